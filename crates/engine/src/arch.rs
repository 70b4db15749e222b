//! Model families. The decoder in `model` serves every family here; a family states only what
//! differs from llama. Adding a family is one entry (and, for a new block structure, one file
//! beside this one).

/// The activation of the gated feed-forward block: `down(act(gate(x)) · up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SiLU (SwiGLU): llama, Qwen.
    Silu,
    /// GELU, tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

/// The conventions of a family's Hugging Face checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HfLayout {
    /// Llama's names (`post_attention_layernorm` is the norm before the feed-forward block),
    /// plain RMSNorm weights, an output matrix unless `tie_word_embeddings`.
    Llama,
    /// Gemma's: four norms per layer (`post_attention_layernorm` is the norm *after*
    /// attention), RMSNorm weights stored as offsets from 1 (`x̂ · (1 + w)`; 1 is added at load,
    /// GGUF files already hold `1 + w`), the output tied unless the configuration says otherwise.
    Gemma,
}

/// What distinguishes a family from the llama baseline. Tensors a family may or may not have
/// (Q/K/V biases, per-head Q/K RMSNorms, norms after attention and after the feed-forward
/// block) load whenever a file holds them; what cannot be read from the tensors is here.
#[derive(Debug, PartialEq)]
pub struct Family {
    /// `general.architecture` in GGUF, `model_type` in a Hugging Face `config.json`.
    pub name: &'static str,
    /// The `architectures` entries of Hugging Face `config.json` files this family reads, the
    /// family's own first (Mistral's checkpoints are llama's network with a sliding window).
    pub hf_classes: &'static [&'static str],
    /// Other `model_type` values of those checkpoints (besides `name`).
    pub hf_model_types: &'static [&'static str],
    /// In GGUF files: RoPE pairs `(i, i + d/2)` (NeoX) instead of `(2i, 2i+1)`. Llama GGUFs store
    /// Q/K permuted for the pairwise layout; Qwen and Gemma keep the Hugging Face layout and
    /// rotate NeoX-style. Hugging Face checkpoints of every family keep the original layout and
    /// rotate NeoX-style.
    pub rope_neox: bool,
    pub activation: Activation,
    /// Token embeddings are multiplied by √hidden before the first layer (Gemma).
    pub scale_embeddings: bool,
    /// Sliding-window attention: of every `n` layers the first `n − 1` attend over the window
    /// (`attention.sliding_window`) and the `n`-th over the whole context (Gemma 3: 6); 1:
    /// every layer is windowed (llama/Mistral and Phi-3, when the file gives a window); 0: no
    /// layer is.
    pub sliding_pattern: usize,
    /// Q, K and V come from one fused projection (`attn_qkv`, rows q then k then v), and gate
    /// and up from one (`ffn_up` of 2 × ffn rows, gate first): Phi-3.
    pub fused_projections: bool,
    /// The RoPE base of the sliding-window layers (Gemma 3: 10,000, unscaled); the global ones use
    /// `rope.freq_base` and the file's scaling.
    pub sliding_rope_theta: Option<f32>,
    /// How the family's Hugging Face checkpoints are laid out.
    pub hf_layout: HfLayout,
    /// The chat template to use when a file carries none (Jinja, as `tokenizer.chat_template`).
    pub chat_template: Option<&'static str>,
}

/// Gemma's turn format: `<start_of_turn>user` / `<start_of_turn>model`, each turn closed by
/// `<end_of_turn>`, a system message folded into the first user turn, BOS first. (Gemma 3
/// GGUFs converted without their tokenizer configuration carry no template.)
const GEMMA_TEMPLATE: &str = "{{ bos_token }}\
{%- if messages and messages[0]['role'] == 'system' -%}\
{%- set prefix = messages[0]['content'] | trim ~ '\n\n' -%}{%- set turns = messages[1:] -%}\
{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}\
{%- for m in turns -%}\
{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}\
{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with the user') }}\
{%- endif -%}\
{{ '<start_of_turn>' ~ ('model' if m['role'] == 'assistant' else m['role']) ~ '\n' ~ (prefix if loop.first else '') ~ (m['content'] | trim) ~ '<end_of_turn>\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

impl Family {
    /// Whether layer `l` attends over the sliding window only.
    pub fn is_sliding(&self, l: usize) -> bool {
        match self.sliding_pattern {
            0 => false,
            1 => true,
            n => l % n < n - 1,
        }
    }
}

/// Llama 2/3, Mistral, SmolLM: GQA, tied or separate output. Every layer attends over
/// `attention.sliding_window` when the file gives one: Mistral 7B v0.1's checkpoints
/// (`MistralForCausalLM`, `sliding_window` 4096; later versions give `null`). llama.cpp converts
/// them to `llama` GGUFs without the window; a GGUF that carries `llama.attention.sliding_window`
/// (as `rampart model quantize` writes) is windowed.
pub const LLAMA: Family = Family {
    name: "llama",
    hf_classes: &["LlamaForCausalLM", "MistralForCausalLM"],
    hf_model_types: &["mistral"],
    rope_neox: false,
    activation: Activation::Silu,
    scale_embeddings: false,
    sliding_pattern: 1,
    fused_projections: false,
    sliding_rope_theta: None,
    hf_layout: HfLayout::Llama,
    chat_template: None,
};

/// Qwen2 / Qwen2.5: NeoX RoPE, separate output, large vocabulary; its Q/K/V biases load like any
/// bias tensor present in a file.
pub const QWEN2: Family = Family {
    name: "qwen2",
    hf_classes: &["Qwen2ForCausalLM"],
    hf_model_types: &[],
    rope_neox: true,
    activation: Activation::Silu,
    scale_embeddings: false,
    sliding_pattern: 0,
    fused_projections: false,
    sliding_rope_theta: None,
    hf_layout: HfLayout::Llama,
    chat_template: None,
};

/// Qwen 3: Qwen2 without the Q/K/V biases, with an RMSNorm over each Q and K head before RoPE
/// (`attn_q_norm`, `attn_k_norm`) and an explicit head size (`attention.key_length`).
pub const QWEN3: Family = Family {
    name: "qwen3",
    hf_classes: &["Qwen3ForCausalLM"],
    hf_model_types: &[],
    rope_neox: true,
    activation: Activation::Silu,
    scale_embeddings: false,
    sliding_pattern: 0,
    fused_projections: false,
    sliding_rope_theta: None,
    hf_layout: HfLayout::Llama,
    chat_template: None,
};

/// Phi-3 (mini, medium; 4k contexts): fused QKV and gate/up projections, NeoX RoPE, a separate
/// output; every layer attends over `attention.sliding_window` when the file gives one (the
/// Hugging Face model's `sliding_window`). LongRoPE (the 128k variants) is refused at load.
pub const PHI3: Family = Family {
    name: "phi3",
    hf_classes: &["Phi3ForCausalLM"],
    hf_model_types: &[],
    rope_neox: true,
    activation: Activation::Silu,
    scale_embeddings: false,
    sliding_pattern: 1,
    fused_projections: true,
    sliding_rope_theta: None,
    hf_layout: HfLayout::Llama,
    chat_template: None,
};

/// Gemma 3 (text): five sliding-window layers (local RoPE base 10,000) to one global layer,
/// per-head Q/K RMSNorms, RMSNorms before and after attention and the feed-forward block,
/// GELU-tanh gated feed-forward, embeddings scaled by √hidden and tied to the output.
pub const GEMMA3: Family = Family {
    name: "gemma3",
    hf_classes: &["Gemma3ForCausalLM"],
    hf_model_types: &[],
    rope_neox: true,
    activation: Activation::GeluTanh,
    scale_embeddings: true,
    sliding_pattern: 6,
    fused_projections: false,
    sliding_rope_theta: Some(10_000.0),
    hf_layout: HfLayout::Gemma,
    chat_template: Some(GEMMA_TEMPLATE),
};

/// Every supported family.
pub const FAMILIES: &[&Family] = &[&LLAMA, &QWEN2, &QWEN3, &PHI3, &GEMMA3];

/// The family of a `general.architecture` value.
pub fn family(architecture: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.name == architecture)
}

/// The family of a Hugging Face `architectures` entry (`LlamaForCausalLM`, ...).
pub fn family_of_hf_class(class: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.hf_classes.contains(&class))
}

/// The family of a Hugging Face `model_type` (`llama`, `mistral`, ...).
pub fn family_of_model_type(model_type: &str) -> Option<&'static Family> {
    FAMILIES
        .iter()
        .copied()
        .find(|f| f.name == model_type || f.hf_model_types.contains(&model_type))
}
