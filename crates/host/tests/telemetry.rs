//! Host telemetry on fixture trees (tests/fixtures/telemetry-v2 and telemetry-v1, written by
//! generate.py): a container under cgroup v2 with two fixture GPUs, a v1 container without
//! GPUs, and the doctor's hosts (no telemetry files beyond theirs: absent values, no panic).

use host::telemetry::Telemetry;
use std::path::{Path, PathBuf};

const GIB: u64 = 1 << 30;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[test]
fn process_values_come_from_proc_self() {
    let t = Telemetry::open(&fixture("telemetry-v2"));
    let p = t.sample().process;
    let ticks = 400.0 / 100.0;
    assert!((p.cpu_seconds.expect("stat readable") - ticks).abs() < 1e-9);
    assert_eq!(p.resident_bytes, Some(512_000 * 1024));
    assert_eq!(p.virtual_bytes, Some(2_048_000 * 1024));
    assert_eq!(p.threads, Some(12));
    assert_eq!(p.open_fds, Some(5));
    assert_eq!(p.max_fds, Some(65536));
}

#[test]
fn cgroup_v2_limits_usage_and_throttling() {
    let t = Telemetry::open(&fixture("telemetry-v2"));
    let s = t.sample();
    let c = &s.cgroup;
    assert_eq!(c.version, Some("v2"));
    assert_eq!(c.memory_usage_bytes, Some(3 * GIB));
    assert_eq!(c.memory_limit_bytes, Some(8 * GIB));
    assert_eq!(c.memory_inactive_file_bytes, Some(GIB / 4));
    assert_eq!(c.oom_kills, Some(1));
    assert_eq!(c.cpu_quota_cores, Some(2.0));
    assert_eq!(c.cpu_usage_seconds, Some(7.5));
    assert_eq!(c.cpu_periods, Some(1000));
    assert_eq!(c.cpu_throttled_periods, Some(40));
    assert_eq!(c.cpu_throttled_seconds, Some(1.25));
    // The cgroup's own PSI files win over the host's.
    assert_eq!(s.pressure_source, Some("cgroup"));
    assert_eq!(s.pressure.len(), 6);
    let memory_full = s
        .pressure
        .iter()
        .find(|p| p.resource == "memory" && p.kind == "full")
        .expect("memory full line");
    assert_eq!(memory_full.avg10_percent, 6.25);
    assert_eq!(memory_full.total_seconds, 1.5);
    assert_eq!(s.memory.total_bytes, Some(64 * GIB));
    assert_eq!(s.memory.available_bytes, Some(40 * GIB));
}

#[test]
fn cgroup_v1_falls_back_and_reads_no_limit_as_none() {
    let t = Telemetry::open(&fixture("telemetry-v1"));
    let s = t.sample();
    let c = &s.cgroup;
    assert_eq!(c.version, Some("v1"));
    assert_eq!(c.memory_usage_bytes, Some(GIB));
    assert_eq!(c.memory_inactive_file_bytes, Some(GIB / 8));
    assert_eq!(
        c.memory_limit_bytes, None,
        "page-rounded i64::MAX is no limit"
    );
    assert_eq!(c.cpu_quota_cores, Some(1.5));
    assert_eq!(c.cpu_periods, Some(500));
    assert_eq!(c.cpu_throttled_periods, Some(25));
    assert_eq!(c.cpu_throttled_seconds, Some(2.0));
    assert_eq!(c.cpu_usage_seconds, Some(3.0));
    assert_eq!(s.pressure_source, Some("host"));
    assert_eq!(s.pressure.len(), 6);
    // No nvml.json in the tree: no GPU readings, and a reason.
    assert!(s.gpus.is_empty());
    assert!(t.gpu_absent().is_some());
}

#[test]
fn gpus_answer_from_the_fixture() {
    let t = Telemetry::open(&fixture("telemetry-v2"));
    assert_eq!(t.gpus().len(), 2);
    assert_eq!(t.gpus()[0].uuid.as_deref(), Some("GPU-0000-fixture"));
    let s = t.sample();
    assert_eq!(s.gpus.len(), 2);
    let g = &s.gpus[0];
    assert_eq!(g.utilization_gpu_percent, Ok(93));
    assert_eq!(g.memory_used_bytes, Ok(60 * GIB));
    assert_eq!(g.memory_total_bytes, Ok(80 * GIB));
    assert_eq!(g.temperature_c, Ok(87));
    assert_eq!(g.power_usage_mw, Ok(650_000));
    assert_eq!(g.power_limit_mw, Ok(700_000));
    assert_eq!(g.sm_clock_mhz, Ok(1500));
    assert_eq!(g.sm_clock_max_mhz, Ok(1980));
    assert_eq!(g.clock_event_reasons, Ok(0x24));
    assert_eq!(g.pcie_current.clone().map(|l| (l.gen, l.width)), Ok((4, 8)));
    assert_eq!(g.pcie_max.clone().map(|l| (l.gen, l.width)), Ok((5, 16)));
    assert_eq!(g.ecc_corrected_volatile, Ok(12));
    assert_eq!(g.ecc_uncorrected_volatile, Ok(1));
    assert_eq!(g.xid_errors, Ok(2));
    // The second GPU answers only what its fixture holds.
    let other = &s.gpus[1];
    assert_eq!(other.temperature_c, Ok(40));
    assert!(other.utilization_gpu_percent.is_err());
    assert!(other.xid_errors.is_err());
}

#[test]
fn doctor_fixtures_give_partial_readings_without_panicking() {
    for name in ["healthy", "bare", "nvml-broken", "gpu-idle"] {
        let t = Telemetry::open(&fixture(name));
        let s = t.sample();
        if name == "bare" {
            assert_eq!(s.cgroup.version, None, "{name}");
            assert!(s.pressure.is_empty(), "{name}");
            assert_eq!(s.process.cpu_seconds, None, "{name}");
        }
        if name == "nvml-broken" {
            assert!(
                s.gpus.is_empty(),
                "{name}: NVML fails to load → no GPU readings"
            );
            assert!(t.gpu_absent().is_some(), "{name}");
        }
    }
    let healthy = Telemetry::open(&fixture("healthy")).sample();
    assert_eq!(healthy.cgroup.memory_limit_bytes, Some(100 * GIB));
    assert_eq!(healthy.pressure_source, Some("host"));
}
