//! A request's timeline: what a trace needs beyond the record. The caller's trace context (the
//! `traceparent`'s parent span and flags, the `tracestate`), the wall-clock start, each stage's
//! start and end (guard, route, admission, tokenize, the chain's attempts, the tensor stages),
//! and a sample of the generated tokens.
//!
//! Kept only when a sink asks for it ([`crate::Sink::wants_timeline`]: the trace sink, when
//! `[tracing]` is on). Otherwise the builder holds `None` and every stage call is one branch, so
//! a server without tracing pays nothing for it.

use std::time::{Duration, Instant, SystemTime};

/// The timeline of one request; offsets are from its arrival.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// The caller's span (the `traceparent`'s parent id, 16 lowercase hex), when it sent one.
    pub parent_span_id: Option<String>,
    /// The caller's `sampled` flag, when it sent a `traceparent`.
    pub parent_sampled: Option<bool>,
    /// The caller's `tracestate`, passed on as it came.
    pub tracestate: Option<String>,
    /// The id the response gave the client (`chatcmpl-…`), when it has one.
    pub response_id: Option<String>,
    /// When the request arrived, by the wall clock (spans carry wall-clock times).
    pub started: SystemTime,
    /// When the record was published (the request's end), from the arrival.
    pub published: Duration,
    pub stages: Vec<Stage>,
    /// The sampled tokens (`token_fraction` of them), in order.
    pub tokens: Vec<TokenNote>,
    /// The fraction of generated tokens kept as notes (0: none).
    pub token_fraction: f64,
    /// Tokens seen, and the running share that decides the next note.
    token_count: usize,
    token_credit: f64,
}

/// One stage of the request, as offsets from its arrival.
#[derive(Debug, Clone, PartialEq)]
pub struct Stage {
    /// `guard`, `route`, `admission`, `attempt`, `tokenize`, `structured_output`,
    /// `decode_image`, `preprocess`, `batch_wait`, `compute`, `postprocess`.
    pub name: &'static str,
    pub start: Duration,
    pub end: Duration,
}

/// One sampled generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenNote {
    /// When it arrived, from the request's arrival.
    pub at: Duration,
    /// Its position among the request's generated tokens (0-based).
    pub index: usize,
    pub text: String,
    /// Its log-probability, when the request asked for logprobs.
    pub logprob: Option<f32>,
    /// Entropy of the distribution it was drawn from, in nats.
    pub entropy: f32,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    /// An empty timeline that starts now.
    pub fn new() -> Self {
        Self {
            parent_span_id: None,
            parent_sampled: None,
            tracestate: None,
            response_id: None,
            started: SystemTime::now(),
            published: Duration::ZERO,
            stages: Vec::new(),
            tokens: Vec::new(),
            token_fraction: 0.0,
            token_count: 0,
            token_credit: 0.0,
        }
    }

    pub(crate) fn stage(
        &mut self,
        origin: Instant,
        name: &'static str,
        began: Instant,
        ended: Instant,
    ) {
        self.stages.push(Stage {
            name,
            start: began.saturating_duration_since(origin),
            end: ended.saturating_duration_since(origin),
        });
    }

    /// Whether the next token is kept: an even spread (every 1/fraction-th), not a random one,
    /// so a response's notes are reproducible.
    pub(crate) fn next_token_kept(&mut self) -> Option<usize> {
        let index = self.token_count;
        self.token_count += 1;
        if self.token_fraction <= 0.0 {
            return None;
        }
        self.token_credit += self.token_fraction.min(1.0);
        if self.token_credit >= 1.0 - 1e-9 {
            self.token_credit -= 1.0;
            Some(index)
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_notes_are_an_even_share() {
        let mut t = Timeline::new();
        t.token_fraction = 0.25;
        let kept: Vec<usize> = (0..12).filter_map(|_| t.next_token_kept()).collect();
        assert_eq!(kept, vec![3, 7, 11]);
        let mut none = Timeline::new();
        assert!((0..10).all(|_| none.next_token_kept().is_none()));
        let mut all = Timeline::new();
        all.token_fraction = 1.0;
        assert_eq!((0..4).filter_map(|_| all.next_token_kept()).count(), 4);
    }
}
