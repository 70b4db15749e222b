//! The feedback service of a server: the feedback store (SQLite or PostgreSQL), the key that
//! signs the answers' feedback links, the correction log, and the submission limits. The routes
//! are `feedback_routes`'s, the correction stream `correction_stream`'s.

use std::collections::HashMap;
use std::io::Write;
use std::sync::{Arc, Mutex};

use feedback::link::LinkKey;
use feedback::{ClassRule, Store};

use crate::auth::SubmissionLimiter;
use crate::config::FeedbackConfig;

/// Why the feedback service could not open.
#[derive(Debug, thiserror::Error)]
pub enum FeedbackOpenError {
    #[error("feedback directory {dir}: {source}")]
    Directory { dir: String, source: std::io::Error },
    #[error("feedback store: {0}")]
    Postgres(feedback::FeedbackError),
    #[error("feedback store in {dir}: {source}")]
    Sqlite {
        dir: String,
        source: feedback::FeedbackError,
    },
    #[error("RAMPART_FEEDBACK_SECRET must be at least 16 characters")]
    ShortSecret,
    #[error("feedback link key: {0}")]
    LinkKey(std::io::Error),
    #[error("feedback correction log: {0}")]
    CorrectionLog(std::io::Error),
}

/// The feedback store, the link key and the correction log of a server.
pub struct FeedbackService {
    pub store: Arc<Store>,
    pub(crate) key: LinkKey,
    pub(crate) config: FeedbackConfig,
    pub(crate) corrections: Mutex<Option<std::fs::File>>,
    /// Told of each line appended to the correction log (the NATS stream reads it).
    pub(crate) appended: Arc<tokio::sync::Notify>,
    /// When the retrain hook last ran per model.
    pub(crate) retrained: Mutex<HashMap<String, std::time::Instant>>,
    /// Submissions per signed link (keyed by the answer's audit id).
    pub(crate) per_link: SubmissionLimiter,
    /// Submissions per key (principal).
    pub(crate) per_principal: SubmissionLimiter,
}

impl std::fmt::Debug for FeedbackService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FeedbackService")
            .field("store", &self.store)
            .finish()
    }
}

impl FeedbackService {
    /// Opens the store (PostgreSQL when a URL is configured, else `feedback.db` in
    /// `[feedback] dir`, made when missing; blocking: call it off the async runtime), its link key
    /// (`RAMPART_FEEDBACK_SECRET` when set, so that replicas share it; else `link.key` there,
    /// made once) and the correction log.
    pub fn open(config: &FeedbackConfig) -> Result<Arc<Self>, FeedbackOpenError> {
        let dir = &config.dir;
        std::fs::create_dir_all(dir).map_err(|source| FeedbackOpenError::Directory {
            dir: dir.display().to_string(),
            source,
        })?;
        let url = std::env::var("RAMPART_FEEDBACK_POSTGRES_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .or_else(|| config.postgres_url.clone());
        let store = match url {
            Some(url) => Store::connect(&url).map_err(FeedbackOpenError::Postgres)?,
            None => Store::open(&dir.join("feedback.db")).map_err(|source| {
                FeedbackOpenError::Sqlite {
                    dir: dir.display().to_string(),
                    source,
                }
            })?,
        };
        let key = match std::env::var("RAMPART_FEEDBACK_SECRET") {
            Ok(secret) if secret.len() >= 16 => LinkKey::from_secret(secret.as_bytes()),
            Ok(_) => {
                return Err(FeedbackOpenError::ShortSecret);
            }
            Err(_) => LinkKey::load_or_create(&dir.join("link.key"))
                .map_err(FeedbackOpenError::LinkKey)?,
        };
        let corrections = if config.corrections_log {
            Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(dir.join("corrections.jsonl"))
                    .map_err(FeedbackOpenError::CorrectionLog)?,
            )
        } else {
            None
        };
        Ok(Arc::new(FeedbackService {
            store: Arc::new(store),
            key,
            config: config.clone(),
            corrections: Mutex::new(corrections),
            appended: Arc::new(tokio::sync::Notify::new()),
            retrained: Mutex::new(HashMap::new()),
            per_link: SubmissionLimiter::new(config.submissions_per_minute_per_link),
            per_principal: SubmissionLimiter::new(config.submissions_per_minute_per_principal),
        }))
    }

    /// Each language model's class rule (checked when the configuration was validated).
    pub fn rules(config: &FeedbackConfig) -> HashMap<String, ClassRule> {
        config
            .classes
            .iter()
            .filter_map(|(m, r)| ClassRule::parse(r).ok().map(|r| (m.clone(), r)))
            .collect()
    }

    /// The index sink for the record bus.
    pub fn sink(&self) -> feedback::sink::IndexSink {
        feedback::sink::IndexSink::new(
            Arc::clone(&self.store),
            Arc::new(Self::rules(&self.config)),
            self.config.keep_content,
            self.config.lane_capacity,
        )
    }

    /// The signed link of a response.
    pub fn token(&self, audit_id: &str) -> String {
        let expires = feedback::now_ms() / 1000 + self.config.link_ttl_s;
        self.key.sign(audit_id, expires)
    }

    pub(crate) fn log_correction(&self, line: &serde_json::Value) {
        let mut file = self
            .corrections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(f) = file.as_mut() {
            let mut bytes = line.to_string().into_bytes();
            bytes.push(b'\n');
            if let Err(e) = f.write_all(&bytes) {
                tracing::error!(error = %e, "the correction log could not be written");
            } else {
                self.appended.notify_one();
            }
        }
    }
}
