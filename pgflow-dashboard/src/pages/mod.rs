//! The HTML: a layout, each view's page and its live fragment (the part the page's script refreshes).
//! maud escapes every interpolated value, so run inputs, errors and names render as text.

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};
use pgflow_runtime::admin::{
    ActionKind, AliasInfo, Attempt, AttemptEnd, CoverageGap, FlowInfo, OperatorAction, Page,
    QueueInfo, QueueRates, RunDetail, RunSummary, ScheduleInfo, StatusCount, UncoveredRoute,
    WorkerFunction, WorkerInfo,
};
use pgflow_runtime::client::RunStatus;
use serde_json::Value;

use crate::dag::{self, truncate};
use crate::routes::{encode, Base, RunsQuery, Writer};

/// How often the live part of a page refreshes, in milliseconds.
mod run;

pub(crate) use run::{confirm_page, run_live, run_page};

const REFRESH_MS: u32 = 2000;

fn time(t: DateTime<Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()
}

fn opt_time(t: Option<DateTime<Utc>>) -> String {
    t.map(time).unwrap_or_default()
}

fn ago(t: DateTime<Utc>) -> String {
    let s = (Utc::now() - t).num_milliseconds() as f64 / 1000.0;
    if s < 120.0 {
        format!("{s:.1} s ago")
    } else if s < 7200.0 {
        format!("{:.0} min ago", s / 60.0)
    } else {
        format!("{:.1} h ago", s / 3600.0)
    }
}

fn json(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

fn badge(status: &str) -> Markup {
    html! { span class=(format!("badge {}", dag::state_class(status))) { (status) } }
}

fn layout(base: &Base, w: &Writer, title: &str, active: &str, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · pgflow" }
                link rel="stylesheet" href=(base.link("/assets/dashboard.css"));
                script src=(base.link("/assets/dashboard.js")) defer {}
            }
            body {
                header {
                    span.brand { "pgflow" }
                    nav {
                        @for (path, name) in [("/runs", "Runs"), ("/queues", "Queues"), ("/workers", "Workers"), ("/schedules", "Schedules")] {
                            a href=(base.link(path)) class=[(active == name).then_some("active")] { (name) }
                        }
                    }
                    span.who {
                        @if !w.enabled {
                            span.readonly title="Started without a write token" { "read-only" }
                        } @else if let Some((actor, _)) = &w.session {
                            "signed in as " b { (actor) } " "
                            form.inline method="post" action=(base.link("/logout")) {
                                button type="submit" { "sign out" }
                            }
                        } @else {
                            a href=(base.link("/login")) { "sign in to act" }
                        }
                    }
                }
                main { (body) }
            }
        }
    }
}

/// An error page.
pub(crate) fn error_page(status: StatusCode, message: &str) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head { meta charset="utf-8"; title { (status.as_u16()) " · pgflow" } }
            body { h1 { (status) } p.error { (message) } p { a href="javascript:history.back()" { "back" } } }
        }
    }
}

// ---------------------------------------------------------------------------------------------------- runs

/// What the run list shows.
pub(crate) struct RunsData {
    pub(crate) page: Page<RunSummary>,
    pub(crate) counts: Vec<StatusCount>,
    pub(crate) hidden: bool,
}

/// The run list.
pub(crate) fn runs_page(base: &Base, w: &Writer, q: &RunsQuery, data: &RunsData) -> Markup {
    let v = |f: &Option<String>| f.clone().unwrap_or_default();
    let live = format!("{}?{}", base.link("/runs/fragment"), q.query_string(true));
    layout(
        base,
        w,
        "Runs",
        "Runs",
        html! {
            h1 { "Runs" }
            form.filters method="get" action=(base.link("/runs")) {
                label { "Flow or alias " input name="flow" value=(v(&q.flow)) placeholder="community"; }
                label { "Version " input name="version" value=(v(&q.version)) placeholder="community_v2"; }
                label { "Status "
                    select name="status" {
                        option value="" { "any" }
                        @for s in ["started", "completed", "failed", "cancelled"] {
                            option value=(s) selected[q.status.as_deref() == Some(s)] { (s) }
                        }
                    }
                }
                label { "Started from " input type="datetime-local" name="from" value=(v(&q.from)); }
                label { "to " input type="datetime-local" name="to" value=(v(&q.to)); }
                label { "Input at " input name="path" value=(v(&q.path)) placeholder="customer.id"; }
                label { "= " input name="value" value=(v(&q.value)) placeholder="42 or \"text\""; }
                button type="submit" { "Filter" }
                " " a href=(base.link("/runs")) { "clear" }
            }
            div #live data-refresh=(live) data-every=(REFRESH_MS) { (runs_live(base, q, data)) }
        },
    )
}

/// The run list's live part: counts, the page of runs, the link to the next page.
pub(crate) fn runs_live(base: &Base, q: &RunsQuery, data: &RunsData) -> Markup {
    let filter_qs = {
        let mut q = q.clone();
        q.status = None;
        q.query_string(false)
    };
    html! {
        p.counts {
            @for c in &data.counts {
                a.count href=(format!("{}?{}{}status={}", base.link("/runs"), filter_qs, if filter_qs.is_empty() { "" } else { "&" }, c.status.as_str()))
                    data-status=(c.status.as_str()) {
                    (badge(c.status.as_str())) " "
                    span.n { (c.count) @if c.capped { "+" } }
                }
            }
        }
        table.runs {
            thead { tr { th { "Run" } th { "Version" } th { "Status" } th { "Started (UTC)" } th { "Finished" } th { "Steps left" } th { "Input" } } }
            tbody {
                @for r in &data.page.items {
                    tr data-run=(r.run_id) {
                        td { a href=(base.link(&format!("/runs/{}", r.run_id))) { code { (r.run_id) } } }
                        td { (r.flow_slug) }
                        td { (badge(r.status.as_str()))
                            @if r.retry_count > 0 { " " span.note { "retried " (r.retry_count) "×" } }
                            @if r.replay_of.is_some() { " " span.note { "replay" } } }
                        td { (time(r.started_at)) }
                        td { (opt_time(r.finished_at)) }
                        td { (r.remaining_steps) }
                        td.payload {
                            @if data.hidden { span.note { "hidden" } }
                            @else if let Some(input) = &r.input { code { (truncate(&input.to_string(), 80)) } }
                        }
                    }
                }
            }
        }
        @if data.page.items.is_empty() { p.empty { "No runs match." } }
        @if let Some(next) = data.page.next {
            @let older = RunsQuery { after: Some(next.to_string()), ..q.clone() };
            p { a.older href=(format!("{}?{}", base.link("/runs"), older.query_string(true))) { "Older runs →" } }
        }
    }
}

// ------------------------------------------------------------------------------------------------- queues

/// What the queues view shows.
pub(crate) struct QueuesData {
    pub(crate) queues: Vec<QueueInfo>,
    pub(crate) rates: Vec<QueueRates>,
    pub(crate) uncovered: Vec<UncoveredRoute>,
    pub(crate) gaps: Vec<CoverageGap>,
    pub(crate) functions: Vec<WorkerFunction>,
}

/// The queues view.
pub(crate) fn queues_page(base: &Base, w: &Writer, data: &QueuesData) -> Markup {
    layout(
        base,
        w,
        "Queues",
        "Queues",
        html! {
            h1 { "Queues" }
            div #live data-refresh=(base.link("/queues/fragment")) data-every=(REFRESH_MS) { (queues_live(data)) }
        },
    )
}

fn sparkline(values: &[i64]) -> Markup {
    let max = values.iter().copied().max().unwrap_or(0).max(1) as f64;
    let n = values.len().max(1);
    html! {
        svg.spark xmlns="http://www.w3.org/2000/svg" width=(n * 6) height="20" viewBox=(format!("0 0 {} 20", n * 6)) {
            @for (i, v) in values.iter().enumerate() {
                @let h = (*v as f64 / max * 18.0).round() as i64;
                rect x=(i * 6) y=(20 - h) width="5" height=(h) {}
            }
        }
    }
}

/// The queues view's live part.
pub(crate) fn queues_live(data: &QueuesData) -> Markup {
    html! {
        table.queues {
            thead { tr { th { "Queue" } th { "Depth" } th { "Oldest message" } th { "Live workers" } th { "Fenced" } th { "Claimed / min (10 min)" } th { "Completed / min" } th { "Failed (10 min)" } } }
            tbody {
                @for q in &data.queues {
                    @let rates = data.rates.iter().find(|r| r.queue_name == q.queue_name);
                    @let claimed: Vec<i64> = rates.map(|r| r.minutes.iter().map(|m| m.claimed).collect()).unwrap_or_default();
                    @let completed: Vec<i64> = rates.map(|r| r.minutes.iter().map(|m| m.completed).collect()).unwrap_or_default();
                    @let failed: i64 = rates.map(|r| r.minutes.iter().map(|m| m.failed).sum()).unwrap_or(0);
                    tr data-queue=(q.queue_name) {
                        td { (q.queue_name) }
                        td.depth { @if let Some(d) = q.depth { (d) } @else { span.note { "no queue table" } } }
                        td { @if let Some(a) = q.oldest_age_seconds { (format!("{a:.0} s")) } }
                        td { (q.live_workers) }
                        td { @if q.fenced_workers > 0 { span.error { (q.fenced_workers) } } @else { "0" } }
                        td { (sparkline(&claimed)) " " (claimed.last().copied().unwrap_or(0)) }
                        td { (sparkline(&completed)) " " (completed.last().copied().unwrap_or(0)) }
                        td { @if failed > 0 { span.error { (failed) } } @else { "0" } }
                    }
                }
            }
        }
        h2 { "Work with no worker" }
        @if data.uncovered.is_empty() && data.gaps.is_empty() {
            p.ok { "Every queued task has a live worker that runs it." }
        }
        @if !data.uncovered.is_empty() {
            table.uncovered {
                thead { tr { th { "Queue" } th { "Version" } th { "Step" } th { "Queued tasks" } th { "Oldest queued" } } }
                tbody { @for u in &data.uncovered { tr { td { (u.queue_name) } td { (u.flow_slug) } td { (u.step_slug) } td { (u.queued_tasks) } td { (opt_time(u.oldest_queued_at)) } } } }
            }
        }
        @if !data.gaps.is_empty() {
            h3 { "Coverage gaps" }
            table.gaps {
                thead { tr { th { "Queue" } th { "Version" } th { "Step" } th { "Why" } th { "Count" } th { "Repair" } } }
                tbody { @for g in &data.gaps { tr { td { (g.queue_name) } td { (g.flow_slug) } td { (g.step_slug) } td { (g.reason) } td { (g.count) } td { (g.repair) } } } }
            }
        }
        h2 { "Worker functions" }
        @let disabled: Vec<_> = data.functions.iter().filter(|f| !f.enabled).collect();
        @if disabled.is_empty() { p.ok { "No worker function is disabled." } }
        table.functions {
            thead { tr { th { "Function" } th { "Enabled" } th { "Disabled why" } th { "Disabled at" } th { "Last invoked" } } }
            tbody { @for f in &data.functions { tr { td { (f.function_name) } td { @if f.enabled { "yes" } @else { span.error { "disabled" } } } td { (f.disabled_reason.clone().unwrap_or_default()) } td { (opt_time(f.disabled_at)) } td { (opt_time(f.last_invoked_at)) } } } }
        }
    }
}

// ------------------------------------------------------------------------------------------------ workers

/// What the workers view shows.
pub(crate) struct WorkersData {
    pub(crate) workers: Vec<WorkerInfo>,
    pub(crate) flows: Vec<FlowInfo>,
    pub(crate) aliases: Vec<AliasInfo>,
}

/// The workers and deployments view.
pub(crate) fn workers_page(base: &Base, w: &Writer, data: &WorkersData) -> Markup {
    layout(
        base,
        w,
        "Workers",
        "Workers",
        html! {
            h1 { "Workers and deployments" }
            div #live data-refresh=(base.link("/workers/fragment")) data-every=(REFRESH_MS) { (workers_live(data)) }
        },
    )
}

/// The workers view's live part.
pub(crate) fn workers_live(data: &WorkersData) -> Markup {
    html! {
        h2 { "Workers (heartbeat in the last hour)" }
        table.workers {
            thead { tr { th { "Worker" } th { "Function" } th { "Queue" } th { "State" } th { "Last heartbeat" } th { "Started" } th { "Versions served" } th { "Steps" } } }
            tbody {
                @for wk in &data.workers {
                    tr data-worker=(wk.worker_id) {
                        td { code title=(wk.worker_id) { (wk.worker_id.to_string()[..8]) } }
                        td { (wk.function_name) }
                        td { (wk.queue_name) }
                        td { @if wk.live { span.badge.st-completed { "live" } } @else if wk.stopped_at.is_some() { span.badge.st-cancelled { "stopped" } } @else { span.badge.st-failed { "silent" } }
                             @if !wk.enabled { " " span.error { "fenced" } } }
                        td { (ago(wk.last_heartbeat_at)) }
                        td { (time(wk.started_at)) }
                        td { @if wk.routes.is_empty() { span.note { "whole queue" } } @else { (wk.versions().join(", ")) } }
                        td { (wk.routes.iter().map(|r| format!("{}.{}", r.flow_slug, r.step_slug)).collect::<Vec<_>>().join(", ")) }
                    }
                }
            }
        }
        @if data.workers.is_empty() { p.empty { "No worker heartbeat in the last hour." } }
        h2 { "Aliases" }
        table.aliases {
            thead { tr { th { "Alias" } th { "Points at" } th { "Before" } th { "Activated" } th { "Versions" } } }
            tbody {
                @for a in &data.aliases {
                    tr data-alias=(a.alias) {
                        td { (a.alias) } td { (a.flow_slug) } td { (a.previous_flow_slug.clone().unwrap_or_default()) } td { (time(a.activated_at)) }
                        td {
                            @for v in &a.versions {
                                div {
                                    b { (v.flow_slug) } @if v.active { " (active)" } " — "
                                    @if v.retirable() { span.ok { "retirable" } }
                                    @else {
                                        span.note { "not retirable: " }
                                        @for q in v.queues.iter().filter(|q| !q.retirable) { code { (q.queue_name) ": " (truncate(&q.blockers.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "), 160)) } " " }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
        h2 { "Versions" }
        table.flows {
            thead { tr { th { "Version" } th { "Queue mode" } th { "Steps" } th { "Aliases" } th { "Compiled" } } }
            tbody { @for f in &data.flows { tr { td { a href=(format!("runs?version={}", encode(&f.flow_slug))) { (f.flow_slug) } } td { (f.queue_mode) } td { (f.steps) } td { (f.aliases.join(", ")) } td { (time(f.created_at)) } } } }
        }
    }
}

// ---------------------------------------------------------------------------------------------- schedules

/// The schedules view.
pub(crate) fn schedules_page(base: &Base, w: &Writer, schedules: &[ScheduleInfo]) -> Markup {
    layout(
        base,
        w,
        "Schedules",
        "Schedules",
        html! {
            h1 { "Schedules" }
            div #live data-refresh=(base.link("/schedules/fragment")) data-every=(REFRESH_MS) { (schedules_live(base, w, schedules)) }
        },
    )
}

/// The schedules view's live part.
pub(crate) fn schedules_live(base: &Base, w: &Writer, schedules: &[ScheduleInfo]) -> Markup {
    html! {
        @if schedules.is_empty() { p.empty { "No schedules." } }
        @else {
            table.schedules {
                thead { tr { th { "Schedule" } th { "Flow" } th { "Cron" } th { "State" } th { "Next fire (UTC)" } th { "Last fire" } th { "Last run" } th { "Missed / overlap" } @if w.enabled { th {} } } }
                tbody {
                    @for s in schedules {
                        tr data-schedule=(s.schedule_name) data-paused=(s.paused) {
                            td { (s.schedule_name) }
                            td { (s.flow_slug) }
                            td { code { (s.cron) } " " span.note { (s.time_zone) } }
                            td { @if s.paused { span class="badge st-cancelled" { "paused" } } @else { span class="badge st-completed" { "active" } }
                                 @if let Some(e) = &s.last_error { " " span.error { (e) } } }
                            td { (opt_time(s.next_fire_at)) }
                            td { (opt_time(s.last_fire_at)) }
                            td { @if let Some(id) = s.last_run_id {
                                    a href=(base.link(&format!("/runs/{id}"))) { code { (id.to_string()[..8]) } }
                                    @if let Some(st) = s.last_run_status { " " (badge(st.as_str())) }
                                 } }
                            td { (s.missed) " / " (s.overlap) }
                            @if w.enabled {
                                td {
                                    @if s.paused {
                                        a.button.pause-resume href=(base.link(&format!("/schedules/{}/resume", encode(&s.schedule_name)))) { "Resume…" }
                                    } @else {
                                        a.button.pause-resume href=(base.link(&format!("/schedules/{}/pause", encode(&s.schedule_name)))) { "Pause…" }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The confirmation of a schedule's pause or resume.
pub(crate) fn schedule_confirm_page(
    base: &Base,
    w: &Writer,
    s: &ScheduleInfo,
    kind: ActionKind,
) -> Markup {
    let verb = if kind == ActionKind::PauseSchedule {
        "pause"
    } else {
        "resume"
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
        "Schedules",
        html! {
            h1 { "Confirm: " (verb) " schedule " code { (s.schedule_name) } }
            p { "It starts " b { (s.flow_slug) } " on " code { (s.cron) } " (" (s.time_zone) ")."
                @if kind == ActionKind::ResumeSchedule { " Fires that fell while it was paused are not caught up." } }
            form.confirm method="post" action=(base.link(&format!("/schedules/{}/{verb}", encode(&s.schedule_name)))) {
                input type="hidden" name="csrf" value=(csrf);
                input type="hidden" name="confirm" value="yes";
                button #confirm type="submit" class="danger" { "Yes, " (verb) }
                " " a href=(base.link("/schedules")) { "No, back to the schedules" }
            }
        },
    )
}

// ------------------------------------------------------------------------------------------------- sign-in

/// The sign-in form.
pub(crate) fn login_page(base: &Base, w: &Writer, next: &str, problem: Option<&str>) -> Markup {
    layout(
        base,
        w,
        "Sign in",
        "",
        html! {
            h1 { "Sign in to act" }
            p { "Write actions (cancel, retry, replay, pause and resume) need the dashboard's write token. Each one is recorded under your name." }
            @if let Some(p) = problem { p.error #login-error { (p) } }
            form.login method="post" action=(base.link("/login")) {
                input type="hidden" name="next" value=(next);
                label { "Your name " input #actor name="actor" required autocomplete="username"; }
                label { "Write token " input #token type="password" name="token" required autocomplete="current-password"; }
                button #signin type="submit" { "Sign in" }
            }
        },
    )
}
