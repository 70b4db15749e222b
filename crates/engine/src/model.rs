//! A loaded model: configuration, weights mapped from a GGUF file or a Hugging Face checkpoint
//! folder, and the forward pass.
//!
//! Weights stay in the memory maps (zero-copy, see [`crate::weights`]); only the small 1-D
//! tensors (norms, biases) are copied to f32 at load. The forward pass is the llama-family
//! decoder; what differs between families (RoPE layout, activation, embedding scale, sliding
//! windows) is described by an [`crate::arch::Family`], and optional tensors (biases, Q/K norms,
//! post-norms) are used where a file has them.

use std::ops::Range;
use std::path::Path;

use formats::gguf::GgufFile;
use kernels::ops::{Rope, RopeScaling};
use kernels::paged::{Attended, Capture, NOT_CAPTURED};
use kernels::quant::dequantize_row;
use kernels::{Backend, Matrix, QueryRow, Scratch};

use crate::arch::{family, Activation, Family, HfLayout};
use crate::error::EngineError;
use crate::kv_store::{KvStore, SequenceCache};
use crate::weights::{tensor_error, TensorRef, Weights};

pub use crate::weights::dtype_of;

/// The shape of the network.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: String,
    pub block_count: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Context the model was trained for.
    pub context_length: usize,
    pub vocab_size: usize,
    pub norm_eps: f32,
    pub rope_theta: f32,
    pub rope_dims: usize,
    pub rope_scaling: RopeScaling,
    /// The window of the family's sliding-window layers (`attention.sliding_window`): a query at
    /// position p sees keys `p + 1 − window ..= p`.
    pub sliding_window: Option<usize>,
    /// Attention scores are `q·k / √query_pre_attn_scalar` (Gemma; `None`: `√head_dim`).
    pub query_pre_attn_scalar: Option<f32>,
}

/// The file format a model was loaded from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// One GGUF file (weights, tokenizer and chat template inside).
    Gguf,
    /// A Hugging Face checkpoint folder: `config.json`, safetensors, `tokenizer.json`.
    HuggingFace,
}

/// Q, K and V projections: three matrices, or one whose rows are Q's, then K's, then V's.
#[derive(Debug)]
enum Qkv {
    Separate {
        wq: TensorRef,
        wk: TensorRef,
        wv: TensorRef,
    },
    Fused(TensorRef),
}

/// Gate and up projections: two matrices, or one whose first half of rows is the gate's.
#[derive(Debug)]
enum GateUp {
    Separate { w_gate: TensorRef, w_up: TensorRef },
    Fused(TensorRef),
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    qkv: Qkv,
    wo: TensorRef,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    /// Per-head RMSNorms of Q and K before RoPE (Qwen 3, Gemma 3).
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// RMSNorm of the attention's output before the residual add (Gemma).
    post_attn_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    gate_up: GateUp,
    w_down: TensorRef,
    /// RMSNorm of the feed-forward output before the residual add (Gemma).
    post_ffn_norm: Option<Vec<f32>>,
    /// A sliding-window layer: attends over the last `window` positions, with the local RoPE.
    window: Option<usize>,
}

/// A model ready to run.
pub struct Model {
    weights: Weights,
    pub config: ModelConfig,
    pub family: &'static Family,
    pub format: WeightFormat,
    embeddings: TensorRef,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    output: TensorRef,
    rope: Rope,
    /// The RoPE of sliding-window layers, when the family gives them their own base.
    rope_local: Option<Rope>,
    /// Multiplies Q before the kernel's `1/√head_dim` so that scores are scaled by
    /// `1/√query_pre_attn_scalar` (1 when they coincide).
    query_factor: f32,
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Model")
            .field("config", &self.config)
            .field("format", &self.format)
            .finish()
    }
}

impl Model {
    /// Maps and checks a model: a GGUF file, or a Hugging Face checkpoint folder
    /// (see [`crate::hf`]).
    pub fn load(path: &Path) -> Result<Self, EngineError> {
        if path.is_dir() {
            Self::load_hf(path)
        } else {
            Self::load_gguf(path)
        }
    }

    /// Maps and checks a Hugging Face checkpoint folder: `config.json` and the safetensors
    /// weights (`model.safetensors`, or the shards `model.safetensors.index.json` names).
    pub fn load_hf(dir: &Path) -> Result<Self, EngineError> {
        let checkpoint = crate::hf::open(dir)?;
        // Hugging Face keeps Q/K in their original row order, which rotates NeoX-style.
        Self::assemble(
            checkpoint.config,
            checkpoint.family,
            true,
            WeightFormat::HuggingFace,
            checkpoint.weights,
        )
    }

    /// Maps and checks a GGUF model file.
    pub fn load_gguf(path: &Path) -> Result<Self, EngineError> {
        let file = GgufFile::open(path)
            .map_err(|e| EngineError::Load(format!("{}: {e}", path.display())))?;
        let meta = |e: formats::gguf::GgufError| EngineError::Load(e.to_string());
        let arch = file
            .architecture()
            .map_err(meta)?
            .ok_or_else(|| EngineError::Load("general.architecture is missing".into()))?
            .to_string();
        let family =
            family(&arch).ok_or_else(|| EngineError::UnsupportedArchitecture(arch.clone()))?;
        let need = |key: &str| -> Result<usize, EngineError> {
            file.arch_u64(key)
                .map_err(meta)?
                .map(|v| v as usize)
                .ok_or_else(|| EngineError::Load(format!("{arch}.{key} is missing")))
        };
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let kv_heads = file
            .arch_u64("attention.head_count_kv")
            .map_err(meta)?
            .map_or(heads, |v| v as usize);
        if heads == 0 || kv_heads == 0 || heads % kv_heads != 0 {
            return Err(EngineError::Load(format!(
                "inconsistent attention shape: hidden {hidden}, heads {heads}, kv heads {kv_heads}"
            )));
        }
        let head_dim = match file.arch_u64("attention.key_length").map_err(meta)? {
            Some(d) if d > 0 => d as usize,
            Some(_) => return Err(EngineError::Load("attention.key_length is 0".into())),
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(EngineError::Load(format!(
                    "hidden {hidden} is not a multiple of {heads} heads and the file gives no \
                     attention.key_length"
                )))
            }
        };
        if let Some(v) = file.arch_u64("attention.value_length").map_err(meta)? {
            if v as usize != head_dim {
                return Err(EngineError::Load(format!(
                    "attention.value_length {v} differs from key_length {head_dim}: not supported"
                )));
            }
        }
        let embd = file
            .tensor("token_embd.weight")
            .ok_or_else(|| tensor_error("token_embd.weight", "missing"))?;
        let vocab_size = embd.dims.get(1).copied().unwrap_or(0) as usize;
        let scaling = match file.arch_f64("rope.scaling.factor").map_err(meta)? {
            Some(factor) if factor > 1.0 => {
                let kind = file
                    .get_str(&format!("{arch}.rope.scaling.type"))
                    .map_err(meta)?
                    .unwrap_or("linear");
                match kind {
                    "linear" => RopeScaling::Linear {
                        factor: factor as f32,
                    },
                    "none" => RopeScaling::None,
                    other => {
                        return Err(EngineError::Load(format!(
                            "RoPE scaling {other:?} is not supported"
                        )))
                    }
                }
            }
            _ => RopeScaling::None,
        };
        let config = ModelConfig {
            architecture: arch.clone(),
            block_count: need("block_count")?,
            hidden,
            ffn: need("feed_forward_length")?,
            heads,
            kv_heads,
            head_dim,
            context_length: need("context_length")?,
            vocab_size,
            norm_eps: file
                .arch_f64("attention.layer_norm_rms_epsilon")
                .map_err(meta)?
                .unwrap_or(1e-5) as f32,
            rope_theta: file
                .arch_f64("rope.freq_base")
                .map_err(meta)?
                .unwrap_or(10000.0) as f32,
            rope_dims: file
                .arch_u64("rope.dimension_count")
                .map_err(meta)?
                .map_or(head_dim, |v| v as usize),
            rope_scaling: scaling,
            sliding_window: match family.sliding_pattern {
                0 => None,
                _ => file
                    .arch_u64("attention.sliding_window")
                    .map_err(meta)?
                    .map(|w| w as usize),
            },
            // GGUF does not carry Gemma 3's query_pre_attn_scalar: it is head_dim except for the
            // 27B model (62 layers), where it is hidden / heads (as llama.cpp reads it).
            query_pre_attn_scalar: (family.name == "gemma3" && need("block_count")? == 62)
                .then(|| (hidden / heads) as f32),
        };
        if config.rope_dims > head_dim || !config.rope_dims.is_multiple_of(2) {
            return Err(EngineError::Load(format!(
                "rope.dimension_count {} does not fit head_dim {head_dim}",
                config.rope_dims
            )));
        }
        Self::assemble(
            config,
            family,
            family.rope_neox,
            WeightFormat::Gguf,
            Weights::from_gguf(file),
        )
    }

    /// Finds and checks every tensor of the decoder (by GGUF name) for `config`. Without
    /// `output.weight` the output projection reuses the token embedding.
    fn assemble(
        config: ModelConfig,
        family: &'static Family,
        rope_neox: bool,
        format: WeightFormat,
        weights: Weights,
    ) -> Result<Self, EngineError> {
        let (hidden, heads, kv_heads, head_dim) = (
            config.hidden,
            config.heads,
            config.kv_heads,
            config.head_dim,
        );
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        // Gemma's Hugging Face checkpoints store RMSNorm weights as offsets from 1.
        let offset = if format == WeightFormat::HuggingFace && family.hf_layout == HfLayout::Gemma {
            1.0
        } else {
            0.0
        };
        let shift = |mut w: Vec<f32>| {
            w.iter_mut().for_each(|v| *v += offset);
            w
        };
        let norm = |name: &str, len: usize| weights.vector(name, len).map(shift);
        let optional_norm = |name: &str, len: usize| {
            Ok::<_, EngineError>(weights.optional_vector(name, len)?.map(shift))
        };
        let mut layers = Vec::with_capacity(config.block_count);
        if family.sliding_pattern > 1 && config.sliding_window.is_none() {
            return Err(EngineError::Load(format!(
                "a {} model needs its attention.sliding_window",
                family.name
            )));
        }
        if config.sliding_window == Some(0) {
            return Err(EngineError::Load("attention.sliding_window is 0".into()));
        }
        for l in 0..config.block_count {
            let n = |t: &str| format!("blk.{l}.{t}");
            let qkv = if family.fused_projections {
                Qkv::Fused(weights.matrix(&n("attn_qkv.weight"), q_dim + 2 * kv_dim, hidden)?)
            } else {
                Qkv::Separate {
                    wq: weights.matrix(&n("attn_q.weight"), q_dim, hidden)?,
                    wk: weights.matrix(&n("attn_k.weight"), kv_dim, hidden)?,
                    wv: weights.matrix(&n("attn_v.weight"), kv_dim, hidden)?,
                }
            };
            let gate_up = if family.fused_projections {
                GateUp::Fused(weights.matrix(&n("ffn_up.weight"), 2 * config.ffn, hidden)?)
            } else {
                GateUp::Separate {
                    w_gate: weights.matrix(&n("ffn_gate.weight"), config.ffn, hidden)?,
                    w_up: weights.matrix(&n("ffn_up.weight"), config.ffn, hidden)?,
                }
            };
            layers.push(Layer {
                attn_norm: norm(&n("attn_norm.weight"), hidden)?,
                qkv,
                wo: weights.matrix(&n("attn_output.weight"), hidden, q_dim)?,
                bq: weights.optional_vector(&n("attn_q.bias"), q_dim)?,
                bk: weights.optional_vector(&n("attn_k.bias"), kv_dim)?,
                bv: weights.optional_vector(&n("attn_v.bias"), kv_dim)?,
                q_norm: optional_norm(&n("attn_q_norm.weight"), head_dim)?,
                k_norm: optional_norm(&n("attn_k_norm.weight"), head_dim)?,
                post_attn_norm: optional_norm(&n("post_attention_norm.weight"), hidden)?,
                ffn_norm: norm(&n("ffn_norm.weight"), hidden)?,
                gate_up,
                w_down: weights.matrix(&n("ffn_down.weight"), hidden, config.ffn)?,
                post_ffn_norm: optional_norm(&n("post_ffw_norm.weight"), hidden)?,
                window: config.sliding_window.filter(|_| family.is_sliding(l)),
            });
        }
        let embeddings = weights.matrix("token_embd.weight", config.vocab_size, hidden)?;
        let output = match weights.get("output.weight") {
            Some(_) => weights.matrix("output.weight", config.vocab_size, hidden)?,
            None => embeddings.clone(),
        };
        let mut rope = Rope::new(
            config.rope_dims,
            config.rope_theta,
            rope_neox,
            config.rope_scaling,
        );
        if weights.get("rope_factors_long.weight").is_some()
            || weights.get("rope_factors_short.weight").is_some()
        {
            return Err(EngineError::Load(
                "LongRoPE (rope_factors_long/short: Phi-3's 128k variants) is not supported".into(),
            ));
        }
        if weights.get("rope_freqs.weight").is_some() {
            // Llama 3.1 GGUFs store their long-context frequency factors as a tensor.
            rope.divide_frequencies(&weights.vector("rope_freqs.weight", config.rope_dims / 2)?);
        }
        let rope_local = family
            .sliding_rope_theta
            .map(|theta| Rope::new(config.rope_dims, theta, rope_neox, RopeScaling::None));
        let query_factor = config
            .query_pre_attn_scalar
            .map_or(1.0, |s| (head_dim as f32).sqrt() / s.sqrt());
        Ok(Self {
            output_norm: norm("output_norm.weight", hidden)?,
            weights,
            config,
            family,
            format,
            embeddings,
            layers,
            output,
            rope,
            rope_local,
            query_factor,
        })
    }

    fn matrix<'a>(&'a self, t: &'a TensorRef) -> Matrix<'a> {
        self.weights.view(t)
    }

    /// Bytes of weights one decode step (one token) reads: every matrix once, in the form the
    /// kernels multiply (the packed copy where there is one), and one embedding row. What decode
    /// speed is measured against: `bytes_per_token × tokens/s` over the read bandwidth.
    pub fn decode_bytes_per_token(&self) -> u64 {
        let read = |t: &TensorRef| {
            let m = self.matrix(t);
            m.packed.map_or(m.data.len(), <[u8]>::len) as u64
        };
        let mut total = self.matrix(&self.embeddings).row_bytes() as u64 + read(&self.output);
        for layer in &self.layers {
            total += match &layer.qkv {
                Qkv::Separate { wq, wk, wv } => read(wq) + read(wk) + read(wv),
                Qkv::Fused(w) => read(w),
            };
            total += match &layer.gate_up {
                GateUp::Separate { w_gate, w_up } => read(w_gate) + read(w_up),
                GateUp::Fused(w) => read(w),
            };
            total += read(&layer.wo) + read(&layer.w_down);
        }
        total
    }

    /// The GGUF file the model runs from (tokenizer metadata lives there too); `None` for a
    /// Hugging Face checkpoint.
    pub fn gguf(&self) -> Option<&GgufFile> {
        self.weights.gguf()
    }

    /// Runs `tokens` (at positions `cache.len()..`) through the network, appending their keys and
    /// values to `cache`. Logits of the rows selected by `logits` land in `state.logits`
    /// (`rows × vocab`).
    pub fn forward(
        &self,
        backend: &dyn Backend,
        tokens: &[u32],
        cache: &mut SequenceCache,
        state: &mut ForwardState,
        logits: LogitRows,
    ) -> Result<(), EngineError> {
        let m = tokens.len();
        if m == 0 {
            return Ok(());
        }
        let start = cache.len;
        if start + m > cache.capacity() {
            return Err(EngineError::ContextExceeded {
                prompt_tokens: start + m,
                max_tokens: 0,
                context: cache.capacity(),
            });
        }
        let mut batch = std::mem::take(&mut state.batch);
        batch.clear();
        batch.push_sequence(&cache.table, tokens, start, logits == LogitRows::All);
        if logits == LogitRows::Last {
            batch.logit_rows.push(m - 1);
        }
        let result = self.forward_batch(backend, &batch, &mut cache.store, state);
        state.batch = batch;
        result?;
        cache.len = start + m;
        Ok(())
    }

    /// One forward pass over the rows of `batch` (tokens of several sequences at their own
    /// positions), writing each row's keys and values into its sequence's blocks in `store` and
    /// attending over them. Logits of `batch.logit_rows` land in `state.logits`
    /// (`logit_rows × vocab`, in that order).
    pub fn forward_batch(
        &self,
        backend: &dyn Backend,
        batch: &Batch,
        store: &mut KvStore,
        state: &mut ForwardState,
    ) -> Result<(), EngineError> {
        let c = &self.config;
        let m = batch.tokens.len();
        if m == 0 {
            return Ok(());
        }
        if let Some(&bad) = batch.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let block_tokens = store.layout().block_tokens;
        for (i, &pos) in batch.positions.iter().enumerate() {
            let table = batch.table(batch.row_seq[i]);
            if pos / block_tokens >= table.len()
                || table.iter().any(|&b| b as usize >= store.blocks())
            {
                return Err(EngineError::InvalidRequest(format!(
                    "row {i} at position {pos} has no block in its table"
                )));
            }
        }
        let (hid, qd, kvd) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
        state.ensure(c, m);
        let s = state;
        // The attention export's entries, layer after layer (see `Batch::capture_slots`).
        let per_layer = if batch.capture_layers.is_empty() {
            0
        } else {
            if batch.capture_slots.len() != m {
                return Err(EngineError::InvalidRequest(format!(
                    "the attention capture names {} rows, the batch has {m}",
                    batch.capture_slots.len()
                )));
            }
            if let Some(&bad) = batch
                .capture_layers
                .iter()
                .find(|&&l| l >= self.layers.len())
            {
                return Err(EngineError::InvalidRequest(format!(
                    "the attention capture names layer {bad} of {}",
                    self.layers.len()
                )));
            }
            let mut seen: Vec<u32> = batch
                .capture_slots
                .iter()
                .copied()
                .filter(|&x| x != NOT_CAPTURED)
                .collect();
            seen.sort_unstable();
            if seen.iter().enumerate().any(|(i, &x)| x as usize != i) {
                return Err(EngineError::InvalidRequest(
                    "the attention capture's slots are not 0..n, one per captured row".into(),
                ));
            }
            seen.len() * c.heads * batch.capture_top_k
        };
        s.attention.clear();
        s.attention
            .resize(batch.capture_layers.len() * per_layer, Attended::NONE);
        let embd = self.matrix(&self.embeddings);
        for (i, &t) in batch.tokens.iter().enumerate() {
            dequantize_row(
                embd.dtype,
                embd.row(t as usize),
                &mut s.x[i * hid..(i + 1) * hid],
            );
        }
        if self.family.scale_embeddings {
            let scale = (hid as f32).sqrt();
            s.x[..m * hid].iter_mut().for_each(|v| *v *= scale);
        }
        for (l, layer) in self.layers.iter().enumerate() {
            let (x, h) = (&mut s.x[..m * hid], &mut s.h[..m * hid]);
            backend.rms_norm_rows(x, &layer.attn_norm, c.norm_eps, h);
            let (q, k, v) = (&mut s.q[..m * qd], &mut s.k[..m * kvd], &mut s.v[..m * kvd]);
            match &layer.qkv {
                Qkv::Separate { wq, wk, wv } => backend.matmul_many(
                    &[self.matrix(wq), self.matrix(wk), self.matrix(wv)],
                    h,
                    m,
                    &mut [&mut *q, &mut *k, &mut *v],
                    &mut s.scratch,
                ),
                Qkv::Fused(w) => {
                    let width = qd + 2 * kvd;
                    let fused = &mut s.fused[..m * width];
                    backend.matmul(&self.matrix(w), h, m, fused, &mut s.scratch);
                    for (i, row) in fused.chunks_exact(width).enumerate() {
                        q[i * qd..(i + 1) * qd].copy_from_slice(&row[..qd]);
                        k[i * kvd..(i + 1) * kvd].copy_from_slice(&row[qd..qd + kvd]);
                        v[i * kvd..(i + 1) * kvd].copy_from_slice(&row[qd + kvd..]);
                    }
                }
            }
            for (buf, bias, dim) in [
                (&mut *q, &layer.bq, qd),
                (&mut *k, &layer.bk, kvd),
                (&mut *v, &layer.bv, kvd),
            ] {
                if let Some(bias) = bias {
                    for row in buf.chunks_exact_mut(dim) {
                        kernels::ops::add_assign(row, bias);
                    }
                }
            }
            // Per-head RMSNorms of Q and K (rows of head_dim values), before RoPE.
            for (buf, norm) in [(&mut *q, &layer.q_norm), (&mut *k, &layer.k_norm)] {
                if let Some(norm) = norm {
                    let tmp = &mut s.att[..buf.len()];
                    backend.rms_norm_rows(buf, norm, c.norm_eps, tmp);
                    buf.copy_from_slice(tmp);
                }
            }
            if self.query_factor != 1.0 {
                q.iter_mut().for_each(|v| *v *= self.query_factor);
            }
            let rope = match (&layer.window, &self.rope_local) {
                (Some(_), Some(local)) => local,
                _ => &self.rope,
            };
            for (i, &pos) in batch.positions.iter().enumerate() {
                let (qi, ki) = (&mut q[i * qd..(i + 1) * qd], &mut k[i * kvd..(i + 1) * kvd]);
                rope.apply(qi, c.heads, c.head_dim, pos);
                rope.apply(ki, c.kv_heads, c.head_dim, pos);
                let table = batch.table(batch.row_seq[i]);
                store.write(
                    l,
                    table[pos / block_tokens],
                    pos % block_tokens,
                    ki,
                    &v[i * kvd..(i + 1) * kvd],
                );
            }
            let rows: Vec<QueryRow<'_>> = batch
                .positions
                .iter()
                .zip(&batch.row_seq)
                .map(|(&pos, &seq)| QueryRow {
                    table: batch.table(seq),
                    first: layer.window.map_or(0, |w| (pos + 1).saturating_sub(w)),
                    keys: pos + 1,
                })
                .collect();
            let att = &mut s.att[..m * qd];
            let captured = batch.capture_layers.iter().position(|&cl| cl == l);
            let mut capture = captured.map(|at| Capture {
                slots: &batch.capture_slots,
                top_k: batch.capture_top_k,
                out: &mut s.attention[at * per_layer..(at + 1) * per_layer],
            });
            backend.paged_attention(c.heads, q, &rows, &store.layer(l), att, capture.as_mut());
            let o = &mut s.o[..m * hid];
            backend.matmul(&self.matrix(&layer.wo), att, m, o, &mut s.scratch);
            if let Some(norm) = &layer.post_attn_norm {
                backend.rms_norm_rows(o, norm, c.norm_eps, h);
                kernels::ops::add_assign(x, h);
            } else {
                kernels::ops::add_assign(x, o);
            }

            backend.rms_norm_rows(x, &layer.ffn_norm, c.norm_eps, h);
            let (gate, up) = (&mut s.gate[..m * c.ffn], &mut s.up[..m * c.ffn]);
            match &layer.gate_up {
                GateUp::Separate { w_gate, w_up } => backend.matmul_many(
                    &[self.matrix(w_gate), self.matrix(w_up)],
                    h,
                    m,
                    &mut [&mut *gate, &mut *up],
                    &mut s.scratch,
                ),
                GateUp::Fused(w) => {
                    let f = c.ffn;
                    let fused = &mut s.fused[..m * 2 * f];
                    backend.matmul(&self.matrix(w), h, m, fused, &mut s.scratch);
                    for (i, row) in fused.chunks_exact(2 * f).enumerate() {
                        gate[i * f..(i + 1) * f].copy_from_slice(&row[..f]);
                        up[i * f..(i + 1) * f].copy_from_slice(&row[f..]);
                    }
                }
            }
            let gelu = self.family.activation == Activation::GeluTanh;
            backend.gated_activation(gelu, gate, up);
            backend.matmul(&self.matrix(&layer.w_down), gate, m, o, &mut s.scratch);
            if let Some(norm) = &layer.post_ffn_norm {
                backend.rms_norm_rows(o, norm, c.norm_eps, h);
                kernels::ops::add_assign(x, h);
            } else {
                kernels::ops::add_assign(x, o);
            }
        }

        let n_rows = batch.logit_rows.len();
        if n_rows == 0 {
            s.logits.clear();
            return Ok(());
        }
        for (j, &row) in batch.logit_rows.iter().enumerate() {
            s.o[j * hid..(j + 1) * hid].copy_from_slice(&s.x[row * hid..(row + 1) * hid]);
        }
        let h = &mut s.h[..n_rows * hid];
        backend.rms_norm_rows(&s.o[..n_rows * hid], &self.output_norm, c.norm_eps, h);
        s.logits.resize(n_rows * c.vocab_size, 0.0);
        backend.matmul(
            &self.matrix(&self.output),
            h,
            n_rows,
            &mut s.logits,
            &mut s.scratch,
        );
        Ok(())
    }
}

/// Which rows of a forward pass need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitRows {
    /// Only the last token (generation).
    Last,
    /// Every token (perplexity, prompt logprobs).
    All,
}

/// The rows of one forward pass: tokens of one or more sequences, each at its own position, and
/// the block table of every sequence.
#[derive(Debug, Default, Clone)]
pub struct Batch {
    pub tokens: Vec<u32>,
    pub positions: Vec<usize>,
    /// Index of the row's sequence in the tables.
    pub row_seq: Vec<usize>,
    /// Rows whose logits are wanted, in output order.
    pub logit_rows: Vec<usize>,
    /// The attention export ([`crate::explain`]): per row its capture slot or
    /// [`NOT_CAPTURED`] (empty: nothing captured), the layers captured (ascending) and the keys
    /// kept per head. The slots must be `0..n` without gaps: the pass writes
    /// `capture_layers × n × heads × capture_top_k` entries to [`ForwardState::attention`],
    /// layer `capture_layers[i]` at `i·n·heads·top_k`, slot `s`, head `h` at
    /// `(s·heads + h)·top_k` within it.
    pub capture_slots: Vec<u32>,
    pub capture_layers: Vec<usize>,
    pub capture_top_k: usize,
    table_blocks: Vec<u32>,
    table_ranges: Vec<Range<usize>>,
}

impl Batch {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.positions.clear();
        self.row_seq.clear();
        self.logit_rows.clear();
        self.capture_slots.clear();
        self.capture_layers.clear();
        self.capture_top_k = 0;
        self.table_blocks.clear();
        self.table_ranges.clear();
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Rows in the batch.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Sequences in the batch.
    pub fn sequences(&self) -> usize {
        self.table_ranges.len()
    }

    /// The block table of sequence `seq`.
    pub fn table(&self, seq: usize) -> &[u32] {
        &self.table_blocks[self.table_ranges[seq].clone()]
    }

    /// Adds `tokens` of a sequence at positions `first_pos..` with its block table; returns the
    /// sequence's index. With `all_logits`, every row of it is added to `logit_rows`.
    pub fn push_sequence(
        &mut self,
        table: &[u32],
        tokens: &[u32],
        first_pos: usize,
        all_logits: bool,
    ) -> usize {
        let seq = self.table_ranges.len();
        let at = self.table_blocks.len();
        self.table_blocks.extend_from_slice(table);
        self.table_ranges.push(at..self.table_blocks.len());
        let first_row = self.tokens.len();
        self.tokens.extend_from_slice(tokens);
        self.positions
            .extend((0..tokens.len()).map(|i| first_pos + i));
        self.row_seq.extend(std::iter::repeat_n(seq, tokens.len()));
        if all_logits {
            self.logit_rows.extend(first_row..self.tokens.len());
        }
        seq
    }
}

/// Activation buffers of the forward pass, grown to the largest batch seen and then reused.
#[derive(Debug, Default)]
pub struct ForwardState {
    rows: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    o: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// A fused projection's output (Phi-3's QKV, gate/up) before it is split.
    fused: Vec<f32>,
    /// Logits of the selected rows, `rows × vocab`.
    pub logits: Vec<f32>,
    /// The attention export of the last pass (see [`Batch::capture_slots`]).
    pub attention: Vec<Attended>,
    scratch: Scratch,
    batch: Batch,
}

impl ForwardState {
    fn ensure(&mut self, c: &ModelConfig, rows: usize) {
        if rows <= self.rows {
            return;
        }
        let (qd, kvd) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        self.rows = rows;
        self.x.resize(rows * c.hidden, 0.0);
        self.h.resize(rows * c.hidden, 0.0);
        self.q.resize(rows * qd, 0.0);
        self.k.resize(rows * kvd, 0.0);
        self.v.resize(rows * kvd, 0.0);
        self.att.resize(rows * qd, 0.0);
        self.o.resize(rows * c.hidden, 0.0);
        self.gate.resize(rows * c.ffn, 0.0);
        self.up.resize(rows * c.ffn, 0.0);
        self.fused.resize(rows * (qd + 2 * kvd).max(2 * c.ffn), 0.0);
    }
}
