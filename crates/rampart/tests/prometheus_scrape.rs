//! The real Prometheus (Debian's `prometheus`, installed by scripts/check-monitoring.sh) scrapes
//! the real `rampart serve` on SmolLM2 with the shipped rule files loaded, and the test reads
//! the series back through Prometheus's HTTP API: request counts, the time-to-first-token
//! histogram, host telemetry, a recording rule, the Watchdog alert, and the Helm chart's
//! prometheus-adapter queries (the autoscaling signals) for one pod. Without a `prometheus`
//! binary the test says so and passes, except in CI or under scripts/test.sh
//! (RAMPART_REQUIRE_MODELS=1), where it fails.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::cached_model;
use testkit::models::SMOLLM2_GGUF;

const KEY: &str = "sk-test-key-0001";
const MODEL: &str = "smollm2-135m";
/// The labels a Kubernetes scrape (the chart's ServiceMonitor) gives every series.
const NAMESPACE: &str = "serving";
const POD: &str = "rampart-5f7c9d8b6-x2k4q";

/// A child process killed when the test ends.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind a free port")
        .local_addr()
        .expect("local address")
        .port()
}

fn required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
        || std::env::var("RAMPART_REQUIRE_MODELS").is_ok_and(|v| v == "1")
}

fn find_prometheus() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("prometheus"))
        .find(|p| p.is_file())
}

/// One HTTP/1.1 exchange (Connection: close): status and body.
fn http(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    key: Option<&str>,
) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .ok()?;
    let auth = key
        .map(|k| format!("Authorization: Bearer {k}\r\n"))
        .unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    // Prometheus answers chunked; the JSON is the one line between the chunk sizes.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    Some((status, body))
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || tail.len() < n {
            break;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
    out
}

fn wait_for(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let start = Instant::now();
    while !ready() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn encode(query: &str) -> String {
    query
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// An instant query through Prometheus's HTTP API: the result vector.
fn query(prometheus: u16, promql: &str) -> Vec<serde_json::Value> {
    let path = format!("/api/v1/query?query={}", encode(promql));
    let Some((200, body)) = http(prometheus, "GET", &path, "", None) else {
        return Vec::new();
    };
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["result"].as_array().cloned().unwrap_or_default()
}

/// The first sample's value of an instant query.
fn value(prometheus: u16, promql: &str) -> Option<f64> {
    query(prometheus, promql)
        .first()
        .and_then(|s| s["value"][1].as_str()?.parse().ok())
}

fn import_model(dir: &Path, model: &Path) -> PathBuf {
    let repo = dir.join("models");
    let status = Command::new(assert_cmd::cargo::cargo_bin("rampart"))
        .args(["model", "import"])
        .arg(model)
        .args(["--name", MODEL, "--version", "1.0.0", "--repo"])
        .arg(&repo)
        .stdout(Stdio::null())
        .status()
        .expect("rampart model import runs");
    assert!(status.success(), "import {MODEL}");
    repo
}

#[test]
fn prometheus_scrapes_the_server_and_evaluates_the_shipped_rules() {
    let Some(prometheus_bin) = find_prometheus() else {
        assert!(
            !required(),
            "no prometheus on PATH: scripts/check-monitoring.sh --install installs it"
        );
        eprintln!("skipped: no prometheus on PATH (scripts/check-monitoring.sh --install installs Debian's)");
        return;
    };
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let repo = import_model(dir.path(), &model);
    let (port, grpc_port, prometheus) = (free_port(), free_port(), free_port());
    std::fs::write(dir.path().join("keys.txt"), format!("tester:{KEY}\n")).expect("write keys");
    let config = dir.path().join("rampart.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:{port}\"\nthreads = 2\n[grpc]\nlisten = \"127.0.0.1:{grpc_port}\"\n\
             [[models]]\nname = \"{MODEL}\"\ncontext = 1024\nkv_cache_memory = \"64MiB\"\n"
        ),
    )
    .expect("write config");
    let server = Process(
        Command::new(assert_cmd::cargo::cargo_bin("rampart"))
            .current_dir(dir.path())
            .args(["serve", "--repo"])
            .arg(&repo)
            .arg("--config")
            .arg(&config)
            .arg("--api-keys")
            .arg(dir.path().join("keys.txt"))
            .stdout(std::fs::File::create(dir.path().join("server.log")).expect("log file"))
            .stderr(Stdio::inherit())
            .spawn()
            .expect("rampart serve starts"),
    );
    wait_for("the server's readiness", Duration::from_secs(120), || {
        http(port, "GET", "/health/ready", "", None).is_some_and(|(s, _)| s == 200)
    });

    // Prometheus with the shipped rule files, scraping every second.
    let rules = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/monitoring/rules");
    let prom_config = dir.path().join("prometheus.yml");
    std::fs::write(
        &prom_config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}/rampart-recording.yml\n  - {}/rampart-alerts.yml\n\
             scrape_configs:\n  - job_name: rampart\n    static_configs:\n      - targets: [\"127.0.0.1:{port}\"]\n\
             \x20       labels: {{namespace: {NAMESPACE}, pod: {POD}}}\n",
            rules.display(),
            rules.display()
        ),
    )
    .expect("write prometheus.yml");
    let _prometheus = Process(
        Command::new(&prometheus_bin)
            .arg(format!("--config.file={}", prom_config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("tsdb").display()
            ))
            .arg(format!("--web.listen-address=127.0.0.1:{prometheus}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("prometheus.log")).expect("log file"))
            .spawn()
            .expect("prometheus starts"),
    );
    wait_for("Prometheus's readiness", Duration::from_secs(30), || {
        http(prometheus, "GET", "/-/ready", "", None).is_some_and(|(s, _)| s == 200)
    });

    // Two completions and one refused request.
    let chat = format!(
        "{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"Say hello.\"}}],\"max_tokens\":8}}"
    );
    for _ in 0..2 {
        let (status, body) = http(port, "POST", "/v1/chat/completions", &chat, Some(KEY))
            .expect("the server answers");
        assert_eq!(status, 200, "{body}");
    }
    let (status, _) = http(port, "POST", "/v1/chat/completions", &chat, None).expect("answers");
    assert_eq!(status, 401);

    let ok =
        format!("sum(rampart_requests_total{{job=\"rampart\",model=\"{MODEL}\",status=\"200\"}})");
    wait_for(
        "the requests in Prometheus",
        Duration::from_secs(30),
        || value(prometheus, &ok).is_some_and(|v| v >= 2.0),
    );
    assert_eq!(value(prometheus, &ok), Some(2.0));
    let refused = "sum(rampart_requests_total{job=\"rampart\",status=\"401\"})";
    assert_eq!(value(prometheus, refused), Some(1.0));

    // The TTFT histogram: both requests counted, buckets cumulative up to +Inf.
    let ttft_count = format!("rampart_time_to_first_token_seconds_count{{model=\"{MODEL}\"}}");
    assert_eq!(value(prometheus, &ttft_count), Some(2.0));
    let buckets = query(
        prometheus,
        &format!("rampart_time_to_first_token_seconds_bucket{{model=\"{MODEL}\"}}"),
    );
    assert!(buckets.len() >= 10, "{buckets:?}");
    let inf = buckets
        .iter()
        .find(|b| b["metric"]["le"] == "+Inf")
        .and_then(|b| b["value"][1].as_str()?.parse::<f64>().ok());
    assert_eq!(inf, Some(2.0));
    let median = value(
        prometheus,
        "histogram_quantile(0.5, sum by (le) (rampart_time_to_first_token_seconds_bucket))",
    )
    .expect("a TTFT median");
    assert!(median > 0.0 && median < 120.0, "{median}");

    // The autoscaling signals as prometheus-adapter asks for them (the chart's rules, with the
    // adapter's template filled in for one pod): every query evaluates, and the load signals
    // have a value for the pod.
    let signals = adapter_queries();
    assert!(signals.len() >= 5, "{signals:?}");
    for (name, promql) in &signals {
        let path = format!("/api/v1/query?query={}", encode(promql));
        let (status, body) = http(prometheus, "GET", &path, "", None).expect("Prometheus answers");
        assert_eq!(status, 200, "{name}: {promql}: {body}");
        let result = query(prometheus, promql);
        if matches!(name.as_str(), "rampart_concurrency" | "rampart_queue_depth") {
            assert_eq!(result.len(), 1, "{name}: one value for the pod: {result:?}");
            assert_eq!(result[0]["metric"]["pod"], POD, "{name}: {result:?}");
            let v: f64 = result[0]["value"][1].as_str().unwrap().parse().unwrap();
            assert!(v >= 0.0, "{name} = {v}");
        }
    }

    // Host telemetry of this machine, and no GPU series where there is no NVML.
    let rss = value(
        prometheus,
        "rampart_process_resident_memory_bytes{job=\"rampart\"}",
    )
    .expect("RSS is scraped");
    assert!(rss > 10e6, "{rss}");
    let available = value(prometheus, "rampart_host_memory_available_bytes").expect("MemAvailable");
    assert!(available > 0.0);
    assert!(value(prometheus, "rampart_process_open_fds").is_some_and(|v| v >= 3.0));
    assert!(value(prometheus, "rampart_process_cpu_seconds_total").is_some_and(|v| v > 0.0));
    if Path::new("/proc/pressure/memory").exists() {
        assert!(
            !query(
                prometheus,
                "rampart_pressure_stall_seconds_total{resource=\"memory\"}"
            )
            .is_empty(),
            "PSI is readable here but not scraped"
        );
    }
    let nvml = [
        "libnvidia-ml.so.1",
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1",
    ]
    .iter()
    .any(|p| Path::new(p).exists());
    if !nvml {
        assert!(query(prometheus, "{__name__=~\"rampart_gpu_.*\"}").is_empty());
    }

    // The shipped rules run on the real series: a recording rule and the Watchdog.
    wait_for("a recording rule", Duration::from_secs(30), || {
        value(
            prometheus,
            &format!("rampart:kv_cache:utilization{{model=\"{MODEL}\"}}"),
        )
        .is_some()
    });
    wait_for("the Watchdog", Duration::from_secs(30), || {
        !query(
            prometheus,
            "ALERTS{alertname=\"Watchdog\",alertstate=\"firing\"}",
        )
        .is_empty()
    });
    assert!(
        query(prometheus, "ALERTS{alertname=\"RampartTargetDown\"}").is_empty(),
        "the target is up"
    );
    drop(server);
}

/// The chart's prometheus-adapter rules (deploy/helm/rampart/files/prometheus-adapter-rules.yaml)
/// as the adapter runs them for one pod: (metric name, PromQL).
fn adapter_queries() -> Vec<(String, String)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/helm/rampart/files/prometheus-adapter-rules.yaml");
    let text = std::fs::read_to_string(&path).expect("the adapter rules");
    let quoted = |line: &str, key: &str| -> Option<String> {
        let rest = line.trim().strip_prefix(key)?.trim();
        Some(rest.trim_matches(|c| c == '\'' || c == '"').to_string())
    };
    let (mut series, mut name) = (None, None);
    let mut out = Vec::new();
    for line in text.lines() {
        if let Some(q) = quoted(line, "- seriesQuery:") {
            series = Some(q.split('{').next().unwrap().to_string());
        } else if let Some(n) = quoted(line, "as:") {
            name = Some(n);
        } else if let Some(m) = quoted(line, "metricsQuery:") {
            let promql = m
                .replace("<<.Series>>", series.as_deref().expect("seriesQuery first"))
                .replace(
                    "<<.LabelMatchers>>",
                    &format!("namespace=\"{NAMESPACE}\",pod=~\"{POD}\""),
                )
                .replace("<<.GroupBy>>", "pod");
            out.push((name.take().expect("a name per rule"), promql));
        }
    }
    out
}
