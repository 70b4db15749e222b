//! Which version of a model users get: the `stable` alias, `models/<name>/ALIASES.json`.
//!
//! A version reaches users only through an explicit choice: the first version of a model to
//! arrive (import or pull) becomes its stable, and after that only `rampart model promote`, an
//! import with `--stable` or a completed release moves it. Importing a newer version never
//! changes what is served; the server logs that a candidate is waiting instead.
//!
//! ```text
//! {
//!   "stable": {"version": "1.0.0", "digest": "sha256:…", "set_at": "2026-12-07T10:00:00Z",
//!              "set_by": "alice", "cause": "first version"},
//!   "history": [ … the earlier settings, newest last, at most 50 … ]
//! }
//! ```
//!
//! The file is written whole or not at all (a temporary file renamed over it). The alias names
//! the version digest it was set on, so a version replaced under the same number (removed and
//! imported again) is noticed rather than served by accident.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::RepoError;

/// File name of a model's aliases, in the model's folder (beside its versions).
pub const ALIASES_FILE: &str = "ALIASES.json";

/// Settings of the alias kept in the history.
const HISTORY_MAX: usize = 50;

/// One setting of an alias: the version, its digest, who set it, when and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AliasSetting {
    pub version: String,
    /// The version digest (`sha256:…`) when the alias was set.
    pub digest: String,
    /// RFC 3339.
    pub set_at: String,
    pub set_by: String,
    /// Why: `first version`, `import --stable`, `promote: <reason>`, `release <id>`.
    pub cause: String,
}

/// A model's aliases file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Aliases {
    pub stable: Option<AliasSetting>,
    /// Earlier settings of `stable`, oldest first.
    #[serde(default)]
    pub history: Vec<AliasSetting>,
}

impl Aliases {
    pub fn path(model_dir: &Path) -> PathBuf {
        model_dir.join(ALIASES_FILE)
    }

    /// Reads a model's aliases; an absent file is no alias.
    pub fn read(model_dir: &Path) -> Result<Self, RepoError> {
        let path = Self::path(model_dir);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Self::default()),
            Err(e) => return Err(RepoError::io(&path)(e)),
        };
        serde_json::from_str(&text).map_err(|e| RepoError::BadManifest {
            path,
            reason: e.to_string(),
        })
    }

    /// Sets `stable`, keeping the previous setting in the history.
    pub fn set_stable(&mut self, setting: AliasSetting) {
        if let Some(old) = self.stable.take() {
            self.history.push(old);
            let excess = self.history.len().saturating_sub(HISTORY_MAX);
            self.history.drain(..excess);
        }
        self.stable = Some(setting);
    }

    /// Writes the file whole or not at all.
    pub fn write(&self, model_dir: &Path) -> Result<(), RepoError> {
        let path = Self::path(model_dir);
        let tmp = model_dir.join(format!(".{ALIASES_FILE}.{}.tmp", std::process::id()));
        let text = serde_json::to_vec_pretty(self).map_err(|e| RepoError::BadManifest {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        std::fs::write(&tmp, text).map_err(RepoError::io(&tmp))?;
        std::fs::rename(&tmp, &path).map_err(RepoError::io(&path))
    }
}

/// Why a model is served at the version it is served at (without a configured pin).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "by")]
pub enum Choice {
    /// The `stable` alias names it.
    Stable { setting: AliasSetting },
    /// The model has one version and no alias (a model as simple as the demo's).
    OnlyVersion,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn setting(v: &str) -> AliasSetting {
        AliasSetting {
            version: v.into(),
            digest: format!("sha256:{v}"),
            set_at: "2026-12-07T00:00:00Z".into(),
            set_by: "test".into(),
            cause: "test".into(),
        }
    }

    #[test]
    fn an_absent_file_is_no_alias_and_a_written_one_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Aliases::read(dir.path()).unwrap(), Aliases::default());
        let mut a = Aliases::default();
        a.set_stable(setting("1.0.0"));
        a.set_stable(setting("1.1.0"));
        a.write(dir.path()).unwrap();
        let back = Aliases::read(dir.path()).unwrap();
        assert_eq!(back.stable.unwrap().version, "1.1.0");
        assert_eq!(back.history.len(), 1);
        assert_eq!(back.history[0].version, "1.0.0");
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from(ALIASES_FILE)]);
    }

    #[test]
    fn the_history_is_bounded() {
        let mut a = Aliases::default();
        for i in 0..(HISTORY_MAX + 20) {
            a.set_stable(setting(&format!("1.0.{i}")));
        }
        assert_eq!(a.history.len(), HISTORY_MAX);
        assert_eq!(
            a.history.last().unwrap().version,
            format!("1.0.{}", HISTORY_MAX + 18)
        );
    }

    #[test]
    fn a_damaged_file_is_an_error_not_no_alias() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(ALIASES_FILE), "{not json").unwrap();
        assert!(Aliases::read(dir.path()).is_err());
    }
}
