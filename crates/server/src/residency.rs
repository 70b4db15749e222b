//! Many models, one memory budget: loading on demand, unloading and eviction (the repository
//! API of KServe v2 and Triton).
//!
//! - `[[models]] residency = "hot"` (the default) loads at start and is never evicted;
//!   `"cold"` loads when its first request comes (that request waits: the wait is its record's
//!   `model_load` stage and part of its time to first token) or on
//!   `POST /v2/repository/models/{name}/load`.
//! - `[memory] models_budget` bounds what the loaded models take together (a version's files
//!   plus its KV pool). Before a model loads, the least recently used cold models with no
//!   request in flight or waiting are evicted until it fits; if it cannot fit, its load is
//!   refused (503 with the arithmetic) and nothing is evicted in vain. Hot models, busy models
//!   and the one being loaded are never evicted.
//! - `POST /v2/repository/models/{name}/unload` takes every version of the model out of the
//!   routing at once, then waits for its in-flight requests to finish (up to
//!   `shutdown_timeout_s`) before its memory is let go.
//! - Loads of one model are single-flight: concurrent requests for a cold model wait on the
//!   same load.
//! - Every load, unload and eviction is logged with its cause, counted
//!   (`rampart_model_loads_total`, `rampart_model_unloads_total`), gauged
//!   (`rampart_models_memory_bytes`, `rampart_models_budget_bytes`) and a controller decision
//!   (`model.loaded`, `model.unloaded`, `model.evicted`; the audit log when it is on).

use std::sync::Arc;
use std::time::{Duration, Instant};

use metrics::{counter, gauge};
use serde::Serialize;

use crate::config::{ModelConfig, Residency as Kind};
use crate::error::ApiError;
use crate::error::WireError;
use crate::registry::{Entry, ModelName};
use crate::state::AppState;

/// One row of `GET /v2/repository/index`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct IndexRow {
    pub name: String,
    pub version: String,
    /// `READY` (loaded), `UNAVAILABLE` (not loaded), `LOADING`.
    pub state: &'static str,
    pub reason: String,
    /// `hot` or `cold` (`null`: in the repository, not configured).
    pub residency: Option<Kind>,
    /// What it takes loaded (bytes; 0 when not loaded or not measured).
    pub memory_bytes: u64,
    /// Requests in flight or waiting on it.
    pub busy: usize,
}

/// Milliseconds since the process started, the clock of [`Entry::touch`].
pub fn now_ms(state: &AppState) -> u64 {
    state.front.now_ms()
}

/// The budget in bytes (`[memory] models_budget`), a fraction resolved against the cgroup's
/// limit or the host's memory.
pub fn budget_bytes(state: &AppState) -> Option<u64> {
    let text = state.config.memory.models_budget.as_deref()?;
    match text.parse::<engine::KvMemory>().ok()? {
        engine::KvMemory::Bytes(b) => Some(b),
        engine::KvMemory::Fraction(f) => {
            let sample =
                host::Telemetry::with_gpu(std::path::Path::new(&state.config.telemetry.root), None)
                    .sample();
            let total = sample
                .cgroup
                .memory_limit_bytes
                .or(sample.memory.total_bytes)?;
            Some((total as f64 * f) as u64)
        }
    }
}

/// What the loaded models take.
fn in_use(state: &AppState) -> u64 {
    state
        .front
        .registry
        .all()
        .iter()
        .map(|e| e.memory_bytes.load(std::sync::atomic::Ordering::Relaxed))
        .sum()
}

fn set_gauges(state: &AppState) {
    gauge!("rampart_models_memory_bytes").set(in_use(state) as f64);
    if let Some(b) = budget_bytes(state) {
        gauge!("rampart_models_budget_bytes").set(b as f64);
    }
}

/// Whether a request for `model` may load it: a configured cold model that no operator
/// unloaded.
fn loads_on_request(state: &AppState, model: &ModelName) -> bool {
    state.config.model(&model.name).is_some_and(|m| {
        m.residency == Kind::Cold
            && model
                .version
                .as_ref()
                .is_none_or(|v| m.version.as_ref().is_none_or(|mv| mv == v))
    }) && !state
        .residency
        .unloaded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains_key(&model.name)
}

/// The residency's part in the pipeline: a model that loads on request is loaded before its
/// route (the front holds this; the state it loads into, weakly).
pub struct OnRequest(pub std::sync::Weak<AppState>);

/// Loads `residency = "cold"` models on their first request from now on (the server wires it
/// in when it starts serving).
pub fn install(state: &Arc<AppState>) {
    state
        .front
        .set_on_demand(Arc::new(OnRequest(Arc::downgrade(state))));
}

impl pipeline::front::OnDemand for OnRequest {
    fn before_route<'a>(
        &'a self,
        model: &'a ModelName,
        record: &'a mut record::RecordBuilder,
    ) -> pipeline::front::LoadFuture<'a> {
        Box::pin(async move {
            match self.0.upgrade() {
                Some(state) => before_route(&state, model, record).await,
                None => Ok(()),
            }
        })
    }
}

/// Before a request is routed: a cold model that is not loaded is loaded now (the request
/// waits; its record gets the `model_load` stage). Nothing happens for hot models (no lookup:
/// the route finds them) or loaded ones; the route marks the entry used.
async fn before_route(
    state: &Arc<AppState>,
    model: &ModelName,
    record: &mut record::RecordBuilder,
) -> Result<(), ApiError> {
    if !loads_on_request(state, model) || state.front.registry.find(model).is_some() {
        return Ok(());
    }
    let began = Instant::now();
    let loaded = load(state, &model.name, "request").await;
    record.stage_since("model_load", began);
    loaded.map(|_| ())
}

/// Loads `name` (its configured version, else its stable one in the repository) unless it is
/// loaded; single flight per model. `cause`: `request`, `admin`.
pub async fn load(
    state: &Arc<AppState>,
    name: &str,
    cause: &'static str,
) -> Result<Arc<Entry>, ApiError> {
    let lock = {
        let mut loading = state
            .residency
            .loading
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        Arc::clone(loading.entry(name.to_string()).or_default())
    };
    let _one = lock.lock().await;
    state
        .residency
        .unloaded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(name);
    if let Some(entry) = state.front.registry.find(&ModelName::parse(name)) {
        return Ok(entry);
    }
    if state.front.is_draining() {
        return Err(ApiError::draining());
    }
    let model = state
        .config
        .model(name)
        .cloned()
        .unwrap_or_else(|| ModelConfig::named(name));
    let repository = repo::Repository::open(&state.config.repo);
    let files = crate::loading::files_bytes(&repository, &model);
    if files == 0 {
        return Err(ApiError::ModelNotFound(format!(
            "model {name:?} is not in the repository {}",
            state.config.repo.display()
        )));
    }
    // Room for what is known before loading (the files; the KV pool when configured in
    // bytes); the pool sized from free memory is known once loaded.
    let kv = model
        .kv_cache_memory
        .as_deref()
        .and_then(|m| m.parse::<engine::KvMemory>().ok())
        .and_then(|m| match m {
            engine::KvMemory::Bytes(b) => Some(b),
            engine::KvMemory::Fraction(_) => None,
        })
        .unwrap_or(0);
    make_room(state, name, files + kv)?;
    let began = Instant::now();
    let config = state.config.clone();
    let for_load = model.clone();
    let prepare = state.prepare_lane.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        let repository = repo::Repository::open(&config.repo);
        crate::loading::load(&config, &repository, &for_load, &prepare)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("loading {name} stopped: {e}")))?;
    let entry = loaded.map_err(|e| ApiError::Unavailable {
        message: format!("model {name:?} could not be loaded: {}", e.message),
        retry_after_s: 5,
    })?;
    let load_ms = began.elapsed().as_millis() as u64;
    let memory = entry
        .memory_bytes
        .load(std::sync::atomic::Ordering::Relaxed);
    // The KV pool sized at load may need more room than was made.
    if let Err(e) = make_room(state, name, memory) {
        drop(entry);
        return Err(e);
    }
    let entry = state.serve(entry);
    entry.touch(now_ms(state));
    tracing::info!(target: "rampart::residency", model = %entry.id, cause, load_ms, memory_bytes = memory, residency = ?model.residency, "model loaded on demand");
    counter!("rampart_model_loads_total", "model" => name.to_string(), "cause" => cause)
        .increment(1);
    state.front.decisions.note(
        "model.loaded",
        Some(name),
        &entry.id,
        &format!("loaded on demand ({cause})"),
        serde_json::json!({ "cause": cause, "load_ms": load_ms, "memory_bytes": memory }),
    );
    set_gauges(state);
    Ok(entry)
}

/// Evicts least recently used idle cold models until `needed` more bytes fit the budget; an
/// error (and no eviction) when even evicting every candidate would not make room.
fn make_room(state: &AppState, loading: &str, needed: u64) -> Result<(), ApiError> {
    let Some(budget) = budget_bytes(state) else {
        return Ok(());
    };
    let used = in_use(state);
    if used + needed <= budget {
        return Ok(());
    }
    let mut candidates: Vec<Arc<Entry>> = state
        .front
        .registry
        .all()
        .into_iter()
        .filter(|e| {
            e.name != loading && e.cold.load(std::sync::atomic::Ordering::Relaxed) && e.busy() == 0
        })
        .collect();
    candidates.sort_by_key(|e| e.last_used_ms());
    let freeable: u64 = candidates
        .iter()
        .map(|e| e.memory_bytes.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    if used - freeable.min(used) + needed > budget {
        return Err(ApiError::Unavailable {
            message: format!(
                "model {loading:?} needs {needed} bytes; the models' budget is {budget} bytes, \
                 {used} are in use and only {freeable} could be freed (idle cold models); \
                 unload a model or raise [memory] models_budget"
            ),
            retry_after_s: 5,
        });
    }
    let mut free = budget.saturating_sub(used);
    for e in candidates {
        if free >= needed {
            break;
        }
        // Busy again since the list was made: keep it.
        if e.busy() > 0 {
            continue;
        }
        let Some(removed) = state.front.registry.remove(&e.name, &e.version) else {
            continue;
        };
        let bytes = removed
            .memory_bytes
            .load(std::sync::atomic::Ordering::Relaxed);
        free += bytes;
        let idle_ms = now_ms(state).saturating_sub(removed.last_used_ms());
        tracing::warn!(target: "rampart::residency", model = %removed.id, for_model = loading, bytes, idle_ms, "model evicted: the models' budget needs room");
        counter!("rampart_model_unloads_total", "model" => removed.name.clone(), "cause" => "evicted")
            .increment(1);
        state.front.decisions.note(
            "model.evicted",
            Some(&removed.name),
            &removed.id,
            &format!("least recently used idle cold model; room for {loading}"),
            serde_json::json!({ "bytes": bytes, "idle_ms": idle_ms, "for": loading, "budget_bytes": budget }),
        );
    }
    set_gauges(state);
    if free >= needed {
        Ok(())
    } else {
        Err(ApiError::Unavailable {
            message: format!(
                "model {loading:?} needs {needed} bytes; {free} of the models' budget of {budget} \
                 bytes could be made free"
            ),
            retry_after_s: 5,
        })
    }
}

/// Takes every version of `name` out of the routing, then waits (up to `drain`) for their
/// in-flight requests. Requests do not load it back until the next `load`.
pub async fn unload(
    state: &Arc<AppState>,
    name: &str,
    drain: Duration,
) -> Result<serde_json::Value, ApiError> {
    let mut removed = Vec::new();
    for v in state.front.registry.versions(name) {
        removed.extend(state.front.registry.remove(name, &v));
    }
    if removed.is_empty() {
        return Err(ApiError::ModelNotFound(format!(
            "model {name:?} is not loaded"
        )));
    }
    state
        .residency
        .unloaded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name.to_string(), "unloaded by an operator".into());
    let began = Instant::now();
    while removed.iter().any(|e| e.busy() > 0) && began.elapsed() < drain {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let still = removed.iter().map(|e| e.busy()).sum::<usize>();
    let bytes: u64 = removed
        .iter()
        .map(|e| e.memory_bytes.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    let versions: Vec<String> = removed.iter().map(|e| e.version.clone()).collect();
    let waited_ms = began.elapsed().as_millis() as u64;
    tracing::info!(target: "rampart::residency", model = name, ?versions, waited_ms, still_running = still, bytes, "model unloaded");
    counter!("rampart_model_unloads_total", "model" => name.to_string(), "cause" => "admin")
        .increment(1);
    drop(removed);
    set_gauges(state);
    Ok(serde_json::json!({
        "model": name,
        "versions": versions,
        "drained_ms": waited_ms,
        "still_running": still,
        "freed_bytes": bytes,
    }))
}

/// Every model version in the repository and whether it is loaded.
pub fn index(state: &AppState) -> Result<Vec<IndexRow>, ApiError> {
    let repository = repo::Repository::open(&state.config.repo);
    let names = repository
        .models()
        .map_err(|e| ApiError::Internal(format!("the repository cannot be read: {e}")))?;
    let loaded = state.front.registry.all();
    let unloaded = state
        .residency
        .unloaded
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    let mut rows = Vec::new();
    for name in names {
        let residency = state.config.model(&name).map(|m| m.residency);
        let versions = repository.versions(&name).unwrap_or_default();
        for version in versions.iter().map(|v| v.version.to_string()) {
            let entry = loaded
                .iter()
                .find(|e| e.name == name && e.version == version);
            let (row_state, reason) = match (entry, residency) {
                (Some(_), _) => ("READY", String::new()),
                (None, _) if unloaded.contains_key(&name) => {
                    ("UNAVAILABLE", unloaded[&name].clone())
                }
                (None, Some(Kind::Cold)) => (
                    "UNAVAILABLE",
                    "cold: loads on its first request or on load".to_string(),
                ),
                (None, Some(Kind::Hot)) => (
                    "UNAVAILABLE",
                    "not loaded (another version is served, or its load failed)".to_string(),
                ),
                (None, None) => (
                    "UNAVAILABLE",
                    "not configured to be served; load it with POST /v2/repository/models/{name}/load".to_string(),
                ),
            };
            rows.push(IndexRow {
                name: name.clone(),
                version,
                state: row_state,
                reason,
                residency,
                memory_bytes: entry.map_or(0, |e| {
                    e.memory_bytes.load(std::sync::atomic::Ordering::Relaxed)
                }),
                busy: entry.map_or(0, |e| e.busy()),
            });
        }
    }
    Ok(rows)
}

/// The repository routes (scope `admin`): `GET`/`POST /v2/repository/index`,
/// `POST /v2/repository/models/{name}/load` and `/unload`. Loads and unloads are audited admin
/// actions.
pub fn routes() -> axum::Router<Arc<AppState>> {
    use axum::routing::{get, post};
    axum::Router::new()
        .route(
            crate::paths::V2_REPOSITORY_INDEX,
            get(index_route).post(index_route),
        )
        .route(crate::paths::V2_REPOSITORY_LOAD, post(load_route))
        .route(crate::paths::V2_REPOSITORY_UNLOAD, post(unload_route))
}

async fn index_route(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    match index(&state) {
        Ok(rows) => axum::Json(rows).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn load_route(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
    model: crate::model_path::ModelPath,
    axum::Extension(principal): axum::Extension<crate::identity::Principal>,
) -> axum::response::Response {
    let name = model.name().to_string();
    let result = async {
        let entry = load(&state, &name, "admin").await?;
        Ok((
            entry.id.clone(),
            serde_json::json!({
                "model": entry.name,
                "version": entry.version,
                "memory_bytes": entry.memory_bytes.load(std::sync::atomic::Ordering::Relaxed),
            }),
        ))
    }
    .await;
    audited(&state, &principal.0, &name, "model.load", result).await
}

async fn unload_route(
    axum::extract::State(state): axum::extract::State<Arc<AppState>>,
    model: crate::model_path::ModelPath,
    axum::Extension(principal): axum::Extension<crate::identity::Principal>,
) -> axum::response::Response {
    let name = model.name().to_string();
    let drain = Duration::from_secs(state.config.shutdown_timeout_s.max(1));
    let result = unload(&state, &name, drain)
        .await
        .map(|detail| (name.clone(), detail));
    audited(&state, &principal.0, &name, "model.unload", result).await
}

/// Answers an admin action's result once it is in the audit log (its target and detail).
async fn audited(
    state: &AppState,
    principal: &str,
    name: &str,
    action: &str,
    result: Result<(String, serde_json::Value), ApiError>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let acted = async {
        let (target, detail) = result?;
        state
            .act(
                principal,
                Some(name),
                audit::Action {
                    name: action.into(),
                    target: Some(target),
                    cause: None,
                    outcome: "ok".into(),
                    detail: detail.clone(),
                },
            )
            .await?;
        Ok::<_, ApiError>(detail)
    }
    .await;
    match acted {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}
