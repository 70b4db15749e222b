//! Sentence embeddings from BERT encoders (sentence-transformers folders such as
//! all-MiniLM-L6-v2) on the CPU kernels.
//!
//! A folder holds `config.json` (a `BertModel`), `model.safetensors` (f32; names with or without a
//! `bert.` prefix), `tokenizer.json` (WordPiece), and the sentence-transformers module files:
//! `modules.json` (a `Normalize` module turns L2 normalization on), the pooling module's
//! `config.json` (mean or CLS pooling; mean when absent) and `sentence_bert_config.json`
//! (`max_seq_length`).
//!
//! A batch is packed, not padded: the tokens of all its inputs are rows of one matrix, the dense
//! layers run over all of them at once, and attention runs within each input's own rows
//! ([`kernels::ops::attention_within_sequences`]). That is what a padded batch with an attention
//! mask computes, without the padding rows, so an input's embedding does not depend on what it is
//! batched with.
//!
//! Limits: an input longer than [`Embedder::max_seq_len`] tokens is an error unless
//! [`EmbedOptions::truncate`] is set (OpenAI rejects over-long inputs rather than cut them).

use std::ops::Range;
use std::path::Path;
use std::sync::Mutex;

use formats::safetensors::{SafetensorsFile, TensorInfo};
use kernels::backend::physical_cores;
use kernels::gemm::{gemm, Activation, Epilogue, PackedMatrix};
use kernels::ops::{attention_within_sequences, layer_norm_rows};
use kernels::{Backend, CpuBackend};
use serde::Deserialize;

use crate::error::EngineError;

/// Tokens (summed over inputs) one forward pass takes at most, by default.
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 8192;

/// The `config.json` fields the encoder reads.
#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab_size")]
    pub type_vocab_size: usize,
    #[serde(default = "default_layer_norm_eps")]
    pub layer_norm_eps: f64,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub position_embedding_type: Option<String>,
}

fn default_type_vocab_size() -> usize {
    2
}
fn default_layer_norm_eps() -> f64 {
    1e-12
}
fn default_hidden_act() -> String {
    "gelu".to_string()
}

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean of the input's token vectors.
    Mean,
    /// The first token's (`[CLS]`) vector.
    Cls,
}

/// Settings of an [`Embedder`].
#[derive(Debug, Clone)]
pub struct EmbedderOptions {
    /// Compute threads (the caller's thread included).
    pub threads: usize,
    /// Tokens one forward pass takes at most (inputs are batched up to it).
    pub max_batch_tokens: usize,
}

impl Default for EmbedderOptions {
    fn default() -> Self {
        Self {
            threads: physical_cores(),
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
        }
    }
}

/// Per-call choices.
#[derive(Debug, Clone, Copy, Default)]
pub struct EmbedOptions {
    /// Cut over-long inputs to `max_seq_len` tokens (keeping the final `[SEP]`) instead of
    /// failing.
    pub truncate: bool,
    /// Keep only the first `dimensions` components, then L2-normalize again (Matryoshka
    /// truncation, OpenAI's `dimensions`). `None`: the full vector.
    pub dimensions: Option<usize>,
}

/// A matrix or vector of the checkpoint: where its f32 bytes lie in the mapped file.
#[derive(Debug, Clone)]
struct Tensor {
    range: Range<usize>,
}

/// A dense layer: `y = W·x + b`, `W` stored `out × in` (PyTorch's `nn.Linear`), packed at load
/// for [`kernels::gemm`].
#[derive(Debug)]
struct Linear {
    weight: PackedMatrix,
    bias: Vec<f32>,
}

#[derive(Debug)]
struct LayerNormWeights {
    weight: Vec<f32>,
    bias: Vec<f32>,
}

#[derive(Debug)]
struct EncoderLayer {
    /// The query, key and value projections as one `3h × h` matrix: each output row holds the
    /// three vectors side by side, as [`attention_within_sequences`] reads them.
    query_key_value: Linear,
    attention_output: Linear,
    attention_norm: LayerNormWeights,
    intermediate: Linear,
    output: Linear,
    output_norm: LayerNormWeights,
}

/// The activations of one forward pass (`n` token rows each), kept between calls.
#[derive(Debug, Default)]
struct Activations {
    embedded: Vec<f32>,
    hidden: Vec<f32>,
    qkv: Vec<f32>,
    context: Vec<f32>,
    projected: Vec<f32>,
    intermediate: Vec<f32>,
}

/// A loaded sentence-embedding model.
pub struct Embedder {
    config: BertConfig,
    file: SafetensorsFile,
    word_embeddings: Tensor,
    position_embeddings: Vec<f32>,
    token_type_embedding: Vec<f32>,
    embedding_norm: LayerNormWeights,
    layers: Vec<EncoderLayer>,
    tokenizer: tokenizers::Tokenizer,
    sep_token: Option<u32>,
    pooling: Pooling,
    normalize: bool,
    max_seq_len: usize,
    max_batch_tokens: usize,
    backend: CpuBackend,
    /// Buffers for up to `max_batch_tokens` rows, reused by one call at a time.
    activations: Mutex<Activations>,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Embedder")
            .field("path", &self.file.path())
            .field("layers", &self.layers.len())
            .field("dimensions", &self.config.hidden_size)
            .field("pooling", &self.pooling)
            .field("normalize", &self.normalize)
            .field("max_seq_len", &self.max_seq_len)
            .finish()
    }
}

fn load_error(path: &Path, reason: impl std::fmt::Display) -> EngineError {
    EngineError::Load(format!("{}: {reason}", path.display()))
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, EngineError> {
    let text = std::fs::read_to_string(path).map_err(|e| load_error(path, e))?;
    serde_json::from_str(&text).map_err(|e| load_error(path, e))
}

#[derive(Debug, Deserialize)]
struct Module {
    #[serde(default)]
    path: String,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Debug, Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

#[derive(Debug, Deserialize)]
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

/// The pooling, normalization and the folder's `max_seq_length` from the sentence-transformers
/// module files (mean pooling, no normalization, no limit when they are absent).
fn read_modules(dir: &Path) -> Result<(Pooling, bool, Option<usize>), EngineError> {
    let mut pooling = Pooling::Mean;
    let mut normalize = false;
    let modules_path = dir.join("modules.json");
    if modules_path.is_file() {
        let modules: Vec<Module> = read_json(&modules_path)?;
        for module in &modules {
            if module.kind.ends_with(".Normalize") {
                normalize = true;
            } else if module.kind.ends_with(".Pooling") {
                let path = dir.join(&module.path).join("config.json");
                let config: PoolingConfig = read_json(&path)?;
                pooling = match (
                    config.pooling_mode_cls_token,
                    config.pooling_mode_mean_tokens,
                    config.pooling_mode_max_tokens,
                    config.pooling_mode_mean_sqrt_len_tokens,
                ) {
                    (true, false, false, false) => Pooling::Cls,
                    (false, true, false, false) => Pooling::Mean,
                    _ => {
                        return Err(load_error(
                            &path,
                            "only one of mean or CLS pooling is supported",
                        ))
                    }
                };
            } else if !module.kind.ends_with(".Transformer") {
                return Err(load_error(
                    &modules_path,
                    format!("module {} is not supported", module.kind),
                ));
            }
        }
    }
    let st_path = dir.join("sentence_bert_config.json");
    let max_seq_length = if st_path.is_file() {
        read_json::<SentenceBertConfig>(&st_path)?.max_seq_length
    } else {
        None
    };
    Ok((pooling, normalize, max_seq_length))
}

impl Embedder {
    /// Loads a folder with the default options.
    pub fn load(dir: &Path) -> Result<Self, EngineError> {
        Self::load_with(dir, &EmbedderOptions::default())
    }

    pub fn load_with(dir: &Path, options: &EmbedderOptions) -> Result<Self, EngineError> {
        let config_path = dir.join("config.json");
        let config: BertConfig = read_json(&config_path)?;
        if let Some(class) = config.architectures.iter().find(|a| !a.starts_with("Bert")) {
            return Err(EngineError::UnsupportedArchitecture(class.clone()));
        }
        if config.hidden_act != "gelu" {
            return Err(load_error(
                &config_path,
                format!(
                    "hidden_act {:?} is not supported (only \"gelu\")",
                    config.hidden_act
                ),
            ));
        }
        if config
            .position_embedding_type
            .as_deref()
            .is_some_and(|p| p != "absolute")
        {
            return Err(load_error(
                &config_path,
                "only absolute position embeddings are supported",
            ));
        }
        if config.num_attention_heads == 0
            || !config
                .hidden_size
                .is_multiple_of(config.num_attention_heads)
        {
            return Err(load_error(
                &config_path,
                "hidden_size must be a multiple of num_attention_heads",
            ));
        }
        let weights_path = dir.join("model.safetensors");
        let file = SafetensorsFile::open(&weights_path)
            .map_err(|e| load_error(&weights_path, e.to_string()))?;
        let prefix = if file
            .tensor("bert.embeddings.word_embeddings.weight")
            .is_some()
        {
            "bert."
        } else {
            ""
        };
        let h = config.hidden_size;
        let find = |name: &str, shape: &[usize]| -> Result<Tensor, EngineError> {
            let full = format!("{prefix}{name}");
            let info: &TensorInfo = file.tensor(&full).ok_or_else(|| EngineError::Tensor {
                name: full.clone(),
                reason: format!("missing from {}", weights_path.display()),
            })?;
            if info.dtype != "F32" {
                return Err(EngineError::Tensor {
                    name: full,
                    reason: format!("dtype {} is not supported (only F32)", info.dtype),
                });
            }
            let got: Vec<usize> = info.shape.iter().map(|&d| d as usize).collect();
            if got != shape {
                return Err(EngineError::Tensor {
                    name: full,
                    reason: format!("shape {got:?}, expected {shape:?}"),
                });
            }
            let range = file.tensor_range(info);
            if range.start % 4 != 0 {
                return Err(EngineError::Tensor {
                    name: full,
                    reason: "f32 data not 4-byte aligned in the file".into(),
                });
            }
            Ok(Tensor { range })
        };
        let floats = |t: &Tensor| -> Vec<f32> { f32s(&file.bytes()[t.range.clone()]) };
        let vector = |name: &str, n: usize| -> Result<Vec<f32>, EngineError> {
            Ok(floats(&find(name, &[n])?))
        };
        // One or more `nn.Linear`s of the same input width, stacked into one packed matrix.
        let linear = |names: &[&str], out: usize, inp: usize| -> Result<Linear, EngineError> {
            let mut weights = Vec::with_capacity(names.len());
            let mut bias = Vec::with_capacity(names.len() * out);
            for name in names {
                let w = find(&format!("{name}.weight"), &[out, inp])?;
                weights.push(f32s(&file.bytes()[w.range]));
                bias.extend(vector(&format!("{name}.bias"), out)?);
            }
            let parts: Vec<&[f32]> = weights.iter().map(Vec::as_slice).collect();
            Ok(Linear {
                weight: PackedMatrix::pack_stacked(&parts, inp),
                bias,
            })
        };
        let norm = |name: &str| -> Result<LayerNormWeights, EngineError> {
            Ok(LayerNormWeights {
                weight: vector(&format!("{name}.weight"), h)?,
                bias: vector(&format!("{name}.bias"), h)?,
            })
        };
        let word_embeddings = find("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position_embeddings = floats(&find(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?);
        let token_types = floats(&find(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?);
        // Every input is one segment: token type 0.
        let token_type_embedding = token_types[..h].to_vec();
        let embedding_norm = norm("embeddings.LayerNorm")?;
        let ffn = config.intermediate_size;
        let layers = (0..config.num_hidden_layers)
            .map(|i| {
                let l = format!("encoder.layer.{i}");
                Ok(EncoderLayer {
                    query_key_value: linear(
                        &[
                            &format!("{l}.attention.self.query"),
                            &format!("{l}.attention.self.key"),
                            &format!("{l}.attention.self.value"),
                        ],
                        h,
                        h,
                    )?,
                    attention_output: linear(&[&format!("{l}.attention.output.dense")], h, h)?,
                    attention_norm: norm(&format!("{l}.attention.output.LayerNorm"))?,
                    intermediate: linear(&[&format!("{l}.intermediate.dense")], ffn, h)?,
                    output: linear(&[&format!("{l}.output.dense")], h, ffn)?,
                    output_norm: norm(&format!("{l}.output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;

        let tokenizer_path = dir.join("tokenizer.json");
        let mut tokenizer = tokenizers::Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| load_error(&tokenizer_path, e))?;
        let tokenizer_limit = tokenizer.get_truncation().map(|t| t.max_length);
        tokenizer
            .with_truncation(None)
            .map_err(|e| load_error(&tokenizer_path, e))?;
        tokenizer.with_padding(None);
        // Client text never makes special tokens: a `[CLS]` or `[SEP]` written in an input is
        // text (split like any word); only the post-processor adds the real ones.
        tokenizer.set_encode_special_tokens(true);
        let sep_token = tokenizer.token_to_id("[SEP]");

        let (pooling, normalize, folder_limit) = read_modules(dir)?;
        let max_seq_len = folder_limit
            .or(tokenizer_limit)
            .unwrap_or(config.max_position_embeddings)
            .min(config.max_position_embeddings);
        Ok(Self {
            config,
            file,
            word_embeddings,
            position_embeddings,
            token_type_embedding,
            embedding_norm,
            layers,
            tokenizer,
            sep_token,
            pooling,
            normalize,
            max_seq_len,
            max_batch_tokens: options.max_batch_tokens.max(1),
            backend: CpuBackend::new(options.threads.max(1)),
            activations: Mutex::new(Activations::default()),
        })
    }

    /// The length of an embedding (the encoder's hidden size).
    pub fn dimensions(&self) -> usize {
        self.config.hidden_size
    }

    /// Most tokens (special tokens included) of one input.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    pub fn pooling(&self) -> Pooling {
        self.pooling
    }

    /// Whether embeddings are L2-normalized.
    pub fn normalizes(&self) -> bool {
        self.normalize
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// The compute backend, in words.
    pub fn describe_backend(&self) -> String {
        self.backend.describe()
    }

    /// Token ids of a text, with the `[CLS]`/`[SEP]` the tokenizer adds (special-token texts
    /// inside `text` are plain text).
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| EngineError::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Embeddings of texts, in order, with the default options.
    pub fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EngineError> {
        let ids = texts
            .iter()
            .map(|t| self.tokenize(t))
            .collect::<Result<Vec<_>, _>>()?;
        self.embed_ids(&ids, EmbedOptions::default())
    }

    /// Embeddings of tokenized inputs, in order. Inputs are sorted by length and packed into
    /// forward passes of at most `max_batch_tokens` tokens.
    pub fn embed_ids(
        &self,
        inputs: &[Vec<u32>],
        options: EmbedOptions,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let inputs = self.validate(inputs, options)?;
        let mut order: Vec<usize> = (0..inputs.len()).collect();
        order.sort_by_key(|&i| inputs[i].len());
        let mut results: Vec<Vec<f32>> = vec![Vec::new(); inputs.len()];
        let mut start = 0;
        while start < order.len() {
            let mut end = start;
            let mut tokens = 0;
            while end < order.len()
                && (end == start || tokens + inputs[order[end]].len() <= self.max_batch_tokens)
            {
                tokens += inputs[order[end]].len();
                end += 1;
            }
            let batch: Vec<&[u32]> = order[start..end].iter().map(|&i| &*inputs[i]).collect();
            let vectors = self.forward(&batch);
            for (&i, vector) in order[start..end].iter().zip(vectors) {
                results[i] = finish(vector, self.normalize, options.dimensions);
            }
            start = end;
        }
        Ok(results)
    }

    /// Checks ids, lengths and `dimensions`; truncates when asked.
    fn validate<'a>(
        &self,
        inputs: &'a [Vec<u32>],
        options: EmbedOptions,
    ) -> Result<Vec<std::borrow::Cow<'a, [u32]>>, EngineError> {
        if let Some(d) = options.dimensions {
            if d == 0 || d > self.dimensions() {
                return Err(EngineError::InvalidRequest(format!(
                    "dimensions must be between 1 and {}, got {d}",
                    self.dimensions()
                )));
            }
        }
        inputs
            .iter()
            .enumerate()
            .map(|(index, ids)| {
                if ids.is_empty() {
                    return Err(EngineError::InvalidRequest(format!(
                        "input {index} has no tokens"
                    )));
                }
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                    return Err(EngineError::InvalidRequest(format!(
                        "input {index}: token {bad} is outside the vocabulary of {} tokens",
                        self.config.vocab_size
                    )));
                }
                if ids.len() <= self.max_seq_len {
                    return Ok(std::borrow::Cow::Borrowed(ids.as_slice()));
                }
                if !options.truncate {
                    return Err(EngineError::InputTooLong {
                        index,
                        tokens: ids.len(),
                        limit: self.max_seq_len,
                    });
                }
                let mut cut = ids[..self.max_seq_len].to_vec();
                if let (Some(sep), Some(last)) = (self.sep_token, cut.last_mut()) {
                    if ids.last() == Some(&sep) {
                        *last = sep;
                    }
                }
                Ok(std::borrow::Cow::Owned(cut))
            })
            .collect()
    }

    /// The pooled (not yet normalized) vectors of one packed batch.
    fn forward(&self, batch: &[&[u32]]) -> Vec<Vec<f32>> {
        // One turn on the shared threads for the whole pass (see `kernels::pool`).
        let _turn = self.backend.pool().turn();
        let h = self.config.hidden_size;
        let heads = self.config.num_attention_heads;
        let eps = self.config.layer_norm_eps as f32;
        let bytes = self.file.bytes();
        let mut sequences = Vec::with_capacity(batch.len());
        let mut n = 0;
        for ids in batch {
            sequences.push(n..n + ids.len());
            n += ids.len();
        }

        let ffn = self.config.intermediate_size;
        // The previous call's buffers when no other call holds them (fresh pages of this size
        // cost a page fault each on every call).
        let mut kept = self.activations.try_lock().ok();
        let mut fresh = Activations::default();
        let Activations {
            embedded: sum,
            hidden,
            qkv,
            context,
            projected,
            intermediate,
        } = kept.as_deref_mut().unwrap_or(&mut fresh);
        for (buffer, width) in [
            (&mut *sum, h),
            (&mut *hidden, h),
            (&mut *qkv, 3 * h),
            (&mut *context, h),
            (&mut *projected, h),
            (&mut *intermediate, ffn),
        ] {
            buffer.resize(n * width, 0.0);
        }

        // Embeddings: word + position + token type, then LayerNorm.
        let word = &bytes[self.word_embeddings.range.clone()];
        let mut row = 0;
        for ids in batch {
            for (position, &id) in ids.iter().enumerate() {
                let dst = &mut sum[row * h..(row + 1) * h];
                let src = &word[id as usize * h * 4..(id as usize + 1) * h * 4];
                let pos = &self.position_embeddings[position * h..(position + 1) * h];
                for (((d, s), p), t) in dst
                    .iter_mut()
                    .zip(src.chunks_exact(4))
                    .zip(pos)
                    .zip(&self.token_type_embedding)
                {
                    *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]) + p + t;
                }
                row += 1;
            }
        }
        self.layer_norm(sum, &self.embedding_norm, eps, hidden);

        let (pool, isa) = (self.backend.pool(), self.backend.isa());
        for layer in &self.layers {
            self.linear(
                &layer.query_key_value,
                hidden,
                n,
                None,
                Activation::None,
                qkv,
            );
            attention_within_sequences(pool, isa, heads, h / heads, qkv, &sequences, context);
            self.linear(
                &layer.attention_output,
                context,
                n,
                Some(hidden),
                Activation::None,
                projected,
            );
            self.layer_norm(projected, &layer.attention_norm, eps, hidden);
            self.linear(
                &layer.intermediate,
                hidden,
                n,
                None,
                Activation::GeluErf,
                intermediate,
            );
            self.linear(
                &layer.output,
                intermediate,
                n,
                Some(hidden),
                Activation::None,
                projected,
            );
            self.layer_norm(projected, &layer.output_norm, eps, hidden);
        }

        sequences
            .iter()
            .map(|range| match self.pooling {
                Pooling::Cls => hidden[range.start * h..(range.start + 1) * h].to_vec(),
                Pooling::Mean => {
                    let mut mean = vec![0f32; h];
                    for r in range.clone() {
                        add_assign(&mut mean, &hidden[r * h..(r + 1) * h]);
                    }
                    let inv = 1.0 / range.len() as f32;
                    mean.iter_mut().for_each(|x| *x *= inv);
                    mean
                }
            })
            .collect()
    }

    fn layer_norm(&self, x: &[f32], norm: &LayerNormWeights, eps: f32, out: &mut [f32]) {
        layer_norm_rows(
            self.backend.pool(),
            self.backend.isa(),
            x,
            &norm.weight,
            &norm.bias,
            eps,
            out,
        );
    }

    /// `out = act(x·Wᵀ + b + residual)` over `n` rows.
    fn linear(
        &self,
        linear: &Linear,
        x: &[f32],
        n: usize,
        residual: Option<&[f32]>,
        activation: Activation,
        out: &mut [f32],
    ) {
        let epilogue = Epilogue {
            bias: Some(&linear.bias),
            residual,
            activation,
        };
        gemm(
            self.backend.pool(),
            self.backend.isa(),
            x,
            n,
            &linear.weight,
            epilogue,
            out,
        );
    }
}

/// Normalizes (when the model does), then applies Matryoshka truncation with renormalization.
fn finish(mut vector: Vec<f32>, normalize: bool, dimensions: Option<usize>) -> Vec<f32> {
    if normalize {
        l2_normalize(&mut vector);
    }
    if let Some(d) = dimensions.filter(|&d| d < vector.len()) {
        vector.truncate(d);
        l2_normalize(&mut vector);
    }
    vector
}

fn l2_normalize(x: &mut [f32]) {
    let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
    // sentence-transformers divides by max(norm, 1e-12).
    let inv = 1.0 / norm.max(1e-12);
    x.iter_mut().for_each(|v| *v *= inv);
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn add_assign(x: &mut [f32], y: &[f32]) {
    kernels::ops::add_assign(x, y);
}

/// Cosine similarity of two vectors.
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}

/// A tiny random BERT folder of the real layout (weights, WordPiece tokenizer, sentence-
/// transformers module files), for tests that must not depend on downloads.
#[doc(hidden)]
pub mod tiny {
    use std::path::Path;

    use formats::safetensors::SafetensorsWriter;
    use serde_json::json;

    /// Words of the tiny vocabulary after the five special tokens (ids 5…).
    pub const WORDS: [&str; 15] = [
        "a", "man", "is", "eating", "food", "the", "girl", "carrying", "baby", "movie", "new",
        "awesome", ".", "##s", "bread",
    ];
    pub const HIDDEN: usize = 16;
    pub const HEADS: usize = 2;
    pub const LAYERS: usize = 2;
    pub const FFN: usize = 24;
    pub const MAX_POSITIONS: usize = 24;

    /// A deterministic generator for the weights (splitmix64).
    fn values(seed: &mut u64, n: usize, scale: f32, around: f32) -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = *seed;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                z ^= z >> 31;
                let unit = (z >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                (around + unit * scale).to_le_bytes()
            })
            .collect()
    }

    /// Writes the folder; `max_seq_length` goes to `sentence_bert_config.json`.
    pub fn write(dir: &Path, max_seq_length: usize) -> std::io::Result<()> {
        let vocab_size = 5 + WORDS.len();
        let h = HIDDEN as u64;
        let mut seed = 7u64;
        let mut tensors: Vec<(String, Vec<u64>, Vec<u8>)> = Vec::new();
        let mut add = |name: String, shape: Vec<u64>, around: f32, scale: f32| {
            let n = shape.iter().product::<u64>() as usize;
            tensors.push((name, shape, values(&mut seed, n, scale, around)));
        };
        add(
            "embeddings.word_embeddings.weight".into(),
            vec![vocab_size as u64, h],
            0.0,
            1.0,
        );
        add(
            "embeddings.position_embeddings.weight".into(),
            vec![MAX_POSITIONS as u64, h],
            0.0,
            0.5,
        );
        add(
            "embeddings.token_type_embeddings.weight".into(),
            vec![2, h],
            0.0,
            0.5,
        );
        add("embeddings.LayerNorm.weight".into(), vec![h], 1.0, 0.1);
        add("embeddings.LayerNorm.bias".into(), vec![h], 0.0, 0.1);
        for i in 0..LAYERS {
            let l = format!("encoder.layer.{i}");
            let dense = |name: &str, out: usize, inp: usize| {
                (name.to_string(), vec![out as u64, inp as u64], out)
            };
            for (name, shape, out) in [
                dense("attention.self.query", HIDDEN, HIDDEN),
                dense("attention.self.key", HIDDEN, HIDDEN),
                dense("attention.self.value", HIDDEN, HIDDEN),
                dense("attention.output.dense", HIDDEN, HIDDEN),
                dense("intermediate.dense", FFN, HIDDEN),
                dense("output.dense", HIDDEN, FFN),
            ] {
                add(format!("{l}.{name}.weight"), shape, 0.0, 0.5);
                add(format!("{l}.{name}.bias"), vec![out as u64], 0.0, 0.1);
            }
            for norm in ["attention.output.LayerNorm", "output.LayerNorm"] {
                add(format!("{l}.{norm}.weight"), vec![h], 1.0, 0.1);
                add(format!("{l}.{norm}.bias"), vec![h], 0.0, 0.1);
            }
        }
        let mut writer = SafetensorsWriter::new();
        for (name, shape, data) in &tensors {
            writer
                .tensor(name, "F32", shape, data.as_slice())
                .map_err(std::io::Error::other)?;
        }
        std::fs::create_dir_all(dir.join("1_Pooling"))?;
        std::fs::write(
            dir.join("model.safetensors"),
            writer.to_bytes().map_err(std::io::Error::other)?,
        )?;
        let write_json = |name: &str, value: serde_json::Value| {
            std::fs::write(dir.join(name), serde_json::to_string_pretty(&value)?)
        };
        write_json(
            "config.json",
            json!({
                "architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
                "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_hidden_layers": LAYERS,
                "intermediate_size": FFN, "max_position_embeddings": MAX_POSITIONS,
                "type_vocab_size": 2, "layer_norm_eps": 1e-12, "vocab_size": vocab_size,
                "position_embedding_type": "absolute"
            }),
        )?;
        write_json(
            "modules.json",
            json!([
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
                {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
            ]),
        )?;
        write_json(
            "1_Pooling/config.json",
            json!({"word_embedding_dimension": HIDDEN, "pooling_mode_cls_token": false,
                   "pooling_mode_mean_tokens": true, "pooling_mode_max_tokens": false,
                   "pooling_mode_mean_sqrt_len_tokens": false}),
        )?;
        write_json(
            "sentence_bert_config.json",
            json!({"max_seq_length": max_seq_length, "do_lower_case": false}),
        )?;
        let mut vocab = serde_json::Map::new();
        for (i, token) in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
            .iter()
            .chain(WORDS.iter())
            .enumerate()
        {
            vocab.insert(token.to_string(), json!(i));
        }
        let special = |id: u32, content: &str| {
            json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        };
        write_json(
            "tokenizer.json",
            json!({
                "version": "1.0",
                // Like the real MiniLM file: padding and truncation on, which the loader turns off.
                "truncation": {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0},
                "padding": {"strategy": {"Fixed": 8}, "direction": "Right", "pad_to_multiple_of": null,
                            "pad_id": 0, "pad_type_id": 0, "pad_token": "[PAD]"},
                "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"),
                                 special(3, "[SEP]"), special(4, "[MASK]")],
                "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                               "strip_accents": null, "lowercase": true},
                "pre_tokenizer": {"type": "BertPreTokenizer"},
                "post_processor": {
                    "type": "TemplateProcessing",
                    "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                               {"Sequence": {"id": "A", "type_id": 0}},
                               {"SpecialToken": {"id": "[SEP]", "type_id": 0}}],
                    "pair": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                             {"Sequence": {"id": "A", "type_id": 0}},
                             {"SpecialToken": {"id": "[SEP]", "type_id": 0}},
                             {"Sequence": {"id": "B", "type_id": 1}},
                             {"SpecialToken": {"id": "[SEP]", "type_id": 1}}],
                    "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                                       "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}
                },
                "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
                "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                          "max_input_chars_per_word": 100, "vocab": vocab}
            }),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_folder(max_seq_length: usize) -> tempfile::TempDir {
        let dir = tempfile::tempdir().expect("temp dir");
        tiny::write(dir.path(), max_seq_length).expect("write the tiny BERT");
        dir
    }

    fn options(max_batch_tokens: usize) -> EmbedderOptions {
        EmbedderOptions {
            threads: 2,
            max_batch_tokens,
        }
    }

    const TEXTS: [&str; 5] = [
        "A man is eating food.",
        "a",
        "The new movie is awesome. The girl is carrying a baby. A man is eating bread.",
        "The girl is carrying a baby.",
        "movies foods",
    ];

    #[test]
    fn loads_the_module_files_and_ignores_the_tokenizers_padding() {
        let dir = tiny_folder(22);
        let embedder = Embedder::load_with(dir.path(), &options(64)).expect("load");
        assert_eq!(embedder.dimensions(), tiny::HIDDEN);
        assert_eq!(embedder.max_seq_len(), 22);
        assert_eq!(embedder.pooling(), Pooling::Mean);
        assert!(embedder.normalizes());
        // [CLS] a man is eating food . [SEP], unpadded; the 10-token input is not truncated to 8.
        assert_eq!(
            embedder
                .tokenize("A man is eating food.")
                .expect("tokenize"),
            vec![2, 5, 6, 7, 8, 9, 17, 3]
        );
        assert_eq!(
            embedder.tokenize("movies foods!").expect("tokenize"),
            vec![2, 14, 18, 9, 18, 1, 3]
        );
        // Special-token texts in client text stay text: no [SEP] (3) or [CLS] (2) inside.
        let ids = embedder.tokenize("a [SEP] man [CLS]").expect("tokenize");
        assert_eq!((ids[0], ids[ids.len() - 1]), (2, 3), "{ids:?}");
        assert!(
            !ids[1..ids.len() - 1].iter().any(|&id| id == 2 || id == 3),
            "{ids:?}"
        );
        let vectors = embedder.embed(&TEXTS).expect("embed");
        for v in &vectors {
            assert_eq!(v.len(), tiny::HIDDEN);
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "{norm}");
        }
        assert!(
            cosine(&vectors[0], &vectors[3]) < 0.9999,
            "different inputs, different vectors"
        );
    }

    #[test]
    fn batching_does_not_change_an_inputs_embedding() {
        let dir = tiny_folder(24);
        // One forward pass for everything, and passes of at most 12 tokens (several batches).
        for max_batch_tokens in [4096, 12, 1] {
            let embedder =
                Embedder::load_with(dir.path(), &options(max_batch_tokens)).expect("load");
            let together = embedder.embed(&TEXTS).expect("embed");
            for (text, batched) in TEXTS.iter().zip(&together) {
                let alone = embedder.embed(&[text]).expect("embed");
                for (a, b) in alone[0].iter().zip(batched) {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "{text:?} with max_batch_tokens {max_batch_tokens}"
                    );
                }
            }
        }
    }

    #[test]
    fn mean_pooling_covers_only_the_inputs_own_tokens() {
        // The same tokens twice in one batch give the same vector: nothing of one input (its
        // length, its rows) leaks into another's attention or mean.
        let dir = tiny_folder(24);
        let embedder = Embedder::load_with(dir.path(), &options(4096)).expect("load");
        let short = embedder.tokenize("a man").expect("tokenize");
        let long = embedder.tokenize(TEXTS[2]).expect("tokenize");
        let vectors = embedder
            .embed_ids(&[short.clone(), long, short], EmbedOptions::default())
            .expect("embed");
        assert_eq!(vectors[0], vectors[2]);
        // Padding the short input with [PAD] tokens (unmasked) does change it: the test above
        // could fail if attention saw another input's rows.
        let mut padded = embedder.tokenize("a man").expect("tokenize");
        padded.extend([0, 0, 0]);
        let with_pads = embedder
            .embed_ids(&[padded], EmbedOptions::default())
            .expect("embed");
        assert!(cosine(&with_pads[0], &vectors[0]) < 0.9999);
    }

    #[test]
    fn too_long_inputs_fail_unless_truncation_is_asked_for() {
        let dir = tiny_folder(6);
        let embedder = Embedder::load_with(dir.path(), &options(4096)).expect("load");
        let ids = embedder
            .tokenize("A man is eating food.")
            .expect("tokenize");
        assert_eq!(ids.len(), 8);
        let err = embedder
            .embed_ids(&[vec![2, 3], ids.clone()], EmbedOptions::default())
            .expect_err("too long");
        assert!(
            matches!(
                err,
                EngineError::InputTooLong {
                    index: 1,
                    tokens: 8,
                    limit: 6
                }
            ),
            "{err}"
        );
        let truncated = embedder
            .embed_ids(
                std::slice::from_ref(&ids),
                EmbedOptions {
                    truncate: true,
                    dimensions: None,
                },
            )
            .expect("truncate");
        // The same as the first five tokens and [SEP].
        let mut cut = ids[..5].to_vec();
        cut.push(3);
        let explicit = embedder
            .embed_ids(&[cut], EmbedOptions::default())
            .expect("embed");
        assert_eq!(truncated, explicit);
    }

    #[test]
    fn rejects_bad_inputs_with_messages() {
        let dir = tiny_folder(24);
        let embedder = Embedder::load_with(dir.path(), &options(4096)).expect("load");
        let message = |ids: Vec<Vec<u32>>, dimensions: Option<usize>| {
            embedder
                .embed_ids(
                    &ids,
                    EmbedOptions {
                        truncate: false,
                        dimensions,
                    },
                )
                .expect_err("must fail")
                .to_string()
        };
        assert!(message(vec![vec![]], None).contains("input 0 has no tokens"));
        assert!(message(vec![vec![2, 99, 3]], None)
            .contains("token 99 is outside the vocabulary of 20"));
        assert!(message(vec![vec![2, 3]], Some(0)).contains("between 1 and 16"));
        assert!(message(vec![vec![2, 3]], Some(17)).contains("between 1 and 16"));
    }

    #[test]
    fn dimensions_truncates_then_renormalizes() {
        let dir = tiny_folder(24);
        let embedder = Embedder::load_with(dir.path(), &options(4096)).expect("load");
        let ids = vec![embedder.tokenize(TEXTS[0]).expect("tokenize")];
        let full = embedder
            .embed_ids(&ids, EmbedOptions::default())
            .expect("embed");
        let short = embedder
            .embed_ids(
                &ids,
                EmbedOptions {
                    truncate: false,
                    dimensions: Some(5),
                },
            )
            .expect("embed");
        assert_eq!(short[0].len(), 5);
        let norm = full[0][..5].iter().map(|x| x * x).sum::<f32>().sqrt();
        for (s, f) in short[0].iter().zip(&full[0]) {
            assert!((s - f / norm).abs() < 1e-6);
        }
    }

    #[test]
    fn load_errors_name_the_tensor_or_file() {
        let dir = tiny_folder(24);
        let config_path = dir.path().join("config.json");
        let text = std::fs::read_to_string(&config_path).expect("read");
        std::fs::write(
            &config_path,
            text.replace("\"intermediate_size\": 24", "\"intermediate_size\": 32"),
        )
        .expect("write");
        let err = Embedder::load(dir.path())
            .expect_err("misshapen")
            .to_string();
        assert!(
            err.contains("encoder.layer.0.intermediate.dense.weight")
                && err.contains("[24, 16], expected [32, 16]"),
            "{err}"
        );
        std::fs::write(
            &config_path,
            text.replace("\"BertModel\"", "\"LlamaForCausalLM\""),
        )
        .expect("write");
        let err = Embedder::load(dir.path())
            .expect_err("not BERT")
            .to_string();
        assert!(err.contains("LlamaForCausalLM"), "{err}");
        std::fs::remove_file(dir.path().join("tokenizer.json")).expect("remove");
        std::fs::write(&config_path, &text).expect("write");
        let err = Embedder::load(dir.path())
            .expect_err("no tokenizer")
            .to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
    }
}
