//! `rampart doctor` as a user runs it: on the host crate's fixture trees (`--root`, with a
//! configuration for the Rampart checks) the exit code follows the worst finding, `--json`
//! holds every check, `--only` and `--fix-script` do what they say, `--verify` catches a
//! changed file; and on this machine it answers without crashing, whatever it finds.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use formats::tiny::TinyLlama;

fn doctor(args: &[&str]) -> Output {
    let cwd = tempfile::tempdir().unwrap();
    Command::new(assert_cmd::cargo::cargo_bin("rampart"))
        .arg("doctor")
        .args(args)
        .current_dir(cwd.path())
        .env_remove("RAMPART_REPO")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).to_string()
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited, not killed")
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn model(kv_cache_memory: &str) -> String {
    format!("[[models]]\nname = \"fixture\"\nkv_cache_memory = \"{kv_cache_memory}\"\n")
}

/// A fixture tree copied to a temporary directory (the audit check writes in it), with a
/// server configuration whose repository and audit directory are the tree's.
struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    config: PathBuf,
}

impl Fixture {
    /// `settings` go at the top of the configuration, `models` at its end.
    fn new(name: &str, settings: &str, grpc_max_message_bytes: u64, models: &str) -> Fixture {
        let source = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../host/tests/fixtures")
            .join(name);
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join(name);
        copy_tree(&source, &root);
        let config = dir.path().join("rampart.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:0\"\nrepo = {:?}\n{settings}\n\n\
                 [grpc]\nlisten = \"127.0.0.1:0\"\nmax_message_bytes = {grpc_max_message_bytes}\n\n\
                 [audit]\ndir = {:?}\n\n{models}",
                root.join("srv/models"),
                root.join("var/lib/rampart/audit"),
            ),
        )
        .unwrap();
        Fixture {
            _dir: dir,
            root,
            config,
        }
    }

    /// The Rampart settings of the host crate's healthy context (tests/fixture_hosts.rs).
    fn healthy() -> Fixture {
        Fixture::new("healthy", "threads = 4", 100 << 20, &model("32GiB"))
    }

    fn degraded() -> Fixture {
        Fixture::new("degraded", "threads = 6", 100 << 20, &model("17GiB"))
    }

    fn bad() -> Fixture {
        Fixture::new("bad", "threads = 16", 4 << 20, &model("16GiB"))
    }

    fn run(&self, args: &[&str]) -> Output {
        let mut all = vec![
            "--root",
            self.root.to_str().unwrap(),
            "--config",
            self.config.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        doctor(&all)
    }
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// The checks that are not ok or unknown, for a failure message.
fn findings(report: &serde_json::Value) -> Vec<String> {
    report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["status"] == "warn" || c["status"] == "error")
        .map(|c| {
            format!(
                "{} {} {}: {}",
                c["status"], c["id"], c["subject"], c["observed"]
            )
        })
        .collect()
}

#[test]
fn the_exit_code_is_0_on_a_healthy_tree_1_on_a_degraded_one_2_on_a_bad_one() {
    for (fixture, expected) in [
        (Fixture::healthy(), 0),
        (Fixture::degraded(), 1),
        (Fixture::bad(), 2),
    ] {
        let out = fixture.run(&["--json"]);
        let report = json(&out);
        assert_eq!(
            code(&out),
            expected,
            "{}: {:#?}",
            fixture.root.display(),
            findings(&report)
        );
        // The text report says the same.
        let text = fixture.run(&[]);
        assert_eq!(code(&text), expected);
        // A pod's init container fails on errors only; `never` reports and passes.
        let init = fixture.run(&["--fail-on", "error"]);
        assert_eq!(code(&init), if expected == 2 { 2 } else { 0 });
        let counts = |o: &Output| {
            stdout(o)
                .lines()
                .last()
                .unwrap()
                .split(" in ")
                .next()
                .unwrap()
                .to_string()
        };
        assert_eq!(counts(&init), counts(&text), "the same report");
        assert_eq!(code(&fixture.run(&["--fail-on", "never"])), 0);
        assert!(
            stdout(&text).starts_with("rampart doctor (root "),
            "{}",
            stdout(&text)
        );
    }
    // Unknowns (an empty tree: nothing readable) are not findings.
    let bare = Fixture::new("bare", "", 100 << 20, "");
    let report = json(&bare.run(&["--json", "--only", "memory"]));
    assert!(report["counts"]["unknown"].as_u64().unwrap() > 0);
    assert_eq!(code(&bare.run(&["--only", "memory"])), 0);
}

#[test]
fn json_holds_every_check_of_the_catalogue_and_the_rampart_inputs() {
    let fixture = Fixture::healthy();
    let report = json(&fixture.run(&["--json"]));
    assert_eq!(report["schema_version"], host::SCHEMA_VERSION);
    assert_eq!(report["host"]["hostname"], "gpu-host-01");
    let checks = report["checks"].as_array().unwrap();
    for spec in host::catalogue() {
        assert!(
            checks.iter().any(|c| c["id"] == spec.id),
            "{} missing",
            spec.id
        );
    }
    // The Rampart checks were fed from the configuration.
    let check = |id: &str| {
        checks
            .iter()
            .find(|c| c["id"] == id)
            .unwrap_or_else(|| panic!("no {id}"))
    };
    for id in [
        "rampart.kv_memory",
        "rampart.threads",
        "rampart.repository",
        "rampart.audit_dir",
        "rampart.grpc_message_limit",
    ] {
        assert_eq!(check(id)["status"], "ok", "{}", check(id));
    }
    assert!(check("rampart.kv_memory")["observed"]
        .as_str()
        .unwrap()
        .contains("KV cache 32.0 GiB"));
    let ports: Vec<&str> = checks
        .iter()
        .filter(|c| c["id"] == "rampart.ports")
        .map(|c| c["subject"].as_str().unwrap())
        .collect();
    assert_eq!(ports, ["http", "grpc"]);
    // The report deserialises as the library's type.
    let typed: host::Report = serde_json::from_value(report).unwrap();
    assert_eq!(typed.exit_code(), 0);
}

#[test]
fn only_memory_runs_the_memory_checks_alone() {
    let fixture = Fixture::bad();
    let out = fixture.run(&["--json", "--only", "memory"]);
    let report = json(&out);
    assert_eq!(report["only"], "memory");
    let checks = report["checks"].as_array().unwrap();
    assert!(checks.len() > 5);
    assert!(checks.iter().all(|c| c["area"] == "memory"), "{report}");
    assert!(checks.iter().any(|c| c["id"] == "memory.swappiness"));
    // Warnings only in the bad tree's memory area.
    assert_eq!(code(&out), 1);
    let text = stdout(&fixture.run(&["--only", "MEMORY"]));
    assert!(
        text.contains("\nMEMORY\n") && !text.contains("\nCPU\n"),
        "{text}"
    );
    // An area that does not exist is refused, naming the ones that do.
    let wrong = fixture.run(&["--only", "disk"]);
    assert_eq!(code(&wrong), 2);
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(err.contains("one of memory, cpu"), "{err}");
}

#[test]
fn the_fix_script_holds_the_commands_and_runs_none() {
    let fixture = Fixture::bad();
    let out = fixture.run(&["--fix-script"]);
    assert_eq!(code(&out), 2);
    let script = stdout(&out);
    assert!(script.starts_with("#!/bin/sh\n"), "{script}");
    assert!(script.contains("sysctl -w vm.swappiness=1"), "{script}");
    assert!(script.contains("# memory.swappiness (warn)"), "{script}");
    // Nothing was changed: the tree still says 60.
    let swappiness = std::fs::read_to_string(fixture.root.join("proc/sys/vm/swappiness")).unwrap();
    assert_eq!(swappiness.trim(), "60");
    let healthy = Fixture::healthy();
    assert!(stdout(&healthy.run(&["--fix-script"])).contains("# Nothing to fix."));
}

#[test]
fn the_fingerprint_prints_as_json_and_as_text() {
    let fixture = Fixture::healthy();
    let out = fixture.run(&["--fingerprint", "--json"]);
    assert_eq!(code(&out), 0);
    let value = json(&out);
    assert_eq!(value["schema_version"], host::FINGERPRINT_VERSION);
    assert_eq!(value["hostname"], "gpu-host-01");
    assert_eq!(value["gpus"][0]["name"], "NVIDIA H100 80GB HBM3");
    let typed: host::Fingerprint = serde_json::from_value(value).unwrap();
    assert_eq!(typed.cuda_driver_version.as_deref(), Some("12.4"));
    let text = stdout(&fixture.run(&["--fingerprint"]));
    assert!(text.starts_with("hardware fingerprint\n"), "{text}");
    assert!(text.contains("gpu0 NVIDIA H100 80GB HBM3"), "{text}");
    // The fingerprint is not a report: it takes no --only.
    assert_eq!(code(&fixture.run(&["--fingerprint", "--only", "gpu"])), 2);
}

#[test]
fn verify_judges_the_repository_by_its_digests() {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("tiny.gguf");
    std::fs::write(&source, TinyLlama::default().to_gguf().unwrap()).unwrap();
    let models = dir.path().join("models");
    repo::Repository::open(&models)
        .import(
            &source,
            &repo::ImportOptions {
                name: "tiny".into(),
                version: "1.0.0".into(),
                kind: None,
                link: false,
                git_commit: None,
                dataset_version: None,
                derived_from: None,
                pipeline: None,
                build: repo::BuildInfo {
                    version: "0.0.0-test".into(),
                    git_commit: None,
                    rustc: None,
                },
                progress: &repo::NoProgress,
                rules_check: None,
                host_fingerprint: None,
                card: None,
                stable: false,
            },
        )
        .unwrap();
    let repository = |args: &[&str]| {
        let mut all = vec![
            "--json",
            "--only",
            "rampart",
            "--repo",
            models.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        let report = json(&doctor(&all));
        report["checks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == "rampart.repository")
            .cloned()
            .unwrap()
    };
    let unverified = repository(&[]);
    assert_eq!(unverified["status"], "ok");
    assert!(unverified["observed"]
        .as_str()
        .unwrap()
        .contains("not verified by this run"));
    let verified = repository(&["--verify"]);
    assert_eq!(verified["status"], "ok", "{verified}");
    assert!(verified["observed"]
        .as_str()
        .unwrap()
        .contains("verified (1 version, 3 files"));
    // A changed file.
    testkit::flip_byte(&models.join("tiny/1.0.0/tiny.gguf"), 100);
    let changed = repository(&["--verify"]);
    assert_eq!(changed["status"], "error", "{changed}");
    assert!(changed["observed"]
        .as_str()
        .unwrap()
        .contains("tiny@1.0.0: content changed: tiny.gguf"));
    // No repository: its check says so, and --verify has nothing to hash.
    let missing = dir.path().join("no-such-repo");
    let report = json(&doctor(&[
        "--json",
        "--only",
        "rampart",
        "--verify",
        "--repo",
        missing.to_str().unwrap(),
    ]));
    let check = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == "rampart.repository")
        .unwrap();
    assert_eq!(check["status"], "error");
    assert!(check["observed"].as_str().unwrap().contains("no-such-repo"));
}

#[test]
fn on_this_machine_it_answers_whatever_it_finds() {
    let text = doctor(&[]);
    assert!(
        [0, 1, 2].contains(&code(&text)),
        "{:?}: {}",
        text.status,
        String::from_utf8_lossy(&text.stderr)
    );
    let out = stdout(&text);
    assert!(out.starts_with("rampart doctor\n"), "{out}");
    assert!(
        out.contains(" ok, ") && out.contains(" unknown in "),
        "{out}"
    );
    let json_out = doctor(&["--json"]);
    let report = json(&json_out);
    assert_eq!(code(&json_out), code(&text));
    let typed: host::Report = serde_json::from_value(report).unwrap();
    assert_eq!(typed.exit_code(), code(&text));
    let fingerprint = doctor(&["--fingerprint", "--json"]);
    assert_eq!(code(&fingerprint), 0);
    let fingerprint: host::Fingerprint = serde_json::from_value(json(&fingerprint)).unwrap();
    assert_eq!(fingerprint.arch, std::env::consts::ARCH);
    assert_eq!(code(&doctor(&["--fingerprint"])), 0);
}

/// Kills the server when the test ends, however it ends.
struct Serving(std::process::Child);

impl Drop for Serving {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn serve_logs_the_fingerprint_and_each_finding_at_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("models")).unwrap();
    let config = dir.path().join("rampart.toml");
    // A gRPC message limit of 4 MiB is a finding on any host.
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{}\"\nrepo = \"models\"\n\n[grpc]\nlisten = \"127.0.0.1:{}\"\nmax_message_bytes = 4194304\n",
            free_port(),
            free_port()
        ),
    )
    .unwrap();
    let log = dir.path().join("server.log");
    let _server = Serving(
        Command::new(assert_cmd::cargo::cargo_bin("rampart"))
            .current_dir(dir.path())
            .env_remove("RAMPART_REPO")
            .env_remove("RUST_LOG")
            .arg("serve")
            .arg("--config")
            .arg(&config)
            .stdout(std::fs::File::create(&log).unwrap())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let doctor_lines = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "rampart::doctor")
            .collect()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let lines = loop {
        let lines = doctor_lines();
        if lines
            .iter()
            .any(|l| l["id"] == "rampart.grpc_message_limit")
            && lines.iter().any(|l| l["message"] == "host checked")
        {
            break lines;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no doctor lines in:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let host_line = lines
        .iter()
        .find(|l| l["message"] == "host checked")
        .unwrap();
    let summary = host_line["fingerprint"].as_str().unwrap();
    assert!(summary.contains(std::env::consts::ARCH), "{host_line}");
    assert!(host_line["warn"].as_u64().unwrap() >= 1, "{host_line}");
    let finding = lines
        .iter()
        .find(|l| l["id"] == "rampart.grpc_message_limit")
        .unwrap();
    assert_eq!(finding["level"], "WARN", "{finding}");
    assert!(
        finding["observed"].as_str().unwrap().contains("4.0 MiB"),
        "{finding}"
    );
    assert!(!finding["fix"].as_str().unwrap().is_empty(), "{finding}");
    // Only findings get a line of their own: one per warning or error of the host line.
    let findings = lines
        .iter()
        .filter(|l| l["message"] != "host checked")
        .count() as u64;
    assert_eq!(
        findings,
        host_line["warn"].as_u64().unwrap() + host_line["error"].as_u64().unwrap()
    );
}

#[test]
fn serve_check_validates_the_configuration_and_binds_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let serve = |toml: &str| {
        let file = dir.path().join("rampart.toml");
        std::fs::write(&file, toml).unwrap();
        Command::new(assert_cmd::cargo::cargo_bin("rampart"))
            .args(["serve", "--check", "--config"])
            .arg(&file)
            .current_dir(dir.path())
            .env_remove("RAMPART_REPO")
            .output()
            .unwrap()
    };
    // A port in use is no error for a check: nothing is bound.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let ok = serve(&format!(
        "listen = \"127.0.0.1:{port}\"\napi_keys_file = \"/nonexistent/keys.txt\"\n\
         [[models]]\nname = \"a\"\n"
    ));
    assert_eq!(code(&ok), 0, "{}", String::from_utf8_lossy(&ok.stderr));
    assert!(
        stdout(&ok).starts_with("configuration ok: listen 127.0.0.1:"),
        "{}",
        stdout(&ok)
    );
    assert!(stdout(&ok).contains("1 model listed"), "{}", stdout(&ok));
    // An unknown key and a value out of range are errors, with what is wrong.
    let unknown = serve("listn = \"127.0.0.1:8080\"\n");
    assert_ne!(code(&unknown), 0);
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("listn"));
    let invalid = serve("[degradation]\nscaling = 1.5\n");
    assert_eq!(
        code(&invalid),
        2,
        "{}",
        String::from_utf8_lossy(&invalid.stderr)
    );
}
