//! Tiny models in the real formats, with deterministic random weights, for tests.
//!
//! Unit tests across the workspace use these instead of downloads: a few layers and a small
//! hidden size, but the exact tensor names, layouts, metadata keys and tokenizer encoding of a
//! llama-architecture GGUF as llama.cpp writes it.

use crate::byte_level::gpt2_byte_tokens;
use crate::gguf::{Array, GgmlType, GgufWriteError, GgufWriter};

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
        }
    }
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

fn f32_tensor(rng: &mut SplitMix, n: u64, scale: f32, around_one: bool) -> Vec<u8> {
    (0..n)
        .flat_map(|_| {
            let w = rng.weight(scale) + if around_one { 1.0 } else { 0.0 };
            w.to_le_bytes()
        })
        .collect()
}

impl TinyLlama {
    /// The GGUF file's bytes (all weights F32).
    pub fn to_gguf(&self) -> Result<Vec<u8>, GgufWriteError> {
        let hidden = u64::from(self.embedding_length);
        let ffn = u64::from(self.feed_forward_length);
        let head_dim = hidden / u64::from(self.head_count.max(1));
        let kv_dim = head_dim * u64::from(self.head_count_kv);
        let vocab = self.tokens.len() as u64;
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", "llama")?
            .metadata("general.name", "tiny-llama")?
            .metadata("general.file_type", 0u32)?
            .metadata("llama.block_count", self.block_count)?
            .metadata("llama.context_length", self.context_length)?
            .metadata("llama.embedding_length", self.embedding_length)?
            .metadata("llama.feed_forward_length", self.feed_forward_length)?
            .metadata("llama.attention.head_count", self.head_count)?
            .metadata("llama.attention.head_count_kv", self.head_count_kv)?
            .metadata("llama.rope.freq_base", 10000.0f32)?
            .metadata("llama.rope.dimension_count", head_dim as u32)?
            .metadata("llama.attention.layer_norm_rms_epsilon", 1e-5f32)?
            .metadata("llama.vocab_size", vocab as u32)?
            .metadata("tokenizer.ggml.model", "gpt2")?
            .metadata("tokenizer.ggml.pre", "smollm")?
            .metadata("tokenizer.ggml.tokens", Array::String(self.tokens.clone()))?;
        let token_types: Vec<i32> = (0..self.tokens.len())
            .map(|i| if i < 3 { 3 } else { 1 })
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
        let mut rng = SplitMix(self.seed);
        let scale = 1.0 / (hidden as f32).sqrt();
        let matrix =
            |rng: &mut SplitMix, cols: u64, rows: u64| f32_tensor(rng, cols * rows, scale, false);
        w.tensor(
            "token_embd.weight",
            &[hidden, vocab],
            GgmlType::F32,
            matrix(&mut rng, hidden, vocab),
        )?;
        for layer in 0..self.block_count {
            let name = |t: &str| format!("blk.{layer}.{t}.weight");
            w.tensor(
                &name("attn_norm"),
                &[hidden],
                GgmlType::F32,
                f32_tensor(&mut rng, hidden, 0.1, true),
            )?
            .tensor(
                &name("attn_q"),
                &[hidden, hidden],
                GgmlType::F32,
                matrix(&mut rng, hidden, hidden),
            )?
            .tensor(
                &name("attn_k"),
                &[hidden, kv_dim],
                GgmlType::F32,
                matrix(&mut rng, hidden, kv_dim),
            )?
            .tensor(
                &name("attn_v"),
                &[hidden, kv_dim],
                GgmlType::F32,
                matrix(&mut rng, hidden, kv_dim),
            )?
            .tensor(
                &name("attn_output"),
                &[hidden, hidden],
                GgmlType::F32,
                matrix(&mut rng, hidden, hidden),
            )?
            .tensor(
                &name("ffn_norm"),
                &[hidden],
                GgmlType::F32,
                f32_tensor(&mut rng, hidden, 0.1, true),
            )?
            .tensor(
                &name("ffn_gate"),
                &[hidden, ffn],
                GgmlType::F32,
                matrix(&mut rng, hidden, ffn),
            )?
            .tensor(
                &name("ffn_up"),
                &[hidden, ffn],
                GgmlType::F32,
                matrix(&mut rng, hidden, ffn),
            )?
            .tensor(
                &name("ffn_down"),
                &[ffn, hidden],
                GgmlType::F32,
                matrix(&mut rng, ffn, hidden),
            )?;
        }
        w.tensor(
            "output_norm.weight",
            &[hidden],
            GgmlType::F32,
            f32_tensor(&mut rng, hidden, 0.1, true),
        )?;
        if !self.tied_embeddings {
            w.tensor(
                "output.weight",
                &[hidden, vocab],
                GgmlType::F32,
                matrix(&mut rng, hidden, vocab),
            )?;
        }
        w.to_bytes()
    }

    /// Number of weights the GGUF holds.
    pub fn parameter_count(&self) -> u64 {
        let hidden = u64::from(self.embedding_length);
        let ffn = u64::from(self.feed_forward_length);
        let kv_dim = hidden / u64::from(self.head_count.max(1)) * u64::from(self.head_count_kv);
        let vocab = self.tokens.len() as u64;
        let per_layer = 2 * hidden + 2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * ffn;
        let output = if self.tied_embeddings {
            0
        } else {
            hidden * vocab
        };
        hidden * vocab + u64::from(self.block_count) * per_layer + hidden + output
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
}
