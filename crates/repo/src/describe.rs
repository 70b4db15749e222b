//! Detecting what an import source is and reading the facts the manifest records.
//!
//! Sources: a `.gguf` file, an `.onnx` file, or a folder holding one GGUF, one ONNX graph (with an
//! optional tokenizer), or a Hugging Face checkpoint (`config.json` + safetensors, single or
//! sharded, + tokenizer files; sentence-transformers folders become embedding models).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use formats::gguf::GgufFile;
use formats::onnx::{OnnxModel, ValueType};
use formats::safetensors::{SafetensorsFile, ShardIndex};
use serde_json::Value as Json;

use crate::digests::walk;
use crate::error::RepoError;
use crate::manifest::{
    Architecture, EmbeddingSection, FileRole, Format, Kind, OnnxSection, TensorSpec,
    TokenizerSection,
};
use crate::tokenizer::TokenizerFacts;

/// Files a version folder owns; a source may not bring its own.
pub const RESERVED_FILES: [&str; 3] = [
    crate::manifest::MANIFEST_FILE,
    crate::digests::DIGESTS_FILE,
    crate::lineage::LINEAGE_FILE,
];

/// A file of the source and its place in the version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceEntry {
    /// Path inside the version folder (`/`-separated).
    pub relative: String,
    /// Where it is now.
    pub path: PathBuf,
    pub role: FileRole,
    pub bytes: u64,
}

/// Everything learned about a source before anything is copied.
#[derive(Debug, Clone, PartialEq)]
pub struct Description {
    pub kind: Kind,
    pub format: Format,
    pub display_name: Option<String>,
    pub parameter_count: u64,
    pub weights: Vec<String>,
    pub architecture: Option<Architecture>,
    pub tokenizer: Option<TokenizerSection>,
    pub embedding: Option<EmbeddingSection>,
    pub onnx: Option<OnnxSection>,
    pub files: Vec<SourceEntry>,
}

/// GGUF architectures that are text encoders rather than generators.
const EMBEDDING_ARCHITECTURES: &[&str] = &[
    "bert",
    "nomic-bert",
    "jina-bert-v2",
    "roberta",
    "xlm-roberta",
];
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
];

fn unsupported(path: &Path, reason: impl Into<String>) -> RepoError {
    RepoError::UnsupportedSource {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn bad_file(path: &Path, reason: impl ToString) -> RepoError {
    RepoError::BadModelFile {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn has_ext(name: &str, ext: &str) -> bool {
    Path::new(name)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case(ext))
}

/// Lists the files of a source: the file itself, or every non-hidden file below the folder
/// (symlinks followed, as in Hugging Face caches).
pub fn source_files(source: &Path) -> Result<Vec<SourceEntry>, RepoError> {
    let meta = std::fs::metadata(source).map_err(RepoError::io(source))?;
    let mut entries = Vec::new();
    if meta.is_file() {
        let name = source
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| unsupported(source, "it has no file name"))?;
        entries.push(SourceEntry {
            relative: name,
            path: source.to_path_buf(),
            role: FileRole::Other,
            bytes: meta.len(),
        });
    } else if meta.is_dir() {
        for entry in walk(source, true)? {
            if entry.relative.split('/').any(|part| part.starts_with('.')) {
                continue;
            }
            // A `rampart.toml` beside the model declares its pipeline; the import reads it and
            // writes the version's own manifest instead.
            if entry.relative == crate::manifest::MANIFEST_FILE {
                continue;
            }
            if !entry.regular {
                return Err(unsupported(&entry.path, "not a regular file"));
            }
            let bytes = std::fs::metadata(&entry.path)
                .map_err(RepoError::io(&entry.path))?
                .len();
            entries.push(SourceEntry {
                relative: entry.relative,
                path: entry.path,
                role: FileRole::Other,
                bytes,
            });
        }
    } else {
        return Err(unsupported(source, "not a file or folder"));
    }
    for e in &entries {
        crate::digests::check_relative_path(&e.relative)
            .map_err(|reason| unsupported(&e.path, reason.to_string()))?;
        if RESERVED_FILES.contains(&e.relative.as_str()) {
            return Err(unsupported(
                &e.path,
                format!(
                    "{} is written by rampart itself; remove it from the source",
                    e.relative
                ),
            ));
        }
    }
    if entries.is_empty() {
        return Err(unsupported(source, "the folder holds no files"));
    }
    Ok(entries)
}

/// Parses and compiles a rules file's text as the server will (the guard's
/// `guard::check_rules_file`) and returns its number of rules. The repository takes it from
/// its caller so that it (and the engine that reads it) builds without the guard; the error is
/// the guard's, whose message is shown.
pub type RulesCheck = fn(&str) -> Result<u64, Box<dyn std::error::Error + Send + Sync>>;

/// Detects the format and kind of `source` and reads its facts. `kind` overrides detection
/// (e.g. an ONNX graph that is an embedder).
pub fn describe(
    source: &Path,
    kind: Option<Kind>,
    rules_check: Option<RulesCheck>,
) -> Result<Description, RepoError> {
    let mut files = source_files(source)?;
    let names: Vec<&str> = files.iter().map(|f| f.relative.as_str()).collect();
    let of_ext = |ext: &str| names.iter().filter(|n| has_ext(n, ext)).count();
    let (ggufs, onnxs, safetensors) = (of_ext("gguf"), of_ext("onnx"), of_ext("safetensors"));
    let formats_present = [ggufs, onnxs, safetensors]
        .iter()
        .filter(|&&n| n > 0)
        .count();
    if formats_present > 1 {
        return Err(unsupported(
            source,
            "it mixes weight formats (GGUF, ONNX, safetensors); import each model separately",
        ));
    }
    let folder = source.is_dir();
    let base = if folder {
        source
    } else {
        source.parent().unwrap_or(Path::new("."))
    };
    let tomls = of_ext("toml");
    let mut description = if formats_present == 0 && (tomls > 0 || kind == Some(Kind::Rules)) {
        if tomls != 1 {
            return Err(unsupported(
                source,
                "a rules model is one .toml rules file; import one file at a time",
            ));
        }
        let file = names
            .iter()
            .find(|n| has_ext(n, "toml"))
            .map(|n| n.to_string());
        describe_rules(base, file.as_deref().unwrap_or_default(), kind, rules_check)?
    } else if ggufs > 0 {
        if ggufs > 1 {
            return Err(unsupported(
                source,
                "it holds several .gguf files; import one file at a time",
            ));
        }
        let weights = names
            .iter()
            .find(|n| has_ext(n, "gguf"))
            .map(|n| n.to_string());
        describe_gguf(base, weights.as_deref().unwrap_or_default(), kind)?
    } else if onnxs > 0 {
        if onnxs > 1 {
            return Err(unsupported(
                source,
                "it holds several .onnx files; import one graph at a time",
            ));
        }
        let weights = names
            .iter()
            .find(|n| has_ext(n, "onnx"))
            .map(|n| n.to_string());
        describe_onnx(base, weights.as_deref().unwrap_or_default(), folder, kind)?
    } else if safetensors > 0 {
        if !folder {
            return Err(unsupported(
                source,
                "a lone .safetensors file lacks config.json and a tokenizer; import its folder",
            ));
        }
        describe_safetensors(source, &names, kind)?
    } else {
        return Err(unsupported(
            source,
            "no model weights found (expected a .gguf, .onnx or .safetensors file, or a .toml rules file)",
        ));
    };
    for f in &mut files {
        let file_name = f.relative.rsplit('/').next().unwrap_or(&f.relative);
        f.role = if description.weights.contains(&f.relative) {
            FileRole::Weights
        } else if TOKENIZER_FILES.contains(&file_name) {
            FileRole::Tokenizer
        } else if has_ext(file_name, "json") {
            FileRole::Config
        } else {
            FileRole::Other
        };
    }
    description.files = files;
    Ok(description)
}

fn check_kind(
    requested: Option<Kind>,
    detected: Kind,
    format: Format,
    path: &Path,
) -> Result<Kind, RepoError> {
    let kind = requested.unwrap_or(detected);
    let allowed = match kind {
        Kind::Llm => matches!(format, Format::Gguf | Format::Safetensors),
        Kind::Embedding => format != Format::Toml,
        Kind::Onnx => format == Format::Onnx,
        Kind::Rules => format == Format::Toml,
    };
    if !allowed {
        return Err(unsupported(
            path,
            format!("a {format} model cannot be imported as kind {kind}"),
        ));
    }
    Ok(kind)
}

/// A rules file: compiled by the rules engine at import, so a file that would not serve is
/// refused here with what is wrong.
fn describe_rules(
    base: &Path,
    file: &str,
    kind: Option<Kind>,
    rules_check: Option<RulesCheck>,
) -> Result<Description, RepoError> {
    let path = base.join(file);
    let kind = check_kind(kind, Kind::Rules, Format::Toml, &path)?;
    let Some(check) = rules_check else {
        return Err(unsupported(
            &path,
            "this import cannot check rules files (nothing would prove the file serves)",
        ));
    };
    let text = std::fs::read_to_string(&path).map_err(RepoError::io(&path))?;
    let rule_count = check(&text).map_err(|e| bad_file(&path, e))?;
    Ok(Description {
        kind,
        format: Format::Toml,
        display_name: None,
        parameter_count: rule_count,
        weights: vec![file.to_string()],
        architecture: None,
        tokenizer: None,
        embedding: None,
        onnx: None,
        files: Vec::new(),
    })
}

fn describe_gguf(base: &Path, weights: &str, kind: Option<Kind>) -> Result<Description, RepoError> {
    let path = base.join(weights);
    let g = GgufFile::open(&path).map_err(|e| bad_file(&path, e))?;
    let meta = |e: formats::gguf::GgufError| bad_file(&path, e);
    let arch = g.architecture().map_err(meta)?.map(str::to_string);
    let detected = match &arch {
        Some(a) if EMBEDDING_ARCHITECTURES.contains(&a.as_str()) => Kind::Embedding,
        _ => Kind::Llm,
    };
    let kind = check_kind(kind, detected, Format::Gguf, &path)?;
    let tokenizer = TokenizerFacts::from_gguf(&g).map_err(|e| bad_file(&path, e))?;
    let mut tensor_types = BTreeMap::new();
    for t in &g.tensors {
        *tensor_types
            .entry(t.ggml_type.name().to_string())
            .or_insert(0u64) += 1;
    }
    let architecture = match &arch {
        None => None,
        Some(name) => Some(Architecture {
            name: name.clone(),
            block_count: g.arch_u64("block_count").map_err(meta)?,
            embedding_length: g.arch_u64("embedding_length").map_err(meta)?,
            feed_forward_length: g.arch_u64("feed_forward_length").map_err(meta)?,
            head_count: g.arch_u64("attention.head_count").map_err(meta)?,
            head_count_kv: match g.arch_u64("attention.head_count_kv").map_err(meta)? {
                Some(n) => Some(n),
                None => g.arch_u64("attention.head_count").map_err(meta)?,
            },
            context_length: g.arch_u64("context_length").map_err(meta)?,
            vocab_size: match g.arch_u64("vocab_size").map_err(meta)? {
                Some(n) => Some(n),
                None => tokenizer.as_ref().map(|t| t.vocab_size),
            },
            rope_freq_base: g.arch_f64("rope.freq_base").map_err(meta)?,
            norm_eps: match g
                .arch_f64("attention.layer_norm_rms_epsilon")
                .map_err(meta)?
            {
                Some(eps) => Some(eps),
                None => g.arch_f64("attention.layer_norm_epsilon").map_err(meta)?,
            },
            tied_embeddings: (kind == Kind::Llm).then(|| {
                g.tensor("output.weight").is_none() && g.tensor("token_embd.weight").is_some()
            }),
            tensor_types,
        }),
    };
    Ok(Description {
        kind,
        format: Format::Gguf,
        display_name: g.get_str("general.name").map_err(meta)?.map(str::to_string),
        parameter_count: g.parameter_count(),
        weights: vec![weights.to_string()],
        architecture,
        tokenizer: tokenizer.map(|t| t.section()),
        embedding: None,
        onnx: None,
        files: Vec::new(),
    })
}

fn tensor_spec(v: &formats::onnx::ValueInfo) -> TensorSpec {
    match &v.value_type {
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
    }
}

fn describe_onnx(
    base: &Path,
    weights: &str,
    folder: bool,
    kind: Option<Kind>,
) -> Result<Description, RepoError> {
    let path = base.join(weights);
    let m = OnnxModel::open(&path).map_err(|e| bad_file(&path, e))?;
    if m.external_data {
        return Err(unsupported(
            &path,
            "its weights live in external data files; re-export it with the weights inside the .onnx",
        ));
    }
    let kind = check_kind(kind, Kind::Onnx, Format::Onnx, &path)?;
    let tokenizer = if folder {
        TokenizerFacts::from_folder(base).map_err(|e| bad_file(&base.join("tokenizer.json"), e))?
    } else {
        None
    };
    let to_u64_map =
        |m: &BTreeMap<String, usize>| m.iter().map(|(k, &v)| (k.clone(), v as u64)).collect();
    let onnx = OnnxSection {
        ir_version: m.ir_version,
        opset: m.opset(),
        extra_opsets: m
            .opsets
            .iter()
            .filter(|(d, _)| d != "ai.onnx")
            .cloned()
            .collect(),
        producer: [m.producer_name.as_str(), m.producer_version.as_str()]
            .iter()
            .filter(|s| !s.is_empty())
            .copied()
            .collect::<Vec<_>>()
            .join(" "),
        inputs: m.inputs.iter().map(tensor_spec).collect(),
        outputs: m.outputs.iter().map(tensor_spec).collect(),
        initializer_types: to_u64_map(&m.initializer_types),
        op_types: to_u64_map(&m.op_types),
        metadata: m.metadata.clone(),
    };
    Ok(Description {
        kind,
        format: Format::Onnx,
        display_name: (!m.graph_name.is_empty()).then(|| m.graph_name.clone()),
        parameter_count: m.parameter_count,
        weights: vec![weights.to_string()],
        architecture: None,
        tokenizer: tokenizer.map(|t| t.section()),
        embedding: None,
        onnx: Some(onnx),
        files: Vec::new(),
    })
}

fn read_json(path: &Path) -> Result<Option<Json>, RepoError> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(RepoError::io(path))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| bad_file(path, e))
}

/// Integer-like dtypes in safetensors are buffers (position ids, masks), not weights.
fn is_weight_dtype(dtype: &str) -> bool {
    !matches!(
        dtype,
        "BOOL" | "I16" | "U16" | "I32" | "U32" | "I64" | "U64"
    )
}

fn describe_safetensors(
    dir: &Path,
    names: &[&str],
    kind: Option<Kind>,
) -> Result<Description, RepoError> {
    let index_name = "model.safetensors.index.json";
    let weights: Vec<String> = if names.contains(&index_name) {
        let index = ShardIndex::read(dir.join(index_name))
            .map_err(|e| bad_file(&dir.join(index_name), e))?;
        let shards: Vec<String> = index.shards().into_iter().map(str::to_string).collect();
        for shard in &shards {
            if !names.contains(&shard.as_str()) {
                return Err(unsupported(
                    dir,
                    format!("the shard index names {shard}, which is missing"),
                ));
            }
        }
        shards
    } else {
        let top: Vec<String> = names
            .iter()
            .filter(|n| has_ext(n, "safetensors") && !n.contains('/'))
            .map(|n| n.to_string())
            .collect();
        if top.len() != 1 {
            return Err(unsupported(
                dir,
                format!(
                    "found {} top-level .safetensors files and no {index_name}; expected one file or a sharded index",
                    top.len()
                ),
            ));
        }
        top
    };
    let mut parameter_count = 0u64;
    let mut tensor_types = BTreeMap::new();
    for w in &weights {
        let path = dir.join(w);
        let st = SafetensorsFile::open(&path).map_err(|e| bad_file(&path, e))?;
        for t in &st.tensors {
            if is_weight_dtype(&t.dtype) {
                parameter_count += t.n_elements;
            }
            *tensor_types.entry(t.dtype.clone()).or_insert(0u64) += 1;
        }
    }

    let config_path = dir.join("config.json");
    let config = read_json(&config_path)?
        .ok_or_else(|| unsupported(dir, "a safetensors checkpoint needs its config.json"))?;
    let get_u64 = |key: &str| config.get(key).and_then(Json::as_u64);
    let get_f64 = |key: &str| config.get(key).and_then(Json::as_f64);
    let model_type = config
        .get("model_type")
        .and_then(Json::as_str)
        .ok_or_else(|| bad_file(&config_path, "no \"model_type\""))?
        .to_string();
    let architectures: Vec<&str> = config
        .get("architectures")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    let generative = architectures.iter().any(|a| {
        a.ends_with("ForCausalLM")
            || a.ends_with("LMHeadModel")
            || a.ends_with("ForConditionalGeneration")
    });
    let sentence_transformers =
        names.contains(&"modules.json") || names.contains(&"sentence_bert_config.json");
    let detected = if generative {
        Kind::Llm
    } else if sentence_transformers || EMBEDDING_ARCHITECTURES.contains(&model_type.as_str()) {
        Kind::Embedding
    } else {
        match kind {
            Some(k) => k,
            None => {
                return Err(unsupported(
                    dir,
                    format!("cannot tell whether {model_type} ({architectures:?}) is an LLM or an embedder; pass --kind"),
                ))
            }
        }
    };
    let kind = check_kind(kind, detected, Format::Safetensors, dir)?;
    let tokenizer =
        TokenizerFacts::from_folder(dir).map_err(|e| bad_file(&dir.join("tokenizer.json"), e))?;
    let head_count = get_u64("num_attention_heads");
    let architecture = Architecture {
        name: model_type,
        block_count: get_u64("num_hidden_layers"),
        embedding_length: get_u64("hidden_size"),
        feed_forward_length: get_u64("intermediate_size"),
        head_count,
        head_count_kv: get_u64("num_key_value_heads").or(head_count),
        context_length: get_u64("max_position_embeddings"),
        vocab_size: get_u64("vocab_size"),
        rope_freq_base: get_f64("rope_theta"),
        norm_eps: get_f64("rms_norm_eps").or_else(|| get_f64("layer_norm_eps")),
        tied_embeddings: config.get("tie_word_embeddings").and_then(Json::as_bool),
        tensor_types,
    };
    let embedding = if kind == Kind::Embedding {
        Some(embedding_section(dir, &architecture)?)
    } else {
        None
    };
    Ok(Description {
        kind,
        format: Format::Safetensors,
        display_name: config
            .get("_name_or_path")
            .and_then(Json::as_str)
            .filter(|s| !s.is_empty())
            .map(str::to_string),
        parameter_count,
        weights,
        architecture: Some(architecture),
        tokenizer: tokenizer.map(|t| t.section()),
        embedding,
        onnx: None,
        files: Vec::new(),
    })
}

/// Pooling and normalization from a sentence-transformers folder.
fn embedding_section(
    dir: &Path,
    architecture: &Architecture,
) -> Result<EmbeddingSection, RepoError> {
    let modules = read_json(&dir.join("modules.json"))?;
    let module_types: Vec<String> = modules
        .as_ref()
        .and_then(Json::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|m| m.get("type").and_then(Json::as_str).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let pooling_dir = modules
        .as_ref()
        .and_then(Json::as_array)
        .and_then(|list| {
            list.iter()
                .find(|m| {
                    m.get("type")
                        .and_then(Json::as_str)
                        .is_some_and(|t| t.ends_with(".Pooling"))
                })
                .and_then(|m| m.get("path").and_then(Json::as_str))
                .map(str::to_string)
        })
        .unwrap_or_else(|| "1_Pooling".to_string());
    let pooling_config = read_json(&dir.join(&pooling_dir).join("config.json"))?;
    let pooling = pooling_config.as_ref().and_then(|p| {
        [
            ("pooling_mode_cls_token", "cls"),
            ("pooling_mode_mean_tokens", "mean"),
            ("pooling_mode_max_tokens", "max"),
            ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
            ("pooling_mode_weightedmean_tokens", "weightedmean"),
            ("pooling_mode_lasttoken", "lasttoken"),
        ]
        .iter()
        .find(|(key, _)| p.get(key).and_then(Json::as_bool) == Some(true))
        .map(|(_, mode)| mode.to_string())
    });
    let dimension = pooling_config
        .as_ref()
        .and_then(|p| p.get("word_embedding_dimension"))
        .and_then(Json::as_u64)
        .or(architecture.embedding_length);
    let max_seq_length = read_json(&dir.join("sentence_bert_config.json"))?
        .and_then(|c| c.get("max_seq_length").and_then(Json::as_u64));
    Ok(EmbeddingSection {
        dimension,
        pooling,
        normalize: module_types.iter().any(|t| t.ends_with(".Normalize")),
        max_seq_length,
    })
}

/// The full tokenizer of an imported version (for `diff`), read from its GGUF or folder.
pub fn version_tokenizer(
    dir: &Path,
    format: Format,
    weights: &[String],
) -> Result<Option<TokenizerFacts>, RepoError> {
    match format {
        Format::Gguf => {
            let Some(w) = weights.first() else {
                return Ok(None);
            };
            let path = dir.join(w);
            let g = GgufFile::open(&path).map_err(|e| bad_file(&path, e))?;
            TokenizerFacts::from_gguf(&g).map_err(|e| bad_file(&path, e))
        }
        Format::Onnx | Format::Safetensors => {
            TokenizerFacts::from_folder(dir).map_err(|e| bad_file(&dir.join("tokenizer.json"), e))
        }
        // Rules have no tokenizer.
        Format::Toml => Ok(None),
    }
}
