//! `rampart bench …`: engine throughput and perplexity, measured as llama.cpp measures them.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::Subcommand;
use engine::bench::{median, perplexity, throughput};
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
