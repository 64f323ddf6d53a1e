//! The run page: the DAG, the steps, every attempt of each task on a timeline, payloads, the operator record and the
//! write actions; and the confirmation page of a run action.

use super::*;

/// One run.
pub(crate) fn run_page(base: &Base, w: &Writer, d: &RunDetail, hidden: bool) -> Markup {
    let live = base.link(&format!("/runs/{}/fragment", d.run.run_id));
    layout(
        base,
        w,
        &format!("Run {}", d.run.run_id),
        "Runs",
        html! {
            h1 { "Run " code { (d.run.run_id) } }
            div #live data-refresh=(live) data-every=(REFRESH_MS) { (run_live(base, w, d, hidden)) }
        },
    )
}

fn action_buttons(base: &Base, w: &Writer, d: &RunDetail) -> Markup {
    let id = d.run.run_id;
    let status = d.run.status;
    html! {
        @if w.enabled {
            div.actions {
                @if status == RunStatus::Started {
                    a.button.danger #cancel href=(base.link(&format!("/runs/{id}/cancel"))) { "Cancel…" }
                }
                @if matches!(status, RunStatus::Failed | RunStatus::Cancelled) {
                    a.button #retry href=(base.link(&format!("/runs/{id}/retry"))) { "Retry…" }
                }
                @if status != RunStatus::Started {
                    form.inline method="get" action=(base.link(&format!("/runs/{id}/replay"))) {
                        select name="step" {
                            @for s in &d.steps { option value=(s.step_slug) { (s.step_slug) } }
                        }
                        button #replay type="submit" { "Replay from step…" }
                    }
                }
            }
        }
    }
}

/// The run page's live part.
pub(crate) fn run_live(base: &Base, w: &Writer, d: &RunDetail, hidden: bool) -> Markup {
    let r = &d.run;
    html! {
        dl.facts {
            dt { "Version" } dd { (r.flow_slug) @for a in &r.aliases { " " span.alias { (a) } } }
            dt { "Status" } dd #run-status data-status=(r.status.as_str()) { (badge(r.status.as_str())) }
            dt { "Started" } dd { (time(r.started_at)) }
            @if let Some(t) = r.completed_at { dt { "Completed" } dd { (time(t)) } }
            @if let Some(t) = r.failed_at { dt { "Failed" } dd { (time(t)) } }
            @if let Some(t) = r.cancelled_at { dt { "Cancelled" } dd { (time(t)) } }
            @if let Some(reason) = &r.cancel_reason { dt { "Cancel reason" } dd { (reason) } }
            @if r.retry_count > 0 { dt { "Retried" } dd { (r.retry_count) "×" } }
            @if let Some(of) = r.replay_of { dt { "Replay of" } dd { a href=(base.link(&format!("/runs/{of}"))) { code { (of) } } } }
            @if !d.replays.is_empty() { dt { "Replays" } dd { @for id in &d.replays { a href=(base.link(&format!("/runs/{id}"))) { code { (id) } } " " } } }
        }
        (action_buttons(base, w, d))
        h2 { "Steps" }
        div.dagbox { (dag::svg(&d.steps)) }
        table.steps {
            thead { tr { th { "Step" } th { "Type" } th { "Depends on" } th { "Queue" } th { "Status" } th { "Tasks" } th { "Error" } } }
            tbody {
                @for s in &d.steps {
                    tr data-step=(s.step_slug) {
                        td { (s.step_slug) } td { (s.step_type) } td { (s.deps.join(", ")) } td { (s.queue_name) }
                        td { (badge(s.status.as_str())) @if let Some(why) = &s.skip_reason { " " span.note { (why) } } }
                        td { @if let Some((k, n)) = s.progress() { (k) "/" (n) } }
                        td.error { @if let Some(e) = &s.error_message { (e) } }
                    }
                }
            }
        }
        h2 { "Tasks" }
        (timeline(d))
        h2 { "Payloads" }
        @if hidden {
            p.note { "Payloads are hidden on this dashboard." }
        } @else {
            div.payloads {
                div { h3 { "Input" } pre #run-input { (r.input.as_ref().map(json).unwrap_or_default()) } }
                div { h3 { "Output" } pre #run-output { (r.output.as_ref().map(json).unwrap_or_default()) } }
            }
        }
        @if !d.retries.is_empty() {
            h2 { "Retries" }
            table { thead { tr { th { "#" } th { "When" } th { "By" } th { "Was" } th { "Errors then" } } }
                tbody { @for t in &d.retries { tr { td { (t.retry_number) } td { (time(t.retried_at)) } td { (t.retried_by) } td { (t.previous_status) } td { code { (truncate(&t.errors.to_string(), 200)) } } } } } }
        }
        @if !d.actions.is_empty() {
            h2 { "Operator actions" }
            (actions_table(&d.actions))
        }
        @if !d.events.is_empty() {
            h2 { "Events" }
            table.events {
                thead { tr { th { "When" } th { "What" } th { "Cause" } th { "Who" } th { "Where" } th { "Detail" } } }
                tbody {
                    @for e in &d.events {
                        tr data-kind=(e.kind) {
                            td { (time(e.occurred_at)) } td { (e.kind) } td { (e.cause) } td { (e.actor.clone().unwrap_or_default()) }
                            td { @if let Some(step) = &e.step_slug { (step) @if let Some(i) = e.task_index { "[" (i) "]" } } }
                            td { code { (truncate(&e.detail.to_string(), 160)) } }
                        }
                    }
                }
            }
        }
    }
}

fn actions_table(actions: &[OperatorAction]) -> Markup {
    html! {
        table.actions-log {
            thead { tr { th { "When" } th { "Who" } th { "What" } th { "Outcome" } th { "Detail" } } }
            tbody {
                @for a in actions {
                    tr {
                        td { (time(a.at)) } td { (a.actor) " (" (a.source) ")" } td { (a.action.as_str()) }
                        td { @if a.succeeded { "done" } @else { span.error { "refused: " (a.error.clone().unwrap_or_default()) } } }
                        td { code { (truncate(&a.detail.to_string(), 160)) } }
                    }
                }
            }
        }
    }
}

/// Every attempt of each task on a common time axis: waiting (queued → started) and running (started →
/// ended), the earlier attempts hatched and faded before the current one, each with its worker and error.
fn timeline(d: &RunDetail) -> Markup {
    let start = d.run.started_at;
    let now = Utc::now();
    let end = d
        .tasks
        .iter()
        .filter_map(|t| {
            t.completed_at
                .or(t.failed_at)
                .or(t.started_at)
                .max(Some(t.attempt_queued_at))
        })
        .chain(d.attempts.iter().map(|a| a.ended_at))
        .chain(
            [d.run.completed_at, d.run.failed_at, d.run.cancelled_at]
                .into_iter()
                .flatten(),
        )
        .max()
        .unwrap_or(start)
        .max(now.min(start + chrono::Duration::hours(24)));
    let span = (end - start).num_microseconds().unwrap_or(1).max(1) as f64;
    let pct = |t: DateTime<Utc>| {
        ((t - start).num_microseconds().unwrap_or(0) as f64 / span * 100.0).clamp(0.0, 100.0)
    };
    let axis = Axis {
        pct: &pct,
        now: pct(now.min(end)),
    };
    html! {
        p.note { "Time axis: " (time(start)) " to " (time(end)) " UTC. Grey: waiting in the queue; coloured: running; hatched: an earlier attempt (hover a bar for its worker and error)." }
        table.tasks {
            thead { tr { th { "Task" } th { "Status" } th { "Attempts" } th.timeline-h { "Timeline" } th { "Queued" } th { "Started" } th { "Finished" } th { "Worker" } th { "Error / output" } } }
            tbody {
                @for t in &d.tasks {
                    @let attempts = d.attempt_list(t);
                    tr data-task=(format!("{}[{}]", t.step_slug, t.task_index)) data-status=(t.status.as_str()) {
                        td { (t.step_slug) "[" (t.task_index) "]" }
                        td { (badge(t.status.as_str())) }
                        td { (t.attempts) @if t.requeued_count > 0 { " " span.note { "requeued " (t.requeued_count) } } }
                        td.timeline { div.track { @for a in &attempts { (attempt_bars(a, &axis)) } } }
                        td { (time(t.attempt_queued_at)) }
                        td { (opt_time(t.started_at)) }
                        td { (opt_time(t.completed_at.or(t.failed_at))) }
                        td { @if let Some(wid) = t.worker_id { code title=(wid) { (wid.to_string()[..8]) } " " (t.worker_function.clone().unwrap_or_default()) } }
                        td.payload {
                            @if let Some(e) = attempts.last().and_then(|a| a.error_message) { span.error.task-error { (e) } }
                            @else if let Some(o) = &t.output { code { (truncate(&o.to_string(), 80)) } }
                            @if attempts.len() > 1 { (earlier_list(&attempts[..attempts.len() - 1])) }
                        }
                    }
                }
            }
        }
    }
}

/// Positions on the timeline: a time's percentage of the axis, and now's.
struct Axis<'a> {
    pct: &'a dyn Fn(DateTime<Utc>) -> f64,
    now: f64,
}

/// One attempt's bars: its wait (queued → started, or → now while queued) and its run (started → ended, or →
/// now while running). An earlier attempt's bars are classed `earlier` with its outcome (`o-failed`, ...).
fn attempt_bars(a: &Attempt<'_>, axis: &Axis<'_>) -> Markup {
    let q = (axis.pct)(a.queued_at);
    let s = a.started_at.map(axis.pct);
    let e = a.ended_at.map(axis.pct).or(s.map(|_| axis.now));
    let wait_end = s.or(a.ended_at.map(axis.pct)).unwrap_or(axis.now);
    let (kind, class) = match a.end {
        AttemptEnd::Earlier(o) => ("earlier", format!("o-{}", o.as_str())),
        _ => ("current", dag::state_class(a.end.as_str())),
    };
    let worker = a.worker_id.map(|w| {
        format!(
            ", worker {} {}",
            &w.to_string()[..8],
            a.worker_function.unwrap_or_default()
        )
    });
    let title = format!(
        "attempt {}: {}{}{}",
        a.number,
        a.end.as_str(),
        worker.unwrap_or_default(),
        a.error_message
            .map(|e| format!(": {e}"))
            .unwrap_or_default()
    );
    html! {
        div class=(format!("bar wait {kind}")) data-attempt=(a.number) title=(title) style=(format!("left:{q:.2}%;width:{:.2}%", (wait_end - q).max(0.3))) {}
        @if let (Some(s), Some(e)) = (s, e) {
            div class=(format!("bar run {kind} {class}")) data-attempt=(a.number) data-outcome=(a.end.as_str()) title=(title) style=(format!("left:{s:.2}%;width:{:.2}%", (e - s).max(0.3))) {}
        }
    }
}

/// The earlier attempts of a task under its result: number, outcome, worker and error.
fn earlier_list(earlier: &[Attempt<'_>]) -> Markup {
    html! {
        ol.attempts {
            @for a in earlier {
                li.earlier-attempt data-attempt=(a.number) data-outcome=(a.end.as_str()) {
                    "#" (a.number) " " (a.end.as_str())
                    @if let Some(w) = a.worker_id { " · " code title=(w) { (w.to_string()[..8]) } @if let Some(f) = a.worker_function { " " (f) } }
                    @if let Some(e) = a.error_message { ": " span.error { (truncate(e, 160)) } }
                }
            }
        }
    }
}

/// The confirmation of a write action.
pub(crate) fn confirm_page(
    base: &Base,
    w: &Writer,
    d: &RunDetail,
    kind: ActionKind,
    step: Option<&str>,
) -> Markup {
    let id = d.run.run_id;
    let (verb, what) = match kind {
        ActionKind::Cancel => (
            "cancel",
            "Cancel this run? Its queued tasks are dropped and running handlers are told to stop.",
        ),
        ActionKind::Retry => (
            "retry",
            "Retry this run in place? Its failed and cancelled steps run again.",
        ),
        _ => (
            "replay",
            "Start a new run that replays this one from the chosen step?",
        ),
    };
    let csrf = w
        .session
        .as_ref()
        .map(|(_, c)| c.clone())
        .unwrap_or_default();
    layout(
        base,
        w,
        &format!("Confirm {verb}"),
        "Runs",
        html! {
            h1 { "Confirm: " (verb) " run " code { (id) } }
            p { (what) }
            p { "Version " b { (d.run.flow_slug) } ", status " (badge(d.run.status.as_str())) ", started " (time(d.run.started_at)) "." }
            form.confirm method="post" action=(base.link(&format!("/runs/{id}/{verb}"))) {
                input type="hidden" name="csrf" value=(csrf);
                input type="hidden" name="confirm" value="yes";
                @if kind == ActionKind::Cancel {
                    label { "Reason " input name="reason" placeholder="why (recorded)"; }
                }
                @if kind == ActionKind::Replay {
                    label { "From step "
                        select name="step" {
                            @for s in &d.steps { option value=(s.step_slug) selected[step == Some(s.step_slug.as_str())] { (s.step_slug) } }
                        }
                    }
                }
                button #confirm type="submit" class="danger" { "Yes, " (verb) }
                " " a href=(base.link(&format!("/runs/{id}"))) { "No, back to the run" }
            }
        },
    )
}
