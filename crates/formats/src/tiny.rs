//! Tiny models in the real formats, with deterministic random weights, for tests.
//!
//! Unit tests across the workspace use these instead of downloads: a few layers and a small
//! hidden size, but the exact tensor names, layouts, metadata keys and tokenizer encoding of a
//! llama- or qwen2-architecture GGUF as llama.cpp writes it, and of the Hugging Face checkpoint
//! folder the same weights come from (`config.json`, safetensors, single or sharded, with Q/K in
//! the Hugging Face row order, `tokenizer.json` and its configuration).

use std::path::Path;

use half::{bf16, f16};
use serde_json::json;

use crate::byte_level::gpt2_byte_tokens;
use crate::gguf::{Array, GgmlType, GgufWriteError, GgufWriter};
use crate::hf::{hf_tensor_name, unpermute_qk};
use crate::safetensors::{SafetensorsWriteError, SafetensorsWriter};

/// The shape and tokenizer of a tiny llama model.
#[derive(Debug, Clone)]
pub struct TinyLlama {
    pub block_count: u32,
    pub embedding_length: u32,
    pub feed_forward_length: u32,
    pub head_count: u32,
    pub head_count_kv: u32,
    pub context_length: u32,
    /// Vocabulary by id.
    pub tokens: Vec<String>,
    /// BPE merges in rank order (`"left right"`).
    pub merges: Vec<String>,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
    pub chat_template: Option<String>,
    /// Omit `output.weight` and reuse the embedding.
    pub tied_embeddings: bool,
    /// Seed of the weight generator.
    pub seed: u64,
    pub architecture: TinyArchitecture,
    /// Element type of the weight matrices (GGUF keeps norms and biases in F32, Hugging Face
    /// checkpoints store every tensor in it). Weights are rounded to it, so a GGUF and a Hugging
    /// Face folder of the same model hold exactly the same numbers.
    pub weight_type: TinyFloat,
}

/// The family of a tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyArchitecture {
    /// Llama: the GGUF stores Q/K rows permuted for pairwise RoPE (as llama.cpp's converter does).
    Llama,
    /// Qwen2: Q/K/V biases, Hugging Face row order in both formats.
    Qwen2,
    /// Mistral: llama's network with every layer attending over the last `sliding_window`
    /// positions (`MistralForCausalLM` folders; a `llama` GGUF with `attention.sliding_window`).
    Mistral { sliding_window: u32 },
}

impl TinyArchitecture {
    /// `general.architecture` of the GGUF.
    pub fn name(self) -> &'static str {
        match self {
            TinyArchitecture::Llama | TinyArchitecture::Mistral { .. } => "llama",
            TinyArchitecture::Qwen2 => "qwen2",
        }
    }

    /// `model_type` of the Hugging Face folder.
    pub fn model_type(self) -> &'static str {
        match self {
            TinyArchitecture::Llama => "llama",
            TinyArchitecture::Qwen2 => "qwen2",
            TinyArchitecture::Mistral { .. } => "mistral",
        }
    }

    /// The Hugging Face `architectures` entry.
    pub fn hf_class(self) -> &'static str {
        match self {
            TinyArchitecture::Llama => "LlamaForCausalLM",
            TinyArchitecture::Qwen2 => "Qwen2ForCausalLM",
            TinyArchitecture::Mistral { .. } => "MistralForCausalLM",
        }
    }

    /// The attention window of every layer, if the family has one.
    pub fn sliding_window(self) -> Option<u32> {
        match self {
            TinyArchitecture::Mistral { sliding_window } => Some(sliding_window),
            _ => None,
        }
    }
}

/// A float element type of weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TinyFloat {
    F32,
    F16,
    BF16,
}

impl TinyFloat {
    /// The value as stored in this type, back as f32.
    pub fn round(self, v: f32) -> f32 {
        match self {
            TinyFloat::F32 => v,
            TinyFloat::F16 => f16::from_f32(v).to_f32(),
            TinyFloat::BF16 => bf16::from_f32(v).to_f32(),
        }
    }

    /// Little-endian bytes of `values` in this type.
    pub fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            TinyFloat::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            TinyFloat::F16 => values
                .iter()
                .flat_map(|&v| f16::from_f32(v).to_le_bytes())
                .collect(),
            TinyFloat::BF16 => values
                .iter()
                .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
                .collect(),
        }
    }

    /// The safetensors dtype name.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            TinyFloat::F32 => "F32",
            TinyFloat::F16 => "F16",
            TinyFloat::BF16 => "BF16",
        }
    }

    /// `torch_dtype` in `config.json`.
    pub fn torch_name(self) -> &'static str {
        match self {
            TinyFloat::F32 => "float32",
            TinyFloat::F16 => "float16",
            TinyFloat::BF16 => "bfloat16",
        }
    }

    pub fn ggml_type(self) -> GgmlType {
        match self {
            TinyFloat::F32 => GgmlType::F32,
            TinyFloat::F16 => GgmlType::F16,
            TinyFloat::BF16 => GgmlType::BF16,
        }
    }
}

impl Default for TinyLlama {
    /// Two layers, hidden size 64, GQA (4 heads, 2 KV heads), a byte-level BPE vocabulary of
    /// three special tokens + 256 bytes + a few merges, and a ChatML template.
    fn default() -> Self {
        let mut tokens = vec![
            "<|endoftext|>".to_string(),
            "<|im_start|>".into(),
            "<|im_end|>".into(),
        ];
        tokens.extend(gpt2_byte_tokens());
        let merges = vec!["Ġ t", "h e", "Ġt he", "i n", "Ġ a"];
        for m in &merges {
            tokens.push(m.replace(' ', ""));
        }
        Self {
            block_count: 2,
            embedding_length: 64,
            feed_forward_length: 128,
            head_count: 4,
            head_count_kv: 2,
            context_length: 256,
            tokens,
            merges: merges.into_iter().map(String::from).collect(),
            bos_token_id: 1,
            eos_token_id: 2,
            chat_template: Some(
                "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into(),
            ),
            tied_embeddings: true,
            seed: 42,
            architecture: TinyArchitecture::Llama,
            weight_type: TinyFloat::F32,
        }
    }
}

/// A family's control-token spelling (never a byte token or a merge of the default vocabulary).
fn looks_like_control(t: &str) -> bool {
    let bracketed = t.len() > 2
        && t.starts_with('[')
        && t.ends_with(']')
        && t[1..t.len() - 1]
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b == b'_' || b == b'/');
    (t.len() > 4 && t.starts_with("<|") && t.ends_with("|>"))
        || bracketed
        || t == "<s>"
        || t == "</s>"
}

/// splitmix64: a tiny, good-enough deterministic generator for test weights.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-scale, scale).
    fn weight(&mut self, scale: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        (unit * 2.0 - 1.0) * scale
    }
}

fn random_values(rng: &mut SplitMix, n: u64, scale: f32, around_one: bool) -> Vec<f32> {
    (0..n)
        .map(|_| rng.weight(scale) + if around_one { 1.0 } else { 0.0 })
        .collect()
}

/// One generated tensor, named and shaped as in the GGUF (ggml dims: contiguous first), its
/// values in the GGUF's row order.
struct Generated {
    name: String,
    dims: Vec<u64>,
    values: Vec<f32>,
}

/// A `tokenizer.json` for a byte-level BPE vocabulary (GPT-2 alphabet): every token in the model
/// vocabulary, the `special` ones also as added special tokens, merges as pairs; the
/// pre-tokenizer splits digits one by one first when `split_digits` (llama.cpp's `smollm`).
pub fn byte_level_tokenizer_json(
    tokens: &[String],
    merges: &[String],
    special: &[bool],
    split_digits: bool,
) -> serde_json::Value {
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| special.get(*i).copied().unwrap_or(false))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let pairs: Vec<serde_json::Value> = merges
        .iter()
        .filter_map(|m| m.split_once(' '))
        .map(|(a, b)| json!([a, b]))
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let pre_tokenizer = if split_digits {
        json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level.clone()]})
    } else {
        byte_level.clone()
    };
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": byte_level.clone(),
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": pairs
        }
    })
}

/// Writes `value` as pretty JSON to `dir/name`.
fn write_json(dir: &Path, name: &str, value: &serde_json::Value) -> std::io::Result<()> {
    let text = serde_json::to_string_pretty(value).expect("JSON values serialize");
    std::fs::write(dir.join(name), text)
}

impl TinyLlama {
    fn head_dim(&self) -> u64 {
        u64::from(self.embedding_length) / u64::from(self.head_count.max(1))
    }

    /// Every tensor, in GGUF names, dims and row order.
    fn generate(&self) -> Vec<Generated> {
        let hidden = u64::from(self.embedding_length);
        let ffn = u64::from(self.feed_forward_length);
        let kv_dim = self.head_dim() * u64::from(self.head_count_kv);
        let vocab = self.tokens.len() as u64;
        let mut rng = SplitMix(self.seed);
        let scale = 1.0 / (hidden as f32).sqrt();
        let mut out = Vec::new();
        let matrix = |rng: &mut SplitMix, name: String, cols: u64, rows: u64| Generated {
            name,
            dims: vec![cols, rows],
            values: random_values(rng, cols * rows, scale, false),
        };
        let norm = |rng: &mut SplitMix, name: String| Generated {
            name,
            dims: vec![hidden],
            values: random_values(rng, hidden, 0.1, true),
        };
        out.push(matrix(&mut rng, "token_embd.weight".into(), hidden, vocab));
        for layer in 0..self.block_count {
            let name = |t: &str| format!("blk.{layer}.{t}.weight");
            out.push(norm(&mut rng, name("attn_norm")));
            out.push(matrix(&mut rng, name("attn_q"), hidden, hidden));
            out.push(matrix(&mut rng, name("attn_k"), hidden, kv_dim));
            out.push(matrix(&mut rng, name("attn_v"), hidden, kv_dim));
            if self.architecture == TinyArchitecture::Qwen2 {
                for (t, len) in [("attn_q", hidden), ("attn_k", kv_dim), ("attn_v", kv_dim)] {
                    out.push(Generated {
                        name: format!("blk.{layer}.{t}.bias"),
                        dims: vec![len],
                        values: random_values(&mut rng, len, 0.1, false),
                    });
                }
            }
            out.push(matrix(&mut rng, name("attn_output"), hidden, hidden));
            out.push(norm(&mut rng, name("ffn_norm")));
            out.push(matrix(&mut rng, name("ffn_gate"), hidden, ffn));
            out.push(matrix(&mut rng, name("ffn_up"), hidden, ffn));
            out.push(matrix(&mut rng, name("ffn_down"), ffn, hidden));
        }
        out.push(norm(&mut rng, "output_norm.weight".into()));
        if !self.tied_embeddings {
            out.push(matrix(&mut rng, "output.weight".into(), hidden, vocab));
        }
        if self.weight_type != TinyFloat::F32 {
            for t in &mut out {
                for v in &mut t.values {
                    *v = self.weight_type.round(*v);
                }
            }
        }
        out
    }

    /// The GGUF file's bytes (matrices in `weight_type`, norms and biases F32).
    pub fn to_gguf(&self) -> Result<Vec<u8>, GgufWriteError> {
        let arch = self.architecture.name();
        let vocab = self.tokens.len() as u64;
        let file_type: u32 = match self.weight_type {
            TinyFloat::F32 => 0,
            TinyFloat::F16 => 1,
            TinyFloat::BF16 => 32,
        };
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", arch)?
            .metadata("general.name", format!("tiny-{arch}"))?
            .metadata("general.file_type", file_type)?;
        for (key, value) in [
            ("block_count", self.block_count),
            ("context_length", self.context_length),
            ("embedding_length", self.embedding_length),
            ("feed_forward_length", self.feed_forward_length),
            ("attention.head_count", self.head_count),
            ("attention.head_count_kv", self.head_count_kv),
        ] {
            w.metadata(&format!("{arch}.{key}"), value)?;
        }
        w.metadata(&format!("{arch}.rope.freq_base"), 10000.0f32)?
            .metadata(
                &format!("{arch}.rope.dimension_count"),
                self.head_dim() as u32,
            )?
            .metadata(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-5f32)?
            .metadata(&format!("{arch}.vocab_size"), vocab as u32)?;
        if let Some(window) = self.architecture.sliding_window() {
            w.metadata(&format!("{arch}.attention.sliding_window"), window)?;
        }
        w.metadata("tokenizer.ggml.model", "gpt2")?
            .metadata("tokenizer.ggml.pre", "smollm")?
            .metadata("tokenizer.ggml.tokens", Array::String(self.tokens.clone()))?;
        let token_types: Vec<i32> = self
            .special()
            .iter()
            .map(|&s| if s { 3 } else { 1 })
            .collect();
        w.metadata("tokenizer.ggml.token_type", Array::I32(token_types))?
            .metadata("tokenizer.ggml.merges", Array::String(self.merges.clone()))?
            .metadata("tokenizer.ggml.bos_token_id", self.bos_token_id)?
            .metadata("tokenizer.ggml.eos_token_id", self.eos_token_id)?
            .metadata("tokenizer.ggml.unknown_token_id", 0u32)?
            .metadata("tokenizer.ggml.padding_token_id", self.eos_token_id)?
            .metadata("tokenizer.ggml.add_bos_token", false)?;
        if let Some(t) = &self.chat_template {
            w.metadata("tokenizer.chat_template", t.as_str())?;
        }
        for t in self.generate() {
            let (ggml_type, bytes) = if t.dims.len() == 2 {
                (
                    self.weight_type.ggml_type(),
                    self.weight_type.encode(&t.values),
                )
            } else {
                (GgmlType::F32, TinyFloat::F32.encode(&t.values))
            };
            w.tensor(&t.name, &t.dims, ggml_type, bytes)?;
        }
        w.to_bytes()
    }

    /// Which tokens are special: the first three (`<|endoftext|>`, `<|im_start|>`,
    /// `<|im_end|>`) and any added token written as a family's control tokens are (`<|...|>`,
    /// `[UPPER_CASE]`, `<s>`, `</s>`), so a test can give a model Llama's, Mistral's or Phi's.
    fn special(&self) -> Vec<bool> {
        self.tokens
            .iter()
            .enumerate()
            .map(|(i, t)| i < 3 || looks_like_control(t))
            .collect()
    }

    /// Writes the same model as a Hugging Face checkpoint folder into `dir` (created if needed):
    /// `config.json`, the weights in `weight_type` (`model.safetensors`, or `shards` files
    /// `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json` when `shards > 1`),
    /// `tokenizer.json`, `tokenizer_config.json` (BOS/EOS, chat template) and
    /// `generation_config.json`.
    pub fn write_hf_folder(&self, dir: &Path, shards: usize) -> Result<(), SafetensorsWriteError> {
        std::fs::create_dir_all(dir)?;
        let heads = self.head_count as usize;
        let kv_heads = self.head_count_kv as usize;
        let mut tensors = Vec::new();
        for t in self.generate() {
            let name = hf_tensor_name(&t.name).expect("every generated tensor has an HF name");
            let cols = if t.dims.len() == 2 {
                t.dims[0] as usize
            } else {
                1
            };
            // llama GGUFs (Mistral's too) store Q/K rows permuted for pairwise RoPE.
            let permuted = self.architecture.name() == "llama";
            let values = match t.name.rsplit('.').nth(1) {
                Some("attn_q") if permuted => unpermute_qk(&t.values, heads, cols),
                Some("attn_k") if permuted => unpermute_qk(&t.values, kv_heads, cols),
                _ => t.values,
            };
            let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
            tensors.push((name, shape, self.weight_type.encode(&values)));
        }
        let dtype = self.weight_type.safetensors_name();
        let shards = shards.clamp(1, tensors.len());
        if shards == 1 {
            let mut w = SafetensorsWriter::new();
            w.metadata("format", "pt");
            for (name, shape, bytes) in &tensors {
                w.tensor(name, dtype, shape, bytes.as_slice())?;
            }
            w.write_to(std::io::BufWriter::new(std::fs::File::create(
                dir.join("model.safetensors"),
            )?))?;
        } else {
            let per_shard = tensors.len().div_ceil(shards);
            let mut weight_map = serde_json::Map::new();
            let mut total_size = 0u64;
            for (i, chunk) in tensors.chunks(per_shard).enumerate() {
                let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
                let mut w = SafetensorsWriter::new();
                w.metadata("format", "pt");
                for (name, shape, bytes) in chunk {
                    w.tensor(name, dtype, shape, bytes.as_slice())?;
                    weight_map.insert(name.clone(), json!(file));
                }
                total_size += w.data_bytes();
                w.write_to(std::io::BufWriter::new(std::fs::File::create(
                    dir.join(&file),
                )?))?;
            }
            write_json(
                dir,
                "model.safetensors.index.json",
                &json!({"metadata": {"total_size": total_size}, "weight_map": weight_map}),
            )?;
        }
        let mut config = json!({
                "architectures": [self.architecture.hf_class()],
                "model_type": self.architecture.model_type(),
                "hidden_size": self.embedding_length,
                "intermediate_size": self.feed_forward_length,
                "num_attention_heads": self.head_count,
                "num_key_value_heads": self.head_count_kv,
                "num_hidden_layers": self.block_count,
                "head_dim": self.head_dim(),
                "max_position_embeddings": self.context_length,
                "vocab_size": self.tokens.len(),
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "rope_scaling": null,
                "hidden_act": "silu",
                "tie_word_embeddings": self.tied_embeddings,
                "torch_dtype": self.weight_type.torch_name(),
                "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id,
                "_name_or_path": format!("tiny-{}", self.architecture.model_type()),
        });
        if let Some(window) = self.architecture.sliding_window() {
            config["sliding_window"] = json!(window);
        }
        write_json(dir, "config.json", &config)?;
        write_json(
            dir,
            "tokenizer.json",
            &byte_level_tokenizer_json(&self.tokens, &self.merges, &self.special(), true),
        )?;
        let token = |id: u32| self.tokens.get(id as usize).cloned().unwrap_or_default();
        let mut config = json!({
            "add_bos_token": false,
            "add_eos_token": false,
            "bos_token": token(self.bos_token_id),
            "eos_token": token(self.eos_token_id),
            "model_max_length": self.context_length,
            "tokenizer_class": "GPT2Tokenizer",
        });
        if let Some(t) = &self.chat_template {
            config["chat_template"] = json!(t);
        }
        write_json(dir, "tokenizer_config.json", &config)?;
        write_json(
            dir,
            "generation_config.json",
            &json!({"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id}),
        )?;
        Ok(())
    }

    /// Number of weights the GGUF holds.
    pub fn parameter_count(&self) -> u64 {
        let hidden = u64::from(self.embedding_length);
        let ffn = u64::from(self.feed_forward_length);
        let kv_dim = self.head_dim() * u64::from(self.head_count_kv);
        let vocab = self.tokens.len() as u64;
        let per_layer = 2 * hidden + 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * ffn;
        let biases = if self.architecture == TinyArchitecture::Qwen2 {
            hidden + 2 * kv_dim
        } else {
            0
        };
        let output = if self.tied_embeddings {
            0
        } else {
            hidden * vocab
        };
        hidden * vocab + u64::from(self.block_count) * (per_layer + biases) + hidden + output
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;

    #[test]
    fn tiny_llama_is_a_valid_gguf() {
        let model = TinyLlama::default();
        let bytes = model.to_gguf().unwrap();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.architecture().unwrap(), Some("llama"));
        assert_eq!(g.arch_u64("block_count").unwrap(), Some(2));
        assert_eq!(g.tensors.len(), 1 + 2 * 9 + 1);
        assert_eq!(g.parameter_count(), model.parameter_count());
        assert!(g.tensor("output.weight").is_none());
        assert_eq!(bytes, model.to_gguf().unwrap(), "deterministic");
        let other = TinyLlama {
            seed: 7,
            ..TinyLlama::default()
        }
        .to_gguf()
        .unwrap();
        assert_ne!(bytes, other);
    }

    #[test]
    fn hf_folders_hold_every_tensor_once() {
        use crate::safetensors::{SafetensorsFile, ShardIndex};
        let dir = tempfile::tempdir().unwrap();
        for (arch, tied, shards) in [
            (TinyArchitecture::Llama, true, 1),
            (TinyArchitecture::Qwen2, false, 3),
        ] {
            let model = TinyLlama {
                architecture: arch,
                tied_embeddings: tied,
                weight_type: TinyFloat::BF16,
                ..TinyLlama::default()
            };
            let out = dir.path().join(arch.name());
            model.write_hf_folder(&out, shards).unwrap();
            let files: Vec<String> = if shards == 1 {
                vec!["model.safetensors".into()]
            } else {
                let index = ShardIndex::read(out.join("model.safetensors.index.json")).unwrap();
                index.shards().into_iter().map(String::from).collect()
            };
            assert_eq!(files.len(), shards);
            let mut count = 0;
            let mut params = 0;
            for f in &files {
                let st = SafetensorsFile::open(out.join(f)).unwrap();
                assert!(st.tensors.iter().all(|t| t.dtype == "BF16"));
                count += st.tensors.len();
                params += st.parameter_count();
            }
            let gguf = crate::gguf::Gguf::parse(&model.to_gguf().unwrap()).unwrap();
            assert_eq!(count, gguf.tensors.len());
            assert_eq!(params, model.parameter_count());
            assert_eq!(gguf.parameter_count(), model.parameter_count());
            let config: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap())
                    .unwrap();
            assert_eq!(config["architectures"][0], arch.hf_class());
            assert_eq!(config["tie_word_embeddings"], tied);
        }
    }
}
