//! The routes: pages, their live fragments, sign-in, and the confirmed write actions.

use std::sync::Arc;

use axum::extract::{FromRequestParts, OriginalUri, Path, Query, State};
use axum::http::{header, request::Parts, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use axum_extra::extract::cookie::{Cookie, CookieJar, SameSite};
use chrono::{DateTime, NaiveDateTime, Utc};
use maud::Markup;
use pgflow_runtime::admin::{ActionKind, Admin, AdminError, NewAction, RunFilter};
use pgflow_runtime::client::RunStatus;
use pgflow_runtime::Client;
use serde::Deserialize;
use serde_json::{json, Value};
use uuid::Uuid;

use crate::auth::{self, WriteAuth, SESSION_COOKIE};
use crate::pages;

mod actions;

use actions::*;

/// What every handler shares.
pub(crate) struct AppState {
    pub(crate) admin: Admin,
    pub(crate) client: Client,
    pub(crate) write: Option<WriteAuth>,
}

type Shared = Arc<AppState>;

pub(crate) fn router(state: Shared) -> Router {
    Router::new()
        .route(
            "/",
            get(|base: Base| async move { Redirect::to(&base.link("/runs")) }),
        )
        .route("/runs", get(runs_page))
        .route("/runs/fragment", get(runs_fragment))
        .route("/runs/{id}", get(run_page))
        .route("/runs/{id}/fragment", get(run_fragment))
        .route("/runs/{id}/{action}", get(confirm_page).post(run_action))
        .route("/queues", get(queues_page))
        .route("/queues/fragment", get(queues_fragment))
        .route("/workers", get(workers_page))
        .route("/workers/fragment", get(workers_fragment))
        .route("/schedules", get(schedules_page))
        .route("/schedules/fragment", get(schedules_fragment))
        .route(
            "/schedules/{name}/{action}",
            get(schedule_confirm_page).post(schedule_action),
        )
        .route("/login", get(login_page).post(login))
        .route("/logout", post(logout))
        .route("/assets/dashboard.js", get(script))
        .route("/assets/dashboard.css", get(style))
        .layer(axum::middleware::map_response(protect))
        .with_state(state)
}

/// Headers on every answer: no framing by other pages (a confirmation button cannot be clicked through a
/// frame), no content sniffing, no URLs with run ids in referrers to other sites.
async fn protect(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static("frame-ancestors 'none'"),
    );
    headers.insert(
        header::X_FRAME_OPTIONS,
        header::HeaderValue::from_static("DENY"),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        header::HeaderValue::from_static("same-origin"),
    );
    response
}

/// The path the dashboard is mounted at (`""` when served alone), for links.
#[derive(Debug, Clone)]
pub(crate) struct Base(pub(crate) String);

impl Base {
    /// `path` (starting with `/`) under the mount point.
    pub(crate) fn link(&self, path: &str) -> String {
        format!("{}{path}", self.0)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Base {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let inner = parts.uri.path().to_owned();
        let full = parts
            .extensions
            .get::<OriginalUri>()
            .map_or_else(|| inner.clone(), |o| o.0.path().to_owned());
        let base = full
            .strip_suffix(inner.as_str())
            .unwrap_or("")
            .trim_end_matches('/');
        Ok(Base(base.to_owned()))
    }
}

/// An error page with its status.
pub(crate) struct PageError {
    status: StatusCode,
    message: String,
}

impl PageError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl From<AdminError> for PageError {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::BadCursor(_) => Self::new(StatusCode::BAD_REQUEST, e.to_string()),
            other => {
                tracing::warn!(error = %other, "pgflow dashboard: a read failed");
                Self::new(StatusCode::SERVICE_UNAVAILABLE, other.to_string())
            }
        }
    }
}

impl From<sqlx::Error> for PageError {
    fn from(e: sqlx::Error) -> Self {
        AdminError::from(e).into()
    }
}

impl IntoResponse for PageError {
    fn into_response(self) -> Response {
        (self.status, pages::error_page(self.status, &self.message)).into_response()
    }
}

type PageResult = Result<Markup, PageError>;

/// The operator signed in on this request, when writes are enabled and the session cookie is valid.
fn operator(state: &AppState, jar: &CookieJar) -> Option<String> {
    let auth = state.write.as_ref()?;
    auth.session_actor(jar.get(SESSION_COOKIE)?.value())
}

/// What a page needs to know about writes: enabled, and by whom with which CSRF token.
#[derive(Debug, Clone)]
pub(crate) struct Writer {
    /// Whether the dashboard allows writes at all.
    pub(crate) enabled: bool,
    /// The signed-in operator and their CSRF token.
    pub(crate) session: Option<(String, String)>,
}

fn writer(state: &AppState, jar: &CookieJar) -> Writer {
    Writer {
        enabled: state.write.is_some(),
        session: operator(state, jar).map(|actor| {
            let csrf = state
                .write
                .as_ref()
                .expect("a session needs writes")
                .csrf(&actor);
            (actor, csrf)
        }),
    }
}

// ---------------------------------------------------------------------------------------------------- runs

/// The run list's query string (every field optional; empty fields are unset).
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct RunsQuery {
    pub(crate) flow: Option<String>,
    pub(crate) version: Option<String>,
    pub(crate) status: Option<String>,
    pub(crate) from: Option<String>,
    pub(crate) to: Option<String>,
    pub(crate) path: Option<String>,
    pub(crate) value: Option<String>,
    pub(crate) after: Option<String>,
}

fn set(field: &Option<String>) -> Option<&str> {
    field.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

fn parse_time(what: &str, text: &str) -> Result<DateTime<Utc>, PageError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(text) {
        return Ok(t.with_timezone(&Utc));
    }
    for format in ["%Y-%m-%dT%H:%M", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S"] {
        if let Ok(t) = NaiveDateTime::parse_from_str(text, format) {
            return Ok(t.and_utc());
        }
    }
    Err(PageError::new(
        StatusCode::BAD_REQUEST,
        format!("`{what}` = `{text}` is not a time: use 2026-12-06T02:30 (UTC) or RFC 3339"),
    ))
}

impl RunsQuery {
    /// The admin filter this query asks for.
    pub(crate) fn filter(&self) -> Result<RunFilter, PageError> {
        let mut f = RunFilter::new();
        if let Some(flow) = set(&self.flow) {
            f = f.flow(flow);
        }
        if let Some(version) = set(&self.version) {
            f = f.version(version);
        }
        if let Some(status) = set(&self.status) {
            let status: RunStatus = status
                .parse()
                .map_err(|e: String| PageError::new(StatusCode::BAD_REQUEST, e))?;
            f = f.status(status);
        }
        if let Some(from) = set(&self.from) {
            f = f.started_after(parse_time("from", from)?);
        }
        if let Some(to) = set(&self.to) {
            f = f.started_before(parse_time("to", to)?);
        }
        match (set(&self.path), set(&self.value)) {
            (Some(path), Some(value)) => {
                // JSON when it parses (numbers, booleans, quoted strings), else the text itself.
                let value = serde_json::from_str(value).unwrap_or_else(|_| Value::from(value));
                f = f.input_equals(path.split('.').map(str::to_owned), value);
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(PageError::new(
                    StatusCode::BAD_REQUEST,
                    "the input filter needs both a JSON path (like customer.id) and a value",
                ))
            }
            (None, None) => {}
        }
        if let Some(after) = set(&self.after) {
            f = f.after(after.parse()?);
        }
        Ok(f)
    }

    /// The query string of this filter (without the page cursor unless `with_cursor`).
    pub(crate) fn query_string(&self, with_cursor: bool) -> String {
        let pairs = [
            ("flow", &self.flow),
            ("version", &self.version),
            ("status", &self.status),
            ("from", &self.from),
            ("to", &self.to),
            ("path", &self.path),
            ("value", &self.value),
            ("after", &self.after),
        ];
        pairs
            .iter()
            .filter(|(k, _)| with_cursor || *k != "after")
            .filter_map(|(k, v)| set(v).map(|v| format!("{k}={}", encode(v))))
            .collect::<Vec<_>>()
            .join("&")
    }
}

/// Percent-encodes a query-string value.
pub(crate) fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

async fn runs_data(state: &AppState, q: &RunsQuery) -> Result<pages::RunsData, PageError> {
    let filter = q.filter()?;
    let page = state.admin.runs(&filter).await?;
    let counts = state.admin.run_counts(&filter).await?;
    Ok(pages::RunsData {
        page,
        counts,
        hidden: state.admin.payloads_hidden(),
    })
}

async fn runs_page(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    Query(q): Query<RunsQuery>,
) -> PageResult {
    let data = runs_data(&state, &q).await?;
    let w = writer(&state, &jar);
    Ok(pages::runs_page(&base, &w, &q, &data))
}

async fn runs_fragment(
    State(state): State<Shared>,
    base: Base,
    Query(q): Query<RunsQuery>,
) -> PageResult {
    let data = runs_data(&state, &q).await?;
    Ok(pages::runs_live(&base, &q, &data))
}

// ----------------------------------------------------------------------------------------------------- run

fn run_id(text: &str) -> Result<Uuid, PageError> {
    text.parse().map_err(|_| {
        PageError::new(
            StatusCode::NOT_FOUND,
            format!("`{text}` is not a run id (a UUID)"),
        )
    })
}

async fn run_detail(
    state: &AppState,
    id: &str,
) -> Result<pgflow_runtime::admin::RunDetail, PageError> {
    let id = run_id(id)?;
    state.admin.run(id).await?.ok_or_else(|| {
        PageError::new(
            StatusCode::NOT_FOUND,
            format!("no run {id}: it never started, or retention removed it"),
        )
    })
}

async fn run_page(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    Path(id): Path<String>,
) -> PageResult {
    let detail = run_detail(&state, &id).await?;
    let w = writer(&state, &jar);
    Ok(pages::run_page(
        &base,
        &w,
        &detail,
        state.admin.payloads_hidden(),
    ))
}

async fn run_fragment(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    Path(id): Path<String>,
) -> PageResult {
    let detail = run_detail(&state, &id).await?;
    let w = writer(&state, &jar);
    Ok(pages::run_live(
        &base,
        &w,
        &detail,
        state.admin.payloads_hidden(),
    ))
}

// ------------------------------------------------------------------------------------------- queues, workers

async fn queues_data(state: &AppState) -> Result<pages::QueuesData, PageError> {
    Ok(pages::QueuesData {
        queues: state.admin.queues().await?,
        rates: state.admin.queue_rates(10).await?,
        uncovered: state.admin.uncovered_routes().await?,
        gaps: state.admin.coverage_gaps().await?,
        functions: state.admin.worker_functions().await?,
    })
}

async fn queues_page(State(state): State<Shared>, base: Base, jar: CookieJar) -> PageResult {
    let data = queues_data(&state).await?;
    Ok(pages::queues_page(&base, &writer(&state, &jar), &data))
}

async fn queues_fragment(State(state): State<Shared>) -> PageResult {
    Ok(pages::queues_live(&queues_data(&state).await?))
}

async fn workers_data(state: &AppState) -> Result<pages::WorkersData, PageError> {
    Ok(pages::WorkersData {
        workers: state
            .admin
            .workers(std::time::Duration::from_secs(3600))
            .await?,
        flows: state.admin.flows().await?,
        aliases: state.admin.aliases().await?,
    })
}

async fn workers_page(State(state): State<Shared>, base: Base, jar: CookieJar) -> PageResult {
    let data = workers_data(&state).await?;
    Ok(pages::workers_page(&base, &writer(&state, &jar), &data))
}

async fn workers_fragment(State(state): State<Shared>) -> PageResult {
    Ok(pages::workers_live(&workers_data(&state).await?))
}

async fn schedules_page(State(state): State<Shared>, base: Base, jar: CookieJar) -> PageResult {
    let schedules = state.admin.schedules().await?;
    Ok(pages::schedules_page(
        &base,
        &writer(&state, &jar),
        &schedules,
    ))
}

async fn schedules_fragment(State(state): State<Shared>, base: Base, jar: CookieJar) -> PageResult {
    let schedules = state.admin.schedules().await?;
    Ok(pages::schedules_live(
        &base,
        &writer(&state, &jar),
        &schedules,
    ))
}

// -------------------------------------------------------------------------------------------------- assets

async fn script() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("../../assets/dashboard.js"),
    )
}

async fn style() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        include_str!("../../assets/dashboard.css"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_in_returns_only_to_a_page_of_the_dashboard() {
        let base = Base("/ops".into());
        assert_eq!(
            safe_next(&base, Some("/ops/runs/x/cancel")),
            "/ops/runs/x/cancel"
        );
        for bad in [
            "//evil.example/",
            "/\\evil.example",
            "https://evil.example/ops/",
            "/other",
            "/ops",
        ] {
            assert_eq!(safe_next(&base, Some(bad)), "/ops/runs", "{bad}");
        }
        let root = Base(String::new());
        assert_eq!(
            safe_next(&root, Some("/runs?status=failed")),
            "/runs?status=failed"
        );
        assert_eq!(safe_next(&root, Some("//evil.example")), "/runs");
        assert_eq!(safe_next(&root, None), "/runs");
    }
}
