//! Deployed flows shared by the runtime tests and the `zero_config_worker` binary: two versions of the
//! community-threads pipeline behind one alias, each step on a named queue, and a per-step-queued flow.
//!
//! `classify` runs on the shared queue `classify_threads` and `deliverSlack` on `deliver_alerts`, in both
//! versions. Every handler's output names the version that ran it, so a test can tell V1 and V2 apart.

use pgflow_runtime::{deployment, queue};
use serde::{Deserialize, Serialize};

/// A community thread.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Thread {
    /// Its text.
    pub text: String,
}

/// What `classify` decided, and which version decided it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Label {
    /// `help` for a question, `chat` otherwise.
    pub route: String,
    /// The version of the handler that ran.
    pub version: String,
}

fn label(thread: &Thread, version: &str) -> Label {
    let route = if thread.text.contains('?') {
        "help"
    } else {
        "chat"
    };
    Label {
        route: route.to_owned(),
        version: version.to_owned(),
    }
}

/// Version 1.
#[pgflow_runtime::flow(slug = "communityThreadsV1", input = Thread)]
pub mod threads_v1 {
    use super::{label, Label, Thread};
    use pgflow_runtime::StepError;

    /// Labels the thread (V1).
    #[step]
    async fn classify(thread: Thread) -> Result<Label, StepError> {
        Ok(label(&thread, "v1"))
    }

    /// Delivers the label (V1).
    #[step(depends_on = [classify], slug = "deliverSlack")]
    async fn deliver_slack(classify: Label) -> Result<String, StepError> {
        Ok(format!(
            "v1 delivered {} (classified by {})",
            classify.route, classify.version
        ))
    }
}

/// Version 2: same shape, new handlers.
#[pgflow_runtime::flow(slug = "communityThreadsV2", input = Thread)]
pub mod threads_v2 {
    use super::{label, Label, Thread};
    use pgflow_runtime::StepError;

    /// Labels the thread (V2).
    #[step]
    async fn classify(thread: Thread) -> Result<Label, StepError> {
        Ok(label(&thread, "v2"))
    }

    /// Delivers the label (V2).
    #[step(depends_on = [classify], slug = "deliverSlack")]
    async fn deliver_slack(classify: Label) -> Result<String, StepError> {
        Ok(format!(
            "v2 delivered {} (classified by {})",
            classify.route, classify.version
        ))
    }
}

/// The shared queue of `classify`.
#[queue("classify_threads")]
pub struct ClassifyThreads;

/// The shared queue of `deliverSlack`.
#[queue("deliver_alerts")]
pub struct DeliverAlerts;

/// The alias producers start (the one both deployments declare).
pub const ALIAS: &str = "communityThreads";

/// V1 behind [`ALIAS`]: `classify` on `classify_threads`, `deliverSlack` on `deliver_alerts`.
#[deployment(alias = "communityThreads")]
pub fn community_v1(step: threads_v1::Step) {
    match step {
        threads_v1::Step::Classify => ClassifyThreads,
        threads_v1::Step::DeliverSlack => DeliverAlerts,
    }
}

/// V2 behind [`ALIAS`], routed like V1.
#[deployment(alias = "communityThreads")]
pub fn community_v2(step: threads_v2::Step) {
    match step {
        threads_v2::Step::Classify => ClassifyThreads,
        threads_v2::Step::DeliverSlack => DeliverAlerts,
    }
}

/// A flow deployed with one private queue per step, for the zero-configuration step worker.
#[pgflow_runtime::flow(slug = "zeroConfigSteps", input = i64, step_queues)]
pub mod zero_config_steps {
    use pgflow_runtime::StepError;

    /// Doubles.
    #[step]
    async fn double(n: i64) -> Result<i64, StepError> {
        Ok(n * 2)
    }
}

/// A one-step flow that schedules start: the `schedule_worker` binary serves it and fires its schedule.
#[pgflow_runtime::flow(slug = "scheduledTicks", input = i64)]
pub mod scheduled_ticks {
    use pgflow_runtime::StepError;

    /// Returns its input.
    #[step]
    async fn tick(n: i64) -> Result<i64, StepError> {
        Ok(n)
    }
}

/// Work of a tenant, for flow-control tests.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantJob {
    /// The key of the per-key limit.
    pub tenant: String,
}

/// When a handler call of `limitedWork` ran, by the worker's clock: what flow-control tests count.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Call {
    /// The tenant of the run.
    pub tenant: String,
    /// When the handler began.
    pub began: chrono::DateTime<chrono::Utc>,
    /// When the handler ended.
    pub ended: chrono::DateTime<chrono::Utc>,
}

/// A one-step flow whose handler takes a while, so that unlimited workers would overlap: the
/// `schedule_worker limited` binary serves it under the limits a test sets.
#[pgflow_runtime::flow(slug = "limitedWork", input = TenantJob)]
pub mod limited_work {
    use super::{Call, TenantJob};
    use pgflow_runtime::StepError;

    /// Sleeps 100 ms and returns the tenant and when it ran.
    #[step]
    async fn work(job: TenantJob) -> Result<Call, StepError> {
        let began = chrono::Utc::now();
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        Ok(Call {
            tenant: job.tenant,
            began,
            ended: chrono::Utc::now(),
        })
    }
}
