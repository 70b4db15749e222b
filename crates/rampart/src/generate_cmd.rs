//! `rampart generate`: run a prompt or a chat through the engine and stream the text.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Result};
use engine::{ChatMessage, Event, GenerateRequest, Prompt, SamplingParams};

use crate::engine_args::ModelChoice;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelChoice,
    /// The prompt (or the user message with --chat).
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A system message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 is greedy (deterministic).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop before this text (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Print each token with its logprob and the entropy of its distribution instead of text.
    #[arg(long)]
    pub logprobs: bool,
}

pub fn run(args: GenerateArgs) -> Result<ExitCode> {
    let engine = Arc::new(args.model.load(None)?);
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &args.prompt));
        Prompt::Chat(messages)
    } else {
        if args.system.is_some() {
            bail!("--system needs --chat");
        }
        Prompt::Text(args.prompt.clone())
    };
    let mut request = GenerateRequest::new(prompt, args.max_tokens);
    request.sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        top_logprobs: if args.logprobs { 3 } else { 0 },
        ..SamplingParams::default()
    };
    request.stop = args.stop.clone();
    let events = engine.generate(request)?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    for event in events {
        match event {
            Event::Token(t) => {
                if args.logprobs {
                    let alternatives: Vec<String> = t
                        .top_logprobs
                        .iter()
                        .map(|(_, text, lp)| format!("{text:?} {lp:.3}"))
                        .collect();
                    writeln!(
                        out,
                        "{:>6}  {:<20} logprob {:>8.4}  entropy {:>6.3}  top: {}",
                        t.id,
                        format!("{:?}", t.text),
                        t.logprob,
                        t.entropy,
                        alternatives.join(", ")
                    )?;
                } else {
                    write!(out, "{}", t.text)?;
                    out.flush()?;
                }
            }
            Event::Finished(f) => {
                if !args.logprobs {
                    writeln!(out, "{}", f.trailing_text)?;
                }
                let decode_tps = if f.decode_seconds > 0.0 {
                    f.completion_tokens as f64 / f.decode_seconds
                } else {
                    0.0
                };
                eprintln!(
                    "[{}: prompt {} tokens in {:.0} ms ({:.1} tok/s), generated {} tokens ({:.1} tok/s), {}]",
                    args.model.model,
                    f.prompt_tokens,
                    f.prefill_seconds * 1e3,
                    f.prompt_tokens as f64 / f.prefill_seconds.max(1e-9),
                    f.completion_tokens,
                    decode_tps,
                    engine.backend().describe()
                );
                eprintln!("[finish: {}]", f.reason.as_str());
            }
            Event::Failed(e) => bail!("generation failed: {e}"),
            Event::Shed(shed) => {
                bail!(
                    "refused: memory is saturated (waited {} ms without starting)",
                    shed.waited_ms
                )
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
