//! What the handlers share: the loaded models, the keys, the limits, readiness and drain.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use engine::{Engine, EngineOptions, KvMemory};
use metrics_exporter_prometheus::PrometheusHandle;
use repo::{ModelRef, Repository};

use crate::admission::Admission;
use crate::auth::{KeyStore, RateLimiter};
use crate::config::{ModelConfig, ServerConfig};

/// One served model version.
pub struct ModelHandle {
    /// The model's name: its id in the API.
    pub id: String,
    pub version: String,
    pub digest: String,
    pub engine: Arc<Engine>,
    pub admission: Arc<Admission>,
    pub entropy_band: Option<[f32; 2]>,
    /// Compiles structured-output requests against this model's vocabulary.
    pub grammar: Arc<grammar::Compiler>,
    /// Unix seconds of loading.
    pub created: u64,
    /// Generated-token counter and when it last moved (stall detection).
    progress: Mutex<(u64, Instant)>,
}

impl std::fmt::Debug for ModelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelHandle")
            .field("id", &self.id)
            .field("version", &self.version)
            .finish()
    }
}

impl ModelHandle {
    /// `Some(seconds)` when sequences are running and no token came for longer than `stall`.
    pub fn stalled_for(&self, stall: Duration) -> Option<Duration> {
        let s = self.engine.snapshot();
        let mut progress = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if s.generated_tokens != progress.0 || s.running == 0 {
            *progress = (s.generated_tokens, now);
            return None;
        }
        let idle = now.duration_since(progress.1);
        (idle > stall).then_some(idle)
    }
}

/// One served embedding model version. Requests run on blocking threads, one batch at a time
/// per model (`compute`): the embedder's thread pool serves one forward pass at a time.
pub struct EmbedderHandle {
    pub id: String,
    pub version: String,
    pub digest: String,
    pub embedder: Arc<engine::Embedder>,
    pub compute: Arc<Mutex<()>>,
    pub admission: Arc<Admission>,
    pub created: u64,
}

impl EmbedderHandle {
    /// Tokenizes (texts) and embeds on a blocking thread, one batch at a time per model (the
    /// caller holds its admission slot). Returns the vectors and the number of tokens.
    pub async fn embed(
        &self,
        inputs: crate::openai::EmbeddingInputs,
        options: engine::EmbedOptions,
    ) -> Result<(Vec<Vec<f32>>, usize), crate::error::ApiError> {
        let embedder = Arc::clone(&self.embedder);
        let compute = Arc::clone(&self.compute);
        tokio::task::spawn_blocking(move || {
            let ids = match inputs {
                crate::openai::EmbeddingInputs::Texts(texts) => texts
                    .iter()
                    .map(|t| embedder.tokenize(t))
                    .collect::<Result<Vec<_>, _>>()?,
                crate::openai::EmbeddingInputs::Tokens(ids) => ids,
            };
            let tokens: usize = ids.iter().map(Vec::len).sum();
            let _running = compute.lock().unwrap_or_else(|e| e.into_inner());
            let vectors = embedder.embed_ids(&ids, options)?;
            Ok((vectors, tokens))
        })
        .await
        .map_err(|e| crate::error::ApiError::Internal(format!("embedding task failed: {e}")))?
    }
}

impl std::fmt::Debug for EmbedderHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbedderHandle")
            .field("id", &self.id)
            .field("version", &self.version)
            .finish()
    }
}

/// One served tensor model version (ONNX graph with its declared pipeline and batcher).
pub struct TensorHandle {
    pub id: String,
    pub version: String,
    pub digest: String,
    pub model: Arc<classic::TensorModel>,
    pub admission: Arc<Admission>,
    pub created: u64,
}

impl std::fmt::Debug for TensorHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorHandle")
            .field("id", &self.id)
            .field("version", &self.version)
            .finish()
    }
}

/// Readiness of the model set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Loading {
    InProgress,
    Done,
}

/// Shared by every handler.
pub struct AppState {
    pub config: ServerConfig,
    pub models: RwLock<Vec<Arc<ModelHandle>>>,
    /// The embedding models, apart from the LLMs: they have their own handle and route.
    pub embedders: RwLock<Vec<Arc<EmbedderHandle>>>,
    /// The tensor models (KServe v2 only).
    pub tensors: RwLock<Vec<Arc<TensorHandle>>>,
    pub loading: Mutex<Loading>,
    /// Models that could not be loaded, and why.
    pub load_errors: Mutex<Vec<String>>,
    pub draining: AtomicBool,
    pub keys: Option<KeyStore>,
    pub rate_limiter: RateLimiter,
    pub metrics: Option<PrometheusHandle>,
    pub started: Instant,
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
    ) -> Arc<Self> {
        Arc::new(Self {
            rate_limiter: RateLimiter::new(config.rate_limit.clone()),
            config,
            models: RwLock::new(Vec::new()),
            embedders: RwLock::new(Vec::new()),
            tensors: RwLock::new(Vec::new()),
            loading: Mutex::new(Loading::InProgress),
            load_errors: Mutex::new(Vec::new()),
            draining: AtomicBool::new(false),
            keys,
            metrics,
            started: Instant::now(),
        })
    }

    pub fn models(&self) -> Vec<Arc<ModelHandle>> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Finds `name` (the newest loaded version) or `name@version`.
    pub fn find(&self, id: &str) -> Option<Arc<ModelHandle>> {
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        match id.split_once('@') {
            Some((name, version)) => models
                .iter()
                .find(|m| m.id == name && m.version == version)
                .cloned(),
            None => models
                .iter()
                .filter(|m| m.id == id)
                .max_by(|a, b| {
                    let parse = |v: &str| semver::Version::parse(v).ok();
                    parse(&a.version)
                        .cmp(&parse(&b.version))
                        .then_with(|| a.version.cmp(&b.version))
                })
                .cloned(),
        }
    }

    pub fn embedders(&self) -> Vec<Arc<EmbedderHandle>> {
        self.embedders
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Finds the embedding model `name` (the newest loaded version) or `name@version`.
    pub fn find_embedder(&self, id: &str) -> Option<Arc<EmbedderHandle>> {
        let embedders = self.embedders.read().unwrap_or_else(|e| e.into_inner());
        let parse = |v: &str| semver::Version::parse(v).ok();
        match id.split_once('@') {
            Some((name, version)) => embedders
                .iter()
                .find(|m| m.id == name && m.version == version)
                .cloned(),
            None => embedders
                .iter()
                .filter(|m| m.id == id)
                .max_by(|a, b| {
                    parse(&a.version)
                        .cmp(&parse(&b.version))
                        .then_with(|| a.version.cmp(&b.version))
                })
                .cloned(),
        }
    }

    pub fn tensors(&self) -> Vec<Arc<TensorHandle>> {
        self.tensors
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Finds the tensor model `name`, the newest loaded version or `version`.
    pub fn find_tensor(&self, name: &str, version: Option<&str>) -> Option<Arc<TensorHandle>> {
        let tensors = self.tensors.read().unwrap_or_else(|e| e.into_inner());
        let parse = |v: &str| semver::Version::parse(v).ok();
        match version {
            Some(version) => tensors
                .iter()
                .find(|m| m.id == name && m.version == version)
                .cloned(),
            None => tensors
                .iter()
                .filter(|m| m.id == name)
                .max_by(|a, b| {
                    parse(&a.version)
                        .cmp(&parse(&b.version))
                        .then_with(|| a.version.cmp(&b.version))
                })
                .cloned(),
        }
    }

    /// The ids clients can use, for error messages.
    pub fn model_ids(&self) -> Vec<String> {
        let llms = self
            .models()
            .iter()
            .map(|m| (m.id.clone(), m.version.clone()))
            .collect::<Vec<_>>();
        let embedders = self
            .embedders()
            .iter()
            .map(|m| (m.id.clone(), m.version.clone()))
            .collect::<Vec<_>>();
        let tensors = self
            .tensors()
            .iter()
            .map(|m| (m.id.clone(), m.version.clone()))
            .collect::<Vec<_>>();
        let mut ids: Vec<String> = llms
            .into_iter()
            .chain(embedders)
            .chain(tensors)
            .flat_map(|(id, version)| [id.clone(), format!("{id}@{version}")])
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
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
            return Some(format!("models failed to load: {}", errors.join("; ")));
        }
        let models = self.models();
        if models.is_empty() && self.embedders().is_empty() && self.tensors().is_empty() {
            return Some("no model is configured or found in the repository".into());
        }
        let stall = Duration::from_secs(self.config.stall_timeout_s.max(1));
        for m in &models {
            if let Some(idle) = m.stalled_for(stall) {
                return Some(format!(
                    "{}: sequences are running but no token was produced for {} s",
                    m.id,
                    idle.as_secs()
                ));
            }
        }
        None
    }
}

/// What to load: the configured models, or the latest version of every LLM and embedding model
/// in the repository.
pub fn models_to_load(
    config: &ServerConfig,
    repository: &Repository,
) -> Result<Vec<ModelConfig>, String> {
    if !config.models.is_empty() {
        return Ok(config.models.clone());
    }
    let models = repository.models().map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for name in models {
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
            repo::manifest::Kind::Llm | repo::manifest::Kind::Onnx => true,
            repo::manifest::Kind::Embedding => {
                manifest.model.format == repo::manifest::Format::Safetensors
            }
        };
        if servable {
            out.push(ModelConfig {
                name,
                version: None,
                entropy_band: None,
                context: None,
                kv_cache_memory: None,
                kv_cache_dtype: None,
                max_num_seqs: None,
                max_num_batched_tokens: None,
                quantization: None,
                quantization_cache_dir: None,
            });
        }
    }
    Ok(out)
}

/// The repository reference a configured model names.
fn model_ref(model: &ModelConfig) -> Result<ModelRef, String> {
    let version = match &model.version {
        Some(v) => Some(
            semver::Version::parse(v).map_err(|e| format!("{}: version {v:?}: {e}", model.name))?,
        ),
        None => None,
    };
    Ok(ModelRef {
        name: model.name.clone(),
        version,
    })
}

/// The kind of a model to load (by its manifest).
pub fn model_kind(repository: &Repository, model: &ModelConfig) -> Result<repo::Kind, String> {
    let reference = model_ref(model)?;
    let version = repository
        .resolve(&reference)
        .map_err(|e| format!("{}: {e}", model.name))?;
    let manifest = repository
        .manifest(&version)
        .map_err(|e| format!("{}: {e}", model.name))?;
    Ok(manifest.model.kind)
}

/// The version a configured model names, its digests verified, and its version digest.
fn load_verified(
    repository: &Repository,
    model: &ModelConfig,
) -> Result<(repo::LoadedVersion, String), String> {
    let reference = model_ref(model)?;
    let loaded = repository
        .load(&reference, &repo::NoProgress)
        .map_err(|e| format!("{}: {e}", model.name))?;
    let digest = repository
        .digests(&loaded.version)
        .map(|d| format!("sha256:{}", d.version_digest()))
        .map_err(|e| format!("{}: {e}", model.name))?;
    Ok((loaded, digest))
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Loads one tensor model (digests verified by the repository first) and starts its batcher.
pub fn load_tensor_model(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
) -> Result<TensorHandle, String> {
    let (loaded, digest) = load_verified(repository, model)?;
    let options = classic::LoadOptions {
        backend: config.tensor.backend,
        onnxruntime_library: config.tensor.onnxruntime_library.clone(),
        threads: config.tensor.threads,
        max_input_elements: config.limits.max_tensor_elements,
    };
    let tensor_model = classic::TensorModel::load(&loaded.version.dir, &loaded.manifest, &options)
        .map_err(|e| format!("{}: {e}", model.name))?;
    Ok(TensorHandle {
        id: model.name.clone(),
        version: loaded.version.version.to_string(),
        digest,
        model: Arc::new(tensor_model),
        admission: Admission::new(config.admission.clone()),
        created: unix_now(),
    })
}

/// Loads one embedding model (digests verified by the repository first): the version folder is
/// a sentence-transformers folder.
pub fn load_embedder(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
) -> Result<EmbedderHandle, String> {
    let (loaded, digest) = load_verified(repository, model)?;
    let mut options = engine::EmbedderOptions::default();
    if let Some(threads) = config.threads {
        options.threads = threads.max(1);
    }
    let embedder = engine::Embedder::load_with(&loaded.version.dir, &options)
        .map_err(|e| format!("{}: {e}", model.name))?;
    Ok(EmbedderHandle {
        id: model.name.clone(),
        version: loaded.version.version.to_string(),
        digest,
        embedder: Arc::new(embedder),
        compute: Arc::new(Mutex::new(())),
        admission: Admission::new(config.admission.clone()),
        created: unix_now(),
    })
}

/// Loads one model (digests verified by the repository first).
pub fn load_model(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
) -> Result<ModelHandle, String> {
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
            .map_err(|e| format!("{}: kv_cache_memory: {e}", model.name))?;
    }
    if let Some(dtype) = &model.kv_cache_dtype {
        options.kv.dtype = dtype
            .parse()
            .map_err(|e| format!("{}: kv_cache_dtype: {e}", model.name))?;
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
                .map_err(|e| format!("{}: quantization: {e}", model.name))?,
        );
    }
    // The server's admission bounds what reaches the engine; the engine's own queue must hold it.
    options.scheduler.max_waiting = options
        .scheduler
        .max_waiting
        .max(config.admission.max_in_flight * config.limits.max_n * config.limits.max_prompts);
    let version = repository
        .resolve(&reference)
        .map_err(|e| format!("{}: {e}", model.name))?;
    let digest = repository
        .digests(&version)
        .map(|d| format!("sha256:{}", d.version_digest()))
        .map_err(|e| format!("{}: {e}", model.name))?;
    let engine = Engine::from_repository(repository, &reference, &options)
        .map_err(|e| format!("{}: {e}", model.name))?;
    let limits = &config.limits;
    let grammar = grammar::Compiler::new(
        engine.shared_tokenizer(),
        grammar::GrammarLimits {
            max_bytes: limits.max_grammar_bytes,
            max_compile: Duration::from_millis(limits.grammar_compile_timeout_ms),
            cache_entries: limits.grammar_cache_entries,
        },
    )
    .map_err(|e| format!("{}: {e}", model.name))?;
    Ok(ModelHandle {
        grammar: Arc::new(grammar),
        id: model.name.clone(),
        version: version.version.to_string(),
        digest,
        engine: Arc::new(engine),
        admission: Admission::new(config.admission.clone()),
        entropy_band: model.entropy_band,
        created: unix_now(),
        progress: Mutex::new((0, Instant::now())),
    })
}
