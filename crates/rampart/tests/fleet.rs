//! The fleet end to end, with real parts: three `rampart serve` replicas of SmolLM2 (1.0.0 the
//! stable, 1.1.0 the candidate, the same weights) on one repository, sharing their releases and
//! their feedback in a real PostgreSQL, shipping their audit logs to a real S3 with Object Lock
//! (SeaweedFS), behind a real HAProxy (round robin, health checks on `/health/ready`), loaded by
//! the official `openai` client through the balancer (tests/e2e/fleet_load.py).
//!
//! One test, in phases that share the fleet: a slower candidate rolled back once for the fleet;
//! an identical one promoted once while its judge is killed with SIGKILL (another takes over,
//! the balancer routes around the dead one, no acknowledged audit entry is lost); a replica
//! stopped with SIGTERM drains behind the balancer without a client seeing an error; every
//! replica's audit log verifies from S3. Its figures are printed (`fleet:` lines) for
//! docs/perf.md.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use testkit::cached_model;
use testkit::models::SMOLLM2_GGUF;

const TICK_MS: u64 = 250;
const THREADS: usize = 4;

struct Replica {
    name: String,
    dir: PathBuf,
    port: u16,
    grpc_port: u16,
    child: Option<Child>,
}

struct Fleet {
    _dir: tempfile::TempDir,
    repo: PathBuf,
    config: String,
    env: Vec<(String, String)>,
    replicas: Vec<Replica>,
    haproxy: Child,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for r in &mut self.replicas {
            if let Some(mut c) = r.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        let _ = self.haproxy.kill();
        let _ = self.haproxy.wait();
    }
}

impl Fleet {
    fn spawn(&mut self, i: usize) {
        let r = &mut self.replicas[i];
        let config = self.config.replace("{replica}", &r.name);
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        // A restarted replica logs to a second file (the first is kept for the checks).
        let log = if r.dir.join("server.log").exists() {
            r.dir.join("server-restarted.log")
        } else {
            r.dir.join("server.log")
        };
        r.child = Some(spawn_server_with_env(
            &r.dir,
            &self.repo,
            r.port,
            r.grpc_port,
            &config,
            &log,
            &env,
        ));
    }

    fn pid(&self, i: usize) -> u32 {
        self.replicas[i].child.as_ref().expect("running").id()
    }

    fn index_of(&self, name: &str) -> usize {
        self.replicas
            .iter()
            .position(|r| r.name == name)
            .expect("a replica")
    }

    /// The last `n` lines of each replica's logs, for a failure's message.
    fn tails(&self, n: usize) -> String {
        let mut all = String::new();
        for r in &self.replicas {
            for entry in std::fs::read_dir(&r.dir).unwrap().flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "log") {
                    let text = std::fs::read_to_string(&p).unwrap_or_default();
                    let lines: Vec<&str> = text.lines().collect();
                    all.push_str(&format!("--- {} {}\n", r.name, p.display()));
                    for l in &lines[lines.len().saturating_sub(n)..] {
                        all.push_str(l);
                        all.push('\n');
                    }
                }
            }
        }
        all
    }

    fn logs(&self) -> String {
        let mut all = String::new();
        for r in &self.replicas {
            for entry in std::fs::read_dir(&r.dir).unwrap().flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|e| e == "log") {
                    all.push_str(&std::fs::read_to_string(&p).unwrap_or_default());
                }
            }
        }
        all
    }
}

fn haproxy() -> Option<PathBuf> {
    [
        "/usr/sbin/haproxy",
        "/usr/bin/haproxy",
        "/usr/local/sbin/haproxy",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.is_file())
}

fn required() -> bool {
    std::env::var("RAMPART_REQUIRE_MODELS").is_ok_and(|v| v == "1")
}

/// HAProxy in front of the replicas: round robin, a health check on `/health/ready` every
/// 250 ms (out after 2 failures, back after 2 successes), a refused connection retried on
/// another replica (the request never reached one), never a request that reached one.
fn start_haproxy(bin: &Path, dir: &Path, lb: u16, ports: &[u16]) -> Child {
    let servers: String = ports
        .iter()
        .enumerate()
        .map(|(i, p)| format!("  server r{} 127.0.0.1:{p} check\n", i + 1))
        .collect();
    let config = format!(
        "global\n  maxconn 512\ndefaults\n  mode http\n  timeout connect 2s\n  timeout client 300s\n  timeout server 300s\n  retries 2\n  option redispatch\n  retry-on conn-failure\nfrontend fleet\n  bind 127.0.0.1:{lb}\n  default_backend replicas\nbackend replicas\n  balance roundrobin\n  option httpchk GET /health/ready\n  http-check expect status 200\n  default-server inter 250ms fall 2 rise 2\n{servers}"
    );
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, config).unwrap();
    let check = Command::new(bin)
        .arg("-c")
        .arg("-f")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "haproxy -c: {}",
        String::from_utf8_lossy(&check.stderr)
    );
    Command::new(bin)
        .arg("-db")
        .arg("-f")
        .arg(&path)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("haproxy.err")).unwrap())
        .spawn()
        .unwrap()
}

/// The official client's load through the balancer, until stopped.
struct Load {
    child: Child,
    stop: PathBuf,
    out: PathBuf,
}

impl Load {
    fn start(python: &Path, dir: &Path, lb: u16, tag: &str, rate_every: u32) -> Load {
        let stop = dir.join(format!("stop-{tag}"));
        let out = dir.join(format!("load-{tag}.json"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/fleet_load.py");
        let child = Command::new(python)
            .arg(script)
            .env("RAMPART_URL", format!("http://127.0.0.1:{lb}"))
            .env("RAMPART_KEY", KEY)
            .env("RAMPART_FEEDBACK_KEY", FEEDBACK_KEY)
            .env("RAMPART_MODEL", MODEL)
            .env("FLEET_STOP", &stop)
            .env("FLEET_OUT", &out)
            .env("FLEET_THREADS", THREADS.to_string())
            .env("FLEET_RATE_EVERY", rate_every.to_string())
            .env("FLEET_TAG", tag)
            .spawn()
            .unwrap();
        Load { child, stop, out }
    }

    fn stop(mut self) -> serde_json::Value {
        std::fs::write(&self.stop, "").unwrap();
        let status = self.child.wait().unwrap();
        assert!(status.success(), "the load client failed");
        serde_json::from_str(&std::fs::read_to_string(&self.out).unwrap()).unwrap()
    }
}

/// A test that fails mid-phase leaves no client looping against a balancer that is gone.
impl Drop for Load {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Answers that were not a 200 (server errors, connections cut).
fn failed(summary: &serde_json::Value) -> u64 {
    summary["statuses"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "200")
        .map(|(_, v)| v.as_u64().unwrap())
        .sum()
}

fn answered(summary: &serde_json::Value) -> u64 {
    summary["statuses"]["200"].as_u64().unwrap_or(0)
}

fn get_json(port: u16, path: &str) -> Option<serde_json::Value> {
    let (status, _, body) = try_http(port, "GET", path, None, Some(ADMIN_KEY))?;
    (status == 200)
        .then(|| serde_json::from_str(&body).ok())
        .flatten()
}

fn release(port: u16) -> serde_json::Value {
    get_json(port, &format!("/admin/releases/{MODEL}")).unwrap_or_default()
}

fn wait_for(
    limit: Duration,
    what: &str,
    mut done: impl FnMut() -> Option<serde_json::Value>,
) -> serde_json::Value {
    let began = Instant::now();
    loop {
        if let Some(v) = done() {
            return v;
        }
        assert!(began.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `done` holds within `limit`, asked every 50 ms.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let began = Instant::now();
    while began.elapsed() < limit {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// Starts releasing 1.1.0 through the balancer (200 asserted); the answer's body.
fn start_release(lb: u16) -> String {
    let (s, _, t) = http(
        lb,
        "POST",
        &format!("/admin/releases/{MODEL}/start"),
        Some(r#"{"candidate":"1.1.0"}"#),
        Some(ADMIN_KEY),
    );
    assert_eq!(s, 200, "{t}");
    // The answer is the started release, not the one that ended before it.
    let answer: serde_json::Value = serde_json::from_str(&t).unwrap();
    assert_eq!(phase_of(&answer), "running", "{t}");
    assert_eq!(answer["status"]["candidate"], "1.1.0", "{t}");
    t
}

/// Waits until the release through the balancer ended (promoted or rolled back).
fn until_decided(lb: u16, what: &str) -> serde_json::Value {
    wait_for(Duration::from_secs(300), what, || {
        let r = release(lb);
        (!["running", "holding", "gating"].contains(&phase_of(&r))).then_some(r)
    })
}

fn phase_of(r: &serde_json::Value) -> &str {
    r["status"]["phase"].as_str().unwrap_or("")
}

/// The actions of one release's decisions in a plan's history.
fn actions(r: &serde_json::Value, release_id: &str) -> Vec<String> {
    let started = release_id
        .rsplit('@')
        .next()
        .unwrap_or("0")
        .parse::<u64>()
        .unwrap_or(0);
    r["plan"]["history"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|d| d["time_ms"].as_u64().unwrap_or(0) >= started)
        .map(|d| d["action"].as_str().unwrap_or("").to_string())
        .collect()
}

fn decision_rows(pg: &mut postgres::Client, release_id: &str, action: &str) -> Vec<String> {
    pg.query(
        "SELECT replica FROM rampart_release_decisions WHERE release_id = $1 AND action = $2",
        &[&release_id, &action],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

fn rampart(args: &[&str], env: &[(String, String)]) -> (bool, String) {
    let out = Command::new(binary())
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// `lag_ms` of every "the fleet's plan changed: adopted" line of `revision`.
fn adoption_lags(logs: &str, revision: i64) -> Vec<u64> {
    logs.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| {
            v["message"] == "the fleet's plan changed: adopted" && v["revision"] == revision
        })
        .filter_map(|v| v["lag_ms"].as_u64())
        .collect()
}

#[test]
fn three_replicas_behind_haproxy_share_one_release_one_judge_and_one_truth() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let Some(haproxy_bin) = haproxy() else {
        assert!(
            !required(),
            "HAProxy is not installed (scripts/test.sh installs it)"
        );
        eprintln!("skipped: HAProxy is not installed");
        return;
    };
    let Some(python) = python_with_openai() else {
        assert!(!required(), "no Python with the openai package");
        eprintln!("skipped: no Python with the openai package");
        return;
    };
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let Some(s3) = audit::testing_s3::SeaweedFs::start() else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let bucket = audit::s3::S3Client::new(s3.config("fleet-audit")).unwrap();
    runtime.block_on(bucket.create_bucket(true)).unwrap();
    let mut db = postgres::Client::connect(&pg.url(), postgres::NoTls).unwrap();

    let dir = tempfile::tempdir().unwrap();
    let repo = import_repository(
        dir.path(),
        &[(MODEL, "1.0.0", model.clone()), (MODEL, "1.1.0", model)],
    );
    // Judged against the stable (no control copy: three replicas on two cores), a short
    // schedule so that a whole release fits the test.
    let first_plan = "stable = \"1.0.0\"\n\n[routing]\ncontrol = false\n\n[schedule]\nsteps = [30.0, 100.0]\nmin_step_secs = 3\nmin_samples = 25\n\n[judge]\nlatency_ratio = 1.5\n";
    std::fs::write(repo.join(MODEL).join("release.toml"), first_plan).unwrap();
    let config = format!(
        "shutdown_timeout_s = 20\ndrain_delay_s = 2\n\
         [faults]\nenabled = true\n[releases]\ntick_ms = {TICK_MS}\n\
         [fleet]\nenabled = true\nreplica = \"{{replica}}\"\nlease_timeout_s = 5\n\
         [feedback]\npostgres_url = \"{pg}\"\n\
         [audit]\nrequired = true\nsegment_max_age_s = 2\ncheckpoint_interval_ms = 200\n\
         [audit.s3]\nurl = \"s3://fleet-audit/prod\"\nendpoint = \"{s3}\"\nretention_days = 1\n\
         access_key_env = \"E2E_S3_KEY\"\nsecret_key_env = \"E2E_S3_SECRET\"\n\
         [[models]]\nname = \"{MODEL}\"\ncontext = 512\nkv_cache_memory = \"64MiB\"\n",
        pg = pg.url(),
        s3 = s3.endpoint,
    );
    let env = vec![
        (
            "E2E_S3_KEY".to_string(),
            audit::testing_s3::ACCESS_KEY.to_string(),
        ),
        (
            "E2E_S3_SECRET".to_string(),
            audit::testing_s3::SECRET_KEY.to_string(),
        ),
    ];
    let replicas: Vec<Replica> = (1..=3)
        .map(|i| {
            let d = dir.path().join(format!("r{i}"));
            std::fs::create_dir_all(&d).unwrap();
            Replica {
                name: format!("r{i}"),
                dir: d,
                port: free_port(),
                grpc_port: free_port(),
                child: None,
            }
        })
        .collect();
    let lb = free_port();
    let ports: Vec<u16> = replicas.iter().map(|r| r.port).collect();
    let haproxy = start_haproxy(&haproxy_bin, dir.path(), lb, &ports);
    let mut fleet = Fleet {
        repo: repo.clone(),
        config,
        env,
        replicas,
        haproxy,
        _dir: dir,
    };
    for i in 0..3 {
        fleet.spawn(i);
    }
    for r in &fleet.replicas {
        wait_ready(r.port);
    }
    // The balancer sees them (its checks pass twice) and answers.
    wait_for(Duration::from_secs(20), "the balancer is ready", || {
        let (s, _, _) = try_http(lb, "GET", "/health/ready", None, None)?;
        (s == 200).then_some(serde_json::Value::Null)
    });
    let view = wait_for(
        Duration::from_secs(20),
        "three replicas and a judge",
        || {
            let v = get_json(lb, "/admin/fleet")?;
            (v["replicas"].as_array()?.len() == 3 && v["judge"].is_string()).then_some(v)
        },
    );
    eprintln!("fleet: {view}");
    let (status, _, _) = http(
        fleet.replicas[0].port,
        "GET",
        "/admin/fleet",
        None,
        Some(KEY),
    );
    assert_eq!(status, 403, "the fleet view needs the admin scope");
    let (ok, text) = rampart(
        &[
            "fleet",
            "status",
            "--url",
            &format!("http://127.0.0.1:{lb}"),
            "--key",
            ADMIN_KEY,
        ],
        &[],
    );
    assert!(
        ok && text.contains("judge: r") && text.contains("r3"),
        "{text}"
    );

    // An admin key polling the fleet view in a loop costs the database at most two reads a
    // second, not one per request.
    let port = fleet.replicas[1].port;
    let reads = || metric_labelled(port, "rampart_fleet_store_calls_total", "op=\"view\"");
    let before = reads();
    let burst = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..8 {
            s.spawn(|| {
                for _ in 0..25 {
                    let (status, _, _) = http(port, "GET", "/admin/fleet", None, Some(ADMIN_KEY));
                    assert_eq!(status, 200);
                }
            });
        }
    });
    let (took, read) = (burst.elapsed(), reads() - before);
    eprintln!("fleet: 200 fleet views in {took:?} read the database {read} times");
    assert!(
        read <= took.as_secs_f64() * 2.0 + 2.0,
        "{read} reads for 200 views in {took:?}"
    );

    // 1. A slower candidate (every call of 1.1.0 five times as slow, on every replica; at three
    // times, contention on two cores measured it 2.8x the stable in some runs, and the judge,
    // rightly, had not rejected it when the step's 10 samples were in; at five, with 10, one
    // CI run in several promoted it after 11: the plan now asks 25 a step): the
    // judge rolls it back once, for the fleet, on the pooled samples; every replica routes by
    // the rollback within two ticks.
    start_release(lb);
    // Every replica loads the candidate the fleet's plan names (within a tick or two of the
    // start), then every call of it is made five times as slow.
    wait_for(
        Duration::from_secs(60),
        "every replica serves 1.1.0",
        || {
            let v = get_json(lb, "/admin/fleet")?;
            v["replicas"]
                .as_array()?
                .iter()
                .all(|r| {
                    r["serving"]
                        .as_array()
                        .is_some_and(|s| s.iter().any(|x| x == "smollm2-135m@1.1.0"))
                })
                .then_some(v)
        },
    );
    // One fault for the whole fleet, injected through the balancer on whichever replica: every
    // replica applies it at its next tick.
    let (s, _, t) = http(
        lb,
        "POST",
        "/admin/faults",
        Some(&format!(
            r#"{{"backend":"{MODEL}@1.1.0","mode":"slow","factor":5.0,"duration_s":900,"scope":"fleet"}}"#
        )),
        Some(ADMIN_KEY),
    );
    assert_eq!(s, 201, "{t}");
    let faults_everywhere = |n: usize| {
        fleet.replicas.iter().all(|r| {
            get_json(r.port, "/admin/faults").and_then(|v| {
                v.as_array()
                    .map(|a| a.iter().filter(|f| f["fleet_id"].is_i64()).count())
            }) == Some(n)
        })
    };
    wait_for(
        Duration::from_secs(10),
        "every replica applies the fleet's fault",
        || faults_everywhere(1).then_some(serde_json::Value::Null),
    );
    let started = Instant::now();
    let load = Load::start(&python, fleet._dir.path(), lb, "slow", 0);
    let r = until_decided(lb, "the slower candidate rolled back");
    let took = started.elapsed();
    let summary = load.stop();
    assert_eq!(phase_of(&r), "rolled_back", "{r}");
    let release_id = r["status"]["release_id"].as_str().unwrap().to_string();
    assert_eq!(
        actions(&r, &release_id)
            .iter()
            .filter(|a| *a == "rollback")
            .count(),
        1,
        "one rollback in the history: {r}"
    );
    let deciders = decision_rows(&mut db, &release_id, "rollback");
    assert_eq!(
        deciders.len(),
        1,
        "one rollback decision for the fleet: {deciders:?}"
    );
    let rollback = r["plan"]["history"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .clone();
    assert!(
        ["ttft_p95", "tpot_p95", "e2e_p95"].contains(&rollback["metric"].as_str().unwrap_or("")),
        "{rollback}"
    );
    // Every replica routes by it: the ones that did not decide adopted the revision.
    let revision: i64 = db
        .query_one(
            "SELECT revision FROM rampart_release_decisions WHERE release_id = $1 AND action = 'rollback'",
            &[&release_id],
        )
        .unwrap()
        .get(0);
    let lags = wait_for(
        Duration::from_secs(5),
        "two followers adopt the rollback",
        || {
            let lags = adoption_lags(&fleet.logs(), revision);
            (lags.len() >= 2).then(|| serde_json::json!(lags))
        },
    );
    for r in &fleet.replicas {
        assert_eq!(phase_of(&release(r.port)), "rolled_back", "{}", r.name);
        assert_eq!(
            metric_labelled(r.port, "rampart_release_weight", "version=\"1.1.0\""),
            0.0
        );
    }
    eprintln!(
        "fleet: slower candidate rolled back by {} after {:.1} s ({} answered, {} failed); followers adopted after {lags} ms (tick {TICK_MS} ms); pooled: {}",
        deciders[0],
        took.as_secs_f64(),
        answered(&summary),
        failed(&summary),
        r["status"]
    );
    assert!(
        lags.as_array()
            .unwrap()
            .iter()
            .all(|l| l.as_u64().unwrap() <= 2 * TICK_MS + 250),
        "followers route by the decision within two ticks: {lags}"
    );
    assert_eq!(failed(&summary), 0, "{summary}");

    // 2. An identical candidate, its answers rated through the balancer; its judge is killed
    // with SIGKILL mid-release: another replica takes the lease, the release goes on and
    // promotes once; the balancer routes around the dead replica.
    // Cleared through the balancer on whichever replica: every replica drops it.
    let (s, _, t) = http(lb, "DELETE", "/admin/faults", None, Some(ADMIN_KEY));
    assert_eq!(s, 200, "{t}");
    wait_for(
        Duration::from_secs(10),
        "every replica drops the fleet's fault",
        || faults_everywhere(0).then_some(serde_json::Value::Null),
    );
    let t = start_release(lb);
    // The replica that took the command wrote it; the others adopt it at their next tick (the
    // balancer may ask one that has not yet).
    let id = serde_json::from_str::<serde_json::Value>(&t).unwrap()["status"]["release_id"]
        .as_str()
        .unwrap()
        .to_string();
    wait_for(
        Duration::from_secs(5),
        "every replica routes by the new release",
        || {
            fleet
                .replicas
                .iter()
                .all(|r| release(r.port)["status"]["release_id"] == id.as_str())
                .then_some(serde_json::Value::Null)
        },
    );
    let started = Instant::now();
    let load = Load::start(&python, fleet._dir.path(), lb, "same", 3);
    let mut last = serde_json::Value::Null;
    let pooled = wait_until(Duration::from_secs(120), || {
        let r = release(lb);
        let done = r["status"]["release_id"] == id.as_str()
            && r["status"]["samples_candidate"].as_u64().unwrap_or(0) >= 3;
        last = r;
        done
    });
    if !pooled {
        let summary = load.stop();
        panic!(
            "candidate samples not pooled within 120 s; load {summary}; last release view {last}; fleet {}; logs:\n{}",
            get_json(lb, "/admin/fleet").unwrap_or_default(),
            fleet.tails(40)
        );
    }
    let judge = get_json(lb, "/admin/fleet").unwrap()["judge"]
        .as_str()
        .unwrap()
        .to_string();
    let dead = fleet.index_of(&judge);
    let killed = Instant::now();
    {
        let child = fleet.replicas[dead].child.as_mut().unwrap();
        child.kill().unwrap();
        child.wait().unwrap();
    }
    fleet.replicas[dead].child = None;
    let view = wait_for(Duration::from_secs(30), "another judge", || {
        let v = get_json(lb, "/admin/fleet")?;
        (v["judge"].is_string() && v["judge"] != judge.as_str()).then_some(v)
    });
    let failover = killed.elapsed();
    let r = until_decided(lb, "the identical candidate decided");
    let took = started.elapsed();
    let summary = load.stop();
    assert_eq!(phase_of(&r), "promoted", "{r}");
    assert_eq!(r["plan"]["stable"], "1.1.0", "{r}");
    let release_id = r["status"]["release_id"].as_str().unwrap().to_string();
    let history = actions(&r, &release_id);
    assert_eq!(
        history.iter().filter(|a| *a == "promote").count(),
        1,
        "{history:?}"
    );
    assert!(!history.contains(&"rollback".to_string()), "{history:?}");
    let promoters = decision_rows(&mut db, &release_id, "promote");
    assert_eq!(promoters.len(), 1, "{promoters:?}");
    assert_ne!(
        promoters[0], judge,
        "the dead judge decided nothing after its death"
    );
    // Feedback given through any replica reached the one table the judge counts.
    let rated: i64 = db
        .query_one(
            "SELECT COUNT(*) FROM rampart_release_ratings WHERE release_id = $1",
            &[&release_id],
        )
        .unwrap()
        .get(0);
    let lost = failed(&summary);
    eprintln!(
        "fleet: judge {judge} killed; {} took the lease after {:.2} s; the identical candidate promoted by {} after {:.1} s; {} answered, {lost} failed (in flight on the dead replica), ratings {} ({rated} answers rated in the release)",
        view["judge"],
        failover.as_secs_f64(),
        promoters[0],
        took.as_secs_f64(),
        answered(&summary),
        summary["ratings"],
    );
    assert!(
        lost <= THREADS as u64,
        "only requests in flight on the killed replica fail: {summary}"
    );
    assert!(
        rated > 0,
        "ratings through the balancer reach the fleet: {summary}"
    );
    assert!(failover < Duration::from_secs(10), "{failover:?}");
    // The killed replica comes back: its log recovers (nothing acknowledged is lost: every
    // answer a client received has its entry in some replica's log), and it adopts the fleet's
    // plan.
    fleet.spawn(dead);
    wait_ready(fleet.replicas[dead].port);
    let back = wait_for(
        Duration::from_secs(10),
        "the restarted replica adopts",
        || {
            let r = release(fleet.replicas[dead].port);
            (phase_of(&r) == "promoted").then_some(r)
        },
    );
    assert_eq!(back["plan"]["stable"], "1.1.0");
    let mut logged = std::collections::HashSet::new();
    for r in &fleet.replicas {
        let audit = r.dir.join("audit");
        let audit = audit.to_str().unwrap();
        let (ok, text) = rampart(&["audit", "--dir", audit, "verify"], &[]);
        assert!(ok, "{}: {text}", r.name);
        let (ok, text) = rampart(&["audit", "--dir", audit, "export"], &[]);
        assert!(ok, "{text}");
        for line in text.lines() {
            if let Ok(v) = serde_json::from_str::<serde_json::Value>(line) {
                if let Some(id) = v["audit_id"].as_str() {
                    logged.insert(id.to_string());
                }
            }
        }
    }
    let acknowledged: Vec<&str> = summary["acknowledged"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_str())
        .collect();
    let missing: Vec<&&str> = acknowledged
        .iter()
        .filter(|id| !logged.contains(**id))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} acknowledged answers have no audit entry: {:?}",
        missing.len(),
        acknowledged.len(),
        &missing[..missing.len().min(5)]
    );

    // An admin's hand-off, given through the balancer to whichever replica, is the fleet's:
    // every replica refuses with 503 human_handoff within a tick or two, and serves again when
    // it is resumed.
    let ask = |port: u16| {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hello"}}],"max_tokens":2}}"#
        );
        try_http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY))
            .map_or((0, String::new()), |(s, _, b)| (s, b))
    };
    let handoff = |action: &str| {
        let (s, _, t) = http(
            lb,
            "POST",
            &format!("/admin/models/{MODEL}/handoff"),
            Some(&format!(r#"{{"action":"{action}"}}"#)),
            Some(ADMIN_KEY),
        );
        assert_eq!(s, 200, "{t}");
    };
    handoff("pause");
    let paused = Instant::now();
    wait_for(Duration::from_secs(10), "every replica hands off", || {
        fleet
            .replicas
            .iter()
            .all(|r| {
                let (s, b) = ask(r.port);
                s == 503 && b.contains("human_handoff")
            })
            .then_some(serde_json::Value::Null)
    });
    let paused = paused.elapsed();
    handoff("resume");
    wait_for(
        Duration::from_secs(10),
        "every replica serves again",
        || {
            fleet
                .replicas
                .iter()
                .all(|r| ask(r.port).0 == 200)
                .then_some(serde_json::Value::Null)
        },
    );
    eprintln!("fleet: a hand-off paused every replica within {paused:?}");

    // GitOps: a plan file changed on disk (a commit) is adopted by the fleet once, by every
    // replica; the file the fleet started from, written back (an old checkout), is not.
    let plan_file = fleet.repo.join(MODEL).join("release.toml");
    std::fs::write(
        &plan_file,
        first_plan
            .replace("stable = \"1.0.0\"", "stable = \"1.1.0\"")
            .replace("latency_ratio = 1.5", "latency_ratio = 1.6"),
    )
    .unwrap();
    let adopted_by_all = |ratio: f64| {
        fleet.replicas.iter().all(|r| {
            let p = release(r.port);
            p["plan"]["judge"]["latency_ratio"] == ratio && p["plan"]["stable"] == "1.1.0"
        })
    };
    wait_for(
        Duration::from_secs(10),
        "every replica adopts the committed plan",
        || adopted_by_all(1.6).then_some(serde_json::Value::Null),
    );
    std::fs::write(&plan_file, first_plan).unwrap();
    std::thread::sleep(Duration::from_millis(6 * TICK_MS));
    assert!(adopted_by_all(1.6), "an older file never comes back");
    let files: i64 = db
        .query_one("SELECT COUNT(*) FROM rampart_release_files", &[])
        .unwrap()
        .get(0);
    assert_eq!(files, 2, "the first file and the commit, each adopted once");

    // 3. SIGTERM on a replica under load: readiness fails first, the balancer takes it out, its
    // stream finishes, and no client sees an error.
    let going = (dead + 1) % 3;
    let load = Load::start(&python, fleet._dir.path(), lb, "drain", 0);
    std::thread::sleep(Duration::from_secs(2));
    let port = fleet.replicas[going].port;
    let stream = std::thread::spawn(move || {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell a long story about a lighthouse."}}],"max_tokens":96,"stream":true,"user":"drain"}}"#
        );
        http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY))
    });
    std::thread::sleep(Duration::from_millis(300));
    let terminated = Command::new("kill")
        .args(["-TERM", &fleet.pid(going).to_string()])
        .status()
        .unwrap();
    assert!(terminated.success());
    let (status, _, body) = stream.join().unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("[DONE]"), "the stream finished: {body}");
    let exited = {
        let child = fleet.replicas[going].child.as_mut().unwrap();
        let began = Instant::now();
        loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            assert!(began.elapsed() < Duration::from_secs(40), "did not exit");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    fleet.replicas[going].child = None;
    assert!(exited.success(), "{exited:?}");
    std::thread::sleep(Duration::from_secs(1));
    let summary = load.stop();
    eprintln!(
        "fleet: {} drained behind the balancer: {} answered, {} failed",
        fleet.replicas[going].name,
        answered(&summary),
        failed(&summary)
    );
    assert_eq!(
        failed(&summary),
        0,
        "a drain behind the balancer fails nobody: {summary}"
    );
    assert!(answered(&summary) > 0);

    // 4. Every replica's audit log, shipped to one S3 prefix, verifies from S3 alone, each on
    // its own origin.
    let s3_env = vec![
        (
            "AWS_ACCESS_KEY_ID".to_string(),
            audit::testing_s3::ACCESS_KEY.to_string(),
        ),
        (
            "AWS_SECRET_ACCESS_KEY".to_string(),
            audit::testing_s3::SECRET_KEY.to_string(),
        ),
    ];
    let verified = wait_for(
        Duration::from_secs(60),
        "three origins verify from S3",
        || {
            let (ok, text) = rampart(
                &[
                    "audit",
                    "--s3",
                    "s3://fleet-audit/prod",
                    "--s3-endpoint",
                    &s3.endpoint,
                    "verify",
                ],
                &s3_env,
            );
            (ok && text.contains("3 origins: 3 verified")).then(|| serde_json::json!(text))
        },
    );
    eprintln!("fleet: {}", verified.as_str().unwrap());
    for r in ["prod/r1", "prod/r2", "prod/r3"] {
        assert!(verified.as_str().unwrap().contains(&format!("origin {r}:")));
    }
}
