//! Loading a model version into a registry entry: which models to load, the version's digests
//! verified, the backend its kind needs (a language model on the engine, an embedder, a tensor
//! model on its runtime, a rules model), its breaker, its fallback chain with its canned answers
//! and tensor twins, and what it takes in memory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{Engine, EngineOptions, KvMemory};
use repo::{ModelRef, Repository};

use crate::admission::Admission;
use crate::backend::canned::CannedBackend;
use crate::backend::embedding::EmbeddingBackend;
use crate::backend::llm::LlmBackend;
use crate::backend::rules::RulesBackend;
use crate::backend::tensor::TensorBackend;
use crate::breaker::BreakerConfig;
use crate::chain::{Policy, Step, Target};
use crate::config::{ModelConfig, ServerConfig};
use crate::registry::{Entry, LoadError, ModelName};

/// What to load: the configured models, or every LLM, embedding, tensor and rules model in the
/// repository at the version its name serves (its stable alias, or its only version).
pub fn models_to_load(
    config: &ServerConfig,
    repository: &Repository,
) -> Result<Vec<ModelConfig>, LoadError> {
    if !config.models.is_empty() {
        return Ok(config.models.clone());
    }
    let models = repository
        .models()
        .map_err(|e| LoadError::new("repository", e))?;
    let mut out = Vec::new();
    // The guard's classifier is the guard's, not a served model.
    let guard_classifier = config
        .guard
        .classifier
        .as_deref()
        .map(|c| c.split('@').next().unwrap_or(c));
    for name in models {
        if Some(name.as_str()) == guard_classifier {
            continue;
        }
        let reference = ModelRef {
            name: name.clone(),
            version: None,
        };
        let version = match repository.resolve(&reference) {
            Ok(v) => v,
            // Several versions and no stable one: it is not guessed; loading it by name
            // fails with the reason and the way out, which readiness gives.
            Err(repo::RepoError::NoStable { .. } | repo::RepoError::StableBroken { .. }) => {
                out.push(ModelConfig::named(name));
                continue;
            }
            Err(_) => continue,
        };
        let Ok(manifest) = repository.manifest(&version) else {
            continue;
        };
        // LLMs, the embedding models the BERT embedder runs (safetensors folders; ONNX
        // embedders without a declared tokenizer are not served and would only keep readiness
        // at 503), and ONNX tensor models.
        let servable = match manifest.model.kind {
            repo::manifest::Kind::Llm
            | repo::manifest::Kind::Onnx
            | repo::manifest::Kind::Rules => true,
            repo::manifest::Kind::Embedding => {
                manifest.model.format == repo::manifest::Format::Safetensors
            }
        };
        if servable {
            out.push(ModelConfig::named(name));
        }
    }
    Ok(out)
}

/// The repository reference a configured model names.
fn model_ref(model: &ModelConfig) -> Result<ModelRef, LoadError> {
    let version = match &model.version {
        Some(v) => Some(
            semver::Version::parse(v)
                .map_err(|e| LoadError::new(&model.name, format!("version {v:?}: {e}")))?,
        ),
        None => None,
    };
    Ok(ModelRef {
        name: model.name.clone(),
        version,
    })
}

/// The kind of a model to load (by its manifest).
pub fn model_kind(repository: &Repository, model: &ModelConfig) -> Result<repo::Kind, LoadError> {
    let reference = model_ref(model)?;
    let version = repository
        .resolve(&reference)
        .map_err(|e| LoadError::new(&model.name, e))?;
    let manifest = repository
        .manifest(&version)
        .map_err(|e| LoadError::new(&model.name, e))?;
    Ok(manifest.model.kind)
}

/// The version a configured model names, its digests verified, and its version digest.
fn load_verified(
    repository: &Repository,
    model: &ModelConfig,
) -> Result<(repo::LoadedVersion, String), LoadError> {
    let reference = model_ref(model)?;
    let loaded = repository
        .load(&reference, &repo::NoProgress)
        .map_err(|e| LoadError::new(&model.name, e))?;
    let digest = repository
        .digests(&loaded.version)
        .map(|d| format!("sha256:{}", d.version_digest()))
        .map_err(|e| LoadError::new(&model.name, e))?;
    Ok((loaded, digest))
}

/// Bytes of a model version's files (what its weights take once mapped and read); 0 when the
/// repository cannot say.
pub fn files_bytes(repository: &Repository, model: &ModelConfig) -> u64 {
    let Ok(reference) = model_ref(model) else {
        return 0;
    };
    repository
        .resolve(&reference)
        .and_then(|v| repository.manifest(&v))
        .map_or(0, |m| m.model.size_bytes)
}

/// Loads one model of whatever kind its manifest says (digests verified by the repository
/// first), ready to be served.
pub fn load(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    prepare: &crate::lane::Lane,
) -> Result<Entry, LoadError> {
    let started = Instant::now();
    let kind = model_kind(repository, model).unwrap_or(repo::Kind::Llm);
    let entry = match kind {
        repo::Kind::Onnx => load_tensor_model(config, repository, model)?,
        repo::Kind::Embedding => load_embedder(config, repository, model, prepare)?,
        repo::Kind::Llm => load_llm(config, repository, model, prepare)?,
        repo::Kind::Rules => load_rules(config, repository, model)?,
    };
    let policy = policy(config, repository, model, &entry)?;
    let entry = entry.with_policy(policy);
    let memory = files_bytes(repository, model)
        + entry
            .engine
            .as_ref()
            .map_or(0, |e| e.kv_capacity().bytes() as u64);
    entry
        .memory_bytes
        .store(memory, std::sync::atomic::Ordering::Relaxed);
    entry.cold.store(
        model.residency == crate::config::Residency::Cold,
        std::sync::atomic::Ordering::Relaxed,
    );
    let d = entry.backend.describe();
    tracing::info!(
        model = %entry.name,
        version = %entry.version,
        digest = %entry.digest,
        kind = ?entry.kind(),
        platform = %d.platform,
        context = d.max_context,
        seconds = started.elapsed().as_secs_f64(),
        "model loaded (digests verified)"
    );
    Ok(entry)
}

fn entry(
    config: &ServerConfig,
    model: &ModelConfig,
    version: &repo::ModelVersion,
    digest: String,
    backend: impl crate::backend::InferenceBackend,
) -> Entry {
    let mut entry = Entry::new(
        model.name.clone(),
        version.version.to_string(),
        digest,
        Admission::new(config.admission.clone()),
        Arc::new(backend),
    )
    .with_breaker(breaker_config(config, model));
    if let Ok(lineage) = repo::Lineage::read(&version.dir) {
        entry.lineage_commit = lineage.git_commit;
        entry.dataset_version = lineage.dataset_version;
    }
    entry
}

/// The server's breaker settings, with the model's latency objective as its slow-call limit.
fn breaker_config(config: &ServerConfig, model: &ModelConfig) -> BreakerConfig {
    BreakerConfig {
        slow_call: model.latency_objective_ms.map(Duration::from_millis),
        ..BreakerConfig::from(&config.breaker)
    }
}

/// A model's fallback chain and timeouts; its canned answers and tensor twins are loaded here.
fn policy(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    entry: &Entry,
) -> Result<Policy, LoadError> {
    let mut steps = Vec::with_capacity(model.fallback.len());
    for step in &model.fallback {
        let target = if let Some(name) = &step.model {
            Target::Model(ModelName::parse(name))
        } else if let Some(text) = &step.canned {
            let backend = CannedBackend::new(text.clone(), step.languages.clone());
            let own = Entry::new(
                model.name.clone(),
                "canned",
                format!("sha256:{}", record::sha256_hex(text)),
                Admission::new(config.admission.clone()),
                Arc::new(backend),
            )
            .with_id(format!("canned:{}", model.name))
            .with_breaker(BreakerConfig::from(&config.breaker));
            Target::Own(Arc::new(own))
        } else if let Some(choice) = step.tensor_backend {
            if entry.kind() != crate::backend::Kind::Tensor {
                return Err(LoadError::new(
                    &model.name,
                    "a tensor_backend fallback needs a tensor (ONNX) model",
                ));
            }
            // The primary's load verified these files a moment ago: read, don't re-hash.
            let version = repository
                .resolve(&model_ref(model)?)
                .map_err(|e| LoadError::new(&model.name, e))?;
            let manifest = repository
                .manifest(&version)
                .map_err(|e| LoadError::new(&model.name, e))?;
            let twin = tensor_entry(
                config,
                model,
                &version,
                &manifest,
                entry.digest.clone(),
                choice,
            )?;
            let runtime = twin.backend.describe().platform;
            let id = format!("{}:{}", entry.id, runtime.trim_start_matches("onnx_"));
            Target::Own(Arc::new(twin.with_id(id)))
        } else {
            return Err(LoadError::new(
                &model.name,
                "a fallback step names no target",
            ));
        };
        steps.push(Step {
            target,
            on: step.triggers(),
        });
    }
    Ok(Policy {
        steps,
        first_token_timeout: Duration::from_millis(model.first_token_timeout_ms),
        stall_timeout: Duration::from_millis(model.stall_timeout_ms),
    })
}

/// Loads one tensor model (digests verified) and starts its batcher.
fn load_tensor_model(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
) -> Result<Entry, LoadError> {
    let (loaded, digest) = load_verified(repository, model)?;
    tensor_entry(
        config,
        model,
        &loaded.version,
        &loaded.manifest,
        digest,
        config.tensor.backend,
    )
}

/// A tensor model of a verified version on `runtime`, its batcher started.
fn tensor_entry(
    config: &ServerConfig,
    model: &ModelConfig,
    version: &repo::ModelVersion,
    manifest: &repo::Manifest,
    digest: String,
    runtime: classic::BackendChoice,
) -> Result<Entry, LoadError> {
    let options = classic::LoadOptions {
        backend: runtime,
        onnxruntime_library: config.tensor.onnxruntime_library.clone(),
        threads: config.tensor.threads,
        max_input_elements: config.limits.max_tensor_elements,
    };
    let mut tensor_model = classic::TensorModel::load(&version.dir, manifest, &options)
        .map_err(|e| LoadError::new(&model.name, e))?;
    tensor_model.observe_images = config
        .monitor
        .enabled
        .then_some(monitor::features::image as classic::ImageFeatures);
    tracing::info!(
        model = %model.name,
        backend = tensor_model.backend(),
        max_batch_size = tensor_model.max_batch_size(),
        "tensor model ready"
    );
    let backend = TensorBackend::new(model.name.clone(), tensor_model);
    Ok(entry(config, model, version, digest, backend))
}

/// Loads one rules model: its rules file, compiled by the rules engine.
fn load_rules(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
) -> Result<Entry, LoadError> {
    let (loaded, digest) = load_verified(repository, model)?;
    let file = loaded
        .manifest
        .model
        .weights
        .first()
        .ok_or_else(|| LoadError::new(&model.name, "the manifest names no rules file"))?;
    let path = loaded.version.dir.join(file);
    let text = std::fs::read_to_string(&path)
        .map_err(|e| LoadError::new(&model.name, format!("{}: {e}", path.display())))?;
    let engine =
        guard::RulesEngine::from_toml(&text).map_err(|e| LoadError::new(&model.name, e))?;
    tracing::info!(
        model = %model.name,
        labels = engine.labels().len(),
        "rules model ready"
    );
    let backend = RulesBackend::new(model.name.clone(), engine, config.limits.max_grammar_bytes);
    Ok(entry(config, model, &loaded.version, digest, backend))
}

/// Loads one embedding model: the version folder is a sentence-transformers folder.
fn load_embedder(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    prepare: &crate::lane::Lane,
) -> Result<Entry, LoadError> {
    let (loaded, digest) = load_verified(repository, model)?;
    let mut options = engine::EmbedderOptions::default();
    if let Some(threads) = config.threads {
        options.threads = threads.max(1);
    }
    let embedder = engine::Embedder::load_with(&loaded.version.dir, &options)
        .map_err(|e| LoadError::new(&model.name, e))?;
    let backend =
        EmbeddingBackend::new(model.name.clone(), embedder).with_prepare_lane(prepare.clone());
    tracing::info!(
        model = %model.name,
        dimensions = backend.dimensions(),
        max_seq_len = backend.max_seq_len(),
        "embedding model ready"
    );
    Ok(entry(config, model, &loaded.version, digest, backend))
}

/// Loads one language model onto an engine.
fn load_llm(
    config: &ServerConfig,
    repository: &Repository,
    model: &ModelConfig,
    prepare: &crate::lane::Lane,
) -> Result<Entry, LoadError> {
    let fail = |e: &dyn std::fmt::Display| LoadError::new(&model.name, e);
    let reference = model_ref(model)?;
    let mut options = EngineOptions {
        context: model.context,
        ..EngineOptions::default()
    };
    if let Some(threads) = config.threads {
        options.threads = threads.max(1);
    }
    if let Some(memory) = &model.kv_cache_memory {
        options.kv.memory = memory
            .parse::<KvMemory>()
            .map_err(|e| fail(&format!("kv_cache_memory: {e}")))?;
    }
    if let Some(dtype) = &model.kv_cache_dtype {
        options.kv.dtype = dtype
            .parse()
            .map_err(|e| fail(&format!("kv_cache_dtype: {e}")))?;
    }
    if let Some(n) = model.max_num_seqs {
        options.scheduler.max_num_seqs = n;
    }
    if let Some(n) = model.max_num_batched_tokens {
        options.scheduler.max_num_batched_tokens = n;
    }
    let speculation = &mut options.scheduler.speculation;
    speculation.max_draft = model.speculative_tokens.unwrap_or(0);
    speculation.ngram_max = model.prompt_lookup_max.unwrap_or(speculation.ngram_max);
    speculation.ngram_min = model.prompt_lookup_min.unwrap_or(speculation.ngram_min);
    if let Some(spec) = &model.quantization {
        options.quantization = Some(
            engine::convert::InSitu::from_spec(spec, model.quantization_cache_dir.clone())
                .map_err(|e| fail(&format!("quantization: {e}")))?,
        );
    }
    // The server's admission bounds what reaches the engine; the engine's own queue must hold it.
    options.scheduler.max_waiting = options
        .scheduler
        .max_waiting
        .max(config.admission.max_in_flight * config.limits.max_n * config.limits.max_prompts);
    let version = repository.resolve(&reference).map_err(|e| fail(&e))?;
    let digest = repository
        .digests(&version)
        .map(|d| format!("sha256:{}", d.version_digest()))
        .map_err(|e| fail(&e))?;
    let engine = Engine::from_repository(repository, &reference, &options).map_err(|e| fail(&e))?;
    let limits = &config.limits;
    let grammar = grammar::Compiler::new(
        engine.shared_tokenizer(),
        grammar::GrammarLimits {
            max_bytes: limits.max_grammar_bytes,
            max_compile: Duration::from_millis(limits.grammar_compile_timeout_ms),
            cache_entries: limits.grammar_cache_entries,
        },
    )
    .map_err(|e| fail(&e))?;
    tracing::info!(
        model = %model.name,
        context = engine.context(),
        kv_tokens = engine.kv_capacity().tokens(),
        "language model ready"
    );
    let engine = Arc::new(engine);
    let backend = LlmBackend::new(
        Arc::clone(&engine),
        Arc::new(grammar),
        model.entropy_band,
        limits.default_max_tokens,
        Duration::from_secs(config.stall_timeout_s.max(1)),
    )
    .with_parse_special_tokens(model.parse_special_tokens)
    .with_tool_format(
        model
            .tool_format
            .as_deref()
            .and_then(grammar::tools::ToolFormat::parse),
    )
    .with_prepare_lane(prepare.clone());
    Ok(entry(config, model, &version, digest, backend).with_engine(engine))
}
