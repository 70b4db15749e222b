//! Prompt lookup (speculative decoding without a draft model) through the real engine: the
//! same tokens, texts, log-probabilities and entropies with and without it, greedy and seeded
//! sampling alike (each emitted token is one draw of the sequence's sampler from the same
//! logits either way), with stop strings, penalties and batching; guesses are made and kept.

use std::path::Path;

use engine::speculation::Speculation;
use engine::{
    Engine, EngineOptions, Event, GenerateRequest, KvDType, KvOptions, Prompt, SamplingParams,
    SchedulerOptions, TokenEvent,
};
use formats::tiny::TinyLlama;
use testkit::cached_model;
use testkit::models::SMOLLM2_GGUF;

fn tiny_model(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tiny.gguf");
    let model = TinyLlama {
        context_length: 1024,
        ..TinyLlama::default()
    };
    std::fs::write(&path, model.to_gguf().unwrap()).unwrap();
    path
}

fn options(max_draft: usize) -> EngineOptions {
    EngineOptions {
        threads: 2,
        context: Some(1024),
        kv: KvOptions {
            dtype: KvDType::F32,
            ..KvOptions::default()
        },
        scheduler: SchedulerOptions {
            max_num_seqs: 8,
            max_num_batched_tokens: 256,
            speculation: Speculation {
                max_draft,
                ngram_min: 1,
                ngram_max: 3,
                max_batch: 8,
            },
            ..SchedulerOptions::default()
        },
        ..EngineOptions::default()
    }
}

/// A token event with its floats as bits: id, text, logprob, entropy, top (id, logprob).
type Token = (u32, String, u32, u32, Vec<(u32, u32)>);

/// What a request produced: every token event and how it ended.
#[derive(Debug, PartialEq)]
struct Output {
    tokens: Vec<Token>,
    reason: String,
}

fn key(t: TokenEvent) -> Token {
    (
        t.id,
        t.text,
        t.logprob.to_bits(),
        t.entropy.to_bits(),
        t.top_logprobs
            .into_iter()
            .map(|(id, _, lp)| (id, lp.to_bits()))
            .collect(),
    )
}

fn collect(stream: engine::Stream) -> Output {
    let mut tokens = Vec::new();
    for event in stream {
        match event {
            Event::Token(t) => tokens.push(key(t)),
            Event::Finished(done) => {
                return Output {
                    tokens,
                    reason: format!("{:?} {:?}", done.reason, done.stop),
                }
            }
            Event::Failed(e) => panic!("{e}"),
            Event::Shed(_) => panic!("shed"),
        }
    }
    panic!("the stream ended without Finished")
}

/// Requests that exercise the sampler: greedy, seeded sampling with penalties and
/// log-probabilities, a stop string.
fn requests(prompts: &[String], max_tokens: usize) -> Vec<GenerateRequest> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut greedy = GenerateRequest::new(Prompt::Text(p.clone()), max_tokens);
        greedy.sampling = SamplingParams::greedy();
        greedy.sampling.top_logprobs = 2;
        greedy.ignore_eos = true;
        out.push(greedy);
        let mut sampled = GenerateRequest::new(Prompt::Text(p.clone()), max_tokens);
        sampled.sampling = SamplingParams {
            temperature: 0.8,
            top_p: 0.95,
            seed: Some(7 + i as u64),
            frequency_penalty: 0.2,
            top_logprobs: 1,
            ..SamplingParams::default()
        };
        sampled.ignore_eos = true;
        out.push(sampled);
        let mut stopped = GenerateRequest::new(Prompt::Text(p.clone()), max_tokens);
        stopped.sampling = SamplingParams::greedy();
        stopped.stop = vec![" the".into(), "e a".into()];
        out.push(stopped);
    }
    out
}

fn run(engine: &Engine, requests: &[GenerateRequest], together: bool) -> Vec<Output> {
    if together {
        let streams: Vec<_> = requests
            .iter()
            .map(|r| engine.generate(r.clone()).unwrap())
            .collect();
        streams.into_iter().map(collect).collect()
    } else {
        requests
            .iter()
            .map(|r| collect(engine.generate(r.clone()).unwrap()))
            .collect()
    }
}

/// Prompts whose continuations copy from them: repeated phrases.
fn copying_prompts() -> Vec<String> {
    vec![
        "one two three four five one two three four five one two three four five one two".into(),
        "the cat sat on the mat and the cat sat on the mat and the cat sat on the".into(),
        "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(".into(),
        "Water boils at one hundred degrees".into(),
    ]
}

fn compare(path: &Path, prompts: &[String], max_tokens: usize) -> engine::SchedulerSnapshot {
    let plain = Engine::load(path, &options(0)).unwrap();
    let guessing = Engine::load(path, &options(5)).unwrap();
    let requests = requests(prompts, max_tokens);
    let expected = run(&plain, &requests, false);
    assert_eq!(plain.snapshot().speculated_tokens, 0);
    for together in [false, true] {
        let got = run(&guessing, &requests, together);
        for (i, (e, g)) in expected.iter().zip(&got).enumerate() {
            assert_eq!(e, g, "request {i} (together: {together})");
        }
    }
    guessing.snapshot()
}

#[test]
fn guesses_change_nothing_but_the_steps_on_a_tiny_model() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_model(dir.path());
    let s = compare(&path, &copying_prompts(), 64);
    assert!(s.speculated_tokens > 0, "{s:?}");
    assert!(s.speculated_accepted > 0, "{s:?}");
    assert!(s.speculated_accepted <= s.speculated_tokens);
}

#[test]
fn guesses_change_nothing_but_the_steps_on_smollm2() {
    let Some(path) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let s = compare(&path, &copying_prompts(), 48);
    // A real model continues a repeated phrase as it was: many guesses are kept (the sampled
    // requests and the prompt that does not repeat keep fewer).
    assert!(
        s.speculated_accepted * 5 >= s.speculated_tokens,
        "kept {} of {}",
        s.speculated_accepted,
        s.speculated_tokens
    );
}
