//! The unreleased development migrations 0001–0030 that the baseline replaced, by version, name and
//! checksum: a database whose records are exactly these is upgraded in place (see [`crate::install`]).

/// (version, name, SHA-256 of the SQL) of each development migration, in order.
pub(crate) const DEVELOPMENT_MIGRATIONS: &[(&str, &str, &str)] = &[
    (
        "0001",
        "pgflow_schema",
        "0942745285ce538deec50a74f8da77eef8f03122d1b81391c2606fb60d83de39",
    ),
    (
        "0002",
        "utilities",
        "76a38755b6bc47f83c94f39c31baaa7f2ca76979faab27f829d553e9ea75009f",
    ),
    (
        "0003",
        "tables",
        "2b00024000058f70fd4996cb0c2326c8fb480ac122c39aa7351c358ce5a66b02",
    ),
    (
        "0004",
        "events",
        "b16b66257c7380306c661efbad9e08f229bdb5b77b4bb63f1ffefefec0e5f182",
    ),
    (
        "0005",
        "definitions",
        "094f4a6b7be343f8d86301ea524d1a0dca3679a4ee538b8643a80f9520ab877f",
    ),
    (
        "0006",
        "runs",
        "e81adb4f50bdef9749811b853d958d62416c354410ee0a8af5928f6667335710",
    ),
    (
        "0007",
        "tasks",
        "12e22b1fe3f73af146aa9cddcda4b3e45042304dba02d74cb0699bc9807fbf44",
    ),
    (
        "0008",
        "maintenance",
        "67d39840afda9b911e23b524fac406970a61c51b6465ce9ea66fb5d683d411e8",
    ),
    (
        "0009",
        "queue_names",
        "43a0379dc2749ae041f2c6d3a734fe72bb90e5cfbb4877c5bc03e6f3711c2aa4",
    ),
    (
        "0010",
        "compilation",
        "35e177dead4b80b20d4832c60fe51283fad2df240c73300fc2dbbcc440670a42",
    ),
    (
        "0011",
        "claims",
        "e1c02c16ebae28234a5b10fb8229556de2531723efbc349937fcbbd32a0e38e5",
    ),
    (
        "0012",
        "workers",
        "f3b8b6d5c84a1cc2dc93ffea10dffd56999ddcfcf5426792c1a08cd3be9dc7a9",
    ),
    (
        "0013",
        "queue_coverage",
        "07ee35a9a1201876b34036b62d1d35005ae5a58fc180c017a4812da11994e9c6",
    ),
    (
        "0014",
        "privileges",
        "fa08a8379bffd5d972cb8e6b0d2339f88adc2e300e4a2c1fc86098b6ccff0a25",
    ),
    (
        "0015",
        "deployments",
        "4937d1e43808ac95f0cc424020f8416b4393a4f24610be1520f10af62cfa3ab9",
    ),
    (
        "0016",
        "batch_completion",
        "261c2ba3e6db4fd6cefa6d6158a28e4714166676096e99ecae8cfacf2f0f874f",
    ),
    (
        "0017",
        "worker_exchange",
        "bd67bcab126282c39e3d034db42d1b174391209f65748a26de7a636931725724",
    ),
    (
        "0018",
        "alias_activation",
        "135f0441f85223e743ead0d98a46c3b949c847ff7f369df1a4ff5095ea56d112",
    ),
    (
        "0019",
        "hot_path_plans",
        "37aae2526493e34b0b32fbce26a7a46790898f0d22e8e379f1a3c1e7d63b739c",
    ),
    (
        "0020",
        "hot_path_index_probes",
        "26295b66962bdaa76fbf3dc517e5c5896e643f3402b8b1b64ac58d93601be1a2",
    ),
    (
        "0021",
        "hot_path_statements",
        "653f4e07908098d3b42c807c137dfaf2e9ab8c5b63b520893fa0001288145dab",
    ),
    (
        "0022",
        "root_steps_start_on_insert",
        "15923544f1d32aa530defc6278c6fd86fbee4bd68d24a4f20f8e7b6815eda11b",
    ),
    (
        "0023",
        "ready_steps_start_on_release",
        "a99a4779ff4dbe12b3264806d7e022d2b5ec7c3fc59e6992cde8c73a4a23ed84",
    ),
    (
        "0024",
        "queue_statements",
        "fe0620137565049a7545209c464f08e699bd0ccdbb5c72d309afebca3074e489",
    ),
    (
        "0025",
        "exchange_signals_apart",
        "7edc14ab27f21e626688e39b8f473c5db3492261e4b9aad04723ddc70cd1c77e",
    ),
    (
        "0026",
        "replan_when_tables_grow",
        "45572157885cba7f3fd4c9774518617754cf413514b2e378d4ad6afc7db8d3e3",
    ),
    (
        "0027",
        "start_many_runs",
        "4e850028c3353fc29237b808f3daf7564c5e010d125c3143d50d7c7383369838",
    ),
    (
        "0028",
        "queue_aware_start_tasks_hot_path",
        "0750c96fe2e6e46fab65b50a2a67bb6799f485378557bfe948aaba44aee1e270",
    ),
    (
        "0029",
        "watched_run_events",
        "3dd72ef716f773f8e075aa1deeb040ce4a875fd4572b4b55926cbe38c31c3374",
    ),
    (
        "0030",
        "exchange_signals_only_for_other_workers",
        "c52ad7d15442db29e18c97906a5528ad7c20adbe7b06146264298accfa9d324f",
    ),
];

use crate::{InstallError, MIGRATIONS};

/// Whether `recorded` (version, name, checksum rows of `pgflow.schema_migrations`) is the final state of
/// the development migrations, which the baseline equals. Records of this build's migrations are not.
///
/// # Errors
/// [`InstallError::DevelopmentSchema`] when some development migrations are recorded but not exactly all
/// of them, unmodified (a half-finished or edited development install).
pub(crate) fn is_development_schema(
    recorded: &[(String, String, String)],
) -> Result<bool, InstallError> {
    let is_development = |(version, name, _): &(String, String, String)| {
        DEVELOPMENT_MIGRATIONS
            .iter()
            .any(|(v, n, _)| v == version && n == name)
            && !MIGRATIONS
                .iter()
                .any(|m| m.version == version && m.name == name)
    };
    if !recorded.iter().any(is_development) {
        return Ok(false);
    }
    let exact = recorded.len() == DEVELOPMENT_MIGRATIONS.len()
        && recorded.iter().zip(DEVELOPMENT_MIGRATIONS).all(
            |((version, name, checksum), (v, n, c))| version == v && name == n && checksum == c,
        );
    if exact {
        Ok(true)
    } else {
        Err(InstallError::DevelopmentSchema {
            found: recorded
                .iter()
                .map(|(version, name, _)| format!("{version}_{name}"))
                .collect(),
        })
    }
}

/// Replaces the development migrations' records with the baseline's, inside the install transaction,
/// and returns the records as they now stand. Nothing else changes: the catalogs are identical.
pub(crate) async fn record_as_baseline(
    tx: &mut sqlx::PgConnection,
) -> Result<Vec<(String, String, String)>, InstallError> {
    let baseline = &MIGRATIONS[0];
    sqlx::query("delete from pgflow.schema_migrations")
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "insert into pgflow.schema_migrations (version, name, checksum) values ($1, $2, $3)",
    )
    .bind(baseline.version)
    .bind(baseline.name)
    .bind(baseline.checksum())
    .execute(&mut *tx)
    .await?;
    tracing::info!(
        "recorded the development migrations 0001-0030 as the baseline (identical catalogs)"
    );
    Ok(vec![(
        baseline.version.to_owned(),
        baseline.name.to_owned(),
        baseline.checksum(),
    )])
}
