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

    let before = schema_fingerprint(db.pool()).await;
    let second = pgflow_sql::install(db.pool()).await.unwrap();
    assert_eq!(second.pgmq, PgmqStatus::AlreadyPresent);
    assert!(
        second.applied.is_empty(),
        "second install applied {:?}",
        second.applied
    );
    assert_eq!(schema_fingerprint(db.pool()).await, before);
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

    let expected = schema_fingerprint(by_install.pool()).await;
    assert!(expected.len() > 3, "the fingerprint covers the schema");
    assert_eq!(schema_fingerprint(by_script.pool()).await, expected);
    // install() recognises a script-installed database as current.
    assert!(pgflow_sql::install(by_script.pool())
        .await
        .unwrap()
        .applied
        .is_empty());
}

/// Every object of schema `pgflow`, described by its catalog definition, plus the recorded migrations.
async fn schema_fingerprint(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar(
        r#"
        select 'relation ' || c.relname || ' ' || c.relkind::text || ' ' ||
               coalesce((select string_agg(a.attname || ':' || format_type(a.atttypid, a.atttypmod) || ':' ||
                                           a.attnotnull || ':' || coalesce(pg_get_expr(d.adbin, d.adrelid), ''), ',' order by a.attnum)
                         from pg_attribute a left join pg_attrdef d on d.adrelid = a.attrelid and d.adnum = a.attnum
                         where a.attrelid = c.oid and a.attnum > 0 and not a.attisdropped), '')
        from pg_class c join pg_namespace n on n.oid = c.relnamespace
        where n.nspname = 'pgflow' and c.relkind in ('r', 'v', 'm', 'S', 'c', 'p')
        union all
        select 'index ' || pg_get_indexdef(i.indexrelid)
        from pg_index i join pg_class c on c.oid = i.indrelid join pg_namespace n on n.oid = c.relnamespace
        where n.nspname = 'pgflow'
        union all
        select 'constraint ' || conrelid::regclass || ' ' || conname || ' ' || pg_get_constraintdef(oid)
        from pg_constraint where connamespace = 'pgflow'::regnamespace
        union all
        select 'function ' || pg_get_functiondef(p.oid)
        from pg_proc p where p.pronamespace = 'pgflow'::regnamespace and p.prokind in ('f', 'p')
        union all
        select 'trigger ' || pg_get_triggerdef(t.oid)
        from pg_trigger t join pg_class c on c.oid = t.tgrelid
        where c.relnamespace = 'pgflow'::regnamespace and not t.tgisinternal
        union all
        select 'migration ' || version || ' ' || name || ' ' || checksum from pgflow.schema_migrations
        order by 1
        "#,
    )
    .fetch_all(pool)
    .await
    .unwrap()
}
