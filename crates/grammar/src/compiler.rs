//! Compiles requests' grammars against one model's vocabulary, keeps the compiled ones in a
//! bounded cache keyed by the spec's hash, and starts a per-sequence constraint from them.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use engine::tokenizer::Tokenizer;
use engine::{ConstraintError, ConstraintFactory, TokenConstraint, TokenMask};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use toktrie::TokEnv;

use crate::spec::GrammarSpec;
use crate::vocab::Vocab;
use crate::GrammarError;

/// Limits on what a request may ask for. Defaults: 64 KiB of schema or grammar, 2 s to compile,
/// 128 compiled grammars cached per model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrammarLimits {
    pub max_bytes: usize,
    pub max_compile: Duration,
    pub cache_entries: usize,
}

impl Default for GrammarLimits {
    fn default() -> Self {
        Self {
            max_bytes: 64 * 1024,
            max_compile: Duration::from_secs(2),
            cache_entries: 128,
        }
    }
}

/// One model's grammar compiler.
pub struct Compiler {
    factory: Arc<ParserFactory>,
    limits: GrammarLimits,
    cache: Mutex<Cache>,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<String, (Arc<Compiled>, u64)>,
    tick: u64,
}

impl std::fmt::Debug for Compiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiler")
            .field("limits", &self.limits)
            .finish()
    }
}

impl Compiler {
    /// Builds the token trie and the grammar engine's per-vocabulary tables (tens of
    /// milliseconds for a 50k vocabulary): done once per model, at load.
    pub fn new(tokenizer: Arc<Tokenizer>, limits: GrammarLimits) -> Result<Self, GrammarError> {
        let env: TokEnv = Arc::new(Vocab::new(tokenizer));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| GrammarError::Internal(format!("grammar engine setup: {e}")))?;
        factory.quiet();
        Ok(Self {
            factory: Arc::new(factory),
            limits,
            cache: Mutex::new(Cache::default()),
        })
    }

    pub fn limits(&self) -> GrammarLimits {
        self.limits
    }

    /// The compiled grammar of `spec`, from the cache or compiled now (within the time limit).
    /// The flag says whether it came from the cache.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<(Arc<Compiled>, bool), GrammarError> {
        spec.validate(self.limits.max_bytes)?;
        let hash = spec.hash();
        {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            cache.tick += 1;
            let tick = cache.tick;
            if let Some(entry) = cache.entries.get_mut(&hash) {
                entry.1 = tick;
                metrics::counter!("rampart_grammar_cache_total", "result" => "hit").increment(1);
                return Ok((Arc::clone(&entry.0), true));
            }
        }
        metrics::counter!("rampart_grammar_cache_total", "result" => "miss").increment(1);
        let compiled = Arc::new(self.compile_uncached(spec.clone(), hash.clone())?);
        metrics::histogram!("rampart_grammar_compile_seconds", "kind" => spec.kind())
            .record(compiled.compile_seconds);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.tick += 1;
        let tick = cache.tick;
        cache.entries.insert(hash, (Arc::clone(&compiled), tick));
        while cache.entries.len() > self.limits.cache_entries.max(1) {
            let oldest = cache
                .entries
                .iter()
                .min_by_key(|(_, (_, t))| *t)
                .map(|(k, _)| k.clone());
            match oldest {
                Some(k) => cache.entries.remove(&k),
                None => break,
            };
        }
        Ok((compiled, false))
    }

    /// Compiled grammars held now.
    pub fn cached(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entries
            .len()
    }

    fn compile_uncached(&self, spec: GrammarSpec, hash: String) -> Result<Compiled, GrammarError> {
        let started = Instant::now();
        let factory = Arc::clone(&self.factory);
        let (tx, rx) = mpsc::channel();
        let work = spec.clone();
        // A grammar that takes too long is abandoned; the engine's fuel limits end its thread.
        std::thread::Builder::new()
            .name("grammar-compile".into())
            .spawn(move || {
                let _ = tx.send(build(&factory, &work));
            })
            .map_err(|e| GrammarError::Internal(format!("starting the compiler thread: {e}")))?;
        let (matcher, check) = match rx.recv_timeout(self.limits.max_compile) {
            Ok(result) => result?,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                return Err(GrammarError::Invalid(format!(
                    "the {} took longer than {} ms to compile",
                    spec.kind(),
                    self.limits.max_compile.as_millis()
                )))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(GrammarError::Internal("the grammar compiler failed".into()))
            }
        };
        Ok(Compiled {
            compile_seconds: started.elapsed().as_secs_f64(),
            env: self.factory.tok_env().clone(),
            spec,
            hash,
            matcher: Mutex::new(matcher),
            check,
        })
    }
}

/// Compiles the grammar and its output check, and computes the first mask: that proves the
/// grammar can start and warms the lexer states every sequence's copy starts with.
fn build(factory: &ParserFactory, spec: &GrammarSpec) -> Result<(Matcher, Check), GrammarError> {
    let check = plain_check(spec)?.unwrap_or(Check::Grammar);
    let parser = factory.create_parser(spec.to_llguidance()).map_err(|e| {
        GrammarError::Invalid(format!(
            "the {} cannot be used: {}",
            spec.kind(),
            first_line(&e.to_string())
        ))
    })?;
    let mut matcher = Matcher::new(Ok(parser));
    let first = matcher.compute_mask();
    if let Some(e) = matcher.get_error() {
        return Err(GrammarError::Invalid(format!(
            "the {} cannot be used: {}",
            spec.kind(),
            first_line(&e)
        )));
    }
    match first {
        Ok(mask) if mask.is_zero() => Err(GrammarError::Invalid(format!(
            "the {} allows no output with this model's vocabulary",
            spec.kind()
        ))),
        Ok(_) => Ok((matcher, check)),
        Err(e) => Err(GrammarError::Invalid(format!(
            "the {} cannot be used: {}",
            spec.kind(),
            first_line(&e.to_string())
        ))),
    }
}

/// The check of `spec` that needs no grammar engine (a JSON-schema validator, a regex, the
/// choices); none for a Lark grammar (or a regex the `regex` crate does not take).
fn plain_check(spec: &GrammarSpec) -> Result<Option<Check>, GrammarError> {
    Ok(match spec.effective_schema() {
        Some(schema) => Some(Check::Schema(Box::new(
            jsonschema::validator_for(&schema)
                .map_err(|e| GrammarError::Invalid(format!("the JSON schema is not valid: {e}")))?,
        ))),
        None => match spec {
            GrammarSpec::Choice(c) => Some(Check::Choice(c.clone())),
            GrammarSpec::Regex(r) => regex::Regex::new(&format!("^(?:{r})$"))
                .ok()
                .map(|re| Check::Regex(Box::new(re))),
            _ => None,
        },
    })
}

/// How the final text is checked.
enum Check {
    Schema(Box<jsonschema::Validator>),
    Regex(Box<regex::Regex>),
    Choice(Vec<String>),
    /// Replayed through a fresh copy of the grammar.
    Grammar,
}

/// What the final check says of an output.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// The output parses and satisfies the constraint.
    Valid,
    /// Generation stopped at `max_tokens` (or the context) before the output was complete.
    Incomplete(String),
    /// The output ended but does not satisfy the constraint (a stop string cut it, say).
    Invalid(String),
}

impl Outcome {
    pub fn as_str(&self) -> &'static str {
        match self {
            Outcome::Valid => "valid",
            Outcome::Incomplete(_) => "incomplete",
            Outcome::Invalid(_) => "invalid",
        }
    }
}

/// What is wrong with `text` under a check that needs no grammar engine.
fn plain_problem(check: &Check, text: &str) -> Option<String> {
    match check {
        Check::Schema(validator) => match serde_json::from_str::<Value>(text) {
            Err(e) => Some(format!("the output is not JSON: {e}")),
            Ok(value) => validator
                .iter_errors(&value)
                .next()
                .map(|e| format!("{e} (at {})", pointer(e.instance_path().as_str()))),
        },
        Check::Regex(re) => {
            (!re.is_match(text)).then(|| "the output does not match the regex".to_string())
        }
        Check::Choice(choices) => (!choices.iter().any(|c| c == text))
            .then(|| "the output is none of the choices".to_string()),
        Check::Grammar => Some("a grammar is checked by replaying it".into()),
    }
}

fn outcome(problem: Option<String>, by_length: bool) -> Outcome {
    match problem {
        None => Outcome::Valid,
        Some(p) if by_length => Outcome::Incomplete(p),
        Some(p) => Outcome::Invalid(p),
    }
}

/// The final check of a finished output, whoever wrote it: a model under its compiled grammar
/// ([`Compiled`]) or a backend that writes its answer itself ([`OutputCheck`]).
pub trait FinalCheck: Send + Sync {
    /// Checks a finished output. `by_length`: it ended at the token limit.
    fn check(&self, text: &str, by_length: bool) -> Outcome;
    /// The constraint's kind (`json_schema`, `regex`, ...).
    fn kind(&self) -> &'static str;
}

impl FinalCheck for Compiled {
    fn check(&self, text: &str, by_length: bool) -> Outcome {
        Compiled::check(self, text, by_length)
    }
    fn kind(&self) -> &'static str {
        self.spec.kind()
    }
}

/// The final check of a structured-output request without a model's vocabulary: what the rules
/// engine's answers are held to. A Lark grammar needs a vocabulary to replay, so it has none.
pub struct OutputCheck {
    kind: &'static str,
    check: Check,
}

impl OutputCheck {
    pub fn new(spec: &GrammarSpec, max_bytes: usize) -> Result<Self, GrammarError> {
        spec.validate(max_bytes)?;
        match plain_check(spec)? {
            Some(check) => Ok(Self {
                kind: spec.kind(),
                check,
            }),
            None => Err(GrammarError::Invalid(format!(
                "a {} can only be checked against a model's vocabulary",
                spec.kind()
            ))),
        }
    }
}

impl FinalCheck for OutputCheck {
    fn check(&self, text: &str, by_length: bool) -> Outcome {
        outcome(plain_problem(&self.check, text), by_length)
    }
    fn kind(&self) -> &'static str {
        self.kind
    }
}

/// A compiled grammar: starts a constraint per sequence and checks final outputs.
pub struct Compiled {
    pub spec: GrammarSpec,
    pub hash: String,
    pub compile_seconds: f64,
    env: TokEnv,
    matcher: Mutex<Matcher>,
    check: Check,
}

impl Compiled {
    /// Checks a finished output. `by_length`: generation ended at the token limit.
    pub fn check(&self, text: &str, by_length: bool) -> Outcome {
        let problem = match &self.check {
            Check::Grammar => self.replay(text),
            plain => plain_problem(plain, text),
        };
        outcome(problem, by_length)
    }

    /// Feeds `text` through a fresh copy of the grammar; `None` when it is a complete sentence.
    fn replay(&self, text: &str) -> Option<String> {
        let mut m = self.fresh();
        let tokens = self.env.tok_trie().greedy_tokenize(text.as_bytes());
        match m.try_consume_tokens(&tokens) {
            Ok(n) if n == tokens.len() => match m.is_accepting() {
                Ok(true) => None,
                _ => Some("the output ends before the grammar does".into()),
            },
            Ok(n) => Some(format!(
                "the grammar rejects the output after {} bytes",
                self.env.tok_trie().decode(&tokens[..n]).len()
            )),
            Err(e) => Some(format!(
                "the grammar rejects the output: {}",
                first_line(&e.to_string())
            )),
        }
    }

    fn fresh(&self) -> Matcher {
        self.matcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .deep_clone()
    }
}

impl ConstraintFactory for Compiled {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError> {
        let matcher = self.fresh();
        if let Some(e) = matcher.get_error() {
            return Err(public_error(self.spec.kind(), &e));
        }
        Ok(Box::new(Guided {
            matcher,
            kind: self.spec.kind(),
        }))
    }

    fn describe(&self) -> String {
        format!("{} {}", self.spec.kind(), &self.hash[..12])
    }
}

/// The grammar engine stopped a sequence; holds the part of its error a client may see.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the grammar engine stopped: {public}")]
pub struct GrammarStopped {
    /// The first line of the engine's message, without parser state, at most 200 characters.
    pub public: String,
}

/// The part of a grammar engine error a client may see: its first line, without the parser
/// state that follows it (token dumps, internal counters), at most 200 characters. The whole
/// error goes to the log.
fn public_error(kind: &str, error: &str) -> ConstraintError {
    tracing::warn!(kind, error, "the grammar engine stopped a sequence");
    ConstraintError::refused(GrammarStopped {
        public: first_line(error),
    })
}

/// An engine message's first line, without the parser state that may follow it, at most 200
/// characters.
fn first_line(error: &str) -> String {
    let first = error
        .split("<state>")
        .next()
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or_default()
        .trim();
    let mut line: String = first.chars().take(200).collect();
    if line.len() < first.len() {
        line.push('…');
    }
    line
}

/// One sequence's grammar state.
struct Guided {
    matcher: Matcher,
    kind: &'static str,
}

impl TokenConstraint for Guided {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        let started = Instant::now();
        let allowed = self
            .matcher
            .compute_mask()
            .map_err(|e| public_error(self.kind, &e.to_string()))?;
        let words = mask.words_mut();
        let src = allowed.as_slice();
        let n = words.len().min(src.len());
        words[..n].copy_from_slice(&src[..n]);
        words[n..].fill(0);
        metrics::histogram!("rampart_grammar_mask_seconds", "kind" => self.kind)
            .record(started.elapsed().as_secs_f64());
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| public_error(self.kind, &e.to_string()))
    }

    fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }
}

fn pointer(p: &str) -> &str {
    if p.is_empty() {
        "the root"
    } else {
        p
    }
}
