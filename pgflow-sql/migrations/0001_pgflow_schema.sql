-- pgflow-rs SQL core, migration 0001: the pgflow schema itself.
-- Every later migration assumes this schema exists and that PGMQ is installed in schema pgmq.
create schema if not exists pgflow;
revoke all on schema pgflow from public;
comment on schema pgflow is 'pgflow-rs: Postgres-native DAG workflows (upstream-compatible SQL core)';
