//! [`RunHandle`]: a started run, typed by its flow.

use std::fmt;
use std::marker::PhantomData;
use std::time::Duration;

use uuid::Uuid;

use super::{CancelOutcome, Client, ClientError, RunState, RunStatus, WaitError};
use crate::flows::Flow;

/// A typed run: its id, its concrete flow, and a way to wait for its output.
///
/// Started by alias ([`Client::start_deployed`]), the run may be of another version than `F` (the alias
/// pointed elsewhere): [`RunHandle::flow_slug`] says which, [`RunHandle::as_version`] gives the handle typed
/// by that version, and [`RunHandle::wait`] decodes the output as `F`'s.
pub struct RunHandle<F: Flow> {
    pub(super) run_id: Uuid,
    pub(super) flow_slug: String,
    pub(super) client: Client,
    pub(super) _flow: PhantomData<fn() -> F>,
}

impl<F: Flow> RunHandle<F> {
    /// The run id (`pgflow.runs.run_id`).
    pub fn run_id(&self) -> Uuid {
        self.run_id
    }

    /// The concrete flow slug of the run (`pgflow.runs.flow_slug`): what an alias resolved to.
    pub fn flow_slug(&self) -> &str {
        &self.flow_slug
    }

    /// This handle typed by concrete flow `G`, when the run is of `G`.
    pub fn as_version<G: Flow>(&self) -> Option<RunHandle<G>> {
        (self.flow_slug == G::SLUG).then(|| RunHandle {
            run_id: self.run_id,
            flow_slug: self.flow_slug.clone(),
            client: self.client.clone(),
            _flow: PhantomData,
        })
    }

    /// The run with its step states.
    ///
    /// # Errors
    ///
    /// See [`Client::run`].
    pub async fn state(&self) -> Result<Option<RunState>, ClientError> {
        self.client.run(self.run_id).await
    }

    /// Waits for the typed output.
    ///
    /// # Errors
    ///
    /// [`WaitError::OtherVersion`] at once when the run is not of `F` (a handle of
    /// [`Client::start_deployed`] whose alias resolved to another version); otherwise see [`Client::wait`].
    pub async fn wait(&self, timeout: Duration) -> Result<F::Output, WaitError> {
        if self.flow_slug != F::SLUG {
            return Err(WaitError::OtherVersion {
                run_id: self.run_id,
                expected_flow_slug: F::SLUG,
                flow_slug: self.flow_slug.clone(),
            });
        }
        self.client.wait::<F>(self.run_id, timeout).await
    }

    /// Cancels the run; see [`Client::cancel`].
    ///
    /// # Errors
    ///
    /// See [`Client::cancel`].
    pub async fn cancel(&self, reason: Option<&str>) -> Result<CancelOutcome, ClientError> {
        self.client.cancel(self.run_id, reason).await
    }

    /// Retries the failed or cancelled run in place; see [`Client::retry`].
    ///
    /// # Errors
    ///
    /// See [`Client::retry`].
    pub async fn retry(&self) -> Result<RunStatus, ClientError> {
        self.client.retry(self.run_id).await
    }

    /// Replays the run from `from_step` as a new run of the same version; see [`Client::replay`].
    ///
    /// # Errors
    ///
    /// See [`Client::replay`].
    pub async fn replay(&self, from_step: &str) -> Result<RunHandle<F>, ClientError> {
        let run_id = self.client.replay(self.run_id, from_step).await?;
        Ok(RunHandle {
            run_id,
            flow_slug: self.flow_slug.clone(),
            client: self.client.clone(),
            _flow: PhantomData,
        })
    }
}

impl<F: Flow> Clone for RunHandle<F> {
    fn clone(&self) -> Self {
        RunHandle {
            run_id: self.run_id,
            flow_slug: self.flow_slug.clone(),
            client: self.client.clone(),
            _flow: PhantomData,
        }
    }
}

impl<F: Flow> fmt::Debug for RunHandle<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunHandle")
            .field("flow", &self.flow_slug)
            .field("run_id", &self.run_id)
            .finish()
    }
}
