//! The backend seam: one trait for everything that can answer a request (an engine model, an
//! embedding model, a tensor model; the fallback issue adds the rules engine and canned
//! answers), over one protocol-neutral work type, with a typed error that says what kind of
//! failure it was.
//!
//! The front hands a backend its [`Work`] after admission; the backend prepares its own input
//! (a model tokenizes with its own tokenizer, decodes images with its own pre-processing) and
//! returns an [`Answer`]. Wire formats live above this line (`openai_http`, `kserve`, `grpc`);
//! model internals below it (`engine`, `classic`).
//!
//! The rules engine answers through the same seam ([`rules`]).
//!
//! The trait is [`InferenceBackend`], named apart from `kernels::Backend` (compute devices) and
//! `classic::Backend` (ONNX runtimes).

pub mod canned;
pub mod embedding;
pub mod llm;
pub mod rules;
pub mod tensor;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use engine::{FinishReason, Finished, GenerateRequest, Prompt};
use futures_util::stream::BoxStream;
use grammar::GrammarSpec;
use record::RecordBuilder;

pub use tensor::{InferRequest, InferResponse, OutputTensor, RequestedOutput};

/// What kind of model a backend serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Llm,
    Embedding,
    Tensor,
    /// The rules engine over a rules file.
    Rules,
    /// A canned answer of a fallback chain.
    Canned,
}

/// Everything a request can ask a backend for.
#[derive(Debug, Clone)]
pub enum Work {
    /// Text generation (chat or completion), `n` choices per prompt.
    Generate(Box<GeneratePlan>),
    /// Sentence embeddings of texts or token lists.
    Embed(EmbedWork),
    /// Named tensors in, named tensors out (KServe v2).
    Tensors(InferRequest),
}

/// The shape of the work, for routing and errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkKind {
    Generate,
    Embed,
    Tensors,
}

impl Work {
    pub fn kind(&self) -> WorkKind {
        match self {
            Work::Generate(_) => WorkKind::Generate,
            Work::Embed(_) => WorkKind::Embed,
            Work::Tensors(_) => WorkKind::Tensors,
        }
    }
}

impl WorkKind {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkKind::Generate => "generate",
            WorkKind::Embed => "embed",
            WorkKind::Tensors => "tensors",
        }
    }
}

/// A validated generation request: what the chat and completion endpoints both turn into.
#[derive(Debug, Clone)]
pub struct GeneratePlan {
    /// Prompts (a chat has one); each runs `n` times.
    pub prompts: Vec<Prompt>,
    pub n: usize,
    pub request: GenerateRequest,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub user: Option<String>,
    /// What the record's input hash covers.
    pub input_for_hash: String,
    /// `max_tokens` was left to the server.
    pub default_max_tokens: bool,
    /// What the output must follow (structured output).
    pub structured: Option<GrammarSpec>,
    /// The functions the model may call and how (`tools`, `tool_choice`).
    pub tools: Option<grammar::tools::ToolRequest>,
    /// The request's `Accept-Language` (canned answers pick their text by it).
    pub language: Option<String>,
    /// The request's `parse_special_tokens` (completions); none: the model's default.
    pub parse_special_tokens: Option<bool>,
    /// 0: asked of the model itself; 1 or 2: a step of its fallback chain (a rules model then
    /// answers only when a rule matched, so the chain can go on to a canned answer).
    pub fallback_level: u8,
    /// The attention export asked for (`explain.attention`), resolved by the model's backend.
    pub explain: Option<ExplainSpec>,
}

/// A request's `explain.attention` as sent: what is left out takes the model's defaults
/// (`engine::AttentionRequest::defaults`); `max_entries` is the server's bound.
#[derive(Debug, Clone, PartialEq)]
pub struct ExplainSpec {
    pub layers: Option<Vec<usize>>,
    pub heads: Option<Vec<usize>>,
    pub top_k: Option<usize>,
    pub positions: Option<Vec<usize>>,
    pub max_entries: usize,
}

/// The attention export a generation carries: the resolved request, and what identifies the
/// kernel that computed it (a replay compares digests under the same identity).
#[derive(Debug, Clone, PartialEq)]
pub struct ExplainInfo {
    pub request: engine::AttentionRequest,
    pub kernel: String,
    /// What a replay needs besides the input (`engine::explain::replay_settings`; the seed is
    /// the first choice's).
    pub replay: serde_json::Value,
}

/// Inputs of an embedding request.
#[derive(Debug, Clone)]
pub enum EmbeddingInputs {
    Texts(Vec<String>),
    Tokens(Vec<Vec<u32>>),
}

/// An embedding request.
#[derive(Debug, Clone)]
pub struct EmbedWork {
    pub inputs: EmbeddingInputs,
    /// Keep the first `dimensions` components (and L2-normalize again).
    pub dimensions: Option<usize>,
}

/// What a backend answered.
pub enum Answer {
    Generation(Generation),
    Embeddings(Embeddings),
    Tensors(InferResponse),
}

impl std::fmt::Debug for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Generation(g) => write!(f, "Generation({} choices)", g.choices),
            Answer::Embeddings(e) => write!(f, "Embeddings({} vectors)", e.vectors.len()),
            Answer::Tensors(t) => write!(f, "Tensors({} outputs)", t.outputs.len()),
        }
    }
}

/// Vectors, one per input, and the tokens they cost.
#[derive(Debug, Clone)]
pub struct Embeddings {
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: usize,
}

/// A generation in progress: every choice's events, interleaved as they come.
pub struct Generation {
    /// `(choice index, event)`; dropping the stream cancels every choice.
    pub events: BoxStream<'static, (usize, Generated)>,
    pub choices: usize,
    pub prompt_tokens: usize,
    /// The final check of a structured-output request (the compiled grammar's, or the plain
    /// check of an answer the backend wrote itself).
    pub structured: Option<Arc<dyn grammar::FinalCheck>>,
    /// The guard's output watch (the system message's canary), set by the front.
    pub watch: Option<Arc<crate::watch::OutputWatch>>,
    /// A tool-calling request's session: how the encoders read calls out of the output.
    pub tools: Option<Arc<grammar::tools::ToolSession>>,
    /// The attention export every choice's tokens carry, when the request asked for one.
    pub explain: Option<ExplainInfo>,
}

/// The end of a choice a backend wrote at once (rules, canned answers): no prompt, no time.
pub(crate) fn finished_at_once(completion_tokens: usize) -> Finished {
    Finished {
        reason: FinishReason::Stop,
        prompt_tokens: 0,
        completion_tokens,
        cached_prompt_tokens: 0,
        queue_seconds: 0.0,
        prefill_seconds: 0.0,
        decode_seconds: 0.0,
        trailing_text: String::new(),
        stop: None,
        speculated_tokens: 0,
        speculated_accepted: 0,
    }
}

/// One event of one choice.
#[derive(Debug, Clone)]
pub enum Generated {
    Token(Token),
    Finished(Finished),
    /// The choice failed after it started.
    Failed(BackendError),
}

/// A generated token, with its log-probabilities resolved to text when the request asked.
#[derive(Debug, Clone)]
pub struct Token {
    /// Text this token completes (may be empty while a character is incomplete).
    pub text: String,
    /// Entropy of the distribution it was drawn from, in nats.
    pub entropy: f32,
    pub logprobs: Option<TokenLogprobs>,
    /// The token's attention export (see [`Generation::explain`]); empty when none.
    pub attention: Vec<engine::Attended>,
    /// Its id in the model's vocabulary (0 from a backend that is not a language model).
    pub id: u32,
}

#[derive(Debug, Clone)]
pub struct TokenLogprobs {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    /// The most likely alternatives.
    pub top: Vec<TopToken>,
}

#[derive(Debug, Clone)]
pub struct TopToken {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

impl Generation {
    /// Checks each finished output of a structured-output request against its constraint and
    /// records the worst outcome. An output that ended by itself yet fails its schema or
    /// grammar is an error: the API promises the shape. Applies to whatever backend answered.
    pub fn check_outputs(
        &self,
        record: &mut RecordBuilder,
        outputs: &[(&str, &Finished)],
    ) -> Result<(), BackendError> {
        let Some(check) = &self.structured else {
            return Ok(());
        };
        let rank = |o: &grammar::Outcome| match o {
            grammar::Outcome::Valid => 0,
            grammar::Outcome::Incomplete(_) => 1,
            grammar::Outcome::Invalid(_) => 2,
        };
        let began = std::time::Instant::now();
        let mut worst = grammar::Outcome::Valid;
        for (text, f) in outputs {
            // Cut short by max_tokens or by one of the request's stop strings: incomplete, not wrong.
            let outcome = check.check(text, f.reason == FinishReason::Length || f.stop.is_some());
            if rank(&outcome) > rank(&worst) {
                worst = outcome;
            }
        }
        record.stage_since("structured_output", began);
        if let Some(s) = record.record.structured.as_mut() {
            s.outcome = Some(worst.as_str());
            s.problem = match &worst {
                grammar::Outcome::Valid => None,
                grammar::Outcome::Incomplete(p) | grammar::Outcome::Invalid(p) => Some(p.clone()),
            };
        }
        match worst {
            grammar::Outcome::Invalid(problem) => Err(BackendError::InvalidOutput(format!(
                "the output does not follow the requested {}: {problem}",
                check.kind()
            ))),
            _ => Ok(()),
        }
    }
}

/// How a backend failed. The class says what a caller (and, later, a fallback chain) may do
/// about it: a client error must never fall through to another backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum BackendError {
    /// The request is wrong for this model (bad input, bad parameter).
    #[error("{message}")]
    Invalid {
        message: String,
        param: Option<String>,
    },
    /// The prompt plus the tokens asked for do not fit the model.
    #[error("{0}")]
    ContextLength(String),
    /// The backend's own queue is full (`queue_full`), or its first-token gate refused the
    /// request (`shedding`).
    #[error("{message}")]
    Overloaded {
        message: String,
        retry_after_s: u64,
        code: &'static str,
        /// The first-token gate's booking, when it made one.
        booking: Option<crate::error::Booking>,
    },
    /// The backend is stopping or not ready.
    #[error("{message}")]
    Unavailable { message: String, retry_after_s: u64 },
    /// The backend did not answer in time.
    #[error("{message}")]
    Timeout { message: String, retry_after_s: u64 },
    /// The backend broke.
    #[error("{0}")]
    Failed(String),
    /// A structured-output request ended with an output that fails its schema or grammar.
    #[error("{0}")]
    InvalidOutput(String),
    /// The backend has no answer for this input (no rule of a rules model matched): not a
    /// fault of the backend, but the chain goes on.
    #[error("{0}")]
    NoMatch(String),
}

/// The classes of [`BackendError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureClass {
    Client,
    Overload,
    Unavailable,
    Timeout,
    Failure,
    /// No answer for this input ([`BackendError::NoMatch`]).
    NoMatch,
}

impl BackendError {
    pub fn invalid(message: impl Into<String>) -> Self {
        BackendError::Invalid {
            message: message.into(),
            param: None,
        }
    }

    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        BackendError::Invalid {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    pub fn class(&self) -> FailureClass {
        match self {
            BackendError::Invalid { .. } | BackendError::ContextLength(_) => FailureClass::Client,
            BackendError::Overloaded { .. } => FailureClass::Overload,
            BackendError::Unavailable { .. } => FailureClass::Unavailable,
            BackendError::Timeout { .. } => FailureClass::Timeout,
            BackendError::Failed(_) | BackendError::InvalidOutput(_) => FailureClass::Failure,
            BackendError::NoMatch(_) => FailureClass::NoMatch,
        }
    }
}

/// Whether a backend can take work now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// Why it cannot serve, if it cannot (stalled, stopped).
    pub problem: Option<String>,
}

impl Health {
    pub const READY: Health = Health { problem: None };
}

/// A tensor's name, datatype (KServe names: FP32, INT64, BYTES, ...) and shape (-1: dynamic).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

/// What a backend says about itself, for model cards and tensor metadata.
#[derive(Debug, Clone, Default)]
pub struct Description {
    /// Tokens of context (LLMs) or of one input (embedders); 0 for tensor models.
    pub max_context: usize,
    /// The model's runtime (`onnx_tract`, `onnx_onnxruntime`, `rampart_embedding`, `rampart_llm`).
    pub platform: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    /// The input that takes encoded images (declared image pre-processing), if any.
    pub image_input: Option<String>,
}

/// What [`InferenceBackend::start`] returns.
pub type StartFuture<'a> = Pin<Box<dyn Future<Output = Result<Answer, BackendError>> + Send + 'a>>;

/// Anything that answers work: the seam between the front and the models.
pub trait InferenceBackend: Send + Sync + 'static {
    fn kind(&self) -> Kind;

    /// Whether it takes this kind of work (an embedder takes no generation).
    fn accepts(&self, work: WorkKind) -> bool;

    /// Starts the work (the caller holds an admission slot). Blocking work (tokenization,
    /// image decoding, compute) runs off the async workers. Fills the record's model-side
    /// fields (tokens, items, compute time, confidence, the structured-output constraint).
    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a>;

    fn describe(&self) -> Description;

    fn health(&self) -> Health {
        Health::READY
    }

    /// The band of mean token entropy outside which a response is abnormal.
    /// Where the model's control-token texts occur in `text` (byte ranges); none for models
    /// without a vocabulary of them.
    fn special_token_spans(&self, _text: &str) -> Vec<(usize, usize)> {
        Vec::new()
    }

    /// The text a token-id prompt spells, for the guard to judge like any prompt; none for
    /// backends without a vocabulary.
    fn prompt_text(&self, _ids: &[u32]) -> Option<String> {
        None
    }

    fn entropy_band(&self) -> Option<[f32; 2]> {
        None
    }

    /// The engine's scheduler state, for the gauges (LLMs).
    fn engine_snapshot(&self) -> Option<engine::SchedulerSnapshot> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_are_told_apart_from_the_backends_failures() {
        let cases = [
            (BackendError::invalid("bad"), FailureClass::Client),
            (
                BackendError::ContextLength("long".into()),
                FailureClass::Client,
            ),
            (
                BackendError::Overloaded {
                    message: "full".into(),
                    retry_after_s: 1,
                    code: "queue_full",
                    booking: None,
                },
                FailureClass::Overload,
            ),
            (
                BackendError::Unavailable {
                    message: "stopping".into(),
                    retry_after_s: 1,
                },
                FailureClass::Unavailable,
            ),
            (
                BackendError::Timeout {
                    message: "late".into(),
                    retry_after_s: 1,
                },
                FailureClass::Timeout,
            ),
            (BackendError::Failed("boom".into()), FailureClass::Failure),
            (
                BackendError::InvalidOutput("bad json".into()),
                FailureClass::Failure,
            ),
        ];
        for (error, class) in cases {
            assert_eq!(error.class(), class, "{error}");
        }
    }
}
