//! What a worker tells about itself: what startup did with each deployment, why it stopped, its counts.

use std::fmt;

use uuid::Uuid;

/// Why a worker stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StopReason {
    /// The shutdown token fired.
    Shutdown,
    /// `pgflow.workers.deprecated_at` was set.
    Deprecated,
    /// The worker function was disabled.
    Disabled,
}

/// What startup compilation did with a flow (`pgflow.ensure_flow_compiled`'s status).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompileStatus {
    /// The flow did not exist and was created.
    Compiled,
    /// The stored flow matched this build.
    Verified,
    /// The stored flow differed and was replaced (a local database, or `Compilation::AllowDataLoss`).
    Recompiled,
    /// Compilation was skipped (`Compilation::Skip`).
    Skipped,
}

impl CompileStatus {
    /// The SQL status text (`compiled`, `verified`, `recompiled`) or `skipped`.
    pub const fn as_str(self) -> &'static str {
        match self {
            CompileStatus::Compiled => "compiled",
            CompileStatus::Verified => "verified",
            CompileStatus::Recompiled => "recompiled",
            CompileStatus::Skipped => "skipped",
        }
    }
}

impl fmt::Display for CompileStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What startup did with a deployment's alias.
///
/// A worker activates the alias of every deployment it serves while it compiles it, except when a
/// deployment served later by the same worker has the same alias: versions of one flow share an alias while
/// the older drains, and the one served last is the one new runs start.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AliasActivation {
    /// Nothing was activated: the deployment has no alias, or compilation was skipped.
    None,
    /// This startup pointed the alias at this version.
    Activated {
        /// The alias.
        alias: String,
        /// The version it pointed at before (`None` for a new alias).
        previous_flow_slug: Option<String>,
    },
    /// The alias already pointed at this version.
    AlreadyActive {
        /// The alias.
        alias: String,
    },
    /// Another deployment of this worker, served later, has the same alias and activated it; this version
    /// was compiled or verified only (typically the older version, draining).
    Superseded {
        /// The alias.
        alias: String,
        /// The concrete flow of this worker that activated it.
        by_flow_slug: String,
    },
}

impl fmt::Display for AliasActivation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AliasActivation::None => f.write_str("no alias activated"),
            AliasActivation::Activated {
                alias,
                previous_flow_slug: Some(previous),
            } => write!(f, "alias `{alias}` activated (was `{previous}`)"),
            AliasActivation::Activated { alias, .. } => write!(f, "alias `{alias}` activated"),
            AliasActivation::AlreadyActive { alias } => {
                write!(f, "alias `{alias}` already active")
            }
            AliasActivation::Superseded {
                alias,
                by_flow_slug,
            } => write!(f, "alias `{alias}` left to `{by_flow_slug}`"),
        }
    }
}

/// What startup did with one deployment of the worker's registry.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeploymentStatus {
    /// The concrete flow slug.
    pub flow_slug: String,
    /// The steps of it this worker runs (those routed to its queue), in step order.
    pub steps: Vec<String>,
    /// What compilation did.
    pub compile_status: CompileStatus,
    /// What happened to its alias.
    pub alias: AliasActivation,
}

impl fmt::Display for DeploymentStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} [{}]: {}, {}",
            self.flow_slug,
            self.steps.join(", "),
            self.compile_status,
            self.alias
        )
    }
}

/// What a worker did, returned when it stops cleanly.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct WorkerReport {
    /// The worker id.
    pub worker_id: Uuid,
    /// Why it stopped.
    pub stop_reason: StopReason,
    /// What startup compilation did with the (first) flow.
    pub compile_status: CompileStatus,
    /// What startup did with every deployment, in registry order.
    pub deployments: Vec<DeploymentStatus>,
    /// Tasks whose output was recorded.
    pub completed: u64,
    /// Tasks whose failure was recorded (retried or not).
    pub failed: u64,
    /// Results ignored as stale: the task had moved on to another attempt (or finished) meanwhile.
    pub stale: u64,
    /// Messages read while their task was running under another claim: left alone for that attempt
    /// (PGMQ delivers at least once; a message whose visibility ran out during a long handler is read
    /// again). Many of these mean a step's timeout outlasts the read visibility.
    pub deferred: u64,
    /// Unfinished tasks handed back at shutdown.
    pub released: u64,
}
