//! Rampart's front door: `rampart serve`.
//!
//! The request path, top to bottom:
//! - [`http`] (routes, identity and key middleware, health, metrics, OpenAPI) with
//!   [`openai_http`] and [`kserve`] (REST); [`grpc`] (KServe v2 over gRPC on its own port):
//!   each decodes its wire format ([`openai`] holds the OpenAI types and their validation), calls
//!   the front, and encodes the answer;
//! - [`tls`]: with `[tls]`, both doors serve TLS (rustls), the certificate reloaded on change;
//! - [`identity`]: request ids, API keys and body limits, once for HTTP and gRPC;
//! - [`front`]: the one pipeline (drain check → guard → route → admission → backend);
//! - [`registry`]: every served model in one list with one lookup; [`backend`]: the seam that
//!   language, embedding and tensor models implement, with its typed error;
//! - [`admission`]: per-model in-flight and waiting bounds (429 / 503 with `Retry-After`);
//!   [`auth`]: key hashes and per-key rate limits; [`error`]: the one error type and its maps
//!   to HTTP and gRPC;
//! - records: every request's `InferenceRecord` (crate `record`) goes to the bus, whose first
//!   sinks are the structured log and the Prometheus metrics ([`log_metrics`]), and, with
//!   `[tracing]` on, the OpenTelemetry traces exported over OTLP ([`traces`]);
//! - [`state`]: what handlers share, and model loading; [`config`]: the typed configuration;
//! - [`release_plans`]: each model's release plan routes its requests (stable, canary, A/B), a
//!   record sink feeds its judge, and a controller task moves weights, promotes and rolls back;
//! - [`doctor`]: the host checks (crate `host`) on this configuration, logged at start and
//!   served at `GET /admin/doctor`.
//!
//! Not here: model internals (the `engine` and `classic` crates) and compute kernels. Engines
//! run on their own threads; handlers await their streams.

pub mod admin;
// The protocol-neutral pipeline (crate `pipeline`), under the names the server's modules use.
pub use pipeline::{
    admission, backend, breaker, chain, faults, front, guard_service, handoff, lane, registry,
    shadow,
};
pub mod audit_routes;
pub mod auth;
pub mod baseline;
pub mod claims;
pub mod config;
pub mod connections;
pub mod correction_stream;
pub mod degradation;
pub mod doctor;
pub mod error;
pub mod feedback_routes;
pub mod feedback_service;
pub mod fleet;
pub mod grpc;
pub mod http;
pub mod identity;
pub mod kserve;
pub mod loading;
pub mod log_metrics;
pub mod marks;
pub mod maturity;
pub mod model_path;
pub mod monitors;
pub mod openai;
pub mod openai_http;
pub mod paths;
pub mod release_control;
pub mod release_plans;
pub mod release_routes;
pub mod residency;
pub mod state;
pub mod telemetry;
pub mod tls;
pub mod tokenize;
pub mod traces;
pub mod unauthenticated;

use std::sync::Arc;
use std::time::Duration;

use record::{Bus, Sink};
use repo::Repository;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::auth::KeyStore;
use crate::config::ServerConfig;
use crate::state::AppState;

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
    #[error("{0}")]
    Tls(#[from] tls::TlsError),
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
pub async fn serve(mut config: ServerConfig) -> Result<(), ServeError> {
    config
        .validate()
        .map_err(|e| ServeError::Config(e.to_string()))?;
    config.identify();
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
    let certificates = config
        .tls
        .enabled()
        .then(|| tls::Certificates::load(&config.tls))
        .transpose()?;
    let metrics = match log_metrics::install_metrics() {
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
    let audit = open_audit(&config)?;
    // The controllers' decisions, published once the bus starts.
    let decisions = pipeline::decisions::Decisions::default();
    let monitors = config.monitor.enabled.then(|| {
        monitors::Monitors::new(
            config.monitor.clone(),
            config.repo.clone(),
            decisions.clone(),
        )
    });
    let fleet = fleet::Fleet::open(&config.fleet, &config.feedback)
        .map_err(|e| ServeError::Config(format!("[fleet]: {e}")))?;
    let releases = open_releases(&config, &decisions, fleet.clone())?;
    let feedback = if config.feedback.enabled {
        let settings = config.feedback.clone();
        let opened =
            tokio::task::spawn_blocking(move || feedback_routes::FeedbackService::open(&settings))
                .await
                .map_err(|e| ServeError::Config(format!("feedback store: {e}")))?;
        Some(opened.map_err(|e| ServeError::Config(e.to_string()))?)
    } else {
        None
    };
    let listening = Listening {
        http: addr,
        grpc: grpc_addr.unwrap_or(config.grpc.listen),
    };
    let mut sinks = sinks(
        &config,
        audit.as_ref(),
        monitors.as_ref(),
        releases.as_ref(),
        listening,
    )?;
    if let Some(f) = &feedback {
        sinks.push(Box::new(f.sink()));
    }
    let bus = Bus::start(sinks).map_err(|e| ServeError::Config(e.to_string()))?;
    // The monitors and releases are sinks of the bus they publish their decisions on.
    decisions.connect(&bus);
    if let Some(log) = &audit {
        spawn_audit(&config, log, &bus)?;
    }
    // The host's findings go to the log while the models load; start does not wait for them.
    doctor::log_at_start(&config);
    let state = AppState::with_audit(config, keys, metrics, bus, audit);
    residency::install(&state);
    if let Some(m) = monitors {
        let _ = state.monitors.set(m);
    }
    if let Some(r) = releases {
        let _ = state.releases.set(Arc::clone(&r));
        state
            .front
            .set_releases(Arc::clone(&r) as Arc<dyn pipeline::front::Releases>);
        if let Some(f) = fleet {
            fleet::spawn_heartbeat(Arc::clone(&state), f, r.cfg.tick_ms);
        }
        release_control::spawn(Arc::clone(&state), r);
    }
    if let Some(f) = feedback {
        tracing::info!(
            store = f.store.location(),
            kind = f.store.kind(),
            "feedback store open"
        );
        let _ = state.feedback.set(f);
        feedback_routes::spawn(Arc::clone(&state));
    }
    tracing::info!(
        listen = %addr,
        grpc = %grpc_addr.map_or_else(|| "off".to_string(), |a| a.to_string()),
        tls = if certificates.is_some() { state.config.tls.client_auth.as_str() } else { "none" },
        auth = state.keys.as_ref().map_or(0, KeyStore::len),
        "rampart serving (models loading)"
    );
    unauthenticated::spawn_summaries(
        Arc::clone(&state.unauthenticated),
        Arc::clone(&state.front.rate_limited),
        state.audit.clone(),
        std::time::Duration::from_secs(state.config.unauthenticated_summary_s.max(1)),
    );
    spawn_loading(Arc::clone(&state));
    spawn_readiness(Arc::clone(&state));
    degradation::spawn(Arc::clone(&state));

    let stop = Arc::new(Notify::new());
    let app = http::router(Arc::clone(&state));
    let graceful = {
        let stop = Arc::clone(&stop);
        async move { stop.notified().await }
    };
    let timeouts = connections::Timeouts {
        header_read: Duration::from_millis(state.config.limits.header_read_timeout_ms.max(1)),
        body_read: Duration::from_millis(state.config.limits.body_read_timeout_ms.max(1)),
    };
    let server = match &certificates {
        None => tokio::spawn(connections::serve(listener, app, graceful, timeouts)),
        Some(certificates) => {
            certificates.spawn_reloader();
            let how = tls::Accepting {
                door: tls::Door::Http,
                tcp_keepalive: None,
            };
            let listener = tls::listen(listener, Arc::clone(certificates), how);
            tokio::spawn(connections::serve(listener, app, graceful, timeouts))
        }
    };
    // gRPC stops with HTTP: its own notifier, since `notify_one` wakes one waiter.
    let grpc_stop = Arc::new(Notify::new());
    let grpc_server = grpc_listener.map(|listener| {
        let stop = Arc::clone(&grpc_stop);
        tokio::spawn(grpc::serve(
            Arc::clone(&state),
            listener,
            certificates.clone(),
            async move { stop.notified().await },
        ))
    });
    shutdown_signal().await;
    // Readiness fails first; behind a balancer, requests are still served until its health
    // check has taken this replica out (`drain_delay_s`), so that nobody is refused.
    state
        .leaving
        .store(true, std::sync::atomic::Ordering::Relaxed);
    if state.config.drain_delay_s > 0 {
        tracing::info!(
            delay_s = state.config.drain_delay_s,
            "leaving: not ready, still serving while the load balancer takes this replica out"
        );
        tokio::time::sleep(Duration::from_secs(state.config.drain_delay_s)).await;
    }
    // Drain: readiness fails and new inference requests get 503 at once, while the requests
    // already admitted (running or waiting for a slot) finish, up to the timeout.
    state.front.drain();
    let busy = |state: &AppState| {
        state.front.registry.busy() + state.releases.get().map_or(0, |r| r.controls_busy())
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
        state.front.registry.clear();
        if let Some(releases) = state.releases.get() {
            releases.drop_controls();
        }
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
        Ok(Ok(())) => tracing::info!("drained; exiting"),
        Ok(Err(e)) => tracing::error!(error = %e, "server task failed"),
        Err(_) => tracing::warn!("connections still open after the drain; closing them"),
    }
    // Dropping the engines cancels whatever still runs.
    state.front.registry.clear();
    // Every record of the drained requests reaches its sinks, within what is left of the time.
    let left = deadline
        .saturating_duration_since(tokio::time::Instant::now())
        .max(Duration::from_secs(2));
    let report = state.front.bus.shutdown(left).await;
    for (sink, end, counters) in &report.sinks {
        if *end == record::SinkEnd::Drained {
            tracing::info!(
                sink,
                written = counters.written,
                dropped = counters.dropped_total(),
                "record sink drained"
            );
        } else {
            tracing::warn!(sink, end = ?end, written = counters.written, dropped = counters.dropped_total(), "record sink did not drain in time");
        }
    }
    Ok(())
}

/// Where the server listens, for the traces' `server.address` and `server.port`.
#[derive(Debug, Clone, Copy)]
struct Listening {
    http: std::net::SocketAddr,
    grpc: std::net::SocketAddr,
}

/// The releases of the repository's models (the plans there are), when `[releases] enabled`.
fn open_releases(
    config: &ServerConfig,
    decisions: &pipeline::decisions::Decisions,
    fleet: Option<Arc<fleet::Fleet>>,
) -> Result<Option<Arc<release_plans::Releases>>, ServeError> {
    if !config.releases.enabled {
        return Ok(None);
    }
    let names = Repository::open(&config.repo).models().unwrap_or_default();
    release_plans::Releases::open(
        config.releases.clone(),
        config.repo.clone(),
        &names,
        decisions.clone(),
        fleet,
    )
    .map(|r| Some(Arc::new(r)))
    .map_err(|e| ServeError::Config(e.to_string()))
}

/// The record's sinks: the structured log, the metrics, the audit log, the monitors, the
/// releases' judges and, with `[tracing]` on, the traces.
fn sinks(
    config: &ServerConfig,
    audit: Option<&Arc<audit::AuditLog>>,
    monitors: Option<&Arc<monitors::Monitors>>,
    releases: Option<&Arc<release_plans::Releases>>,
    listening: Listening,
) -> Result<Vec<Box<dyn Sink>>, ServeError> {
    let capacity = config.records.lane_capacity;
    let mut sinks: Vec<Box<dyn Sink>> = vec![
        Box::new(log_metrics::LogSink::redacting(
            capacity,
            config.audit.redact.clone(),
        )),
        Box::new(log_metrics::MetricsSink::new(capacity)),
    ];
    if let Some(log) = audit {
        sinks.push(Box::new(audit::AuditSink::new(
            Arc::clone(log),
            &config.audit,
        )));
    }
    if let Some(m) = monitors {
        sinks.push(Box::new(monitors::MonitorSink::new(Arc::clone(m))));
    }
    if let Some(r) = releases {
        sinks.push(Box::new(release_plans::ReleaseSink::new(Arc::clone(r))));
    }
    if config.tracing.enabled {
        let names = sinks.iter().map(|s| s.name()).collect();
        let settings =
            traces::SpanSettings::new(&config.tracing, listening.http, listening.grpc, names);
        let sink = traces::TraceSink::new(&config.tracing, settings)
            .map_err(|e| ServeError::Config(e.to_string()))?;
        sinks.push(Box::new(sink));
    }
    Ok(sinks)
}

/// Opens (and, after a crash, recovers) the audit log when `[audit] enabled`.
fn open_audit(config: &ServerConfig) -> Result<Option<Arc<audit::AuditLog>>, ServeError> {
    let a = &config.audit;
    if !a.enabled {
        tracing::warn!(
            "the audit log is off ([audit] enabled = false): requests leave no audit entry"
        );
        return Ok(None);
    }
    let log = audit::AuditLog::open(a.log_options()).map_err(|e| {
        ServeError::Config(format!(
            "audit log {}: {e} (run `rampart audit verify --dir {}` to see what is wrong)",
            a.dir.display(),
            a.dir.display()
        ))
    })?;
    let status = log.status();
    tracing::info!(
        dir = %a.dir.display(),
        mode = a.mode().as_str(),
        entries = status.size,
        key_id = %status.key_id,
        s3 = a.s3.as_ref().map_or("off", |s| s.url.as_str()),
        "audit log open"
    );
    Ok(Some(log))
}

/// The audit log's upkeep task: checkpoints, sealing, shipping, gauges.
fn spawn_audit(
    config: &ServerConfig,
    log: &Arc<audit::AuditLog>,
    bus: &Arc<Bus>,
) -> Result<(), ServeError> {
    let shipper = config
        .audit
        .s3
        .as_ref()
        .map(|s3| audit::ship::Shipper::new(&config.audit.dir, s3).map(Arc::new))
        .transpose()
        .map_err(|e| ServeError::Config(e.to_string()))?;
    let service = audit::Service {
        log: Arc::clone(log),
        shipper,
        interval: Duration::from_millis(config.audit.checkpoint_interval_ms),
    };
    let bus = Arc::clone(bus);
    tokio::spawn(service.run(move || {
        let dropped = bus
            .counters()
            .iter()
            .find(|c| c.sink == audit::sink::SINK_NAME)
            .map_or(0, |c| c.dropped_total());
        (bus.depth(audit::sink::SINK_NAME), dropped)
    }));
    Ok(())
}

/// Loads the models on a blocking thread; readiness follows.
fn spawn_loading(state: Arc<AppState>) {
    tokio::task::spawn_blocking(move || load_models(&state));
}

/// Loads the guard and the configured models (blocking: files are read and engines started);
/// each failure is kept as a reason readiness gives.
pub fn load_models(state: &AppState) {
    let repository = Repository::open(&state.config.repo);
    // The guard first: no request is served before its guard is.
    let (guard, problem) =
        guard_service::GuardService::load(&state.config.guard_setup(), &repository);
    if state.front.set_guard(Arc::new(guard)).is_err() {
        tracing::warn!("the input guard was already in use before it loaded");
    }
    if let Some(e) = problem {
        state.refuse(e);
    }
    let wanted = match loading::models_to_load(&state.config, &repository) {
        Ok(w) => w,
        Err(e) => {
            tracing::error!(error = %e, repo = %state.config.repo.display(), "cannot read the model repository");
            state.refuse(e);
            state.loaded();
            return;
        }
    };
    let wanted = if state.config.releases.enabled {
        with_release_versions(&state.config.repo, wanted)
    } else {
        wanted
    };
    let mut named = std::collections::BTreeSet::new();
    let mut below = std::collections::BTreeSet::new();
    let mut doctor = None;
    for model in &wanted {
        if named.insert(model.name.clone()) {
            choose_stable(state, &repository, model);
            if !maturity_gate(state, &repository, model, &mut doctor) {
                below.insert(model.name.clone());
            }
        }
    }
    for model in wanted.into_iter().filter(|m| !below.contains(&m.name)) {
        // Cold models load on their first request (or an operator's `load`), unless their
        // release is under way (a release serves its versions from the start).
        let releasing = state.config.releases.enabled
            && release_plans::Releases::versions_wanted(&state.config.repo, &model.name)
                .is_some_and(|(_, candidate)| candidate.is_some());
        if model.residency == config::Residency::Cold && !releasing {
            tracing::info!(model = %model.name, "cold model: loads on its first request");
            continue;
        }
        match loading::load(&state.config, &repository, &model, &state.prepare_lane) {
            Ok(entry) => {
                state.serve(entry);
            }
            Err(e) => state.refuse(e),
        }
    }
    check_chains(state);
    state.loaded();
}

/// The version a model's name serves (its release plan's stable, else its configured pin,
/// else the repository's stable alias), set in the registry before anything loads so that no
/// other loaded version (a candidate, an operator's load) takes its users. Versions newer than
/// it are candidates waiting for a release: logged, never served by name.
fn choose_stable(state: &AppState, repository: &Repository, model: &config::ModelConfig) {
    let plan = state
        .config
        .releases
        .enabled
        .then(|| release_plans::Releases::versions_wanted(&state.config.repo, &model.name))
        .flatten();
    let (version, by) = match (&plan, &model.version) {
        (Some((stable, _)), _) => (stable.clone(), "release plan".to_string()),
        (None, Some(pinned)) => (pinned.clone(), "configured version".to_string()),
        (None, None) => match repository.chosen(&model.name) {
            Ok((v, repo::Choice::Stable { setting })) => (
                v.version.to_string(),
                format!(
                    "stable alias ({}, set by {} at {})",
                    setting.cause, setting.set_by, setting.set_at
                ),
            ),
            Ok((v, repo::Choice::OnlyVersion)) => (v.version.to_string(), "only version".into()),
            // Loading by name fails with the same error, which readiness then gives.
            Err(_) => return,
        },
    };
    state.front.registry.set_stable(&model.name, &version);
    tracing::info!(model = %model.name, version, by, "the version users get");
    let waiting: Vec<String> = repository
        .versions(&model.name)
        .unwrap_or_default()
        .into_iter()
        .filter(|v| semver::Version::parse(&version).is_ok_and(|s| v.version > s))
        .map(|v| v.version.to_string())
        .collect();
    if !waiting.is_empty() {
        let release_under_way = plan.as_ref().is_some_and(|(_, c)| c.is_some());
        tracing::warn!(
            model = %model.name,
            stable = version,
            waiting = waiting.join(", "),
            release_under_way,
            "newer versions are waiting: users get the stable until a release (`rampart release start {} --candidate VERSION`) or `rampart model promote` moves them",
            model.name
        );
    }
}

/// In production mode (`[maturity] production`), a model whose stable version is below its
/// required level is not served: refused with the failing checks named (readiness gives it),
/// unless its `maturity_override` says why, which is logged and audited. Either is a decision.
/// Returns whether the model may be served.
fn maturity_gate(
    state: &AppState,
    repository: &Repository,
    model: &config::ModelConfig,
    doctor: &mut Option<host::Report>,
) -> bool {
    let cfg = &state.config.maturity;
    let Some(required) = cfg.required(model).filter(|_| cfg.production) else {
        return true;
    };
    let Some(stable) = state.front.registry.stable_version(&model.name) else {
        return true; // Loading by name fails with its own reason.
    };
    let version = match repository.resolve(&repo::ModelRef {
        name: model.name.clone(),
        version: semver::Version::parse(&stable).ok(),
    }) {
        Ok(v) => v,
        Err(_) => return true,
    };
    let doctor = doctor
        .get_or_insert_with(|| doctor::examine(&state.config).report)
        .clone();
    let alerts_loaded = state
        .config
        .maturity
        .prometheus_url
        .as_deref()
        .map(|url| tokio::runtime::Handle::current().block_on(maturity::alerts_loaded(url)));
    let live = maturity::Live {
        // Loading verifies every file (and refuses a version that does not).
        verified: Some(Ok(())),
        doctor: Some(doctor),
        alerts_loaded,
    };
    let report = match maturity::report(&state.config, repository, &version, &live) {
        Ok(r) => r,
        Err(e) => {
            state.refuse(crate::registry::LoadError::new(
                &model.name,
                format!("its maturity cannot be judged: {e}"),
            ));
            return false;
        }
    };
    let Some(shortfall) = report.shortfall(required) else {
        tracing::info!(target: "rampart::maturity", model = %model.name, version = %report.version, level = %report.level, required = %required, "maturity: the stable version reaches its level");
        return true;
    };
    let missing: Vec<String> = report
        .missing_for(required)
        .iter()
        .map(|c| c.id.clone())
        .collect();
    let detail = serde_json::json!({
        "version": report.version,
        "level": report.level,
        "required": required,
        "missing": missing,
        "override": model.maturity_override,
    });
    let target = format!("{}@{}", report.model, report.version);
    match &model.maturity_override {
        Some(reason) => {
            tracing::warn!(target: "rampart::maturity", model = %model.name, version = %report.version, level = %report.level, required = %required, reason, missing = missing.join(", "), "maturity override: the stable version is served below its level");
            state.front.decisions.note(
                "maturity.override",
                Some(&model.name),
                &target,
                &format!("override: {reason}; {shortfall}"),
                detail,
            );
            true
        }
        None => {
            state.front.decisions.note(
                "maturity.refused",
                Some(&model.name),
                &target,
                &shortfall,
                detail,
            );
            state.refuse(crate::registry::LoadError::new(
                &model.name,
                format!("{shortfall} (production mode: set maturity_override = \"why\" on the model to serve it anyway, audited)"),
            ));
            false
        }
    }
}

/// The models to load with their release plans' versions: a model served by name serves its
/// plan's stable version, and the candidate too while its release is under way.
fn with_release_versions(
    repo: &std::path::Path,
    wanted: Vec<config::ModelConfig>,
) -> Vec<config::ModelConfig> {
    let mut out: Vec<config::ModelConfig> = Vec::new();
    for model in wanted {
        let Some((stable, candidate)) = release_plans::Releases::versions_wanted(repo, &model.name)
        else {
            out.push(model);
            continue;
        };
        let mut versions = vec![model.version.clone().unwrap_or_else(|| stable.clone())];
        if model.version.is_some() && model.version.as_deref() != Some(stable.as_str()) {
            versions.push(stable);
        }
        versions.extend(candidate);
        for v in versions {
            let present = out
                .iter()
                .any(|m| m.name == model.name && m.version.as_deref() == Some(v.as_str()));
            if !present {
                let mut m = model.clone();
                m.version = Some(v);
                out.push(m);
            }
        }
    }
    out
}

/// Checks every backend's readiness each `breaker.readiness_interval_ms`: the chain reads the
/// result (a backend that is not ready is skipped with `not_ready`) and its breaker counts
/// the failed checks (3 in a row open it).
pub fn spawn_readiness(state: Arc<AppState>) {
    let every = Duration::from_millis(state.config.breaker.readiness_interval_ms.max(1));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for e in state.front.registry.all() {
                for b in e.backends() {
                    if let Some(problem) = b.check_readiness() {
                        tracing::debug!(backend = %b.id, problem, "readiness check failed");
                    }
                }
            }
        }
    });
}

/// Warns of fallback steps that name a model that is not served (the step is skipped as
/// `not_ready` until it is).
fn check_chains(state: &AppState) {
    for e in state.front.registry.all() {
        for step in &e.policy.steps {
            if let crate::chain::Target::Model(m) = &step.target {
                if state.front.registry.find(m).is_none() {
                    tracing::warn!(model = %e.id, fallback = %m, "a fallback step names a model that is not served");
                }
            }
        }
    }
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
