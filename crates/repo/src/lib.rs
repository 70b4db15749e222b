//! Rampart's model repository: a folder of models, each with immutable, digest-checked versions.
//!
//! ```text
//! models/
//!   smollm2-135m/
//!     1.0.0/
//!       rampart.toml   manifest: kind, format, architecture, tokenizer, ONNX signature, ...
//!       DIGESTS        sha256 of every file + the version digest
//!       LINEAGE.json   source, import time, rampart build, user-given commit/dataset, host snapshot
//!       SmolLM2-135M-Instruct.Q4_1.gguf
//! ```
//!
//! This crate imports models ([`Repository::import`]), lists and resolves them (`name@version`,
//! or `name` to the version users get: its `stable` alias, [`aliases`]), verifies digests before anything is served ([`Repository::load`]) and
//! compares versions ([`diff`]), tokenizers included. It reads model files through `formats` and
//! knows nothing of inference or serving. Progress reporting is a trait ([`Progress`]) so that the
//! command line can draw bars while servers stay quiet.

pub mod aliases;
pub mod card;
pub mod describe;
pub mod diff;
pub mod digests;
pub mod error;
pub mod lineage;
pub mod manifest;
pub mod model_ref;
pub mod pipeline;
pub mod progress;
pub mod repository;
pub mod tokenizer;

pub use aliases::{AliasSetting, Aliases, Choice};
pub use card::ModelCard;
pub use describe::RulesCheck;
pub use digests::{Digests, VerifyReport};
pub use error::RepoError;
pub use lineage::{BuildInfo, Derivation, Lineage};
pub use manifest::{Format, Kind, Manifest};
pub use model_ref::ModelRef;
pub use pipeline::{Declaration, Pipeline, PipelineError};
pub use progress::{NoProgress, Progress};
pub use repository::{ImportOptions, LoadedVersion, ModelVersion, Repository};
