//! `pgflow-sql`: print the install script, or install pgflow into `DATABASE_URL`.
//!
//! ```text
//! pgflow-sql script               print the complete pgflow install script (PGMQ excluded)
//! pgflow-sql install              install PGMQ (when missing) and pgflow into $DATABASE_URL
//! pgflow-sql status               list the applied pgflow migrations of $DATABASE_URL
//! ```

use std::process::ExitCode;

const USAGE: &str = "usage: pgflow-sql <script|install|status>\n\
  script   print the complete pgflow install script (PGMQ excluded)\n\
  install  install PGMQ (when missing) and pgflow into $DATABASE_URL\n\
  status   list the applied pgflow migrations of $DATABASE_URL";

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let command = std::env::args().nth(1).unwrap_or_default();
    match command.as_str() {
        "script" => {
            use std::io::Write;
            // A reader that stops early (`| head`) is not an error of ours.
            match std::io::stdout().write_all(pgflow_sql::install_script().as_bytes()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("pgflow-sql: writing the script: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        "install" | "status" => match run(&command).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(message) => {
                eprintln!("pgflow-sql: {message}");
                ExitCode::FAILURE
            }
        },
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

async fn run(command: &str) -> Result<(), String> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "DATABASE_URL is not set; point it at the database to use".to_owned())?;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .map_err(|e| format!("cannot connect to DATABASE_URL: {e}"))?;
    if command == "install" {
        let report = pgflow_sql::install(&pool)
            .await
            .map_err(|e| e.to_string())?;
        println!(
            "PGMQ: {:?}; applied migrations: {:?}",
            report.pgmq, report.applied
        );
    } else {
        let mut conn = pool.acquire().await.map_err(|e| e.to_string())?;
        let applied = pgflow_sql::applied_versions(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        println!(
            "applied: {applied:?}; this build knows up to {}",
            pgflow_sql::latest_version()
        );
    }
    Ok(())
}
