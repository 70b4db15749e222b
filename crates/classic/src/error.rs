//! Errors of tensor-model serving, each mapped to the HTTP status the server answers with.

/// What can go wrong loading or running a tensor model.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClassicError {
    /// The request is malformed (shape, type, size, image): 400.
    #[error("{0}")]
    BadInput(String),
    /// The request's tensors would decode to more memory than its limit allows: 413.
    #[error("{0}")]
    TooLarge(String),
    /// The model's queue is full: 429 with Retry-After.
    #[error("the queue of model {model:?} is full ({capacity} requests waiting); retry later")]
    QueueFull { model: String, capacity: usize },
    /// The request waited longer than the model's queue timeout: 503.
    #[error(
        "the request waited {waited_ms} ms in the queue of model {model:?} (limit {limit_ms} ms)"
    )]
    QueueTimeout {
        model: String,
        waited_ms: u64,
        limit_ms: u64,
    },
    /// The model is being unloaded: 503.
    #[error("model {0:?} is shutting down")]
    ShuttingDown(String),
    /// The model cannot be loaded (unsupported graph, bad declaration).
    #[error("{0}")]
    Load(String),
    /// The backend failed on valid input: 500.
    #[error("inference failed: {0}")]
    Backend(String),
}
