//! API keys and per-key rate limits.
//!
//! [`RateLimiter`]: the inference APIs' request and token buckets per principal.
//! [`SubmissionLimiter`]: one bucket per key of any kind (a principal, a feedback link), for
//! routes whose writes must stay bounded per sender (`POST /v1/feedback`); its table forgets
//! full buckets, so it holds only the keys that sent within the last minute.
//!
//! Keys come from a file (one per line, `id:key` or just `key`, then optionally the key's
//! scopes separated by spaces; `#` comments) or from the `RAMPART_API_KEYS` variable (the same
//! lines separated by commas). Only their sha256 hashes are kept; a presented key is hashed and
//! looked up, so no comparison leaks a key's prefix through timing. The key's id is the
//! request's principal (`key-N` for keys given without one).
//!
//! Scopes: `infer` (the inference APIs; what a key without scopes has), `admin` (`/admin/…`),
//! `audit` (audit reads), `feedback` (the feedback API). `ops:sk-ops-0001 admin infer` is a key
//! for both.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::Instant;

use sha2::{Digest, Sha256};

pub use pipeline::rate_limit::{Bucket, RateLimit, RateLimiter};

/// A key line that cannot be accepted (the message names the entry, never the key).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct KeyFileError(pub String);

/// The key of an `Authorization: Bearer KEY` value (HTTP header or gRPC metadata).
pub fn bearer(value: &str) -> Option<&str> {
    value
        .strip_prefix("Bearer ")
        .or_else(|| value.strip_prefix("bearer "))
        .map(str::trim)
}

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Infer,
    Admin,
    Audit,
    Feedback,
}

impl Scope {
    pub const ALL: [Scope; 4] = [Scope::Infer, Scope::Admin, Scope::Audit, Scope::Feedback];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Infer => "infer",
            Scope::Admin => "admin",
            Scope::Audit => "audit",
            Scope::Feedback => "feedback",
        }
    }

    fn bit(self) -> u8 {
        1 << self as u8
    }

    fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

/// A key's scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scopes(u8);

impl Scopes {
    /// A key given without scopes.
    pub const DEFAULT: Scopes = Scopes(1);
    /// The server without keys (loopback or `insecure_no_auth`): everything.
    pub const ALL: Scopes = Scopes(0b1111);

    pub fn has(self, scope: Scope) -> bool {
        self.0 & scope.bit() != 0
    }

    pub fn names(self) -> Vec<&'static str> {
        Scope::ALL
            .into_iter()
            .filter(|s| self.has(*s))
            .map(Scope::as_str)
            .collect()
    }
}

/// Hashes of the accepted keys, their ids and scopes.
#[derive(Debug, Default)]
pub struct KeyStore {
    by_hash: HashMap<[u8; 32], (String, Scopes)>,
    /// Keys' tenants (`tenant=NAME`); a key without one is its own tenant.
    tenants: HashMap<String, String>,
}

fn hash(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl KeyStore {
    /// Parses key lines; errors name the offending line (never the key).
    pub fn parse(text: &str, separator: char) -> Result<Self, KeyFileError> {
        let mut store = KeyStore::default();
        for (n, raw) in text.split(separator).enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (id, rest) = match line.split_once(':') {
                Some((id, rest)) => (id.trim().to_string(), rest.trim()),
                None => (format!("key-{}", store.by_hash.len() + 1), line),
            };
            let mut words = rest.split_whitespace();
            let key = words.next().unwrap_or_default();
            let mut scopes = 0u8;
            let mut tenant = None;
            for word in words {
                if let Some(t) = word.strip_prefix("tenant=") {
                    if t.is_empty() {
                        return Err(KeyFileError(format!(
                            "entry {} (id {id:?}): empty tenant=",
                            n + 1
                        )));
                    }
                    tenant = Some(t.to_string());
                    continue;
                }
                let scope = Scope::parse(word).ok_or_else(|| {
                    KeyFileError(format!(
                        "entry {} (id {id:?}): unknown scope {word:?} (scopes: infer, admin, audit, feedback; or tenant=NAME)",
                        n + 1
                    ))
                })?;
                scopes |= scope.bit();
            }
            let scopes = if scopes == 0 {
                Scopes::DEFAULT
            } else {
                Scopes(scopes)
            };
            if key.len() < 8 {
                return Err(KeyFileError(format!(
                    "entry {} (id {id:?}): keys must be at least 8 characters",
                    n + 1
                )));
            }
            if id.is_empty() {
                return Err(KeyFileError(format!(
                    "entry {}: empty id before ':'",
                    n + 1
                )));
            }
            if let Some(t) = tenant {
                store.tenants.insert(id.clone(), t);
            }
            if store
                .by_hash
                .insert(hash(key), (id.clone(), scopes))
                .is_some()
            {
                return Err(KeyFileError(format!(
                    "entry {} (id {id:?}): duplicate key",
                    n + 1
                )));
            }
        }
        Ok(store)
    }

    /// Reads a key file.
    pub fn from_file(path: &Path) -> Result<Self, KeyFileError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| KeyFileError(format!("{}: {e}", path.display())))?;
        Self::parse(&text, '\n').map_err(|e| KeyFileError(format!("{}: {e}", path.display())))
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The tenant of a key id: its `tenant=`, else the id itself (a key of its own).
    pub fn tenant<'a>(&'a self, id: &'a str) -> &'a str {
        self.tenants.get(id).map_or(id, String::as_str)
    }

    /// The id of a presented key.
    pub fn principal(&self, key: &str) -> Option<&str> {
        self.by_hash.get(&hash(key)).map(|(id, _)| id.as_str())
    }

    /// The id and scopes of a presented key.
    pub fn lookup(&self, key: &str) -> Option<(&str, Scopes)> {
        self.by_hash
            .get(&hash(key))
            .map(|(id, scopes)| (id.as_str(), *scopes))
    }
}

/// Submissions per minute per key: a bucket of `per_minute` (the burst), refilled at
/// `per_minute` a minute. 0 turns it off.
#[derive(Debug)]
pub struct SubmissionLimiter {
    per_minute: u32,
    table: Mutex<SubmissionTable>,
}

#[derive(Debug, Default)]
struct SubmissionTable {
    buckets: HashMap<String, Bucket>,
    /// The table is swept of full buckets when it grows past this (twice what the last sweep
    /// kept, at least `SWEEP_FLOOR`): amortised constant time, and a size bounded by the keys
    /// that sent within the last minute.
    sweep_at: usize,
}

/// The smallest table that is swept.
const SWEEP_FLOOR: usize = 1024;

impl SubmissionLimiter {
    pub fn new(per_minute: u32) -> Self {
        Self {
            per_minute,
            table: Mutex::new(SubmissionTable {
                buckets: HashMap::new(),
                sweep_at: SWEEP_FLOOR,
            }),
        }
    }

    /// Takes one submission from `key`'s bucket; the whole seconds to wait when there is none.
    pub fn admit(&self, key: &str) -> Result<(), u64> {
        self.admit_at(key, Instant::now())
    }

    fn admit_at(&self, key: &str, now: Instant) -> Result<(), u64> {
        if self.per_minute == 0 {
            return Ok(());
        }
        let capacity = f64::from(self.per_minute);
        let rate = capacity / 60.0;
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if table.buckets.len() >= table.sweep_at {
            // A bucket refilled to the brim says no more than a missing one.
            table.buckets.retain(|_, b| {
                b.refill(rate, capacity, now);
                b.level < capacity
            });
            table.sweep_at = (table.buckets.len() * 2).max(SWEEP_FLOOR);
        }
        let bucket = table.buckets.entry(key.to_string()).or_insert(Bucket {
            level: capacity,
            updated: now,
        });
        bucket.refill(rate, capacity, now);
        if bucket.level < 1.0 {
            return Err(((1.0 - bucket.level) / rate).ceil().max(1.0) as u64);
        }
        bucket.level -= 1.0;
        Ok(())
    }

    /// Keys the table holds (tests, and the bound in docs/feedback.md).
    pub fn tracked(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .buckets
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submissions_are_limited_per_key_and_the_table_forgets_full_buckets() {
        let limiter = SubmissionLimiter::new(6);
        let t0 = Instant::now();
        for _ in 0..6 {
            assert!(limiter.admit_at("link-a", t0).is_ok(), "the burst");
        }
        assert_eq!(limiter.admit_at("link-a", t0), Err(10), "one a 10 s");
        assert!(limiter.admit_at("link-b", t0).is_ok(), "per key");
        let later = t0 + std::time::Duration::from_secs(10);
        assert!(limiter.admit_at("link-a", later).is_ok(), "refilled by one");
        assert!(limiter.admit_at("link-a", later).is_err());
        // Thousands of keys that sent once: their buckets refill within the minute and the
        // table is swept of them as it grows.
        for i in 0..5 * SWEEP_FLOOR {
            let at = t0 + std::time::Duration::from_secs(61 * (i / SWEEP_FLOOR + 1) as u64);
            limiter.admit_at(&format!("link-{i}"), at).unwrap();
        }
        assert!(
            limiter.tracked() <= 2 * SWEEP_FLOOR,
            "{} keys tracked",
            limiter.tracked()
        );
        let off = SubmissionLimiter::new(0);
        for _ in 0..1000 {
            assert!(off.admit("x").is_ok());
        }
    }

    #[test]
    fn keys_parse_with_and_without_ids() {
        let store = KeyStore::parse(
            "# team keys\nalice:sk-alice-123456\n\nsk-anonymous-99\n",
            '\n',
        )
        .unwrap();
        assert_eq!(store.len(), 2);
        assert_eq!(store.principal("sk-alice-123456"), Some("alice"));
        assert_eq!(store.principal("sk-anonymous-99"), Some("key-2"));
        assert_eq!(store.principal("sk-alice-12345"), None);
        let err = KeyStore::parse("bob:short", '\n').unwrap_err();
        assert!(
            err.0.contains("at least 8") && !err.0.contains("short"),
            "{err}"
        );
        assert!(KeyStore::parse("a:sk-same-key-1,b:sk-same-key-1", ',').is_err());
    }

    #[test]
    fn keys_carry_scopes_and_old_lines_keep_infer() {
        let store = KeyStore::parse(
            "alice: sk-alice-123456\nops:sk-ops-0000001 admin infer\nsk-auditor-0001 audit\n",
            '\n',
        )
        .unwrap();
        let (id, scopes) = store.lookup("sk-alice-123456").unwrap();
        assert_eq!(id, "alice");
        assert_eq!(scopes, Scopes::DEFAULT);
        assert!(scopes.has(Scope::Infer) && !scopes.has(Scope::Admin));
        let (_, ops) = store.lookup("sk-ops-0000001").unwrap();
        assert_eq!(ops.names(), ["infer", "admin"]);
        let (id, auditor) = store.lookup("sk-auditor-0001").unwrap();
        assert_eq!(id, "key-3");
        assert!(auditor.has(Scope::Audit) && !auditor.has(Scope::Infer));
        let err = KeyStore::parse("ops:sk-ops-0000001 root", '\n').unwrap_err();
        assert!(
            err.0.contains("unknown scope") && !err.0.contains("sk-ops"),
            "{err}"
        );
    }

    #[test]
    fn keys_of_one_tenant_share_it_and_others_are_their_own() {
        let store = KeyStore::parse(
            "app:sk-app-0000001 tenant=acme\nagents:sk-agents-0001 feedback tenant=acme\nsolo:sk-solo-0000001\n",
            '\n',
        )
        .unwrap();
        assert_eq!(store.tenant("app"), "acme");
        assert_eq!(store.tenant("agents"), store.tenant("app"));
        assert_eq!(store.tenant("solo"), "solo");
        let (_, agents) = store.lookup("sk-agents-0001").unwrap();
        assert!(agents.has(Scope::Feedback) && !agents.has(Scope::Infer));
        assert_eq!(store.lookup("sk-app-0000001").unwrap().1, Scopes::DEFAULT);
        assert!(KeyStore::parse("a:sk-a-00000001 tenant=", '\n').is_err());
    }

    #[test]
    fn request_and_token_buckets_refuse_then_refill() {
        let limiter = RateLimiter::new(RateLimit {
            requests_per_second: 2.0,
            tokens_per_minute: 600,
        });
        assert!(limiter.admit("a").is_ok());
        assert!(limiter.admit("a").is_ok());
        assert!(
            limiter.admit("a").is_err(),
            "a burst beyond the rate is refused"
        );
        assert!(limiter.admit("b").is_ok(), "buckets are per principal");
        limiter.charge("b", 700);
        let wait = limiter.admit("b").unwrap_err();
        assert!(wait >= 1, "spent token budget: wait {wait}s");
        let open = RateLimiter::new(RateLimit::default());
        for _ in 0..100 {
            assert!(open.admit("x").is_ok());
        }
    }
}
