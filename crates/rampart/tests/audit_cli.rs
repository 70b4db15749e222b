//! `rampart audit …` on a local log: verify names the first bad entry after tampering and passes
//! on an untouched log; get, list, prove and export read exactly the right entries; queries by
//! anything but exact keys do not exist.

use std::path::Path;
use std::process::{Command, Output};

use audit::entry::Action;
use audit::{AuditEntry, AuditLog, LogOptions};

fn rampart(dir: &Path, args: &[&str]) -> Output {
    Command::new(assert_cmd::cargo::cargo_bin("rampart"))
        .arg("audit")
        .arg("--dir")
        .arg(dir)
        .args(args)
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// A log of `n` actions by two users' operators, with a sealed first half.
fn log(n: usize) -> (tempfile::TempDir, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let log = AuditLog::open(LogOptions::new(dir.path())).unwrap();
    let mut ids = Vec::new();
    for i in 0..n {
        let mut e = AuditEntry::action(
            Some("ops".into()),
            None,
            Some("smollm2".into()),
            Action {
                name: format!("drill.{i}"),
                target: None,
                cause: None,
                outcome: "ok".into(),
                detail: serde_json::Value::Null,
            },
        );
        e.user = match i % 3 {
            0 => Some("alice".into()),
            // As `[audit.redact] user = "hash"` stores it.
            1 => audit::entry::redact_string("carol", audit::RedactAction::Hash),
            _ => Some("bob".into()),
        };
        ids.push(e.audit_id.clone());
        log.append(vec![e]).unwrap();
        if i + 1 == n / 2 {
            log.checkpoint().unwrap();
            log.rotate().unwrap();
            log.seal_next().unwrap().unwrap();
        }
    }
    log.checkpoint().unwrap();
    (dir, ids)
}

#[test]
fn verify_passes_untouched_and_names_the_first_bad_entry_after_a_flipped_byte() {
    let (dir, ids) = log(12);
    let ok = rampart(dir.path(), &["verify"]);
    assert!(ok.status.success(), "{}", stdout(&ok));
    assert!(
        stdout(&ok).starts_with("ok: 12 entries, 1 sealed files"),
        "{}",
        stdout(&ok)
    );
    // Flip one byte inside entry 9 (in the active segment).
    let seg = std::fs::read_dir(dir.path().join("segments"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .max()
        .unwrap();
    let mut data = std::fs::read(&seg).unwrap();
    let needle = ids[9].as_bytes();
    let at = data
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap();
    data[at] ^= 0x01;
    std::fs::write(&seg, &data).unwrap();
    let bad = rampart(dir.path(), &["verify"]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(stdout(&bad).contains("FAILED: entry 9"), "{}", stdout(&bad));
    let json = rampart(dir.path(), &["verify", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(report["problem"]["index"], 9, "{report}");
}

#[test]
fn get_list_prove_and_export_read_exactly_the_right_entries() {
    let (dir, ids) = log(9);
    let got = rampart(dir.path(), &["get", &ids[4]]);
    assert!(got.status.success());
    let entry: serde_json::Value = serde_json::from_slice(&got.stdout).unwrap();
    assert_eq!(
        (entry["index"].as_u64(), entry["action"]["name"].as_str()),
        (Some(4), Some("drill.4"))
    );
    let missing = rampart(dir.path(), &["get", "not-an-id"]);
    assert!(!missing.status.success());
    let listed = rampart(dir.path(), &["list", "--user", "alice", "--json"]);
    let listed: Vec<serde_json::Value> = serde_json::from_slice(&listed.stdout).unwrap();
    let indices: Vec<u64> = listed
        .iter()
        .map(|e| e["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, [0, 3, 6]);
    // A hashed user id is found by the id itself.
    let carol = rampart(dir.path(), &["list", "--user", "carol", "--json"]);
    let carol: Vec<serde_json::Value> = serde_json::from_slice(&carol.stdout).unwrap();
    assert_eq!(carol.len(), 3);
    // Exact user ids only: a prefix finds nothing.
    let prefix = rampart(dir.path(), &["list", "--user", "ali", "--json"]);
    assert_eq!(stdout(&prefix).trim(), "[]");
    let proof = rampart(dir.path(), &["prove", &ids[7]]);
    let proof: serde_json::Value = serde_json::from_slice(&proof.stdout).unwrap();
    assert_eq!(proof["verified"], true, "{proof}");
    let out = dir.path().join("export.jsonl");
    let export = rampart(dir.path(), &["export", "--out", out.to_str().unwrap()]);
    assert!(export.status.success());
    assert_eq!(std::fs::read_to_string(&out).unwrap().lines().count(), 9);
}
