//! Rampart's LLM engine: runs llama-family models from GGUF files and Hugging Face checkpoint
//! folders (safetensors) on the CPU kernels.
//!
//! - [`model`]: configuration, the batched forward pass over a paged KV cache; [`weights`]:
//!   zero-copy weights from the memory-mapped files; [`hf`]: Hugging Face folders
//!   (`config.json`, single or sharded safetensors);
//! - [`block_pool`]: KV block bookkeeping and the prefix cache; [`kv_store`]: the blocks' bytes;
//!   [`kv_tier`]: the second tier (host memory, then disk) for preempted and evicted blocks;
//! - [`scheduler`]: continuous batching with chunked prefill, preemption and cancellation;
//! - [`arch`]: the model families (llama, qwen2) and what distinguishes them;
//! - [`tokenizer`]: byte-level BPE and SentencePiece vocabularies from GGUF metadata or
//!   `tokenizer.json`, streaming detokenization ([`sentencepiece`] holds the SentencePiece algorithm);
//! - [`chat`]: chat templates (minijinja with the helpers HF templates use);
//! - [`sampler`]: sampling with logprobs and per-token entropy;
//! - [`generate`]: the engine API, `Engine::generate(request) → stream of events`, and the
//!   engine thread that steps the scheduler;
//! - [`bert`]: sentence embeddings from BERT encoders (sentence-transformers folders);
//! - [`bench`]: throughput and perplexity measured as llama.cpp measures them; [`synthetic`]:
//!   random-weight GGUF files of real shapes (Qwen2-1.5B Q4_K_M) for speed runs.
//!
//! The engine knows nothing of HTTP, tenants or audit; it runs on its own threads and talks
//! through channels.

pub mod arch;
pub mod bench;
pub mod bert;
pub mod block_pool;
pub mod chat;
pub mod constraint;
pub mod convert;
pub mod error;
pub mod explain;
pub mod generate;
pub mod hf;
pub mod kv_store;
pub mod kv_tier;
pub mod model;
pub mod reservations;
pub mod sampler;
pub mod scheduler;
pub mod sentencepiece;
pub mod speculation;
pub mod step_cost;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;

pub use bert::{EmbedOptions, Embedder, EmbedderOptions};
pub use chat::{ChatMessage, ChatTemplate, FunctionCall, ToolCall};
pub use constraint::{Constraint, ConstraintError, ConstraintFactory, TokenConstraint, TokenMask};
pub use error::EngineError;
pub use explain::{AttentionDigest, AttentionRequest};
pub use generate::{
    Engine, EngineOptions, Event, FinishReason, Finished, GenerateRequest, KvMemory, KvOptions,
    ParseKvMemoryError, Prompt, SchedulerOptions, Shed, Stream, TokenEvent,
};
pub use kernels::paged::Attended;
pub use kernels::KvDType;
pub use reservations::{Booked, Claim, ReservationStats};
pub use sampler::SamplingParams;
pub use scheduler::{GateRefusal, LatencySamples, SchedulerLimits, SchedulerSnapshot};
