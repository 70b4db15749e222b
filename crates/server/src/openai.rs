//! The OpenAI wire format: request and response types of `/v1/chat/completions`,
//! `/v1/completions` and `/v1/models`, and their translation to engine requests.
//!
//! Requests accept the fields OpenAI clients send and ignore unknown ones (clients add new
//! fields faster than servers learn them); every accepted field is validated against a documented
//! range. Extensions: `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` on requests, and a
//! per-token `entropy` (nats) next to each logprob.

use std::collections::HashMap;

use engine::{ChatMessage, GenerateRequest, Prompt, SamplingParams};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use grammar::GrammarSpec;

use crate::backend::{EmbeddingInputs, GeneratePlan};
use crate::config::Limits;
use crate::error::ApiError;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the usage of the whole request.
    #[serde(default)]
    pub include_usage: bool,
}

/// Message content: a string, or a list of parts of which `text` parts are used.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatMessageIn {
    /// `system`, `developer` (treated as system), `user`, `assistant` or `tool` (`function`).
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    /// An assistant message's calls of tools (as a response returned them).
    pub tool_calls: Option<Vec<ToolCallIn>>,
    /// A tool message: the id of the call it answers.
    pub tool_call_id: Option<String>,
}

/// A tool call in the history.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ToolCallIn {
    pub id: Option<String>,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct FunctionCallIn {
    pub name: String,
    /// The arguments as a JSON text (an object), as responses return them.
    pub arguments: String,
}

/// A tool call in an answer.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionCallOut {
    pub name: String,
    /// JSON text of an object that follows the function's parameter schema.
    pub arguments: String,
}

/// A tool call's piece in a stream: the first carries id, type and name, the later ones
/// fragments of the arguments.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionDelta,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct FunctionDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// `explain` in a request.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ExplainField {
    pub attention: Option<AttentionField>,
    /// The three spans of the last user message that most support the answer.
    pub reasons: Option<ReasonsField>,
}

/// `explain.reasons`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReasonsField {
    /// `occlusion` (the default): each clause removed in turn and the answer scored again.
    pub method: Option<String>,
}

/// `explain.attention`: what is left out takes the model's defaults (the last two layers,
/// every query head, the top 8 keys, every generated token).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AttentionField {
    /// Layers, 0-based.
    pub layers: Option<Vec<i64>>,
    /// Query heads, 0-based.
    pub heads: Option<Vec<i64>>,
    /// Keys per head and token (1–64).
    pub top_k: Option<i64>,
    /// Generated tokens to export (0 is the first), none: all.
    pub positions: Option<Vec<i64>>,
}

/// One choice's explanation: its attention export and its reasons, as asked.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChoiceExplain {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionExport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasons: Option<ReasonsOut>,
}

/// The reasons of an answer, by occlusion.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ReasonsOut {
    pub method: &'static str,
    /// The message whose content the spans are of (the last user message).
    pub message: usize,
    /// Up to three, the strongest first.
    pub reasons: Vec<ReasonOut>,
    /// Spans tried.
    pub segments: usize,
    /// The answer's probability with the whole input, without the reasons, and without as many
    /// random spans of the same lengths.
    pub deletion: DeletionCheck,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ReasonOut {
    /// The span, verbatim.
    pub text: String,
    /// Byte offsets into the message's content.
    pub start: usize,
    pub end: usize,
    /// How much removing it lowers the answer's log-probability (nats).
    pub drop: f64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DeletionCheck {
    pub probability: f64,
    pub without_reasons: f64,
    pub without_random: f64,
}

impl ReasonsOut {
    pub fn from_occlusion(o: &engine::explain::Occlusion) -> Self {
        Self {
            method: "occlusion",
            message: o.message,
            reasons: o
                .reasons
                .iter()
                .map(|r| ReasonOut {
                    text: r.text.clone(),
                    start: r.start,
                    end: r.end,
                    drop: r.drop,
                })
                .collect(),
            segments: o.segments,
            deletion: DeletionCheck {
                probability: o.logprob.exp(),
                without_reasons: o.without_reasons.exp(),
                without_random: o.without_random.exp(),
            },
        }
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AttentionExport {
    pub layers: Vec<usize>,
    pub heads: Vec<usize>,
    pub top_k: usize,
    /// Positions below it are the prompt's; the rest the completion's, in order.
    pub prompt_tokens: usize,
    /// One entry per exported token.
    pub tokens: Vec<ExportedToken>,
    /// Per position attended: the mean exported weight over the tokens, layers and heads
    /// (a weight outside a head's top_k counts 0), positions ascending.
    #[schema(value_type = Vec<Vec<f64>>)]
    pub positions: Vec<(u32, f32)>,
    /// `sha256:` of the export with the model version's digest, the seed and the kernel: the
    /// audit entry keeps it.
    pub digest: String,
    /// The kernels' identity a replay must match (build, SIMD level, threads).
    pub kernel: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ExportedToken {
    /// The token's index in the completion (0: the first).
    pub index: usize,
    /// `[layer][head]` lists of `[position, weight]`, heaviest first (layers and heads in the
    /// order of `layers` and `heads`).
    #[schema(value_type = Vec<Vec<Vec<Vec<f64>>>>)]
    pub top: Vec<Vec<Vec<(u32, f32)>>>,
}

/// Sampling and output fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingFields {
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// Extension: keep the k most likely tokens.
    pub top_k: Option<i64>,
    /// Extension: drop tokens below min_p × the top probability.
    pub min_p: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    /// Extension: divide logits of tokens already seen.
    pub repetition_penalty: Option<f64>,
    /// Token id (as a string) → bias in [-100, 100].
    pub logit_bias: Option<HashMap<String, f64>>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub user: Option<String>,
    /// Extension: keep generating past end-of-sequence tokens (benchmarks).
    pub ignore_eos: Option<bool>,
    /// Extension: `{"attention": {"layers", "heads", "top_k", "positions"}}` exports, for every
    /// generated token (or the chosen ones), the input positions each head attended to most
    /// (docs/explain.md).
    pub explain: Option<ExplainField>,
    /// Structured output: `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`,
    /// `{"type": "json_object"}` or `{"type": "text"}`; extensions `{"type": "regex", "regex"}`,
    /// `{"type": "choice", "choices"}` and `{"type": "grammar", "grammar"}` (Lark).
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<serde_json::Value>,
    /// Extension (as other servers name it): a JSON schema the output follows.
    #[schema(value_type = Option<Object>)]
    pub guided_json: Option<serde_json::Value>,
    /// Extension: a regex the whole output matches.
    pub guided_regex: Option<String>,
    /// Extension: the output is exactly one of these strings.
    pub guided_choice: Option<Vec<String>>,
    /// Extension: a Lark grammar the output follows.
    pub guided_grammar: Option<String>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessageIn>,
    /// Functions the model may call: `[{"type": "function", "function": {"name",
    /// "description", "parameters", "strict"}}]` (at most 128).
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<serde_json::Value>,
    /// `none`, `auto` (the default with tools), `required`, or `{"type": "function",
    /// "function": {"name": ...}}`.
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<serde_json::Value>,
    /// Whether one answer may call several tools (default true; Llama 3 calls one at a time).
    pub parallel_tool_calls: Option<bool>,
    /// Newer name of max_tokens (wins when both are given).
    pub max_completion_tokens: Option<i64>,
    /// Return log-probabilities of the output tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per token (0–20), with `logprobs: true`.
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// `prompt`: a string, a list of strings, a list of token ids, or a list of those.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: PromptField,
    /// Log-probabilities of the output tokens and this many alternatives (0–20).
    pub logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    /// Special-token texts in the prompt become control tokens (`true`) or stay plain text
    /// (`false`); unset: the model's `parse_special_tokens` (default `true`).
    pub parse_special_tokens: Option<bool>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

/// One alternative token.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// One output token's log-probability (chat format), with its distribution's entropy.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    /// Extension: entropy of the distribution the token was drawn from, in nats.
    pub entropy: f32,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct AssistantMessage {
    pub role: &'static str,
    /// The text answer; null when the model called tools.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallOut>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: AssistantMessage,
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: Option<String>,
    /// Extension: the attention export, when the request asked for one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<ChoiceExplain>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    pub system_fingerprint: String,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    pub usage: Option<Usage>,
    pub system_fingerprint: String,
}

/// Log-probabilities in the completions format, with per-token entropies.
#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<HashMap<String, f32>>,
    pub text_offset: Vec<usize>,
    /// Extension: entropy (nats) of each token's distribution.
    pub entropies: Vec<f32>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub text: String,
    pub index: usize,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<String>,
    /// Extension: the attention export, when the request asked for one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explain: Option<ChoiceExplain>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    pub usage: Option<Usage>,
    pub system_fingerprint: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: String,
    /// Extension: the served version, its digest and whether it is ready.
    pub version: String,
    pub digest: String,
    pub ready: bool,
    pub max_context: usize,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}

fn in_range(name: &str, value: f64, lo: f64, hi: f64) -> Result<f32, ApiError> {
    if value.is_finite() && (lo..=hi).contains(&value) {
        Ok(value as f32)
    } else {
        Err(ApiError::invalid_param(
            name,
            format!("{name} must be between {lo} and {hi}, got {value}"),
        ))
    }
}

fn count(name: &str, value: i64, lo: i64, hi: usize) -> Result<usize, ApiError> {
    if value < lo || value as u64 > hi as u64 {
        return Err(ApiError::invalid_param(
            name,
            format!("{name} must be between {lo} and {hi}, got {value}"),
        ));
    }
    Ok(value as usize)
}

impl SamplingFields {
    /// The structured-output constraint the request asks for, if any.
    fn structured(&self) -> Result<Option<GrammarSpec>, ApiError> {
        let mut guided = serde_json::Map::new();
        if let Some(v) = &self.guided_json {
            guided.insert("guided_json".into(), v.clone());
        }
        if let Some(v) = &self.guided_regex {
            guided.insert("guided_regex".into(), v.clone().into());
        }
        if let Some(v) = &self.guided_choice {
            guided.insert("guided_choice".into(), v.clone().into());
        }
        if let Some(v) = &self.guided_grammar {
            guided.insert("guided_grammar".into(), v.clone().into());
        }
        let param = if self.response_format.is_some() || guided.is_empty() {
            "response_format"
        } else {
            guided
                .keys()
                .next()
                .map_or("response_format", String::as_str)
        };
        grammar::from_request(self.response_format.as_ref(), &guided)
            .map_err(|e| ApiError::invalid_param(param, e.to_string()))
    }

    /// `explain.reasons` checked: the segments' bound when asked (chat answers of one choice,
    /// not streamed).
    pub fn reasons(&self, limits: &Limits) -> Result<Option<usize>, ApiError> {
        let Some(reasons) = self.explain.as_ref().and_then(|e| e.reasons.as_ref()) else {
            return Ok(None);
        };
        let refuse = |m: &str| Err(ApiError::invalid_param("explain", m));
        match reasons.method.as_deref() {
            None | Some("occlusion") => {}
            Some(other) => {
                return refuse(&format!(
                    "explain.reasons.method {other:?} is not supported (occlusion)"
                ))
            }
        }
        if self.stream == Some(true) {
            return refuse("explain.reasons come in whole responses: set stream to false");
        }
        if self.n.is_some_and(|n| n > 1) {
            return refuse("explain.reasons explain one choice: set n to 1");
        }
        Ok(Some(limits.max_reason_segments))
    }

    /// `explain.attention` checked for shape (the model's backend checks it against the model):
    /// non-negative indices, short lists, the server's bound on weights shared by the choices.
    fn explain_spec(
        &self,
        limits: &Limits,
        choices: usize,
    ) -> Result<Option<crate::backend::ExplainSpec>, ApiError> {
        let Some(attention) = self.explain.as_ref().and_then(|e| e.attention.as_ref()) else {
            return Ok(None);
        };
        let list =
            |name: &str, values: &Option<Vec<i64>>| -> Result<Option<Vec<usize>>, ApiError> {
                let Some(values) = values else {
                    return Ok(None);
                };
                if values.len() > 4096 {
                    return Err(ApiError::invalid_param(
                        "explain",
                        format!("explain.attention.{name} may list at most 4096 values"),
                    ));
                }
                values
                    .iter()
                    .map(|&v| {
                        usize::try_from(v).map_err(|_| {
                            ApiError::invalid_param(
                                "explain",
                                format!("explain.attention.{name}: {v} is not a 0-based index"),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map(Some)
            };
        let max_k = engine::explain::MAX_TOP_K;
        let top_k = match attention.top_k {
            Some(k) if (1..=max_k as i64).contains(&k) => Some(k as usize),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "explain",
                    format!("explain.attention.top_k must be between 1 and {max_k}, got {k}"),
                ))
            }
            None => None,
        };
        Ok(Some(crate::backend::ExplainSpec {
            layers: list("layers", &attention.layers)?,
            heads: list("heads", &attention.heads)?,
            top_k,
            positions: list("positions", &attention.positions)?,
            max_entries: limits.max_attention_entries / choices.max(1),
        }))
    }

    /// Validates the fields and builds the engine's request (prompt filled in by the caller).
    fn to_plan(
        &self,
        limits: &Limits,
        max_tokens: Option<i64>,
        top_logprobs: usize,
    ) -> Result<(GenerateRequest, usize), ApiError> {
        let mut sampling = SamplingParams::default();
        if let Some(t) = self.temperature {
            sampling.temperature = in_range("temperature", t, 0.0, 2.0)?;
        }
        if let Some(p) = self.top_p {
            sampling.top_p = in_range("top_p", p, f64::MIN_POSITIVE, 1.0)?;
        }
        if let Some(k) = self.top_k {
            // -1 and 0 both mean "no limit" in the servers clients talk to.
            sampling.top_k = if k <= 0 {
                0
            } else {
                count("top_k", k, 1, 1 << 20)?
            };
        }
        if let Some(p) = self.min_p {
            sampling.min_p = in_range("min_p", p, 0.0, 1.0)?;
        }
        if let Some(p) = self.frequency_penalty {
            sampling.frequency_penalty = in_range("frequency_penalty", p, -2.0, 2.0)?;
        }
        if let Some(p) = self.presence_penalty {
            sampling.presence_penalty = in_range("presence_penalty", p, -2.0, 2.0)?;
        }
        if let Some(p) = self.repetition_penalty {
            sampling.repetition_penalty = in_range("repetition_penalty", p, 0.01, 10.0)?;
        }
        if let Some(bias) = &self.logit_bias {
            if bias.len() > 1024 {
                return Err(ApiError::invalid_param(
                    "logit_bias",
                    "logit_bias may name at most 1024 tokens",
                ));
            }
            for (token, &value) in bias {
                let id: u32 = token.parse().map_err(|_| {
                    ApiError::invalid_param(
                        "logit_bias",
                        format!("logit_bias keys are token ids, got {token:?}"),
                    )
                })?;
                sampling
                    .logit_bias
                    .push((id, in_range("logit_bias", value, -100.0, 100.0)?));
            }
            sampling.logit_bias.sort_by_key(|b| b.0);
        }
        sampling.seed = self.seed.map(|s| s as u64);
        sampling.top_logprobs = top_logprobs;
        let stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(list)) => list.clone(),
        };
        if stop.len() > limits.max_stop {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "at most {} stop strings, got {}",
                    limits.max_stop,
                    stop.len()
                ),
            ));
        }
        if stop.iter().any(|s| s.is_empty() || s.len() > 256) {
            return Err(ApiError::invalid_param(
                "stop",
                "stop strings must be 1 to 256 bytes long",
            ));
        }
        let n = match self.n {
            Some(n) => count("n", n, 1, limits.max_n)?,
            None => 1,
        };
        let max_tokens = match max_tokens {
            Some(m) => count("max_tokens", m, 1, limits.max_tokens)?,
            None => 0,
        };
        let mut request = GenerateRequest::new(Prompt::Tokens(Vec::new()), max_tokens);
        request.sampling = sampling;
        request.stop = stop;
        request.ignore_eos = self.ignore_eos.unwrap_or(false);
        Ok((request, n))
    }
}

/// A request's messages as the engine's: roles checked (`developer` is `system`, `function` is
/// `tool`), content parts joined (text only). Shared by chat completions and `/tokenize`.
pub fn engine_messages(input: &[ChatMessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if input.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages must hold at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(input.len());
    for (i, m) in input.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            // Tool and function results (retrieved documents): the guard's strictest
            // channel; the model's template decides how they read.
            "tool" | "function" => "tool",
            other => {
                return Err(ApiError::invalid_param(
                    "messages",
                    format!(
                        "messages[{i}].role {other:?} is not supported (system, developer, user, assistant, tool)"
                    ),
                ))
            }
        };
        let content = match &m.content {
            None => String::new(),
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid_param(
                                "messages",
                                format!(
                                    "messages[{i}]: content parts of type {kind:?} are not supported (text only)"
                                ),
                            ))
                        }
                    }
                }
                text
            }
        };
        let mut message = ChatMessage::new(role, &content);
        if let Some(calls) = &m.tool_calls {
            if role != "assistant" {
                return Err(ApiError::invalid_param(
                    "messages",
                    format!("messages[{i}]: only assistant messages carry tool_calls"),
                ));
            }
            for (k, call) in calls.iter().enumerate() {
                if call.kind.as_deref().is_some_and(|k| k != "function") {
                    return Err(ApiError::invalid_param(
                        "messages",
                        format!("messages[{i}].tool_calls[{k}].type must be function"),
                    ));
                }
                let arguments: serde_json::Value = serde_json::from_str(&call.function.arguments)
                    .ok()
                    .filter(serde_json::Value::is_object)
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            "messages",
                            format!(
                                "messages[{i}].tool_calls[{k}].function.arguments must be the JSON text of an object"
                            ),
                        )
                    })?;
                message.tool_calls.push(engine::ToolCall {
                    id: call.id.clone().unwrap_or_else(|| format!("call_{i}_{k}")),
                    kind: "function".into(),
                    function: engine::FunctionCall {
                        name: call.function.name.clone(),
                        arguments,
                    },
                });
            }
        }
        if role == "tool" {
            message.tool_call_id = m.tool_call_id.clone();
            message.name = m.name.clone();
        }
        messages.push(message);
    }
    Ok(messages)
}

impl ChatCompletionRequest {
    pub fn plan(&self, limits: &Limits) -> Result<GeneratePlan, ApiError> {
        let messages = engine_messages(&self.messages)?;
        let want_logprobs = self.logprobs.unwrap_or(false);
        let top = match self.top_logprobs {
            Some(k) if !want_logprobs && k > 0 => {
                return Err(ApiError::invalid_param(
                    "top_logprobs",
                    "top_logprobs needs logprobs: true",
                ))
            }
            Some(k) => count("top_logprobs", k, 0, limits.max_top_logprobs)?,
            None => 0,
        };
        let max_tokens = self.max_completion_tokens.or(self.sampling.max_tokens);
        let (mut request, n) = self.sampling.to_plan(limits, max_tokens, top)?;
        let prompt_count = 1;
        let tools = grammar::tools::ToolRequest::from_openai(
            self.tools.as_ref(),
            self.tool_choice.as_ref(),
            self.parallel_tool_calls,
        )
        .map_err(|(param, e)| ApiError::invalid_param(&param, e.to_string()))?;
        let with_tools = tools.is_some()
            || messages
                .iter()
                .any(|m| !m.tool_calls.is_empty() || m.tool_call_id.is_some());
        // What the digest and the audit cover: the messages as (role, content) pairs, or, when
        // tools take part, the messages whole and the tools.
        let input_for_hash = if with_tools {
            serde_json::to_string(&serde_json::json!({
                "messages": messages,
                "tools": tools.as_ref().map(|t| t.template_tools()),
            }))
        } else {
            serde_json::to_string(
                &messages
                    .iter()
                    .map(|m| (m.role.as_str(), m.content.as_str()))
                    .collect::<Vec<_>>(),
            )
        }
        .unwrap_or_default();
        request.prompt = Prompt::Chat(messages.clone());
        Ok(GeneratePlan {
            prompts: vec![Prompt::Chat(messages)],
            n,
            default_max_tokens: max_tokens.is_none(),
            language: None,
            parse_special_tokens: None,
            fallback_level: 0,
            request,
            stream: self.sampling.stream.unwrap_or(false),
            include_usage: self
                .sampling
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            logprobs: want_logprobs,
            user: self.sampling.user.clone(),
            input_for_hash,
            structured: self.sampling.structured()?,
            tools,
            explain: self.sampling.explain_spec(limits, n * prompt_count)?,
        })
    }
}

impl CompletionRequest {
    pub fn plan(&self, limits: &Limits) -> Result<GeneratePlan, ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::invalid_param("echo", "echo is not supported"));
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
        }
        if self.best_of.is_some_and(|b| b > 1) {
            return Err(ApiError::invalid_param(
                "best_of",
                "best_of is not supported (use n)",
            ));
        }
        let prompts: Vec<Prompt> = match &self.prompt {
            PromptField::Text(t) => vec![Prompt::Text(t.clone())],
            PromptField::Texts(list) => list.iter().map(|t| Prompt::Text(t.clone())).collect(),
            PromptField::Tokens(ids) => vec![Prompt::Tokens(ids.clone())],
            PromptField::TokenLists(lists) => lists
                .iter()
                .map(|ids| Prompt::Tokens(ids.clone()))
                .collect(),
        };
        if prompts.is_empty() || prompts.len() > limits.max_prompts {
            return Err(ApiError::invalid_param(
                "prompt",
                format!(
                    "prompt must hold 1 to {} prompts, got {}",
                    limits.max_prompts,
                    prompts.len()
                ),
            ));
        }
        let (top, want) = match self.logprobs {
            Some(k) => (count("logprobs", k, 0, limits.max_top_logprobs)?, true),
            None => (0, false),
        };
        let prompt_count = prompts.len();
        let (request, n) = self
            .sampling
            .to_plan(limits, self.sampling.max_tokens, top)?;
        if prompts.len() * n > limits.max_n * limits.max_prompts.min(limits.max_n) {
            return Err(ApiError::invalid_param(
                "n",
                format!(
                    "{} prompts × n {n} is more choices than the server allows",
                    prompts.len()
                ),
            ));
        }
        let input_for_hash = match &self.prompt {
            PromptField::Text(t) => t.clone(),
            PromptField::Texts(list) => serde_json::to_string(list).unwrap_or_default(),
            PromptField::Tokens(ids) => serde_json::to_string(ids).unwrap_or_default(),
            PromptField::TokenLists(lists) => serde_json::to_string(lists).unwrap_or_default(),
        };
        Ok(GeneratePlan {
            prompts,
            n,
            default_max_tokens: self.sampling.max_tokens.is_none(),
            language: None,
            parse_special_tokens: self.parse_special_tokens,
            fallback_level: 0,
            request,
            stream: self.sampling.stream.unwrap_or(false),
            include_usage: self
                .sampling
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            logprobs: want,
            user: self.sampling.user.clone(),
            input_for_hash,
            structured: self.sampling.structured()?,
            tools: None,
            explain: self.sampling.explain_spec(limits, n * prompt_count)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(json: &str) -> Result<GeneratePlan, ApiError> {
        let r: ChatCompletionRequest = serde_json::from_str(json).unwrap();
        r.plan(&Limits::default())
    }

    #[test]
    fn chat_requests_validate_every_field() {
        let p = chat(
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],
               "max_completion_tokens":5,"temperature":0.5,"top_p":0.9,"stop":"\n","n":2,"seed":-3,
               "logprobs":true,"top_logprobs":3,"logit_bias":{"7":-100},"stream":true,
               "stream_options":{"include_usage":true},"user":"u1","unknown_field":1}"#,
        )
        .unwrap();
        assert_eq!(p.n, 2);
        assert_eq!(p.request.max_tokens, 5);
        assert_eq!(p.request.stop, vec!["\n".to_string()]);
        assert_eq!(p.request.sampling.top_logprobs, 3);
        assert_eq!(p.request.sampling.logit_bias, vec![(7, -100.0)]);
        assert!(p.stream && p.include_usage && p.logprobs);
        match &p.prompts[0] {
            Prompt::Chat(m) => assert_eq!(m[1].content, "ab"),
            other => panic!("{other:?}"),
        }
        for (body, param) in [
            (r#"{"model":"m","messages":[]}"#, "messages"),
            (
                r#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#,
                "messages",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"temperature":3}"#,
                "temperature",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"n":0}"#,
                "n",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
                "max_tokens",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"max_tokens":99999999}"#,
                "max_tokens",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
                "top_logprobs",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"logit_bias":{"x":1}}"#,
                "logit_bias",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#,
                "stop",
            ),
        ] {
            match chat(body) {
                Err(ApiError::InvalidRequest { param: Some(p), .. }) => {
                    assert_eq!(p, param, "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn structured_output_fields_become_a_grammar_spec() {
        let p = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],
               "response_format":{"type":"json_schema","json_schema":{"name":"t","strict":true,"schema":{"type":"object"}}}}"#,
        )
        .unwrap();
        assert_eq!(p.structured.as_ref().map(|s| s.kind()), Some("json_schema"));
        let p = chat(
            r#"{"model":"m","messages":[{"role":"user","content":"x"}],"guided_choice":["a","b"]}"#,
        )
        .unwrap();
        assert_eq!(
            p.structured,
            Some(GrammarSpec::Choice(vec!["a".into(), "b".into()]))
        );
        let p = chat(r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"text"}}"#)
            .unwrap();
        assert!(p.structured.is_none());
        for (body, param) in [
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"yaml"}}"#,
                "response_format",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_object"},"guided_regex":"a"}"#,
                "response_format",
            ),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}],"guided_json":"{not json"}"#,
                "guided_json",
            ),
        ] {
            match chat(body) {
                Err(ApiError::InvalidRequest { param: Some(p), .. }) => {
                    assert_eq!(p, param, "{body}")
                }
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn completion_prompts_take_every_shape() {
        for (prompt, count) in [
            (r#""hello""#, 1),
            (r#"["a","b"]"#, 2),
            (r#"[1,2,3]"#, 1),
            (r#"[[1,2],[3]]"#, 2),
        ] {
            let r: CompletionRequest =
                serde_json::from_str(&format!(r#"{{"model":"m","prompt":{prompt}}}"#)).unwrap();
            assert_eq!(r.plan(&Limits::default()).unwrap().prompts.len(), count);
        }
        let r: CompletionRequest =
            serde_json::from_str(r#"{"model":"m","prompt":"x","echo":true}"#).unwrap();
        assert!(r.plan(&Limits::default()).is_err());
    }
}

/// `input` of `/v1/embeddings`: one text, several texts, one token list or several.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// A `/v1/embeddings` request.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct EmbeddingRequest {
    pub model: String,
    pub input: EmbeddingInput,
    /// `float` (default) or `base64` (the little-endian f32 bytes, base64-encoded).
    pub encoding_format: Option<String>,
    /// Keep the first `dimensions` components and L2-normalize again.
    pub dimensions: Option<usize>,
    pub user: Option<String>,
}

/// What an embedding request asks for, validated.
#[derive(Debug, Clone)]
pub struct EmbeddingPlan {
    /// Texts to tokenize, or token lists as given.
    pub inputs: EmbeddingInputs,
    pub base64: bool,
    pub dimensions: Option<usize>,
    pub user: Option<String>,
    /// The inputs joined, for the record's input hash.
    pub input_for_hash: String,
}

impl EmbeddingRequest {
    pub fn plan(self, limits: &Limits) -> Result<EmbeddingPlan, ApiError> {
        let inputs = match self.input {
            EmbeddingInput::Text(t) => EmbeddingInputs::Texts(vec![t]),
            EmbeddingInput::Texts(t) => EmbeddingInputs::Texts(t),
            EmbeddingInput::Tokens(t) => EmbeddingInputs::Tokens(vec![t]),
            EmbeddingInput::TokenLists(t) => EmbeddingInputs::Tokens(t),
        };
        let count = match &inputs {
            EmbeddingInputs::Texts(t) => t.len(),
            EmbeddingInputs::Tokens(t) => t.len(),
        };
        if count == 0 {
            return Err(ApiError::invalid_param("input", "input must not be empty"));
        }
        if count > limits.max_embedding_inputs {
            return Err(ApiError::invalid_param(
                "input",
                format!(
                    "input has {count} items; at most {} are allowed per request",
                    limits.max_embedding_inputs
                ),
            ));
        }
        let empty = match &inputs {
            EmbeddingInputs::Texts(t) => t.iter().position(|s| s.is_empty()),
            EmbeddingInputs::Tokens(t) => t.iter().position(|s| s.is_empty()),
        };
        if let Some(i) = empty {
            return Err(ApiError::invalid_param(
                "input",
                format!(
                    "input[{i}] is empty; every input must have at least one character or token"
                ),
            ));
        }
        let base64 = match self.encoding_format.as_deref() {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(ApiError::invalid_param(
                    "encoding_format",
                    format!("encoding_format must be \"float\" or \"base64\", got {other:?}"),
                ))
            }
        };
        if self.dimensions == Some(0) {
            return Err(ApiError::invalid_param(
                "dimensions",
                "dimensions must be at least 1",
            ));
        }
        let input_for_hash = match &inputs {
            EmbeddingInputs::Texts(t) => t.join("\n"),
            EmbeddingInputs::Tokens(t) => format!("{t:?}"),
        };
        Ok(EmbeddingPlan {
            inputs,
            base64,
            dimensions: self.dimensions,
            user: self.user,
            input_for_hash,
        })
    }
}

/// One embedding: a list of floats, or base64 of their little-endian bytes.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum EmbeddingVector {
    Float(Vec<f32>),
    Base64(String),
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingData {
    pub object: &'static str,
    pub index: usize,
    pub embedding: EmbeddingVector,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingUsage {
    pub prompt_tokens: usize,
    pub total_tokens: usize,
}

/// The `/v1/embeddings` response.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct EmbeddingResponse {
    pub object: &'static str,
    pub data: Vec<EmbeddingData>,
    pub model: String,
    pub usage: EmbeddingUsage,
}

/// Standard base64 (with padding) of the little-endian bytes of `values`.
pub fn base64_f32(values: &[f32]) -> String {
    let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    base64_bytes(&bytes)
}

pub use pipeline::backend::tensor::base64_bytes;

#[cfg(test)]
mod embedding_tests {
    use super::*;

    #[test]
    fn base64_matches_known_encodings() {
        // 1.0f32 = 00 00 80 3f; 1.0, 2.0 = 00 00 80 3f 00 00 00 40.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
        assert_eq!(base64_f32(&[]), "");
    }

    fn plan(body: &str) -> Result<EmbeddingPlan, String> {
        let request: EmbeddingRequest = serde_json::from_str(body).map_err(|e| e.to_string())?;
        request.plan(&Limits::default()).map_err(|e| e.to_string())
    }

    #[test]
    fn input_shapes_and_errors() {
        let p = plan(r#"{"model":"m","input":"hi"}"#).expect("one text");
        assert!(matches!(p.inputs, EmbeddingInputs::Texts(ref t) if t == &["hi"]));
        let p = plan(r#"{"model":"m","input":[[101,102],[101,7,102]],"encoding_format":"base64"}"#)
            .expect("token lists");
        assert!(p.base64 && matches!(p.inputs, EmbeddingInputs::Tokens(ref t) if t.len() == 2));
        let p = plan(r#"{"model":"m","input":[101,102]}"#).expect("one token list");
        assert!(matches!(p.inputs, EmbeddingInputs::Tokens(ref t) if t.len() == 1));
        assert!(plan(r#"{"model":"m","input":[]}"#)
            .unwrap_err()
            .contains("input must not be empty"));
        assert!(plan(r#"{"model":"m","input":["a",""]}"#)
            .unwrap_err()
            .contains("input[1] is empty"));
        assert!(
            plan(r#"{"model":"m","input":"a","encoding_format":"int8"}"#)
                .unwrap_err()
                .contains("\"float\" or \"base64\"")
        );
        let many = format!(r#"{{"model":"m","input":{:?}}}"#, vec!["x"; 2049]);
        assert!(plan(&many).unwrap_err().contains("at most 2048"));
    }
}
