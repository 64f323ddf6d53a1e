//! The installer: idempotence, concurrency, PGMQ, checksums, and the printed script.

use std::process::Command;

use pgflow_sql::{InstallError, PgmqStatus, MIGRATIONS};
use pgflow_tests::{db_with, Contents, TestDb};
use sqlx::{Connection, PgPool};

fn all_versions() -> Vec<String> {
    MIGRATIONS.iter().map(|m| m.version.to_owned()).collect()
}

async fn applied(pool: &PgPool) -> Vec<String> {
    let mut conn = pool.acquire().await.unwrap();
    pgflow_sql::applied_versions(&mut conn).await.unwrap()
}

#[tokio::test]
async fn installing_twice_is_a_no_op_the_second_time() {
    let db = db_with(Contents::Empty).await;
    let first = pgflow_sql::install(db.pool()).await.unwrap();
    assert_ne!(
        first.pgmq,
        PgmqStatus::AlreadyPresent,
        "an empty database has no PGMQ yet"
    );
    assert_eq!(first.applied, all_versions());

    let before = catalog(db.pool()).await;
    let second = pgflow_sql::install(db.pool()).await.unwrap();
    assert_eq!(second.pgmq, PgmqStatus::AlreadyPresent);
    assert!(
        second.applied.is_empty(),
        "second install applied {:?}",
        second.applied
    );
    assert_catalogs_equal(
        &catalog(db.pool()).await,
        &before,
        "after the second install",
    );
    assert_eq!(applied(db.pool()).await, all_versions());
}

#[tokio::test]
async fn four_concurrent_installs_on_one_fresh_database_all_succeed() {
    let db = db_with(Contents::Empty).await;
    let installs = (0..4).map(|_| {
        let options = db.options();
        tokio::spawn(async move {
            // Separate pools, as separate processes would have.
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(2)
                .connect_with(options)
                .await
                .unwrap();
            let report = pgflow_sql::install(&pool).await;
            pool.close().await;
            report
        })
    });
    let reports: Vec<_> = futures::future::join_all(installs).await;
    let mut applied_by = 0;
    for report in reports {
        let report = report.unwrap().expect("every concurrent install succeeds");
        if !report.applied.is_empty() {
            assert_eq!(report.applied, all_versions());
            applied_by += 1;
        }
    }
    assert_eq!(applied_by, 1, "exactly one install applies the migrations");
    assert_eq!(applied(db.pool()).await, all_versions());
}

#[tokio::test]
async fn pgmq_works_after_install() {
    let db = db_with(Contents::Empty).await;
    pgflow_sql::install(db.pool()).await.unwrap();
    let pool = db.pool();
    sqlx::query("select pgmq.create('install_probe')")
        .execute(pool)
        .await
        .unwrap();
    let id: i64 =
        sqlx::query_scalar("select * from pgmq.send('install_probe', '{\"hello\": 1}'::jsonb)")
            .fetch_one(pool)
            .await
            .unwrap();
    let (read_id, body): (i64, serde_json::Value) =
        sqlx::query_as("select msg_id, message from pgmq.read('install_probe', 30, 1)")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(read_id, id);
    assert_eq!(body, serde_json::json!({"hello": 1}));
    let archived: bool = sqlx::query_scalar("select pgmq.archive('install_probe', $1)")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap();
    assert!(archived);
    let in_archive: i64 =
        sqlx::query_scalar("select count(*) from pgmq.a_install_probe where msg_id = $1")
            .bind(id)
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(in_archive, 1);
}

#[tokio::test]
async fn a_modified_applied_migration_is_refused_with_a_clear_error() {
    let db = db_with(Contents::Pgflow).await;
    sqlx::query("update pgflow.schema_migrations set checksum = 'edited' where version = '0001'")
        .execute(db.pool())
        .await
        .unwrap();
    let err = pgflow_sql::install(db.pool()).await.unwrap_err();
    match &err {
        InstallError::ModifiedMigration {
            version,
            applied_checksum,
            file_checksum,
            ..
        } => {
            assert_eq!(version, "0001");
            assert_eq!(applied_checksum, "edited");
            assert_eq!(*file_checksum, MIGRATIONS[0].checksum());
        }
        other => panic!("expected ModifiedMigration, got {other:?}"),
    }
    let message = err.to_string();
    assert!(message.contains("migration 0001"), "{message}");
    assert!(
        message.contains("was modified after it was applied"),
        "{message}"
    );
}

#[tokio::test]
async fn a_database_newer_than_the_code_is_refused() {
    let db = db_with(Contents::Pgflow).await;
    sqlx::query(
        "insert into pgflow.schema_migrations (version, name, checksum) values ('9999', 'from_the_future', 'x')",
    )
    .execute(db.pool())
    .await
    .unwrap();
    let err = pgflow_sql::install(db.pool()).await.unwrap_err();
    assert!(
        matches!(&err, InstallError::SchemaNewer { unknown, .. } if unknown == &["9999_from_the_future".to_owned()]),
        "{err:?}"
    );
    assert!(err.to_string().contains("newer than this build"), "{err}");
}

#[tokio::test]
async fn install_inside_a_rolled_back_transaction_leaves_nothing_behind() {
    let db = db_with(Contents::Pgmq).await;
    let mut conn = db.pool().acquire().await.unwrap();
    let mut tx = conn.begin().await.unwrap();
    let report = pgflow_sql::install_on(&mut tx).await.unwrap();
    assert_eq!(report.applied, all_versions());
    tx.rollback().await.unwrap();
    assert!(applied(db.pool()).await.is_empty());
    let schema: bool =
        sqlx::query_scalar("select exists (select 1 from pg_namespace where nspname = 'pgflow')")
            .fetch_one(db.pool())
            .await
            .unwrap();
    assert!(!schema);
}

#[tokio::test]
async fn the_connection_form_asks_for_pgmq_when_it_cannot_install_it() {
    let db = db_with(Contents::Empty).await;
    let offers_extension: bool = sqlx::query_scalar(
        "select exists (select 1 from pg_available_extensions where name = 'pgmq')",
    )
    .fetch_one(db.pool())
    .await
    .unwrap();
    let mut conn = db.pool().acquire().await.unwrap();
    let result = pgflow_sql::install_on(&mut conn).await;
    if offers_extension {
        assert_eq!(result.unwrap().pgmq, PgmqStatus::CreatedExtension);
    } else {
        let err = result.unwrap_err();
        assert!(matches!(err, InstallError::PgmqMissing), "{err:?}");
        assert!(
            err.to_string().contains("pgflow_sql::install(&pool)"),
            "{err}"
        );
    }
}

fn psql() -> String {
    for candidate in ["psql", "/usr/bin/psql"] {
        if Command::new(candidate)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return candidate.to_owned();
        }
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin/psql"))
        .filter(|p| p.is_file())
        .max();
    newest.map(|p| p.display().to_string()).expect(
        "psql not found; install it (Debian/Ubuntu: `apt-get install -y postgresql-client`)",
    )
}

fn run_psql(db: &TestDb, args: &[&str], stdin_file: Option<&std::path::Path>) {
    let mut command = Command::new(psql());
    command
        .arg("-X")
        .arg("-q")
        .args(["-v", "ON_ERROR_STOP=1"])
        .arg("-d")
        .arg(db.url())
        .args(args);
    if let Some(file) = stdin_file {
        command.arg("-f").arg(file);
    }
    let out = command.output().expect("run psql");
    assert!(
        out.status.success(),
        "psql {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn every_migration_file_applies_with_psql_in_order_on_a_database_with_only_pgmq() {
    let db = db_with(Contents::Pgmq).await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../pgflow-sql/migrations");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    assert_eq!(files.len(), MIGRATIONS.len());
    for file in &files {
        run_psql(&db, &[], Some(file));
    }
    let functions: i64 = sqlx::query_scalar(
        "select count(*) from pg_proc p join pg_namespace n on n.oid = p.pronamespace where n.nspname = 'pgflow'",
    )
    .fetch_one(db.pool())
    .await
    .unwrap();
    if MIGRATIONS.len() > 1 {
        assert!(functions > 0, "the migrations define pgflow functions");
    }
}

#[tokio::test]
async fn the_printed_install_script_applied_with_psql_gives_the_same_schema_as_install() {
    let by_script = db_with(Contents::Pgmq).await;
    let file = std::env::temp_dir().join(format!("pgflow-install-{}.sql", by_script.name()));
    std::fs::write(&file, pgflow_sql::install_script()).unwrap();
    run_psql(&by_script, &["-1"], Some(&file));
    std::fs::remove_file(&file).unwrap();

    let by_install = db_with(Contents::Pgmq).await;
    let report = pgflow_sql::install(by_install.pool()).await.unwrap();
    assert_eq!(report.applied, all_versions());

    assert_catalogs_equal(
        &catalog(by_script.pool()).await,
        &catalog(by_install.pool()).await,
        "script (left) and install (right)",
    );
    assert_eq!(applied(by_script.pool()).await, all_versions());
    // install() recognises a script-installed database as current.
    assert!(pgflow_sql::install(by_script.pool())
        .await
        .unwrap()
        .applied
        .is_empty());
}

/// The schema files, applied in name order after PGMQ, install exactly what the migrations install:
/// every function (definition, SECURITY DEFINER, SET options, ACL), table, column, default, constraint,
/// index, trigger, view and type, and the table and schema ACLs.
#[tokio::test]
async fn schema_matches_migrations() {
    let by_migrations = db_with(Contents::Pgflow).await;
    let by_schema = db_with(Contents::Pgmq).await;
    sqlx::raw_sql(&pgflow_sql::schema_script())
        .execute(by_schema.pool())
        .await
        .unwrap_or_else(|e| panic!("applying pgflow-sql/schema/ failed: {e}"));
    let expected = catalog(by_migrations.pool()).await;
    assert!(
        expected
            .keys()
            .filter(|(kind, _)| kind == "function")
            .count()
            > 100,
        "the catalog covers the functions"
    );
    assert_catalogs_equal(
        &catalog(by_schema.pool()).await,
        &expected,
        "pgflow-sql/schema/ (left) and pgflow-sql/migrations/ (right)",
    );
}

/// The comparison itself fails on a difference and names the object, so the test above cannot pass
/// vacuously.
#[tokio::test]
async fn the_catalog_comparison_names_what_differs() {
    let db = db_with(Contents::Pgflow).await;
    let before = catalog(db.pool()).await;
    sqlx::raw_sql(
        "alter function pgflow.start_flow(text, jsonb, uuid) set work_mem = '8MB';
         grant select on pgflow.flows to public;",
    )
    .execute(db.pool())
    .await
    .unwrap();
    let after = catalog(db.pool()).await;
    let differences = catalog_differences(&after, &before);
    assert_eq!(differences.len(), 2, "{differences:#?}");
    assert!(differences[0].contains("function pgflow.start_flow(text,jsonb,uuid)"));
    assert!(
        differences[1].contains("relation flows"),
        "{differences:#?}"
    );
}

/// A database installed by the unreleased development migrations 0001–0030 is upgraded in place: its
/// records become the baseline's, the later migrations apply, and its catalog then equals a fresh
/// install's. Its data stays.
#[tokio::test]
async fn a_development_install_is_upgraded_in_place() {
    let old = db_with(Contents::Pgmq).await;
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/development_migrations_0001_0030.sql");
    run_psql(&old, &["-1"], Some(&fixture));
    // Data that creates no objects (a flow would create its queue), so the catalogs stay comparable.
    sqlx::query("insert into pgflow.worker_functions (function_name) values ('kept')")
        .execute(old.pool())
        .await
        .unwrap();

    let report = pgflow_sql::install(old.pool()).await.unwrap();
    assert!(report.upgraded_development_schema);
    assert_eq!(report.applied, all_versions()[1..].to_vec());
    assert_eq!(applied(old.pool()).await, all_versions());

    let fresh = db_with(Contents::Pgflow).await;
    assert_catalogs_equal(
        &catalog(old.pool()).await,
        &catalog(fresh.pool()).await,
        "upgraded development install (left) and fresh install (right)",
    );
    let kept: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.worker_functions where function_name = 'kept'",
    )
    .fetch_one(old.pool())
    .await
    .unwrap();
    assert_eq!(kept, 1);
    let again = pgflow_sql::install(old.pool()).await.unwrap();
    assert!(!again.upgraded_development_schema && again.applied.is_empty());
}

/// A database with only some of the development migrations (or an edited one) is refused with an
/// error that says what to do, and nothing changes.
#[tokio::test]
async fn a_partial_development_install_is_refused_and_left_as_it_was() {
    let old = db_with(Contents::Pgmq).await;
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/development_migrations_0001_0030.sql");
    run_psql(&old, &["-1"], Some(&fixture));
    // As if the last development migration had never been applied.
    sqlx::query("delete from pgflow.schema_migrations where version = '0030'")
        .execute(old.pool())
        .await
        .unwrap();
    let before = catalog(old.pool()).await;
    let recorded = applied(old.pool()).await;

    let err = pgflow_sql::install(old.pool()).await.unwrap_err();
    assert!(
        matches!(&err, InstallError::DevelopmentSchema { found } if found.len() == 29),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(
        message.contains("unreleased development migrations"),
        "{message}"
    );
    assert!(message.contains("drop schema pgflow cascade"), "{message}");
    assert_eq!(applied(old.pool()).await, recorded);
    assert_catalogs_equal(&catalog(old.pool()).await, &before, "after the refusal");
}

type Catalog = std::collections::BTreeMap<(String, String), String>;

/// Every object of schema `pgflow`, keyed by (kind, name), with its catalog definition: functions
/// (definition, SECURITY DEFINER, SET options, ACL, comment), relations (kind, persistence, options,
/// ACL, comment, view definition), columns (position, type, NOT NULL, default, ACL), constraints,
/// indexes, triggers, types, the schema's ACL and comment, and default privileges.
async fn catalog(pool: &PgPool) -> Catalog {
    let rows: Vec<(String, String, String)> =
        sqlx::query_as(include_str!("../fixtures/catalog.sql"))
            .fetch_all(pool)
            .await
            .unwrap();
    rows.into_iter()
        .map(|(kind, name, detail)| ((kind, name), detail))
        .collect()
}

fn catalog_differences(left: &Catalog, right: &Catalog) -> Vec<String> {
    let mut differences = Vec::new();
    for key in left
        .keys()
        .chain(right.keys().filter(|k| !left.contains_key(*k)))
    {
        let (kind, name) = key;
        match (left.get(key), right.get(key)) {
            (Some(_), None) => differences.push(format!("{kind} {name}: only on the left")),
            (None, Some(_)) => differences.push(format!("{kind} {name}: only on the right")),
            (Some(l), Some(r)) if l != r => differences.push(format!(
                "{kind} {name} differs:\n--- left\n{l}\n--- right\n{r}"
            )),
            _ => {}
        }
    }
    differences
}

#[track_caller]
fn assert_catalogs_equal(left: &Catalog, right: &Catalog, what: &str) {
    let differences = catalog_differences(left, right);
    assert!(
        differences.is_empty(),
        "catalogs differ, {what}:\n{}",
        differences.join("\n")
    );
}

#[tokio::test]
async fn the_priorities_migration_replaces_the_queue_statement_functions_of_queues_in_use() {
    let db = db_with(Contents::Pgmq).await;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../pgflow-sql/migrations");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "sql"))
        .collect();
    files.sort();
    let at = files
        .iter()
        .position(|f| f.to_string_lossy().contains("priorities_and_key_rates"))
        .expect("the priorities migration");
    for file in &files[..at] {
        run_psql(&db, &[], Some(file));
    }
    let pool = db.pool();
    let claim = "select count(*) from pgflow.read_and_claim_tasks('up', 1, 30, \
                 '11111111-1111-1111-1111-111111111111', array['up'], array['work']) where outcome = 'claimed'";
    sqlx::raw_sql(
        "select pgflow.create_flow('up'); select pgflow.add_step('up', 'work');
         insert into pgflow.workers (worker_id, queue_name, function_name)
         values ('11111111-1111-1111-1111-111111111111', 'up', 'test');
         select pgflow.start_flow('up', '{}');",
    )
    .execute(pool)
    .await
    .unwrap();
    // The queue's statement function exists in its old form (the start sent through it).
    let n: i64 = sqlx::query_scalar(claim).fetch_one(pool).await.unwrap();
    assert_eq!(n, 1);
    for file in &files[at..] {
        run_psql(&db, &[], Some(file));
    }
    sqlx::raw_sql(
        "select pgflow.set_queue_priority('up', '1 minute');
         select pgflow.start_flow('up', '{}', null, 3);",
    )
    .execute(pool)
    .await
    .unwrap();
    let n: i64 = sqlx::query_scalar(claim).fetch_one(pool).await.unwrap();
    assert_eq!(n, 1, "sends and claims work through the new form");
    let ranked: i64 =
        sqlx::query_scalar("select count(*) from pgmq.q_up where headers ? 'pgflow_rank'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(ranked, 1);
}
