//! The read commands: `status`, `runs`, `run ID` and `aliases`, on the runtime's read layer
//! (`pgflow_runtime::admin`), which holds every query; these only print its answers.

use anyhow::anyhow;
use pgflow_runtime::admin::{
    Admin, Attempt, CoverageGap, QueueInfo, RunDetail, RunFilter, RunInfo, TaskStatus,
    UncoveredRoute, WorkerFunction,
};
use pgflow_runtime::client::RunStatus;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

use crate::cli::RunsArgs;
use crate::dag;
use crate::db::{explain_admin, About};
use crate::output::{self, Out};

/// `status`: queues (depth, oldest message, live workers), routes no live worker covers, coverage gaps of
/// the queues' live workers, and fenced worker functions.
pub(crate) async fn status(pool: &PgPool, out: Out) -> anyhow::Result<()> {
    let admin = Admin::new(pool.clone());
    let err = |e| explain_admin(e, About::Nothing);
    let queues = admin.queues().await.map_err(err)?;
    let uncovered = admin.uncovered_routes().await.map_err(err)?;
    let gaps = admin.coverage_gaps().await.map_err(err)?;
    let functions = admin.worker_functions().await.map_err(err)?;
    let disabled: Vec<_> = functions.iter().filter(|f| !f.enabled).collect();

    if out.json {
        return out.json(&status_json(&queues, &uncovered, &gaps, &disabled));
    }
    print_status(&queues, &uncovered, &gaps, &disabled)
}

/// `status --json`: the four lists as JSON objects.
fn status_json(
    queues: &[QueueInfo],
    uncovered: &[UncoveredRoute],
    gaps: &[CoverageGap],
    disabled: &[&WorkerFunction],
) -> Value {
    json!({
        "queues": queues.iter().map(|q| json!({
            "queue_name": q.queue_name,
            "depth": q.depth,
            "oldest_age_seconds": q.oldest_age_seconds,
            "live_workers": q.live_workers,
            "fenced_workers": q.fenced_workers,
        })).collect::<Vec<_>>(),
        "uncovered_routes": uncovered.iter().map(|u| json!({
            "flow_slug": u.flow_slug,
            "step_slug": u.step_slug,
            "queue_name": u.queue_name,
            "queued_tasks": u.queued_tasks,
            "oldest_queued_at": u.oldest_queued_at,
        })).collect::<Vec<_>>(),
        "coverage_gaps": gaps.iter().map(|g| json!({
            "queue_name": g.queue_name,
            "flow_slug": g.flow_slug,
            "step_slug": g.step_slug,
            "reason": g.reason,
            "count": g.count,
            "examples": g.examples,
            "repair": g.repair,
        })).collect::<Vec<_>>(),
        "disabled_functions": disabled.iter().map(|f| json!({
            "function_name": f.function_name,
            "disabled_reason": f.disabled_reason,
            "disabled_at": f.disabled_at,
        })).collect::<Vec<_>>(),
    })
}

/// `status` for people: the four lists as tables.
fn print_status(
    queues: &[QueueInfo],
    uncovered: &[UncoveredRoute],
    gaps: &[CoverageGap],
    disabled: &[&WorkerFunction],
) -> anyhow::Result<()> {
    output::line("QUEUES")?;
    let mut table = output::table(["QUEUE", "DEPTH", "OLDEST", "LIVE WORKERS", "FENCED"]);
    for q in queues {
        table.add_row([
            q.queue_name.clone(),
            q.depth
                .map_or_else(|| "no queue".to_owned(), |d| d.to_string()),
            output::age(q.oldest_age_seconds),
            q.live_workers.to_string(),
            q.fenced_workers.to_string(),
        ]);
    }
    output::print_table(&table, "  (no queues: no flow is compiled yet)")?;

    output::line("")?;
    output::line("UNCOVERED ROUTES (queued work no live worker can run)")?;
    let mut table = output::table(["FLOW", "STEP", "QUEUE", "QUEUED", "SINCE"]);
    for u in uncovered {
        table.add_row([
            u.flow_slug.clone(),
            u.step_slug.clone(),
            u.queue_name.clone(),
            u.queued_tasks.to_string(),
            output::time(u.oldest_queued_at),
        ]);
    }
    output::print_table(&table, "  none")?;

    output::line("")?;
    output::line("COVERAGE GAPS (pairs a queue must carry that its live workers lack)")?;
    let mut table = output::table(["QUEUE", "FLOW", "STEP", "REASON", "COUNT", "REPAIR"]);
    for g in gaps {
        table.add_row([
            g.queue_name.clone(),
            g.flow_slug.clone(),
            g.step_slug.clone(),
            g.reason.to_string(),
            g.count.to_string(),
            g.repair.clone(),
        ]);
    }
    output::print_table(&table, "  none")?;

    output::line("")?;
    output::line("DISABLED WORKER FUNCTIONS")?;
    let mut table = output::table(["FUNCTION", "SINCE", "REASON"]);
    for f in disabled {
        table.add_row([
            f.function_name.clone(),
            output::time(f.disabled_at),
            f.disabled_reason.clone().unwrap_or_else(|| "-".to_owned()),
        ]);
    }
    output::print_table(&table, "  none")?;
    if !disabled.is_empty() {
        output::line("  lift a fence with `pgflow unfence FUNCTION` once the cause is fixed")?;
    }
    Ok(())
}

/// `runs`: one page of runs, newest first.
pub(crate) async fn runs(pool: &PgPool, out: Out, args: RunsArgs) -> anyhow::Result<()> {
    let mut filter = RunFilter::new().limit(args.limit);
    if let Some(flow) = &args.flow {
        filter = filter.flow(flow.clone());
    }
    if let Some(status) = args.status {
        filter = filter.status(status.into());
    }
    if let Some(since) = args.since {
        filter = filter.started_after(since.0);
    }
    if let Some(before) = args.before {
        filter = filter.started_before(before.0);
    }
    if let Some(m) = &args.input_eq {
        filter = filter.input_equals(m.path.clone(), m.value.clone());
    }
    if let Some(cursor) = args.after {
        filter = filter.after(cursor);
    }
    let page = Admin::new(pool.clone())
        .runs(&filter)
        .await
        .map_err(|e| explain_admin(e, About::Nothing))?;
    let next = page.next.map(|c| c.to_string());
    if out.json {
        return out.json(&json!({
            "runs": page.items.iter().map(|r| json!({
                "run_id": r.run_id,
                "flow_slug": r.flow_slug,
                "status": r.status.as_str(),
                "started_at": r.started_at,
                "finished_at": r.finished_at,
                "remaining_steps": r.remaining_steps,
                "retry_count": r.retry_count,
                "replay_of": r.replay_of,
                "cancel_reason": r.cancel_reason,
                "input": r.input,
            })).collect::<Vec<_>>(),
            "next": next,
        }));
    }
    let mut table = output::table([
        "RUN", "FLOW", "STATUS", "STARTED", "FINISHED", "RETRIES", "INPUT",
    ]);
    for r in &page.items {
        table.add_row([
            r.run_id.to_string(),
            r.flow_slug.clone(),
            r.status.as_str().to_owned(),
            output::time(Some(r.started_at)),
            output::time(r.finished_at),
            r.retry_count.to_string(),
            r.input
                .as_ref()
                .map_or_else(|| "-".to_owned(), |v| output::short_json(v, 40)),
        ]);
    }
    output::print_table(&table, "no runs match")?;
    if let Some(next) = next {
        output::line(&format!(
            "more runs: add `--after {next}` for the next page"
        ))?;
    }
    Ok(())
}

/// `(finished, total)` tasks of a step that has started (a created step has no tasks yet).
fn progress(step: &pgflow_runtime::admin::StepDetail) -> Option<(i32, i32)> {
    match step.status {
        pgflow_runtime::client::StepStatus::Created => None,
        _ => step.progress(),
    }
}

/// The state of a step as the DAG shows it: its status, and a started map step's progress.
fn step_label(step: &pgflow_runtime::admin::StepDetail) -> String {
    match progress(step) {
        Some((done, total)) if step.is_map() || total > 1 => {
            format!("{} {done}/{total}", step.status.as_str())
        }
        _ => step.status.as_str().to_owned(),
    }
}

/// One attempt of a task in JSON: `outcome` is how an earlier attempt ended, or the task's status for its
/// current or last attempt (`current` true).
fn attempt_json(a: &Attempt<'_>) -> Value {
    json!({
        "attempt": a.number,
        "queued_at": a.queued_at,
        "started_at": a.started_at,
        "ended_at": a.ended_at,
        "worker_id": a.worker_id,
        "worker_function": a.worker_function,
        "outcome": a.end.as_str(),
        "current": a.end.is_current(),
        "error_message": a.error_message,
    })
}

/// The JSON form of a run in detail.
fn detail_json(d: &RunDetail) -> Value {
    let r = &d.run;
    json!({
        "run_id": r.run_id,
        "flow_slug": r.flow_slug,
        "aliases": r.aliases,
        "status": r.status.as_str(),
        "input": r.input,
        "output": r.output,
        "remaining_steps": r.remaining_steps,
        "started_at": r.started_at,
        "completed_at": r.completed_at,
        "failed_at": r.failed_at,
        "cancelled_at": r.cancelled_at,
        "cancel_reason": r.cancel_reason,
        "replay_of": r.replay_of,
        "retry_count": r.retry_count,
        "steps": d.steps.iter().map(|s| json!({
            "step_slug": s.step_slug,
            "step_index": s.step_index,
            "step_type": s.step_type,
            "deps": s.deps,
            "queue_name": s.queue_name,
            "status": s.status.as_str(),
            "total_tasks": s.total_tasks,
            "remaining_tasks": s.remaining_tasks,
            "output": s.output,
            "error_message": s.error_message,
            "skip_reason": s.skip_reason,
            "started_at": s.started_at,
            "finished_at": s.finished_at,
        })).collect::<Vec<_>>(),
        "tasks": d.tasks.iter().map(|t| json!({
            "step_slug": t.step_slug,
            "task_index": t.task_index,
            "status": t.status.as_str(),
            "attempts": t.attempts,
            "attempts_base": t.attempts_base,
            "queued_at": t.queued_at,
            "started_at": t.started_at,
            "completed_at": t.completed_at,
            "failed_at": t.failed_at,
            "worker_id": t.worker_id,
            "worker_function": t.worker_function,
            "error_message": t.error_message,
            "output": t.output,
            "requeued_count": t.requeued_count,
            "attempt_history": d.attempt_list(t).iter().map(attempt_json).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "retries": d.retries.iter().map(|x| json!({
            "retry_number": x.retry_number,
            "retried_at": x.retried_at,
            "retried_by": x.retried_by,
            "previous_status": x.previous_status,
            "previous_cancel_reason": x.previous_cancel_reason,
            "errors": x.errors,
        })).collect::<Vec<_>>(),
        "replays": d.replays,
        "actions": d.actions.iter().map(|a| json!({
            "at": a.at,
            "actor": a.actor,
            "source": a.source,
            "action": a.action.as_str(),
            "detail": a.detail,
            "succeeded": a.succeeded,
            "error": a.error,
        })).collect::<Vec<_>>(),
        "dag": dag::draw(&dag_nodes(d)),
    })
}

fn dag_nodes(d: &RunDetail) -> Vec<dag::Node> {
    d.steps
        .iter()
        .map(|s| dag::Node {
            slug: s.step_slug.clone(),
            deps: s.deps.clone(),
            label: step_label(s),
        })
        .collect()
}

/// `run ID`: the run, its DAG, steps, tasks with attempts and errors, outputs, retries and replays.
pub(crate) async fn run(pool: &PgPool, out: Out, id: Uuid) -> anyhow::Result<()> {
    let detail = Admin::new(pool.clone())
        .run(id)
        .await
        .map_err(|e| explain_admin(e, About::Run(id)))?
        .ok_or_else(|| {
            anyhow!("run {id} not found (never started, or pruned): list runs with `pgflow runs`")
        })?;
    if out.json {
        return out.json(&detail_json(&detail));
    }
    print_run(&detail.run)?;
    output::line("")?;
    for l in dag::draw(&dag_nodes(&detail)) {
        output::line(&format!("  {l}"))?;
    }
    print_steps(&detail)?;
    print_tasks(&detail)?;
    print_attempts(&detail)?;
    print_history(&detail)?;
    if matches!(detail.run.status, RunStatus::Failed | RunStatus::Cancelled) {
        output::line(&format!(
            "retry it with `pgflow retry {id}`, or replay it with `pgflow replay {id} --from STEP`"
        ))?;
    }
    Ok(())
}

/// The run's own row: flow, status, times, input and output.
fn print_run(r: &RunInfo) -> anyhow::Result<()> {
    let finished = r.completed_at.or(r.failed_at).or(r.cancelled_at);
    output::line(&format!("run       {}", r.run_id))?;
    let aliases = if r.aliases.is_empty() {
        String::new()
    } else {
        format!(" (alias {})", r.aliases.join(", "))
    };
    output::line(&format!("flow      {}{aliases}", r.flow_slug))?;
    output::line(&format!("status    {}", r.status.as_str()))?;
    output::line(&format!(
        "started   {}   finished {}",
        output::time(Some(r.started_at)),
        output::time(finished)
    ))?;
    if let Some(reason) = &r.cancel_reason {
        output::line(&format!("cancelled {reason}"))?;
    }
    if let Some(of) = r.replay_of {
        output::line(&format!("replays   {of}"))?;
    }
    if r.retry_count > 0 {
        output::line(&format!("retried   {} time(s)", r.retry_count))?;
    }
    if let Some(input) = &r.input {
        output::line(&format!("input     {}", output::short_json(input, 100)))?;
    }
    if let Some(o) = &r.output {
        output::line(&format!("output    {}", output::short_json(o, 100)))?;
    }

    Ok(())
}

/// The steps: type, status, map progress, queue, output or error.
fn print_steps(detail: &RunDetail) -> anyhow::Result<()> {
    output::line("")?;
    let mut table = output::table(["STEP", "TYPE", "STATUS", "TASKS", "QUEUE", "OUTPUT / ERROR"]);
    for s in &detail.steps {
        let tasks = progress(s).map_or_else(|| "-".to_owned(), |(d, t)| format!("{d}/{t}"));
        let result = s
            .error_message
            .clone()
            .or_else(|| s.skip_reason.as_ref().map(|x| format!("skipped: {x}")))
            .or_else(|| s.output.as_ref().map(|o| output::short_json(o, 50)))
            .unwrap_or_else(|| "-".to_owned());
        table.add_row([
            s.step_slug.clone(),
            s.step_type.to_string(),
            s.status.as_str().to_owned(),
            tasks,
            s.queue_name.clone(),
            result,
        ]);
    }
    output::print_table(&table, "no steps")?;

    Ok(())
}

/// The tasks listed (the first ones and the failed ones of each step) with their latest attempt.
fn print_tasks(detail: &RunDetail) -> anyhow::Result<()> {
    output::line("")?;
    let mut table = output::table([
        "STEP",
        "TASK",
        "STATUS",
        "ATTEMPTS",
        "WORKER",
        "OUTPUT / ERROR",
    ]);
    for t in &detail.tasks {
        // A completed task keeps the error of an earlier attempt: its output is what it ended with.
        let output = t.output.as_ref().map(|o| output::short_json(o, 50));
        let result = if t.status == TaskStatus::Completed {
            output.or_else(|| t.error_message.clone())
        } else {
            t.error_message.clone().or(output)
        }
        .unwrap_or_else(|| "-".to_owned());
        table.add_row([
            t.step_slug.clone(),
            t.task_index.to_string(),
            t.status.as_str().to_owned(),
            t.attempts.to_string(),
            t.worker_function.clone().unwrap_or_else(|| "-".to_owned()),
            result,
        ]);
    }
    output::print_table(&table, "no tasks yet")?;
    for s in &detail.steps {
        let shown = detail.tasks_of(&s.step_slug).count();
        if let Some(total) = s
            .total_tasks
            .filter(|&t| usize::try_from(t).unwrap_or(0) > shown)
        {
            output::line(&format!(
                "step {}: {shown} of its {total} tasks shown (the first ones and the failed ones)",
                s.step_slug
            ))?;
        }
    }

    Ok(())
}

/// Retries, replays and operator actions taken on the run.
fn print_history(detail: &RunDetail) -> anyhow::Result<()> {
    for x in &detail.retries {
        output::line(&format!(
            "retry {} at {} by {} (was {}): {}",
            x.retry_number,
            output::time(Some(x.retried_at)),
            x.retried_by,
            x.previous_status,
            output::short_json(&x.errors, 120)
        ))?;
    }
    for replay in &detail.replays {
        output::line(&format!("replayed by run {replay}"))?;
    }
    for a in &detail.actions {
        output::line(&format!(
            "{} at {} by {} from {}: {}",
            a.action.as_str(),
            output::time(Some(a.at)),
            a.actor,
            a.source,
            a.error
                .as_deref()
                .map_or_else(|| "done".to_owned(), |e| format!("refused: {e}"))
        ))?;
    }
    Ok(())
}

/// The attempts of the tasks that had more than one, oldest first, with their worker and how each ended.
fn print_attempts(detail: &RunDetail) -> anyhow::Result<()> {
    let mut table = output::table([
        "STEP", "TASK", "ATTEMPT", "OUTCOME", "STARTED", "ENDED", "WORKER", "ERROR",
    ]);
    let mut any = false;
    for t in &detail.tasks {
        let attempts = detail.attempt_list(t);
        if attempts.len() < 2 {
            continue;
        }
        any = true;
        for a in &attempts {
            let worker = match (a.worker_function, a.worker_id) {
                (Some(f), Some(id)) => format!("{f} {}", &id.to_string()[..8]),
                (None, Some(id)) => id.to_string()[..8].to_owned(),
                _ => "-".to_owned(),
            };
            table.add_row([
                t.step_slug.clone(),
                t.task_index.to_string(),
                a.number.to_string(),
                a.end.as_str().to_owned(),
                output::time(a.started_at),
                output::time(a.ended_at),
                worker,
                a.error_message
                    .map_or_else(|| "-".to_owned(), |e| output::short(e, 60)),
            ]);
        }
    }
    if any {
        output::line("")?;
        output::line("attempts of the tasks that ran more than once:")?;
        output::print_table(&table, "")?;
    }
    Ok(())
}

/// `aliases`: every alias, the version it points at and the previous one, and whether each is retirable.
pub(crate) async fn aliases(pool: &PgPool, out: Out) -> anyhow::Result<()> {
    let aliases = Admin::new(pool.clone())
        .aliases()
        .await
        .map_err(|e| explain_admin(e, About::Nothing))?;
    if out.json {
        return out.json(
            &aliases
                .iter()
                .map(|a| {
                    json!({
                        "alias": a.alias,
                        "flow_slug": a.flow_slug,
                        "previous_flow_slug": a.previous_flow_slug,
                        "activated_at": a.activated_at,
                        "versions": a.versions.iter().map(|v| json!({
                            "flow_slug": v.flow_slug,
                            "active": v.active,
                            "retirable": v.retirable(),
                            "queues": v.queues.iter().map(|q| json!({
                                "queue_name": q.queue_name,
                                "retirable": q.retirable,
                                "blockers": q.blockers,
                            })).collect::<Vec<_>>(),
                        })).collect::<Vec<_>>(),
                    })
                })
                .collect::<Vec<_>>(),
        );
    }
    let mut table = output::table(["ALIAS", "VERSION", "PREVIOUS", "ACTIVATED", "RETIRABLE"]);
    for a in &aliases {
        let retirable: Vec<String> = a
            .versions
            .iter()
            .map(|v| {
                format!(
                    "{}: {}",
                    v.flow_slug,
                    if v.retirable() { "yes" } else { "no" }
                )
            })
            .collect();
        table.add_row([
            a.alias.clone(),
            a.flow_slug.clone(),
            a.previous_flow_slug
                .clone()
                .unwrap_or_else(|| "-".to_owned()),
            output::time(Some(a.activated_at)),
            retirable.join(", "),
        ]);
    }
    output::print_table(
        &table,
        "no aliases: point one at a version with `pgflow activate ALIAS VERSION`",
    )
}
