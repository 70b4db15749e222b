//! The WORM audit log: every request and every admin or controller action, kept so that years
//! later it can be shown what the model was given, which version answered, what it said and who
//! asked, and proven that nothing was changed or removed.
//!
//! - [`entry`]: the entry (the request's record, full input and output, or an action) and the
//!   redaction policy applied before anything is written;
//! - [`log`]: the local log: append-only segments with group commit (one fsync per batch), the
//!   RFC 6962 Merkle tree ([`merkle`]), Ed25519-signed checkpoints ([`checkpoint`]), sealing to
//!   Parquet ([`seal`]), recovery after a crash, and the exact-key lookups (audit id, user id);
//! - [`read`]: the verifier and the read-only lookups of the CLI, on a local directory or on
//!   what was shipped to S3;
//! - [`ship`]: sealed files and their manifests to S3 with Object Lock ([`s3`], a small SigV4
//!   client), each verified remotely before it counts as shipped;
//! - [`sink`]: the record bus's audit sink (lossless and acknowledged in `fail_closed`) and the
//!   service task (checkpoints every second, sealing, shipping, metrics).
//!
//! Not here: HTTP routes and scopes (the server), what a record holds (crate `record`).

pub mod checkpoint;
pub mod config;
pub mod entry;
pub mod log;
pub mod merkle;
pub mod read;
pub mod s3;
pub mod seal;
pub mod ship;
pub mod sink;
pub mod testing_s3;

use std::path::Path;

pub use config::{AuditConfig, Mode};
pub use entry::{Action, AuditEntry, EntryKind, RedactAction, RedactionPolicy};
pub use log::{AuditLog, LogOptions};
pub use sink::{AuditSink, Service};

/// What went wrong in the audit log.
#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// The log cannot persist: requests in `fail_closed` are refused until it can.
    #[error("the audit log cannot persist: {0}")]
    Unavailable(String),
    /// The log does not verify.
    #[error("the audit log does not verify: {0}")]
    Tampered(String),
    #[error("the audit log is damaged: {0}")]
    Corrupt(String),
    #[error("audit key: {0}")]
    Key(String),
    #[error("parquet: {0}")]
    Parquet(String),
    #[error("an audit entry of {0} bytes exceeds the 64 MiB limit")]
    TooLarge(usize),
    #[error("{0}")]
    NotFound(String),
    #[error("s3: {0}")]
    S3(#[from] s3::S3Error),
    #[error("audit configuration: {0}")]
    Config(String),
}

impl AuditError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
