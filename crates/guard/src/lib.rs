//! Pure guard logic, no I/O and no server types.
//!
//! - [`rules`]: the rules engine, a declarative classifier (labels, regular expressions and
//!   weighted keywords, a threshold, a default) that answers when a model cannot, and says why:
//!   every answer carries the spans of the input that decided it.
//! - [`normalize`], [`injection`], [`classifier`]: the prompt-injection guard, tiers cheapest
//!   first (normalise and decode, control-token texts, injection rules, the classifier head on
//!   sentence embeddings), each verdict with its reason codes.
//!
//! Not here: serving, records, anything async; the classifier's embedder is the caller's.

pub mod classifier;
pub mod injection;
pub mod normalize;
pub mod rules;

pub use classifier::{
    Classifier, ClassifyError, Embed, EmbedError, Head, HeadError, HeadFormatError,
};
pub use injection::{
    Channel, Decision, Finding, Guard, Input, Mode, OnError, OverBudget, Policy, SpecialTokens,
    Thresholds, Verdict, SEED_RULES,
};
pub use rules::{
    check_rules_file, Classification, LabelScore, Reason, RulesEngine, RulesError, RulesFile,
    RulesFileError,
};
