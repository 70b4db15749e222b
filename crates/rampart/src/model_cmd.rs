//! `rampart model …`: the model repository from the command line.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use repo::diff::{diff, VersionDiff, DEFAULT_TOKENIZER_THRESHOLD_PCT};
use repo::{ImportOptions, Kind, Manifest, ModelRef, ModelVersion, Repository};
use serde_json::json;

use crate::render::{bytes, count, float, table, Section};
use crate::{build_info, progress_bar, ModelArgs};

/// Exit status of `diff` when the tokenizer changed beyond the threshold.
pub const EXIT_TOKENIZER_CHANGED: u8 = 3;

#[derive(Debug, Subcommand)]
pub enum ModelCommand {
    /// Import a model file or folder as a new, immutable version.
    ///
    /// Detects the format (GGUF, ONNX, safetensors folder) and kind, copies the files into
    /// REPO/NAME/VERSION/, and writes rampart.toml (manifest), DIGESTS (sha256 of every file plus
    /// the version digest) and LINEAGE.json (source, build, host).
    Import {
        /// A .gguf or .onnx file, or a folder (Hugging Face checkpoint, sentence-transformers
        /// model, or a folder holding one .gguf/.onnx with its tokenizer files).
        source: PathBuf,
        /// Model name: lowercase letters, digits, '-', '_', '.'.
        #[arg(long)]
        name: String,
        /// Version (semver, e.g. 1.0.0). Existing versions are never overwritten.
        #[arg(long)]
        version: String,
        /// Override the detected kind.
        #[arg(long, value_parser = parse_kind)]
        kind: Option<Kind>,
        /// Hard-link the files instead of copying (same filesystem only; the version then shares
        /// its bytes with the source, and `verify` catches later edits to either).
        #[arg(long)]
        link: bool,
        /// Commit of the code that produced the model, recorded in the lineage.
        #[arg(long, value_name = "COMMIT")]
        git_commit: Option<String>,
        /// Version of the data the model was trained or evaluated on, recorded in the lineage.
        #[arg(long, value_name = "VERSION")]
        dataset_version: Option<String>,
        /// A TOML file declaring the serving pipeline (`[pipeline.preprocess]`,
        /// `[pipeline.postprocess]`, `[pipeline.batching]`; see examples/). Without it, a
        /// `rampart.toml` in a source folder is read.
        #[arg(long, value_name = "FILE")]
        manifest: Option<PathBuf>,
        /// The model card (Markdown: intended use, limits, evaluation data, licence), imported
        /// as MODEL_CARD.md and covered by the digests. A source folder's own MODEL_CARD.md or
        /// README.md is imported without it.
        #[arg(long, value_name = "FILE")]
        card: Option<PathBuf>,
        /// Make this version the stable one at once (what users get by the model's name).
        /// Without it only a model's first version becomes stable; later ones wait for
        /// `rampart model promote` or a release.
        #[arg(long)]
        stable: bool,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Make NAME@VERSION the stable version: what users get by the model's name (at a server's
    /// next start; a running server moves users with a release instead). Refused for a model
    /// that has a release plan: its releases decide its stable.
    Promote {
        /// NAME@VERSION.
        model: String,
        /// Why (kept in the alias's history).
        #[arg(long)]
        reason: String,
        #[arg(long)]
        json: bool,
    },
    /// The maturity report of a version (the stable one when none is given): checks in six
    /// sections with their evidence from the repository and the server's configuration, a
    /// level per section and the overall level (the lowest). Exits 4 when it is below
    /// --require.
    Maturity {
        /// NAME or NAME@VERSION.
        model: String,
        /// The server's configuration file (what it would run with); without it, the
        /// defaults.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Exit with status 4 when the overall level is below this one (experimental,
        /// staging, production).
        #[arg(long, value_name = "LEVEL")]
        require: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// List every model and version in the repository.
    List {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show a version's manifest, digest, lineage, stable alias and model card (the stable
    /// version when none is given).
    Inspect {
        /// NAME or NAME@VERSION.
        model: String,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Re-hash versions against their DIGESTS; exits non-zero and lists the files that differ.
    ///
    /// Without an argument every version of every model is checked; NAME checks every version
    /// of that model; NAME@VERSION checks one.
    Verify {
        /// NAME or NAME@VERSION.
        model: Option<String>,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Compare two versions: files, manifest and tokenizer.
    ///
    /// Exits with status 3 when the tokenizer changed beyond the threshold (more than
    /// --tokenizer-threshold percent of merges or vocabulary entries, any special-token or
    /// BOS/EOS-rule change, another tokenizer model), so a release pipeline can stop on it.
    Diff {
        /// The old version, NAME@VERSION.
        old: String,
        /// The new version, NAME@VERSION.
        new: String,
        /// Percent of merges (or vocabulary entries) that may change.
        #[arg(long, default_value_t = DEFAULT_TOKENIZER_THRESHOLD_PCT, value_name = "PERCENT")]
        tokenizer_threshold: f64,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Upload one version (NAME@VERSION) to S3 (`s3://bucket/prefix`) or a folder, as
    /// PREFIX/NAME/VERSION/<files> with its DIGESTS last; prints the version digest to pin.
    Push {
        /// NAME@VERSION.
        model: String,
        /// `s3://bucket/prefix`, or a folder (another repository's root).
        #[arg(long, value_name = "LOCATION")]
        to: String,
        #[command(flatten)]
        s3: crate::model_transfer::S3Args,
        #[arg(long)]
        json: bool,
    },
    /// Fetch one version (NAME@VERSION) from S3 or a folder into the repository, verified by
    /// its digests (and against --digest) before it appears; a version already here is
    /// verified instead (what a pod's init container runs on every start).
    Pull {
        /// NAME@VERSION, one or more; NAME@VERSION=sha256:HEX pins each one's version digest.
        #[arg(required = true, value_name = "NAME@VERSION[=DIGEST]")]
        models: Vec<String>,
        /// `s3://bucket/prefix`, or a folder (another repository's root, e.g. a model image's).
        #[arg(long, value_name = "LOCATION")]
        from: String,
        /// The version digest it must have (`sha256:…`, as `push` and `inspect` print it); with
        /// one model only.
        #[arg(long, value_name = "DIGEST")]
        digest: Option<String>,
        #[command(flatten)]
        s3: crate::model_transfer::S3Args,
        #[arg(long)]
        json: bool,
    },
    /// Delete one version (NAME@VERSION).
    Remove {
        /// NAME@VERSION.
        model: String,
    },
    /// Quantize a model (a GGUF, a Hugging Face folder, or NAME[@VERSION]) by a plan that maps tensor-name
    /// patterns to types, and import the result as a new version whose lineage records the
    /// source digest and the plan. The output loads in llama.cpp too.
    Quantize {
        /// A .gguf file, a Hugging Face checkpoint folder, or NAME[@VERSION] in the repository.
        source: String,
        /// A plan file (TOML: `default = "Q4_K"` and ordered `rules = [{ match, type }]`).
        #[arg(long, value_name = "FILE")]
        plan: Option<PathBuf>,
        /// One type for every matrix instead of a plan (F32, F16, Q8_0, Q6_K, Q5_K, Q5_1, Q5_0,
        /// Q4_K, Q4_1, Q4_0).
        #[arg(long = "type", value_name = "TYPE")]
        dtype: Option<String>,
        /// Name of the new model version.
        #[arg(long)]
        name: String,
        #[arg(long)]
        version: String,
        /// Quantization threads (default: physical cores).
        #[arg(long, short = 't')]
        threads: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// Compare versions: perplexity on a text (and its change against --baseline), size on
    /// disk, peak resident memory and decode tokens/s, one row per version. Each version is
    /// measured in its own process.
    Evaluate {
        /// NAME@VERSION (or .gguf files), one or more.
        #[arg(required = true)]
        models: Vec<String>,
        /// A UTF-8 text for perplexity.
        #[arg(long, value_name = "FILE")]
        text: PathBuf,
        /// The version the others are compared with (measured first).
        #[arg(long)]
        baseline: Option<String>,
        /// Tokens per perplexity chunk.
        #[arg(long, default_value_t = 256)]
        ctx: usize,
        /// At most this many chunks (0: the whole text).
        #[arg(long, default_value_t = 0)]
        chunks: usize,
        /// Tokens generated for the decode speed (median of 3).
        #[arg(long, default_value_t = 64)]
        gen_tokens: usize,
        #[arg(long, short = 't')]
        threads: Option<usize>,
        #[arg(long)]
        json: bool,
    },
    /// One model's measurements as JSON (what `evaluate` runs per version).
    #[command(hide = true)]
    EvaluateOne {
        model: String,
        #[arg(long)]
        text: PathBuf,
        #[arg(long)]
        ctx: usize,
        #[arg(long)]
        chunks: usize,
        #[arg(long)]
        gen_tokens: usize,
        #[arg(long, short = 't')]
        threads: Option<usize>,
    },
}

fn parse_kind(s: &str) -> Result<Kind, String> {
    s.parse::<Kind>().map_err(|e| e.to_string())
}

fn parse_ref(s: &str) -> Result<ModelRef> {
    s.parse::<ModelRef>().map_err(anyhow::Error::from)
}

pub fn run(args: ModelArgs) -> Result<ExitCode> {
    let repo = Repository::open(&args.repo);
    match args.command {
        ModelCommand::Import {
            source,
            name,
            version,
            kind,
            link,
            git_commit,
            dataset_version,
            manifest,
            card,
            stable,
            json,
        } => {
            let pipeline = match manifest {
                Some(file) => {
                    let text = std::fs::read_to_string(&file)
                        .with_context(|| format!("reading {}", file.display()))?;
                    let declaration = repo::Declaration::parse(&text)
                        .map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
                    Some(declaration.pipeline)
                }
                None => None,
            };
            import(
                &repo,
                source,
                ImportArgs {
                    name,
                    version,
                    kind,
                    link,
                    git_commit,
                    dataset_version,
                    pipeline,
                    card,
                    stable,
                },
                json,
            )
        }
        ModelCommand::Promote {
            model,
            reason,
            json,
        } => promote(&repo, &model, &reason, json),
        ModelCommand::Maturity {
            model,
            config,
            require,
            json,
        } => crate::maturity_cmd::run(
            &args.repo,
            &model,
            config.as_deref(),
            require.as_deref(),
            json,
        ),
        ModelCommand::List { json } => list(&repo, json),
        ModelCommand::Inspect { model, json } => inspect(&repo, &model, json),
        ModelCommand::Verify { model, json } => verify(&repo, model.as_deref(), json),
        ModelCommand::Diff {
            old,
            new,
            tokenizer_threshold,
            json,
        } => diff_cmd(&repo, &old, &new, tokenizer_threshold, json),
        ModelCommand::Remove { model } => remove(&repo, &model),
        ModelCommand::Push {
            model,
            to,
            s3,
            json,
        } => crate::model_transfer::push(&repo, &model, &to, &s3, json),
        ModelCommand::Pull {
            models,
            from,
            digest,
            s3,
            json,
        } => crate::model_transfer::pull_all(&repo, &models, &from, digest.as_deref(), &s3, json),
        ModelCommand::Quantize {
            source,
            plan,
            dtype,
            name,
            version,
            threads,
            json,
        } => crate::quantize_cmd::quantize(
            &args.repo, &source, plan, dtype, name, version, threads, json,
        ),
        ModelCommand::Evaluate {
            models,
            text,
            baseline,
            ctx,
            chunks,
            gen_tokens,
            threads,
            json,
        } => crate::quantize_cmd::evaluate(
            &args.repo,
            &models,
            baseline.as_deref(),
            &text,
            ctx,
            chunks,
            gen_tokens,
            threads,
            json,
        ),
        ModelCommand::EvaluateOne {
            model,
            text,
            ctx,
            chunks,
            gen_tokens,
            threads,
        } => crate::quantize_cmd::evaluate_one(
            &args.repo, &model, &text, ctx, chunks, gen_tokens, threads,
        ),
    }
}

struct ImportArgs {
    name: String,
    version: String,
    kind: Option<Kind>,
    link: bool,
    git_commit: Option<String>,
    dataset_version: Option<String>,
    pipeline: Option<repo::Pipeline>,
    card: Option<PathBuf>,
    stable: bool,
}

fn import(repo: &Repository, source: PathBuf, args: ImportArgs, json: bool) -> Result<ExitCode> {
    let ImportArgs {
        name,
        version,
        kind,
        link,
        git_commit,
        dataset_version,
        pipeline,
        card,
        stable,
    } = args;
    if stable {
        let plan = release::plan::plan_path(repo.root(), &name)?;
        if plan.is_file() {
            bail!(
                "{name} has a release plan ({}): its releases decide its stable version; import without --stable and release it (`rampart release start {name} --candidate {version}`)",
                plan.display()
            );
        }
    }
    let progress = progress_bar::for_stderr(json);
    let options = ImportOptions {
        name,
        version,
        kind,
        link,
        git_commit,
        dataset_version,
        derived_from: None,
        pipeline,
        build: build_info(),
        progress: progress.as_ref(),
        rules_check: Some(|text| Ok(guard::check_rules_file(text)?)),
        host_fingerprint: crate::host_fingerprint(),
        card,
        stable,
    };
    let loaded = repo
        .import(&source, &options)
        .with_context(|| format!("importing {}", source.display()))?;
    let m = &loaded.manifest.model;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": loaded.version.to_string(),
                "dir": loaded.version.dir,
                "version_digest": format!("sha256:{}", loaded.version_digest),
                "stable": repo.stable(&loaded.version.name)?,
                "manifest": loaded.manifest,
            }))?
        );
    } else {
        println!(
            "imported {} ({}, {}, {} parameters, {}) into {}",
            loaded.version,
            m.kind,
            m.format,
            count(m.parameter_count),
            bytes(m.size_bytes),
            loaded.version.dir.display()
        );
        println!("version digest sha256:{}", loaded.version_digest);
        match repo.stable(&loaded.version.name)? {
            Some(s) if s.version == loaded.version.version.to_string() => {
                println!("stable: users get {} by its name ({})", loaded.version, s.cause);
            }
            Some(s) => println!(
                "stable: users still get {}@{}; {} waits for a release or `rampart model promote {}`",
                loaded.version.name, s.version, loaded.version, loaded.version
            ),
            None => {}
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn promote(repo: &Repository, model: &str, reason: &str, json: bool) -> Result<ExitCode> {
    let version = versioned(repo, model)?;
    if reason.trim().is_empty() {
        bail!("--reason must say why {version} becomes the stable version");
    }
    let plan = release::plan::plan_path(repo.root(), &version.name)?;
    if plan.is_file() {
        bail!(
            "{} has a release plan ({}): its releases decide its stable version; move users with `rampart release start {} --candidate {}` and promote the release",
            version.name,
            plan.display(),
            version.name,
            version.version
        );
    }
    // A version that fails verification does not become what users get.
    repo.verified(&version, &repo::NoProgress)?;
    let previous = repo.stable(&version.name)?;
    let by = repo::lineage::current_user().unwrap_or_else(|| "unknown".into());
    let setting = repo.set_stable(&version, &by, &format!("promote: {reason}"))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": version.name,
                "stable": setting,
                "previous": previous,
            }))?
        );
    } else {
        println!(
            "{version} is the stable version of {} (was {}); a running server serves it from its next start",
            version.name,
            previous.map_or_else(|| "none".to_string(), |p| p.version)
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn list(repo: &Repository, json: bool) -> Result<ExitCode> {
    let mut rows = Vec::new();
    let mut items = Vec::new();
    for name in repo.models()? {
        let stable = repo.chosen(&name).ok().map(|(v, _)| v.version);
        for v in repo.versions(&name)? {
            let is_stable = stable.as_ref() == Some(&v.version);
            let manifest = repo.manifest(&v)?;
            let digest = repo.digests(&v)?.version_digest();
            let m = &manifest.model;
            rows.push(vec![
                name.clone(),
                v.version.to_string(),
                m.kind.to_string(),
                m.format.to_string(),
                count(m.parameter_count),
                bytes(m.size_bytes),
                digest[..12].to_string(),
                if is_stable { "stable" } else { "" }.to_string(),
            ]);
            items.push(json!({
                "name": name,
                "version": v.version.to_string(),
                "kind": m.kind,
                "format": m.format,
                "parameter_count": m.parameter_count,
                "size_bytes": m.size_bytes,
                "version_digest": format!("sha256:{digest}"),
                "stable": is_stable,
                "dir": v.dir,
            }));
        }
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&items)?);
    } else if rows.is_empty() {
        println!(
            "no models in {} (import one with `rampart model import FILE --name NAME --version 1.0.0`)",
            repo.root().display()
        );
    } else {
        print!(
            "{}",
            table(
                &["NAME", "VERSION", "KIND", "FORMAT", "PARAMS", "SIZE", "DIGEST", "SERVED"],
                &rows
            )
        );
    }
    Ok(ExitCode::SUCCESS)
}

fn resolve(repo: &Repository, model: &str) -> Result<ModelVersion> {
    Ok(repo.resolve(&parse_ref(model)?)?)
}

fn inspect(repo: &Repository, model: &str, json: bool) -> Result<ExitCode> {
    let version = resolve(repo, model)?;
    let manifest = repo.manifest(&version)?;
    let digest = repo.digests(&version)?.version_digest();
    let lineage = repo.lineage(&version).ok();
    let card = repo.card(&version)?;
    let stable = repo.stable(&version.name)?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": version.to_string(),
                "dir": version.dir,
                "version_digest": format!("sha256:{digest}"),
                "stable": stable,
                "manifest": manifest,
                "lineage": lineage,
                "card": card,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", render_manifest(&version, &manifest, &digest));
    let mut s = Section::new("served");
    match &stable {
        Some(st) if st.version == version.version.to_string() => {
            s.row(
                "stable",
                format!("yes, since {} ({}, by {})", st.set_at, st.cause, st.set_by),
            );
        }
        Some(st) => {
            s.row(
                "stable",
                format!("no: users get {}@{}", version.name, st.version),
            );
        }
        None => {
            s.row("stable", "no alias (a model with one version serves it)");
        }
    }
    print!("{}", s.render());
    let mut s = Section::new("model card");
    match &card {
        Some(c) => {
            s.row("file", &c.file);
            s.opt("intended use", c.intended_use.as_deref().map(preview));
            s.opt("limits", c.limits.as_deref().map(preview));
            s.opt("evaluation data", c.evaluation_data.as_deref().map(preview));
            s.opt("licence", c.licence.as_deref().map(preview));
            let missing = c.missing();
            if !missing.is_empty() {
                s.row("missing", missing.join(", "));
            }
        }
        None => {
            s.row("file", "none (import one with --card FILE)");
        }
    }
    print!("{}", s.render());
    if let Some(l) = lineage {
        let mut s = Section::new("lineage");
        s.row(
            "source",
            format!(
                "{} ({}, sha256:{})",
                l.source.path, l.source.kind, l.source.sha256
            ),
        );
        s.row(
            "imported",
            format!(
                "{} by {} ({})",
                l.imported_at,
                l.imported_by.as_deref().unwrap_or("unknown"),
                l.import_mode
            ),
        );
        s.row(
            "rampart",
            format!(
                "{} (commit {})",
                l.rampart.version,
                l.rampart.git_commit.as_deref().unwrap_or("unknown")
            ),
        );
        s.opt("git commit", l.git_commit.as_deref());
        s.opt("dataset", l.dataset_version.as_deref());
        let env = &l.environment;
        s.row(
            "host",
            format!(
                "{} / {} / {} ({} cpus) / {}",
                env.os.as_deref().unwrap_or("?"),
                env.kernel.as_deref().unwrap_or("?"),
                env.cpu_model.as_deref().unwrap_or(&env.arch),
                env.logical_cpus,
                env.memory_bytes.map(bytes).unwrap_or_else(|| "?".into())
            ),
        );
        if !env.gpus.is_empty() {
            let gpus: Vec<String> = env
                .gpus
                .iter()
                .map(|g| format!("{} (driver {})", g.name, g.driver))
                .collect();
            s.row("gpus", gpus.join(", "));
        }
        if let Some(fingerprint) = env
            .fingerprint
            .as_ref()
            .and_then(host::Fingerprint::from_json)
        {
            s.row("fingerprint", fingerprint.summary());
        }
        print!("{}", s.render());
    }
    Ok(ExitCode::SUCCESS)
}

/// Shortens long metadata values for the terminal; `--json` shows them whole.
fn preview(text: &str) -> String {
    let one_line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if one_line.chars().count() > 72 {
        format!(
            "{}… ({} bytes)",
            one_line.chars().take(72).collect::<String>(),
            text.len()
        )
    } else {
        one_line
    }
}

fn render_manifest(version: &ModelVersion, manifest: &Manifest, digest: &str) -> String {
    let m = &manifest.model;
    let mut out = String::new();
    let mut s = Section::new(version.to_string());
    s.row("kind", m.kind.to_string())
        .row("format", m.format.to_string())
        .opt("name", m.display_name.as_deref())
        .row(
            "parameters",
            format!("{} ({})", count(m.parameter_count), m.parameter_count),
        )
        .row("size", bytes(m.size_bytes))
        .row("digest", format!("sha256:{digest}"))
        .row("weights", m.weights.join(", "))
        .row("path", version.dir.display().to_string());
    out.push_str(&s.render());

    if let Some(a) = &manifest.architecture {
        let mut s = Section::new("architecture");
        s.row("name", &a.name)
            .opt("layers", a.block_count)
            .opt("hidden size", a.embedding_length)
            .opt("ffn size", a.feed_forward_length)
            .opt(
                "attention heads",
                a.head_count.map(|h| match a.head_count_kv {
                    Some(kv) if kv != h => format!("{h} (kv heads {kv})"),
                    _ => h.to_string(),
                }),
            )
            .opt("context length", a.context_length)
            .opt("vocab size", a.vocab_size)
            .opt("rope theta", a.rope_freq_base.map(float))
            .opt("norm eps", a.norm_eps.map(float))
            .opt(
                "tied embeddings",
                a.tied_embeddings.map(|t| if t { "yes" } else { "no" }),
            );
        let types: Vec<String> = a
            .tensor_types
            .iter()
            .map(|(t, n)| format!("{t} ×{n}"))
            .collect();
        s.row("tensor types", types.join(", "));
        out.push_str(&s.render());
    }
    if let Some(t) = &manifest.tokenizer {
        let mut s = Section::new("tokenizer");
        s.row("source", &t.source)
            .row(
                "kind",
                match &t.pre {
                    Some(pre) => format!("{} (pre-tokenizer {pre})", t.kind),
                    None => t.kind.clone(),
                },
            )
            .row("vocab size", t.vocab_size.to_string())
            .row("merges", t.merges.to_string())
            .opt("add bos", t.add_bos)
            .opt("add eos", t.add_eos)
            .row(
                "chat template",
                match &t.chat_template_sha256 {
                    Some(sha) => format!("yes (sha256:{})", &sha[..12.min(sha.len())]),
                    None => "no".into(),
                },
            );
        let special: Vec<String> = t
            .special
            .iter()
            .map(|(role, tok)| format!("{role} {} {:?}", tok.id, tok.text))
            .collect();
        s.row("special tokens", special.join("\n"));
        out.push_str(&s.render());
    }
    if let Some(e) = &manifest.embedding {
        let mut s = Section::new("embedding");
        s.opt("dimension", e.dimension)
            .opt("pooling", e.pooling.as_deref())
            .row("normalize", if e.normalize { "yes" } else { "no" })
            .opt("max tokens", e.max_seq_length);
        out.push_str(&s.render());
    }
    if let Some(o) = &manifest.onnx {
        let mut s = Section::new("onnx");
        let mut opsets = vec![format!(
            "ai.onnx {}",
            o.opset.map_or("?".into(), |v| v.to_string())
        )];
        opsets.extend(o.extra_opsets.iter().map(|(d, v)| format!("{d} {v}")));
        s.row("ir version", o.ir_version.to_string())
            .row("opsets", opsets.join(", "));
        if !o.producer.is_empty() {
            s.row("producer", &o.producer);
        }
        let spec = |t: &repo::manifest::TensorSpec| match &t.shape {
            Some(shape) => format!(
                "{}: {}[{}]",
                t.name,
                t.dtype,
                shape
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => format!("{}: {}", t.name, t.dtype),
        };
        s.row(
            "inputs",
            o.inputs.iter().map(spec).collect::<Vec<_>>().join("\n"),
        )
        .row(
            "outputs",
            o.outputs.iter().map(spec).collect::<Vec<_>>().join("\n"),
        );
        let types: Vec<String> = o
            .initializer_types
            .iter()
            .map(|(t, n)| format!("{t} ×{n}"))
            .collect();
        s.row("weight types", types.join(", "));
        s.row(
            "operators",
            format!(
                "{} kinds, {} nodes",
                o.op_types.len(),
                o.op_types.values().sum::<u64>()
            ),
        );
        for (k, v) in &o.metadata {
            s.row(&format!("metadata {k}"), preview(v));
        }
        out.push_str(&s.render());
    }
    let rows: Vec<Vec<String>> = manifest
        .files
        .iter()
        .map(|f| {
            vec![
                format!("{:?}", f.role).to_lowercase(),
                bytes(f.bytes),
                f.path.clone(),
            ]
        })
        .collect();
    out.push_str("files\n");
    for line in table(&["ROLE", "SIZE", "PATH"], &rows).lines() {
        out.push_str(&format!("  {line}\n"));
    }
    out
}

fn verify(repo: &Repository, model: Option<&str>, json: bool) -> Result<ExitCode> {
    let versions: Vec<ModelVersion> = match model {
        None => {
            let mut all = Vec::new();
            for name in repo.models()? {
                all.extend(repo.versions(&name)?);
            }
            all
        }
        Some(text) => {
            let r = parse_ref(text)?;
            if r.version.is_some() {
                vec![repo.resolve(&r)?]
            } else {
                repo.resolve(&r)?; // a clear error when the model does not exist
                repo.versions(&r.name)?
            }
        }
    };
    if versions.is_empty() {
        bail!("no models in {} to verify", repo.root().display());
    }
    let progress = progress_bar::for_stderr(json);
    let mut failed = 0;
    let mut reports = Vec::new();
    let width = versions
        .iter()
        .map(|v| v.to_string().len())
        .max()
        .unwrap_or(0);
    for v in &versions {
        let report = repo.verify(v, progress.as_ref())?;
        if !report.ok() {
            failed += 1;
        }
        if !json {
            if report.ok() {
                println!(
                    "ok      {:<width$}  {} files, {}, sha256:{}",
                    v.to_string(),
                    report.files_checked,
                    bytes(report.bytes_checked),
                    &report.version_digest[..12]
                );
            } else {
                println!("FAILED  {v}");
                for f in &report.mismatched {
                    println!("        content changed: {f}");
                }
                for f in &report.missing {
                    println!("        missing: {f}");
                }
                for f in &report.unexpected {
                    println!("        not in DIGESTS: {f}");
                }
            }
        }
        reports.push(json!({"model": v.to_string(), "ok": report.ok(), "report": report}));
    }
    if json {
        println!("{}", serde_json::to_string_pretty(&reports)?);
    } else if failed > 0 {
        eprintln!(
            "{failed} of {} versions failed verification",
            versions.len()
        );
    }
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn versioned(repo: &Repository, text: &str) -> Result<ModelVersion> {
    let r = parse_ref(text)?;
    if r.version.is_none() {
        let versions = repo.versions(&r.name)?;
        bail!(
            "{text}: give an explicit version, NAME@VERSION (versions: {})",
            if versions.is_empty() {
                "none".to_string()
            } else {
                versions
                    .iter()
                    .map(|v| v.version.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            }
        );
    }
    Ok(repo.resolve(&r)?)
}

fn diff_cmd(
    repo: &Repository,
    old: &str,
    new: &str,
    threshold: f64,
    json: bool,
) -> Result<ExitCode> {
    if !(0.0..=100.0).contains(&threshold) {
        bail!("--tokenizer-threshold must be a percentage between 0 and 100, got {threshold}");
    }
    let (old, new) = (versioned(repo, old)?, versioned(repo, new)?);
    let progress = progress_bar::for_stderr(json);
    let d = diff(repo, &old, &new, threshold, progress.as_ref())?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"diff": d, "blocking": !d.blocking.is_empty()}))?
        );
    } else {
        print!("{}", render_diff(&d));
    }
    Ok(if d.blocking.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_TOKENIZER_CHANGED)
    })
}

fn render_diff(d: &VersionDiff) -> String {
    let mut out = format!("{} → {}\n", d.old, d.new);
    out.push_str(&format!(
        "version digest: sha256:{} → sha256:{}\n",
        &d.old_digest[..12],
        &d.new_digest[..12]
    ));
    out.push_str("files:\n");
    if d.files_added.is_empty() && d.files_removed.is_empty() && d.files_changed.is_empty() {
        out.push_str("  (model files identical)\n");
    }
    for f in &d.files_added {
        out.push_str(&format!("  added    {f}\n"));
    }
    for f in &d.files_removed {
        out.push_str(&format!("  removed  {f}\n"));
    }
    for f in &d.files_changed {
        out.push_str(&format!("  changed  {f}\n"));
    }
    out.push_str("manifest:\n");
    if d.manifest_changes.is_empty() {
        out.push_str("  (no field changed)\n");
    }
    for c in &d.manifest_changes {
        out.push_str(&format!(
            "  {}: {} → {}\n",
            c.key,
            c.before
                .as_deref()
                .map(preview)
                .unwrap_or_else(|| "(absent)".into()),
            c.after
                .as_deref()
                .map(preview)
                .unwrap_or_else(|| "(absent)".into())
        ));
    }
    out.push_str("tokenizer:\n");
    match &d.tokenizer {
        None => out.push_str(&format!(
            "  {}\n",
            match d.tokenizer_present {
                (false, false) => "(neither version has one)",
                (false, true) => "added in the new version",
                _ => "removed in the new version",
            }
        )),
        Some(t) if t.is_unchanged() => out.push_str("  unchanged\n"),
        Some(t) => {
            if t.kind.0 != t.kind.1 {
                out.push_str(&format!("  model: {} → {}\n", t.kind.0, t.kind.1));
            }
            if t.pre.0 != t.pre.1 {
                out.push_str(&format!("  pre-tokenizer: {:?} → {:?}\n", t.pre.0, t.pre.1));
            }
            out.push_str(&format!(
                "  vocabulary: {} → {} ids; {} added, {} removed, {} renumbered ({:.2}% changed)\n",
                t.vocab_size.0,
                t.vocab_size.1,
                t.tokens_added,
                t.tokens_removed,
                t.tokens_renumbered,
                t.vocab_changed_pct
            ));
            if !t.examples_added.is_empty() {
                out.push_str(&format!("    added: {:?}\n", t.examples_added));
            }
            if !t.examples_removed.is_empty() {
                out.push_str(&format!("    removed: {:?}\n", t.examples_removed));
            }
            if !t.examples_renumbered.is_empty() {
                out.push_str(&format!("    renumbered: {:?}\n", t.examples_renumbered));
            }
            out.push_str(&format!(
                "  merges: {} → {}; {} added, {} removed, {} reordered ({:.2}% changed)\n",
                t.merges.0,
                t.merges.1,
                t.merges_added,
                t.merges_removed,
                t.merges_reordered,
                t.merges_changed_pct
            ));
            for c in &t.special_changes {
                let show = |s: &Option<repo::manifest::SpecialToken>| match s {
                    Some(tok) => format!("{} {:?}", tok.id, tok.text),
                    None => "(none)".into(),
                };
                out.push_str(&format!(
                    "  special {}: {} → {}\n",
                    c.role,
                    show(&c.before),
                    show(&c.after)
                ));
            }
            if t.add_bos.0 != t.add_bos.1 {
                out.push_str(&format!(
                    "  add_bos: {:?} → {:?}\n",
                    t.add_bos.0, t.add_bos.1
                ));
            }
            if t.add_eos.0 != t.add_eos.1 {
                out.push_str(&format!(
                    "  add_eos: {:?} → {:?}\n",
                    t.add_eos.0, t.add_eos.1
                ));
            }
            if t.chat_template_changed {
                out.push_str("  chat template changed\n");
            }
        }
    }
    if d.blocking.is_empty() {
        out.push_str(&format!(
            "verdict: ok (tokenizer threshold {}%)\n",
            d.threshold_pct
        ));
    } else {
        out.push_str(&format!(
            "verdict: BLOCKING, the tokenizer changed beyond the threshold ({}%):\n",
            d.threshold_pct
        ));
        for r in &d.blocking {
            out.push_str(&format!("  - {r}\n"));
        }
    }
    out
}

fn remove(repo: &Repository, model: &str) -> Result<ExitCode> {
    let version = versioned(repo, model)?;
    repo.remove(&version)?;
    println!("removed {version} ({})", version.dir.display());
    Ok(ExitCode::SUCCESS)
}
