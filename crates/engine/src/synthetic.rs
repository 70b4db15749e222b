//! Synthetic GGUF models for speed runs: the real shapes, tensor names, types and metadata of a
//! published model, with random weights.
//!
//! Speed does not depend on the weights' values, so a Qwen2-1.5B-shaped Q4_K_M file measures what
//! the real one would without a download: the same matrices in the same block formats, read in
//! the same order. The quantized blocks are random valid blocks (random quants, f16 scales in a
//! realistic range, see [`kernels::testing::random_row`]), not quantized floats: quantizing 1.5
//! billion floats with the reference quantizers takes minutes and changes nothing measured.
//! The type of each matrix follows llama.cpp's Q4_K_M recipe: Q6_K for the output matrix and
//! for `attn_v` and `ffn_down` in the first and last eighth of the layers and every third layer
//! between them, Q4_K elsewhere, F32 norms and biases. The vocabulary is GPT-2 byte-level (the
//! 256 byte tokens, placeholder words, then Qwen2's three control tokens) with no merges, which
//! both Rampart and llama.cpp load; benchmarks feed random token ids, as `llama-bench` does.

use std::io::BufWriter;
use std::path::Path;

use formats::gguf::{Array, GgmlType, GgufWriteError, GgufWriter};
use kernels::DType;

/// A decoder's shape (Qwen2 architecture: Q/K/V biases, untied output matrix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticShape {
    pub name: String,
    pub block_count: u32,
    pub embedding_length: u32,
    pub feed_forward_length: u32,
    pub head_count: u32,
    pub head_count_kv: u32,
    pub vocab_size: u32,
    pub context_length: u32,
}

impl SyntheticShape {
    /// Qwen2-1.5B: 28 layers, hidden 1,536, 12 query and 2 key/value heads, feed-forward 8,960,
    /// vocabulary 151,936.
    pub fn qwen2_1_5b() -> Self {
        Self {
            name: "qwen2-1.5b".into(),
            block_count: 28,
            embedding_length: 1536,
            feed_forward_length: 8960,
            head_count: 12,
            head_count_kv: 2,
            vocab_size: 151_936,
            context_length: 32_768,
        }
    }

    /// Qwen2-0.5B: 24 layers, hidden 896, 14 and 2 heads, feed-forward 4,864.
    pub fn qwen2_0_5b() -> Self {
        Self {
            name: "qwen2-0.5b".into(),
            block_count: 24,
            embedding_length: 896,
            feed_forward_length: 4864,
            head_count: 14,
            head_count_kv: 2,
            vocab_size: 151_936,
            context_length: 32_768,
        }
    }

    /// The shapes by name (`qwen2-1.5b`, `qwen2-0.5b`).
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "qwen2-1.5b" => Some(Self::qwen2_1_5b()),
            "qwen2-0.5b" => Some(Self::qwen2_0_5b()),
            _ => None,
        }
    }

    fn head_dim(&self) -> u64 {
        u64::from(self.embedding_length / self.head_count.max(1))
    }

    /// Whether llama.cpp's Q4_K_M gives layer `layer`'s `attn_v` and `ffn_down` more bits
    /// (`use_more_bits`: the first and last eighth, and every third layer between).
    pub fn more_bits(&self, layer: u32) -> bool {
        let n = self.block_count;
        layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2
    }

    /// Every tensor: name, dims in ggml order (contiguous dimension first), type.
    pub fn tensors(&self) -> Vec<(String, Vec<u64>, DType)> {
        let hidden = u64::from(self.embedding_length);
        let ffn = u64::from(self.feed_forward_length);
        let kv = self.head_dim() * u64::from(self.head_count_kv);
        let vocab = u64::from(self.vocab_size);
        let mut out = vec![(
            "token_embd.weight".to_string(),
            vec![hidden, vocab],
            DType::Q4_K,
        )];
        for layer in 0..self.block_count {
            let more = if self.more_bits(layer) {
                DType::Q6_K
            } else {
                DType::Q4_K
            };
            let name = |t: &str, kind: &str| format!("blk.{layer}.{t}.{kind}");
            out.extend([
                (name("attn_norm", "weight"), vec![hidden], DType::F32),
                (name("attn_q", "weight"), vec![hidden, hidden], DType::Q4_K),
                (name("attn_k", "weight"), vec![hidden, kv], DType::Q4_K),
                (name("attn_v", "weight"), vec![hidden, kv], more),
                (name("attn_q", "bias"), vec![hidden], DType::F32),
                (name("attn_k", "bias"), vec![kv], DType::F32),
                (name("attn_v", "bias"), vec![kv], DType::F32),
                (
                    name("attn_output", "weight"),
                    vec![hidden, hidden],
                    DType::Q4_K,
                ),
                (name("ffn_norm", "weight"), vec![hidden], DType::F32),
                (name("ffn_gate", "weight"), vec![hidden, ffn], DType::Q4_K),
                (name("ffn_up", "weight"), vec![hidden, ffn], DType::Q4_K),
                (name("ffn_down", "weight"), vec![ffn, hidden], more),
            ]);
        }
        out.push(("output_norm.weight".into(), vec![hidden], DType::F32));
        out.push(("output.weight".into(), vec![hidden, vocab], DType::Q6_K));
        // Rows that are not whole K-quant blocks of 256 (Qwen2-0.5B's hidden 896) take
        // llama.cpp's fallback types: Q4_K → Q5_0, Q6_K → Q8_0.
        for (_, dims, dtype) in &mut out {
            if dims[0] % dtype.block_size() as u64 != 0 {
                *dtype = match *dtype {
                    DType::Q6_K => DType::Q8_0,
                    _ => DType::Q5_0,
                };
            }
        }
        out
    }

    /// Writes the Q4_K_M file to `path` (about 1 GB for Qwen2-1.5B; a few seconds). `seed` picks
    /// the random weights.
    pub fn write_q4_k_m(&self, path: &Path, seed: u64) -> Result<(), GgufWriteError> {
        let arch = "qwen2";
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", arch)?
            .metadata("general.name", format!("synthetic {} Q4_K_M", self.name))?
            // LLAMA_FTYPE_MOSTLY_Q4_K_M.
            .metadata("general.file_type", 15u32)?;
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
        w.metadata(&format!("{arch}.rope.freq_base"), 1_000_000.0f32)?
            .metadata(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6f32)?;
        let vocab = self.vocab_size as usize;
        let specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
        let mut tokens = formats::byte_level::gpt2_byte_tokens();
        let words = vocab.saturating_sub(tokens.len() + specials.len());
        tokens.extend((0..words).map(|i| format!("w{i}")));
        tokens.extend(specials.iter().map(|s| s.to_string()));
        tokens.truncate(vocab);
        let token_types: Vec<i32> = (0..tokens.len())
            .map(|i| if i + specials.len() >= vocab { 3 } else { 1 })
            .collect();
        let eos = (vocab - specials.len()) as u32;
        w.metadata("tokenizer.ggml.model", "gpt2")?
            .metadata("tokenizer.ggml.pre", "qwen2")?
            .metadata("tokenizer.ggml.tokens", Array::String(tokens))?
            .metadata("tokenizer.ggml.token_type", Array::I32(token_types))?
            .metadata("tokenizer.ggml.merges", Array::String(Vec::new()))?
            .metadata("tokenizer.ggml.eos_token_id", eos)?
            .metadata("tokenizer.ggml.padding_token_id", eos)?
            .metadata("tokenizer.ggml.bos_token_id", eos)?
            .metadata("tokenizer.ggml.add_bos_token", false)?
            // Qwen2's ChatML, so chat benchmarks run on the shape.
            .metadata(
                "tokenizer.chat_template",
                "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            )?;
        for (i, (name, dims, dtype)) in self.tensors().into_iter().enumerate() {
            let cols = dims[0] as usize;
            let rows = dims.get(1).copied().unwrap_or(1) as usize;
            let tensor_seed = seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
            let bytes = if dtype == DType::F32 {
                // Norm weights of 1 and zero biases keep the activations in range.
                let value = if name.ends_with(".bias") { 0f32 } else { 1f32 };
                value.to_le_bytes().repeat(cols)
            } else {
                // A few random rows repeated: the same bytes read, generated in moments.
                let distinct: Vec<Vec<u8>> = (0..16)
                    .map(|r| kernels::testing::random_row(dtype, cols, tensor_seed * 31 + r))
                    .collect();
                (0..rows)
                    .flat_map(|r| distinct[r % 16].iter().copied())
                    .collect()
            };
            let ggml = GgmlType::from_name(dtype.name()).ok_or_else(|| {
                GgufWriteError::Io(std::io::Error::other(format!("no GGML type {dtype}")))
            })?;
            w.tensor(&name, &dims, ggml, bytes)?;
        }
        let file = std::fs::File::create(path)?;
        w.write_to(BufWriter::new(file))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recipe's counts on the Qwen2-1.5B shape: 169 Q4_K and 29 Q6_K matrices, as in the
    /// published Q4_K_M file.
    #[test]
    fn qwen2_1_5b_has_the_q4_k_m_type_counts() {
        let tensors = SyntheticShape::qwen2_1_5b().tensors();
        let count = |d: DType| tensors.iter().filter(|t| t.2 == d).count();
        assert_eq!((count(DType::Q4_K), count(DType::Q6_K)), (169, 29));
        let params: u64 = tensors.iter().map(|t| t.1.iter().product::<u64>()).sum();
        assert!((1_700_000_000..1_800_000_000).contains(&params), "{params}");
    }

    /// Qwen2-0.5B's hidden 896 is not whole blocks of 256: those rows take Q5_0 and Q8_0, and
    /// every row is whole blocks of its type.
    #[test]
    fn qwen2_0_5b_falls_back_where_rows_are_not_whole_k_blocks() {
        let tensors = SyntheticShape::qwen2_0_5b().tensors();
        for (name, dims, dtype) in &tensors {
            assert_eq!(dims[0] % dtype.block_size() as u64, 0, "{name} {dtype}");
        }
        assert!(tensors.iter().any(|t| t.2 == DType::Q5_0));
        assert!(tensors.iter().any(|t| t.2 == DType::Q4_K));
    }

    /// A small shape loads in the engine and runs the throughput benchmark (prefill and decode).
    #[test]
    fn a_small_shape_loads_and_decodes() {
        let shape = SyntheticShape {
            name: "small".into(),
            block_count: 2,
            embedding_length: 256,
            feed_forward_length: 512,
            head_count: 4,
            head_count_kv: 2,
            vocab_size: 1024,
            context_length: 256,
        };
        let dir = std::env::temp_dir().join(format!("rampart-synthetic-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("small.gguf");
        shape.write_q4_k_m(&path, 1).unwrap();
        let model = crate::model::Model::load(&path).unwrap();
        assert_eq!(model.config.vocab_size, 1024);
        let engine = crate::generate::Engine::load(&path, &Default::default()).unwrap();
        let report = crate::bench::throughput(&engine, 8, 4, 1).unwrap();
        assert_eq!(report.decode_tps.len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
