//! Shipping sealed segments to S3 with Object Lock.
//!
//! For each sealed segment, oldest first: its Parquet files, then its manifest (which holds the
//! signed checkpoint), each PUT with the lock mode, `retain-until` = now + retention, the legal
//! hold when asked, and a sha256 checksum; then each object is read back with HEAD (size,
//! checksum, lock) before the segment counts as shipped (`shipped.jsonl`). The public key goes
//! first, once (`_key.pub`). A failed segment is retried on the next round with backoff; the
//! local copy stays until its remote copy is verified (and is removed then only with
//! `delete_local_after_verify`).
//!
//! The remote layout mirrors `sealed/` under the prefix:
//! `<prefix>/<model>/YYYY/MM/DD/<first>-<last>.parquet`, `<prefix>/_manifests/<first>.json`,
//! `<prefix>/_key.pub`.

use std::collections::HashSet;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::checkpoint::PUBLIC_KEY_FILE;
use crate::config::ShipConfig;
use crate::log::read_manifests;
use crate::s3::{LockMode, ObjectLock, S3Client, S3Config};
use crate::seal::Manifest;
use crate::AuditError;

/// The remote name of the public key.
pub const REMOTE_KEY: &str = "_key.pub";

/// One shipped object.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct ShippedLine {
    first: u64,
    key: String,
    sha256: String,
    version_id: Option<String>,
    /// The local file it came from (relative to `sealed/`).
    #[serde(default)]
    file: Option<String>,
}

/// The sealed files (relative to `sealed/`) that `dir`'s shipper shipped and verified.
pub fn shipped_files(dir: &Path) -> HashSet<String> {
    shipped_lines(dir)
        .into_iter()
        .filter_map(|l| l.file)
        .collect()
}

/// `dir/shipped.jsonl`, what the shipper shipped and verified (none when it never shipped).
fn shipped_lines(dir: &Path) -> Vec<ShippedLine> {
    let text = fs::read_to_string(dir.join(SHIPPED_FILE)).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

const SHIPPED_FILE: &str = "shipped.jsonl";

/// What a round of shipping did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Round {
    pub segments: usize,
    pub objects: usize,
    /// Why the round stopped early.
    pub failure: Option<String>,
}

/// Ships one log directory's sealed segments to one bucket and prefix.
pub struct Shipper {
    client: S3Client,
    prefix: String,
    dir: PathBuf,
    mode: LockMode,
    retention: Duration,
    legal_hold: bool,
    delete_local: bool,
    /// When the oldest segment still waiting was sealed (ms), as of the last round.
    oldest_pending_ms: std::sync::Mutex<Option<u64>>,
}

impl std::fmt::Debug for Shipper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shipper")
            .field("to", &self.client.describe())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The client and prefix of a `[audit.s3]` section (credentials from its environment
/// variables).
pub fn client_for(config: &ShipConfig) -> Result<(S3Client, String), AuditError> {
    let (bucket, prefix) = crate::s3::parse_s3_url(&config.url)?;
    let env = |name: &str| {
        std::env::var(name).map_err(|_| {
            AuditError::Config(format!(
                "[audit.s3] reads its credentials from ${name}, which is not set"
            ))
        })
    };
    let client = S3Client::new(S3Config {
        endpoint: config.endpoint.clone(),
        bucket,
        region: config.region.clone(),
        access_key: env(&config.access_key_env)?,
        secret_key: env(&config.secret_key_env)?,
        path_style: config.path_style,
    })?;
    Ok((client, prefix.trim_end_matches('/').to_string()))
}

/// `prefix/name` (or `name` without a prefix).
pub fn remote_key(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}/{name}")
    }
}

impl Shipper {
    pub fn new(dir: &Path, config: &ShipConfig) -> Result<Self, AuditError> {
        let (client, prefix) = client_for(config)?;
        Ok(Self::with_client(dir, client, prefix, config))
    }

    pub fn with_client(dir: &Path, client: S3Client, prefix: String, config: &ShipConfig) -> Self {
        Self {
            client,
            prefix,
            dir: dir.to_path_buf(),
            mode: LockMode::parse(&config.lock_mode).unwrap_or(LockMode::Compliance),
            retention: Duration::from_secs(config.retention_days.saturating_mul(86_400)),
            legal_hold: config.legal_hold,
            delete_local: config.delete_local_after_verify,
            oldest_pending_ms: std::sync::Mutex::new(None),
        }
    }

    pub fn describe(&self) -> String {
        format!("{} prefix {:?}", self.client.describe(), self.prefix)
    }

    fn shipped_path(&self) -> PathBuf {
        self.dir.join(SHIPPED_FILE)
    }

    fn shipped(&self) -> HashSet<u64> {
        // A segment counts once its manifest (shipped last) is there.
        shipped_lines(&self.dir)
            .iter()
            .filter(|l| l.key.ends_with(&Manifest::path(l.first)))
            .map(|l| l.first)
            .collect()
    }

    /// Sealed segments not yet shipped, oldest first.
    pub fn pending(&self) -> Result<Vec<Manifest>, AuditError> {
        let done = self.shipped();
        Ok(read_manifests(&self.dir.join("sealed"))?
            .into_iter()
            .filter(|m| !done.contains(&m.first))
            .collect())
    }

    /// Ships every pending segment; stops at the first failure (retried next round).
    pub async fn round(&self) -> Round {
        let round = self.ship_pending().await;
        let oldest = self
            .pending()
            .ok()
            .and_then(|p| p.first().map(|m| m.checkpoint.time_ms));
        *self
            .oldest_pending_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = oldest;
        round
    }

    async fn ship_pending(&self) -> Round {
        let mut round = Round::default();
        let pending = match self.pending() {
            Ok(p) => p,
            Err(e) => {
                round.failure = Some(e.to_string());
                return round;
            }
        };
        if pending.is_empty() {
            return round;
        }
        if let Err(e) = self.ship_key().await {
            round.failure = Some(e.to_string());
            return round;
        }
        for m in pending {
            match self.ship_segment(&m).await {
                Ok(n) => {
                    round.segments += 1;
                    round.objects += n;
                }
                Err(e) => {
                    round.failure = Some(format!("segment {}..{}: {e}", m.first, m.end));
                    break;
                }
            }
        }
        round
    }

    async fn ship_key(&self) -> Result<(), AuditError> {
        let key = remote_key(&self.prefix, REMOTE_KEY);
        if self.client.head_object(&key).await?.is_some() {
            return Ok(());
        }
        let path = self.dir.join(PUBLIC_KEY_FILE);
        let data = fs::read(&path).map_err(|e| AuditError::io(&path, e))?;
        self.put_verified(&key, data).await.map(|_| ())
    }

    fn lock(&self) -> ObjectLock {
        ObjectLock {
            mode: self.mode,
            retain_until: SystemTime::now() + self.retention,
            legal_hold: self.legal_hold,
        }
    }

    /// PUT with lock and checksum, then HEAD: the stored object has our size, checksum and a
    /// lock; returns its version.
    async fn put_verified(&self, key: &str, data: Vec<u8>) -> Result<Option<String>, AuditError> {
        let len = data.len() as u64;
        let checksum = base64::engine::general_purpose::STANDARD.encode(Sha256::digest(&data));
        let lock = self.lock();
        let put = self.client.put_object(key, data, Some(&lock)).await?;
        let meta =
            self.client.head_object(key).await?.ok_or_else(|| {
                AuditError::Unavailable(format!("{key} is not there after its PUT"))
            })?;
        let problem = if meta.len != len {
            Some(format!("it holds {} bytes, we sent {len}", meta.len))
        } else if meta
            .checksum_sha256
            .as_deref()
            .is_some_and(|c| c != checksum)
        {
            Some("its sha256 is not the one we sent".to_string())
        } else if meta.lock_mode.is_none() {
            Some(
                "it carries no Object Lock retention (is Object Lock enabled on the bucket?)"
                    .to_string(),
            )
        } else {
            None
        };
        if let Some(p) = problem {
            return Err(AuditError::Unavailable(format!(
                "remote copy of {key} does not verify: {p}"
            )));
        }
        Ok(put.version_id.or(meta.version_id))
    }

    async fn ship_segment(&self, m: &Manifest) -> Result<usize, AuditError> {
        let sealed = self.dir.join("sealed");
        let mut lines = Vec::new();
        for f in &m.files {
            let path = sealed.join(&f.path);
            let data = fs::read(&path).map_err(|e| AuditError::io(&path, e))?;
            let key = remote_key(&self.prefix, &f.path);
            let version_id = self.put_verified(&key, data).await?;
            lines.push(ShippedLine {
                first: m.first,
                key,
                sha256: f.sha256.clone(),
                version_id,
                file: Some(f.path.clone()),
            });
        }
        let name = Manifest::path(m.first);
        let path = sealed.join(&name);
        let data = fs::read(&path).map_err(|e| AuditError::io(&path, e))?;
        let sha = record::sha256_bytes_hex(&data);
        let key = remote_key(&self.prefix, &name);
        let version_id = self.put_verified(&key, data).await?;
        lines.push(ShippedLine {
            first: m.first,
            key,
            sha256: sha,
            version_id,
            file: Some(name.clone()),
        });
        let mut out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.shipped_path())
            .map_err(|e| AuditError::io(&self.shipped_path(), e))?;
        let mut text = String::new();
        for l in &lines {
            text.push_str(&serde_json::to_string(l).unwrap_or_default());
            text.push('\n');
        }
        out.write_all(text.as_bytes())
            .and_then(|()| out.sync_data())
            .map_err(|e| AuditError::io(&self.shipped_path(), e))?;
        if self.delete_local {
            for f in &m.files {
                let _ = fs::remove_file(sealed.join(&f.path));
            }
        }
        tracing::info!(first = m.first, end = m.end, objects = lines.len(), to = %self.describe(), "audit segment shipped and verified");
        Ok(lines.len())
    }

    /// Seconds since the oldest segment still waiting (as of the last round) was sealed; 0
    /// when none waits.
    pub fn lag_s(&self) -> f64 {
        let oldest = *self
            .oldest_pending_ms
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        oldest.map_or(0.0, |t| {
            crate::entry::now_ms().saturating_sub(t) as f64 / 1e3
        })
    }
}

/// Copies what was shipped under `prefix` into `into` (as `sealed/…` and `key.pub`), so that
/// [`crate::read::load`] verifies it from S3 alone; also checks that every object carries an
/// Object Lock retention. Returns the objects copied.
pub async fn download(client: &S3Client, prefix: &str, into: &Path) -> Result<usize, AuditError> {
    let list_prefix = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}/")
    };
    let keys = client.list(&list_prefix).await?;
    let mut n = 0;
    for key in keys {
        let rel = key.strip_prefix(&list_prefix).unwrap_or(&key);
        // Only plain relative paths: a key with `..`, an empty or absolute part would land
        // outside the copy.
        if rel
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == "..")
        {
            return Err(AuditError::Tampered(format!(
                "{key} is not a path the log writes"
            )));
        }
        let data = client.get_object(&key).await?;
        let meta = client.head_object(&key).await?;
        if meta.as_ref().is_none_or(|m| m.lock_mode.is_none()) {
            return Err(AuditError::Tampered(format!(
                "{key} carries no Object Lock retention"
            )));
        }
        let path = if rel == REMOTE_KEY {
            into.join(PUBLIC_KEY_FILE)
        } else {
            into.join("sealed").join(rel)
        };
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| AuditError::io(parent, e))?;
        }
        fs::write(&path, data).map_err(|e| AuditError::io(&path, e))?;
        n += 1;
    }
    Ok(n)
}
