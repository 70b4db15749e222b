//! What the handlers share: the registry of served models, the keys, the limits, the record
//! bus, readiness and drain; and the loading of models into the registry.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::{Engine, EngineOptions, KvMemory};
use metrics_exporter_prometheus::PrometheusHandle;
use record::{Bus, RecordBuilder};
use repo::{ModelRef, Repository};

use crate::admission::Admission;
use crate::auth::KeyStore;
use crate::backend::canned::CannedBackend;
use crate::backend::embedding::EmbeddingBackend;
use crate::backend::llm::LlmBackend;
use crate::backend::rules::RulesBackend;
use crate::backend::tensor::TensorBackend;
use crate::breaker::BreakerConfig;
use crate::chain::{Policy, Step, Target};
use crate::config::{ModelConfig, ServerConfig};
use crate::registry::{Entry, ModelName};
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

    fn fail_closed(&self) -> bool {
        self.mode == audit::Mode::FailClosed
    }
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
    pub releases: std::sync::OnceLock<Arc<crate::releases::Releases>>,
    /// The feedback store and links, when `[feedback] enabled`.
    pub feedback: std::sync::OnceLock<Arc<crate::feedback_api::FeedbackService>>,
    /// The host telemetry, opened at the first scrape (`None` inside: `[telemetry]` is off).
    pub telemetry: std::sync::OnceLock<Option<host::Telemetry>>,
    /// Each language model's degradation controller (`[degradation]`).
    pub degradation: crate::degradation::Degradation,
    /// Loading on demand, unloading and evicting within `[memory] models_budget`.
    pub residency: crate::residency::Residency,
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
        let state = Arc::new(Self {
            front,
            audit,
            unauthenticated: Arc::default(),
            tokenizing: crate::admission::Admission::new(crate::config::Admission {
                max_in_flight: config.limits.tokenize_in_flight.max(1),
                max_waiting: config.limits.tokenize_waiting,
                queue_timeout_ms: config.limits.tokenize_timeout_ms,
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
            residency: crate::residency::Residency::default(),
        });
        let on_request = crate::residency::OnRequest(Arc::downgrade(&state));
        state.front.set_on_demand(Arc::new(on_request));
        state
    }

    /// The host telemetry, opened on first use as `[telemetry]` says.
    pub fn telemetry(&self) -> Option<&host::Telemetry> {
        self.telemetry
            .get_or_init(|| crate::telemetry::open(&self.config.telemetry))
            .as_ref()
    }

    /// A fresh record for a request that just arrived.
    pub fn record(
        &self,
        request_id: String,
        principal: String,
        endpoint: &'static str,
    ) -> RecordBuilder {
        self.front.record(request_id, principal, endpoint)
    }

    /// `fail_closed`: the refusal while the audit log cannot persist (nothing is served
    /// unaudited).
    pub fn audit_refusal(&self) -> Option<crate::error::ApiError> {
        self.front.audit_refusal()
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
                operator: crate::identity::origin().operator,
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

    pub fn is_draining(&self) -> bool {
        self.front.is_draining()
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
        if self.is_draining() {
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

/// What to load: the configured models, or the latest version of every LLM and embedding model
/// in the repository.
pub fn models_to_load(
    config: &ServerConfig,
    repository: &Repository,
) -> Result<Vec<ModelConfig>, LoadError> {
    if !config.models.is_empty() {
        return Ok(config.models.clone());
    }
    let models = repository
        .models()
        .map_err(|e| LoadError::new("repository", e))?;
    let mut out = Vec::new();
    // The guard's classifier is the guard's, not a served model.
    let guard_classifier = config
        .guard
        .classifier
        .as_deref()
        .map(|c| c.split('@').next().unwrap_or(c));
    for name in models {
        if Some(name.as_str()) == guard_classifier {
            continue;
        }
        let reference = ModelRef {
            name: name.clone(),
            version: None,
        };
        let Ok(version) = repository.resolve(&reference) else {
            continue;
        };
        let Ok(manifest) = repository.manifest(&version) else {
            continue;
        };
        // LLMs, the embedding models the BERT embedder runs (safetensors folders; ONNX
        // embedders without a declared tokenizer are not served and would only keep readiness
        // at 503), and ONNX tensor models.
        let servable = match manifest.model.kind {
            repo::manifest::Kind::Llm
            | repo::manifest::Kind::Onnx
            | repo::manifest::Kind::Rules => true,
            repo::manifest::Kind::Embedding => {
                manifest.model.format == repo::manifest::Format::Safetensors
            }
        };
        if servable {
            out.push(ModelConfig::named(name));
        }
    }
    Ok(out)
}

/// The repository reference a configured model names.
fn model_ref(model: &ModelConfig) -> Result<ModelRef, LoadError> {
    let version = match &model.version {
        Some(v) => Some(
            semver::Version::parse(v)
                .map_err(|e| LoadError::new(&model.name, format!("version {v:?}: {e}")))?,
        ),
        None => None,
    };
    Ok(ModelRef {
        name: model.name.clone(),
        version,
    })
}

/// The kind of a model to load (by its manifest).
pub fn model_kind(repository: &Repository, model: &ModelConfig) -> Result<repo::Kind, LoadError> {
    let reference = model_ref(model)?;
    let version = repository
        .resolve(&reference)
        .map_err(|e| LoadError::new(&model.name, e))?;
    let manifest = repository
        .manifest(&version)
        .map_err(|e| LoadError::new(&model.name, e))?;
    Ok(manifest.model.kind)
}

/// The version a configured model names, its digests verified, and its version digest.
fn load_verified(
    repository: &Repository,
    model: &ModelConfig,
) -> Result<(repo::LoadedVersion, String), LoadError> {
    let reference = model_ref(model)?;
    let loaded = repository
        .load(&reference, &repo::NoProgress)
        .map_err(|e| LoadError::new(&model.name, e))?;
    let digest = repository
        .digests(&loaded.version)
        .map(|d| format!("sha256:{}", d.version_digest()))
        .map_err(|e| LoadError::new(&model.name, e))?;
    Ok((loaded, digest))
}

/// Bytes of a model version's files (what its weights take once mapped and read); 0 when the
/// repository cannot say.
pub fn files_bytes(repository: &Repository, model: &ModelConfig) -> u64 {
    let Ok(reference) = model_ref(model) else {
        return 0;
    };
    repository
        .resolve(&reference)
        .and_then(|v| repository.manifest(&v))
        .map_or(0, |m| m.model.size_bytes)
}

/// Loads one model of whatever kind its manifest says (digests verified by the repository
/// first), ready to be served.
pub fn load(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    prepare: &crate::lane::Lane,
) -> Result<Entry, LoadError> {
    let started = Instant::now();
    let kind = model_kind(repository, model).unwrap_or(repo::Kind::Llm);
    let entry = match kind {
        repo::Kind::Onnx => load_tensor_model(config, repository, model)?,
        repo::Kind::Embedding => load_embedder(config, repository, model, prepare)?,
        repo::Kind::Llm => load_llm(config, repository, model, prepare)?,
        repo::Kind::Rules => load_rules(config, repository, model)?,
    };
    let policy = policy(config, repository, model, &entry)?;
    let entry = entry.with_policy(policy);
    let memory = files_bytes(repository, model)
        + entry
            .engine
            .as_ref()
            .map_or(0, |e| e.kv_capacity().bytes() as u64);
    entry
        .memory_bytes
        .store(memory, std::sync::atomic::Ordering::Relaxed);
    entry.cold.store(
        model.residency == crate::config::Residency::Cold,
        std::sync::atomic::Ordering::Relaxed,
    );
    let d = entry.backend.describe();
    tracing::info!(
        model = %entry.name,
        version = %entry.version,
        digest = %entry.digest,
        kind = ?entry.kind(),
        platform = %d.platform,
        context = d.max_context,
        seconds = started.elapsed().as_secs_f64(),
        "model loaded (digests verified)"
    );
    Ok(entry)
}

fn entry(
    config: &ServerConfig,
    model: &ModelConfig,
    version: &repo::ModelVersion,
    digest: String,
    backend: impl crate::backend::InferenceBackend,
) -> Entry {
    let mut entry = Entry::new(
        model.name.clone(),
        version.version.to_string(),
        digest,
        Admission::new(config.admission.clone()),
        Arc::new(backend),
    )
    .with_breaker(breaker_config(config, model));
    if let Ok(lineage) = repo::Lineage::read(&version.dir) {
        entry.lineage_commit = lineage.git_commit;
        entry.dataset_version = lineage.dataset_version;
    }
    entry
}

/// The server's breaker settings, with the model's latency objective as its slow-call limit.
fn breaker_config(config: &ServerConfig, model: &ModelConfig) -> BreakerConfig {
    BreakerConfig {
        slow_call: model.latency_objective_ms.map(Duration::from_millis),
        ..BreakerConfig::from(&config.breaker)
    }
}

/// A model's fallback chain and timeouts; its canned answers and tensor twins are loaded here.
fn policy(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    entry: &Entry,
) -> Result<Policy, LoadError> {
    let mut steps = Vec::with_capacity(model.fallback.len());
    for step in &model.fallback {
        let target = if let Some(name) = &step.model {
            Target::Model(ModelName::parse(name))
        } else if let Some(text) = &step.canned {
            let backend = CannedBackend::new(text.clone(), step.languages.clone());
            let own = Entry::new(
                model.name.clone(),
                "canned",
                format!("sha256:{}", record::sha256_hex(text)),
                Admission::new(config.admission.clone()),
                Arc::new(backend),
            )
            .with_id(format!("canned:{}", model.name))
            .with_breaker(BreakerConfig::from(&config.breaker));
            Target::Own(Arc::new(own))
        } else if let Some(choice) = step.tensor_backend {
            if entry.kind() != crate::backend::Kind::Tensor {
                return Err(LoadError::new(
                    &model.name,
                    "a tensor_backend fallback needs a tensor (ONNX) model",
                ));
            }
            // The primary's load verified these files a moment ago: read, don't re-hash.
            let version = repository
                .resolve(&model_ref(model)?)
                .map_err(|e| LoadError::new(&model.name, e))?;
            let manifest = repository
                .manifest(&version)
                .map_err(|e| LoadError::new(&model.name, e))?;
            let twin = tensor_entry(
                config,
                model,
                &version,
                &manifest,
                entry.digest.clone(),
                choice,
            )?;
            let runtime = twin.backend.describe().platform;
            let id = format!("{}:{}", entry.id, runtime.trim_start_matches("onnx_"));
            Target::Own(Arc::new(twin.with_id(id)))
        } else {
            return Err(LoadError::new(
                &model.name,
                "a fallback step names no target",
            ));
        };
        steps.push(Step {
            target,
            on: step.triggers(),
        });
    }
    Ok(Policy {
        steps,
        first_token_timeout: Duration::from_millis(model.first_token_timeout_ms),
        stall_timeout: Duration::from_millis(model.stall_timeout_ms),
    })
}

/// Loads one tensor model (digests verified) and starts its batcher.
fn load_tensor_model(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
) -> Result<Entry, LoadError> {
    let (loaded, digest) = load_verified(repository, model)?;
    tensor_entry(
        config,
        model,
        &loaded.version,
        &loaded.manifest,
        digest,
        config.tensor.backend,
    )
}

/// A tensor model of a verified version on `runtime`, its batcher started.
fn tensor_entry(
    config: &ServerConfig,
    model: &ModelConfig,
    version: &repo::ModelVersion,
    manifest: &repo::Manifest,
    digest: String,
    runtime: classic::BackendChoice,
) -> Result<Entry, LoadError> {
    let options = classic::LoadOptions {
        backend: runtime,
        onnxruntime_library: config.tensor.onnxruntime_library.clone(),
        threads: config.tensor.threads,
        max_input_elements: config.limits.max_tensor_elements,
    };
    let mut tensor_model = classic::TensorModel::load(&version.dir, manifest, &options)
        .map_err(|e| LoadError::new(&model.name, e))?;
    tensor_model.observe_images = config
        .monitor
        .enabled
        .then_some(monitor::features::image as classic::ImageFeatures);
    tracing::info!(
        model = %model.name,
        backend = tensor_model.backend(),
        max_batch_size = tensor_model.max_batch_size(),
        "tensor model ready"
    );
    let backend = TensorBackend::new(model.name.clone(), tensor_model);
    Ok(entry(config, model, version, digest, backend))
}

/// Loads one rules model: its rules file, compiled by the rules engine.
fn load_rules(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
) -> Result<Entry, LoadError> {
    let (loaded, digest) = load_verified(repository, model)?;
    let file = loaded
        .manifest
        .model
        .weights
        .first()
        .ok_or_else(|| LoadError::new(&model.name, "the manifest names no rules file"))?;
    let path = loaded.version.dir.join(file);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| LoadError::new(&model.name, format!("{}: {e}", path.display())))?;
    let engine =
        guard::RulesEngine::from_toml(&text).map_err(|e| LoadError::new(&model.name, e))?;
    tracing::info!(
        model = %model.name,
        labels = engine.labels().len(),
        "rules model ready"
    );
    let backend = RulesBackend::new(model.name.clone(), engine, config.limits.max_grammar_bytes);
    Ok(entry(config, model, &loaded.version, digest, backend))
}

/// Loads one embedding model: the version folder is a sentence-transformers folder.
fn load_embedder(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    prepare: &crate::lane::Lane,
) -> Result<Entry, LoadError> {
    let (loaded, digest) = load_verified(repository, model)?;
    let mut options = engine::EmbedderOptions::default();
    if let Some(threads) = config.threads {
        options.threads = threads.max(1);
    }
    let embedder = engine::Embedder::load_with(&loaded.version.dir, &options)
        .map_err(|e| LoadError::new(&model.name, e))?;
    let backend =
        EmbeddingBackend::new(model.name.clone(), embedder).with_prepare_lane(prepare.clone());
    tracing::info!(
        model = %model.name,
        dimensions = backend.dimensions(),
        max_seq_len = backend.max_seq_len(),
        "embedding model ready"
    );
    Ok(entry(config, model, &loaded.version, digest, backend))
}

/// Loads one language model onto an engine.
fn load_llm(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    prepare: &crate::lane::Lane,
) -> Result<Entry, LoadError> {
    let fail = |e: &dyn std::fmt::Display| LoadError::new(&model.name, e);
    let reference = model_ref(model)?;
    let mut options = EngineOptions {
        context: model.context,
        ..EngineOptions::default()
    };
    if let Some(threads) = config.threads {
        options.threads = threads.max(1);
    }
    if let Some(memory) = &model.kv_cache_memory {
        options.kv.memory = memory
            .parse::<KvMemory>()
            .map_err(|e| fail(&format!("kv_cache_memory: {e}")))?;
    }
    if let Some(dtype) = &model.kv_cache_dtype {
        options.kv.dtype = dtype
            .parse()
            .map_err(|e| fail(&format!("kv_cache_dtype: {e}")))?;
    }
    if let Some(n) = model.max_num_seqs {
        options.scheduler.max_num_seqs = n;
    }
    if let Some(n) = model.max_num_batched_tokens {
        options.scheduler.max_num_batched_tokens = n;
    }
    if let Some(spec) = &model.quantization {
        options.quantization = Some(
            engine::convert::InSitu::from_spec(spec, model.quantization_cache_dir.clone())
                .map_err(|e| fail(&format!("quantization: {e}")))?,
        );
    }
    // The server's admission bounds what reaches the engine; the engine's own queue must hold it.
    options.scheduler.max_waiting = options
        .scheduler
        .max_waiting
        .max(config.admission.max_in_flight * config.limits.max_n * config.limits.max_prompts);
    let version = repository.resolve(&reference).map_err(|e| fail(&e))?;
    let digest = repository
        .digests(&version)
        .map(|d| format!("sha256:{}", d.version_digest()))
        .map_err(|e| fail(&e))?;
    let engine = Engine::from_repository(repository, &reference, &options).map_err(|e| fail(&e))?;
    let limits = &config.limits;
    let grammar = grammar::Compiler::new(
        engine.shared_tokenizer(),
        grammar::GrammarLimits {
            max_bytes: limits.max_grammar_bytes,
            max_compile: Duration::from_millis(limits.grammar_compile_timeout_ms),
            cache_entries: limits.grammar_cache_entries,
        },
    )
    .map_err(|e| fail(&e))?;
    tracing::info!(
        model = %model.name,
        context = engine.context(),
        kv_tokens = engine.kv_capacity().tokens(),
        "language model ready"
    );
    let engine = Arc::new(engine);
    let backend = LlmBackend::new(
        Arc::clone(&engine),
        Arc::new(grammar),
        model.entropy_band,
        limits.default_max_tokens,
        Duration::from_secs(config.stall_timeout_s.max(1)),
    )
    .with_parse_special_tokens(model.parse_special_tokens)
    .with_prepare_lane(prepare.clone());
    Ok(entry(config, model, &version, digest, backend).with_engine(engine))
}
