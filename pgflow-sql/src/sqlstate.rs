//! The SQLSTATE codes the pgflow SQL core raises, as a type.
//!
//! The SQL core raises its own codes (`PF001` to `PF020`) for routing, queue and alias errors, `PF031` to `PF036` for run control,, and a few
//! standard ones for bad arguments. [`SqlState`] names each of them; a code this build does not know is
//! kept as it came ([`SqlState::Other`]), never taken for a known one.

use std::fmt;

macro_rules! sqlstates {
    ($($(#[$doc:meta])* $name:ident = $code:literal,)*) => {
        /// A SQLSTATE code: one the pgflow SQL core raises, or any other ([`SqlState::Other`]).
        ///
        /// ```
        /// use pgflow_sql::SqlState;
        /// assert_eq!(SqlState::from_code("PF020"), SqlState::SubscriptionInvalid);
        /// assert_eq!(SqlState::SubscriptionInvalid.code(), "PF020");
        /// assert_eq!(SqlState::from_code("57014").code(), "57014");
        /// ```
        #[derive(Debug, Clone, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum SqlState {
            $($(#[$doc])* $name,)*
            /// A code this build does not name, as the server sent it.
            Other(String),
        }

        impl SqlState {
            /// The state of a five-character SQLSTATE code.
            pub fn from_code(code: &str) -> Self {
                match code {
                    $($code => SqlState::$name,)*
                    other => SqlState::Other(other.to_owned()),
                }
            }

            /// The five-character code.
            pub fn code(&self) -> &str {
                match self {
                    $(SqlState::$name => $code,)*
                    SqlState::Other(code) => code,
                }
            }
        }
    };
}

sqlstates! {
    /// `PF001`: a concrete flow is deployed with another queue mode or route map.
    RoutingChanged = "PF001",
    /// `PF002`: the caller's route map differs from the one the SQL resolves.
    RouteMapDisagrees = "PF002",
    /// `PF010`: the flow cannot use per-step queues (its slug is too long, or it has no steps).
    StepQueuesImpossible = "PF010",
    /// `PF011`: both queue names of a step (readable and index fallback) are too long.
    StepQueueNameTooLong = "PF011",
    /// `PF012`: two steps resolve to the same queue name.
    DuplicateQueueName = "PF012",
    /// `PF013`: a generated queue is already used by another flow.
    QueueNotPrivate = "PF013",
    /// `PF014`: a named queue is not a valid queue name.
    InvalidQueueName = "PF014",
    /// `PF015`: a route map is missing, incomplete, or names a step twice or a step the flow lacks.
    InvalidRouteMap = "PF015",
    /// `PF016`: a queue private to one flow is named as shared, or the other way round.
    QueueSharingConflict = "PF016",
    /// `PF017`: a named queue exists in PGMQ but pgflow did not create it, and adoption was not asked for.
    QueueNotAdopted = "PF017",
    /// `PF018`: an alias collides with a concrete flow slug (or another alias, by letter case).
    AliasCollision = "PF018",
    /// `PF019`: a flow slug names no compiled flow (an alias target, or the version asked about).
    /// `version_retirable`'s error lists the known slugs.
    AliasTargetMissing = "PF019",
    /// `PF020`: a worker's subscription does not match the persisted routes.
    SubscriptionInvalid = "PF020",
    /// `PF031`: no such run (never started, or removed by retention): cancel, retry or replay of an unknown run.
    RunNotFound = "PF031",
    /// `PF032`: the run cannot be retried in its state (still started, or completed: replay it instead).
    RunNotRetryable = "PF032",
    /// `PF033`: the run's flow version is gone (a queue of a step that would run again no longer exists).
    FlowVersionGone = "PF033",
    /// `PF034`: a replay from a step the run's flow does not have.
    UnknownReplayStep = "PF034",
    /// `PF035`: an idempotency key was used before with another input.
    IdempotencyKeyConflict = "PF035",
    /// `PF036`: a replay is impossible: a dependency of the step did not complete in the original run.
    ReplayNotPossible = "PF036",
    /// `22023` (`invalid_parameter_value`): an argument the SQL core refuses.
    InvalidParameterValue = "22023",
    /// `23000` (`integrity_constraint_violation`).
    IntegrityConstraintViolation = "23000",
    /// `23505` (`unique_violation`), for example a run id given twice.
    UniqueViolation = "23505",
    /// `42501` (`insufficient_privilege`): the role may not call the function or read the table.
    InsufficientPrivilege = "42501",
    /// `42710` (`duplicate_object`), for example a queue that exists without pgflow.
    DuplicateObject = "42710",
    /// `42704` (`undefined_object`), for example a schedule of a flow or alias that is not compiled.
    UndefinedObject = "42704",
}

impl SqlState {
    /// Whether the code is one of the pgflow SQL core's own (`PF...`).
    pub fn is_pgflow(&self) -> bool {
        self.code().starts_with("PF")
    }

    /// The SQLSTATE of a database error (`None` for any other error, or a database error without one).
    #[cfg(feature = "install")]
    pub fn of(error: &sqlx::Error) -> Option<Self> {
        error
            .as_database_error()
            .and_then(|e| e.code())
            .map(|code| Self::from_code(&code))
    }
}

impl fmt::Display for SqlState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

#[cfg(test)]
mod tests {
    use super::SqlState;

    #[test]
    fn every_named_code_comes_back_as_itself_and_others_are_kept() {
        for code in [
            "PF001", "PF002", "PF010", "PF011", "PF012", "PF013", "PF014", "PF015", "PF016",
            "PF017", "PF018", "PF019", "PF020", "22023", "23000", "23505", "42501", "42710",
        ] {
            let state = SqlState::from_code(code);
            assert!(!matches!(state, SqlState::Other(_)), "{code}");
            assert_eq!(state.code(), code);
        }
        assert_eq!(
            SqlState::from_code("PF099"),
            SqlState::Other("PF099".into())
        );
        assert!(SqlState::from_code("PF099").is_pgflow());
        assert!(!SqlState::UniqueViolation.is_pgflow());
    }
}
