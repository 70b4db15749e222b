//! The engine's error type.

/// Everything the engine can fail at, typed so callers can map it to their own errors.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot load the model: {0}")]
    Load(String),
    #[error("the model architecture {0:?} is not supported (supported: llama, qwen2)")]
    UnsupportedArchitecture(String),
    #[error("tensor {name:?}: {reason}")]
    Tensor { name: String, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("the prompt has {prompt_tokens} tokens; with max_tokens {max_tokens} that exceeds the context of {context} tokens")]
    ContextExceeded {
        prompt_tokens: usize,
        max_tokens: usize,
        context: usize,
    },
    #[error(transparent)]
    Repository(#[from] repo::RepoError),
}
