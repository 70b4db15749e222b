//! The engine API: load a model, then generate a stream of token events for a prompt or a chat.
//!
//! One sequence runs at a time (the batching scheduler generalises this). Generation runs on a
//! dedicated OS thread and reports through a bounded channel; dropping the receiver cancels the
//! sequence at the next token.

use std::path::Path;
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kernels::{Backend, CpuBackend};
use repo::manifest::{Format, Kind};
use repo::{ModelRef, NoProgress, Repository};

use crate::chat::{ChatMessage, ChatTemplate};
use crate::error::EngineError;
use crate::model::{ForwardState, KvCache, LogitRows, Model, ModelConfig};
use crate::sampler::{Sampler, SamplingParams, TokenChoice};
use crate::tokenizer::{Detokenizer, Tokenizer};

/// How to run a model.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Compute threads (the default is the number of physical cores).
    pub threads: usize,
    /// Most positions (prompt + output) of a sequence; the model's trained context when larger
    /// is asked. Default: the model's context, at most 4096.
    pub context: Option<usize>,
    /// Prompt tokens per forward pass during prefill.
    pub prefill_chunk: usize,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            threads: kernels::backend::physical_cores(),
            context: None,
            prefill_chunk: 512,
        }
    }
}

/// What to continue.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Raw text (BOS added when the model wants it).
    Text(String),
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
}

impl GenerateRequest {
    pub fn new(prompt: Prompt, max_tokens: usize) -> Self {
        Self {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
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
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Text still held back when generation ended (flushed here).
    pub trailing_text: String,
}

/// What the stream carries.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Finished(Finished),
    Failed(String),
}

/// A request checked and tokenized, ready to run.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub tokens: Vec<u32>,
    pub request: GenerateRequest,
}

struct Session {
    cache: KvCache,
    state: ForwardState,
}

/// A loaded model with its tokenizer, chat template and compute backend.
pub struct Engine {
    model: Model,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    backend: Box<dyn Backend>,
    session: Mutex<Session>,
    context: usize,
    prefill_chunk: usize,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("model", &self.model)
            .field("backend", &self.backend.describe())
            .finish()
    }
}

impl Engine {
    /// Loads a GGUF file.
    pub fn load(path: &Path, options: &EngineOptions) -> Result<Self, EngineError> {
        let model = Model::load(path)?;
        let tokenizer = Tokenizer::from_gguf(model.gguf())?;
        if tokenizer.vocab_size() != model.config.vocab_size {
            return Err(EngineError::Load(format!(
                "the tokenizer has {} tokens but the embedding has {} rows",
                tokenizer.vocab_size(),
                model.config.vocab_size
            )));
        }
        let template = match &tokenizer.chat_template {
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
        let session = Session {
            cache: KvCache::new(&model.config, context),
            state: ForwardState::default(),
        };
        Ok(Self {
            backend: Box::new(CpuBackend::new(options.threads)),
            model,
            tokenizer,
            template,
            session: Mutex::new(session),
            context,
            prefill_chunk: options.prefill_chunk.max(1),
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
        if m.kind != Kind::Llm || m.format != Format::Gguf {
            return Err(EngineError::Load(format!(
                "{} is a {} model in {} format; the engine runs LLMs in GGUF",
                loaded.version, m.kind, m.format
            )));
        }
        let weights = m
            .weights
            .first()
            .ok_or_else(|| EngineError::Load("the manifest lists no weights".into()))?;
        Self::load(&loaded.version.dir.join(weights), options)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// Most positions of a sequence.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Renders a chat with the model's template.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| EngineError::ChatTemplate("the model has no chat template".into()))?;
        template.render(messages, true)
    }

    /// Validates and tokenizes a request. Every request error surfaces here, before streaming.
    pub fn prepare(&self, request: GenerateRequest) -> Result<Prepared, EngineError> {
        request.sampling.validate(self.model.config.vocab_size)?;
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
        let tokens = match &request.prompt {
            Prompt::Text(text) => self.tokenizer.encode(text, true)?,
            Prompt::Chat(messages) => self.tokenizer.encode(&self.render_chat(messages)?, false)?,
            Prompt::Tokens(ids) => {
                if let Some(bad) = ids
                    .iter()
                    .find(|&&id| id as usize >= self.model.config.vocab_size)
                {
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
        if tokens.len() + request.max_tokens > self.context {
            return Err(EngineError::ContextExceeded {
                prompt_tokens: tokens.len(),
                max_tokens: request.max_tokens,
                context: self.context,
            });
        }
        Ok(Prepared { tokens, request })
    }

    /// Runs a prepared request on this thread, handing each event to `sink`; `sink` returning
    /// false cancels. Returns how it finished.
    pub fn run(
        &self,
        prepared: Prepared,
        sink: &mut dyn FnMut(Event) -> bool,
    ) -> Result<Finished, EngineError> {
        let mut session = self.session.lock().unwrap_or_else(|e| e.into_inner());
        let Session { cache, state } = &mut *session;
        cache.clear();
        let Prepared { tokens, request } = prepared;
        let prefill_start = Instant::now();
        for chunk in tokens.chunks(self.prefill_chunk) {
            self.model
                .forward(self.backend.as_ref(), chunk, cache, state, LogitRows::Last)?;
        }
        let prefill_seconds = prefill_start.elapsed().as_secs_f64();
        let decode_start = Instant::now();

        let mut sampler = Sampler::new(request.sampling.clone(), &tokens);
        let mut detok = Detokenizer::default();
        let mut stops = StopMatcher::new(&request.stop);
        let mut completion = 0;
        let finish = |reason, completion, trailing_text: String| Finished {
            reason,
            prompt_tokens: tokens.len(),
            completion_tokens: completion,
            prefill_seconds,
            decode_seconds: decode_start.elapsed().as_secs_f64(),
            trailing_text,
        };
        loop {
            let choice: TokenChoice = sampler.sample(&mut state.logits);
            sampler.accept(choice.id);
            completion += 1;
            if !request.ignore_eos && self.tokenizer.stop_tokens.contains(&choice.id) {
                let done = finish(FinishReason::Stop, completion, stops.flush(detok.flush()));
                sink(Event::Finished(done.clone()));
                return Ok(done);
            }
            let piece = detok.push(&self.tokenizer, choice.id, false);
            let (text, stopped) = stops.push(&piece);
            let top_logprobs = choice
                .top
                .iter()
                .map(|&(id, lp)| (id, self.tokenizer.token_text(id), lp))
                .collect();
            let event = Event::Token(TokenEvent {
                id: choice.id,
                text,
                logprob: choice.logprob,
                entropy: choice.entropy,
                top_logprobs,
            });
            if !sink(event) {
                return Ok(finish(FinishReason::Cancelled, completion, String::new()));
            }
            if stopped {
                let done = finish(FinishReason::Stop, completion, String::new());
                sink(Event::Finished(done.clone()));
                return Ok(done);
            }
            if completion >= request.max_tokens {
                let done = finish(FinishReason::Length, completion, stops.flush(detok.flush()));
                sink(Event::Finished(done.clone()));
                return Ok(done);
            }
            self.model.forward(
                self.backend.as_ref(),
                &[choice.id],
                cache,
                state,
                LogitRows::Last,
            )?;
        }
    }

    /// Starts a generation on its own thread. Request errors return here; the stream carries the
    /// tokens and ends with `Finished` (or `Failed`). Dropping the receiver cancels.
    pub fn generate(
        self: &Arc<Self>,
        request: GenerateRequest,
    ) -> Result<Receiver<Event>, EngineError> {
        let prepared = self.prepare(request)?;
        let (tx, rx) = sync_channel(64);
        let engine = Arc::clone(self);
        std::thread::Builder::new()
            .name("rampart-engine".into())
            .spawn(move || {
                let mut send = |e: Event| tx.send(e).is_ok();
                if let Err(e) = engine.run(prepared, &mut send) {
                    let _ = tx.send(Event::Failed(e.to_string()));
                }
            })
            .map_err(|e| EngineError::Load(format!("cannot start the engine thread: {e}")))?;
        Ok(rx)
    }

    /// Runs the model over `tokens` from an empty context and returns the logits of every
    /// position (`tokens.len() × vocab`), for scoring and reference checks.
    pub fn logits(&self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        let mut session = self.session.lock().unwrap_or_else(|e| e.into_inner());
        let Session { cache, state } = &mut *session;
        cache.clear();
        if tokens.len() > cache.capacity() {
            return Err(EngineError::ContextExceeded {
                prompt_tokens: tokens.len(),
                max_tokens: 0,
                context: cache.capacity(),
            });
        }
        let mut out = Vec::with_capacity(tokens.len() * self.model.config.vocab_size);
        for chunk in tokens.chunks(self.prefill_chunk) {
            self.model
                .forward(self.backend.as_ref(), chunk, cache, state, LogitRows::All)?;
            out.extend_from_slice(&state.logits);
        }
        Ok(out)
    }

    /// Direct access to the model, backend, KV cache and buffers of the session (for benchmarks
    /// that drive the forward pass themselves); holds the session for the duration of `f`.
    pub fn with_session<T>(
        &self,
        f: impl FnOnce(&Model, &dyn Backend, &mut KvCache, &mut ForwardState) -> T,
    ) -> T {
        let mut session = self.session.lock().unwrap_or_else(|e| e.into_inner());
        let Session { cache, state } = &mut *session;
        f(&self.model, self.backend.as_ref(), cache, state)
    }
}

/// Finds stop strings in streamed text, holding back any tail that could still become one.
#[derive(Debug)]
struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.to_vec(),
            held: String::new(),
        }
    }

    /// Adds text; returns what can be shown now and whether a stop string was reached (the stop
    /// string and anything after it are dropped).
    fn push(&mut self, piece: &str) -> (String, bool) {
        if self.stops.is_empty() {
            return (piece.to_string(), false);
        }
        self.held.push_str(piece);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
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
    fn flush(&mut self, rest: String) -> String {
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
