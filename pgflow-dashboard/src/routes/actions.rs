//! The write side: confirmation pages, run and schedule actions (checked, recorded), and signing in and out.

use super::*;

/// A write action on a run, from the URL.
pub(super) fn action_kind(text: &str) -> Result<ActionKind, PageError> {
    match text {
        "cancel" => Ok(ActionKind::Cancel),
        "retry" => Ok(ActionKind::Retry),
        "replay" => Ok(ActionKind::Replay),
        other => Err(PageError::new(
            StatusCode::NOT_FOUND,
            format!("no run action `{other}`: the actions are cancel, retry and replay"),
        )),
    }
}

/// The confirmation page's query: the replay's first step.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ConfirmQuery {
    pub(crate) step: Option<String>,
}

pub(super) async fn confirm_page(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    Path((id, action)): Path<(String, String)>,
    Query(q): Query<ConfirmQuery>,
) -> Result<Response, PageError> {
    let kind = action_kind(&action)?;
    if state.write.is_none() {
        return Err(read_only());
    }
    let detail = run_detail(&state, &id).await?;
    let w = writer(&state, &jar);
    if w.session.is_none() {
        let next = base.link(&format!("/runs/{id}/{action}"));
        let next = match set(&q.step) {
            Some(step) => format!("{next}?step={}", encode(step)),
            None => next,
        };
        return Ok(
            Redirect::to(&base.link(&format!("/login?next={}", encode(&next)))).into_response(),
        );
    }
    Ok(pages::confirm_page(&base, &w, &detail, kind, set(&q.step)).into_response())
}

pub(super) fn read_only() -> PageError {
    PageError::new(
        StatusCode::FORBIDDEN,
        "this dashboard is read-only: start it with a write token to cancel, retry or replay runs",
    )
}

/// A confirmed write action's form.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct ActionForm {
    csrf: Option<String>,
    confirm: Option<String>,
    reason: Option<String>,
    step: Option<String>,
}

/// Checks everything a write needs and returns the operator.
pub(super) fn authorize(
    state: &AppState,
    headers: &HeaderMap,
    jar: &CookieJar,
    csrf: Option<&str>,
) -> Result<String, PageError> {
    let auth = state.write.as_ref().ok_or_else(read_only)?;
    auth::same_origin(headers)
        .map_err(|why| PageError::new(StatusCode::FORBIDDEN, format!("write refused: {why}")))?;
    let actor = operator(state, jar).ok_or_else(|| {
        PageError::new(
            StatusCode::FORBIDDEN,
            "write refused: sign in with the write token first (/login)",
        )
    })?;
    if !csrf.is_some_and(|c| auth.csrf_matches(&actor, c)) {
        return Err(PageError::new(
            StatusCode::FORBIDDEN,
            "write refused: the form's CSRF token is missing or stale; reload the page and confirm again",
        ));
    }
    Ok(actor)
}

pub(super) async fn run_action(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    headers: HeaderMap,
    Path((id, action)): Path<(String, String)>,
    Form(form): Form<ActionForm>,
) -> Result<Response, PageError> {
    let kind = action_kind(&action)?;
    let actor = authorize(&state, &headers, &jar, form.csrf.as_deref())?;
    if form.confirm.as_deref() != Some("yes") {
        return Err(PageError::new(
            StatusCode::BAD_REQUEST,
            "write refused: not confirmed (use the confirmation page's button)",
        ));
    }
    let run_id = run_id(&id)?;
    let mut record = NewAction::on_run(&actor, "dashboard", kind, run_id);
    let mut target = run_id;
    let outcome = match kind {
        ActionKind::Cancel => {
            let reason = set(&form.reason)
                .map(str::to_owned)
                .unwrap_or_else(|| format!("cancelled by {actor} from the dashboard"));
            state.client.cancel(run_id, Some(&reason)).await.map(
                |o| json!({"reason": reason, "status": o.status.as_str(), "changed": o.changed}),
            )
        }
        ActionKind::Retry => state
            .client
            .retry(run_id)
            .await
            .map(|status| json!({"status": status.as_str()})),
        _ => {
            let step = set(&form.step).ok_or_else(|| {
                PageError::new(
                    StatusCode::BAD_REQUEST,
                    "a replay needs the step to start from",
                )
            })?;
            state.client.replay(run_id, step).await.map(|new_run| {
                target = new_run;
                json!({"from_step": step, "new_run_id": new_run})
            })
        }
    };
    let failed = outcome.as_ref().err().map(|e| e.to_string());
    record = match outcome {
        Ok(detail) => record.detail(detail),
        Err(e) => record
            .detail(json!({"reason": form.reason, "from_step": form.step}))
            .outcome(Err(e.to_string())),
    };
    state.admin.record_action(&record).await?;
    if let Some(error) = failed {
        return Err(PageError::new(
            StatusCode::CONFLICT,
            format!("{action} of run {run_id} refused: {error}"),
        ));
    }
    Ok(Redirect::to(&base.link(&format!("/runs/{target}"))).into_response())
}

/// A write action on a schedule, from the URL.
pub(super) fn schedule_kind(text: &str) -> Result<ActionKind, PageError> {
    match text {
        "pause" => Ok(ActionKind::PauseSchedule),
        "resume" => Ok(ActionKind::ResumeSchedule),
        other => Err(PageError::new(
            StatusCode::NOT_FOUND,
            format!("no schedule action `{other}`: the actions are pause and resume"),
        )),
    }
}

pub(super) async fn schedule_confirm_page(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    Path((name, action)): Path<(String, String)>,
) -> Result<Response, PageError> {
    let kind = schedule_kind(&action)?;
    if state.write.is_none() {
        return Err(read_only());
    }
    let w = writer(&state, &jar);
    if w.session.is_none() {
        let next = base.link(&format!("/schedules/{}/{action}", encode(&name)));
        return Ok(
            Redirect::to(&base.link(&format!("/login?next={}", encode(&next)))).into_response(),
        );
    }
    let schedules = state.admin.schedules().await?;
    let schedule = schedules
        .iter()
        .find(|s| s.schedule_name == name)
        .ok_or_else(|| PageError::new(StatusCode::NOT_FOUND, format!("no schedule `{name}`")))?;
    Ok(pages::schedule_confirm_page(&base, &w, schedule, kind).into_response())
}

pub(super) async fn schedule_action(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    headers: HeaderMap,
    Path((name, action)): Path<(String, String)>,
    Form(form): Form<ActionForm>,
) -> Result<Response, PageError> {
    let kind = schedule_kind(&action)?;
    let actor = authorize(&state, &headers, &jar, form.csrf.as_deref())?;
    if form.confirm.as_deref() != Some("yes") {
        return Err(PageError::new(
            StatusCode::BAD_REQUEST,
            "write refused: not confirmed (use the confirmation page's button)",
        ));
    }
    let pool = state.admin.pool();
    let outcome = if kind == ActionKind::PauseSchedule {
        pgflow_runtime::schedules::pause(pool, &name).await
    } else {
        pgflow_runtime::schedules::resume(pool, &name).await
    };
    let failed = outcome.as_ref().err().map(|e| e.to_string());
    let record = NewAction::on_schedule(&actor, "dashboard", kind, &name)
        .outcome(failed.clone().map_or(Ok(()), Err));
    state.admin.record_action(&record).await?;
    if let Some(error) = failed {
        return Err(PageError::new(
            StatusCode::CONFLICT,
            format!("{action} of schedule `{name}` refused: {error}"),
        ));
    }
    Ok(Redirect::to(&base.link("/schedules")).into_response())
}

// ------------------------------------------------------------------------------------------------- sign-in

/// Where to go after signing in.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct NextQuery {
    next: Option<String>,
}

/// A local path under the mount point, or the run list (never another site: no `//host`, `/\\host` or scheme).
pub(crate) fn safe_next(base: &Base, next: Option<&str>) -> String {
    match next {
        Some(n)
            if n.starts_with(&format!("{}/", base.0))
                && !n.starts_with("//")
                && !n.contains("://")
                && !n.contains('\\') =>
        {
            n.to_owned()
        }
        _ => base.link("/runs"),
    }
}

pub(super) async fn login_page(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    Query(q): Query<NextQuery>,
) -> PageResult {
    if state.write.is_none() {
        return Err(read_only());
    }
    let next = safe_next(&base, q.next.as_deref());
    Ok(pages::login_page(&base, &writer(&state, &jar), &next, None))
}

#[derive(Debug, Default, Deserialize)]
pub(crate) struct LoginForm {
    actor: Option<String>,
    token: Option<String>,
    next: Option<String>,
}

pub(super) async fn login(
    State(state): State<Shared>,
    base: Base,
    jar: CookieJar,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Result<Response, PageError> {
    let auth = state.write.as_ref().ok_or_else(read_only)?;
    auth::same_origin(&headers)
        .map_err(|why| PageError::new(StatusCode::FORBIDDEN, format!("sign-in refused: {why}")))?;
    let next = safe_next(&base, form.next.as_deref());
    let actor = set(&form.actor).unwrap_or("").to_owned();
    let problem = if !auth::valid_actor(&actor) {
        Some("your name: 1 to 64 letters, digits and . _ @ -")
    } else if !auth.token_matches(form.token.as_deref().unwrap_or("")) {
        Some("that is not the write token")
    } else {
        None
    };
    if let Some(problem) = problem {
        return Ok((
            StatusCode::UNAUTHORIZED,
            pages::login_page(&base, &writer(&state, &jar), &next, Some(problem)),
        )
            .into_response());
    }
    let cookie = Cookie::build((SESSION_COOKIE, auth.session_value(&actor)))
        .path(if base.0.is_empty() {
            "/".to_owned()
        } else {
            base.0.clone()
        })
        .http_only(true)
        .same_site(SameSite::Strict)
        .build();
    Ok((jar.add(cookie), Redirect::to(&next)).into_response())
}

pub(super) async fn logout(
    base: Base,
    jar: CookieJar,
    headers: HeaderMap,
) -> Result<Response, PageError> {
    auth::same_origin(&headers)
        .map_err(|why| PageError::new(StatusCode::FORBIDDEN, format!("sign-out refused: {why}")))?;
    let cookie = Cookie::build((SESSION_COOKIE, ""))
        .path(if base.0.is_empty() {
            "/".to_owned()
        } else {
            base.0.clone()
        })
        .build();
    Ok((jar.remove(cookie), Redirect::to(&base.link("/runs"))).into_response())
}
