//! `[audit]` in the server's configuration.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::entry::RedactionPolicy;
use crate::log::LogOptions;
use crate::seal::Layout;
use crate::AuditError;

/// What happens when the log cannot keep up or cannot persist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// A response is acknowledged only once its entry is durable; when the log cannot persist,
    /// requests are refused (503 `audit_unavailable`), never served unaudited.
    FailClosed,
    /// Entries go through a bounded queue; a full queue drops (counted in
    /// `rampart_audit_dropped_total`, alerted on).
    BestEffort,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::FailClosed => "fail_closed",
            Mode::BestEffort => "best_effort",
        }
    }
}

/// `[audit]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    /// Keep the log at all (default on).
    pub enabled: bool,
    /// Regulated deployments: the mode defaults to `fail_closed`.
    pub required: bool,
    /// `fail_closed` or `best_effort` (default: `fail_closed` when `required`, else
    /// `best_effort`).
    pub mode: Option<Mode>,
    /// The local log's directory.
    pub dir: PathBuf,
    /// Names this log in its signed checkpoints (e.g. the deployment).
    pub origin: String,
    /// A segment seals when it reaches this size ...
    pub segment_max_bytes: u64,
    /// ... or this age.
    pub segment_max_age_s: u64,
    /// How often a checkpoint is signed while entries arrive (at most 1000 ms; the default 500
    /// keeps every entry covered by a signed checkpoint within a second under load).
    pub checkpoint_interval_ms: u64,
    /// Entries per group commit (one fsync).
    pub max_batch: usize,
    /// `best_effort`: entries waiting at most; `fail_closed`: the lane's capacity before
    /// publishers wait.
    pub queue: usize,
    /// `segment` (one Parquet file per model per segment) or `request` (one per entry).
    pub layout: Layout,
    /// Tensor models: keep the input bytes (base64), not only their digests.
    pub store_tensor_inputs: bool,
    /// Per field (`input`, `output`, `user`, `operator`, `principal`): `keep`, `mask`,
    /// `hash` or `drop`.
    pub redact: RedactionPolicy,
    /// Ship sealed files to S3 with Object Lock.
    pub s3: Option<ShipConfig>,
}

impl Default for AuditConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            required: false,
            mode: None,
            dir: PathBuf::from("audit"),
            origin: "rampart".into(),
            segment_max_bytes: 64 << 20,
            segment_max_age_s: 3600,
            checkpoint_interval_ms: 500,
            max_batch: 1024,
            queue: 8192,
            layout: Layout::Segment,
            store_tensor_inputs: false,
            redact: RedactionPolicy::default(),
            s3: None,
        }
    }
}

/// `[audit.s3]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShipConfig {
    /// `s3://bucket/prefix`.
    pub url: String,
    /// The S3 service root (`https://s3.eu-west-1.amazonaws.com`, `http://127.0.0.1:8333`).
    pub endpoint: String,
    pub region: String,
    /// Read from this environment variable (default `AWS_ACCESS_KEY_ID`).
    pub access_key_env: String,
    /// Read from this environment variable (default `AWS_SECRET_ACCESS_KEY`).
    pub secret_key_env: String,
    pub path_style: bool,
    /// `compliance` (default) or `governance`.
    pub lock_mode: String,
    /// Retention of every shipped object (default 2557 days, 7 years).
    pub retention_days: u64,
    /// Also set a legal hold on every object.
    pub legal_hold: bool,
    /// Remove the local sealed file once its remote copy is verified (default: keep both).
    pub delete_local_after_verify: bool,
}

impl Default for ShipConfig {
    fn default() -> Self {
        Self {
            url: String::new(),
            endpoint: String::new(),
            region: "us-east-1".into(),
            access_key_env: "AWS_ACCESS_KEY_ID".into(),
            secret_key_env: "AWS_SECRET_ACCESS_KEY".into(),
            path_style: true,
            lock_mode: "compliance".into(),
            retention_days: 2557,
            legal_hold: false,
            delete_local_after_verify: false,
        }
    }
}

impl AuditConfig {
    pub fn mode(&self) -> Mode {
        self.mode.unwrap_or(if self.required {
            Mode::FailClosed
        } else {
            Mode::BestEffort
        })
    }

    /// The settings' own consistency.
    pub fn validate(&self) -> Result<(), AuditError> {
        let bad = |m: &str| Err(AuditError::Config(m.to_string()));
        if self.required && !self.enabled {
            return bad("required = true needs enabled = true");
        }
        if self.required && self.mode() == Mode::BestEffort {
            return bad("required = true cannot run in best_effort mode (it would drop entries)");
        }
        if self.checkpoint_interval_ms == 0 || self.checkpoint_interval_ms > 1000 {
            return bad("checkpoint_interval_ms must be between 1 and 1000");
        }
        if self.max_batch == 0 || self.queue == 0 {
            return bad("max_batch and queue must be at least 1");
        }
        if self.segment_max_bytes < 4096 {
            return bad("segment_max_bytes must be at least 4096");
        }
        if let Some(s3) = &self.s3 {
            crate::s3::parse_s3_url(&s3.url).map_err(|e| AuditError::Config(e.to_string()))?;
            if s3.endpoint.is_empty() {
                return bad("[audit.s3] needs endpoint");
            }
            crate::s3::LockMode::parse(&s3.lock_mode)
                .map_err(|e| AuditError::Config(e.to_string()))?;
            if s3.retention_days == 0 {
                return bad("[audit.s3] retention_days must be at least 1");
            }
        }
        Ok(())
    }

    pub fn log_options(&self) -> LogOptions {
        LogOptions {
            dir: self.dir.clone(),
            origin: self.origin.clone(),
            segment_max_bytes: self.segment_max_bytes,
            segment_max_age: Duration::from_secs(self.segment_max_age_s.max(1)),
            layout: self.layout,
            redact: self.redact.clone(),
        }
    }
}
