//! Choosing and loading a model for the engine commands (`generate`, `bench`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::kv_tier::TierConfig;
use engine::{Engine, EngineOptions, KvDType, KvMemory, KvOptions, SchedulerOptions};
use repo::{ModelRef, Repository};

/// Which model, from where, on how many threads.
#[derive(Debug, clap::Args)]
pub struct ModelChoice {
    /// NAME[@VERSION] in the repository (digests are verified before loading), or a path to a
    /// .gguf file or to a Hugging Face checkpoint folder (config.json, safetensors,
    /// tokenizer.json).
    #[arg(long, short = 'm')]
    pub model: String,
    /// The model repository folder.
    #[arg(
        long,
        env = "RAMPART_REPO",
        default_value = "models",
        value_name = "DIR"
    )]
    pub repo: PathBuf,
    /// Compute threads (default: physical cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Quantize the weights at load ("in situ"): a type (Q8_0, Q6_K, Q5_K, Q4_K, Q4_0, …) or a
    /// plan file; the result is cached in ~/.cache/rampart/quantized.
    #[arg(long, value_name = "TYPE|PLAN")]
    pub quantize: Option<String>,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// The KV cache and the scheduler's limits (docs/engine.md describes each).
#[derive(Debug, Clone, clap::Args)]
pub struct KvArgs {
    /// Size of the KV block pool: bytes (with KiB/MiB/GiB) or a fraction of available memory.
    #[arg(long, default_value = "0.2", value_name = "SIZE|FRACTION", value_parser = parse_kv_memory)]
    pub kv_cache_memory: KvMemory,
    /// Element type of cached keys and values: f32, f16 or q8_0.
    #[arg(long, default_value = "f16", value_parser = parse_kv_dtype)]
    pub kv_cache_dtype: KvDType,
    /// Token slots per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Do not keep finished sequences' blocks for reuse by later prompts.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Host memory for KV blocks moved out of the pool (preempted sequences, evicted prefixes);
    /// 0 turns the tier off and preemption recomputes.
    #[arg(long, default_value = "0", value_name = "SIZE", value_parser = parse_bytes)]
    pub kv_tier_memory: u64,
    /// Size of the on-disk KV tier file (0: none).
    #[arg(long, default_value = "0", value_name = "SIZE", value_parser = parse_bytes)]
    pub kv_tier_disk: u64,
    /// Folder of the on-disk tier file (default: the temporary folder).
    #[arg(long, value_name = "DIR")]
    pub kv_tier_dir: Option<PathBuf>,
    /// Most sequences decoding together.
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Most tokens (decode tokens + prompt chunks) in one forward pass.
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Most requests waiting for admission.
    #[arg(long, default_value_t = 1024)]
    pub max_waiting: usize,
    /// Prompt lookup (speculative decoding without a draft model): most tokens guessed per
    /// step from earlier occurrences of a sequence's last tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub speculative_tokens: usize,
    /// The longest n-gram prompt lookup matches.
    #[arg(long, default_value_t = 4)]
    pub prompt_lookup_max: usize,
    /// The shortest n-gram prompt lookup matches.
    #[arg(long, default_value_t = 2)]
    pub prompt_lookup_min: usize,
}

impl KvArgs {
    /// The flags' defaults with a small pool, for commands that only tokenize.
    pub fn small() -> Self {
        Self {
            kv_cache_memory: KvMemory::Bytes(16 << 20),
            kv_cache_dtype: KvDType::F16,
            block_size: 16,
            no_prefix_caching: false,
            kv_tier_memory: 0,
            kv_tier_disk: 0,
            kv_tier_dir: None,
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            max_waiting: 1024,
            speculative_tokens: 0,
            prompt_lookup_max: 4,
            prompt_lookup_min: 2,
        }
    }
}

fn parse_kv_memory(text: &str) -> Result<KvMemory, String> {
    text.parse::<KvMemory>().map_err(|e| e.to_string())
}

fn parse_kv_dtype(text: &str) -> Result<KvDType, String> {
    text.parse::<KvDType>().map_err(|e| e.to_string())
}

fn parse_bytes(text: &str) -> Result<u64, String> {
    match text.parse::<KvMemory>().map_err(|e| e.to_string())? {
        KvMemory::Bytes(b) => Ok(b),
        KvMemory::Fraction(_) => Err(format!("{text:?}: a size is needed here, not a fraction")),
    }
}

impl KvArgs {
    /// The engine options these flags describe.
    pub fn apply(&self, options: &mut EngineOptions) {
        options.kv = KvOptions {
            block_tokens: self.block_size,
            dtype: self.kv_cache_dtype,
            memory: self.kv_cache_memory,
            prefix_caching: !self.no_prefix_caching,
            tier: TierConfig {
                host_bytes: self.kv_tier_memory as usize,
                disk_bytes: self.kv_tier_disk as usize,
                disk_dir: self.kv_tier_dir.clone(),
            },
        };
        options.scheduler = SchedulerOptions {
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_waiting: self.max_waiting,
            speculation: engine::speculation::Speculation {
                max_draft: self.speculative_tokens,
                ngram_max: self.prompt_lookup_max,
                ngram_min: self.prompt_lookup_min,
                ..Default::default()
            },
            ..SchedulerOptions::default()
        };
    }
}

impl ModelChoice {
    /// Loads the engine with a context of at least `context` positions.
    pub fn load(&self, context: Option<usize>) -> Result<Engine> {
        let mut options = EngineOptions {
            threads: self
                .threads
                .unwrap_or_else(kernels::backend::physical_cores)
                .max(1),
            context,
            ..EngineOptions::default()
        };
        self.kv.apply(&mut options);
        if let Some(spec) = &self.quantize {
            options.quantization = Some(engine::convert::InSitu::from_spec(spec, None)?);
        }
        let path = PathBuf::from(&self.model);
        let gguf_file = path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
            && path.is_file();
        let hf_folder = path.is_dir() && path.join("config.json").is_file();
        if gguf_file || hf_folder {
            return Engine::load(&path, &options)
                .with_context(|| format!("loading {}", path.display()));
        }
        let model: ModelRef = self.model.parse()?;
        let repository = Repository::open(&self.repo);
        Engine::from_repository(&repository, &model, &options)
            .with_context(|| format!("loading {model} from {}", self.repo.display()))
    }
}
