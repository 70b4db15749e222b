//! Controller decisions as audit entries: a breaker that opens, half-opens or closes, a model
//! handed off to people or resumed. The controllers decide inside request paths and timers,
//! without the server's state, so they hand each decision (already logged and counted) to a
//! bounded queue that one task appends to the audit log. Never blocks; a full queue drops the
//! entry with a warning (the log line and the metric stay).

use std::sync::{Arc, OnceLock};

use tokio::sync::mpsc;

struct Decision {
    model: Option<String>,
    action: audit::Action,
}

static QUEUE: OnceLock<mpsc::Sender<Decision>> = OnceLock::new();

/// Sends the process's controller decisions to `log` from now on (once per process; `serve`
/// calls it when the audit log is on).
pub fn install(log: Arc<audit::AuditLog>) {
    let (tx, mut rx) = mpsc::channel::<Decision>(1024);
    if QUEUE.set(tx).is_err() {
        return;
    }
    tokio::spawn(async move {
        while let Some(d) = rx.recv().await {
            let kept =
                audit::sink::append_action(&log, Some("rampart".into()), None, d.model, d.action)
                    .await;
            if let Err(e) = kept {
                tracing::error!(error = %e, "a controller decision could not be kept in the audit log");
            }
        }
    });
}

/// Keeps a controller's decision: `name` (`breaker.open`, `handoff.handed_off`, ...), what it
/// concerns, and why.
pub fn note(name: &str, model: Option<&str>, target: &str, cause: &str, detail: serde_json::Value) {
    let Some(queue) = QUEUE.get() else {
        return;
    };
    let decision = Decision {
        model: model.map(str::to_string),
        action: audit::Action {
            name: name.to_string(),
            target: Some(target.to_string()),
            cause: Some(cause.to_string()),
            outcome: "ok".into(),
            detail,
        },
    };
    if queue.try_send(decision).is_err() {
        tracing::warn!(
            decision = name,
            target,
            "the controller decisions' queue is full: this one is not in the audit log"
        );
    }
}
