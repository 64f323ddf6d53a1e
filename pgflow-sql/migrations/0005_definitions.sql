-- pgflow-rs SQL core, migration 0005: flow definitions, flow shapes, and the queue helpers definitions use.
--
-- Upstream interface: create_flow, add_step, _create_flow_from_shape, _get_flow_shape, _compare_flow_shapes.
-- ensure_flow_compiled and delete_flow_and_data are defined once, with queue modes, in 0010.

-- The exact spelling PGMQ registered for a queue (pgmq.meta is case-sensitive, PGMQ table names are not).
-- NULL when no such queue exists.
create function pgflow._queue_meta_name(queue_name text)
returns text
language sql
stable
set search_path = ''
as $$
  select m.queue_name::text from pgmq.meta m where lower(m.queue_name) = lower(_queue_meta_name.queue_name)
  order by (m.queue_name = _queue_meta_name.queue_name) desc
  limit 1;
$$;

-- Serialises every claim on the given queue names: transaction-scoped advisory locks (key space 2), taken in
-- sorted order. Two compilations that would create, adopt or route to the same queue name therefore run one
-- after the other, whatever their flow slugs, and the second one sees what the first one persisted.
create function pgflow._lock_queue_names(p_names text[])
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_name text;
begin
  for v_name in select distinct lower(n) from unnest(p_names) as n where n is not null order by 1 loop
    perform pg_advisory_xact_lock(2, hashtext(v_name));
  end loop;
end;
$$;

-- Creates the PGMQ queue `p_queue` unless it exists. A new queue's message ids continue after every id pgflow
-- has recorded for that queue name: a queue that was dropped and created again would otherwise restart at 1
-- and collide with historical tasks on unique (queue_name, message_id), failing every start_flow.
create function pgflow._ensure_queue(p_queue text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_max bigint;
  v_seq text;
begin
  if pgflow._queue_meta_name(p_queue) is not null then
    return;
  end if;
  perform pgmq.create(p_queue);
  select max(t.message_id) into v_max from pgflow.step_tasks t where t.queue_name = lower(p_queue);
  if v_max is null then
    return;
  end if;
  v_seq := pg_get_serial_sequence(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q')), 'msg_id');
  if v_seq is not null then
    perform setval(v_seq, greatest(v_max, coalesce(pg_sequence_last_value(v_seq::regclass), 0)));
  end if;
end;
$$;

-- Locks the live messages `p_ids` of queue `p_queue` (FOR UPDATE, in msg_id order) and returns the ids it
-- locked. With p_skip_locked, messages another transaction holds are skipped instead of waited for. Ids that
-- are no longer live (archived or deleted), or of a queue that does not exist, are not returned. This is step 3 of the lock order (0011_claims.sql):
-- a task's message is locked before the task row.
create function pgflow._lock_messages(p_queue text, p_ids bigint[], p_skip_locked boolean default false)
returns bigint[]
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_locked bigint[];
begin
  if p_ids is null or cardinality(p_ids) = 0
     or to_regclass(format('pgmq.%I', pgmq.format_table_name(p_queue, 'q'))) is null then
    return '{}';
  end if;
  execute format(
    'select coalesce(array_agg(x.msg_id order by x.msg_id), ''{}'') from (
       select q.msg_id from pgmq.%I q where q.msg_id = any ($1) order by q.msg_id for update%s) x',
    pgmq.format_table_name(p_queue, 'q'), case when p_skip_locked then ' skip locked' else '' end)
  into v_locked
  using p_ids;
  return v_locked;
end;
$$;

-- Creates the flow (idempotent: an existing flow is returned unchanged) and its PGMQ queue.
-- NULL options mean the defaults: max_attempts 3, base_delay 5, timeout 60.
create function pgflow.create_flow(
  flow_slug text,
  max_attempts int default null,
  base_delay int default null,
  timeout int default null
)
returns pgflow.flows
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_flow pgflow.flows;
  v_other text;
begin
  select f.* into v_flow from pgflow.flows f where f.flow_slug = create_flow.flow_slug;
  if found then
    return v_flow;
  end if;

  -- Invalid slugs fail on the flows check constraint `slug_is_valid`, as upstream.
  if pgflow.is_valid_slug(create_flow.flow_slug) then
    select f.flow_slug into v_other from pgflow.flows f where lower(f.flow_slug) = lower(create_flow.flow_slug);
    if found then
      raise exception 'flow slug "%" differs only in case from existing flow "%"', create_flow.flow_slug, v_other
        using errcode = 'unique_violation',
              detail = format('Both flows would use the PGMQ queue "%s" (queue names are case-insensitive).',
                              lower(create_flow.flow_slug)),
              hint = 'Choose a flow slug that differs by more than letter case.';
    end if;

    if length(create_flow.flow_slug) > 47 then
      raise exception 'flow "%" cannot be created: queue name is too long, maximum length is 47 characters (the slug has %)',
          create_flow.flow_slug, length(create_flow.flow_slug)
        using errcode = 'invalid_parameter_value',
              detail = 'A flow''s tasks go to a PGMQ queue named after the flow slug, and PGMQ limits queue names to 47 characters.',
              hint = 'Shorten the flow slug to 47 characters or fewer.';
    end if;
  end if;

  insert into pgflow.flows (flow_slug, opt_max_attempts, opt_base_delay, opt_timeout)
  values (create_flow.flow_slug, coalesce(max_attempts, 3), coalesce(base_delay, 5), coalesce(timeout, 60))
  on conflict on constraint flows_pkey do nothing
  returning * into v_flow;

  if v_flow.flow_slug is null then
    -- A concurrent creator won.
    select f.* into v_flow from pgflow.flows f where f.flow_slug = create_flow.flow_slug;
    return v_flow;
  end if;

  perform pgflow._lock_queue_names(array[create_flow.flow_slug]);
  perform pgflow._ensure_queue(create_flow.flow_slug);

  return v_flow;
end;
$$;

-- Adds a step (idempotent by (flow_slug, step_slug): an existing step is returned unchanged).
create function pgflow.add_step(
  flow_slug text,
  step_slug text,
  deps_slugs text[] default '{}',
  max_attempts int default null,
  base_delay int default null,
  timeout int default null,
  start_delay int default null,
  step_type text default 'single',
  required_input_pattern jsonb default null,
  forbidden_input_pattern jsonb default null,
  when_unmet text default 'skip',
  when_exhausted text default 'fail'
)
returns pgflow.steps
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_step pgflow.steps;
  v_deps_count int := coalesce(cardinality(deps_slugs), 0);
  v_dup text;
  v_stored text[];
begin
  -- A dependency listed twice would be counted twice (deps_count) but stored once, so the step would wait
  -- for a completion that never comes.
  select d into v_dup from unnest(deps_slugs) as d group by d having count(*) > 1 order by d limit 1;
  if found then
    raise exception 'Step "%" of flow "%" lists dependency "%" more than once', add_step.step_slug,
        add_step.flow_slug, v_dup
      using errcode = 'invalid_parameter_value',
            detail = format('dependencies: %s', array_to_string(deps_slugs, ', ')),
            hint = 'List each dependency once.';
  end if;

  if coalesce(add_step.step_type, 'single') = 'map' and v_deps_count > 1 then
    raise exception 'Map step "%" can have at most one dependency, but % were provided: %',
      add_step.step_slug, v_deps_count, array_to_string(deps_slugs, ', ');
  end if;

  insert into pgflow.steps (
    flow_slug, step_slug, step_type, step_index, deps_count,
    opt_max_attempts, opt_base_delay, opt_timeout, opt_start_delay,
    required_input_pattern, forbidden_input_pattern, when_unmet, when_exhausted, queue_name
  )
  select
    add_step.flow_slug, add_step.step_slug, coalesce(add_step.step_type, 'single'),
    coalesce((select max(s.step_index) + 1 from pgflow.steps s where s.flow_slug = add_step.flow_slug), 0),
    v_deps_count,
    max_attempts, base_delay, timeout, start_delay,
    add_step.required_input_pattern, add_step.forbidden_input_pattern,
    add_step.when_unmet, add_step.when_exhausted,
    lower(add_step.flow_slug)
  on conflict on constraint steps_pkey do nothing
  returning * into v_step;

  if v_step.step_slug is null then
    select s.* into v_step from pgflow.steps s
    where s.flow_slug = add_step.flow_slug and s.step_slug = add_step.step_slug;
    -- An existing step is returned unchanged; adding it again with other dependencies would store edges its
    -- deps_count does not count (a run could then wait forever, or fail a completion), so it is refused.
    select coalesce(array_agg(d.dep_slug order by d.dep_slug collate "C"), '{}') into v_stored
    from pgflow.deps d where d.flow_slug = add_step.flow_slug and d.step_slug = add_step.step_slug;
    if v_stored is distinct from coalesce(
         (select array_agg(x order by x collate "C") from unnest(deps_slugs) as x), '{}') then
      raise exception 'Step "%" of flow "%" already exists with other dependencies', add_step.step_slug,
          add_step.flow_slug
        using errcode = 'invalid_parameter_value',
              detail = format('stored: [%s]; given: [%s]', array_to_string(v_stored, ', '),
                              array_to_string(deps_slugs, ', ')),
              hint = 'A step''s dependencies cannot change: deploy the changed flow under a new flow slug.';
    end if;
    return v_step;
  end if;

  insert into pgflow.deps (flow_slug, dep_slug, step_slug)
  select add_step.flow_slug, d.dep_slug, add_step.step_slug
  from unnest(coalesce(deps_slugs, '{}')) as d(dep_slug);

  return v_step;
end;
$$;

-- Adds the steps of a shape JSON to an existing flow (steps in array order, so array index = step_index).
create function pgflow._add_steps_from_shape(p_flow_slug text, p_shape jsonb)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_step jsonb;
begin
  for v_step in select e from jsonb_array_elements(coalesce(p_shape -> 'steps', '[]')) as e loop
    perform pgflow.add_step(
      flow_slug => p_flow_slug,
      step_slug => v_step ->> 'slug',
      deps_slugs => coalesce(
        (select array_agg(d order by o) from jsonb_array_elements_text(v_step -> 'dependencies')
           with ordinality as x(d, o)),
        '{}'),
      max_attempts => (v_step #>> '{options,maxAttempts}')::int,
      base_delay => (v_step #>> '{options,baseDelay}')::int,
      timeout => (v_step #>> '{options,timeout}')::int,
      start_delay => (v_step #>> '{options,startDelay}')::int,
      step_type => coalesce(v_step ->> 'stepType', 'single'),
      required_input_pattern => case when (v_step #>> '{requiredInputPattern,defined}')::boolean
                                     then v_step #> '{requiredInputPattern,value}' end,
      forbidden_input_pattern => case when (v_step #>> '{forbiddenInputPattern,defined}')::boolean
                                      then v_step #> '{forbiddenInputPattern,value}' end,
      when_unmet => coalesce(v_step ->> 'whenUnmet', 'skip'),
      when_exhausted => coalesce(v_step ->> 'whenExhausted', 'fail')
    );
  end loop;
end;
$$;

-- Creates a flow and its steps from the shape JSON that workers send (steps in array order).
create function pgflow._create_flow_from_shape(p_flow_slug text, p_shape jsonb)
returns void
language plpgsql
volatile
set search_path = ''
as $$
begin
  perform pgflow.create_flow(
    flow_slug => p_flow_slug,
    max_attempts => (p_shape #>> '{options,maxAttempts}')::int,
    base_delay => (p_shape #>> '{options,baseDelay}')::int,
    timeout => (p_shape #>> '{options,timeout}')::int
  );
  perform pgflow._add_steps_from_shape(p_flow_slug, p_shape);
end;
$$;

-- The structural shape of a stored flow (options are runtime-tunable and not part of it). Dependencies are
-- sorted in byte order (collate "C"), as the Rust macro and JavaScript sort them, whatever the database's
-- default collation.
create function pgflow._get_flow_shape(p_flow_slug text)
returns jsonb
language sql
stable
set search_path = ''
as $$
  select jsonb_build_object('steps', coalesce(jsonb_agg(
    jsonb_build_object(
      'slug', s.step_slug,
      'stepType', s.step_type,
      'dependencies', coalesce(
        (select jsonb_agg(d.dep_slug order by d.dep_slug collate "C") from pgflow.deps d
         where d.flow_slug = s.flow_slug and d.step_slug = s.step_slug),
        '[]'::jsonb),
      'whenUnmet', s.when_unmet,
      'whenExhausted', s.when_exhausted,
      'requiredInputPattern', case when s.required_input_pattern is null
        then '{"defined": false}'::jsonb
        else jsonb_build_object('defined', true, 'value', s.required_input_pattern) end,
      'forbiddenInputPattern', case when s.forbidden_input_pattern is null
        then '{"defined": false}'::jsonb
        else jsonb_build_object('defined', true, 'value', s.forbidden_input_pattern) end
    ) order by s.step_index), '[]'::jsonb))
  from pgflow.steps s
  where s.flow_slug = p_flow_slug;
$$;

-- Human-readable differences between two shapes ("first" = p_local, "second" = p_db); empty when equal.
create function pgflow._compare_flow_shapes(p_local jsonb, p_db jsonb)
returns text[]
language plpgsql
stable
set search_path = ''
as $$
declare
  v_diffs text[] := '{}';
  v_local jsonb := coalesce(p_local -> 'steps', '[]');
  v_db jsonb := coalesce(p_db -> 'steps', '[]');
  v_n1 int := jsonb_array_length(v_local);
  v_n2 int := jsonb_array_length(v_db);
  v_a jsonb;
  v_b jsonb;
  v_prefix text;
  v_deps_a text;
  v_deps_b text;
  v_key text;
  i int;
begin
  if v_n1 <> v_n2 then
    v_diffs := v_diffs || format('Step count differs: %s vs %s', v_n1, v_n2);
  end if;

  for i in 0 .. greatest(v_n1, v_n2) - 1 loop
    v_a := v_local -> i;
    v_b := v_db -> i;
    v_prefix := format('Step at index %s: ', i);

    if v_a is null then
      v_diffs := v_diffs || (v_prefix || format('missing in first shape (second has ''%s'')', v_b ->> 'slug'));
      continue;
    elsif v_b is null then
      v_diffs := v_diffs || (v_prefix || format('missing in second shape (first has ''%s'')', v_a ->> 'slug'));
      continue;
    end if;

    -- Plain comparisons: a key missing on one side yields NULL and therefore no difference.
    if (v_a ->> 'slug') <> (v_b ->> 'slug') then
      v_diffs := v_diffs || (v_prefix || format('slug differs ''%s'' vs ''%s''', v_a ->> 'slug', v_b ->> 'slug'));
    end if;
    if (v_a ->> 'stepType') <> (v_b ->> 'stepType') then
      v_diffs := v_diffs || (v_prefix || format('type differs ''%s'' vs ''%s''', v_a ->> 'stepType', v_b ->> 'stepType'));
    end if;

    select coalesce(string_agg(d, ', ' order by d collate "C"), '') into v_deps_a
    from jsonb_array_elements_text(coalesce(v_a -> 'dependencies', '[]')) as d;
    select coalesce(string_agg(d, ', ' order by d collate "C"), '') into v_deps_b
    from jsonb_array_elements_text(coalesce(v_b -> 'dependencies', '[]')) as d;
    if v_deps_a <> v_deps_b then
      v_diffs := v_diffs || (v_prefix || format('dependencies differ [%s] vs [%s]', v_deps_a, v_deps_b));
    end if;

    if (v_a ->> 'whenUnmet') <> (v_b ->> 'whenUnmet') then
      v_diffs := v_diffs || (v_prefix || format('whenUnmet differs ''%s'' vs ''%s''', v_a ->> 'whenUnmet', v_b ->> 'whenUnmet'));
    end if;
    if (v_a ->> 'whenExhausted') <> (v_b ->> 'whenExhausted') then
      v_diffs := v_diffs || (v_prefix || format('whenExhausted differs ''%s'' vs ''%s''', v_a ->> 'whenExhausted', v_b ->> 'whenExhausted'));
    end if;

    foreach v_key in array array['requiredInputPattern', 'forbiddenInputPattern'] loop
      if (v_a -> v_key) is distinct from (v_b -> v_key) then
        v_diffs := v_diffs || (v_prefix || format('%s differs ''%s'' vs ''%s''', v_key,
          coalesce((v_a -> v_key)::text, ''), coalesce((v_b -> v_key)::text, '')));
      end if;
    end loop;
  end loop;

  return v_diffs;
end;
$$;
