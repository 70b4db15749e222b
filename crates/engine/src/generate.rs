//! The engine API: load a model, then submit requests and read each one's stream of token events.
//!
//! Each engine owns one OS thread that runs the [`crate::scheduler`]: all submitted sequences are
//! batched together, step by step, over a paged KV cache. Requests reach that thread through a
//! channel; events come back through one unbounded channel per request (bounded in practice by
//! the request's `max_tokens`). Dropping a [`Stream`] cancels its sequence: its blocks are freed
//! at the next step.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use kernels::{Backend, CpuBackend, KvDType};
use repo::manifest::{Format, Kind};
use repo::{ModelRef, NoProgress, Repository};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::block_pool::BlockPool;
use crate::chat::{ChatMessage, ChatTemplate};
use crate::constraint::Constraint;
use crate::error::EngineError;
use crate::explain::AttentionRequest;
use crate::kv_store::{KvLayout, KvStore, SequenceCache};
use crate::kv_tier::{KvTier, TierConfig};
use crate::model::{Batch, ForwardState, LogitRows, Model, ModelConfig, WeightFormat};
use crate::reservations::Claim;
use crate::sampler::{Sampler, SamplingParams};
use crate::scheduler::{
    Executor, Forwarded, LatencySamples, NewSequence, Scheduler, SchedulerConfig, SchedulerHandles,
    SchedulerLimits, SchedulerSnapshot,
};
use crate::tokenizer::Tokenizer;
use kernels::paged::Attended;

/// How much memory the KV block pool takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KvMemory {
    /// A number of bytes.
    Bytes(u64),
    /// A share of the memory available when the engine starts (0 < f ≤ 1).
    Fraction(f64),
}

/// Text that is neither a size nor a fraction in (0, 1] (see [`KvMemory`]'s `FromStr`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{text:?} is neither a size (bytes, or with KiB/MiB/GiB/KB/MB/GB) nor a fraction in (0, 1]"
)]
pub struct ParseKvMemoryError {
    pub text: String,
}

impl std::str::FromStr for KvMemory {
    type Err = ParseKvMemoryError;

    /// `"2GiB"`, `"512MiB"`, `"1500000000"`, or a fraction like `"0.3"`.
    fn from_str(text: &str) -> Result<Self, ParseKvMemoryError> {
        let t = text.trim();
        let bad = || ParseKvMemoryError {
            text: text.to_string(),
        };
        if t.contains('.') && t.chars().all(|c| c.is_ascii_digit() || c == '.') {
            let f: f64 = t.parse().map_err(|_| bad())?;
            return if f > 0.0 && f <= 1.0 {
                Ok(KvMemory::Fraction(f))
            } else {
                Err(bad())
            };
        }
        let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
        let value: u64 = t[..digits].parse().map_err(|_| bad())?;
        let unit: u64 = match t[digits..].trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kib" => 1 << 10,
            "mib" => 1 << 20,
            "gib" => 1 << 30,
            "kb" | "k" => 1_000,
            "mb" | "m" => 1_000_000,
            "gb" | "g" => 1_000_000_000,
            _ => return Err(bad()),
        };
        value.checked_mul(unit).map(KvMemory::Bytes).ok_or_else(bad)
    }
}

/// The KV cache of the serving path.
#[derive(Debug, Clone)]
pub struct KvOptions {
    /// Token slots per block.
    pub block_tokens: usize,
    /// Element type of keys and values.
    pub dtype: KvDType,
    /// Size of the block pool. It always holds at least one full-context sequence, and never
    /// more than `max_num_seqs` of them.
    pub memory: KvMemory,
    /// Keep full blocks after their sequences end and share them with later prompts.
    pub prefix_caching: bool,
    /// The second tier (off by default: preemption recomputes).
    pub tier: TierConfig,
}

impl Default for KvOptions {
    fn default() -> Self {
        Self {
            block_tokens: 16,
            dtype: KvDType::F16,
            memory: KvMemory::Fraction(0.2),
            prefix_caching: true,
            tier: TierConfig::default(),
        }
    }
}

/// The batching limits of the serving path.
#[derive(Debug, Clone)]
pub struct SchedulerOptions {
    /// Most sequences in one step.
    pub max_num_seqs: usize,
    /// Most tokens (decode tokens + prefill chunks) in one step.
    pub max_num_batched_tokens: usize,
    /// Most prompt tokens in one step, after every running stream's decode token (none: only
    /// `max_num_batched_tokens` bounds them).
    pub max_prefill_tokens: Option<usize>,
    /// Most requests waiting for admission; more are refused with [`EngineError::QueueFull`].
    pub max_waiting: usize,
    /// Share of the pool kept free when admitting a new sequence.
    pub watermark: f64,
    /// Prompt lookup: speculative decoding without a draft model (off by default).
    pub speculation: crate::speculation::Speculation,
}

impl Default for SchedulerOptions {
    fn default() -> Self {
        Self {
            max_num_seqs: 64,
            max_num_batched_tokens: 512,
            max_prefill_tokens: None,
            max_waiting: 1024,
            watermark: 0.01,
            speculation: Default::default(),
        }
    }
}

/// How to run a model.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Compute threads (the default is the number of physical cores).
    pub threads: usize,
    /// Most positions (prompt + output) of a sequence; the model's trained context when larger
    /// is asked. Default: the model's context, at most 4096.
    pub context: Option<usize>,
    /// Prompt tokens per forward pass on the one-sequence paths (scoring, benchmarks).
    pub prefill_chunk: usize,
    pub kv: KvOptions,
    pub scheduler: SchedulerOptions,
    /// Quantize the weights at load by a plan ("in situ"); the result is cached on disk.
    pub quantization: Option<crate::convert::InSitu>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            threads: kernels::backend::physical_cores(),
            context: None,
            prefill_chunk: 512,
            kv: KvOptions::default(),
            scheduler: SchedulerOptions::default(),
            quantization: None,
        }
    }
}

/// What to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Raw text (BOS added when the model wants it); special-token texts in it become their
    /// tokens, as clients of raw completion APIs expect.
    Text(String),
    /// Raw text whose special-token texts stay plain text (BOS added when the model wants it).
    PlainText(String),
    /// A conversation, rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
    /// Token ids as they are.
    Tokens(Vec<u32>),
}

/// A generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Prompt,
    pub sampling: SamplingParams,
    /// Most tokens to generate (≥ 1).
    pub max_tokens: usize,
    /// Generation ends before any of these texts (not included in the output).
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Limits the output to a grammar (structured output); each choice starts its own state.
    pub constraint: Option<Constraint>,
    /// A chat's tools (`{"type": "function", "function": {...}}`), rendered by the template.
    pub tools: Vec<serde_json::Value>,
    /// Control tokens whose text the output shows (a tool call's markers); the others stay
    /// hidden.
    pub reveal: Vec<u32>,
    /// Who the request is, for the first-token gate's bookings and fair order
    /// ([`crate::reservations`]); none: an anonymous newcomer, never booked.
    pub claim: Option<Claim>,
    /// The attention export ([`crate::explain`]), normalized and bounded by the caller
    /// ([`AttentionRequest::normalize`]); the engine checks it against the model again.
    pub attention: Option<AttentionRequest>,
}

impl GenerateRequest {
    pub fn new(prompt: Prompt, max_tokens: usize) -> Self {
        Self {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            constraint: None,
            tools: Vec::new(),
            reveal: Vec::new(),
            claim: None,
            attention: None,
        }
    }
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Text this token completes (empty while a UTF-8 character or a possible stop string is
    /// incomplete; that text arrives with a later event).
    pub text: String,
    pub logprob: f32,
    /// Entropy of the next-token distribution this token was drawn from, in nats.
    pub entropy: f32,
    /// Most likely alternatives: (id, token text, logprob).
    pub top_logprobs: Vec<(u32, String, f32)>,
    /// The attention export of this token when the request asked for it and this token
    /// (layers × heads × top_k entries, in the request's order; [`Attended::NONE`] past the
    /// keys it saw); empty otherwise.
    pub attention: Vec<Attended>,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The consumer went away.
    Cancelled,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// The end of a generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose keys and values came from the prefix cache.
    pub cached_prompt_tokens: usize,
    /// From submission to the first step that ran the sequence.
    pub queue_seconds: f64,
    /// From the first step to the first token.
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Text still held back when generation ended (flushed here).
    pub trailing_text: String,
    /// The stop string that ended the text (reason `stop`), when one did.
    pub stop: Option<String>,
    /// Tokens guessed by prompt lookup and verified for it, and how many were kept.
    pub speculated_tokens: u64,
    pub speculated_accepted: u64,
}

/// What the stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Finished(Finished),
    Failed(String),
    /// Refused before it started: new prompts were stopped (memory saturated) and it waited
    /// the engine's `saturation_wait_ms` without starting. Nothing was computed for it.
    Shed(Shed),
}

/// A sequence refused at saturation before it started (see [`Event::Shed`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shed {
    pub waited_ms: u64,
    /// When a retry could be let in, in seconds.
    pub retry_after_s: u64,
}

impl From<Shed> for EngineError {
    fn from(shed: Shed) -> Self {
        EngineError::Saturated {
            waited_ms: shed.waited_ms,
            retry_after_s: shed.retry_after_s,
        }
    }
}

/// A request checked and tokenized, ready to run.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    pub request: GenerateRequest,
}

/// The model side shared by the engine's callers and its scheduler thread.
struct Core {
    model: Model,
    tokenizer: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    backend: Box<dyn Backend>,
    /// One forward pass at a time on the compute pool.
    compute: Mutex<()>,
}

/// The one-sequence paths' cache and buffers (scoring, benchmarks).
struct Solo {
    cache: SequenceCache,
    state: ForwardState,
}

enum Command {
    Submit(Box<NewSequence>),
    /// Drop the prefix cache's unreferenced blocks and give free KV pages back.
    ReleaseMemory,
    Shutdown,
}

/// The events of one request. Dropping it cancels the request.
#[derive(Debug)]
pub struct Stream {
    events: UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl Stream {
    /// The next event, waiting for it (not from inside an async runtime: use [`Stream::recv`]).
    pub fn blocking_next(&mut self) -> Option<Event> {
        self.events.blocking_recv()
    }

    /// The next event if one is ready.
    pub fn try_next(&mut self) -> Option<Event> {
        self.events.try_recv().ok()
    }

    /// The next event, asynchronously.
    pub async fn recv(&mut self) -> Option<Event> {
        self.events.recv().await
    }

    /// Cancels the request; its blocks are freed at the next step.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }
}

impl Iterator for Stream {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        self.blocking_next()
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// The size of the KV pool an engine runs with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCapacity {
    pub layout: KvLayout,
    pub blocks: usize,
}

impl KvCapacity {
    /// Tokens the pool holds.
    pub fn tokens(&self) -> usize {
        self.blocks * self.layout.block_tokens
    }

    pub fn bytes(&self) -> usize {
        self.blocks * self.layout.block_bytes()
    }
}

/// A loaded model with its tokenizer, chat template, compute backend and scheduler thread.
pub struct Engine {
    core: Arc<Core>,
    context: usize,
    prefill_chunk: usize,
    kv_dtype: KvDType,
    capacity: KvCapacity,
    limits: Arc<SchedulerLimits>,
    snapshot: Arc<Mutex<SchedulerSnapshot>>,
    latency: Arc<Mutex<LatencySamples>>,
    queued: Arc<AtomicUsize>,
    max_waiting: usize,
    commands: Mutex<Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    solo: Mutex<Option<Solo>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.core.model)
            .field("backend", &self.core.backend.describe())
            .field("kv", &self.capacity)
            .finish()
    }
}

/// Runs forward passes for the scheduler on the shared model.
struct ModelExecutor {
    core: Arc<Core>,
    state: ForwardState,
}

impl Executor for ModelExecutor {
    fn forward(
        &mut self,
        batch: &Batch,
        store: &mut KvStore,
    ) -> Result<Forwarded<'_>, EngineError> {
        let _compute = self.core.compute.lock().unwrap_or_else(|e| e.into_inner());
        let _turn = self.core.backend.turn();
        self.core
            .model
            .forward_batch(self.core.backend.as_ref(), batch, store, &mut self.state)?;
        Ok(Forwarded {
            logits: &mut self.state.logits,
            attention: &self.state.attention,
        })
    }

    fn threads(&self) -> crate::scheduler::ForEach {
        let core = Arc::clone(&self.core);
        Arc::new(move |items, task| core.backend.for_each(items, task))
    }
}

/// Memory the OS reports as available, in bytes (`None` off Linux).
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Blocks of the pool for these options: the requested memory, at least one full-context
/// sequence, at most `max_num_seqs` of them.
fn pool_blocks(layout: &KvLayout, options: &EngineOptions, context: usize) -> usize {
    let block_bytes = layout.block_bytes() as u64;
    let bytes = match options.kv.memory {
        KvMemory::Bytes(b) => b,
        KvMemory::Fraction(f) => {
            (available_memory().unwrap_or(4 << 30) as f64 * f.clamp(0.0, 1.0)) as u64
        }
    };
    let per_sequence = context.div_ceil(layout.block_tokens);
    let wanted = (bytes / block_bytes) as usize;
    let most = per_sequence * options.scheduler.max_num_seqs.max(1);
    wanted.clamp(per_sequence, most.max(per_sequence))
}

impl Engine {
    /// Loads a model (a GGUF file, or a Hugging Face checkpoint folder with its
    /// `tokenizer.json`) and starts its scheduler thread.
    pub fn load(path: &Path, options: &EngineOptions) -> Result<Self, EngineError> {
        let converted;
        let path = match &options.quantization {
            Some(q) => {
                converted = q.prepare(path)?;
                converted.as_path()
            }
            None => path,
        };
        let model = Model::load(path)?;
        let mut tokenizer = match model.gguf() {
            Some(gguf) => Tokenizer::from_gguf(gguf)?,
            None => Tokenizer::from_hf_folder(path)?,
        };
        if model.format == WeightFormat::HuggingFace {
            // Checkpoints pad their embedding past the tokenizer's last id.
            tokenizer.pad_to(model.config.vocab_size);
        }
        if tokenizer.vocab_size() != model.config.vocab_size {
            return Err(EngineError::Load(format!(
                "the tokenizer has {} tokens but the embedding has {} rows",
                tokenizer.vocab_size(),
                model.config.vocab_size
            )));
        }
        let template = match tokenizer
            .chat_template
            .as_deref()
            .or(model.family.chat_template)
        {
            Some(source) => {
                let text =
                    |id: Option<u32>| id.map(|i| tokenizer.token_text(i)).unwrap_or_default();
                Some(ChatTemplate::new(
                    source,
                    &text(tokenizer.bos),
                    &text(tokenizer.eos),
                )?)
            }
            None => None,
        };
        let context = options
            .context
            .unwrap_or(4096)
            .min(model.config.context_length)
            .max(1);
        let kv = &options.kv;
        if !kv.dtype.supports(model.config.head_dim) {
            return Err(EngineError::Load(format!(
                "a {} KV cache needs a head size that is a multiple of 32; this model's is {}",
                kv.dtype, model.config.head_dim
            )));
        }
        if kv.block_tokens == 0 || kv.block_tokens > 1024 {
            return Err(EngineError::Load(format!(
                "block_tokens {} is outside 1..=1024",
                kv.block_tokens
            )));
        }
        let layout = KvLayout::new(&model.config, kv.block_tokens, kv.dtype);
        let blocks = pool_blocks(&layout, options, context);
        let tier =
            if kv.tier.enabled() {
                Some(KvTier::new(&kv.tier, layout.block_bytes()).map_err(|e| {
                    EngineError::Load(format!("cannot create the KV tier file: {e}"))
                })?)
            } else {
                None
            };
        let backend = CpuBackend::new(options.threads);
        // The kernels' level (RAMPART_ISA lowers it), logged once per model: speed depends on it.
        tracing::info!(
            backend = %backend.describe(),
            isa = backend.isa().name(),
            decode_bytes_per_token = model.decode_bytes_per_token(),
            "engine kernels"
        );
        let core = Arc::new(Core {
            backend: Box::new(backend),
            model,
            tokenizer: Arc::new(tokenizer),
            template,
            compute: Mutex::new(()),
        });
        let sched = &options.scheduler;
        let handles = SchedulerHandles::new(sched.max_num_seqs, sched.max_num_batched_tokens);
        if let Some(prefill) = sched.max_prefill_tokens {
            handles.limits.set_max_prefill_tokens(prefill);
            handles.limits.set_prefill_ceiling(prefill);
        }
        let (commands, inbox) = channel::<Command>();
        let thread = {
            let config = SchedulerConfig {
                watermark: sched.watermark.clamp(0.0, 0.5),
                context,
                speculation: sched.speculation,
            };
            let (core, handles) = (Arc::clone(&core), handles.clone());
            let prefix_caching = kv.prefix_caching;
            std::thread::Builder::new()
                .name("rampart-engine".into())
                .spawn(move || {
                    let scheduler = Scheduler::new(
                        config,
                        handles,
                        Arc::clone(&core.tokenizer),
                        BlockPool::new(blocks, layout.block_tokens, prefix_caching),
                        KvStore::new(layout, blocks),
                        tier,
                    );
                    let executor = ModelExecutor {
                        core,
                        state: ForwardState::default(),
                    };
                    engine_loop(scheduler, executor, inbox);
                })
                .map_err(|e| EngineError::Load(format!("cannot start the engine thread: {e}")))?
        };
        Ok(Self {
            core,
            context,
            prefill_chunk: options.prefill_chunk.max(1),
            kv_dtype: kv.dtype,
            capacity: KvCapacity { layout, blocks },
            limits: handles.limits,
            snapshot: handles.snapshot,
            latency: handles.latency,
            queued: handles.queued,
            max_waiting: sched.max_waiting,
            commands: Mutex::new(commands),
            thread: Some(thread),
            solo: Mutex::new(None),
        })
    }

    /// Loads `name[@version]` from a repository after verifying its digests.
    pub fn from_repository(
        repository: &Repository,
        model: &ModelRef,
        options: &EngineOptions,
    ) -> Result<Self, EngineError> {
        let loaded = repository.load(model, &NoProgress)?;
        let m = &loaded.manifest.model;
        match (m.kind, m.format) {
            (Kind::Llm, Format::Gguf) => {
                let weights = m
                    .weights
                    .first()
                    .ok_or_else(|| EngineError::Load("the manifest lists no weights".into()))?;
                Self::load(&loaded.version.dir.join(weights), options)
            }
            // A Hugging Face checkpoint: the version folder is the checkpoint folder.
            (Kind::Llm, Format::Safetensors) => Self::load(&loaded.version.dir, options),
            _ => Err(EngineError::Load(format!(
                "{} is a {} model in {} format; the engine runs LLMs in GGUF or safetensors",
                loaded.version, m.kind, m.format
            ))),
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.core.model.config
    }

    pub fn model(&self) -> &Model {
        &self.core.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.core.tokenizer
    }

    /// The tokenizer, to keep beside the engine (grammar compilers hold one).
    pub fn shared_tokenizer(&self) -> Arc<Tokenizer> {
        Arc::clone(&self.core.tokenizer)
    }

    pub fn backend(&self) -> &dyn Backend {
        self.core.backend.as_ref()
    }

    /// Most positions of a sequence.
    pub fn context(&self) -> usize {
        self.context
    }

    /// The KV pool's layout and size.
    /// What identifies the computation of an attention export (see
    /// [`crate::explain::kernel_identity`]).
    pub fn kernel_identity(&self) -> String {
        crate::explain::kernel_identity(self.backend(), self.kv_dtype)
    }

    pub fn kv_capacity(&self) -> KvCapacity {
        self.capacity
    }

    /// The scheduler's limits, adjustable while running.
    pub fn limits(&self) -> &SchedulerLimits {
        &self.limits
    }

    /// Asks the engine thread to drop the prefix cache's unreferenced blocks and give the pages
    /// of free KV blocks back to the system (the degradation controller's first memory lever).
    /// Done between steps, also while idle; the snapshot counts what went
    /// (`kv_released_bytes`, `blocks_resident`).
    pub fn release_memory(&self) {
        let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        let _ = commands.send(Command::ReleaseMemory);
    }

    /// Times to first token and inter-token gaps since the last call (the degradation
    /// controller's latency signal).
    pub fn drain_latency(&self) -> LatencySamples {
        self.latency
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
    }

    /// A gap between two tokens of one response, measured where the server hands them to the
    /// client (milliseconds). The degradation controller keeps its inter-token objective on
    /// these when there are any: they add the way out of the process to the engine's steps.
    pub fn record_delivered_gap(&self, ms: f32) {
        let mut samples = self.latency.lock().unwrap_or_else(|e| e.into_inner());
        let LatencySamples {
            delivered_itl_ms,
            dropped,
            ..
        } = &mut *samples;
        LatencySamples::push(delivered_itl_ms, dropped, ms);
    }

    /// The scheduler's state after its latest step.
    pub fn snapshot(&self) -> SchedulerSnapshot {
        self.snapshot
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Renders a chat with the model's template.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let template =
            self.core.template.as_ref().ok_or_else(|| {
                EngineError::ChatTemplate("the model has no chat template".into())
            })?;
        template.render(messages, true)
    }

    /// Token ids of a chat: the template's control tokens, and every message's content as plain
    /// text (a special-token text a client wrote never becomes a control token, so no one can
    /// forge a turn).
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        self.encode_chat_with(messages, true)
    }

    /// [`Engine::encode_chat`], with or without the assistant turn's opening at the end.
    pub fn encode_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.core
            .tokenizer
            .encode_chat_with(self.template()?, messages, add_generation_prompt)
    }

    /// Token ids of a chat with the request's tools ([`Engine::encode_chat`]).
    pub fn encode_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
    ) -> Result<Vec<u32>, EngineError> {
        self.core
            .tokenizer
            .encode_chat_tools(self.template()?, messages, tools, true)
    }

    /// The model's chat template, if it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.core.template.as_ref()
    }

    fn template(&self) -> Result<&ChatTemplate, EngineError> {
        self.chat_template()
            .ok_or_else(|| EngineError::ChatTemplate("the model has no chat template".into()))
    }

    /// Validates and tokenizes a request. Every request error surfaces here, before streaming.
    pub fn prepare(&self, request: GenerateRequest) -> Result<Prepared, EngineError> {
        let vocab = self.core.model.config.vocab_size;
        request.sampling.validate(vocab)?;
        if request.max_tokens == 0 {
            return Err(EngineError::InvalidRequest(
                "max_tokens must be at least 1".into(),
            ));
        }
        if request.stop.iter().any(String::is_empty) {
            return Err(EngineError::InvalidRequest(
                "stop strings must not be empty".into(),
            ));
        }
        let tokenizer = &self.core.tokenizer;
        let tokens = match &request.prompt {
            Prompt::Text(text) => tokenizer.encode(text, true)?,
            Prompt::PlainText(text) => tokenizer.encode_plain(text, true)?,
            Prompt::Chat(messages) => self.encode_chat_tools(messages, &request.tools)?,
            Prompt::Tokens(ids) => {
                if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(EngineError::InvalidRequest(format!(
                        "token id {bad} is outside the vocabulary"
                    )));
                }
                ids.clone()
            }
        };
        if tokens.is_empty() {
            return Err(EngineError::InvalidRequest("the prompt is empty".into()));
        }
        if let Some(asked) = &request.attention {
            let mut checked = asked.clone();
            checked
                .normalize(self.config(), request.max_tokens, usize::MAX)
                .map_err(EngineError::InvalidRequest)?;
            if &checked != asked {
                return Err(EngineError::InvalidRequest(
                    "explain.attention must be normalized before it reaches the engine".into(),
                ));
            }
        }
        if tokens.len() + request.max_tokens > self.context {
            return Err(EngineError::ContextExceeded {
                prompt_tokens: tokens.len(),
                max_tokens: request.max_tokens,
                context: self.context,
            });
        }
        Ok(Prepared { tokens, request })
    }

    /// Hands a prepared request to the scheduler. Refused at once when the pool could never
    /// hold it or the waiting queue is full.
    pub fn submit(&self, prepared: Prepared) -> Result<Stream, EngineError> {
        let Prepared { tokens, request } = prepared;
        let positions = tokens.len() + request.max_tokens;
        if positions > self.capacity.tokens() {
            return Err(EngineError::PoolTooSmall {
                tokens: positions,
                pool_tokens: self.capacity.tokens(),
            });
        }
        let taken = self
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                (q < self.max_waiting).then_some(q + 1)
            });
        if taken.is_err() {
            return Err(EngineError::QueueFull {
                limit: self.max_waiting,
            });
        }
        let predicted_read_ms = match self
            .limits
            .admit_prompt(tokens.len(), request.claim.as_ref())
        {
            Ok(predicted) => predicted,
            Err(refused) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                if let Some(limit_tokens) = refused.unmeasured_limit_tokens {
                    return Err(EngineError::Warming {
                        backlog_tokens: refused.backlog_tokens,
                        limit_tokens,
                        retry_after_s: 1,
                    });
                }
                // Without a booking: when the prompts ahead would have drained enough.
                let over_ms = refused.predicted_ms + refused.margin_ms - refused.max_wait_ms as f64;
                let retry_after_ms = refused
                    .booked
                    .map_or(over_ms.clamp(1.0, 60_000.0) as u64, |b| b.retry_after_ms);
                return Err(EngineError::Shedding {
                    predicted_ms: refused.predicted_ms,
                    margin_ms: refused.margin_ms,
                    max_wait_ms: refused.max_wait_ms,
                    backlog_tokens: refused.backlog_tokens,
                    tokens_per_second: refused.tokens_per_second,
                    retry_after_s: retry_after_ms.div_ceil(1000).clamp(1, 600),
                    retry_after_ms,
                    booked: refused.booked.map(|b| b.identity),
                });
            }
        };
        let constraint = match &request.constraint {
            Some(c) => match c.0.start() {
                Ok(state) => Some(state),
                Err(e) => {
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    self.limits.withdraw_prompt(tokens.len());
                    return Err(EngineError::InvalidRequest(format!(
                        "structured output: {e}"
                    )));
                }
            },
            None => None,
        };
        let (events, receiver) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let new = NewSequence {
            constraint,
            sampler: Sampler::new(request.sampling.clone(), &tokens),
            tokens,
            max_tokens: request.max_tokens,
            ignore_eos: request.ignore_eos,
            stop: request.stop,
            reveal: request.reveal,
            events,
            cancel: Arc::clone(&cancel),
            arrived: Instant::now(),
            predicted_read_ms,
            attention: request.attention,
        };
        let prompt_tokens = new.tokens.len();
        let sent = self
            .commands
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(Command::Submit(Box::new(new)));
        if sent.is_err() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            self.limits.withdraw_prompt(prompt_tokens);
            return Err(EngineError::Stopped);
        }
        Ok(Stream {
            events: receiver,
            cancel,
        })
    }

    /// Validates, tokenizes and submits a request. Request errors return here; the stream
    /// carries the tokens and ends with `Finished` (or `Failed`). Dropping the stream cancels.
    pub fn generate(&self, request: GenerateRequest) -> Result<Stream, EngineError> {
        let prepared = self.prepare(request)?;
        self.submit(prepared)
    }

    /// Runs a prepared request to its end, handing each event to `sink` on this thread; `sink`
    /// returning false cancels. Returns how it finished.
    pub fn run(
        &self,
        prepared: Prepared,
        sink: &mut dyn FnMut(Event) -> bool,
    ) -> Result<Finished, EngineError> {
        let prompt_tokens = prepared.tokens.len();
        let started = Instant::now();
        let mut stream = self.submit(prepared)?;
        let mut completion_tokens = 0;
        while let Some(event) = stream.blocking_next() {
            match event {
                Event::Token(token) => {
                    completion_tokens += 1;
                    if !sink(Event::Token(token)) {
                        return Ok(Finished {
                            reason: FinishReason::Cancelled,
                            prompt_tokens,
                            completion_tokens,
                            cached_prompt_tokens: 0,
                            queue_seconds: 0.0,
                            prefill_seconds: 0.0,
                            decode_seconds: started.elapsed().as_secs_f64(),
                            trailing_text: String::new(),
                            stop: None,
                            speculated_tokens: 0,
                            speculated_accepted: 0,
                        });
                    }
                }
                Event::Finished(done) => {
                    sink(Event::Finished(done.clone()));
                    return Ok(done);
                }
                Event::Failed(message) => return Err(EngineError::Failed(message)),
                Event::Shed(shed) => return Err(shed.into()),
            }
        }
        Err(EngineError::Stopped)
    }

    fn with_solo<T>(&self, f: impl FnOnce(&mut Solo) -> T) -> T {
        let mut solo = self.solo.lock().unwrap_or_else(|e| e.into_inner());
        let solo = solo.get_or_insert_with(|| Solo {
            cache: SequenceCache::new(&self.core.model.config, self.context, self.kv_dtype),
            state: ForwardState::default(),
        });
        f(solo)
    }

    /// Runs the model over `tokens` from an empty context and returns the logits of every
    /// position (`tokens.len() × vocab`), for scoring and reference checks.
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.with_session(|model, backend, cache, state| {
            cache.clear();
            if tokens.len() > cache.capacity() {
                return Err(EngineError::ContextExceeded {
                    prompt_tokens: tokens.len(),
                    max_tokens: 0,
                    context: cache.capacity(),
                });
            }
            let mut out = Vec::with_capacity(tokens.len() * model.config.vocab_size);
            for chunk in tokens.chunks(self.prefill_chunk) {
                model.forward(backend, chunk, cache, state, LogitRows::All)?;
                out.extend_from_slice(&state.logits);
            }
            Ok(out)
        })
    }

    /// The log-probability of `continuation` after `prompt` (teacher-forced, summed over its
    /// tokens, natural log), from an empty context. Holds the compute lock while it runs (the
    /// scheduler pauses for one prompt's prefill).
    pub fn score(&self, prompt: &[u32], continuation: &[u32]) -> Result<f64, EngineError> {
        self.score_path(prompt, continuation, &vec![Vec::new(); continuation.len()])
    }

    /// The log-probability of `path` after `prompt` when each of its tokens is drawn among
    /// `allowed[k]` (what a decoder held to a grammar may draw at that step; an empty set: the
    /// whole vocabulary). From an empty context, under the compute lock.
    pub fn score_path(
        &self,
        prompt: &[u32],
        path: &[u32],
        allowed: &[Vec<u32>],
    ) -> Result<f64, EngineError> {
        if prompt.is_empty() || path.is_empty() || allowed.len() != path.len() {
            return Err(EngineError::InvalidRequest(
                "scoring a path needs a prompt, a path and an allowed set per token".into(),
            ));
        }
        self.with_session(|model, backend, cache, state| {
            cache.clear();
            if prompt.len() + path.len() > cache.capacity() {
                return Err(EngineError::ContextExceeded {
                    prompt_tokens: prompt.len() + path.len(),
                    max_tokens: 0,
                    context: cache.capacity(),
                });
            }
            let (head, last) = prompt.split_at(prompt.len() - 1);
            for chunk in head.chunks(self.prefill_chunk) {
                model.forward(backend, chunk, cache, state, LogitRows::Last)?;
            }
            let mut rows: Vec<u32> = last.to_vec();
            rows.extend_from_slice(&path[..path.len() - 1]);
            let vocab = model.config.vocab_size;
            let mut sum = 0f64;
            let mut done = 0;
            for chunk in rows.chunks(self.prefill_chunk) {
                model.forward(backend, chunk, cache, state, LogitRows::All)?;
                for row in state.logits.chunks_exact(vocab) {
                    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
                    let exp = |x: f32| ((x - max) as f64).exp();
                    let norm = if allowed[done].is_empty() {
                        row.iter().map(|&x| exp(x)).sum::<f64>()
                    } else {
                        allowed[done]
                            .iter()
                            .filter_map(|&t| row.get(t as usize))
                            .map(|&x| exp(x))
                            .sum::<f64>()
                    };
                    sum += (row[path[done] as usize] - max) as f64 - norm.ln();
                    done += 1;
                }
            }
            Ok(sum)
        })
    }

    /// Direct access to the model, backend, a one-sequence KV cache and buffers (for scoring and
    /// benchmarks that drive the forward pass themselves); holds the compute lock for the
    /// duration of `f`, so the scheduler pauses meanwhile.
    pub fn with_session<T>(
        &self,
        f: impl FnOnce(&Model, &dyn Backend, &mut SequenceCache, &mut ForwardState) -> T,
    ) -> T {
        self.with_solo(|solo| {
            let _compute = self.core.compute.lock().unwrap_or_else(|e| e.into_inner());
            let _turn = self.core.backend.turn();
            f(
                &self.core.model,
                self.core.backend.as_ref(),
                &mut solo.cache,
                &mut solo.state,
            )
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let commands = self.commands.lock().unwrap_or_else(|e| e.into_inner());
        let _ = commands.send(Command::Shutdown);
        drop(commands);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// How long the engine thread waits for new requests when it has work but its last step could
/// schedule nothing, instead of spinning.
const STALLED_WAIT: std::time::Duration = std::time::Duration::from_millis(1);

/// The engine thread: takes new requests, steps the scheduler while there is work, sleeps on
/// the inbox when there is none.
fn engine_loop(
    mut scheduler: Scheduler,
    mut executor: ModelExecutor,
    inbox: std::sync::mpsc::Receiver<Command>,
) {
    let mut stalled = false;
    loop {
        let first = if !scheduler.has_work() {
            match inbox.recv() {
                Ok(command) => Some(command),
                Err(_) => return,
            }
        } else if stalled {
            match inbox.recv_timeout(STALLED_WAIT) {
                Ok(command) => Some(command),
                Err(RecvTimeoutError::Timeout) => None,
                Err(RecvTimeoutError::Disconnected) => {
                    scheduler.abort_all("the engine stopped");
                    return;
                }
            }
        } else {
            None
        };
        for command in first.into_iter().chain(inbox.try_iter()) {
            match command {
                Command::Submit(new) => scheduler.add(*new),
                Command::ReleaseMemory => {
                    scheduler.release_memory();
                }
                Command::Shutdown => {
                    scheduler.abort_all("the engine stopped");
                    return;
                }
            }
        }
        if scheduler.has_work() {
            stalled = scheduler.step(&mut executor) == 0;
        }
    }
}

/// Finds stop strings in streamed text, holding back any tail that could still become one.
#[derive(Debug)]
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    held: String,
    /// The stop string that ended the text.
    pub(crate) matched: Option<String>,
}

impl StopMatcher {
    pub(crate) fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.to_vec(),
            held: String::new(),
            matched: None,
        }
    }

    /// Adds text; returns what can be shown now and whether a stop string was reached (the stop
    /// string and anything after it are dropped).
    pub(crate) fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (piece.to_string(), false);
        }
        self.held.push_str(piece);
        if let Some((at, stop)) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at)
        {
            self.matched = Some(stop.clone());
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                let tail = &self.held[i..];
                if s.starts_with(tail) {
                    keep = keep.max(tail.len());
                    break;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// Releases held text at the end, with the detokenizer's remainder appended.
    pub(crate) fn flush(&mut self, rest: String) -> String {
        let mut out = std::mem::take(&mut self.held);
        out.push_str(&rest);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_cut_and_held_back() {
        let mut m = StopMatcher::new(&["\n\n".to_string(), "END".to_string()]);
        assert_eq!(m.push("Hello"), ("Hello".to_string(), false));
        assert_eq!(m.push(" wor"), (" wor".to_string(), false));
        assert_eq!(
            m.push("ld\n"),
            ("ld".to_string(), false),
            "a lone newline might start a stop"
        );
        assert_eq!(m.push("x"), ("\nx".to_string(), false));
        assert_eq!(m.push("EN"), (String::new(), false));
        assert_eq!(m.push("Dgame"), (String::new(), true));
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("a\n\n"), ("a\n\n".to_string(), false));
        let mut m = StopMatcher::new(&["stop".to_string()]);
        assert_eq!(m.push("no st"), ("no ".to_string(), false));
        assert_eq!(m.flush("!".into()), "st!");
    }
}
