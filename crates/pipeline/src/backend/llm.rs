//! Language models on the engine: tokenization and templates, the structured-output constraint,
//! one engine sequence per choice, events resolved to text.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::tokenizer::Tokenizer;
use engine::{Engine, EngineError, Event, Prompt, TokenEvent};
use futures_util::stream::{self, SelectAll, StreamExt};
use record::{RecordBuilder, StructuredRecord};
use tracing::Instrument;

use crate::lane::Lane;
use grammar::tools::{prepare_history, ToolFormat, ToolRendering, ToolSession};

use super::{
    Answer, BackendError, Description, ExplainInfo, ExplainSpec, GeneratePlan, Generated,
    Generation, Health, InferenceBackend, Kind, StartFuture, Token, TokenLogprobs, TopToken, Work,
    WorkKind,
};

/// One served language model version.
pub struct LlmBackend {
    engine: Arc<Engine>,
    /// Compiles structured-output requests against this model's vocabulary.
    grammar: Arc<grammar::Compiler>,
    entropy_band: Option<[f32; 2]>,
    /// `max_tokens` when the request leaves it to the server (capped by the room left).
    default_max_tokens: usize,
    /// No token for this long while sequences run: the engine is stalled (readiness fails).
    stall: Duration,
    /// Generated-token counter and when it last moved.
    progress: Mutex<(u64, Instant)>,
    /// Whether completion prompts may carry control tokens (`[models] parse_special_tokens`,
    /// off by default): special-token texts become control tokens unless the request says
    /// otherwise, and token-id prompts may hold control ids. Off, both stay out of client input
    /// and a request asking for them is refused.
    parse_special_tokens: bool,
    /// Where long prompts are rendered and tokenized (below the compute's priority, the
    /// server's prepare lane); short ones, and all of them without a lane, on the blocking pool.
    prepare: Option<Lane>,
    /// The tool-call format the operator declared (`[[models]] tool_format`); none: the one
    /// the chat template shows, if any.
    tool_format: Option<ToolFormat>,
}

/// Prompts up to this many bytes (all of a request's texts together) are rendered and tokenized
/// at the request's own priority; longer ones on the prepare lane: the tokenizer takes about
/// 2 ms per 1,000 tokens, and a client sending 240 KB prompts that overflow the context would
/// otherwise take a core from the generations running (`rampart bench abuse`, guard attack).
const INLINE_PROMPT_BYTES: usize = 16 * 1024;

impl LlmBackend {
    pub fn new(
        engine: Arc<Engine>,
        grammar: Arc<grammar::Compiler>,
        entropy_band: Option<[f32; 2]>,
        default_max_tokens: usize,
        stall: Duration,
    ) -> Self {
        Self {
            engine,
            grammar,
            entropy_band,
            default_max_tokens,
            stall,
            progress: Mutex::new((0, Instant::now())),
            parse_special_tokens: false,
            prepare: None,
            tool_format: None,
        }
    }

    /// Declares the model's tool-call format (a template without tools, or another format).
    pub fn with_tool_format(mut self, format: Option<ToolFormat>) -> Self {
        self.tool_format = format;
        self
    }

    /// Renders and tokenizes long prompts on `lane` (crate::lane).
    pub fn with_prepare_lane(mut self, lane: Lane) -> Self {
        self.prepare = Some(lane);
        self
    }

    /// Whether completion prompts may carry control tokens (the model's opt-in).
    pub fn with_parse_special_tokens(mut self, parse: bool) -> Self {
        self.parse_special_tokens = parse;
        self
    }

    /// `Some(idle)` when sequences are running and no token came for longer than the stall
    /// timeout.
    fn stalled_for(&self) -> Option<Duration> {
        let s = self.engine.snapshot();
        let mut progress = self.progress.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if s.generated_tokens != progress.0 || s.running == 0 {
            *progress = (s.generated_tokens, now);
            return None;
        }
        let idle = now.duration_since(progress.1);
        (idle > self.stall).then_some(idle)
    }

    async fn generate(
        &self,
        plan: GeneratePlan,
        record: &mut RecordBuilder,
    ) -> Result<Generation, BackendError> {
        // Tokenization and template rendering run off the async workers.
        let engine = Arc::clone(&self.engine);
        let compiler = Arc::clone(&self.grammar);
        let default_cap = self.default_max_tokens;
        let mut prepare_plan = plan.clone();
        let raw = control_tokens_allowed(plan.parse_special_tokens, self.parse_special_tokens)?;
        if !raw {
            let tokenizer = self.engine.tokenizer();
            for p in &mut prepare_plan.prompts {
                match p {
                    Prompt::Text(t) => *p = Prompt::PlainText(std::mem::take(t)),
                    Prompt::Tokens(ids) => no_control_ids(ids, tokenizer)?,
                    _ => {}
                }
            }
        }
        let began = Instant::now();
        let long = prompt_bytes(&prepare_plan.prompts)
            + prepare_plan.tools.as_ref().map_or(0, |t| t.size())
            > INLINE_PROMPT_BYTES;
        let declared = self.tool_format;
        let prepare = move || {
            let tools = prepare_tools(&engine, declared, &mut prepare_plan)?;
            let param = if tools.is_some() {
                "tools"
            } else {
                "response_format"
            };
            // The grammar first: a bad schema is refused before any tokenization work.
            let structured = match &prepare_plan.structured {
                Some(spec) => Some(compiler.compile(spec).map_err(|e| match e {
                    grammar::GrammarError::Invalid(m) => BackendError::invalid_param(param, m),
                    grammar::GrammarError::Internal(m) => BackendError::Failed(m),
                })?),
                None => None,
            };
            let mut out = Vec::with_capacity(prepare_plan.prompts.len());
            for prompt in &prepare_plan.prompts {
                let mut request = prepare_plan.request.clone();
                request.prompt = prompt.clone();
                if prepare_plan.default_max_tokens {
                    request.max_tokens = 1;
                }
                let mut prepared = engine.prepare(request)?;
                if prepare_plan.default_max_tokens {
                    let room = engine.context().saturating_sub(prepared.tokens.len());
                    prepared.request.max_tokens = room.min(default_cap).max(1);
                }
                if let Some((compiled, _)) = &structured {
                    let factory: Arc<dyn engine::ConstraintFactory> = compiled.clone();
                    prepared.request.constraint = Some(engine::Constraint(factory));
                }
                if let Some(spec) = &prepare_plan.explain {
                    let asked = attention_request(spec, engine.config(), &prepared.request)?;
                    prepared.request.attention = Some(asked);
                }
                out.push(prepared);
            }
            Ok::<_, BackendError>((out, structured, tools))
        };
        let prepared = async {
            match &self.prepare {
                Some(lane) if long => lane.run(prepare).await.map_err(|e| e.to_string()),
                _ => tokio::task::spawn_blocking(prepare)
                    .await
                    .map_err(|e| e.to_string()),
            }
        }
        .instrument(tracing::debug_span!("tokenize"))
        .await
        .map_err(|e| BackendError::Failed(format!("tokenization task failed: {e}")));
        record.stage_since("tokenize", began);
        let (prepared, structured, tools) = prepared??;
        if let Some((compiled, cached)) = &structured {
            record.record.structured = Some(StructuredRecord {
                kind: if tools.is_some() {
                    "tools"
                } else {
                    compiled.spec.kind()
                },
                grammar_sha256: compiled.hash.clone(),
                compile_ms: if *cached {
                    0.0
                } else {
                    compiled.compile_seconds * 1e3
                },
                cached: *cached,
                outcome: None,
                problem: None,
            });
        }
        let prompt_tokens: usize = prepared.iter().map(|p| p.tokens.len()).sum();
        record.record.prompt_tokens = prompt_tokens;
        let tokenizer = self.engine.shared_tokenizer();
        let mut events = SelectAll::new();
        let mut index = 0;
        for p in &prepared {
            for k in 0..plan.n {
                let mut one = p.clone();
                if let Some(seed) = one.request.sampling.seed {
                    one.request.sampling.seed = Some(seed.wrapping_add(k as u64));
                }
                let engine_stream = self.engine.submit(one)?;
                let choice = index;
                let tokenizer = Arc::clone(&tokenizer);
                let logprobs = plan.logprobs;
                let s = stream::unfold(engine_stream, move |mut s| async move {
                    s.recv().await.map(|e| ((choice, e), s))
                })
                .map(move |(choice, event)| (choice, resolve(event, &tokenizer, logprobs)))
                .boxed();
                events.push(s);
                index += 1;
            }
        }
        let explain = prepared.first().and_then(|p| {
            p.request.attention.clone().map(|request| ExplainInfo {
                request,
                kernel: self.engine.kernel_identity(),
                replay: engine::explain::replay_settings(&p.request),
            })
        });
        Ok(Generation {
            explain,
            events: events.boxed(),
            choices: index,
            prompt_tokens,
            structured: match &tools {
                Some(session) => Some(Arc::new(grammar::tools::ToolCheck(Arc::clone(session)))
                    as Arc<dyn grammar::FinalCheck>),
                None => structured.map(|(compiled, _)| compiled as Arc<dyn grammar::FinalCheck>),
            },
            watch: None,
            tools,
        })
    }
}

/// Makes a chat with tools (or with earlier calls in its history) ready for the model: the
/// format its calls take, the tools and history where its template reads them, the grammar
/// that holds the output to the format and each function's schema, and the control tokens the
/// output must show. A request with tools for a model without a tool format is refused.
fn prepare_tools(
    engine: &Engine,
    declared: Option<ToolFormat>,
    plan: &mut GeneratePlan,
) -> Result<Option<Arc<ToolSession>>, BackendError> {
    let has_calls = plan.prompts.iter().any(|p| match p {
        Prompt::Chat(messages) => messages
            .iter()
            .any(|m| !m.tool_calls.is_empty() || m.tool_call_id.is_some()),
        _ => false,
    });
    if plan.tools.is_none() && !has_calls {
        return Ok(None);
    }
    let Some(template) = engine.chat_template() else {
        return match plan.tools {
            Some(_) => Err(BackendError::invalid_param(
                "tools",
                "this model has no chat template, so it cannot be offered tools",
            )),
            None => Ok(None),
        };
    };
    let detected = ToolFormat::detect(template.source());
    let format = declared.or(detected);
    // A template that never reads tools renders as `Prompt`: only a declared format gets there.
    let rendering = ToolRendering::of(template.source());
    let Some(format) = format else {
        return match plan.tools {
            Some(_) => Err(BackendError::invalid_param(
                "tools",
                "this model's chat template has no tool-call format (it never reads `tools`), so it cannot be offered tools; an operator who knows the model was tuned for one can declare it with [[models]] tool_format (hermes, llama3, mistral, phi4-mini, smollm2)",
            )),
            None => Ok(None),
        };
    };
    let template_tools = plan
        .tools
        .as_ref()
        .map(|t| t.template_tools())
        .unwrap_or_default();
    let mut request_tools = Vec::new();
    for prompt in &mut plan.prompts {
        if let Prompt::Chat(messages) = prompt {
            request_tools = prepare_history(messages, format, rendering, &template_tools);
        }
    }
    plan.request.tools = request_tools;
    let Some(request) = plan.tools.clone() else {
        return Ok(None);
    };
    let session = ToolSession::new(
        request,
        format,
        engine.tokenizer(),
        plan.structured.as_ref(),
    )
    .map_err(|e| match e {
        grammar::GrammarError::Invalid(m) => BackendError::invalid_param("tools", m),
        grammar::GrammarError::Internal(m) => BackendError::Failed(m),
    })?;
    plan.structured = session.grammar().cloned();
    plan.request.reveal = session.reveal().to_vec();
    Ok(Some(Arc::new(session)))
}

/// A request's `explain.attention` resolved for this model (defaults for what it left out) and
/// bounded by the server's entries per request (layers × heads × top_k × exported tokens).
fn attention_request(
    spec: &ExplainSpec,
    config: &engine::model::ModelConfig,
    request: &engine::GenerateRequest,
) -> Result<engine::AttentionRequest, BackendError> {
    let defaults = engine::AttentionRequest::defaults(config);
    let mut asked = engine::AttentionRequest {
        layers: spec.layers.clone().unwrap_or(defaults.layers),
        heads: spec.heads.clone().unwrap_or(defaults.heads),
        top_k: spec.top_k.unwrap_or(defaults.top_k),
        positions: spec.positions.clone(),
    };
    asked
        .normalize(config, request.max_tokens, spec.max_entries)
        .map_err(|e| BackendError::invalid_param("explain", e))?;
    Ok(asked)
}

/// An engine event in the seam's terms: token texts resolved only when logprobs were asked for.
fn resolve(event: Event, tokenizer: &Tokenizer, logprobs: bool) -> Generated {
    match event {
        Event::Token(t) => Generated::Token(token(t, tokenizer, logprobs)),
        Event::Finished(f) => Generated::Finished(f),
        Event::Failed(message) => Generated::Failed(BackendError::Failed(format!(
            "generation failed: {message}"
        ))),
        Event::Shed(shed) => Generated::Failed(EngineError::from(shed).into()),
    }
}

fn token(t: TokenEvent, tokenizer: &Tokenizer, logprobs: bool) -> Token {
    let logprobs = logprobs.then(|| TokenLogprobs {
        token: tokenizer.token_text(t.id),
        bytes: tokenizer.token_bytes(t.id).to_vec(),
        logprob: t.logprob,
        top: t
            .top_logprobs
            .iter()
            .map(|(id, text, lp)| TopToken {
                token: text.clone(),
                bytes: tokenizer.token_bytes(*id).to_vec(),
                logprob: *lp,
            })
            .collect(),
    });
    Token {
        text: t.text,
        entropy: t.entropy,
        logprobs,
        attention: t.attention,
        id: t.id,
    }
}

impl InferenceBackend for LlmBackend {
    fn kind(&self) -> Kind {
        Kind::Llm
    }

    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Generate
    }

    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a> {
        Box::pin(async move {
            match work {
                Work::Generate(plan) => Ok(Answer::Generation(self.generate(*plan, record).await?)),
                other => Err(BackendError::invalid(format!(
                    "a language model does not take {} work",
                    other.kind().as_str()
                ))),
            }
        })
    }

    fn describe(&self) -> Description {
        Description {
            max_context: self.engine.context(),
            platform: "rampart_llm".into(),
            ..Description::default()
        }
    }

    fn health(&self) -> Health {
        match self.stalled_for() {
            None => Health::READY,
            Some(idle) => Health {
                problem: Some(format!(
                    "sequences are running but no token was produced for {} s",
                    idle.as_secs()
                )),
            },
        }
    }

    fn special_token_spans(&self, text: &str) -> Vec<(usize, usize)> {
        self.engine.tokenizer().find_special(text)
    }

    fn prompt_text(&self, ids: &[u32]) -> Option<String> {
        let vocab = self.engine.tokenizer().vocab_size();
        let known: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|&id| (id as usize) < vocab)
            .collect();
        Some(self.engine.tokenizer().decode(&known))
    }

    fn entropy_band(&self) -> Option<[f32; 2]> {
        self.entropy_band
    }

    fn engine_snapshot(&self) -> Option<engine::SchedulerSnapshot> {
        Some(self.engine.snapshot())
    }
}

/// Whether a completion's prompts may carry control tokens: only where the model opts in
/// (`[models] parse_special_tokens = true`), and then unless the request says `false`. A
/// request asking for them from a model that does not opt in is refused, not quietly served.
fn control_tokens_allowed(requested: Option<bool>, model: bool) -> Result<bool, BackendError> {
    match (requested, model) {
        (Some(true), false) => Err(BackendError::invalid_param(
            "parse_special_tokens",
            "this model does not take control tokens in client prompts (an operator can allow raw templated prompts with [models] parse_special_tokens = true)",
        )),
        (requested, model) => Ok(requested.unwrap_or(model)),
    }
}

/// Refuses a token-id prompt that holds a control token (a BOS at the start is allowed: it is
/// what the model reads first anyway).
fn no_control_ids(
    ids: &[u32],
    tokenizer: &engine::tokenizer::Tokenizer,
) -> Result<(), BackendError> {
    let bos = tokenizer.bos;
    for (i, &id) in ids.iter().enumerate() {
        if i == 0 && Some(id) == bos {
            continue;
        }
        if tokenizer.is_special(id) {
            return Err(BackendError::invalid_param(
                "prompt",
                format!(
                    "prompt token {i} is the control token {id} ({:?}); this model does not take control tokens in client prompts (an operator can allow raw templated prompts with [models] parse_special_tokens = true)",
                    tokenizer.token_text(id)
                ),
            ));
        }
    }
    Ok(())
}

/// The bytes of text a request's prompts hold; a token-id prompt counts 4 bytes an id (it is
/// only checked, not tokenized, but a long list is still work).
fn prompt_bytes(prompts: &[Prompt]) -> usize {
    prompts
        .iter()
        .map(|p| match p {
            Prompt::Text(t) | Prompt::PlainText(t) => t.len(),
            Prompt::Chat(messages) => messages
                .iter()
                .map(|m| {
                    m.role.len()
                        + m.content.len()
                        + m.tool_calls
                            .iter()
                            .map(|c| c.function.name.len() + c.function.arguments.to_string().len())
                            .sum::<usize>()
                })
                .sum(),
            Prompt::Tokens(ids) => ids.len() * 4,
        })
        .sum()
}

#[cfg(test)]
mod control_token_tests {
    use super::*;

    #[test]
    fn control_tokens_need_the_models_opt_in() {
        assert!(!control_tokens_allowed(None, false).unwrap());
        assert!(!control_tokens_allowed(Some(false), false).unwrap());
        assert!(control_tokens_allowed(Some(true), false).is_err());
        assert!(control_tokens_allowed(None, true).unwrap());
        assert!(!control_tokens_allowed(Some(false), true).unwrap());
    }
}
