//! One function per command. Each calls the SQL core's functions (through the runtime's client where it
//! has a method), and prints a table or, with `--json`, a JSON document.

use crate::cli::{Cli, Command};
use crate::db;
use crate::output::{self, Out};

mod control;
mod dashboard;
mod install;
mod prune;
mod read;
mod rollout;
mod schedules;

/// Runs the command `cli` names.
pub(crate) async fn run(cli: Cli) -> anyhow::Result<()> {
    let out = Out { json: cli.json };
    let url = cli.database_url.as_deref();
    match cli.command {
        Command::Sql if out.json => out.json(&serde_json::json!({
            "latest": pgflow_sql::latest_version(),
            "sql": pgflow_sql::install_script(),
        })),
        Command::Sql => output::line(pgflow_sql::install_script().trim_end()),
        Command::Install => install::install(&db::connect(url).await?, out).await,
        Command::Status => read::status(&db::connect(url).await?, out).await,
        Command::Runs(args) => read::runs(&db::connect(url).await?, out, args).await,
        Command::Run { id } => read::run(&db::connect(url).await?, out, id).await,
        Command::Aliases => read::aliases(&db::connect(url).await?, out).await,
        Command::Cancel(args) => control::cancel(&db::connect(url).await?, out, args).await,
        Command::Retry { id } => control::retry(&db::connect(url).await?, out, id).await,
        Command::Replay { id, from_step } => {
            control::replay(&db::connect(url).await?, out, id, &from_step).await
        }
        Command::Activate { alias, flow_slug } => {
            rollout::activate(&db::connect(url).await?, out, &alias, &flow_slug).await
        }
        Command::Fence { function, reason } => {
            rollout::fence(&db::connect(url).await?, out, &function, &reason).await
        }
        Command::Unfence { function } => {
            rollout::unfence(&db::connect(url).await?, out, &function).await
        }
        Command::Retirable { flow_slug, queue } => {
            rollout::retirable(&db::connect(url).await?, out, &flow_slug, queue.as_deref()).await
        }
        Command::Prune(args) => prune::prune(&db::connect(url).await?, out, &args).await,
        Command::Dashboard(args) => dashboard::serve(&db::connect(url).await?, out, args).await,
        Command::Schedules { action } => {
            schedules::schedules(&db::connect(url).await?, out, action).await
        }
    }
}
