//! Every served model version, whatever its kind, in one list with one lookup.

use std::sync::{Arc, RwLock};

use crate::admission::Admission;
use crate::backend::{InferenceBackend, Kind, WorkKind};
use crate::error::ApiError;

/// One served model version: who it is, its admission, and the backend that answers.
pub struct Entry {
    /// The model's name: its id in the APIs.
    pub name: String,
    pub version: String,
    /// `sha256:` + the version digest of the repository.
    pub digest: String,
    /// Unix seconds of loading.
    pub created: u64,
    pub admission: Arc<Admission>,
    pub backend: Arc<dyn InferenceBackend>,
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
    pub fn kind(&self) -> Kind {
        self.backend.kind()
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
}

fn newer(a: &Entry, b: &Entry) -> std::cmp::Ordering {
    let parse = |v: &str| semver::Version::parse(v).ok();
    parse(&a.version)
        .cmp(&parse(&b.version))
        .then_with(|| a.version.cmp(&b.version))
}

impl Registry {
    pub fn add(&self, entry: Entry) {
        self.entries
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .push(Arc::new(entry));
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

    /// The one lookup: `name` at `version`, or its newest loaded version.
    pub fn find(&self, model: &ModelName) -> Option<Arc<Entry>> {
        let entries = self.entries.read().unwrap_or_else(|e| e.into_inner());
        let mut named = entries.iter().filter(|e| e.name == model.name);
        match &model.version {
            Some(version) => named.find(|e| &e.version == version).cloned(),
            None => named.max_by(|a, b| newer(a, b)).cloned(),
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

    /// The first model whose backend cannot serve, and why.
    pub fn problem(&self) -> Option<String> {
        self.all().iter().find_map(|e| {
            e.backend
                .health()
                .problem
                .map(|p| format!("{}: {p}", e.name))
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
