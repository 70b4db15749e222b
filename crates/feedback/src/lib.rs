//! The feedback loop: what the people who use the answers say about them.
//!
//! Every response is indexed as it is served (the [`sink::IndexSink`] on the record bus, off the
//! request path): its ids (request, audit, response), model, version, the class it gave and its
//! confidence, and its input and output for the retention window. `POST /v1/feedback` joins a
//! rating, a label correction or a text correction to that response ([`store::Store::submit`]),
//! idempotent per (response, item, rater), a signed link being one rater per response. From the
//! store come the per-class error rates with their Wilson bounds ([`quality`]), the calibration
//! table, and the datasets a fine-tuning job takes ([`export`]). [`link`] signs the
//! per-response tokens that let an end user's client rate without an API key.

pub mod class;
pub mod export;
pub mod link;
pub mod quality;
pub mod sink;
pub mod store;
pub mod submission;
pub mod testing;

pub use class::{ClassRule, ClassRuleError};
pub use store::{Feedback, Rater, Response, Store, Submitted};
pub use submission::{Correction, Rating, Submission, Target};

/// What went wrong in the feedback store.
#[derive(Debug, thiserror::Error)]
pub enum FeedbackError {
    #[error("feedback store: {0}")]
    Store(String),
    /// A key's rater named like a link (`link`, `link:…`): those names are the links'.
    #[error("the rater name {0:?} is reserved for signed feedback links")]
    ReservedRater(String),
    #[error("feedback export: {0}")]
    Export(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl From<rusqlite::Error> for FeedbackError {
    fn from(e: rusqlite::Error) -> Self {
        FeedbackError::Store(e.to_string())
    }
}

impl From<postgres::Error> for FeedbackError {
    fn from(e: postgres::Error) -> Self {
        FeedbackError::Store(format!("PostgreSQL: {e}"))
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
