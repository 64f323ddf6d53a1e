//! Runnable pgflow-rs examples. Each binary in `src/bin` runs end to end against a real Postgres.

pub mod community;
