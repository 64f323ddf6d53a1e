-- Deployments: aliases over immutable versions, named shared queues, and coverage.
--
-- Owns: the one namespace of flow slugs and aliases, activating an alias, resolving an alias to its version,
-- checking and provisioning named shared queues, and the questions an operator asks before a rollout or a
-- retirement (queue_coverage_gaps, version_retirable).

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

-- Raises PF018 when a new concrete slug is already an alias of another flow.
create function pgflow._assert_slug_not_alias(p_flow_slug text)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_alias record;
begin
  select a.alias, a.flow_slug into v_alias
  from pgflow.flow_aliases a
  where lower(a.alias) = lower(p_flow_slug) and a.flow_slug <> p_flow_slug
  limit 1;
  if found then
    raise exception 'Flow slug "%" is already the alias "%" of flow "%".', p_flow_slug, v_alias.alias,
        v_alias.flow_slug
      using errcode = 'PF018',
            detail = 'start_flow resolves aliases first, so runs of the new flow could never be started by its slug.',
            hint = 'Choose another concrete slug (aliases name versions; concrete slugs carry the version).';
  end if;
end;
$$;

-- Raises PF018 unless `p_alias` may name `p_flow_slug`: it is a valid slug and no other concrete flow has it
-- (in any letter case) as its slug.
create function pgflow._assert_alias_allowed(p_alias text, p_flow_slug text)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_other text;
begin
  if not pgflow.is_valid_slug(p_alias) then
    raise exception 'Alias "%" of flow "%" is not a valid slug.', coalesce(p_alias, 'NULL'), p_flow_slug
      using errcode = 'invalid_parameter_value',
            hint = 'A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.';
  end if;
  select f.flow_slug into v_other
  from pgflow.flows f
  where lower(f.flow_slug) = lower(p_alias) and f.flow_slug <> p_flow_slug
  limit 1;
  if found then
    raise exception 'Alias "%" cannot point at flow "%": it is the concrete slug of flow "%".', p_alias,
        p_flow_slug, v_other
      using errcode = 'PF018',
            detail = 'start_flow resolves aliases first, so the alias would hide that flow.',
            hint = 'Choose an alias that is no flow''s concrete slug (a name without a version suffix, for example).';
  end if;
end;
$$;

-- Raises PF016 when any of `p_queues` (private queues of flow p_flow_slug: its default queue or generated step
-- queues) is a shared queue.
create function pgflow._assert_not_shared(p_flow_slug text, p_queues text[])
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_queue text;
begin
  select sq.queue_name into v_queue
  from pgflow.shared_queues sq
  where sq.queue_name = any (p_queues)
  limit 1;
  if found then
    raise exception 'Queue "%" of flow "%" is a shared queue.', v_queue, p_flow_slug
      using errcode = 'PF016',
            detail = 'Named routes share it; a flow''s default queue and its generated step queues are private to it.',
            hint = 'Choose another concrete flow slug, or route the flow''s steps to the shared queue by name (queue mode ''named'').';
  end if;
end;
$$;

-- Raises PF014 unless `p_queue` (named for step `p_step` of flow `p_flow`) is a valid queue name: a lowercase
-- identifier ([a-z_][a-z0-9_]*) of at most 47 characters, which pgmq.validate_queue_name and
-- pgmq.format_table_name then also accept.
create function pgflow._check_named_queue(p_flow text, p_step text, p_queue text)
returns void
language plpgsql
stable
set search_path = ''
as $$
begin
  if p_queue is null or p_queue !~ '^[a-z_][a-z0-9_]*$' or length(p_queue) > pgflow._max_queue_name_length() then
    raise exception 'Queue "%" named for step "%" of flow "%" is not a valid queue name.', coalesce(p_queue, 'NULL'),
        p_step, p_flow
      using errcode = 'PF014',
            detail = format('A queue name is a lowercase identifier (letters a-z, digits, underscores; not starting with a digit) of 1 to %s characters; this one has %s.',
                            pgflow._max_queue_name_length(), coalesce(length(p_queue), 0)),
            hint = 'Name the queue in lowercase with letters, digits and underscores only, at most 47 characters.';
  end if;
  perform pgmq.validate_queue_name(p_queue);
end;
$$;

-- Checks, before any mutation, that flow `p_flow_slug` may route steps `p_steps[i]` to the named queues
-- `p_queues[i]`: each queue is not private to any flow (PF016: a flow-mode flow's default queue, or a
-- step-mode flow's generated queue), and is either already shared, or new, or (with p_adopt) an existing PGMQ
-- queue pgflow did not create (else PF017). Returns the queues that will be adopted.
create function pgflow._check_shared_queues(p_flow_slug text, p_steps text[], p_queues text[], p_adopt boolean)
returns text[]
language plpgsql
stable
set search_path = ''
as $$
declare
  v_queue text;
  v_step text;
  v_other record;
  v_meta text;
  v_adopt text[] := '{}';
  i int;
begin
  for i in 1 .. coalesce(cardinality(p_queues), 0) loop
    v_queue := p_queues[i];
    v_step := p_steps[i];
    if v_queue = any (v_adopt) then
      continue;
    end if;

    select f.flow_slug into v_other
    from pgflow.flows f
    where f.queue_mode = 'flow' and lower(f.flow_slug) = v_queue
    limit 1;
    if found then
      raise exception 'Queue "%" named for step "%" of flow "%" is private to another flow.', v_queue, v_step,
          p_flow_slug
        using errcode = 'PF016',
              detail = format('It is the default queue of flow "%s".', v_other.flow_slug),
              hint = 'Name another queue: a flow''s own queues are never shared.';
    end if;
    select s.flow_slug, s.step_slug into v_other
    from pgflow.steps s
    join pgflow.flows f on f.flow_slug = s.flow_slug
    where s.queue_name = v_queue and f.queue_mode = 'step'
    limit 1;
    if found then
      raise exception 'Queue "%" named for step "%" of flow "%" is private to another flow.', v_queue, v_step,
          p_flow_slug
        using errcode = 'PF016',
              detail = format('It is the generated queue of step "%s" in flow "%s".', v_other.step_slug, v_other.flow_slug),
              hint = 'Name another queue: a flow''s own queues are never shared.';
    end if;

    if exists (select 1 from pgflow.shared_queues sq where sq.queue_name = v_queue) then
      continue;
    end if;
    v_meta := pgflow._queue_meta_name(v_queue);
    if v_meta is null then
      continue;
    end if;
    if v_meta <> v_queue then
      raise exception 'Queue "%" named for step "%" of flow "%" collides with the PGMQ queue "%".', v_queue, v_step,
          p_flow_slug, v_meta
        using errcode = 'PF016',
              detail = 'The names differ only in letter case, and PGMQ queue tables are case-insensitive.',
              hint = 'Name the queue exactly as PGMQ spells it, or name another queue.';
    end if;
    if not coalesce(p_adopt, false) then
      raise exception 'Queue "%" named for step "%" of flow "%" exists in PGMQ, but pgflow did not create it.',
          v_queue, v_step, p_flow_slug
        using errcode = 'PF017',
              detail = 'An existing queue may hold messages that are not pgflow tasks; a worker would stop on them.',
              hint = 'If the queue is meant for pgflow (and empty, or holding only pgflow tasks), compile with adopt_queues => true; otherwise name another queue.';
    end if;
    v_adopt := v_adopt || v_queue;
  end loop;
  return v_adopt;
end;
$$;

-- Creates (or registers, when adopted) every shared queue of a named route map. Idempotent; recreates a shared
-- queue that was dropped by hand (its message ids continue after the recorded ones, see _ensure_queue).
create function pgflow._provision_shared_queues(p_queues text[], p_adopted text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_queue text;
begin
  for v_queue in select distinct q from unnest(p_queues) as q order by 1 loop
    perform pgflow._ensure_queue(v_queue);
    insert into pgflow.shared_queues (queue_name, adopted)
    values (v_queue, v_queue = any (coalesce(p_adopted, '{}')))
    on conflict (queue_name) do nothing;
  end loop;
end;
$$;

-- Points `p_alias` at `p_flow_slug` (the caller has persisted the flow's complete shape and routing in this
-- transaction, under its concrete-slug lock). Idempotent: an alias already pointing there is left as it is.
-- Otherwise the previous target is recorded, activated_at is now, and the event `alias:activated` goes out
-- through pgflow._emit. Returns {"alias", "flow_slug", "previous_flow_slug", "activated_at", "activated"}.
create function pgflow._activate_alias(p_alias text, p_flow_slug text)
returns jsonb
language plpgsql
set search_path = ''
as $$
declare
  v_current pgflow.flow_aliases;
begin
  perform pg_advisory_xact_lock(3, hashtext(lower(p_alias)));
  perform pgflow._assert_alias_allowed(p_alias, p_flow_slug);

  select a.* into v_current from pgflow.flow_aliases a where lower(a.alias) = lower(p_alias);
  if found and v_current.alias <> p_alias then
    raise exception 'Alias "%" differs only in case from the existing alias "%".', p_alias, v_current.alias
      using errcode = 'PF018',
            hint = 'Use the existing alias''s exact spelling.';
  end if;
  if found and v_current.flow_slug = p_flow_slug then
    return jsonb_build_object('alias', p_alias, 'flow_slug', p_flow_slug,
      'previous_flow_slug', v_current.previous_flow_slug, 'activated_at', v_current.activated_at,
      'activated', false);
  end if;

  insert into pgflow.flow_aliases as a (alias, flow_slug, activated_at, previous_flow_slug)
  values (p_alias, p_flow_slug, clock_timestamp(), null)
  on conflict (alias) do update
    set flow_slug = excluded.flow_slug, activated_at = excluded.activated_at,
        previous_flow_slug = a.flow_slug
  returning a.* into v_current;

  perform pgflow._emit('alias:activated', null, jsonb_build_object(
    'event_type', 'alias:activated',
    'alias', v_current.alias,
    'flow_slug', v_current.flow_slug,
    'previous_flow_slug', v_current.previous_flow_slug,
    'activated_at', v_current.activated_at
  ));
  return jsonb_build_object('alias', v_current.alias, 'flow_slug', v_current.flow_slug,
    'previous_flow_slug', v_current.previous_flow_slug, 'activated_at', v_current.activated_at,
    'activated', true);
end;
$$;

-- Points `alias` at the compiled concrete flow `flow_slug` (idempotent; records the previous target; emits
-- alias:activated). Returns {"alias", "flow_slug", "previous_flow_slug", "activated_at", "activated"}.
-- Raises PF019 for a flow that is not compiled, PF018 for an alias that is not allowed (see
-- _assert_alias_allowed).
create function pgflow.activate_alias(alias text, flow_slug text)
returns jsonb
language plpgsql
security definer
set search_path = ''
as $$
begin
  -- The concrete-slug lock first (as compilation takes it), then the alias lock inside _activate_alias.
  perform pg_advisory_xact_lock(1, hashtext(lower(activate_alias.flow_slug)));
  perform 1 from pgflow.flows f where f.flow_slug = activate_alias.flow_slug for key share;
  if not found then
    raise exception 'Alias "%" cannot point at flow "%": no flow has that slug.', activate_alias.alias,
        activate_alias.flow_slug
      using errcode = 'PF019',
            hint = 'Compile the flow first (start a worker that serves it, or call pgflow.ensure_flow_compiled), then activate its alias.';
  end if;
  return pgflow._activate_alias(activate_alias.alias, activate_alias.flow_slug);
end;
$$;

-- The concrete flow slug a name resolves to: an alias's target (aliases first), else the name itself.
create function pgflow.resolve_flow_slug(flow_slug text)
returns text
language plpgsql
stable
set search_path = ''
as $$
begin
  return coalesce(
    (select a.flow_slug from pgflow.flow_aliases a where a.alias = resolve_flow_slug.flow_slug),
    resolve_flow_slug.flow_slug);
end;
$$;

-- Every (flow_slug, step_slug) pair that any consumer of `queue_name` must be able to run, with the reason that
-- makes it required (a pair can appear once per reason):
--   'active_alias'   a step routed to the queue of a concrete version an alias points at: new runs start it
--   'started_run'    a step routed to the queue, not finished yet in a started run: that run may still create
--                    its task there
--   'task_snapshot'  a queued (executable) or started (recoverable) task snapshotted in the queue
-- With `count` (aliases, runs or tasks) and up to three `examples` (alias names, run ids, or
-- {"run_id", "msg_id"} objects). Reads only aliases, definitions and started runs or steps: the cost follows the
-- work in flight, not the history.
create function pgflow._queue_requirements(p_queue text)
returns table(flow_slug text, step_slug text, reason text, count bigint, examples jsonb)
language sql
stable
set search_path = ''
as $$
  select s.flow_slug, s.step_slug, 'active_alias', count(*),
         coalesce(jsonb_path_query_array(jsonb_agg(to_jsonb(a.alias) order by a.alias), '$[0 to 2]'), '[]')
  from pgflow.flow_aliases a
  join pgflow.steps s on s.flow_slug = a.flow_slug
  where s.queue_name = lower(p_queue)
  group by s.flow_slug, s.step_slug
  union all
  select x.flow_slug, x.step_slug, 'started_run', count(*),
         coalesce(jsonb_path_query_array(jsonb_agg(to_jsonb(x.run_id) order by x.started_at), '$[0 to 2]'), '[]')
  from (
    select ss.flow_slug, ss.step_slug, r.run_id, r.started_at
    from pgflow.runs r
    join pgflow.step_states ss on ss.run_id = r.run_id
    join pgflow.steps s on s.flow_slug = ss.flow_slug and s.step_slug = ss.step_slug
    where r.status = 'started' and ss.status in ('created', 'started') and s.queue_name = lower(p_queue)
  ) x
  group by x.flow_slug, x.step_slug
  union all
  select t.flow_slug, t.step_slug, 'task_snapshot', count(*),
         coalesce(jsonb_path_query_array(
           jsonb_agg(jsonb_build_object('run_id', t.run_id, 'msg_id', t.message_id) order by t.message_id),
           '$[0 to 2]'), '[]')
  from pgflow.step_states ss
  join pgflow.step_tasks t on t.run_id = ss.run_id and t.step_slug = ss.step_slug
  where ss.status = 'started' and t.queue_name = lower(p_queue) and t.status in ('queued', 'started')
  group by t.flow_slug, t.step_slug;
$$;

-- The startup coverage check: given the queue a worker polls and the (flow_slugs[i], step_slugs[i]) pairs it can
-- run, every required pair (see _queue_requirements) it lacks, with the reason, a count, up to three examples
-- and how to repair the gap. No row: the worker covers everything the queue can carry. Workers call it after
-- compiling and before registering, and refuse to start on any row.
create function pgflow.queue_coverage_gaps(queue_name text, flow_slugs text[], step_slugs text[])
returns table(flow_slug text, step_slug text, reason text, count bigint, examples jsonb, repair text)
language sql
stable security definer
set search_path = ''
as $$
  select q.flow_slug, q.step_slug, q.reason, q.count, q.examples,
         case q.reason
           when 'active_alias' then format(
             'Flow "%s" is the active version of alias %s and routes step "%s" to queue "%s": include that version in this worker''s registry.',
             q.flow_slug, q.examples ->> 0, q.step_slug, lower(queue_coverage_gaps.queue_name))
           when 'started_run' then format(
             '%s started run(s) of flow "%s" may still create step "%s" tasks on queue "%s": keep that version''s handlers in this worker until pgflow.version_retirable(''%s'', ''%s'') says it has drained.',
             q.count, q.flow_slug, q.step_slug, lower(queue_coverage_gaps.queue_name), q.flow_slug,
             lower(queue_coverage_gaps.queue_name))
           else format(
             '%s task(s) of flow "%s" step "%s" wait or run on queue "%s": keep that version''s handlers in this worker until they finish.',
             q.count, q.flow_slug, q.step_slug, lower(queue_coverage_gaps.queue_name))
         end
  from pgflow._queue_requirements(queue_coverage_gaps.queue_name) q
  where not exists (
    select 1 from unnest(queue_coverage_gaps.flow_slugs, queue_coverage_gaps.step_slugs) as p(flow_slug, step_slug)
    where p.flow_slug = q.flow_slug and p.step_slug = q.step_slug)
  order by q.flow_slug, q.step_slug, q.reason;
$$;

create function pgflow.version_retirable(flow_slug text, queue_name text)
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
