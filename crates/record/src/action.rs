//! The record of a decision or an operator's action: a controller's (a breaker that opens, a
//! model handed off to people, a release promoted, a monitor's alarm) or an admin's (a fault
//! injected, a baseline replaced, a release paused). It rides the bus beside the inference
//! records, so the sinks that keep actions (the log, the metrics, the audit log) take it the way
//! they take every record: counted when a lane loses it, acknowledged where the audit log
//! fails closed.

use serde::{Deserialize, Serialize};

/// Who acted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Actor {
    /// One of the server's own controllers, deciding on what it saw.
    Controller,
    /// A caller with a key that holds the scope (the principal), and the operator its request
    /// named (`X-Operator-Id`), if any.
    Key {
        principal: String,
        operator: Option<String>,
    },
}

/// What was done, as the audit log keeps it (`audit::Action` is this type).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Action {
    /// What was done (`faults.inject`, `handoff.resume`, `audit.read`, `audit.recovered`, ...).
    pub name: String,
    /// What it was done to (a model, a backend id, audit ids).
    pub target: Option<String>,
    /// Why (the cause a controller saw, or the caller's stated reason).
    pub cause: Option<String>,
    /// `ok`, or what went wrong.
    pub outcome: String,
    /// The parameters, as given.
    pub detail: serde_json::Value,
}

/// One decision or action on the bus: who, about which model, and what.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ActionRecord {
    pub by: Actor,
    /// The model it concerns, when it concerns one.
    pub model: Option<String>,
    pub action: Action,
}

impl ActionRecord {
    /// A controller's decision (its outcome `ok`).
    pub fn decision(
        name: &str,
        model: Option<&str>,
        target: &str,
        cause: &str,
        detail: serde_json::Value,
    ) -> Self {
        Self {
            by: Actor::Controller,
            model: model.map(str::to_string),
            action: Action {
                name: name.to_string(),
                target: Some(target.to_string()),
                cause: Some(cause.to_string()),
                outcome: "ok".into(),
                detail,
            },
        }
    }
}
