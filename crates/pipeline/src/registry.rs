//! Every served model version, whatever its kind, in one list with one lookup.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::admission::Admission;
use crate::backend::{InferenceBackend, Kind, WorkKind};
use crate::breaker::{BackendBreaker, BreakerConfig};
use crate::decisions::Decisions;
use crate::error::ApiError;
pub use crate::error::LoadError;
use crate::policy::Policy;

/// One served backend: a model version (or a chain's own canned answer or tensor twin), its
/// admission, its breaker, its fallback policy, and the backend that answers.
pub struct Entry {
    /// The backend's id in breakers, faults, headers and records: `name@version`, or
    /// `name@version:tract` (a tensor model's twin on the other runtime), or `canned:name`.
    pub id: String,
    /// The model's name: its id in the APIs.
    pub name: String,
    pub version: String,
    /// `sha256:` + the version digest of the repository.
    pub digest: String,
    /// Unix seconds of loading.
    pub created: u64,
    pub admission: Arc<Admission>,
    pub backend: Arc<dyn InferenceBackend>,
    /// The engine behind a language model's backend: the handle the degradation controller
    /// moves the limits of, the tokenizer endpoints read, and the encoders tell the delivered
    /// token gaps (none for other kinds).
    pub engine: Option<Arc<engine::Engine>>,
    pub breaker: BackendBreaker,
    /// Its fallback chain and timeouts.
    pub policy: Policy,
    /// From the version's `LINEAGE.json`: the source's git commit and dataset version.
    pub lineage_commit: Option<String>,
    pub dataset_version: Option<String>,
    /// The last readiness check passed (the readiness task keeps it).
    ready: AtomicBool,
    /// What loading it took: the version's files and the KV pool (bytes; 0: not measured).
    pub memory_bytes: AtomicU64,
    /// `residency = "cold"`: evictable when idle and the models' budget needs room.
    pub cold: AtomicBool,
    /// Milliseconds since the process started, at the last request routed to it (LRU).
    last_used_ms: AtomicU64,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("name", &self.name)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl Entry {
    /// A model version served with the default policy and breaker.
    pub fn new(
        name: impl Into<String>,
        version: impl Into<String>,
        digest: impl Into<String>,
        admission: Arc<Admission>,
        backend: Arc<dyn InferenceBackend>,
    ) -> Self {
        let (name, version) = (name.into(), version.into());
        let id = format!("{name}@{version}");
        Self {
            breaker: BackendBreaker::new(id.clone(), BreakerConfig::default()),
            id,
            name,
            version,
            digest: digest.into(),
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            admission,
            backend,
            engine: None,
            policy: Policy::default(),
            lineage_commit: None,
            dataset_version: None,
            ready: AtomicBool::new(true),
            memory_bytes: AtomicU64::new(0),
            cold: AtomicBool::new(false),
            last_used_ms: AtomicU64::new(0),
        }
    }

    /// Marks a request routed to it now (`now_ms`: since the process started).
    pub fn touch(&self, now_ms: u64) {
        self.last_used_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    pub fn last_used_ms(&self) -> u64 {
        self.last_used_ms.load(Ordering::Relaxed)
    }

    /// Requests holding or waiting for its slots.
    pub fn busy(&self) -> usize {
        self.admission.in_flight() + self.admission.waiting()
    }

    /// The same entry under another backend id (a chain's own steps); its breaker keeps its
    /// settings and takes the new id.
    pub fn with_id(mut self, id: impl Into<String>) -> Self {
        self.id = id.into();
        self.breaker = self.breaker.renamed(self.id.clone());
        self
    }

    /// The entry with the engine its backend runs on.
    pub fn with_engine(mut self, engine: Arc<engine::Engine>) -> Self {
        self.engine = Some(engine);
        self
    }

    pub fn with_policy(mut self, policy: Policy) -> Self {
        self.policy = policy;
        self
    }

    pub fn with_breaker(mut self, config: BreakerConfig) -> Self {
        self.breaker = BackendBreaker::new(self.id.clone(), config);
        self
    }

    pub fn kind(&self) -> Kind {
        self.backend.kind()
    }

    /// Whether the last readiness check passed.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed)
    }

    /// Runs a readiness check: remembers it and tells the breaker.
    pub fn check_readiness(&self) -> Option<String> {
        let problem = self.backend.health().problem;
        self.ready.store(problem.is_none(), Ordering::Relaxed);
        self.breaker.readiness(problem.is_none());
        problem
    }

    /// Every backend this entry answers with: itself, then its chain's own steps.
    pub fn backends(self: &Arc<Self>) -> Vec<Arc<Entry>> {
        let mut out = vec![Arc::clone(self)];
        out.extend(self.policy.own_entries());
        out
    }
}

/// A model as a request names it: `name`, or `name` and a version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelName {
    pub name: String,
    pub version: Option<String>,
}

impl ModelName {
    /// `name` or `name@version` (the OpenAI `model` field).
    pub fn parse(id: &str) -> Self {
        match id.split_once('@') {
            Some((name, version)) => Self {
                name: name.to_string(),
                version: Some(version.to_string()),
            },
            None => Self {
                name: id.to_string(),
                version: None,
            },
        }
    }

    /// KServe: the name, and a version where `""` or none means the newest.
    pub fn versioned(name: &str, version: Option<&str>) -> Self {
        Self {
            name: name.to_string(),
            version: version.filter(|v| !v.is_empty()).map(str::to_string),
        }
    }
}

impl std::fmt::Display for ModelName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.version {
            Some(v) => write!(f, "{}@{v}", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// The served models.
#[derive(Debug, Default)]
pub struct Registry {
    entries: RwLock<Vec<Arc<Entry>>>,
    /// The version each model's name serves (its stable: the repository's alias, a configured
    /// pin, or its release plan's), whatever other versions are loaded (a candidate prepared
    /// for a release, a version an operator loaded): loading one never moves users to it.
    stable: RwLock<std::collections::HashMap<String, String>>,
    /// Where the breakers of the entries it serves publish their transitions.
    decisions: Decisions,
}

fn newer(a: &Entry, b: &Entry) -> std::cmp::Ordering {
    let parse = |v: &str| semver::Version::parse(v).ok();
    parse(&a.version)
        .cmp(&parse(&b.version))
        .then_with(|| a.version.cmp(&b.version))
}

impl Registry {
    /// An empty registry whose breakers publish their transitions on `decisions`.
    pub fn new(decisions: Decisions) -> Self {
        Self {
            entries: RwLock::default(),
            stable: RwLock::default(),
            decisions,
        }
    }

    /// `name` without a version serves `version` from now on; returns the one it served before.
    pub fn set_stable(&self, name: &str, version: &str) -> Option<String> {
        self.stable
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string(), version.to_string())
    }

    /// The version `name` without a version serves, when one was set.
    pub fn stable_version(&self, name: &str) -> Option<String> {
        self.stable
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    /// Serves `entry` from now on; the shared entry requests will find.
    pub fn add(&self, entry: Entry) -> Arc<Entry> {
        let entry = Arc::new(entry);
        for backend in entry.backends() {
            backend.breaker.report_to(&self.decisions);
        }
        self.entries
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::clone(&entry));
        entry
    }

    /// Takes `name@version` out (new requests no longer find it; those in flight keep it
    /// until they finish).
    pub fn remove(&self, name: &str, version: &str) -> Option<Arc<Entry>> {
        let mut entries = self.entries.write().unwrap_or_else(|e| e.into_inner());
        let at = entries
            .iter()
            .position(|e| e.name == name && e.version == version)?;
        Some(entries.remove(at))
    }

    pub fn all(&self) -> Vec<Arc<Entry>> {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn is_empty(&self) -> bool {
        self.entries
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    /// The one lookup: `name` at `version`, or without a version its stable version
    /// ([`Registry::set_stable`]): `None` while that one is not loaded (a cold model loads it
    /// by name). A name whose stable was never set (an entry added directly, as in tests)
    /// serves its newest loaded version.
    pub fn find(&self, model: &ModelName) -> Option<Arc<Entry>> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let mut named = entries.iter().filter(|e| e.name == model.name);
        match &model.version {
            Some(version) => named.find(|e| &e.version == version).cloned(),
            None => match self.stable_version(&model.name) {
                Some(stable) => named.find(|e| e.version == stable).cloned(),
                None => named.max_by(|a, b| newer(a, b)).cloned(),
            },
        }
    }

    /// The entry that takes `work` for `model`, or the error the client gets (the wording
    /// each API has always used).
    pub fn resolve(&self, model: &ModelName, work: WorkKind) -> Result<Arc<Entry>, ApiError> {
        let found = self.find(model);
        match (found, work) {
            (Some(entry), _) if entry.backend.accepts(work) => Ok(entry),
            (Some(entry), WorkKind::Embed) if entry.kind() == Kind::Llm => {
                Err(ApiError::invalid_param(
                    "model",
                    format!("{:?} is not an embedding model", model.to_string()),
                ))
            }
            (Some(entry), WorkKind::Tensors) if entry.kind() == Kind::Llm => {
                Err(ApiError::invalid(format!(
                    "{:?} is a language model; it is served by /v1/chat/completions and /v1/completions",
                    model.to_string()
                )))
            }
            (_, WorkKind::Tensors) => Err(self.not_served_by_kserve(model)),
            _ => Err(self.unknown(model)),
        }
    }

    /// The newest loaded version of `name` other than `except` (the order [`Registry::find`]
    /// uses).
    pub fn newest_version(&self, name: &str, except: Option<&str>) -> Option<String> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        entries
            .iter()
            .filter(|e| e.name == name && Some(e.version.as_str()) != except)
            .max_by(|a, b| newer(a, b))
            .map(|e| e.version.clone())
    }

    /// Every loaded version of `name`, sorted.
    pub fn versions(&self, name: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .all()
            .iter()
            .filter(|e| e.name == name)
            .map(|e| e.version.clone())
            .collect();
        v.sort();
        v
    }

    /// The ids clients can use (`name` and `name@version`), for error messages.
    pub fn ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .all()
            .iter()
            .flat_map(|e| [e.name.clone(), format!("{}@{}", e.name, e.version)])
            .collect();
        ids.sort();
        ids.dedup();
        ids
    }

    /// Requests holding or waiting for a slot, over every model.
    pub fn busy(&self) -> usize {
        self.all()
            .iter()
            .map(|e| e.admission.in_flight() + e.admission.waiting())
            .sum()
    }

    /// The first model whose backend cannot serve, and why. A model whose chain still has a
    /// ready step is degraded, not down: it is logged, and readiness holds (taking the replica
    /// out of rotation would take its working fallbacks out too).
    pub fn problem(&self) -> Option<String> {
        self.all().iter().find_map(|e| {
            let problem = e.backend.health().problem?;
            if self.chain_can_serve(e) {
                tracing::warn!(model = %e.id, problem, "model not ready; its fallback chain serves");
                return None;
            }
            Some(format!("{}: {problem}", e.name))
        })
    }

    /// Whether a step of `entry`'s chain is loaded and ready.
    fn chain_can_serve(&self, entry: &Entry) -> bool {
        entry.policy.steps.iter().any(|step| {
            let target = match &step.target {
                crate::policy::Target::Own(own) => Some(Arc::clone(own)),
                crate::policy::Target::Model(m) => self.find(m),
            };
            target.is_some_and(|t| t.id != entry.id && t.backend.health().problem.is_none())
        })
    }

    /// Forgets every model (shutdown): their backends stop once the last request lets go.
    pub fn clear(&self) {
        self.entries
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    fn unknown(&self, model: &ModelName) -> ApiError {
        let available = self.ids();
        ApiError::ModelNotFound(format!(
            "The model {:?} does not exist. Available: {}",
            model.to_string(),
            if available.is_empty() {
                "none (still loading?)".to_string()
            } else {
                available.join(", ")
            }
        ))
    }

    fn not_served_by_kserve(&self, model: &ModelName) -> ApiError {
        let mut known: Vec<String> = self
            .all()
            .iter()
            .filter(|e| e.backend.accepts(WorkKind::Tensors))
            .map(|e| e.name.clone())
            .collect();
        known.sort();
        known.dedup();
        ApiError::ModelNotFound(format!(
            "model {:?} is not served here (tensor and embedding models: {})",
            model.to_string(),
            if known.is_empty() {
                "none".to_string()
            } else {
                known.join(", ")
            }
        ))
    }
}
