//! The end of a generation, the same for every protocol and for shadow mirrors: a
//! [`Delivery`] takes each event the encoder reads (the record's token timings and notes, the
//! gap the engine is told as a token leaves, each choice's text when something reads it at the
//! end) and [`Delivery::finish`] settles what every protocol must settle once all choices ended:
//! the record's timings and finish reason, the key's token charge, the guard's output watch,
//! the structured-output check, and the output the audit log keeps. Encoders only encode.

use std::sync::Arc;

use engine::{FinishReason, Finished};
use futures_util::StreamExt;
use record::RecordBuilder;

use crate::admission::Slot;
use crate::backend::{Generated, Generation, Token};
use crate::error::ApiError;
use crate::rate_limit::RateLimiter;
use crate::registry::Entry;

/// A generation on its way to the client, from its first event to its [`Delivery::finish`].
pub struct Delivery {
    generation: Generation,
    entry: Arc<Entry>,
    /// Held until the response ends (the admission slot); charges the key's tokens.
    ticket: Ticket,
    /// The engine that generates it, told how far apart the tokens reach the client (a
    /// single-choice language-model response only: the gaps of several choices interleave).
    delivered_to: Option<Arc<engine::Engine>>,
    /// Each choice's text so far, kept when something reads it (the encoder of a whole answer,
    /// the structured-output check, the output watch, a sink that takes the payload).
    texts: Option<Vec<String>>,
    finished: Vec<Option<Finished>>,
    /// The text reaches the client as it comes (a stream): what finishing finds wrong cannot
    /// withhold it, so the audit keeps it whatever the check says.
    streamed: bool,
    /// The ids of each choice's tool calls, made when the encoder first names a call; the
    /// audit entry names the same.
    tool_ids: Vec<Vec<String>>,
}

impl std::fmt::Debug for Delivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Delivery")
            .field("entry", &self.entry.id)
            .field("choices", &self.generation.choices)
            .finish_non_exhaustive()
    }
}

impl Delivery {
    /// A generation `entry` answered, held by `ticket`. Not `streamed`: the caller reads the
    /// whole texts at the end ([`Delivery::take_texts`]); a stream keeps them only when the
    /// finish needs them (a structured-output check, an output watch, a sink of payloads).
    pub fn new(
        generation: Generation,
        entry: Arc<Entry>,
        ticket: Ticket,
        streamed: bool,
        record: &RecordBuilder,
    ) -> Self {
        let choices = generation.choices;
        let keep_texts = !streamed
            || generation.structured.is_some()
            || generation.tools.is_some()
            || generation.watch.is_some()
            || record.wants_payload();
        let delivered_to = if choices == 1 {
            entry.engine.clone()
        } else {
            None
        };
        Self {
            delivered_to,
            texts: keep_texts.then(|| vec![String::new(); choices]),
            finished: vec![None; choices],
            tool_ids: vec![Vec::new(); choices],
            generation,
            entry,
            ticket,
            streamed,
        }
    }

    /// The entry that answers.
    pub fn entry(&self) -> &Arc<Entry> {
        &self.entry
    }

    pub fn choices(&self) -> usize {
        self.generation.choices
    }

    pub fn prompt_tokens(&self) -> usize {
        self.generation.prompt_tokens
    }

    /// The tool-calling session, when the request offered tools to a model that takes them.
    pub fn tools(&self) -> Option<&Arc<grammar::tools::ToolSession>> {
        self.generation.tools.as_ref()
    }

    /// The attention export the tokens carry, when the request asked and the model answered.
    pub fn explain(&self) -> Option<&crate::backend::ExplainInfo> {
        self.generation.explain.as_ref()
    }

    /// The id of choice `i`'s call `index` (made on first use, in the format's shape).
    pub fn tool_call_id(&mut self, i: usize, index: usize) -> String {
        match self.generation.tools.clone() {
            Some(session) => call_id(&session, &mut self.tool_ids[i], index),
            None => String::new(),
        }
    }

    /// The next event of any choice (none: the backend stopped).
    pub async fn next(&mut self) -> Option<(usize, Generated)> {
        self.generation.events.next().await
    }

    /// Choice `i`'s text so far (empty when texts are not kept).
    pub fn text(&self, i: usize) -> &str {
        self.texts
            .as_ref()
            .and_then(|t| t.get(i))
            .map_or("", String::as_str)
    }

    /// The choices' texts (empty when not kept).
    pub fn take_texts(&mut self) -> Vec<String> {
        self.texts.take().unwrap_or_default()
    }

    /// A token of choice `i` leaves for the client: its timing and note in the record, the gap
    /// told to the engine, its text kept.
    pub fn on_token(&mut self, record: &mut RecordBuilder, i: usize, t: &Token) {
        let gap = record.token(t.entropy);
        if let (Some(engine), Some(gap)) = (&self.delivered_to, gap) {
            engine.record_delivered_gap((gap * 1e3) as f32);
        }
        record.token_note(
            || t.text.clone(),
            t.logprobs.as_ref().map(|l| l.logprob),
            t.entropy,
        );
        if let Some(text) = self.texts.as_mut().and_then(|t| t.get_mut(i)) {
            text.push_str(&t.text);
        }
    }

    /// Choice `i` ended; true once every choice has.
    pub fn on_finished(&mut self, i: usize, f: &Finished) -> bool {
        if let Some(text) = self.texts.as_mut().and_then(|t| t.get_mut(i)) {
            text.push_str(&f.trailing_text);
        }
        if let Some(slot) = self.finished.get_mut(i) {
            *slot = Some(f.clone());
        }
        self.finished.iter().all(Option::is_some)
    }

    /// Once every choice ended: the record's timings and finish reason, the key's token
    /// charge, the output watch, the structured-output check (an output that ended by itself
    /// yet fails its schema is an error: the API promises the shape), and the output the audit
    /// keeps (for a stream, whatever the check said: the text went out).
    pub fn finish(&mut self, record: &mut RecordBuilder) -> Result<(), ApiError> {
        let all: Vec<Finished> = self.finished.iter().flatten().cloned().collect();
        record_finished(record, &all);
        self.ticket
            .charge(record.record.prompt_tokens + record.record.completion_tokens);
        let texts: Vec<&str> = match &self.texts {
            Some(texts) => texts.iter().map(String::as_str).collect(),
            None => Vec::new(),
        };
        let outputs: Vec<(&str, &Finished)> = texts.iter().copied().zip(all.iter()).collect();
        if let Some(watch) = &self.generation.watch {
            let stops: Vec<Option<&str>> = all.iter().map(|f| f.stop.as_deref()).collect();
            crate::watch::watch_outputs(
                watch,
                record,
                &self.entry.name,
                outputs.iter().map(|(t, _)| *t),
                &stops,
            );
        }
        let checked = self
            .generation
            .check_outputs(record, &outputs)
            .map_err(ApiError::from);
        let calls = self.generation.tools.clone().map(|session| {
            tool_calls(
                &session,
                &mut self.tool_ids,
                &self.entry.name,
                record,
                &outputs,
            )
        });
        if checked.is_ok() || self.streamed {
            record.payload_output(|| match &calls {
                Some(calls) => serde_json::json!({ "choices": texts, "tool_calls": calls }),
                None => serde_json::json!({ "choices": texts }),
            });
        }
        checked
    }
}

/// Call `index`'s id among a choice's `ids` (made on first use).
fn call_id(session: &grammar::tools::ToolSession, ids: &mut Vec<String>, index: usize) -> String {
    while ids.len() <= index {
        ids.push(session.new_id());
    }
    ids[index].clone()
}

/// Each choice's tool calls (id, function, arguments), counted per function, their names in
/// the record.
fn tool_calls(
    session: &grammar::tools::ToolSession,
    tool_ids: &mut [Vec<String>],
    model: &str,
    record: &mut RecordBuilder,
    outputs: &[(&str, &Finished)],
) -> Vec<Vec<serde_json::Value>> {
    let mut all = Vec::with_capacity(outputs.len());
    for (i, (text, f)) in outputs.iter().enumerate() {
        let read = session.read(text);
        let cut = f.reason == FinishReason::Length || f.stop.is_some();
        if read.problem.is_some() && !cut {
            metrics::counter!("rampart_tool_calls_invalid_total", "model" => model.to_string())
                .increment(1);
        }
        let mut calls = Vec::with_capacity(read.calls.len());
        for (index, (name, arguments)) in read.calls.iter().enumerate() {
            metrics::counter!(
                "rampart_tool_calls_total",
                "model" => model.to_string(),
                "function" => crate::tool_metrics::function_label(model, name)
            )
            .increment(1);
            record.record.tool_calls.push(name.clone());
            calls.push(serde_json::json!({
                "id": call_id(session, &mut tool_ids[i], index),
                "name": name,
                "arguments": arguments,
            }));
        }
        all.push(calls);
    }
    all
}

/// Held until the response ends: the admission slot, and the principal whose token budget the
/// response is charged to.
pub struct Ticket {
    /// None for answers the front gives itself (the guard's refusal completion).
    _slot: Option<Slot>,
    /// Whose budget pays (none: a shadow mirror, which no key asked for).
    payer: Option<(Arc<RateLimiter>, String)>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("principal", &self.payer.as_ref().map(|(_, p)| p))
            .finish_non_exhaustive()
    }
}

impl Ticket {
    pub(crate) fn new(slot: Option<Slot>, limiter: &Arc<RateLimiter>, principal: &str) -> Self {
        Self {
            _slot: slot,
            payer: Some((Arc::clone(limiter), principal.to_string())),
        }
    }

    /// A shadow mirror's hold on its slot: its tokens are charged to no key.
    pub fn unpaid(slot: Slot) -> Self {
        Self {
            _slot: Some(slot),
            payer: None,
        }
    }

    /// Charges the key's token budget for what the request used.
    pub fn charge(&self, tokens: usize) {
        if let Some((limiter, principal)) = &self.payer {
            limiter.charge(principal, tokens);
        }
    }
}

/// Fills the record's timings from the engine's account of each choice.
fn record_finished(record: &mut RecordBuilder, finished: &[Finished]) {
    let r = &mut record.record;
    r.completion_tokens = finished.iter().map(|f| f.completion_tokens).sum();
    r.cached_prompt_tokens = finished
        .iter()
        .map(|f| f.cached_prompt_tokens)
        .max()
        .unwrap_or(0);
    r.speculated_tokens = finished.iter().map(|f| f.speculated_tokens).sum();
    r.speculated_accepted = finished.iter().map(|f| f.speculated_accepted).sum();
    r.prefill_ms = finished
        .iter()
        .map(|f| f.prefill_seconds * 1e3)
        .fold(0.0, f64::max);
    r.decode_ms = finished
        .iter()
        .map(|f| f.decode_seconds * 1e3)
        .fold(0.0, f64::max);
    let length = finished.iter().any(|f| f.reason == FinishReason::Length);
    r.finish_reason = Some(if length { "length" } else { "stop" }.into());
}

/// What the record keeps of an embedding answer: the vectors' count, width and digests (of the
/// little-endian f32 bytes of each), not the vectors themselves.
pub fn record_embeddings(record: &mut RecordBuilder, e: &crate::backend::Embeddings) {
    record.payload_output(|| {
        let digests: Vec<String> = e
            .vectors
            .iter()
            .map(|v| {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                record::sha256_bytes_hex(&bytes)
            })
            .collect();
        serde_json::json!({
            "vectors": e.vectors.len(),
            "dimensions": e.vectors.first().map_or(0, Vec::len),
            "sha256": digests,
        })
    });
}
