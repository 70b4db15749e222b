//! Controller decisions on the record bus: a breaker that opens, half-opens or closes, a model
//! handed off to people or resumed, a release promoted, a monitor's alarm. The controllers
//! decide inside request paths and timers, without the server's state, so they publish through
//! the process's bus (installed by `serve`). The bus takes each decision to the sinks that keep
//! actions — the log (`rampart::decision`), the metrics (`rampart_controller_decisions_total`)
//! and the audit log — in order with the records: a lossy lane that is full counts its loss
//! (`rampart_record_dropped_total`), the fail-closed audit lane waits for room like it does for
//! a request's entry. Publishing never blocks the controller.

use std::sync::{Arc, OnceLock};

use record::{ActionRecord, Bus};

static BUS: OnceLock<Arc<Bus>> = OnceLock::new();

/// Sends the process's controller decisions to `bus` from now on (once per process; `serve`
/// calls it when the bus starts).
pub fn install(bus: Arc<Bus>) {
    let _ = BUS.set(bus);
}

/// Publishes a controller's decision: `name` (`breaker.open`, `handoff.handed_off`, ...), what
/// it concerns, and why.
pub fn note(name: &str, model: Option<&str>, target: &str, cause: &str, detail: serde_json::Value) {
    let Some(bus) = BUS.get() else {
        return;
    };
    let _ = bus.publish_action(ActionRecord::decision(name, model, target, cause, detail));
}
