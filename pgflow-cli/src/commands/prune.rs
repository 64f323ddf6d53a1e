//! `prune --older-than`: `pgflow.prune_history` batch after batch, with a progress bar of the runs deleted
//! towards the count its dry run gives first.

use serde_json::{json, Value};
use sqlx::PgPool;

use crate::cli::PruneArgs;
use crate::db::{explain, About};
use crate::output::{self, Out};

/// Calls `pgflow.prune_history(older_than, batch)` until a batch deletes fewer runs than its bound (as the
/// function's contract says: call it again while a count equals its bound).
pub(crate) async fn prune(pool: &PgPool, out: Out, args: &PruneArgs) -> anyhow::Result<()> {
    let batch = i32::try_from(args.batch).unwrap_or(i32::MAX);
    let archived_bound = i64::from(batch) * 10;
    // The total first: the same selection, counted (`dry_run`), changing nothing.
    let total: Value = sqlx::query_scalar("select pgflow.prune_history($1, $2, dry_run => true)")
        .bind(args.older_than)
        .bind(batch)
        .fetch_one(pool)
        .await
        .map_err(|e| explain(e, About::Nothing))?;
    let total = total["runs"].as_u64().unwrap_or(0);
    let bar = output::progress(out, "finished runs deleted", total);
    let (mut runs, mut archived, mut workers, mut events) = (0i64, 0i64, 0i64, 0i64);
    loop {
        let result: Value = match sqlx::query_scalar("select pgflow.prune_history($1, $2)")
            .bind(args.older_than)
            .bind(batch)
            .fetch_one(pool)
            .await
        {
            Ok(v) => v,
            Err(e) => {
                bar.abandon();
                return Err(explain(e, About::Nothing).context(format!(
                    "{runs} run(s) were deleted before the error; run the command again for the rest"
                )));
            }
        };
        let count = |k: &str| result[k].as_i64().unwrap_or(0);
        let (r, a, w, e) = (
            count("runs"),
            count("archived_messages"),
            count("workers"),
            count("events"),
        );
        runs += r;
        archived += a;
        workers += w;
        events += e;
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
        return out.json(&json!({
            "runs": runs,
            "archived_messages": archived,
            "workers": workers,
            "events": events,
        }));
    }
    output::line(&format!(
        "deleted {runs} finished run(s) older than {}, {archived} archived message(s), {workers} stopped worker \
         row(s) and {events} event(s)",
        humantime::format_duration(args.older_than)
    ))
}
