//! `rampart explain verify AUDIT_ID`: checks an attention export against its audit entry. The
//! entry keeps the export's digest per choice and after each exported token
//! (`attention_sha256`, `attention.steps`), the model version, the kernel identity and the
//! request's settings; its input is the request's. The command replays the request on the same
//! version, alone, and compares digests token by token; with `--response` it also checks that an
//! answer's export (a client's copy) is the one the entry describes. It names the first token
//! that differs.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use engine::explain::{replay_request, AttentionDigest};
use engine::{Attended, ChatMessage, Event, Prompt};

use crate::engine_args::{KvArgs, ModelChoice};

#[derive(Debug, clap::Args)]
pub struct ExplainArgs {
    #[command(subcommand)]
    pub command: ExplainCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum ExplainCommand {
    /// Replay a request's attention export on the same model version and compare its digests
    /// with the audit entry's, token by token (exit 0: verified, 1: a digest differs, 2: it
    /// cannot be replayed here, saying why).
    Verify {
        audit_id: String,
        /// The local audit log directory.
        #[arg(
            long,
            env = "RAMPART_AUDIT_DIR",
            default_value = "audit",
            value_name = "DIR"
        )]
        audit_dir: PathBuf,
        /// The model repository folder.
        #[arg(
            long,
            env = "RAMPART_REPO",
            default_value = "models",
            value_name = "DIR"
        )]
        repo: PathBuf,
        /// Compute threads: the server's (the kernel identity names them).
        #[arg(long, short = 't')]
        threads: Option<usize>,
        /// The KV cache element type the server used (the kernel identity names it).
        #[arg(long, default_value = "f16")]
        kv_cache_dtype: String,
        /// Also check the export of this response body (JSON, as the server answered it).
        #[arg(long, value_name = "FILE")]
        response: Option<PathBuf>,
        /// Only check `--response` against the entry; do not replay.
        #[arg(long)]
        no_replay: bool,
    },
}

pub fn run(args: ExplainArgs) -> anyhow::Result<ExitCode> {
    match args.command {
        ExplainCommand::Verify {
            audit_id,
            audit_dir,
            repo,
            threads,
            kv_cache_dtype,
            response,
            no_replay,
        } => verify(
            &audit_id,
            &audit_dir,
            repo,
            threads,
            &kv_cache_dtype,
            response,
            no_replay,
        ),
    }
}

/// What the audit entry says of one request's export.
struct Audited {
    model: String,
    version: String,
    version_digest: String,
    kernel: String,
    settings: serde_json::Value,
    /// Per choice: the digest and the digest after each exported token.
    digests: Vec<String>,
    steps: Vec<Vec<String>>,
    input: Option<serde_json::Value>,
    /// The request held its output to a grammar (structured output, tools).
    structured: bool,
}

fn audited(audit_dir: &std::path::Path, audit_id: &str) -> anyhow::Result<Audited> {
    let log = audit::read::load(audit_dir, None);
    if let Some(p) = &log.problem {
        bail!(
            "the audit log in {} does not verify ({p}): run `rampart audit verify`",
            audit_dir.display()
        );
    }
    let Some(loaded) = log.get(audit_id) else {
        bail!("no audit entry {audit_id:?} in {}", audit_dir.display());
    };
    let entry = &loaded.entry;
    let record = entry
        .record
        .as_ref()
        .context("the audit entry holds no request record")?;
    let text = |k: &str| record[k].as_str().unwrap_or_default().to_string();
    let Some(attention) = record.get("attention").filter(|a| a.is_object()) else {
        bail!("the request {audit_id} exported no attention (no `attention` in its record)");
    };
    let digests: Vec<String> = text("attention_sha256")
        .split(',')
        .filter(|d| !d.is_empty())
        .map(str::to_string)
        .collect();
    let steps: Vec<Vec<String>> = serde_json::from_value(attention["steps"].clone())
        .context("the record's attention.steps")?;
    if digests.len() != steps.len() {
        bail!(
            "the record names {} digests and {} choices' steps",
            digests.len(),
            steps.len()
        );
    }
    Ok(Audited {
        model: text("model"),
        version: text("version"),
        version_digest: text("version_digest"),
        kernel: attention["kernel"].as_str().unwrap_or_default().to_string(),
        settings: attention["settings"].clone(),
        digests,
        steps,
        input: entry.input.clone(),
        structured: record["params"]["structured"].as_bool().unwrap_or(false),
    })
}

/// The digest of one choice's export, token by token: (the steps, the digest).
fn digest_of<'a>(
    a: &Audited,
    request: &engine::AttentionRequest,
    seed: Option<u64>,
    tokens: impl Iterator<Item = (usize, &'a [Attended])>,
) -> (Vec<String>, String) {
    let mut d = AttentionDigest::new(request, &a.version_digest, seed, &a.kernel);
    let mut steps = Vec::new();
    for (index, entries) in tokens {
        d.token(index, entries);
        steps.push(d.step());
    }
    (steps, d.finish())
}

/// Where two choices' steps first differ: `None` when they agree.
fn first_difference(want: &[String], got: &[String]) -> Option<usize> {
    (0..want.len().max(got.len())).find(|&i| want.get(i) != got.get(i))
}

fn seed_of(settings: &serde_json::Value, choice: usize) -> Option<u64> {
    settings["seed"]
        .as_u64()
        .map(|s| s.wrapping_add(choice as u64))
}

/// The export of a response body's choice, as the digest reads it: (token index, entries with
/// each head's list padded to top_k).
fn response_tokens(
    choice: &serde_json::Value,
    request: &engine::AttentionRequest,
) -> anyhow::Result<Vec<(usize, Vec<Attended>)>> {
    let export = &choice["explain"]["attention"];
    let tokens = export["tokens"]
        .as_array()
        .context("the response's choice has no explain.attention.tokens")?;
    let mut out = Vec::new();
    for t in tokens {
        let index = t["index"].as_u64().context("a token without an index")? as usize;
        let mut entries = Vec::with_capacity(request.entries_per_token());
        for layer in t["top"].as_array().context("a token without top")? {
            for head in layer.as_array().context("a layer that is not a list")? {
                let pairs = head.as_array().context("a head that is not a list")?;
                for pair in pairs {
                    let position = pair[0].as_u64().context("a position")? as u32;
                    // The weight as the server printed it: f32's shortest form, read back exact.
                    let weight = pair[1].as_f64().context("a weight")? as f32;
                    entries.push(Attended { position, weight });
                }
                for _ in pairs.len()..request.top_k {
                    entries.push(Attended::NONE);
                }
            }
        }
        out.push((index, entries));
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn verify(
    audit_id: &str,
    audit_dir: &std::path::Path,
    repo: PathBuf,
    threads: Option<usize>,
    kv_cache_dtype: &str,
    response: Option<PathBuf>,
    no_replay: bool,
) -> anyhow::Result<ExitCode> {
    let a = audited(audit_dir, audit_id)?;
    let probe =
        replay_request(&a.settings, Prompt::Tokens(Vec::new())).map_err(anyhow::Error::msg)?;
    let request = probe
        .attention
        .clone()
        .context("the settings hold no attention request")?;
    println!(
        "entry    {audit_id}: {}@{} ({}), {} choice(s)",
        a.model,
        a.version,
        a.version_digest,
        a.digests.len()
    );
    println!("kernel   {}", a.kernel);
    let mut failed = false;
    if let Some(path) = &response {
        let body: serde_json::Value = serde_json::from_slice(
            &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("{} is not JSON", path.display()))?;
        let choices = body["choices"]
            .as_array()
            .context("the response has no choices")?;
        for (i, choice) in choices.iter().enumerate() {
            let tokens = response_tokens(choice, &request)?;
            let (steps, digest) = digest_of(
                &a,
                &request,
                seed_of(&a.settings, i),
                tokens.iter().map(|(i, e)| (*i, e.as_slice())),
            );
            let want = a.digests.get(i).map(String::as_str).unwrap_or_default();
            if digest == want {
                println!("response choice {i}: the export is the audited one ({digest})");
            } else {
                failed = true;
                let at = first_difference(&a.steps[i], &steps).unwrap_or(0);
                let index = tokens.get(at).map_or(at, |t| t.0);
                println!(
                    "response choice {i}: DIFFERS from the audit entry from exported token {at} (completion token {index}) on: {digest} against {want}"
                );
            }
        }
    }
    if no_replay {
        return Ok(ExitCode::from(u8::from(failed)));
    }
    if a.structured {
        // Without its grammar the model is free where the constraint held it: the replay
        // would differ at the first constrained token.
        eprintln!(
            "cannot replay a structured-output request yet: the entry does not keep its grammar (--response checks a copy of the answer against the entry)"
        );
        return Ok(ExitCode::from(u8::from(failed) + 2 * u8::from(!failed)));
    }
    let prompt = match (a.settings["prompt"].as_str(), &a.input) {
        (Some("chat"), Some(input)) => {
            let messages: Vec<ChatMessage> = input["messages"]
                .as_array()
                .context(
                    "the entry's input holds no messages (a chat with tools is not replayed yet)",
                )?
                .iter()
                .map(|m| {
                    ChatMessage::new(
                        m["role"].as_str().unwrap_or_default(),
                        m["content"].as_str().unwrap_or_default(),
                    )
                })
                .collect();
            Prompt::Chat(messages)
        }
        (Some(kind @ ("text" | "plain_text")), Some(input)) => {
            let text = input["prompt"]
                .as_str()
                .context("the entry's input holds no prompt text")?
                .to_string();
            if kind == "text" {
                Prompt::Text(text)
            } else {
                Prompt::PlainText(text)
            }
        }
        (_, None) => {
            eprintln!("cannot replay: the audit entry keeps no input (redacted or not kept)");
            return Ok(ExitCode::from(2));
        }
        (kind, _) => {
            eprintln!("cannot replay a {kind:?} prompt yet (chat and text prompts are replayed)");
            return Ok(ExitCode::from(2));
        }
    };
    let kv = KvArgs {
        kv_cache_dtype: kv_cache_dtype
            .parse()
            .map_err(|e| anyhow::anyhow!("--kv-cache-dtype: {e}"))?,
        ..KvArgs::small()
    };
    let choice = ModelChoice {
        model: format!("{}@{}", a.model, a.version),
        repo,
        threads,
        quantize: None,
        kv,
    };
    let engine = choice.load(None)?;
    let kernel = engine.kernel_identity();
    if kernel != a.kernel {
        eprintln!(
            "cannot replay here: this replay's kernels are `{kernel}`, the export's `{}`; digests compare only under the same identity (set --threads and --kv-cache-dtype as the server had them, on a CPU of the same SIMD level)",
            a.kernel
        );
        return Ok(ExitCode::from(2));
    }
    for (i, (want, want_steps)) in a.digests.iter().zip(&a.steps).enumerate() {
        let mut replay = replay_request(&a.settings, prompt.clone()).map_err(anyhow::Error::msg)?;
        replay.sampling.seed = seed_of(&a.settings, i);
        let mut tokens: Vec<(usize, Vec<Attended>)> = Vec::new();
        let mut seen = 0;
        for event in engine.generate(replay)? {
            match event {
                Event::Token(t) => {
                    if !t.attention.is_empty() {
                        tokens.push((seen, t.attention));
                    }
                    seen += 1;
                }
                Event::Finished(_) => break,
                Event::Failed(e) => bail!("the replay failed: {e}"),
                Event::Shed(_) => bail!("the replay was shed"),
            }
        }
        let (steps, digest) = digest_of(
            &a,
            &request,
            seed_of(&a.settings, i),
            tokens.iter().map(|(i, e)| (*i, e.as_slice())),
        );
        if &digest == want {
            println!(
                "replay choice {i}: verified, {} exported tokens ({digest})",
                tokens.len()
            );
        } else {
            failed = true;
            match first_difference(want_steps, &steps) {
                Some(at) => println!(
                    "replay choice {i}: DIFFERS from exported token {at} (completion token {}) on: {digest} against {want}",
                    tokens.get(at).map_or(at, |t| t.0)
                ),
                None => println!("replay choice {i}: DIFFERS: {digest} against {want}"),
            }
        }
    }
    Ok(ExitCode::from(u8::from(failed)))
}
