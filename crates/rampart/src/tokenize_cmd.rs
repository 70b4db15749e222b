//! `rampart tokenize MODEL TEXT`: a language model's token ids for a text or a chat message, as
//! the server's `/tokenize` computes them (the same tokenizer and template, loaded from the
//! repository or a file; no server needed).

use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use engine::ChatMessage;

use crate::engine_args::{KvArgs, ModelChoice};

#[derive(Debug, clap::Args)]
pub struct TokenizeArgs {
    /// NAME[@VERSION] in the repository, or a .gguf file or a Hugging Face checkpoint folder.
    pub model: String,
    /// The text (`-` or nothing: read standard input).
    pub text: Option<String>,
    /// The model repository folder.
    #[arg(
        long,
        env = "RAMPART_REPO",
        default_value = "models",
        value_name = "DIR"
    )]
    pub repo: PathBuf,
    /// Send the text as a user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// A system message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// With --chat: leave out the assistant turn's opening.
    #[arg(long)]
    pub no_generation_prompt: bool,
    /// Without --chat: no BOS.
    #[arg(long)]
    pub no_special_tokens: bool,
    /// Without --chat: special-token texts stay plain text.
    #[arg(long)]
    pub plain: bool,
    /// One JSON object (`count`, `tokens`, `token_strs`), as `/tokenize` answers.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: TokenizeArgs) -> Result<ExitCode> {
    let text = match args.text.as_deref() {
        None | Some("-") => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("reading the text from standard input")?;
            text
        }
        Some(t) => t.to_string(),
    };
    if args.system.is_some() && !args.chat {
        bail!("--system needs --chat");
    }
    if args.no_generation_prompt && !args.chat {
        bail!("--no-generation-prompt needs --chat");
    }
    if (args.no_special_tokens || args.plain) && args.chat {
        bail!("--no-special-tokens and --plain apply to text without --chat (the template places the special tokens)");
    }
    // Only the tokenizer is used: one thread and a small KV pool.
    let choice = ModelChoice {
        model: args.model.clone(),
        repo: args.repo.clone(),
        threads: Some(1),
        quantize: None,
        kv: KvArgs::small(),
    };
    let engine = choice.load(None)?;
    let tokenizer = engine.tokenizer();
    let tokens = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &text));
        engine.encode_chat_with(&messages, !args.no_generation_prompt)?
    } else if args.plain {
        tokenizer.encode_plain(&text, !args.no_special_tokens)?
    } else {
        tokenizer.encode(&text, !args.no_special_tokens)?
    };
    let strs: Vec<String> = tokens.iter().map(|&t| tokenizer.token_text(t)).collect();
    if args.json {
        let out = serde_json::json!({
            "count": tokens.len(),
            "max_model_len": engine.context(),
            "tokens": tokens,
            "token_strs": strs,
        });
        println!("{out}");
    } else {
        println!("{} tokens", tokens.len());
        for (id, s) in tokens.iter().zip(&strs) {
            println!("{id:>8}  {s:?}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
