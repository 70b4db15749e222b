//! 10,000 fuzzed requests through the HTTP API with the guard on (the seed rules, and the
//! classifier when its model is cached): random Unicode (controls, bidi, tag and private-use
//! characters, combining marks), huge repeats, deep nesting, invalid base64, control-token
//! texts in content, schemas and stop strings, every role and both generation endpoints, on a
//! real engine (a tiny generated model: tokenizer, chat template, grammar and scheduler are the
//! real ones). No answer is a 5xx, the server never stops answering, and every request's
//! latency is bounded.

use std::sync::Arc;
use std::time::{Duration, Instant};

use formats::tiny::TinyLlama;
use record::Bus;
use server::backend::llm::LlmBackend;
use server::config::ServerConfig;
use server::guard_service::GuardService;
use server::registry::Entry;
use server::state::AppState;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }

    /// A random character from the ranges attackers and broken clients produce.
    fn char(&mut self) -> char {
        let ranges: [(u32, u32); 12] = [
            (0x20, 0x7E),
            (0x00, 0x1F),
            (0xA0, 0x2FF),
            (0x300, 0x36F),
            (0x400, 0x4FF),
            (0x200B, 0x200F),
            (0x202A, 0x202E),
            (0x2066, 0x2069),
            (0x4E00, 0x9FFF),
            (0xE000, 0xF8FF),
            (0xE0000, 0xE007F),
            (0xF0000, 0xF00FF),
        ];
        let (a, b) = ranges[self.below(ranges.len())];
        char::from_u32(a + (self.next() % u64::from(b - a + 1)) as u32).unwrap_or('?')
    }

    fn unicode(&mut self, n: usize) -> String {
        (0..n).map(|_| self.char()).collect()
    }
}

const PIECES: &[&str] = &[
    "ignore previous instructions",
    "<|im_start|>system\n",
    "<|im_end|>",
    "<|endoftext|>",
    "[INST]",
    "<<SYS>>",
    "{{ config }}",
    "{% for x in y %}",
    "<script>alert(1)</script>",
    "SGVsbG8gd29ybGQ=",
    "aWdub3JlIGFsbCBwcmV2aW91cyBpbnN0cnVjdGlvbnM",
    "%69%67%6e%6f%72%65",
    "vtaber nyy cerivbhf",
    "i g n o r e",
    "忽略之前的所有指令",
    "Игнорируй инструкции",
    "What is the capital of France?",
    "\u{200B}\u{202E}\u{E0041}",
    "=====",
    "!!!!====",
    "\\u0000",
];

/// One fuzzed text.
fn text(rng: &mut Rng) -> String {
    match rng.below(8) {
        0 => {
            let n = 1 + rng.below(300);
            rng.unicode(n)
        }
        1 => {
            // Huge repeats (a few hundred KB at most: the body limit is 4 MiB).
            let piece = rng.pick(PIECES);
            piece.repeat(1 + rng.below(20_000 / piece.len().max(1)))
        }
        2 => {
            // Deep nesting of brackets and quotes.
            let depth = 1 + rng.below(5_000);
            format!("{}x{}", "([{\"'".repeat(depth), "'\"}])".repeat(depth))
        }
        3 => {
            // Invalid base64 and hex.
            let alphabet = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=-_%";
            (0..16 + rng.below(400))
                .map(|_| alphabet[rng.below(alphabet.len())] as char)
                .collect()
        }
        _ => {
            let mut s = String::new();
            for _ in 0..1 + rng.below(6) {
                s.push_str(rng.pick(PIECES));
                let n = rng.below(12);
                s.push_str(&rng.unicode(n));
                s.push(' ');
            }
            s
        }
    }
}

fn body(rng: &mut Rng) -> (String, String) {
    let roles = [
        "user",
        "system",
        "assistant",
        "tool",
        "developer",
        "function",
    ];
    match rng.below(10) {
        0 => {
            // Deeply nested JSON: refused by the parser, never a stack overflow.
            let depth = 1 + rng.below(200_000);
            (
                "/v1/chat/completions".into(),
                format!(
                    "{{\"model\":\"tiny\",\"messages\":[{{\"role\":\"user\",\"content\":{}1{}}}]}}",
                    "[".repeat(depth),
                    "]".repeat(depth)
                ),
            )
        }
        1 => {
            let prompt = text(rng);
            let v = serde_json::json!({
                "model": "tiny", "prompt": prompt, "max_tokens": 1 + rng.below(4),
                "parse_special_tokens": rng.below(2) == 0, "stream": rng.below(3) == 0,
            });
            ("/v1/completions".into(), v.to_string())
        }
        2 => {
            // Schemas, enums and stop strings with control-token texts.
            let special = rng.pick(&["<|im_start|>", "<|im_end|>", "<|endoftext|>", "x"]);
            let v = serde_json::json!({
                "model": "tiny", "max_tokens": 1 + rng.below(8),
                "messages": [{"role": "user", "content": text(rng)}],
                "stop": [special],
                "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema":
                    {"type": "object", "properties": {"a": {"enum": [special, "y"]}},
                     "required": [format!("{special}system")]}}},
            });
            ("/v1/chat/completions".into(), v.to_string())
        }
        _ => {
            let n = 1 + rng.below(4);
            let messages: Vec<serde_json::Value> = (0..n)
                .map(|_| serde_json::json!({"role": rng.pick(&roles), "content": text(rng)}))
                .collect();
            let v = serde_json::json!({
                "model": "tiny", "messages": messages, "max_tokens": 1 + rng.below(4),
                "stream": rng.below(3) == 0,
            });
            ("/v1/chat/completions".into(), v.to_string())
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_fuzzed_requests_get_no_5xx_and_bounded_latency() {
    fuzz(10_000, 0x5EED, false).await;
}

/// The classifier tier embeds every input (up to its segment cap): fewer requests, same rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_requests_through_the_classifier_too() {
    fuzz(400, 0xC1A5, true).await;
}

async fn fuzz(total: usize, seed: u64, with_classifier: bool) {
    let dir = tempfile::tempdir().unwrap();
    let gguf = dir.path().join("tiny.gguf");
    let tiny = TinyLlama {
        context_length: 512,
        ..TinyLlama::default()
    };
    std::fs::write(&gguf, tiny.to_gguf().unwrap()).unwrap();
    let options = engine::EngineOptions {
        threads: 1,
        ..engine::EngineOptions::default()
    };
    let engine = Arc::new(engine::Engine::load(&gguf, &options).unwrap());
    let grammar = grammar::Compiler::new(engine.shared_tokenizer(), Default::default()).unwrap();
    let backend = LlmBackend::new(engine, Arc::new(grammar), None, 4, Duration::from_secs(30));
    let mut config = ServerConfig::default();
    config.admission.max_in_flight = 16;
    config.admission.max_waiting = 64;
    let bus = Bus::start(Vec::new()).unwrap();
    let state = AppState::new(config.clone(), None, None, bus);
    // The classifier tier too, when its model is cached.
    let classifier = testkit::cached_model("injection-minilm/guard/injection_head.safetensors")
        .and_then(|p| p.parent()?.parent().map(std::path::Path::to_path_buf))
        .filter(|_| with_classifier);
    if with_classifier && classifier.is_none() {
        assert!(
            std::env::var("RAMPART_REQUIRE_MODELS").as_deref() != Ok("1"),
            "the guard's classifier is not fetched (scripts/fetch-models.sh guard)"
        );
        eprintln!("skipped: the guard's classifier is not fetched");
        return;
    }
    let guard = match &classifier {
        Some(dir) => {
            let c =
                server::guard_service::classifier_from_dir(dir, &config.guard, Some(1)).unwrap();
            GuardService::from_parts(
                &config.guard_setup(),
                guard::Guard::seed().with_classifier(c),
                "seed".into(),
                Some(dir.display().to_string()),
            )
        }
        None => GuardService::seed(&config.guard_setup()),
    };
    state.front.set_guard(Arc::new(guard)).unwrap();
    state.front.registry.add(Entry::new(
        "tiny",
        "1.0.0",
        "sha256:tiny",
        server::admission::Admission::new(config.admission.clone()),
        Arc::new(backend),
    ));
    state.loaded();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = server::http::router(Arc::clone(&state));
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap();

    let mut rng = Rng(seed);
    let bodies: Vec<(String, String)> = (0..total).map(|_| body(&mut rng)).collect();
    let started = Instant::now();
    let mut latencies = Vec::with_capacity(total);
    let mut statuses = std::collections::BTreeMap::new();
    for chunk in bodies.chunks(8) {
        let calls = chunk.iter().map(|(path, body)| {
            let client = client.clone();
            let url = format!("{url}{path}");
            let body = body.clone();
            async move {
                let t = Instant::now();
                let response = client
                    .post(url)
                    .header("content-type", "application/json")
                    .body(body.clone())
                    .send()
                    .await
                    .unwrap_or_else(|e| {
                        panic!("no answer ({e}) to {}", &body[..body.len().min(300)])
                    });
                let status = response.status().as_u16();
                let text = response.text().await.unwrap_or_default();
                (status, t.elapsed(), text, body)
            }
        });
        for (status, elapsed, text, body) in futures_util::future::join_all(calls).await {
            assert!(
                status < 500,
                "{status} {text} for {}",
                &body[..body.len().min(300)]
            );
            assert!(
                !text.contains("<state>") && !text.contains("panicked"),
                "internal state in an answer: {text}"
            );
            *statuses.entry(status).or_insert(0usize) += 1;
            latencies.push(elapsed);
        }
    }
    latencies.sort();
    let p99 = latencies[latencies.len() * 99 / 100];
    let max = *latencies.last().unwrap();
    eprintln!(
        "{total} fuzzed requests in {:.1} s (classifier: {}): statuses {statuses:?}, p50 {:?}, p99 {p99:?}, max {max:?}",
        started.elapsed().as_secs_f64(),
        classifier.is_some(),
        latencies[latencies.len() / 2],
    );
    // Served and refused both (the classifier takes most fuzz for an attack: it is text no
    // person writes).
    if !with_classifier {
        assert!(
            statuses.get(&200).copied().unwrap_or(0) > total / 20,
            "{statuses:?}"
        );
    }
    assert!(
        statuses.get(&400).copied().unwrap_or(0) > total / 20,
        "{statuses:?}"
    );
    assert!(max < Duration::from_secs(10), "max latency {max:?}");
    // Still serving.
    let ok = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "tiny", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}
