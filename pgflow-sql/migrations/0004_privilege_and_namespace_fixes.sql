-- pgflow-rs SQL core: privilege and namespace fixes found by an outside review.
--
-- * Data loss needs an admin role: a destructive recompilation (allow_data_loss, or a local database) is
--   refused with 42501 unless the calling role is the owner of schema pgflow, has its privileges, or is a
--   superuser. A worker role can no longer delete runs by passing allow_data_loss or setting pgflow.local.
-- * For any role but an admin, set_vt_batch changes only queues pgflow routes tasks to, never another
--   application's PGMQ queue.
-- * delete_flow_and_data (and so a destructive recompilation) deletes the messages of the flow's tasks on
--   queues that stay, so no message is left without a task.
-- * Verification recreates a dropped flow-mode queue, and a queue created again by hand continues its
--   message ids after the recorded ones.
-- * version_retirable refuses an unknown slug (or one differing only in case) and names the known ones.
-- * Concrete slugs and aliases are one namespace, checked under one name lock (advisory key space 3).
-- * ensure_flow_compiled refuses a NULL or non-object shape; read_and_claim_tasks refuses a NULL quantity.

-- The role behind this call: the session's current role (SET ROLE included), never the owner that a
-- SECURITY DEFINER function runs as.
create function pgflow._caller_role()
returns text
language sql
stable
set search_path = ''
as $$
  select coalesce(nullif(current_setting('role'), 'none'), session_user::text)
$$;

-- Whether the role behind this call is an admin, who may destroy data (delete a flow's runs) or touch queues
-- that are not pgflow's: the owner of schema pgflow, a role with its privileges, or a superuser.
create function pgflow._caller_is_admin()
returns boolean
language sql
stable
set search_path = ''
as $$
  select coalesce(bool_or(pg_has_role(pgflow._caller_role()::name, n.nspowner, 'USAGE')), false)
  from pg_catalog.pg_namespace n
  where n.nspname = 'pgflow'
$$;

-- Takes the name lock (advisory key space 3, the one activate_alias takes for an alias) of each of `p_names`
-- in any letter case, in key order. Concrete slugs and aliases share these locks: they are one namespace.
create function pgflow._lock_names(p_names text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_key int;
begin
  for v_key in select distinct hashtext(lower(n)) from unnest(p_names) as n where n is not null order by 1 loop
    perform pg_advisory_xact_lock(3, v_key);
  end loop;
end;
$$;

create or replace function pgflow.ensure_flow_compiled(
  flow_slug text,
  shape jsonb,
  allow_data_loss boolean default false,
  queue_mode text default 'flow',
  routes jsonb default null,
  alias text default null,
  adopt_queues boolean default false
)
returns jsonb
language plpgsql
volatile
security definer
set search_path = ''
as $$
declare
  v_slug text := ensure_flow_compiled.flow_slug;
  v_mode text := coalesce(ensure_flow_compiled.queue_mode, 'flow');
  v_steps text[];
  v_queues text[];
  v_req_steps text[];
  v_req_queues text[];
  v_adopt text[] := '{}';
  v_differences text[];
  v_routing text[];
  v_status text;
  v_queue text;
  v_bad text;
  i int;
begin
  perform pg_advisory_xact_lock(1, hashtext(lower(v_slug)));

  if shape is null or jsonb_typeof(shape) <> 'object' or jsonb_typeof(shape -> 'steps') is distinct from 'array' then
    raise exception 'Flow "%" cannot compile: its shape must be a JSON object with a "steps" array, got %.', v_slug,
        case when shape is null then 'NULL'
             when jsonb_typeof(shape) <> 'object' then 'a JSON ' || jsonb_typeof(shape)
             else 'an object whose "steps" is ' || coalesce('a JSON ' || jsonb_typeof(shape -> 'steps'), 'missing')
        end
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the shape the worker builds for the flow: {"steps": [...], "options": {...}}, every step in order.';
  end if;
  if v_mode not in ('flow', 'step', 'named') then
    raise exception 'ensure_flow_compiled(): queue_mode must be ''flow'', ''step'' or ''named'', got %',
        quote_literal(v_mode)
      using errcode = 'invalid_parameter_value';
  end if;
  if routes is not null and jsonb_typeof(routes) <> 'array' then
    raise exception 'ensure_flow_compiled(): routes must be a JSON array of {"step_slug", "queue_name"} objects'
      using errcode = 'invalid_parameter_value';
  end if;

  select coalesce(array_agg(e ->> 'slug' order by o), '{}') into v_steps
  from jsonb_array_elements(coalesce(shape -> 'steps', '[]')) with ordinality as x(e, o);
  if routes is not null then
    select coalesce(array_agg(e ->> 'step_slug' order by o), '{}'),
           coalesce(array_agg(e ->> 'queue_name' order by o), '{}')
    into v_req_steps, v_req_queues
    from jsonb_array_elements(routes) with ordinality as x(e, o);
  end if;

  if v_mode = 'step' then
    select array_agg(r.queue_name order by r.step_index) into v_queues
    from pgflow.resolve_step_queues(v_slug, v_steps) r;
  elsif v_mode = 'named' then
    if routes is null then
      raise exception 'Flow "%" uses named queues but no route map was given.', v_slug
        using errcode = 'PF015',
              hint = 'Pass routes => [{"step_slug": "...", "queue_name": "..."}, ...] with every step exactly once.';
    end if;
    select r into v_bad from unnest(v_req_steps) as r group by r having count(*) > 1 limit 1;
    if found then
      raise exception 'The route map of flow "%" routes step "%" more than once.', v_slug, v_bad
        using errcode = 'PF015',
              hint = 'Route every step exactly once.';
    end if;
    select r into v_bad from unnest(v_req_steps) as r where r is null or r <> all (v_steps) limit 1;
    if found then
      raise exception 'The route map of flow "%" routes "%", which is not a step of the flow.', v_slug,
          coalesce(v_bad, 'NULL')
        using errcode = 'PF015',
              detail = format('The steps are: %s.', array_to_string(v_steps, ', ')),
              hint = 'Route every step exactly once, by its slug.';
    end if;
    select s into v_bad from unnest(v_steps) as s where s <> all (v_req_steps) limit 1;
    if found then
      raise exception 'The route map of flow "%" leaves step "%" without a queue.', v_slug, v_bad
        using errcode = 'PF015',
              hint = 'Route every step exactly once.';
    end if;
    -- In step order.
    select coalesce(array_agg(lower(r.queue_name) order by s.ord), '{}') into v_queues
    from unnest(v_steps) with ordinality as s(step_slug, ord)
    join unnest(v_req_steps, v_req_queues) as r(step_slug, queue_name) on r.step_slug = s.step_slug;
    for i in 1 .. cardinality(v_steps) loop
      perform pgflow._check_named_queue(v_slug, v_steps[i],
        (select r.queue_name from unnest(v_req_steps, v_req_queues) as r(step_slug, queue_name)
         where r.step_slug = v_steps[i]));
    end loop;
  else
    select coalesce(array_agg(lower(v_slug)), '{}') into v_queues from unnest(v_steps);
  end if;

  -- Every queue name this compilation may create, adopt or route to is claimed under its own lock, so two
  -- compilations of different flows that resolve to one name cannot both pass the ownership checks below.
  perform pgflow._lock_queue_names(v_queues || lower(v_slug));
  -- Concrete slugs and aliases are one namespace: the slug and the alias are claimed under their name locks
  -- (the lock activate_alias takes for an alias), so a new flow and an alias of the same name never both pass
  -- the checks below.
  perform pgflow._lock_names(array[v_slug, alias]);

  if routes is not null and v_mode <> 'named' then
    for i in 1 .. greatest(cardinality(v_req_steps), cardinality(v_steps)) loop
      if v_req_steps[i] is distinct from v_steps[i] or v_req_queues[i] is distinct from v_queues[i] then
        raise exception 'Flow "%": the requested route map differs from the one the database resolves.', v_slug
          using errcode = 'PF002',
                detail = format('Route at index %s: requested %s -> %s, resolved %s -> %s.', i - 1,
                                coalesce(quote_ident(v_req_steps[i]), 'none'), coalesce(quote_literal(v_req_queues[i]), 'none'),
                                coalesce(quote_ident(v_steps[i]), 'none'), coalesce(quote_literal(v_queues[i]), 'none')),
                hint = 'The worker''s queue-name resolver disagrees with SQL, which is authoritative: upgrade the worker and the migrations together.';
      end if;
    end loop;
  end if;

  if alias is not null then
    perform pgflow._assert_alias_allowed(alias, v_slug);
  end if;

  if not exists (select 1 from pgflow.flows f where f.flow_slug = v_slug) then
    if exists (select 1 from pgflow.flows f where lower(f.flow_slug) = lower(v_slug)) then
      raise exception 'flow slug "%" differs only in case from existing flow "%"', v_slug,
          (select f.flow_slug from pgflow.flows f where lower(f.flow_slug) = lower(v_slug) limit 1)
        using errcode = 'unique_violation',
              detail = 'PGMQ queue names are case-insensitive, so both flows would share their queues.',
              hint = 'Choose a flow slug that differs by more than letter case.';
    end if;
    perform pgflow._assert_slug_not_alias(v_slug);
    if v_mode = 'step' then
      perform pgflow._assert_not_shared(v_slug, v_queues);
      perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, false);
    elsif v_mode = 'named' then
      v_adopt := pgflow._check_shared_queues(v_slug, v_steps, v_queues, adopt_queues);
    else
      perform pgflow._assert_not_shared(v_slug, array[lower(v_slug)]);
      perform pgflow._assert_flow_queue_private(v_slug);
      -- The flow's queue is a private pgflow resource: never adopt a queue that exists without the flow.
      if pgflow._queue_meta_name(v_slug) is not null
         and not exists (select 1 from pgflow.flows f where lower(f.flow_slug) = lower(v_slug)) then
        raise exception 'ensure_flow_compiled(): PGMQ queue "%" already exists but flow "%" does not',
            pgflow._queue_meta_name(v_slug), v_slug
          using errcode = 'duplicate_object',
                detail = 'pgflow creates and owns the queue of each flow; an existing queue may hold foreign messages.',
                hint = 'Drop the queue if it is a leftover (select pgmq.drop_queue(...)), or choose another flow slug.';
      end if;
    end if;
    perform pgflow._create_flow_with_routes(v_slug, shape, v_mode, v_steps, v_queues);
    if v_mode = 'named' then
      perform pgflow._provision_shared_queues(v_queues, v_adopt);
    end if;
    v_status := 'compiled';
    v_differences := '{}';
  else
    v_differences := pgflow._compare_flow_shapes(shape, pgflow._get_flow_shape(v_slug));
    v_routing := pgflow._compare_flow_routes(v_slug, v_mode, v_steps, v_queues);

    if cardinality(v_differences) = 0 and cardinality(v_routing) = 0 then
      if v_mode = 'step' then
        perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, true);
        foreach v_queue in array v_queues loop
          perform pgflow._ensure_queue(v_queue);
        end loop;
      elsif v_mode = 'named' then
        v_adopt := pgflow._check_shared_queues(v_slug, v_steps, v_queues, adopt_queues);
        perform pgflow._provision_shared_queues(v_queues, v_adopt);
      else
        -- The flow's own queue, recreated when it was dropped (its message ids continue, see _ensure_queue).
        perform pgflow._ensure_queue(lower(v_slug));
      end if;
      v_status := 'verified';
    elsif coalesce(allow_data_loss, false) or pgflow.is_local() then
      -- Every check before the first mutation. Deleting a flow's runs needs an admin role, whatever the
      -- session says about being local.
      if not pgflow._caller_is_admin() then
        raise exception 'Flow "%" differs from its stored definition; recompiling it would delete every run of it, and role "%" may not do that.',
            v_slug, pgflow._caller_role()
          using errcode = 'insufficient_privilege',
                detail = array_to_string(v_differences || v_routing, '; ') || '.',
                hint = 'Deploy the new definition under a new concrete flow slug (a new version), or recompile as the owner of schema pgflow (or a role with its privileges).';
      end if;
      if v_mode = 'step' then
        perform pgflow._assert_not_shared(v_slug, v_queues);
        perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, false);
      elsif v_mode = 'named' then
        v_adopt := pgflow._check_shared_queues(v_slug, v_steps, v_queues, adopt_queues);
      else
        perform pgflow._assert_not_shared(v_slug, array[lower(v_slug)]);
        perform pgflow._assert_flow_queue_private(v_slug);
      end if;
      perform pgflow.delete_flow_and_data(v_slug);
      perform pgflow._create_flow_with_routes(v_slug, shape, v_mode, v_steps, v_queues);
      if v_mode = 'named' then
        perform pgflow._provision_shared_queues(v_queues, v_adopt);
      end if;
      v_status := 'recompiled';
      v_differences := v_differences || case when cardinality(v_differences) = 0 then v_routing
                                             else array(select d from unnest(v_routing) d
                                                        where d like 'Queue mode differs%') end;
    elsif cardinality(v_differences) > 0 then
      return jsonb_build_object('status', 'mismatch',
        'differences', to_jsonb(v_differences || array(select d from unnest(v_routing) d
                                                       where d like 'Queue mode differs%')));
    else
      raise exception 'Flow "%" is deployed with a different queue routing.', v_slug
        using errcode = 'PF001',
              detail = array_to_string(v_routing, '; ') || '.',
              hint = 'A concrete flow''s queue mode and route map cannot change in production: deploy the change under a new concrete flow slug (a new version, such as "...V2"). A local database (pgflow.local) recompiles destructively.';
    end if;
  end if;

  if alias is null then
    return jsonb_build_object('status', v_status, 'differences', to_jsonb(v_differences));
  end if;
  return jsonb_build_object('status', v_status, 'differences', to_jsonb(v_differences),
                            'alias', pgflow._activate_alias(alias, v_slug));
end;
$$;


create or replace function pgflow.delete_flow_and_data(p_flow_slug text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text;
  v_meta_name text;
  v_ids bigint[];
begin
  -- The messages of the flow's tasks go with the tasks, on every queue (a queue that stays, shared or
  -- another flow's, would otherwise keep messages that no task records).
  for v_queue, v_ids in
    select t.queue_name, array_agg(t.message_id order by t.message_id)
    from pgflow.step_tasks t join pgflow.runs r on r.run_id = t.run_id
    where r.flow_slug = p_flow_slug and t.message_id is not null
    group by t.queue_name
    order by t.queue_name
  loop
    v_meta_name := pgflow._queue_meta_name(v_queue);
    if v_meta_name is not null then
      perform pgmq.delete(v_meta_name, v_ids);
    end if;
  end loop;

  for v_queue in
    select distinct q from (
      select s.queue_name as q from pgflow.steps s where s.flow_slug = p_flow_slug
      union all
      select t.queue_name from pgflow.step_tasks t join pgflow.runs r on r.run_id = t.run_id
      where r.flow_slug = p_flow_slug
      union all
      select lower(f.flow_slug) from pgflow.flows f where f.flow_slug = p_flow_slug and f.queue_mode = 'flow'
    ) x
    where not exists (select 1 from pgflow.steps o where o.queue_name = x.q and o.flow_slug <> p_flow_slug)
      and not exists (select 1 from pgflow.shared_queues sq where sq.queue_name = x.q)
  loop
    v_meta_name := pgflow._queue_meta_name(v_queue);
    if v_meta_name is null then
      raise notice 'pgmq queue `%` does not exist', v_queue;
    else
      perform pgmq.drop_queue(v_meta_name);
      perform pgflow._drop_queue_ops(v_queue);
    end if;
  end loop;

  delete from pgflow.step_tasks t using pgflow.runs r
    where r.flow_slug = p_flow_slug and t.run_id = r.run_id;
  delete from pgflow.step_states ss using pgflow.runs r
    where r.flow_slug = p_flow_slug and ss.run_id = r.run_id;
  delete from pgflow.runs r where r.flow_slug = p_flow_slug;
  delete from pgflow.flow_aliases a where a.flow_slug = p_flow_slug;
  delete from pgflow.deps d where d.flow_slug = p_flow_slug;
  delete from pgflow.steps s where s.flow_slug = p_flow_slug;
  delete from pgflow.flows f where f.flow_slug = p_flow_slug;
end;
$$;


create or replace function pgflow._ensure_queue(p_queue text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_max bigint;
  v_seq text;
begin
  insert into pgflow.queue_signals (queue_name) values (lower(p_queue)) on conflict do nothing;
  if pgflow._queue_meta_name(p_queue) is null then
    perform pgmq.create(p_queue);
    perform pgflow._create_queue_ops(p_queue);
  end if;
  -- Also when the queue exists: one dropped and created again by hand restarts its ids at 1.
  select max(t.message_id) into v_max from pgflow.step_tasks t where t.queue_name = lower(p_queue);
  if v_max is null then
    return;
  end if;
  v_seq := pg_get_serial_sequence(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q')), 'msg_id');
  if v_seq is not null and coalesce(pg_sequence_last_value(v_seq::regclass), 0) < v_max then
    perform setval(v_seq, v_max);
  end if;
end;
$$;


create or replace function pgflow.version_retirable(flow_slug text, queue_name text)
returns jsonb
language plpgsql
stable
security definer
set search_path = ''
as $$
declare
  v_known text;
  v_hint text;
  v_result jsonb;
begin
  if not exists (select 1 from pgflow.flows f where f.flow_slug = version_retirable.flow_slug) then
    select string_agg(format('"%s"', k.flow_slug), ', ' order by k.flow_slug) into v_known
    from (select f.flow_slug from pgflow.flows f order by f.flow_slug limit 50) k;
    select coalesce(
      (select format('Slugs are case-sensitive: did you mean "%s"?', f.flow_slug) from pgflow.flows f
       where lower(f.flow_slug) = lower(version_retirable.flow_slug) limit 1),
      (select format('"%s" is an alias of version "%s": pass the version''s concrete slug.', a.alias, a.flow_slug)
       from pgflow.flow_aliases a where lower(a.alias) = lower(version_retirable.flow_slug) limit 1),
      'Pass the concrete slug of a compiled version.') into v_hint;
    raise exception 'version_retirable(): no flow has the slug "%".', version_retirable.flow_slug
      using errcode = 'PF019',
            detail = coalesce('Known flow slugs: ' || v_known || '.', 'No flow is compiled.'),
            hint = v_hint;
  end if;
  select jsonb_build_object(
    'flow_slug', version_retirable.flow_slug,
    'queue_name', lower(version_retirable.queue_name),
    'retirable', count(q.*) = 0,
    'blockers', coalesce(jsonb_agg(jsonb_build_object('step_slug', q.step_slug, 'reason', q.reason,
                                                      'count', q.count, 'examples', q.examples)
                                   order by q.step_slug, q.reason) filter (where q.flow_slug is not null),
                         '[]'::jsonb))
  into v_result
  from pgflow._queue_requirements(version_retirable.queue_name) q
  where q.flow_slug = version_retirable.flow_slug;
  return v_result;
end;
$$;


create or replace function pgflow.read_and_claim_tasks(
  queue_name text,
  qty int,
  vt int,
  worker_id uuid,
  flow_slugs text[],
  step_slugs text[]
)
returns table (
  outcome text,
  msg_id bigint,
  flow_slug text,
  run_id uuid,
  step_slug text,
  task_index int,
  input jsonb,
  flow_input jsonb,
  attempts_count int,
  timeout int,
  report jsonb
)
language plpgsql
volatile
security definer
set search_path = ''
set plan_cache_mode = force_generic_plan
set enable_seqscan = off
as $$
declare
  v_ids bigint[];
begin
  if read_and_claim_tasks.qty is null or read_and_claim_tasks.qty < 0 then
    raise exception 'read_and_claim_tasks(): qty must be how many messages of queue "%" to read at most, got %.',
        read_and_claim_tasks.queue_name, coalesce(read_and_claim_tasks.qty::text, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'Pass 0 or more (a worker passes its free handler slots); NULL is not "the whole queue".';
  end if;
  -- Lock order step 3: the messages.
  v_ids := pgflow._queue_op(read_and_claim_tasks.queue_name, 'lock_visible', null, null,
                            read_and_claim_tasks.qty);
  if v_ids is null then
    return;
  end if;
  return query
  select * from pgflow._claim_tasks(read_and_claim_tasks.queue_name, v_ids, read_and_claim_tasks.worker_id,
                                    read_and_claim_tasks.flow_slugs, read_and_claim_tasks.step_slugs,
                                    coalesce(read_and_claim_tasks.vt, 0));
end;
$$;


create or replace function pgflow.set_vt_batch(queue_name text, msg_ids bigint[], vt_offsets integer[])
returns table (msg_id bigint, read_ct integer, enqueued_at timestamptz, vt timestamptz, message jsonb, headers jsonb)
language plpgsql
volatile
security definer
set search_path = ''
as $$
begin
  -- A worker role changes only queues pgflow routes tasks to; an admin, any queue (as upstream).
  if not exists (select 1 from pgflow.steps s where s.queue_name = lower(set_vt_batch.queue_name))
     and not exists (select 1 from pgflow.shared_queues sq where sq.queue_name = lower(set_vt_batch.queue_name))
     and not pgflow._caller_is_admin() then
    raise exception 'set_vt_batch(): queue "%" is not a queue pgflow routes tasks to.', set_vt_batch.queue_name
      using errcode = 'invalid_parameter_value',
            hint = 'Pass the queue of a compiled flow''s step; other PGMQ queues are not pgflow''s to change.';
  end if;
  if msg_ids is null or vt_offsets is null or coalesce(array_length(msg_ids, 1), 0) = 0 then
    return;
  end if;
  if coalesce(array_length(msg_ids, 1), 0) <> coalesce(array_length(vt_offsets, 1), 0) then
    raise exception 'msg_ids length (%) must equal vt_offsets length (%)',
      coalesce(array_length(msg_ids, 1), 0), coalesce(array_length(vt_offsets, 1), 0);
  end if;

  return query execute format(
    'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.off)
       from unnest($1::bigint[], $2::int[]) as v(id, off)
      where q.msg_id = v.id
      returning q.msg_id, q.read_ct, q.enqueued_at, q.vt, q.message, q.headers',
    pgmq.format_table_name(set_vt_batch.queue_name, 'q'))
  using msg_ids, vt_offsets;
end;
$$;

revoke execute on all functions in schema pgflow from public;
