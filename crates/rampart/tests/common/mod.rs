//! The harness the real binary's end-to-end tests share: ports, a raw HTTP/1.1 client, a
//! repository of imported models, `rampart serve` with the test keys, the records of its log.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const KEY: &str = "sk-test-key-0001";
pub const MODEL: &str = "smollm2-135m";

pub struct Server {
    pub child: Child,
    pub port: u16,
    /// The KServe v2 gRPC port (every server gets its own: tests run in parallel).
    pub grpc_port: u16,
    pub _dir: tempfile::TempDir,
    pub log: PathBuf,
}

impl Server {
    /// Starts a server in `dir` (its keys, configuration and `server.log` are written there)
    /// on `repo` with `config` and free ports; does not wait for it to be ready.
    pub fn start(
        dir: tempfile::TempDir,
        repo: &Path,
        config: &str,
        env: &[(&str, &str)],
    ) -> Server {
        let (port, grpc_port) = (free_port(), free_port());
        let log = dir.path().join("server.log");
        let child = spawn_server_with_env(dir.path(), repo, port, grpc_port, config, &log, env);
        Server {
            child,
            port,
            grpc_port,
            _dir: dir,
            log,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn binary() -> PathBuf {
    assert_cmd::cargo::cargo_bin("rampart")
}

/// A raw HTTP/1.1 exchange (Connection: close): status, headers (lower-cased), body.
pub fn http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> Exchange {
    try_http(port, method, path, body, key).expect("the server takes connections")
}

/// Status, headers (lower-cased names), body.
pub type Exchange = (u16, Vec<(String, String)>, String);

/// [`http`], or `None` when nobody listens.
pub fn try_http(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    key: Option<&str>,
) -> Option<Exchange> {
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    try_http_with(port, method, path, body, &auth)
}

/// [`http`] with these headers (`name`, `value`) instead of a key.
pub fn http_with_headers(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    headers: &[(&str, &str)],
) -> Exchange {
    let lines: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    try_http_with(port, method, path, body, &lines).expect("the server takes connections")
}

/// The exchange, `auth` being the extra header lines (each ending in CRLF).
fn try_http_with(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    auth: &str,
) -> Option<Exchange> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let body = body.unwrap_or("");
    // The server may answer (413) and close before it read an oversized body: a failed write
    // is not the test's concern, the response is.
    let _ = write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    Some((status, headers, rest.to_string()))
}

pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

pub fn wait_ready(port: u16) -> Vec<u16> {
    let start = Instant::now();
    let mut seen = Vec::new();
    loop {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            drop(s.write_all(b""));
            let (status, _, _) = http(port, "GET", "/health/ready", None, None);
            seen.push(status);
            if status == 200 {
                return seen;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "not ready: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The sum of a metric's samples whose labels contain `label`.
pub fn metric_labelled(port: u16, name: &str, label: &str) -> f64 {
    let (_, _, body) = http(port, "GET", "/metrics", None, None);
    body.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

pub fn metric(port: u16, name: &str) -> f64 {
    let (_, _, body) = http(port, "GET", "/metrics", None, None);
    body.lines()
        .filter(|l| l.starts_with(name) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Imports `(name, version, source)` models into `dir/models`.
pub fn import_repository(dir: &Path, models: &[(&str, &str, PathBuf)]) -> PathBuf {
    let repo = dir.join("models");
    for (name, version, source) in models {
        let status = Command::new(binary())
            .args(["model", "import"])
            .arg(source)
            .args(["--name", name, "--version", version, "--repo"])
            .arg(&repo)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "import {name}@{version}");
    }
    repo
}

/// `rampart serve` in `dir` (its working directory: the audit log lands in `dir/audit`) on
/// `repo` with the test keys and `config`, its log to `log`.
/// Imports `(name, version, source)` into a fresh repository and starts the server with
/// `config` (the listen addresses and the keys are added: `tester` with scope infer, `ops`
/// with admin and infer). `config` may start with top-level settings.
pub fn start_repository(models: &[(&str, &str, PathBuf)], config: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let repo = import_repository(dir.path(), models);
    Server::start(dir, &repo, config, &[])
}

pub fn spawn_server(
    dir: &Path,
    repo: &Path,
    port: u16,
    grpc_port: u16,
    config: &str,
    log: &Path,
) -> Child {
    spawn_server_with_env(dir, repo, port, grpc_port, config, log, &[])
}

/// [`spawn_server`] with more environment variables.
pub fn spawn_server_with_env(
    dir: &Path,
    repo: &Path,
    port: u16,
    grpc_port: u16,
    config: &str,
    log: &Path,
    env: &[(&str, &str)],
) -> Child {
    let keys = dir.join("keys.txt");
    std::fs::write(
        &keys,
        format!(
            "# test keys\ntester:{KEY}\nops:{ADMIN_KEY} admin infer\nauditor:{AUDIT_KEY} audit\n{GUARD_KEYS}{FEEDBACK_KEYS}"
        ),
    )
    .unwrap();
    let path = dir.join("rampart.toml");
    // The top-level settings and tables of `config` first; `[grpc]` is a table of its own.
    std::fs::write(
        &path,
        format!("listen = \"127.0.0.1:{port}\"\nthreads = 2\n{config}\n[grpc]\nlisten = \"127.0.0.1:{grpc_port}\"\n"),
    )
    .unwrap();
    Command::new(binary())
        .current_dir(dir)
        .envs(env.iter().copied())
        .args(["serve", "--repo"])
        .arg(repo)
        .arg("--config")
        .arg(&path)
        .arg("--api-keys")
        .arg(&keys)
        .stdout(std::fs::File::create(log).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

pub const AUDIT_KEY: &str = "sk-test-audit-0001";
/// Keys whose ids the guard test gives their own `[guard.keys.<id>]` policies.
pub const GUARD_KEYS: &str = "flagger:sk-test-flag-0001\nshadower:sk-test-shadow-0001\ncompleter:sk-test-completion-0001\ncutter:sk-test-cut-0001\n";
/// A feedback key of the tester's tenant (its agents) and one of another tenant.
pub const FEEDBACK_KEY: &str = "sk-test-feedback-0001";
pub const OUTSIDER_KEY: &str = "sk-test-outsider-0001";
pub const FEEDBACK_KEYS: &str =
    "agents:sk-test-feedback-0001 feedback tenant=tester\noutsider:sk-test-outsider-0001 feedback\n";
pub const ADMIN_KEY: &str = "sk-test-admin-0001";
pub const CANNED: &str = "We are improving the service, please try again shortly.";

pub fn records_of(server: &Server) -> Vec<serde_json::Value> {
    std::fs::read_to_string(&server.log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "inference record")
        .collect()
}

/// A Python with the official `openai` client: `RAMPART_TEST_PYTHON`, or the test setup's
/// environment in the model cache (scripts/test.sh makes it).
pub fn python_with_openai() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("RAMPART_TEST_PYTHON").map(PathBuf::from),
        testkit::model_cache().map(|c| c.join("venv/bin/python")),
    ];
    candidates.into_iter().flatten().find(|p| {
        Command::new(p)
            .args(["-c", "import openai"])
            .status()
            .is_ok_and(|s| s.success())
    })
}
