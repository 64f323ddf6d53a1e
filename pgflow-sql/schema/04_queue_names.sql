-- Queue names, queue privacy, and the per-queue statement functions.
--
-- Owns: the PGMQ queue-name rule (at most 47 characters, lowercase: readable `flow__step`, else `flow__index`,
-- else the flow is refused; never truncated or hashed), the routes a flow persists, the checks that a flow's
-- private queues belong to nobody else, queue creation, and `pgflow._queue_ops_<queue>`: one PL/pgSQL
-- function per queue holding the statements on its PGMQ tables, planned once per session.

create function pgflow._max_queue_name_length()
returns integer
language sql
immutable parallel safe
as $$ select 47 $$;

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
returns table(step_index integer, step_slug text, queue_name text)
language plpgsql
stable security definer
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
returns table(step_index integer, step_slug text, queue_name text, queue_mode text)
language sql
stable security definer
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
create function pgflow._assert_step_queues_private(p_flow_slug text, p_step_slugs text[], p_queues text[], p_owned_by_flow boolean)
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

-- Serialises every claim on the given queue names: transaction-scoped advisory locks (key space 2), taken in
-- sorted order. Two compilations that would create, adopt or route to the same queue name therefore run one
-- after the other, whatever their flow slugs, and the second one sees what the first one persisted.
create function pgflow._lock_queue_names(p_names text[])
returns void
language plpgsql
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

-- The name of queue `p_queue`'s statements function (at most 11 + 47 characters, within the 63 allowed).
-- Immutable all through (quote_ident, not the stable format()), so PostgreSQL inlines it into its callers.
create function pgflow._queue_ops_name(p_queue text)
returns text
language sql
immutable
as $$
  select 'pgflow.' || quote_ident('_queue_ops_' || lower(p_queue))
$$;

-- Creates queue `p_queue`'s statements function unless it exists. Operations (ids are message ids):
--   lock              lock p_ids' live messages, in id order; returns those locked
--   lock_skip_locked  the same, skipping messages another transaction holds
--   lock_visible      lock up to p_n visible messages, oldest first, skipping held ones (as pgmq.read);
--                     returns them, or NULL when there is none
--   lock_visible_ranked  the same, lowest rank first (a queue with priorities, 18_priorities.sql: through
--                     its rank index; messages without a rank first, then by msg_id)
--   peek_visible      up to p_n visible messages, oldest first, without locking them (held ones too); returns
--                     their ids, or NULL when there is none
--   visibility        set each of p_ids' vt to p_vts' matching value, add p_n to read_ct and, when p_n is 1,
--                     stamp last_read_at; returns the ids updated
--   archive           move p_ids' messages to the archive table (as pgmq.archive); returns the ids moved
--   send              insert p_msgs with vt p_vts[i] (or p_vts[1] for all, when p_vts has one element) and
--                     headers p_headers (NULL: none), as pgmq.send_batch; with p_n > 0 they are sent as read
--                     p_n times (read_ct, last_read_at stamped): a claim's own messages; returns their ids,
--                     in p_msgs order
create function pgflow._create_queue_ops(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if to_regproc(pgflow._queue_ops_name(p_queue)) is not null then
    return;
  end if;
  execute format($f$
    create function %1$s(p_op text, p_ids bigint[], p_vts timestamptz[], p_n int, p_msgs jsonb[], p_headers jsonb[])
    returns bigint[]
    language plpgsql
    volatile
    as $body$
    declare
      v_ids bigint[];
    begin
      case p_op
      when 'lock' then
        select coalesce(array_agg(x.msg_id order by x.msg_id), '{}') into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.msg_id = any (p_ids) order by q.msg_id for update) x;
      when 'lock_skip_locked' then
        select coalesce(array_agg(x.msg_id order by x.msg_id), '{}') into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.msg_id = any (p_ids)
              order by q.msg_id for update skip locked) x;
      when 'lock_visible' then
        select array_agg(x.msg_id order by x.msg_id) into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.vt <= clock_timestamp()
              order by q.msg_id limit p_n for update skip locked) x;
      when 'lock_visible_ranked' then
        select array_agg(x.msg_id order by x.msg_id) into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.vt <= clock_timestamp()
              order by (q.headers ->> 'pgflow_rank')::float8 nulls first, q.msg_id
              limit p_n for update skip locked) x;
      when 'peek_visible' then
        select array_agg(x.msg_id order by x.msg_id) into v_ids
        from (select q.msg_id from pgmq.%2$I q where q.vt <= clock_timestamp()
              order by q.msg_id limit p_n) x;
      when 'visibility' then
        with updated as (
          update pgmq.%2$I q
          set vt = v.vt, read_ct = q.read_ct + p_n,
              last_read_at = case when p_n = 1 then clock_timestamp() else q.last_read_at end
          from unnest(p_ids, p_vts) as v(id, vt)
          where q.msg_id = v.id
          returning q.msg_id
        )
        select coalesce(array_agg(u.msg_id), '{}') into v_ids from updated u;
      when 'archive' then
        with archived as (
          delete from pgmq.%2$I q where q.msg_id = any (p_ids)
          returning q.msg_id, q.vt, q.read_ct, q.enqueued_at, q.last_read_at, q.message, q.headers
        ),
        moved as (
          insert into pgmq.%3$I (msg_id, vt, read_ct, enqueued_at, last_read_at, message, headers)
          select a.msg_id, a.vt, a.read_ct, a.enqueued_at, a.last_read_at, a.message, a.headers from archived a
          returning msg_id
        )
        select coalesce(array_agg(m.msg_id), '{}') into v_ids from moved m;
      when 'send' then
        with sent as (
          insert into pgmq.%2$I (vt, read_ct, last_read_at, message, headers)
          select coalesce(p_vts[m.ord], p_vts[1]), coalesce(p_n, 0),
                 case when p_n > 0 then clock_timestamp() end, m.message, p_headers[m.ord]
          from unnest(p_msgs) with ordinality as m(message, ord) order by m.ord
          returning msg_id
        )
        select array_agg(s.msg_id order by s.msg_id) into v_ids from sent s;
      else
        raise exception 'pgflow._queue_op(): unknown operation %%', p_op;
      end case;
      return v_ids;
    end;
    $body$
  $f$, pgflow._queue_ops_name(p_queue), pgmq.format_table_name(p_queue, 'q'),
     pgmq.format_table_name(p_queue, 'a'));
  -- Schema-level default privileges cannot take EXECUTE away from PUBLIC, so it is revoked here.
  execute format('revoke execute on function %s(text, bigint[], timestamptz[], int, jsonb[], jsonb[]) from public',
                 pgflow._queue_ops_name(p_queue));
exception
  -- Another transaction created it first.
  when duplicate_function or unique_violation then
    null;
end;
$$;

-- Drops queue `p_queue`'s statements function, if any (its queue is being dropped).
create function pgflow._drop_queue_ops(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  execute format('drop function if exists %s(text, bigint[], timestamptz[], int, jsonb[], jsonb[])',
                 pgflow._queue_ops_name(p_queue));
end;
$$;

-- Runs operation `p_op` (see _create_queue_ops) on queue `p_queue`'s messages.
create function pgflow._queue_op(p_queue text, p_op text, p_ids bigint[] default NULL::bigint[], p_vts timestamp with time zone[] default NULL::timestamp with time zone[], p_n integer default NULL::integer, p_msgs jsonb[] default NULL::jsonb[], p_headers jsonb[] default NULL::jsonb[])
returns bigint[]
language plpgsql
set search_path = ''
as $$
declare
  v_fn text := pgflow._queue_ops_name(p_queue);
  v_ids bigint[];
begin
  if to_regproc(v_fn) is null then
    perform pgflow._create_queue_ops(p_queue);
  end if;
  execute format('select %s($1, $2, $3, $4, $5, $6)', v_fn) into v_ids using p_op, p_ids, p_vts, p_n, p_msgs,
    p_headers;
  return v_ids;
end;
$$;

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
