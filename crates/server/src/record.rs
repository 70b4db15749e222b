//! The InferenceRecord: one per request, produced when the request ends (however it ends), and
//! fanned out to the sinks: the structured log and the Prometheus metrics. Handlers never call
//! the sinks; they fill a [`RecordBuilder`] and let it go.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use sha2::{Digest, Sha256};

/// The fixed fields of one request's record.
#[derive(Debug, Clone, Serialize)]
pub struct InferenceRecord {
    pub request_id: String,
    pub audit_id: String,
    /// Milliseconds since the Unix epoch when the request arrived.
    pub time_ms: u64,
    pub principal: String,
    pub user: Option<String>,
    pub endpoint: &'static str,
    pub model: String,
    pub version: String,
    pub version_digest: String,
    /// sha256 of the prompt (text, or the chat messages as JSON).
    pub input_sha256: String,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_prompt_tokens: usize,
    pub queue_ms: f64,
    pub prefill_ms: f64,
    pub ttft_ms: f64,
    pub decode_ms: f64,
    pub total_ms: f64,
    pub entropy_mean: Option<f32>,
    pub entropy_min: Option<f32>,
    /// Mean token entropy outside the model's configured band.
    pub abnormal: bool,
    /// `stop`, `length`, `cancelled` (client went away), or none when it failed.
    pub finish_reason: Option<String>,
    pub status: u16,
    pub error_type: Option<String>,
    /// 0: the model asked for; higher: a fallback served (none yet).
    pub fallback_level: u8,
    pub stream: bool,
    /// Structured-output requests: the constraint and what the final check said.
    pub structured: Option<StructuredRecord>,
    /// Tensor models with declared post-processing: the mean over the batch of each input's
    /// confidence (top class probability, or best detection score).
    pub confidence: Option<f32>,
    /// The lowest of those confidences.
    pub confidence_min: Option<f32>,
    /// Tensor and embedding models: inputs in the request (batch rows, texts).
    pub items: usize,
    /// Tensor and embedding models: time in pre-processing, the queue and the backend.
    pub compute_ms: f64,
}

/// The structured-output part of a record.
#[derive(Debug, Clone, Serialize)]
pub struct StructuredRecord {
    /// `json_schema`, `json_object`, `regex`, `choice` or `grammar`.
    pub kind: &'static str,
    /// sha256 of the canonical constraint (the compile cache's key).
    pub grammar_sha256: String,
    /// Compile time of this grammar (0 when it came from the cache).
    pub compile_ms: f64,
    pub cached: bool,
    /// Worst outcome over the choices: `valid`, `incomplete` (ended at max_tokens inside the
    /// structure) or `invalid` (ended but fails the check); none when the request did not finish.
    pub outcome: Option<&'static str>,
    /// Why the output is incomplete or invalid.
    pub problem: Option<String>,
}

/// Collects a record while a request runs; emits it exactly once, on `finish` or when dropped
/// (a client that disconnects still produces its record, with `finish_reason: cancelled`).
#[derive(Debug)]
pub struct RecordBuilder {
    pub record: InferenceRecord,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    entropy_sum: f64,
    entropy_count: usize,
    entropy_min: f32,
    entropy_band: Option<[f32; 2]>,
    emitted: bool,
    sink: fn(&InferenceRecord, &[f64], &[f32]),
    /// Gaps between consecutive tokens (seconds), for the inter-token latency histogram.
    gaps: Vec<f64>,
    entropies: Vec<f32>,
}

pub fn sha256_hex(text: &str) -> String {
    hex::encode(Sha256::digest(text.as_bytes()))
}

impl RecordBuilder {
    pub fn new(
        request_id: String,
        principal: String,
        endpoint: &'static str,
        sink: fn(&InferenceRecord, &[f64], &[f32]),
    ) -> Self {
        let time_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Self {
            record: InferenceRecord {
                request_id,
                audit_id: uuid::Uuid::new_v4().to_string(),
                time_ms,
                principal,
                user: None,
                endpoint,
                model: String::new(),
                version: String::new(),
                version_digest: String::new(),
                input_sha256: String::new(),
                prompt_tokens: 0,
                completion_tokens: 0,
                cached_prompt_tokens: 0,
                queue_ms: 0.0,
                prefill_ms: 0.0,
                ttft_ms: 0.0,
                decode_ms: 0.0,
                total_ms: 0.0,
                entropy_mean: None,
                entropy_min: None,
                abnormal: false,
                finish_reason: None,
                status: 200,
                error_type: None,
                fallback_level: 0,
                stream: false,
                structured: None,
                confidence: None,
                confidence_min: None,
                items: 0,
                compute_ms: 0.0,
            },
            started: Instant::now(),
            first_token: None,
            last_token: None,
            entropy_sum: 0.0,
            entropy_count: 0,
            entropy_min: f32::INFINITY,
            entropy_band: None,
            emitted: false,
            sink,
            gaps: Vec::new(),
            entropies: Vec::new(),
        }
    }

    pub fn set_entropy_band(&mut self, band: Option<[f32; 2]>) {
        self.entropy_band = band;
    }

    /// A generated token arrived.
    pub fn token(&mut self, entropy: f32) {
        let now = Instant::now();
        if self.first_token.is_none() {
            self.first_token = Some(now);
            self.record.ttft_ms = now.duration_since(self.started).as_secs_f64() * 1e3;
        }
        if let Some(last) = self.last_token {
            self.gaps.push(now.duration_since(last).as_secs_f64());
        }
        self.last_token = Some(now);
        if entropy.is_finite() {
            self.entropy_sum += f64::from(entropy);
            self.entropy_count += 1;
            self.entropy_min = self.entropy_min.min(entropy);
            self.entropies.push(entropy);
        }
    }

    /// The request failed with this status and error type.
    pub fn fail(&mut self, status: u16, error_type: &str) {
        self.record.status = status;
        self.record.error_type = Some(error_type.to_string());
    }

    /// Emits the record (once).
    pub fn finish(&mut self) {
        if self.emitted {
            return;
        }
        self.emitted = true;
        let r = &mut self.record;
        r.total_ms = self.started.elapsed().as_secs_f64() * 1e3;
        if self.entropy_count > 0 {
            let mean = (self.entropy_sum / self.entropy_count as f64) as f32;
            r.entropy_mean = Some(mean);
            r.entropy_min = Some(self.entropy_min);
            if let Some([lo, hi]) = self.entropy_band {
                r.abnormal = mean < lo || mean > hi;
            }
        }
        if r.status == 200 && r.finish_reason.is_none() {
            r.finish_reason = Some("cancelled".into());
            r.status = 499;
            r.error_type = Some("client_closed_request".into());
        }
        (self.sink)(r, &self.gaps, &self.entropies);
    }
}

impl Drop for RecordBuilder {
    fn drop(&mut self) {
        self.finish();
    }
}
