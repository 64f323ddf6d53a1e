//! `dashboard`: serves `pgflow_dashboard` on an address until ctrl-c or SIGTERM.

use anyhow::{bail, Context};
use pgflow_dashboard::Dashboard;
use sqlx::PgPool;

use crate::cli::DashboardArgs;
use crate::output::{self, Out};

/// Serves the dashboard; returns when the process is asked to stop.
pub(crate) async fn serve(pool: &PgPool, out: Out, args: DashboardArgs) -> anyhow::Result<()> {
    let mut dashboard = Dashboard::new(pool.clone()).hide_payloads(args.hide_payloads);
    let writable = match &args.write_token_env {
        Some(var) => {
            let token = std::env::var(var).map_err(|_| {
                anyhow::anyhow!(
                    "the environment variable {var} (--write-token-env) is not set: export it with the write \
                     token, or leave out --write-token-env for a read-only dashboard"
                )
            })?;
            if token.trim().is_empty() {
                bail!("the environment variable {var} (--write-token-env) is empty: set it to the write token");
            }
            dashboard = dashboard.write_token(token);
            true
        }
        None => false,
    };
    let url = format!("http://{}/", args.listen);
    if out.json {
        out.json(&serde_json::json!({
            "url": url,
            "writable": writable,
            "hide_payloads": args.hide_payloads,
        }))?;
    } else {
        output::line(&format!(
            "pgflow dashboard on {url} ({}{}); stop it with ctrl-c",
            if writable {
                "write actions enabled"
            } else {
                "read-only"
            },
            if args.hide_payloads {
                ", payloads hidden"
            } else {
                ""
            },
        ))?;
    }
    tokio::select! {
        served = dashboard.serve(args.listen) => served.with_context(|| {
            format!("serving the dashboard on {}; pick a free port with --listen 127.0.0.1:PORT", args.listen)
        }),
        () = pgflow_runtime::worker::shutdown_signal() => Ok(()),
    }
}
