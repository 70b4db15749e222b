//! Measurements: engine throughput (as `llama-bench` measures it) and perplexity (as
//! `llama-perplexity` computes it), so numbers compare one to one with llama.cpp.

use std::time::Instant;

use crate::error::EngineError;
use crate::generate::Engine;
use crate::model::LogitRows;

/// Prefill and decode speed.
#[derive(Debug, Clone, PartialEq)]
pub struct ThroughputReport {
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    /// Prompt tokens per second of each repetition.
    pub prefill_tps: Vec<f64>,
    /// Generated tokens per second of each repetition.
    pub decode_tps: Vec<f64>,
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
    };
    engine.with_session(|model, backend, cache, state| -> Result<(), EngineError> {
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
