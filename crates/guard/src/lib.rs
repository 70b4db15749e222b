//! Pure guard logic, no I/O and no server types.
//!
//! - [`rules`]: the rules engine, a declarative classifier (labels, regular expressions and
//!   weighted keywords, a threshold, a default) that answers when a model cannot, and says why:
//!   every answer carries the spans of the input that decided it.
//!
//! The prompt-injection guard (normalisation, injection rules, the classifier's scoring) joins
//! this crate in its own issue. Not here: serving, records, anything async.

pub mod rules;

pub use rules::{Classification, Reason, RulesEngine, RulesError, RulesFile};
