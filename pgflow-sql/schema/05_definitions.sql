-- Flow definitions and compilation.
--
-- Owns: creating flows and steps (upstream's create_flow and add_step), the flow shape as JSON and its
-- comparison, compilation of a shape with its routes (ensure_flow_compiled: create, verify, or recompile when
-- data loss is allowed), and deleting a flow with all of its data.

-- Creates the flow (idempotent: an existing flow is returned unchanged) and its PGMQ queue.
-- NULL options mean the defaults: max_attempts 3, base_delay 5, timeout 60.
create function pgflow.create_flow(flow_slug text, max_attempts integer default NULL::integer, base_delay integer default NULL::integer, timeout integer default NULL::integer)
returns pgflow.flows
language plpgsql
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
create function pgflow.add_step(flow_slug text, step_slug text, deps_slugs text[] default '{}'::text[], max_attempts integer default NULL::integer, base_delay integer default NULL::integer, timeout integer default NULL::integer, start_delay integer default NULL::integer, step_type text default 'single'::text, required_input_pattern jsonb default NULL::jsonb, forbidden_input_pattern jsonb default NULL::jsonb, when_unmet text default 'skip'::text, when_exhausted text default 'fail'::text)
returns pgflow.steps
language plpgsql
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

-- Differences between the persisted queue mode and route map of a flow and the requested ones; empty when
-- they match. The route map is compared step by step in step order, even when shape and mode match (it
-- catches resolver changes, migration defects and manual edits of steps.queue_name).
create function pgflow._compare_flow_routes(p_flow_slug text, p_queue_mode text, p_step_slugs text[], p_queues text[])
returns text[]
language plpgsql
stable
set search_path = ''
as $$
declare
  v_diffs text[] := '{}';
  v_mode text;
  v_steps text[];
  v_queues text[];
  i int;
begin
  select f.queue_mode into v_mode from pgflow.flows f where f.flow_slug = p_flow_slug;
  if v_mode is distinct from p_queue_mode then
    v_diffs := v_diffs || format('Queue mode differs: persisted ''%s'', requested ''%s''', v_mode, p_queue_mode);
  end if;

  select coalesce(array_agg(s.step_slug order by s.step_index), '{}'),
         coalesce(array_agg(s.queue_name order by s.step_index), '{}')
  into v_steps, v_queues
  from pgflow.steps s
  where s.flow_slug = p_flow_slug;

  for i in 1 .. greatest(cardinality(v_steps), coalesce(cardinality(p_step_slugs), 0)) loop
    if v_steps[i] is distinct from p_step_slugs[i] or v_queues[i] is distinct from p_queues[i] then
      v_diffs := v_diffs || format('Route at index %s differs: persisted %s -> ''%s'', requested %s -> ''%s''',
        i - 1, coalesce(quote_literal(v_steps[i]), 'none'), coalesce(v_queues[i], ''),
        coalesce(quote_literal(p_step_slugs[i]), 'none'), coalesce(p_queues[i], ''));
    end if;
  end loop;

  return v_diffs;
end;
$$;

-- Adds the steps of a shape JSON to an existing flow (steps in array order, so array index = step_index).
create function pgflow._add_steps_from_shape(p_flow_slug text, p_shape jsonb)
returns void
language plpgsql
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

-- Creates a flow (with the given queue mode) and its steps from a shape, routing step i to p_queues[i].
-- Flow mode: upstream's path (create_flow creates the default queue). Step and named mode: no default queue;
-- the step queues are created (named ones are registered as shared). Callers have checked every name first.
create function pgflow._create_flow_with_routes(p_flow_slug text, p_shape jsonb, p_queue_mode text, p_step_slugs text[], p_queues text[])
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_other text;
  v_queue text;
begin
  if p_queue_mode = 'flow' then
    perform pgflow._create_flow_from_shape(p_flow_slug, p_shape);
    return;
  end if;

  select f.flow_slug into v_other from pgflow.flows f where lower(f.flow_slug) = lower(p_flow_slug);
  if found then
    raise exception 'flow slug "%" differs only in case from existing flow "%"', p_flow_slug, v_other
      using errcode = 'unique_violation',
            hint = 'Choose a flow slug that differs by more than letter case.';
  end if;

  insert into pgflow.flows (flow_slug, opt_max_attempts, opt_base_delay, opt_timeout, queue_mode)
  values (p_flow_slug,
          coalesce((p_shape #>> '{options,maxAttempts}')::int, 3),
          coalesce((p_shape #>> '{options,baseDelay}')::int, 5),
          coalesce((p_shape #>> '{options,timeout}')::int, 60),
          p_queue_mode);

  perform pgflow._add_steps_from_shape(p_flow_slug, p_shape);

  update pgflow.steps s
  set queue_name = r.queue_name
  from unnest(p_step_slugs, p_queues) as r(step_slug, queue_name)
  where s.flow_slug = p_flow_slug and s.step_slug = r.step_slug;

  if p_queue_mode = 'step' then
    foreach v_queue in array p_queues loop
      perform pgflow._ensure_queue(v_queue);
    end loop;
  end if;
end;
$$;

create function pgflow.ensure_flow_compiled(
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

create function pgflow.delete_flow_and_data(p_flow_slug text)
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

  delete from pgflow.task_attempts a using pgflow.runs r
    where r.flow_slug = p_flow_slug and a.run_id = r.run_id;
  delete from pgflow.limit_slots ls using pgflow.runs r
    where r.flow_slug = p_flow_slug and ls.run_id = r.run_id;
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
