//! Model families. The llama-family decoder in `model` serves every family here; a family
//! states only what differs. Adding a family is one entry (and, for a new block structure, one
//! file beside this one).

/// What distinguishes a family from the llama baseline.
#[derive(Debug, PartialEq, Eq)]
pub struct Family {
    /// `general.architecture` in GGUF, `model_type` in a Hugging Face `config.json`.
    pub name: &'static str,
    /// The `architectures` entry of a Hugging Face `config.json` for this family.
    pub hf_class: &'static str,
    /// In GGUF files: RoPE pairs `(i, i + d/2)` (NeoX) instead of `(2i, 2i+1)`. Llama GGUFs store
    /// Q/K permuted for the pairwise layout; Qwen2 keeps the Hugging Face layout and rotates
    /// NeoX-style. Hugging Face checkpoints of every family keep the original layout and rotate
    /// NeoX-style.
    pub rope_neox: bool,
}

/// Llama 2/3, Mistral, SmolLM: GQA, tied or separate output.
pub const LLAMA: Family = Family {
    name: "llama",
    hf_class: "LlamaForCausalLM",
    rope_neox: false,
};

/// Qwen2 / Qwen2.5: NeoX RoPE, separate output, large vocabulary; its Q/K/V biases load like any
/// bias tensor present in a file.
pub const QWEN2: Family = Family {
    name: "qwen2",
    hf_class: "Qwen2ForCausalLM",
    rope_neox: true,
};

/// Every supported family.
pub const FAMILIES: &[&Family] = &[&LLAMA, &QWEN2];

/// The family of a `general.architecture` value.
pub fn family(architecture: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.name == architecture)
}

/// The family of a Hugging Face `architectures` entry (`LlamaForCausalLM`, ...).
pub fn family_of_hf_class(class: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.hf_class == class)
}
