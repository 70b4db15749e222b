//! The HTTP routes, declared once (they feed the OpenAPI document too), and the request path:
//! identity → auth → body limit → parse and validate → model → rate limit → admission slot →
//! tokenize → engine → stream back → record.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use engine::{Event, FinishReason, Finished, TokenEvent};
use futures_util::stream::{self, SelectAll, StreamExt};
use serde::Serialize;
use utoipa::OpenApi;

use crate::admission::Slot;
use crate::error::{ApiError, ErrorBody};
use crate::observe;
use crate::openai::*;
use crate::record::{sha256_hex, RecordBuilder, StructuredRecord};
use crate::state::{AppState, ModelHandle};

/// Route paths.
pub mod paths {
    pub const LIVE: &str = "/health/live";
    pub const READY: &str = "/health/ready";
    pub const METRICS: &str = "/metrics";
    pub const OPENAPI: &str = "/openapi.json";
    pub const MODELS: &str = "/v1/models";
    pub const MODEL: &str = "/v1/models/{id}";
    pub const CHAT: &str = "/v1/chat/completions";
    pub const COMPLETIONS: &str = "/v1/completions";
    pub const EMBEDDINGS: &str = "/v1/embeddings";
    // KServe v2 / Open Inference Protocol.
    pub const V2: &str = "/v2";
    pub const V2_LIVE: &str = "/v2/health/live";
    pub const V2_READY: &str = "/v2/health/ready";
    pub const V2_MODEL: &str = "/v2/models/{name}";
    pub const V2_MODEL_READY: &str = "/v2/models/{name}/ready";
    pub const V2_MODEL_INFER: &str = "/v2/models/{name}/infer";
    pub const V2_VERSION: &str = "/v2/models/{name}/versions/{version}";
    pub const V2_VERSION_READY: &str = "/v2/models/{name}/versions/{version}/ready";
    pub const V2_VERSION_INFER: &str = "/v2/models/{name}/versions/{version}/infer";
}

/// The request's id (`X-Request-Id` from the client, or a fresh UUIDv4).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

/// Who is asking: the API key's id, or `anonymous` when the server runs without keys.
#[derive(Debug, Clone)]
pub struct Principal(pub String);

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Rampart",
        description = "OpenAI-compatible inference API with health and metrics."
    ),
    paths(
        live,
        ready,
        metrics,
        list_models,
        get_model,
        chat_completions,
        completions,
        embeddings
    ),
    components(schemas(
        ChatCompletionRequest,
        CompletionRequest,
        ChatCompletion,
        ChatCompletionChunk,
        Completion,
        ModelList,
        ModelCard,
        ErrorBody,
        Usage,
        EmbeddingRequest,
        EmbeddingResponse
    ))
)]
pub struct ApiDoc;

/// The whole application.
pub fn router(state: Arc<AppState>) -> Router {
    let metrics_route = Router::new().route(paths::METRICS, get(metrics));
    let metrics_route = if state.config.metrics_require_auth {
        metrics_route.layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            authenticate,
        ))
    } else {
        metrics_route.layer(middleware::from_fn(anonymous))
    };
    let api = Router::new()
        .route(paths::MODELS, get(list_models))
        .route(paths::MODEL, get(get_model))
        .route(paths::CHAT, post(chat_completions))
        .route(paths::COMPLETIONS, post(completions))
        .route(paths::EMBEDDINGS, post(embeddings))
        .route(paths::OPENAPI, get(openapi))
        .route(paths::V2, get(crate::kserve::server_metadata))
        .route(paths::V2_MODEL, get(crate::kserve::model_metadata))
        .route(paths::V2_MODEL_READY, get(crate::kserve::model_ready))
        .route(paths::V2_MODEL_INFER, post(crate::kserve::model_infer))
        .route(
            paths::V2_VERSION,
            get(crate::kserve::model_version_metadata),
        )
        .route(
            paths::V2_VERSION_READY,
            get(crate::kserve::model_version_ready),
        )
        .route(
            paths::V2_VERSION_INFER,
            post(crate::kserve::model_version_infer),
        )
        .layer(middleware::from_fn_with_state(
            Arc::clone(&state),
            authenticate,
        ));
    Router::new()
        .route(paths::LIVE, get(live))
        .route(paths::READY, get(ready))
        .route(paths::V2_LIVE, get(crate::kserve::health_live))
        .route(paths::V2_READY, get(crate::kserve::health_ready))
        .merge(metrics_route)
        .merge(api)
        .fallback(not_found)
        .layer(middleware::from_fn(identify))
        .with_state(state)
}

/// Accepts a sane `X-Request-Id` or makes one; echoes it on the response.
async fn identify(mut request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_string);
    let id = given.unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    request.extensions_mut().insert(RequestId(id.clone()));
    let mut response = next.run(request).await;
    if let Ok(value) = HeaderValue::from_str(&id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

async fn anonymous(mut request: Request, next: Next) -> Response {
    request
        .extensions_mut()
        .insert(Principal("anonymous".into()));
    next.run(request).await
}

/// Bearer auth against the key hashes (when keys are configured).
async fn authenticate(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let principal = match &state.keys {
        None => "anonymous".to_string(),
        Some(keys) => {
            let presented = request
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| {
                    v.strip_prefix("Bearer ")
                        .or_else(|| v.strip_prefix("bearer "))
                })
                .map(str::trim);
            match presented.and_then(|key| keys.principal(key)) {
                Some(id) => id.to_string(),
                None => {
                    let message = if presented.is_none() {
                        "missing API key: send it as 'Authorization: Bearer <key>'"
                    } else {
                        "invalid API key"
                    };
                    observe::rejected("none", "unauthorized");
                    let error = ApiError::Unauthorized(message.into());
                    // Refused requests leave a record too (who tried what, from the audit's view).
                    let request_id = request
                        .extensions()
                        .get::<RequestId>()
                        .map_or_else(String::new, |id| id.0.clone());
                    let mut record = RecordBuilder::new(
                        request_id,
                        "unauthenticated".into(),
                        endpoint_of(request.uri().path()),
                        observe::emit,
                    );
                    record.fail(error.status().as_u16(), error.kind());
                    record.finish();
                    return error.into_response();
                }
            }
        }
    };
    request.extensions_mut().insert(Principal(principal));
    next.run(request).await
}

/// The record's `endpoint` for a path.
fn endpoint_of(path: &str) -> &'static str {
    match path {
        paths::CHAT => "chat.completions",
        paths::COMPLETIONS => "completions",
        paths::MODELS => "models",
        paths::METRICS => "metrics",
        paths::OPENAPI => "openapi",
        p if p.starts_with("/v1/models/") => "models",
        paths::EMBEDDINGS => "embeddings",
        p if p.starts_with("/v2/models/") && p.ends_with("/infer") => "kserve_infer",
        p if p.starts_with("/v2") => "kserve",
        _ => "other",
    }
}

async fn not_found(request: Request) -> Response {
    ApiError::RouteNotFound(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
    .into_response()
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    models: Vec<String>,
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/health/live", responses((status = 200, description = "The process is up")))]
async fn live() -> impl IntoResponse {
    Json(Health {
        status: "live",
        reason: None,
        models: Vec::new(),
    })
}

/// Readiness: every configured model is loaded, the engines make progress, not draining.
#[utoipa::path(get, path = "/health/ready", responses(
    (status = 200, description = "Ready to serve"),
    (status = 503, description = "Loading, draining, a model failed to load, or an engine stalled")
))]
async fn ready(State(state): State<Arc<AppState>>) -> Response {
    let models = state
        .models()
        .iter()
        .map(|m| format!("{}@{}", m.id, m.version))
        .collect();
    match state.not_ready_reason() {
        None => Json(Health {
            status: "ready",
            reason: None,
            models,
        })
        .into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "not_ready",
                reason: Some(reason),
                models,
            }),
        )
            .into_response(),
    }
}

/// Prometheus metrics (docs/metrics.md).
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    observe::refresh_engine_gauges(&state.models());
    let body = state
        .metrics
        .as_ref()
        .map(|h| h.render())
        .unwrap_or_default();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn openapi() -> Response {
    Json(ApiDoc::openapi()).into_response()
}

fn card(m: &ModelHandle) -> ModelCard {
    ModelCard {
        id: m.id.clone(),
        object: "model",
        created: m.created,
        owned_by: "rampart".into(),
        version: m.version.clone(),
        digest: m.digest.clone(),
        ready: true,
        max_context: m.engine.context(),
    }
}

/// The served models.
#[utoipa::path(get, path = "/v1/models", responses((status = 200, body = ModelList)))]
async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    let embedders = state.embedders();
    Json(ModelList {
        object: "list",
        data: state
            .models()
            .iter()
            .map(|m| card(m))
            .chain(embedders.iter().map(|e| ModelCard {
                id: e.id.clone(),
                object: "model",
                created: e.created,
                owned_by: "rampart".into(),
                version: e.version.clone(),
                digest: e.digest.clone(),
                ready: true,
                max_context: e.embedder.max_seq_len(),
            }))
            .collect(),
    })
}

/// One model (`name` or `name@version`) and its status.
#[utoipa::path(get, path = "/v1/models/{id}", params(("id" = String, Path, description = "name or name@version")),
    responses((status = 200, body = ModelCard), (status = 404, body = ErrorBody)))]
async fn get_model(State(state): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match state.find(&id) {
        Some(m) => Json(card(&m)).into_response(),
        None => unknown_model(&state, &id).into_response(),
    }
}

fn unknown_model(state: &AppState, id: &str) -> ApiError {
    let available = state.model_ids();
    ApiError::ModelNotFound(format!(
        "The model {id:?} does not exist. Available: {}",
        if available.is_empty() {
            "none (still loading?)".to_string()
        } else {
            available.join(", ")
        }
    ))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Chat,
    Completions,
}

impl Endpoint {
    fn name(self) -> &'static str {
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
async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    body: Body,
) -> Response {
    handle(state, id, principal, body, Endpoint::Chat).await
}

/// Text completions (streaming with `stream: true`).
#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest, responses(
    (status = 200, body = Completion, description = "A completion, or an SSE stream of Completion chunks"),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    body: Body,
) -> Response {
    handle(state, id, principal, body, Endpoint::Completions).await
}

/// Embeddings of one or more inputs (texts or token lists).
#[utoipa::path(post, path = "/v1/embeddings", request_body = EmbeddingRequest, responses(
    (status = 200, body = EmbeddingResponse),
    (status = 400, body = ErrorBody), (status = 401, body = ErrorBody), (status = 404, body = ErrorBody),
    (status = 413, body = ErrorBody), (status = 429, body = ErrorBody), (status = 503, body = ErrorBody)))]
async fn embeddings(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    body: Body,
) -> Response {
    let mut record = RecordBuilder::new(id.0, principal.0.clone(), "embeddings", observe::emit);
    match embed(&state, &principal.0, body, &mut record).await {
        Ok(response) => {
            record.record.finish_reason = Some("stop".into());
            record.finish();
            Json(response).into_response()
        }
        Err(e) => {
            record.fail(e.status().as_u16(), e.kind());
            record.finish();
            e.into_response()
        }
    }
}

/// The request body, up to `limits.max_body_bytes`.
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, ApiError> {
    let limit = state.config.limits.max_body_bytes;
    axum::body::to_bytes(body, limit).await.map_err(|_| {
        observe::rejected("none", "body_too_large");
        ApiError::BodyTooLarge(format!(
            "the request body exceeds the limit of {limit} bytes"
        ))
    })
}

async fn embed(
    state: &Arc<AppState>,
    principal: &str,
    body: Body,
    record: &mut RecordBuilder,
) -> Result<EmbeddingResponse, ApiError> {
    let bytes = read_body(state, body).await?;
    let request: EmbeddingRequest = parse_json(&bytes)?;
    let model_id = request.model.clone();
    let plan = request.plan(&state.config.limits)?;
    record.record.user = plan.user.clone();
    record.record.input_sha256 = sha256_hex(&plan.input_for_hash);
    if state.is_draining() {
        return Err(ApiError::Unavailable {
            message: "the server is shutting down".into(),
            retry_after_s: 5,
        });
    }
    let model = match state.find_embedder(&model_id) {
        Some(m) => m,
        None if state.find(&model_id).is_some() => {
            return Err(ApiError::invalid_param(
                "model",
                format!("{model_id:?} is not an embedding model"),
            ))
        }
        None => return Err(unknown_model(state, &model_id)),
    };
    record.record.model = model.id.clone();
    record.record.version = model.version.clone();
    record.record.version_digest = model.digest.clone();
    if let Some(d) = plan.dimensions {
        let max = model.embedder.dimensions();
        if d > max {
            return Err(ApiError::invalid_param(
                "dimensions",
                format!("dimensions must be between 1 and {max} for {}", model.id),
            ));
        }
    }
    let slot = admit(state, principal, &model.id, &model.admission, record).await?;
    let options = engine::EmbedOptions {
        truncate: false,
        dimensions: plan.dimensions,
    };
    let (vectors, prompt_tokens) = model.embed(plan.inputs.clone(), options).await?;
    drop(slot);
    record.record.prompt_tokens = prompt_tokens;
    let data = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| EmbeddingData {
            object: "embedding",
            index,
            embedding: if plan.base64 {
                EmbeddingVector::Base64(base64_f32(&v))
            } else {
                EmbeddingVector::Float(v)
            },
        })
        .collect();
    Ok(EmbeddingResponse {
        object: "list",
        data,
        model: model.id.clone(),
        usage: EmbeddingUsage {
            prompt_tokens,
            total_tokens: prompt_tokens,
        },
    })
}

/// A request on its way through the engine.
struct Generation {
    state: Arc<AppState>,
    principal: String,
    model: Arc<ModelHandle>,
    /// Held until the response ends.
    _slot: Slot,
    events: SelectAll<futures_util::stream::BoxStream<'static, (usize, Event)>>,
    choices: usize,
    prompt_tokens: usize,
    plan: Plan,
    endpoint: Endpoint,
    id: String,
    created: u64,
    /// The compiled constraint of a structured-output request (checks the final outputs).
    structured: Option<Arc<grammar::Compiled>>,
}

async fn handle(
    state: Arc<AppState>,
    id: RequestId,
    principal: Principal,
    body: Body,
    endpoint: Endpoint,
) -> Response {
    let mut record = RecordBuilder::new(id.0, principal.0.clone(), endpoint.name(), observe::emit);
    match start(&state, &principal.0, body, endpoint, &mut record).await {
        Ok(generation) => {
            record.record.stream = generation.plan.stream;
            if generation.plan.stream {
                stream_response(generation, record)
            } else {
                collect_response(generation, record).await
            }
        }
        Err(e) => {
            record.fail(e.status().as_u16(), e.kind());
            record.finish();
            e.into_response()
        }
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The key's rate limit, then a slot of the model's admission (counted as refusals by reason).
pub(crate) async fn admit(
    state: &AppState,
    principal: &str,
    model_id: &str,
    admission: &Arc<crate::admission::Admission>,
    record: &mut RecordBuilder,
) -> Result<Slot, ApiError> {
    if let Err(wait) = state.rate_limiter.admit(principal) {
        observe::rejected(model_id, "rate_limited");
        return Err(ApiError::Overloaded {
            message: format!("rate limit of key {principal:?} reached; retry in {wait} s"),
            retry_after_s: wait,
            code: "rate_limited",
        });
    }
    let slot = admission.acquire().await.inspect_err(|e| {
        let reason = if e.status() == StatusCode::TOO_MANY_REQUESTS {
            "queue_full"
        } else {
            "queue_timeout"
        };
        observe::rejected(model_id, reason);
    })?;
    record.record.queue_ms = slot.queued.as_secs_f64() * 1e3;
    Ok(slot)
}

/// Everything before the first token: parse, validate, admit, tokenize, submit.
async fn start(
    state: &Arc<AppState>,
    principal: &str,
    body: Body,
    endpoint: Endpoint,
    record: &mut RecordBuilder,
) -> Result<Generation, ApiError> {
    let bytes = read_body(state, body).await?;
    let limits = &state.config.limits;
    let (model_id, plan) = match endpoint {
        Endpoint::Chat => {
            let r: ChatCompletionRequest = parse_json(&bytes)?;
            (r.model.clone(), r.plan(limits)?)
        }
        Endpoint::Completions => {
            let r: CompletionRequest = parse_json(&bytes)?;
            (r.model.clone(), r.plan(limits)?)
        }
    };
    record.record.user = plan.user.clone();
    record.record.input_sha256 = sha256_hex(&plan.input_for_hash);
    if state.is_draining() {
        return Err(ApiError::Unavailable {
            message: "the server is shutting down".into(),
            retry_after_s: 5,
        });
    }
    let model = state
        .find(&model_id)
        .ok_or_else(|| unknown_model(state, &model_id))?;
    record.record.model = model.id.clone();
    record.record.version = model.version.clone();
    record.record.version_digest = model.digest.clone();
    record.set_entropy_band(model.entropy_band);
    let slot = admit(state, principal, &model.id, &model.admission, record).await?;

    // Tokenization and template rendering run off the async workers.
    let engine = Arc::clone(&model.engine);
    let prepare_plan = plan.clone();
    let default_cap = limits.default_max_tokens;
    let compiler = Arc::clone(&model.grammar);
    let (prepared, structured) = tokio::task::spawn_blocking(move || {
        // The grammar first: a bad schema is refused before any tokenization work.
        let structured = match &prepare_plan.structured {
            Some(spec) => Some(compiler.compile(spec).map_err(|e| match e {
                grammar::GrammarError::Invalid(m) => ApiError::invalid_param("response_format", m),
                grammar::GrammarError::Internal(m) => ApiError::Internal(m),
            })?),
            None => None,
        };
        let mut out = Vec::new();
        for prompt in &prepare_plan.prompts {
            let mut request = prepare_plan.request.clone();
            request.prompt = prompt.clone();
            if prepare_plan.default_max_tokens {
                request.max_tokens = 1;
            }
            let mut prepared = engine.prepare(request)?;
            if prepare_plan.default_max_tokens {
                let room = engine.context().saturating_sub(prepared.tokens.len());
                prepared.request.max_tokens = room.min(default_cap).max(1);
            }
            if let Some((compiled, _)) = &structured {
                let factory: Arc<dyn engine::ConstraintFactory> = compiled.clone();
                prepared.request.constraint = Some(engine::Constraint(factory));
            }
            out.push(prepared);
        }
        Ok::<_, ApiError>((out, structured))
    })
    .await
    .map_err(|e| ApiError::Internal(format!("tokenization task failed: {e}")))??;
    if let Some((compiled, cached)) = &structured {
        record.record.structured = Some(StructuredRecord {
            kind: compiled.spec.kind(),
            grammar_sha256: compiled.hash.clone(),
            compile_ms: if *cached {
                0.0
            } else {
                compiled.compile_seconds * 1e3
            },
            cached: *cached,
            outcome: None,
            problem: None,
        });
    }

    let prompt_tokens: usize = prepared.iter().map(|p| p.tokens.len()).sum();
    record.record.prompt_tokens = prompt_tokens;
    let mut events = SelectAll::new();
    let mut index = 0;
    for p in &prepared {
        for k in 0..plan.n {
            let mut one = p.clone();
            if let Some(seed) = one.request.sampling.seed {
                one.request.sampling.seed = Some(seed.wrapping_add(k as u64));
            }
            let engine_stream = model.engine.submit(one)?;
            let choice = index;
            let s = stream::unfold(engine_stream, move |mut s| async move {
                s.recv().await.map(|e| ((choice, e), s))
            })
            .boxed();
            events.push(s);
            index += 1;
        }
    }
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    Ok(Generation {
        state: Arc::clone(state),
        principal: principal.to_string(),
        model,
        _slot: slot,
        events,
        choices: index,
        prompt_tokens,
        plan,
        endpoint,
        id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
        created: now_s(),
        structured: structured.map(|(compiled, _)| compiled),
    })
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

/// Per-choice state while events arrive.
#[derive(Default)]
struct ChoiceState {
    text: String,
    chat_logprobs: Vec<TokenLogprob>,
    completion_logprobs: CompletionLogprobs,
    finish: Option<Finished>,
}

impl Generation {
    /// Checks each finished output of a structured-output request and records the worst
    /// outcome. An output that ended by itself yet fails its schema or grammar is an error: the
    /// API promises the shape.
    fn check_structured(
        &self,
        record: &mut RecordBuilder,
        outputs: &[(&str, &Finished)],
    ) -> Result<(), ApiError> {
        let Some(compiled) = &self.structured else {
            return Ok(());
        };
        let mut worst = grammar::Outcome::Valid;
        for (text, f) in outputs {
            let outcome = compiled.check(text, f.reason == FinishReason::Length);
            let rank = |o: &grammar::Outcome| match o {
                grammar::Outcome::Valid => 0,
                grammar::Outcome::Incomplete(_) => 1,
                grammar::Outcome::Invalid(_) => 2,
            };
            if rank(&outcome) > rank(&worst) {
                worst = outcome;
            }
        }
        if let Some(s) = record.record.structured.as_mut() {
            s.outcome = Some(worst.as_str());
            s.problem = match &worst {
                grammar::Outcome::Valid => None,
                grammar::Outcome::Incomplete(p) | grammar::Outcome::Invalid(p) => Some(p.clone()),
            };
        }
        match worst {
            grammar::Outcome::Invalid(problem) => Err(ApiError::InvalidOutput(format!(
                "the output does not follow the requested {}: {problem}",
                compiled.spec.kind()
            ))),
            _ => Ok(()),
        }
    }

    /// Charges the key's token budget for what the request used.
    fn charge(&self, record: &RecordBuilder) {
        let used = record.record.prompt_tokens + record.record.completion_tokens;
        self.state.rate_limiter.charge(&self.principal, used);
    }

    fn token_logprob(&self, t: &TokenEvent) -> TokenLogprob {
        let tokenizer = self.model.engine.tokenizer();
        TokenLogprob {
            token: tokenizer.token_text(t.id),
            logprob: t.logprob,
            bytes: tokenizer.token_bytes(t.id).to_vec(),
            entropy: t.entropy,
            top_logprobs: t
                .top_logprobs
                .iter()
                .map(|(id, text, lp)| TopLogprob {
                    token: text.clone(),
                    logprob: finite_logprob(*lp),
                    bytes: tokenizer.token_bytes(*id).to_vec(),
                })
                .collect(),
        }
    }

    fn add_completion_logprob(&self, state: &mut ChoiceState, t: &TokenEvent) {
        let tokenizer = self.model.engine.tokenizer();
        let lp = &mut state.completion_logprobs;
        lp.text_offset.push(state.text.len());
        lp.tokens.push(tokenizer.token_text(t.id));
        lp.token_logprobs.push(t.logprob);
        lp.entropies.push(t.entropy);
        lp.top_logprobs.push(
            t.top_logprobs
                .iter()
                .map(|(_, text, lp)| (text.clone(), finite_logprob(*lp)))
                .collect::<HashMap<_, _>>(),
        );
    }

    fn usage(&self, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens,
            total_tokens: self.prompt_tokens + completion_tokens,
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

/// Fills the record's timings from the engine's account of each choice.
fn record_finished(record: &mut RecordBuilder, finished: &[Finished]) {
    let r = &mut record.record;
    r.completion_tokens = finished.iter().map(|f| f.completion_tokens).sum();
    r.cached_prompt_tokens = finished
        .iter()
        .map(|f| f.cached_prompt_tokens)
        .max()
        .unwrap_or(0);
    r.prefill_ms = finished
        .iter()
        .map(|f| f.prefill_seconds * 1e3)
        .fold(0.0, f64::max);
    r.decode_ms = finished
        .iter()
        .map(|f| f.decode_seconds * 1e3)
        .fold(0.0, f64::max);
    let reasons: Vec<&str> = finished
        .iter()
        .map(|f| {
            if f.reason == FinishReason::Length {
                "length"
            } else {
                "stop"
            }
        })
        .collect();
    r.finish_reason = Some(
        if reasons.contains(&"length") {
            "length"
        } else {
            "stop"
        }
        .into(),
    );
}

async fn collect_response(mut g: Generation, mut record: RecordBuilder) -> Response {
    let mut states: Vec<ChoiceState> = (0..g.choices).map(|_| ChoiceState::default()).collect();
    let mut done = 0;
    while done < g.choices {
        let Some((i, event)) = g.events.next().await else {
            break;
        };
        match event {
            Event::Token(t) => {
                record.token(t.entropy);
                if g.plan.logprobs {
                    match g.endpoint {
                        Endpoint::Chat => {
                            let lp = g.token_logprob(&t);
                            states[i].chat_logprobs.push(lp);
                        }
                        Endpoint::Completions => {
                            let mut s = std::mem::take(&mut states[i]);
                            g.add_completion_logprob(&mut s, &t);
                            states[i] = s;
                        }
                    }
                }
                states[i].text.push_str(&t.text);
            }
            Event::Finished(f) => {
                states[i].text.push_str(&f.trailing_text);
                states[i].finish = Some(f);
                done += 1;
            }
            Event::Failed(message) => {
                let e = ApiError::Internal(format!("generation failed: {message}"));
                record.fail(500, e.kind());
                return e.into_response();
            }
        }
    }
    if done < g.choices {
        let e = ApiError::Unavailable {
            message: "the engine stopped before the request finished".into(),
            retry_after_s: 5,
        };
        record.fail(503, e.kind());
        return e.into_response();
    }
    let finished: Vec<Finished> = states.iter().filter_map(|s| s.finish.clone()).collect();
    record_finished(&mut record, &finished);
    let outputs: Vec<(&str, &Finished)> = states
        .iter()
        .filter_map(|s| s.finish.as_ref().map(|f| (s.text.as_str(), f)))
        .collect();
    if let Err(e) = g.check_structured(&mut record, &outputs) {
        g.charge(&record);
        record.fail(500, e.kind());
        return e.into_response();
    }
    let completion_tokens = record.record.completion_tokens;
    g.charge(&record);
    let usage = g.usage(completion_tokens);
    let fingerprint = format!("{}@{}", g.model.id, g.model.version);
    let model = g.model.id.clone();
    let response = match g.endpoint {
        Endpoint::Chat => Json(ChatCompletion {
            id: g.id.clone(),
            object: "chat.completion",
            created: g.created,
            model,
            choices: states
                .into_iter()
                .enumerate()
                .map(|(index, s)| ChatChoice {
                    index,
                    finish_reason: s.finish.as_ref().map(finish_reason),
                    logprobs: g.plan.logprobs.then_some(ChatLogprobs {
                        content: s.chat_logprobs,
                    }),
                    message: AssistantMessage {
                        role: "assistant",
                        content: s.text,
                    },
                })
                .collect(),
            usage,
            system_fingerprint: fingerprint,
        })
        .into_response(),
        Endpoint::Completions => Json(Completion {
            id: g.id.clone(),
            object: "text_completion",
            created: g.created,
            model,
            choices: states
                .into_iter()
                .enumerate()
                .map(|(index, s)| CompletionChoice {
                    index,
                    finish_reason: s.finish.as_ref().map(finish_reason),
                    logprobs: g.plan.logprobs.then_some(s.completion_logprobs),
                    text: s.text,
                })
                .collect(),
            usage: Some(usage),
            system_fingerprint: fingerprint,
        })
        .into_response(),
    };
    record.finish();
    response
}

/// The SSE stream's state: the generation, the record, the events not yet sent.
struct Streaming {
    g: Generation,
    record: RecordBuilder,
    pending: std::collections::VecDeque<String>,
    finished: Vec<Option<Finished>>,
    text_len: Vec<usize>,
    /// Each choice's text so far (structured-output requests only: checked at the end).
    texts: Vec<String>,
    done: bool,
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
            id: self.g.id.clone(),
            object: "chat.completion.chunk",
            created: self.g.created,
            model: self.g.model.id.clone(),
            choices: vec![ChatChunkChoice {
                index,
                delta,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
            system_fingerprint: format!("{}@{}", self.g.model.id, self.g.model.version),
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
            id: self.g.id.clone(),
            object: "text_completion",
            created: self.g.created,
            model: self.g.model.id.clone(),
            choices: vec![CompletionChoice {
                text,
                index,
                logprobs,
                finish_reason: finish,
            }],
            usage: None,
            system_fingerprint: format!("{}@{}", self.g.model.id, self.g.model.version),
        })
        .unwrap_or_default()
    }

    fn on_token(&mut self, i: usize, t: TokenEvent) {
        self.record.token(t.entropy);
        let want_logprobs = self.g.plan.logprobs;
        if t.text.is_empty() && !want_logprobs {
            return;
        }
        let chunk = match self.g.endpoint {
            Endpoint::Chat => {
                let logprobs = want_logprobs.then(|| ChatLogprobs {
                    content: vec![self.g.token_logprob(&t)],
                });
                self.chunk_chat(
                    i,
                    ChatDelta {
                        role: None,
                        content: Some(t.text.clone()),
                    },
                    logprobs,
                    None,
                )
            }
            Endpoint::Completions => {
                let logprobs = want_logprobs.then(|| {
                    let mut s = ChoiceState::default();
                    self.g.add_completion_logprob(&mut s, &t);
                    for o in s.completion_logprobs.text_offset.iter_mut() {
                        *o += self.text_len[i];
                    }
                    s.completion_logprobs
                });
                self.chunk_completion(i, t.text.clone(), logprobs, None)
            }
        };
        self.text_len[i] += t.text.len();
        if self.g.structured.is_some() {
            self.texts[i].push_str(&t.text);
        }
        self.pending.push_back(chunk);
    }

    fn on_finished(&mut self, i: usize, f: Finished) {
        let reason = Some(finish_reason(&f));
        let chunk = match self.g.endpoint {
            Endpoint::Chat => self.chunk_chat(
                i,
                ChatDelta {
                    role: None,
                    content: (!f.trailing_text.is_empty()).then(|| f.trailing_text.clone()),
                },
                None,
                reason,
            ),
            Endpoint::Completions => {
                self.chunk_completion(i, f.trailing_text.clone(), None, reason)
            }
        };
        self.pending.push_back(chunk);
        if self.g.structured.is_some() {
            self.texts[i].push_str(&f.trailing_text);
        }
        self.finished[i] = Some(f);
        if self.finished.iter().all(Option::is_some) {
            let all: Vec<Finished> = self.finished.iter().flatten().cloned().collect();
            record_finished(&mut self.record, &all);
            self.g.charge(&self.record);
            let outputs: Vec<(&str, &Finished)> = self
                .texts
                .iter()
                .map(String::as_str)
                .zip(all.iter())
                .collect();
            if let Err(e) = self.g.check_structured(&mut self.record, &outputs) {
                // The text already went out; the client learns it is not to be trusted.
                self.record.fail(500, e.kind());
                self.pending
                    .push_back(serde_json::to_string(&e.body()).unwrap_or_default());
            }
            if self.g.plan.include_usage {
                let usage = self.g.usage(self.record.record.completion_tokens);
                let fingerprint = format!("{}@{}", self.g.model.id, self.g.model.version);
                let chunk = match self.g.endpoint {
                    Endpoint::Chat => serde_json::to_string(&ChatCompletionChunk {
                        id: self.g.id.clone(),
                        object: "chat.completion.chunk",
                        created: self.g.created,
                        model: self.g.model.id.clone(),
                        choices: Vec::new(),
                        usage: Some(usage),
                        system_fingerprint: fingerprint,
                    }),
                    Endpoint::Completions => serde_json::to_string(&Completion {
                        id: self.g.id.clone(),
                        object: "text_completion",
                        created: self.g.created,
                        model: self.g.model.id.clone(),
                        choices: Vec::new(),
                        usage: Some(usage),
                        system_fingerprint: fingerprint,
                    }),
                };
                self.pending.push_back(chunk.unwrap_or_default());
            }
            self.pending.push_back("[DONE]".into());
            self.done = true;
            self.record.finish();
        }
    }
}

fn stream_response(g: Generation, record: RecordBuilder) -> Response {
    let choices = g.choices;
    let mut state = Streaming {
        finished: vec![None; choices],
        text_len: vec![0; choices],
        texts: vec![String::new(); choices],
        g,
        record,
        pending: std::collections::VecDeque::new(),
        done: false,
    };
    if state.g.endpoint == Endpoint::Chat {
        for i in 0..choices {
            let first = state.chunk_chat(
                i,
                ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                },
                None,
                None,
            );
            state.pending.push_back(first);
        }
    }
    let events = stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.pending.pop_front() {
                return Some((
                    Ok::<_, std::convert::Infallible>(SseEvent::default().data(data)),
                    st,
                ));
            }
            if st.done {
                return None;
            }
            match st.g.events.next().await {
                Some((i, Event::Token(t))) => st.on_token(i, t),
                Some((i, Event::Finished(f))) => st.on_finished(i, f),
                Some((_, Event::Failed(message))) => {
                    let e = ApiError::Internal(format!("generation failed: {message}"));
                    st.record.fail(500, e.kind());
                    st.record.finish();
                    st.pending
                        .push_back(serde_json::to_string(&e.body()).unwrap_or_default());
                    st.pending.push_back("[DONE]".into());
                    st.done = true;
                }
                None => {
                    let e = ApiError::Unavailable {
                        message: "the engine stopped before the request finished".into(),
                        retry_after_s: 5,
                    };
                    st.record.fail(503, e.kind());
                    st.record.finish();
                    st.pending
                        .push_back(serde_json::to_string(&e.body()).unwrap_or_default());
                    st.pending.push_back("[DONE]".into());
                    st.done = true;
                }
            }
        }
    });
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}
