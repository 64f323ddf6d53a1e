//! The floor: raw PGMQ on the same server, with no pgflow logic at all.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::{Connection as _, PgConnection};

use crate::db::BenchDb;
use crate::BenchError;

/// The raw PGMQ workloads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FloorKind {
    /// Per message: `send` one, `read(1)`, `archive` it; three commits per message.
    Pipeline,
    /// `read(10)`, then per message `archive` + `send` in one transaction: the queue work of one task.
    Relay,
    /// `read(10)`, then `archive(ids[])` + `send_batch` in one transaction: one commit per ten.
    RelayBatched,
}

impl FloorKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            FloorKind::Pipeline => "PGMQ pipeline: send → read(1) → archive, per message (floor)",
            FloorKind::Relay => {
                "PGMQ relay: read(10), then archive + send per message, 1 commit/msg"
            }
            FloorKind::RelayBatched => {
                "PGMQ relay batched: read(10), archive(ids[]) + send_batch, 1 commit/10"
            }
        }
    }

    fn tag(self) -> &'static str {
        match self {
            FloorKind::Pipeline => "pipe",
            FloorKind::Relay => "relay",
            FloorKind::RelayBatched => "relayb",
        }
    }
}

/// Runs `kind` with `k` clients (one connection each) for `duration`; returns messages per second.
pub(crate) async fn run(
    db: &BenchDb,
    kind: FloorKind,
    k: usize,
    duration: Duration,
) -> Result<f64, BenchError> {
    let queue = format!("floor_{}_k{k}", kind.tag());
    sqlx::query("select pgmq.create($1)")
        .bind(&queue)
        .execute(&db.pool)
        .await?;
    if kind != FloorKind::Pipeline {
        // Enough visible messages that every client always reads a full batch.
        sqlx::query("select pgmq.send_batch($1, array_fill('{}'::jsonb, array[$2]))")
            .bind(&queue)
            .bind((k * 40).max(200) as i32)
            .execute(&db.pool)
            .await?;
    }
    let done = Arc::new(AtomicU64::new(0));
    let mut conns = Vec::with_capacity(k);
    for _ in 0..k {
        conns.push(db.connect().await?);
    }
    let started = Instant::now();
    let deadline = started + duration;
    let mut clients = tokio::task::JoinSet::new();
    for conn in conns {
        let (queue, done) = (queue.clone(), done.clone());
        clients.spawn(async move { client(conn, kind, &queue, deadline, &done).await });
    }
    while let Some(result) = clients.join_next().await {
        result.map_err(|e| BenchError::Invalid(format!("floor client panicked: {e}")))??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    Ok(done.load(Ordering::Relaxed) as f64 / elapsed)
}

async fn client(
    mut conn: PgConnection,
    kind: FloorKind,
    queue: &str,
    deadline: Instant,
    done: &AtomicU64,
) -> Result<(), sqlx::Error> {
    while Instant::now() < deadline {
        match kind {
            FloorKind::Pipeline => {
                sqlx::query("select pgmq.send($1, '{}'::jsonb)")
                    .bind(queue)
                    .execute(&mut conn)
                    .await?;
                let ids: Vec<i64> = sqlx::query_scalar("select msg_id from pgmq.read($1, 30, 1)")
                    .bind(queue)
                    .fetch_all(&mut conn)
                    .await?;
                if !ids.is_empty() {
                    sqlx::query("select pgmq.archive($1, $2::bigint[])")
                        .bind(queue)
                        .bind(&ids)
                        .execute(&mut conn)
                        .await?;
                    done.fetch_add(ids.len() as u64, Ordering::Relaxed);
                }
            }
            FloorKind::Relay => {
                let ids = read10(&mut conn, queue).await?;
                for id in ids {
                    let mut tx = conn.begin().await?;
                    sqlx::query("select pgmq.archive($1, $2::bigint)")
                        .bind(queue)
                        .bind(id)
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query("select pgmq.send($1, '{}'::jsonb)")
                        .bind(queue)
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }
            FloorKind::RelayBatched => {
                let ids = read10(&mut conn, queue).await?;
                if ids.is_empty() {
                    continue;
                }
                let mut tx = conn.begin().await?;
                sqlx::query("select pgmq.archive($1, $2::bigint[])")
                    .bind(queue)
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query("select pgmq.send_batch($1, array_fill('{}'::jsonb, array[$2]))")
                    .bind(queue)
                    .bind(ids.len() as i32)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
                done.fetch_add(ids.len() as u64, Ordering::Relaxed);
            }
        }
    }
    conn.close().await
}

async fn read10(conn: &mut PgConnection, queue: &str) -> Result<Vec<i64>, sqlx::Error> {
    sqlx::query_scalar("select msg_id from pgmq.read($1, 30, 10)")
        .bind(queue)
        .fetch_all(conn)
        .await
}
