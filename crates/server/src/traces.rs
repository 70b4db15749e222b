//! OpenTelemetry traces: one trace per request, exported over OTLP (gRPC or HTTP/protobuf) when
//! `[tracing] enabled`.
//!
//! **Built at the end, from the record.** A trace here is one more sink on the record bus: when
//! a request ends, its record (model, version, tokens, finish reason, fallback, guard verdict,
//! entropy, timings) and its [`record::Timeline`] (the caller's trace context, the wall-clock
//! start, each stage's start and end, sampled tokens) reach [`TraceSink`], which builds the
//! whole span tree with explicit start and end times and exports it. Why this rather than live
//! spans through `tracing-opentelemetry`:
//! - the record already carries nearly every attribute the GenAI conventions ask for, filled
//!   once; live spans would fill them a second time on the request path;
//! - prefill and decode run on the engine's own threads, which know nothing of HTTP or
//!   OpenTelemetry; their spans come from the timings the engine reports (`Finished`'s prefill
//!   and decode seconds, the first token's time), which only exist at the end anyway;
//! - the request path pays two `Instant`s per stage when tracing is on, and nothing when it is
//!   off: no sink, no timeline (the builder holds `None`), no exporter, no span objects;
//! - export cannot slow or fail a request: the sink's lane is lossy and bounded (drops counted
//!   as `rampart_record_dropped_total{sink="traces"}`), the sink exports in batches under a
//!   timeout, and a failed export drops its spans, counted and logged at most once a minute.
//!
//! The root span is still the parent of everything: a `SERVER` span named by the GenAI
//! conventions (`chat {model}`, `text_completion {model}`, `embeddings {model}`; tensor models
//! `infer {model}`), child of the caller's span when a `traceparent` came (same trace id, its
//! `tracestate` carried on), else the root of the trace whose id the record already carries.
//! Children: `guard`, `route`, one `attempt` per step of the fallback chain (with `admission`,
//! `tokenize`, `prefill`, `decode` with the sampled token events, `batch_wait` and `compute` for
//! embeddings and tensor models, and for images `decode_image`, `preprocess`, `postprocess`,
//! under the attempt they belong to), `structured_output` (the final check), and `record` (the
//! fan-out to the sinks).
//!
//! Sampling is parent-based: a caller's `sampled` flag decides; without one, the trace id's
//! lower 64 bits against `sampling_ratio` (as OpenTelemetry's `TraceIdRatioBased`). The server
//! makes no outgoing calls on a request's path (every fallback runs in-process), so there is
//! nothing to propagate the context to.

use std::borrow::Cow;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use metrics::counter;
use opentelemetry::trace::{
    Event, SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue, StringValue, Value};
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use record::{Delivery, Envelope, InferenceRecord, Sink, SinkError, SinkFuture, Stage, Timeline};

use crate::config::{TraceProtocol, TracingConfig};

/// The sink's name (the `sink` label of the bus's counters).
pub const TRACES_SINK: &str = "traces";

/// The value of `gen_ai.provider.name` (`gen_ai.system` before semconv 1.37).
pub const PROVIDER: &str = "rampart";

/// The exporter could not be set up.
#[derive(Debug, thiserror::Error)]
#[error("[tracing]: {0}")]
pub struct TraceSetupError(String);

pub use pipeline::origin::new_trace_id;

/// The parts of a valid W3C `traceparent` (`00-<trace id>-<parent id>-<flags>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: String,
    pub parent_span_id: String,
    pub sampled: bool,
}

impl TraceParent {
    /// Parses a `traceparent`: version `00` exactly as the spec lays it out; a later version
    /// by its first four fields (forward compatibility). None when invalid, or when either id
    /// is all zeros.
    pub fn parse(value: &str) -> Option<TraceParent> {
        let value = value.trim();
        let mut parts = value.split('-');
        let (version, trace, parent, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        // Upper-case hex is read too (as this server always has), then written in lower case.
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !hex(version, 2)
            || version.eq_ignore_ascii_case("ff")
            || !hex(trace, 32)
            || !hex(parent, 16)
        {
            return None;
        }
        if !hex(flags, 2) || (version == "00" && parts.next().is_some()) {
            return None;
        }
        if trace.bytes().all(|b| b == b'0') || parent.bytes().all(|b| b == b'0') {
            return None;
        }
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(TraceParent {
            trace_id: trace.to_ascii_lowercase(),
            parent_span_id: parent.to_ascii_lowercase(),
            sampled: flags & 1 == 1,
        })
    }
}

/// A `tracestate` worth passing on: at most 512 characters and 32 list members, each
/// `key=value` as the W3C grammar allows (checked by OpenTelemetry's parser). None otherwise,
/// as the spec asks of a vendor that cannot parse it.
pub fn sane_tracestate(value: &str) -> Option<String> {
    let value = value.trim();
    if value.is_empty() || value.len() > 512 || value.split(',').count() > 32 {
        return None;
    }
    value.parse::<TraceState>().ok().map(|_| value.to_string())
}

/// How the spans are named and what they carry, from `[tracing]` and the listen addresses.
#[derive(Debug, Clone)]
pub struct SpanSettings {
    pub sampling_ratio: f64,
    pub capture_content: bool,
    /// semconv 1.36 names the provider `gen_ai.system` and has no cache attribute.
    pub legacy_names: bool,
    /// `server.address` and `server.port` of the HTTP and the gRPC listener.
    pub http_address: (String, u16),
    pub grpc_address: (String, u16),
    /// The record's other sinks, named on the `record` span.
    pub sinks: Vec<&'static str>,
}

impl SpanSettings {
    pub fn new(
        config: &TracingConfig,
        http: SocketAddr,
        grpc: SocketAddr,
        sinks: Vec<&'static str>,
    ) -> Self {
        Self {
            sampling_ratio: config.sampling_ratio,
            capture_content: config.capture_content,
            legacy_names: config.semconv_version == "1.36",
            http_address: (http.ip().to_string(), http.port()),
            grpc_address: (grpc.ip().to_string(), grpc.port()),
            sinks,
        }
    }
}

/// The sink that turns each record into a trace and exports it.
pub struct TraceSink {
    exporter: opentelemetry_otlp::SpanExporter,
    settings: SpanSettings,
    scope: InstrumentationScope,
    ids: SpanIds,
    capacity: usize,
    max_batch: usize,
    timeout: Duration,
    /// When a failed export was last logged (at most once a minute).
    last_complaint: Option<Instant>,
}

impl std::fmt::Debug for TraceSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TraceSink").finish_non_exhaustive()
    }
}

impl TraceSink {
    /// The sink with its OTLP exporter (built here, on the running tokio runtime; a gRPC
    /// channel connects lazily, so a collector that is down does not stop the server).
    pub fn new(config: &TracingConfig, settings: SpanSettings) -> Result<Self, TraceSetupError> {
        let timeout = Duration::from_millis(config.export_timeout_ms);
        let endpoint = config.resolved_endpoint();
        let mut exporter = match config.protocol {
            TraceProtocol::Grpc => {
                let mut metadata = tonic::metadata::MetadataMap::new();
                for (name, value) in &config.headers {
                    let key = tonic::metadata::MetadataKey::from_bytes(name.as_bytes())
                        .map_err(|e| TraceSetupError(format!("header {name:?}: {e}")))?;
                    let value = value
                        .parse()
                        .map_err(|e| TraceSetupError(format!("header {name:?}: {e}")))?;
                    metadata.insert(key, value);
                }
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint.clone())
                    .with_timeout(timeout)
                    .with_metadata(metadata)
                    .build()
            }
            TraceProtocol::Http => {
                let client = reqwest::Client::builder()
                    .timeout(timeout)
                    .build()
                    .map_err(|e| TraceSetupError(format!("HTTP client: {e}")))?;
                let headers: HashMap<String, String> = config
                    .headers
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_http_client(client)
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(endpoint.clone())
                    .with_timeout(timeout)
                    .with_headers(headers)
                    .build()
            }
        }
        .map_err(|e| TraceSetupError(format!("exporter to {endpoint}: {e}")))?;
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_service_name(config.service_name.clone())
            .with_attributes([
                KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
                KeyValue::new("service.instance.id", config.service_instance_id.clone()),
            ])
            .build();
        exporter.set_resource(&resource);
        tracing::info!(
            endpoint = %endpoint,
            protocol = ?config.protocol,
            sampling_ratio = config.sampling_ratio,
            semconv = %config.semconv_version,
            "tracing: exporting spans over OTLP"
        );
        Ok(Self {
            exporter,
            settings,
            scope: scope(&config.semconv_version),
            ids: SpanIds::seeded(),
            capacity: config.queue_capacity,
            max_batch: config.max_batch,
            timeout,
            last_complaint: None,
        })
    }

    async fn export(&mut self, envelopes: &[&Envelope]) {
        let mut batch = Vec::new();
        for e in envelopes {
            batch.extend(build_spans(e, &self.settings, &self.scope, &mut self.ids));
        }
        if batch.is_empty() {
            return;
        }
        let n = batch.len() as u64;
        let outcome = tokio::time::timeout(self.timeout, self.exporter.export(batch)).await;
        let problem = match outcome {
            Ok(Ok(())) => {
                counter!("rampart_trace_spans_exported_total").increment(n);
                return;
            }
            Ok(Err(e)) => ("export_failed", e.to_string()),
            Err(_) => (
                "timeout",
                format!("no answer within {} ms", self.timeout.as_millis()),
            ),
        };
        counter!("rampart_trace_spans_dropped_total", "reason" => problem.0).increment(n);
        let quiet = self
            .last_complaint
            .is_some_and(|at| at.elapsed() < Duration::from_secs(60));
        if !quiet {
            self.last_complaint = Some(Instant::now());
            tracing::warn!(
                reason = problem.0,
                error = %problem.1,
                spans = n,
                "tracing: an export failed; its spans are dropped (counted in \
                 rampart_trace_spans_dropped_total; this warning repeats at most once a minute)"
            );
        }
    }
}

impl Sink for TraceSink {
    fn name(&self) -> &'static str {
        TRACES_SINK
    }

    /// No span for a request refused before authentication or past its key's rate limit: they
    /// come at any rate (counted in the metrics, summarised in the log and audit log).
    fn takes_summarised_refusals(&self) -> bool {
        false
    }

    fn delivery(&self) -> Delivery {
        Delivery::Lossy {
            capacity: self.capacity,
        }
    }

    fn wants_payload(&self) -> bool {
        self.settings.capture_content
    }

    fn wants_timeline(&self) -> bool {
        true
    }

    fn max_batch(&self) -> usize {
        self.max_batch
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        Box::pin(async move {
            self.export(&[envelope]).await;
            Ok::<(), SinkError>(())
        })
    }

    fn write_batch<'a>(&'a mut self, envelopes: &'a [Arc<Envelope>]) -> SinkFuture<'a> {
        Box::pin(async move {
            let all: Vec<&Envelope> = envelopes.iter().map(|e| e.as_ref()).collect();
            self.export(&all).await;
            Ok(())
        })
    }

    fn flush(&mut self) -> SinkFuture<'_> {
        Box::pin(async move {
            let _ = self.exporter.force_flush();
            Ok(())
        })
    }
}

/// The instrumentation scope, with the schema of the semconv version the names follow.
fn scope(semconv_version: &str) -> InstrumentationScope {
    InstrumentationScope::builder("rampart")
        .with_version(env!("CARGO_PKG_VERSION"))
        .with_schema_url(format!(
            "https://opentelemetry.io/schemas/{semconv_version}.0"
        ))
        .build()
}

/// Span ids: a SplitMix64 sequence seeded at random once (ids need to be unique, not secret;
/// one random draw per span would cost a system call each).
pub struct SpanIds(u64);

impl SpanIds {
    pub fn seeded() -> Self {
        Self(uuid::Uuid::new_v4().as_u64_pair().0)
    }

    fn next(&mut self) -> SpanId {
        loop {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z != 0 {
                return SpanId::from_bytes(z.to_be_bytes());
            }
        }
    }
}

/// Whether a trace is kept: the caller's flag when it sent one, else the trace id's lower 64
/// bits under `ratio` of their range (OpenTelemetry's `TraceIdRatioBased`).
pub fn sampled(trace_id: TraceId, parent_sampled: Option<bool>, ratio: f64) -> bool {
    if let Some(flag) = parent_sampled {
        return flag;
    }
    if ratio >= 1.0 {
        return true;
    }
    if ratio <= 0.0 {
        return false;
    }
    let bytes = trace_id.to_bytes();
    let mut low = [0u8; 8];
    low.copy_from_slice(&bytes[8..16]);
    let x = u64::from_be_bytes(low) >> 1;
    x < (ratio * (1u64 << 63) as f64) as u64
}

/// The GenAI operation of an endpoint (`None`: the endpoint is not traced: models, metrics,
/// admin, ...).
pub fn operation(endpoint: &str) -> Option<&'static str> {
    Some(match endpoint {
        "chat.completions" => "chat",
        "completions" => "text_completion",
        "embeddings" => "embeddings",
        "kserve_infer" | "kserve_grpc_infer" => "infer",
        _ => return None,
    })
}

/// The stages that hang under the chain's attempt they ran in; the others hang under the root.
fn in_attempt(stage: &str) -> bool {
    !matches!(stage, "guard" | "route" | "attempt" | "structured_output")
}

/// One span under construction.
struct Draft {
    id: SpanId,
    parent: SpanId,
    name: Cow<'static, str>,
    kind: SpanKind,
    start: Duration,
    end: Duration,
    attributes: Vec<KeyValue>,
    events: Vec<Event>,
    status: Status,
}

impl Draft {
    fn new(id: SpanId, parent: SpanId, name: impl Into<Cow<'static, str>>, stage: &Stage) -> Self {
        Self {
            id,
            parent,
            name: name.into(),
            kind: SpanKind::Internal,
            start: stage.start,
            end: stage.end.max(stage.start),
            attributes: Vec::new(),
            events: Vec::new(),
            status: Status::Unset,
        }
    }
}

/// The spans of one request's record: none when it is not traced (no timeline, an endpoint
/// that is not an inference, a trace not sampled).
pub fn build_spans(
    envelope: &Envelope,
    settings: &SpanSettings,
    scope: &InstrumentationScope,
    ids: &mut SpanIds,
) -> Vec<SpanData> {
    let (Some(timeline), Some(op)) = (&envelope.timeline, operation(envelope.record.endpoint))
    else {
        return Vec::new();
    };
    let r = &envelope.record;
    let Some(trace_id) = r
        .trace_id
        .as_deref()
        .and_then(|t| TraceId::from_hex(t).ok())
        .filter(|t| *t != TraceId::INVALID)
    else {
        return Vec::new();
    };
    if !sampled(trace_id, timeline.parent_sampled, settings.sampling_ratio) {
        return Vec::new();
    }
    let caller = timeline
        .parent_span_id
        .as_deref()
        .and_then(|s| SpanId::from_hex(s).ok())
        .unwrap_or(SpanId::INVALID);
    let state = timeline
        .tracestate
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();

    let end = Duration::from_secs_f64((r.total_ms / 1e3).max(0.0)).max(timeline.published);
    let root_stage = Stage {
        name: "request",
        start: Duration::ZERO,
        end,
    };
    let name = if r.model.is_empty() {
        Cow::Borrowed(op)
    } else {
        Cow::Owned(format!("{op} {}", r.model))
    };
    let mut root = Draft::new(ids.next(), caller, name, &root_stage);
    root.kind = SpanKind::Server;
    root.attributes = root_attributes(envelope, timeline, op, settings);
    if r.status >= 400 {
        root.status = Status::error(
            r.error_code
                .clone()
                .or_else(|| r.error_type.clone())
                .unwrap_or_default(),
        );
    }
    let mut drafts: Vec<Draft> = Vec::new();
    // The chain's attempts, in order; the i-th `attempt` stage is the record's i-th attempt.
    let mut attempts: Vec<usize> = Vec::new();
    for stage in timeline.stages.iter().filter(|s| s.name == "attempt") {
        let mut d = Draft::new(ids.next(), root.id, "attempt", stage);
        if let Some(a) = r.attempts.get(attempts.len()) {
            d.attributes.push(KeyValue::new(
                "rampart.attempt.index",
                attempts.len() as i64,
            ));
            d.attributes
                .push(KeyValue::new("rampart.attempt.backend", a.backend.clone()));
            d.attributes
                .push(KeyValue::new("rampart.attempt.outcome", a.outcome));
            if let Some(detail) = &a.detail {
                d.attributes
                    .push(KeyValue::new("rampart.attempt.detail", detail.clone()));
            }
            if a.outcome != "answered" && a.outcome != "skipped" {
                d.status = Status::error(a.outcome);
            }
        }
        attempts.push(drafts.len());
        drafts.push(d);
    }
    // The attempt a stage ran in: the last one that began before it.
    let owner = |drafts: &[Draft], start: Duration| {
        attempts
            .iter()
            .rev()
            .find(|&&i| drafts[i].start <= start)
            .copied()
    };
    let answered = attempts
        .iter()
        .rev()
        .find(|&&i| {
            drafts[i].attributes.iter().any(|kv| {
                kv.key.as_str() == "rampart.attempt.outcome" && kv.value.as_str() == "answered"
            })
        })
        .copied();
    let mut children: Vec<(Option<usize>, Draft)> = Vec::new();
    for stage in timeline.stages.iter().filter(|s| s.name != "attempt") {
        let at = if in_attempt(stage.name) {
            owner(&drafts, stage.start)
        } else {
            None
        };
        let mut d = Draft::new(ids.next(), SpanId::INVALID, stage.name, stage);
        if stage.name == "structured_output" {
            if let Some(s) = &r.structured {
                d.attributes
                    .push(KeyValue::new("rampart.structured.kind", s.kind));
                d.attributes.push(KeyValue::new(
                    "rampart.structured.outcome",
                    s.outcome.unwrap_or("none"),
                ));
                d.attributes
                    .push(KeyValue::new("rampart.structured.cached", s.cached));
                d.attributes
                    .push(KeyValue::new("rampart.structured.compile_ms", s.compile_ms));
                if let Some(p) = &s.problem {
                    d.attributes
                        .push(KeyValue::new("rampart.structured.problem", p.clone()));
                }
                if s.outcome == Some("invalid") {
                    d.status = Status::error("invalid");
                }
            }
        }
        if stage.name == "guard" {
            if let Some(v) = &r.guard_verdict {
                d.attributes
                    .push(KeyValue::new("rampart.guard.verdict", v.clone()));
            }
            if let Some(s) = r.guard_score {
                d.attributes
                    .push(KeyValue::new("rampart.guard.score", f64::from(s)));
            }
        }
        if stage.name == "admission" {
            d.attributes
                .push(KeyValue::new("rampart.queue_ms", r.queue_ms));
        }
        children.push((at, d));
    }
    // Prefill and decode ran on the engine's threads: their spans come from the engine's
    // timings, placed against the first token's time.
    if matches!(op, "chat" | "text_completion") && r.ttft_ms > 0.0 && r.completion_tokens > 0 {
        let ms = |v: f64| Duration::from_secs_f64((v / 1e3).max(0.0));
        let first = ms(r.ttft_ms);
        // The engine's clock and ours differ a little: prefill never began before the
        // admission that let the request in.
        let admitted = timeline
            .stages
            .iter()
            .filter(|s| s.name == "admission" && s.end <= first)
            .map(|s| s.end)
            .max()
            .unwrap_or_default();
        let prefill = Stage {
            name: "prefill",
            start: first.saturating_sub(ms(r.prefill_ms)).max(admitted),
            end: first,
        };
        let decode = Stage {
            name: "decode",
            start: first,
            end: (first + ms(r.decode_ms)).min(end.max(first)),
        };
        let mut p = Draft::new(ids.next(), SpanId::INVALID, "prefill", &prefill);
        p.attributes.push(KeyValue::new(
            "gen_ai.usage.input_tokens",
            r.prompt_tokens as i64,
        ));
        p.attributes.push(KeyValue::new(
            "rampart.cached_prompt_tokens",
            r.cached_prompt_tokens as i64,
        ));
        let mut d = Draft::new(ids.next(), SpanId::INVALID, "decode", &decode);
        d.attributes.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            r.completion_tokens as i64,
        ));
        for t in &timeline.tokens {
            let mut attributes = vec![
                KeyValue::new("rampart.token.index", t.index as i64),
                KeyValue::new("rampart.token.text", t.text.clone()),
                KeyValue::new("rampart.token.entropy", f64::from(t.entropy)),
            ];
            if let Some(lp) = t.logprob {
                attributes.push(KeyValue::new("rampart.token.logprob", f64::from(lp)));
            }
            d.events.push(Event::new(
                "rampart.token",
                timeline.started + t.at,
                attributes,
                0,
            ));
        }
        let at = answered.or_else(|| owner(&drafts, prefill.start));
        children.push((at, p));
        children.push((at, d));
    }
    let published = Stage {
        name: "record",
        start: timeline.published,
        end: SystemTime::now()
            .duration_since(timeline.started)
            .unwrap_or(timeline.published)
            .max(timeline.published),
    };
    let mut sinks = Draft::new(ids.next(), root.id, "record", &published);
    sinks.attributes.push(KeyValue::new(
        "rampart.record.sinks",
        Value::Array(
            settings
                .sinks
                .iter()
                .map(|s| StringValue::from(*s))
                .collect::<Vec<_>>()
                .into(),
        ),
    ));
    // Each attempt lasts as long as what ran in it (a stream's decode outlives the commit
    // point where the chain noted the attempt).
    for (at, child) in &mut children {
        match at {
            Some(i) => {
                child.parent = drafts[*i].id;
                drafts[*i].end = drafts[*i].end.max(child.end);
            }
            None => child.parent = root.id,
        }
    }
    let mut all = Vec::with_capacity(drafts.len() + children.len() + 2);
    all.push(root);
    all.extend(drafts);
    all.extend(children.into_iter().map(|(_, d)| d));
    all.push(sinks);
    let flags = TraceFlags::SAMPLED;
    all.into_iter()
        .map(|mut d| {
            let mut events = SpanEvents::default();
            events.events = std::mem::take(&mut d.events);
            (d, events)
        })
        .map(|(d, events)| SpanData {
            span_context: SpanContext::new(trace_id, d.id, flags, false, state.clone()),
            parent_span_id: d.parent,
            parent_span_is_remote: d.parent == caller && caller != SpanId::INVALID,
            span_kind: d.kind,
            name: d.name,
            start_time: timeline.started + d.start,
            end_time: timeline.started + d.end,
            attributes: d.attributes,
            dropped_attributes_count: 0,
            events,
            links: SpanLinks::default(),
            status: d.status,
            instrumentation_scope: scope.clone(),
        })
        .collect()
}

/// The server span's attributes: the GenAI conventions' names, then Rampart's own.
fn root_attributes(
    envelope: &Envelope,
    timeline: &Timeline,
    op: &'static str,
    settings: &SpanSettings,
) -> Vec<KeyValue> {
    let r: &InferenceRecord = &envelope.record;
    let mut a = Vec::with_capacity(32);
    let provider = if settings.legacy_names {
        "gen_ai.system"
    } else {
        "gen_ai.provider.name"
    };
    a.push(KeyValue::new(provider, PROVIDER));
    if op != "infer" {
        a.push(KeyValue::new("gen_ai.operation.name", op));
    }
    if !r.model.is_empty() {
        a.push(KeyValue::new("gen_ai.request.model", r.model.clone()));
        let answered_by = r
            .fallback_backend
            .clone()
            .unwrap_or_else(|| format!("{}@{}", r.model, r.version));
        if r.status < 400 {
            a.push(KeyValue::new("gen_ai.response.model", answered_by));
        }
    }
    if let Some(params) = &r.params {
        if let Some(v) = params.get("max_tokens").and_then(|v| v.as_i64()) {
            a.push(KeyValue::new("gen_ai.request.max_tokens", v));
        }
        if let Some(v) = params.get("temperature").and_then(|v| v.as_f64()) {
            a.push(KeyValue::new("gen_ai.request.temperature", v));
        }
        if let Some(v) = params.get("top_p").and_then(|v| v.as_f64()) {
            a.push(KeyValue::new("gen_ai.request.top_p", v));
        }
        if let Some(v) = params.get("seed").and_then(|v| v.as_i64()) {
            a.push(KeyValue::new("gen_ai.request.seed", v));
        }
        if let Some(v) = params.get("n").and_then(|v| v.as_i64()).filter(|n| *n != 1) {
            a.push(KeyValue::new("gen_ai.request.choice.count", v));
        }
    }
    if let Some(id) = &timeline.response_id {
        a.push(KeyValue::new("gen_ai.response.id", id.clone()));
    }
    if let Some(reason) = &r.finish_reason {
        a.push(KeyValue::new(
            "gen_ai.response.finish_reasons",
            Value::Array(vec![StringValue::from(reason.clone())].into()),
        ));
    }
    if op != "infer" || r.prompt_tokens > 0 {
        a.push(KeyValue::new(
            "gen_ai.usage.input_tokens",
            r.prompt_tokens as i64,
        ));
    }
    if matches!(op, "chat" | "text_completion") {
        a.push(KeyValue::new(
            "gen_ai.usage.output_tokens",
            r.completion_tokens as i64,
        ));
        if !settings.legacy_names {
            a.push(KeyValue::new(
                "gen_ai.usage.cache_read.input_tokens",
                r.cached_prompt_tokens as i64,
            ));
        }
    }
    let (address, port) = if r.endpoint == "kserve_grpc_infer" {
        &settings.grpc_address
    } else {
        &settings.http_address
    };
    a.push(KeyValue::new("server.address", address.clone()));
    a.push(KeyValue::new("server.port", i64::from(*port)));
    if r.status >= 400 {
        let kind = r
            .error_code
            .clone()
            .or_else(|| r.error_type.clone())
            .unwrap_or_else(|| r.status.to_string());
        a.push(KeyValue::new("error.type", kind));
    }
    a.push(KeyValue::new("rampart.request_id", r.request_id.clone()));
    a.push(KeyValue::new("rampart.audit_id", r.audit_id.clone()));
    a.push(KeyValue::new("rampart.endpoint", r.endpoint));
    a.push(KeyValue::new("rampart.status", i64::from(r.status)));
    if !r.version.is_empty() {
        a.push(KeyValue::new("rampart.model.version", r.version.clone()));
        a.push(KeyValue::new(
            "rampart.variant",
            format!("{}@{}", r.model, r.version),
        ));
    }
    a.push(KeyValue::new(
        "rampart.fallback.level",
        i64::from(r.fallback_level),
    ));
    if let Some(b) = &r.fallback_backend {
        a.push(KeyValue::new("rampart.fallback.backend", b.clone()));
    }
    if let Some(reason) = r.fallback_reason {
        a.push(KeyValue::new("rampart.fallback.reason", reason));
    }
    if let Some(v) = &r.guard_verdict {
        a.push(KeyValue::new("rampart.guard.verdict", v.clone()));
    }
    if let Some(refusal) = r.refusal {
        a.push(KeyValue::new("rampart.refusal", refusal));
    }
    if let Some(m) = r.entropy_mean {
        a.push(KeyValue::new("rampart.entropy.mean", f64::from(m)));
    }
    if let Some(m) = r.entropy_min {
        a.push(KeyValue::new("rampart.entropy.min", f64::from(m)));
    }
    if r.entropy_mean.is_some() {
        a.push(KeyValue::new("rampart.entropy.abnormal", r.abnormal));
    }
    if let Some(c) = r.confidence {
        a.push(KeyValue::new("rampart.confidence", f64::from(c)));
    }
    if r.items > 0 {
        a.push(KeyValue::new("rampart.items", r.items as i64));
    }
    a.push(KeyValue::new("rampart.stream", r.stream));
    if settings.capture_content {
        if let Some(p) = &envelope.payload {
            if let Some(input) = &p.input {
                a.push(KeyValue::new("gen_ai.input.messages", input.to_string()));
            }
            if let Some(output) = &p.output {
                a.push(KeyValue::new("gen_ai.output.messages", output.to_string()));
            }
        }
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_parsed_by_the_w3c_rules() {
        let p =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(p.trace_id, "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.parent_span_id, "00f067aa0ba902b7");
        assert!(p.sampled);
        let unsampled =
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00").unwrap();
        assert!(!unsampled.sampled);
        // A later version may add fields after the flags.
        assert!(TraceParent::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra"
        )
        .is_some());
        for bad in [
            "",
            "garbage",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn tracestates_pass_only_when_sane() {
        assert_eq!(
            sane_tracestate("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE").as_deref(),
            Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
        );
        assert_eq!(sane_tracestate(""), None);
        assert_eq!(sane_tracestate("no equals sign"), None);
        assert_eq!(sane_tracestate(&"a=b,".repeat(40)), None);
        assert_eq!(sane_tracestate(&format!("a={}", "x".repeat(600))), None);
    }

    #[test]
    fn sampling_follows_the_parent_else_the_ratio() {
        let id = |n: u128| TraceId::from_bytes(n.to_be_bytes());
        assert!(sampled(id(5), Some(true), 0.0));
        assert!(!sampled(id(5), Some(false), 1.0));
        assert!(sampled(id(5), None, 1.0));
        assert!(!sampled(id(5), None, 0.0));
        let kept = (0..10_000u128)
            .filter(|n| {
                let mixed = n.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
                sampled(id(mixed), None, 0.25)
            })
            .count();
        assert!((2_000..3_000).contains(&kept), "{kept} of 10000 at 0.25");
    }

    #[test]
    fn new_trace_ids_are_valid_and_distinct() {
        let a = new_trace_id();
        let b = new_trace_id();
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        assert!(TraceParent::parse(&format!("00-{a}-00f067aa0ba902b7-01")).is_some());
    }

    fn settings() -> SpanSettings {
        SpanSettings {
            sampling_ratio: 1.0,
            capture_content: false,
            legacy_names: false,
            http_address: ("127.0.0.1".into(), 8080),
            grpc_address: ("127.0.0.1".into(), 8081),
            sinks: vec!["log", "metrics"],
        }
    }

    fn stage(name: &'static str, from_ms: u64, to_ms: u64) -> Stage {
        Stage {
            name,
            start: Duration::from_millis(from_ms),
            end: Duration::from_millis(to_ms),
        }
    }

    /// A chat that fell back once: the primary timed out, the second step answered.
    fn chat_envelope() -> Envelope {
        let mut e = record::testing::sample_envelope(1);
        let r = &mut e.record;
        r.trace_id = Some("4bf92f3577b34da6a3ce929d0e0e4736".into());
        r.model = "smollm2".into();
        r.version = "1.0.0".into();
        r.params =
            Some(serde_json::json!({"max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "n": 1}));
        r.prompt_tokens = 7;
        r.completion_tokens = 5;
        r.cached_prompt_tokens = 3;
        r.ttft_ms = 40.0;
        r.prefill_ms = 10.0;
        r.decode_ms = 50.0;
        r.total_ms = 100.0;
        r.fallback_level = 1;
        r.fallback_backend = Some("tiny@1.0.0".into());
        r.fallback_reason = Some("first_token_timeout");
        r.guard_verdict = Some("allow".into());
        r.attempts = vec![
            record::Attempt {
                backend: "smollm2@1.0.0".into(),
                outcome: "first_token_timeout",
                detail: None,
                ms: 10.0,
            },
            record::Attempt {
                backend: "tiny@1.0.0".into(),
                outcome: "answered",
                detail: None,
                ms: 30.0,
            },
        ];
        let mut t = Timeline::new();
        t.parent_span_id = Some("00f067aa0ba902b7".into());
        t.parent_sampled = Some(true);
        t.tracestate = Some("rojo=00f067aa0ba902b7".into());
        t.response_id = Some("chatcmpl-1".into());
        t.published = Duration::from_millis(100);
        t.stages = vec![
            stage("route", 0, 1),
            stage("guard", 1, 3),
            stage("admission", 4, 5),
            stage("attempt", 3, 13),
            stage("admission", 14, 15),
            stage("tokenize", 15, 20),
            stage("attempt", 13, 43),
            stage("structured_output", 95, 96),
        ];
        t.tokens = vec![record::TokenNote {
            at: Duration::from_millis(60),
            index: 2,
            text: "hi".into(),
            logprob: Some(-0.5),
            entropy: 1.25,
        }];
        e.timeline = Some(Box::new(t));
        e
    }

    fn attr<'a>(s: &'a SpanData, key: &str) -> Option<&'a Value> {
        s.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| &kv.value)
    }

    #[test]
    fn a_chat_becomes_a_nested_tree_under_the_callers_span() {
        let scope = scope("1.38");
        let spans = build_spans(&chat_envelope(), &settings(), &scope, &mut SpanIds(7));
        let by_name =
            |n: &str| -> Vec<&SpanData> { spans.iter().filter(|s| s.name == n).collect() };
        let root = by_name("chat smollm2")[0];
        assert_eq!(root.span_kind, SpanKind::Server);
        assert_eq!(
            root.parent_span_id,
            SpanId::from_hex("00f067aa0ba902b7").unwrap()
        );
        assert!(root.parent_span_is_remote);
        assert_eq!(
            format!("{}", root.span_context.trace_id()),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(
            root.span_context.trace_state().header(),
            "rojo=00f067aa0ba902b7"
        );
        assert_eq!(
            attr(root, "gen_ai.operation.name")
                .map(Value::as_str)
                .as_deref(),
            Some("chat")
        );
        assert_eq!(
            attr(root, "gen_ai.provider.name")
                .map(Value::as_str)
                .as_deref(),
            Some("rampart")
        );
        assert_eq!(
            attr(root, "gen_ai.request.max_tokens"),
            Some(&Value::I64(16))
        );
        assert_eq!(
            attr(root, "gen_ai.request.temperature"),
            Some(&Value::F64(0.5))
        );
        assert_eq!(
            attr(root, "gen_ai.response.id")
                .map(Value::as_str)
                .as_deref(),
            Some("chatcmpl-1")
        );
        assert_eq!(
            attr(root, "gen_ai.usage.cache_read.input_tokens"),
            Some(&Value::I64(3))
        );
        assert_eq!(attr(root, "rampart.fallback.level"), Some(&Value::I64(1)));
        assert_eq!(attr(root, "server.port"), Some(&Value::I64(8080)));
        assert!(
            attr(root, "gen_ai.input.messages").is_none(),
            "content stays out by default"
        );
        // Every other span's parent is in the trace; the root's is the caller's.
        let ids: Vec<SpanId> = spans.iter().map(|s| s.span_context.span_id()).collect();
        for s in &spans {
            if s.name != root.name {
                assert!(ids.contains(&s.parent_span_id), "{} has no parent", s.name);
            }
        }
        let attempts = by_name("attempt");
        assert_eq!(attempts.len(), 2);
        assert!(attempts
            .iter()
            .all(|a| a.parent_span_id == root.span_context.span_id()));
        let (first, second) = (
            attempts[0].span_context.span_id(),
            attempts[1].span_context.span_id(),
        );
        let admissions = by_name("admission");
        assert_eq!(admissions[0].parent_span_id, first);
        assert_eq!(admissions[1].parent_span_id, second);
        for n in ["tokenize", "prefill", "decode"] {
            assert_eq!(by_name(n)[0].parent_span_id, second, "{n}");
        }
        for n in ["guard", "route", "structured_output", "record"] {
            assert_eq!(
                by_name(n)[0].parent_span_id,
                root.span_context.span_id(),
                "{n}"
            );
        }
        // The answering attempt lasts until its decode ended.
        assert!(attempts[1].end_time >= by_name("decode")[0].end_time);
        assert_eq!(by_name("decode")[0].events.len(), 1);
        assert_eq!(attempts[0].status, Status::error("first_token_timeout"));
    }

    #[test]
    fn untraced_records_build_nothing() {
        let scope = scope("1.38");
        let mut e = chat_envelope();
        if let Some(t) = &mut e.timeline {
            t.parent_sampled = Some(false);
        }
        assert!(build_spans(&e, &settings(), &scope, &mut SpanIds(1)).is_empty());
        let mut e = chat_envelope();
        e.timeline = None;
        assert!(build_spans(&e, &settings(), &scope, &mut SpanIds(1)).is_empty());
        let mut e = chat_envelope();
        e.record.endpoint = "models";
        assert!(build_spans(&e, &settings(), &scope, &mut SpanIds(1)).is_empty());
    }

    fn down() -> TracingConfig {
        TracingConfig {
            enabled: true,
            // Nothing listens on the discard port: connections are refused at once.
            endpoint: "http://127.0.0.1:9".into(),
            queue_capacity: 64,
            export_timeout_ms: 300,
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_trace_sink_passes_the_sink_contract() {
        let config = down();
        let addr: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        record::testing::check_sink(|| {
            TraceSink::new(&config, SpanSettings::new(&config, addr, addr, vec![])).unwrap()
        })
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_collector_that_is_down_costs_a_bounded_wait_and_no_error() {
        let addr: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        for protocol in [TraceProtocol::Grpc, TraceProtocol::Http] {
            let config = TracingConfig { protocol, ..down() };
            let mut sink =
                TraceSink::new(&config, SpanSettings::new(&config, addr, addr, vec![])).unwrap();
            let e = chat_envelope();
            let began = Instant::now();
            for _ in 0..3 {
                sink.write(&e).await.unwrap();
            }
            assert!(
                began.elapsed() < Duration::from_secs(3),
                "{protocol:?}: {:?}",
                began.elapsed()
            );
            assert!(sink.last_complaint.is_some(), "the failure was logged once");
        }
    }

    /// What tracing costs per request, off the request path: building a chat's spans, and
    /// building plus exporting them in batches of 64 to a receiver in the same process (which
    /// decodes them too: an upper bound). docs/perf.md quotes it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "a measurement: cargo test -p rampart-server --lib -- --ignored trace_cost --nocapture"]
    async fn trace_cost_per_request() {
        let scope = scope("1.38");
        let e = chat_envelope();
        let mut ids = SpanIds::seeded();
        let n = 20_000;
        let began = Instant::now();
        let mut spans = 0;
        for _ in 0..n {
            spans += build_spans(&e, &settings(), &scope, &mut ids).len();
        }
        let per = began.elapsed().as_secs_f64() / n as f64;
        println!(
            "build_spans: {:.1} µs per request ({} spans)",
            per * 1e6,
            spans / n
        );
        let receiver = testkit::otlp::Receiver::start_on(("127.0.0.1", 0), ("127.0.0.1", 0), false)
            .await
            .unwrap();
        let addr: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        for (protocol, endpoint) in [
            (TraceProtocol::Grpc, receiver.grpc_endpoint.clone()),
            (TraceProtocol::Http, receiver.http_endpoint.clone()),
        ] {
            let config = TracingConfig {
                enabled: true,
                protocol,
                endpoint,
                ..Default::default()
            };
            let mut sink =
                TraceSink::new(&config, SpanSettings::new(&config, addr, addr, vec![])).unwrap();
            let batch: Vec<Arc<Envelope>> = (0..64).map(|_| Arc::new(chat_envelope())).collect();
            sink.write_batch(&batch).await.unwrap();
            let rounds = 100;
            let began = Instant::now();
            for _ in 0..rounds {
                sink.write_batch(&batch).await.unwrap();
            }
            let per = began.elapsed().as_secs_f64() / (rounds * batch.len()) as f64;
            println!(
                "{protocol:?} build + export: {:.1} µs per request",
                per * 1e6
            );
        }
        assert!(receiver.span_count() > 0);
    }

    #[test]
    fn semconv_1_36_names_the_system_and_content_is_opt_in() {
        let scope = scope("1.36");
        let mut s = settings();
        s.legacy_names = true;
        s.capture_content = true;
        let spans = build_spans(&chat_envelope(), &s, &scope, &mut SpanIds(3));
        let root = &spans[0];
        assert!(attr(root, "gen_ai.system").is_some());
        assert!(attr(root, "gen_ai.provider.name").is_none());
        assert!(attr(root, "gen_ai.usage.cache_read.input_tokens").is_none());
        assert!(attr(root, "gen_ai.input.messages").is_some());
    }
}
