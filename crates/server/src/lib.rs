//! Rampart's front door: `rampart serve`.
//!
//! - [`config`]: the typed configuration file, environment overrides, limits;
//! - [`routes`]: the OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`,
//!   `/v1/models`), health, metrics and the OpenAPI document, with request identity and auth;
//! - [`kserve`]: KServe v2 (core and REST binding); [`grpc`]: its gRPC binding on its own port;
//! - [`openai`]: the wire types and their validation into engine requests;
//! - [`admission`]: per-model in-flight and waiting bounds (429 / 503 with `Retry-After`);
//! - [`auth`]: API keys (hashes only) and per-key rate limits;
//! - [`record`]: the InferenceRecord of every request; [`observe`]: its sinks (JSON log,
//!   Prometheus) and the engine gauges;
//! - [`state`]: loaded models, readiness, drain.
//!
//! Not here: model internals (the `engine` crate) and compute kernels. Engines run on their own
//! threads; handlers await their streams.

pub mod admission;
pub mod auth;
pub mod config;
pub mod error;
pub mod grpc;
pub mod kserve;
pub mod observe;
pub mod openai;
pub mod record;
pub mod routes;
pub mod state;

use std::sync::Arc;
use std::time::Duration;

use repo::Repository;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::auth::KeyStore;
use crate::config::ServerConfig;
use crate::state::{AppState, Loading};

/// Why the server could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("{0}")]
    Config(String),
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error(
        "cannot listen for gRPC on {addr}: {source} (choose another address with [grpc] listen \
         or --grpc-listen, or turn gRPC off with --no-grpc)"
    )]
    GrpcBind {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("server: {0}")]
    Io(#[from] std::io::Error),
}

/// Reads the API keys from the configured file and `RAMPART_API_KEYS` (comma-separated).
pub fn load_keys(config: &ServerConfig) -> Result<Option<KeyStore>, ServeError> {
    let mut text = String::new();
    if let Some(path) = &config.api_keys_file {
        text = std::fs::read_to_string(path)
            .map_err(|e| ServeError::Config(format!("API keys file {}: {e}", path.display())))?;
        text.push('\n');
    }
    if let Ok(env) = std::env::var("RAMPART_API_KEYS") {
        text.push_str(&env.replace(',', "\n"));
    }
    let store =
        KeyStore::parse(&text, '\n').map_err(|e| ServeError::Config(format!("API keys: {e}")))?;
    Ok((!store.is_empty()).then_some(store))
}

/// Runs the server until SIGTERM/SIGINT, then drains: readiness fails, no new connections are
/// taken, in-flight requests get `shutdown_timeout_s` to finish, the rest are cancelled.
pub async fn serve(config: ServerConfig) -> Result<(), ServeError> {
    config
        .validate()
        .map_err(|e| ServeError::Config(e.to_string()))?;
    let keys = load_keys(&config)?;
    if keys.is_none() && !config.listen.ip().is_loopback() && !config.insecure_no_auth {
        return Err(ServeError::Config(format!(
            "refusing to serve on {} without API keys: give --api-keys FILE (or RAMPART_API_KEYS), \
             listen on a loopback address, or pass --insecure-no-auth",
            config.listen
        )));
    }
    if keys.is_none()
        && config.grpc.enabled
        && !config.grpc.listen.ip().is_loopback()
        && !config.insecure_no_auth
    {
        return Err(ServeError::Config(format!(
            "refusing to serve gRPC on {} without API keys: give --api-keys FILE (or RAMPART_API_KEYS), \
             listen on a loopback address, or pass --insecure-no-auth",
            config.grpc.listen
        )));
    }
    let metrics = match observe::install_metrics() {
        Ok(handle) => Some(handle),
        Err(e) => {
            tracing::warn!(error = %e, "metrics recorder not installed");
            None
        }
    };
    let listener = TcpListener::bind(config.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
    let addr = listener.local_addr()?;
    let grpc_listener = if config.grpc.enabled {
        let bound = grpc::bind(&config.grpc).await;
        Some(bound.map_err(|source| ServeError::GrpcBind {
            addr: config.grpc.listen,
            source,
        })?)
    } else {
        None
    };
    let grpc_addr = grpc_listener
        .as_ref()
        .map(TcpListener::local_addr)
        .transpose()?;
    let state = AppState::new(config, keys, metrics);
    tracing::info!(
        listen = %addr,
        grpc = %grpc_addr.map_or_else(|| "off".to_string(), |a| a.to_string()),
        auth = state.keys.as_ref().map_or(0, KeyStore::len),
        "rampart serving (models loading)"
    );
    spawn_loading(Arc::clone(&state));

    let stop = Arc::new(Notify::new());
    let app = routes::router(Arc::clone(&state));
    let graceful = {
        let stop = Arc::clone(&stop);
        async move { stop.notified().await }
    };
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(graceful)
            .await
    });
    // gRPC stops with HTTP: its own notifier, since `notify_one` wakes one waiter.
    let grpc_stop = Arc::new(Notify::new());
    let grpc_server = grpc_listener.map(|listener| {
        let stop = Arc::clone(&grpc_stop);
        tokio::spawn(grpc::serve(Arc::clone(&state), listener, async move {
            stop.notified().await
        }))
    });
    shutdown_signal().await;
    // Drain: readiness fails and new inference requests get 503 at once, while the requests
    // already admitted (running or waiting for a slot) finish, up to the timeout.
    state
        .draining
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let busy = |state: &AppState| -> usize {
        let llm: usize = state
            .models()
            .iter()
            .map(|m| m.admission.in_flight() + m.admission.waiting())
            .sum();
        let embed: usize = state
            .embedders()
            .iter()
            .map(|m| m.admission.in_flight() + m.admission.waiting())
            .sum();
        let tensor: usize = state
            .tensors()
            .iter()
            .map(|m| m.admission.in_flight() + m.admission.waiting())
            .sum();
        llm + embed + tensor
    };
    tracing::info!(
        in_flight = busy(&state),
        timeout_s = state.config.shutdown_timeout_s,
        "draining: not ready, refusing new requests, finishing admitted ones"
    );
    let deadline =
        tokio::time::Instant::now() + Duration::from_secs(state.config.shutdown_timeout_s);
    while busy(&state) > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = busy(&state);
    if left > 0 {
        tracing::warn!(
            cancelled = left,
            "shutdown timeout reached; cancelling the requests still running"
        );
        // Dropping the engines ends their streams.
        state
            .models
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }
    // Stop accepting and close idle connections.
    stop.notify_one();
    grpc_stop.notify_one();
    if let Some(grpc_server) = grpc_server {
        match tokio::time::timeout(Duration::from_secs(2), grpc_server).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::error!(error = %e, "gRPC server failed"),
            Ok(Err(e)) => tracing::error!(error = %e, "gRPC server task failed"),
            Err(_) => tracing::warn!("gRPC calls still open after the drain; closing them"),
        }
    }
    match tokio::time::timeout(Duration::from_secs(2), server).await {
        Ok(Ok(Ok(()))) => tracing::info!("drained; exiting"),
        Ok(Ok(Err(e))) => return Err(ServeError::Io(e)),
        Ok(Err(e)) => tracing::error!(error = %e, "server task failed"),
        Err(_) => tracing::warn!("connections still open after the drain; closing them"),
    }
    // Dropping the engines cancels whatever still runs.
    state
        .models
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
    Ok(())
}

/// Loads the models on a blocking thread; readiness follows.
fn spawn_loading(state: Arc<AppState>) {
    tokio::task::spawn_blocking(move || {
        let repository = Repository::open(&state.config.repo);
        let wanted = match state::models_to_load(&state.config, &repository) {
            Ok(w) => w,
            Err(e) => {
                tracing::error!(error = %e, repo = %state.config.repo.display(), "cannot read the model repository");
                state
                    .load_errors
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(e);
                *state.loading.lock().unwrap_or_else(|e| e.into_inner()) = Loading::Done;
                return;
            }
        };
        for model in wanted {
            let started = std::time::Instant::now();
            let kind = state::model_kind(&repository, &model).unwrap_or(repo::Kind::Llm);
            if kind == repo::Kind::Onnx {
                match state::load_tensor_model(&state.config, &repository, &model) {
                    Ok(handle) => {
                        tracing::info!(
                            model = %handle.id,
                            version = %handle.version,
                            digest = %handle.digest,
                            backend = handle.model.backend(),
                            max_batch_size = handle.model.max_batch_size(),
                            seconds = started.elapsed().as_secs_f64(),
                            "tensor model loaded (digests verified)"
                        );
                        state
                            .tensors
                            .write()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(Arc::new(handle));
                    }
                    Err(e) => refuse(&state, &model.name, e),
                }
                continue;
            }
            if kind == repo::Kind::Embedding {
                match state::load_embedder(&state.config, &repository, &model) {
                    Ok(handle) => {
                        tracing::info!(
                            model = %handle.id,
                            version = %handle.version,
                            digest = %handle.digest,
                            dimensions = handle.embedder.dimensions(),
                            max_seq_len = handle.embedder.max_seq_len(),
                            seconds = started.elapsed().as_secs_f64(),
                            "embedding model loaded (digests verified)"
                        );
                        state
                            .embedders
                            .write()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(Arc::new(handle));
                    }
                    Err(e) => refuse(&state, &model.name, e),
                }
                continue;
            }
            match state::load_model(&state.config, &repository, &model) {
                Ok(handle) => {
                    tracing::info!(
                        model = %handle.id,
                        version = %handle.version,
                        digest = %handle.digest,
                        context = handle.engine.context(),
                        kv_tokens = handle.engine.kv_capacity().tokens(),
                        seconds = started.elapsed().as_secs_f64(),
                        "model loaded (digests verified)"
                    );
                    state
                        .models
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(Arc::new(handle));
                }
                Err(e) => refuse(&state, &model.name, e),
            }
        }
        *state.loading.lock().unwrap_or_else(|e| e.into_inner()) = Loading::Done;
    });
}

/// SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// A model that could not be loaded: logged, and kept as a reason readiness gives.
fn refuse(state: &AppState, model: &str, error: String) {
    tracing::error!(model = %model, error = %error, "model refused");
    state
        .load_errors
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(error);
}
