//! The local log: append-only segment files with group commit, the Merkle tree, signed
//! checkpoints, sealing to Parquet, recovery after a crash, and the exact-key lookups.
//!
//! Directory layout (`dir`, default `./audit`):
//!
//! ```text
//! key.ed25519, key.pub          the signing key (0600) and its public half
//! segments/<first>.seg          frames: [u32 LE length][32-byte leaf hash][entry bytes]
//! checkpoints.jsonl             one signed checkpoint per line, appended and fsynced
//! sealed/<model>/YYYY/MM/DD/…   Parquet files of sealed segments (mirrored to S3)
//! sealed/_manifests/<first>.json  each sealed segment's files, digests and checkpoint
//! ```
//!
//! Durability: [`AuditLog::append`] writes a batch with one `write` and one `fdatasync`, and
//! returns only after both: that is the group commit the fail-closed sink acknowledges on.
//! After a crash, [`AuditLog::open`] replays every frame; a torn frame after the last signed
//! checkpoint is a write the crash interrupted (never acknowledged): it is cut, noted in the log
//! and as an entry. A bad frame the last checkpoint covers is tampering, and the log refuses to
//! open.

use std::collections::HashMap;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::checkpoint::{Checkpoint, Signer25519};
use crate::entry::{self, Action, AuditEntry, RedactionPolicy};
use crate::merkle::{self, Frontier, Hash};
use crate::seal::{self, Layout, Manifest, Row, SealedFile};
use crate::AuditError;

const FRAME_HEAD: usize = 4 + 32;
/// An entry larger than this is refused (a frame length beyond it marks a torn tail).
pub const MAX_ENTRY_BYTES: usize = 64 << 20;

/// What the local log needs to know.
#[derive(Debug, Clone)]
pub struct LogOptions {
    pub dir: PathBuf,
    /// Names the log in its checkpoints.
    pub origin: String,
    pub segment_max_bytes: u64,
    pub segment_max_age: Duration,
    pub layout: Layout,
    pub redact: RedactionPolicy,
}

impl LogOptions {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            origin: "rampart".into(),
            segment_max_bytes: 64 << 20,
            segment_max_age: Duration::from_secs(3600),
            layout: Layout::Segment,
            redact: RedactionPolicy::default(),
        }
    }
}

/// Where an entry's bytes are.
#[derive(Debug, Clone)]
enum Location {
    Segment {
        first: u64,
        offset: u64,
        len: u32,
    },
    Sealed {
        file: Arc<PathBuf>,
        row: u32,
    },
    /// Shipped, and the local copy removed (`delete_local_after_verify`): on S3 only.
    Shipped {
        file: Arc<String>,
    },
}

/// One line of a sealed segment's local index (`sealed/_index/<first>.jsonl`): what the log
/// needs of an entry whose sealed file may be gone locally once shipped.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub(crate) struct IndexLine {
    pub i: u64,
    pub h: String,
    pub id: String,
    pub u: String,
    pub t: u64,
    /// The sealed file (relative to `sealed/`).
    pub f: String,
}

pub(crate) fn index_path(sealed: &Path, first: u64) -> PathBuf {
    sealed.join("_index").join(format!("{first:020}.jsonl"))
}

pub(crate) fn read_index(sealed: &Path, first: u64) -> Result<Vec<IndexLine>, AuditError> {
    let path = index_path(sealed, first);
    let text = fs::read_to_string(&path).map_err(|e| AuditError::io(&path, e))?;
    text.lines()
        .map(|l| {
            serde_json::from_str(l)
                .map_err(|e| AuditError::Corrupt(format!("{}: {e}", path.display())))
        })
        .collect()
}

#[derive(Debug)]
struct Active {
    first: u64,
    file: File,
    path: PathBuf,
    bytes: u64,
    opened: Instant,
}

#[derive(Debug, Default)]
struct Index {
    leaves: Vec<Hash>,
    frontier: Frontier,
    locations: Vec<Location>,
    times: Vec<u64>,
    by_id: HashMap<String, u64>,
    by_user: HashMap<String, Vec<u64>>,
}

impl Index {
    fn add(&mut self, leaf: Hash, location: Location, audit_id: &str, user: &str, time_ms: u64) {
        let index = self.leaves.len() as u64;
        self.leaves.push(leaf);
        self.frontier.push(leaf);
        self.locations.push(location);
        self.times.push(time_ms);
        self.by_id.insert(audit_id.to_string(), index);
        if !user.is_empty() {
            self.by_user
                .entry(user.to_string())
                .or_default()
                .push(index);
        }
    }

    fn size(&self) -> u64 {
        self.leaves.len() as u64
    }
}

struct Inner {
    active: Active,
    /// Closed segments waiting to be sealed, oldest first.
    closed: Vec<u64>,
    /// The tree's root at the end of each closed segment (by the end's index), kept when it
    /// closed so sealing never walks the whole tree.
    segment_roots: HashMap<u64, Hash>,
    index: Index,
    checkpoints: Vec<Checkpoint>,
    checkpoints_file: File,
}

/// What the log did since it opened (for the metrics and `GET /admin/audit/status`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct LogStatus {
    pub dir: String,
    pub size: u64,
    pub root: String,
    pub healthy: bool,
    pub problem: Option<String>,
    pub last_checkpoint: Option<Checkpoint>,
    pub checkpoint_age_s: f64,
    pub segments_open: usize,
    pub sealed_segments: usize,
    pub key_id: String,
    pub public_key: String,
}

/// An inclusion proof of one entry against a signed checkpoint.
#[derive(Debug, Clone, Serialize)]
pub struct InclusionProof {
    pub audit_id: String,
    pub index: u64,
    pub leaf_hash: String,
    /// The audit path, hex, leaf to root.
    pub path: Vec<String>,
    pub checkpoint: Checkpoint,
}

impl InclusionProof {
    pub fn new(
        audit_id: &str,
        index: u64,
        leaf: &Hash,
        path: &[Hash],
        checkpoint: Checkpoint,
    ) -> Self {
        Self {
            audit_id: audit_id.to_string(),
            index,
            leaf_hash: hex::encode(leaf),
            path: path.iter().map(hex::encode).collect(),
            checkpoint,
        }
    }

    /// Whether the path leads from the leaf to the checkpoint's root (RFC 9162 §2.1.3.2); the
    /// checkpoint's signature is the caller's to check.
    pub fn verify(&self) -> bool {
        let parse = crate::checkpoint::parse_hash;
        let (Some(leaf), Some(root)) = (parse(&self.leaf_hash), parse(&self.checkpoint.root))
        else {
            return false;
        };
        let Some(path) = self
            .path
            .iter()
            .map(|h| parse(h))
            .collect::<Option<Vec<Hash>>>()
        else {
            return false;
        };
        merkle::verify_inclusion(self.index, self.checkpoint.size, &leaf, &path, &root)
    }
}

/// A consistency proof between two checkpoints.
#[derive(Debug, Clone, Serialize)]
pub struct ConsistencyProof {
    pub first: Checkpoint,
    pub second: Checkpoint,
    pub path: Vec<String>,
}

/// A page of a user's entries.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub entries: Vec<AuditEntry>,
    /// Pass as `after` for the next page; none on the last.
    pub next: Option<u64>,
}

/// The local WORM log.
pub struct AuditLog {
    options: LogOptions,
    signer: Signer25519,
    inner: Mutex<Inner>,
    healthy: AtomicBool,
    problem: Mutex<Option<String>>,
    sealed_count: std::sync::atomic::AtomicUsize,
    last_checkpoint_at: Mutex<Instant>,
    /// Drills and tests: every write fails with this, as a failing disk would.
    write_fault: Mutex<Option<String>>,
    /// Group commits done (one write and one fsync each).
    batches: std::sync::atomic::AtomicU64,
    /// A failed write that could not be undone: appends stop until a restart recovers.
    stuck: Mutex<Option<String>>,
}

impl std::fmt::Debug for AuditLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuditLog")
            .field("dir", &self.options.dir)
            .finish_non_exhaustive()
    }
}

fn segment_path(dir: &Path, first: u64) -> PathBuf {
    dir.join("segments").join(format!("{first:020}.seg"))
}

/// One frame read back.
pub(crate) struct Frame {
    pub offset: u64,
    pub hash: Hash,
    pub bytes: Vec<u8>,
}

/// How a segment's bytes ended.
pub(crate) enum Tail {
    Clean,
    /// The frame at `offset` is incomplete or its hash does not match: `why`. `followed`: a
    /// valid frame comes after it — damage in the middle, never a torn write.
    Bad {
        offset: u64,
        why: String,
        followed: bool,
    },
}

/// Whether a whole frame with a matching hash starts at `at`.
fn valid_frame_at(data: &[u8], at: usize) -> bool {
    if data.len() < at + FRAME_HEAD {
        return false;
    }
    let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap_or_default()) as usize;
    if len > MAX_ENTRY_BYTES || data.len() - at - FRAME_HEAD < len {
        return false;
    }
    let hash: Hash = data[at + 4..at + FRAME_HEAD].try_into().unwrap_or_default();
    merkle::leaf_hash(&data[at + FRAME_HEAD..at + FRAME_HEAD + len]) == hash
}

/// Reads every frame of a segment up to the first bad one.
pub(crate) fn read_frames(path: &Path) -> Result<(Vec<Frame>, Tail, u64), AuditError> {
    let mut data = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut data))
        .map_err(|e| AuditError::io(path, e))?;
    let mut frames = Vec::new();
    let mut at = 0usize;
    let total = data.len() as u64;
    while at < data.len() {
        let bad = |why: &str| Tail::Bad {
            offset: at as u64,
            why: why.to_string(),
            followed: false,
        };
        if data.len() - at < FRAME_HEAD {
            return Ok((frames, bad("an incomplete frame header"), total));
        }
        let len = u32::from_le_bytes(data[at..at + 4].try_into().unwrap_or_default()) as usize;
        if len > MAX_ENTRY_BYTES || data.len() - at - FRAME_HEAD < len {
            return Ok((frames, bad("a frame longer than what follows it"), total));
        }
        let hash: Hash = data[at + 4..at + FRAME_HEAD].try_into().unwrap_or_default();
        let bytes = &data[at + FRAME_HEAD..at + FRAME_HEAD + len];
        if merkle::leaf_hash(bytes) != hash {
            let tail = Tail::Bad {
                offset: at as u64,
                why: "an entry whose bytes do not match its hash".into(),
                followed: valid_frame_at(&data, at + FRAME_HEAD + len),
            };
            return Ok((frames, tail, total));
        }
        frames.push(Frame {
            offset: at as u64,
            hash,
            bytes: bytes.to_vec(),
        });
        at += FRAME_HEAD + len;
    }
    Ok((frames, Tail::Clean, total))
}

pub(crate) fn read_checkpoints(path: &Path) -> Result<Vec<Checkpoint>, AuditError> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(AuditError::io(path, e)),
    };
    let mut out = Vec::new();
    let lines: Vec<&str> = text.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<Checkpoint>(line) {
            Ok(c) => out.push(c),
            // A torn last line is a checkpoint the crash interrupted.
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => break,
            Err(e) => {
                return Err(AuditError::Corrupt(format!(
                    "{} line {}: {e}",
                    path.display(),
                    i + 1
                )))
            }
        }
    }
    Ok(out)
}

pub(crate) fn read_manifests(sealed: &Path) -> Result<Vec<Manifest>, AuditError> {
    let dir = sealed.join("_manifests");
    let mut names: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(rd) => rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(AuditError::io(&dir, e)),
    };
    names.sort();
    names
        .iter()
        .map(|p| {
            let text = fs::read_to_string(p).map_err(|e| AuditError::io(p, e))?;
            serde_json::from_str(&text)
                .map_err(|e| AuditError::Corrupt(format!("{}: {e}", p.display())))
        })
        .collect()
}

fn fsync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

impl AuditLog {
    /// Opens (or creates) the log in `options.dir`, replaying what is there.
    pub fn open(options: LogOptions) -> Result<Arc<Self>, AuditError> {
        let dir = options.dir.clone();
        for sub in ["segments", "sealed/_manifests"] {
            let p = dir.join(sub);
            fs::create_dir_all(&p).map_err(|e| AuditError::io(&p, e))?;
        }
        let signer = Signer25519::load_or_create(&dir)?;
        let checkpoints_path = dir.join("checkpoints.jsonl");
        let checkpoints = read_checkpoints(&checkpoints_path)?;
        for c in &checkpoints {
            if !c.verify(&signer.verifying_key()) {
                return Err(AuditError::Tampered(format!(
                    "checkpoint of size {} (time {}) does not carry this log's signature",
                    c.size, c.time_ms
                )));
            }
        }
        let covered = checkpoints.last().map_or(0, |c| c.size);
        let mut index = Index::default();
        let sealed_root = dir.join("sealed");
        let manifests = read_manifests(&sealed_root)?;
        let mut sealed_until = 0u64;
        let shipped = crate::ship::shipped_files(&dir);
        for m in &manifests {
            if !m.checkpoint.verify(&signer.verifying_key()) || m.checkpoint.size != m.end {
                return Err(AuditError::Tampered(format!(
                    "the checkpoint of sealed segment {}..{} is not signed by this log's key",
                    m.first, m.end
                )));
            }
            if m.first != sealed_until {
                return Err(AuditError::Tampered(format!(
                    "sealed segments do not follow each other: expected one starting at entry {sealed_until}, found {}",
                    m.first
                )));
            }
            // (index, leaf, audit id, user, time, location)
            let mut rows: Vec<(u64, Hash, String, String, u64, Location)> = Vec::new();
            let mut local_index: Option<Vec<IndexLine>> = None;
            for f in &m.files {
                let path = Arc::new(sealed_root.join(&f.path));
                let data = match fs::read(&*path) {
                    Ok(d) => d,
                    // Shipped and removed: the segment's local index stands in for the file.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        if !shipped.contains(&f.path) {
                            return Err(AuditError::Tampered(format!(
                                "sealed file {} is missing and was never shipped",
                                f.path
                            )));
                        }
                        if local_index.is_none() {
                            local_index = Some(read_index(&sealed_root, m.first)?);
                        }
                        let file = Arc::new(f.path.clone());
                        for l in local_index.iter().flatten().filter(|l| l.f == f.path) {
                            let leaf = crate::checkpoint::parse_hash(&l.h).ok_or_else(|| {
                                AuditError::Corrupt(format!("bad hash in the index of {}", f.path))
                            })?;
                            let location = Location::Shipped {
                                file: Arc::clone(&file),
                            };
                            rows.push((l.i, leaf, l.id.clone(), l.u.clone(), l.t, location));
                        }
                        continue;
                    }
                    Err(e) => return Err(AuditError::io(&path, e)),
                };
                if record::sha256_bytes_hex(&data) != f.sha256 {
                    return Err(AuditError::Tampered(format!(
                        "sealed file {} does not match its manifest's sha256",
                        f.path
                    )));
                }
                for (i, row) in seal::read(data)?.into_iter().enumerate() {
                    if merkle::leaf_hash(&row.entry) != row.leaf_hash {
                        return Err(AuditError::Tampered(format!(
                            "sealed entry {} in {} does not match its hash",
                            row.index, f.path
                        )));
                    }
                    let location = Location::Sealed {
                        file: Arc::clone(&path),
                        row: i as u32,
                    };
                    rows.push((
                        row.index,
                        row.leaf_hash,
                        row.audit_id,
                        row.user,
                        row.time_ms,
                        location,
                    ));
                }
            }
            rows.sort_by_key(|r| r.0);
            for (i, leaf, audit_id, user, time_ms, location) in rows {
                if i != index.size() {
                    return Err(AuditError::Tampered(format!(
                        "sealed entry {} is missing or out of place (found {i})",
                        index.size(),
                    )));
                }
                index.add(leaf, location, &audit_id, &user, time_ms);
            }
            sealed_until = m.end;
        }
        // Segments: the sealed ones may still be there (a crash between sealing and removal).
        let seg_dir = dir.join("segments");
        let mut firsts: Vec<u64> = fs::read_dir(&seg_dir)
            .map_err(|e| AuditError::io(&seg_dir, e))?
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                name.strip_suffix(".seg")?.parse().ok()
            })
            .collect();
        firsts.sort_unstable();
        let mut recovered: Vec<String> = Vec::new();
        let mut open_segments = Vec::new();
        for first in firsts {
            let path = segment_path(&dir, first);
            if first < sealed_until {
                let _ = fs::remove_file(&path);
                continue;
            }
            if first != index.size() {
                return Err(AuditError::Tampered(format!(
                    "segment {} starts at entry {first} but the log has {} entries before it",
                    path.display(),
                    index.size()
                )));
            }
            let (frames, tail, total) = read_frames(&path)?;
            for f in &frames {
                let e = AuditEntry::decode(&f.bytes).map_err(|e| {
                    AuditError::Corrupt(format!(
                        "entry {} in {}: {e}",
                        index.size(),
                        path.display()
                    ))
                })?;
                if e.index != index.size() {
                    return Err(AuditError::Tampered(format!(
                        "entry {} is missing or out of place (found entry {} at its position)",
                        index.size(),
                        e.index
                    )));
                }
                index.add(
                    f.hash,
                    Location::Segment {
                        first,
                        offset: f.offset,
                        len: f.bytes.len() as u32,
                    },
                    &e.audit_id,
                    e.user.as_deref().unwrap_or(""),
                    e.time_ms,
                );
            }
            if let Tail::Bad {
                offset,
                why,
                followed,
            } = tail
            {
                if index.size() < covered || followed {
                    return Err(AuditError::Tampered(format!(
                        "entry {} in {} is damaged ({why}); a signed checkpoint or the entries after it show it was written whole",
                        index.size(),
                        path.display()
                    )));
                }
                let file = OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map_err(|e| AuditError::io(&path, e))?;
                file.set_len(offset)
                    .and_then(|()| file.sync_all())
                    .map_err(|e| AuditError::io(&path, e))?;
                let note = format!(
                    "cut a torn tail of {} bytes at offset {offset} of {} ({why}): a write the crash interrupted, never acknowledged",
                    total - offset,
                    path.display()
                );
                tracing::warn!(dir = %dir.display(), "audit log recovered: {note}");
                recovered.push(note);
            }
            open_segments.push(first);
        }
        if index.size() < covered {
            return Err(AuditError::Tampered(format!(
                "the log holds {} entries but checkpoint {covered} was signed: entries from {} on are missing",
                index.size(),
                index.size()
            )));
        }
        let sizes: Vec<u64> = checkpoints.iter().map(|c| c.size).collect();
        for (c, root) in checkpoints
            .iter()
            .zip(merkle::roots_at(&index.leaves, &sizes))
        {
            if hex::encode(root) != c.root {
                return Err(AuditError::Tampered(format!(
                    "the entries up to {} do not match the checkpoint signed at {} ms",
                    c.size, c.time_ms
                )));
            }
        }
        // The newest segment stays active; older unsealed ones wait for the sealer, each with
        // the tree's root at its end.
        let active_first = open_segments.pop().unwrap_or(index.size());
        let ends: Vec<u64> = open_segments
            .iter()
            .skip(1)
            .copied()
            .chain(std::iter::once(active_first))
            .take(open_segments.len())
            .collect();
        let segment_roots: HashMap<u64, Hash> = ends
            .iter()
            .copied()
            .zip(merkle::roots_at(&index.leaves, &ends))
            .collect();
        let active_path = segment_path(&dir, active_first);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&active_path)
            .map_err(|e| AuditError::io(&active_path, e))?;
        let bytes = file.metadata().map(|m| m.len()).unwrap_or(0);
        fsync_dir(&seg_dir);
        let checkpoints_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&checkpoints_path)
            .map_err(|e| AuditError::io(&checkpoints_path, e))?;
        let log = Arc::new(Self {
            signer,
            inner: Mutex::new(Inner {
                active: Active {
                    first: active_first,
                    file,
                    path: active_path,
                    bytes,
                    opened: Instant::now(),
                },
                closed: open_segments,
                segment_roots,
                index,
                checkpoints,
                checkpoints_file,
            }),
            healthy: AtomicBool::new(true),
            problem: Mutex::new(None),
            sealed_count: std::sync::atomic::AtomicUsize::new(manifests.len()),
            last_checkpoint_at: Mutex::new(Instant::now()),
            write_fault: Mutex::new(None),
            batches: std::sync::atomic::AtomicU64::new(0),
            stuck: Mutex::new(None),
            options,
        });
        for note in recovered {
            log.append(vec![AuditEntry::action(
                None,
                None,
                None,
                Action {
                    name: "audit.recovered".into(),
                    target: None,
                    cause: Some("the process stopped in the middle of a write".into()),
                    outcome: "ok".into(),
                    detail: serde_json::json!({ "note": note }),
                },
            )])?;
        }
        Ok(log)
    }

    /// Group commits done since the log opened (one write and one fsync each).
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the last write reached the disk.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    fn set_problem(&self, problem: Option<String>) {
        self.healthy.store(problem.is_none(), Ordering::Relaxed);
        *self.problem.lock().unwrap_or_else(|e| e.into_inner()) = problem;
    }

    /// Appends the entries (redacted, numbered) with one write and one fsync; returns their
    /// indices once they are durable. On failure nothing of the batch stays in the log.
    pub fn append(&self, mut entries: Vec<AuditEntry>) -> Result<Vec<u64>, AuditError> {
        if entries.is_empty() {
            return Ok(Vec::new());
        }
        let mut inner = self.lock();
        if let Some(stuck) = self.stuck.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(AuditError::Unavailable(stuck));
        }
        if let Err(e) = self.rotate_if_due(&mut inner) {
            self.set_problem(Some(e.to_string()));
            return Err(AuditError::Unavailable(e.to_string()));
        }
        let start = inner.index.size();
        let mut buf = Vec::new();
        let mut staged = Vec::with_capacity(entries.len());
        for (i, e) in entries.iter_mut().enumerate() {
            e.index = start + i as u64;
            e.redact(&self.options.redact);
            let mut bytes = e.encode();
            if bytes.len() > MAX_ENTRY_BYTES {
                // Keep the entry without its payload (noted) rather than lose the batch.
                let size = bytes.len();
                for (field, value) in [("input", &mut e.input), ("output", &mut e.output)] {
                    if value.take().is_some() {
                        e.redactions.push(entry::Redaction {
                            field: field.to_string(),
                            action: entry::RedactAction::Drop,
                        });
                    }
                }
                e.redactions.push(entry::Redaction {
                    field: format!("too_large:{size}"),
                    action: entry::RedactAction::Drop,
                });
                bytes = e.encode();
                if bytes.len() > MAX_ENTRY_BYTES {
                    return Err(AuditError::TooLarge(bytes.len()));
                }
                tracing::warn!(audit_id = %e.audit_id, bytes = size, "an audit entry over 64 MiB is kept without its input and output");
            }
            let hash = merkle::leaf_hash(&bytes);
            let offset = inner.active.bytes + buf.len() as u64;
            buf.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
            buf.extend_from_slice(&hash);
            buf.extend_from_slice(&bytes);
            staged.push((hash, offset, bytes.len() as u32));
        }
        let began = Instant::now();
        let fault = self
            .write_fault
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let written = match fault {
            Some(f) => Err(std::io::Error::other(f)),
            None => inner
                .active
                .file
                .write_all(&buf)
                .and_then(|()| inner.active.file.sync_data()),
        };
        metrics::histogram!("rampart_audit_fsync_seconds").record(began.elapsed().as_secs_f64());
        if let Err(e) = written {
            let at = inner.active.bytes;
            let message = format!("cannot write {}: {e}", inner.active.path.display());
            if let Err(cut) = inner.active.file.set_len(at) {
                // Part of the batch may stay in the segment: no more appends to this log until
                // a restart recovers it (a torn tail after the last checkpoint is cut then).
                let stuck = format!("{message}; and the partial write could not be removed ({cut}): restart to recover");
                *self.stuck.lock().unwrap_or_else(|e| e.into_inner()) = Some(stuck.clone());
                self.set_problem(Some(stuck.clone()));
                return Err(AuditError::Unavailable(stuck));
            }
            self.set_problem(Some(message.clone()));
            return Err(AuditError::Unavailable(message));
        }
        if !self.is_healthy() {
            self.set_problem(None);
            tracing::info!(dir = %self.options.dir.display(), "audit log writes again");
        }
        inner.active.bytes += buf.len() as u64;
        self.batches.fetch_add(1, Ordering::Relaxed);
        let first = inner.active.first;
        let mut out = Vec::with_capacity(entries.len());
        for (e, (hash, offset, len)) in entries.iter().zip(staged) {
            out.push(e.index);
            inner.index.add(
                hash,
                Location::Segment { first, offset, len },
                &e.audit_id,
                e.user.as_deref().unwrap_or(""),
                e.time_ms,
            );
        }
        metrics::counter!("rampart_audit_appended_total").increment(entries.len() as u64);
        Ok(out)
    }

    fn rotate_if_due(&self, inner: &mut Inner) -> Result<(), AuditError> {
        let a = &inner.active;
        if a.bytes >= self.options.segment_max_bytes
            || a.opened.elapsed() >= self.options.segment_max_age
        {
            self.roll(inner)?;
        }
        Ok(())
    }

    /// Closes the active segment (when it holds anything) and opens the next: the sealer takes
    /// the closed one.
    fn roll(&self, inner: &mut Inner) -> Result<(), AuditError> {
        if inner.active.bytes == 0 {
            return Ok(());
        }
        let first = inner.index.size();
        let path = segment_path(&self.options.dir, first);
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| AuditError::io(&path, e))?;
        fsync_dir(&self.options.dir.join("segments"));
        let old = std::mem::replace(
            &mut inner.active,
            Active {
                first,
                file,
                path,
                bytes: 0,
                opened: Instant::now(),
            },
        );
        inner.closed.push(old.first);
        let root = inner.index.frontier.root();
        inner.segment_roots.insert(first, root);
        Ok(())
    }

    /// Closes the active segment now (when it holds anything) so the sealer takes it.
    pub fn rotate(&self) -> Result<(), AuditError> {
        let mut inner = self.lock();
        self.roll(&mut inner)
    }

    /// Rotates the active segment when it is due by age (the timer's half of sealing by age).
    pub fn rotate_if_old(&self) -> Result<(), AuditError> {
        let mut inner = self.lock();
        self.rotate_if_due(&mut inner)
    }

    /// Signs and appends a checkpoint when the tree grew since the last one.
    pub fn checkpoint(&self) -> Result<Option<Checkpoint>, AuditError> {
        let mut inner = self.lock();
        let size = inner.index.size();
        if inner.checkpoints.last().map(|c| c.size) == Some(size) {
            *self
                .last_checkpoint_at
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = Instant::now();
            return Ok(None);
        }
        let root = inner.index.frontier.root();
        let c = self
            .signer
            .sign(&self.options.origin, size, &root, entry::now_ms());
        let mut line = serde_json::to_vec(&c).unwrap_or_default();
        line.push(b'\n');
        let before = inner.checkpoints_file.metadata().map(|m| m.len()).ok();
        let written = inner
            .checkpoints_file
            .write_all(&line)
            .and_then(|()| inner.checkpoints_file.sync_data());
        if let Err(e) = written {
            // A partial line would sit in the middle of the file once the next one follows.
            if let Some(len) = before {
                let _ = inner.checkpoints_file.set_len(len);
            }
            let message = format!("cannot write the checkpoint: {e}");
            self.set_problem(Some(message.clone()));
            return Err(AuditError::Unavailable(message));
        }
        inner.checkpoints.push(c.clone());
        *self
            .last_checkpoint_at
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Instant::now();
        Ok(Some(c))
    }

    /// Seconds since the tree was last covered by a checkpoint (0 when nothing is uncovered).
    pub fn checkpoint_age_s(&self) -> f64 {
        let inner = self.lock();
        let covered = inner.checkpoints.last().map_or(0, |c| c.size);
        if covered == inner.index.size() {
            return 0.0;
        }
        self.last_checkpoint_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .elapsed()
            .as_secs_f64()
    }

    /// Seals the oldest closed segment into Parquet files and its manifest; returns the
    /// manifest (none when no segment waits).
    pub fn seal_next(&self) -> Result<Option<Manifest>, AuditError> {
        let (first, end, leaves_end) = {
            let inner = self.lock();
            let Some(&first) = inner.closed.first() else {
                return Ok(None);
            };
            let end = inner.closed.get(1).copied().unwrap_or(inner.active.first);
            let root = match inner.segment_roots.get(&end) {
                Some(r) => *r,
                None => merkle::root(&inner.index.leaves[..end as usize]),
            };
            (first, end, root)
        };
        let path = segment_path(&self.options.dir, first);
        let (frames, tail, _) = read_frames(&path)?;
        if let Tail::Bad { offset, why, .. } = tail {
            return Err(AuditError::Tampered(format!(
                "closed segment {} is damaged at offset {offset}: {why}",
                path.display()
            )));
        }
        if frames.len() as u64 != end - first {
            return Err(AuditError::Tampered(format!(
                "closed segment {} holds {} entries, expected {}",
                path.display(),
                frames.len(),
                end - first
            )));
        }
        let mut rows = Vec::with_capacity(frames.len());
        for f in frames {
            let e = AuditEntry::decode(&f.bytes)
                .map_err(|e| AuditError::Corrupt(format!("{}: {e}", path.display())))?;
            rows.push(Row {
                index: e.index,
                leaf_hash: f.hash,
                audit_id: e.audit_id,
                time_ms: e.time_ms,
                user: e.user.unwrap_or_default(),
                model: e.model,
                kind: e.kind.as_str().to_string(),
                entry: f.bytes,
            });
        }
        // Group: one file per model (segment layout) or per entry (request layout).
        let mut groups: Vec<(String, Vec<Row>)> = Vec::new();
        for row in rows {
            let key = match self.options.layout {
                Layout::Segment => row.model.clone(),
                Layout::Request => row.audit_id.clone(),
            };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, g)) => g.push(row),
                None => groups.push((key, vec![row])),
            }
        }
        let sealed = self.options.dir.join("sealed");
        let mut files = Vec::new();
        let mut placed: Vec<(u64, Arc<PathBuf>, u32)> = Vec::new();
        for (_, group) in &groups {
            let head = &group[0];
            let last = group[group.len() - 1].index;
            let rel = seal::file_path(
                self.options.layout,
                &head.model,
                head.time_ms,
                head.index,
                last,
                &head.audit_id,
            );
            let data = seal::write(group)?;
            let full = sealed.join(&rel);
            write_durable(&full, &data)?;
            let full = Arc::new(full);
            for (i, r) in group.iter().enumerate() {
                placed.push((r.index, Arc::clone(&full), i as u32));
            }
            files.push(SealedFile {
                path: rel,
                sha256: record::sha256_bytes_hex(&data),
                rows: group.len() as u64,
                model: head.model.clone(),
            });
        }
        let checkpoint = self
            .signer
            .sign(&self.options.origin, end, &leaves_end, entry::now_ms());
        let manifest = Manifest {
            first,
            end,
            files,
            checkpoint,
        };
        let mut lines = String::new();
        // Groups and files were made in the same order.
        for ((_, group), file) in groups.iter().zip(&manifest.files) {
            let rel = &file.path;
            for row in group {
                let line = IndexLine {
                    i: row.index,
                    h: hex::encode(row.leaf_hash),
                    id: row.audit_id.clone(),
                    u: row.user.clone(),
                    t: row.time_ms,
                    f: rel.clone(),
                };
                lines.push_str(&serde_json::to_string(&line).unwrap_or_default());
                lines.push('\n');
            }
        }
        write_durable(&index_path(&sealed, first), lines.as_bytes())?;
        // The manifest last: a segment counts as sealed once its manifest is there.
        let text = serde_json::to_vec_pretty(&manifest).unwrap_or_default();
        write_durable(&sealed.join(Manifest::path(first)), &text)?;
        {
            let mut inner = self.lock();
            for (index, file, row) in placed {
                inner.index.locations[index as usize] = Location::Sealed { file, row };
            }
            inner.closed.retain(|f| *f != first);
            inner.segment_roots.remove(&end);
        }
        let _ = fs::remove_file(&path);
        fsync_dir(&self.options.dir.join("segments"));
        self.sealed_count.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            first,
            end,
            files = manifest.files.len(),
            "audit segment sealed"
        );
        Ok(Some(manifest))
    }

    /// The entry with this audit id.
    pub fn get(&self, audit_id: &str) -> Result<Option<AuditEntry>, AuditError> {
        let location = {
            let inner = self.lock();
            let Some(&i) = inner.index.by_id.get(audit_id) else {
                return Ok(None);
            };
            inner.index.locations[i as usize].clone()
        };
        self.read_at(&location).map(Some)
    }

    fn read_at(&self, location: &Location) -> Result<AuditEntry, AuditError> {
        self.read_cached(location, &mut HashMap::new())
    }

    /// [`Self::read_at`], keeping each sealed file read in `files` (a page of a user's entries
    /// reads each Parquet file once).
    fn read_cached(
        &self,
        location: &Location,
        files: &mut HashMap<PathBuf, Vec<Row>>,
    ) -> Result<AuditEntry, AuditError> {
        let bytes = match location {
            Location::Segment { first, offset, len } => {
                let path = segment_path(&self.options.dir, *first);
                let mut f = File::open(&path).map_err(|e| AuditError::io(&path, e))?;
                let mut buf = vec![0u8; *len as usize];
                f.seek(SeekFrom::Start(offset + FRAME_HEAD as u64))
                    .and_then(|_| f.read_exact(&mut buf))
                    .map_err(|e| AuditError::io(&path, e))?;
                buf
            }
            Location::Shipped { file } => return Err(on_s3_only(file)),
            Location::Sealed { file, row } => {
                if !files.contains_key(&**file) {
                    let data = fs::read(&**file).map_err(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => on_s3_only(&file.display().to_string()),
                        _ => AuditError::io(file, e),
                    })?;
                    files.insert((**file).clone(), seal::read(data)?);
                }
                files
                    .get(&**file)
                    .and_then(|rows| rows.get(*row as usize))
                    .map(|r| r.entry.clone())
                    .ok_or_else(|| AuditError::Corrupt(format!("{} lost a row", file.display())))?
            }
        };
        AuditEntry::decode(&bytes).map_err(|e| AuditError::Corrupt(e.to_string()))
    }

    /// A user's entries between two times (ms, inclusive), oldest first, `limit` per page,
    /// after index `after`. The user id is matched as the redaction policy stores it.
    pub fn by_user(
        &self,
        user: &str,
        from_ms: Option<u64>,
        to_ms: Option<u64>,
        after: Option<u64>,
        limit: usize,
    ) -> Result<Page, AuditError> {
        if matches!(
            self.options.redact.user,
            entry::RedactAction::Mask | entry::RedactAction::Drop
        ) {
            return Err(AuditError::Config(
                "user ids are masked or dropped ([audit.redact] user): entries cannot be found by user; use hash to keep them findable".into(),
            ));
        }
        let stored = entry::redact_string(user, self.options.redact.user).unwrap_or_default();
        let locations: Vec<(u64, Location)> = {
            let inner = self.lock();
            let Some(indices) = inner.index.by_user.get(&stored) else {
                return Ok(Page {
                    entries: Vec::new(),
                    next: None,
                });
            };
            indices
                .iter()
                .filter(|i| after.is_none_or(|a| **i > a))
                .filter(|i| {
                    let t = inner.index.times[**i as usize];
                    from_ms.is_none_or(|f| t >= f) && to_ms.is_none_or(|to| t <= to)
                })
                .take(limit.max(1) + 1)
                .map(|i| (*i, inner.index.locations[*i as usize].clone()))
                .collect()
        };
        let more = locations.len() > limit.max(1);
        let mut entries = Vec::new();
        let mut last = None;
        let mut files = HashMap::new();
        for (i, loc) in locations.into_iter().take(limit.max(1)) {
            entries.push(self.read_cached(&loc, &mut files)?);
            last = Some(i);
        }
        Ok(Page {
            entries,
            next: if more { last } else { None },
        })
    }

    /// The inclusion proof of an entry against the newest checkpoint (made now when the entry
    /// is newer than it).
    pub fn prove(&self, audit_id: &str) -> Result<Option<InclusionProof>, AuditError> {
        let index = {
            let inner = self.lock();
            match inner.index.by_id.get(audit_id) {
                Some(i) => *i,
                None => return Ok(None),
            }
        };
        let covered = self.lock().checkpoints.last().map_or(0, |c| c.size);
        if index >= covered {
            self.checkpoint()?;
        }
        let inner = self.lock();
        let Some(checkpoint) = inner.checkpoints.last().cloned() else {
            return Err(AuditError::Unavailable("no checkpoint yet".into()));
        };
        // A copy of the leaves (a memcpy), so the O(n) hashing runs without the lock that
        // appends need.
        let leaves = inner.index.leaves[..checkpoint.size as usize].to_vec();
        let leaf = inner.index.leaves[index as usize];
        drop(inner);
        let path = merkle::inclusion_proof(&leaves, index as usize).unwrap_or_default();
        Ok(Some(InclusionProof::new(
            audit_id, index, &leaf, &path, checkpoint,
        )))
    }

    /// The consistency proof between the checkpoints of sizes `first` and `second` (the newest
    /// checkpoint when `second` is none).
    pub fn consistency(
        &self,
        first: u64,
        second: Option<u64>,
    ) -> Result<ConsistencyProof, AuditError> {
        let inner = self.lock();
        let find = |size: u64| {
            inner
                .checkpoints
                .iter()
                .rev()
                .find(|c| c.size == size)
                .cloned()
        };
        let second = match second {
            Some(s) => find(s),
            None => inner.checkpoints.last().cloned(),
        }
        .ok_or_else(|| AuditError::NotFound("no checkpoint of that size".into()))?;
        let first = find(first)
            .ok_or_else(|| AuditError::NotFound(format!("no checkpoint of size {first}")))?;
        if first.size > second.size {
            return Err(AuditError::NotFound(
                "the first checkpoint is larger than the second".into(),
            ));
        }
        let leaves = inner.index.leaves[..second.size as usize].to_vec();
        drop(inner);
        let path = merkle::consistency_proof(&leaves, first.size as usize).unwrap_or_default();
        Ok(ConsistencyProof {
            first,
            second,
            path: path.iter().map(hex::encode).collect(),
        })
    }

    pub fn checkpoints(&self) -> Vec<Checkpoint> {
        self.lock().checkpoints.clone()
    }

    pub fn public_key_hex(&self) -> String {
        hex::encode(self.signer.verifying_key().to_bytes())
    }

    pub fn status(&self) -> LogStatus {
        let age = self.checkpoint_age_s();
        let inner = self.lock();
        LogStatus {
            dir: self.options.dir.display().to_string(),
            size: inner.index.size(),
            root: hex::encode(inner.index.frontier.root()),
            healthy: self.is_healthy(),
            problem: self
                .problem
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            last_checkpoint: inner.checkpoints.last().cloned(),
            checkpoint_age_s: age,
            segments_open: inner.closed.len() + 1,
            sealed_segments: self.sealed_count.load(Ordering::Relaxed),
            key_id: self.signer.key_id().to_string(),
            public_key: hex::encode(self.signer.verifying_key().to_bytes()),
        }
    }

    /// Drills and tests: make every write fail with `message` (as a failing disk would), or
    /// stop doing so (`None`; the next probe or write clears the problem).
    pub fn set_write_fault(&self, message: Option<String>) {
        *self.write_fault.lock().unwrap_or_else(|e| e.into_inner()) = message;
    }

    /// Tries the disk again after a failure (an empty write and fsync); clears the problem when
    /// it works.
    pub fn probe(&self) {
        if self.is_healthy()
            || self
                .write_fault
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .is_some()
        {
            return;
        }
        if self
            .stuck
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
        {
            return;
        }
        // A real write and fsync: a full disk or a failing device fails it (fsync of a file
        // with nothing dirty would succeed and say nothing).
        let path = self.options.dir.join(".probe");
        let works = File::create(&path)
            .and_then(|mut f| f.write_all(&[0u8; 4096]).and_then(|()| f.sync_all()))
            .is_ok();
        let _ = fs::remove_file(&path);
        if works {
            self.set_problem(None);
            tracing::info!(dir = %self.options.dir.display(), "audit log writes again");
        }
    }

    /// The reason the log cannot persist, if it cannot (no lock on the log itself: callable
    /// on every request while a write is stuck).
    pub fn problem(&self) -> Option<String> {
        self.problem
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// A lookup of an entry whose sealed file was removed once shipped.
fn on_s3_only(file: &str) -> AuditError {
    AuditError::NotFound(format!(
        "the entry is in {file} on S3 only (its local copy was removed once shipped): \
         read it with `rampart audit get ID --s3 URL`"
    ))
}

fn write_durable(path: &Path, data: &[u8]) -> Result<(), AuditError> {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).map_err(|e| AuditError::io(parent, e))?;
    }
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp).map_err(|e| AuditError::io(&tmp, e))?;
    f.write_all(data)
        .and_then(|()| f.sync_all())
        .map_err(|e| AuditError::io(&tmp, e))?;
    fs::rename(&tmp, path).map_err(|e| AuditError::io(path, e))?;
    if let Some(parent) = path.parent() {
        fsync_dir(parent);
    }
    Ok(())
}
