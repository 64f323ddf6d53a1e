//! `with-throwaway-postgres CMD [ARGS...]`: run a command with `DATABASE_URL` pointing at a server.
//!
//! When `DATABASE_URL` is already set, the command simply runs against it. Otherwise a throwaway
//! cluster (fast settings: no fsync) is started, `DATABASE_URL` points at its `postgres` database,
//! the command runs, and the cluster is removed afterwards, whatever the command's outcome. All test
//! processes of a run then share one cluster, and each test still gets its own database.

use std::process::{Command, ExitCode};

use pgflow_sql::throwaway::{Durability, TempPostgres};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let Some(program) = args.next() else {
        eprintln!("usage: with-throwaway-postgres CMD [ARGS...]");
        return ExitCode::from(2);
    };
    let args: Vec<String> = args.collect();
    let mut command = Command::new(&program);
    command.args(&args);

    let _cluster = match std::env::var("DATABASE_URL") {
        Ok(url) if !url.is_empty() => None,
        _ => match TempPostgres::start(Durability::Fast).await {
            Ok(cluster) => {
                command.env("DATABASE_URL", cluster.url("postgres"));
                eprintln!(
                    "with-throwaway-postgres: throwaway PostgreSQL on 127.0.0.1:{}",
                    cluster.port()
                );
                Some(cluster)
            }
            Err(e) => {
                eprintln!("with-throwaway-postgres: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    match command.status() {
        Ok(status) => match status.code() {
            Some(0) => ExitCode::SUCCESS,
            Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
            None => ExitCode::FAILURE,
        },
        Err(e) => {
            eprintln!("with-throwaway-postgres: cannot run {program}: {e}");
            ExitCode::FAILURE
        }
    }
}
