//! `rampart model quantize` (a model through a quantization plan into a new repository version)
//! and `rampart model evaluate` (perplexity, size, memory and speed of versions side by side).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{bail, Context, Result};
use engine::bench::{median, perplexity, throughput};
use engine::convert::{quantize_model, QuantPlan, QuantizeSummary};
use engine::EngineOptions;
use indicatif::{ProgressBar, ProgressStyle};
use repo::{Derivation, ImportOptions, ModelRef, Repository};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::render::{bytes, table};
use crate::{build_info, progress_bar};

/// Where a model comes from: a GGUF file, or a repository version (digests verified).
struct Source {
    label: String,
    path: PathBuf,
    sha256: String,
}

fn resolve(repo: &Repository, model: &str) -> Result<Source> {
    let path = PathBuf::from(model);
    if path.is_dir() {
        // A Hugging Face folder: named by the digest of its files, as an import would name it.
        let mut digests = repo::Digests {
            files: Default::default(),
        };
        for entry in repo::digests::walk(&path, true)? {
            if entry.regular {
                let (sha256, _) = repo::digests::hash_file(&entry.path, &repo::NoProgress)?;
                digests.files.insert(entry.relative, sha256);
            }
        }
        return Ok(Source {
            label: path.display().to_string(),
            path,
            sha256: digests.version_digest(),
        });
    }
    if path.is_file() {
        let (sha256, _) = repo::digests::hash_file(&path, &repo::NoProgress)
            .with_context(|| format!("hashing {}", path.display()))?;
        return Ok(Source {
            label: path.display().to_string(),
            path,
            sha256,
        });
    }
    let reference: ModelRef = model
        .parse()
        .with_context(|| format!("{model:?} is neither a file nor NAME[@VERSION]"))?;
    let loaded = repo
        .load(&reference, &repo::NoProgress)
        .with_context(|| format!("loading {reference}"))?;
    let m = &loaded.manifest.model;
    let path = if m.format == repo::Format::Safetensors {
        // A Hugging Face checkpoint: the version folder holds config, shards and tokenizer.
        loaded.version.dir.clone()
    } else {
        let weights = m
            .weights
            .iter()
            .find(|w| w.ends_with(".gguf"))
            .with_context(|| format!("{} has no GGUF or safetensors weights", loaded.version))?;
        loaded.version.dir.join(weights)
    };
    Ok(Source {
        label: loaded.version.to_string(),
        path,
        sha256: loaded.version_digest.clone(),
    })
}

#[allow(clippy::too_many_arguments)]
pub fn quantize(
    repo_dir: &Path,
    source: &str,
    plan: Option<PathBuf>,
    dtype: Option<String>,
    name: String,
    version: String,
    threads: Option<usize>,
    json_out: bool,
) -> Result<ExitCode> {
    let repo = Repository::open(repo_dir);
    let plan = match (&plan, &dtype) {
        (Some(path), None) => QuantPlan::parse(
            &std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?,
        )
        .with_context(|| format!("in {}", path.display()))?,
        (None, Some(t)) => QuantPlan::parse(&format!("default = {t:?}"))?,
        (None, None) => {
            bail!("give a plan (--plan FILE) or one type for every matrix (--type Q4_K)")
        }
        (Some(_), Some(_)) => bail!("give either --plan or --type, not both"),
    };
    let src = resolve(&repo, source)?;
    let work = tempfile::tempdir().context("creating a working folder")?;
    let out = work.path().join(format!("{name}-{version}.gguf"));
    let threads = threads
        .unwrap_or_else(kernels::backend::physical_cores)
        .max(1);
    let bar = if !json_out && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("{msg:40!} [{bar:30}] {pos}/{len} tensors {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        Some(bar)
    } else {
        None
    };
    let summary = quantize_model(&src.path, &plan, &out, threads, &mut |i, n, t| {
        if let Some(bar) = &bar {
            bar.set_length(n as u64);
            bar.set_position(i as u64 + 1);
            bar.set_message(format!("{} → {}", t.name, t.written));
        }
    })
    .with_context(|| format!("quantizing {}", src.label))?;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let progress = progress_bar::for_stderr(json_out);
    let options = ImportOptions {
        name,
        version,
        kind: Some(repo::Kind::Llm),
        link: false,
        git_commit: None,
        dataset_version: None,
        derived_from: Some(Derivation {
            model: src.label.clone(),
            sha256: src.sha256.clone(),
            operation: "quantize".into(),
            parameters: plan.to_toml(),
        }),
        pipeline: None,
        build: build_info(),
        progress: progress.as_ref(),
        rules_check: Some(|text| Ok(guard::check_rules_file(text)?)),
        host_fingerprint: crate::host_fingerprint(),
        card: None,
        stable: false,
    };
    let loaded = repo
        .import(&out, &options)
        .context("importing the quantized model")?;
    report(&summary, &src, &loaded.version.to_string(), json_out)?;
    Ok(ExitCode::SUCCESS)
}

fn report(summary: &QuantizeSummary, src: &Source, version: &str, json_out: bool) -> Result<()> {
    let mut by_type: std::collections::BTreeMap<String, (usize, u64)> = Default::default();
    for t in &summary.tensors {
        let e = by_type.entry(t.written.clone()).or_default();
        e.0 += 1;
        e.1 += t.bytes;
    }
    let fallbacks: Vec<_> = summary
        .tensors
        .iter()
        .filter(|t| t.wanted != t.written && t.shape.iter().filter(|&&d| d > 1).count() >= 2)
        .collect();
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": version,
                "source": src.label,
                "source_sha256": src.sha256,
                "source_bytes": summary.source_bytes,
                "output_bytes": summary.output_bytes,
                "parameters": summary.parameters,
                "types": by_type.iter().map(|(t, (n, b))| json!({"type": t, "tensors": n, "bytes": b})).collect::<Vec<_>>(),
                "unused_rules": summary.unused_rules,
                "tensors": summary.tensors,
            }))?
        );
        return Ok(());
    }
    println!(
        "quantized {} ({}) into {version}: {} → {}",
        src.label,
        &src.sha256[..12.min(src.sha256.len())],
        bytes(summary.source_bytes),
        bytes(summary.output_bytes)
    );
    let rows: Vec<Vec<String>> = by_type
        .iter()
        .map(|(t, (n, b))| vec![t.clone(), n.to_string(), bytes(*b)])
        .collect();
    print!("{}", table(&["type", "tensors", "bytes"], &rows));
    if !fallbacks.is_empty() {
        println!(
            "{} tensors got another type because their rows ({} values) do not fit the asked type's blocks (as llama.cpp does):",
            fallbacks.len(),
            fallbacks[0].shape[0]
        );
        let mut seen = std::collections::BTreeMap::new();
        for t in &fallbacks {
            *seen
                .entry(format!("{} → {}", t.wanted, t.written))
                .or_insert(0) += 1;
        }
        for (k, n) in seen {
            println!("  {k}: {n} tensors");
        }
    }
    for r in &summary.unused_rules {
        println!("warning: rule {r:?} matched no tensor");
    }
    Ok(())
}

/// One version's measurements (a child process measures each, so resident memory is its own).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Evaluation {
    pub model: String,
    /// The weights' dominant type by bytes and its share.
    pub weights: String,
    pub size_bytes: u64,
    /// Peak resident memory of the process that loaded the model and ran the measurements.
    pub peak_rss_bytes: u64,
    pub perplexity: f64,
    pub ppl_chunks: usize,
    pub ppl_context: usize,
    pub decode_tokens_per_second: f64,
}

fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

fn weights_summary(path: &Path) -> (String, u64) {
    if path.is_dir() {
        let size = repo::digests::walk(path, true)
            .map(|entries| {
                entries
                    .iter()
                    .filter(|e| e.relative.ends_with(".safetensors"))
                    .filter_map(|e| std::fs::metadata(&e.path).ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        return ("safetensors".into(), size);
    }
    let Ok(file) = formats::gguf::GgufFile::open(path) else {
        return ("?".into(), 0);
    };
    let mut by_type: std::collections::HashMap<String, u64> = Default::default();
    let mut total = 0;
    for t in &file.header().tensors {
        *by_type.entry(format!("{:?}", t.ggml_type)).or_default() += t.size_bytes;
        total += t.size_bytes;
    }
    let top = by_type.into_iter().max_by_key(|e| e.1);
    let size = std::fs::metadata(path).map(|m| m.len()).unwrap_or(0);
    match top {
        Some((t, b)) => (
            format!("{t} {:.0}%", 100.0 * b as f64 / total.max(1) as f64),
            size,
        ),
        None => ("?".into(), size),
    }
}

/// Measures one model in this process (the hidden `evaluate-one` command).
pub fn evaluate_one(
    repo_dir: &Path,
    model: &str,
    text: &Path,
    ctx: usize,
    chunks: usize,
    gen_tokens: usize,
    threads: Option<usize>,
) -> Result<ExitCode> {
    let repo = Repository::open(repo_dir);
    let src = resolve(&repo, model)?;
    let text =
        std::fs::read_to_string(text).with_context(|| format!("reading {}", text.display()))?;
    let options = EngineOptions {
        threads: threads
            .unwrap_or_else(kernels::backend::physical_cores)
            .max(1),
        context: Some(ctx.max(gen_tokens + 1)),
        ..EngineOptions::default()
    };
    let engine = engine::Engine::load(&src.path, &options)
        .with_context(|| format!("loading {}", src.label))?;
    let ppl = perplexity(&engine, &text, ctx, chunks)?;
    let tg = throughput(&engine, 0, gen_tokens, 3)?;
    let (weights, size_bytes) = weights_summary(&src.path);
    let e = Evaluation {
        model: src.label,
        weights,
        size_bytes,
        peak_rss_bytes: peak_rss(),
        perplexity: ppl.perplexity,
        ppl_chunks: ppl.chunks,
        ppl_context: ppl.context,
        decode_tokens_per_second: median(&tg.decode_tps),
    };
    println!("{}", serde_json::to_string(&e)?);
    Ok(ExitCode::SUCCESS)
}

#[allow(clippy::too_many_arguments)]
pub fn evaluate(
    repo_dir: &Path,
    models: &[String],
    baseline: Option<&str>,
    text: &Path,
    ctx: usize,
    chunks: usize,
    gen_tokens: usize,
    threads: Option<usize>,
    json_out: bool,
) -> Result<ExitCode> {
    if models.is_empty() {
        bail!("name at least one model to evaluate");
    }
    let mut order: Vec<String> = Vec::new();
    if let Some(b) = baseline {
        order.push(b.to_string());
    }
    for m in models {
        if !order.contains(m) {
            order.push(m.clone());
        }
    }
    let exe = std::env::current_exe().context("finding the rampart binary")?;
    let mut results = Vec::new();
    for m in &order {
        if !json_out {
            eprintln!("evaluating {m} …");
        }
        let mut cmd = Command::new(&exe);
        cmd.arg("model")
            .arg("--repo")
            .arg(repo_dir)
            .arg("evaluate-one")
            .arg(m)
            .arg("--text")
            .arg(text)
            .arg("--ctx")
            .arg(ctx.to_string())
            .arg("--chunks")
            .arg(chunks.to_string())
            .arg("--gen-tokens")
            .arg(gen_tokens.to_string());
        if let Some(t) = threads {
            cmd.arg("--threads").arg(t.to_string());
        }
        let out = cmd.output().with_context(|| format!("measuring {m}"))?;
        if !out.status.success() {
            bail!(
                "measuring {m} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let e: Evaluation = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("reading the measurement of {m}"))?;
        results.push(e);
    }
    let base = baseline.map(|_| results[0].perplexity);
    if json_out {
        let rows: Vec<_> = results
            .iter()
            .map(|e| {
                let mut v = serde_json::to_value(e).unwrap_or_default();
                if let (Some(b), Some(obj)) = (base, v.as_object_mut()) {
                    obj.insert("ppl_delta".into(), json!(e.perplexity - b));
                    obj.insert(
                        "ppl_delta_pct".into(),
                        json!(100.0 * (e.perplexity / b - 1.0)),
                    );
                }
                v
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "text": text,
                "ctx": ctx,
                "baseline": baseline,
                "results": rows,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|e| {
            let delta = match base {
                Some(b) => format!(
                    "{:+.4} ({:+.2}%)",
                    e.perplexity - b,
                    100.0 * (e.perplexity / b - 1.0)
                ),
                None => "-".into(),
            };
            vec![
                e.model.clone(),
                e.weights.clone(),
                bytes(e.size_bytes),
                bytes(e.peak_rss_bytes),
                format!("{:.4}", e.perplexity),
                delta,
                format!("{:.1}", e.decode_tokens_per_second),
            ]
        })
        .collect();
    print!(
        "{}",
        table(
            &[
                "model",
                "weights",
                "size",
                "peak RSS",
                "perplexity",
                "Δ baseline",
                "decode tok/s"
            ],
            &rows
        )
    );
    if let Some(e) = results.first() {
        println!(
            "perplexity over {} chunks of {} tokens of {}",
            e.ppl_chunks,
            e.ppl_context,
            text.display()
        );
    }
    Ok(ExitCode::SUCCESS)
}
