//! Completions: outputs queue up and are recorded several per `pgflow.complete_tasks` call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use sqlx::PgPool;
use tokio::sync::{mpsc, Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::statements as sql;

/// How many times an outcome is sent before it is left to stalled recovery (backoff 0.1 s doubling to
/// 5 s: about a minute in all, enough to ride out a database restart).
pub(crate) const RECORD_ATTEMPTS: u32 = 16;

/// One finished task's output.
pub(crate) struct Completion {
    pub(crate) run_id: Uuid,
    pub(crate) step_slug: &'static str,
    pub(crate) task_index: i32,
    pub(crate) msg_id: i64,
    pub(crate) output: Value,
}

/// Counters shared by the worker's parts.
#[derive(Default)]
pub(crate) struct Stats {
    pub(crate) completed: AtomicU64,
    pub(crate) failed: AtomicU64,
}

/// Records completions until every sender is gone and the queue is empty.
///
/// Each flush takes whatever is queued (up to `batch`), so under load batches grow by themselves;
/// at most `flushers` calls run at once. After each flush the poller is woken: the completion may
/// have made dependent steps ready.
pub(crate) async fn completer(
    pool: PgPool,
    mut rx: mpsc::UnboundedReceiver<Completion>,
    batch: usize,
    flushers: usize,
    wake: Arc<Notify>,
    stats: Arc<Stats>,
) {
    let slots = Arc::new(Semaphore::new(flushers));
    let mut inflight = JoinSet::new();
    let mut buf = Vec::with_capacity(batch);
    loop {
        if rx.recv_many(&mut buf, batch).await == 0 {
            break;
        }
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            break;
        };
        while buf.len() < batch {
            match rx.try_recv() {
                Ok(c) => buf.push(c),
                Err(_) => break,
            }
        }
        let items = std::mem::replace(&mut buf, Vec::with_capacity(batch));
        inflight.spawn(flush(
            pool.clone(),
            items,
            permit,
            Arc::clone(&wake),
            Arc::clone(&stats),
        ));
        while inflight.try_join_next().is_some() {}
    }
    while inflight.join_next().await.is_some() {}
}

async fn flush(
    pool: PgPool,
    items: Vec<Completion>,
    _permit: OwnedSemaphorePermit,
    wake: Arc<Notify>,
    stats: Arc<Stats>,
) {
    let n = items.len() as u64;
    let result = if items.len() == 1 {
        complete_one(&pool, &items[0]).await
    } else {
        complete_batch(&pool, &items).await
    };
    match result {
        Ok(()) => {
            stats.completed.fetch_add(n, Ordering::Relaxed);
            wake.notify_one();
        }
        Err(e) => {
            tracing::warn!(error = %e, tasks = n, "recording a batch of completions failed; recording them one by one");
            for item in &items {
                if complete_with_retries(&pool, item).await {
                    stats.completed.fetch_add(1, Ordering::Relaxed);
                }
            }
            wake.notify_one();
        }
    }
}

async fn complete_batch(pool: &PgPool, items: &[Completion]) -> Result<(), sqlx::Error> {
    let mut run_ids = Vec::with_capacity(items.len());
    let mut steps = Vec::with_capacity(items.len());
    let mut indexes = Vec::with_capacity(items.len());
    let mut outputs = Vec::with_capacity(items.len());
    for c in items {
        run_ids.push(c.run_id);
        steps.push(c.step_slug);
        indexes.push(c.task_index);
        outputs.push(&c.output);
    }
    sqlx::query(sql::COMPLETE_TASKS)
        .bind(run_ids)
        .bind(steps)
        .bind(indexes)
        .bind(outputs)
        .execute(pool)
        .await?;
    Ok(())
}

async fn complete_one(pool: &PgPool, c: &Completion) -> Result<(), sqlx::Error> {
    sqlx::query(sql::COMPLETE_TASK)
        .bind(c.run_id)
        .bind(c.step_slug)
        .bind(c.task_index)
        .bind(&c.output)
        .execute(pool)
        .await?;
    Ok(())
}

/// Tries a few times with backoff; an output that cannot be recorded is left to stalled recovery.
async fn complete_with_retries(pool: &PgPool, c: &Completion) -> bool {
    let mut delay = Duration::from_millis(100);
    for attempt in 1..=RECORD_ATTEMPTS {
        match complete_one(pool, c).await {
            Ok(()) => return true,
            Err(e) if attempt < RECORD_ATTEMPTS => {
                tracing::warn!(run_id = %c.run_id, step = c.step_slug, task_index = c.task_index,
                    msg_id = c.msg_id, attempt, error = %e, "recording a completion failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(e) => {
                tracing::error!(run_id = %c.run_id, step = c.step_slug, task_index = c.task_index,
                    msg_id = c.msg_id, error = %e,
                    "cannot record a completion; the task is left to stalled-task recovery");
            }
        }
    }
    false
}
