//! One shared `LISTEN` connection per [`Client`](crate::Client) that wakes run waiters.
//!
//! The connection listens on each waited run's channel and registers itself as the run's watcher
//! (`pgflow.watch_run`): by default the SQL core sends a run's events only while someone watches it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgListener;
use sqlx::PgPool;
use tokio::sync::{mpsc, oneshot, Notify};
use uuid::Uuid;

use crate::statements;

enum Cmd {
    Listen(Uuid, oneshot::Sender<bool>),
    Unlisten(Uuid),
}

struct Entry {
    notify: Arc<Notify>,
    waiters: usize,
}

type Waiters = Arc<Mutex<HashMap<Uuid, Entry>>>;

/// The shared listener; its task ends when the last handle is dropped.
pub(crate) struct Hub {
    tx: mpsc::UnboundedSender<Cmd>,
    waiters: Waiters,
}

/// A waiter's registration; dropping it unregisters.
pub(crate) struct Subscription {
    run_id: Uuid,
    notify: Arc<Notify>,
    tx: mpsc::UnboundedSender<Cmd>,
    waiters: Waiters,
}

impl Subscription {
    /// Resolves on the next notification of the run (or one that arrived since the last call).
    pub(crate) async fn notified(&self) {
        self.notify.notified().await;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut map = self.waiters.lock().expect("waiters lock");
        if let Some(e) = map.get_mut(&self.run_id) {
            e.waiters -= 1;
            if e.waiters == 0 {
                map.remove(&self.run_id);
                let _ = self.tx.send(Cmd::Unlisten(self.run_id));
            }
        }
    }
}

impl Hub {
    /// Connects the listener (one pool connection, held while the hub lives).
    pub(crate) async fn start(pool: &PgPool) -> Result<Hub, sqlx::Error> {
        let listener = PgListener::connect_with(pool).await?;
        let (tx, rx) = mpsc::unbounded_channel();
        let waiters: Waiters = Arc::default();
        tokio::spawn(run(listener, rx, Arc::clone(&waiters)));
        Ok(Hub { tx, waiters })
    }

    /// Registers interest in a run; `None` when the listener is gone (poll instead).
    pub(crate) async fn subscribe(&self, run_id: Uuid) -> Option<Subscription> {
        let (notify, first) = {
            let mut map = self.waiters.lock().expect("waiters lock");
            let e = map.entry(run_id).or_insert_with(|| Entry {
                notify: Arc::new(Notify::new()),
                waiters: 0,
            });
            e.waiters += 1;
            (Arc::clone(&e.notify), e.waiters == 1)
        };
        let sub = Subscription {
            run_id,
            notify,
            tx: self.tx.clone(),
            waiters: Arc::clone(&self.waiters),
        };
        if first {
            let (ack, done) = oneshot::channel();
            self.tx.send(Cmd::Listen(run_id, ack)).ok()?;
            if !done.await.unwrap_or(false) {
                return None;
            }
        }
        Some(sub)
    }
}

/// Registers the listening session as a watcher of `run_id` (the run's status is read by the waiter).
async fn watch(listener: &mut PgListener, run_id: Uuid) -> Result<(), sqlx::Error> {
    sqlx::query(statements::WATCH_RUN)
        .bind(run_id)
        .execute(listener)
        .await
        .map(drop)
}

async fn run(mut listener: PgListener, mut rx: mpsc::UnboundedReceiver<Cmd>, waiters: Waiters) {
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None => return,
                Some(Cmd::Listen(run_id, ack)) => {
                    // Listen before watching: an event sent once the watch is in place finds the channel.
                    let mut ok = listener.listen(&statements::run_channel(run_id)).await;
                    if ok.is_ok() {
                        ok = watch(&mut listener, run_id).await;
                    }
                    if let Err(e) = &ok {
                        tracing::debug!(%run_id, error = %e, "LISTEN or watch_run failed; waiters poll");
                    }
                    let _ = ack.send(ok.is_ok());
                }
                Some(Cmd::Unlisten(run_id)) => {
                    let still_waited = waiters.lock().expect("waiters lock").contains_key(&run_id);
                    if !still_waited {
                        let _ = sqlx::query(statements::UNWATCH_RUN)
                            .bind(run_id)
                            .execute(&mut listener)
                            .await;
                        let _ = listener.unlisten(&statements::run_channel(run_id)).await;
                    }
                }
            },
            note = listener.recv() => match note {
                Ok(n) => {
                    let id = n.channel().strip_prefix("pgflow_run_").and_then(|h| Uuid::parse_str(h).ok());
                    if let Some(id) = id {
                        if let Some(e) = waiters.lock().expect("waiters lock").get(&id) {
                            e.notify.notify_waiters();
                            e.notify.notify_one();
                        }
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "run listener error; reconnecting");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    // The new session watches every waited run again (maintenance removes the old
                    // session's registrations once it is gone); a failure leaves the waiters to their poll.
                    let waited: Vec<Uuid> = waiters.lock().expect("waiters lock").keys().copied().collect();
                    for run_id in waited {
                        if let Err(e) = watch(&mut listener, run_id).await {
                            tracing::debug!(%run_id, error = %e, "watch_run failed after reconnecting");
                            break;
                        }
                    }
                    // Then wake everyone to read their run again: an event may have been lost meanwhile.
                    for e in waiters.lock().expect("waiters lock").values() {
                        e.notify.notify_waiters();
                    }
                }
            },
        }
    }
}
