-- The pgflow schema, and small pure helpers that tables and functions build on.
--
-- Owns: the schema itself; slug validation; the retry-delay formula and its cap; the timing buffers of claims,
-- stalls and recovery; the minimum interval between queue signals; the plan reset once the tables grow.
-- Upstream interface: is_valid_slug, is_local, calculate_retry_delay.

create schema if not exists pgflow;
comment on schema pgflow is 'pgflow-rs: Postgres-native DAG workflows (upstream-compatible SQL core)';

-- A slug is an identifier-like name: letter or underscore first, then letters, digits or underscores,
-- at most 128 characters, and never the reserved word `run` (step inputs use step slugs as keys).
create function pgflow.is_valid_slug(slug text)
returns boolean
language plpgsql
immutable
set search_path = ''
as $$
begin
  return slug is not null
    and slug <> ''
    and length(slug) <= 128
    and slug ~ '^[a-zA-Z_][a-zA-Z0-9_]*$'
    and slug <> 'run';
end;
$$;

-- Whether this database is a local development database, where `ensure_flow_compiled` may recompile a flow
-- destructively when its shape changed.
--
-- Two ways to say "local":
--   * the Supabase CLI's fixed local JWT secret in `app.settings.jwt_secret` (upstream's rule);
--   * outside Supabase: `ALTER DATABASE <db> SET pgflow.local = 'true'` (or `SET pgflow.local = 'true'` in a
--     session). Production databases must never set it.
create function pgflow.is_local()
returns boolean
language sql
stable parallel safe
set search_path = ''
as $$
  select coalesce(
      current_setting('app.settings.jwt_secret', true)
        = 'super-secret-jwt-token-with-at-least-32-characters-long',
      false)
    or coalesce(lower(current_setting('pgflow.local', true)) in ('true', 'on', '1', 'yes'), false);
$$;

-- The longest delay, in seconds, that a retry may wait: one day. Both the computed backoff and a
-- handler-chosen delay are capped at it.
create function pgflow._max_retry_delay_seconds()
returns integer
language sql
immutable parallel safe
as $$ select 86400 $$;

-- Exponential backoff: the delay before the next attempt, after `attempts_count` attempts so far:
-- base_delay * 2^attempts_count seconds, capped at pgflow._max_retry_delay_seconds() (one day). Computed in
-- numeric with a bounded exponent, so no attempt count or base delay overflows; negative inputs count as 0.
create function pgflow.calculate_retry_delay(base_delay numeric, attempts_count integer)
returns integer
language sql
immutable parallel safe
set search_path = ''
as $$
  select least(
    floor(greatest(coalesce(base_delay, 0), 0)
          * power(2::numeric, least(greatest(coalesce(attempts_count, 0), 0), 64))),
    pgflow._max_retry_delay_seconds())::int;
$$;

-- Timing buffers, in seconds, in one place.
--
-- A claimed task's message is kept invisible for (effective step timeout + claim buffer): the worker enforces
-- the timeout itself, and the buffer covers the round trip that reports the result.
--
-- A started task counts as stalled once it has been running for (effective step timeout + stall buffer).
-- The stall buffer is larger than the claim buffer, so a task is never requeued while its claim visibility
-- (and a late but honest result) is still pending.
--
-- "Effective step timeout" is always coalesce(steps.opt_timeout, flows.opt_timeout).
create function pgflow._claim_visibility_buffer_seconds()
returns integer
language sql
immutable parallel safe
as $$ select 2 $$;

create function pgflow._stall_buffer_seconds()
returns integer
language sql
immutable parallel safe
as $$ select 30 $$;

-- The recovery boundary of a started task: from this moment on, requeue_stalled_tasks() may requeue it
-- (started_at + effective step timeout + stall buffer). claim_tasks hides a duplicate message of a started
-- task until exactly this moment, so claim visibility and stalled recovery share one rule.
-- Computed in double precision, so a timeout near the int maximum cannot overflow.
create function pgflow._recovery_boundary(p_started_at timestamp with time zone, p_effective_timeout integer)
returns timestamp with time zone
language sql
stable parallel safe
as $$
  select p_started_at
    + make_interval(secs => p_effective_timeout::float8 + pgflow._stall_buffer_seconds())
$$;

-- The shortest time between two signals of one queue.
create function pgflow._signal_interval()
returns interval
language sql
immutable parallel safe
as $$ select interval '5 milliseconds' $$;

create function pgflow._replan_if_grown()
returns void
language plpgsql
set search_path = ''
as $$
declare
  v_pages bigint := (pg_relation_size('pgflow.runs'::regclass) + pg_relation_size('pgflow.step_states'::regclass)
                     + pg_relation_size('pgflow.step_tasks'::regclass)) / current_setting('block_size')::int;
  v_planned bigint := nullif(current_setting('pgflow.planned_pages', true), '')::bigint;
begin
  if v_planned is not null and v_pages > 2 * v_planned + 16 then
    discard plans;
  elsif v_planned is not null and v_pages >= v_planned then
    return;
  end if;
  -- First call of the session (its plans are about to be built), a replan, or tables that shrank (plans
  -- built on larger tables stay good; growth is measured from the smaller size).
  perform set_config('pgflow.planned_pages', v_pages::text, false);
end;
$$;

-- The role behind this call: the session's current role (SET ROLE included), never the owner that a
-- SECURITY DEFINER function runs as.
create function pgflow._caller_role()
returns text
language sql
stable
set search_path = ''
as $$
  select coalesce(nullif(current_setting('role'), 'none'), session_user::text)
$$;

-- Whether the role behind this call is an admin, who may destroy data (delete a flow's runs) or touch queues
-- that are not pgflow's: the owner of schema pgflow, a role with its privileges, or a superuser.
create function pgflow._caller_is_admin()
returns boolean
language sql
stable
set search_path = ''
as $$
  select coalesce(bool_or(pg_has_role(pgflow._caller_role()::name, n.nspowner, 'USAGE')), false)
  from pg_catalog.pg_namespace n
  where n.nspname = 'pgflow'
$$;
