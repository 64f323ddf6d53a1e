//! Least privilege with real roles: a role that may only use the schema is refused everywhere (42501), and
//! roles holding exactly the documented worker and client grants run a flow end to end.

use crate::step_support::*;
use pgflow_sql::SqlState;
use pgflow_tests::TestDb;
use serde_json::{json, Value};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Executor, PgPool};
use uuid::Uuid;

/// A login role of its own (cluster-wide, so the name is random), dropped with everything it owns at the end.
pub(crate) struct Role {
    pub(crate) name: String,
    admin: PgPool,
}

impl Role {
    pub(crate) async fn create(db: &TestDb, what: &str) -> Role {
        let name = format!("pgflow_{what}_{:08x}", rand_suffix());
        db.pool()
            .execute(format!("create role {name} login password '{name}'").as_str())
            .await
            .unwrap();
        Role {
            name,
            admin: db.pool().clone(),
        }
    }

    pub(crate) async fn pool(&self, db: &TestDb) -> PgPool {
        PgPoolOptions::new()
            .max_connections(2)
            .connect_with(db.options().username(&self.name).password(&self.name))
            .await
            .unwrap()
    }

    pub(crate) async fn drop(self) {
        let sql = format!("drop owned by {0}; drop role {0}", self.name);
        self.admin.execute(sql.as_str()).await.unwrap();
    }
}

fn rand_suffix() -> u32 {
    Uuid::new_v4().as_u128() as u32
}

fn code(e: sqlx::Error) -> SqlState {
    db_error(e).code
}

#[tokio::test]
async fn a_role_with_only_schema_usage_can_call_nothing() {
    let db = pgflow_tests::test_db().await;
    let pool = db.pool();
    compile(pool, "priv", &roots(&["a"]), "flow").await;
    let run: Uuid = sqlx::query_scalar("select run_id from pgflow.start_flow('priv', '{}')")
        .fetch_one(pool)
        .await
        .unwrap();
    let public: Vec<String> = sqlx::query_scalar(
        "select p.oid::regprocedure::text from pg_proc p
          where p.pronamespace = 'pgflow'::regnamespace and has_function_privilege('public', p.oid, 'execute')",
    )
    .fetch_all(pool)
    .await
    .unwrap();
    assert_eq!(
        public,
        Vec::<String>::new(),
        "no pgflow function, created by a migration or at compile time, is PUBLIC's"
    );
    let role = Role::create(&db, "nobody").await;
    pool.execute(format!("grant usage on schema pgflow to {}", role.name).as_str())
        .await
        .unwrap();
    let nobody = role.pool(&db).await;
    for sql in [
        "select pgflow.start_flow_with_states('priv', '{}')",
        "select pgflow.start_flow('priv', '{}')",
        "select pgflow.start_flows('priv', array['{}'::jsonb])",
        "select pgflow.get_run_with_states('00000000-0000-0000-0000-000000000000')",
        "select pgflow.requeue_stalled_tasks()",
        "select pgflow.setup_requeue_stalled_tasks_cron()",
        "select * from pgflow.read_and_claim_tasks('priv', 10, 30, gen_random_uuid(), array['priv'], array['a'])",
        "select pgflow.run_maintenance()",
        "select pgflow.enable_worker_function('x')",
        "select * from pgflow.runs",
    ] {
        let err = sqlx::query(sql).execute(&nobody).await.unwrap_err();
        assert_eq!(code(err), SqlState::InsufficientPrivilege, "{sql}");
    }
    let err = sqlx::query("select pgflow.get_run_with_states($1)")
        .bind(run)
        .execute(&nobody)
        .await
        .unwrap_err();
    assert_eq!(code(err), SqlState::InsufficientPrivilege);
    nobody.close().await;
    role.drop().await;
}

#[tokio::test]
async fn worker_and_client_roles_with_the_documented_grants_run_a_flow_end_to_end() {
    let db = pgflow_tests::test_db().await;
    let owner = db.pool();
    let worker_role = Role::create(&db, "worker").await;
    let client_role = Role::create(&db, "client").await;
    for (f, role) in [
        ("grant_worker_privileges", &worker_role),
        ("grant_client_privileges", &client_role),
    ] {
        sqlx::query(&format!("select pgflow.{f}($1)"))
            .bind(&role.name)
            .execute(owner)
            .await
            .unwrap();
    }
    let worker = worker_role.pool(&db).await;
    let client = client_role.pool(&db).await;
    let worker_id = Uuid::new_v4();

    // The worker compiles and registers (the queue is created by the owner's functions).
    let shape = shape(vec![step("a", &[]), step("b", &["a"])]);
    let compiled: Value =
        sqlx::query_scalar("select pgflow.ensure_flow_compiled(flow_slug => 'e2e', shape => $1)")
            .bind(&shape)
            .fetch_one(&worker)
            .await
            .unwrap();
    assert_eq!(compiled["status"], "compiled");
    let state: Value =
        sqlx::query_scalar(
            "select pgflow.register_worker($1, 'e2e-worker', 'e2e', array['e2e', 'e2e'], array['a', 'b'])",
        )
            .bind(worker_id)
            .fetch_one(&worker)
            .await
            .unwrap();
    assert_eq!(state["enabled"], true);

    // The client starts a run; it may not claim.
    let run: Uuid = sqlx::query_scalar("select run_id from pgflow.start_flow('e2e', '{\"n\": 1}')")
        .fetch_one(&client)
        .await
        .unwrap();
    let err = sqlx::query(
        "select * from pgflow.read_and_claim_tasks('e2e', 10, 30, $1, array['e2e', 'e2e'], array['a', 'b'])",
    )
        .bind(worker_id)
        .execute(&client)
        .await
        .unwrap_err();
    assert_eq!(code(err), SqlState::InsufficientPrivilege);

    // The worker drains the run with the fenced calls.
    for _ in 0..2 {
        let claimed = claim_json(
            sqlx::query(
                "select * from pgflow.read_and_claim_tasks('e2e', 10, 30, $1, array['e2e', 'e2e'], array['a', 'b'])",
            )
            .bind(worker_id)
            .fetch_all(&worker)
            .await
            .unwrap(),
        );
        let task = &claimed["tasks"][0];
        let outcome: String = sqlx::query_scalar(
            "select outcome from pgflow.complete_tasks(array[$1]::uuid[], array[$2], array[0], array[$3]::jsonb[],
               array[$4]::int[], $5)",
        )
        .bind(run)
        .bind(task["step_slug"].as_str().unwrap())
        .bind(json!({"done": task["step_slug"]}))
        .bind(task["attempts_count"].as_i64().unwrap() as i32)
        .bind(worker_id)
        .fetch_one(&worker)
        .await
        .unwrap();
        assert_eq!(outcome, "applied");
    }
    let beat: Value = sqlx::query_scalar("select pgflow.worker_heartbeat($1)")
        .bind(worker_id)
        .fetch_one(&worker)
        .await
        .unwrap();
    assert_eq!(beat["enabled"], true);
    let maintenance: Value = sqlx::query_scalar(
        "select pgflow.run_maintenance(interval '30 seconds', interval '7 days')",
    )
    .fetch_one(&worker)
    .await
    .unwrap();
    assert_eq!(maintenance["skipped"], false);

    // The client reads the outcome.
    let states: Value = sqlx::query_scalar("select pgflow.get_run_with_states($1)")
        .bind(run)
        .fetch_one(&client)
        .await
        .unwrap();
    assert_eq!(states["run"]["status"], "completed");
    assert_eq!(states["run"]["output"], json!({"b": {"done": "b"}}));
    let (status,): (String,) = sqlx::query_as("select status from pgflow.runs where run_id = $1")
        .bind(run)
        .fetch_one(&client)
        .await
        .unwrap();
    assert_eq!(status, "completed");
    // The client may also start many runs in one call.
    let together: i64 = sqlx::query_scalar(
        "select count(*) from pgflow.start_flows('e2e', array['{\"n\": 2}'::jsonb, '{}'])",
    )
    .fetch_one(&client)
    .await
    .unwrap();
    assert_eq!(together, 2);
    // Neither role can touch tables directly.
    for pool in [&worker, &client] {
        let err = sqlx::query("delete from pgflow.runs")
            .execute(pool)
            .await
            .unwrap_err();
        assert_eq!(code(err), SqlState::InsufficientPrivilege);
    }

    worker.close().await;
    client.close().await;
    worker_role.drop().await;
    client_role.drop().await;
}
