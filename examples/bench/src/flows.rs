//! The benchmark's flows as `#[flow]` modules, run by the pgflow-rs workers. Their shapes are also
//! what the upstream-style driver's flows are compiled from, so both drive identical definitions.

use pgflow_runtime::{flow, StepError};

#[flow(slug = "benchDiamond", input = i64)]
pub(crate) mod diamond {
    use super::StepError;
    use crate::processes::probe;

    #[step]
    async fn a(n: i64) -> Result<i64, StepError> {
        probe::mark(probe::Mark::RootStarted, n);
        probe::mark(probe::Mark::RootDone, n);
        Ok(n)
    }

    #[step(depends_on = [a])]
    async fn b(a: i64) -> Result<i64, StepError> {
        probe::mark(probe::Mark::DependentStarted, a);
        Ok(a + 1)
    }

    #[step(depends_on = [a])]
    async fn c(a: i64) -> Result<i64, StepError> {
        Ok(a + 1)
    }

    #[step(depends_on = [b, c])]
    async fn d(b: i64, c: i64) -> Result<i64, StepError> {
        Ok(b + c)
    }
}

#[flow(slug = "benchMap10", input = Vec<i64>)]
pub(crate) mod map10 {
    use super::StepError;

    #[step(map)]
    async fn double(x: i64) -> Result<i64, StepError> {
        Ok(x * 2)
    }
}

/// One tenant's job, for the flow-control scenarios (public: the flow's input type appears in the
/// generated flow type's interface).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[allow(unreachable_pub)]
pub struct TenantJob {
    /// The key of the per-key limit.
    pub tenant: String,
}

#[flow(slug = "benchTenant", input = TenantJob)]
pub(crate) mod tenant {
    use super::{StepError, TenantJob};

    #[step]
    async fn work(job: TenantJob) -> Result<usize, StepError> {
        Ok(job.tenant.len())
    }
}

/// The diamond's shape with a keyed input, for the flow-control overhead scenario (`--only priority`).
#[flow(slug = "benchKeyed", input = TenantJob)]
pub(crate) mod keyed_diamond {
    use super::{StepError, TenantJob};

    #[step]
    async fn a(job: TenantJob) -> Result<usize, StepError> {
        Ok(job.tenant.len())
    }

    #[step(depends_on = [a])]
    async fn b(a: usize) -> Result<usize, StepError> {
        Ok(a + 1)
    }

    #[step(depends_on = [a])]
    async fn c(a: usize) -> Result<usize, StepError> {
        Ok(a + 1)
    }

    #[step(depends_on = [b, c])]
    async fn d(b: usize, c: usize) -> Result<usize, StepError> {
        Ok(b + c)
    }
}
