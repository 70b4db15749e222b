//! The load generator against a tiny in-process OpenAI server: hand-written HTTP/1.1 over a
//! TcpListener, streaming SSE in chunked encoding with known delays, events split across writes;
//! it can refuse each prompt a number of times first, with the headers of a shedding server.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use loadgen::{Arrivals, Benchmark, BenchmarkConfig, Endpoint, LoadgenError, WorkloadConfig};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MODEL_ID: &str = "fake-model";

#[derive(Clone, Default)]
struct Behaviour {
    time_to_first_token: Duration,
    inter_token: Duration,
    /// End each stream with a usage chunk: (prompt tokens, tokens claimed per content chunk).
    usage: Option<(usize, usize)>,
    /// Answer every completion request with this status and body instead of a stream.
    failure: Option<(u16, String)>,
    /// Refuse each distinct prompt this way before streaming it.
    refusal: Option<Refusal>,
}

#[derive(Clone)]
struct Refusal {
    /// Attempts refused per prompt (`usize::MAX`: always).
    times: usize,
    status: u16,
    headers: Vec<(&'static str, &'static str)>,
    body: &'static str,
}

/// One completion request as the server received it.
#[derive(Clone)]
struct Received {
    path: String,
    body: Value,
    /// Lower-case names.
    headers: HashMap<String, String>,
    at: Instant,
}

#[derive(Default)]
struct Seen {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// Every completion request, in the order received.
    received: Mutex<Vec<Received>>,
    /// Refusals so far, by prompt.
    refused: Mutex<HashMap<String, usize>>,
}

struct FakeServer {
    url: String,
    seen: Arc<Seen>,
    // Dropping the runtime stops the server.
    _runtime: tokio::runtime::Runtime,
}

impl FakeServer {
    fn start(behaviour: Behaviour) -> Self {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("test runtime starts");
        let listener = runtime
            .block_on(TcpListener::bind("127.0.0.1:0"))
            .expect("bind a local port");
        let url = format!("http://{}", listener.local_addr().expect("bound address"));
        let seen = Arc::new(Seen::default());
        let behaviour = Arc::new(behaviour);
        let seen_by_server = Arc::clone(&seen);
        runtime.spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve_connection(
                    socket,
                    Arc::clone(&behaviour),
                    Arc::clone(&seen_by_server),
                ));
            }
        });
        Self {
            url,
            seen,
            _runtime: runtime,
        }
    }

    fn requests(&self) -> Vec<(String, Value)> {
        self.received()
            .into_iter()
            .map(|received| (received.path, received.body))
            .collect()
    }

    fn received(&self) -> Vec<Received> {
        self.seen.received.lock().expect("not poisoned").clone()
    }

    fn max_in_flight(&self) -> usize {
        self.seen.max_in_flight.load(Ordering::SeqCst)
    }
}

struct HttpRequest {
    method: String,
    path: String,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

/// Appends what the next read brings; `None` at end of stream or on error.
async fn read_more(socket: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<()> {
    let mut piece = [0u8; 4096];
    let n = socket.read(&mut piece).await.ok()?;
    (n > 0).then(|| buffer.extend_from_slice(&piece[..n]))
}

async fn read_request(socket: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<HttpRequest> {
    let header_end = loop {
        if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        read_more(socket, buffer).await?;
    };
    let head = String::from_utf8_lossy(&buffer[..header_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next()?.split(' ');
    let (method, path) = (
        request_line.next()?.to_string(),
        request_line.next()?.to_string(),
    );
    let headers: HashMap<String, String> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.to_ascii_lowercase(), value.trim().to_string()))
        .collect();
    let content_length: usize = headers
        .get("content-length")
        .and_then(|value| value.parse().ok())
        .unwrap_or(0);
    while buffer.len() < header_end + content_length {
        read_more(socket, buffer).await?;
    }
    let body = buffer[header_end..header_end + content_length].to_vec();
    buffer.drain(..header_end + content_length);
    Some(HttpRequest {
        method,
        path,
        headers,
        body,
    })
}

async fn serve_connection(mut socket: TcpStream, behaviour: Arc<Behaviour>, seen: Arc<Seen>) {
    socket.set_nodelay(true).expect("set TCP_NODELAY");
    let mut buffer = Vec::new();
    while let Some(request) = read_request(&mut socket, &mut buffer).await {
        let answered = match (request.method.as_str(), request.path.as_str()) {
            ("GET", "/v1/models") => {
                let list = json!({"object": "list", "data": [{"id": MODEL_ID, "object": "model"}]});
                respond(&mut socket, 200, &list.to_string()).await
            }
            ("POST", "/v1/completions" | "/v1/chat/completions") => {
                let body: Value = serde_json::from_slice(&request.body).expect("JSON request body");
                seen.received.lock().expect("not poisoned").push(Received {
                    path: request.path.clone(),
                    body: body.clone(),
                    headers: request.headers.clone(),
                    at: Instant::now(),
                });
                if let Some(refusal) = &behaviour.refusal {
                    let prompt = body.get("prompt").unwrap_or(&body["messages"]).to_string();
                    let refused = {
                        let mut refused = seen.refused.lock().expect("not poisoned");
                        let count = refused.entry(prompt).or_default();
                        *count += 1;
                        *count <= refusal.times
                    };
                    if refused {
                        let answered = respond_with(
                            &mut socket,
                            refusal.status,
                            &refusal.headers,
                            refusal.body,
                        )
                        .await;
                        if answered.is_err() {
                            return;
                        }
                        continue;
                    }
                }
                let now = seen.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                seen.max_in_flight.fetch_max(now, Ordering::SeqCst);
                // A request leaves flight before its last bytes go out: the client may send its
                // next one (on another connection) as soon as it reads them.
                match &behaviour.failure {
                    Some((status, text)) => {
                        seen.in_flight.fetch_sub(1, Ordering::SeqCst);
                        respond(&mut socket, *status, text).await
                    }
                    None => {
                        let chat = request.path == "/v1/chat/completions";
                        let left = std::sync::atomic::AtomicBool::new(false);
                        let done = || {
                            left.store(true, Ordering::SeqCst);
                            seen.in_flight.fetch_sub(1, Ordering::SeqCst);
                        };
                        let answered =
                            stream_completion(&mut socket, &behaviour, &body, chat, done).await;
                        if !left.load(Ordering::SeqCst) {
                            // Cut short (the client went away): it leaves flight now.
                            seen.in_flight.fetch_sub(1, Ordering::SeqCst);
                        }
                        answered
                    }
                }
            }
            _ => respond(&mut socket, 404, "not found").await,
        };
        if answered.is_err() {
            return;
        }
    }
}

async fn respond(socket: &mut TcpStream, status: u16, body: &str) -> std::io::Result<()> {
    respond_with(socket, status, &[], body).await
}

async fn respond_with(
    socket: &mut TcpStream,
    status: u16,
    headers: &[(&str, &str)],
    body: &str,
) -> std::io::Result<()> {
    let extra: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let head = format!(
        "HTTP/1.1 {status} Fake\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n",
        body.len()
    );
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body.as_bytes()).await
}

async fn write_http_chunk(socket: &mut TcpStream, data: &[u8]) -> std::io::Result<()> {
    let mut framed = format!("{:x}\r\n", data.len()).into_bytes();
    framed.extend_from_slice(data);
    framed.extend_from_slice(b"\r\n");
    socket.write_all(&framed).await
}

fn sse(payload: &Value) -> Vec<u8> {
    format!("data: {payload}\n\n").into_bytes()
}

async fn stream_completion(
    socket: &mut TcpStream,
    behaviour: &Behaviour,
    request: &Value,
    chat: bool,
    done: impl FnOnce(),
) -> std::io::Result<()> {
    let max_tokens = request["max_tokens"].as_u64().expect("max_tokens") as usize;
    socket
        .write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        )
        .await?;
    // Neither a comment nor a role-only delta is a token.
    write_http_chunk(socket, b": keep-alive\n\n").await?;
    if chat {
        let role = json!({"choices": [{"index": 0, "delta": {"role": "assistant"}}]});
        write_http_chunk(socket, &sse(&role)).await?;
    }
    tokio::time::sleep(behaviour.time_to_first_token).await;
    for token in 0..max_tokens {
        if token > 0 {
            tokio::time::sleep(behaviour.inter_token).await;
        }
        let choice = if chat {
            json!({"index": 0, "delta": {"content": " tok"}})
        } else {
            json!({"index": 0, "text": " tok"})
        };
        let event = sse(&json!({"choices": [choice]}));
        // Each event arrives in two network reads.
        let (head, tail) = event.split_at(event.len() / 2);
        write_http_chunk(socket, head).await?;
        tokio::time::sleep(Duration::from_millis(2)).await;
        write_http_chunk(socket, tail).await?;
    }
    let last = if chat {
        json!({"index": 0, "delta": {}, "finish_reason": "length"})
    } else {
        json!({"index": 0, "text": "", "finish_reason": "length"})
    };
    let mut ending = sse(&json!({"choices": [last]}));
    if let Some((prompt_tokens, tokens_per_chunk)) = behaviour.usage {
        let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens * tokens_per_chunk});
        ending.extend(sse(&json!({"choices": [], "usage": usage})));
    }
    ending.extend_from_slice(b"data: [DONE]\n\n");
    done();
    write_http_chunk(socket, &ending).await?;
    socket.write_all(b"0\r\n\r\n").await
}

fn config(url: &str, output_tokens: usize, requests_per_level: usize) -> BenchmarkConfig {
    BenchmarkConfig {
        base_url: url.to_string(),
        workload: WorkloadConfig {
            prompt_tokens: 16,
            output_tokens,
            ..WorkloadConfig::default()
        },
        requests_per_level,
        warmup_requests: 0,
        request_timeout: Duration::from_secs(30),
        ..BenchmarkConfig::default()
    }
}

#[test]
fn completions_are_counted_and_timed_at_each_concurrency() {
    let server = FakeServer::start(Behaviour {
        time_to_first_token: Duration::from_millis(50),
        inter_token: Duration::from_millis(20),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        warmup_requests: 1,
        ..config(&server.url, 5, 6)
    })
    .expect("benchmark starts");
    assert_eq!(benchmark.model(), MODEL_ID, "model taken from /v1/models");
    let warmup = benchmark.warm_up();
    assert_eq!((warmup.completed, warmup.failed), (1, 0));

    let sequential = benchmark.run_level(1).expect("level runs");
    assert_eq!(server.max_in_flight(), 1);
    let concurrent = benchmark.run_level(3).expect("level runs");
    assert_eq!(server.max_in_flight(), 3, "exactly 3 requests in flight");

    for level in [&sequential, &concurrent] {
        assert_eq!((level.requests, level.completed, level.failed), (6, 6, 0));
        assert!(level.errors.is_empty());
        assert_eq!(level.total_output_tokens, 30);
        assert_eq!(level.output_tokens_from_server, 0);
        assert_eq!(
            level.total_input_tokens,
            6 * 16,
            "words stand in for tokens"
        );
        assert_eq!(level.input_tokens_from_server, 0);
        let ttft = level.ttft_ms.expect("TTFT measured");
        assert!(
            (50.0..2000.0).contains(&ttft.p50),
            "TTFT p50 {} ms",
            ttft.p50
        );
        let itl = level.itl_ms.expect("ITL measured");
        assert!((15.0..1000.0).contains(&itl.p50), "ITL p50 {} ms", itl.p50);
        let tpot = level.tpot_ms.expect("TPOT measured");
        assert!(
            (15.0..1000.0).contains(&tpot.p50),
            "TPOT p50 {} ms",
            tpot.p50
        );
        let e2e = level.e2e_ms.expect("E2E measured");
        assert!(e2e.p50 >= 50.0 + 4.0 * 20.0, "E2E p50 {} ms", e2e.p50);
        assert!(e2e.p50 > ttft.p50);
        assert!(level.output_tokens_per_s > 0.0 && level.requests_per_s > 0.0);
    }
    // Three at a time finish the same work in well under the sequential time.
    assert!(concurrent.duration_s < sequential.duration_s);

    let requests = server.requests();
    assert_eq!(requests.len(), 1 + 6 + 6);
    for (path, body) in &requests {
        assert_eq!(path, "/v1/completions");
        assert_eq!(body["model"], MODEL_ID);
        assert_eq!(body["stream"], true);
        assert_eq!(body["ignore_eos"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["max_tokens"], 5);
        assert_eq!(body["temperature"], 0.0);
        assert_eq!(
            body["prompt"].as_str().expect("prompt").split(' ').count(),
            16
        );
    }
    // Warm-up and each level draw different prompts.
    assert_ne!(requests[0].1["prompt"], requests[1].1["prompt"]);
    let first_prompts = |from: usize| -> Vec<Value> {
        let mut prompts: Vec<Value> = requests[from..from + 6]
            .iter()
            .map(|(_, body)| body["prompt"].clone())
            .collect();
        prompts.sort_by_key(Value::to_string);
        prompts
    };
    assert_ne!(first_prompts(1), first_prompts(7));
}

#[test]
fn server_usage_is_preferred_for_token_counts() {
    let server = FakeServer::start(Behaviour {
        time_to_first_token: Duration::from_millis(10),
        inter_token: Duration::from_millis(20),
        usage: Some((100, 2)),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(config(&server.url, 5, 4)).expect("benchmark starts");
    let level = benchmark.run_level(2).expect("level runs");
    assert_eq!((level.completed, level.failed), (4, 0));
    assert_eq!(level.total_output_tokens, 4 * 10);
    assert_eq!(level.output_tokens_from_server, 4);
    assert_eq!(level.total_input_tokens, 4 * 100);
    assert_eq!(level.input_tokens_from_server, 4);
    // Two tokens per chunk: time per token is under half the gap between chunks.
    let (tpot, itl) = (level.tpot_ms.expect("TPOT"), level.itl_ms.expect("ITL"));
    assert!(
        tpot.p50 < 0.6 * itl.p50,
        "TPOT {} vs ITL {}",
        tpot.p50,
        itl.p50
    );
}

#[test]
fn chat_counts_delta_content_only() {
    let server = FakeServer::start(Behaviour {
        time_to_first_token: Duration::from_millis(30),
        inter_token: Duration::from_millis(5),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        endpoint: Endpoint::Chat,
        model: Some("chosen".to_string()),
        temperature: 0.7,
        ..config(&format!("{}/v1/", server.url), 4, 3)
    })
    .expect("benchmark starts");
    let level = benchmark.run_level(1).expect("level runs");
    assert_eq!((level.completed, level.failed), (3, 0));
    assert_eq!(
        level.total_output_tokens, 12,
        "the role delta is not a token"
    );
    // The role delta arrives at once; TTFT waits for the first content.
    assert!(level.ttft_ms.expect("TTFT").p50 >= 30.0);
    for (path, body) in server.requests() {
        assert_eq!(path, "/v1/chat/completions");
        assert_eq!(body["model"], "chosen");
        assert_eq!(body["temperature"], 0.7);
        assert_eq!(body["messages"][0]["role"], "user");
        assert!(body.get("prompt").is_none());
    }
}

#[test]
fn http_errors_are_counted_with_status_and_body() {
    let body = format!("overloaded: {}", "x".repeat(400));
    let server = FakeServer::start(Behaviour {
        failure: Some((503, body.clone())),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(config(&server.url, 5, 4)).expect("benchmark starts");
    let warmup = benchmark.warm_up();
    let level = benchmark.run_level(2).expect("level runs");
    assert_eq!((level.completed, level.failed), (0, 4));
    assert_eq!(level.errors.len(), 1);
    assert_eq!(level.errors[0].count, 4);
    let expected: String = body.chars().take(200).collect();
    assert_eq!(level.errors[0].message, format!("HTTP 503: {expected}"));
    assert!(level.ttft_ms.is_none());
    let report = benchmark.report(warmup, vec![level]);
    assert!(report.every_request_failed());
}

#[test]
fn slow_requests_time_out() {
    let server = FakeServer::start(Behaviour {
        time_to_first_token: Duration::from_secs(5),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        request_timeout: Duration::from_millis(200),
        ..config(&server.url, 3, 2)
    })
    .expect("benchmark starts");
    let level = benchmark.run_level(2).expect("level runs");
    assert_eq!((level.completed, level.failed), (0, 2));
    assert!(
        level.errors[0].message.starts_with("timed out"),
        "{:?}",
        level.errors
    );
    assert!(level.duration_s < 3.0, "requests were cut at the timeout");
}

#[test]
fn unreachable_server_fails_model_lookup_and_requests() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free port")
        .port();
    let url = format!("http://127.0.0.1:{port}");
    match Benchmark::new(config(&url, 3, 2)) {
        Err(LoadgenError::ModelList { .. }) => {}
        other => panic!("expected a model list error, got {:?}", other.err()),
    }
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        model: Some("m".to_string()),
        ..config(&url, 3, 2)
    })
    .expect("no lookup with an explicit model");
    let level = benchmark.run_level(1).expect("level runs");
    assert_eq!((level.completed, level.failed), (0, 2));
    assert!(
        level.errors[0].message.starts_with("connection error"),
        "{:?}",
        level.errors
    );
}

const SHED_429: Refusal = Refusal {
    times: 2,
    status: 429,
    headers: Vec::new(),
    body: r#"{"error":{"message":"overloaded","type":"rate_limit_error"}}"#,
};

#[test]
fn refused_requests_are_sent_again_identically_and_users_wait_for_it() {
    let server = FakeServer::start(Behaviour {
        time_to_first_token: Duration::from_millis(10),
        inter_token: Duration::from_millis(5),
        refusal: Some(Refusal {
            headers: vec![("retry-after-ms", "50"), ("retry-after", "1")],
            ..SHED_429
        }),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        max_retries: 30,
        send_request_id: true,
        api_key: Some("sk-test".to_string()),
        ..config(&server.url, 3, 1)
    })
    .expect("benchmark starts");
    let level = benchmark.run_level(1).expect("level runs");
    assert_eq!((level.requests, level.completed, level.failed), (1, 1, 0));
    assert_eq!(
        (level.gave_up, level.retries, level.responses_429),
        (0, 2, 2)
    );
    assert!(level.errors.is_empty(), "{:?}", level.errors);

    let received = server.received();
    assert_eq!(received.len(), 3, "two refusals, then the stream");
    for (retries, attempt) in received.iter().enumerate() {
        assert_eq!(attempt.body, received[0].body, "the same body every time");
        assert_eq!(
            attempt.headers["x-stainless-retry-count"],
            retries.to_string()
        );
        for header in ["x-request-id", "authorization", "content-type"] {
            assert_eq!(
                attempt.headers[header], received[0].headers[header],
                "{header}"
            );
        }
    }
    assert!(received[0].headers["x-request-id"].starts_with("loadgen-"));
    assert_eq!(received[0].headers["authorization"], "Bearer sk-test");
    // retry-after-ms (50 ms) wins over Retry-After (1 s).
    for pair in received.windows(2) {
        let gap = pair[1].at - pair[0].at;
        assert!(
            gap >= Duration::from_millis(50) && gap < Duration::from_millis(900),
            "{gap:?} between attempts"
        );
    }

    let user = level.user_ttft_ms.expect("user TTFT").p50;
    let admitted = level.ttft_ms.expect("admitted TTFT").p50;
    assert!(user >= 100.0, "user TTFT {user} ms counts both waits");
    assert!(
        user - admitted >= 100.0,
        "user {user} ms, admitted {admitted} ms"
    );
    assert!(
        admitted < 100.0,
        "the admitted attempt waited {admitted} ms"
    );
    let user_e2e = level.user_e2e_ms.expect("user E2E").p50;
    assert!(user_e2e - level.e2e_ms.expect("E2E").p50 >= 100.0);
}

#[test]
fn a_server_that_always_refuses_is_given_up_on_after_max_retries() {
    let server = FakeServer::start(Behaviour {
        refusal: Some(Refusal {
            times: usize::MAX,
            headers: vec![("retry-after-ms", "10")],
            ..SHED_429
        }),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        max_retries: 3,
        ..config(&server.url, 3, 2)
    })
    .expect("benchmark starts");
    let level = benchmark.run_level(2).expect("level runs");
    assert_eq!((level.requests, level.completed, level.failed), (2, 0, 2));
    assert_eq!(level.gave_up, 2);
    assert_eq!((level.retries, level.responses_429), (6, 8));
    assert_eq!(server.received().len(), 8, "1 + 3 attempts each");
    assert_eq!(level.errors.len(), 1);
    assert_eq!(level.errors[0].count, 2);
    assert!(
        level.errors[0].message.starts_with("HTTP 429: "),
        "{:?}",
        level.errors
    );
    assert!(level.user_ttft_ms.is_none() && level.ttft_ms.is_none());
    let warmup = benchmark.warm_up();
    let report = benchmark.report(warmup, vec![level]);
    assert!(report.every_request_failed());
    let json = serde_json::to_value(&report).expect("serializes");
    assert_eq!(json["max_retries"], 3);
    assert_eq!(json["levels"][0]["gave_up"], 2);
}

#[test]
fn retry_after_beyond_60_s_falls_back_to_the_backoff() {
    let server = FakeServer::start(Behaviour {
        refusal: Some(Refusal {
            times: 1,
            status: 503,
            headers: vec![("retry-after", "120")],
            body: "restarting",
        }),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        max_retries: 2,
        ..config(&server.url, 2, 1)
    })
    .expect("benchmark starts");
    let level = benchmark.run_level(1).expect("level runs");
    assert_eq!(
        (level.completed, level.retries, level.responses_429),
        (1, 1, 0)
    );
    let received = server.received();
    assert_eq!(received.len(), 2);
    // The first backoff: 0.5 s less up to a quarter of jitter, not 120 s.
    let gap = received[1].at - received[0].at;
    assert!(
        gap >= Duration::from_millis(370) && gap < Duration::from_secs(5),
        "{gap:?} between attempts"
    );
}

#[test]
fn refusals_the_clients_do_not_retry_end_the_request() {
    for (status, headers) in [(429, vec![("x-should-retry", "false")]), (400, vec![])] {
        let server = FakeServer::start(Behaviour {
            refusal: Some(Refusal {
                times: usize::MAX,
                status,
                headers,
                body: "no",
            }),
            ..Behaviour::default()
        });
        let mut benchmark = Benchmark::new(BenchmarkConfig {
            max_retries: 5,
            ..config(&server.url, 2, 1)
        })
        .expect("benchmark starts");
        let level = benchmark.run_level(1).expect("level runs");
        assert_eq!(
            (level.failed, level.gave_up, level.retries),
            (1, 0, 0),
            "{status}"
        );
        assert_eq!(server.received().len(), 1);
    }
}

#[test]
fn bursts_arrive_together_and_the_cap_drops_the_excess() {
    let behaviour = Behaviour {
        time_to_first_token: Duration::from_millis(60),
        inter_token: Duration::from_millis(10),
        ..Behaviour::default()
    };
    let bursts = Arrivals::Burst {
        size: 3,
        every_s: 0.5,
        rate_per_s: 0.0,
    };
    let server = FakeServer::start(behaviour.clone());
    let mut benchmark = Benchmark::new(config(&server.url, 3, 6)).expect("benchmark starts");
    let level = benchmark.run(bursts).expect("level runs");
    assert_eq!((level.requests, level.completed, level.dropped), (6, 6, 0));
    assert_eq!(level.arrivals, bursts);
    assert_eq!(server.max_in_flight(), 3, "a burst at a time");
    assert_eq!(level.peak_outstanding, 3);
    assert_eq!(level.concurrency, 3, "an open loop reports its peak");
    let at: Vec<Instant> = server.received().iter().map(|r| r.at).collect();
    assert!(
        at[2] - at[0] < Duration::from_millis(250),
        "{:?}",
        at[2] - at[0]
    );
    assert!(
        at[3] - at[0] >= Duration::from_millis(400),
        "{:?}",
        at[3] - at[0]
    );
    assert!(
        at[5] - at[3] < Duration::from_millis(250),
        "{:?}",
        at[5] - at[3]
    );
    assert!(level.duration_s >= 0.5);

    // With at most 2 outstanding, the third of each burst is dropped, never sent.
    let server = FakeServer::start(behaviour);
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        max_outstanding: 2,
        ..config(&server.url, 3, 6)
    })
    .expect("benchmark starts");
    let level = benchmark.run(bursts).expect("level runs");
    assert_eq!((level.requests, level.completed, level.dropped), (4, 4, 2));
    assert_eq!(level.peak_outstanding, 2);
    assert_eq!(server.received().len(), 4);
}

#[test]
fn poisson_arrivals_run_for_the_duration() {
    let server = FakeServer::start(Behaviour {
        time_to_first_token: Duration::from_millis(5),
        inter_token: Duration::from_millis(5),
        ..Behaviour::default()
    });
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        open_loop_duration: Some(Duration::from_millis(800)),
        ..config(&server.url, 2, 1)
    })
    .expect("benchmark starts");
    let level = benchmark
        .run(Arrivals::Poisson { rate_per_s: 40.0 })
        .expect("level runs");
    // 32 expected; the count is a draw of the seeded schedule.
    assert!(
        (10..70).contains(&level.requests),
        "{} requests",
        level.requests
    );
    assert_eq!(
        (level.completed, level.failed, level.dropped),
        (level.requests, 0, 0)
    );
    assert!(level.duration_s >= 0.6, "{} s", level.duration_s);
    assert_eq!(level.user_ttft_ms, level.ttft_ms, "nothing retried");
    // Without retries or --request-id, requests carry neither header (as before).
    for received in server.received() {
        assert!(!received.headers.contains_key("x-stainless-retry-count"));
        assert!(!received.headers.contains_key("x-request-id"));
    }
    let warmup = benchmark.warm_up();
    let report = benchmark.report(warmup, vec![level]);
    let json = serde_json::to_value(&report).expect("serializes");
    assert_eq!(json["open_loop_duration_s"], 0.8);
    assert_eq!(json["levels"][0]["arrivals"]["kind"], "poisson");
}
