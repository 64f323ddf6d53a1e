-- The comment in pgflow._create_queue_ops no longer names the migration that revoked PUBLIC's EXECUTE.
-- (`create or replace` resets a function's SET and SECURITY options: the definition restates them.)

create or replace function pgflow._create_queue_ops(p_queue text)
returns void
language plpgsql
set search_path = ''
as $$
begin
  if to_regproc(pgflow._queue_ops_name(p_queue)) is not null then
    return;
  end if;
  execute format($f$
    create function %1$s(p_op text, p_ids bigint[], p_vts timestamptz[], p_n int, p_msgs jsonb[])
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
          insert into pgmq.%2$I (vt, message)
          select p_vts[1], m.message from unnest(p_msgs) with ordinality as m(message, ord) order by m.ord
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
  execute format('revoke execute on function %s(text, bigint[], timestamptz[], int, jsonb[]) from public',
                 pgflow._queue_ops_name(p_queue));
exception
  -- Another transaction created it first.
  when duplicate_function or unique_violation then
    null;
end;
$$;
