//! Compile-pass and compile-fail tests for the pgflow-rs macros live in `tests/`.
