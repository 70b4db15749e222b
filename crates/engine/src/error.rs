//! The engine's error type.

/// Everything the engine can fail at, typed so callers can map it to their own errors.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot load the model: {0}")]
    Load(String),
    #[error("the model architecture {0:?} is not supported (supported: llama, qwen2; in Hugging Face folders LlamaForCausalLM, Qwen2ForCausalLM)")]
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
    #[error("input {index} has {tokens} tokens, more than the model's limit of {limit}")]
    InputTooLong {
        index: usize,
        tokens: usize,
        limit: usize,
    },
    #[error("the request needs {tokens} KV positions but the whole KV cache holds {pool_tokens}; raise the KV cache memory or lower max_tokens")]
    PoolTooSmall { tokens: usize, pool_tokens: usize },
    #[error("the engine's waiting queue is full ({limit} requests); retry later")]
    QueueFull { limit: usize },
    #[error("the first token would come too late: {predicted_ms:.0} ms predicted to read {backlog_tokens} prompt tokens ahead and this one at {tokens_per_second:.0} tokens/s, plus a {margin_ms:.0} ms margin (how much later than predicted first tokens came lately, 99th percentile), above {max_wait_ms} ms; retry later")]
    Shedding {
        predicted_ms: f64,
        margin_ms: f64,
        max_wait_ms: u64,
        backlog_tokens: usize,
        tokens_per_second: f64,
        retry_after_s: u64,
        /// The same, to the millisecond (`retry-after-ms`).
        retry_after_ms: u64,
        /// The identity its booking is kept under, when it was booked.
        booked: Option<u64>,
    },
    #[error("the engine just started and has not measured how fast it reads prompts yet: {backlog_tokens} prompt tokens are ahead of this one, and no more than {limit_tokens} are let in before the first step measures it; retry later")]
    Warming {
        backlog_tokens: usize,
        limit_tokens: usize,
        retry_after_s: u64,
    },
    #[error("memory is saturated: new prompts are not started until it eases, and this one waited {waited_ms} ms without starting; retry later")]
    Saturated { waited_ms: u64, retry_after_s: u64 },
    #[error("the engine has stopped")]
    Stopped,
    #[error("generation failed: {0}")]
    Failed(String),
    #[error(transparent)]
    Repository(#[from] repo::RepoError),
}
