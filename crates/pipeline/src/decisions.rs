//! Controller decisions on the record bus: a breaker that opens, half-opens or closes, a model
//! handed off to people or resumed, a release promoted, a monitor's alarm. Each controller holds
//! a [`Decisions`] handle of the bus it was given (the registry gives one to every breaker it
//! serves, the front to the hand-offs), and publishes what it decided with its cause. The bus
//! takes each decision to the sinks that keep actions — the log (`rampart::decision`), the
//! metrics (`rampart_controller_decisions_total`) and the audit log — in order with the records:
//! a lossy lane that is full counts its loss (`rampart_record_dropped_total`), the fail-closed
//! audit lane waits for room like it does for a request's entry. Publishing never blocks the
//! controller.

use std::sync::{Arc, OnceLock, Weak};

use record::{ActionRecord, Bus};

/// Where a controller's decisions go: the bus it is connected to (by [`Decisions::on`], or later
/// by [`Decisions::connect`] for controllers that are themselves sinks of the bus and so are made
/// before it), or nowhere until then (a unit test, a command that serves nothing). Clones share
/// the connection. It holds the bus weakly: a sink holding it keeps no bus alive.
#[derive(Clone, Default)]
pub struct Decisions(Arc<OnceLock<Weak<Bus>>>);

impl std::fmt::Debug for Decisions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Decisions")
            .field(&self.0.get().is_some())
            .finish()
    }
}

impl Decisions {
    /// Decisions published on `bus`.
    pub fn on(bus: &Arc<Bus>) -> Self {
        let decisions = Self::default();
        decisions.connect(bus);
        decisions
    }

    /// Publishes on `bus` from now on (the first connection stays).
    pub fn connect(&self, bus: &Arc<Bus>) {
        let _ = self.0.set(Arc::downgrade(bus));
    }

    /// Publishes a controller's decision: `name` (`breaker.open`, `handoff.handed_off`, ...),
    /// what it concerns, and why.
    pub fn note(
        &self,
        name: &str,
        model: Option<&str>,
        target: &str,
        cause: &str,
        detail: serde_json::Value,
    ) {
        if let Some(bus) = self.0.get().and_then(Weak::upgrade) {
            let _ = bus.publish_action(ActionRecord::decision(name, model, target, cause, detail));
        }
    }
}
