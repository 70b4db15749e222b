//! The audit log on the record bus, and the task that keeps it signed, sealed and shipped.

use std::sync::Arc;
use std::time::Duration;

use record::{Delivery, Envelope, Sink, SinkError, SinkFuture};

use crate::config::{AuditConfig, Mode};
use crate::entry::{Action, AuditEntry};
use crate::log::AuditLog;
use crate::ship::Shipper;
use crate::AuditError;

/// The bus's name for the audit sink.
pub const SINK_NAME: &str = "audit";

/// Writes each record as an entry. In `fail_closed` the lane is lossless and acknowledged: a
/// response waits for its entry's fsync. Batches are one group commit.
pub struct AuditSink {
    log: Arc<AuditLog>,
    mode: Mode,
    queue: usize,
    max_batch: usize,
}

impl AuditSink {
    pub fn new(log: Arc<AuditLog>, config: &AuditConfig) -> Self {
        Self {
            log,
            mode: config.mode(),
            queue: config.queue,
            max_batch: config.max_batch,
        }
    }

    async fn append(&self, entries: Vec<AuditEntry>) -> Result<(), SinkError> {
        append_blocking(&self.log, entries)
            .await
            .map(|_| ())
            .map_err(|e| SinkError(e.to_string()))
    }
}

impl Sink for AuditSink {
    fn name(&self) -> &'static str {
        SINK_NAME
    }

    fn delivery(&self) -> Delivery {
        match self.mode {
            Mode::FailClosed => Delivery::Lossless {
                capacity: self.queue,
                timeout: Duration::from_secs(10),
                acknowledge: true,
            },
            Mode::BestEffort => Delivery::Lossy {
                capacity: self.queue,
            },
        }
    }

    fn wants_payload(&self) -> bool {
        true
    }

    /// Refusals before authentication and past a key's rate limit reach the log as summaries
    /// per interval (the server's `unauthenticated` tallies), never one fsync'd entry each.
    fn takes_summarised_refusals(&self) -> bool {
        false
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        let entry = AuditEntry::request(envelope);
        Box::pin(async move { self.append(vec![entry]).await })
    }

    fn write_batch<'a>(&'a mut self, envelopes: &'a [Arc<Envelope>]) -> SinkFuture<'a> {
        let entries = envelopes.iter().map(|e| AuditEntry::request(e)).collect();
        Box::pin(async move { self.append(entries).await })
    }

    /// Controller decisions and admin actions: one action entry each, in order with the
    /// requests' entries (a controller's principal is `rampart`).
    fn takes_actions(&self) -> bool {
        true
    }

    fn write_action<'a>(&'a mut self, action: &'a record::ActionRecord) -> SinkFuture<'a> {
        let entry = action_entry(action);
        Box::pin(async move { self.append(vec![entry]).await })
    }

    fn flush(&mut self) -> SinkFuture<'_> {
        let log = Arc::clone(&self.log);
        Box::pin(async move {
            tokio::task::spawn_blocking(move || log.checkpoint())
                .await
                .map_err(|e| SinkError(e.to_string()))?
                .map(|_| ())
                .map_err(|e| SinkError(e.to_string()))
        })
    }
}

/// The log's background work: a checkpoint at every interval while entries arrive, sealing
/// by size and age, shipping, the disk probe after a failure, and the gauges.
pub struct Service {
    pub log: Arc<AuditLog>,
    pub shipper: Option<Arc<Shipper>>,
    pub interval: Duration,
}

impl Service {
    /// Runs until the runtime stops. `lane` reads the audit lane's queue depth and the records
    /// it lost so far.
    pub async fn run(self, lane: impl Fn() -> (usize, u64) + Send + 'static) {
        spawn_checkpointer(&self.log, self.interval);
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ship_backoff = 0u32;
        let mut next_ship = tokio::time::Instant::now();
        // Ship at start (what an earlier run sealed), after each seal, and after a failure once
        // its backoff has passed — not on every tick (a round reads every manifest).
        let mut ship_due = true;
        loop {
            tick.tick().await;
            let log = Arc::clone(&self.log);
            let sealed = tokio::task::spawn_blocking(move || -> Result<usize, AuditError> {
                log.probe();
                log.rotate_if_old()?;
                let mut n = 0;
                while log.seal_next()?.is_some() {
                    n += 1;
                }
                Ok(n)
            })
            .await;
            match sealed {
                Ok(Err(e)) => tracing::error!(error = %e, "audit log upkeep failed"),
                Err(e) => tracing::error!(error = %e, "audit log upkeep stopped"),
                Ok(Ok(n)) => ship_due |= n > 0,
            }
            metrics::gauge!("rampart_audit_checkpoint_age_seconds")
                .set(self.log.checkpoint_age_s());
            let (depth, dropped) = lane();
            metrics::gauge!("rampart_audit_queue_depth").set(depth as f64);
            metrics::counter!("rampart_audit_dropped_total").absolute(dropped);
            metrics::gauge!("rampart_audit_healthy").set(if self.log.is_healthy() {
                1.0
            } else {
                0.0
            });
            let Some(shipper) = &self.shipper else {
                continue;
            };
            if ship_due && tokio::time::Instant::now() >= next_ship {
                let round = shipper.round().await;
                if let Some(why) = &round.failure {
                    metrics::counter!("rampart_audit_ship_failures_total").increment(1);
                    ship_backoff = (ship_backoff + 1).min(6);
                    let wait = Duration::from_secs(1 << ship_backoff);
                    tracing::warn!(error = %why, retry_in_s = wait.as_secs(), to = %shipper.describe(), "audit shipping failed; the local copy stays");
                    next_ship = tokio::time::Instant::now() + wait;
                } else {
                    ship_backoff = 0;
                    ship_due = false;
                }
            }
            metrics::gauge!("rampart_audit_ship_lag_seconds").set(shipper.lag_s());
        }
    }
}

/// Signs a checkpoint every `interval` while entries arrive, on a thread of its own (never
/// queued behind the writers on the runtime's blocking pool); ends when the log is dropped.
fn spawn_checkpointer(log: &Arc<AuditLog>, interval: Duration) {
    let log = Arc::downgrade(log);
    let spawned = std::thread::Builder::new()
        .name("audit-checkpoint".into())
        .spawn(move || loop {
            std::thread::sleep(interval);
            let Some(log) = log.upgrade() else {
                return;
            };
            if let Err(e) = log.checkpoint() {
                tracing::error!(error = %e, "audit checkpoint failed");
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "the audit checkpoint thread did not start");
    }
}

/// The audit entry of an action that rode the bus.
pub fn action_entry(action: &record::ActionRecord) -> AuditEntry {
    let (principal, operator) = match &action.by {
        record::Actor::Controller => (Some("rampart".to_string()), None),
        record::Actor::Key {
            principal,
            operator,
        } => (Some(principal.clone()), operator.clone()),
    };
    AuditEntry::action(
        principal,
        operator,
        action.model.clone(),
        action.action.clone(),
    )
}

/// Appends one action entry (off the async threads); the error says why it was not kept.
pub async fn append_action(
    log: &Arc<AuditLog>,
    principal: Option<String>,
    operator: Option<String>,
    model: Option<String>,
    action: Action,
) -> Result<u64, AuditError> {
    let entry = AuditEntry::action(principal, operator, model, action);
    append_blocking(log, vec![entry])
        .await
        .map(|v| v.first().copied().unwrap_or(0))
}

/// [`AuditLog::append`] off the async threads (it writes and fsyncs).
async fn append_blocking(
    log: &Arc<AuditLog>,
    entries: Vec<AuditEntry>,
) -> Result<Vec<u64>, AuditError> {
    let log = Arc::clone(log);
    tokio::task::spawn_blocking(move || log.append(entries))
        .await
        .map_err(|e| AuditError::Unavailable(format!("the audit writer stopped: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_audit_sink_passes_the_sink_contract_in_both_modes() {
        for mode in [Mode::FailClosed, Mode::BestEffort] {
            let dir = tempfile::tempdir().unwrap();
            let config = AuditConfig {
                mode: Some(mode),
                dir: dir.path().to_path_buf(),
                queue: 64,
                ..Default::default()
            };
            let log = AuditLog::open(config.log_options()).unwrap();
            record::testing::check_sink(|| AuditSink::new(Arc::clone(&log), &config)).await;
            let read = crate::read::load(dir.path(), None);
            assert!(read.problem.is_none(), "{:?}", read.problem);
            assert!(!read.entries.is_empty());
        }
    }
}
