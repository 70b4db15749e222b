//! Hugging Face checkpoint folders of the llama family: `config.json` gives the network's shape
//! and family (`LlamaForCausalLM`, `Qwen2ForCausalLM`), the safetensors files (one
//! `model.safetensors`, or the shards `model.safetensors.index.json` names) give the weights,
//! which the decoder then finds by their GGUF names (see [`formats::hf`]).
//!
//! Hugging Face keeps Q/K rows in their original order, so these models rotate NeoX-style
//! (pairs `(i, i + d/2)`) where a llama GGUF of the same model rotates adjacent pairs of rows
//! that llama.cpp's converter permuted. The folder's tokenizer is read by
//! [`crate::tokenizer::Tokenizer::from_hf_folder`].
//!
//! Everything a checkpoint could get wrong is an error naming the file and field: a missing
//! `config.json` or key, an architecture or option the decoder does not implement (sliding
//! windows, partial rotary, another activation, an unknown RoPE scaling), a missing or misshapen
//! tensor, and tensors the decoder would silently ignore (an `o_proj` bias, say).

use std::collections::{HashMap, HashSet};
use std::path::Path;

use formats::hf::gguf_tensor_name_of;
use formats::safetensors::{SafetensorsFile, ShardIndex};
use kernels::ops::RopeScaling;
use serde::Deserialize;
use serde_json::Value as Json;

use crate::arch::{family_of_hf_class, family_of_model_type, Activation, Family, HfLayout};
use crate::error::EngineError;
use crate::model::ModelConfig;
use crate::weights::{dtype_of_safetensors, tensor_error, StoredTensor, Weights};

/// The model configuration file of a checkpoint folder.
pub const CONFIG_FILE: &str = "config.json";
/// The weights of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The shard index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Most tensor names one error message lists.
const LISTED_NAMES: usize = 5;

/// The fields of `config.json` the engine reads; the many others are ignored.
#[derive(Debug, Default, Deserialize)]
pub struct HfConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub max_position_embeddings: Option<usize>,
    pub vocab_size: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<Json>,
    pub tie_word_embeddings: Option<bool>,
    pub hidden_act: Option<String>,
    /// Gemma's name for `hidden_act`.
    pub hidden_activation: Option<String>,
    pub use_sliding_window: Option<bool>,
    pub sliding_window: Option<usize>,
    /// Gemma 3: every n-th layer is global (older configs; newer ones list `layer_types`).
    pub sliding_window_pattern: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    pub query_pre_attn_scalar: Option<f64>,
    pub rope_local_base_freq: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
}

fn load_error(dir: &Path, reason: impl std::fmt::Display) -> EngineError {
    EngineError::Load(format!("{}: {reason}", dir.display()))
}

impl HfConfig {
    /// Reads `config.json` in `dir`.
    pub fn read(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join(CONFIG_FILE);
        if !path.is_file() {
            return Err(load_error(
                dir,
                "config.json is missing (a Hugging Face model folder holds config.json, the \
                 safetensors weights and tokenizer.json)",
            ));
        }
        let text = std::fs::read_to_string(&path).map_err(|e| load_error(&path, e))?;
        serde_json::from_str(&text).map_err(|e| load_error(&path, e))
    }

    /// The family the configuration names: its first `architectures` entry the engine knows,
    /// or, without `architectures`, its `model_type`.
    pub fn family(&self) -> Result<&'static Family, EngineError> {
        if let Some(f) = self
            .architectures
            .iter()
            .find_map(|class| family_of_hf_class(class))
        {
            return Ok(f);
        }
        if self.architectures.is_empty() {
            if let Some(f) = self.model_type.as_deref().and_then(family_of_model_type) {
                return Ok(f);
            }
        }
        let named = self
            .architectures
            .first()
            .cloned()
            .or_else(|| self.model_type.clone())
            .unwrap_or_else(|| "(config.json names no architectures)".into());
        Err(EngineError::UnsupportedArchitecture(named))
    }

    /// The network's shape, checked for what the decoder implements. `vocab_size` is the
    /// configuration's; the loader checks it against the embedding.
    pub fn model_config(&self, family: &Family) -> Result<ModelConfig, EngineError> {
        let bad = |reason: String| EngineError::Load(format!("config.json: {reason}"));
        let need = |value: Option<usize>, key: &str| -> Result<usize, EngineError> {
            match value {
                None => Err(bad(format!("{key} is missing"))),
                Some(0) => Err(bad(format!("{key} is 0"))),
                Some(v) => Ok(v),
            }
        };
        let hidden = need(self.hidden_size, "hidden_size")?;
        let heads = need(self.num_attention_heads, "num_attention_heads")?;
        let kv_heads = need(
            self.num_key_value_heads.or(self.num_attention_heads),
            "num_key_value_heads",
        )?;
        if heads % kv_heads != 0 {
            return Err(bad(format!(
                "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )));
        }
        let head_dim = match self.head_dim {
            Some(d) => d,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(bad(format!(
                    "hidden_size {hidden} is not a multiple of num_attention_heads {heads} and \
                     head_dim is not given"
                )))
            }
        };
        if head_dim == 0 || head_dim % 2 != 0 || head_dim > 512 {
            return Err(bad(format!(
                "head_dim {head_dim} is not an even number up to 512"
            )));
        }
        let wanted = match family.activation {
            Activation::Silu => &["silu"][..],
            Activation::GeluTanh => &["gelu_pytorch_tanh", "gelu_new", "gelu_tanh"][..],
        };
        for act in [&self.hidden_act, &self.hidden_activation]
            .into_iter()
            .flatten()
        {
            if !wanted.contains(&act.as_str()) {
                return Err(bad(format!(
                    "hidden activation {act:?} is not supported (the {} decoder uses {})",
                    family.name, wanted[0]
                )));
            }
        }
        for (key, cap) in [
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
        ] {
            if let Some(cap) = cap {
                return Err(bad(format!("{key} {cap} is not supported")));
            }
        }
        if let Some(f) = self.partial_rotary_factor {
            if f != 1.0 {
                return Err(bad(format!("partial_rotary_factor {f} is not supported")));
            }
        }
        if family.sliding_pattern == 0 && self.use_sliding_window == Some(true) {
            return Err(bad(format!(
                "use_sliding_window is true; the {} decoder has no sliding-window layers",
                family.name
            )));
        }
        let block_count = need(self.num_hidden_layers, "num_hidden_layers")?;
        let sliding_window = if family.sliding_pattern == 1 {
            // Every layer windowed when the configuration gives a window (Mistral 7B v0.1,
            // Phi-3) and does not switch it off.
            self.sliding_window
                .filter(|&w| w > 0 && self.use_sliding_window != Some(false))
        } else if family.sliding_pattern > 1 {
            let window = need(self.sliding_window, "sliding_window")?;
            // The layer pattern the decoder implements must be the checkpoint's.
            let expected = |l: usize| {
                if family.is_sliding(l) {
                    "sliding_attention"
                } else {
                    "full_attention"
                }
            };
            if let Some(types) = &self.layer_types {
                if let Some((l, t)) = types
                    .iter()
                    .enumerate()
                    .find(|(l, t)| t.as_str() != expected(*l))
                {
                    return Err(bad(format!(
                        "layer_types[{l}] is {t:?}; the {} decoder makes every {}th layer global",
                        family.name, family.sliding_pattern
                    )));
                }
            }
            if let Some(p) = self.sliding_window_pattern {
                if p != family.sliding_pattern {
                    return Err(bad(format!(
                        "sliding_window_pattern {p} is not supported (the {} decoder's is {})",
                        family.name, family.sliding_pattern
                    )));
                }
            }
            if let (Some(local), Some(theta)) =
                (self.rope_local_base_freq, family.sliding_rope_theta)
            {
                if (local as f32 - theta).abs() > 1e-3 * theta {
                    return Err(bad(format!(
                        "rope_local_base_freq {local} is not supported (the {} decoder's is {theta})",
                        family.name
                    )));
                }
            }
            Some(window)
        } else {
            None
        };
        Ok(ModelConfig {
            architecture: family.name.to_string(),
            block_count,
            hidden,
            ffn: need(self.intermediate_size, "intermediate_size")?,
            heads,
            kv_heads,
            head_dim,
            context_length: need(self.max_position_embeddings, "max_position_embeddings")?,
            vocab_size: need(self.vocab_size, "vocab_size")?,
            // The defaults of transformers' LlamaConfig and Qwen2Config.
            norm_eps: self.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: self.rope_theta.unwrap_or(10000.0) as f32,
            rope_dims: head_dim,
            rope_scaling: rope_scaling(self.rope_scaling.as_ref())
                .map_err(|e| bad(e.to_string()))?,
            sliding_window,
            query_pre_attn_scalar: self
                .query_pre_attn_scalar
                .map(|s| s as f32)
                .filter(|&s| s != head_dim as f32),
        })
    }
}

/// Why `rope_scaling` of `config.json` is not one we can run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RopeScalingError {
    #[error("rope_scaling is neither null nor an object")]
    NotAnObject,
    #[error("rope_scaling {kind:?} needs a number {key}")]
    MissingNumber { kind: String, key: String },
    #[error("rope_scaling type {0:?} is not supported (supported: default, linear, llama3)")]
    Unsupported(String),
}

/// `rope_scaling` of `config.json`: absent, `null` or `default`, `linear`, or `llama3`
/// (Llama 3.1's smooth frequency scaling).
fn rope_scaling(value: Option<&Json>) -> Result<RopeScaling, RopeScalingError> {
    let Some(value) = value.filter(|v| !v.is_null()) else {
        return Ok(RopeScaling::None);
    };
    let fields = value.as_object().ok_or(RopeScalingError::NotAnObject)?;
    let kind = fields
        .get("rope_type")
        .or_else(|| fields.get("type"))
        .and_then(Json::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<f32, RopeScalingError> {
        fields
            .get(key)
            .and_then(Json::as_f64)
            .map(|v| v as f32)
            .ok_or_else(|| RopeScalingError::MissingNumber {
                kind: kind.to_string(),
                key: key.to_string(),
            })
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: number("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: number("factor")?,
            low_freq_factor: number("low_freq_factor")?,
            high_freq_factor: number("high_freq_factor")?,
            original_context: number("original_max_position_embeddings")?,
        },
        other => return Err(RopeScalingError::Unsupported(other.to_string())),
    })
}

/// A checkpoint folder's shape, family and weights.
pub(crate) struct Checkpoint {
    pub config: ModelConfig,
    pub family: &'static Family,
    pub weights: Weights,
}

/// Reads `config.json` and maps the safetensors weights of `dir`.
pub(crate) fn open(dir: &Path) -> Result<Checkpoint, EngineError> {
    let hf = HfConfig::read(dir)?;
    let family = hf.family()?;
    let config = hf.model_config(family)?;
    // Gemma ties its output to the embeddings unless the configuration says otherwise.
    let gemma = family.hf_layout == HfLayout::Gemma;
    let tied = hf.tie_word_embeddings.unwrap_or(gemma);

    // The files, and for a sharded checkpoint the shard the index assigns each tensor to.
    let index_path = dir.join(INDEX_FILE);
    let (file_names, assigned): (Vec<String>, Option<HashMap<String, String>>) =
        if index_path.is_file() {
            let index = ShardIndex::read(&index_path).map_err(|e| load_error(dir, e))?;
            let shards = index.shards().into_iter().map(str::to_string).collect();
            (shards, Some(index.weight_map.into_iter().collect()))
        } else if dir.join(SINGLE_FILE).is_file() {
            (vec![SINGLE_FILE.to_string()], None)
        } else {
            return Err(load_error(
                dir,
                format!("neither {SINGLE_FILE} nor {INDEX_FILE} is present"),
            ));
        };
    let mut files = Vec::with_capacity(file_names.len());
    let mut tensors: HashMap<String, StoredTensor> = HashMap::new();
    let mut unused: Vec<String> = Vec::new();
    let mut seen: HashSet<String> = HashSet::new();
    for (i, file_name) in file_names.iter().enumerate() {
        let path = dir.join(file_name);
        let file = SafetensorsFile::open(&path).map_err(|e| load_error(&path, e))?;
        for t in &file.tensors {
            if let Some(assigned) = &assigned {
                if assigned.get(&t.name) != Some(file_name) {
                    // The index is authoritative: a copy elsewhere is not the model's.
                    continue;
                }
            }
            seen.insert(t.name.clone());
            // Older exports keep RoPE's inverse frequencies as a buffer; the engine computes them.
            if t.name.ends_with(".rotary_emb.inv_freq") {
                continue;
            }
            let Some(name) = gguf_tensor_name_of(&t.name, gemma) else {
                unused.push(t.name.clone());
                continue;
            };
            if tied && name == "output.weight" {
                // Tied checkpoints sometimes store the shared matrix twice; the embedding serves.
                continue;
            }
            tensors.insert(
                name,
                StoredTensor {
                    file_name: t.name.clone(),
                    type_name: t.dtype.clone(),
                    dtype: dtype_of_safetensors(&t.dtype),
                    shape: t.shape.iter().map(|&d| d as usize).collect(),
                    file: i,
                    range: file.tensor_range(t),
                },
            );
        }
        files.push(file);
    }
    if let Some(assigned) = &assigned {
        let mut absent: Vec<&String> = assigned.keys().filter(|n| !seen.contains(*n)).collect();
        absent.sort();
        if let Some(name) = absent.first() {
            return Err(tensor_error(
                name,
                format!(
                    "{INDEX_FILE} places it in {}, which does not hold it",
                    assigned[*name]
                ),
            ));
        }
    }

    // Tensors the decoder would not read would be silently dropped: refuse them instead.
    let mut expected: HashSet<String> = ["token_embd.weight", "output_norm.weight"]
        .into_iter()
        .map(String::from)
        .collect();
    if !tied {
        expected.insert("output.weight".into());
    }
    for l in 0..config.block_count {
        for t in [
            "attn_norm.weight",
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_q.bias",
            "attn_k.bias",
            "attn_v.bias",
            "attn_output.weight",
            "attn_qkv.weight",
            "attn_q_norm.weight",
            "attn_k_norm.weight",
            "post_attention_norm.weight",
            "ffn_norm.weight",
            "ffn_gate.weight",
            "ffn_up.weight",
            "ffn_down.weight",
            "post_ffw_norm.weight",
        ] {
            expected.insert(format!("blk.{l}.{t}"));
        }
    }
    unused.extend(
        tensors
            .iter()
            .filter(|(name, _)| !expected.contains(*name))
            .map(|(_, t)| t.file_name.clone()),
    );
    if !unused.is_empty() {
        unused.sort();
        let more = unused.len().saturating_sub(LISTED_NAMES);
        let mut list = unused[..unused.len().min(LISTED_NAMES)].join(", ");
        if more > 0 {
            list.push_str(&format!(" and {more} more"));
        }
        return Err(load_error(
            dir,
            format!(
                "the checkpoint holds tensors the {} decoder does not use ({list}); it would \
                 compute something else than the model",
                family.name
            ),
        ));
    }
    if !tied && !tensors.contains_key("output.weight") {
        return Err(tensor_error(
            "lm_head.weight",
            "missing (config.json does not set tie_word_embeddings)",
        ));
    }
    let embedding = tensors
        .get("token_embd.weight")
        .ok_or_else(|| tensor_error("model.embed_tokens.weight", "missing"))?;
    if embedding.shape.first() != Some(&config.vocab_size) {
        return Err(tensor_error(
            "model.embed_tokens.weight",
            format!(
                "shape {:?}, but config.json has vocab_size {}",
                embedding.shape, config.vocab_size
            ),
        ));
    }
    Ok(Checkpoint {
        config,
        family,
        weights: Weights::from_safetensors(files, tensors),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> HfConfig {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn reads_the_llama_shape_with_defaults() {
        let c = config(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
                "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,
                "max_position_embeddings":8192,"vocab_size":49152,"rope_theta":100000,
                "rms_norm_eps":1e-05,"hidden_act":"silu","rope_scaling":null,"unknown_key":[1]}"#,
        );
        let family = c.family().unwrap();
        assert_eq!(family.name, "llama");
        let m = c.model_config(family).unwrap();
        assert_eq!(
            (m.hidden, m.heads, m.kv_heads, m.head_dim, m.rope_dims),
            (576, 9, 3, 64, 64)
        );
        assert_eq!((m.rope_theta, m.norm_eps), (100000.0, 1e-5));
        assert_eq!(m.rope_scaling, RopeScaling::None);
    }

    #[test]
    fn mistral_is_llama_with_a_window_on_every_layer() {
        let base = r#""hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":32768,
            "vocab_size":10,"rope_theta":1000000.0"#;
        for (extra, window) in [
            (
                r#""architectures":["MistralForCausalLM"],"sliding_window":4096"#,
                Some(4096),
            ),
            (
                r#""architectures":["MistralForCausalLM"],"sliding_window":null"#,
                None,
            ),
            (
                r#""model_type":"mistral","sliding_window":4096"#,
                Some(4096),
            ),
            (
                r#""model_type":"mistral","sliding_window":4096,"use_sliding_window":false"#,
                None,
            ),
            // Llama configurations carry no window.
            (r#""model_type":"llama""#, None),
        ] {
            let c = config(&format!("{{{base},{extra}}}"));
            let family = c.family().unwrap();
            assert_eq!(family.name, "llama", "{extra}");
            let m = c.model_config(family).unwrap();
            assert_eq!(m.sliding_window, window, "{extra}");
            assert!((0..2).all(|l| family.is_sliding(l)));
        }
    }

    #[test]
    fn reads_llama3_rope_scaling_and_an_explicit_head_dim() {
        let c = config(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
                "num_hidden_layers":1,"num_attention_heads":2,"head_dim":48,
                "max_position_embeddings":256,"vocab_size":10,
                "rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,
                                "high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#,
        );
        let m = c.model_config(c.family().unwrap()).unwrap();
        assert_eq!((m.head_dim, m.kv_heads), (48, 2));
        assert_eq!(
            m.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 8192.0
            }
        );
    }

    #[test]
    fn refuses_what_the_decoder_does_not_implement() {
        let base = r#""hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
            "num_attention_heads":2,"max_position_embeddings":256,"vocab_size":10"#;
        for (extra, needle) in [
            (
                r#""architectures":["MixtralForCausalLM"]"#,
                "\"MixtralForCausalLM\" is not supported",
            ),
            (r#""architectures":[]"#, "names no architectures"),
            (
                r#""model_type":"qwen2","hidden_act":"gelu""#,
                "hidden activation \"gelu\"",
            ),
            (
                r#""model_type":"gemma3","hidden_activation":"gelu_pytorch_tanh","sliding_window":512,"layer_types":["sliding_attention","full_attention"]"#,
                "layer_types[1]",
            ),
            (
                r#""model_type":"gemma3","hidden_activation":"gelu_pytorch_tanh""#,
                "sliding_window is missing",
            ),
            (
                r#""model_type":"gemma3","sliding_window":512,"final_logit_softcapping":30.0"#,
                "final_logit_softcapping",
            ),
            (
                r#""model_type":"qwen2","use_sliding_window":true"#,
                "sliding-window",
            ),
            (
                r#""model_type":"llama","partial_rotary_factor":0.5"#,
                "partial_rotary_factor",
            ),
            (
                r#""model_type":"llama","rope_scaling":{"type":"yarn","factor":4}"#,
                "\"yarn\"",
            ),
            (
                r#""model_type":"llama","rope_scaling":{"rope_type":"llama3","factor":8}"#,
                "low_freq_factor",
            ),
            (
                r#""model_type":"llama","num_key_value_heads":3"#,
                "not a multiple",
            ),
        ] {
            let c = config(&format!("{{{base},{extra}}}"));
            let err = c
                .family()
                .and_then(|f| c.model_config(f))
                .expect_err(extra)
                .to_string();
            assert!(err.contains(needle), "{extra}: {err}");
        }
        let c = config(r#"{"model_type":"llama","hidden_size":64}"#);
        let err = c.model_config(c.family().unwrap()).unwrap_err().to_string();
        assert!(err.contains("num_attention_heads is missing"), "{err}");
    }
}
