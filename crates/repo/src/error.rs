//! The repository's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the repository, with enough context to act on.
#[derive(Debug, thiserror::Error)]
pub enum RepoError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid model name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },
    #[error("invalid version {version:?}: {reason} (versions are semver, e.g. 1.0.0)")]
    InvalidVersion { version: String, reason: String },
    #[error("invalid model reference {0:?}: expected NAME or NAME@VERSION")]
    InvalidRef(String),
    #[error("model {name:?} is not in the repository {repo} (models: {available})")]
    ModelNotFound {
        name: String,
        repo: PathBuf,
        available: String,
    },
    #[error("model {name:?} has no version {version} (versions: {available})")]
    VersionNotFound {
        name: String,
        version: String,
        available: String,
    },
    #[error("model {name:?} has versions {available} and no stable version: name one ({name}@VERSION), or choose what users get with `rampart model promote {name}@VERSION`")]
    NoStable { name: String, available: String },
    #[error("the stable version of {name:?} is {version}, which {problem}: promote a version that is there (`rampart model promote {name}@VERSION`)")]
    StableBroken {
        name: String,
        version: String,
        problem: String,
    },
    #[error("{name}@{version} is the stable version (what users get): promote another version first (`rampart model promote {name}@VERSION`)")]
    StableInUse { name: String, version: String },
    #[error("{name}@{version} already exists in {path}; versions are immutable: import under a new version")]
    VersionExists {
        name: String,
        version: String,
        path: PathBuf,
    },
    #[error("cannot import {path}: {reason}")]
    UnsupportedSource { path: PathBuf, reason: String },
    #[error("cannot read model file {path}: {reason}")]
    BadModelFile { path: PathBuf, reason: String },
    #[error("invalid manifest {path}: {reason}")]
    BadManifest { path: PathBuf, reason: String },
    /// `problem` is not the `source`: the message already says it, and a chain printer
    /// (anyhow's `{:#}`) would say it twice.
    #[error("invalid DIGESTS file {path}: {problem}")]
    BadDigests {
        path: PathBuf,
        problem: crate::digests::DigestsError,
    },
    #[error("{name}@{version} failed verification: {summary}")]
    VerificationFailed {
        name: String,
        version: String,
        summary: String,
    },
    #[error("--link cannot hard-link {path} into the repository ({source}); import without --link to copy")]
    HardLink {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl RepoError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> RepoError {
        let path = path.into();
        move |source| RepoError::Io { path, source }
    }
}
