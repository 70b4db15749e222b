//! The HTTP front door: the route table, declared once (it feeds the OpenAPI document too),
//! request identity and API keys as middleware, health, metrics and the OpenAPI document. The
//! inference routes are the OpenAI endpoints ([`crate::openai_http`]) and KServe v2
//! ([`crate::kserve`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;
use utoipa::OpenApi;

use crate::admin;
use crate::audit_routes;
use crate::auth::Scope;
use crate::error::WireError;
use crate::error::{ApiError, ErrorBody};
use crate::identity::{self, Granted, Principal, RequestId, Transport};
use crate::kserve;
use crate::log_metrics;
use crate::openai::*;
use crate::openai_http;
use crate::release_routes;
use crate::state::AppState;

pub use crate::paths;

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
        openai_http::list_models,
        openai_http::get_model,
        openai_http::chat_completions,
        openai_http::completions,
        openai_http::embeddings,
        crate::tokenize::tokenize,
        crate::tokenize::detokenize
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
        EmbeddingResponse,
        crate::tokenize::TokenizeRequest,
        crate::tokenize::TokenizeResponse,
        crate::tokenize::DetokenizeRequest,
        crate::tokenize::DetokenizeResponse
    ))
)]
pub struct ApiDoc;

/// The whole application.
pub fn router(state: Arc<AppState>) -> Router {
    let metrics_route = Router::new().route(paths::METRICS, get(metrics));
    let metrics_route = if state.config.metrics_require_auth {
        metrics_route.layer(middleware::from_fn_with_state(
            (Arc::clone(&state), None),
            authenticate,
        ))
    } else {
        metrics_route.layer(middleware::from_fn(anonymous))
    };
    let api = Router::new()
        .route(paths::MODELS, get(openai_http::list_models))
        .route(paths::MODEL, get(openai_http::get_model))
        .route(paths::CHAT, post(openai_http::chat_completions))
        .route(paths::COMPLETIONS, post(openai_http::completions))
        .route(paths::EMBEDDINGS, post(openai_http::embeddings))
        .route(paths::TOKENIZE, post(crate::tokenize::tokenize))
        .route(paths::DETOKENIZE, post(crate::tokenize::detokenize))
        .route(paths::OPENAPI, get(openapi))
        .route(paths::V2, get(kserve::server_metadata))
        .route(paths::V2_MODEL, get(kserve::model_metadata))
        .route(paths::V2_MODEL_READY, get(kserve::model_ready))
        .route(paths::V2_MODEL_INFER, post(kserve::model_infer))
        .route(paths::V2_VERSION, get(kserve::model_version_metadata))
        .route(paths::V2_VERSION_READY, get(kserve::model_version_ready))
        .route(paths::V2_VERSION_INFER, post(kserve::model_version_infer))
        .layer(middleware::from_fn_with_state(
            (Arc::clone(&state), Some(Scope::Infer)),
            authenticate,
        ));
    let admin_routes = admin::routes()
        .merge(release_routes::routes())
        .merge(crate::residency::routes())
        .merge(crate::feedback_routes::admin_routes())
        .layer(middleware::from_fn_with_state(
            (Arc::clone(&state), Some(Scope::Admin)),
            authenticate,
        ));
    let audit_routes = audit_routes::routes().layer(middleware::from_fn_with_state(
        (Arc::clone(&state), Some(Scope::Audit)),
        authenticate,
    ));
    Router::new()
        .route(paths::LIVE, get(live))
        .route(paths::READY, get(ready))
        .route(paths::V2_LIVE, get(kserve::health_live))
        .route(paths::V2_READY, get(kserve::health_ready))
        .merge(metrics_route)
        .merge(api)
        .merge(admin_routes)
        .merge(audit_routes)
        .merge(crate::feedback_routes::routes())
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(Arc::clone(&state), identify))
        .with_state(state)
}

/// Accepts a sane `X-Request-Id` or makes one; echoes it on the response.
async fn identify(
    State(state): State<Arc<AppState>>,
    mut request: Request,
    next: Next,
) -> Response {
    let id = identity::request_id(
        request
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok()),
    );
    request.extensions_mut().insert(RequestId(id.clone()));
    let origin = {
        let header = |name: &str| request.headers().get(name).and_then(|v| v.to_str().ok());
        identity::origin_from_headers(
            header("x-operator-id"),
            header("traceparent"),
            header("tracestate"),
        )
        .with_routing(
            header(&state.config.releases.user_header),
            header(&state.config.releases.group_header),
        )
    };
    let mut response = identity::with_origin(origin, next.run(request)).await;
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

/// Bearer auth against the key hashes (when keys are configured); the route group needs
/// `scope` (none: any valid key).
async fn authenticate(
    State((state, scope)): State<(Arc<AppState>, Option<Scope>)>,
    mut request: Request,
    next: Next,
) -> Response {
    let request_id = request
        .extensions()
        .get::<RequestId>()
        .map_or_else(String::new, |id| id.0.clone());
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    match identity::authenticate(
        &state,
        authorization,
        Transport::Http,
        &request_id,
        endpoint_of(request.uri().path()),
        scope,
    ) {
        Ok((principal, scopes)) => {
            request.extensions_mut().insert(Principal(principal));
            request.extensions_mut().insert(Granted(scopes));
            next.run(request).await
        }
        Err(e) => {
            identity::pause_refusal(&state, &e).await;
            e.into_response()
        }
    }
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
        p if p.starts_with("/admin/") => "admin",
        _ => "other",
    }
}

/// A path no route serves, before any key is asked for: answered after `[limits]
/// invalid_path_delay_ms` (a timer), like a refused model name, so that a loop of made-up
/// paths gets a few answers a second per connection, not a core's worth.
async fn not_found(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let delay = state.config.limits.invalid_path_delay_ms;
    if delay > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
    }
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
    /// Every loaded model version (`name@version`), whatever its kind; cold models that are
    /// not loaded are not in it and do not make the server unready. `models` and `loaded` are
    /// left out for a readiness caller without a valid key.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    loaded: Vec<String>,
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/health/live", responses((status = 200, description = "The process is up")))]
async fn live() -> impl IntoResponse {
    Json(Health {
        status: "live",
        reason: None,
        models: Vec::new(),
        loaded: Vec::new(),
    })
}

/// Readiness: every configured model is loaded, the engines make progress, not draining.
/// Anyone gets the status and the reason (probes send no key); the model lists only a caller
/// with a valid key (any scope), or anyone when no keys are configured.
#[utoipa::path(get, path = "/health/ready", responses(
    (status = 200, description = "Ready to serve"),
    (status = 503, description = "Loading, draining, a model failed to load, or an engine stalled")
))]
async fn ready(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let (models, loaded) = if may_list_models(&state, authorization) {
        let models = state
            .front
            .registry
            .all()
            .iter()
            .filter(|e| e.kind() == crate::backend::Kind::Llm)
            .map(|e| format!("{}@{}", e.name, e.version))
            .collect();
        let mut loaded: Vec<String> = state
            .front
            .registry
            .all()
            .iter()
            .map(|e| format!("{}@{}", e.name, e.version))
            .collect();
        loaded.sort();
        loaded.dedup();
        (models, loaded)
    } else {
        (Vec::new(), Vec::new())
    };
    match state.not_ready_reason() {
        None => Json(Health {
            status: "ready",
            reason: None,
            models,
            loaded,
        })
        .into_response(),
        Some(reason) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Health {
                status: "not_ready",
                reason: Some(reason),
                models,
                loaded,
            }),
        )
            .into_response(),
    }
}

/// Whether a readiness caller sees which versions are loaded: with a valid key of any scope,
/// or when the server has no keys. A missing or wrong key is not refused (a probe sends none):
/// the answer just leaves the lists out.
fn may_list_models(state: &AppState, authorization: Option<&str>) -> bool {
    match &state.keys {
        None => true,
        Some(keys) => authorization
            .and_then(crate::auth::bearer)
            .and_then(|key| keys.lookup(key))
            .is_some(),
    }
}

/// Prometheus metrics (docs/metrics.md).
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", content_type = "text/plain")))]
async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    // Every request answered before the scrape is counted in it (the sink runs on its own task).
    state
        .front
        .bus
        .caught_up(
            log_metrics::METRICS_SINK,
            std::time::Duration::from_millis(250),
        )
        .await;
    log_metrics::refresh_gauges(
        &state.front.registry,
        &state.front.handoffs,
        &state.front.bus,
    );
    let mut body = state
        .metrics
        .as_ref()
        .map(|h| h.render())
        .unwrap_or_default();
    // The host and GPU telemetry read /proc, /sys and NVML (opened on the first scrape): off
    // the async workers.
    let sampled = {
        let state = Arc::clone(&state);
        tokio::task::spawn_blocking(move || {
            let mut telemetry_text = String::new();
            if let Some(telemetry) = state.telemetry() {
                let utilization = crate::telemetry::render(telemetry, &mut telemetry_text);
                state.front.set_gpu_utilization(utilization);
            }
            telemetry_text
        })
        .await
    };
    match sampled {
        Ok(text) => body.push_str(&text),
        Err(e) => tracing::error!(error = %e, "the host telemetry could not be read for /metrics"),
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body).into_response()
}

async fn openapi() -> Response {
    Json(ApiDoc::openapi()).into_response()
}
