//! `rampart.toml`: the manifest of one model version, written at import and read by the server.
//!
//! It records every fact serving needs without opening the weights: what kind of model it is,
//! which files the backend loads, the architecture's shape, the tokenizer's special tokens, the
//! ONNX signature. It is part of the version's digests, so it is as immutable as the weights.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use formats::onnx::Dim;
use serde::{Deserialize, Serialize};

use crate::error::RepoError;

/// File name of the manifest in a version folder.
pub const MANIFEST_FILE: &str = "rampart.toml";
/// The manifest schema this build writes and reads.
pub const MANIFEST_VERSION: u32 = 1;

/// What a model does, which decides the backend that serves it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A generative language model (the LLM engine).
    Llm,
    /// A text embedder (BERT-style encoder with pooling).
    Embedding,
    /// A classic tensor model (classifier, detector, ...) run as an ONNX graph.
    Onnx,
    /// A rules file for the rules engine (labels of weighted keywords and patterns).
    Rules,
}

impl Kind {
    pub const ALL: [Kind; 4] = [Kind::Llm, Kind::Embedding, Kind::Onnx, Kind::Rules];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Llm => "llm",
            Kind::Embedding => "embedding",
            Kind::Onnx => "onnx",
            Kind::Rules => "rules",
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A kind name that is none of [`Kind::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown kind {name:?} (expected llm, embedding, onnx or rules)")]
pub struct UnknownKind {
    pub name: String,
}

impl std::str::FromStr for Kind {
    type Err = UnknownKind;
    fn from_str(s: &str) -> Result<Self, UnknownKind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| UnknownKind {
                name: s.to_string(),
            })
    }
}

/// The file format of the weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Gguf,
    Safetensors,
    Onnx,
    /// A rules file.
    Toml,
}

impl Format {
    pub fn as_str(self) -> &'static str {
        match self {
            Format::Gguf => "gguf",
            Format::Safetensors => "safetensors",
            Format::Onnx => "onnx",
            Format::Toml => "toml",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// Schema version of this file.
    pub manifest_version: u32,
    pub model: ModelSection,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub architecture: Option<Architecture>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSection>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<EmbeddingSection>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub onnx: Option<OnnxSection>,
    /// The declared serving pipeline (pre/post-processing, batching).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<crate::pipeline::Pipeline>,
    /// Every model file of the version (the manifest, lineage and digests excepted).
    pub files: Vec<FileEntry>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    pub name: String,
    pub version: String,
    pub kind: Kind,
    pub format: Format,
    /// The name the model gives itself (`general.name`, `_name_or_path`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    /// Number of weights (tied embeddings counted once).
    pub parameter_count: u64,
    /// Bytes of all model files.
    pub size_bytes: u64,
    /// The files a backend loads, in load order (one GGUF, the safetensors shards, one ONNX).
    pub weights: Vec<String>,
}

/// The network's shape, from GGUF metadata or `config.json`. GGUF key names are used for both.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Architecture {
    /// `llama`, `qwen2`, `bert`, ...
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_count: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding_length: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub feed_forward_length: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_count: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_count_kv: Option<u64>,
    /// Longest sequence the model was trained for (tokens).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab_size: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_freq_base: Option<f64>,
    /// RMSNorm or LayerNorm epsilon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub norm_eps: Option<f64>,
    /// True when the output projection reuses the token embedding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tied_embeddings: Option<bool>,
    /// Tensor element type → number of tensors of that type.
    pub tensor_types: BTreeMap<String, u64>,
}

/// A special token: its id and text.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecialToken {
    pub id: u32,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerSection {
    /// Where the tokenizer lives: `gguf` (metadata of the weights) or a file name
    /// (`tokenizer.json`).
    pub source: String,
    /// Tokenizer model: `gpt2` (byte-level BPE), `llama` (SentencePiece), `bert` (WordPiece),
    /// or the `tokenizer.json` model type in lowercase (`bpe`, `wordpiece`, `unigram`).
    pub kind: String,
    /// Pre-tokenizer variant (`tokenizer.ggml.pre`), when named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pre: Option<String>,
    pub vocab_size: u64,
    /// Number of BPE merges (0 for tokenizers without merges).
    pub merges: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_bos: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub add_eos: Option<bool>,
    /// Whether a chat template ships with the model.
    pub chat_template: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_sha256: Option<String>,
    /// Role (`bos`, `eos`, `unk`, `pad`, `sep`, `cls`, `mask`, `eot`, ...) → token.
    #[serde(default)]
    pub special: BTreeMap<String, SpecialToken>,
}

/// How an embedder turns token states into one vector (sentence-transformers configuration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingSection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimension: Option<u64>,
    /// `mean`, `cls`, `max`, `lasttoken`, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pooling: Option<String>,
    /// L2-normalize the pooled vector.
    pub normalize: bool,
    /// Inputs are truncated to this many tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_seq_length: Option<u64>,
}

/// A graph input or output of an ONNX model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    pub name: String,
    /// Element type (`float32`, `int64`, ...) for tensors; the full type (`sequence<...>`,
    /// `map<...>`) otherwise.
    pub dtype: String,
    /// Dimensions: numbers, or names/`"?"` for dynamic ones. Absent when the rank is undeclared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shape: Option<Vec<Dim>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OnnxSection {
    pub ir_version: i64,
    /// Version of the default operator set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opset: Option<i64>,
    /// Other operator-set domains and versions (`com.microsoft` = 1, ...).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extra_opsets: BTreeMap<String, i64>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub producer: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    /// Initializer element type → number of initializers.
    pub initializer_types: BTreeMap<String, u64>,
    /// Operator → number of nodes, which tells whether a runtime supports the graph.
    pub op_types: BTreeMap<String, u64>,
    /// The model's `metadata_props` (labels often live here, e.g. `character`).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

/// The role of a file in a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FileRole {
    Weights,
    Tokenizer,
    Config,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub path: String,
    pub role: FileRole,
    pub bytes: u64,
}

impl Manifest {
    /// Reads and validates `rampart.toml` in `dir`.
    pub fn read(dir: &Path) -> Result<Self, RepoError> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read_to_string(&path).map_err(RepoError::io(&path))?;
        let bad = |reason: String| RepoError::BadManifest {
            path: path.clone(),
            reason,
        };
        let manifest: Manifest = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
        if manifest.manifest_version != MANIFEST_VERSION {
            return Err(bad(format!(
                "manifest_version {} is not supported by this build (supports {MANIFEST_VERSION})",
                manifest.manifest_version
            )));
        }
        for weight in &manifest.model.weights {
            if !manifest.files.iter().any(|f| &f.path == weight) {
                return Err(bad(format!(
                    "weights file {weight:?} is not listed in [[files]]"
                )));
            }
        }
        Ok(manifest)
    }

    /// The manifest as TOML text.
    pub fn to_toml(&self) -> Result<String, RepoError> {
        toml::to_string_pretty(self).map_err(|e| RepoError::BadManifest {
            path: MANIFEST_FILE.into(),
            reason: e.to_string(),
        })
    }

    /// Writes `rampart.toml` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), RepoError> {
        let path = dir.join(MANIFEST_FILE);
        let text = format!(
            "# Rampart model manifest, written by `rampart model import`. Part of the version's digests:\n\
             # do not edit; import a new version instead.\n{}",
            self.to_toml()?
        );
        std::fs::write(&path, text).map_err(RepoError::io(&path))
    }
}
