//! Defects an outside review found in the SQL core, as an attacker and as an unlucky operator would meet
//! them: a worker role that could destroy data, grant lists the documentation did not show, messages left
//! without a task, a dropped flow queue that stayed dropped, a false "retirable", an alias and a flow slug
//! taking one name, and unchecked shapes and quantities. Each test failed before its fix.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::privileges::Role;
use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::{test_db, wait_until, TestDb};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection, PgPool};
use uuid::Uuid;

/// A role holding exactly the worker grants, with a pool of its own.
async fn worker_role(db: &TestDb) -> (Role, PgPool) {
    let role = Role::create(db, "worker").await;
    sqlx::query("select pgflow.grant_worker_privileges($1)")
        .bind(&role.name)
        .execute(db.pool())
        .await
        .unwrap();
    let pool = role.pool(db).await;
    (role, pool)
}

async fn run_exists(pool: &PgPool, run: Uuid) -> bool {
    sqlx::query_scalar("select exists (select 1 from pgflow.runs where run_id = $1)")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_worker_role_cannot_recompile_destructively_with_allow_data_loss() {
    let db = test_db().await;
    let owner = db.pool();
    compile(owner, "dl", &roots(&["a"]), "flow").await;
    let run = start(owner, "dl", json!({})).await;
    let (role, worker) = worker_role(&db).await;

    let err = db_error(
        try_compile(&worker, "dl", &roots(&["a", "b"]), "flow", true)
            .await
            .expect_err("a worker role must not delete a flow's runs"),
    );
    assert_eq!(err.code, SqlState::InsufficientPrivilege, "{err:?}");
    assert!(err.message.contains("\"dl\""), "{err:?}");
    assert!(err.hint.is_some(), "{err:?}");
    assert!(run_exists(owner, run).await, "the run must survive");

    // An admin session that has become the worker role (SET ROLE) is the worker role.
    let mut as_worker = owner.acquire().await.unwrap();
    sqlx::query(&format!("set role {}", role.name))
        .execute(&mut *as_worker)
        .await
        .unwrap();
    let err = db_error(
        sqlx::query_scalar::<_, Value>(
            "select pgflow.ensure_flow_compiled(flow_slug => 'dl', shape => $1, allow_data_loss => true)",
        )
        .bind(roots(&["a", "b"]))
        .fetch_one(&mut *as_worker)
        .await
        .expect_err("SET ROLE to a worker role gives up the admin's rights"),
    );
    assert_eq!(err.code, SqlState::InsufficientPrivilege, "{err:?}");
    assert!(err.message.contains(&role.name), "{err:?}");
    sqlx::query("reset role")
        .execute(&mut *as_worker)
        .await
        .unwrap();
    drop(as_worker);

    // The owner may.
    let result = try_compile(owner, "dl", &roots(&["a", "b"]), "flow", true)
        .await
        .unwrap();
    assert_eq!(result["status"], "recompiled");
    assert!(!run_exists(owner, run).await);

    worker.close().await;
    role.drop().await;
}

#[tokio::test]
async fn a_worker_role_cannot_make_its_own_session_local_to_recompile() {
    let db = test_db().await;
    let owner = db.pool();
    compile(owner, "dl", &roots(&["a"]), "flow").await;
    let run = start(owner, "dl", json!({})).await;
    let (role, worker) = worker_role(&db).await;

    let mut conn = worker.acquire().await.unwrap();
    sqlx::query("set pgflow.local = 'true'")
        .execute(&mut *conn)
        .await
        .unwrap();
    let err = db_error(
        sqlx::query_scalar::<_, Value>(
            "select pgflow.ensure_flow_compiled(flow_slug => 'dl', shape => $1)",
        )
        .bind(roots(&["a", "b"]))
        .fetch_one(&mut *conn)
        .await
        .expect_err("a worker role must not delete a flow's runs"),
    );
    assert_eq!(err.code, SqlState::InsufficientPrivilege, "{err:?}");
    assert!(run_exists(owner, run).await, "the run must survive");

    drop(conn);
    worker.close().await;
    role.drop().await;
}

#[tokio::test]
async fn set_vt_batch_refuses_a_queue_that_pgflow_does_not_serve() {
    let db = test_db().await;
    let owner = db.pool();
    compile(owner, "vt", &roots(&["a"]), "flow").await;
    start(owner, "vt", json!({})).await;
    exec(
        owner,
        "select pgmq.create('other_app'); select pgmq.send('other_app', '{\"order\": 1}')",
    )
    .await;
    let (role, worker) = worker_role(&db).await;

    let err = db_error(
        sqlx::query(
            "select * from pgflow.set_vt_batch('other_app', array[1]::bigint[], array[3600])",
        )
        .execute(&worker)
        .await
        .expect_err("another application's queue is not the worker's"),
    );
    assert_eq!(err.code, SqlState::InvalidParameterValue, "{err:?}");
    assert!(err.message.contains("other_app"), "{err:?}");
    let hidden: bool = sqlx::query_scalar("select vt > clock_timestamp() from pgmq.q_other_app")
        .fetch_one(owner)
        .await
        .unwrap();
    assert!(!hidden, "the other application's message must stay visible");

    // A queue pgflow routes tasks to still works.
    let moved: Vec<i64> = sqlx::query_scalar(
        "select msg_id from pgflow.set_vt_batch('vt', array[1]::bigint[], array[3600])",
    )
    .fetch_all(&worker)
    .await
    .unwrap();
    assert_eq!(moved, vec![1]);

    worker.close().await;
    role.drop().await;
}

/// The documented grants of `role` ("worker" or "client"): privilege -> objects, from OPERATIONS.md's table
/// `| role | privilege | on |`; functions without a schema are pgflow's.
fn documented_grants(role: &str) -> BTreeMap<String, BTreeSet<String>> {
    let doc = include_str!("../../../pgflow-sql/OPERATIONS.md");
    let mut grants: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() != 5 || cells[1] != role {
            continue;
        }
        let privilege = cells[2].to_owned();
        let objects = grants.entry(privilege.clone()).or_default();
        for (i, item) in cells[3].split('`').enumerate() {
            if i % 2 == 0 {
                continue;
            }
            let qualified = if privilege == "execute" && !item.contains('.') {
                format!("pgflow.{item}")
            } else {
                item.to_owned()
            };
            assert!(objects.insert(qualified), "{item} is listed twice");
        }
    }
    assert!(
        !grants.is_empty(),
        "OPERATIONS.md has no grant rows for {role}"
    );
    grants
}

/// What the catalog grants `role` directly: privilege -> objects (schemas, functions, relations).
async fn catalog_grants(pool: &PgPool, role: &str) -> BTreeMap<String, BTreeSet<String>> {
    let rows: Vec<(String, String)> = sqlx::query_as(
        "select lower(a.privilege_type), n.nspname::text
           from pg_namespace n, aclexplode(n.nspacl) a where a.grantee = $1::regrole
         union all
         select lower(a.privilege_type), p.oid::regprocedure::text
           from pg_proc p, aclexplode(p.proacl) a where a.grantee = $1::regrole
         union all
         select lower(a.privilege_type), c.oid::regclass::text
           from pg_class c, aclexplode(c.relacl) a where a.grantee = $1::regrole",
    )
    .bind(role)
    .fetch_all(pool)
    .await
    .unwrap();
    let mut grants: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (privilege, object) in rows {
        grants.entry(privilege).or_default().insert(object);
    }
    grants
}

#[tokio::test]
async fn the_documented_grant_lists_are_the_ones_a_fresh_install_grants() {
    let db = test_db().await;
    let owner = db.pool();
    for (kind, grant) in [
        ("worker", "grant_worker_privileges"),
        ("client", "grant_client_privileges"),
    ] {
        let role = Role::create(&db, kind).await;
        sqlx::query(&format!("select pgflow.{grant}($1)"))
            .bind(&role.name)
            .execute(owner)
            .await
            .unwrap();
        let documented = documented_grants(kind);
        let granted = catalog_grants(owner, &role.name).await;
        for privilege in documented.keys().chain(granted.keys()) {
            let empty = BTreeSet::new();
            let d = documented.get(privilege).unwrap_or(&empty);
            let g = granted.get(privilege).unwrap_or(&empty);
            assert!(
                d == g,
                "{kind} role, {privilege}: granted but not documented {:?}; documented but not granted {:?}",
                g.difference(d).collect::<Vec<_>>(),
                d.difference(g).collect::<Vec<_>>()
            );
        }
        role.drop().await;
    }
}

/// Messages of `queue` that no task records.
async fn orphan_messages(pool: &PgPool, queue: &str) -> i64 {
    sqlx::query_scalar(&format!(
        "select count(*) from pgmq.q_{queue} q
          where not exists (select 1 from pgflow.step_tasks t
                             where t.queue_name = '{queue}' and t.message_id = q.msg_id)"
    ))
    .fetch_one(pool)
    .await
    .unwrap()
}

async fn compile_named(
    pool: &PgPool,
    flow: &str,
    shape: &Value,
    queue: &str,
    allow_data_loss: bool,
) -> Value {
    let routes: Vec<Value> = shape["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| json!({"step_slug": s["slug"], "queue_name": queue}))
        .collect();
    sqlx::query_scalar(
        "select pgflow.ensure_flow_compiled(flow_slug => $1, shape => $2, queue_mode => 'named', routes => $3,
           allow_data_loss => $4)",
    )
    .bind(flow)
    .bind(shape)
    .bind(Value::Array(routes))
    .bind(allow_data_loss)
    .fetch_one(pool)
    .await
    .unwrap_or_else(|e| panic!("ensure_flow_compiled({flow}): {e}"))
}

#[tokio::test]
async fn deleting_or_recompiling_a_flow_on_a_shared_queue_leaves_no_message_without_a_task() {
    let db = test_db().await;
    let pool = db.pool();
    compile_named(pool, "orphA", &roots(&["a"]), "shared_work", false).await;
    compile_named(pool, "orphB", &roots(&["b"]), "shared_work", false).await;
    start(pool, "orphA", json!({})).await;
    start(pool, "orphA", json!({})).await;
    start(pool, "orphB", json!({})).await;
    assert_eq!(live_messages(pool, "shared_work").await, 3);

    exec(pool, "select pgflow.delete_flow_and_data('orphA')").await;
    assert_eq!(orphan_messages(pool, "shared_work").await, 0);
    assert_eq!(
        live_messages(pool, "shared_work").await,
        1,
        "orphB's message stays"
    );

    // orphB's worker claims its own task; nothing in the batch is foreign to it.
    let worker = Uuid::new_v4();
    register(pool, worker, "orphB-fn", "shared_work", "orphB", None).await;
    let claimed = claim_json(
        sqlx::query(
            "select * from pgflow.read_and_claim_tasks('shared_work', 10, 30, $1, array['orphB'], array['b'])",
        )
        .bind(worker)
        .fetch_all(pool)
        .await
        .unwrap(),
    );
    assert_eq!(claimed["outcome"], "claimed", "{claimed}");
    assert_eq!(claimed["tasks"].as_array().unwrap().len(), 1, "{claimed}");

    // A destructive recompilation of a named-route flow deletes its tasks' messages with them.
    start(pool, "orphB", json!({})).await;
    let recompiled = compile_named(pool, "orphB", &roots(&["b", "c"]), "shared_work", true).await;
    assert_eq!(recompiled["status"], "recompiled");
    assert_eq!(orphan_messages(pool, "shared_work").await, 0);
    assert_eq!(live_messages(pool, "shared_work").await, 0);
}

async fn max_message_id(pool: &PgPool, queue: &str) -> i64 {
    sqlx::query_scalar("select max(message_id) from pgflow.step_tasks where queue_name = $1")
        .bind(queue)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn verification_recreates_a_dropped_flow_queue() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "dq", &roots(&["a"]), "flow").await;
    start(pool, "dq", json!({})).await;
    start(pool, "dq", json!({})).await;
    exec(pool, "select pgmq.drop_queue('dq')").await;
    let err = sqlx::query("select pgflow.start_flow('dq', '{}')")
        .execute(pool)
        .await
        .expect_err("no queue, no start");
    assert!(err.to_string().contains("does not exist"), "{err}");

    // A worker's startup verification.
    assert_eq!(
        compile(pool, "dq", &roots(&["a"]), "flow").await,
        "verified"
    );
    let before = max_message_id(pool, "dq").await;
    start(pool, "dq", json!({})).await;
    assert!(
        max_message_id(pool, "dq").await > before,
        "ids continue after the recorded ones"
    );
    assert_eq!(live_messages(pool, "dq").await, 1);
}

#[tokio::test]
async fn verification_moves_a_queue_recreated_by_hand_past_the_recorded_message_ids() {
    let db = test_db().await;
    let pool = db.pool();
    for (flow, mode) in [("hand", "flow"), ("handstep", "step")] {
        compile(pool, flow, &roots(&["a"]), mode).await;
        let queue: String =
            sqlx::query_scalar("select queue_name from pgflow.steps where flow_slug = $1")
                .bind(flow)
                .fetch_one(pool)
                .await
                .unwrap();
        start(pool, flow, json!({})).await;
        start(pool, flow, json!({})).await;
        exec(
            pool,
            &format!("select pgmq.drop_queue('{queue}'); select pgmq.create('{queue}')"),
        )
        .await;

        assert_eq!(compile(pool, flow, &roots(&["a"]), mode).await, "verified");
        let before = max_message_id(pool, &queue).await;
        sqlx::query("select pgflow.start_flow($1, '{}')")
            .bind(flow)
            .execute(pool)
            .await
            .unwrap_or_else(|e| {
                panic!("start_flow({flow}) after the queue was recreated by hand: {e}")
            });
        assert!(max_message_id(pool, &queue).await > before, "{flow}");
    }
}

#[tokio::test]
async fn version_retirable_refuses_an_unknown_slug_and_names_the_known_ones() {
    let db = test_db().await;
    let pool = db.pool();
    compile_named(pool, "retV1", &roots(&["a"]), "ret_work", false).await;
    compile_named(pool, "otherV1", &roots(&["a"]), "ret_work", false).await;
    start(pool, "retV1", json!({})).await;

    let real: Value = sqlx::query_scalar("select pgflow.version_retirable('retV1', 'ret_work')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(real["retirable"], false, "{real}");

    for wrong in ["retv1", "RETV1", "nope"] {
        let err = db_error(
            sqlx::query("select pgflow.version_retirable($1, 'ret_work')")
                .bind(wrong)
                .execute(pool)
                .await
                .expect_err("an unknown slug is not retirable, it is a mistake"),
        );
        assert_eq!(err.code, SqlState::AliasTargetMissing, "{wrong}: {err:?}");
        assert!(err.message.contains(wrong), "{err:?}");
        let detail = err.detail.clone().unwrap_or_default();
        assert!(
            detail.contains("retV1") && detail.contains("otherV1"),
            "the known slugs are named: {err:?}"
        );
    }
}

/// Waits until the session whose query contains `tag` waits for a lock (true), or until `task` is done
/// without having been seen waiting (false).
async fn wait_for_lock_or_end<T>(
    pool: &PgPool,
    tag: &str,
    task: &tokio::task::JoinHandle<T>,
) -> bool {
    let like = format!("%{tag}%");
    let waited = AtomicBool::new(false);
    let waited_ref = &waited;
    wait_until(
        Duration::from_secs(10),
        "the second session to wait or finish",
        || {
            let like = like.clone();
            let finished = task.is_finished();
            async move {
                let waiting: bool = sqlx::query_scalar(
                    "select exists (select 1 from pg_stat_activity
                     where datname = current_database() and wait_event_type = 'Lock' and query like $1)",
                )
                .bind(like)
                .fetch_one(pool)
                .await
                .unwrap();
                waited_ref.store(waiting, Ordering::SeqCst);
                waiting || finished
            }
        },
    )
    .await;
    waited.load(Ordering::SeqCst)
}

async fn connect(db: &TestDb) -> PgConnection {
    PgConnection::connect_with(&db.options()).await.unwrap()
}

#[tokio::test]
async fn a_new_flow_slug_and_an_alias_of_the_same_name_never_both_commit() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "targetV1", &roots(&["a"]), "flow").await;

    // Session A compiles flow "x" and holds its transaction open.
    let mut a = connect(&db).await;
    sqlx::query("begin").execute(&mut a).await.unwrap();
    let compiled: Value =
        sqlx::query_scalar("select pgflow.ensure_flow_compiled(flow_slug => 'x', shape => $1)")
            .bind(roots(&["a"]))
            .fetch_one(&mut a)
            .await
            .unwrap();
    assert_eq!(compiled["status"], "compiled");

    // Session B activates alias "x": it must wait for A, then see flow "x" and refuse.
    let b_pool = pool.clone();
    let b = tokio::spawn(async move {
        sqlx::query_scalar::<_, Value>(
            "select pgflow.activate_alias('x', 'targetV1') /* session B */",
        )
        .fetch_one(&b_pool)
        .await
    });
    let waited = wait_for_lock_or_end(pool, "session B", &b).await;
    sqlx::query("commit").execute(&mut a).await.unwrap();
    let result = b.await.unwrap();
    assert!(
        waited,
        "session B must wait for session A's name lock, got {result:?}"
    );
    let err = db_error(result.expect_err("alias \"x\" would hide flow \"x\""));
    assert_eq!(err.code, SqlState::AliasCollision, "{err:?}");
    let aliases: i64 = sqlx::query_scalar("select count(*) from pgflow.flow_aliases")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(aliases, 0);
}

#[tokio::test]
async fn an_alias_and_a_new_flow_slug_of_the_same_name_never_both_commit() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "targetV1", &roots(&["a"]), "flow").await;

    // Session A activates alias "x" and holds its transaction open.
    let mut a = connect(&db).await;
    sqlx::query("begin").execute(&mut a).await.unwrap();
    let activated: Value = sqlx::query_scalar("select pgflow.activate_alias('x', 'targetV1')")
        .fetch_one(&mut a)
        .await
        .unwrap();
    assert_eq!(activated["activated"], true);

    // Session B compiles flow "X": it must wait for A, then see alias "x" and refuse.
    let b_pool = pool.clone();
    let b = tokio::spawn(async move {
        sqlx::query_scalar::<_, Value>(
            "select pgflow.ensure_flow_compiled(flow_slug => 'X', shape => $1) /* session B */",
        )
        .bind(roots(&["a"]))
        .fetch_one(&b_pool)
        .await
    });
    let waited = wait_for_lock_or_end(pool, "session B", &b).await;
    sqlx::query("commit").execute(&mut a).await.unwrap();
    let result = b.await.unwrap();
    assert!(
        waited,
        "session B must wait for session A's name lock, got {result:?}"
    );
    let err = db_error(result.expect_err("flow \"X\" would be hidden by alias \"x\""));
    assert_eq!(err.code, SqlState::AliasCollision, "{err:?}");
    let flows: i64 =
        sqlx::query_scalar("select count(*) from pgflow.flows where lower(flow_slug) = 'x'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(flows, 0);
}

#[tokio::test]
async fn a_null_or_non_object_shape_is_refused() {
    let db = test_db().await;
    let pool = db.pool();
    for shape in [
        Value::Null,
        json!([]),
        json!("steps"),
        json!(42),
        json!({"options": {}}),
        json!({"steps": {"slug": "a"}}),
    ] {
        let err = db_error(
            try_compile(pool, "noShape", &shape, "flow", false)
                .await
                .expect_err("a flow needs a shape object with a steps array"),
        );
        assert_eq!(
            err.code,
            SqlState::InvalidParameterValue,
            "{shape}: {err:?}"
        );
        assert!(err.message.contains("\"noShape\""), "{shape}: {err:?}");
        assert!(err.hint.is_some(), "{shape}: {err:?}");
    }
    let flows: i64 = sqlx::query_scalar("select count(*) from pgflow.flows")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(flows, 0, "no zero-step flow blocks the real shape");
    assert_eq!(
        compile(pool, "noShape", &roots(&["a"]), "flow").await,
        "compiled"
    );
}

#[tokio::test]
async fn read_and_claim_tasks_refuses_a_null_quantity() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "nq", &roots(&["a"]), "flow").await;
    for _ in 0..3 {
        start(pool, "nq", json!({})).await;
    }
    let worker = Uuid::new_v4();
    register(pool, worker, "nq-fn", "nq", "nq", None).await;
    let err = db_error(
        sqlx::query("select * from pgflow.read_and_claim_tasks('nq', null, 30, $1, array['nq'], array['a'])")
            .bind(worker)
            .execute(pool)
            .await
            .expect_err("a NULL quantity is a caller's mistake, not the whole queue"),
    );
    assert_eq!(err.code, SqlState::InvalidParameterValue, "{err:?}");
    assert!(
        err.message.contains("qty") && err.message.contains("\"nq\""),
        "{err:?}"
    );
    let started: i64 =
        sqlx::query_scalar("select count(*) from pgflow.step_tasks where status <> 'queued'")
            .fetch_one(pool)
            .await
            .unwrap();
    assert_eq!(started, 0);
}
