//! The doctor on fixture trees (tests/fixtures/, written by generate.py): a healthy host, a
//! degraded one (the warning side of each check), a bad one (the error side), an empty one, an
//! idle GPU and a GPU whose NVML fails. Each tree is copied to a temporary directory first, so
//! the audit check's test writes never touch the source tree.

use host::{catalogue, Area, Check, Context, PortToCheck, ProbeTimings, Report, Status};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const GIB: u64 = 1 << 30;

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create fixture copy");
    for entry in std::fs::read_dir(from).expect("fixture tree exists") {
        let entry = entry.expect("readable entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy fixture file");
        }
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

fn fixture(name: &str) -> Fixture {
    let source = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let dir = tempfile::tempdir().expect("temp dir");
    let root = dir.path().join(name);
    copy_tree(&source, &root);
    Fixture { _dir: dir, root }
}

/// The ISA of a build with AVX-512, VNNI and AMX kernels, so every ISA check has something
/// to compare.
fn wide_isa() -> Vec<String> {
    ["avx2", "fma", "f16c", "avx512f", "avx512vnni", "amx-tile"]
        .into_iter()
        .map(String::from)
        .collect()
}

fn healthy_context(f: &Fixture) -> Context {
    Context {
        repository_dir: Some(f.root.join("srv/models")),
        repository_verification: Some(Ok("1 model, 1 version".into())),
        audit_dir: Some(f.root.join("var/lib/rampart/audit")),
        cache_dir: Some(f.root.join("var/cache/rampart")),
        threads: Some(4),
        kv_memory_bytes: Some(32 * GIB),
        grpc_max_message_bytes: Some(100 << 20),
        ports: vec![PortToCheck {
            name: "http".into(),
            addr: "127.0.0.1:0".parse().expect("literal address"),
        }],
        probes: Some(ProbeTimings {
            liveness_period_ms: Some(10_000),
            liveness_timeout_ms: Some(2_000),
            readiness_period_ms: Some(5_000),
            readiness_timeout_ms: Some(1_000),
            startup_budget_ms: Some(600_000),
            termination_grace_ms: Some(60_000),
            health_check_ms: Some(10),
            model_load_ms: Some(120_000),
            shutdown_timeout_ms: Some(30_000),
        }),
        kernel_isa: wide_isa(),
        cuda_required: Some("12.4".into()),
        gpu_load_sample: true,
        ..Context::at_root(&f.root)
    }
}

fn find<'a>(report: &'a Report, id: &str, subject: Option<&str>) -> &'a Check {
    report
        .check(id, subject)
        .unwrap_or_else(|| panic!("no check {id} {subject:?} in\n{}", report.render_text()))
}

fn expect(report: &Report, expected: &[(&str, Option<&str>, Status)]) {
    let mut wrong = Vec::new();
    for (id, subject, status) in expected {
        let check = find(report, id, *subject);
        if check.status != *status {
            wrong.push(format!(
                "{id} {subject:?}: {} (expected {status}): {}",
                check.status, check.observed
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{}\n\n{}",
        wrong.join("\n"),
        report.render_text()
    );
}

fn print_if_asked(report: &Report) {
    if std::env::var_os("RAMPART_DOCTOR_PRINT").is_some() {
        println!("{}", report.render_text());
    }
}

#[test]
fn a_healthy_host_is_all_ok() {
    let f = fixture("healthy");
    let report = host::run(&healthy_context(&f), None);
    print_if_asked(&report);
    let not_ok: Vec<String> = report
        .checks
        .iter()
        .filter(|c| c.status != Status::Ok)
        .map(|c| format!("{} {:?}: {} {}", c.id, c.subject, c.status, c.observed))
        .collect();
    assert!(not_ok.is_empty(), "{}", not_ok.join("\n"));
    assert_eq!(report.exit_code(), 0);
    assert!(report.fix_script().contains("# Nothing to fix."));
    // Every check of the catalogue ran.
    for spec in catalogue() {
        assert!(
            report.checks.iter().any(|c| c.id == spec.id),
            "{} did not run",
            spec.id
        );
    }
    assert_eq!(report.host.hostname.as_deref(), Some("gpu-host-01"));
    assert_eq!(report.host.gpus, 1);
}

fn degraded_context(f: &Fixture) -> Context {
    Context {
        repository_dir: Some(f.root.join("srv/models")),
        audit_dir: Some(f.root.join("var/lib/rampart/audit")),
        cache_dir: Some(f.root.join("var/cache/rampart")),
        threads: Some(6),
        kv_memory_bytes: Some(17 * GIB),
        grpc_max_message_bytes: Some(100 << 20),
        probes: Some(ProbeTimings {
            liveness_period_ms: Some(500),
            liveness_timeout_ms: Some(1_000),
            health_check_ms: Some(600),
            startup_budget_ms: Some(130_000),
            model_load_ms: Some(120_000),
            termination_grace_ms: Some(30_000),
            shutdown_timeout_ms: Some(30_000),
            ..ProbeTimings::default()
        }),
        kernel_isa: wide_isa(),
        cuda_required: Some("12.4".into()),
        gpu_load_sample: true,
        ..Context::at_root(&f.root)
    }
}

#[test]
fn a_degraded_host_warns() {
    use Status::{Ok, Warn};
    let f = fixture("degraded");
    let report = host::run(&degraded_context(&f), None);
    print_if_asked(&report);
    expect(
        &report,
        &[
            ("memory.transparent_hugepages", None, Ok),
            ("memory.swappiness", None, Ok),
            ("cpu.energy_preference", None, Ok),
            ("cpu.boost", None, Ok),
            ("cpu.cgroup_quota", None, Ok),
            ("numa.placement", None, Ok),
            ("numa.gpu_affinity", Some("gpu0"), Warn),
            ("storage.repository_space", None, Warn),
            ("storage.audit_space", None, Warn),
            ("storage.cache_space", None, Warn),
            ("storage.mount_options", Some("audit"), Warn),
            ("storage.mount_options", Some("repository"), Ok),
            ("limits.open_files", None, Warn),
            ("limits.locked_memory", None, Warn),
            ("limits.cgroup_version", None, Ok),
            ("limits.cgroup_memory", None, Warn),
            ("kernel.known_issues", None, Warn),
            ("kernel.tainted", None, Warn),
            ("kernel.version", None, Ok),
            ("gpu.driver_cuda", None, Warn),
            ("gpu.kernel_module", None, Ok),
            ("gpu.ecc_errors", Some("gpu0"), Warn),
            ("gpu.retired_pages", Some("gpu0"), Warn),
            ("gpu.row_remap", Some("gpu0"), Warn),
            ("gpu.pcie_link", Some("gpu0"), Warn),
            ("gpu.pcie_aer", Some("gpu0"), Warn),
            ("gpu.clock_events", Some("gpu0"), Warn),
            ("gpu.temperature", Some("gpu0"), Warn),
            ("gpu.xid", None, Warn),
            ("rampart.kv_memory", None, Warn),
            ("rampart.threads", None, Warn),
            ("rampart.probe_timings", None, Warn),
        ],
    );
    let errors: Vec<&Check> = report
        .checks
        .iter()
        .filter(|c| c.status == Status::Error)
        .collect();
    assert!(errors.is_empty(), "{errors:#?}");
    assert_eq!(report.exit_code(), 1);
    // The PCIe judgement is on the best reading, after an idle Gen1 one.
    assert!(find(&report, "gpu.pcie_link", Some("gpu0"))
        .observed
        .contains("best Gen3 x16 of Gen4 x16"));
}

struct Bad {
    _listener: std::net::TcpListener,
    context: Context,
    _fixture: Fixture,
}

fn bad_context() -> Bad {
    let f = fixture("bad");
    // A port some other process holds.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a port");
    let taken = listener.local_addr().expect("bound address");
    let context = Context {
        repository_dir: Some(f.root.join("srv/models")),
        repository_verification: Some(Err("smollm2-135m@1.0.0: model.gguf digest differs".into())),
        audit_dir: Some(f.root.join("var/lib/rampart/audit")),
        cache_dir: Some(f.root.join("var/cache/rampart")),
        threads: Some(16),
        kv_memory_bytes: Some(16 * GIB),
        grpc_max_message_bytes: Some(4 << 20),
        ports: vec![PortToCheck {
            name: "http".into(),
            addr: taken,
        }],
        probes: Some(ProbeTimings {
            liveness_timeout_ms: Some(1_000),
            health_check_ms: Some(1_500),
            startup_budget_ms: Some(60_000),
            model_load_ms: Some(120_000),
            ..ProbeTimings::default()
        }),
        kernel_isa: wide_isa(),
        cuda_required: Some("12.4".into()),
        gpu_load_sample: true,
        ..Context::at_root(&f.root)
    };
    Bad {
        _listener: listener,
        context,
        _fixture: f,
    }
}

#[test]
fn a_bad_host_fails() {
    use Status::{Error, Ok, Warn};
    let bad = bad_context();
    let report = host::run(&bad.context, None);
    print_if_asked(&report);
    expect(
        &report,
        &[
            ("memory.swap", None, Warn),
            ("memory.swappiness", None, Warn),
            ("memory.overcommit_memory", None, Warn),
            ("memory.transparent_hugepages", None, Warn),
            ("memory.thp_defrag", None, Warn),
            ("memory.hugepages", None, Warn),
            ("memory.numa_balancing", None, Warn),
            ("memory.oom_kills", None, Warn),
            ("memory.pressure", None, Warn),
            ("cpu.governor", None, Warn),
            ("cpu.energy_preference", None, Warn),
            ("cpu.boost", None, Warn),
            ("cpu.smt", None, Warn),
            ("cpu.isa_avx2", None, Warn),
            ("cpu.isa_avx512", None, Warn),
            ("cpu.isa_vnni", None, Warn),
            ("cpu.isa_amx", None, Warn),
            ("cpu.thermal_throttle", None, Warn),
            ("cpu.cgroup_quota", None, Error),
            ("cpu.pressure", None, Warn),
            ("numa.nodes", None, Warn),
            ("numa.placement", None, Warn),
            ("numa.zone_reclaim_mode", None, Warn),
            ("storage.scheduler", None, Warn),
            ("storage.read_ahead", None, Warn),
            ("storage.repository_space", None, Error),
            ("storage.audit_space", None, Error),
            ("storage.cache_space", None, Warn),
            ("storage.mount_options", Some("repository"), Warn),
            ("storage.mount_options", Some("audit"), Error),
            ("storage.mount_options", Some("cache"), Warn),
            ("storage.pressure", None, Warn),
            ("network.somaxconn", None, Warn),
            ("network.tcp_tw_reuse", None, Warn),
            ("network.tcp_fin_timeout", None, Warn),
            ("network.ip_local_port_range", None, Warn),
            ("network.netdev_max_backlog", None, Warn),
            ("network.offloads", Some("eth0"), Warn),
            ("limits.open_files", None, Error),
            ("limits.locked_memory", None, Warn),
            ("limits.max_map_count", None, Warn),
            ("limits.cgroup_version", None, Warn),
            ("limits.cgroup_memory", None, Error),
            ("kernel.version", None, Warn),
            ("kernel.known_issues", None, Error),
            ("kernel.boot_parameters", None, Warn),
            ("kernel.tainted", None, Error),
            ("kernel.clocksource", None, Warn),
            ("gpu.nvml", None, Ok),
            ("gpu.driver_cuda", None, Error),
            ("gpu.kernel_module", None, Error),
            ("gpu.persistence_mode", Some("gpu0"), Warn),
            ("gpu.persistence_mode", Some("gpu1"), Ok),
            ("gpu.ecc_mode", Some("gpu0"), Warn),
            ("gpu.ecc_errors", Some("gpu0"), Error),
            ("gpu.retired_pages", Some("gpu0"), Error),
            ("gpu.row_remap", Some("gpu0"), Error),
            ("gpu.pcie_link", Some("gpu0"), Ok),
            ("gpu.pcie_link", Some("gpu1"), Error),
            ("gpu.pcie_aer", Some("gpu0"), Warn),
            ("gpu.pcie_aer", Some("gpu1"), Error),
            ("gpu.nvlink", Some("gpu0"), Warn),
            ("gpu.nvlink", Some("gpu1"), Ok),
            ("gpu.clock_events", Some("gpu0"), Error),
            ("gpu.temperature", Some("gpu0"), Error),
            ("gpu.power", Some("gpu0"), Warn),
            ("gpu.mig", Some("gpu0"), Warn),
            ("gpu.xid", None, Error),
            ("rampart.kv_memory", None, Error),
            ("rampart.threads", None, Error),
            ("rampart.repository", None, Error),
            ("rampart.audit_dir", None, Error),
            ("rampart.ports", Some("http"), Error),
            ("rampart.grpc_message_limit", None, Warn),
            ("rampart.probe_timings", None, Error),
        ],
    );
    assert_eq!(report.exit_code(), 2);
}

/// Every check has a finding in the degraded or the bad tree, so no warn or error path is
/// left without a fixture.
#[test]
fn every_check_has_a_finding_in_some_fixture() {
    let degraded_fixture = fixture("degraded");
    let degraded = host::run(&degraded_context(&degraded_fixture), None);
    let bad = bad_context();
    let bad_report = host::run(&bad.context, None);
    let mut seen: BTreeMap<&str, Vec<Status>> = BTreeMap::new();
    for check in degraded.checks.iter().chain(bad_report.checks.iter()) {
        seen.entry(
            catalogue()
                .into_iter()
                .find(|s| s.id == check.id)
                .expect("known id")
                .id,
        )
        .or_default()
        .push(check.status);
    }
    // gpu.nvml has its error in the nvml-broken tree (a_gpu_nvml_cannot_see_is_an_error).
    let elsewhere = ["gpu.nvml"];
    let missing: Vec<&str> = catalogue()
        .into_iter()
        .map(|s| s.id)
        .filter(|id| !elsewhere.contains(id))
        .filter(|id| {
            !seen
                .get(id)
                .is_some_and(|s| s.iter().any(|s| matches!(s, Status::Warn | Status::Error)))
        })
        .collect();
    assert!(
        missing.is_empty(),
        "no warn or error fixture for {missing:?}"
    );
}

#[test]
fn pcie_at_x8_of_x16_without_the_load_sample_is_only_a_warning() {
    let bad = bad_context();
    let context = Context {
        gpu_load_sample: false,
        ..bad.context.clone()
    };
    let report = host::run(&context, Some(Area::Gpu));
    let link = find(&report, "gpu.pcie_link", Some("gpu1"));
    assert_eq!(link.status, Status::Warn, "{}", link.observed);
    assert!(
        link.observed.contains("x8 of Gen5 x16"),
        "{}",
        link.observed
    );
}

#[test]
fn throttling_names_its_reasons() {
    let bad = bad_context();
    let report = host::run(&bad.context, Some(Area::Gpu));
    let events = find(&report, "gpu.clock_events", Some("gpu0"));
    assert_eq!(events.status, Status::Error);
    assert!(
        events.observed.contains("hw_thermal_slowdown"),
        "{}",
        events.observed
    );
    assert!(
        events.observed.contains("sw_thermal_slowdown"),
        "{}",
        events.observed
    );
}

#[test]
fn an_idle_link_below_its_maximum_is_not_judged() {
    let f = fixture("gpu-idle");
    let report = host::run(&Context::at_root(&f.root), Some(Area::Gpu));
    print_if_asked(&report);
    let link = find(&report, "gpu.pcie_link", Some("gpu0"));
    assert_eq!(link.status, Status::Unknown, "{}", link.observed);
    assert!(link.observed.contains("while idle"), "{}", link.observed);
    // No ECC, MIG or NVLink on this GPU: not a finding.
    for id in ["gpu.ecc_mode", "gpu.mig", "gpu.nvlink"] {
        assert_eq!(find(&report, id, Some("gpu0")).status, Status::Ok);
    }
    assert_eq!(report.exit_code(), 0, "{}", report.render_text());
}

#[test]
fn a_gpu_nvml_cannot_see_is_an_error() {
    let f = fixture("nvml-broken");
    let report = host::run(&Context::at_root(&f.root), Some(Area::Gpu));
    let nvml = find(&report, "gpu.nvml", None);
    assert_eq!(nvml.status, Status::Error, "{}", nvml.observed);
    assert!(
        nvml.observed.contains("version mismatch"),
        "{}",
        nvml.observed
    );
}

#[test]
fn an_empty_tree_is_unknown_never_a_failure() {
    let f = fixture("bare");
    let report = host::run(&Context::at_root(&f.root), None);
    print_if_asked(&report);
    let findings: Vec<String> = report
        .checks
        .iter()
        .filter(|c| matches!(c.status, Status::Warn | Status::Error))
        .map(|c| format!("{}: {}", c.id, c.observed))
        .collect();
    assert!(findings.is_empty(), "{findings:#?}");
    assert_eq!(report.exit_code(), 0);
    let swappiness = find(&report, "memory.swappiness", None);
    assert_eq!(swappiness.status, Status::Unknown);
    assert_eq!(
        swappiness.observed,
        "not readable: /proc/sys/vm/swappiness (no such file)"
    );
    let xid = find(&report, "gpu.xid", None);
    assert!(
        xid.observed.starts_with("kernel log not readable"),
        "{}",
        xid.observed
    );
}

#[test]
fn the_fix_script_holds_the_commands_of_the_findings() {
    let bad = bad_context();
    let script = host::run(&bad.context, None).fix_script();
    assert!(script.starts_with("#!/bin/sh\n"));
    assert!(script.contains("sysctl -w vm.swappiness=1\n"));
    assert!(script.contains("echo 'vm.swappiness = 1' >> /etc/sysctl.d/90-rampart.conf\n"));
    assert!(script.contains("nvidia-smi -i 0 -pm 1\n"));
    assert!(script.contains("echo madvise > /sys/kernel/mm/transparent_hugepage/enabled\n"));
    assert!(script.contains("ethtool -K eth0 tso on gso on\n"));
    assert!(script.contains("# memory.swappiness (warn): 60\n"));
    // Nothing of what was fine.
    assert!(!script.contains("gpu.persistence_mode [gpu1]"));
    // A comment or a command on every line: nothing the shell would choke on.
    for line in script.lines() {
        assert!(
            !line.starts_with(' '),
            "indented line in the script: {line:?}"
        );
    }
}

#[test]
fn a_listening_port_inside_the_ephemeral_range_is_flagged() {
    let f = fixture("healthy");
    let context = Context {
        ports: vec![PortToCheck {
            name: "grpc".into(),
            addr: "0.0.0.0:45678".parse().expect("literal address"),
        }],
        ..Context::at_root(&f.root)
    };
    let report = host::run(&context, Some(Area::Network));
    let range = find(&report, "network.ip_local_port_range", None);
    assert_eq!(range.status, Status::Warn, "{}", range.observed);
    assert!(
        range.fix.contains("net.ipv4.ip_local_reserved_ports=45678"),
        "{}",
        range.fix
    );
}

#[test]
fn the_json_report_round_trips() {
    let bad = bad_context();
    let report = host::run(&bad.context, None);
    let json = serde_json::to_string_pretty(&report).expect("serialises");
    let back: Report = serde_json::from_str(&json).expect("deserialises");
    assert_eq!(back, report);
    let value: serde_json::Value = serde_json::from_str(&json).expect("valid JSON");
    assert_eq!(value["checks"][0]["status"], "warn");
    assert_eq!(value["checks"][0]["area"], "memory");
}

#[test]
fn the_fingerprint_of_a_fixture_names_its_gpus_and_links() {
    let f = fixture("healthy");
    let fingerprint = host::fingerprint(&Context::at_root(&f.root));
    assert_eq!(fingerprint.hostname.as_deref(), Some("gpu-host-01"));
    assert_eq!(fingerprint.os.as_deref(), Some("Ubuntu 22.04.4 LTS"));
    assert_eq!(fingerprint.cpu.physical_cores, Some(8));
    assert_eq!(fingerprint.cpu.sockets, Some(2));
    assert_eq!(fingerprint.numa_nodes, Some(2));
    assert_eq!(fingerprint.gpu_driver_version.as_deref(), Some("550.54.15"));
    assert_eq!(fingerprint.cuda_driver_version.as_deref(), Some("12.4"));
    let gpu = &fingerprint.gpus[0];
    assert_eq!(gpu.name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
    assert_eq!(gpu.pci_bus_id.as_deref(), Some("0000:3b:00.0"));
    assert_eq!(gpu.compute_capability.as_deref(), Some("9.0"));
    assert_eq!(gpu.numa_node, Some(0));
    let kinds: Vec<&str> = fingerprint.pcie.iter().map(|d| d.kind.as_str()).collect();
    assert_eq!(kinds, vec!["nic", "gpu"]);
    assert_eq!(
        fingerprint.pcie[1].max_link.as_deref(),
        Some("32.0 GT/s PCIe x16")
    );
}

#[test]
fn the_fingerprint_reads_as_one_line_and_as_a_table() {
    let f = fixture("healthy");
    let fingerprint = host::fingerprint(&Context::at_root(&f.root));
    let line = fingerprint.summary();
    assert!(!line.contains('\n'), "{line}");
    for fact in [
        "gpu-host-01",
        "Ubuntu 22.04.4 LTS",
        "2 NUMA nodes",
        "NVIDIA driver 550.54.15 (CUDA 12.4)",
        "gpu0 NVIDIA H100 80GB HBM3",
    ] {
        assert!(line.contains(fact), "{fact:?} not in {line}");
    }
    let text = fingerprint.render_text();
    assert!(text.starts_with("hardware fingerprint\n"), "{text}");
    assert!(text.contains("bus 0000:3b:00.0"), "{text}");
    assert!(text.contains("2 devices (GPUs, NICs, NVMe)"), "{text}");
    let bare = host::fingerprint(&Context::at_root(tempfile::tempdir().unwrap().path()));
    assert!(
        bare.summary().contains("no NVIDIA GPU"),
        "{}",
        bare.summary()
    );
    assert!(bare.render_text().contains("host       unknown"));
}

#[test]
fn every_check_is_documented() {
    let docs =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/doctor.md"))
            .expect("docs/doctor.md exists");
    let one_line = |text: &str| text.split_whitespace().collect::<Vec<_>>().join(" ");
    let docs = one_line(&docs);
    let stale: Vec<&str> = catalogue()
        .into_iter()
        .filter(|s| {
            !docs.contains(&format!("#### `{}`", s.id))
                || !docs.contains(&format!("**Expected:** {}", one_line(s.expected)))
                || !docs.contains(&format!("**Why:** {}", one_line(s.why)))
                || !docs.contains(&format!("**Reads:** {}", one_line(s.reads)))
        })
        .map(|s| s.id)
        .collect();
    assert!(
        stale.is_empty(),
        "missing or stale in docs/doctor.md: {stale:?}"
    );
}
