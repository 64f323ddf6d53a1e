-- pgflow-rs SQL core: flow control costs less per claim.
-- - A limit slot row no longer has a foreign key to its task: the check ran one query per slot taken. The
--   slot trigger deletes a slot when its task leaves 'started', and delete_flow_and_data and prune_history
--   delete slots with their tasks. The primary key now leads with the queue, so it also counts a queue's
--   slots, and the separate queue index goes.
-- - A claim locks the key limits of its queue's steps (no longer found through the batch's tasks), and on a
--   queue without key limits whose free slots and tokens cover the batch it admits the whole batch without
--   the admission query.
-- - A task leaving 'started' looks for parked messages to wake only when its queue has any.

alter table pgflow.limit_slots drop constraint limit_slots_run_id_step_slug_task_index_fkey;
alter table pgflow.limit_slots drop constraint limit_slots_pkey;
alter table pgflow.limit_slots add constraint limit_slots_pkey primary key (queue_name, run_id, step_slug, task_index);
drop index pgflow.idx_limit_slots_queue;

-- ---- as in schema/16_flow_control.sql : pgflow._apply_limits ----
create or replace function pgflow._apply_limits(p_queue text, p_ids bigint[])
returns table(msg_id bigint, hide_until timestamptz)
language plpgsql
set search_path = ''
as $$
declare
  v_limit pgflow.queue_limits;
  v_free bigint;
  v_tokens double precision;
  v_now timestamptz := clock_timestamp();
  v_ids bigint[];
  v_runs uuid[];
  v_flows text[];
  v_steps text[];
  v_indexes integer[];
  v_keys text[];
  v_slot_keys text[];
  v_key_tokens double precision[];
  v_admitted boolean[];
  v_hide timestamptz[];
  v_full_keys text[];
  v_keyed boolean;
begin
  -- Lock order step 6: the queue's limit row, then the key limits of the queue's steps in (flow, step) order
  -- (all of them, which is at most a few rows, rather than finding the batch's steps through its tasks).
  select * into v_limit from pgflow.queue_limits l where l.queue_name = p_queue for update;
  perform 1 from pgflow.key_limits k
  join pgflow.steps s on s.flow_slug = k.flow_slug and s.step_slug = k.step_slug
  where s.queue_name = p_queue
  order by k.flow_slug, k.step_slug
  for update of k;
  v_keyed := found;

  if v_limit.max_started is not null then
    select v_limit.max_started - count(*) into v_free from pgflow.limit_slots s where s.queue_name = p_queue;
  end if;
  if v_limit.rate_limit is not null then
    v_tokens := least(v_limit.rate_limit::float8,
                      coalesce(v_limit.tokens, v_limit.rate_limit)
                      + v_limit.rate_limit * extract(epoch from v_now - coalesce(v_limit.refilled_at, v_now))
                        / extract(epoch from v_limit.rate_period));
    v_free := least(coalesce(v_free, floor(v_tokens)::bigint), floor(v_tokens)::bigint);
  end if;

  -- No key limit on the queue, and its free slots and tokens cover the whole batch: every task is admitted,
  -- in the same writes as below without the admission query.
  if not v_keyed and (v_free is null or v_free >= cardinality(p_ids)) then
    if v_limit.max_started is not null then
      insert into pgflow.limit_slots (run_id, step_slug, task_index, queue_name)
      select t.run_id, t.step_slug, t.task_index, p_queue
      from pgflow.step_tasks t
      where t.queue_name = p_queue and t.message_id = any (p_ids)
      on conflict do nothing;
    end if;
    delete from pgflow.parked_messages pm where pm.queue_name = p_queue and pm.msg_id = any (p_ids);
    if v_limit.rate_limit is not null then
      update pgflow.queue_limits l set tokens = v_tokens - cardinality(p_ids), refilled_at = v_now
      where l.queue_name = p_queue;
    end if;
    return;
  end if;

  select array_agg(a.msg_id order by a.msg_id), array_agg(a.run_id order by a.msg_id),
         array_agg(a.flow_slug order by a.msg_id), array_agg(a.step_slug order by a.msg_id),
         array_agg(a.task_index order by a.msg_id), array_agg(a.limit_key order by a.msg_id),
         array_agg(a.slot_key order by a.msg_id), array_agg(a.key_tokens order by a.msg_id),
         array_agg(a.admitted order by a.msg_id), array_agg(a.hide_until order by a.msg_id)
  into v_ids, v_runs, v_flows, v_steps, v_indexes, v_keys, v_slot_keys, v_key_tokens, v_admitted, v_hide
  from pgflow._limit_admission(p_queue, p_ids, v_limit, v_free, v_tokens, v_now) a;

  insert into pgflow.limit_slots (run_id, step_slug, task_index, queue_name, limit_key)
  select a.run_id, a.step_slug, a.task_index, p_queue, a.slot_key
  from unnest(v_runs, v_steps, v_indexes, v_slot_keys, v_admitted) as a(run_id, step_slug, task_index, slot_key, admitted)
  where a.admitted and (v_limit.max_started is not null or a.slot_key is not null)
  on conflict do nothing;

  delete from pgflow.parked_messages pm
  where pm.queue_name = p_queue
    and pm.msg_id in (select a.id from unnest(v_ids, v_admitted) as a(id, admitted) where a.admitted);

  if v_limit.rate_limit is not null then
    update pgflow.queue_limits l
    set tokens = v_tokens - (select count(*) from unnest(v_admitted) as a(admitted) where a.admitted),
        refilled_at = v_now
    where l.queue_name = p_queue;
  end if;
  perform pgflow._spend_key_tokens(v_flows, v_steps, v_keys, v_key_tokens, v_admitted, v_now);

  -- Held ones: parked until a slot frees or their token comes.
  insert into pgflow.parked_messages as pm (queue_name, msg_id, limit_key)
  select p_queue, a.id, a.limit_key
  from unnest(v_ids, v_keys, v_admitted) as a(id, limit_key, admitted)
  where not a.admitted
  on conflict on constraint parked_messages_pkey do update set parked_at = excluded.parked_at;

  -- A key whose slots are all taken: the rest of its visible backlog is parked now as well, so that the next
  -- reads reach the other keys' tasks at once instead of meeting this key's tasks batch by batch.
  if array_position(v_admitted, false) is not null then
    select array_agg(distinct a.slot_key) into v_full_keys
    from unnest(v_flows, v_steps, v_slot_keys, v_admitted) as a(flow_slug, step_slug, slot_key, admitted)
    join pgflow.key_limits k on k.flow_slug = a.flow_slug and k.step_slug = a.step_slug
    where not a.admitted and a.slot_key is not null
      and (select count(*) from pgflow.limit_slots s where s.limit_key = a.slot_key) >= k.max_per_key;
    if v_full_keys is not null then
      perform pgflow._park_key_backlog(p_queue, v_full_keys, v_ids,
                                       v_now + make_interval(secs => pgflow._park_seconds()));
    end if;
  end if;

  return query
  select a.id, a.hide from unnest(v_ids, v_admitted, v_hide) as a(id, admitted, hide) where not a.admitted order by a.id;
end;
$$;
-- ---- end pgflow._apply_limits ----

-- ---- as in schema/16_flow_control.sql : pgflow._free_limit_slot ----
create or replace function pgflow._free_limit_slot()
returns trigger
language plpgsql
set search_path = ''
as $$
declare
  v_slot pgflow.limit_slots;
  v_ids bigint[];
begin
  delete from pgflow.limit_slots s
  where s.queue_name = old.queue_name and s.run_id = old.run_id and s.step_slug = old.step_slug
    and s.task_index = old.task_index
  returning * into v_slot;
  -- No slot, or nothing parked on the queue (while the limits do not bind): nothing to wake.
  if v_slot is null
     or not exists (select 1 from pgflow.parked_messages pm where pm.queue_name = v_slot.queue_name) then
    return null;
  end if;
  select array_agg(x.msg_id order by x.msg_id) into v_ids
  from (
    (select pm.msg_id from pgflow.parked_messages pm
     where pm.queue_name = v_slot.queue_name and v_slot.limit_key is not null and pm.limit_key = v_slot.limit_key
     order by pm.parked_at limit 1)
    union
    (select pm.msg_id from pgflow.parked_messages pm
     where pm.queue_name = v_slot.queue_name
       and exists (select 1 from pgflow.queue_limits l where l.queue_name = v_slot.queue_name and l.max_started is not null)
     order by pm.parked_at limit 1)
  ) x;
  if v_ids is null then
    return null;
  end if;
  v_ids := pgflow._lock_messages(v_slot.queue_name, v_ids, true);
  if cardinality(v_ids) > 0 then
    delete from pgflow.parked_messages pm where pm.queue_name = v_slot.queue_name and pm.msg_id = any (v_ids);
    perform pgflow._queue_op(v_slot.queue_name, 'visibility', v_ids,
                             array(select clock_timestamp() from unnest(v_ids)), 0);
  end if;
  return null;
end;
$$;
-- ---- end pgflow._free_limit_slot ----

-- ---- as in schema/05_definitions.sql : pgflow.delete_flow_and_data ----
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
-- ---- end pgflow.delete_flow_and_data ----

-- ---- as in schema/11_maintenance.sql : pgflow.prune_history ----
create or replace function pgflow.prune_history(older_than interval, max_runs int default 1000, dry_run boolean default false)
returns jsonb
language plpgsql
volatile
set search_path = ''
as $$
declare
  v_cutoff timestamptz := now() - older_than;
  v_runs constant text := 'select r.run_id from pgflow.runs r
    where r.status <> ''started'' and coalesce(r.completed_at, r.failed_at, r.cancelled_at) < $1';
  v_run_ids uuid[];
  v_group record;
  v_queue text;
  v_n int;
  v_archived bigint := 0;
  v_workers int;
begin
  if older_than is null or older_than < interval '0' or coalesce(max_runs, 0) < 1 or dry_run is null then
    raise exception 'prune_history(): older_than must be a non-negative interval, max_runs at least 1 and dry_run true or false (got %, %, %)',
      older_than, max_runs, dry_run
      using errcode = 'invalid_parameter_value';
  end if;

  if dry_run then
    execute 'select count(*) from (' || v_runs || ') x' into v_n using v_cutoff;
    return jsonb_build_object('runs', v_n, 'dry_run', true);
  end if;

  execute 'select array_agg(x.run_id) from (' || v_runs
          || ' order by coalesce(r.completed_at, r.failed_at, r.cancelled_at) limit $2 for update skip locked) x'
  into v_run_ids
  using v_cutoff, max_runs;
  v_run_ids := coalesce(v_run_ids, '{}');

  for v_group in
    select t.queue_name, array_agg(t.message_id) as ids
    from pgflow.step_tasks t
    where t.run_id = any (v_run_ids) and t.message_id is not null
    group by t.queue_name
  loop
    if pgflow._queue_meta_name(v_group.queue_name) is not null then
      perform pgmq.delete(v_group.queue_name, v_group.ids);
      execute format('delete from pgmq.%I where msg_id = any ($1)',
                     pgmq.format_table_name(v_group.queue_name, 'a'))
      using v_group.ids;
    end if;
  end loop;

  delete from pgflow.run_watchers w where w.run_id = any (v_run_ids);
  delete from pgflow.task_attempts a where a.run_id = any (v_run_ids);
  -- A finished run's tasks hold no limit slot (each went when its task left 'started'); this only guards
  -- against a stray one.
  delete from pgflow.limit_slots ls where ls.run_id = any (v_run_ids);
  delete from pgflow.step_tasks t where t.run_id = any (v_run_ids);
  delete from pgflow.step_states ss where ss.run_id = any (v_run_ids);
  delete from pgflow.runs r where r.run_id = any (v_run_ids);

  for v_queue in select distinct s.queue_name from pgflow.steps s order by 1 loop
    if pgflow._queue_meta_name(v_queue) is not null then
      execute format(
        'delete from pgmq.%1$I where msg_id in (
           select a.msg_id from pgmq.%1$I a where a.archived_at < $1 order by a.archived_at limit $2)',
        pgmq.format_table_name(v_queue, 'a'))
      using v_cutoff, max_runs * 10;
      get diagnostics v_n = row_count;
      v_archived := v_archived + v_n;
    end if;
  end loop;

  -- Idempotency keys past their window (the keys of the runs deleted above went with them).
  delete from pgflow.idempotency_keys k
  where (k.flow_name, k.idempotency_key) in (
    select o.flow_name, o.idempotency_key from pgflow.idempotency_keys o
    where o.expires_at < now()
    order by o.expires_at
    limit max_runs * 10);

  delete from pgflow.workers w
  where w.worker_id in (
    select o.worker_id from pgflow.workers o
    where coalesce(o.stopped_at, o.last_heartbeat_at) < v_cutoff
      -- Still named by a retained task: kept until that task goes, so a deletion never has to touch tasks.
      and not exists (select 1 from pgflow.step_tasks t where t.last_worker_id = o.worker_id)
    order by coalesce(o.stopped_at, o.last_heartbeat_at)
    limit max_runs
    for update skip locked);
  get diagnostics v_workers = row_count;

  -- The event log: oldest first, at most max_runs * 10 per call, like archived messages.
  delete from pgflow.events e
  where e.event_id in (
    select o.event_id from pgflow.events o where o.occurred_at < v_cutoff
    order by o.occurred_at limit max_runs * 10);
  get diagnostics v_n = row_count;

  return jsonb_build_object('runs', cardinality(v_run_ids), 'archived_messages', v_archived,
                            'workers', v_workers, 'events', v_n);
end;
$$;
-- ---- end pgflow.prune_history ----
