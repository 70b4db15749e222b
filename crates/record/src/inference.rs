//! The record of one request and the envelope it travels in.

use serde::Serialize;

/// The fixed fields of one request's record.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct InferenceRecord {
    pub request_id: String,
    pub audit_id: String,
    /// The response body's `id` (`chatcmpl-…`, `cmpl-…`), where the protocol has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub response_id: Option<String>,
    /// Milliseconds since the Unix epoch when the request arrived.
    pub time_ms: u64,
    pub principal: String,
    pub user: Option<String>,
    /// The person acting (`X-Operator-Id`), when the client names one.
    pub operator: Option<String>,
    /// The W3C trace id: the one the request came with (`traceparent`), or, when tracing is
    /// on, the id of the trace the server started for it.
    pub trace_id: Option<String>,
    pub endpoint: &'static str,
    pub model: String,
    pub version: String,
    pub version_digest: String,
    /// The version's lineage (`LINEAGE.json`): the source's git commit and dataset version.
    pub lineage_commit: Option<String>,
    pub dataset_version: Option<String>,
    /// The release variant that answered (`stable` or `candidate`; `shadow` for the discarded
    /// copy a shadow release mirrors), when the model has a release plan.
    pub variant: Option<&'static str>,
    /// Why the route chose that version: `weight` (the user's sticky bucket against the
    /// candidate's weight), `group` (an A/B group), `anonymous` (no user: a per-request draw),
    /// `named_version` (the request named it), `no_release`, `paused`, `holding`,
    /// `rolled_back`, `shadow`.
    pub route_reason: Option<&'static str>,
    /// Mean utilization (0–1) of the host's GPUs at the server's last telemetry reading (each
    /// `/metrics` scrape); absent without GPUs (or before the first scrape).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_utilization: Option<f32>,
    /// The request's sampling parameters (temperature, top_p, max_tokens, seed, ...).
    pub params: Option<serde_json::Value>,
    /// sha256 of the input (prompt text, chat messages as JSON, or the tensors).
    pub input_sha256: String,
    /// sha256 of the output as the client received it (empty when none).
    pub output_sha256: String,
    /// What the input guard said (`allow`, `flag`, `block`, `shadow`, `error`), when it ran.
    pub guard_verdict: Option<String>,
    /// The guard's reason codes, strongest first (`rules.ignore_instructions`, ...).
    pub guard_reasons: Vec<String>,
    /// The guard's highest score (0 to 1).
    pub guard_score: Option<f32>,
    /// How long the guard took.
    pub guard_ms: Option<f64>,
    /// The output side: `flag` (the system prompt's canary or the prompt itself came back) or
    /// `cut` (the output was cut before it).
    pub guard_output: Option<&'static str>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_prompt_tokens: usize,
    /// Tokens guessed by prompt lookup and verified, and how many of them were kept (the
    /// acceptance; 0 and 0 without prompt lookup).
    pub speculated_tokens: u64,
    pub speculated_accepted: u64,
    /// The digest of each choice's attention export (comma-separated, choice order), when the
    /// request asked for one: what `rampart explain verify` recomputes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention_sha256: Option<String>,
    /// What `rampart explain verify` needs to replay an attention export: the kernel identity,
    /// the request's settings (`engine::explain::replay_settings`) and, per choice, the digest
    /// after each exported token (16 hex digits). In the audit entry; not in the log line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<serde_json::Value>,
    /// `explain.reasons`: the reasons given with the answer (method, spans with their offsets
    /// and drops, the deletion check), or why none could be given. In the audit entry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasons: Option<serde_json::Value>,
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
    /// The stable error type (`invalid_request_error`, `rate_limit_error`, ...).
    pub error_type: Option<String>,
    /// The precise error code where the type is shared (`rate_limited` vs `queue_full`,
    /// `context_length_exceeded`, `model_not_found`, ...).
    pub error_code: Option<String>,
    /// Why the front refused the request before a backend saw it (`unauthorized`,
    /// `body_too_large`, `rate_limited`, `queue_full`, `queue_timeout`); none otherwise.
    pub refusal: Option<&'static str>,
    /// 0: the model asked for; 1: another backend of its chain (a model, the same tensor model
    /// on the other runtime, the rules engine); 2: a canned answer; 3: handed off to people.
    pub fallback_level: u8,
    /// The backend that answered when it was not the model asked for (`name@version`,
    /// `name@version:tract`, `canned:name`).
    pub fallback_backend: Option<String>,
    /// The trigger that moved the request off the model asked for (`error`,
    /// `first_token_timeout`, `stall_timeout`, `overloaded`, `circuit_open`, `context_length`,
    /// `not_ready`; `human_handoff` at level 3).
    pub fallback_reason: Option<&'static str>,
    /// Each backend the request tried, in order, with how it went.
    pub attempts: Vec<Attempt>,
    pub stream: bool,
    /// Structured-output requests: the constraint and what the final check said.
    pub structured: Option<StructuredRecord>,
    /// Tool-calling requests: the functions the answer called, in order over the choices (the
    /// arguments are in the audit entry's output).
    pub tool_calls: Vec<String>,
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

/// One backend a request tried.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Attempt {
    /// `name@version`, `name@version:tract` or `canned:name`.
    pub backend: String,
    /// `answered`, or the trigger it failed with (`error`, `first_token_timeout`, ...), or
    /// `skipped` (the step does not take the trigger or the work).
    pub outcome: &'static str,
    /// What happened, in words (the error's message, the injected fault).
    pub detail: Option<String>,
    /// Time spent on this attempt.
    pub ms: f64,
}

/// The structured-output part of a record.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct StructuredRecord {
    /// `json_schema`, `json_object`, `regex`, `choice`, `grammar`, or `tools` (a tool-calling
    /// request's grammar: calls in the model's format, arguments held to each schema).
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

/// The full input and output of a request. Only sinks that ask for it (the audit log) receive
/// it; the others see the record alone.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Payload {
    /// The input as the client sent it in meaning (messages, prompt, texts, tensor digests).
    pub input: Option<serde_json::Value>,
    /// The output as the client received it (texts, vectors' shapes, tensor digests).
    pub output: Option<serde_json::Value>,
}

/// What travels to the sinks: the record plus the per-token series the metrics need, and the
/// payload for the sinks that want it.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub record: InferenceRecord,
    /// Gaps between consecutive tokens, in seconds.
    pub token_gaps_s: Vec<f64>,
    /// Entropy of each generated token's distribution, in nats.
    pub token_entropies: Vec<f32>,
    /// What the request's input looked like where only the request path could see it (one
    /// observation per image of a batch, with the output features of that image), for the
    /// monitors. Empty when no monitor runs.
    pub observations: Vec<crate::Observation>,
    pub payload: Option<Payload>,
    /// The stages' times and the caller's trace context, when a sink wants them (tracing on).
    pub timeline: Option<Box<crate::Timeline>>,
}

impl InferenceRecord {
    /// Refused before any work, by a refusal its sender can repeat at any rate: a missing or
    /// invalid key (`unauthorized`: anyone can send those) or a key past its rate limit
    /// (`rate_limited`). Sinks that write per record (the audit log, the log, traces) leave
    /// them to the server's summaries ([`crate::Sink::takes_summarised_refusals`]); the metrics
    /// still count each one.
    pub fn summarised_refusal(&self) -> bool {
        matches!(self.refusal, Some("unauthorized" | "rate_limited"))
    }

    /// An empty record of a request that just arrived.
    pub fn new(request_id: String, principal: String, endpoint: &'static str) -> Self {
        let time_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        Self {
            request_id,
            audit_id: uuid::Uuid::new_v4().to_string(),
            response_id: None,
            time_ms,
            principal,
            user: None,
            operator: None,
            trace_id: None,
            endpoint,
            model: String::new(),
            version: String::new(),
            version_digest: String::new(),
            lineage_commit: None,
            dataset_version: None,
            variant: None,
            route_reason: None,
            gpu_utilization: None,
            params: None,
            input_sha256: String::new(),
            output_sha256: String::new(),
            guard_verdict: None,
            guard_reasons: Vec::new(),
            guard_score: None,
            guard_ms: None,
            guard_output: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_prompt_tokens: 0,
            speculated_tokens: 0,
            attention_sha256: None,
            attention: None,
            reasons: None,
            speculated_accepted: 0,
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
            error_code: None,
            refusal: None,
            fallback_level: 0,
            fallback_backend: None,
            fallback_reason: None,
            attempts: Vec::new(),
            stream: false,
            structured: None,
            tool_calls: Vec::new(),
            confidence: None,
            confidence_min: None,
            items: 0,
            compute_ms: 0.0,
        }
    }
}
