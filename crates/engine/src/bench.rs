//! Measurements: engine throughput (as `llama-bench` measures it), batched decode (as
//! `llama-batched-bench` does), prefix-cache time to first token, and perplexity (as
//! `llama-perplexity` computes it), so numbers compare one to one with llama.cpp.

use std::time::Instant;

use crate::error::EngineError;
use crate::generate::{Engine, Event, Finished, GenerateRequest, Prompt, Stream};
use crate::model::LogitRows;
use crate::sampler::SamplingParams;

/// Prefill and decode speed.
#[derive(Debug, Clone, PartialEq)]
pub struct ThroughputReport {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// Prompt tokens per second of each repetition.
    pub prefill_tps: Vec<f64>,
    /// Generated tokens per second of each repetition.
    pub decode_tps: Vec<f64>,
    /// Weight bytes one decode step reads ([`crate::model::Model::decode_bytes_per_token`]).
    pub decode_bytes_per_token: u64,
}

/// The median of a sample.
pub fn median(values: &[f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let mid = v.len() / 2;
    if v.len() % 2 == 1 {
        v[mid]
    } else {
        (v[mid - 1] + v[mid]) / 2.0
    }
}

/// Deterministic pseudo-random token ids (llama-bench also feeds random tokens).
fn token_stream(vocab: usize, seed: u64) -> impl Iterator<Item = u32> {
    let mut state = seed;
    std::iter::repeat_with(move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) % vocab as u64) as u32
    })
}

/// Prefill of `prompt_tokens` in one batch from an empty context, and decode of `gen_tokens`
/// one at a time from an empty context, each repeated `repetitions` times after one warm-up.
pub fn throughput(
    engine: &Engine,
    prompt_tokens: usize,
    gen_tokens: usize,
    repetitions: usize,
) -> Result<ThroughputReport, EngineError> {
    let vocab = engine.config().vocab_size;
    if prompt_tokens.max(gen_tokens) > engine.context() {
        return Err(EngineError::InvalidRequest(format!(
            "the benchmark needs {} positions; the context is {}",
            prompt_tokens.max(gen_tokens),
            engine.context()
        )));
    }
    let mut report = ThroughputReport {
        prompt_tokens,
        gen_tokens,
        prefill_tps: Vec::new(),
        decode_tps: Vec::new(),
        decode_bytes_per_token: 0,
    };
    engine.with_session(|model, backend, cache, state| -> Result<(), EngineError> {
        report.decode_bytes_per_token = model.decode_bytes_per_token();
        for rep in 0..=repetitions {
            if prompt_tokens > 0 {
                let tokens: Vec<u32> = token_stream(vocab, rep as u64 + 1)
                    .take(prompt_tokens)
                    .collect();
                cache.clear();
                let start = Instant::now();
                model.forward(backend, &tokens, cache, state, LogitRows::Last)?;
                if rep > 0 {
                    report
                        .prefill_tps
                        .push(prompt_tokens as f64 / start.elapsed().as_secs_f64());
                }
            }
            if gen_tokens > 0 {
                cache.clear();
                let mut tokens = token_stream(vocab, 1000 + rep as u64);
                let start = Instant::now();
                for _ in 0..gen_tokens {
                    let t = tokens.next().unwrap_or(0);
                    model.forward(backend, &[t], cache, state, LogitRows::Last)?;
                }
                if rep > 0 {
                    report
                        .decode_tps
                        .push(gen_tokens as f64 / start.elapsed().as_secs_f64());
                }
            }
        }
        Ok(())
    })?;
    Ok(report)
}

/// Perplexity over a text.
#[derive(Debug, Clone, PartialEq)]
pub struct PerplexityReport {
    pub perplexity: f64,
    pub chunks: usize,
    pub context: usize,
    pub tokens_scored: usize,
    pub seconds: f64,
}

/// llama-perplexity's method: tokenize the text, cut it into non-overlapping chunks of `context`
/// tokens (the first token of each replaced by BOS when the model adds BOS), run each chunk from
/// an empty cache, and score the second half of each chunk (position j predicts token j + 1).
/// `max_chunks` limits the run (0: all).
pub fn perplexity(
    engine: &Engine,
    text: &str,
    context: usize,
    max_chunks: usize,
) -> Result<PerplexityReport, EngineError> {
    let tokenizer = engine.tokenizer();
    let tokens = tokenizer.encode(text, true)?;
    if context < 8 || context > engine.context() {
        return Err(EngineError::InvalidRequest(format!(
            "the perplexity context must be between 8 and {} tokens, got {context}",
            engine.context()
        )));
    }
    let mut chunks = tokens.len() / context;
    if max_chunks > 0 {
        chunks = chunks.min(max_chunks);
    }
    if chunks == 0 {
        return Err(EngineError::InvalidRequest(format!(
            "the text has {} tokens, fewer than one chunk of {context}",
            tokens.len()
        )));
    }
    let vocab = engine.config().vocab_size;
    let first = context / 2;
    let start = Instant::now();
    let mut nll = 0f64;
    let mut scored = 0usize;
    for c in 0..chunks {
        let mut chunk = tokens[c * context..(c + 1) * context].to_vec();
        if tokenizer.add_bos {
            if let Some(bos) = tokenizer.bos {
                chunk[0] = bos;
            }
        }
        let logits = engine.logits(&chunk)?;
        for j in first..context - 1 {
            let row = &logits[j * vocab..(j + 1) * vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let log_z = f64::from(max)
                + row
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += log_z - f64::from(row[chunk[j + 1] as usize]);
            scored += 1;
        }
    }
    Ok(PerplexityReport {
        perplexity: (nll / scored as f64).exp(),
        chunks,
        context,
        tokens_scored: scored,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Aggregate speed of `parallel` sequences decoding together (as `llama-batched-bench` measures
/// it: every sequence gets its own prompt of `prompt_tokens`, prefilled together, then
/// `gen_tokens` decode steps of `parallel` tokens each).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchedReport {
    pub parallel: usize,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// From submission until every sequence has its first token.
    pub prefill_seconds: f64,
    /// From then until the last sequence ends.
    pub decode_seconds: f64,
    pub prefill_tps: f64,
    /// Generated tokens per second over all sequences.
    pub decode_tps: f64,
    /// Mean share of allocated KV token slots that hold no token, sampled while decoding.
    pub kv_waste: f64,
    pub preemptions: u64,
}

/// Reads every stream to its end; while they run, samples the KV waste whenever all
/// `parallel` sequences are running.
fn drain(
    engine: &Engine,
    streams: Vec<Stream>,
    parallel: usize,
) -> Result<(Vec<Finished>, f64), EngineError> {
    let mut streams: Vec<Option<Stream>> = streams.into_iter().map(Some).collect();
    let mut finished = Vec::with_capacity(streams.len());
    let (mut waste, mut samples) = (0.0, 0usize);
    while finished.len() < streams.len() {
        let mut progressed = false;
        for slot in streams.iter_mut() {
            let Some(stream) = slot.as_mut() else {
                continue;
            };
            while let Some(event) = stream.try_next() {
                progressed = true;
                match event {
                    Event::Token(_) => {}
                    Event::Finished(f) => {
                        finished.push(f);
                        *slot = None;
                        break;
                    }
                    Event::Failed(e) => return Err(EngineError::Failed(e)),
                    Event::Shed(shed) => return Err(shed.into()),
                }
            }
        }
        let s = engine.snapshot();
        if s.running == parallel && s.waiting == 0 {
            waste += s.kv_waste();
            samples += 1;
        }
        if !progressed {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }
    Ok((
        finished,
        if samples > 0 {
            waste / samples as f64
        } else {
            0.0
        },
    ))
}

/// Runs `parallel` sequences of random prompts at once through the scheduler. The prompts are
/// distinct (no prefix sharing); the scheduler's token budget should cover
/// `parallel × prompt_tokens` for the prompts to prefill in one step, as llama.cpp's does.
pub fn batched(
    engine: &Engine,
    prompt_tokens: usize,
    gen_tokens: usize,
    parallel: usize,
    seed: u64,
) -> Result<BatchedReport, EngineError> {
    let vocab = engine.config().vocab_size;
    let before = engine.snapshot();
    let mut streams = Vec::with_capacity(parallel);
    for i in 0..parallel {
        let tokens: Vec<u32> = token_stream(vocab, seed * 1000 + i as u64 + 1)
            .take(prompt_tokens.max(1))
            .collect();
        // One more token than the decode steps: the first comes from the prefill's logits.
        let mut request = GenerateRequest::new(Prompt::Tokens(tokens), gen_tokens + 1);
        request.sampling = SamplingParams::greedy();
        request.ignore_eos = true;
        streams.push(engine.generate(request)?);
    }
    let (finished, kv_waste) = drain(engine, streams, parallel)?;
    let first_token = finished
        .iter()
        .map(|f| f.queue_seconds + f.prefill_seconds)
        .fold(0.0, f64::max);
    let end = finished
        .iter()
        .map(|f| f.queue_seconds + f.prefill_seconds + f.decode_seconds)
        .fold(0.0, f64::max);
    let decode_seconds = (end - first_token).max(1e-9);
    Ok(BatchedReport {
        parallel,
        prompt_tokens,
        gen_tokens,
        prefill_seconds: first_token,
        decode_seconds,
        prefill_tps: (parallel * prompt_tokens) as f64 / first_token.max(1e-9),
        decode_tps: (parallel * gen_tokens) as f64 / decode_seconds,
        kv_waste,
        preemptions: engine.snapshot().preemptions - before.preemptions,
    })
}

/// Time to first token of a request whose prompt shares a prefix with one that ran before it.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefixReport {
    pub prefix_tokens: usize,
    pub suffix_tokens: usize,
    /// Time to first token of each measured request (the second of each pair), seconds.
    pub ttft_seconds: Vec<f64>,
    /// Prompt tokens of the measured requests served from the cache, per request.
    pub cached_tokens: Vec<usize>,
}

/// For each repetition, runs a request of a fresh random `prefix_tokens` prefix plus a suffix,
/// then a second request with the same prefix and another suffix, and records the second one's
/// time to first token (submission to first token, as the engine measures it).
pub fn prefix_reuse(
    engine: &Engine,
    prefix_tokens: usize,
    suffix_tokens: usize,
    repetitions: usize,
) -> Result<PrefixReport, EngineError> {
    let vocab = engine.config().vocab_size;
    let mut report = PrefixReport {
        prefix_tokens,
        suffix_tokens,
        ttft_seconds: Vec::new(),
        cached_tokens: Vec::new(),
    };
    let run = |tokens: Vec<u32>| -> Result<Finished, EngineError> {
        let mut request = GenerateRequest::new(Prompt::Tokens(tokens), 1);
        request.sampling = SamplingParams::greedy();
        request.ignore_eos = true;
        for event in engine.generate(request)? {
            match event {
                Event::Finished(f) => return Ok(f),
                Event::Failed(e) => return Err(EngineError::Failed(e)),
                Event::Shed(shed) => return Err(shed.into()),
                Event::Token(_) => {}
            }
        }
        Err(EngineError::Stopped)
    };
    for rep in 0..=repetitions {
        let prefix: Vec<u32> = token_stream(vocab, 7_000 + rep as u64)
            .take(prefix_tokens)
            .collect();
        let with_suffix = |seed: u64| {
            let mut t = prefix.clone();
            t.extend(token_stream(vocab, seed).take(suffix_tokens.max(1)));
            t
        };
        run(with_suffix(9_000 + rep as u64))?;
        let second = run(with_suffix(11_000 + rep as u64))?;
        // The first pair warms up.
        if rep > 0 {
            report
                .ttft_seconds
                .push(second.queue_seconds + second.prefill_seconds);
            report.cached_tokens.push(second.cached_prompt_tokens);
        }
    }
    Ok(report)
}

/// One greedy generation for the prompt-lookup benchmark: the tokens, and how long decoding took
/// after the first token (`Finished::decode_seconds`).
#[derive(Debug, Clone)]
pub struct DecodeRun {
    pub ids: Vec<u32>,
    pub decode_seconds: f64,
    /// Guessed and kept tokens during this run (the engine's counters before and after).
    pub guessed: u64,
    pub kept: u64,
}

impl DecodeRun {
    /// Tokens per second after the first.
    pub fn decode_tps(&self) -> f64 {
        self.ids.len().saturating_sub(1) as f64 / self.decode_seconds.max(1e-9)
    }
}

/// Generates `max_tokens` greedily for a chat alone on the engine (nothing else running).
/// Chats generated together (greedy, `max_tokens` each past end-of-sequence), with the
/// attention export `attention` or without: the tokens generated, the wall-clock seconds from
/// submission to the last finish, and each chat's token ids.
pub fn decode_together(
    engine: &Engine,
    chats: &[Vec<crate::ChatMessage>],
    max_tokens: usize,
    attention: Option<&crate::AttentionRequest>,
) -> Result<(usize, f64, Vec<Vec<u32>>), EngineError> {
    let began = std::time::Instant::now();
    let mut streams = Vec::with_capacity(chats.len());
    for chat in chats {
        let mut request = GenerateRequest::new(Prompt::Chat(chat.clone()), max_tokens);
        request.sampling = SamplingParams::greedy();
        request.ignore_eos = true;
        request.attention = attention.cloned();
        streams.push(engine.generate(request)?);
    }
    let mut all = Vec::with_capacity(chats.len());
    for stream in streams {
        let mut ids = Vec::with_capacity(max_tokens);
        for event in stream {
            match event {
                Event::Token(t) => ids.push(t.id),
                Event::Finished(_) => break,
                Event::Failed(e) => return Err(EngineError::Failed(e)),
                Event::Shed(_) => return Err(EngineError::Failed("shed".into())),
            }
        }
        all.push(ids);
    }
    let tokens = all.iter().map(Vec::len).sum();
    Ok((tokens, began.elapsed().as_secs_f64(), all))
}

pub fn decode_alone(
    engine: &Engine,
    messages: &[crate::ChatMessage],
    max_tokens: usize,
) -> Result<DecodeRun, EngineError> {
    let before = engine.snapshot();
    let mut request = GenerateRequest::new(Prompt::Chat(messages.to_vec()), max_tokens);
    request.sampling = SamplingParams::greedy();
    let mut ids = Vec::with_capacity(max_tokens);
    for event in engine.generate(request)? {
        match event {
            Event::Token(t) => ids.push(t.id),
            Event::Finished(done) => {
                let after = engine.snapshot();
                return Ok(DecodeRun {
                    ids,
                    decode_seconds: done.decode_seconds,
                    guessed: after.speculated_tokens - before.speculated_tokens,
                    kept: after.speculated_accepted - before.speculated_accepted,
                });
            }
            Event::Failed(e) => return Err(EngineError::Failed(e)),
            Event::Shed(_) => return Err(EngineError::Failed("shed".into())),
        }
    }
    Err(EngineError::Failed("the stream ended early".into()))
}
