//! The shipper end to end against a real SeaweedFS (`weed mini`) with Object Lock: a local log is
//! filled, rotated and sealed, its sealed segments shipped, and then everything that matters is
//! checked on the server itself, not on what the shipper says it did:
//!
//! - every shipped object is COMPLIANCE-locked until now + the retention, cannot be deleted and its
//!   retention cannot be shortened;
//! - with the local log gone, a copy of the prefix verifies alone (signatures, roots, entries);
//! - a sealed file replaced on S3 (the old locked version stays, the forgery becomes current)
//!   fails that verification and the verifier names the file and an entry;
//! - S3 going away mid-life fails a round without marking anything shipped, and the next round
//!   after it comes back ships the segment;
//! - the per-request layout names one object per entry by its audit id;
//! - `delete_local_after_verify` leaves S3 the only copy of a shipped segment, and it verifies.
//!
//! Each test starts its own server (own ports and data directory), so they run in parallel; each
//! skips when `weed` is not installed, unless `RAMPART_REQUIRE_MODELS=1`.

use std::collections::BTreeSet;
use std::fs;
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use audit::config::ShipConfig;
use audit::read;
use audit::s3::{LockMode, ObjectLock, Retention, S3Client, S3Error};
use audit::seal::{self, Layout, Manifest};
use audit::ship::{download, remote_key, Round, Shipper, REMOTE_KEY};
use audit::testing_s3::SeaweedFs;
use audit::{Action, AuditEntry, AuditLog, LogOptions};

const DAY: Duration = Duration::from_secs(86_400);
/// How far a reported retain-until may be from now + the retention (shipping takes seconds).
const RETENTION_SLACK: Duration = Duration::from_secs(300);
/// Where the tests ship to in their bucket.
const PREFIX: &str = "audit/prod";
/// How long a killed server may take to stop answering.
const KILL_TIMEOUT_MS: u64 = 10_000;

/// One entry this test appended, as the test itself recorded it (not read back from the log).
#[derive(Debug, Clone)]
struct Appended {
    index: u64,
    audit_id: String,
    model: String,
    time_ms: u64,
}

fn action(model: Option<&str>, name: String) -> AuditEntry {
    AuditEntry::action(
        Some("svc:controller".into()),
        Some("alice".into()),
        model.map(str::to_string),
        Action {
            name,
            target: model.map(|m| format!("model/{m}")),
            cause: Some("drill".into()),
            outcome: "ok".into(),
            detail: serde_json::json!({ "replicas": 2 }),
        },
    )
}

/// Appends one batch (one group commit) of `n` entries cycling through `models`.
fn append_batch(log: &AuditLog, models: &[Option<&str>], n: usize, tag: &str) -> Vec<Appended> {
    let entries: Vec<AuditEntry> = (0..n)
        .map(|i| action(models[i % models.len()], format!("{tag}.{i}")))
        .collect();
    let recorded: Vec<(String, String, u64)> = entries
        .iter()
        .map(|e| (e.audit_id.clone(), e.model.clone(), e.time_ms))
        .collect();
    let indices = log.append(entries).expect("append a batch");
    assert_eq!(indices.len(), n, "one index per appended entry");
    indices
        .into_iter()
        .zip(recorded)
        .map(|(index, (audit_id, model, time_ms))| Appended {
            index,
            audit_id,
            model,
            time_ms,
        })
        .collect()
}

/// Closes the active segment and seals it; the manifest must cover exactly `entries`.
fn rotate_and_seal(log: &AuditLog, entries: &[Appended]) -> Manifest {
    log.checkpoint().expect("checkpoint");
    log.rotate().expect("rotate");
    let manifest = log
        .seal_next()
        .expect("seal")
        .expect("the rotated segment waits for sealing");
    assert_eq!(manifest.first, entries[0].index);
    assert_eq!(manifest.end, entries[entries.len() - 1].index + 1);
    assert_eq!(
        log.seal_next().expect("seal again"),
        None,
        "one segment was closed"
    );
    manifest
}

/// `YYYY/MM/DD` (UTC) of a time in ms: computed here from the civil calendar, not by the library.
fn utc_date(time_ms: u64) -> String {
    let days = (time_ms / 86_400_000) as i64;
    // Howard Hinnant's days_from_civil, inverted: shift to an era starting 0000-03-01.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z - era * 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!("{year:04}/{month:02}/{day:02}")
}

/// The remote keys of one sealed segment in the segment layout: one Parquet file per model,
/// `<model>/YYYY/MM/DD/<first>-<last>.parquet` (the date of that model's first entry), and the
/// manifest.
fn segment_layout_keys(segment: &[Appended]) -> Vec<String> {
    let mut models: Vec<&str> = Vec::new();
    for e in segment {
        if !models.contains(&e.model.as_str()) {
            models.push(&e.model);
        }
    }
    let mut keys: Vec<String> = models
        .iter()
        .map(|model| {
            let of_model: Vec<&Appended> = segment.iter().filter(|e| e.model == *model).collect();
            let first = of_model[0];
            let last = of_model[of_model.len() - 1];
            format!(
                "{PREFIX}/{model}/{}/{:020}-{:020}.parquet",
                utc_date(first.time_ms),
                first.index,
                last.index
            )
        })
        .collect();
    keys.push(format!("{PREFIX}/_manifests/{:020}.json", segment[0].index));
    keys
}

fn ship_config() -> ShipConfig {
    ShipConfig {
        retention_days: 1,
        ..Default::default()
    }
}

/// A server and a client of a fresh lock-enabled bucket on it; `None` when `weed` is absent.
async fn locked_bucket(bucket: &str) -> Option<(SeaweedFs, S3Client)> {
    let weed = SeaweedFs::start()?;
    let client = S3Client::new(weed.config(bucket)).expect("valid S3 config");
    client
        .create_bucket(true)
        .await
        .expect("create a lock-enabled bucket");
    Some((weed, client))
}

/// Asserts a refusal: an HTTP 4xx answer (never a transport error or success).
fn assert_refused<T: std::fmt::Debug>(outcome: Result<T, S3Error>, what: &str) {
    let err = outcome.expect_err(what);
    assert!(
        err.status().is_some_and(|s| (400..500).contains(&s)),
        "{what}: expected a 4xx refusal, got {err}"
    );
}

/// A round that must ship everything pending without failure.
async fn ship_all(shipper: &Shipper, segments: usize, objects: usize) {
    let round = shipper.round().await;
    assert_eq!(
        round,
        Round {
            segments,
            objects,
            failure: None
        },
        "the round ships every pending segment"
    );
    assert!(
        shipper.pending().expect("read pending").is_empty(),
        "nothing waits after a full round"
    );
}

/// Downloads the prefix into a fresh directory and verifies it there with its own `_key.pub`.
async fn verify_from_s3(client: &S3Client) -> (tempfile::TempDir, read::Log, usize) {
    let copy = tempfile::tempdir().expect("tempdir");
    let copied = download(client, PREFIX, copy.path())
        .await
        .expect("download the shipped prefix");
    let log = read::load(copy.path(), None);
    (copy, log, copied)
}

/// The pids of the processes running this server (matched by its unique data directory).
fn server_pids(weed: &SeaweedFs) -> Vec<u32> {
    let marker = format!("-dir={}", weed.dir().join("data").display());
    let Ok(proc_dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    proc_dir
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                cmdline
                    .split(|b| *b == 0)
                    .any(|arg| arg == marker.as_bytes())
            })
        })
        .collect()
}

fn s3_port(weed: &SeaweedFs) -> u16 {
    weed.endpoint
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("the endpoint ends with a port")
}

/// S3 going away without notice: SIGKILL the server's own process (by pid, which this test
/// started) and wait until its port refuses connections. `restart` reaps it and starts it again
/// on the same data and ports.
fn kill_server(weed: &SeaweedFs) {
    let pids = server_pids(weed);
    assert!(
        !pids.is_empty(),
        "found the weed process of {}",
        weed.endpoint
    );
    for pid in &pids {
        let killed = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(killed.success(), "kill -KILL {pid}");
    }
    let port = s3_port(weed);
    let deadline = Instant::now() + Duration::from_millis(KILL_TIMEOUT_MS);
    while TcpStream::connect(("127.0.0.1", port)).is_ok() {
        assert!(Instant::now() < deadline, "S3 still answers after SIGKILL");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn within(reported: SystemTime, expected: SystemTime, slack: Duration) -> bool {
    let diff = reported
        .duration_since(expected)
        .or_else(|_| expected.duration_since(reported))
        .unwrap_or(Duration::MAX);
    diff <= slack
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_segments_ship_with_compliance_retention_and_verify_from_s3_alone() {
    let Some((_weed, client)) = locked_bucket("audit-ship").await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = AuditLog::open(LogOptions::new(dir.path())).expect("open the log");
    let models = [Some("smollm2"), Some("qwen2.5-0.5b"), None];

    // Segment one: four group commits across two models and model-less actions.
    let mut first = Vec::new();
    for batch in 0..4 {
        first.extend(append_batch(&log, &models, 8, &format!("s1b{batch}")));
        log.checkpoint().expect("checkpoint");
    }
    let first_manifest = rotate_and_seal(&log, &first);
    // Segment two: only the two models, in different proportions.
    let mut second = Vec::new();
    for batch in 0..3 {
        second.extend(append_batch(
            &log,
            &[Some("qwen2.5-0.5b"), Some("smollm2"), Some("smollm2")],
            10,
            &format!("s2b{batch}"),
        ));
        if batch != 1 {
            log.checkpoint().expect("checkpoint");
        }
    }
    let second_manifest = rotate_and_seal(&log, &second);
    // Entries still in the active segment are not sealed, so never shipped.
    let unsealed = append_batch(&log, &models, 4, "active");
    log.checkpoint().expect("checkpoint");
    let sealed: Vec<Appended> = first.iter().chain(&second).cloned().collect();
    assert_eq!(sealed.len(), 62);
    assert_eq!(first_manifest.files.len(), 3, "one file per model");
    assert_eq!(second_manifest.files.len(), 2, "one file per model");
    let sealed_files = first_manifest.files.len() + second_manifest.files.len();

    let shipper = Shipper::with_client(dir.path(), client.clone(), PREFIX.into(), &ship_config());
    assert_eq!(
        shipper
            .pending()
            .expect("pending")
            .iter()
            .map(|m| m.first)
            .collect::<Vec<_>>(),
        [0, first_manifest.end]
    );
    // Each segment: its Parquet files, then its manifest (the public key is not counted).
    ship_all(&shipper, 2, sealed_files + 2).await;
    assert_eq!(
        shipper.round().await,
        Round::default(),
        "a second round finds nothing to ship"
    );

    // The remote layout: exactly the sealed files and manifests under the prefix, and the key.
    let mut expected: BTreeSet<String> = segment_layout_keys(&first)
        .into_iter()
        .chain(segment_layout_keys(&second))
        .collect();
    expected.insert(remote_key(PREFIX, REMOTE_KEY));
    let keys = client
        .list(&format!("{PREFIX}/"))
        .await
        .expect("list the prefix");
    assert_eq!(keys.iter().cloned().collect::<BTreeSet<_>>(), expected);
    assert_eq!(keys.len(), sealed_files + 2 + 1);
    for file in first_manifest.files.iter().chain(&second_manifest.files) {
        assert!(
            keys.contains(&remote_key(PREFIX, &file.path)),
            "{} is shipped under the prefix",
            file.path
        );
    }

    // WORM on the server: every object COMPLIANCE-locked for a day, undeletable, unshortenable.
    let now = SystemTime::now();
    for key in &keys {
        let meta = client
            .head_object(key)
            .await
            .expect("head")
            .unwrap_or_else(|| panic!("{key} exists"));
        assert_eq!(meta.lock_mode, Some(LockMode::Compliance), "{key}");
        assert_eq!(meta.legal_hold, Some(false), "{key}: no legal hold asked");
        let retain_until = meta
            .retain_until
            .unwrap_or_else(|| panic!("{key} reports a retain-until date"));
        assert!(
            within(retain_until, now + DAY, RETENTION_SLACK),
            "{key}: retained until {retain_until:?}, expected about now + 1 day"
        );
        let version = meta
            .version_id
            .unwrap_or_else(|| panic!("{key}: a lock-enabled bucket is versioned"));
        let retention = client
            .get_retention(key, Some(&version))
            .await
            .expect("get retention")
            .unwrap_or_else(|| panic!("{key} has a retention"));
        assert_eq!(retention.mode, LockMode::Compliance, "{key}");
        assert_refused(
            client.delete_object(key, Some(&version)).await,
            &format!("deleting the locked version of {key} must be refused"),
        );
        assert_refused(
            client
                .put_retention(
                    key,
                    Some(&version),
                    &Retention {
                        mode: LockMode::Compliance,
                        retain_until: now + Duration::from_secs(3_600),
                    },
                )
                .await,
            &format!("shortening the retention of {key} must be refused"),
        );
        let after = client
            .head_object(key)
            .await
            .expect("head after the refusals")
            .unwrap_or_else(|| panic!("{key} is still there"));
        assert_eq!(after.version_id.as_deref(), Some(version.as_str()), "{key}");
        assert_eq!(after.retain_until, Some(retain_until), "{key}");
    }

    // The local log is gone; what S3 holds verifies alone.
    drop(shipper);
    drop(log);
    let dir_path = dir.path().to_path_buf();
    drop(dir);
    assert!(!dir_path.exists(), "the local log directory is deleted");
    let (_copy, restored, copied) = verify_from_s3(&client).await;
    assert_eq!(copied, keys.len(), "every shipped object is downloaded");
    assert_eq!(restored.problem, None, "the shipped copy verifies");
    let report = restored.report();
    assert!(report.ok);
    assert_eq!(report.entries, sealed.len() as u64);
    assert_eq!(report.sealed_files, sealed_files);
    assert_eq!(report.checkpoints, 2, "each manifest's signed checkpoint");
    assert_eq!(
        report.newest_checkpoint.map(|c| c.size),
        Some(second_manifest.end)
    );
    let restored_ids: Vec<&str> = restored
        .entries
        .iter()
        .map(|l| l.entry.audit_id.as_str())
        .collect();
    let appended_ids: Vec<&str> = sealed.iter().map(|e| e.audit_id.as_str()).collect();
    assert_eq!(restored_ids, appended_ids, "every sealed entry, in order");
    for e in &unsealed {
        assert!(
            restored.get(&e.audit_id).is_none(),
            "an unsealed entry is not shipped"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_object_on_s3_fails_verification() {
    let Some((_weed, client)) = locked_bucket("audit-forged").await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = AuditLog::open(LogOptions::new(dir.path())).expect("open the log");
    let mut first = Vec::new();
    for batch in 0..2 {
        first.extend(append_batch(
            &log,
            &[Some("smollm2"), Some("phi-3")],
            10,
            &format!("b{batch}"),
        ));
    }
    let first_manifest = rotate_and_seal(&log, &first);
    let second = append_batch(&log, &[Some("smollm2"), Some("phi-3")], 10, "c");
    let second_manifest = rotate_and_seal(&log, &second);
    let shipper = Shipper::with_client(dir.path(), client.clone(), PREFIX.into(), &ship_config());
    let objects = first_manifest.files.len() + second_manifest.files.len() + 2;
    ship_all(&shipper, 2, objects).await;
    let (_copy, before, _) = verify_from_s3(&client).await;
    assert_eq!(
        before.problem, None,
        "the shipped copy verifies before the forgery"
    );

    // The forger: the second segment's phi-3 file, one entry's bytes changed (the model's answer
    // turned from ok to denied) with its leaf hash recomputed so the row itself looks sound.
    let target = second_manifest
        .files
        .iter()
        .find(|f| f.model == "phi-3")
        .expect("the second segment has a phi-3 file");
    let key = remote_key(PREFIX, &target.path);
    let original = fs::read(dir.path().join("sealed").join(&target.path)).expect("the sealed file");
    let original_version = client
        .head_object(&key)
        .await
        .expect("head")
        .expect("shipped")
        .version_id
        .expect("versioned");
    let mut rows = seal::read(original.clone()).expect("read the sealed rows");
    assert!(rows.len() >= 3, "a file with rows around the forged one");
    let forged_at = 2;
    let mut entry = AuditEntry::decode(&rows[forged_at].entry).expect("decode the entry");
    let forged_index = entry.index;
    entry.action.as_mut().expect("an action entry").outcome = "denied".into();
    rows[forged_at].entry = entry.encode();
    rows[forged_at].leaf_hash = audit::merkle::leaf_hash(&rows[forged_at].entry);
    let forged = seal::write(&rows).expect("write the forged file");
    assert_ne!(forged, original);
    // An attacker with write access can lock the forgery too; download accepts only locked
    // objects, so this is the forgery that gets as far as the verifier.
    let put = client
        .put_object(
            &key,
            forged.clone(),
            Some(&ObjectLock {
                mode: LockMode::Compliance,
                retain_until: SystemTime::now() + DAY,
                legal_hold: false,
            }),
        )
        .await
        .expect("S3 accepts a new version over a locked one");
    let forged_version = put.version_id.expect("a new version id");
    assert_ne!(forged_version, original_version);
    assert_eq!(client.get_object(&key).await.expect("get"), forged);

    let (_copy, after, _) = verify_from_s3(&client).await;
    let problem = after
        .problem
        .clone()
        .expect("a replaced sealed file fails verification");
    eprintln!("verifier on the forged copy: {problem}");
    assert!(problem.message.contains("replaced"), "{problem}");
    assert!(problem.message.contains(&target.path), "{problem}");
    assert!(problem.message.contains("sha256"), "{problem}");
    // The verifier names the first entry of the replaced file: which of its rows changed cannot
    // be told from the manifest (it holds one digest per file), only that the file did.
    let file_indices: Vec<u64> = rows.iter().map(|r| r.index).collect();
    let file_first = *file_indices.iter().min().expect("rows");
    assert_eq!(problem.index, Some(file_first), "{problem}");
    assert!(file_first <= forged_index);
    assert!(
        file_first >= second_manifest.first,
        "the problem lies in the second segment"
    );
    assert!(!after.report().ok);
    // Nothing after the problem counts as verified; the first segment still does.
    assert!(after.entries.len() as u64 >= first_manifest.end);
    assert!(after.entries.len() as u64 <= file_first);

    // S3 kept the original: still readable by its version, still locked.
    assert_eq!(
        client
            .get_object_version(&key, Some(&original_version))
            .await
            .expect("the original version is still readable"),
        original
    );
    let old = client
        .head_object_version(&key, Some(&original_version))
        .await
        .expect("head the original version")
        .expect("the original version is still there");
    assert_eq!(old.lock_mode, Some(LockMode::Compliance));
    assert_refused(
        client.delete_object(&key, Some(&original_version)).await,
        "the original version stays locked",
    );
    drop(log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shipping_survives_s3_going_away() {
    let Some((mut weed, client)) = locked_bucket("audit-outage").await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = AuditLog::open(LogOptions::new(dir.path())).expect("open the log");
    let models = [Some("smollm2"), Some("qwen2.5-0.5b")];
    let first = append_batch(&log, &models, 12, "before");
    let first_manifest = rotate_and_seal(&log, &first);
    let shipper = Shipper::with_client(dir.path(), client.clone(), PREFIX.into(), &ship_config());
    ship_all(&shipper, 1, first_manifest.files.len() + 1).await;

    let second = append_batch(&log, &models, 12, "during");
    let second_manifest = rotate_and_seal(&log, &second);
    let shipped_before = fs::read_to_string(dir.path().join("shipped.jsonl")).expect("shipped");

    kill_server(&weed);
    let round = shipper.round().await;
    let failure = round
        .failure
        .clone()
        .expect("a round without S3 reports a failure");
    eprintln!("round without S3: {failure}");
    assert_eq!((round.segments, round.objects), (0, 0), "{round:?}");
    assert_eq!(
        shipper
            .pending()
            .expect("pending")
            .iter()
            .map(|m| m.first)
            .collect::<Vec<_>>(),
        [second_manifest.first],
        "the segment is still pending"
    );
    assert_eq!(
        fs::read_to_string(dir.path().join("shipped.jsonl")).expect("shipped"),
        shipped_before,
        "nothing was marked shipped"
    );
    for file in &second_manifest.files {
        assert!(
            dir.path().join("sealed").join(&file.path).is_file(),
            "{} stays local",
            file.path
        );
    }

    // Back on the same data and ports: the next round ships the segment.
    weed.restart();
    ship_all(&shipper, 1, second_manifest.files.len() + 1).await;
    drop(log);
    drop(shipper);
    let (_copy, restored, _) = verify_from_s3(&client).await;
    assert_eq!(restored.problem, None, "the shipped copy verifies");
    assert_eq!(restored.entries.len(), first.len() + second.len());
    assert_eq!(
        restored.sealed_files,
        first_manifest.files.len() + second_manifest.files.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_layout_ships_one_object_per_entry_named_by_audit_id() {
    let Some((_weed, client)) = locked_bucket("audit-requests").await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = AuditLog::open(LogOptions {
        layout: Layout::Request,
        ..LogOptions::new(dir.path())
    })
    .expect("open the log");
    let models = [Some("smollm2"), Some("qwen2.5-0.5b"), Some("smollm2")];
    let mut entries = append_batch(&log, &models, 7, "a");
    entries.extend(append_batch(&log, &models, 5, "b"));
    let manifest = rotate_and_seal(&log, &entries);
    assert_eq!(manifest.files.len(), entries.len(), "one file per entry");
    assert!(manifest.files.iter().all(|f| f.rows == 1));
    let shipper = Shipper::with_client(dir.path(), client.clone(), PREFIX.into(), &ship_config());
    ship_all(&shipper, 1, entries.len() + 1).await;

    let mut expected: BTreeSet<String> = entries
        .iter()
        .map(|e| {
            format!(
                "{PREFIX}/{}/{}/{}.parquet",
                e.model,
                utc_date(e.time_ms),
                e.audit_id
            )
        })
        .collect();
    expected.insert(format!("{PREFIX}/_manifests/{:020}.json", 0));
    expected.insert(remote_key(PREFIX, REMOTE_KEY));
    let keys = client
        .list(&format!("{PREFIX}/"))
        .await
        .expect("list the prefix");
    assert_eq!(keys.iter().cloned().collect::<BTreeSet<_>>(), expected);
    // Each object holds exactly its own entry.
    for e in &entries {
        let key = format!(
            "{PREFIX}/{}/{}/{}.parquet",
            e.model,
            utc_date(e.time_ms),
            e.audit_id
        );
        let rows = seal::read(client.get_object(&key).await.expect("get")).expect("parquet");
        assert_eq!(rows.len(), 1, "{key}");
        assert_eq!(
            (rows[0].index, rows[0].audit_id.as_str()),
            (e.index, e.audit_id.as_str())
        );
    }

    drop(shipper);
    drop(log);
    drop(dir);
    let (_copy, restored, copied) = verify_from_s3(&client).await;
    assert_eq!(copied, keys.len());
    assert_eq!(restored.problem, None, "the shipped copy verifies");
    assert_eq!(restored.entries.len(), entries.len());
    assert_eq!(restored.sealed_files, entries.len());
    let ids: Vec<&str> = restored
        .entries
        .iter()
        .map(|l| l.entry.audit_id.as_str())
        .collect();
    let appended: Vec<&str> = entries.iter().map(|e| e.audit_id.as_str()).collect();
    assert_eq!(ids, appended, "every entry, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_local_copies_after_verify_leaves_s3_the_only_copy() {
    let Some((_weed, client)) = locked_bucket("audit-delete-local").await else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let log = AuditLog::open(LogOptions::new(dir.path())).expect("open the log");
    let entries = append_batch(&log, &[Some("smollm2"), Some("phi-3")], 10, "x");
    let manifest = rotate_and_seal(&log, &entries);
    let config = ShipConfig {
        delete_local_after_verify: true,
        ..ship_config()
    };
    let shipper = Shipper::with_client(dir.path(), client.clone(), PREFIX.into(), &config);
    ship_all(&shipper, 1, manifest.files.len() + 1).await;
    for file in &manifest.files {
        assert!(
            !dir.path().join("sealed").join(&file.path).exists(),
            "{} is removed once its remote copy is verified",
            file.path
        );
    }
    let (_copy, restored, _) = verify_from_s3(&client).await;
    assert_eq!(restored.problem, None, "the shipped copy verifies");
    assert_eq!(restored.entries.len(), entries.len());

    // The running log's lookup of a shipped entry says where it is.
    let lookup = log.get(&entries[3].audit_id);
    assert!(
        matches!(&lookup, Err(audit::AuditError::NotFound(m)) if m.contains("S3 only")),
        "{lookup:?}"
    );
    drop(shipper);
    drop(log);
    // The log opens again: the segment's local index stands in for the removed files.
    let reopened = AuditLog::open(LogOptions::new(dir.path()));
    assert!(
        reopened.is_ok(),
        "the log opens again after shipping removed its files: {:?}",
        reopened.err()
    );
    let reopened = reopened.unwrap();
    assert_eq!(reopened.status().size, entries.len() as u64);
    let lookup = reopened.get(&entries[3].audit_id);
    assert!(
        matches!(&lookup, Err(audit::AuditError::NotFound(m)) if m.contains("S3 only")),
        "{lookup:?}"
    );
    drop(reopened);
}
