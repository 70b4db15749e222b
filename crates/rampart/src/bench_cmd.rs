//! `rampart bench …`: engine throughput and perplexity, measured as llama.cpp measures them, and
//! serving load against any OpenAI-compatible server, measured as vLLM's `benchmark_serving.py`
//! measures it.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::builder::RangedU64ValueParser;
use clap::Subcommand;
use engine::bench::{batched, median, perplexity, prefix_reuse, throughput};
use loadgen::report::{TABLE_HEADER, USER_TABLE_HEADER};
use loadgen::{Arrivals, Benchmark, BenchmarkConfig, Endpoint, WorkloadConfig};
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
        /// Skip measuring the read bandwidth (by default measured after the run on the same
        /// threads, and decode reported as a fraction of it).
        #[arg(long)]
        no_bandwidth: bool,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Read bandwidth from main memory on the engine's threads (a STREAM-like read of a buffer
    /// far beyond the caches, each thread a contiguous share): the roofline decode runs against.
    Bandwidth {
        /// Compute threads (default: physical cores).
        #[arg(long, short = 't')]
        threads: Option<usize>,
        /// Buffer size in MiB.
        #[arg(long, default_value_t = 1024)]
        mib: usize,
        /// Timed passes (the best is reported, as STREAM does).
        #[arg(long, short = 'r', default_value_t = 10)]
        repetitions: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Writes a GGUF with a published model's shapes, tensor names and Q4_K_M types and random
    /// weights, for speed runs (speed does not depend on the weights' values).
    SyntheticModel {
        /// `qwen2-1.5b` (28 layers, hidden 1,536, 12/2 heads, FFN 8,960, vocabulary 151,936) or
        /// `qwen2-0.5b`.
        #[arg(long, default_value = "qwen2-1.5b")]
        shape: String,
        /// The file to write.
        #[arg(long, short = 'o')]
        out: PathBuf,
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Prompt lookup (speculative decoding without a draft model) on and off, alternated:
    /// decode tokens/s of one greedy chat at a time on answers that copy from their prompt
    /// (repeat a text, edit code, quote) and on plain chat, whether the outputs are identical,
    /// and how many guesses were kept.
    Lookup {
        #[command(flatten)]
        model: ModelChoice,
        /// Most tokens guessed per step with prompt lookup on.
        #[arg(long, default_value_t = 8)]
        guess: usize,
        /// Tokens generated per chat.
        #[arg(long, default_value_t = 200)]
        max_tokens: usize,
        #[arg(long, short = 'r', default_value_t = 3)]
        rounds: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Attention export on and off, alternated: tokens/s of N greedy chats generated together
    /// (submission to last token) with every token's export (the last --layers layers, every
    /// head, --top-k keys) and without, and whether the outputs are identical.
    Explain {
        #[command(flatten)]
        model: ModelChoice,
        /// Chats generated together, one run per value.
        #[arg(long, value_delimiter = ',', default_value = "1,4")]
        sequences: Vec<usize>,
        #[arg(long, default_value_t = 2)]
        layers: usize,
        #[arg(long, default_value_t = 8)]
        top_k: usize,
        /// Tokens generated per chat.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        #[arg(long, short = 'r', default_value_t = 4)]
        rounds: usize,
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
    /// Decode tokens/s of the same chat prompts with and without a JSON-schema constraint
    /// (greedy; rounds alternate the two modes), mask time per token, and the schema's
    /// first-request compile time.
    Structured {
        #[command(flatten)]
        model: ModelChoice,
        /// A JSON schema file [default: the ticket-classification schema].
        #[arg(long)]
        schema: Option<PathBuf>,
        /// Most tokens per answer.
        #[arg(long, default_value_t = 128)]
        max_tokens: usize,
        /// Requests in flight at once, comma-separated (1 measures one sequence's decode rate).
        #[arg(long, default_value = "1,8", value_delimiter = ',')]
        parallel: Vec<usize>,
        /// Rounds of each mode (medians are reported).
        #[arg(long, short = 'r', default_value_t = 3)]
        rounds: usize,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Latency and throughput of a tensor model (NAME[@VERSION] with declared pre-processing)
    /// on one image: the raw backend call, the model behind its dynamic batcher, and, with
    /// --url, a running server over HTTP (KServe v2 binary tensors); prints the server's
    /// overhead over the raw call.
    Tensor {
        /// NAME[@VERSION] in the repository.
        #[arg(long, short = 'm')]
        model: String,
        #[arg(
            long,
            env = "RAMPART_REPO",
            default_value = "models",
            value_name = "DIR"
        )]
        repo: PathBuf,
        /// The image each request sends (JPEG or PNG).
        #[arg(long)]
        image: PathBuf,
        /// `auto`, `tract` or `onnxruntime`.
        #[arg(long, default_value = "tract")]
        backend: String,
        /// Seconds per level.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Concurrent callers of the batcher and the server.
        #[arg(long, default_value_t = 16)]
        concurrency: usize,
        /// A running server's base URL (http://127.0.0.1:8080).
        #[arg(long)]
        url: Option<String>,
        /// The model's name on that server (default: the model's name).
        #[arg(long)]
        served_name: Option<String>,
        #[arg(long, env = "RAMPART_API_KEY")]
        api_key: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Sentences/s of a sentence-embedding model (a sentence-transformers folder or
    /// NAME[@VERSION]) over generated sentences of 8–40 words (those of the sentence-transformers
    /// peer benchmark), in requests of --batch sentences (median of --rounds).
    Embed {
        /// A sentence-transformers folder or NAME[@VERSION] in the repository.
        #[arg(long, short = 'm')]
        model: String,
        #[arg(
            long,
            env = "RAMPART_REPO",
            default_value = "models",
            value_name = "DIR"
        )]
        repo: PathBuf,
        #[arg(long, short = 't')]
        threads: Option<usize>,
        /// Sentences per embed call.
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Sentences per round.
        #[arg(long, default_value_t = 256)]
        sentences: usize,
        #[arg(long, short = 'r', default_value_t = 3)]
        rounds: usize,
        #[arg(long)]
        json: bool,
    },
    /// Load a running OpenAI-compatible server (Rampart, llama-server, vLLM) with concurrent
    /// streaming requests; report throughput and TTFT, TPOT, ITL and end-to-end latency per
    /// concurrency level (like vLLM's benchmark_serving.py). Open-loop arrivals (Poisson,
    /// bursts) and the official OpenAI clients' retries show a shedding server as its users
    /// see it: retries, give-ups and the time to first token from a request's first attempt.
    Serve(ServeArgs),
    /// Attack a running Rampart as a holder of an ordinary key (or of none) would: floods of
    /// unauthenticated requests, lying and oversized tensor bodies, guard-cost bombs, feedback
    /// replays, name traversal on every route, slow and idle connections, tokenize floods —
    /// while an honest client keeps asking. Judges the honest client's p99 (against the idle
    /// server's), its 5xx, the server's RSS, the audit log and readiness; exit 1 when any
    /// promise broke (docs/security.md).
    Abuse(AbuseArgs),
}

#[derive(Debug, clap::Args)]
pub struct AbuseArgs {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The language model the honest client and the guard bombs ask.
    #[arg(long)]
    model: String,
    /// The honest client's key (scope infer).
    #[arg(long, env = "RAMPART_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The attacker's ordinary key [default: the honest client's].
    #[arg(long)]
    attacker_key: Option<String>,
    /// A key with the admin scope: name traversal on the admin routes.
    #[arg(long)]
    admin_key: Option<String>,
    /// A key with the audit scope: every honest answer looked up in the audit log afterwards
    /// [default: --admin-key].
    #[arg(long)]
    audit_key: Option<String>,
    /// A tensor model for the lying and oversized KServe bodies (none: skipped).
    #[arg(long)]
    tensor_model: Option<String>,
    /// Which attacks (comma-separated): unauthenticated, tensor, guard, feedback, traversal,
    /// slowloris, tokenize [default: all].
    #[arg(long, value_delimiter = ',')]
    attacks: Vec<String>,
    /// Workers per flooding attack.
    #[arg(long, default_value_t = 4, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    concurrency: usize,
    /// Seconds the attacks run.
    #[arg(long, default_value_t = 30)]
    duration_s: u64,
    /// Honest requests on the idle server first (the p99 reference).
    #[arg(long, default_value_t = 10)]
    baseline_requests: usize,
    /// Milliseconds between the honest client's requests.
    #[arg(long, default_value_t = 500)]
    honest_interval_ms: u64,
    /// The server's process id, for its resident memory.
    #[arg(long)]
    server_pid: Option<u32>,
    /// The most resident memory the server may reach (MiB), with --server-pid.
    #[arg(long)]
    rss_limit_mb: Option<u64>,
    /// The honest p99 under attack may be at most this times the idle one.
    #[arg(long, default_value_t = 2.0)]
    max_latency_ratio: f64,
    /// Seconds within which the server must close a slow or idle connection.
    #[arg(long, default_value_t = 60)]
    slow_close_limit_s: u64,
    /// Niceness of the attack threads (0: as the process). The honest client keeps the
    /// process's priority on a thread of its own, so that on one machine the attack client's
    /// work does not count as the server's delay.
    #[arg(long, default_value_t = 10)]
    attacker_nice: i32,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum EndpointArg {
    /// POST /v1/completions with the prompt as is.
    Completions,
    /// POST /v1/chat/completions with the prompt as one user message.
    Chat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ArrivalsArg {
    /// A closed loop: --concurrency clients, each sending its next request when its last one
    /// finished.
    Closed,
    /// An open loop: --rate requests per second on average, exponential gaps between them.
    Poisson,
    /// An open loop: --burst requests at once at the start and every --every-s seconds, over
    /// Poisson arrivals at --rate (default 0: bursts only).
    Burst,
}

#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The server's base URL (with or without /v1).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Model id sent in requests [default: the first id listed by GET /v1/models].
    #[arg(long)]
    model: Option<String>,
    /// Sent as `Authorization: Bearer <key>`.
    #[arg(long, env = "RAMPART_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Which OpenAI endpoint to load.
    #[arg(long, value_enum, default_value_t = EndpointArg::Completions)]
    endpoint: EndpointArg,
    /// Requests in flight at once in the closed loop [default: 1]; a comma-separated list
    /// (1,4,16) runs one level after another.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = RangedU64ValueParser::<usize>::new().range(1..)
    )]
    concurrency: Vec<usize>,
    /// How requests arrive: a closed loop of --concurrency clients, or an open loop whose
    /// arrivals do not wait for the server (each a new request in flight beside the others).
    #[arg(long, value_enum, default_value_t = ArrivalsArg::Closed)]
    arrivals: ArrivalsArg,
    /// Open loop: mean arrivals per second (poisson: required; burst: the Poisson background,
    /// default 0); a comma-separated list (2,4,8) runs one level after another.
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// --arrivals burst: requests that arrive at once.
    #[arg(long, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    burst: Option<usize>,
    /// --arrivals burst: seconds between bursts (the first comes at the start).
    #[arg(long, visible_alias = "every")]
    every_s: Option<f64>,
    /// Open loop: arrivals for this many seconds per level instead of --requests of them; the
    /// requests still outstanding at the end are waited for.
    #[arg(long, visible_alias = "duration")]
    duration_s: Option<f64>,
    /// Open loop: the most requests outstanding at once (streaming or waiting to retry); an
    /// arrival beyond it is dropped, never sent, and counted.
    #[arg(long, default_value_t = 1024, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    max_outstanding: usize,
    /// Retries of a request refused with 429, 408, 409 or 5xx, not connected or not answered in
    /// time, waiting as the official OpenAI clients wait (retry-after-ms, else Retry-After, if
    /// at most 60 s; else 0.5 s doubling to 8 s, less up to 25% jitter) and sending
    /// x-stainless-retry-count. The official clients retry 2 times by default; 0 sends each
    /// request once.
    #[arg(long, default_value_t = 0)]
    max_retries: u32,
    /// Send an X-Request-Id with each request, the same on all its attempts.
    #[arg(long)]
    request_id: bool,
    /// Requests measured at each concurrency level; in an open loop without --duration-s, the
    /// arrivals of each level.
    #[arg(long, default_value_t = 64, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    requests: usize,
    /// Mean prompt length in tokens — approximate: prompts are common English words, about one
    /// token each.
    #[arg(long, default_value_t = 256, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    prompt_tokens: usize,
    /// Prompt lengths are uniform in mean × (1 ± spread).
    #[arg(long, default_value_t = 0.0)]
    prompt_spread: f64,
    /// Mean max_tokens of a request (sent with ignore_eos; servers that stop early are counted
    /// as they are).
    #[arg(long, default_value_t = 128, value_parser = RangedU64ValueParser::<usize>::new().range(1..))]
    output_tokens: usize,
    /// Output lengths are uniform in mean × (1 ± spread).
    #[arg(long, default_value_t = 0.0)]
    output_spread: f64,
    /// Seed of the prompts and lengths (the same seed sends the same requests). A server that
    /// caches prompts finds them again in a second run with the same seed: change the seed or
    /// restart the server to measure cold prefill.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sampling temperature sent with each request.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    /// Unmeasured requests sent one at a time before the first level.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Limit on each whole request (each attempt of it, with --max-retries), in seconds.
    #[arg(long, default_value_t = 600.0)]
    timeout_s: f64,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

pub fn run(command: BenchCommand) -> Result<ExitCode> {
    match command {
        BenchCommand::Serve(args) => return serve(args),
        BenchCommand::Abuse(args) => return abuse(args),
        BenchCommand::Engine {
            model,
            prompt_tokens,
            gen_tokens,
            repetitions,
            no_bandwidth,
            json,
        } => {
            let engine = model.load(Some(prompt_tokens.max(gen_tokens).max(1)))?;
            let report = throughput(&engine, prompt_tokens, gen_tokens, repetitions.max(1))?;
            let (pp, tg) = (median(&report.prefill_tps), median(&report.decode_tps));
            let decode_bytes_per_second = tg * report.decode_bytes_per_token as f64;
            let bandwidth = (!no_bandwidth && gen_tokens > 0).then(|| {
                let threads = model
                    .threads
                    .unwrap_or_else(kernels::backend::physical_cores);
                let pool = kernels::ThreadPool::shared(threads);
                kernels::memory_bandwidth::read_bandwidth(
                    &pool,
                    kernels::Isa::detect(),
                    kernels::memory_bandwidth::DEFAULT_BYTES,
                    5,
                )
                .best_bytes_per_second()
            });
            let fraction = bandwidth.map(|b| decode_bytes_per_second / b);
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
                        "decode_bytes_per_token": report.decode_bytes_per_token,
                        "decode_bytes_per_second": decode_bytes_per_second,
                        "read_bandwidth_bytes_per_second": bandwidth,
                        "decode_bandwidth_fraction": fraction,
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
                    println!(
                        "decode   {:.3} GB per token, {:.1} GB/s{}",
                        report.decode_bytes_per_token as f64 / 1e9,
                        decode_bytes_per_second / 1e9,
                        match (bandwidth, fraction) {
                            (Some(b), Some(f)) => format!(
                                ", {:.0}% of the measured read bandwidth ({:.1} GB/s)",
                                f * 100.0,
                                b / 1e9
                            ),
                            _ => String::new(),
                        }
                    );
                }
            }
        }
        BenchCommand::Bandwidth {
            threads,
            mib,
            repetitions,
            json,
        } => {
            let threads = threads.unwrap_or_else(kernels::backend::physical_cores);
            let pool = kernels::ThreadPool::shared(threads);
            let isa = kernels::Isa::detect();
            let report = kernels::memory_bandwidth::read_bandwidth(
                &pool,
                isa,
                mib << 20,
                repetitions.max(1),
            );
            let passes = &report.passes_bytes_per_second;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "threads": threads,
                        "isa": isa.name(),
                        "bytes": report.bytes,
                        "read_bytes_per_second": report.best_bytes_per_second(),
                        "median_bytes_per_second": median(passes),
                        "passes_bytes_per_second": passes,
                    }))?
                );
            } else {
                println!(
                    "read     {:.1} GB/s best, {:.1} GB/s median  ({} MiB, {} passes, {threads} threads, {})",
                    report.best_bytes_per_second() / 1e9,
                    median(passes) / 1e9,
                    report.bytes >> 20,
                    passes.len(),
                    isa.name()
                );
            }
        }
        BenchCommand::SyntheticModel { shape, out, seed } => {
            let Some(shape) = engine::synthetic::SyntheticShape::named(&shape) else {
                bail!("unknown shape {shape:?} (qwen2-1.5b, qwen2-0.5b)");
            };
            shape
                .write_q4_k_m(&out, seed)
                .with_context(|| format!("writing {}", out.display()))?;
            let bytes = std::fs::metadata(&out)?.len();
            println!(
                "wrote {} ({}, Q4_K_M, {:.2} GB)",
                out.display(),
                shape.name,
                bytes as f64 / 1e9
            );
        }
        BenchCommand::Lookup {
            mut model,
            guess,
            max_tokens,
            rounds,
            json,
        } => return lookup(&mut model, guess, max_tokens, rounds, json),
        BenchCommand::Explain {
            mut model,
            sequences,
            layers,
            top_k,
            max_tokens,
            rounds,
            json,
        } => {
            return explain(
                &mut model, &sequences, layers, top_k, max_tokens, rounds, json,
            )
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
        BenchCommand::Structured {
            model,
            schema,
            max_tokens,
            parallel,
            rounds,
            json,
        } => structured(model, schema, max_tokens, &parallel, rounds.max(1), json)?,
        BenchCommand::Tensor {
            model,
            repo,
            image,
            backend,
            seconds,
            concurrency,
            url,
            served_name,
            api_key,
            json,
        } => crate::tensor_bench::run(crate::tensor_bench::TensorBench {
            model,
            repo,
            image,
            backend: serde_json::from_value(serde_json::Value::String(backend.clone())).map_err(
                |_| anyhow::anyhow!("--backend {backend:?}: expected auto, tract or onnxruntime"),
            )?,
            seconds,
            concurrency,
            url,
            served_name,
            api_key,
            json,
        })?,
        BenchCommand::Embed {
            model,
            repo,
            threads,
            batch,
            sentences,
            rounds,
            json,
        } => embed_bench(&model, &repo, threads, batch, sentences, rounds, json)?,
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

fn abuse(args: AbuseArgs) -> Result<ExitCode> {
    use loadgen::abuse::{self, AbuseConfig, Attack};
    let attacks = if args.attacks.is_empty() {
        Attack::ALL.to_vec()
    } else {
        args.attacks
            .iter()
            .map(|a| {
                Attack::parse(a.trim()).with_context(|| {
                    format!(
                        "--attacks: {a:?} is not one of {}",
                        Attack::ALL.map(Attack::as_str).join(", ")
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?
    };
    let report = abuse::run(AbuseConfig {
        base_url: args
            .url
            .trim_end_matches('/')
            .trim_end_matches("/v1")
            .to_string(),
        key: args.api_key,
        attacker_key: args.attacker_key,
        admin_key: args.admin_key,
        audit_key: args.audit_key,
        model: args.model,
        tensor_model: args.tensor_model,
        attacks,
        concurrency: args.concurrency,
        duration: Duration::from_secs(args.duration_s.max(1)),
        baseline_requests: args.baseline_requests.max(1),
        honest_interval: Duration::from_millis(args.honest_interval_ms),
        server_pid: args.server_pid,
        rss_limit_bytes: args.rss_limit_mb.map(|m| m << 20),
        max_latency_ratio: args.max_latency_ratio,
        slow_close_limit: Duration::from_secs(args.slow_close_limit_s.max(1)),
        attacker_nice: args.attacker_nice.clamp(0, 19),
        ..AbuseConfig::default()
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let ms = |s: Option<loadgen::Summary>| {
            s.map_or_else(
                || "-".to_string(),
                |s| format!("p50 {:.0} ms, p99 {:.0} ms", s.p50 * 1e3, s.p99 * 1e3),
            )
        };
        println!("abuse     {} for {:.0} s", report.url, report.duration_s);
        println!("honest    idle: {}", ms(report.idle_latency));
        println!("          under attack: {}", ms(report.attacked_latency));
        for (attack, r) in &report.attacks {
            println!(
                "{:<9} {} requests {:?}{}",
                attack.as_str(),
                r.requests,
                r.statuses,
                if r.notes.is_empty() {
                    String::new()
                } else {
                    format!(" {:?}", r.notes)
                }
            );
        }
        println!();
        for c in &report.checks {
            println!(
                "{} {:<24} {}",
                if c.passed { "pass" } else { "FAIL" },
                c.name,
                c.detail
            );
        }
    }
    Ok(if report.passed() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// The levels `rampart bench serve` runs, from --arrivals and the flags that shape it.
fn serve_levels(args: &ServeArgs) -> Result<Vec<Arrivals>> {
    let open_loop = args.arrivals != ArrivalsArg::Closed;
    if open_loop && !args.concurrency.is_empty() {
        bail!(
            "--concurrency is for the closed loop; an open loop's requests in flight are \
             bounded by --max-outstanding"
        );
    }
    if !open_loop && (!args.rate.is_empty() || args.duration_s.is_some()) {
        bail!("--rate and --duration-s are for an open loop (--arrivals poisson or burst)");
    }
    if args.arrivals != ArrivalsArg::Burst && (args.burst.is_some() || args.every_s.is_some()) {
        bail!("--burst and --every-s are for --arrivals burst");
    }
    let levels: Vec<Arrivals> = match args.arrivals {
        ArrivalsArg::Closed if args.concurrency.is_empty() => {
            vec![Arrivals::Closed { concurrency: 1 }]
        }
        ArrivalsArg::Closed => args
            .concurrency
            .iter()
            .map(|&concurrency| Arrivals::Closed { concurrency })
            .collect(),
        ArrivalsArg::Poisson => {
            if args.rate.is_empty() {
                bail!("--arrivals poisson needs --rate (requests per second)");
            }
            args.rate
                .iter()
                .map(|&rate_per_s| Arrivals::Poisson { rate_per_s })
                .collect()
        }
        ArrivalsArg::Burst => {
            let size = args.burst.context("--arrivals burst needs --burst N")?;
            let every_s = args.every_s.context("--arrivals burst needs --every-s S")?;
            let rates = if args.rate.is_empty() {
                vec![0.0]
            } else {
                args.rate.clone()
            };
            rates
                .into_iter()
                .map(|rate_per_s| Arrivals::Burst {
                    size,
                    every_s,
                    rate_per_s,
                })
                .collect()
        }
    };
    for level in &levels {
        level.validate()?;
    }
    Ok(levels)
}

fn serve(args: ServeArgs) -> Result<ExitCode> {
    let request_timeout = Duration::try_from_secs_f64(args.timeout_s)
        .ok()
        .filter(|timeout| !timeout.is_zero())
        .with_context(|| format!("--timeout-s {} is not a positive duration", args.timeout_s))?;
    let levels_to_run = serve_levels(&args)?;
    let open_loop_duration = match args.duration_s {
        Some(duration_s) => Some(
            Duration::try_from_secs_f64(duration_s)
                .ok()
                .filter(|duration| !duration.is_zero())
                .with_context(|| format!("--duration-s {duration_s} is not a positive duration"))?,
        ),
        None => None,
    };
    let open_loop = args.arrivals != ArrivalsArg::Closed;
    let workload = WorkloadConfig {
        prompt_tokens: args.prompt_tokens,
        prompt_spread: args.prompt_spread,
        output_tokens: args.output_tokens,
        output_spread: args.output_spread,
        seed: args.seed,
    };
    let endpoint = match args.endpoint {
        EndpointArg::Completions => Endpoint::Completions,
        EndpointArg::Chat => Endpoint::Chat,
    };
    let mut benchmark = Benchmark::new(BenchmarkConfig {
        base_url: args.url.clone(),
        model: args.model,
        api_key: args.api_key,
        endpoint,
        workload: workload.clone(),
        temperature: args.temperature,
        requests_per_level: args.requests,
        warmup_requests: args.warmup,
        request_timeout,
        max_retries: args.max_retries,
        send_request_id: args.request_id,
        max_outstanding: args.max_outstanding,
        open_loop_duration,
    })?;

    if !args.json {
        println!(
            "model     {} at {} ({})",
            benchmark.model(),
            args.url,
            endpoint.name()
        );
        let per_level = match (open_loop, args.duration_s) {
            (false, _) => format!("{} requests per level", args.requests),
            (true, None) => format!("{} arrivals per level", args.requests),
            (true, Some(duration_s)) => format!("arrivals for {duration_s} s per level"),
        };
        println!(
            "workload  {per_level}; prompt ~{} tokens ±{:.0}% (approximate: one word ≈ one \
             token); output {} tokens ±{:.0}%; temperature {}; seed {}",
            workload.prompt_tokens,
            100.0 * workload.prompt_spread,
            workload.output_tokens,
            100.0 * workload.output_spread,
            args.temperature,
            workload.seed
        );
        if open_loop {
            println!(
                "arrivals  open loop, at most {} requests outstanding (more are dropped); conc \
                 below: the most outstanding at once",
                args.max_outstanding
            );
        }
        if args.max_retries > 0 || args.request_id {
            println!(
                "retries   up to {} per request, as the official OpenAI clients retry (429, 408, \
                 409, 5xx, connection; they default to 2){}",
                args.max_retries,
                if args.request_id {
                    "; X-Request-Id on every attempt"
                } else {
                    ""
                }
            );
        }
    }
    let warmup = benchmark.warm_up();
    if !args.json {
        if warmup.requests > 0 {
            let failures = match &warmup.first_error {
                Some(error) => format!(", {} failed (first: {error})", warmup.failed),
                None => String::new(),
            };
            println!(
                "warm-up   {} requests: {} ok{failures}",
                warmup.requests, warmup.completed
            );
        }
        println!();
        println!("{TABLE_HEADER}");
    }

    // An open loop's row is labelled with its arrivals: its first column is a measurement.
    let label = |level: &loadgen::LevelReport| {
        if open_loop {
            format!("  {}", level.arrivals)
        } else {
            String::new()
        }
    };
    let mut levels = Vec::with_capacity(levels_to_run.len());
    for arrivals in levels_to_run {
        let level = benchmark.run(arrivals)?;
        if !args.json {
            println!("{}{}", level.table_row(), label(&level));
        }
        levels.push(level);
    }
    let report = benchmark.report(warmup, levels);

    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        if open_loop || args.max_retries > 0 {
            println!();
            println!(
                "users: a request's TTFT and E2E from its first attempt (admitted: from the \
                 attempt that streamed)"
            );
            println!("{USER_TABLE_HEADER}");
            for level in &report.levels {
                println!("{}{}", level.user_table_row(), label(level));
            }
        }
        let completed: usize = report.levels.iter().map(|level| level.completed).sum();
        let input_reported: usize = report
            .levels
            .iter()
            .map(|level| level.input_tokens_from_server)
            .sum();
        let output_reported: usize = report
            .levels
            .iter()
            .map(|level| level.output_tokens_from_server)
            .sum();
        if completed > 0 {
            println!();
            println!(
                "tokens    server-reported usage for {input_reported} of {completed} prompts (the rest: \
                 word counts, approximate) and {output_reported} of {completed} outputs (the rest: \
                 stream chunks with text)"
            );
        }
        for level in report
            .levels
            .iter()
            .filter(|level| !level.errors.is_empty())
        {
            println!("\nerrors at {}:", level.arrivals);
            for error in &level.errors {
                println!("  {:>5} × {}", error.count, error.message);
            }
        }
    }
    if report.every_request_failed() {
        eprintln!("error: every request failed");
        return Ok(ExitCode::FAILURE);
    }
    Ok(ExitCode::SUCCESS)
}

fn structured(
    mut model: ModelChoice,
    schema: Option<PathBuf>,
    max_tokens: usize,
    parallel: &[usize],
    rounds: usize,
    json_out: bool,
) -> Result<()> {
    use grammar::bench::{compile_cost, run_mode, ticket_schema, TICKETS};
    let schema = match &schema {
        Some(path) => serde_json::from_str(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("{} is not JSON", path.display()))?,
        None => ticket_schema(),
    };
    let spec = grammar::GrammarSpec::JsonSchema {
        schema,
        strict: true,
    };
    let most = parallel.iter().copied().max().unwrap_or(1).max(1);
    model.kv.max_num_seqs = model.kv.max_num_seqs.max(most);
    let engine = model.load(Some(1024))?;
    let (cost, compiled) = compile_cost(&engine, &spec).map_err(anyhow::Error::msg)?;
    let prompts: Vec<String> = TICKETS.iter().map(|t| t.to_string()).collect();
    run_mode(&engine, Some(&compiled), &prompts[..2], 16, 1)?; // warm-up
    if !json_out {
        println!("model    {}", model.model);
        println!("backend  {}", engine.backend().describe());
        println!(
            "compile  setup {:.1} ms (once per model), schema {:.2} ms (first request)",
            cost.setup_seconds * 1e3,
            cost.compile_seconds * 1e3
        );
        println!(
            "{:>4} {:>12} {:>12} {:>7} {:>12} {:>12} {:>7} {:>10} {:>7}",
            "N",
            "free tok/s",
            "json tok/s",
            "ratio",
            "free thr",
            "json thr",
            "ratio",
            "mask µs",
            "valid"
        );
    }
    let mut rows = Vec::new();
    for &n in parallel {
        let n = n.max(1);
        let (mut free, mut constrained) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            free.push(run_mode(&engine, None, &prompts, max_tokens, n)?);
            constrained.push(run_mode(&engine, Some(&compiled), &prompts, max_tokens, n)?);
        }
        let metric = |runs: &[grammar::bench::ModeReport],
                      f: fn(&grammar::bench::ModeReport) -> f64| {
            median(&runs.iter().map(f).collect::<Vec<_>>())
        };
        let (free_tps, json_tps) = (
            metric(&free, |r| r.decode_tps()),
            metric(&constrained, |r| r.decode_tps()),
        );
        let (free_thr, json_thr) = (
            metric(&free, |r| r.throughput()),
            metric(&constrained, |r| r.throughput()),
        );
        let mask_us = metric(&constrained, |r| {
            r.mask_seconds * 1e6 / r.masks.max(1) as f64
        });
        let valid: usize = constrained.iter().map(|r| r.valid).sum();
        let total: usize = constrained.iter().map(|r| r.requests).sum();
        if !json_out {
            println!(
                "{:>4} {:>12.1} {:>12.1} {:>7.3} {:>12.1} {:>12.1} {:>7.3} {:>10.1} {:>3}/{:<3}",
                n,
                free_tps,
                json_tps,
                json_tps / free_tps,
                free_thr,
                json_thr,
                json_thr / free_thr,
                mask_us,
                valid,
                total
            );
        }
        rows.push(json!({
            "parallel": n,
            "free_decode_tokens_per_second": free_tps,
            "constrained_decode_tokens_per_second": json_tps,
            "decode_ratio": json_tps / free_tps,
            "free_throughput": free_thr,
            "constrained_throughput": json_thr,
            "throughput_ratio": json_thr / free_thr,
            "mask_microseconds_per_token": mask_us,
            "valid_outputs": valid,
            "outputs": total,
        }));
    }
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": model.model,
                "backend": engine.backend().describe(),
                "compiler_setup_seconds": cost.setup_seconds,
                "schema_compile_seconds": cost.compile_seconds,
                "runs": rows,
            }))?
        );
    }
    Ok(())
}

/// The words of [`generated_sentences`].
const SENTENCE_WORDS: &str =
    "the a an one this that some every small large quick slow bright dark \
    old new red green blue happy tired busy quiet loud warm cold cat dog man woman child teacher \
    doctor farmer city river mountain road house garden kitchen market school office train car \
    bicycle boat letter book song movie picture window door table chair bread apple coffee water \
    music story game question answer idea plan report model server request batch queue result \
    error time day night morning evening week year walks runs reads writes sees finds takes gives \
    makes builds opens closes carries eats drinks likes wants needs sends brings watches plays \
    sings helps and but or because while after before near under over with without into from to \
    in on at across behind through very often never always quickly slowly carefully again \
    together alone today tomorrow";

/// `count` deterministic sentences of 8–40 words, the same ones the sentence-transformers peer
/// benchmark encodes (its `sentgen.py`, mirrored exactly): one xorshift64* stream seeded with
/// 0x9E3779B97F4A7C15, `below(n) = (next >> 33) % n`; per sentence `8 + below(33)` words drawn
/// with `below(words)`, the first capitalized, joined by spaces, then a full stop.
fn generated_sentences(count: usize) -> Vec<String> {
    let words: Vec<&str> = SENTENCE_WORDS.split_whitespace().collect();
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut below = |n: usize| -> usize {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        ((state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % n as u64) as usize
    };
    (0..count)
        .map(|_| {
            let n = 8 + below(33);
            let mut sentence = String::new();
            for k in 0..n {
                let word = words[below(words.len())];
                if k == 0 {
                    let mut chars = word.chars();
                    if let Some(first) = chars.next() {
                        sentence.extend(first.to_uppercase());
                        sentence.push_str(chars.as_str());
                    }
                } else {
                    sentence.push(' ');
                    sentence.push_str(word);
                }
            }
            sentence.push('.');
            sentence
        })
        .collect()
}

fn embed_bench(
    model: &str,
    repo_dir: &std::path::Path,
    threads: Option<usize>,
    batch: usize,
    sentences: usize,
    rounds: usize,
    json_out: bool,
) -> Result<()> {
    let path = PathBuf::from(model);
    let dir = if path.is_dir() {
        path
    } else {
        let reference: repo::ModelRef = model.parse()?;
        repo::Repository::open(repo_dir)
            .load(&reference, &repo::NoProgress)
            .with_context(|| format!("loading {reference}"))?
            .version
            .dir
    };
    let mut options = engine::bert::EmbedderOptions::default();
    if let Some(t) = threads {
        options.threads = t.max(1);
    }
    let embedder = engine::Embedder::load_with(&dir, &options)
        .with_context(|| format!("loading {}", dir.display()))?;
    let texts = generated_sentences(sentences.max(1));
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    embedder.embed(&refs[..batch.min(refs.len()).max(1)])?; // warm-up
    let mut rates = Vec::new();
    for _ in 0..rounds.max(1) {
        let started = std::time::Instant::now();
        for chunk in refs.chunks(batch.max(1)) {
            embedder.embed(chunk)?;
        }
        rates.push(refs.len() as f64 / started.elapsed().as_secs_f64());
    }
    let rate = median(&rates);
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": model,
                "batch": batch,
                "sentences": refs.len(),
                "sentences_per_second": rate,
                "runs": rates,
            }))?
        );
    } else {
        println!("model    {model} ({} dimensions)", embedder.dimensions());
        println!(
            "embed    {rate:.1} sentences/s  (batch {batch}, {} sentences of 8-40 words as sentgen.py, median of {})",
            refs.len(),
            rates.len()
        );
    }
    Ok(())
}

/// The prompt-lookup benchmark's chats: answers that copy from their prompt, and plain chat.
fn lookup_workloads() -> [(&'static str, Vec<&'static str>); 2] {
    [
        (
            "copy",
            vec![
                "Repeat the following paragraph exactly, word for word:\n\nThe committee met on \
                 Tuesday to review the budget for the coming year. After a long discussion, the \
                 members agreed to increase the funding for public libraries by ten percent, to \
                 keep the parks open until nine in the evening during the summer, and to repair \
                 the bridge on River Street before the winter. The mayor thanked everyone for \
                 their work and said that the new budget would be published on the city website \
                 next week.",
                "Add a docstring to this Python function and return the whole function:\n\n\
                 def moving_average(values, window):\n    if window <= 0:\n        raise \
                 ValueError(\"window must be positive\")\n    result = []\n    total = 0.0\n    \
                 for i, value in enumerate(values):\n        total += value\n        if i >= \
                 window:\n            total -= values[i - window]\n        if i >= window - 1:\n\
                 \x20           result.append(total / window)\n    return result\n",
                "Here is a list of items: apples, bananas, cherries, dates, elderberries, figs, \
                 grapes, honeydew melons, kiwis, lemons, mangoes, nectarines, oranges, papayas. \
                 Write the same list again, one item per line, each line starting with a dash.",
            ],
        ),
        (
            "chat",
            vec![
                "Tell me about the history of the bicycle.",
                "Write a short poem about autumn leaves.",
                "What are three tips for sleeping better?",
            ],
        ),
    ]
}

/// `rampart bench explain`: see [`BenchCommand::Explain`].
fn explain(
    model: &mut ModelChoice,
    sequences: &[usize],
    layers: usize,
    top_k: usize,
    max_tokens: usize,
    rounds: usize,
    json: bool,
) -> Result<ExitCode> {
    use engine::bench::decode_together;
    use engine::ChatMessage;
    model.kv.speculative_tokens = 0;
    let engine = model.load(Some(2048))?;
    let config = engine.config().clone();
    let mut asked = engine::AttentionRequest {
        layers: (config.block_count.saturating_sub(layers)..config.block_count).collect(),
        heads: (0..config.heads).collect(),
        top_k,
        positions: None,
    };
    asked
        .normalize(&config, max_tokens, usize::MAX)
        .map_err(anyhow::Error::msg)?;
    let prompts: Vec<&str> = lookup_workloads()
        .into_iter()
        .flat_map(|(_, p)| p)
        .collect();
    let warm = vec![vec![ChatMessage::new("user", "Hello!")]];
    decode_together(&engine, &warm, 8, None)?;
    decode_together(&engine, &warm, 8, Some(&asked))?;
    if !json {
        println!("model    {}", model.model);
        println!("backend  {}", engine.backend().describe());
        println!(
            "export   layers {:?}, {} heads, top {top_k}, every token",
            asked.layers,
            asked.heads.len()
        );
        println!(
            "{:>4} {:>5} {:>10} {:>10} {:>7} {:>10}",
            "seqs", "round", "off tok/s", "on tok/s", "ratio", "identical"
        );
    }
    let mut results = Vec::new();
    for &n in sequences {
        let chats: Vec<Vec<ChatMessage>> = (0..n)
            .map(|i| vec![ChatMessage::new("user", prompts[i % prompts.len()])])
            .collect();
        // An untimed round of each first: the KV pool's pages and the first batches' buffers
        // are touched once (the first timed round ran 1.5x slower without it).
        decode_together(&engine, &chats, max_tokens, None)?;
        decode_together(&engine, &chats, max_tokens, Some(&asked))?;
        let (mut off, mut on) = ((0usize, 0f64), (0usize, 0f64));
        let mut identical = true;
        for round in 0..rounds {
            // Alternated: off first in even rounds, on first in odd ones.
            let (a, b) = if round % 2 == 0 {
                let a = decode_together(&engine, &chats, max_tokens, None)?;
                (
                    a,
                    decode_together(&engine, &chats, max_tokens, Some(&asked))?,
                )
            } else {
                let b = decode_together(&engine, &chats, max_tokens, Some(&asked))?;
                (decode_together(&engine, &chats, max_tokens, None)?, b)
            };
            identical &= a.2 == b.2;
            if !json {
                println!(
                    "{:>4} {:>5} {:>10.1} {:>10.1} {:>7.3} {:>10}",
                    n,
                    round + 1,
                    a.0 as f64 / a.1,
                    b.0 as f64 / b.1,
                    (b.0 as f64 / b.1) / (a.0 as f64 / a.1),
                    a.2 == b.2
                );
            }
            off = (off.0 + a.0, off.1 + a.1);
            on = (on.0 + b.0, on.1 + b.1);
        }
        let (off_tps, on_tps) = (off.0 as f64 / off.1, on.0 as f64 / on.1);
        if !json {
            println!(
                "{:>4} {:>5} {:>10.1} {:>10.1} {:>7.3} {:>10}",
                n,
                "all",
                off_tps,
                on_tps,
                on_tps / off_tps,
                identical
            );
        }
        results.push(json!({"sequences": n, "off_tps": off_tps, "on_tps": on_tps,
                            "ratio": on_tps / off_tps, "identical": identical}));
    }
    if json {
        println!(
            "{}",
            json!({"model": model.model, "layers": asked.layers, "heads": asked.heads.len(),
                   "top_k": top_k, "max_tokens": max_tokens, "rounds": rounds,
                   "backend": engine.backend().describe(), "results": results})
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn lookup(
    model: &mut ModelChoice,
    guess: usize,
    max_tokens: usize,
    rounds: usize,
    json: bool,
) -> Result<ExitCode> {
    use engine::bench::decode_alone;
    use engine::ChatMessage;
    model.kv.speculative_tokens = 0;
    let plain = model.load(Some(2048))?;
    model.kv.speculative_tokens = guess;
    let guessing = model.load(Some(2048))?;
    let workloads = lookup_workloads();
    // Warm-up: one chat each.
    let warm = [ChatMessage::new("user", "Hello!")];
    decode_alone(&plain, &warm, 8)?;
    decode_alone(&guessing, &warm, 8)?;
    let mut results = Vec::new();
    if !json {
        println!("model    {}", model.model);
        println!("backend  {}", plain.backend().describe());
        println!(
            "guess    {guess} tokens a step, n-grams {}..{}",
            model.kv.prompt_lookup_min, model.kv.prompt_lookup_max
        );
        println!(
            "{:<6} {:>5} {:>10} {:>10} {:>7} {:>9} {:>10}",
            "kind", "round", "off tok/s", "on tok/s", "ratio", "kept", "identical"
        );
    }
    for (kind, prompts) in &workloads {
        let (mut off_total, mut on_total) = ((0usize, 0f64), (0usize, 0f64));
        let (mut guessed, mut kept, mut identical) = (0u64, 0u64, true);
        for round in 0..rounds {
            let (mut off, mut on) = ((0usize, 0f64), (0usize, 0f64));
            for prompt in prompts {
                let messages = [ChatMessage::new("user", prompt)];
                // Alternated: off first in even rounds, on first in odd ones.
                let (a, b) = if round % 2 == 0 {
                    let a = decode_alone(&plain, &messages, max_tokens)?;
                    (a, decode_alone(&guessing, &messages, max_tokens)?)
                } else {
                    let b = decode_alone(&guessing, &messages, max_tokens)?;
                    (decode_alone(&plain, &messages, max_tokens)?, b)
                };
                identical &= a.ids == b.ids;
                off.0 += a.ids.len().saturating_sub(1);
                off.1 += a.decode_seconds;
                on.0 += b.ids.len().saturating_sub(1);
                on.1 += b.decode_seconds;
                guessed += b.guessed;
                kept += b.kept;
            }
            let (off_tps, on_tps) = (off.0 as f64 / off.1, on.0 as f64 / on.1);
            if !json {
                println!(
                    "{:<6} {:>5} {:>10.1} {:>10.1} {:>7.2} {:>9} {:>10}",
                    kind,
                    round + 1,
                    off_tps,
                    on_tps,
                    on_tps / off_tps,
                    "",
                    ""
                );
            }
            off_total = (off_total.0 + off.0, off_total.1 + off.1);
            on_total = (on_total.0 + on.0, on_total.1 + on.1);
        }
        let (off_tps, on_tps) = (
            off_total.0 as f64 / off_total.1,
            on_total.0 as f64 / on_total.1,
        );
        let share = kept as f64 / guessed.max(1) as f64;
        if !json {
            println!(
                "{:<6} {:>5} {:>10.1} {:>10.1} {:>7.2} {:>8.0}% {:>10}",
                kind,
                "all",
                off_tps,
                on_tps,
                on_tps / off_tps,
                share * 100.0,
                identical
            );
        }
        results.push(json!({
            "kind": kind,
            "off_tps": off_tps,
            "on_tps": on_tps,
            "ratio": on_tps / off_tps,
            "guessed": guessed,
            "kept": kept,
            "identical": identical,
        }));
    }
    if json {
        println!(
            "{}",
            json!({"model": model.model, "guess": guess, "max_tokens": max_tokens,
                   "rounds": rounds, "backend": plain.backend().describe(), "results": results})
        );
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    use clap::Parser;

    #[derive(Parser)]
    struct ServeCli {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn serve_args(argv: &[&str]) -> ServeArgs {
        let argv = std::iter::once("serve").chain(argv.iter().copied());
        ServeCli::try_parse_from(argv).expect("flags parse").args
    }

    #[test]
    fn serve_runs_closed_loops_by_default_and_open_loops_when_asked() {
        let default = serve_args(&[]);
        assert_eq!(
            serve_levels(&default).unwrap(),
            vec![Arrivals::Closed { concurrency: 1 }]
        );
        assert_eq!((default.max_retries, default.max_outstanding), (0, 1024));
        assert!(!default.request_id);
        assert_eq!(
            serve_levels(&serve_args(&["--concurrency", "1,4"])).unwrap(),
            vec![
                Arrivals::Closed { concurrency: 1 },
                Arrivals::Closed { concurrency: 4 }
            ]
        );
        let poisson = serve_args(&[
            "--arrivals",
            "poisson",
            "--rate",
            "4",
            "--duration",
            "60",
            "--max-retries",
            "30",
            "--request-id",
        ]);
        assert_eq!(
            serve_levels(&poisson).unwrap(),
            vec![Arrivals::Poisson { rate_per_s: 4.0 }]
        );
        assert_eq!((poisson.duration_s, poisson.max_retries), (Some(60.0), 30));
        assert!(poisson.request_id);
        assert_eq!(
            serve_levels(&serve_args(&["--arrivals", "poisson", "--rate", "2,8"])).unwrap(),
            vec![
                Arrivals::Poisson { rate_per_s: 2.0 },
                Arrivals::Poisson { rate_per_s: 8.0 }
            ]
        );
        let burst = ["--arrivals", "burst", "--burst", "8", "--every-s", "2"];
        assert_eq!(
            serve_levels(&serve_args(&burst)).unwrap(),
            vec![Arrivals::Burst {
                size: 8,
                every_s: 2.0,
                rate_per_s: 0.0
            }]
        );
        let over_background = serve_args(&[
            "--arrivals",
            "burst",
            "--burst",
            "8",
            "--every",
            "2",
            "--rate",
            "1",
        ]);
        assert_eq!(
            serve_levels(&over_background).unwrap(),
            vec![Arrivals::Burst {
                size: 8,
                every_s: 2.0,
                rate_per_s: 1.0
            }]
        );
    }

    #[test]
    fn serve_refuses_flags_of_the_other_loop() {
        for argv in [
            &["--arrivals", "poisson"][..],
            &["--arrivals", "poisson", "--rate", "0"],
            &["--arrivals", "poisson", "--rate", "4", "--concurrency", "4"],
            &["--arrivals", "poisson", "--rate", "4", "--burst", "4"],
            &["--rate", "4"],
            &["--duration-s", "60"],
            &["--arrivals", "burst", "--burst", "4"],
            &["--arrivals", "burst", "--every-s", "1"],
            &["--arrivals", "burst", "--burst", "4", "--every-s", "0"],
        ] {
            assert!(serve_levels(&serve_args(argv)).is_err(), "{argv:?}");
        }
    }

    #[test]
    fn generated_sentences_are_the_peer_benchmarks() {
        // The first and the thousandth sentence of `sentgen.sentences(1000)`.
        let texts = generated_sentences(1000);
        assert_eq!(
            texts[1],
            "Carefully slow reads answer evening never evening letter doctor server day to always."
        );
        assert_eq!(
            texts[999],
            "Busy story alone sends server music sends takes report man bright game builds warm \
             over table game movie result through every queue queue river together red never an \
             report blue door loud with warm."
        );
        let words: usize = texts.iter().map(|t| t.split(' ').count()).sum();
        assert_eq!(words, 24_281);
    }
}
