//! `prune --older-than`: `pgflow.prune_history` batch after batch, with a progress bar of the runs deleted
//! towards the count its dry run gives first.

use serde::{Deserialize, Serialize};
use sqlx::types::Json;
use sqlx::PgPool;

use crate::cli::PruneArgs;
use crate::db::{explain, About};
use crate::output::{self, Out};

/// The count a dry run of `pgflow.prune_history` answers.
#[derive(Debug, Deserialize)]
struct DryRun {
    runs: u64,
}

/// What one call of `pgflow.prune_history` deleted (a missing field is a decode error, never zero).
#[derive(Debug, Default, Deserialize, Serialize)]
struct Pruned {
    runs: i64,
    archived_messages: i64,
    workers: i64,
    events: i64,
}

/// Calls `pgflow.prune_history(older_than, batch)` until a batch deletes fewer runs than its bound (as the
/// function's contract says: call it again while a count equals its bound).
pub(crate) async fn prune(pool: &PgPool, out: Out, args: &PruneArgs) -> anyhow::Result<()> {
    let batch = i32::try_from(args.batch).unwrap_or(i32::MAX);
    let archived_bound = i64::from(batch) * 10;
    // The total first: the same selection, counted (`dry_run`), changing nothing.
    let Json(total): Json<DryRun> =
        sqlx::query_scalar("select pgflow.prune_history($1, $2, dry_run => true)")
            .bind(args.older_than)
            .bind(batch)
            .fetch_one(pool)
            .await
            .map_err(|e| explain(e, About::Nothing))?;
    let bar = output::progress(out, "finished runs deleted", total.runs);
    let mut sum = Pruned::default();
    loop {
        let result: Json<Pruned> = match sqlx::query_scalar("select pgflow.prune_history($1, $2)")
            .bind(args.older_than)
            .bind(batch)
            .fetch_one(pool)
            .await
        {
            Ok(v) => v,
            Err(e) => {
                bar.abandon();
                return Err(explain(e, About::Nothing).context(format!(
                    "{} run(s) were deleted before the error; run the command again for the rest",
                    sum.runs
                )));
            }
        };
        let Pruned {
            runs: r,
            archived_messages: a,
            workers: w,
            events: e,
        } = result.0;
        sum.runs += r;
        sum.archived_messages += a;
        sum.workers += w;
        sum.events += e;
        let r = u64::try_from(r).unwrap_or(0);
        output::advance(&bar, r);
        // Archived messages and events are bounded at ten times the batch per call.
        if r < u64::from(args.batch)
            && a < archived_bound
            && w < i64::from(batch)
            && e < archived_bound
        {
            break;
        }
    }
    bar.finish_and_clear();
    if out.json {
        return out.json(&sum);
    }
    output::line(&format!(
        "deleted {} finished run(s) older than {}, {} archived message(s), {} stopped worker row(s) and {} \
         event(s)",
        sum.runs,
        humantime::format_duration(args.older_than),
        sum.archived_messages,
        sum.workers,
        sum.events
    ))
}
