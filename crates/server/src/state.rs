//! What the handlers share: the registry of served models, the keys, the limits, the record
//! bus, readiness and drain; and the loading of models into the registry.

use std::sync::{Arc, Mutex};

use metrics_exporter_prometheus::PrometheusHandle;
use record::Bus;

use crate::auth::KeyStore;
use crate::config::ServerConfig;
use pipeline::Front;

/// Readiness of the model set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loading {
    InProgress,
    Done,
}

pub use pipeline::registry::LoadError;

/// The audit log's say on the path (`fail_closed`: nothing is served while it cannot persist).
struct AuditLogGate {
    log: Arc<audit::AuditLog>,
    mode: audit::Mode,
}

impl pipeline::front::AuditGate for AuditLogGate {
    fn refusal(&self) -> Option<crate::error::ApiError> {
        if self.mode != audit::Mode::FailClosed || self.log.is_healthy() {
            return None;
        }
        let why = self.log.problem().unwrap_or_default();
        Some(crate::error::ApiError::AuditUnavailable(format!(
            "the audit log cannot persist ({why}); requests are refused until it can"
        )))
    }
}

/// Per-model load locks (single flight) and what was unloaded on purpose.
#[derive(Debug, Default)]
pub struct Residency {
    pub(crate) loading: Mutex<std::collections::HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Models an operator unloaded: requests do not load them back (until `load`).
    pub(crate) unloaded: Mutex<std::collections::HashMap<String, String>>,
}

/// Shared by every handler.
pub struct AppState {
    pub config: ServerConfig,
    /// The pipeline every protocol calls: the registry, the rate limits, the guard, the
    /// hand-offs, the faults, the record bus and the drain flag (crate `pipeline`).
    pub front: Arc<Front>,
    pub loading: Mutex<Loading>,
    /// Models that could not be loaded, and why.
    pub load_errors: Mutex<Vec<LoadError>>,
    pub keys: Option<KeyStore>,
    /// Requests refused before authentication, summarised per interval.
    pub unauthenticated: Arc<crate::unauthenticated::Tally>,
    /// The places of `/tokenize` and `/detokenize` (`[limits] tokenize_in_flight`).
    pub tokenizing: Arc<crate::admission::Admission>,
    /// Where `/tokenize` and `/detokenize` work: `tokenize_in_flight` threads below the
    /// compute's priority (crate::lane).
    pub tokenize_lane: crate::lane::Lane,
    /// Where a client's long input is made ready for a model: KServe v2 JSON bodies decoded
    /// into typed tensors, long prompts rendered and tokenized, long texts to embed tokenized;
    /// one thread a core, below the compute's priority (crate::lane). Short inputs never wait
    /// here.
    pub prepare_lane: crate::lane::Lane,
    pub metrics: Option<PrometheusHandle>,
    /// The WORM audit log, when `[audit] enabled`.
    pub audit: Option<Arc<audit::AuditLog>>,
    /// The monitors (drift, output entropy and confidence), when `[monitor] enabled`; set by
    /// `serve` before the first request.
    pub monitors: std::sync::OnceLock<Arc<crate::monitors::Monitors>>,
    /// The models' releases (their plans route, judge and steer), when `[releases] enabled`;
    /// set by `serve` before the first request.
    pub releases: std::sync::OnceLock<Arc<crate::release_plans::Releases>>,
    /// The feedback store and links, when `[feedback] enabled`.
    pub feedback: std::sync::OnceLock<Arc<crate::feedback_service::FeedbackService>>,
    /// The host telemetry, opened at the first scrape (`None` inside: `[telemetry]` is off).
    pub telemetry: std::sync::OnceLock<Option<host::Telemetry>>,
    /// Each language model's degradation controller (`[degradation]`).
    pub degradation: crate::degradation::Degradation,
    /// Loading on demand, unloading and evicting within `[memory] models_budget`.
    pub residency: Residency,
    /// SIGTERM came: readiness fails (the balancer takes this replica out) while requests are
    /// still served for `drain_delay_s`, then the drain refuses new ones.
    pub leaving: std::sync::atomic::AtomicBool,
}

impl AppState {
    /// SIGTERM came (readiness fails; requests may still be served during `drain_delay_s`).
    pub fn is_leaving(&self) -> bool {
        self.leaving.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

impl AppState {
    pub fn new(
        config: ServerConfig,
        keys: Option<KeyStore>,
        metrics: Option<PrometheusHandle>,
        bus: Arc<Bus>,
    ) -> Arc<Self> {
        Self::with_audit(config, keys, metrics, bus, None)
    }

    /// The state with the audit log (whose sink is on `bus`).
    pub fn with_audit(
        config: ServerConfig,
        keys: Option<KeyStore>,
        metrics: Option<PrometheusHandle>,
        bus: Arc<Bus>,
        audit: Option<Arc<audit::AuditLog>>,
    ) -> Arc<Self> {
        let gate = audit.as_ref().map(|log| {
            Arc::new(AuditLogGate {
                log: Arc::clone(log),
                mode: config.audit.mode(),
            }) as Arc<dyn pipeline::front::AuditGate>
        });
        let front = Arc::new(Front::new(config.front_setup(), bus, gate));
        Arc::new(Self {
            front,
            audit,
            unauthenticated: Arc::default(),
            tokenizing: crate::admission::Admission::new(crate::config::Admission {
                max_in_flight: config.limits.tokenize_in_flight.max(1),
                max_waiting: config.limits.tokenize_waiting,
                queue_timeout_ms: config.limits.tokenize_timeout_ms,
                ..Default::default()
            }),
            tokenize_lane: crate::lane::Lane::start(
                "tokenize",
                config.limits.tokenize_in_flight,
                config.limits.background_nice,
            ),
            prepare_lane: crate::lane::Lane::start(
                "prepare",
                std::thread::available_parallelism().map_or(2, |n| n.get()),
                config.limits.background_nice,
            ),
            config,
            loading: Mutex::new(Loading::InProgress),
            load_errors: Mutex::new(Vec::new()),
            keys,
            metrics,
            monitors: std::sync::OnceLock::new(),
            releases: std::sync::OnceLock::new(),
            feedback: std::sync::OnceLock::new(),
            telemetry: std::sync::OnceLock::new(),
            degradation: crate::degradation::Degradation::default(),
            residency: Residency::default(),
            leaving: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The host telemetry, opened on first use as `[telemetry]` says.
    pub fn telemetry(&self) -> Option<&host::Telemetry> {
        self.telemetry
            .get_or_init(|| crate::telemetry::open(&self.config.telemetry))
            .as_ref()
    }

    /// An admin's action: published on the record bus, whose sinks log it with who and why
    /// (`rampart::admin`), count it (`rampart_admin_actions_total`) and keep it in the audit log.
    /// In `fail_closed` an action the log could not keep is an error; in `best_effort` the
    /// answer waits briefly for the log to catch up.
    pub async fn act(
        &self,
        principal: &str,
        model: Option<&str>,
        action: audit::Action,
    ) -> Result<(), crate::error::ApiError> {
        let action = record::ActionRecord {
            by: record::Actor::Key {
                principal: principal.to_string(),
                operator: pipeline::origin::origin().operator,
            },
            model: model.map(str::to_string),
            action,
        };
        let receipt = self.front.bus.publish_action(action);
        if !receipt.is_pending() {
            // A best-effort audit log does not acknowledge: wait (briefly) until it wrote what
            // came before, so that a caller reading the log next finds the action.
            if self.audit.is_some() {
                self.front
                    .bus
                    .caught_up(audit::sink::SINK_NAME, std::time::Duration::from_secs(2))
                    .await;
            }
            return Ok(());
        }
        match receipt.wait().await {
            Ok(()) => Ok(()),
            Err(e) if self.config.audit.mode() == audit::Mode::FailClosed => {
                Err(crate::error::ApiError::AuditUnavailable(e.to_string()))
            }
            Err(e) => {
                tracing::error!(error = %e, "an admin action could not be kept in the audit log");
                Ok(())
            }
        }
    }

    /// A loaded model version goes into service: its engine is armed for the degradation
    /// controller (the first-token gate holds from its first request), then it is added to
    /// the registry, where requests find it.
    pub fn serve(&self, entry: crate::registry::Entry) -> Arc<crate::registry::Entry> {
        crate::degradation::arm(&self.config, &entry);
        self.front.registry.add(entry)
    }

    /// Loading is over (whatever loaded): readiness can follow.
    pub fn loaded(&self) {
        *self.loading.lock().unwrap_or_else(|e| e.into_inner()) = Loading::Done;
    }

    /// A model that could not be loaded: logged, and kept as a reason readiness gives.
    pub fn refuse(&self, error: LoadError) {
        tracing::error!(model = %error.model, error = %error.message, "model refused");
        self.load_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(error);
    }

    /// Why the server is not ready, if it is not.
    pub fn not_ready_reason(&self) -> Option<String> {
        if self.front.is_draining() || self.is_leaving() {
            return Some("draining: the server is shutting down".into());
        }
        if *self.loading.lock().unwrap_or_else(|e| e.into_inner()) != Loading::Done {
            return Some("loading models".into());
        }
        let errors = self.load_errors.lock().unwrap_or_else(|e| e.into_inner());
        if !errors.is_empty() {
            let errors: Vec<String> = errors.iter().map(ToString::to_string).collect();
            return Some(format!("models failed to load: {}", errors.join("; ")));
        }
        let cold = self
            .config
            .models
            .iter()
            .any(|m| m.residency == crate::config::Residency::Cold);
        if self.front.registry.is_empty() && !cold {
            return Some("no model is configured or found in the repository".into());
        }
        self.front.registry.problem()
    }
}
