//! Comparing two versions: files, manifest fields and the tokenizer.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::describe::version_tokenizer;
use crate::error::RepoError;
use crate::lineage::LINEAGE_FILE;
use crate::manifest::{Manifest, MANIFEST_FILE};
use crate::progress::Progress;
use crate::repository::{ModelVersion, Repository};
use crate::tokenizer::TokenizerDiff;

/// Default share of merges (or vocabulary entries) that may change before a diff blocks.
pub const DEFAULT_TOKENIZER_THRESHOLD_PCT: f64 = 5.0;

/// One manifest field that differs (`None`: absent on that side).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FieldChange {
    pub key: String,
    pub before: Option<String>,
    pub after: Option<String>,
}

/// The differences between two versions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct VersionDiff {
    pub old: String,
    pub new: String,
    pub old_digest: String,
    pub new_digest: String,
    /// Model files only in the new version, only in the old one, and in both with new content
    /// (the manifest and lineage, which always differ, are compared as fields instead).
    pub files_added: Vec<String>,
    pub files_removed: Vec<String>,
    pub files_changed: Vec<String>,
    pub manifest_changes: Vec<FieldChange>,
    /// Whether each side has a tokenizer.
    pub tokenizer_present: (bool, bool),
    pub tokenizer: Option<TokenizerDiff>,
    pub threshold_pct: f64,
    /// Why a release pipeline should stop on this change; empty when it need not.
    pub blocking: Vec<String>,
}

impl VersionDiff {
    /// Why releasing the new version over the old one needs an explicit approval: its tokenizer
    /// differs in anything that changes the ids a text becomes or how a chat is rendered (the
    /// blocking reasons when there are any, else what changed). `None` when the tokenizers are
    /// the same.
    pub fn tokenizer_change(&self) -> Option<String> {
        let changed = self.tokenizer_present.0 != self.tokenizer_present.1
            || self.tokenizer.as_ref().is_some_and(|t| !t.is_unchanged());
        if !changed {
            return None;
        }
        if !self.blocking.is_empty() {
            return Some(self.blocking.join("; "));
        }
        let Some(t) = &self.tokenizer else {
            return Some("the tokenizer changed".into());
        };
        let mut parts = Vec::new();
        let tokens = t.tokens_added + t.tokens_removed + t.tokens_renumbered;
        if tokens > 0 {
            parts.push(format!(
                "{} tokens added, {} removed, {} renumbered",
                t.tokens_added, t.tokens_removed, t.tokens_renumbered
            ));
        }
        let merges = t.merges_added + t.merges_removed + t.merges_reordered;
        if merges > 0 {
            parts.push(format!(
                "{} merges added, {} removed, {} reordered",
                t.merges_added, t.merges_removed, t.merges_reordered
            ));
        }
        if t.chat_template_changed {
            parts.push("the chat template changed".into());
        }
        if parts.is_empty() {
            parts.push("the tokenizer changed".into());
        }
        Some(parts.join("; "))
    }
}

fn flatten(prefix: &str, value: &toml::Value, out: &mut BTreeMap<String, String>) {
    match value {
        toml::Value::Table(table) => {
            for (k, v) in table {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        toml::Value::Array(items) if items.iter().any(|v| v.is_table()) => {
            for (i, v) in items.iter().enumerate() {
                flatten(&format!("{prefix}[{i}]"), v, out);
            }
        }
        other => {
            out.insert(prefix.to_string(), other.to_string());
        }
    }
}

/// Manifest fields that differ, except those that differ by construction (the version) or are
/// covered by the file comparison (the file list).
pub fn manifest_changes(old: &Manifest, new: &Manifest) -> Result<Vec<FieldChange>, RepoError> {
    let to_map = |m: &Manifest| -> Result<BTreeMap<String, String>, RepoError> {
        let value = toml::Value::try_from(m).map_err(|e| RepoError::BadManifest {
            path: MANIFEST_FILE.into(),
            reason: e.to_string(),
        })?;
        let mut out = BTreeMap::new();
        flatten("", &value, &mut out);
        out.retain(|k, _| k != "model.version" && !k.starts_with("files[") && k != "files");
        Ok(out)
    };
    let (a, b) = (to_map(old)?, to_map(new)?);
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    Ok(keys
        .into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .map(|k| FieldChange {
            key: k.clone(),
            before: a.get(k).cloned(),
            after: b.get(k).cloned(),
        })
        .collect())
}

/// How the new version's tokenizer differs from the old one's ([`VersionDiff::tokenizer_change`]),
/// with the default threshold: what a release needs an explicit approval for.
pub fn tokenizer_change(
    repo: &Repository,
    old: &ModelVersion,
    new: &ModelVersion,
) -> Result<Option<String>, RepoError> {
    let d = diff(
        repo,
        old,
        new,
        DEFAULT_TOKENIZER_THRESHOLD_PCT,
        &crate::progress::NoProgress,
    )?;
    Ok(d.tokenizer_change())
}

/// Compares two versions (usually of one model). `threshold_pct` bounds the share of tokenizer
/// merges/vocabulary that may change before the diff is blocking.
///
/// Both versions are verified first: a comparison of recorded digests says nothing about files
/// that were changed after import, so a version that fails verification is an error here too.
pub fn diff(
    repo: &Repository,
    old: &ModelVersion,
    new: &ModelVersion,
    threshold_pct: f64,
    progress: &dyn Progress,
) -> Result<VersionDiff, RepoError> {
    repo.verified(old, progress)?;
    repo.verified(new, progress)?;
    let (old_manifest, new_manifest) = (repo.manifest(old)?, repo.manifest(new)?);
    let (old_digests, new_digests) = (repo.digests(old)?, repo.digests(new)?);
    let own = |p: &&String| p.as_str() != MANIFEST_FILE && p.as_str() != LINEAGE_FILE;
    let files_added = new_digests
        .files
        .keys()
        .filter(own)
        .filter(|p| !old_digests.files.contains_key(*p))
        .cloned()
        .collect();
    let files_removed = old_digests
        .files
        .keys()
        .filter(own)
        .filter(|p| !new_digests.files.contains_key(*p))
        .cloned()
        .collect();
    let files_changed = new_digests
        .files
        .iter()
        .filter(|(p, _)| own(p))
        .filter(|(p, sha)| {
            old_digests
                .files
                .get(*p)
                .is_some_and(|old_sha| old_sha != *sha)
        })
        .map(|(p, _)| p.clone())
        .collect();

    let old_tok = version_tokenizer(
        &old.dir,
        old_manifest.model.format,
        &old_manifest.model.weights,
    )?;
    let new_tok = version_tokenizer(
        &new.dir,
        new_manifest.model.format,
        &new_manifest.model.weights,
    )?;
    let mut blocking = Vec::new();
    let tokenizer = match (&old_tok, &new_tok) {
        (Some(a), Some(b)) => {
            let d = TokenizerDiff::between(a, b);
            blocking.extend(d.blocking_reasons(threshold_pct));
            Some(d)
        }
        (None, Some(_)) => {
            blocking.push("a tokenizer was added".into());
            None
        }
        (Some(_), None) => {
            blocking.push("the tokenizer was removed".into());
            None
        }
        (None, None) => None,
    };
    Ok(VersionDiff {
        old: old.to_string(),
        new: new.to_string(),
        old_digest: old_digests.version_digest(),
        new_digest: new_digests.version_digest(),
        files_added,
        files_removed,
        files_changed,
        manifest_changes: manifest_changes(&old_manifest, &new_manifest)?,
        tokenizer_present: (old_tok.is_some(), new_tok.is_some()),
        tokenizer,
        threshold_pct,
        blocking,
    })
}
