//! `DIGESTS`: the sha256 of every file of a version, and the version digest over them.
//!
//! Format (text, one file per line, sorted by path, in `sha256sum` style):
//!
//! ```text
//! # rampart DIGESTS v1: sha256 of every file in this version; `version` is the sha256 of the file lines
//! 3f2a...  LINEAGE.json
//! b179...  SmolLM2-135M-Instruct.Q4_1.gguf
//! 91c0...  rampart.toml
//! version sha256:5e1d...
//! ```
//!
//! The version digest is the sha256 of the file lines exactly as written (each `HEX  PATH\n`), so it
//! changes when any file, name or the set of files changes. `grep -v '^[#v]' DIGESTS | sha256sum -c`
//! checks the files with standard tools.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::RepoError;
use crate::progress::Progress;

/// File name of the digest list in a version folder.
pub const DIGESTS_FILE: &str = "DIGESTS";
const HEADER: &str =
    "# rampart DIGESTS v1: sha256 of every file in this version; `version` is the sha256 of the file lines";
const CHUNK_BYTES: usize = 1 << 20;
/// Folders nested deeper than this inside a model are refused (no real model needs it).
pub const MAX_DEPTH: usize = 16;

/// sha256 of each file, keyed by its path relative to the version folder (`/`-separated).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Digests {
    pub files: BTreeMap<String, String>,
}

impl Digests {
    fn file_lines(&self) -> String {
        let mut out = String::new();
        for (path, hex) in &self.files {
            out.push_str(hex);
            out.push_str("  ");
            out.push_str(path);
            out.push('\n');
        }
        out
    }

    /// The version digest: sha256 over the file lines.
    pub fn version_digest(&self) -> String {
        hex::encode(Sha256::digest(self.file_lines().as_bytes()))
    }

    /// The file's text.
    pub fn render(&self) -> String {
        format!(
            "{HEADER}\n{}version sha256:{}\n",
            self.file_lines(),
            self.version_digest()
        )
    }

    /// Parses the text of a `DIGESTS` file and checks its recorded version digest.
    pub fn parse(text: &str) -> Result<Self, DigestsError> {
        let mut files = BTreeMap::new();
        let mut recorded = None;
        for (number, line) in text.lines().enumerate() {
            let number = number + 1;
            if line.starts_with('#') || line.is_empty() {
                continue;
            }
            if recorded.is_some() {
                return Err(DigestsError::TextAfterVersion { line: number });
            }
            if let Some(digest) = line.strip_prefix("version sha256:") {
                recorded = Some(digest.to_string());
                continue;
            }
            let (hex, path) = line
                .split_once("  ")
                .ok_or(DigestsError::NotHashAndPath { line: number })?;
            if hex.len() != 64
                || !hex
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            {
                return Err(DigestsError::NotSha256 {
                    line: number,
                    hex: hex.to_string(),
                });
            }
            check_relative_path(path).map_err(|source| DigestsError::Path {
                line: number,
                source,
            })?;
            if files.insert(path.to_string(), hex.to_string()).is_some() {
                return Err(DigestsError::ListedTwice {
                    line: number,
                    path: path.to_string(),
                });
            }
        }
        let digests = Self { files };
        match recorded {
            None => Err(DigestsError::NoVersionLine),
            Some(recorded) if recorded != digests.version_digest() => {
                Err(DigestsError::VersionMismatch {
                    recorded,
                    computed: digests.version_digest(),
                })
            }
            Some(_) => Ok(digests),
        }
    }

    /// Reads and parses `DIGESTS` in `dir`.
    pub fn read(dir: &Path) -> Result<Self, RepoError> {
        let path = dir.join(DIGESTS_FILE);
        let text = std::fs::read_to_string(&path).map_err(RepoError::io(&path))?;
        Self::parse(&text).map_err(|problem| RepoError::BadDigests { path, problem })
    }

    /// Writes `DIGESTS` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<(), RepoError> {
        let path = dir.join(DIGESTS_FILE);
        std::fs::write(&path, self.render()).map_err(RepoError::io(&path))
    }
}

/// Why the text of a `DIGESTS` file is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DigestsError {
    #[error("line {line}: text after the version line")]
    TextAfterVersion { line: usize },
    #[error("line {line}: expected `SHA256  PATH`")]
    NotHashAndPath { line: usize },
    #[error("line {line}: {hex:?} is not a lowercase sha256")]
    NotSha256 { line: usize, hex: String },
    #[error("line {line}: {source}")]
    Path {
        line: usize,
        #[source]
        source: RelativePathError,
    },
    #[error("line {line}: {path} is listed twice")]
    ListedTwice { line: usize, path: String },
    #[error("no `version sha256:` line")]
    NoVersionLine,
    #[error("recorded version digest {recorded} does not match the file lines ({computed})")]
    VersionMismatch { recorded: String, computed: String },
}

/// A path that is not a plain relative one (see [`check_relative_path`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path:?} is not a plain relative path")]
pub struct RelativePathError {
    pub path: String,
}

/// A path as it may appear in DIGESTS: relative, `/`-separated, no `.`/`..`, no control chars.
pub fn check_relative_path(path: &str) -> Result<(), RelativePathError> {
    if path.is_empty()
        || path.starts_with('/')
        || path.contains('\\')
        || path.chars().any(char::is_control)
        || path
            .split('/')
            .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return Err(RelativePathError {
            path: path.to_string(),
        });
    }
    Ok(())
}

/// sha256 and length of a file, reporting progress.
pub fn hash_file(path: &Path, progress: &dyn Progress) -> Result<(String, u64), RepoError> {
    let mut file = File::open(path).map_err(RepoError::io(path))?;
    let total = file.metadata().map_err(RepoError::io(path))?.len();
    progress.begin(&display_name(path), total);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut length = 0u64;
    loop {
        let n = file.read(&mut buf).map_err(RepoError::io(path))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        length += n as u64;
        progress.advance(n as u64);
    }
    progress.end();
    Ok((hex::encode(hasher.finalize()), length))
}

/// Copies `src` to a new file `dst`, hashing the bytes as they pass (one read of the source).
pub fn copy_and_hash(
    src: &Path,
    dst: &Path,
    progress: &dyn Progress,
) -> Result<(String, u64), RepoError> {
    let mut input = File::open(src).map_err(RepoError::io(src))?;
    let total = input.metadata().map_err(RepoError::io(src))?.len();
    let mut output = File::options()
        .write(true)
        .create_new(true)
        .open(dst)
        .map_err(RepoError::io(dst))?;
    progress.begin(&display_name(src), total);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK_BYTES];
    let mut length = 0u64;
    loop {
        let n = input.read(&mut buf).map_err(RepoError::io(src))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        output.write_all(&buf[..n]).map_err(RepoError::io(dst))?;
        length += n as u64;
        progress.advance(n as u64);
    }
    output.sync_all().map_err(RepoError::io(dst))?;
    progress.end();
    Ok((hex::encode(hasher.finalize()), length))
}

fn display_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string())
}

/// An entry found while walking a folder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalkEntry {
    /// Relative `/`-separated path.
    pub relative: String,
    pub path: PathBuf,
    /// False for symlinks, sockets and other non-regular files.
    pub regular: bool,
}

/// Every entry below `root`, sorted by relative path. `follow_links` decides whether symlinks
/// count as the files they point to (import sources) or as foreign entries (version folders).
pub fn walk(root: &Path, follow_links: bool) -> Result<Vec<WalkEntry>, RepoError> {
    fn visit(
        root: &Path,
        dir: &Path,
        depth: usize,
        follow: bool,
        out: &mut Vec<WalkEntry>,
    ) -> Result<(), RepoError> {
        if depth > MAX_DEPTH {
            return Err(RepoError::UnsupportedSource {
                path: dir.to_path_buf(),
                reason: format!("folders are nested deeper than {MAX_DEPTH} levels"),
            });
        }
        for entry in std::fs::read_dir(dir).map_err(RepoError::io(dir))? {
            let entry = entry.map_err(RepoError::io(dir))?;
            let path = entry.path();
            let relative_path = path.strip_prefix(root).unwrap_or(&path);
            let relative = relative_path
                .components()
                .map(|c| c.as_os_str().to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            let meta = if follow {
                std::fs::metadata(&path)
            } else {
                std::fs::symlink_metadata(&path)
            }
            .map_err(RepoError::io(&path))?;
            if meta.is_dir() {
                visit(root, &path, depth + 1, follow, out)?;
            } else {
                out.push(WalkEntry {
                    relative,
                    path,
                    regular: meta.is_file(),
                });
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    visit(root, root, 0, follow_links, &mut out)?;
    out.sort_by(|a, b| a.relative.cmp(&b.relative));
    Ok(out)
}

/// The outcome of re-hashing a version folder against its `DIGESTS`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct VerifyReport {
    /// The version digest recorded in DIGESTS.
    pub version_digest: String,
    pub files_checked: usize,
    pub bytes_checked: u64,
    /// Files whose content no longer matches.
    pub mismatched: Vec<String>,
    /// Files listed in DIGESTS that are gone.
    pub missing: Vec<String>,
    /// Files (or links, devices) present but not listed.
    pub unexpected: Vec<String>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.mismatched.is_empty() && self.missing.is_empty() && self.unexpected.is_empty()
    }

    /// One line naming what failed.
    pub fn summary(&self) -> String {
        let mut parts = Vec::new();
        if !self.mismatched.is_empty() {
            parts.push(format!("content changed: {}", self.mismatched.join(", ")));
        }
        if !self.missing.is_empty() {
            parts.push(format!("missing: {}", self.missing.join(", ")));
        }
        if !self.unexpected.is_empty() {
            parts.push(format!("not in DIGESTS: {}", self.unexpected.join(", ")));
        }
        if parts.is_empty() {
            "ok".into()
        } else {
            parts.join("; ")
        }
    }
}

/// Re-hashes every file of the version folder `dir` and compares with its `DIGESTS`.
pub fn verify_dir(dir: &Path, progress: &dyn Progress) -> Result<VerifyReport, RepoError> {
    let digests = Digests::read(dir)?;
    let mut report = VerifyReport {
        version_digest: digests.version_digest(),
        ..VerifyReport::default()
    };
    let present = walk(dir, false)?;
    let mut seen = std::collections::BTreeSet::new();
    for entry in &present {
        if entry.relative == DIGESTS_FILE {
            continue;
        }
        seen.insert(entry.relative.clone());
        match digests.files.get(&entry.relative) {
            None => report.unexpected.push(entry.relative.clone()),
            Some(_) if !entry.regular => report
                .unexpected
                .push(format!("{} (not a regular file)", entry.relative)),
            Some(expected) => {
                let (actual, length) = hash_file(&entry.path, progress)?;
                report.files_checked += 1;
                report.bytes_checked += length;
                if &actual != expected {
                    report.mismatched.push(entry.relative.clone());
                }
            }
        }
    }
    report.missing = digests
        .files
        .keys()
        .filter(|p| !seen.contains(*p))
        .cloned()
        .collect();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Digests {
        let mut files = BTreeMap::new();
        files.insert("model.gguf".to_string(), "a".repeat(64));
        files.insert("rampart.toml".to_string(), "b".repeat(64));
        files.insert("sub/tokenizer.json".to_string(), "c".repeat(64));
        Digests { files }
    }

    #[test]
    fn render_parse_round_trip() {
        let d = sample();
        let text = d.render();
        assert!(text.ends_with(&format!("version sha256:{}\n", d.version_digest())));
        assert_eq!(Digests::parse(&text).unwrap(), d);
    }

    #[test]
    fn version_digest_depends_on_names_and_contents() {
        let d = sample();
        let mut renamed = d.clone();
        let v = renamed.files.remove("model.gguf").unwrap();
        renamed.files.insert("model2.gguf".into(), v);
        assert_ne!(d.version_digest(), renamed.version_digest());
        let mut changed = d.clone();
        changed.files.insert("model.gguf".into(), "d".repeat(64));
        assert_ne!(d.version_digest(), changed.version_digest());
        // The digest is the sha256 of the exact lines, so standard tools can recompute it.
        let lines: String = d
            .render()
            .lines()
            .filter(|l| !l.starts_with(['#', 'v']))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            hex::encode(Sha256::digest(lines.as_bytes())),
            d.version_digest()
        );
    }

    #[test]
    fn tampered_digests_are_rejected() {
        let text = sample().render();
        let edited = text.replacen(&"a".repeat(64), &"e".repeat(64), 1);
        assert!(Digests::parse(&edited)
            .unwrap_err()
            .to_string()
            .contains("does not match"));
        assert!(Digests::parse("")
            .unwrap_err()
            .to_string()
            .contains("no `version"));
        let bad_path = sample()
            .render()
            .replace("sub/tokenizer.json", "../tokenizer.json");
        assert!(Digests::parse(&bad_path).is_err());
        assert!(Digests::parse(&format!("{}extra\n", sample().render())).is_err());
    }

    #[test]
    fn known_sha256() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x");
        std::fs::write(&path, b"abc").unwrap();
        let (hex, len) = hash_file(&path, &crate::NoProgress).unwrap();
        assert_eq!(
            hex,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(len, 3);
        let copy = dir.path().join("y");
        assert_eq!(
            copy_and_hash(&path, &copy, &crate::NoProgress).unwrap().0,
            hex
        );
        assert_eq!(std::fs::read(&copy).unwrap(), b"abc");
        assert!(
            copy_and_hash(&path, &copy, &crate::NoProgress).is_err(),
            "never overwrites"
        );
    }
}
