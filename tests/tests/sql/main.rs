//! SQL core integration tests: the pgflow schema's functions against real PostgreSQL and real PGMQ.
//!
//! One binary, one module per area. Every test gets a fresh database with PGMQ and all migrations.

mod attempt_history;
mod bad_input;
mod batch_completion;
mod claims;
mod compile;
mod concurrency;
mod conditions;
mod coverage;
mod deployments;
mod events;
mod exchange;
mod fencing;
mod flow_control;
mod flow_shapes;
mod hardening;
mod hot_paths;
mod lock_order;
mod maintenance;
mod observability;
mod priorities;
mod privileges;
mod queue_identity;
mod queue_names;
mod queue_ownership;
mod recovery;
mod retries;
mod review_defects;
mod review_defects_b;
mod run_control;
mod schedules;
mod start_many;
mod step_queues;
mod step_support;
mod support;
