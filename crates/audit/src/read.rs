//! Reading a log without changing it: the verifier, and the lookups the CLI runs on a local
//! directory or on a copy of what was shipped to S3.
//!
//! [`load`] reads the sealed files (through their manifests) and the segments, in index order,
//! and checks as it goes: each entry's bytes against its hash, each entry's index against its
//! position, each sealed file against its manifest's sha256, each checkpoint's signature and
//! root. The first problem found is reported with the entry it concerns.

use std::fs;
use std::path::Path;

use ed25519_dalek::VerifyingKey;
use serde::Serialize;

use crate::checkpoint::{self, Checkpoint};
use crate::entry::AuditEntry;
use crate::log::{read_checkpoints, read_frames, read_manifests, Tail};
use crate::merkle::{self, Hash};
use crate::seal;

/// One entry read back.
#[derive(Debug, Clone)]
pub struct Loaded {
    pub leaf: Hash,
    pub entry: AuditEntry,
}

/// What the verifier found wrong first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    /// The first bad entry, when one can be named.
    pub index: Option<u64>,
    pub audit_id: Option<String>,
    pub message: String,
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.index, &self.audit_id) {
            (Some(i), Some(id)) => write!(f, "entry {i} (audit id {id}): {}", self.message),
            (Some(i), None) => write!(f, "entry {i}: {}", self.message),
            _ => f.write_str(&self.message),
        }
    }
}

/// A log read back.
#[derive(Debug, Default)]
pub struct Log {
    pub entries: Vec<Loaded>,
    pub checkpoints: Vec<Checkpoint>,
    pub sealed_files: usize,
    /// A torn tail after the last checkpoint (a crash mid-write, cut when the server opens the
    /// log again): not a verification failure.
    pub torn_tail: Option<String>,
    pub problem: Option<Problem>,
}

/// The verifier's summary.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub ok: bool,
    pub entries: u64,
    pub checkpoints: usize,
    pub sealed_files: usize,
    pub root: String,
    pub newest_checkpoint: Option<Checkpoint>,
    /// Entries after the newest checkpoint: no signature covers them yet (removing them would go
    /// unnoticed; a clean shutdown signs a checkpoint over everything).
    pub uncovered: u64,
    pub torn_tail: Option<String>,
    pub problem: Option<Problem>,
}

impl Log {
    pub fn report(&self) -> Report {
        let leaves: Vec<Hash> = self.entries.iter().map(|l| l.leaf).collect();
        Report {
            ok: self.problem.is_none(),
            entries: self.entries.len() as u64,
            checkpoints: self.checkpoints.len(),
            sealed_files: self.sealed_files,
            root: hex::encode(merkle::root(&leaves)),
            newest_checkpoint: self.checkpoints.iter().max_by_key(|c| c.size).cloned(),
            uncovered: (self.entries.len() as u64)
                .saturating_sub(self.checkpoints.iter().map(|c| c.size).max().unwrap_or(0)),
            torn_tail: self.torn_tail.clone(),
            problem: self.problem.clone(),
        }
    }

    pub fn get(&self, audit_id: &str) -> Option<&Loaded> {
        self.entries.iter().find(|l| l.entry.audit_id == audit_id)
    }

    /// The entries of user `user` between two times (ms, inclusive): its id as stored, or as
    /// `hash` redaction stores it (the reader need not know the server's policy).
    pub fn by_user<'a>(
        &'a self,
        user: &'a str,
        from_ms: Option<u64>,
        to_ms: Option<u64>,
    ) -> impl Iterator<Item = &'a Loaded> + 'a {
        let hashed = crate::entry::redact_string(user, crate::entry::RedactAction::Hash);
        self.entries.iter().filter(move |l| {
            let stored = l.entry.user.as_deref();
            (stored == Some(user) || stored == hashed.as_deref())
                && from_ms.is_none_or(|f| l.entry.time_ms >= f)
                && to_ms.is_none_or(|t| l.entry.time_ms <= t)
        })
    }

    /// The inclusion proof of an entry against the newest checkpoint that covers it.
    pub fn prove(&self, audit_id: &str) -> Option<crate::log::InclusionProof> {
        let index = self
            .entries
            .iter()
            .position(|l| l.entry.audit_id == audit_id)? as u64;
        let checkpoint = self
            .checkpoints
            .iter()
            .filter(|c| c.size > index && c.size as usize <= self.entries.len())
            .max_by_key(|c| c.size)?
            .clone();
        let leaves: Vec<Hash> = self.entries[..checkpoint.size as usize]
            .iter()
            .map(|l| l.leaf)
            .collect();
        let path = merkle::inclusion_proof(&leaves, index as usize)?;
        let leaf = leaves[index as usize];
        Some(crate::log::InclusionProof::new(
            audit_id, index, &leaf, &path, checkpoint,
        ))
    }
}

fn problem(index: Option<u64>, audit_id: Option<&str>, message: impl Into<String>) -> Problem {
    Problem {
        index,
        audit_id: audit_id.map(str::to_string),
        message: message.into(),
    }
}

/// Reads and verifies the log in `dir` (a log directory, or a copy of an S3 prefix with its
/// sealed files under `sealed/`). The public key is `key` or the directory's `key.pub`.
pub fn load(dir: &Path, key: Option<VerifyingKey>) -> Log {
    let mut log = Log::default();
    let key = match key {
        Some(k) => k,
        None => {
            let path = dir.join(checkpoint::PUBLIC_KEY_FILE);
            match fs::read_to_string(&path)
                .map_err(|e| e.to_string())
                .and_then(|t| checkpoint::parse_public_key(&t).map_err(|e| e.to_string()))
            {
                Ok(k) => k,
                Err(e) => {
                    log.problem = Some(problem(
                        None,
                        None,
                        format!("no public key at {}: {e}", path.display()),
                    ));
                    return log;
                }
            }
        }
    };
    if let Err(p) = load_into(dir, &key, &mut log) {
        log.problem = Some(p);
    }
    log
}

fn load_into(dir: &Path, key: &VerifyingKey, log: &mut Log) -> Result<(), Problem> {
    let sealed = dir.join("sealed");
    let manifests = read_manifests(&sealed).map_err(|e| problem(None, None, e.to_string()))?;
    for m in &manifests {
        let next = log.entries.len() as u64;
        if m.first != next {
            return Err(problem(
                Some(next),
                None,
                format!(
                    "missing: the sealed segments jump from entry {next} to entry {}",
                    m.first
                ),
            ));
        }
        if !m.checkpoint.verify(key) || m.checkpoint.size != m.end {
            return Err(problem(
                Some(m.first),
                None,
                format!(
                    "the checkpoint of sealed segment {}..{} is not signed by this log's key",
                    m.first, m.end
                ),
            ));
        }
        let mut rows = Vec::new();
        for f in &m.files {
            let path = sealed.join(&f.path);
            let data = fs::read(&path).map_err(|e| {
                problem(
                    Some(m.first),
                    None,
                    format!("sealed file {} is missing: {e}", f.path),
                )
            })?;
            if record::sha256_bytes_hex(&data) != f.sha256 {
                // Name the first entry the replaced file changed, when it still reads.
                let first_bad = seal::read(data)
                    .ok()
                    .and_then(|rs| rs.into_iter().map(|r| r.index).min());
                return Err(problem(
                    first_bad.or(Some(m.first)),
                    None,
                    format!(
                        "sealed file {} was replaced or changed (its sha256 is not the manifest's)",
                        f.path
                    ),
                ));
            }
            rows.extend(
                seal::read(data)
                    .map_err(|e| problem(Some(m.first), None, format!("{}: {e}", f.path)))?,
            );
        }
        rows.sort_by_key(|r| r.index);
        for row in rows {
            let at = log.entries.len() as u64;
            let entry = check_entry(at, &row.entry, &row.leaf_hash, row.index)?;
            // The query columns say what the entry says (a forged user column would mislead
            // lookups while the entry itself verifies).
            let columns = (
                row.audit_id.as_str(),
                row.time_ms,
                row.user.as_str(),
                row.model.as_str(),
                row.kind.as_str(),
            );
            let said = (
                entry.audit_id.as_str(),
                entry.time_ms,
                entry.user.as_deref().unwrap_or(""),
                entry.model.as_str(),
                entry.kind.as_str(),
            );
            if columns != said {
                return Err(problem(
                    Some(at),
                    Some(&entry.audit_id),
                    "altered: its columns in the sealed file do not match the entry",
                ));
            }
            log.entries.push(Loaded {
                leaf: row.leaf_hash,
                entry,
            });
        }
        if log.entries.len() as u64 != m.end {
            return Err(problem(
                Some(log.entries.len() as u64),
                None,
                format!(
                    "missing: sealed segment {}..{} lacks entries",
                    m.first, m.end
                ),
            ));
        }
        log.checkpoints.push(m.checkpoint.clone());
        log.sealed_files += m.files.len();
    }
    let seg_dir = dir.join("segments");
    let mut firsts: Vec<u64> = fs::read_dir(&seg_dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            e.file_name()
                .into_string()
                .ok()?
                .strip_suffix(".seg")?
                .parse()
                .ok()
        })
        .collect();
    firsts.sort_unstable();
    let checkpoints = read_checkpoints(&dir.join("checkpoints.jsonl"))
        .map_err(|e| problem(None, None, e.to_string()))?;
    let covered = checkpoints.iter().map(|c| c.size).max().unwrap_or(0);
    for first in firsts {
        if first < log.entries.len() as u64 {
            continue; // sealed already; the segment file outlived a crash
        }
        let path = seg_dir.join(format!("{first:020}.seg"));
        let (frames, tail, _) =
            read_frames(&path).map_err(|e| problem(None, None, e.to_string()))?;
        let next = log.entries.len() as u64;
        if first != next {
            return Err(problem(
                Some(next),
                None,
                format!(
                    "missing: segment {} starts at entry {first}",
                    path.display()
                ),
            ));
        }
        for f in frames {
            let at = log.entries.len() as u64;
            let entry = check_entry(at, &f.bytes, &f.hash, at)?;
            log.entries.push(Loaded {
                leaf: f.hash,
                entry,
            });
        }
        if let Tail::Bad {
            offset,
            why,
            followed,
        } = tail
        {
            let at = log.entries.len() as u64;
            if at < covered || followed {
                return Err(problem(
                    Some(at),
                    None,
                    format!("altered: {why} (at offset {offset} of {})", path.display()),
                ));
            }
            log.torn_tail = Some(format!("{} at offset {offset}: {why}", path.display()));
        }
    }
    for (k, c) in checkpoints.iter().enumerate() {
        if !c.verify(key) {
            return Err(problem(
                None,
                None,
                format!(
                    "checkpoint {k} (size {}) is not signed by this log's key",
                    c.size
                ),
            ));
        }
        if c.size as usize > log.entries.len() {
            let have = log.entries.len() as u64;
            return Err(problem(
                Some(have),
                None,
                format!("missing: the log was truncated; checkpoint {k} signed {} entries, the log holds {have}", c.size),
            ));
        }
        log.checkpoints.push(c.clone());
    }
    check_roots(log)
}

/// One entry: its bytes match its hash, it decodes, and it sits where its index says.
fn check_entry(
    at: u64,
    bytes: &[u8],
    hash: &Hash,
    stored_index: u64,
) -> Result<AuditEntry, Problem> {
    let entry = AuditEntry::decode(bytes).ok();
    let id = entry.as_ref().map(|e| e.audit_id.clone());
    if merkle::leaf_hash(bytes) != *hash {
        return Err(problem(
            Some(at),
            id.as_deref(),
            "altered: its bytes do not match its hash",
        ));
    }
    let Some(entry) = entry else {
        return Err(problem(Some(at), None, "altered: it is not a valid entry"));
    };
    if entry.index != at || stored_index != at {
        return Err(problem(
            Some(at),
            None,
            format!(
                "missing or out of order: entry {} sits at position {at}",
                entry.index
            ),
        ));
    }
    Ok(entry)
}

/// Every checkpoint's root is rebuilt by the entries up to its size (one pass over the leaves,
/// smallest checkpoint first); on a mismatch the change lies after the last checkpoint that
/// matched.
fn check_roots(log: &Log) -> Result<(), Problem> {
    let leaves: Vec<Hash> = log.entries.iter().map(|l| l.leaf).collect();
    let mut order: Vec<&Checkpoint> = log.checkpoints.iter().collect();
    order.sort_by_key(|c| c.size);
    let sizes: Vec<u64> = order.iter().map(|c| c.size).collect();
    let mut since = 0;
    for (c, root) in order.iter().zip(merkle::roots_at(&leaves, &sizes)) {
        if hex::encode(root) != c.root {
            let first = log
                .entries
                .get(since as usize)
                .map(|l| l.entry.audit_id.as_str());
            return Err(problem(
                Some(since),
                first,
                format!(
                    "altered: the entries {since}..{} do not rebuild the root signed at {} ms (rewritten with fresh \
                     hashes, or replaced); the change is at or after this entry",
                    c.size, c.time_ms
                ),
            ));
        }
        since = c.size;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::Action;
    use crate::log::{AuditLog, LogOptions};

    fn action(i: usize) -> AuditEntry {
        AuditEntry::action(
            Some("ops".into()),
            None,
            Some("m".into()),
            Action {
                name: format!("test.{i}"),
                target: None,
                cause: None,
                outcome: "ok".into(),
                detail: serde_json::Value::Null,
            },
        )
    }

    fn filled(n: usize, seal_at: Option<usize>) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(LogOptions::new(dir.path())).unwrap();
        for i in 0..n {
            log.append(vec![action(i)]).unwrap();
            if Some(i + 1) == seal_at {
                log.checkpoint().unwrap();
                log.rotate().unwrap();
                log.seal_next().unwrap().unwrap();
            }
        }
        log.checkpoint().unwrap();
        dir
    }

    fn segment(dir: &Path) -> std::path::PathBuf {
        let mut segs: Vec<_> = fs::read_dir(dir.join("segments"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        segs.sort();
        segs.pop().unwrap()
    }

    #[test]
    fn an_untouched_log_verifies() {
        let dir = filled(30, Some(12));
        let r = load(dir.path(), None).report();
        assert!(r.ok, "{:?}", r.problem);
        assert_eq!(r.entries, 30);
        assert_eq!(r.sealed_files, 1);
    }

    #[test]
    fn a_flipped_byte_names_its_entry() {
        let dir = filled(10, None);
        let seg = segment(dir.path());
        let mut data = fs::read(&seg).unwrap();
        let (frames, _, _) = read_frames(&seg).unwrap();
        let at = frames[4].offset as usize + 36 + 10;
        data[at] ^= 0x20;
        fs::write(&seg, data).unwrap();
        let p = load(dir.path(), None).problem.unwrap();
        assert_eq!(p.index, Some(4), "{p}");
        assert!(p.message.contains("altered"), "{p}");
    }

    #[test]
    fn a_deleted_or_reordered_entry_is_named() {
        let dir = filled(10, None);
        let seg = segment(dir.path());
        let data = fs::read(&seg).unwrap();
        let (frames, _, _) = read_frames(&seg).unwrap();
        let span = |i: usize| {
            let start = frames[i].offset as usize;
            let end = frames.get(i + 1).map_or(data.len(), |f| f.offset as usize);
            data[start..end].to_vec()
        };
        // Delete entry 3.
        let mut deleted = data[..frames[3].offset as usize].to_vec();
        deleted.extend_from_slice(&data[frames[4].offset as usize..]);
        fs::write(&seg, &deleted).unwrap();
        let p = load(dir.path(), None).problem.unwrap();
        assert_eq!(p.index, Some(3), "{p}");
        // Swap entries 5 and 6.
        let mut swapped = data[..frames[5].offset as usize].to_vec();
        swapped.extend(span(6));
        swapped.extend(span(5));
        swapped.extend_from_slice(&data[frames[7].offset as usize..]);
        fs::write(&seg, &swapped).unwrap();
        let p = load(dir.path(), None).problem.unwrap();
        assert_eq!(p.index, Some(5), "{p}");
        // Truncate to 6 entries.
        fs::write(&seg, &data[..frames[6].offset as usize]).unwrap();
        let p = load(dir.path(), None).problem.unwrap();
        assert_eq!(p.index, Some(6), "{p}");
        assert!(p.message.contains("truncated"), "{p}");
        // Restored, it verifies again.
        fs::write(&seg, &data).unwrap();
        assert!(load(dir.path(), None).problem.is_none());
    }

    #[test]
    fn a_replaced_sealed_file_or_checkpoint_fails() {
        let dir = filled(20, Some(8));
        let manifests = read_manifests(&dir.path().join("sealed")).unwrap();
        let file = dir.path().join("sealed").join(&manifests[0].files[0].path);
        let original = fs::read(&file).unwrap();
        let mut rows = seal::read(original.clone()).unwrap();
        let mut e = AuditEntry::decode(&rows[2].entry).unwrap();
        e.action.as_mut().unwrap().name = "forged".into();
        rows[2].entry = e.encode();
        rows[2].leaf_hash = merkle::leaf_hash(&rows[2].entry);
        fs::write(&file, seal::write(&rows).unwrap()).unwrap();
        let p = load(dir.path(), None).problem.unwrap();
        assert!(p.message.contains("replaced"), "{p}");
        fs::write(&file, &original).unwrap();
        assert!(load(dir.path(), None).problem.is_none());
        // A checkpoint with another root (re-signed by a stranger's key) fails.
        let path = dir.path().join("checkpoints.jsonl");
        let text = fs::read_to_string(&path).unwrap();
        let mut c: Checkpoint = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        c.root = hex::encode([0u8; 32]);
        fs::write(&path, format!("{}\n", serde_json::to_string(&c).unwrap())).unwrap();
        let p = load(dir.path(), None).problem.unwrap();
        assert!(p.message.contains("not signed"), "{p}");
    }

    #[test]
    fn damage_after_the_last_checkpoint_is_not_taken_for_a_torn_tail_when_entries_follow() {
        let dir = filled(6, None);
        let log = AuditLog::open(LogOptions::new(dir.path())).unwrap();
        for i in 0..3 {
            log.append(vec![action(100 + i)]).unwrap();
        }
        drop(log);
        // Entry 7 (no checkpoint covers it) is damaged; entry 8 after it is whole.
        let seg = segment(dir.path());
        let (frames, _, _) = read_frames(&seg).unwrap();
        let mut data = fs::read(&seg).unwrap();
        data[frames[7].offset as usize + 36 + 3] ^= 0x40;
        fs::write(&seg, &data).unwrap();
        let p = load(dir.path(), None).problem.unwrap();
        assert_eq!(p.index, Some(7), "{p}");
        let refused = AuditLog::open(LogOptions::new(dir.path()));
        assert!(
            matches!(refused, Err(crate::AuditError::Tampered(_))),
            "{refused:?}"
        );
    }

    #[test]
    fn an_entry_over_the_size_limit_is_kept_without_its_payload() {
        let dir = tempfile::tempdir().unwrap();
        let log = AuditLog::open(LogOptions::new(dir.path())).unwrap();
        let mut big = action(1);
        big.input = Some(serde_json::Value::String(
            "x".repeat(crate::log::MAX_ENTRY_BYTES + 10),
        ));
        let small = action(2);
        let indices = log.append(vec![big.clone(), small]).unwrap();
        assert_eq!(indices, [0, 1], "the batch is kept");
        let kept = log.get(&big.audit_id).unwrap().unwrap();
        assert!(kept.input.is_none());
        assert!(kept
            .redactions
            .iter()
            .any(|r| r.field.starts_with("too_large:")));
        log.checkpoint().unwrap();
        let report = load(dir.path(), None).report();
        assert!(report.ok && report.uncovered == 0, "{report:?}");
    }

    #[test]
    fn a_torn_tail_is_cut_on_open_and_noted() {
        let dir = filled(5, None);
        let seg = segment(dir.path());
        let mut data = fs::read(&seg).unwrap();
        // Half a frame of a sixth entry, as a crash leaves it.
        let frame = {
            let bytes = action(99).encode();
            let mut f = (bytes.len() as u32).to_le_bytes().to_vec();
            f.extend_from_slice(&merkle::leaf_hash(&bytes));
            f.extend_from_slice(&bytes[..bytes.len() / 2]);
            f
        };
        data.extend_from_slice(&frame);
        fs::write(&seg, &data).unwrap();
        let before = load(dir.path(), None);
        assert!(before.problem.is_none(), "{:?}", before.problem);
        assert!(before.torn_tail.is_some());
        let log = AuditLog::open(LogOptions::new(dir.path())).unwrap();
        log.checkpoint().unwrap();
        drop(log);
        let after = load(dir.path(), None);
        assert!(after.problem.is_none(), "{:?}", after.problem);
        assert_eq!(after.entries.len(), 6, "five entries and the recovery note");
        let note = &after.entries[5].entry;
        assert_eq!(note.action.as_ref().unwrap().name, "audit.recovered");
    }

    #[test]
    fn proofs_verify() {
        let dir = filled(25, Some(10));
        let log = AuditLog::open(LogOptions::new(dir.path())).unwrap();
        let read = load(dir.path(), None);
        let id = read.entries[17].entry.audit_id.clone();
        let p = log.prove(&id).unwrap().unwrap();
        let path: Vec<Hash> = p
            .path
            .iter()
            .map(|h| checkpoint::parse_hash(h).unwrap())
            .collect();
        let leaf = checkpoint::parse_hash(&p.leaf_hash).unwrap();
        assert!(merkle::verify_inclusion(
            p.index,
            p.checkpoint.size,
            &leaf,
            &path,
            &p.checkpoint.root_hash().unwrap()
        ));
        let early = log.checkpoints()[0].size;
        let c = log.consistency(early, None).unwrap();
        let path: Vec<Hash> = c
            .path
            .iter()
            .map(|h| checkpoint::parse_hash(h).unwrap())
            .collect();
        assert!(merkle::verify_consistency(
            c.first.size,
            c.second.size,
            &c.first.root_hash().unwrap(),
            &c.second.root_hash().unwrap(),
            &path
        ));
        // The user index finds exactly the right entries.
        let page = log.by_user("nobody", None, None, None, 10).unwrap();
        assert!(page.entries.is_empty());
        assert_eq!(log.get(&id).unwrap().unwrap().index, 17);
    }
}
