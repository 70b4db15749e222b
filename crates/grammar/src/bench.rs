//! What structured output costs: decode tokens/s of the same prompts with and without a
//! constraint, the time spent computing masks, and the compile time of a schema
//! (`rampart bench structured`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use engine::{
    ChatMessage, Constraint, ConstraintError, ConstraintFactory, Engine, EngineError, Event,
    GenerateRequest, Prompt, SamplingParams, TokenConstraint, TokenMask,
};
use serde_json::{json, Value};

use crate::{Compiled, Compiler, GrammarError, GrammarLimits, GrammarSpec, Outcome};

/// The seeds' ticket classification schema: category (five labels), confidence 0–1, reasons.
pub fn ticket_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "category": {"type": "string", "enum": ["billing", "technical", "account", "shipping", "other"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            "reasons": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 1, "maxItems": 3}
        },
        "required": ["category", "confidence", "reasons"],
        "additionalProperties": false
    })
}

/// Sample support tickets (the prompts of the benchmark and of the e2e tests).
pub const TICKETS: &[&str] = &[
    "I was charged twice for my subscription this month, please refund one payment.",
    "The app crashes every time I open the settings page on Android 14.",
    "I forgot my password and the reset email never arrives.",
    "My package has been stuck in transit for ten days, where is it?",
    "Can you change the invoice address on my last order to our new office?",
    "Do you have a dark mode? Just curious.",
    "Your latest update deleted all my saved projects, I need them back today.",
    "How do I export my data before closing my account?",
];

/// One mode's measurement over all prompts.
#[derive(Debug, Clone, Default)]
pub struct ModeReport {
    /// Generated tokens after the first, over all requests.
    pub decode_tokens: usize,
    /// Sum of the requests' decode times (first token to last).
    pub decode_seconds: f64,
    /// Wall time of the whole batch of requests.
    pub wall_seconds: f64,
    pub completion_tokens: usize,
    /// Time spent computing masks (constrained mode).
    pub mask_seconds: f64,
    pub masks: u64,
    /// Outputs that passed the final check (constrained mode).
    pub valid: usize,
    pub requests: usize,
}

impl ModeReport {
    /// Decode tokens/s of one sequence (requests run one at a time).
    pub fn decode_tps(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_seconds.max(1e-9)
    }

    /// Generated tokens/s of the whole batch, wall clock.
    pub fn throughput(&self) -> f64 {
        self.completion_tokens as f64 / self.wall_seconds.max(1e-9)
    }
}

/// Counts a constraint's mask time.
struct Timed {
    inner: Arc<Compiled>,
    nanos: Arc<AtomicU64>,
    masks: Arc<AtomicU64>,
}

struct TimedState {
    inner: Box<dyn TokenConstraint>,
    nanos: Arc<AtomicU64>,
    masks: Arc<AtomicU64>,
}

impl ConstraintFactory for Timed {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        Ok(Box::new(TimedState {
            inner: self.inner.start()?,
            nanos: Arc::clone(&self.nanos),
            masks: Arc::clone(&self.masks),
        }))
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

impl TokenConstraint for TimedState {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        let t = Instant::now();
        let r = self.inner.compute_mask(mask);
        self.nanos
            .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.masks.fetch_add(1, Ordering::Relaxed);
        r
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.inner.commit(token)
    }

    fn is_complete(&self) -> bool {
        self.inner.is_complete()
    }
}

/// Runs every prompt (at most `parallel` at once), greedy, with or without the constraint.
pub fn run_mode(
    engine: &Engine,
    compiled: Option<&Arc<Compiled>>,
    prompts: &[String],
    max_tokens: usize,
    parallel: usize,
) -> Result<ModeReport, EngineError> {
    let nanos = Arc::new(AtomicU64::new(0));
    let masks = Arc::new(AtomicU64::new(0));
    let mut report = ModeReport {
        requests: prompts.len(),
        ..ModeReport::default()
    };
    let started = Instant::now();
    for group in prompts.chunks(parallel.max(1)) {
        let mut streams = Vec::new();
        for prompt in group {
            let mut r = GenerateRequest::new(
                Prompt::Chat(vec![
                    ChatMessage::new(
                        "system",
                        "Classify the support ticket. Answer in JSON with category, confidence and reasons.",
                    ),
                    ChatMessage::new("user", prompt),
                ]),
                max_tokens,
            );
            r.sampling = SamplingParams::greedy();
            if let Some(c) = compiled {
                r.constraint = Some(Constraint(Arc::new(Timed {
                    inner: Arc::clone(c),
                    nanos: Arc::clone(&nanos),
                    masks: Arc::clone(&masks),
                })));
            }
            streams.push(engine.submit(engine.prepare(r)?)?);
        }
        for mut s in streams {
            let mut text = String::new();
            while let Some(e) = s.blocking_next() {
                match e {
                    Event::Token(t) => text.push_str(&t.text),
                    Event::Finished(f) => {
                        text.push_str(&f.trailing_text);
                        report.completion_tokens += f.completion_tokens;
                        report.decode_tokens += f.completion_tokens.saturating_sub(1);
                        report.decode_seconds += f.decode_seconds;
                        if let Some(c) = compiled {
                            let by_length = f.reason == engine::FinishReason::Length;
                            if c.check(&text, by_length) == Outcome::Valid {
                                report.valid += 1;
                            }
                        }
                    }
                    Event::Failed(e) => return Err(EngineError::Failed(e)),
                    Event::Shed(shed) => return Err(shed.into()),
                }
            }
        }
    }
    report.wall_seconds = started.elapsed().as_secs_f64();
    report.mask_seconds = nanos.load(Ordering::Relaxed) as f64 * 1e-9;
    report.masks = masks.load(Ordering::Relaxed);
    Ok(report)
}

/// Compile costs: setting the model's compiler up, and compiling `spec` the first time.
#[derive(Debug, Clone)]
pub struct CompileReport {
    pub setup_seconds: f64,
    pub compile_seconds: f64,
}

/// Sets up the model's compiler and compiles `spec`, timing both; returns the compiled grammar.
pub fn compile_cost(
    engine: &Engine,
    spec: &GrammarSpec,
) -> Result<(CompileReport, Arc<Compiled>), GrammarError> {
    let t = Instant::now();
    let compiler = Compiler::new(engine.shared_tokenizer(), GrammarLimits::default())?;
    let setup_seconds = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (compiled, _) = compiler.compile(spec)?;
    let report = CompileReport {
        setup_seconds,
        compile_seconds: t.elapsed().as_secs_f64(),
    };
    Ok((report, compiled))
}
