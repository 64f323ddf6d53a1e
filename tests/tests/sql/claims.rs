//! claim_tasks: classification of a complete read batch against an exact subscription (claim, defer,
//! archive, unsupported), visibility, the fence, and plain-flow subscriptions.

use crate::step_support::*;
use crate::support::*;
use pgflow_sql::SqlState;
use pgflow_tests::test_db;
use serde_json::{json, Value};
use sqlx::PgPool;
use uuid::Uuid;

const Q: &str = "comm__classify";

/// Step-queued flow "comm": classify -> deliver; a registered classify worker.
async fn setup(pool: &PgPool) -> Uuid {
    let shape = shape(vec![step("classify", &[]), step("deliver", &["classify"])]);
    compile(pool, "comm", &shape, "step").await;
    let worker = Uuid::new_v4();
    let state = register(pool, worker, "comm-classify", Q, "comm", Some("classify")).await;
    assert_eq!(state["enabled"], true);
    worker
}

async fn claim(pool: &PgPool, worker: Uuid, ids: &[i64]) -> Value {
    claim_tasks(pool, Q, "comm", Some("classify"), ids, worker).await
}

async fn vt_of(pool: &PgPool, queue: &str, id: i64) -> f64 {
    seconds_until_visible(pool, queue, id).await
}

#[tokio::test]
async fn queued_tasks_are_claimed_with_the_step_timeout_visibility() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "comm", json!({"thread": 7})).await;
    let msgs = read(pool, Q, 10).await;
    let result = claim(pool, worker, &msgs).await;
    assert_eq!(result["outcome"], "claimed");
    let task = &result["tasks"][0];
    assert_eq!(task["flow_slug"], "comm");
    assert_eq!(task["run_id"], json!(run));
    assert_eq!(task["step_slug"], "classify");
    assert_eq!(task["msg_id"], json!(msgs[0]));
    assert_eq!(task["task_index"], 0);
    assert_eq!(task["flow_input"], json!({"thread": 7}));
    assert_eq!(task["input"], json!({}));
    assert_eq!(
        task_state(pool, run, "classify", 0).await,
        ("started".into(), 1)
    );
    // Flow timeout 30 s + claim buffer 2 s.
    let vt = vt_of(pool, Q, msgs[0]).await;
    assert!((30.0..=32.5).contains(&vt), "{vt}");
    // The dependent's task goes to its own queue once classify completes.
    complete(pool, run, "classify", 0, json!({"route": "help"})).await;
    assert_eq!(live_messages(pool, "comm__deliver").await, 1);
    let queue: String = sqlx::query_scalar(
        "select queue_name from pgflow.step_tasks where run_id = $1 and step_slug = 'deliver'",
    )
    .bind(run)
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(queue, "comm__deliver");
}

#[tokio::test]
async fn a_visible_message_of_a_started_task_is_deferred_to_the_recovery_boundary_without_an_attempt(
) {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "comm", json!({})).await;
    let msgs = read(pool, Q, 10).await;
    claim(pool, worker, &msgs).await;
    // The claim visibility expires while the handler still runs.
    make_visible(pool, Q).await;
    let again = read(pool, Q, 10).await;
    assert_eq!(again, msgs);
    let other = Uuid::new_v4();
    register(pool, other, "comm-classify", Q, "comm", Some("classify")).await;
    let result = claim(pool, other, &again).await;
    assert_eq!(result["outcome"], "claimed");
    assert!(result["tasks"].as_array().unwrap().is_empty());
    assert_eq!(ids(&result["deferred"]), msgs);
    assert_eq!(
        task_state(pool, run, "classify", 0).await,
        ("started".into(), 1)
    );
    // Hidden until started_at + 30 s timeout + 30 s stall buffer.
    let vt = vt_of(pool, Q, msgs[0]).await;
    assert!((58.0..=60.5).contains(&vt), "{vt}");

    // Past the boundary, stalled recovery requeues it and the next claim is a real second attempt.
    exec(
        pool,
        "update pgflow.step_tasks set queued_at = now() - interval '1 hour', started_at = now() - interval '61 seconds'",
    )
    .await;
    let requeued: i32 = sqlx::query_scalar("select pgflow.requeue_stalled_tasks()")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(requeued, 1);
    let msgs = read(pool, Q, 10).await;
    let result = claim(pool, other, &msgs).await;
    assert_eq!(result["tasks"].as_array().unwrap().len(), 1);
    assert_eq!(
        task_state(pool, run, "classify", 0).await,
        ("started".into(), 2)
    );
}

#[tokio::test]
async fn a_message_of_a_terminal_task_is_archived_and_not_returned() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    start(pool, "comm", json!({})).await;
    // A task that became terminal while its message stayed live (e.g. a crash between the two).
    exec(pool, "update pgflow.step_tasks set status = 'cancelled'").await;
    let msgs = read(pool, Q, 10).await;
    let result = claim(pool, worker, &msgs).await;
    assert_eq!(result["outcome"], "claimed");
    assert!(result["tasks"].as_array().unwrap().is_empty());
    assert_eq!(ids(&result["archived"]), msgs);
    assert_eq!(live_messages(pool, Q).await, 0);
    assert_eq!(archived_messages(pool, Q).await, 1);
    // Idempotent: claiming the same ids again changes nothing.
    let result = claim(pool, worker, &msgs).await;
    assert_eq!(result["outcome"], "claimed");
    assert_eq!(archived_messages(pool, Q).await, 1);
}

#[tokio::test]
async fn a_mixed_supported_batch_claims_defers_and_archives_atomically() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let queued = start(pool, "comm", json!({"n": 1})).await;
    let started = start(pool, "comm", json!({"n": 2})).await;
    let terminal = start(pool, "comm", json!({"n": 3})).await;
    let m_started = task_msg(pool, started, "classify").await;
    claim(pool, worker, &[m_started]).await;
    sqlx::query("update pgflow.step_tasks set status = 'cancelled' where run_id = $1")
        .bind(terminal)
        .execute(pool)
        .await
        .unwrap();
    make_visible(pool, Q).await;
    let msgs = read(pool, Q, 10).await;
    assert_eq!(msgs.len(), 3);
    let result = claim(pool, worker, &msgs).await;
    assert_eq!(result["outcome"], "claimed");
    assert_eq!(
        ids(&result["tasks"]),
        [task_msg(pool, queued, "classify").await]
    );
    assert_eq!(ids(&result["deferred"]), [m_started]);
    assert_eq!(
        ids(&result["archived"]),
        [task_msg(pool, terminal, "classify").await]
    );
    assert_eq!(
        task_state(pool, queued, "classify", 0).await,
        ("started".into(), 1)
    );
    assert_eq!(
        task_state(pool, started, "classify", 0).await,
        ("started".into(), 1)
    );
}

#[tokio::test]
async fn an_unsupported_message_leaves_the_whole_batch_untouched_and_visible_and_the_function_is_fenced(
) {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "comm", json!({})).await;
    // A foreign message in the private queue.
    let foreign: i64 = sqlx::query_scalar(
        "select pgmq.send('comm__classify', '{\"flow_slug\": \"other\", \"step_slug\": \"x\", \"secret\": 1}')",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    let msgs = read(pool, Q, 10).await;
    assert_eq!(msgs.len(), 2);
    let result = claim(pool, worker, &msgs).await;
    assert_eq!(result["outcome"], "unsupported");
    assert!(result["tasks"].as_array().unwrap().is_empty());
    let report = &result["unsupported"];
    assert_eq!(report["queue_name"], Q);
    assert_eq!(report["supported"], json!([["comm", "classify"]]));
    assert_eq!(ids(&report["msg_ids"]), msgs);
    assert_eq!(ids(&report["unsupported_msg_ids"]), [foreign]);
    assert_eq!(report["flows"], json!(["other"]));
    assert_eq!(report["steps"], json!(["x"]));
    assert_eq!(report["messages"][0]["reason"], "no_task");
    assert!(!report.to_string().contains("secret"), "no message bodies");
    // No mutation, no attempt, the batch visible again.
    assert_eq!(
        task_state(pool, run, "classify", 0).await,
        ("queued".into(), 0)
    );
    for id in &msgs {
        assert!(vt_of(pool, Q, *id).await <= 0.0);
    }

    // The worker fences its function before stopping; a restart learns it and claims nothing.
    let state: Value = sqlx::query_scalar(
        "select pgflow.disable_worker_function(function_name => 'comm-classify', reason => $1)",
    )
    .bind(report.to_string())
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(state["enabled"], false);
    let tracked: Value = sqlx::query_scalar("select pgflow.track_worker_function('comm-classify')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(tracked["enabled"], false);
    assert!(tracked["disabled_reason"]
        .as_str()
        .unwrap()
        .contains("unsupported_msg_ids"));
    let restarted = Uuid::new_v4();
    let state = register(
        pool,
        restarted,
        "comm-classify",
        Q,
        "comm",
        Some("classify"),
    )
    .await;
    assert_eq!(state["enabled"], false);
    let beat: Value = sqlx::query_scalar("select pgflow.worker_heartbeat($1)")
        .bind(worker)
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(beat["enabled"], false);
    let run_msg = task_msg(pool, run, "classify").await;
    let result = claim(pool, restarted, &[run_msg]).await;
    assert_eq!(result["outcome"], "disabled");
    assert_eq!(
        task_state(pool, run, "classify", 0).await,
        ("queued".into(), 0)
    );

    // An operator lifts the fence after removing the foreign message.
    exec(
        pool,
        &format!("select pgmq.delete('comm__classify', {foreign}::bigint)"),
    )
    .await;
    let state: Value = sqlx::query_scalar("select pgflow.enable_worker_function('comm-classify')")
        .fetch_one(pool)
        .await
        .unwrap();
    assert_eq!(state["enabled"], true);
    assert_eq!(state["disabled_reason"], Value::Null);
    let result = claim(pool, restarted, &[run_msg]).await;
    assert_eq!(result["tasks"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn tasks_of_another_step_or_another_queue_are_unsupported() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "comm", json!({})).await;
    // A classify message read from the classify queue by a worker subscribed to "deliver".
    let msgs = read(pool, Q, 10).await;
    let deliver = Uuid::new_v4();
    register(
        pool,
        deliver,
        "comm-deliver",
        "comm__deliver",
        "comm",
        Some("deliver"),
    )
    .await;
    let result = claim_tasks(pool, Q, "comm", Some("deliver"), &msgs, deliver).await;
    assert_eq!(result["outcome"], "unsupported");
    assert_eq!(
        result["unsupported"]["messages"][0]["reason"],
        "unsupported_route"
    );
    assert_eq!(result["unsupported"]["steps"], json!(["classify"]));

    // A copy of the classify message sent to the deliver queue: its task lives in another queue.
    let copy: i64 = sqlx::query_scalar(&format!(
        "select pgmq.send('comm__deliver', message) from pgmq.q_comm__classify where msg_id = {}",
        msgs[0]
    ))
    .fetch_one(pool)
    .await
    .unwrap();
    let result = claim_tasks(
        pool,
        "comm__deliver",
        "comm",
        Some("deliver"),
        &[copy],
        deliver,
    )
    .await;
    assert_eq!(result["outcome"], "unsupported");
    assert_eq!(
        result["unsupported"]["messages"][0]["reason"],
        "wrong_queue"
    );
    assert_eq!(
        task_state(pool, run, "classify", 0).await,
        ("queued".into(), 0)
    );

    // The right worker still claims it.
    let result = claim(pool, worker, &msgs).await;
    assert_eq!(result["tasks"].as_array().unwrap().len(), 1);
}

#[tokio::test]
async fn plain_flows_use_a_subscription_covering_every_step_of_their_queue() {
    let db = test_db().await;
    let pool = db.pool();
    compile(pool, "plain", &roots(&["a", "b"]), "flow").await;
    let worker = Uuid::new_v4();
    let state = register(pool, worker, "plain-fn", "plain", "plain", None).await;
    assert_eq!(state["pairs"], json!([["plain", "a"], ["plain", "b"]]));
    let run = start(pool, "plain", json!({})).await;
    let msgs = read(pool, "plain", 10).await;
    let result = claim_tasks(pool, "plain", "plain", None, &msgs, worker).await;
    assert_eq!(result["outcome"], "claimed");
    let steps: Vec<&str> = result["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["step_slug"].as_str().unwrap())
        .collect();
    assert_eq!(steps, ["a", "b"]);
    assert_eq!(task_state(pool, run, "b", 0).await, ("started".into(), 1));

    // A message of another flow in the plain queue is unsupported as well.
    compile(pool, "other", &roots(&["x"]), "flow").await;
    let other_run = start(pool, "other", json!({})).await;
    let other_msgs = read(pool, "other", 10).await;
    let result = claim_tasks(pool, "other", "plain", None, &other_msgs, worker).await;
    assert_eq!(result["outcome"], "unsupported");
    assert_eq!(result["unsupported"]["flows"], json!(["other"]));
    assert_eq!(
        task_state(pool, other_run, "x", 0).await,
        ("queued".into(), 0)
    );
}

#[tokio::test]
async fn registration_rejects_a_subscription_that_does_not_match_the_persisted_route() {
    let db = test_db().await;
    let pool = db.pool();
    setup(pool).await;
    let w = Uuid::new_v4();
    let e = db_error(
        try_register(pool, w, "f", "comm__deliver", "comm", Some("classify"))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::SubscriptionInvalid);
    assert_eq!(
        e.detail.as_deref(),
        Some("The persisted route of the step is the queue \"comm__classify\".")
    );
    let e = db_error(
        try_register(pool, w, "f", Q, "comm", None)
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::SubscriptionInvalid);
    let e = db_error(
        try_register(pool, w, "f", Q, "nope", Some("classify"))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, SqlState::SubscriptionInvalid);
    let (flow, step, queue): (String, String, String) = sqlx::query_as(
        "select r.flow_slug, r.step_slug, w.queue_name from pgflow.workers w
         join pgflow.worker_routes r on r.worker_id = w.worker_id where w.function_name = 'comm-classify'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(
        (flow.as_str(), step.as_str(), queue.as_str()),
        ("comm", "classify", Q)
    );
}

#[tokio::test]
async fn a_run_spanning_several_queues_archives_cancels_and_skips_in_every_queue() {
    let db = test_db().await;
    let pool = db.pool();
    let mut skip = step("b", &[]);
    skip["whenExhausted"] = json!("skip");
    let flow_shape = json!({
        "options": {"timeout": 30, "maxAttempts": 1},
        "steps": [step("a", &[]), skip, step("c", &[]), step("d", &["a", "b", "c"])]
    });
    compile(pool, "multi", &flow_shape, "step").await;
    let worker = Uuid::new_v4();
    register(pool, worker, "multi-a", "multi__a", "multi", Some("a")).await;

    // Archive: each completion archives in the task's own queue; skip: b is skipped in its queue.
    let run = start(pool, "multi", json!({})).await;
    for (queue, step_slug) in [("multi__a", "a"), ("multi__b", "b"), ("multi__c", "c")] {
        let msgs = read(pool, queue, 10).await;
        let result = claim_tasks(pool, queue, "multi", Some(step_slug), &msgs, worker).await;
        assert_eq!(result["tasks"].as_array().unwrap().len(), 1, "{queue}");
    }
    complete(pool, run, "a", 0, json!(1)).await;
    assert_eq!(fail(pool, run, "b", 0, "boom").await, "failed");
    assert_eq!(step_status(pool, run, "b").await, "skipped");
    complete(pool, run, "c", 0, json!(3)).await;
    let msgs = read(pool, "multi__d", 10).await;
    claim_tasks(pool, "multi__d", "multi", Some("d"), &msgs, worker).await;
    complete(pool, run, "d", 0, json!(4)).await;
    assert_eq!(run_status(pool, run).await, "completed");
    for queue in ["multi__a", "multi__b", "multi__c", "multi__d"] {
        assert_eq!(live_messages(pool, queue).await, 0, "{queue}");
        assert_eq!(archived_messages(pool, queue).await, 1, "{queue}");
    }

    // Cancel: a failing run cancels the unfinished tasks of every queue at once.
    let run = start(pool, "multi", json!({})).await;
    let msgs = read(pool, "multi__a", 10).await;
    claim_tasks(pool, "multi__a", "multi", Some("a"), &msgs, worker).await;
    assert_eq!(fail(pool, run, "a", 0, "fatal").await, "failed");
    assert_eq!(run_status(pool, run).await, "failed");
    assert_eq!(task_statuses(pool, run, "b").await, ["cancelled"]);
    assert_eq!(task_statuses(pool, run, "c").await, ["cancelled"]);
    for queue in ["multi__a", "multi__b", "multi__c"] {
        assert_eq!(live_messages(pool, queue).await, 0, "{queue}");
        assert_eq!(archived_messages(pool, queue).await, 2, "{queue}");
    }
}

#[tokio::test]
async fn claim_and_deferral_visibility_use_the_effective_step_timeout() {
    let db = test_db().await;
    let pool = db.pool();
    let mut quick = step("quick", &[]);
    quick["options"] = json!({"timeout": 10});
    compile(pool, "timed", &shape(vec![quick]), "step").await;
    let worker = Uuid::new_v4();
    register(
        pool,
        worker,
        "timed",
        "timed__quick",
        "timed",
        Some("quick"),
    )
    .await;
    start(pool, "timed", json!({})).await;
    let msgs = read(pool, "timed__quick", 1).await;
    claim_tasks(pool, "timed__quick", "timed", Some("quick"), &msgs, worker).await;
    // Step timeout 10 s + claim buffer 2 s (not the flow's 30 s).
    let vt = seconds_until_visible(pool, "timed__quick", msgs[0]).await;
    assert!((10.0..=12.5).contains(&vt), "{vt}");
    make_visible(pool, "timed__quick").await;
    let again = read(pool, "timed__quick", 1).await;
    let result = claim_tasks(pool, "timed__quick", "timed", Some("quick"), &again, worker).await;
    assert_eq!(ids(&result["deferred"]), msgs);
    // Step timeout 10 s + stall buffer 30 s: the moment requeue_stalled_tasks() may requeue it.
    let vt = seconds_until_visible(pool, "timed__quick", msgs[0]).await;
    assert!((38.0..=40.5).contains(&vt), "{vt}");
}

#[tokio::test]
async fn overlapping_claims_of_one_message_return_the_task_exactly_once() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "comm", json!({})).await;
    let msgs = read(pool, Q, 1).await;

    // The first claim holds its transaction open; the second blocks on the task row, then defers it.
    let mut first = pool.begin().await.unwrap();
    let claimed = claim_json(
        sqlx::query(
            "select * from pgflow.claim_tasks(queue_name => $1, msg_ids => $2, worker_id => $3,
               flow_slugs => array['comm'], step_slugs => array['classify'])",
        )
        .bind(Q)
        .bind(&msgs)
        .bind(worker)
        .fetch_all(&mut *first)
        .await
        .unwrap(),
    );
    assert_eq!(claimed["tasks"].as_array().unwrap().len(), 1);
    let second = {
        let pool = pool.clone();
        let msgs = msgs.clone();
        tokio::spawn(
            async move { claim_tasks(&pool, Q, "comm", Some("classify"), &msgs, worker).await },
        )
    };
    pgflow_tests::wait_until(
        std::time::Duration::from_secs(10),
        "the second claim to wait for the first",
        || async {
            sqlx::query_scalar::<_, bool>(
                "select exists (select 1 from pg_stat_activity
                                where wait_event_type = 'Lock' and query like '%claim_tasks%')",
            )
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
    assert!(!second.is_finished());
    first.commit().await.unwrap();
    let second = second.await.unwrap();
    assert!(second["tasks"].as_array().unwrap().is_empty());
    assert_eq!(ids(&second["deferred"]), msgs);
    assert_eq!(
        task_state(pool, run, "classify", 0).await,
        ("started".into(), 1)
    );
}

#[tokio::test]
async fn retries_recovery_and_pruning_use_the_task_queue_snapshot() {
    let db = test_db().await;
    let pool = db.pool();
    let worker = setup(pool).await;
    let run = start(pool, "comm", json!({})).await;
    let msgs = read(pool, Q, 1).await;
    claim(pool, worker, &msgs).await;

    // Retry: back to queued, the same message in the step queue, delayed by the backoff.
    assert_eq!(fail(pool, run, "classify", 0, "flaky").await, "queued");
    assert_eq!(live_messages(pool, Q).await, 1);
    assert!(seconds_until_visible(pool, Q, msgs[0]).await > 0.0);

    // Permanent stall and the operator's retry: a fresh message in the same step queue.
    make_visible(pool, Q).await;
    claim(pool, worker, &msgs).await;
    exec(
        pool,
        "update pgflow.step_tasks set requeued_count = 3, queued_at = now() - interval '1 hour',
                started_at = now() - interval '61 seconds'",
    )
    .await;
    exec(pool, "select pgflow.requeue_stalled_tasks()").await;
    assert_eq!(live_messages(pool, Q).await, 0);
    exec(
        pool,
        &format!("select pgflow.resolve_stalled_task('{run}', 'classify', 0, 'retry')"),
    )
    .await;
    assert_eq!(live_messages(pool, Q).await, 1);
    assert_eq!(live_messages(pool, "comm__deliver").await, 0);
    let fresh = read(pool, Q, 1).await;
    let result = claim(pool, worker, &fresh).await;
    assert_eq!(result["tasks"].as_array().unwrap().len(), 1);
    complete(pool, run, "classify", 0, json!({})).await;

    // Pruning a finished run removes its messages from every step queue's archive.
    let deliver = Uuid::new_v4();
    register(
        pool,
        deliver,
        "comm-deliver",
        "comm__deliver",
        "comm",
        Some("deliver"),
    )
    .await;
    let msgs = read(pool, "comm__deliver", 1).await;
    claim_tasks(
        pool,
        "comm__deliver",
        "comm",
        Some("deliver"),
        &msgs,
        deliver,
    )
    .await;
    complete(pool, run, "deliver", 0, json!({})).await;
    assert_eq!(run_status(pool, run).await, "completed");
    assert_eq!(archived_messages(pool, Q).await, 2);
    assert_eq!(archived_messages(pool, "comm__deliver").await, 1);
    exec(
        pool,
        "update pgflow.runs set started_at = now() - interval '2 days', completed_at = now() - interval '2 days'",
    )
    .await;
    exec(
        pool,
        "select pgflow.prune_data_older_than(interval '1 day')",
    )
    .await;
    // The task's current message is gone from the classify archive (the message replaced by the operator's
    // retry is only pruned once its own archive time passes the cutoff), and the deliver archive is empty.
    assert_eq!(archived_messages(pool, Q).await, 1);
    assert_eq!(archived_messages(pool, "comm__deliver").await, 0);
}
