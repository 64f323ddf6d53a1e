//! The JSON answers of the SQL core's worker functions, as types (decoded with `sqlx::types::Json`). A
//! missing field or a value this build does not know is a decode error, never a default.

use serde::Deserialize;

use crate::decode::text_enum;

/// A worker function's fence (`pgflow.track_worker_function`, `pgflow.register_worker`).
#[derive(Debug, Deserialize)]
pub(crate) struct FunctionState {
    /// `false`: fenced; the worker must not claim.
    pub(crate) enabled: bool,
    /// Why it was disabled.
    pub(crate) disabled_reason: Option<String>,
}

/// A heartbeat's answer (`pgflow.worker_heartbeat`).
#[derive(Debug, Deserialize)]
pub(crate) struct Heartbeat {
    /// `false`: the worker function was disabled (elsewhere, perhaps).
    pub(crate) enabled: bool,
    /// `pgflow.workers.deprecated_at` is set: drain and stop.
    pub(crate) deprecated: bool,
    /// Recovery had declared the worker dead; this beat registered it again.
    pub(crate) revived: bool,
    /// Live workers of the worker's queue, itself included (see [`Peers`](super::background::Peers)).
    pub(crate) peers: usize,
}

/// What one maintenance sweep did (`pgflow.run_maintenance`).
#[derive(Debug, Deserialize)]
pub(crate) struct MaintenanceReport {
    /// Another caller held the maintenance lock; nothing was done.
    #[allow(dead_code)]
    pub(crate) skipped: bool,
    /// Stalled tasks requeued (or failed).
    pub(crate) stalled: i64,
    /// Tasks of dead workers recovered.
    pub(crate) dead: i64,
    /// What retention deleted (absent when it did not run).
    pub(crate) pruned: Option<Pruned>,
}

/// What retention deleted (`pgflow.prune_history`).
#[derive(Debug, Deserialize)]
pub(crate) struct Pruned {
    /// Runs deleted.
    pub(crate) runs: i64,
    /// Queue messages archived with them.
    pub(crate) archived_messages: i64,
    /// Stopped workers' rows deleted.
    pub(crate) workers: i64,
}

/// `pgflow.activate_alias`'s answer.
#[derive(Debug, Deserialize)]
pub(crate) struct AliasActivated {
    /// `false`: the alias already pointed at this version.
    pub(crate) activated: bool,
    /// The version it pointed at before (`None` for a new alias).
    pub(crate) previous_flow_slug: Option<String>,
}

text_enum! {
    /// `pgflow.ensure_flow_compiled`'s `status`.
    pub(crate) enum CompileAnswer {
        /// The flow was new and was created.
        Compiled = "compiled",
        /// The stored flow matched.
        Verified = "verified",
        /// The stored flow differed and was replaced (its runs deleted).
        Recompiled = "recompiled",
        /// The stored flow differs and data loss is not allowed.
        Mismatch = "mismatch",
    }
}

/// `pgflow.ensure_flow_compiled`'s answer (without an alias).
#[derive(Debug, Deserialize)]
pub(crate) struct Compilation {
    /// What it did.
    pub(crate) status: CompileAnswer,
    /// How the stored flow differs (empty when it matched or was new).
    pub(crate) differences: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn answers_decode_and_a_missing_field_or_an_unknown_status_is_an_error() {
        let beat: Heartbeat = serde_json::from_value(json!({"function_name": "f", "enabled": true,
            "disabled_reason": null, "disabled_at": null, "deprecated": false, "revived": true,
            "peers": 2}))
        .unwrap();
        assert!(beat.enabled && !beat.deprecated && beat.revived && beat.peers == 2);
        assert!(serde_json::from_value::<Heartbeat>(json!({"enabled": true})).is_err());
        let report: MaintenanceReport =
            serde_json::from_value(json!({"skipped": false, "stalled": 1,
            "dead": 2, "pruned": {"runs": 3, "archived_messages": 4, "workers": 0}}))
            .unwrap();
        assert_eq!(
            (report.stalled, report.dead, report.pruned.unwrap().runs),
            (1, 2, 3)
        );
        let c: Compilation =
            serde_json::from_value(json!({"status": "verified", "differences": []})).unwrap();
        assert_eq!(c.status, CompileAnswer::Verified);
        let unknown =
            serde_json::from_value::<Compilation>(json!({"status": "adopted", "differences": []}));
        assert!(unknown
            .unwrap_err()
            .to_string()
            .contains("unknown CompileAnswer `adopted`"));
    }
}
