-- pgflow-rs SQL core, migration 0010: startup compilation with queue mode and route map.
--
-- ensure_flow_compiled takes upstream's three arguments plus two trailing, defaulted ones (queue_mode, routes),
-- in exactly one function: calls with 2 or 3 arguments, positional or named, keep working and keep their
-- results.

-- Creates a flow (with the given queue mode) and its steps from a shape, routing step i to p_queues[i].
-- Flow mode: upstream's path (create_flow creates the default queue). Step mode: no default queue; one
-- private queue per step. Callers have resolved and checked every name before calling.
create function pgflow._create_flow_with_routes(
  p_flow_slug text,
  p_shape jsonb,
  p_queue_mode text,
  p_step_slugs text[],
  p_queues text[]
)
returns void
language plpgsql
volatile
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
          'step');

  perform pgflow._add_steps_from_shape(p_flow_slug, p_shape);

  update pgflow.steps s
  set queue_name = r.queue_name
  from unnest(p_step_slugs, p_queues) as r(step_slug, queue_name)
  where s.flow_slug = p_flow_slug and s.step_slug = r.step_slug;

  foreach v_queue in array p_queues loop
    perform pgflow._ensure_queue(v_queue);
  end loop;
end;
$$;

-- Differences between the persisted queue mode and route map of a flow and the requested ones; empty when
-- they match. The route map is compared step by step in step order, even when shape and mode match (it
-- catches resolver changes, migration defects and manual edits of steps.queue_name).
create function pgflow._compare_flow_routes(
  p_flow_slug text,
  p_queue_mode text,
  p_step_slugs text[],
  p_queues text[]
)
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

-- The default queue of a plain flow must not be a queue another flow routes a step to (a per-step queue
-- "<flow>__<step>" and a plain flow named "<flow>__<step>" would otherwise share one queue).
create function pgflow._assert_flow_queue_private(p_flow_slug text)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_other record;
begin
  select s.flow_slug, s.step_slug into v_other
  from pgflow.steps s
  where s.queue_name = lower(p_flow_slug) and lower(s.flow_slug) <> lower(p_flow_slug)
  limit 1;
  if found then
    raise exception 'Queue "%" of flow "%" is already used by another flow.', lower(p_flow_slug), p_flow_slug
      using errcode = 'PF013',
            detail = format('It is the queue of step "%s" in flow "%s".', v_other.step_slug, v_other.flow_slug),
            hint = 'Choose another concrete flow slug.';
  end if;
end;
$$;

-- Destroys a flow with all its runs, tasks and its own queues. Local recompilation only; never used in
-- production. Own queues: the queues its steps route to, the queues recorded on its tasks, and (flow mode
-- only) its default queue. A queue another flow routes a step to is never dropped.
create function pgflow.delete_flow_and_data(p_flow_slug text)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text;
  v_meta_name text;
begin
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
  loop
    v_meta_name := pgflow._queue_meta_name(v_queue);
    if v_meta_name is null then
      raise notice 'pgmq queue `%` does not exist', v_queue;
    else
      perform pgmq.drop_queue(v_meta_name);
    end if;
  end loop;

  delete from pgflow.step_tasks t using pgflow.runs r
    where r.flow_slug = p_flow_slug and t.run_id = r.run_id;
  delete from pgflow.step_states ss using pgflow.runs r
    where r.flow_slug = p_flow_slug and ss.run_id = r.run_id;
  delete from pgflow.runs r where r.flow_slug = p_flow_slug;
  delete from pgflow.deps d where d.flow_slug = p_flow_slug;
  delete from pgflow.steps s where s.flow_slug = p_flow_slug;
  delete from pgflow.flows f where f.flow_slug = p_flow_slug;
end;
$$;

-- The only deployment path: workers call this at startup with their flow's complete ordered shape, the queue
-- mode and (optionally) the route map they computed.
--
--   flow_slug        concrete flow slug
--   shape            the flow shape JSON (steps in order)
--   allow_data_loss  permit destructive recompilation outside a local database (default false)
--   queue_mode       'flow' (default: every step on the queue lower(flow_slug)) or 'step' (private per-step
--                    queues resolved by pgflow.resolve_step_queues)
--   routes           NULL (default: SQL resolves the route map) or the caller's ordered route map
--                    [{"step_slug": "...", "queue_name": "..."}, ...]; it must equal what SQL resolves,
--                    else PF002 is raised (the caller's resolver disagrees with the authoritative one)
--
-- Before any mutation, step mode resolves every name (PF010 / PF011 / PF012, see 0009) and checks private
-- ownership of every queue (PF013). Then, under the per-slug advisory lock:
--   flow missing                              -> create flow, steps and every queue   -> {"status": "compiled"}
--   same shape, mode and route map            -> nothing (recreates a missing queue)  -> {"status": "verified"}
--   different, and local or allow_data_loss   -> delete flow, data and own queues,
--                                                recreate in the requested mode       -> {"status": "recompiled"}
--   shape differs (production)                -> nothing                              -> {"status": "mismatch"}
--   only mode or route map differs (prod.)    -> raises PF001 (routing error, MESSAGE / DETAIL / HINT)
-- Every result also has "differences" (text array), as before. A shape mismatch is therefore reported as a
-- result and a routing mismatch as an error with SQLSTATE PF001; the runtime tells them apart that way.
create function pgflow.ensure_flow_compiled(
  flow_slug text,
  shape jsonb,
  allow_data_loss boolean default false,
  queue_mode text default 'flow',
  routes jsonb default null
)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_slug text := ensure_flow_compiled.flow_slug;
  v_mode text := coalesce(ensure_flow_compiled.queue_mode, 'flow');
  v_steps text[];
  v_queues text[];
  v_req_steps text[];
  v_req_queues text[];
  v_differences text[];
  v_routing text[];
  v_queue text;
  i int;
begin
  perform pg_advisory_xact_lock(1, hashtext(lower(v_slug)));

  if v_mode not in ('flow', 'step') then
    raise exception 'ensure_flow_compiled(): queue_mode must be ''flow'' or ''step'', got %', quote_literal(v_mode)
      using errcode = 'invalid_parameter_value';
  end if;

  select coalesce(array_agg(e ->> 'slug' order by o), '{}') into v_steps
  from jsonb_array_elements(coalesce(shape -> 'steps', '[]')) with ordinality as x(e, o);

  if v_mode = 'step' then
    select array_agg(r.queue_name order by r.step_index) into v_queues
    from pgflow.resolve_step_queues(v_slug, v_steps) r;
  else
    select coalesce(array_agg(lower(v_slug)), '{}') into v_queues from unnest(v_steps);
  end if;

  -- Every queue name this compilation may create, adopt or route to is claimed under its own lock, so two
  -- compilations of different flows that resolve to one name (flow "x" step "y__z" and flow "x__y" step "z"
  -- both give "x__y__z") cannot both pass the ownership checks below.
  perform pgflow._lock_queue_names(v_queues || lower(v_slug));

  if routes is not null then
    if jsonb_typeof(routes) <> 'array' then
      raise exception 'ensure_flow_compiled(): routes must be a JSON array of {"step_slug", "queue_name"} objects'
        using errcode = 'invalid_parameter_value';
    end if;
    select coalesce(array_agg(e ->> 'step_slug' order by o), '{}'), coalesce(array_agg(e ->> 'queue_name' order by o), '{}')
    into v_req_steps, v_req_queues
    from jsonb_array_elements(routes) with ordinality as x(e, o);
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

  if not exists (select 1 from pgflow.flows f where f.flow_slug = v_slug) then
    if exists (select 1 from pgflow.flows f where lower(f.flow_slug) = lower(v_slug)) then
      raise exception 'flow slug "%" differs only in case from existing flow "%"', v_slug,
          (select f.flow_slug from pgflow.flows f where lower(f.flow_slug) = lower(v_slug) limit 1)
        using errcode = 'unique_violation',
              detail = 'PGMQ queue names are case-insensitive, so both flows would share their queues.',
              hint = 'Choose a flow slug that differs by more than letter case.';
    end if;
    if v_mode = 'step' then
      perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, false);
    else
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
    return jsonb_build_object('status', 'compiled', 'differences', '[]'::jsonb);
  end if;

  v_differences := pgflow._compare_flow_shapes(shape, pgflow._get_flow_shape(v_slug));
  v_routing := pgflow._compare_flow_routes(v_slug, v_mode, v_steps, v_queues);

  if cardinality(v_differences) = 0 and cardinality(v_routing) = 0 then
    if v_mode = 'step' then
      perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, true);
      foreach v_queue in array v_queues loop
        perform pgflow._ensure_queue(v_queue);
      end loop;
    end if;
    return jsonb_build_object('status', 'verified', 'differences', '[]'::jsonb);
  end if;

  if coalesce(allow_data_loss, false) or pgflow.is_local() then
    -- Every check before the first mutation.
    if v_mode = 'step' then
      perform pgflow._assert_step_queues_private(v_slug, v_steps, v_queues, false);
    else
      perform pgflow._assert_flow_queue_private(v_slug);
    end if;
    perform pgflow.delete_flow_and_data(v_slug);
    perform pgflow._create_flow_with_routes(v_slug, shape, v_mode, v_steps, v_queues);
    return jsonb_build_object('status', 'recompiled',
      'differences', to_jsonb(v_differences || case when cardinality(v_differences) = 0 then v_routing
                                                    else array(select d from unnest(v_routing) d
                                                               where d like 'Queue mode differs%') end));
  end if;

  if cardinality(v_differences) > 0 then
    return jsonb_build_object('status', 'mismatch',
      'differences', to_jsonb(v_differences || array(select d from unnest(v_routing) d
                                                     where d like 'Queue mode differs%')));
  end if;

  raise exception 'Flow "%" is deployed with a different queue routing.', v_slug
    using errcode = 'PF001',
          detail = array_to_string(v_routing, '; ') || '.',
          hint = format('A concrete flow''s queue mode and route map cannot change in production: deploy the change under a new concrete flow slug (a new version, such as "...V2"). A local database (pgflow.local) recompiles destructively.');
end;
$$;
