//! Runtime integration tests: workers and the client against real PostgreSQL and real PGMQ.
//!
//! One binary, one module per area. Every test gets a fresh database with PGMQ and all migrations.

mod admin;
mod client;
mod compat;
mod failures;
mod flow_control;
mod flows;
mod pooler;
mod queue_workers;
mod reliability;
mod retention;
mod rollout;
mod run_control;
mod schedules;
mod shutdown;
mod steps;
mod support;
mod zero_config;
