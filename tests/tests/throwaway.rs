//! The throwaway server itself: a restart keeps committed data, and pools reconnect on their own.

use chrono::{DateTime, Utc};
use pgflow_sql::throwaway::{Durability, TempPostgres};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection};

#[tokio::test]
async fn a_restarted_throwaway_server_keeps_its_data_and_its_pools_reconnect() {
    pgflow_tests::init_tracing();
    // A server of its own: restarting the shared one would break every test running beside this.
    let cluster = TempPostgres::start(Durability::Fast)
        .await
        .unwrap_or_else(|e| panic!("cannot start a throwaway server: {e}"));
    let url = cluster.url("postgres");
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .connect(&url)
        .await
        .unwrap();
    pgflow_sql::install(&pool).await.unwrap();
    sqlx::query("select pgmq.create('restart_probe')")
        .execute(&pool)
        .await
        .unwrap();
    let sent: i64 = sqlx::query_scalar("select pgmq.send('restart_probe', '{\"kept\": true}')")
        .fetch_one(&pool)
        .await
        .unwrap();
    let started_before: DateTime<Utc> = sqlx::query_scalar("select pg_postmaster_start_time()")
        .fetch_one(&pool)
        .await
        .unwrap();
    let mut session = PgConnection::connect(&url).await.unwrap();

    cluster.restart().await.expect("the server restarts");

    // The server really went down: a session from before the restart is gone.
    assert!(
        sqlx::query("select 1").execute(&mut session).await.is_err(),
        "a session opened before the restart still works"
    );
    // The pool from before the restart works again, on a new server process, with the same port.
    let started_after: DateTime<Utc> = sqlx::query_scalar("select pg_postmaster_start_time()")
        .fetch_one(&pool)
        .await
        .expect("the pool reconnects after the restart");
    assert!(
        started_after > started_before,
        "a new postmaster serves the pool"
    );
    assert_eq!(cluster.url("postgres"), url);
    // Committed data survived: the queued message and the pgflow schema.
    let (read_id, body): (i64, serde_json::Value) =
        sqlx::query_as("select msg_id, message from pgmq.read('restart_probe', 30, 1)")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(read_id, sent);
    assert_eq!(body, serde_json::json!({"kept": true}));
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        pgflow_sql::applied_versions(&mut conn).await.unwrap().len(),
        pgflow_sql::MIGRATIONS.len()
    );
    drop(conn);
    pool.close().await;
}
