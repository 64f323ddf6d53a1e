-- pgflow-rs SQL core, migration 0015: deployed flows. Stable aliases over immutable concrete versions, named
-- static routes to shared queues, queue-scoped claims that serve several concrete flows, and the startup
-- coverage and drain checks.
--
-- Ownership model. A concrete flow (flow_slug) is one immutable version: its shape and its routing never
-- change. An alias (flow_aliases) selects the concrete version new runs start; a run records the concrete
-- slug it resolved to, and each task snapshots its queue. A worker polls one queue and runs a registry of
-- concrete flows; it registers exactly the (flow_slug, step_slug) pairs it runs (worker_routes). Defaults keep
-- today's behaviour: alias = flow slug, every step on the flow's own queue, the worker polls that queue.
--
-- Queue modes of a concrete flow (flows.queue_mode):
--   'flow'   every step on the private default queue lower(flow_slug) (upstream's behaviour);
--   'step'   every step on its own private generated queue (resolve_step_queues);
--   'named'  every step on a queue the caller names in ensure_flow_compiled's `routes`. Named queues are
--            shared: several steps, flows and versions may route to one; they are provisioned while steps
--            compile (never while runs schedule tasks), never dropped by flow deletion, and a PGMQ queue that
--            pgflow did not create is adopted only with adopt_queues => true. A queue is never private to one
--            flow and shared by another.
--
-- SQLSTATEs added here (class PF, with MESSAGE / DETAIL / HINT):
--   PF014  a named queue that is not a valid queue name
--   PF015  a named route map that does not route every step exactly once
--   PF016  a queue that is private to one flow and would be shared by another (either way round)
--   PF017  a PGMQ queue pgflow did not create, named without adopt_queues => true
--   PF018  an alias that is another flow's concrete slug, or a new concrete slug that is another flow's alias
--   PF020  a worker subscription that is not a persisted route to the worker's queue (register_worker)
--
-- The lock order of 0011_claims.sql holds; compilation takes its advisory locks in the order: concrete slug
-- (key space 1), queue names (2, sorted), alias (3).

------------------------------------------------------------------------------------------------------------
-- Schema
------------------------------------------------------------------------------------------------------------

alter table pgflow.flows
  drop constraint queue_mode_is_valid,
  add constraint queue_mode_is_valid check (queue_mode in ('flow', 'step', 'named'));

-- A stable name for the concrete version new runs start. Activated by ensure_flow_compiled(alias => ...)
-- after the version's complete shape and routing are persisted.
create table pgflow.flow_aliases (
  alias text primary key,
  flow_slug text not null references pgflow.flows (flow_slug),
  activated_at timestamptz not null default now(),
  -- The concrete slug this alias pointed at before its last activation (NULL for a new alias).
  previous_flow_slug text,
  constraint alias_is_valid check (pgflow.is_valid_slug(alias))
);
create unique index flow_aliases_alias_lower_key on pgflow.flow_aliases (lower(alias));
create index idx_flow_aliases_flow_slug on pgflow.flow_aliases (flow_slug);

-- Queues shared by named routes: created by pgflow for a named route, or adopted (an existing PGMQ queue,
-- named with adopt_queues => true). Never dropped by pgflow.
create table pgflow.shared_queues (
  queue_name text primary key,
  adopted boolean not null default false,
  created_at timestamptz not null default now(),
  constraint queue_name_is_lowercase check (queue_name = lower(queue_name))
);

-- The exact (flow, step) pairs a registered worker runs from its queue (pgflow.workers.queue_name). A worker
-- with no rows registered the upstream way (track_worker_function) and is taken to serve its whole queue.
create table pgflow.worker_routes (
  worker_id uuid not null references pgflow.workers (worker_id) on delete cascade,
  flow_slug text not null,
  step_slug text not null,
  primary key (worker_id, flow_slug, step_slug),
  foreign key (flow_slug, step_slug) references pgflow.steps (flow_slug, step_slug) on delete cascade
);
create index idx_worker_routes_flow_step on pgflow.worker_routes (flow_slug, step_slug);

-- One worker row no longer names one flow: its pairs live in worker_routes.
drop view pgflow.queue_coverage;
insert into pgflow.worker_routes (worker_id, flow_slug, step_slug)
select w.worker_id, s.flow_slug, s.step_slug
from pgflow.workers w
join pgflow.steps s on s.flow_slug = w.flow_slug and (w.step_slug is null or s.step_slug = w.step_slug)
on conflict do nothing;
alter table pgflow.workers drop column flow_slug, drop column step_slug;

------------------------------------------------------------------------------------------------------------
-- Events that belong to no run
------------------------------------------------------------------------------------------------------------

-- The one event function, extended: an event with a NULL run_id (alias activation) goes to the Realtime
-- topic `pgflow:deployments`, or else to the pg_notify channel `pgflow_deployments`. Deployment events are
-- emitted unless pgflow.notify is 'off'. Run events are unchanged (0004).
create or replace function pgflow._emit(event text, run_id uuid, payload jsonb)
returns void
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_mode text;
begin
  if to_regprocedure('realtime.send(jsonb,text,text,boolean)') is not null then
    perform realtime.send(payload, event,
                          case when run_id is null then 'pgflow:deployments' else 'pgflow:run:' || run_id::text end,
                          false);
    return;
  end if;

  v_mode := coalesce(nullif(current_setting('pgflow.notify', true), ''), 'run');
  if v_mode = 'off' then
    return;
  end if;

  if run_id is null then
    perform pg_notify('pgflow_deployments', payload::text);
    return;
  end if;

  if v_mode = 'run' and left(event, 4) <> 'run:' then
    return;
  end if;

  perform pg_notify(
    pgflow.run_channel(run_id),
    jsonb_strip_nulls(jsonb_build_object(
      'event_type', payload ->> 'event_type',
      'event', event,
      'run_id', run_id,
      'step_slug', payload ->> 'step_slug',
      'status', payload ->> 'status'
    ))::text
  );
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Aliases
------------------------------------------------------------------------------------------------------------

-- The concrete flow slug a name resolves to: an alias's target (aliases first), else the name itself.
create function pgflow.resolve_flow_slug(flow_slug text)
returns text
language sql
stable
set search_path = ''
as $$
  select coalesce(
    (select a.flow_slug from pgflow.flow_aliases a where a.alias = resolve_flow_slug.flow_slug),
    resolve_flow_slug.flow_slug);
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

-- Points `p_alias` at `p_flow_slug` (the caller has persisted the flow's complete shape and routing in this
-- transaction, under its concrete-slug lock). Idempotent: an alias already pointing there is left as it is.
-- Otherwise the previous target is recorded, activated_at is now, and the event `alias:activated` goes out
-- through pgflow._emit. Returns {"alias", "flow_slug", "previous_flow_slug", "activated_at", "activated"}.
create function pgflow._activate_alias(p_alias text, p_flow_slug text)
returns jsonb
language plpgsql
volatile
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

------------------------------------------------------------------------------------------------------------
-- Named queues
------------------------------------------------------------------------------------------------------------

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
volatile
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

------------------------------------------------------------------------------------------------------------
-- Compilation
------------------------------------------------------------------------------------------------------------

-- Creates a flow (with the given queue mode) and its steps from a shape, routing step i to p_queues[i].
-- Flow mode: upstream's path (create_flow creates the default queue). Step and named mode: no default queue;
-- the step queues are created (named ones are registered as shared). Callers have checked every name first.
create or replace function pgflow._create_flow_with_routes(
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

-- Destroys a flow with all its runs, tasks, aliases and its own queues. Local recompilation only; never used
-- in production. Own queues: the queues its steps route to, the queues recorded on its tasks, and (flow mode
-- only) its default queue. A shared queue, or a queue another flow routes a step to, is never dropped.
create or replace function pgflow.delete_flow_and_data(p_flow_slug text)
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
      and not exists (select 1 from pgflow.shared_queues sq where sq.queue_name = x.q)
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
  delete from pgflow.flow_aliases a where a.flow_slug = p_flow_slug;
  delete from pgflow.deps d where d.flow_slug = p_flow_slug;
  delete from pgflow.steps s where s.flow_slug = p_flow_slug;
  delete from pgflow.flows f where f.flow_slug = p_flow_slug;
end;
$$;

drop function pgflow.ensure_flow_compiled(text, jsonb, boolean, text, jsonb);

-- The only deployment path: workers call this at startup with their flow's complete ordered shape, its queue
-- mode and route map, and (optionally) the alias the version should serve.
--
--   flow_slug        concrete flow slug (one immutable version)
--   shape            the flow shape JSON (steps in order)
--   allow_data_loss  permit destructive recompilation outside a local database (default false)
--   queue_mode       'flow' (default), 'step' (private generated queues) or 'named' (the caller's queues)
--   routes           'step': NULL or the caller's route map, which must equal what SQL resolves (else PF002);
--                    'named': required, [{"step_slug": "...", "queue_name": "..."}, ...] routing every step
--                    exactly once (else PF015), each queue a valid name (PF014);
--                    'flow': NULL or the default queue for every step
--   alias            NULL (default: no alias is touched) or the stable name to point at this version once its
--                    complete shape and routing are persisted (PF018 when it is another flow's concrete slug)
--   adopt_queues     'named' only: adopt named queues that exist in PGMQ although pgflow did not create them
--                    (default false: PF017)
--
-- Before any mutation every name, ownership and alias check runs. Then, under the concrete-slug advisory lock:
--   flow missing                              -> create flow, steps and queues        -> {"status": "compiled"}
--   same shape, mode and route map            -> nothing (recreates a missing queue)  -> {"status": "verified"}
--   different, and local or allow_data_loss   -> delete flow, data and own queues,
--                                                recreate in the requested mode       -> {"status": "recompiled"}
--   shape differs (production)                -> nothing                              -> {"status": "mismatch"}
--   only mode or route map differs (prod.)    -> raises PF001 (routing error, MESSAGE / DETAIL / HINT)
-- When an alias is given and the version is compiled, verified or recompiled, the alias is activated in the
-- same transaction (pgflow._activate_alias: idempotent, records the previous target, emits alias:activated);
-- the result then also has "alias": {"alias", "flow_slug", "previous_flow_slug", "activated_at",
-- "activated"}. A mismatch activates nothing. Rollback is activating an older version again: its shape and
-- routing are untouched.
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
      end if;
      v_status := 'verified';
    elsif coalesce(allow_data_loss, false) or pgflow.is_local() then
      -- Every check before the first mutation.
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

------------------------------------------------------------------------------------------------------------
-- Starting runs by alias
------------------------------------------------------------------------------------------------------------

-- Upstream's start_flow, resolving an alias first: `flow_slug` may be an alias (resolved to its concrete
-- slug) or a concrete slug. The run records the concrete slug; the returned runs row carries it in
-- `flow_slug`, so the caller learns what the alias resolved to. Same signature and return type as upstream.
create or replace function pgflow.start_flow(flow_slug text, input jsonb, run_id uuid default null)
returns setof pgflow.runs
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_slug text := pgflow.resolve_flow_slug(start_flow.flow_slug);
  v_run pgflow.runs;
  v_root_len int;
begin
  if exists (
    select 1 from pgflow.steps s
    where s.flow_slug = v_slug and s.step_type = 'map' and s.deps_count = 0
  ) then
    if input is null then
      raise exception 'Flow % has root map steps but input is NULL', v_slug;
    elsif jsonb_typeof(input) <> 'array' then
      raise exception 'Flow % has root map steps but input is not an array (got %)',
        v_slug, jsonb_typeof(input);
    end if;
    v_root_len := jsonb_array_length(input);
  end if;

  insert into pgflow.runs (run_id, flow_slug, input, remaining_steps)
  values (
    coalesce(start_flow.run_id, gen_random_uuid()),
    v_slug,
    start_flow.input,
    (select count(*) from pgflow.steps s where s.flow_slug = v_slug)
  )
  returning * into v_run;

  insert into pgflow.step_states (flow_slug, run_id, step_slug, remaining_deps, initial_tasks)
  select s.flow_slug, v_run.run_id, s.step_slug, s.deps_count,
         case when s.step_type = 'single' then 1
              when s.deps_count = 0 then v_root_len
         end
  from pgflow.steps s
  where s.flow_slug = v_slug;

  perform pgflow._emit('run:started', v_run.run_id, jsonb_build_object(
    'event_type', 'run:started',
    'run_id', v_run.run_id,
    'flow_slug', v_run.flow_slug,
    'input', v_run.input,
    'status', 'started',
    'remaining_steps', v_run.remaining_steps,
    'started_at', v_run.started_at
  ));

  perform pgflow._advance_run(v_run.run_id);

  return query select r.* from pgflow.runs r where r.run_id = v_run.run_id;
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Queue-scoped claims
------------------------------------------------------------------------------------------------------------

drop function pgflow.read_and_claim_tasks(text, text, text, integer, integer, uuid);
drop function pgflow.claim_tasks(text, text, text, bigint[], uuid);

-- The claim of pgflow-rs workers: the messages `msg_ids` a worker read from `queue_name`, classified against
-- the exact (flow_slugs[i], step_slugs[i]) pairs the worker runs from that queue. One queue may carry tasks of
-- several concrete flows; tasks are matched by (queue_name, message_id) only, never by inferring a queue from a
-- flow slug. The complete batch is classified first, with its messages and then its task rows locked in message
-- order (the lock order at the top of 0011_claims.sql):
--   claimed      task in this queue, its (flow, step) among the pairs, `queued`, run and step started
--   deferred     task `started` (a duplicate visibility, benign): no attempt consumed; the message is hidden
--                until the task's recovery boundary (at least the claim buffer from now)
--   archived     task terminal (completed, failed, skipped, cancelled): the message is archived, idempotently
--   waiting      task `queued` but its run or step is not started (not normally reachable): left untouched
--   unsupported  no task for (queue_name, msg_id) ("no_task"), a task for the message body recorded in another
--                queue ("wrong_queue"), or a task whose (flow, step) is not among the pairs ("unsupported_route")
-- If any message is unsupported, or the worker's function is disabled: nothing is claimed, deferred or
-- archived, no attempt is consumed, and every message of the batch becomes visible again (vt = now).
-- Otherwise, atomically: queued tasks become `started` (attempts_count + 1, started_at, last_worker_id) and their
-- messages get visibility = effective step timeout + claim buffer; started ones are deferred; terminal ones
-- archived.
--
-- Returns rows, so a worker decodes no document:
--   outcome 'claimed'      one row per claimed task: msg_id, flow_slug, run_id, step_slug, task_index, input,
--                          flow_input (the task-input assembly of pgflow._task_inputs), attempts_count (the
--                          attempt this claim started: every result carries it, the fence of 0007), timeout
--                          (the effective step timeout in seconds the visibility is based on); in msg_id order
--   outcome 'deferred' | 'archived' | 'waiting'   one row per such message (msg_id only)
--   outcome 'unsupported'  exactly one row, report = {"queue_name", "msg_ids" (the whole batch, visible again),
--                          "unsupported_msg_ids", "flows", "steps" (distinct, of the unsupported messages),
--                          "messages": [{"msg_id", "reason", "flow_slug", "step_slug"}], "supported": [[flow,
--                          step], ...]} without message bodies
--   outcome 'disabled'     exactly one row, report = {"function_name", "reason", "disabled_at"}
-- An empty batch returns no row.
create function pgflow.claim_tasks(
  queue_name text,
  msg_ids bigint[],
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
set search_path = ''
as $$
declare
  v_queue text := lower(claim_tasks.queue_name);
  v_ids bigint[];
  v_table text;
  v_claim_ids bigint[];
  v_defer_ids bigint[];
  v_defer_vts timestamptz[];
  v_archive_ids bigint[];
  v_wait_ids bigint[];
  v_unsupported_ids bigint[];
  v_run_ids uuid[];
  v_step_slugs text[];
  v_task_indexes int[];
  v_secs float8[];
  v_updated int;
  v_disabled jsonb;
  v_report jsonb;
begin
  if cardinality(claim_tasks.flow_slugs) is distinct from cardinality(claim_tasks.step_slugs) then
    raise exception 'claim_tasks(): flow_slugs and step_slugs differ in length (% and %)',
      cardinality(claim_tasks.flow_slugs), cardinality(claim_tasks.step_slugs)
      using errcode = 'invalid_parameter_value';
  end if;
  select coalesce(array_agg(distinct i order by i), '{}') into v_ids
  from unnest(claim_tasks.msg_ids) as i where i is not null;
  if cardinality(v_ids) = 0 then
    return;
  end if;
  v_table := pgmq.format_table_name(v_queue, 'q');

  -- Lock order step 3: the batch's messages (already held when pgmq.read ran in this transaction).
  perform pgflow._lock_messages(v_queue, v_ids);

  -- The fence: a worker of a disabled function claims nothing.
  select jsonb_build_object('function_name', wf.function_name, 'reason', wf.disabled_reason,
                            'disabled_at', wf.disabled_at)
  into v_disabled
  from pgflow.workers w
  join pgflow.worker_functions wf on wf.function_name = w.function_name
  where w.worker_id = claim_tasks.worker_id and not wf.enabled;

  -- Lock order step 4: every task of the batch, in message order, classified in the same statement.
  with pairs as (
    select p.flow_slug, p.step_slug
    from unnest(claim_tasks.flow_slugs, claim_tasks.step_slugs) as p(flow_slug, step_slug)
  ),
  locked as (
    select t.message_id as id,
           t.run_id, t.step_slug, t.task_index, t.started_at,
           coalesce(s.opt_timeout, f.opt_timeout) as timeout,
           case
             when not exists (select 1 from pairs p where p.flow_slug = t.flow_slug and p.step_slug = t.step_slug)
               then 'unsupported'
             when t.status = 'queued' and r.status = 'started' and ss.status = 'started' then 'claim'
             when t.status = 'queued' then 'wait'
             when t.status = 'started' then 'defer'
             else 'archive'
           end as kind
    from pgflow.step_tasks t
    join pgflow.runs r on r.run_id = t.run_id
    join pgflow.step_states ss on ss.run_id = t.run_id and ss.step_slug = t.step_slug
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    where t.queue_name = v_queue and t.message_id = any (v_ids)
    order by t.message_id
    for update of t
  ),
  classified as (
    select m.id, l.run_id, l.step_slug, l.task_index, l.started_at, l.timeout,
           coalesce(l.kind, 'unsupported') as kind
    from unnest(v_ids) as m(id)
    left join locked l on l.id = m.id
  )
  select array_agg(c.id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.run_id order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.step_slug order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.task_index order by c.id) filter (where c.kind = 'claim'),
         array_agg(c.timeout::float8 + pgflow._claim_visibility_buffer_seconds() order by c.id)
           filter (where c.kind = 'claim'),
         array_agg(c.id order by c.id) filter (where c.kind = 'defer'),
         array_agg(greatest(pgflow._recovery_boundary(c.started_at, c.timeout),
                            clock_timestamp() + make_interval(secs => pgflow._claim_visibility_buffer_seconds()))
                   order by c.id) filter (where c.kind = 'defer'),
         array_agg(c.id order by c.id) filter (where c.kind = 'archive'),
         array_agg(c.id order by c.id) filter (where c.kind = 'wait'),
         array_agg(c.id order by c.id) filter (where c.kind = 'unsupported')
  into v_claim_ids, v_run_ids, v_step_slugs, v_task_indexes, v_secs,
       v_defer_ids, v_defer_vts, v_archive_ids, v_wait_ids, v_unsupported_ids
  from classified c;

  if v_unsupported_ids is not null or v_disabled is not null then
    -- No mutation except making the whole batch visible again.
    execute format('update pgmq.%I q set vt = clock_timestamp() where q.msg_id = any ($1)', v_table)
    using v_ids;

    if v_disabled is not null then
      return query select 'disabled'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                          null::jsonb, null::jsonb, null::int, null::int, v_disabled;
      return;
    end if;

    execute format($q$
      with msgs as (
        select u.id,
               t.flow_slug as t_flow, t.step_slug as t_step,
               q.message ->> 'flow_slug' as b_flow, q.message ->> 'step_slug' as b_step,
               q.message ->> 'run_id' as b_run, q.message ->> 'task_index' as b_index
        from unnest($1::bigint[]) as u(id)
        left join pgflow.step_tasks t on t.queue_name = $2 and t.message_id = u.id
        left join pgmq.%I q on q.msg_id = u.id
      ),
      reasons as (
        select m.id, coalesce(m.t_flow, m.b_flow) as flow_slug, coalesce(m.t_step, m.b_step) as step_slug,
               case
                 when m.t_flow is not null then 'unsupported_route'
                 when m.b_run ~ '^[0-9a-fA-F-]{36}$' and m.b_index ~ '^[0-9]+$' and exists (
                        select 1 from pgflow.step_tasks o
                        where o.run_id = m.b_run::uuid and o.step_slug = m.b_step
                          and o.task_index = m.b_index::int and o.queue_name <> $2) then 'wrong_queue'
                 else 'no_task'
               end as reason
        from msgs m
      )
      select jsonb_build_object(
        'queue_name', $2,
        'msg_ids', to_jsonb($3::bigint[]),
        'unsupported_msg_ids', to_jsonb($1::bigint[]),
        'flows', coalesce((select jsonb_agg(distinct r.flow_slug) from reasons r where r.flow_slug is not null), '[]'),
        'steps', coalesce((select jsonb_agg(distinct r.step_slug) from reasons r where r.step_slug is not null), '[]'),
        'messages', (select jsonb_agg(jsonb_build_object('msg_id', r.id, 'reason', r.reason,
                                      'flow_slug', r.flow_slug, 'step_slug', r.step_slug) order by r.id)
                     from reasons r),
        'supported', coalesce((select jsonb_agg(jsonb_build_array(p.flow_slug, p.step_slug))
                               from unnest($4::text[], $5::text[]) as p(flow_slug, step_slug)), '[]'))
    $q$, v_table)
    into v_report
    using v_unsupported_ids, v_queue, v_ids, claim_tasks.flow_slugs, claim_tasks.step_slugs;

    return query select 'unsupported'::text, null::bigint, null::text, null::uuid, null::text, null::int,
                        null::jsonb, null::jsonb, null::int, null::int, v_report;
    return;
  end if;

  -- Fully supported batch: claim, defer, archive.
  if v_claim_ids is not null then
    update pgflow.step_tasks t
    set status = 'started',
        attempts_count = t.attempts_count + 1,
        -- A claim whose transaction began before the task was queued still starts it no earlier
        -- than it was queued (started_at_is_after_queued_at).
        started_at = greatest(now(), t.queued_at),
        last_worker_id = claim_tasks.worker_id
    from unnest(v_run_ids, v_step_slugs, v_task_indexes) as c(run_id, step_slug, task_index)
    where t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
      and t.status = 'queued';

    execute format(
      'update pgmq.%I q set vt = clock_timestamp() + make_interval(secs => v.secs)
         from unnest($1::bigint[], $2::float8[]) as v(id, secs)
        where q.msg_id = v.id',
      v_table)
    using v_claim_ids, v_secs;
    get diagnostics v_updated = row_count;
    if v_updated <> cardinality(v_claim_ids) then
      raise exception 'claim_tasks(): visibility updated % of % claimed messages', v_updated, cardinality(v_claim_ids)
        using detail = format('queue %s, messages %s', v_queue, v_claim_ids::text),
              hint = 'A claimed message is missing from its queue; no task was claimed.';
    end if;
  end if;

  if v_defer_ids is not null then
    execute format(
      'update pgmq.%I q set vt = v.vt from unnest($1::bigint[], $2::timestamptz[]) as v(id, vt) where q.msg_id = v.id',
      v_table)
    using v_defer_ids, v_defer_vts;
  end if;

  if v_archive_ids is not null then
    perform pgmq.archive(v_queue, v_archive_ids);
  end if;

  if v_claim_ids is not null then
    return query
    select 'claimed'::text, c.msg_id, t.flow_slug, t.run_id, t.step_slug, t.task_index, i.input, i.flow_input,
           t.attempts_count, coalesce(s.opt_timeout, f.opt_timeout), null::jsonb
    from unnest(v_run_ids, v_step_slugs, v_task_indexes, v_claim_ids)
           with ordinality as c(run_id, step_slug, task_index, msg_id, ord)
    join pgflow.step_tasks t on t.run_id = c.run_id and t.step_slug = c.step_slug and t.task_index = c.task_index
    join pgflow.steps s on s.flow_slug = t.flow_slug and s.step_slug = t.step_slug
    join pgflow.flows f on f.flow_slug = t.flow_slug
    join pgflow.runs r on r.run_id = t.run_id
    cross join lateral pgflow._task_inputs(t.run_id, t.flow_slug, t.step_slug, s.step_type, s.deps_count,
                                           t.element, r.input) i
    order by c.ord;
  end if;
  return query
  select x.kind, x.id, null::text, null::uuid, null::text, null::int, null::jsonb, null::jsonb, null::int,
         null::int, null::jsonb
  from (
    select 'deferred'::text as kind, d.id from unnest(v_defer_ids) as d(id)
    union all
    select 'archived', a.id from unnest(v_archive_ids) as a(id)
    union all
    select 'waiting', w.id from unnest(v_wait_ids) as w(id)
  ) x
  order by x.id;
end;
$$;

-- Reads up to `qty` visible messages from `queue_name` (hidden for `vt` seconds) and classifies and claims
-- them with claim_tasks for the worker's pairs, in one call. Never sleeps. An empty read returns no row.
create function pgflow.read_and_claim_tasks(
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
set search_path = ''
as $$
declare
  v_ids bigint[];
begin
  select array_agg(m.msg_id) into v_ids
  from pgmq.read(read_and_claim_tasks.queue_name, read_and_claim_tasks.vt, read_and_claim_tasks.qty) m;
  if v_ids is null then
    return;
  end if;
  return query
  select * from pgflow.claim_tasks(read_and_claim_tasks.queue_name, v_ids, read_and_claim_tasks.worker_id,
                                   read_and_claim_tasks.flow_slugs, read_and_claim_tasks.step_slugs);
end;
$$;

------------------------------------------------------------------------------------------------------------
-- Registration and monitoring
------------------------------------------------------------------------------------------------------------

drop function pgflow.register_worker(uuid, text, text, text, text);

-- Registers (or re-registers) a worker for one queue and the exact (flow_slugs[i], step_slugs[i]) pairs it
-- runs from it, after compiling every flow it serves. A worker function may serve several flows. Every pair
-- must be a persisted route to the queue (else PF020, MESSAGE / DETAIL / HINT). Records the worker (queue in
-- lowercase, heartbeat now, not stopped) and its pairs, tracks the function, and returns
--   {"worker_id", "queue_name", "pairs": [[flow, step], ...], "function_name", "enabled", "disabled_reason",
--    "disabled_at"}
-- A worker whose function is disabled (enabled = false) must stop without claiming.
create function pgflow.register_worker(
  worker_id uuid,
  function_name text,
  queue_name text,
  flow_slugs text[],
  step_slugs text[]
)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_queue text := lower(register_worker.queue_name);
  v_bad record;
  v_state jsonb;
begin
  if cardinality(register_worker.flow_slugs) is distinct from cardinality(register_worker.step_slugs)
     or coalesce(cardinality(register_worker.flow_slugs), 0) = 0 then
    raise exception 'register_worker(): give the same number (at least one) of flow_slugs and step_slugs, got % and %',
      cardinality(register_worker.flow_slugs), cardinality(register_worker.step_slugs)
      using errcode = 'invalid_parameter_value';
  end if;

  select p.flow_slug, p.step_slug, s.queue_name as route, f.flow_slug as flow
  into v_bad
  from unnest(register_worker.flow_slugs, register_worker.step_slugs) as p(flow_slug, step_slug)
  left join pgflow.flows f on f.flow_slug = p.flow_slug
  left join pgflow.steps s on s.flow_slug = p.flow_slug and s.step_slug = p.step_slug
  where s.queue_name is distinct from v_queue
  limit 1;
  if found then
    if v_bad.flow is null then
      raise exception 'Worker subscription for flow "%" cannot be registered: the flow does not exist.', v_bad.flow_slug
        using errcode = 'PF020',
              hint = 'Call pgflow.ensure_flow_compiled() before registering workers.';
    elsif v_bad.route is null then
      raise exception 'Worker subscription for step "%" of flow "%" cannot be registered: the flow has no such step.',
          v_bad.step_slug, v_bad.flow_slug
        using errcode = 'PF020',
              hint = 'The worker''s flow definition differs from the compiled one; deploy matching code.';
    else
      raise exception 'Worker subscription for flow "%" step "%" cannot be registered on queue "%".',
          v_bad.flow_slug, v_bad.step_slug, v_queue
        using errcode = 'PF020',
              detail = format('The persisted route of the step is the queue "%s".', v_bad.route),
              hint = 'Poll the queue that ensure_flow_compiled() persisted (pgflow.flow_routes()), or register only the steps routed to this queue.';
    end if;
  end if;

  v_state := pgflow.track_worker_function(register_worker.function_name);

  insert into pgflow.workers as w (worker_id, queue_name, function_name, started_at, last_heartbeat_at, stopped_at)
  values (register_worker.worker_id, v_queue, register_worker.function_name, clock_timestamp(),
          clock_timestamp(), null)
  on conflict on constraint workers_pkey do update
    set queue_name = excluded.queue_name, function_name = excluded.function_name,
        last_heartbeat_at = excluded.last_heartbeat_at, stopped_at = null;

  delete from pgflow.worker_routes wr where wr.worker_id = register_worker.worker_id;
  insert into pgflow.worker_routes (worker_id, flow_slug, step_slug)
  select distinct register_worker.worker_id, p.flow_slug, p.step_slug
  from unnest(register_worker.flow_slugs, register_worker.step_slugs) as p(flow_slug, step_slug);

  return v_state || jsonb_build_object(
    'worker_id', register_worker.worker_id, 'queue_name', v_queue,
    'pairs', (select jsonb_agg(jsonb_build_array(p.flow_slug, p.step_slug))
              from unnest(register_worker.flow_slugs, register_worker.step_slugs) as p(flow_slug, step_slug)));
end;
$$;

-- pgflow.queue_coverage: every persisted route, one row per step of every flow, in step order (as in 0013),
-- with the live workers that cover it: a worker polling the route's queue that registered the route's
-- (flow, step) pair, or that registered no pairs at all (a worker registered the upstream way serves its whole
-- queue). Counting reads only started step states, never task history.
create view pgflow.queue_coverage as
select s.flow_slug,
       s.step_slug,
       s.step_index,
       f.queue_mode,
       s.queue_name,
       coalesce(t.queued, 0) as queued_tasks,
       coalesce(t.started, 0) as started_tasks,
       t.oldest_queued_at,
       now() - t.oldest_queued_at as oldest_queued_age,
       coalesce(w.live, 0) as live_workers,
       coalesce(w.ids, '{}'::uuid[]) as live_worker_ids,
       coalesce(t.queued, 0) > 0 and coalesce(w.live, 0) = 0 as uncovered
from pgflow.steps s
join pgflow.flows f on f.flow_slug = s.flow_slug
left join lateral (
  select count(*) filter (where st.status = 'queued') as queued,
         count(*) filter (where st.status = 'started') as started,
         min(st.queued_at) filter (where st.status = 'queued') as oldest_queued_at
  from pgflow.step_states ss
  join pgflow.step_tasks st on st.run_id = ss.run_id and st.step_slug = ss.step_slug
  where ss.flow_slug = s.flow_slug and ss.step_slug = s.step_slug and ss.status = 'started'
) t on true
left join lateral (
  select count(*) as live, array_agg(wk.worker_id order by wk.worker_id) as ids
  from pgflow.workers wk
  left join pgflow.worker_functions wf on wf.function_name = wk.function_name
  where wk.queue_name = s.queue_name
    and (exists (select 1 from pgflow.worker_routes wr
                 where wr.worker_id = wk.worker_id and wr.flow_slug = s.flow_slug and wr.step_slug = s.step_slug)
         or not exists (select 1 from pgflow.worker_routes wr where wr.worker_id = wk.worker_id))
    and wk.stopped_at is null
    and wk.last_heartbeat_at > now() - pgflow._worker_liveness_window()
    and coalesce(wf.enabled, true)
) w on true;

comment on view pgflow.queue_coverage is
  'Every persisted route (flow, step, queue mode, queue) with queued/started task counts, the oldest queued task, and live covering workers; uncovered = queued work and no live worker.';

------------------------------------------------------------------------------------------------------------
-- Startup coverage and drain checks
------------------------------------------------------------------------------------------------------------

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
returns table (flow_slug text, step_slug text, reason text, count bigint, examples jsonb)
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
returns table (flow_slug text, step_slug text, reason text, count bigint, examples jsonb, repair text)
language sql
stable
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

-- Whether concrete version `flow_slug` can be retired from queue `queue_name` (its handlers removed from the
-- workers of that queue): no alias points at it with a step routed there, no started run of it can still
-- reach the queue, and no executable or recoverable task of it remains there. Returns
--   {"flow_slug", "queue_name", "retirable", "blockers": [{"step_slug", "reason", "count", "examples"}]}
create function pgflow.version_retirable(flow_slug text, queue_name text)
returns jsonb
language sql
stable
set search_path = ''
as $$
  select jsonb_build_object(
    'flow_slug', version_retirable.flow_slug,
    'queue_name', lower(version_retirable.queue_name),
    'retirable', count(q.*) = 0,
    'blockers', coalesce(jsonb_agg(jsonb_build_object('step_slug', q.step_slug, 'reason', q.reason,
                                                      'count', q.count, 'examples', q.examples)
                                   order by q.step_slug, q.reason) filter (where q.flow_slug is not null),
                         '[]'::jsonb))
  from pgflow._queue_requirements(version_retirable.queue_name) q
  where q.flow_slug = version_retirable.flow_slug;
$$;

------------------------------------------------------------------------------------------------------------
-- Privileges (0014): the worker and client entry points of this migration
------------------------------------------------------------------------------------------------------------

create or replace function pgflow._worker_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.ensure_flow_compiled(text,jsonb,boolean,text,jsonb,text,boolean)',
    'pgflow.flow_routes(text)',
    'pgflow.resolve_step_queues(text,text[])',
    'pgflow.register_worker(uuid,text,text,text[],text[])',
    'pgflow.queue_coverage_gaps(text,text[],text[])',
    'pgflow.version_retirable(text,text)',
    'pgflow.track_worker_function(text)',
    'pgflow.worker_heartbeat(uuid)',
    'pgflow.mark_worker_stopped(uuid)',
    'pgflow.disable_worker_function(text,text)',
    'pgflow.claim_tasks(text,bigint[],uuid,text[],text[])',
    'pgflow.read_and_claim_tasks(text,integer,integer,uuid,text[],text[])',
    'pgflow.start_tasks(text,bigint[],uuid)',
    'pgflow.start_tasks(text,bigint[],uuid,text)',
    'pgflow.set_vt_batch(text,bigint[],integer[])',
    'pgflow.complete_task(uuid,text,integer,jsonb)',
    'pgflow.complete_task(uuid,text,integer,jsonb,integer,uuid)',
    'pgflow.complete_tasks(uuid[],text[],integer[],jsonb[],integer[],uuid)',
    'pgflow.fail_task(uuid,text,integer,text)',
    'pgflow.fail_task(uuid,text,integer,text,integer,uuid,integer,boolean)',
    'pgflow.release_worker_tasks(uuid)',
    'pgflow.requeue_stalled_tasks()',
    'pgflow.requeue_dead_worker_tasks(interval)',
    'pgflow.run_maintenance(interval,interval,integer)'
  ]
$$;

create or replace function pgflow._client_api()
returns text[]
language sql
immutable
as $$
  select array[
    'pgflow.start_flow(text,jsonb,uuid)',
    'pgflow.start_flow_with_states(text,jsonb,uuid)',
    'pgflow.get_run_with_states(uuid)',
    'pgflow.run_channel(uuid)',
    'pgflow.resolve_flow_slug(text)'
  ]
$$;

do $$
declare
  v_fn text;
begin
  foreach v_fn in array pgflow._worker_api() || pgflow._client_api() loop
    execute format('alter function %s security definer', v_fn::regprocedure);
  end loop;
end;
$$;

revoke execute on all functions in schema pgflow from public;
