//! Runs the doctor on the machine the tests run on (a developer box, CI, a container): many
//! knobs may be absent there, which must read as `unknown`, never as a crash.

use host::{Area, Context, PortToCheck, ProbeTimings, Status};
use std::time::{Duration, Instant};

fn context(dir: &std::path::Path) -> Context {
    let repository = dir.join("models");
    std::fs::create_dir_all(&repository).expect("temp dir is writable");
    let audit = dir.join("audit");
    std::fs::create_dir_all(&audit).expect("temp dir is writable");
    Context {
        repository_dir: Some(repository),
        audit_dir: Some(audit),
        cache_dir: Some(dir.join("cache")),
        threads: Some(1),
        kv_memory_bytes: Some(64 << 20),
        grpc_max_message_bytes: Some(100 << 20),
        ports: vec![PortToCheck {
            name: "http".into(),
            addr: "127.0.0.1:0".parse().expect("literal address"),
        }],
        probes: Some(ProbeTimings {
            liveness_timeout_ms: Some(1000),
            liveness_period_ms: Some(10_000),
            health_check_ms: Some(5),
            ..ProbeTimings::default()
        }),
        ..Context::default()
    }
}

#[test]
fn the_real_host_gives_a_sane_report() {
    let dir = tempfile::tempdir().expect("temp dir");
    let report = host::run(&context(dir.path()), None);
    if std::env::var_os("RAMPART_DOCTOR_PRINT").is_some() {
        println!("{}", report.render_text());
    }
    assert!(report.checks.len() >= 40, "{} checks", report.checks.len());
    for area in Area::ALL {
        assert!(
            report.checks.iter().any(|c| c.area == area),
            "no check in {area}"
        );
    }
    for check in &report.checks {
        assert!(
            !check.observed.is_empty(),
            "{} has no observed text",
            check.id
        );
        assert!(!check.why.is_empty(), "{} has no why", check.id);
        if check.status == Status::Unknown {
            continue;
        }
        assert!(!check.expected.is_empty(), "{} has no expected", check.id);
    }
    // Things every Linux test machine has.
    assert!(report.host.kernel_release.is_some());
    assert!(report.host.memory_total_bytes.unwrap_or(0) > 0);
    let audit = report
        .check("rampart.audit_dir", None)
        .expect("audit check");
    assert_ne!(audit.status, Status::Unknown, "{}", audit.observed);
    let port = report
        .check("rampart.ports", Some("http"))
        .expect("port check");
    assert_eq!(port.status, Status::Ok, "{}", port.observed);
    let counts = report.counts;
    assert_eq!(
        counts.ok + counts.warn + counts.error + counts.unknown,
        report.checks.len()
    );
    assert!((0..=2).contains(&report.exit_code()));
    assert!(report.fix_script().starts_with("#!/bin/sh\n"));
}

#[test]
fn a_bare_context_runs_too() {
    let report = host::run(&Context::default(), None);
    assert!(report.checks.len() >= 40);
    let kv = report.check("rampart.kv_memory", None).expect("kv check");
    assert_eq!(kv.status, Status::Unknown);
}

/// A loose bound only: the 300 ms goal is measured by `cargo bench -p rampart-host`.
#[test]
fn a_run_without_the_gpu_load_sample_is_quick() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ctx = context(dir.path());
    host::run(&ctx, None);
    let start = Instant::now();
    host::run(&ctx, None);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "took {:?}",
        start.elapsed()
    );
}

#[test]
fn the_fingerprint_describes_this_machine() {
    let fingerprint = host::fingerprint(&Context::default());
    assert!(fingerprint.kernel_release.is_some());
    assert!(fingerprint.memory_total_bytes.unwrap_or(0) > 0);
    assert!(!fingerprint.arch.is_empty());
    if cfg!(target_arch = "x86_64") {
        assert!(!fingerprint.cpu.flags.is_empty());
    }
    let json = serde_json::to_string(&fingerprint).expect("serialises");
    let back: host::Fingerprint = serde_json::from_str(&json).expect("deserialises");
    assert_eq!(back, fingerprint);
}

#[test]
fn only_one_area_runs_only_that_area() {
    let report = host::run(&Context::default(), Some(Area::Memory));
    assert!(!report.checks.is_empty());
    assert!(report.checks.iter().all(|c| c.area == Area::Memory));
    assert_eq!(report.only, Some(Area::Memory));
}
