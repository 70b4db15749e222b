//! A model's fallback chain as configured and loaded: its steps (another model, or a backend of
//! its own: a canned answer, the tensor model on the other runtime), the triggers each step
//! takes, and the chain's timeouts. The registry's entries carry it; [`crate::chain`] runs it.

use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::registry::{Entry, ModelName};

/// A model's fallback chain and its timeouts.
#[derive(Debug, Clone)]
pub struct Policy {
    pub steps: Vec<Step>,
    /// After admission: longest wait for the first content token (or the whole answer of a
    /// tensor or embedding request).
    pub first_token_timeout: Duration,
    /// Longest gap between two events of a generation.
    pub stall_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            steps: Vec::new(),
            first_token_timeout: Duration::from_secs(60),
            stall_timeout: Duration::from_secs(30),
        }
    }
}

impl Policy {
    /// The backends the chain holds itself (canned answers, tensor twins).
    pub fn own_entries(&self) -> Vec<Arc<Entry>> {
        self.steps
            .iter()
            .filter_map(|s| match &s.target {
                Target::Own(e) => Some(Arc::clone(e)),
                Target::Model(_) => None,
            })
            .collect()
    }
}

/// One step of a chain.
#[derive(Debug, Clone)]
pub struct Step {
    pub target: Target,
    pub on: Vec<Trigger>,
}

/// What a step falls back to.
#[derive(Clone)]
pub enum Target {
    /// A served model, looked up when the step is reached.
    Model(ModelName),
    /// A backend of the chain's own: a canned answer, or the model on the other tensor
    /// runtime.
    Own(Arc<Entry>),
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Model(m) => write!(f, "Model({m})"),
            Target::Own(e) => write!(f, "Own({})", e.id),
        }
    }
}

impl Target {
    /// The step as `GET /admin/backends` names it.
    pub fn describe(&self) -> String {
        match self {
            Target::Model(m) => m.to_string(),
            Target::Own(e) => e.id.clone(),
        }
    }
}

/// What moves a request to the next step of its model's fallback chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Trigger {
    /// The backend failed (an error before or instead of the answer; a failed stream before
    /// its first content token).
    Error,
    /// No first content token (or, for tensors and embeddings, no answer) within
    /// `first_token_timeout_ms`.
    FirstTokenTimeout,
    /// No event for `stall_timeout_ms` while generating (falls back only while nothing has
    /// reached the client: a non-streaming request, or a stream before its first token).
    StallTimeout,
    /// The backend's admission refused (its queue is full or the wait ran out), or its own
    /// queue did.
    Overloaded,
    /// The backend's circuit breaker is open.
    CircuitOpen,
    /// The prompt does not fit the backend's context (only steps that list it take it).
    ContextLength,
    /// The backend is not loaded or fails its readiness check.
    NotReady,
}

impl Trigger {
    pub const ALL: [Trigger; 7] = [
        Trigger::Error,
        Trigger::FirstTokenTimeout,
        Trigger::StallTimeout,
        Trigger::Overloaded,
        Trigger::CircuitOpen,
        Trigger::ContextLength,
        Trigger::NotReady,
    ];

    /// What a step takes when it lists nothing: every trigger but `context_length` (a prompt
    /// too long for one model is the client's to shorten unless a step says it can take it).
    pub const DEFAULT: [Trigger; 6] = [
        Trigger::Error,
        Trigger::FirstTokenTimeout,
        Trigger::StallTimeout,
        Trigger::Overloaded,
        Trigger::CircuitOpen,
        Trigger::NotReady,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Error => "error",
            Trigger::FirstTokenTimeout => "first_token_timeout",
            Trigger::StallTimeout => "stall_timeout",
            Trigger::Overloaded => "overloaded",
            Trigger::CircuitOpen => "circuit_open",
            Trigger::ContextLength => "context_length",
            Trigger::NotReady => "not_ready",
        }
    }
}

/// One step of a model's fallback chain: exactly one of `model`, `canned`, `tensor_backend`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FallbackStep {
    /// Another served model (`name` or `name@version`): a language model, a rules model, a
    /// tensor model.
    pub model: Option<String>,
    /// A canned answer: this text (a generation that says so).
    pub canned: Option<String>,
    /// Canned answers per language (`zh = "..."`), chosen by the request's `Accept-Language`.
    #[serde(default)]
    pub languages: std::collections::BTreeMap<String, String>,
    /// The same tensor model on this runtime (`tract` or `onnxruntime`).
    pub tensor_backend: Option<classic::BackendChoice>,
    /// The triggers this step takes (default: all but `context_length`).
    pub on: Option<Vec<Trigger>>,
}

impl FallbackStep {
    pub fn triggers(&self) -> Vec<Trigger> {
        self.on.clone().unwrap_or_else(|| Trigger::DEFAULT.to_vec())
    }
}
