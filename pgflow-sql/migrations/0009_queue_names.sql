-- pgflow-rs SQL core, migration 0009: the canonical per-step queue name resolver and private queue ownership.
--
-- The name contract (identical in pgflow-rs's macro and runtime; this SQL is authoritative):
--   for zero-based step index i in the complete ordered shape
--     readable = lower(flow_slug || '__' || step_slug)
--     fallback = lower(flow_slug || '__' || i)
--   readable if it has at most 47 characters, else fallback if it fits, else the whole flow is rejected.
--   Names are never truncated or hashed; there is no separate step-count limit.
--
-- SQLSTATEs of the errors raised here and by ensure_flow_compiled's routing checks (class "PF", pgflow):
--   PF010  the flow slug cannot fit even "<flow>__0" (or the flow has no steps)
--   PF011  one step's readable and index fallback names are both too long
--   PF012  two steps resolve to the same queue name
--   PF013  a generated queue exists and is not privately owned by the same concrete flow and step
--   PF001  routing mismatch: the persisted queue mode or route map differs from the requested one
--   PF002  the caller's route map differs from the one SQL resolves (a resolver disagreement)
--   PF020  a worker subscription does not match the persisted route (register_worker)

create function pgflow._max_queue_name_length()
returns int
language sql
immutable
parallel safe
as $$ select 47 $$;

-- The authoritative per-step route map of a step-queued flow.
--
-- Input: the concrete flow slug and the complete ordered list of step slugs (array order = step_index).
-- Output: one row per step, in order: (step_index zero-based, step_slug as given, queue_name lowercase).
-- Raises, before returning anything (PostgreSQL MESSAGE / DETAIL / HINT):
--   PF010 MESSAGE  Flow "<flow>" cannot use per-step queues.
--         DETAIL   The shortest required queue "<lower(flow)>__0" is <n> characters; PGMQ allows at most 47.
--         HINT     Shorten the concrete flow slug or use the default single queue.
--   PF011 MESSAGE  Cannot derive a queue for step "<step>" at index <i> in flow "<flow>".
--         DETAIL   The readable name is <r> characters and the index fallback is <f>; PGMQ allows at most 47.
--         HINT     Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use
--                  the default single queue.
--   PF012 two steps resolve to the same name (only possible for step slugs that differ only in letter case);
--   22023 an empty flow, or a flow or step slug that is not a valid slug.
-- Every distinct name is also passed to pgmq.validate_queue_name(). Pure otherwise: reads no table.
create function pgflow.resolve_step_queues(flow_slug text, step_slugs text[])
returns table (step_index int, step_slug text, queue_name text)
language plpgsql
stable
set search_path = ''
as $$
declare
  v_max int := pgflow._max_queue_name_length();
  v_flow text := resolve_step_queues.flow_slug;
  v_n int := coalesce(cardinality(resolve_step_queues.step_slugs), 0);
  v_lower int := coalesce(array_lower(resolve_step_queues.step_slugs, 1), 1);
  v_slugs text[] := '{}';
  v_names text[] := '{}';
  v_slug text;
  v_readable text;
  v_fallback text;
  v_first int;
  v_name text;
  i int;
begin
  if not pgflow.is_valid_slug(v_flow) then
    raise exception 'Flow slug "%" is not a valid slug.', coalesce(v_flow, 'NULL')
      using errcode = 'invalid_parameter_value',
            hint = 'A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.';
  end if;

  if length(lower(v_flow) || '__0') > v_max then
    raise exception 'Flow "%" cannot use per-step queues.', v_flow
      using errcode = 'PF010',
            detail = format('The shortest required queue "%s" is %s characters; PGMQ allows at most %s.',
                            lower(v_flow) || '__0', length(lower(v_flow) || '__0'), v_max),
            hint = 'Shorten the concrete flow slug or use the default single queue.';
  end if;

  if v_n = 0 then
    raise exception 'Flow "%" cannot use per-step queues.', v_flow
      using errcode = 'PF010',
            detail = 'The flow has no steps; a step-queued flow needs at least one step.',
            hint = 'Add a step to the flow or use the default single queue.';
  end if;

  for i in 0 .. v_n - 1 loop
    v_slug := resolve_step_queues.step_slugs[v_lower + i];
    if not pgflow.is_valid_slug(v_slug) then
      raise exception 'Step slug "%" at index % in flow "%" is not a valid slug.', coalesce(v_slug, 'NULL'), i, v_flow
        using errcode = 'invalid_parameter_value',
              hint = 'A slug starts with a letter or underscore, continues with letters, digits or underscores, and has at most 128 characters.';
    end if;
    v_readable := lower(v_flow || '__' || v_slug);
    v_fallback := lower(v_flow || '__' || i);
    if length(v_readable) <= v_max then
      v_name := v_readable;
    elsif length(v_fallback) <= v_max then
      v_name := v_fallback;
    else
      raise exception 'Cannot derive a queue for step "%" at index % in flow "%".', v_slug, i, v_flow
        using errcode = 'PF011',
              detail = format('The readable name is %s characters and the index fallback is %s; PGMQ allows at most %s.',
                              length(v_readable), length(v_fallback), v_max),
              hint = 'Shorten the concrete flow slug, shorten the step slug enough for the readable name, or use the default single queue.';
    end if;

    v_first := array_position(v_names, v_name);
    if v_first is not null then
      raise exception 'Steps "%" (index %) and "%" (index %) of flow "%" resolve to the same queue "%".',
          v_slugs[v_first], v_first - 1, v_slug, i, v_flow, v_name
        using errcode = 'PF012',
              detail = 'Generated queue names are lowercase, so step slugs that differ only in letter case collide.',
              hint = 'Rename one of the steps so the slugs differ by more than letter case, or use the default single queue.';
    end if;
    v_slugs := v_slugs || v_slug;
    v_names := v_names || v_name;
  end loop;

  foreach v_name in array v_names loop
    perform pgmq.validate_queue_name(v_name);
  end loop;

  return query
  select (u.ord - 1)::int, u.slug, u.name
  from unnest(v_slugs, v_names) with ordinality as u(slug, name, ord)
  order by u.ord;
end;
$$;

-- The persisted route map of a flow, in step order: what a worker subscribes to. Empty for a missing flow.
create function pgflow.flow_routes(flow_slug text)
returns table (step_index int, step_slug text, queue_name text, queue_mode text)
language sql
stable
set search_path = ''
as $$
  select s.step_index, s.step_slug, s.queue_name, f.queue_mode
  from pgflow.steps s
  join pgflow.flows f on f.flow_slug = s.flow_slug
  where s.flow_slug = flow_routes.flow_slug
  order by s.step_index;
$$;

-- Raises PF013 unless every generated queue (p_step_slugs[i] -> p_queues[i]) of flow p_flow_slug may be
-- used by it:
--   * no other flow routes a step to the name, and no other flow has it as its default queue;
--   * when p_owned_by_flow is false (the flow does not exist yet, or is being recompiled), PGMQ has no queue of
--     that name in any letter case, unless the flow itself currently routes a step to it (recompilation);
--   * when p_owned_by_flow is true (verifying an existing definition), an existing PGMQ queue must be spelled
--     exactly like the name and be routed to exactly this flow and step.
-- Reads only; runs before any mutation.
create function pgflow._assert_step_queues_private(
  p_flow_slug text,
  p_step_slugs text[],
  p_queues text[],
  p_owned_by_flow boolean
)
returns void
language plpgsql
stable
set search_path = ''
as $$
declare
  v_hint text := 'Generated per-step queues are private to one concrete flow and step: drop the queue if it is a leftover nothing uses, or choose another concrete flow slug.';
  v_step text;
  v_queue text;
  v_meta text;
  v_other record;
  i int;
begin
  for i in 1 .. coalesce(cardinality(p_queues), 0) loop
    v_step := p_step_slugs[i];
    v_queue := p_queues[i];

    select f.flow_slug into v_other
    from pgflow.flows f
    where lower(f.flow_slug) = v_queue and f.flow_slug <> p_flow_slug
    limit 1;
    if found then
      raise exception 'Queue "%" for step "%" of flow "%" is already used by another flow.', v_queue, v_step, p_flow_slug
        using errcode = 'PF013',
              detail = format('It is the default queue of flow "%s".', v_other.flow_slug),
              hint = v_hint;
    end if;

    select s.flow_slug, s.step_slug into v_other
    from pgflow.steps s
    where s.queue_name = v_queue and s.flow_slug <> p_flow_slug
    limit 1;
    if found then
      raise exception 'Queue "%" for step "%" of flow "%" is already used by another flow.', v_queue, v_step, p_flow_slug
        using errcode = 'PF013',
              detail = format('It is the queue of step "%s" in flow "%s".', v_other.step_slug, v_other.flow_slug),
              hint = v_hint;
    end if;

    v_meta := pgflow._queue_meta_name(v_queue);
    if v_meta is null then
      continue;
    end if;

    if p_owned_by_flow then
      if v_meta <> v_queue then
        raise exception 'Queue "%" for step "%" of flow "%" collides with the PGMQ queue "%".', v_queue, v_step, p_flow_slug, v_meta
          using errcode = 'PF013',
                detail = 'The names differ only in letter case, and PGMQ queue tables are case-insensitive.',
                hint = v_hint;
      end if;
      if exists (select 1 from pgflow.steps s
                 where s.flow_slug = p_flow_slug and s.queue_name = v_queue and s.step_slug <> v_step) then
        raise exception 'Queue "%" for step "%" of flow "%" is routed to another step of the flow.', v_queue, v_step, p_flow_slug
          using errcode = 'PF013',
                hint = v_hint;
      end if;
    elsif not exists (select 1 from pgflow.steps s where s.flow_slug = p_flow_slug and s.queue_name = v_queue)
          and not exists (select 1 from pgflow.flows f where f.flow_slug = p_flow_slug
                          and f.queue_mode = 'flow' and lower(f.flow_slug) = v_queue) then
      if v_meta <> v_queue then
        raise exception 'Queue "%" for step "%" of flow "%" collides with the PGMQ queue "%".', v_queue, v_step, p_flow_slug, v_meta
          using errcode = 'PF013',
                detail = 'The names differ only in letter case, and PGMQ queue tables are case-insensitive.',
                hint = v_hint;
      end if;
      raise exception 'Queue "%" for step "%" of flow "%" already exists in PGMQ.', v_queue, v_step, p_flow_slug
        using errcode = 'PF013',
              detail = 'pgflow creates and owns every generated queue; an existing queue (created by an application, or left over) may hold foreign messages.',
              hint = v_hint;
    end if;
  end loop;
end;
$$;
