//! The HTTP and gRPC layers driven in-process over loopback, with fake backends behind the
//! backend seam: typed errors to status codes, a slow first token, a failure mid-stream, overload,
//! keys, drain, clients that go away, and a stuck sink that must not slow anyone. The real
//! binary with real models is tested in `crates/rampart/tests/serve.rs`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{FinishReason, Finished};
use futures_util::stream::{self, StreamExt};
use record::testing::{Collected, CollectingSink, Gate, GatedSink};
use record::{Bus, Delivery, DropReason, InferenceRecord, RecordBuilder, Sink};
use server::auth::KeyStore;
use server::backend::{
    Answer, BackendError, Description, Embeddings, Generated, Generation, InferResponse,
    InferenceBackend, Kind, OutputTensor, StartFuture, Token, Work, WorkKind,
};
use server::chain::Policy;
use server::config::ServerConfig;
use server::registry::Entry;
use server::state::AppState;

const KEY: &str = "sk-in-process-0001";

/// What a fake language model does with each request.
#[derive(Debug, Clone)]
enum Script {
    /// Streams these tokens, `gap` apart after waiting `first` for the first one.
    Tokens {
        tokens: Vec<&'static str>,
        first: Duration,
        gap: Duration,
    },
    /// Refuses the work at once.
    Refuse(BackendError),
    /// Streams these tokens, then fails.
    FailAfter(Vec<&'static str>),
}

struct FakeLlm {
    script: Script,
    started: AtomicUsize,
}

fn finished(completion_tokens: usize) -> Finished {
    Finished {
        reason: FinishReason::Stop,
        prompt_tokens: 3,
        completion_tokens,
        cached_prompt_tokens: 0,
        queue_seconds: 0.0,
        prefill_seconds: 0.001,
        decode_seconds: 0.002,
        trailing_text: String::new(),
        stop: None,
        speculated_tokens: 0,
        speculated_accepted: 0,
    }
}

fn token(text: &'static str) -> Generated {
    Generated::Token(Token {
        text: text.into(),
        entropy: 0.5,
        logprobs: None,
        attention: Vec::new(),
        id: 0,
    })
}

impl InferenceBackend for FakeLlm {
    fn kind(&self) -> Kind {
        Kind::Llm
    }
    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Generate
    }
    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a> {
        self.started.fetch_add(1, Ordering::SeqCst);
        let script = self.script.clone();
        Box::pin(async move {
            let Work::Generate(plan) = work else {
                return Err(BackendError::invalid("not generation"));
            };
            record.record.prompt_tokens = 3 * plan.n;
            let events = match script {
                Script::Refuse(e) => return Err(e),
                Script::Tokens { tokens, first, gap } => {
                    let n = tokens.len();
                    let mut items: Vec<(Duration, Generated)> = Vec::new();
                    for (i, t) in tokens.into_iter().enumerate() {
                        items.push((if i == 0 { first } else { gap }, token(t)));
                    }
                    items.push((Duration::ZERO, Generated::Finished(finished(n))));
                    stream::iter(items)
                        .then(|(wait, event)| async move {
                            tokio::time::sleep(wait).await;
                            (0, event)
                        })
                        .boxed()
                }
                Script::FailAfter(tokens) => {
                    let mut items: Vec<Generated> = tokens.into_iter().map(token).collect();
                    items.push(Generated::Failed(BackendError::Failed(
                        "generation failed: the device fell off the bus".into(),
                    )));
                    stream::iter(items.into_iter().map(|e| (0, e))).boxed()
                }
            };
            Ok(Answer::Generation(Generation {
                events,
                choices: 1,
                prompt_tokens: 3,
                structured: None,
                watch: None,
                tools: None,
                explain: None,
            }))
        })
    }
    fn describe(&self) -> Description {
        Description {
            max_context: 2048,
            platform: "fake_llm".into(),
            ..Description::default()
        }
    }
}

/// Echoes its first input as `y` (an input named `overload` is refused as a full queue, one
/// named `slow` answers after 500 ms); embeds texts as their lengths.
struct FakeTensor;

impl InferenceBackend for FakeTensor {
    fn kind(&self) -> Kind {
        Kind::Tensor
    }
    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Tensors
    }
    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a> {
        Box::pin(async move {
            let Work::Tensors(request) = work else {
                return Err(BackendError::invalid("not tensors"));
            };
            let Some(input) = request.inputs.into_iter().next() else {
                return Err(BackendError::invalid("no input"));
            };
            if input.name == "slow" {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            if input.name == "overload" {
                return Err(BackendError::Overloaded {
                    message: "the batcher's queue is full".into(),
                    retry_after_s: 2,
                    code: "queue_full",
                    booking: None,
                });
            }
            record.record.items = input.batch();
            let mut tensor = input;
            tensor.name = "y".into();
            Ok(Answer::Tensors(InferResponse {
                model_name: String::new(),
                model_version: String::new(),
                id: request.id,
                outputs: vec![OutputTensor {
                    tensor,
                    binary: false,
                }],
                judgements: Vec::new(),
            }))
        })
    }
    fn describe(&self) -> Description {
        Description {
            platform: "fake_tensor".into(),
            ..Description::default()
        }
    }
}

struct FakeEmbedder;

impl InferenceBackend for FakeEmbedder {
    fn kind(&self) -> Kind {
        Kind::Embedding
    }
    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Embed
    }
    fn start<'a>(&'a self, work: Work, _record: &'a mut RecordBuilder) -> StartFuture<'a> {
        Box::pin(async move {
            let Work::Embed(e) = work else {
                return Err(BackendError::invalid("not embeddings"));
            };
            let server::backend::EmbeddingInputs::Texts(texts) = e.inputs else {
                return Err(BackendError::invalid("texts only"));
            };
            Ok(Answer::Embeddings(Embeddings {
                prompt_tokens: texts.len(),
                vectors: texts.iter().map(|t| vec![t.len() as f32, 1.0]).collect(),
            }))
        })
    }
    fn describe(&self) -> Description {
        Description {
            max_context: 128,
            platform: "fake_embedding".into(),
            ..Description::default()
        }
    }
}

/// A server on loopback with the given backends, and what its lossless test sink saw.
struct Harness {
    url: String,
    state: Arc<AppState>,
    records: Collected,
    client: reqwest::Client,
}

struct Options {
    keys: bool,
    max_in_flight: usize,
    max_waiting: usize,
    extra_sinks: Vec<Box<dyn Sink>>,
    /// Fallback policies by backend id (`name@version`).
    policies: Vec<(&'static str, Policy)>,
    /// Edits the server's configuration (breaker, hand-off, faults, keys file lines).
    configure: fn(&mut ServerConfig),
    /// Extra key lines (`id:key scopes`).
    extra_keys: &'static str,
    /// Keep an audit log with these settings (its sink on the bus, its upkeep task running).
    audit: Option<audit::AuditConfig>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            keys: true,
            max_in_flight: 8,
            max_waiting: 8,
            extra_sinks: Vec::new(),
            policies: Vec::new(),
            configure: |_| {},
            extra_keys: "",
            audit: None,
        }
    }
}

async fn harness(backends: Vec<(&str, Arc<dyn InferenceBackend>)>, options: Options) -> Harness {
    let mut config = ServerConfig::default();
    config.admission.max_in_flight = options.max_in_flight;
    config.admission.max_waiting = options.max_waiting;
    config.admission.queue_timeout_ms = 200;
    (options.configure)(&mut config);
    let keys = options
        .keys
        .then(|| KeyStore::parse(&format!("tester:{KEY}\n{}", options.extra_keys), '\n').unwrap());
    let (sink, records) = CollectingSink::new(
        "test",
        Delivery::Lossless {
            capacity: 1024,
            timeout: Duration::from_secs(10),
            acknowledge: false,
        },
    );
    let mut sinks: Vec<Box<dyn Sink>> = vec![Box::new(sink)];
    sinks.extend(options.extra_sinks);
    let log = options.audit.map(|a| {
        config.audit = a;
        audit::AuditLog::open(config.audit.log_options()).unwrap()
    });
    if let Some(log) = &log {
        sinks.push(Box::new(audit::AuditSink::new(
            Arc::clone(log),
            &config.audit,
        )));
        let service = audit::Service {
            log: Arc::clone(log),
            shipper: None,
            interval: Duration::from_millis(config.audit.checkpoint_interval_ms),
        };
        tokio::spawn(service.run(|| (0, 0)));
    }
    let bus = Bus::start(sinks).unwrap();
    let state = AppState::with_audit(config.clone(), keys, None, bus, log);
    let mut policies = options.policies;
    for (id, backend) in backends {
        let (name, version) = id.split_once('@').unwrap_or((id, "1.0.0"));
        let mut entry = Entry::new(
            name,
            version,
            "sha256:fake",
            server::admission::Admission::new(config.admission.clone()),
            backend,
        )
        .with_breaker((&config.breaker).into());
        let full = format!("{name}@{version}");
        if let Some(i) = policies.iter().position(|(p, _)| *p == full) {
            entry = entry.with_policy(policies.remove(i).1);
        }
        state.front.registry.add(entry);
    }
    assert!(policies.is_empty(), "policies for unknown backends");
    server::spawn_readiness(Arc::clone(&state));
    state.loaded();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = server::http::router(Arc::clone(&state));
    tokio::spawn(async move { axum::serve(listener, app).await });
    Harness {
        url: format!("http://{addr}"),
        state,
        records,
        client: reqwest::Client::new(),
    }
}

impl Harness {
    async fn post(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url))
            .bearer_auth(KEY)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    /// The records seen so far, once `n` have arrived (the sink runs on its own task).
    async fn records(&self, n: usize) -> Vec<InferenceRecord> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.records.len() < n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.records.records()
    }
}

fn llm(script: Script) -> Arc<dyn InferenceBackend> {
    Arc::new(FakeLlm {
        script,
        started: AtomicUsize::new(0),
    })
}

fn hello() -> Script {
    Script::Tokens {
        tokens: vec!["Hello", " world"],
        first: Duration::ZERO,
        gap: Duration::ZERO,
    }
}

fn chat(stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "fake",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "max_tokens": 8,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_goes_through_the_front_and_leaves_one_record() {
    let h = harness(vec![("fake", llm(hello()))], Options::default()).await;
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["choices"][0]["message"]["content"], "Hello world");
    assert_eq!(body["model"], "fake");
    assert_eq!(body["system_fingerprint"], "fake@1.0.0");
    assert_eq!(body["usage"]["completion_tokens"], 2);
    let records = h.records(1).await;
    assert_eq!(records.len(), 1);
    let r = &records[0];
    assert_eq!(
        (r.status, r.model.as_str(), r.version.as_str()),
        (200, "fake", "1.0.0")
    );
    assert_eq!(r.finish_reason.as_deref(), Some("stop"));
    assert_eq!((r.principal.as_str(), r.completion_tokens), ("tester", 2));
    assert!(r.error_type.is_none() && r.refusal.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_backend_errors_become_their_status_codes() {
    let cases = [
        (
            BackendError::Overloaded {
                message: "queue full".into(),
                retry_after_s: 3,
                code: "queue_full",
                booking: None,
            },
            429,
            "rate_limit_error",
            Some("queue_full"),
        ),
        (
            BackendError::invalid_param("response_format", "bad schema"),
            400,
            "invalid_request_error",
            None,
        ),
        (
            BackendError::ContextLength("too long".into()),
            400,
            "invalid_request_error",
            Some("context_length_exceeded"),
        ),
        (
            BackendError::Unavailable {
                message: "stopping".into(),
                retry_after_s: 5,
            },
            503,
            "service_unavailable",
            None,
        ),
        (
            BackendError::Timeout {
                message: "no slot in time".into(),
                retry_after_s: 1,
            },
            503,
            "service_unavailable",
            None,
        ),
        (
            BackendError::Failed("boom".into()),
            500,
            "server_error",
            None,
        ),
    ];
    for (i, (error, status, kind, code)) in cases.into_iter().enumerate() {
        let h = harness(
            vec![("fake", llm(Script::Refuse(error)))],
            Options::default(),
        )
        .await;
        let r = h.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(r.status().as_u16(), status, "case {i}");
        if status == 429 || status == 503 {
            assert!(r.headers().contains_key("retry-after"), "case {i}");
        }
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], kind, "case {i}: {body}");
        assert_eq!(body["error"]["code"].as_str(), code, "case {i}: {body}");
        let records = h.records(1).await;
        assert_eq!(records[0].status, status, "case {i}");
        assert_eq!(records[0].error_type.as_deref(), Some(kind), "case {i}");
        assert_eq!(records[0].error_code.as_deref(), code, "case {i}");
        // The backend's own refusals (its queue, its first-token gate) are counted as
        // refusals by their code; its failures are not.
        let refused = (status == 429).then_some("queue_full");
        assert_eq!(records[0].refusal, refused, "case {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_first_token_still_streams_and_is_timed() {
    let script = Script::Tokens {
        tokens: vec!["a", "b", "c"],
        first: Duration::from_millis(150),
        gap: Duration::from_millis(5),
    };
    let h = harness(vec![("fake", llm(script))], Options::default()).await;
    let r = h.post("/v1/chat/completions", chat(true)).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let content: String = data
        .iter()
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| {
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(content, "abc");
    let r = &h.records(1).await[0];
    assert!(r.stream && r.status == 200);
    assert!(r.ttft_ms >= 140.0, "time to first token {} ms", r.ttft_ms);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_mid_stream_ends_with_a_typed_error_event() {
    let h = harness(
        vec![("fake", llm(Script::FailAfter(vec!["par", "tial"])))],
        Options::default(),
    )
    .await;
    let text = h
        .post("/v1/chat/completions", chat(true))
        .await
        .text()
        .await
        .unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let error: serde_json::Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert_eq!(error["error"]["type"], "server_error", "{text}");
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("device fell off"));
    assert!(!text.contains("\"finish_reason\":\"stop\""), "{text}");
    let r = &h.records(1).await[0];
    assert_eq!(
        (r.status, r.error_type.as_deref()),
        (500, Some("server_error"))
    );
    // Non-streaming: the same failure is a 500 body.
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 500);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_mid_stream_still_leaves_its_record() {
    let script = Script::Tokens {
        tokens: vec!["x"; 200],
        first: Duration::ZERO,
        gap: Duration::from_millis(10),
    };
    let h = harness(vec![("fake", llm(script))], Options::default()).await;
    for _ in 0..4 {
        let mut r = h.post("/v1/chat/completions", chat(true)).await;
        // Read a little, then hang up.
        let _ = r.chunk().await.unwrap();
        drop(r);
    }
    let records = h.records(4).await;
    assert_eq!(records.len(), 4, "every disconnect is recorded");
    for r in &records {
        assert_eq!(r.status, 499, "{r:?}");
        assert_eq!(r.finish_reason.as_deref(), Some("cancelled"));
    }
    // The admission slots came back.
    let deadline = Instant::now() + Duration::from_secs(5);
    while h.state.front.registry.busy() > 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(h.state.front.registry.busy(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_keys_and_drain_are_refused_with_their_reason_recorded() {
    let slow = Script::Tokens {
        tokens: vec!["x"],
        first: Duration::from_millis(400),
        gap: Duration::ZERO,
    };
    let h = harness(
        vec![("fake", llm(slow))],
        Options {
            max_in_flight: 1,
            max_waiting: 0,
            ..Options::default()
        },
    )
    .await;
    let busy = {
        let h_url = h.url.clone();
        let client = h.client.clone();
        tokio::spawn(async move {
            client
                .post(format!("{h_url}/v1/chat/completions"))
                .bearer_auth(KEY)
                .json(&chat(false))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    // The slow request holds the one slot before the next arrives.
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.state.front.registry.busy() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(busy.await.unwrap(), 200);

    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.url))
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    h.state.front.drain();
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 503);

    let records = h.records(4).await;
    let refusal = |status: u16| {
        records
            .iter()
            .find(|r| r.status == status)
            .unwrap_or_else(|| panic!("no {status} record in {records:?}"))
    };
    assert_eq!(refusal(429).refusal, Some("queue_full"));
    assert_eq!(refusal(429).error_code.as_deref(), Some("queue_full"));
    assert_eq!(refusal(401).refusal, Some("unauthorized"));
    assert_eq!(refusal(401).principal, "unauthenticated");
    assert_eq!(
        refusal(503).error_type.as_deref(),
        Some("service_unavailable")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_lossy_sink_never_slows_requests_and_its_drops_are_counted() {
    let gate = Gate::closed();
    let (stuck, _) = CollectingSink::new("stuck", Delivery::Lossy { capacity: 4 });
    let h = harness(
        vec![("fake", llm(hello()))],
        Options {
            extra_sinks: vec![Box::new(GatedSink::new(stuck, &gate))],
            ..Options::default()
        },
    )
    .await;
    let started = Instant::now();
    for _ in 0..40 {
        let r = h.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(r.status(), 200);
    }
    let elapsed = started.elapsed();
    let records = h.records(40).await;
    assert_eq!(records.len(), 40, "the lossless test sink got every record");
    let stuck = h
        .state
        .front
        .bus
        .counters()
        .into_iter()
        .find(|c| c.sink == "stuck")
        .unwrap();
    assert!(
        (35..=36).contains(&stuck.dropped(DropReason::LaneFull)),
        "{stuck:?}"
    );
    eprintln!("40 requests with a stuck lossy sink: {elapsed:?}");
    gate.open();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_serves_its_stable_version_whatever_newer_one_is_loaded() {
    let h = harness(
        vec![
            ("echo@1.0.0", Arc::new(FakeTensor)),
            ("echo@1.1.0", Arc::new(FakeTensor)),
        ],
        Options::default(),
    )
    .await;
    let tensors = serde_json::json!({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]
    });
    let version = |body: serde_json::Value| body["model_version"].as_str().unwrap().to_string();
    // The server sets each name's stable version as it loads; 1.1.0 is a candidate loaded
    // beside it (a release's prepare, an operator's load): it answers only by its version.
    h.state.front.registry.set_stable("echo", "1.0.0");
    let r = h.post("/v2/models/echo/infer", tensors.clone()).await;
    assert_eq!(version(r.json().await.unwrap()), "1.0.0");
    let r = h
        .post("/v2/models/echo/versions/1.1.0/infer", tensors.clone())
        .await;
    assert_eq!(version(r.json().await.unwrap()), "1.1.0");
    // A promotion moves the name.
    assert_eq!(
        h.state
            .front
            .registry
            .set_stable("echo", "1.1.0")
            .as_deref(),
        Some("1.0.0")
    );
    let r = h.post("/v2/models/echo/infer", tensors.clone()).await;
    assert_eq!(version(r.json().await.unwrap()), "1.1.0");
    // A stable version that is not loaded is not replaced by another one.
    h.state.front.registry.set_stable("echo", "2.0.0");
    let r = h.post("/v2/models/echo/infer", tensors).await;
    assert_eq!(r.status(), 404, "{:?}", r.text().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kserve_rest_embeddings_and_model_lists_share_the_one_registry() {
    let h = harness(
        vec![
            ("fake", llm(hello())),
            ("echo", Arc::new(FakeTensor)),
            ("embed", Arc::new(FakeEmbedder)),
        ],
        Options::default(),
    )
    .await;
    let tensors = serde_json::json!({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.5]}]
    });
    let r = h.post("/v2/models/echo/infer", tensors.clone()).await;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["model_name"], "echo");
    assert_eq!(body["model_version"], "1.0.0");
    assert_eq!(body["outputs"][0]["data"], serde_json::json!([1.5, 2.5]));
    let r = h.post("/v2/models/fake/infer", tensors.clone()).await;
    assert_eq!(r.status(), 400);
    assert!(r.text().await.unwrap().contains("is a language model"));
    let r = h.post("/v2/models/nope/infer", tensors).await;
    assert_eq!(r.status(), 404);
    let overload = serde_json::json!({
        "inputs": [{"name": "overload", "datatype": "FP32", "shape": [1], "data": [0]}]
    });
    let r = h.post("/v2/models/echo/infer", overload).await;
    assert_eq!(r.status(), 429);

    let r = h
        .post(
            "/v1/embeddings",
            serde_json::json!({"model": "embed", "input": ["abc", "de"]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["data"][1]["embedding"], serde_json::json!([2.0, 1.0]));
    let r = h
        .post(
            "/v1/embeddings",
            serde_json::json!({"model": "fake", "input": "abc"}),
        )
        .await;
    assert_eq!(r.status(), 400, "a language model is not an embedder");
    let r = h
        .post(
            "/v1/chat/completions",
            serde_json::json!({"model": "embed", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(r.status(), 404);

    let models: serde_json::Value = h
        .client
        .get(format!("{}/v1/models", h.url))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["fake", "embed"], "language models, then embedders");
    let records = h.records(7).await;
    assert!(records
        .iter()
        .any(|r| r.endpoint == "kserve_infer" && r.model == "echo" && r.items == 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_the_same_front() {
    use server::grpc::proto::grpc_inference_service_server::GrpcInferenceService;
    use server::grpc::proto::model_infer_request::InferInputTensor;
    use server::grpc::proto::{InferTensorContents, ModelInferRequest};
    use tonic::Code;

    let h = harness(
        vec![("fake", llm(hello())), ("echo", Arc::new(FakeTensor))],
        Options::default(),
    )
    .await;
    let service = server::grpc::Inference::new(Arc::clone(&h.state));
    let request = |model: &str, input: &str| {
        let mut r = tonic::Request::new(ModelInferRequest {
            model_name: model.into(),
            inputs: vec![InferInputTensor {
                name: input.into(),
                datatype: "FP32".into(),
                shape: vec![2],
                parameters: Default::default(),
                contents: Some(InferTensorContents {
                    fp32_contents: vec![1.0, 2.0],
                    ..Default::default()
                }),
            }],
            ..Default::default()
        });
        r.metadata_mut()
            .insert("authorization", format!("Bearer {KEY}").parse().unwrap());
        r
    };
    let ok = service.model_infer(request("echo", "x")).await.unwrap();
    assert_eq!(ok.get_ref().model_name, "echo");
    assert_eq!(ok.get_ref().outputs[0].name, "y");
    let e = service
        .model_infer(request("echo", "overload"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(e.metadata().get("retry-after").unwrap(), "2");
    let e = service.model_infer(request("fake", "x")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    h.state.front.drain();
    let e = service.model_infer(request("echo", "x")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    let records = h.records(4).await;
    assert_eq!(
        records
            .iter()
            .filter(|r| r.endpoint == "kserve_grpc_infer")
            .count(),
        4
    );
}

/// A KServe request takes its model's slot before its tensors are decoded: with the one slot
/// taken, a request whose data would be refused (too many elements) is refused as overloaded
/// instead, having cost no decode; over REST an unknown model is refused before its body is
/// read, and the body's declared length past the limit before any of it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kserve_takes_the_slot_before_the_decode() {
    use server::grpc::proto::grpc_inference_service_server::GrpcInferenceService;
    use server::grpc::proto::model_infer_request::InferInputTensor;
    use server::grpc::proto::{InferTensorContents, ModelInferRequest};
    use tonic::Code;

    let h = harness(
        vec![("echo", Arc::new(FakeTensor))],
        Options {
            max_in_flight: 1,
            max_waiting: 0,
            configure: |c| c.limits.max_tensor_body_bytes = 4096,
            ..Options::default()
        },
    )
    .await;
    let busy = {
        let h_url = h.url.clone();
        let client = h.client.clone();
        tokio::spawn(async move {
            client
                .post(format!("{h_url}/v2/models/echo/infer"))
                .bearer_auth(KEY)
                .json(&serde_json::json!({
                    "inputs": [{"name": "slow", "datatype": "FP32", "shape": [1], "data": [0]}]
                }))
                .send()
                .await
                .unwrap()
                .status()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while h.state.front.registry.busy() == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let lying = serde_json::json!({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1, 2, 3]}]
    });
    let r = h.post("/v2/models/echo/infer", lying.clone()).await;
    assert_eq!(r.status(), 429, "refused for the slot, not decoded");
    let service = server::grpc::Inference::new(Arc::clone(&h.state));
    let mut request = tonic::Request::new(ModelInferRequest {
        model_name: "echo".into(),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "FP32".into(),
            shape: vec![1],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                fp32_contents: vec![1.0, 2.0, 3.0],
                ..Default::default()
            }),
        }],
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    let e = service.model_infer(request).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(busy.await.unwrap(), 200);
    // With the slot free the same body is decoded, and refused for what it is.
    let r = h.post("/v2/models/echo/infer", lying).await;
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|m| m
                .contains("input \"x\": shape [1] needs 1 elements, the data holds more than 1")),
        "{body}"
    );
    // A body declared past the limit is refused on its length alone.
    let r = h
        .client
        .post(format!("{}/v2/models/echo/infer", h.url))
        .bearer_auth(KEY)
        .header("content-type", "application/json")
        .body(vec![b' '; h.state.config.limits.max_tensor_body_bytes + 1])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let records = h.records(5).await;
    let refused: Vec<_> = records.iter().filter_map(|r| r.refusal).collect();
    assert_eq!(
        refused,
        ["queue_full", "queue_full", "body_too_large"],
        "{records:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_model_answers_chat_and_kserve_with_reasons_from_the_input() {
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/rules/support-tickets.toml"
    ))
    .unwrap();
    let engine = guard::RulesEngine::from_toml(&rules).unwrap();
    let backend = server::backend::rules::RulesBackend::new("tickets".into(), engine, 65536);
    let h = harness(vec![("tickets", Arc::new(backend))], Options::default()).await;
    let ticket = "我的快递一个星期了还没收到，物流也不更新";
    let r = h
        .post(
            "/v1/chat/completions",
            serde_json::json!({"model": "tickets", "messages": [{"role": "user", "content": ticket}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    let answer: serde_json::Value =
        serde_json::from_str(body["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(answer["category"], "logistics", "{answer}");
    assert!(answer["confidence"].as_f64().unwrap() > 0.5);
    let reasons = answer["reasons"].as_array().unwrap();
    assert!(!reasons.is_empty() && reasons.len() <= 3);
    for reason in reasons {
        assert!(
            ticket.contains(reason["text"].as_str().unwrap()),
            "{reason}"
        );
    }
    let tensors = serde_json::json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2],
        "data": ["I was charged twice, I want my money back", "hello"]}]});
    let r = h.post("/v2/models/tickets/infer", tensors).await;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["outputs"][0]["name"], "label");
    assert_eq!(
        body["outputs"][0]["data"],
        serde_json::json!(["refund", "service"])
    );
    let records = h.records(2).await;
    assert!(records[0].confidence.is_some_and(|c| c > 0.5));
    assert_eq!(records[1].items, 2);
}

// ---- The backend chain, breakers, hand-off, scopes and faults (through the admin API). ----

const OPS_KEY: &str = "sk-ops-in-process-1";

fn step(target: &str) -> server::chain::Step {
    server::chain::Step {
        target: server::chain::Target::Model(server::registry::ModelName::parse(target)),
        on: server::config::Trigger::DEFAULT.to_vec(),
    }
}

fn canned_step(model: &str, text: &str) -> server::chain::Step {
    let mut languages = std::collections::BTreeMap::new();
    languages.insert("zh".to_string(), "服务正在改进，请稍后再试。".to_string());
    let backend = server::backend::canned::CannedBackend::new(text.into(), languages);
    let entry = Entry::new(
        model,
        "canned",
        "sha256:canned",
        server::admission::Admission::new(server::config::Admission::default()),
        Arc::new(backend),
    )
    .with_id(format!("canned:{model}"));
    server::chain::Step {
        target: server::chain::Target::Own(Arc::new(entry)),
        on: server::config::Trigger::DEFAULT.to_vec(),
    }
}

fn policy(steps: Vec<server::chain::Step>, first_token_ms: u64, stall_ms: u64) -> Policy {
    Policy {
        steps,
        first_token_timeout: Duration::from_millis(first_token_ms),
        stall_timeout: Duration::from_millis(stall_ms),
    }
}

fn tickets() -> Arc<dyn InferenceBackend> {
    let rules = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/rules/support-tickets.toml"
    ))
    .unwrap();
    let engine = guard::RulesEngine::from_toml(&rules).unwrap();
    Arc::new(server::backend::rules::RulesBackend::new(
        "tickets".into(),
        engine,
        65536,
    ))
}

fn words(tokens: Vec<&'static str>) -> Script {
    Script::Tokens {
        tokens,
        first: Duration::ZERO,
        gap: Duration::from_millis(5),
    }
}

fn drill_options() -> Options {
    Options {
        policies: vec![(
            "fake@2.0.0",
            policy(
                vec![
                    step("fake@1.0.0"),
                    step("tickets"),
                    canned_step(
                        "fake",
                        "We are improving the service, please try again shortly.",
                    ),
                ],
                400,
                300,
            ),
        )],
        configure: |c| c.faults.enabled = true,
        extra_keys: "ops:sk-ops-in-process-1 admin infer",
        ..Options::default()
    }
}

impl Harness {
    async fn admin(&self, path: &str, body: serde_json::Value) -> reqwest::Response {
        self.client
            .post(format!("{}{path}", self.url))
            .bearer_auth(OPS_KEY)
            .json(&body)
            .send()
            .await
            .unwrap()
    }

    async fn fault(&self, backend: &str, mode: &str, extra: serde_json::Value) {
        let mut body = serde_json::json!({"backend": backend, "mode": mode, "duration_s": 30});
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        let r = self.admin("/admin/faults", body).await;
        assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    }

    async fn clear_faults(&self) {
        let r = self
            .client
            .delete(format!("{}/admin/faults", self.url))
            .bearer_auth(OPS_KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
}

fn ticket_chat(stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "fake",
        "messages": [{"role": "user", "content": "I was charged twice for my order, I want a refund"}],
        "stream": stream,
        "max_tokens": 16,
        "response_format": {"type": "json_schema", "json_schema": {"name": "ticket", "strict": true, "schema": {
            "type": "object",
            "properties": {
                "category": {"type": "string", "enum": ["logistics", "quality", "refund", "invoice", "service"]},
                "confidence": {"type": "number"},
                "reasons": {"type": "array", "items": {"type": "string"}}
            },
            "required": ["category", "confidence", "reasons"]
        }}},
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_level_of_the_chain_answers_when_the_one_before_fails() {
    let h = harness(
        vec![
            (
                "fake@2.0.0",
                llm(words(vec![
                    "{\"category\":",
                    "\"refund\",\"confidence\":0.9,\"reasons\":[]}",
                ])),
            ),
            (
                "fake@1.0.0",
                llm(words(vec![
                    "{\"category\":\"refund\",",
                    "\"confidence\":0.8,\"reasons\":[]}",
                ])),
            ),
            ("tickets", tickets()),
        ],
        drill_options(),
    )
    .await;
    // Healthy: the newest version answers, unmarked.
    let r = h.post("/v1/chat/completions", ticket_chat(false)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-rampart-fallback").is_none());

    // Level 1: the primary fails, the other version answers inside the same request.
    h.fault("fake@2.0.0", "fail", serde_json::json!({})).await;
    let r = h.post("/v1/chat/completions", ticket_chat(false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=1; backend=fake@1.0.0; reason=error"
    );
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["system_fingerprint"], "fake@1.0.0");

    // Level 1 again: both versions fail, the rules engine answers the ticket schema.
    h.fault("fake@1.0.0", "fail", serde_json::json!({})).await;
    let r = h.post("/v1/chat/completions", ticket_chat(false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=1; backend=tickets@1.0.0; reason=error"
    );
    let body: serde_json::Value = r.json().await.unwrap();
    let answer: serde_json::Value =
        serde_json::from_str(body["choices"][0]["message"]["content"].as_str().unwrap()).unwrap();
    assert_eq!(answer["category"], "refund", "{answer}");
    let reasons = answer["reasons"].as_array().unwrap();
    assert!(!reasons.is_empty());
    for reason in reasons {
        assert!(
            "I was charged twice for my order, I want a refund"
                .to_lowercase()
                .contains(&reason.as_str().unwrap().to_lowercase()),
            "{reason}"
        );
    }

    // Level 2: the rules fail too, the canned answer (in the asked language) is marked.
    h.fault("tickets", "fail", serde_json::json!({})).await;
    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.url))
        .bearer_auth(KEY)
        .header("accept-language", "zh-CN,zh;q=0.9")
        .json(&ticket_chat(true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=2; backend=canned:fake; reason=error"
    );
    let text = r.text().await.unwrap();
    assert!(text.contains("服务正在改进"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");

    let records = h.records(4).await;
    let degraded: Vec<_> = records.iter().filter(|r| r.fallback_level > 0).collect();
    assert_eq!(degraded.len(), 3);
    assert!(records.iter().all(|r| r.status == 200), "{records:?}");
    let last = &records[3];
    assert_eq!(last.fallback_level, 2);
    assert_eq!(last.fallback_backend.as_deref(), Some("canned:fake"));
    assert_eq!(last.fallback_reason, Some("error"));
    let tried: Vec<(&str, &str)> = last
        .attempts
        .iter()
        .map(|a| (a.backend.as_str(), a.outcome))
        .collect();
    assert_eq!(
        tried,
        [
            ("fake@2.0.0", "error"),
            ("fake@1.0.0", "error"),
            ("tickets@1.0.0", "error"),
            ("canned:fake", "answered")
        ]
    );
    assert!(last.attempts[0]
        .detail
        .as_deref()
        .is_some_and(|d| d.contains("injected fault")));
    // The rules answer was held to the request's schema.
    let rules = &records[2];
    assert_eq!(
        rules.structured.as_ref().and_then(|s| s.outcome),
        Some("valid")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rules_step_that_matches_nothing_moves_on_to_the_canned_answer() {
    let h = harness(
        vec![("fake@2.0.0", llm(hello())), ("tickets", tickets())],
        Options {
            policies: vec![(
                "fake@2.0.0",
                policy(
                    vec![
                        step("tickets"),
                        canned_step("fake", "Please try again shortly."),
                    ],
                    400,
                    300,
                ),
            )],
            configure: |c| c.faults.enabled = true,
            extra_keys: "ops:sk-ops-in-process-1 admin infer",
            ..Options::default()
        },
    )
    .await;
    h.fault("fake", "fail", serde_json::json!({})).await;
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=2; backend=canned:fake; reason=error"
    );
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        body["choices"][0]["message"]["content"],
        "Please try again shortly."
    );
    let r = &h.records(1).await[0];
    assert_eq!(r.attempts[1].outcome, "error");
    assert!(
        r.attempts[1].detail.as_deref().unwrap().contains("no rule"),
        "{:?}",
        r.attempts
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_before_the_first_token_falls_back_within_the_timeout() {
    let h = harness(
        vec![
            ("fake@2.0.0", llm(hello())),
            ("fake@1.0.0", llm(words(vec!["old", " version"]))),
        ],
        Options {
            policies: vec![("fake@2.0.0", policy(vec![step("fake@1.0.0")], 300, 300))],
            ..drill_options()
        },
    )
    .await;
    h.fault("fake@2.0.0", "hang", serde_json::json!({})).await;
    let began = Instant::now();
    let r = h.post("/v1/chat/completions", chat(true)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=1; backend=fake@1.0.0; reason=first_token_timeout"
    );
    let text = r.text().await.unwrap();
    let took = began.elapsed();
    assert!(
        text.contains("old") && text.contains("\"finish_reason\":\"stop\""),
        "{text}"
    );
    assert!(took >= Duration::from_millis(300), "{took:?}");
    let r = &h.records(1).await[0];
    let hung = &r.attempts[0];
    assert_eq!(
        (hung.backend.as_str(), hung.outcome),
        ("fake@2.0.0", "first_token_timeout")
    );
    // The attempt gave up at its deadline (the bound is loose: CI machines are noisy; the
    // benchmark in docs/perf.md measures the real overshoot).
    assert!(hung.ms >= 300.0 && hung.ms < 600.0, "{hung:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_mid_stream_ends_with_a_typed_error_and_a_buffered_request_falls_back() {
    let script = Script::Tokens {
        tokens: vec!["one", " two", " three", " four"],
        first: Duration::ZERO,
        gap: Duration::from_millis(5),
    };
    let h = harness(
        vec![
            ("fake@2.0.0", llm(script)),
            ("fake@1.0.0", llm(words(vec!["old"]))),
        ],
        Options {
            policies: vec![("fake@2.0.0", policy(vec![step("fake@1.0.0")], 1000, 200))],
            ..drill_options()
        },
    )
    .await;
    h.fault(
        "fake@2.0.0",
        "stall",
        serde_json::json!({"after_tokens": 2}),
    )
    .await;
    // A stream already sent text: it ends with a typed error event, never a clean stop.
    let r = h.post("/v1/chat/completions", chat(true)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-rampart-fallback").is_none());
    let text = r.text().await.unwrap();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert!(text.contains("one") && !text.contains("three"), "{text}");
    let error: serde_json::Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert_eq!(error["error"]["type"], "service_unavailable", "{text}");
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("stalled"));
    assert!(!text.contains("\"finish_reason\":\"stop\""), "{text}");
    assert_eq!(data.last(), Some(&"[DONE]"));
    // Nothing reached the client of a non-streaming request yet: it falls back.
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=1; backend=fake@1.0.0; reason=stall_timeout"
    );
    let records = h.records(2).await;
    assert_eq!(records[0].status, 503);
    assert_eq!(records[0].finish_reason, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_sends_only_probes_while_open_and_closes_after_recovery() {
    let primary = Arc::new(FakeLlm {
        script: hello(),
        started: AtomicUsize::new(0),
    });
    let h = harness(
        vec![("fake@2.0.0", primary.clone() as Arc<dyn InferenceBackend>)],
        Options {
            policies: vec![(
                "fake@2.0.0",
                policy(vec![canned_step("fake", "later")], 1000, 1000),
            )],
            configure: |c| {
                c.faults.enabled = true;
                c.breaker.consecutive_failures = 3;
                c.breaker.open_base_ms = 400;
                c.breaker.jitter = 0.0;
                c.breaker.probes = 2;
            },
            ..drill_options()
        },
    )
    .await;
    let state_of = |h: &Harness| {
        let e = h
            .state
            .front
            .registry
            .find(&server::registry::ModelName::parse("fake"))
            .unwrap();
        e.breaker.state().as_str()
    };
    // A broken backend: errors mid-start (the fault) are failures.
    h.fault("fake@2.0.0", "fail", serde_json::json!({})).await;
    for _ in 0..3 {
        let r = h.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(
            r.headers()["x-rampart-fallback"],
            "level=2; backend=canned:fake; reason=error"
        );
    }
    // The open time runs from the third failure (a slow machine takes a while to get there).
    let opened = Instant::now();
    assert_eq!(state_of(&h), "open", "3 failures in a row open it");
    // While open: no call reaches the backend; the chain moves on at once.
    let calls = primary.started.load(Ordering::SeqCst);
    for _ in 0..5 {
        let r = h.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(
            r.headers()["x-rampart-fallback"],
            "level=2; backend=canned:fake; reason=circuit_open"
        );
    }
    assert_eq!(primary.started.load(Ordering::SeqCst), calls);
    // The backend recovers; after the open time, probes pass and close it.
    h.clear_faults().await;
    while opened.elapsed() < Duration::from_millis(450) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..2 {
        let r = h.post("/v1/chat/completions", chat(false)).await;
        assert!(r.headers().get("x-rampart-fallback").is_none());
    }
    assert_eq!(state_of(&h), "closed", "2 successful probes close it");
    let view: serde_json::Value = h
        .client
        .get(format!("{}/admin/backends", h.url))
        .bearer_auth(OPS_KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let fake = &view["backends"][0];
    assert_eq!(fake["id"], "fake@2.0.0");
    assert_eq!(fake["breaker"]["state"], "closed");
    assert_eq!(fake["breaker"]["refused"], 5);
    assert_eq!(fake["chain"][0]["target"], "canned:fake");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_fallbacks_hand_the_model_to_people_until_the_cool_down() {
    let h = harness(
        vec![("fake@2.0.0", llm(hello()))],
        Options {
            policies: vec![(
                "fake@2.0.0",
                policy(vec![canned_step("fake", "later")], 1000, 1000),
            )],
            configure: |c| {
                c.faults.enabled = true;
                c.breaker.consecutive_failures = 1000;
                c.handoff.threshold = 3;
                c.handoff.window_s = 60;
                c.handoff.cooldown_s = 1;
                c.handoff.url = Some("https://support.example/handoff".into());
            },
            ..drill_options()
        },
    )
    .await;
    h.fault("fake@2.0.0", "fail", serde_json::json!({})).await;
    for _ in 0..4 {
        let r = h.post("/v1/chat/completions", chat(false)).await;
        assert_eq!(r.status(), 200);
    }
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "human_handoff", "{body}");
    assert_eq!(
        body["error"]["handoff_url"],
        "https://support.example/handoff"
    );
    let records = h.records(5).await;
    assert_eq!(records[4].fallback_level, 3);
    assert_eq!(records[4].refusal, Some("human_handoff"));
    // Resumes by itself after the cool-down.
    h.clear_faults().await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().get("x-rampart-fallback").is_none());
    // An admin pauses and resumes by hand.
    let r = h
        .admin(
            "/admin/models/fake/handoff",
            serde_json::json!({"action": "pause"}),
        )
        .await;
    let view: serde_json::Value = r.json().await.unwrap();
    assert_eq!(view["active"], true);
    assert_eq!(
        h.post("/v1/chat/completions", chat(false)).await.status(),
        503
    );
    let r = h
        .admin(
            "/admin/models/fake/handoff",
            serde_json::json!({"action": "resume"}),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        h.post("/v1/chat/completions", chat(false)).await.status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_admin_scope_and_faults_need_enabling() {
    let h = harness(
        vec![("fake", llm(hello()))],
        Options {
            extra_keys: "ops:sk-ops-in-process-1 admin",
            ..Options::default()
        },
    )
    .await;
    let get = |key: &'static str, path: &'static str| {
        h.client
            .get(format!("{}{path}", h.url))
            .bearer_auth(key)
            .send()
    };
    let r = get(KEY, "/admin/backends").await.unwrap();
    assert_eq!(r.status(), 403);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "insufficient_scope");
    assert_eq!(get(OPS_KEY, "/admin/backends").await.unwrap().status(), 200);
    // An admin-only key cannot infer.
    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.url))
        .bearer_auth(OPS_KEY)
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    // Faults are off unless configured.
    let r = h
        .admin(
            "/admin/faults",
            serde_json::json!({"backend": "fake", "mode": "fail"}),
        )
        .await;
    assert_eq!(r.status(), 403);
    let records = h.records(2).await;
    assert!(records
        .iter()
        .any(|r| r.refusal == Some("insufficient_scope") && r.principal == "tester"));
}

/// Answers tensors like [`FakeTensor`] but says which runtime it is in its output's name.
struct NamedTensor(&'static str);

impl InferenceBackend for NamedTensor {
    fn kind(&self) -> Kind {
        Kind::Tensor
    }
    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Tensors
    }
    fn start<'a>(&'a self, work: Work, _record: &'a mut RecordBuilder) -> StartFuture<'a> {
        let name = self.0;
        Box::pin(async move {
            let Work::Tensors(request) = work else {
                return Err(BackendError::invalid("not tensors"));
            };
            Ok(Answer::Tensors(InferResponse {
                model_name: String::new(),
                model_version: String::new(),
                id: request.id,
                outputs: vec![OutputTensor {
                    tensor: classic::Tensor::new(name, vec![1], classic::Data::F32(vec![1.0]))
                        .unwrap(),
                    binary: false,
                }],
                judgements: Vec::new(),
            }))
        })
    }
    fn describe(&self) -> Description {
        Description {
            platform: format!("onnx_{}", self.0),
            ..Description::default()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kserve_rest_and_grpc_fall_back_to_the_twin_on_the_other_runtime() {
    let twin = Entry::new(
        "vision",
        "1.0.0",
        "sha256:fake",
        server::admission::Admission::new(server::config::Admission::default()),
        Arc::new(NamedTensor("tract")),
    )
    .with_id("vision@1.0.0:tract");
    let h = harness(
        vec![("vision", Arc::new(NamedTensor("onnxruntime")))],
        Options {
            policies: vec![(
                "vision@1.0.0",
                policy(
                    vec![server::chain::Step {
                        target: server::chain::Target::Own(Arc::new(twin)),
                        on: server::config::Trigger::DEFAULT.to_vec(),
                    }],
                    1000,
                    1000,
                ),
            )],
            ..drill_options()
        },
    )
    .await;
    let body = serde_json::json!({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]});
    let r = h.post("/v2/models/vision/infer", body.clone()).await;
    let out: serde_json::Value = r.json().await.unwrap();
    assert_eq!(out["outputs"][0]["name"], "onnxruntime");
    h.fault("vision@1.0.0", "fail", serde_json::json!({})).await;
    let r = h.post("/v2/models/vision/infer", body).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=1; backend=vision@1.0.0:tract; reason=error"
    );
    let out: serde_json::Value = r.json().await.unwrap();
    assert_eq!(out["outputs"][0]["name"], "tract");
    assert_eq!(out["model_name"], "vision");
    // gRPC: the same chain, marked in the metadata and the response's parameters.
    use server::grpc::proto::grpc_inference_service_server::GrpcInferenceService;
    use server::grpc::proto::model_infer_request::InferInputTensor;
    use server::grpc::proto::{InferTensorContents, ModelInferRequest};
    let service = server::grpc::Inference::new(Arc::clone(&h.state));
    let mut request = tonic::Request::new(ModelInferRequest {
        model_name: "vision".into(),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "FP32".into(),
            shape: vec![1],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                fp32_contents: vec![1.0],
                ..Default::default()
            }),
        }],
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    let response = service.model_infer(request).await.unwrap();
    assert_eq!(
        response.metadata().get("x-rampart-fallback").unwrap(),
        "level=1; backend=vision@1.0.0:tract; reason=error"
    );
    assert_eq!(response.into_inner().outputs[0].name, "tract");
}

/// A language model whose engine stalled: readiness fails, calls fail.
struct Stalled;

impl InferenceBackend for Stalled {
    fn kind(&self) -> Kind {
        Kind::Llm
    }
    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Generate
    }
    fn start<'a>(&'a self, _work: Work, _record: &'a mut RecordBuilder) -> StartFuture<'a> {
        Box::pin(std::future::ready(Err(BackendError::Unavailable {
            message: "the engine stalled".into(),
            retry_after_s: 5,
        })))
    }
    fn describe(&self) -> Description {
        Description::default()
    }
    fn health(&self) -> server::backend::Health {
        server::backend::Health {
            problem: Some("no token for 61 s while 2 sequences run".into()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_model_with_a_working_chain_stays_ready_and_is_skipped() {
    let alone = harness(vec![("fake@2.0.0", Arc::new(Stalled))], Options::default()).await;
    let r = alone
        .client
        .get(format!("{}/health/ready", alone.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503, "no chain: the replica is not ready");
    let h = harness(
        vec![
            ("fake@2.0.0", Arc::new(Stalled)),
            ("fake@1.0.0", llm(words(vec!["old"]))),
        ],
        Options {
            policies: vec![("fake@2.0.0", policy(vec![step("fake@1.0.0")], 1000, 1000))],
            ..Options::default()
        },
    )
    .await;
    let r = h
        .client
        .get(format!("{}/health/ready", h.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "its chain serves: ready");
    let primary = h
        .state
        .front
        .registry
        .find(&server::registry::ModelName::parse("fake@2.0.0"))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while primary.is_ready() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=1; backend=fake@1.0.0; reason=not_ready"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_classifier_falls_back_to_rules_over_kserve_only_when_a_rule_matches() {
    let h = harness(
        vec![
            ("classifier", Arc::new(NamedTensor("onnxruntime"))),
            ("tickets", tickets()),
        ],
        Options {
            policies: vec![(
                "classifier@1.0.0",
                policy(vec![step("tickets")], 1000, 1000),
            )],
            ..drill_options()
        },
    )
    .await;
    h.fault("classifier", "fail", serde_json::json!({})).await;
    let texts = |text: &str| serde_json::json!({"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [text]}]});
    let r = h
        .post(
            "/v2/models/classifier/infer",
            texts("I was charged twice, refund my money"),
        )
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["x-rampart-fallback"],
        "level=1; backend=tickets@1.0.0; reason=error"
    );
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["outputs"][0]["data"], serde_json::json!(["refund"]));
    // Nothing matches: the rules' default is no answer for a fallback; the client gets the
    // model's own failure.
    let r = h
        .post("/v2/models/classifier/infer", texts("hello there"))
        .await;
    assert_eq!(r.status(), 500);
    let records = h.records(2).await;
    assert_eq!(records[1].attempts[1].outcome, "error");
    assert!(records[1].attempts[1]
        .detail
        .as_deref()
        .unwrap()
        .contains("no rule"));
}

const AUDITOR_KEY: &str = "sk-auditor-0001";
const OPS_AUDIT_TEST_KEY: &str = "sk-ops-0002";

impl Harness {
    async fn get_as(&self, path: &str, key: &str) -> (u16, serde_json::Value) {
        let r = self
            .client
            .get(format!("{}{path}", self.url))
            .bearer_auth(key)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or_default())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_doctor_route_needs_the_admin_scope_answers_a_report_and_is_audited() {
    let dir = tempfile::tempdir().unwrap();
    let h = harness(
        vec![("fake", llm(hello()))],
        Options {
            extra_keys: "ops:sk-ops-in-process-1 admin",
            ..audited(dir.path())
        },
    )
    .await;
    let (status, body) = h.get_as("/admin/doctor", KEY).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("insufficient_scope"))
    );
    let (status, body) = h.get_as("/admin/doctor", OPS_KEY).await;
    assert_eq!(status, 200, "{body}");
    let report: host::Report = serde_json::from_value(body["report"].clone()).unwrap();
    for area in host::Area::ALL {
        assert!(
            report.checks.iter().any(|c| c.area == area),
            "no {area} check"
        );
    }
    // The server's own configuration is the Rampart context: its audit directory, and its
    // ports are not bound again.
    let audit_dir = report.check("rampart.audit_dir", None).unwrap();
    assert!(
        audit_dir
            .observed
            .contains(&dir.path().display().to_string()),
        "{audit_dir:?}"
    );
    let ports = report.check("rampart.ports", None).unwrap();
    assert_eq!(ports.status, host::Status::Unknown);
    assert!(
        ports.observed.contains("this server holds them"),
        "{ports:?}"
    );
    assert!(!report.gpu_load_sample);
    let fingerprint: host::Fingerprint =
        serde_json::from_value(body["fingerprint"].clone()).unwrap();
    assert_eq!(fingerprint.arch, std::env::consts::ARCH);
    // The read is an audited action by the admin key.
    let read = audit::read::load(dir.path(), None);
    assert!(read.problem.is_none(), "{:?}", read.problem);
    let doctor_reads: Vec<_> = read
        .entries
        .iter()
        .filter_map(|l| l.entry.action.as_ref().map(|a| (a, &l.entry)))
        .filter(|(a, _)| a.name == "doctor")
        .collect();
    assert_eq!(doctor_reads.len(), 1);
    let (action, entry) = doctor_reads[0];
    assert_eq!(entry.principal.as_deref(), Some("ops"));
    assert_eq!(action.detail["error"], report.counts.error);
    // fail_closed: a read the log cannot keep is not answered.
    h.state
        .audit
        .as_ref()
        .unwrap()
        .set_write_fault(Some("injected".into()));
    let (status, body) = h.get_as("/admin/doctor", OPS_KEY).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("audit_unavailable"))
    );
}

/// Options with a fail_closed audit log in `dir` (checkpoints every 50 ms).
fn audited(dir: &std::path::Path) -> Options {
    Options {
        audit: Some(audit::AuditConfig {
            required: true,
            dir: dir.to_path_buf(),
            checkpoint_interval_ms: 50,
            ..Default::default()
        }),
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_log_keeps_each_request_is_read_by_exact_key_only_and_fails_closed() {
    let dir = tempfile::tempdir().unwrap();
    let h = harness(
        vec![("fake", llm(hello()))],
        Options {
            extra_keys: "auditor:sk-auditor-0001 audit\nops:sk-ops-0002 admin",
            ..audited(dir.path())
        },
    )
    .await;
    // A request: its entry holds the input, the output, the user and the operator.
    let mut body = chat(false);
    body["user"] = "patient-7".into();
    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.url))
        .bearer_auth(KEY)
        .header("x-operator-id", "dr-who")
        .header(
            "traceparent",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        )
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let id = r.headers()["x-rampart-audit-id"]
        .to_str()
        .unwrap()
        .to_string();
    let (status, entry) = h.get_as(&format!("/admin/audit/{id}"), AUDITOR_KEY).await;
    assert_eq!(status, 200, "{entry}");
    assert_eq!(entry["user"], "patient-7");
    assert_eq!(entry["operator"], "dr-who");
    assert_eq!(
        entry["record"]["trace_id"],
        "4bf92f3577b34da6a3ce929d0e0e4736"
    );
    assert_eq!(entry["record"]["status"], 200);
    assert_eq!(entry["record"]["params"]["max_tokens"], 8);
    assert_eq!(entry["input"]["messages"][0]["role"], "user", "{entry}");
    assert_eq!(entry["input"]["messages"][0]["content"], "hi", "{entry}");
    assert_eq!(entry["output"]["choices"][0], "Hello world");
    // A stream: its entry has the streamed text.
    let r = h.post("/v1/chat/completions", chat(true)).await;
    let stream_id = r.headers()["x-rampart-audit-id"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(r.text().await.unwrap().contains("[DONE]"));
    let (_, entry) = h
        .get_as(&format!("/admin/audit/{stream_id}"), AUDITOR_KEY)
        .await;
    assert_eq!(entry["output"]["choices"][0], "Hello world", "{entry}");
    // Only the audit scope reads; only exact keys are asked.
    for key in [KEY, OPS_AUDIT_TEST_KEY] {
        let (status, body) = h.get_as(&format!("/admin/audit/{id}"), key).await;
        assert_eq!(status, 403, "{body}");
    }
    let (status, page) = h
        .get_as("/admin/audit?user_id=patient-7", AUDITOR_KEY)
        .await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = page["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["audit_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [id.as_str()]);
    for bad in [
        "/admin/audit",
        "/admin/audit?q=hi",
        "/admin/audit?user_id=patient-7&prefix=p",
    ] {
        let (status, body) = h.get_as(bad, AUDITOR_KEY).await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, body) = h.get_as("/admin/audit/no-such-id", AUDITOR_KEY).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (404, Some("audit_entry_not_found"))
    );
    // The proof verifies against the signed checkpoint.
    let (status, proof) = h
        .get_as(&format!("/admin/audit/{id}/proof"), AUDITOR_KEY)
        .await;
    assert_eq!(status, 200, "{proof}");
    let hash = |v: &serde_json::Value| audit::checkpoint::parse_hash(v.as_str().unwrap()).unwrap();
    let path: Vec<_> = proof["path"].as_array().unwrap().iter().map(hash).collect();
    assert!(audit::merkle::verify_inclusion(
        proof["index"].as_u64().unwrap(),
        proof["checkpoint"]["size"].as_u64().unwrap(),
        &hash(&proof["leaf_hash"]),
        &path,
        &hash(&proof["checkpoint"]["root"]),
    ));
    // The reads are entries themselves: who read which entry.
    let log = h.state.audit.as_ref().unwrap();
    let read = audit::read::load(dir.path(), None);
    assert!(read.problem.is_none(), "{:?}", read.problem);
    let reads: Vec<_> = read
        .entries
        .iter()
        .filter_map(|l| l.entry.action.as_ref().map(|a| (a, &l.entry)))
        .filter(|(a, _)| a.name == "audit.read")
        .collect();
    assert!(reads
        .iter()
        .any(|(a, e)| a.target.as_deref() == Some(id.as_str())
            && e.principal.as_deref() == Some("auditor")));
    // The disk fails: the answer is withheld (503 audit_unavailable), then requests are refused
    // before any backend runs, streams included.
    log.set_write_fault(Some("injected: no space left on device".into()));
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 503);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "audit_unavailable", "{body}");
    let r = h.post("/v1/chat/completions", chat(true)).await;
    assert_eq!(r.status(), 503);
    let (status, body) = h.get_as(&format!("/admin/audit/{id}"), AUDITOR_KEY).await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (503, Some("audit_unavailable")),
        "an unrecorded read is refused"
    );
    // The disk comes back: the upkeep task's probe clears the refusal.
    log.set_write_fault(None);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !log.is_healthy() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = h.post("/v1/chat/completions", chat(false)).await;
    assert_eq!(r.status(), 200);
    assert!(audit::read::load(dir.path(), None).problem.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_entry_cannot_be_kept_ends_with_audit_unavailable_not_its_finish() {
    let dir = tempfile::tempdir().unwrap();
    let h = harness(vec![("fake", llm(hello()))], audited(dir.path())).await;
    // The log is healthy when the stream starts and fails when its entry is written.
    h.state
        .audit
        .as_ref()
        .unwrap()
        .set_write_fault(Some("injected".into()));
    let r = h.post("/v1/chat/completions", chat(true)).await;
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    assert!(text.contains("audit_unavailable"), "{text}");
    assert!(!text.contains("\"finish_reason\":\"stop\""), "{text}");
    assert!(text.trim_end().ends_with("[DONE]"), "{text}");
}

/// A trace sink exporting to a test receiver, as `[tracing]` would build it.
fn trace_sink(endpoint: &str, protocol: server::config::TraceProtocol) -> Box<dyn Sink> {
    let config = server::config::TracingConfig {
        enabled: true,
        endpoint: endpoint.into(),
        protocol,
        token_events: 1.0,
        ..Default::default()
    };
    let settings = server::traces::SpanSettings::new(
        &config,
        "127.0.0.1:8080".parse().unwrap(),
        "127.0.0.1:8081".parse().unwrap(),
        vec!["test"],
    );
    Box::new(server::traces::TraceSink::new(&config, settings).unwrap())
}

fn traced(config: &mut ServerConfig) {
    config.tracing.enabled = true;
    config.tracing.token_events = 1.0;
}

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_chat_stream_is_one_span_tree_under_the_callers_span() {
    use testkit::otlp::{check_tree, children};
    let receiver = testkit::otlp::Receiver::start().await.unwrap();
    let sink = trace_sink(&receiver.grpc_endpoint, server::config::TraceProtocol::Grpc);
    let h = harness(
        vec![("fake", llm(hello()))],
        Options {
            extra_sinks: vec![sink],
            configure: traced,
            ..Options::default()
        },
    )
    .await;
    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.url))
        .bearer_auth(KEY)
        .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
        .header("tracestate", "rojo=00f067aa0ba902b7")
        .json(&chat(true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("[DONE]"));
    let records = h.records(1).await;
    assert_eq!(records[0].trace_id.as_deref(), Some(CALLER_TRACE));
    let spans = receiver
        .wait_for_trace(CALLER_TRACE, Duration::from_secs(10), |s| {
            s.iter().any(|s| s.name == "record")
        })
        .await;
    let root = check_tree(&spans, CALLER_SPAN).unwrap_or_else(|e| panic!("{e}: {spans:#?}"));
    assert_eq!(root.name, "chat fake");
    assert_eq!(root.kind, 2, "a server span");
    assert_eq!(root.transport, "grpc");
    assert_eq!(root.trace_state, "rojo=00f067aa0ba902b7");
    assert_eq!(
        root.resource.get("service.name").map(String::as_str),
        Some("rampart")
    );
    for (key, value) in [
        ("gen_ai.operation.name", "chat"),
        ("gen_ai.provider.name", "rampart"),
        ("gen_ai.request.model", "fake"),
        ("gen_ai.response.model", "fake@1.0.0"),
        ("gen_ai.request.max_tokens", "8"),
        ("gen_ai.response.finish_reasons", "[stop]"),
        ("gen_ai.usage.input_tokens", "3"),
        ("gen_ai.usage.output_tokens", "2"),
        ("server.address", "127.0.0.1"),
        ("server.port", "8080"),
        ("rampart.stream", "true"),
        ("rampart.fallback.level", "0"),
    ] {
        assert_eq!(root.attr(key), Some(value), "{key}");
    }
    assert_eq!(
        root.attr("rampart.audit_id"),
        Some(records[0].audit_id.as_str())
    );
    assert!(root
        .attr("gen_ai.response.id")
        .is_some_and(|id| id.starts_with("chatcmpl-")));
    assert!(
        root.attr("gen_ai.input.messages").is_none(),
        "no content unless opted in"
    );
    let names: Vec<&str> = children(&spans, root)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    for n in ["route", "guard", "attempt", "record"] {
        assert!(names.contains(&n), "{n} under the root: {names:?}");
    }
    let attempt = children(&spans, root)
        .into_iter()
        .find(|s| s.name == "attempt")
        .unwrap();
    assert_eq!(attempt.attr("rampart.attempt.outcome"), Some("answered"));
    let inner: Vec<&str> = children(&spans, attempt)
        .iter()
        .map(|s| s.name.as_str())
        .collect();
    assert_eq!(
        inner,
        ["admission", "prefill", "decode"],
        "nested, in order"
    );
    let decode = children(&spans, attempt)
        .into_iter()
        .find(|s| s.name == "decode")
        .unwrap();
    let texts: Vec<&str> = decode
        .events
        .iter()
        .map(|(_, a)| a["rampart.token.text"].as_str())
        .collect();
    assert_eq!(
        texts,
        ["Hello", " world"],
        "token_events = 1.0 keeps every token"
    );
    for s in &spans {
        assert!(s.start_unix_nano <= s.end_unix_nano, "{}", s.name);
        assert!(s.start_unix_nano >= root.start_unix_nano, "{}", s.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn traces_over_http_start_a_trace_per_request_for_chat_embeddings_and_infer() {
    use server::grpc::proto::grpc_inference_service_server::GrpcInferenceService;
    use server::grpc::proto::model_infer_request::InferInputTensor;
    use server::grpc::proto::{InferTensorContents, ModelInferRequest};
    use testkit::otlp::check_tree;
    let receiver = testkit::otlp::Receiver::start().await.unwrap();
    let sink = trace_sink(&receiver.http_endpoint, server::config::TraceProtocol::Http);
    let h = harness(
        vec![
            ("fake", llm(hello())),
            ("echo", Arc::new(FakeTensor)),
            ("embed", Arc::new(FakeEmbedder)),
        ],
        Options {
            extra_sinks: vec![sink],
            configure: traced,
            ..Options::default()
        },
    )
    .await;
    assert_eq!(
        h.post("/v1/chat/completions", chat(false)).await.status(),
        200
    );
    let embed = serde_json::json!({"model": "embed", "input": ["abc", "de"]});
    assert_eq!(h.post("/v1/embeddings", embed).await.status(), 200);
    let tensors = serde_json::json!({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1.5, 2.5]}]
    });
    assert_eq!(h.post("/v2/models/echo/infer", tensors).await.status(), 200);
    let missing =
        serde_json::json!({"model": "nope", "messages": [{"role": "user", "content": "hi"}]});
    assert_eq!(h.post("/v1/chat/completions", missing).await.status(), 404);
    let service = server::grpc::Inference::new(Arc::clone(&h.state));
    let mut request = tonic::Request::new(ModelInferRequest {
        model_name: "echo".into(),
        inputs: vec![InferInputTensor {
            name: "x".into(),
            datatype: "FP32".into(),
            shape: vec![2],
            parameters: Default::default(),
            contents: Some(InferTensorContents {
                fp32_contents: vec![1.0, 2.0],
                ..Default::default()
            }),
        }],
        ..Default::default()
    });
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    request.metadata_mut().insert(
        "traceparent",
        format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01")
            .parse()
            .unwrap(),
    );
    service.model_infer(request).await.unwrap();

    let records = h.records(5).await;
    assert_eq!(records.len(), 5);
    let mut ids = std::collections::BTreeSet::new();
    for r in &records {
        let id = r
            .trace_id
            .clone()
            .expect("with tracing on every record has a trace id");
        assert_eq!(id.len(), 32);
        ids.insert(id);
    }
    assert_eq!(ids.len(), 5, "one trace per request");
    let expected = [
        ("chat.completions", "fake", "chat fake", "8080"),
        ("embeddings", "embed", "embeddings embed", "8080"),
        ("kserve_infer", "echo", "infer echo", "8080"),
        ("chat.completions", "", "chat", "8080"),
        ("kserve_grpc_infer", "echo", "infer echo", "8081"),
    ];
    for (endpoint, model, name, port) in expected {
        let r = records
            .iter()
            .find(|r| r.endpoint == endpoint && r.model == model)
            .unwrap_or_else(|| panic!("no record of {endpoint} {model}"));
        let trace = r.trace_id.as_deref().unwrap();
        let spans = receiver
            .wait_for_trace(trace, Duration::from_secs(10), |s| {
                s.iter().any(|s| s.name == "record")
            })
            .await;
        let caller = if endpoint == "kserve_grpc_infer" {
            assert_eq!(trace, CALLER_TRACE, "the gRPC metadata's traceparent");
            CALLER_SPAN
        } else {
            ""
        };
        let root = check_tree(&spans, caller).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(root.name, name);
        assert_eq!(root.transport, "http");
        assert_eq!(root.attr("server.port"), Some(port), "{name}");
        let names: Vec<&str> = spans.iter().map(|s| s.name.as_str()).collect();
        match endpoint {
            "embeddings" => {
                assert_eq!(root.attr("gen_ai.operation.name"), Some("embeddings"));
                assert!(root.attr("gen_ai.usage.input_tokens").is_some());
                assert!(names.contains(&"attempt") && names.contains(&"admission"));
            }
            "kserve_infer" | "kserve_grpc_infer" => {
                assert_eq!(
                    root.attr("gen_ai.operation.name"),
                    None,
                    "not generative AI"
                );
                assert_eq!(root.attr("gen_ai.request.model"), Some("echo"));
                assert!(names.contains(&"admission"), "{names:?}");
            }
            _ if model.is_empty() => {
                assert_eq!(root.status_code, 2, "an error status");
                assert_eq!(root.attr("error.type"), Some("model_not_found"));
                assert_eq!(root.attr("rampart.status"), Some("404"));
            }
            _ => {
                assert!(names.contains(&"decode") && names.contains(&"guard"));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tracing_records_keep_only_the_callers_trace_id() {
    let h = harness(vec![("fake", llm(hello()))], Options::default()).await;
    assert!(
        !h.state.front.bus.wants_timeline(),
        "no timeline without a trace sink"
    );
    assert_eq!(
        h.post("/v1/chat/completions", chat(false)).await.status(),
        200
    );
    let r = h
        .client
        .post(format!("{}/v1/chat/completions", h.url))
        .bearer_auth(KEY)
        .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
        .json(&chat(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let records = h.records(2).await;
    let ids: Vec<Option<&str>> = records.iter().map(|r| r.trace_id.as_deref()).collect();
    assert!(ids.contains(&None));
    assert!(ids.contains(&Some(CALLER_TRACE)));
}
