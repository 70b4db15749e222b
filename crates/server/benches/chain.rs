//! What the backend chain costs and how fast it reacts, on instant fake backends (so only the
//! chain is measured): the healthy path with no chain and with a three-step chain; a request
//! whose primary fails and the next step answers; how long past `first_token_timeout_ms` a hung
//! backend is left; how many requests it takes a dead backend's breaker to open.
//!
//! `cargo bench -p rampart-server --bench chain`

use std::sync::Arc;
use std::time::{Duration, Instant};

use record::{Bus, RecordBuilder};
use server::backend::{
    Answer, BackendError, Description, EmbedWork, EmbeddingInputs, Embeddings, GeneratePlan,
    Generated, Generation, InferenceBackend, Kind, StartFuture, Token, Work, WorkKind,
};
use server::chain::{Policy, Step, Target};
use server::config::{ServerConfig, Trigger};
use server::faults::{FaultMode, FaultRequest};
use server::registry::{Entry, ModelName};
use server::state::AppState;

/// Answers at once: one vector per text.
struct Instant0;

impl InferenceBackend for Instant0 {
    fn kind(&self) -> Kind {
        Kind::Embedding
    }
    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Embed
    }
    fn start<'a>(&'a self, work: Work, _record: &'a mut RecordBuilder) -> StartFuture<'a> {
        let result = match work {
            Work::Embed(EmbedWork {
                inputs: EmbeddingInputs::Texts(texts),
                ..
            }) => Ok(Answer::Embeddings(Embeddings {
                vectors: texts.iter().map(|t| vec![t.len() as f32]).collect(),
                prompt_tokens: texts.len(),
            })),
            _ => Err(BackendError::invalid("texts only")),
        };
        Box::pin(std::future::ready(result))
    }
    fn describe(&self) -> Description {
        Description::default()
    }
}

/// Generates `TOKENS` tokens at once (a ready stream): what the chain adds per token shows.
struct Talker;

const TOKENS: usize = 64;

impl InferenceBackend for Talker {
    fn kind(&self) -> Kind {
        Kind::Llm
    }
    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Generate
    }
    fn start<'a>(&'a self, _work: Work, _record: &'a mut RecordBuilder) -> StartFuture<'a> {
        use futures_util::StreamExt;
        let mut events: Vec<(usize, Generated)> = (0..TOKENS)
            .map(|_| {
                (
                    0,
                    Generated::Token(Token {
                        text: "tok".into(),
                        entropy: 0.5,
                        logprobs: None,
                        attention: Vec::new(),
                        id: 0,
                    }),
                )
            })
            .collect();
        events.push((
            0,
            Generated::Finished(engine::Finished {
                reason: engine::FinishReason::Stop,
                prompt_tokens: 1,
                completion_tokens: TOKENS,
                cached_prompt_tokens: 0,
                queue_seconds: 0.0,
                prefill_seconds: 0.0,
                decode_seconds: 0.0,
                trailing_text: String::new(),
                stop: None,
                speculated_tokens: 0,
                speculated_accepted: 0,
            }),
        ));
        Box::pin(std::future::ready(Ok(Answer::Generation(Generation {
            events: futures_util::stream::iter(events).boxed(),
            choices: 1,
            prompt_tokens: 1,
            structured: None,
            tools: None,
            watch: None,
            explain: None,
        }))))
    }
    fn describe(&self) -> Description {
        Description::default()
    }
}

fn generate_work(stream: bool) -> Work {
    Work::Generate(Box::new(GeneratePlan {
        prompts: vec![engine::Prompt::Text("hi".into())],
        n: 1,
        request: engine::GenerateRequest::new(engine::Prompt::Text("hi".into()), TOKENS),
        stream,
        include_usage: false,
        logprobs: false,
        user: None,
        input_for_hash: String::new(),
        default_max_tokens: false,
        structured: None,
        tools: None,
        language: None,
        parse_special_tokens: None,
        fallback_level: 0,
        explain: None,
    }))
}

/// Nanoseconds per token of draining a generation: through the chain (`stream` or buffered),
/// or straight from the backend (the floor).
fn per_token(state: &Arc<AppState>, runtime: &tokio::runtime::Runtime, how: &str, n: usize) -> f64 {
    use futures_util::StreamExt;
    runtime.block_on(async {
        let entry = state
            .front
            .registry
            .find(&ModelName::parse("talker"))
            .expect("served");
        let began = Instant::now();
        for _ in 0..n {
            let mut record = state
                .front
                .record("bench".into(), "bench".into(), "completions");
            let answer = match how {
                "direct" => entry
                    .backend
                    .start(generate_work(true), &mut record)
                    .await
                    .expect("an answer"),
                _ => {
                    server::chain::run(
                        state.front.chain_parts(),
                        Arc::clone(&entry),
                        generate_work(how == "stream"),
                        &mut record,
                    )
                    .await
                    .expect("an answer")
                    .answer
                }
            };
            let Answer::Generation(mut g) = answer else {
                panic!("a generation")
            };
            while g.events.next().await.is_some() {}
        }
        began.elapsed().as_nanos() as f64 / (n * TOKENS) as f64
    })
}

fn work() -> Work {
    Work::Embed(EmbedWork {
        inputs: EmbeddingInputs::Texts(vec!["a ticket".into()]),
        dimensions: None,
    })
}

fn setup(runtime: &tokio::runtime::Runtime, first_token_ms: u64, trip: bool) -> Arc<AppState> {
    let _context = runtime.enter();
    let mut config = ServerConfig::default();
    if !trip {
        // Every hang is timed (a breaker would open after 5 and skip the rest).
        config.breaker.consecutive_failures = u32::MAX;
        config.breaker.min_calls = u32::MAX;
    }
    config.faults.enabled = true;
    config.handoff.enabled = false;
    let bus = Bus::start(Vec::new()).expect("a bus");
    let state = AppState::new(config.clone(), None, None, bus);
    let entry = |name: &str, version: &str| {
        Entry::new(
            name,
            version,
            "sha256:bench",
            server::admission::Admission::new(config.admission.clone()),
            Arc::new(Instant0),
        )
        .with_breaker((&config.breaker).into())
    };
    let step = |target: &str| Step {
        target: Target::Model(ModelName::parse(target)),
        on: Trigger::DEFAULT.to_vec(),
    };
    state.front.registry.add(entry("plain", "1.0.0"));
    state
        .front
        .registry
        .add(entry("chained", "2.0.0").with_policy(Policy {
            steps: vec![step("chained@1.0.0"), step("other"), step("plain")],
            first_token_timeout: Duration::from_millis(first_token_ms),
            stall_timeout: Duration::from_secs(30),
        }));
    state.front.registry.add(entry("chained", "1.0.0"));
    state.front.registry.add(entry("other", "1.0.0"));
    state.front.registry.add(
        Entry::new(
            "talker",
            "1.0.0",
            "sha256:bench",
            server::admission::Admission::new(config.admission.clone()),
            Arc::new(Talker),
        )
        .with_breaker((&config.breaker).into()),
    );
    state.loaded();
    state
}

async fn one(state: &Arc<AppState>, model: &str) -> Duration {
    let began = Instant::now();
    let mut record = state
        .front
        .record("bench".into(), "bench".into(), "embeddings");
    let entry = state
        .front
        .registry
        .find(&ModelName::parse(model))
        .expect("served");
    let answered = server::chain::run(state.front.chain_parts(), entry, work(), &mut record)
        .await
        .expect("an answer");
    drop(answered);
    drop(record);
    began.elapsed()
}

fn per_request(
    state: &Arc<AppState>,
    runtime: &tokio::runtime::Runtime,
    model: &str,
    n: usize,
) -> f64 {
    runtime.block_on(async {
        for _ in 0..1000 {
            one(state, model).await;
        }
        let began = Instant::now();
        for _ in 0..n {
            one(state, model).await;
        }
        began.elapsed().as_nanos() as f64 / n as f64
    })
}

fn fault(state: &AppState, backend: &str, mode: FaultMode) {
    state
        .front
        .faults
        .inject(
            FaultRequest {
                backend: backend.into(),
                mode,
                duration_s: 600.0,
                factor: None,
                fraction: None,
                after_tokens: None,
                scope: Default::default(),
            },
            "bench",
            |_| true,
        )
        .expect("faults are on");
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let n = 200_000;
    let state = setup(&runtime, 100, true);
    let plain = per_request(&state, &runtime, "plain", n);
    let chained = per_request(&state, &runtime, "chained", n);
    println!("healthy, no chain              {plain:>8.0} ns/request (record, breaker, admission, attempt)");
    println!("healthy, three-step chain      {chained:>8.0} ns/request");
    for how in ["direct", "stream", "buffered"] {
        per_token(&state, &runtime, how, 2_000);
        let ns = per_token(&state, &runtime, how, 20_000);
        println!("a {TOKENS}-token generation, {how:<9} {ns:>8.0} ns/token drained");
    }
    fault(&state, "chained@2.0.0", FaultMode::Fail);
    // The breaker opens after 5 failures: count them, then time the open-circuit path.
    let mut until_open = 0;
    runtime.block_on(async {
        let entry = state
            .front
            .registry
            .find(&ModelName::parse("chained@2.0.0"))
            .expect("served");
        while entry.breaker.state() != server::breaker::State::Open {
            one(&state, "chained").await;
            until_open += 1;
        }
    });
    println!("a dead backend's breaker opens after {until_open} requests");
    let open = per_request(&state, &runtime, "chained", n);
    println!("primary circuit open → step 1  {open:>8.0} ns/request");
    state.front.faults.clear(None, "bench");

    // A hang before the answer: how long past the deadline the fallback takes over.
    let state = setup(&runtime, 100, false);
    fault(&state, "chained@2.0.0", FaultMode::Hang);
    let mut over: Vec<f64> = runtime.block_on(async {
        let mut v = Vec::new();
        for _ in 0..40 {
            let took = one(&state, "chained").await;
            v.push(took.as_secs_f64() * 1e3 - 100.0);
        }
        v
    });
    over.sort_by(f64::total_cmp);
    println!(
        "hang, first_token_timeout 100 ms: answered by step 1 after the deadline + p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        percentile(&over, 0.5),
        percentile(&over, 0.99),
        over[over.len() - 1]
    );
}
