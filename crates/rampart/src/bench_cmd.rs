//! `rampart bench …`: engine throughput and perplexity, measured as llama.cpp measures them.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Subcommand;
use engine::bench::{batched, median, perplexity, prefix_reuse, throughput};
use serde_json::json;

use crate::engine_args::ModelChoice;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Prefill and decode tokens/s (like llama-bench's pp and tg tests: random tokens, empty
    /// context, median of repetitions after a warm-up).
    Engine {
        #[command(flatten)]
        model: ModelChoice,
        /// Prompt tokens processed in one batch (0 skips prefill).
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        /// Tokens generated one at a time (0 skips decode).
        #[arg(long, default_value_t = 128)]
        gen_tokens: usize,
        #[arg(long, short = 'r', default_value_t = 5)]
        repetitions: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Aggregate decode tokens/s of N sequences decoding together (like llama-batched-bench:
    /// distinct random prompts prefilled together, then --gen-tokens decode steps).
    Batched {
        #[command(flatten)]
        model: ModelChoice,
        /// Prompt tokens of each sequence.
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        /// Decode steps (tokens per sequence after the first).
        #[arg(long, default_value_t = 128)]
        gen_tokens: usize,
        /// Sequence counts to measure, comma-separated.
        #[arg(long, default_value = "1,4,8,16,32", value_delimiter = ',')]
        parallel: Vec<usize>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Time to first token of a request sharing a long prefix with the request before it (run
    /// with and without --no-prefix-caching to compare).
    Prefix {
        #[command(flatten)]
        model: ModelChoice,
        /// Shared prefix tokens.
        #[arg(long, default_value_t = 1000)]
        prefix_tokens: usize,
        /// Distinct tokens after the prefix.
        #[arg(long, default_value_t = 16)]
        suffix_tokens: usize,
        #[arg(long, short = 'r', default_value_t = 5)]
        repetitions: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Perplexity of a text (llama-perplexity's method: non-overlapping chunks of --ctx tokens,
    /// the second half of each scored).
    Perplexity {
        #[command(flatten)]
        model: ModelChoice,
        /// A UTF-8 text file.
        #[arg(long, short = 'f')]
        file: PathBuf,
        /// Tokens per chunk.
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Score at most this many chunks (0: all).
        #[arg(long, default_value_t = 0)]
        chunks: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: BenchCommand) -> Result<ExitCode> {
    match command {
        BenchCommand::Engine {
            model,
            prompt_tokens,
            gen_tokens,
            repetitions,
            json,
        } => {
            let engine = model.load(Some(prompt_tokens.max(gen_tokens).max(1)))?;
            let report = throughput(&engine, prompt_tokens, gen_tokens, repetitions.max(1))?;
            let (pp, tg) = (median(&report.prefill_tps), median(&report.decode_tps));
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "model": model.model,
                        "backend": engine.backend().describe(),
                        "prompt_tokens": prompt_tokens,
                        "gen_tokens": gen_tokens,
                        "prefill_tokens_per_second": pp,
                        "decode_tokens_per_second": tg,
                        "prefill_runs": report.prefill_tps,
                        "decode_runs": report.decode_tps,
                    }))?
                );
            } else {
                println!("model    {}", model.model);
                println!("backend  {}", engine.backend().describe());
                if prompt_tokens > 0 {
                    println!(
                        "pp{prompt_tokens:<5}  {pp:8.1} tok/s  (median of {})",
                        report.prefill_tps.len()
                    );
                }
                if gen_tokens > 0 {
                    println!(
                        "tg{gen_tokens:<5}  {tg:8.1} tok/s  (median of {})",
                        report.decode_tps.len()
                    );
                }
            }
        }
        BenchCommand::Batched {
            mut model,
            prompt_tokens,
            gen_tokens,
            parallel,
            json,
        } => {
            let most = parallel.iter().copied().max().unwrap_or(1).max(1);
            // Every prompt prefills in one step, as llama-batched-bench's batch does.
            model.kv.max_num_seqs = model.kv.max_num_seqs.max(most);
            model.kv.max_num_batched_tokens = model
                .kv
                .max_num_batched_tokens
                .max(most * prompt_tokens.max(1));
            let engine = model.load(Some(prompt_tokens + gen_tokens + 1))?;
            batched(&engine, prompt_tokens, gen_tokens.min(4), 1, 0)?; // warm-up
            let mut rows = Vec::new();
            if !json {
                println!("model    {}", model.model);
                println!("backend  {}", engine.backend().describe());
                let capacity = engine.kv_capacity();
                println!(
                    "kv       {} blocks × {} tokens, {}, {:.0} MiB",
                    capacity.blocks,
                    capacity.layout.block_tokens,
                    capacity.layout.dtype,
                    capacity.bytes() as f64 / (1u64 << 20) as f64
                );
                println!(
                    "{:>4} {:>6} {:>6} {:>9} {:>10} {:>9} {:>10} {:>8} {:>8}",
                    "N", "PP", "TG", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "waste", "preempt"
                );
            }
            for (i, &n) in parallel.iter().enumerate() {
                let r = batched(&engine, prompt_tokens, gen_tokens, n.max(1), i as u64 + 1)?;
                if !json {
                    println!(
                        "{:>4} {:>6} {:>6} {:>9.3} {:>10.1} {:>9.3} {:>10.1} {:>7.1}% {:>8}",
                        r.parallel,
                        r.prompt_tokens,
                        r.gen_tokens,
                        r.prefill_seconds,
                        r.prefill_tps,
                        r.decode_seconds,
                        r.decode_tps,
                        100.0 * r.kv_waste,
                        r.preemptions
                    );
                }
                rows.push(json!({
                    "parallel": r.parallel,
                    "prompt_tokens": r.prompt_tokens,
                    "gen_tokens": r.gen_tokens,
                    "prefill_seconds": r.prefill_seconds,
                    "prefill_tokens_per_second": r.prefill_tps,
                    "decode_seconds": r.decode_seconds,
                    "decode_tokens_per_second": r.decode_tps,
                    "kv_waste": r.kv_waste,
                    "preemptions": r.preemptions,
                }));
            }
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "model": model.model,
                        "backend": engine.backend().describe(),
                        "kv_cache_dtype": engine.kv_capacity().layout.dtype.name(),
                        "runs": rows,
                    }))?
                );
            }
        }
        BenchCommand::Prefix {
            model,
            prefix_tokens,
            suffix_tokens,
            repetitions,
            json,
        } => {
            let engine = model.load(Some(prefix_tokens + suffix_tokens.max(1) + 1))?;
            let r = prefix_reuse(&engine, prefix_tokens, suffix_tokens, repetitions.max(1))?;
            let ttft = median(&r.ttft_seconds);
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "model": model.model,
                        "prefix_caching": !model.kv.no_prefix_caching,
                        "prefix_tokens": prefix_tokens,
                        "suffix_tokens": suffix_tokens,
                        "ttft_seconds": ttft,
                        "ttft_runs": r.ttft_seconds,
                        "cached_tokens": r.cached_tokens,
                    }))?
                );
            } else {
                println!(
                    "prefix caching {}: time to first token {:.1} ms (median of {}; {} of {} prompt tokens cached)",
                    if model.kv.no_prefix_caching { "off" } else { "on" },
                    ttft * 1e3,
                    r.ttft_seconds.len(),
                    r.cached_tokens.first().copied().unwrap_or(0),
                    prefix_tokens + suffix_tokens.max(1)
                );
            }
        }
        BenchCommand::Perplexity {
            model,
            file,
            ctx,
            chunks,
            json,
        } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            let engine = model.load(Some(ctx))?;
            let r = perplexity(&engine, &text, ctx, chunks)?;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "model": model.model,
                        "file": file,
                        "perplexity": r.perplexity,
                        "chunks": r.chunks,
                        "context": r.context,
                        "tokens_scored": r.tokens_scored,
                        "seconds": r.seconds,
                    }))?
                );
            } else {
                println!(
                    "perplexity {:.4} over {} chunks of {} tokens ({} tokens scored, {:.1} s)",
                    r.perplexity, r.chunks, r.context, r.tokens_scored, r.seconds
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
