//! `cancel`, `retry`, `replay`: run control through the runtime's client (`pgflow.cancel_run`,
//! `cancel_runs`, `retry_run`, `replay_run`). Each action on one run is written to the operator record
//! (`pgflow.operator_actions`, source `cli`), refused ones too.

use anyhow::bail;
use pgflow_runtime::admin::ActionKind;
use pgflow_runtime::client::CancelFilter;
use pgflow_runtime::Client;
use serde_json::json;
use sqlx::PgPool;
use uuid::Uuid;

use crate::cli::CancelArgs;
use crate::db::{self, explain_client, About};
use crate::output::{self, Out};

/// Runs cancelled per transaction by a bulk cancel.
const CANCEL_BATCH: u32 = 500;

/// `cancel ID` or `cancel --flow .. --before .. --input-eq ..`.
pub(crate) async fn cancel(pool: &PgPool, out: Out, args: CancelArgs) -> anyhow::Result<()> {
    if let Some(id) = args.id {
        return cancel_one(pool, out, id, args.reason.as_deref()).await;
    }
    if args.flow.is_none() && args.before.is_none() && args.input_eq.is_none() && !args.all {
        bail!(
            "say which runs to cancel: a run id, or filters (--flow, --before, --input-eq), or --all for \
             every started run"
        );
    }
    let (filter, what) = cancel_filter(&args);
    let client = Client::new(pool.clone());
    // The total first: the same selection, counted (`dry_run`), changing nothing.
    let total = client
        .count_runs_to_cancel(&filter)
        .await
        .map_err(|e| explain_client(e, About::Nothing))?;
    if !args.yes && !output::confirm(&format!("cancel {what} ({total} now)?"))? {
        bail!("not cancelled: the answer was not yes");
    }

    let bar = output::progress(out, "runs cancelled", total);
    let mut cancelled = 0u64;
    loop {
        let n = client
            .cancel_runs_batch(&filter)
            .await
            .map_err(|e| explain_client(e, About::Nothing));
        let n = match n {
            Ok(n) => n,
            Err(e) => {
                bar.abandon();
                return Err(e.context(format!(
                    "{cancelled} run(s) were cancelled before the error; run the command again for the rest"
                )));
            }
        };
        cancelled += n;
        output::advance(&bar, n);
        if n < u64::from(CANCEL_BATCH) {
            break;
        }
    }
    bar.finish_and_clear();
    if out.json {
        return out.json(&json!({ "cancelled": cancelled }));
    }
    output::line(&format!("cancelled {cancelled} run(s)"))
}

/// `cancel ID`: one run, recorded in the operator record.
async fn cancel_one(pool: &PgPool, out: Out, id: Uuid, reason: Option<&str>) -> anyhow::Result<()> {
    let client = Client::new(pool.clone());
    let action = db::run_action(pool, ActionKind::Cancel, id).await;
    let outcome = client.cancel(id, reason).await;
    let detail = json!({ "reason": reason });
    let outcome = match outcome {
        Ok(o) => {
            let detail =
                json!({ "reason": reason, "status": o.status.as_str(), "changed": o.changed });
            db::record(pool, action.detail(detail)).await;
            o
        }
        Err(e) => {
            let e = explain_client(e, About::Run(id));
            db::record(pool, action.detail(detail).outcome(Err(format!("{e:#}")))).await;
            return Err(e);
        }
    };
    if out.json {
        return out.json(&json!({
            "run_id": id,
            "status": outcome.status.as_str(),
            "changed": outcome.changed,
            "reason": outcome.reason,
            "cancelled_at": outcome.cancelled_at,
        }));
    }
    output::line(&if outcome.changed {
        format!("run {id} cancelled")
    } else {
        format!(
            "run {id} was already {} (nothing changed)",
            outcome.status.as_str()
        )
    })
}

/// The bulk cancel's filter, and what it selects in words.
fn cancel_filter(args: &CancelArgs) -> (CancelFilter, String) {
    let mut filter = CancelFilter::new().batch_size(CANCEL_BATCH);
    let mut described = Vec::new();
    if let Some(flow) = &args.flow {
        filter = filter.flow(flow.clone());
        described.push(format!("of flow `{flow}`"));
    }
    if let Some(before) = args.before {
        filter = filter.started_before(before.0);
        described.push(format!("started before {}", output::time(Some(before.0))));
    }
    if let Some(m) = &args.input_eq {
        filter = filter.input_equals(m.path.clone(), m.value.clone());
        described.push(format!("with input {} = {}", m.path.join("."), m.value));
    }
    if let Some(reason) = &args.reason {
        filter = filter.reason(reason.clone());
    }
    let what = if described.is_empty() {
        "every started run".to_owned()
    } else {
        format!("the started runs {}", described.join(", "))
    };
    (filter, what)
}

/// `retry ID`.
pub(crate) async fn retry(pool: &PgPool, out: Out, id: Uuid) -> anyhow::Result<()> {
    let action = db::run_action(pool, ActionKind::Retry, id).await;
    let status = match Client::new(pool.clone()).retry(id).await {
        Ok(status) => {
            db::record(pool, action.detail(json!({ "status": status.as_str() }))).await;
            status
        }
        Err(e) => {
            let e = explain_client(e, About::Run(id));
            db::record(pool, action.outcome(Err(format!("{e:#}")))).await;
            return Err(e);
        }
    };
    if out.json {
        return out.json(&json!({ "run_id": id, "status": status.as_str() }));
    }
    output::line(&format!(
        "run {id} retried: now {}; follow it with `pgflow run {id}`",
        status.as_str()
    ))
}

/// `replay ID --from STEP`.
pub(crate) async fn replay(
    pool: &PgPool,
    out: Out,
    id: Uuid,
    from_step: &str,
) -> anyhow::Result<()> {
    let action = db::run_action(pool, ActionKind::Replay, id).await;
    let new_run = match Client::new(pool.clone()).replay(id, from_step).await {
        Ok(new_run) => {
            let detail = json!({ "from_step": from_step, "new_run_id": new_run });
            db::record(pool, action.detail(detail)).await;
            new_run
        }
        Err(e) => {
            let e = explain_client(e, About::Run(id));
            let detail = json!({ "from_step": from_step });
            db::record(pool, action.detail(detail).outcome(Err(format!("{e:#}")))).await;
            return Err(e);
        }
    };
    if out.json {
        return out.json(&json!({ "run_id": new_run, "replay_of": id, "from_step": from_step }));
    }
    output::line(&format!(
        "run {new_run} replays run {id} from step `{from_step}`; follow it with `pgflow run {new_run}`"
    ))
}
