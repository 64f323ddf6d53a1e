-- pgflow-rs SQL core: the two lookups every exchange makes are planned once per session.
-- - _queue_limited (every claim) and _queue_aging_secs (every send of task messages) become PL/pgSQL. As SQL
--   functions that read a table they could not be inlined, so PostgreSQL parsed and planned their queries
--   again in every statement that called them (about 0.28 and 0.11 ms a call at half load).

-- ---- as in schema/16_flow_control.sql : pgflow._queue_limited ----
create or replace function pgflow._queue_limited(p_queue text)
returns boolean
language plpgsql
stable
set search_path = ''
as $$
begin
  return exists (select 1 from pgflow.queue_limits l where l.queue_name = p_queue)
      or exists (select 1 from pgflow.key_limits k
                 join pgflow.steps s on s.flow_slug = k.flow_slug and s.step_slug = k.step_slug
                 where s.queue_name = p_queue);
end;
$$;
-- ---- end pgflow._queue_limited ----

-- ---- as in schema/18_priorities.sql : pgflow._queue_aging_secs ----
create or replace function pgflow._queue_aging_secs(p_queue text)
returns double precision
language plpgsql
stable
set search_path = ''
as $$
begin
  return (select extract(epoch from qp.aging)::float8 from pgflow.queue_priorities qp
          where qp.queue_name = p_queue);
end;
$$;
-- ---- end pgflow._queue_aging_secs ----
