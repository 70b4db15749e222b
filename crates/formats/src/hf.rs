//! Hugging Face checkpoint conventions of the llama family (Llama, Qwen2, SmolLM): tensor
//! names in `model.safetensors` against the GGUF names the engine uses, and the Q/K row order.
//!
//! llama.cpp's converter permutes the rows of `q_proj`/`k_proj` so that RoPE rotates adjacent
//! pairs; Hugging Face checkpoints keep the original order and rotate pairs `(i, i + d/2)`
//! (NeoX style). [`permute_qk`] and [`unpermute_qk`] convert between the two.

/// The Hugging Face name of a GGUF tensor (`blk.3.attn_q.weight` →
/// `model.layers.3.self_attn.q_proj.weight`); `None` for names outside the llama family.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    let simple = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(name) = simple {
        return Some(name.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, tensor) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, suffix) = tensor.rsplit_once('.')?;
    let hf = LAYER_TENSORS
        .iter()
        .find(|(gguf, _)| *gguf == base)
        .map(|(_, hf)| *hf)?;
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The GGUF name of a Hugging Face tensor; `None` for names outside the llama family.
pub fn gguf_tensor_name(hf_name: &str) -> Option<String> {
    gguf_tensor_name_of(hf_name, false)
}

/// [`gguf_tensor_name`] for a family whose layers have four norms (Gemma: before and after
/// attention, before and after the feed-forward block), where `post_attention_layernorm` is the
/// norm after attention rather than the llama family's norm before the feed-forward block.
pub fn gguf_tensor_name_of(hf_name: &str, gemma_norms: bool) -> Option<String> {
    let simple = match hf_name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = simple {
        return Some(name.to_string());
    }
    let rest = hf_name.strip_prefix("model.layers.")?;
    let (layer, tensor) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, suffix) = tensor.rsplit_once('.')?;
    let gemma = gemma_norms
        .then(|| GEMMA_NORMS.iter().find(|(_, hf)| *hf == base))
        .flatten();
    let gguf = gemma
        .or_else(|| LAYER_TENSORS.iter().find(|(_, hf)| *hf == base))
        .map(|(gguf, _)| *gguf)?;
    Some(format!("blk.{layer}.{gguf}.{suffix}"))
}

/// Gemma's layer norms that are named differently from (or absent in) the llama family.
const GEMMA_NORMS: &[(&str, &str)] = &[
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

/// Per-layer tensors: GGUF base name, Hugging Face base name.
const LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_qkv", "self_attn.qkv_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    // Phi-3's fused gate and up projection (llama.cpp keeps it whole as `ffn_up`).
    ("ffn_up", "mlp.gate_up_proj"),
];

/// The row that row `hf_row` of a Hugging Face Q/K projection becomes in llama.cpp's order
/// (`w.reshape(heads, 2, head_dim / 2, cols).swapaxes(1, 2)`: row `h·d + s·d/2 + i` moves to
/// `h·d + 2i + s`).
fn gguf_row(hf_row: usize, head_dim: usize) -> usize {
    let (h, r) = (hf_row / head_dim, hf_row % head_dim);
    let half = head_dim / 2;
    let (s, i) = (r / half, r % half);
    h * head_dim + 2 * i + s
}

/// Rows of a Hugging Face `q_proj`/`k_proj` (`values` is `rows × cols` row-major, `heads`
/// heads; a bias has `cols = 1`) in llama.cpp's order, as llama-architecture GGUFs store them.
pub fn permute_qk(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    reorder(values, heads, cols, true)
}

/// The inverse of [`permute_qk`]: rows of a llama GGUF's `attn_q`/`attn_k` back in Hugging Face
/// order.
pub fn unpermute_qk(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    reorder(values, heads, cols, false)
}

fn reorder(values: &[f32], heads: usize, cols: usize, to_gguf: bool) -> Vec<f32> {
    let cols = cols.max(1);
    let rows = values.len() / cols;
    let head_dim = rows / heads.max(1);
    if head_dim < 2 || !head_dim.is_multiple_of(2) || !rows.is_multiple_of(heads.max(1)) {
        return values.to_vec();
    }
    let mut out = vec![0f32; values.len()];
    for hf in 0..rows {
        let gguf = gguf_row(hf, head_dim);
        let (from, to) = if to_gguf { (hf, gguf) } else { (gguf, hf) };
        out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_both_ways() {
        for (gguf, hf) in [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            (
                "blk.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            (
                "blk.12.attn_q.bias",
                "model.layers.12.self_attn.q_proj.bias",
            ),
            (
                "blk.3.attn_output.weight",
                "model.layers.3.self_attn.o_proj.weight",
            ),
            (
                "blk.3.ffn_norm.weight",
                "model.layers.3.post_attention_layernorm.weight",
            ),
            (
                "blk.3.ffn_down.weight",
                "model.layers.3.mlp.down_proj.weight",
            ),
        ] {
            assert_eq!(hf_tensor_name(gguf).as_deref(), Some(hf));
            assert_eq!(gguf_tensor_name(hf).as_deref(), Some(gguf));
        }
        // Qwen 3's per-head norms; Gemma's four layer norms.
        assert_eq!(
            gguf_tensor_name("model.layers.2.self_attn.k_norm.weight").as_deref(),
            Some("blk.2.attn_k_norm.weight")
        );
        for (hf, gguf) in [
            ("post_attention_layernorm", "post_attention_norm"),
            ("pre_feedforward_layernorm", "ffn_norm"),
            ("post_feedforward_layernorm", "post_ffw_norm"),
            ("input_layernorm", "attn_norm"),
            ("self_attn.q_norm", "attn_q_norm"),
        ] {
            assert_eq!(
                gguf_tensor_name_of(&format!("model.layers.4.{hf}.weight"), true).as_deref(),
                Some(format!("blk.4.{gguf}.weight").as_str())
            );
        }
        assert_eq!(
            gguf_tensor_name("model.layers.4.pre_feedforward_layernorm.weight"),
            None
        );
        for odd in [
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.0.self_attn.rotary_emb.inv_freq",
            "model.embed_tokens",
            "vision_tower.weight",
        ] {
            assert_eq!(gguf_tensor_name(odd), None, "{odd}");
        }
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permutation() {
        // llama.cpp: w.reshape(heads, 2, head_dim / 2, cols).swapaxes(1, 2), i.e. GGUF row
        // h·d + 2i + s holds HF row h·d + s·d/2 + i.
        let (heads, head_dim, cols) = (2, 8, 3);
        let hf: Vec<f32> = (0..heads * head_dim * cols).map(|v| v as f32).collect();
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..heads {
            for i in 0..head_dim / 2 {
                for s in 0..2 {
                    let (g, r) = (
                        h * head_dim + 2 * i + s,
                        h * head_dim + s * head_dim / 2 + i,
                    );
                    gguf[g * cols..(g + 1) * cols].copy_from_slice(&hf[r * cols..(r + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_qk(&gguf, heads, cols), hf);
        assert_eq!(permute_qk(&hf, heads, cols), gguf);
    }
}
