//! Structured output. A request asks for a JSON schema, any JSON object, a regex, one of a list
//! of choices, or a Lark grammar ([`GrammarSpec`]); the model's [`Compiler`] turns it into a
//! grammar over the model's real vocabulary (byte-level tokens that straddle grammar boundaries
//! included) with llguidance, caches it by the spec's hash, and hands the engine one constraint
//! per sequence that computes the allowed-token mask for each step. When the output is done,
//! [`Compiled::check`] checks it independently of the grammar engine (a JSON-schema validator, a
//! regex, the list of choices).

pub mod bench;
pub mod compiler;
pub mod spec;
pub mod tools;
mod vocab;

pub use compiler::{
    Compiled, Compiler, FinalCheck, GrammarLimits, GrammarStopped, Outcome, OutputCheck,
};
pub use spec::{from_request, GrammarSpec};

/// Why a structured-output request cannot be served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The request's schema, regex or grammar is invalid, unsupported or over a limit (400).
    #[error("{0}")]
    Invalid(String),
    /// Something failed on our side (500).
    #[error("grammar engine: {0}")]
    Internal(String),
}
