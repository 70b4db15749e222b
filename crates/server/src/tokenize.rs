//! `POST /tokenize` and `POST /detokenize` (vLLM's shapes): a language model's tokenizer and
//! chat template, without generating. Scope `infer`, like the models they read.
//!
//! - `/tokenize` takes a `prompt` (with `add_special_tokens`, default true: BOS when the model
//!   adds one; `parse_special_tokens`, default the model's `parse_special_tokens` (false unless
//!   it opts in), as `/v1/completions` reads prompts: true reads special-token texts as their
//!   tokens) or chat `messages` (rendered by the
//!   model's template, with `add_generation_prompt`, default true; message contents never become
//!   control tokens, as in a chat completion). It answers `count`, `max_model_len` (the served
//!   context), `tokens`, and with `return_token_strs` each token's text.
//! - `/detokenize` takes `tokens` and answers the `prompt` they spell (special tokens included).
//!
//! `model` names a served language model (`name` or `name@version`); it may be left out when the
//! server serves exactly one. The work runs off the async workers (a long text takes a while), on
//! the tokenize lane's `tokenize_in_flight` threads, below the compute's CPU priority
//! (`[limits] background_nice`, crate::lane): a flood of long texts takes what the generations
//! leave of the cores, not half of them.
//!
//! Both routes cost CPU without generating, so they are bounded like inference: the key's rate
//! limit is taken first (one request from its bucket, 429 `rate_limited`), then a place among
//! `[limits] tokenize_in_flight` server-wide (waiting at most `tokenize_waiting` deep, 429
//! `queue_full` beyond it, 503 after `tokenize_timeout_ms`), and only then is the body read.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use axum::Json;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admission::Slot;
use crate::backend::{Kind, WorkKind};
use crate::error::ApiError;
use crate::error::WireError;
use crate::identity::Principal;
use crate::openai::{engine_messages, ChatMessageIn};
use crate::registry::ModelName;
use crate::state::AppState;

/// `/tokenize`: a prompt, or a chat.
#[derive(Debug, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    /// Text to tokenize (or `messages`).
    pub prompt: Option<String>,
    /// A chat, rendered with the model's template (or `prompt`).
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Prompt: add BOS when the model does (default true). Chat: the template places the
    /// special tokens; this adds nothing.
    pub add_special_tokens: Option<bool>,
    /// Prompt: special-token texts become their tokens; false: they stay plain text (default:
    /// the model's `parse_special_tokens`, as `/v1/completions` reads prompts).
    pub parse_special_tokens: Option<bool>,
    /// Chat: end with the assistant turn's opening (default true).
    pub add_generation_prompt: Option<bool>,
    /// Also answer each token's text.
    #[serde(default)]
    pub return_token_strs: bool,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    /// The context the server serves the model with.
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
    /// Each token's text (its bytes, invalid UTF-8 replaced), with `return_token_strs`.
    pub token_strs: Option<Vec<String>>,
}

/// `/detokenize`.
#[derive(Debug, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// The engine of the named model (or of the only language model served), and whether its
/// completion prompts read special-token texts as control tokens by default.
fn engine_of(
    state: &AppState,
    model: Option<&str>,
) -> Result<(Arc<engine::Engine>, bool), ApiError> {
    let entry = match model {
        Some(name) => state
            .front
            .registry
            .resolve(&ModelName::parse(name), WorkKind::Generate)?,
        None => {
            let mut llms: Vec<_> = state
                .front
                .registry
                .all()
                .into_iter()
                .filter(|e| e.kind() == Kind::Llm)
                .collect();
            llms.dedup_by(|a, b| a.name == b.name);
            match llms.len() {
                1 => llms.remove(0),
                0 => {
                    return Err(ApiError::ModelNotFound(
                        "no language model is served".into(),
                    ))
                }
                _ => {
                    return Err(ApiError::invalid_param(
                        "model",
                        "model is required: several language models are served",
                    ))
                }
            }
        }
    };
    let raw = state
        .config
        .models
        .iter()
        .find(|m| m.name == entry.name)
        .is_some_and(|m| m.parse_special_tokens);
    let engine = entry.engine.clone().ok_or_else(|| {
        ApiError::invalid_param(
            "model",
            format!(
                "{} has no tokenizer of its own to run (a rules or canned model)",
                entry.id
            ),
        )
    })?;
    Ok((engine, raw))
}

/// The key's rate limit, then a place in the tokenizing pool: before the body is read.
async fn admit(state: &AppState, principal: &str) -> Result<Slot, ApiError> {
    if let Err(wait) = state.front.rate_limiter.admit(principal) {
        metrics::counter!("rampart_tokenize_rejected_total", "reason" => "rate_limited")
            .increment(1);
        return Err(ApiError::Overloaded {
            message: format!("rate limit of key {principal:?} reached; retry in {wait} s"),
            retry_after_s: wait,
            code: "rate_limited",
            booking: None,
        });
    }
    state.tokenizing.acquire().await.inspect_err(|e| {
        let reason = match e {
            ApiError::Overloaded { code, .. } => *code,
            _ => "timeout",
        };
        metrics::counter!("rampart_tokenize_rejected_total", "reason" => reason).increment(1);
    })
}

async fn read_json<T: serde::de::DeserializeOwned>(
    state: &AppState,
    body: Body,
) -> Result<T, ApiError> {
    let limit = state.config.limits.max_body_bytes;
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|e| crate::identity::body_error(&e, limit))?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::invalid(format!("invalid JSON: {e}")))
}

fn engine_error(param: &str, e: engine::EngineError) -> ApiError {
    ApiError::invalid_param(param, e.to_string())
}

#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest, responses(
    (status = 200, body = TokenizeResponse), (status = 400, body = crate::error::ErrorBody),
    (status = 401, body = crate::error::ErrorBody), (status = 404, body = crate::error::ErrorBody)))]
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    body: Body,
) -> Response {
    answer(&state, &principal.0, tokenize_inner(&state, body)).await
}

/// Runs `work` (lazy: nothing of it, the body's read included, happens before) once
/// [`admit`] gave it a place, and answers its result.
async fn answer<R: Serialize>(
    state: &AppState,
    principal: &str,
    work: impl std::future::Future<Output = Result<R, ApiError>>,
) -> Response {
    let _slot = match admit(state, principal).await {
        Ok(slot) => slot,
        Err(e) => return e.into_response(),
    };
    match work.await {
        Ok(r) => Json(r).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn tokenize_inner(state: &AppState, body: Body) -> Result<TokenizeResponse, ApiError> {
    let request: TokenizeRequest = read_json(state, body).await?;
    let (engine, raw) = engine_of(state, request.model.as_deref())?;
    let chat = match (&request.prompt, &request.messages) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param(
                "messages",
                "give either prompt or messages, not both",
            ))
        }
        (None, None) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "prompt (a text) or messages (a chat) is required",
            ))
        }
        (None, Some(messages)) => Some(engine_messages(messages)?),
        (Some(_), None) => None,
    };
    if chat.is_none() && request.add_generation_prompt.is_some() {
        return Err(ApiError::invalid_param(
            "add_generation_prompt",
            "add_generation_prompt applies to messages only",
        ));
    }
    if chat.is_some() && request.parse_special_tokens.is_some() {
        return Err(ApiError::invalid_param(
            "parse_special_tokens",
            "parse_special_tokens applies to prompt only (chat contents are always plain text)",
        ));
    }
    let prompt = request.prompt.unwrap_or_default();
    let bos = request.add_special_tokens.unwrap_or(true);
    let parse = request.parse_special_tokens.unwrap_or(raw);
    let generation_prompt = request.add_generation_prompt.unwrap_or(true);
    let strs = request.return_token_strs;
    state
        .tokenize_lane
        .run(move || {
            let tokenizer = engine.tokenizer();
            let tokens = match chat {
                Some(messages) => engine
                    .encode_chat_with(&messages, generation_prompt)
                    .map_err(|e| engine_error("messages", e))?,
                None if parse => tokenizer
                    .encode(&prompt, bos)
                    .map_err(|e| engine_error("prompt", e))?,
                None => tokenizer
                    .encode_plain(&prompt, bos)
                    .map_err(|e| engine_error("prompt", e))?,
            };
            let token_strs =
                strs.then(|| tokens.iter().map(|&t| tokenizer.token_text(t)).collect());
            Ok(TokenizeResponse {
                count: tokens.len(),
                max_model_len: engine.context(),
                tokens,
                token_strs,
            })
        })
        .await?
}

#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest, responses(
    (status = 200, body = DetokenizeResponse), (status = 400, body = crate::error::ErrorBody),
    (status = 401, body = crate::error::ErrorBody), (status = 404, body = crate::error::ErrorBody)))]
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    Extension(principal): Extension<Principal>,
    body: Body,
) -> Response {
    answer(&state, &principal.0, detokenize_inner(&state, body)).await
}

async fn detokenize_inner(state: &AppState, body: Body) -> Result<DetokenizeResponse, ApiError> {
    let request: DetokenizeRequest = read_json(state, body).await?;
    let (engine, _) = engine_of(state, request.model.as_deref())?;
    let vocab = engine.tokenizer().vocab_size();
    let mut ids = Vec::with_capacity(request.tokens.len());
    for (i, &t) in request.tokens.iter().enumerate() {
        match u32::try_from(t) {
            Ok(id) if (id as usize) < vocab => ids.push(id),
            _ => {
                return Err(ApiError::invalid_param(
                    "tokens",
                    format!("tokens[{i}] = {t} is not a token id of this vocabulary (0..{vocab})"),
                ))
            }
        }
    }
    let prompt = state
        .tokenize_lane
        .run(move || engine.tokenizer().decode(&ids))
        .await?;
    Ok(DetokenizeResponse { prompt })
}
