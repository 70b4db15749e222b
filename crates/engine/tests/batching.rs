//! Continuous batching through the real engine: many prompts at once give the same greedy tokens
//! as each prompt alone, cancellation frees blocks, admission refuses what can never fit.

use std::path::Path;

use engine::{
    Engine, EngineError, EngineOptions, Event, GenerateRequest, KvDType, KvMemory, KvOptions,
    Prompt, SamplingParams, SchedulerOptions,
};
use formats::tiny::TinyLlama;
use testkit::cached_model;
use testkit::models::SMOLLM2_GGUF;

/// The tiny model with a 4,096-token context: sequences long enough to outlast a busy machine.
fn long_tiny_model(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("long.gguf");
    let long = TinyLlama {
        context_length: 4096,
        ..TinyLlama::default()
    };
    std::fs::write(&path, long.to_gguf().unwrap()).unwrap();
    path
}

fn tiny_model(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, TinyLlama::default().to_gguf().unwrap()).unwrap();
    path
}

fn options(dtype: KvDType, max_num_seqs: usize) -> EngineOptions {
    EngineOptions {
        threads: 2,
        context: Some(256),
        kv: KvOptions {
            dtype,
            ..KvOptions::default()
        },
        scheduler: SchedulerOptions {
            max_num_seqs,
            max_num_batched_tokens: 64,
            ..SchedulerOptions::default()
        },
        ..EngineOptions::default()
    }
}

fn request(prompt: &str, max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(Prompt::Text(prompt.to_string()), max_tokens);
    r.sampling = SamplingParams::greedy();
    r.ignore_eos = true;
    r
}

/// The first snapshot that satisfies `ok` (the snapshot is published at the end of a step, a
/// little after the step's events are sent).
fn snapshot_where(
    engine: &Engine,
    ok: impl Fn(&engine::SchedulerSnapshot) -> bool,
) -> engine::SchedulerSnapshot {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let s = engine.snapshot();
        if ok(&s) || std::time::Instant::now() > deadline {
            return s;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

fn collect(stream: engine::Stream) -> Vec<u32> {
    let mut ids = Vec::new();
    for event in stream {
        match event {
            Event::Token(t) => ids.push(t.id),
            Event::Finished(_) => return ids,
            Event::Failed(e) => panic!("{e}"),
            Event::Shed(shed) => panic!("shed after {} ms", shed.waited_ms),
        }
    }
    panic!("the stream ended without Finished")
}

/// Greedy tokens of each prompt, all submitted at once, and one at a time.
fn concurrent_and_alone(engine: &Engine, prompts: &[String], max_tokens: usize) {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| engine.generate(request(p, max_tokens)).unwrap())
        .collect();
    let together: Vec<Vec<u32>> = streams.into_iter().map(collect).collect();
    let s = engine.snapshot();
    assert!(s.steps > 0);
    for (i, p) in prompts.iter().enumerate() {
        let alone = collect(engine.generate(request(p, max_tokens)).unwrap());
        assert_eq!(together[i], alone, "prompt {i} {p:?}");
    }
    let s = snapshot_where(engine, |s| s.running == 0);
    assert_eq!((s.running, s.waiting, s.blocks_used), (0, 0, 0), "{s:?}");
}

fn prompts(n: usize) -> Vec<String> {
    let subjects = [
        "The capital of France is",
        "Once upon a time",
        "The quick brown fox",
        "In 1492, Columbus",
        "Water boils at",
        "The best way to learn a language is",
        "def fibonacci(n):",
        "Photosynthesis converts",
    ];
    (0..n)
        .map(|i| {
            let base = subjects[i % subjects.len()];
            // Different lengths (and so different chunking and positions) per prompt.
            format!(
                "{base}{}",
                " and then".repeat(i / subjects.len() * 3 + i % 3)
            )
        })
        .collect()
}

#[test]
fn sixteen_concurrent_prompts_match_running_alone_on_a_tiny_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_model(dir.path());
    for dtype in [KvDType::F32, KvDType::F16] {
        let engine = Engine::load(&path, &options(dtype, 16)).unwrap();
        concurrent_and_alone(&engine, &prompts(16), 24);
    }
}

#[test]
fn sixteen_concurrent_prompts_match_running_alone_on_smollm2() {
    let Some(path) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let engine = Engine::load(&path, &options(KvDType::F16, 16)).unwrap();
    concurrent_and_alone(&engine, &prompts(16), 16);
}

#[test]
fn dropping_a_stream_frees_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    // A long context, so that `keep` cannot finish on a busy machine before the snapshots below
    // see it running alone.
    let mut opts = options(KvDType::F32, 8);
    opts.context = Some(4096);
    let engine = Engine::load(&long_tiny_model(dir.path()), &opts).unwrap();
    let mut keep = engine.generate(request("Once upon a time", 4000)).unwrap();
    let mut cancel = engine
        .generate(request("The quick brown fox", 200))
        .unwrap();
    // Both are running once each has produced a token.
    assert!(matches!(keep.blocking_next(), Some(Event::Token(_))));
    assert!(matches!(cancel.blocking_next(), Some(Event::Token(_))));
    let before = snapshot_where(&engine, |s| s.running == 2);
    assert_eq!(before.running, 2);
    drop(cancel);
    // The cancelled sequence is gone and its blocks are back (that this happens at the very next
    // step is checked step by step in tests/scheduler.rs).
    keep.blocking_next();
    keep.blocking_next();
    let after = snapshot_where(&engine, |s| s.running == 1);
    assert_eq!(after.running, 1, "{after:?}");
    // The pool holds exactly the blocks of the one sequence still running (it keeps growing,
    // so a before/after count would race with it): the cancelled one's came back.
    assert_eq!(
        after.blocks_used * after.block_tokens,
        after.kv_slots_allocated,
        "{before:?} → {after:?}"
    );
    assert_eq!(
        before.blocks_used * before.block_tokens,
        before.kv_slots_allocated
    );
    drop(keep);
}

/// At saturation (new prefills stopped) a request that never started is refused after the
/// engine's `saturation_wait_ms`, with a retry hint, instead of waiting for the saturation to
/// end; a running stream goes on untouched; once prefills are admitted again, new requests run.
#[test]
fn at_saturation_an_unstarted_request_is_shed_after_the_wait_and_a_running_one_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(KvDType::F32, 8);
    opts.context = Some(4096);
    let engine = Engine::load(&long_tiny_model(dir.path()), &opts).unwrap();
    let mut running = engine.generate(request("Once upon a time", 4000)).unwrap();
    assert!(matches!(running.blocking_next(), Some(Event::Token(_))));
    engine.limits().set_saturation_wait_ms(300);
    engine.limits().set_admit_prefills(false);
    let submitted = std::time::Instant::now();
    let mut waiting = engine.generate(request("The quick brown fox", 8)).unwrap();
    let first = loop {
        if let Some(event) = waiting.try_next() {
            break Some(event);
        }
        if submitted.elapsed() > std::time::Duration::from_secs(5) {
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    match first {
        Some(Event::Shed(engine::Shed {
            waited_ms,
            retry_after_s,
        })) => {
            assert!(waited_ms >= 300, "{waited_ms}");
            assert_eq!(retry_after_s, 1);
        }
        other => panic!("expected the waiting request to be shed, got {other:?}"),
    }
    let elapsed = submitted.elapsed();
    assert!(
        elapsed >= std::time::Duration::from_millis(300),
        "{elapsed:?}"
    );
    assert!(elapsed < std::time::Duration::from_secs(5), "{elapsed:?}");
    assert_eq!(engine.limits().saturation_refusals(), 1);
    // The refused request's queue slot and blocks are back; the running stream keeps going.
    for _ in 0..3 {
        assert!(matches!(running.blocking_next(), Some(Event::Token(_))));
    }
    let s = snapshot_where(&engine, |s| s.waiting == 0 && s.running == 1);
    assert_eq!((s.waiting, s.running), (0, 1), "{s:?}");
    // The wait counts from the saturation's onset for requests that arrived before it.
    engine.limits().set_admit_prefills(true);
    drop(running);
    assert_eq!(
        collect(engine.generate(request("Hello", 4)).unwrap()).len(),
        4
    );
    // With no wait configured, a request waits for the saturation to end.
    engine.limits().set_saturation_wait_ms(0);
    engine.limits().set_admit_prefills(false);
    let mut patient = engine.generate(request("The quick brown fox", 4)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(400));
    assert!(patient.try_next().is_none());
    engine.limits().set_admit_prefills(true);
    assert!(matches!(patient.blocking_next(), Some(Event::Token(_))));
}

#[test]
fn requests_that_can_never_fit_are_refused_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(KvDType::F32, 4);
    opts.kv.memory = KvMemory::Bytes(1);
    opts.scheduler.max_waiting = 2;
    let engine = Engine::load(&tiny_model(dir.path()), &opts).unwrap();
    // The pool holds one full-context sequence at least, whatever the memory asked.
    assert!(engine.kv_capacity().tokens() >= 256);
    let err = engine.generate(request("Hello", 300)).unwrap_err();
    assert!(matches!(err, EngineError::ContextExceeded { .. }), "{err}");
    // One sequence runs (slowly), two wait: the other three are refused. Long sequences (a
    // 4,096-token context), so that none can finish between two submissions on a busy machine.
    let mut opts = opts.clone();
    opts.context = Some(4096);
    let engine = Engine::load(&long_tiny_model(dir.path()), &opts).unwrap();
    engine.limits().set_max_num_seqs(1);
    engine.limits().set_max_num_batched_tokens(1);
    let streams: Vec<_> = (0..6)
        .map(|_| engine.generate(request("Hello there", 4000)))
        .collect();
    let refused = streams
        .iter()
        .filter(|s| matches!(s, Err(EngineError::QueueFull { limit: 2 })))
        .count();
    assert!(refused >= 3, "{refused} of 6 refused with QueueFull");
}
