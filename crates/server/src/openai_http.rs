//! The OpenAI-compatible endpoints over HTTP: decode the wire format, call the front, encode the
//! answer (one JSON body, or an SSE stream of chunks).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use engine::{FinishReason, Finished};
use futures_util::stream;
use record::{sha256_hex, RecordBuilder};

use crate::backend::{Answer, EmbedWork, Embeddings, Generated, Kind, Token, Work, WorkKind};
use crate::chain::Fallback;
use crate::error::WireError;
use crate::error::{ApiError, ErrorBody};
use crate::front;
use crate::identity::{self, Principal, RequestId};
use crate::model_path::ModelPath;
use crate::openai::*;
use crate::registry::{Entry, ModelName};
use crate::state::AppState;
use pipeline::finish::Delivery;

/// The two generation endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat.completions",
            Endpoint::Completions => "completions",
        }
    }
}

/// Chat completions (streaming with `stream: true`).
#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatCompletionRequest, responses(
    (status = 200, body = ChatCompletion, description = "A completion, or an SSE stream of ChatCompletionChunk"),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(state, id, principal, &headers, body, Endpoint::Chat).await
}

/// Text completions (streaming with `stream: true`).
#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest, responses(
    (status = 200, body = Completion, description = "A completion, or an SSE stream of Completion chunks"),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    generate(state, id, principal, &headers, body, Endpoint::Completions).await
}

/// Decode → front → encode, for both generation endpoints.
#[tracing::instrument(name = "openai", skip_all, fields(endpoint = endpoint.name(), request_id = %id.0))]
async fn generate(
    state: Arc<AppState>,
    id: RequestId,
    principal: Principal,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    let mut record = state
        .front
        .record(id.0, principal.0.clone(), endpoint.name());
    let audit_id = record.record.audit_id.clone();
    let language = headers
        .get(header::ACCEPT_LANGUAGE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let mut response = match start(
        &state,
        &principal.0,
        headers,
        body,
        endpoint,
        language,
        &mut record,
    )
    .await
    {
        Ok(reply) => {
            record.record.stream = reply.shape.stream;
            let fallback = reply.fallback.clone();
            let mut response = if reply.shape.stream {
                stream_response(reply, record)
            } else {
                collect_response(reply, record).await
            };
            crate::marks::mark_fallback(&mut response, fallback.as_ref());
            response
        }
        Err(e) => {
            let _ = front::settle::<()>(&mut record, Err(&e)).await;
            e.into_response()
        }
    };
    crate::marks::mark_audit(&mut response, &audit_id);
    crate::feedback_routes::stamp(&state, &mut response, &audit_id);
    response
}

/// Parses and validates the body, then hands the plan to the front.
async fn start(
    state: &Arc<AppState>,
    principal: &str,
    headers: &HeaderMap,
    body: Body,
    endpoint: Endpoint,
    language: Option<String>,
    record: &mut RecordBuilder,
) -> Result<Reply, ApiError> {
    let bytes = identity::read_body(body, state.config.limits.max_body_bytes, record).await?;
    let (model, mut plan, reasons) = decode_generation(&bytes, endpoint, &state.config.limits)?;
    plan.language = language;
    note_input(record, endpoint, &plan, state.config.monitor.enabled);
    // Who it is, for the first-token gate's bookings and fair order.
    let tenant = state
        .keys
        .as_ref()
        .map_or(principal, |keys| keys.tenant(principal));
    plan.request.claim = Some(crate::claims::claim(
        tenant,
        state.config.admission.weight(tenant),
        headers,
        &record.record.input_sha256,
    ));
    let shape = Shape {
        stream: plan.stream,
        include_usage: plan.include_usage,
        logprobs: plan.logprobs,
        n: plan.n,
        seed: plan.request.sampling.seed,
        reasons,
    };
    let work = Work::Generate(Box::new(plan));
    let admitted = front::serve(&state.front, principal, &model, work, record).await?;
    let Answer::Generation(g) = admitted.answer else {
        return Err(ApiError::Internal(
            "the backend answered a generation with something else".into(),
        ));
    };
    let id = response_id(endpoint, record);
    let delivery = Delivery::new(g, admitted.entry, admitted.ticket, shape.stream, record);
    Ok(Reply {
        delivery,
        fallback: admitted.fallback,
        shape,
        endpoint,
        id,
        created: now_s(),
    })
}

/// What the record keeps of a generation's input: the user, the input's digest and payload,
/// the monitors' observation, the sampling parameters.
fn note_input(
    record: &mut RecordBuilder,
    endpoint: Endpoint,
    plan: &crate::backend::GeneratePlan,
    monitored: bool,
) {
    record.record.user = plan.user.clone();
    record.record.input_sha256 = sha256_hex(&plan.input_for_hash);
    record.payload_input(|| audit_input(endpoint, &plan.input_for_hash));
    if monitored {
        record.observe(crate::monitors::text_observation(
            endpoint == Endpoint::Chat,
            &plan.input_for_hash,
        ));
    }
    record.record.params = Some(params_of(plan));
}

/// A fresh response id (`chatcmpl-…`, `cmpl-…`), named in the record and its timeline.
fn response_id(endpoint: Endpoint, record: &mut RecordBuilder) -> String {
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    let id = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
    record.record.response_id = Some(id.clone());
    if let Some(t) = record.timeline_mut() {
        t.response_id = Some(id.clone());
    }
    id
}

/// The sampling parameters a generation's record keeps.
fn params_of(plan: &crate::backend::GeneratePlan) -> serde_json::Value {
    let sampling = &plan.request.sampling;
    serde_json::json!({
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "max_tokens": plan.request.max_tokens,
        "n": plan.n,
        "seed": sampling.seed,
        "stop": plan.request.stop,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logprobs": plan.logprobs,
        "structured": plan.structured.is_some(),
    })
}

/// What the audit log keeps of a generation's input: a chat's messages as `{role, content}`
/// objects, a completion's prompt as sent.
fn audit_input(endpoint: Endpoint, input_for_hash: &str) -> serde_json::Value {
    if endpoint == Endpoint::Chat {
        if let Ok(pairs) = serde_json::from_str::<Vec<(String, String)>>(input_for_hash) {
            let messages: Vec<serde_json::Value> = pairs
                .into_iter()
                .map(|(role, content)| serde_json::json!({ "role": role, "content": content }))
                .collect();
            return serde_json::json!({ "messages": messages });
        }
    }
    serde_json::json!({ "prompt": input_for_hash })
}

/// The model named and the validated plan of a chat or completion body.
fn decode_generation(
    bytes: &[u8],
    endpoint: Endpoint,
    limits: &crate::config::Limits,
) -> Result<(ModelName, crate::backend::GeneratePlan, Option<Reasons>), ApiError> {
    let (model, plan, reasons) = match endpoint {
        Endpoint::Chat => {
            let r: ChatCompletionRequest = parse_json(bytes)?;
            let plan = r.plan(limits)?;
            let reasons = match (r.sampling.reasons(limits)?, plan.prompts.first()) {
                (Some(max_segments), Some(engine::Prompt::Chat(messages))) => Some(Reasons {
                    messages: messages.clone(),
                    max_segments,
                    labels: match &plan.structured {
                        Some(grammar::GrammarSpec::Choice(labels)) => Some(labels.clone()),
                        _ => None,
                    },
                }),
                _ => None,
            };
            (r.model.clone(), plan, reasons)
        }
        Endpoint::Completions => {
            let r: CompletionRequest = parse_json(bytes)?;
            if r.sampling.reasons(limits)?.is_some() {
                return Err(ApiError::invalid_param(
                    "explain",
                    "explain.reasons explain chat answers (/v1/chat/completions)",
                ));
            }
            (r.model.clone(), r.plan(limits)?, None)
        }
    };
    Ok((ModelName::parse(&model), plan, reasons))
}

/// The reasons of the first choice's answer (`explain.reasons`), by occlusion on the engine
/// that answered, off the async workers; the record keeps them, or why there are none (a
/// fallback that is not a language model, a failure).
async fn give_reasons(
    ask: Option<Reasons>,
    engine: Option<Arc<engine::Engine>>,
    seed: Option<u64>,
    texts: &[String],
    ids: Vec<u32>,
    record: &mut RecordBuilder,
) -> Option<ReasonsOut> {
    let ask = ask?;
    let Some(engine) = engine else {
        record.record.reasons = Some(serde_json::json!({
            "error": "the answer came from a backend that is not a language model"
        }));
        return None;
    };
    let (messages, max, labels, answer) = (
        ask.messages,
        ask.max_segments,
        ask.labels,
        texts.first().cloned().unwrap_or_default(),
    );
    // The random spans of the deletion check: the request's seed, or a fixed one.
    let seed = seed.unwrap_or(0x5eed);
    let began = std::time::Instant::now();
    let done = tokio::task::spawn_blocking(move || {
        let answer = engine::explain::Answer {
            text: &answer,
            ids: &ids,
            labels: labels.as_deref(),
        };
        engine::explain::occlusion(&engine, &messages, &answer, max, seed)
    })
    .await;
    let ms = began.elapsed().as_secs_f64() * 1e3;
    match done {
        Ok(Ok(o)) => {
            let out = ReasonsOut::from_occlusion(&o);
            let mut kept = serde_json::to_value(&out).unwrap_or_default();
            kept["scored"] = o.scored.into();
            kept["ms"] = ms.into();
            record.record.reasons = Some(kept);
            Some(out)
        }
        Ok(Err(e)) => {
            tracing::warn!(target: "rampart::explain", error = %e, "no reasons for this answer");
            record.record.reasons = Some(serde_json::json!({ "error": e.to_string() }));
            None
        }
        Err(e) => {
            record.record.reasons = Some(serde_json::json!({ "error": e.to_string() }));
            None
        }
    }
}

/// A chat's `explain.reasons`: the messages and the bound on spans tried.
#[derive(Debug, Clone)]
struct Reasons {
    messages: Vec<engine::ChatMessage>,
    max_segments: usize,
    /// A label answer's labels (`guided_choice`, a `choice` response format): its probability
    /// is then the one the decoder held to them gave the tokens it drew.
    labels: Option<Vec<String>>,
}

/// Embeddings of one or more inputs (texts or token lists).
#[utoipa::path(post, path = "/v1/embeddings", request_body = EmbeddingRequest, responses(
    (status = 200, body = EmbeddingResponse),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
#[tracing::instrument(name = "openai", skip_all, fields(endpoint = "embeddings", request_id = %id.0))]
pub async fn embeddings(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    body: Body,
) -> Response {
    let mut record = state.front.record(id.0, principal.0.clone(), "embeddings");
    let result = embed(&state, &principal.0, body, &mut record).await;
    let mut response = match front::conclude(&mut record, result).await {
        Ok((body, fallback)) => {
            let mut response = Json(body).into_response();
            crate::marks::mark_fallback(&mut response, fallback.as_ref());
            response
        }
        Err(e) => e.into_response(),
    };
    crate::marks::mark_audit(&mut response, &record.record.audit_id);
    response
}

async fn embed(
    state: &Arc<AppState>,
    principal: &str,
    body: Body,
    record: &mut RecordBuilder,
) -> Result<(EmbeddingResponse, Option<Fallback>), ApiError> {
    let bytes = identity::read_body(body, state.config.limits.max_body_bytes, record).await?;
    let request: EmbeddingRequest = parse_json(&bytes)?;
    let model = ModelName::parse(&request.model);
    let plan = request.plan(&state.config.limits)?;
    record.record.user = plan.user.clone();
    record.record.input_sha256 = sha256_hex(&plan.input_for_hash);
    record.payload_input(|| serde_json::json!({ "input": plan.input_for_hash }));
    if state.config.monitor.enabled {
        record.observe(crate::monitors::text_observation(
            false,
            &plan.input_for_hash,
        ));
    }
    let work = Work::Embed(EmbedWork {
        inputs: plan.inputs,
        dimensions: plan.dimensions,
    });
    let admitted = front::serve(&state.front, principal, &model, work, record).await?;
    let Answer::Embeddings(e) = admitted.answer else {
        return Err(ApiError::Internal(
            "the backend answered embeddings with something else".into(),
        ));
    };
    pipeline::finish::record_embeddings(record, &e);
    Ok((
        encode_embeddings(e, plan.base64, &admitted.entry.name),
        admitted.fallback,
    ))
}

fn encode_embeddings(e: Embeddings, base64: bool, model: &str) -> EmbeddingResponse {
    let data = e
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| EmbeddingData {
            object: "embedding",
            index,
            embedding: if base64 {
                EmbeddingVector::Base64(base64_f32(&v))
            } else {
                EmbeddingVector::Float(v)
            },
        })
        .collect();
    EmbeddingResponse {
        object: "list",
        data,
        model: model.to_string(),
        usage: EmbeddingUsage {
            prompt_tokens: e.prompt_tokens,
            total_tokens: e.prompt_tokens,
        },
    }
}

fn card(e: &Entry) -> ModelCard {
    ModelCard {
        id: e.name.clone(),
        object: "model",
        created: e.created,
        owned_by: "rampart".into(),
        version: e.version.clone(),
        digest: e.digest.clone(),
        ready: true,
        max_context: e.backend.describe().max_context,
    }
}

/// The served language and embedding models.
#[utoipa::path(get, path = "/v1/models", responses((status = 200, body = ModelList)))]
pub async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    let mut entries = state.front.registry.all();
    // Language models first, then embedders (tensor models are KServe's).
    entries.retain(|e| e.kind() != Kind::Tensor);
    entries.sort_by_key(|e| e.kind() != Kind::Llm);
    Json(ModelList {
        object: "list",
        data: entries.iter().map(|e| card(e)).collect(),
    })
}

/// One model (`name` or `name@version`) and its status.
#[utoipa::path(get, path = "/v1/models/{id}", params(("id" = String, Path, description = "name or name@version")),
    responses((status = 200, body = ModelCard), (status = 404, body = ErrorBody)))]
pub async fn get_model(State(state): State<Arc<AppState>>, model: ModelPath) -> Response {
    let name = ModelName::versioned(model.name(), model.version().as_deref());
    match state.front.registry.resolve(&name, WorkKind::Generate) {
        Ok(e) => Json(card(&e)).into_response(),
        Err(e) => e.into_response(),
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let what = if e.is_syntax() || e.is_eof() {
            "malformed JSON"
        } else {
            "invalid request"
        };
        ApiError::invalid(format!("{what}: {e}"))
    })
}

/// What of the plan the encoder needs.
#[derive(Debug, Clone)]
struct Shape {
    stream: bool,
    include_usage: bool,
    logprobs: bool,
    /// Choices per prompt and the request's seed (each choice's is the seed + its number).
    n: usize,
    seed: Option<u64>,
    /// `explain.reasons`, when asked.
    reasons: Option<Reasons>,
}

/// An admitted generation on its way to the client.
struct Reply {
    /// Its events, and the finishing every protocol shares (crate::finish).
    delivery: Delivery,
    /// The fallback that answered, if the model asked for did not.
    fallback: Option<Fallback>,
    shape: Shape,
    endpoint: Endpoint,
    id: String,
    created: u64,
}

/// Per-choice state while events arrive (the text is the delivery's).
#[derive(Default)]
struct ChoiceState {
    chat_logprobs: Vec<TokenLogprob>,
    completion_logprobs: CompletionLogprobs,
    finish: Option<Finished>,
}

/// Every choice's attention export while the tokens arrive, and what the record keeps of them.
#[derive(Default)]
struct Explains {
    info: Option<crate::backend::ExplainInfo>,
    states: Vec<Option<ExplainState>>,
    /// Per finished choice: its digest and the digest after each exported token.
    finished: Vec<Option<(String, Vec<String>)>>,
}

impl Explains {
    /// Choice i of prompt p is the (n·p + k)-th; its seed the request's + k (as the backend
    /// seeds it).
    fn new(reply: &Reply, version_digest: &str) -> Self {
        let Some(info) = reply.delivery.explain() else {
            return Self::default();
        };
        let choices = reply.delivery.choices();
        let n = reply.shape.n.max(1);
        Self {
            states: (0..choices)
                .map(|i| {
                    let seed = reply.shape.seed.map(|s| s.wrapping_add((i % n) as u64));
                    Some(ExplainState::new(info, version_digest, seed))
                })
                .collect(),
            finished: vec![None; choices],
            info: Some(info.clone()),
        }
    }

    fn on_token(&mut self, i: usize, attention: &[engine::Attended]) {
        if let Some(Some(s)) = self.states.get_mut(i) {
            s.on_token(attention);
        }
    }

    /// Choice i's export, once it finished.
    fn finish(&mut self, i: usize, prompt_tokens: usize) -> Option<ChoiceExplain> {
        let state = self.states.get_mut(i)?.take()?;
        let steps = state.steps.clone();
        let explain = state.finish(prompt_tokens);
        let digest = explain
            .attention
            .as_ref()
            .map(|a| a.digest.clone())
            .unwrap_or_default();
        self.finished[i] = Some((digest, steps));
        Some(explain)
    }

    /// The digests (`attention_sha256`) and what a replay needs (`attention`) into the record.
    fn record(&self, record: &mut record::InferenceRecord) {
        let Some(info) = &self.info else {
            return;
        };
        let done: Vec<&(String, Vec<String>)> = self.finished.iter().flatten().collect();
        record.attention_sha256 = Some(
            done.iter()
                .map(|(d, _)| d.as_str())
                .collect::<Vec<_>>()
                .join(","),
        );
        record.attention = Some(serde_json::json!({
            "kernel": info.kernel,
            "settings": info.replay,
            "steps": done.iter().map(|(_, s)| s).collect::<Vec<_>>(),
        }));
    }
}

/// One choice's attention export while its tokens arrive.
struct ExplainState {
    info: crate::backend::ExplainInfo,
    digest: engine::AttentionDigest,
    /// Tokens seen so far (the next one's index).
    seen: usize,
    /// The digest after each exported token (`AttentionDigest::step`).
    steps: Vec<String>,
    tokens: Vec<ExportedToken>,
    /// Exported weight per position, summed.
    sums: std::collections::BTreeMap<u32, f64>,
}

impl ExplainState {
    fn new(info: &crate::backend::ExplainInfo, version_digest: &str, seed: Option<u64>) -> Self {
        Self {
            digest: engine::AttentionDigest::new(&info.request, version_digest, seed, &info.kernel),
            info: info.clone(),
            seen: 0,
            steps: Vec::new(),
            tokens: Vec::new(),
            sums: Default::default(),
        }
    }

    fn on_token(&mut self, attention: &[engine::Attended]) {
        let index = self.seen;
        self.seen += 1;
        if attention.is_empty() {
            return;
        }
        self.digest.token(index, attention);
        self.steps.push(self.digest.step());
        let k = self.info.request.top_k;
        let heads = self.info.request.heads.len();
        let top = attention
            .chunks(heads * k)
            .map(|layer| {
                layer
                    .chunks(k)
                    .map(|head| {
                        head.iter()
                            .filter(|a| **a != engine::Attended::NONE)
                            .map(|a| {
                                *self.sums.entry(a.position).or_default() += a.weight as f64;
                                (a.position, a.weight)
                            })
                            .collect()
                    })
                    .collect()
            })
            .collect();
        self.tokens.push(ExportedToken { index, top });
    }

    fn finish(self, prompt_tokens: usize) -> ChoiceExplain {
        let r = &self.info.request;
        let rows = (self.tokens.len() * r.layers.len() * r.heads.len()).max(1) as f64;
        ChoiceExplain {
            reasons: None,
            attention: Some(AttentionExport {
                layers: r.layers.clone(),
                heads: r.heads.clone(),
                top_k: r.top_k,
                prompt_tokens,
                positions: self
                    .sums
                    .iter()
                    .map(|(&p, &w)| (p, (w / rows) as f32))
                    .collect(),
                tokens: self.tokens,
                digest: self.digest.finish(),
                kernel: self.info.kernel,
            }),
        }
    }
}

/// Tokens a structured-output constraint ruled out have log-probability −∞, which JSON cannot
/// carry; they are reported as −9999 (as OpenAI reports impossible tokens).
fn finite_logprob(lp: f32) -> f32 {
    lp.max(-9999.0)
}

fn finish_reason(f: &Finished) -> String {
    match f.reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    }
    .to_string()
}

impl Reply {
    fn model(&self) -> String {
        self.delivery.entry().name.clone()
    }

    fn fingerprint(&self) -> String {
        let entry = self.delivery.entry();
        format!("{}@{}", entry.name, entry.version)
    }

    fn usage(&self, completion_tokens: usize) -> Usage {
        let prompt_tokens = self.delivery.prompt_tokens();
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
        }
    }

    fn token_logprob(&self, t: &Token) -> TokenLogprob {
        let lp = t.logprobs.as_ref();
        TokenLogprob {
            token: lp.map(|l| l.token.clone()).unwrap_or_default(),
            logprob: lp.map_or(0.0, |l| l.logprob),
            bytes: lp.map(|l| l.bytes.clone()).unwrap_or_default(),
            entropy: t.entropy,
            top_logprobs: lp
                .map(|l| {
                    l.top
                        .iter()
                        .map(|top| TopLogprob {
                            token: top.token.clone(),
                            logprob: finite_logprob(top.logprob),
                            bytes: top.bytes.clone(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
        }
    }

    /// Adds a token's log-probabilities to a completion's, at `offset` in the choice's text.
    fn add_completion_logprob(&self, state: &mut ChoiceState, t: &Token, offset: usize) {
        let lp = &mut state.completion_logprobs;
        lp.text_offset.push(offset);
        let Some(l) = &t.logprobs else { return };
        lp.tokens.push(l.token.clone());
        lp.token_logprobs.push(l.logprob);
        lp.entropies.push(t.entropy);
        lp.top_logprobs.push(
            l.top
                .iter()
                .map(|top| (top.token.clone(), finite_logprob(top.logprob)))
                .collect::<HashMap<_, _>>(),
        );
    }
}

async fn collect_response(mut reply: Reply, mut record: RecordBuilder) -> Response {
    let choices = reply.delivery.choices();
    let mut states: Vec<ChoiceState> = (0..choices).map(|_| ChoiceState::default()).collect();
    let mut explains = Explains::new(&reply, &record.record.version_digest);
    // The first choice's token ids, for its reasons.
    let mut first_ids: Vec<u32> = Vec::new();
    let mut done = false;
    while !done {
        let Some((i, event)) = reply.delivery.next().await else {
            let e = ApiError::Unavailable {
                message: "the engine stopped before the request finished".into(),
                retry_after_s: 5,
            };
            let _ = front::settle::<()>(&mut record, Err(&e)).await;
            return e.into_response();
        };
        match event {
            Generated::Token(t) => {
                explains.on_token(i, &t.attention);
                if i == 0 && reply.shape.reasons.is_some() {
                    first_ids.push(t.id);
                }
                if reply.shape.logprobs {
                    match reply.endpoint {
                        Endpoint::Chat => {
                            let lp = reply.token_logprob(&t);
                            states[i].chat_logprobs.push(lp);
                        }
                        Endpoint::Completions => {
                            let offset = reply.delivery.text(i).len();
                            let mut s = std::mem::take(&mut states[i]);
                            reply.add_completion_logprob(&mut s, &t, offset);
                            states[i] = s;
                        }
                    }
                }
                reply.delivery.on_token(&mut record, i, &t);
            }
            Generated::Finished(f) => {
                done = reply.delivery.on_finished(i, &f);
                states[i].finish = Some(f);
            }
            Generated::Failed(e) => {
                let e = ApiError::from(e);
                let _ = front::settle::<()>(&mut record, Err(&e)).await;
                return e.into_response();
            }
        }
    }
    if let Err(e) = reply.delivery.finish(&mut record) {
        let _ = front::settle::<()>(&mut record, Err(&e)).await;
        return e.into_response();
    }
    let texts = reply.delivery.take_texts();
    let calls = read_tool_calls(&mut reply.delivery, &texts);
    // Each choice's export finished; their digests go into the record (and the audit entry).
    let mut finished: Vec<Option<ChoiceExplain>> = states
        .iter()
        .enumerate()
        .map(|(i, s)| explains.finish(i, s.finish.as_ref().map_or(0, |f| f.prompt_tokens)))
        .collect();
    explains.record(&mut record.record);
    let (ask, engine, seed) = (
        reply.shape.reasons.clone(),
        reply.delivery.entry().engine.clone(),
        reply.shape.seed,
    );
    if let Some(reasons) = give_reasons(ask, engine, seed, &texts, first_ids, &mut record).await {
        match finished.first_mut() {
            Some(Some(e)) => e.reasons = Some(reasons),
            Some(slot) => {
                *slot = Some(ChoiceExplain {
                    attention: None,
                    reasons: Some(reasons),
                })
            }
            None => {}
        }
    }
    let response = encode_collected(
        &reply,
        states,
        finished,
        texts,
        calls,
        reply.usage(record.record.completion_tokens),
    );
    // The answer leaves only once its audit entry is durable (fail_closed).
    if let Err(e) = front::durable(record.finish()).await {
        return e.into_response();
    }
    response
}

/// Each choice's tool calls read out of its text (none without tools): the text answer (none
/// when it called tools) and the calls.
fn read_tool_calls(
    delivery: &mut Delivery,
    texts: &[String],
) -> Vec<Option<(Option<String>, Vec<ToolCallOut>)>> {
    let Some(session) = delivery.tools().cloned() else {
        return vec![None; texts.len()];
    };
    texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let read = session.read(text);
            let calls = read
                .calls
                .into_iter()
                .enumerate()
                .map(|(index, (name, arguments))| ToolCallOut {
                    id: delivery.tool_call_id(i, index),
                    kind: "function",
                    function: FunctionCallOut { name, arguments },
                })
                .collect();
            Some((read.content, calls))
        })
        .collect()
}

/// A chat choice's finish reason: `tool_calls` when it ended by itself after calling tools.
fn chat_finish_reason(f: &Finished, called: bool) -> String {
    if called && f.reason == FinishReason::Stop {
        "tool_calls".into()
    } else {
        finish_reason(f)
    }
}

/// The one JSON body of a non-streaming generation.
fn encode_collected(
    reply: &Reply,
    states: Vec<ChoiceState>,
    explains: Vec<Option<ChoiceExplain>>,
    texts: Vec<String>,
    calls: Vec<Option<(Option<String>, Vec<ToolCallOut>)>>,
    usage: Usage,
) -> Response {
    match reply.endpoint {
        Endpoint::Chat => Json(ChatCompletion {
            id: reply.id.clone(),
            object: "chat.completion",
            created: reply.created,
            model: reply.model(),
            choices: states
                .into_iter()
                .zip(texts)
                .zip(calls)
                .zip(explains)
                .enumerate()
                .map(|(index, (((s, text), calls), explain))| {
                    let (content, tool_calls) = match calls {
                        None => (Some(text), None),
                        Some((content, calls)) if calls.is_empty() => (content, None),
                        Some((content, calls)) => (content, Some(calls)),
                    };
                    ChatChoice {
                        index,
                        finish_reason: s
                            .finish
                            .as_ref()
                            .map(|f| chat_finish_reason(f, tool_calls.is_some())),
                        logprobs: reply.shape.logprobs.then_some(ChatLogprobs {
                            content: s.chat_logprobs,
                        }),
                        message: AssistantMessage {
                            role: "assistant",
                            content,
                            tool_calls,
                        },
                        explain,
                    }
                })
                .collect(),
            usage,
            system_fingerprint: reply.fingerprint(),
        })
        .into_response(),
        Endpoint::Completions => Json(Completion {
            id: reply.id.clone(),
            object: "text_completion",
            created: reply.created,
            model: reply.model(),
            choices: states
                .into_iter()
                .zip(texts)
                .zip(explains)
                .enumerate()
                .map(|(index, ((s, text), explain))| CompletionChoice {
                    index,
                    finish_reason: s.finish.as_ref().map(finish_reason),
                    logprobs: reply.shape.logprobs.then_some(s.completion_logprobs),
                    text,
                    explain,
                })
                .collect(),
            usage: Some(usage),
            system_fingerprint: reply.fingerprint(),
        })
        .into_response(),
    }
}

/// The SSE stream's state: the reply, the record, the events not yet sent.
struct Streaming {
    reply: Reply,
    record: RecordBuilder,
    pending: VecDeque<String>,
    /// Each choice's text length so far (the completions' log-probability offsets).
    text_len: Vec<usize>,
    done: bool,
    /// Set at the end: the final events wait until the record is durable (fail_closed audit).
    receipt: Option<record::Receipt>,
    /// The choices' finish chunks, held until every choice finished.
    finishes: Vec<String>,
    /// Each choice's tool-call parser (a request with tools).
    parsers: Vec<grammar::tools::ToolParser>,
    /// Each choice's attention export (sent whole in its finish chunk).
    explains: Explains,
}

impl Streaming {
    fn chunk_chat(
        &self,
        index: usize,
        delta: ChatDelta,
        logprobs: Option<ChatLogprobs>,
        finish: Option<String>,
    ) -> String {
        serde_json::to_string(&ChatCompletionChunk {
            id: self.reply.id.clone(),
            object: "chat.completion.chunk",
            created: self.reply.created,
            model: self.reply.model(),
            choices: vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
            system_fingerprint: self.reply.fingerprint(),
        })
        .unwrap_or_default()
    }

    fn chunk_completion(
        &self,
        index: usize,
        text: String,
        logprobs: Option<CompletionLogprobs>,
        finish: Option<String>,
    ) -> String {
        serde_json::to_string(&Completion {
            id: self.reply.id.clone(),
            object: "text_completion",
            created: self.reply.created,
            model: self.reply.model(),
            choices: vec![CompletionChoice {
                text,
                index,
                logprobs,
                finish_reason: finish,
                explain: None,
            }],
            usage: None,
            system_fingerprint: self.reply.fingerprint(),
        })
        .unwrap_or_default()
    }

    fn usage_chunk(&self) -> String {
        let usage = Some(self.reply.usage(self.record.record.completion_tokens));
        let (id, created, model) = (
            self.reply.id.clone(),
            self.reply.created,
            self.reply.model(),
        );
        let system_fingerprint = self.reply.fingerprint();
        match self.reply.endpoint {
            Endpoint::Chat => serde_json::to_string(&ChatCompletionChunk {
                id,
                object: "chat.completion.chunk",
                created,
                model,
                choices: Vec::new(),
                usage,
                system_fingerprint,
            }),
            Endpoint::Completions => serde_json::to_string(&Completion {
                id,
                object: "text_completion",
                created,
                model,
                choices: Vec::new(),
                usage,
                system_fingerprint,
            }),
        }
        .unwrap_or_default()
    }

    /// A chat choice's text read for tool calls: the chunks of what it adds (content, a
    /// call's start, argument fragments), the first of them carrying `logprobs`.
    fn tool_chunks(&mut self, i: usize, text: &str, mut logprobs: Option<ChatLogprobs>) {
        let events = self.parsers[i].push(text);
        if events.is_empty() {
            if let Some(lp) = logprobs {
                let chunk = self.chunk_chat(i, ChatDelta::default(), Some(lp), None);
                self.pending.push_back(chunk);
            }
            return;
        }
        for event in events {
            let delta = match event {
                grammar::tools::ToolEvent::Content(c) => ChatDelta {
                    content: Some(c),
                    ..ChatDelta::default()
                },
                grammar::tools::ToolEvent::Call { index, name } => ChatDelta {
                    tool_calls: Some(vec![ToolCallDelta {
                        index,
                        id: Some(self.reply.delivery.tool_call_id(i, index)),
                        kind: Some("function"),
                        function: FunctionDelta {
                            name: Some(name),
                            arguments: String::new(),
                        },
                    }]),
                    ..ChatDelta::default()
                },
                grammar::tools::ToolEvent::Arguments { index, fragment } => ChatDelta {
                    tool_calls: Some(vec![ToolCallDelta {
                        index,
                        id: None,
                        kind: None,
                        function: FunctionDelta {
                            name: None,
                            arguments: fragment,
                        },
                    }]),
                    ..ChatDelta::default()
                },
            };
            let chunk = self.chunk_chat(i, delta, logprobs.take(), None);
            self.pending.push_back(chunk);
        }
    }

    fn on_token(&mut self, i: usize, t: Token) {
        self.explains.on_token(i, &t.attention);
        self.reply.delivery.on_token(&mut self.record, i, &t);
        let want_logprobs = self.reply.shape.logprobs;
        if t.text.is_empty() && !want_logprobs {
            return;
        }
        if !self.parsers.is_empty() {
            let logprobs = want_logprobs.then(|| ChatLogprobs {
                content: vec![self.reply.token_logprob(&t)],
            });
            self.tool_chunks(i, &t.text, logprobs);
            return;
        }
        let chunk = match self.reply.endpoint {
            Endpoint::Chat => {
                let logprobs = want_logprobs.then(|| ChatLogprobs {
                    content: vec![self.reply.token_logprob(&t)],
                });
                self.chunk_chat(
                    i,
                    ChatDelta {
                        content: Some(t.text.clone()),
                        ..ChatDelta::default()
                    },
                    logprobs,
                    None,
                )
            }
            Endpoint::Completions => {
                let logprobs = want_logprobs.then(|| {
                    let mut s = ChoiceState::default();
                    self.reply
                        .add_completion_logprob(&mut s, &t, self.text_len[i]);
                    s.completion_logprobs
                });
                self.chunk_completion(i, t.text.clone(), logprobs, None)
            }
        };
        self.text_len[i] += t.text.len();
        self.pending.push_back(chunk);
    }

    fn on_finished(&mut self, i: usize, f: Finished) {
        let reason = Some(finish_reason(&f));
        let chunk = match self.reply.endpoint {
            Endpoint::Chat if !self.parsers.is_empty() => {
                self.tool_chunks(i, &f.trailing_text, None);
                let held = self.parsers[i].finish();
                for event in held {
                    if let grammar::tools::ToolEvent::Content(c) = event {
                        let delta = ChatDelta {
                            content: Some(c),
                            ..ChatDelta::default()
                        };
                        let chunk = self.chunk_chat(i, delta, None, None);
                        self.pending.push_back(chunk);
                    }
                }
                let reason = Some(chat_finish_reason(&f, self.parsers[i].calling()));
                self.chunk_chat(i, ChatDelta::default(), None, reason)
            }
            Endpoint::Chat => self.chunk_chat(
                i,
                ChatDelta {
                    content: (!f.trailing_text.is_empty()).then(|| f.trailing_text.clone()),
                    ..ChatDelta::default()
                },
                None,
                reason,
            ),
            Endpoint::Completions => {
                self.chunk_completion(i, f.trailing_text.clone(), None, reason)
            }
        };
        // The choice's attention export rides its finish chunk.
        let chunk = match self.explains.finish(i, f.prompt_tokens) {
            Some(explain) => with_explain(&chunk, explain),
            None => chunk,
        };
        // Every choice's finish goes out only with the last one, after the record is durable:
        // no choice is complete at the client before its audit entry is (fail_closed).
        self.finishes.push(chunk);
        if self.reply.delivery.on_finished(i, &f) {
            let finishes = std::mem::take(&mut self.finishes);
            self.pending.extend(finishes);
            self.on_all_finished();
        }
    }

    fn on_all_finished(&mut self) {
        self.explains.record(&mut self.record.record);
        if let Err(e) = self.reply.delivery.finish(&mut self.record) {
            // The text already went out; the client learns it is not to be trusted.
            e.record(&mut self.record);
            self.pending
                .push_back(serde_json::to_string(&e.body()).unwrap_or_default());
        }
        if self.reply.shape.include_usage {
            let chunk = self.usage_chunk();
            self.pending.push_back(chunk);
        }
        self.end();
    }

    /// A failure mid-stream: the error event, then the end.
    fn on_error(&mut self, e: ApiError) {
        e.record(&mut self.record);
        self.pending
            .push_back(serde_json::to_string(&e.body()).unwrap_or_default());
        self.end();
    }

    fn end(&mut self) {
        self.pending.push_back("[DONE]".into());
        self.done = true;
        self.receipt = Some(self.record.finish());
    }
}

/// A chunk's JSON with `explain` added to its one choice.
fn with_explain(chunk: &str, explain: ChoiceExplain) -> String {
    let Ok(mut v) = serde_json::from_str::<serde_json::Value>(chunk) else {
        return chunk.to_string();
    };
    if let Some(choice) = v["choices"].get_mut(0) {
        // Through its text: f32 weights keep their shortest form (a Value would widen them).
        choice["explain"] = serde_json::to_string(&explain)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
    }
    v.to_string()
}

fn stream_response(reply: Reply, record: RecordBuilder) -> Response {
    let choices = reply.delivery.choices();
    let parsers = match (reply.endpoint, reply.delivery.tools()) {
        (Endpoint::Chat, Some(session)) => (0..choices).map(|_| session.parser()).collect(),
        _ => Vec::new(),
    };
    let explains = Explains::new(&reply, &record.record.version_digest);
    let mut state = Streaming {
        explains,
        parsers,
        text_len: vec![0; choices],
        reply,
        record,
        pending: VecDeque::new(),
        done: false,
        receipt: None,
        finishes: Vec::new(),
    };
    if state.reply.endpoint == Endpoint::Chat {
        for i in 0..choices {
            let first = state.chunk_chat(
                i,
                ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: None,
                },
                None,
                None,
            );
            state.pending.push_back(first);
        }
    }
    let events = stream::unfold(state, |mut st| async move {
        loop {
            if let Some(receipt) = st.receipt.take() {
                if let Err(e) = front::durable(receipt).await {
                    // The final events are withheld: the client learns the answer was not kept.
                    st.pending.clear();
                    st.pending
                        .push_back(serde_json::to_string(&e.body()).unwrap_or_default());
                    st.pending.push_back("[DONE]".into());
                }
            }
            if let Some(data) = st.pending.pop_front() {
                return Some((
                    Ok::<_, std::convert::Infallible>(SseEvent::default().data(data)),
                    st,
                ));
            }
            if st.done {
                return None;
            }
            match st.reply.delivery.next().await {
                Some((i, Generated::Token(t))) => st.on_token(i, t),
                Some((i, Generated::Finished(f))) => st.on_finished(i, f),
                Some((_, Generated::Failed(e))) => st.on_error(ApiError::from(e)),
                None => st.on_error(ApiError::Unavailable {
                    message: "the engine stopped before the request finished".into(),
                    retry_after_s: 5,
                }),
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
