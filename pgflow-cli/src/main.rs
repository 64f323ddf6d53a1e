//! `pgflow`: the operator's command line for pgflow-rs.
//!
//! Installs the SQL core, shows queues, workers and runs, and controls runs (cancel, retry, replay) and
//! rollouts (aliases, the fence, retirement, retention) by calling the SQL core's own functions. Every read
//! command prints a table for people, or JSON with `--json`. Exit codes: 0 success, 1 error, 2 usage.

use std::process::ExitCode;

use clap::Parser;

mod cli;
mod commands;
mod dag;
mod db;
mod filters;
mod output;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        // Usage errors exit 2; `--help` and `--version` print and exit 0.
        Err(e) => e.exit(),
    };
    match commands::run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pgflow: {e:#}");
            ExitCode::FAILURE
        }
    }
}
