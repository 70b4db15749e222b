//! Collects a record while its request runs and publishes it exactly once.

use std::sync::Arc;
use std::time::Instant;

use sha2::{Digest, Sha256};

use crate::bus::{Bus, Receipt};
use crate::inference::{Envelope, InferenceRecord, Payload};
use crate::timeline::{Timeline, TokenNote};

/// Collects a record while a request runs; publishes it to the bus exactly once, on `finish`
/// or when dropped (a client that disconnects still produces its record, with
/// `finish_reason: cancelled` and status 499).
#[derive(Debug)]
pub struct RecordBuilder {
    pub record: InferenceRecord,
    bus: Arc<Bus>,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    entropy_sum: f64,
    entropy_count: usize,
    entropy_min: f32,
    entropy_band: Option<[f32; 2]>,
    emitted: bool,
    gaps: Vec<f64>,
    entropies: Vec<f32>,
    observations: Vec<crate::Observation>,
    payload: Option<Payload>,
    /// Kept only when a sink wants it (tracing on); `None` costs nothing.
    timeline: Option<Box<Timeline>>,
}

/// sha256 of a text, as lowercase hex.
pub fn sha256_hex(text: &str) -> String {
    sha256_bytes_hex(text.as_bytes())
}

/// sha256 of bytes, as lowercase hex.
pub fn sha256_bytes_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl RecordBuilder {
    pub fn new(
        bus: Arc<Bus>,
        request_id: String,
        principal: String,
        endpoint: &'static str,
    ) -> Self {
        let timeline = bus.wants_timeline().then(|| Box::new(Timeline::new()));
        Self {
            record: InferenceRecord::new(request_id, principal, endpoint),
            bus,
            started: Instant::now(),
            first_token: None,
            last_token: None,
            entropy_sum: 0.0,
            entropy_count: 0,
            entropy_min: f32::INFINITY,
            entropy_band: None,
            emitted: false,
            gaps: Vec::new(),
            entropies: Vec::new(),
            observations: Vec::new(),
            payload: None,
            timeline,
        }
    }

    /// Whether this record keeps a timeline (a sink traces requests).
    pub fn traced(&self) -> bool {
        self.timeline.is_some()
    }

    /// The request's timeline, when one is kept (to set the caller's trace context).
    pub fn timeline_mut(&mut self) -> Option<&mut Timeline> {
        self.timeline.as_deref_mut()
    }

    /// A stage of the request ran from `began` to `ended` (kept only when traced).
    pub fn stage(&mut self, name: &'static str, began: Instant, ended: Instant) {
        if let Some(t) = &mut self.timeline {
            t.stage(self.started, name, began, ended);
        }
    }

    /// A stage of the request ran from `began` until now (kept only when traced).
    pub fn stage_since(&mut self, name: &'static str, began: Instant) {
        if self.timeline.is_some() {
            self.stage(name, began, Instant::now());
        }
    }

    /// What the last generated token was, for the sampled token notes (call after
    /// [`RecordBuilder::token`]; `text` is made only for a token that is kept).
    pub fn token_note(
        &mut self,
        text: impl FnOnce() -> String,
        logprob: Option<f32>,
        entropy: f32,
    ) {
        let Some(t) = &mut self.timeline else { return };
        if let Some(index) = t.next_token_kept() {
            t.tokens.push(TokenNote {
                at: self.started.elapsed(),
                index,
                text: text(),
                logprob,
                entropy,
            });
        }
    }

    pub fn set_entropy_band(&mut self, band: Option<[f32; 2]>) {
        self.entropy_band = band;
    }

    /// Whether any sink takes the payload: callers build it only then.
    pub fn wants_payload(&self) -> bool {
        self.bus.wants_payload()
    }

    /// The full input (kept only when a sink wants it).
    pub fn payload_input(&mut self, input: impl FnOnce() -> serde_json::Value) {
        if self.wants_payload() {
            self.payload.get_or_insert_with(Payload::default).input = Some(input());
        }
    }

    /// The full output (kept only when a sink wants it; its sha256 goes into the record).
    pub fn payload_output(&mut self, output: impl FnOnce() -> serde_json::Value) {
        if self.wants_payload() {
            let output = output();
            self.record.output_sha256 = sha256_hex(&output.to_string());
            self.payload.get_or_insert_with(Payload::default).output = Some(output);
        }
    }

    /// A generated token arrived.
    /// Adds an observation of the input (and its output) for the monitors.
    pub fn observe(&mut self, o: crate::Observation) {
        self.observations.push(o);
    }

    /// Returns the gap since the previous token in seconds (none for the first).
    pub fn token(&mut self, entropy: f32) -> Option<f64> {
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
            self.record.ttft_ms = now.duration_since(self.started).as_secs_f64() * 1e3;
        }
        let gap = self
            .last_token
            .map(|last| now.duration_since(last).as_secs_f64());
        if let Some(g) = gap {
            self.gaps.push(g);
        }
        self.last_token = Some(now);
        if entropy.is_finite() {
            self.entropy_sum += f64::from(entropy);
            self.entropy_count += 1;
            self.entropy_min = self.entropy_min.min(entropy);
            self.entropies.push(entropy);
        }
        gap
    }

    /// The request failed with this status, error type and (where there is one) error code.
    pub fn fail(&mut self, status: u16, error_type: &str, error_code: Option<&str>) {
        self.record.status = status;
        self.record.error_type = Some(error_type.to_string());
        self.record.error_code = error_code.map(str::to_string);
    }

    /// The front refused the request before a backend saw it, for `reason`.
    pub fn refuse(&mut self, reason: &'static str) {
        self.record.refusal = Some(reason);
    }

    /// Publishes the record (once; later calls return an empty receipt). The receipt resolves
    /// when every acknowledging sink has made the record durable.
    pub fn finish(&mut self) -> Receipt {
        if self.emitted {
            return Receipt::empty();
        }
        self.emitted = true;
        let record = &mut self.record;
        record.total_ms = self.started.elapsed().as_secs_f64() * 1e3;
        if self.entropy_count > 0 {
            let mean = (self.entropy_sum / self.entropy_count as f64) as f32;
            record.entropy_mean = Some(mean);
            record.entropy_min = Some(self.entropy_min);
            if let Some([lo, hi]) = self.entropy_band {
                record.abnormal = mean < lo || mean > hi;
            }
        }
        if record.status == 200 && record.finish_reason.is_none() {
            record.finish_reason = Some("cancelled".into());
            record.status = 499;
            record.error_type = Some("client_closed_request".into());
            record.error_code = Some("client_closed_request".into());
        }
        let record = record.clone();
        let mut timeline = self.timeline.take();
        if let Some(t) = &mut timeline {
            t.published = self.started.elapsed();
        }
        self.bus.publish(Envelope {
            record,
            token_gaps_s: std::mem::take(&mut self.gaps),
            token_entropies: std::mem::take(&mut self.entropies),
            observations: std::mem::take(&mut self.observations),
            payload: self.payload.take(),
            timeline,
        })
    }
}

impl Drop for RecordBuilder {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}
