//! The record's first two sinks (the structured log and the Prometheus metrics), the gauges
//! refreshed at each scrape (engines, the record bus's lanes), and the logging setup. Metric
//! names and labels are documented in docs/metrics.md. Nothing outside this module records a
//! request's metrics: handlers emit the record.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use record::{ActionRecord, Actor, Bus, Delivery, Envelope, InferenceRecord, Sink, SinkFuture};

use crate::config::{Log, LogFormat};
use crate::registry::Registry;

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];
const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56,
];
const ENTROPY_BUCKETS: &[f64] = &[0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0];
const MASK_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.05,
];
/// The GenAI semantic conventions' advised bucket boundaries (`gen_ai.server.*` metrics).
const GEN_AI_REQUEST_BUCKETS: &[f64] = &[
    0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92,
];
const GEN_AI_TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
const GEN_AI_TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
const COMPILE_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0,
];

/// What a metric is, in Prometheus terms. A histogram is exposed as `<name>_bucket`, `_sum`
/// and `_count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// Who writes a metric's samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MetricSource {
    /// The `metrics` recorder (the sinks, the engines' snapshots, the audit log, the batcher).
    Recorder,
    /// The host telemetry, read and written as text at each scrape ([`crate::telemetry`]).
    Host,
}

/// One metric the server can emit: the registry the shipped alert rules and dashboards are
/// checked against (`rampart metrics list --json`, scripts/check-monitoring.sh).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct MetricInfo {
    pub name: &'static str,
    #[serde(rename = "type")]
    pub kind: MetricKind,
    /// The labels it carries (documentation; docs/metrics.md says what each value means).
    pub labels: &'static [&'static str],
    pub help: &'static str,
    pub source: MetricSource,
}

const fn recorded(
    name: &'static str,
    kind: MetricKind,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricInfo {
    MetricInfo {
        name,
        kind,
        labels,
        help,
        source: MetricSource::Recorder,
    }
}

/// Every metric the `metrics` recorder can emit (described at install). With
/// [`crate::telemetry::HOST_METRICS`] ([`all_metrics`]) this is the server's metric registry;
/// a name emitted in the code but missing here fails a test.
pub static METRICS: &[MetricInfo] = &[
    recorded("rampart_output_confidence", MetricKind::Histogram, &["model"], "Tensor models: per request, the mean confidence of its inputs (top class probability or best detection score)."),
    recorded("rampart_inputs_total", MetricKind::Counter, &["model"], "Tensor and embedding models: inputs served (batch rows, texts)."),
    recorded("rampart_tensor_batch_size", MetricKind::Histogram, &["model"], "Tensor models: rows per backend call, as the dynamic batcher formed them."),
    recorded("rampart_tensor_queue_delay_seconds", MetricKind::Histogram, &["model"], "Tensor models: time a request waited in the batcher's queue."),
    recorded("rampart_tensor_compute_seconds", MetricKind::Histogram, &["model"], "Tensor models: time of one backend call (one batch)."),
    recorded("rampart_tensor_queue_depth", MetricKind::Gauge, &["model"], "Tensor models: requests waiting in the batcher's queue."),
    recorded("rampart_requests_total", MetricKind::Counter, &["model", "endpoint", "status"], "Requests finished, by model, endpoint and status code."),
    recorded("rampart_fallback_total", MetricKind::Counter, &["model", "to", "reason"], "Requests answered by a step of the model's fallback chain, by model, the backend that answered and the trigger."),
    recorded("rampart_canned_responses_total", MetricKind::Counter, &["model"], "Requests answered by the model's canned answer (fallback level 2)."),
    recorded("rampart_breaker_state", MetricKind::Gauge, &["backend"], "Circuit breaker of each backend: 0 closed, 1 half-open, 2 open."),
    recorded("rampart_breaker_transitions_total", MetricKind::Counter, &["backend", "to"], "Circuit breaker changes of state, by backend and the state it went to."),
    recorded("rampart_handoff_active", MetricKind::Gauge, &["model"], "1 while the model is handed off to people (new requests get 503 human_handoff)."),
    recorded("rampart_handoff_transitions_total", MetricKind::Counter, &["model", "to"], "Hand-offs and resumptions, by model (to: handed_off, resumed)."),
    recorded("rampart_faults_injected_total", MetricKind::Counter, &["backend", "mode"], "Faults injected through the admin API, by backend and mode."),
    recorded("rampart_faults_struck_total", MetricKind::Counter, &["backend", "mode"], "Calls an injected fault struck, by backend and mode."),
    recorded("rampart_admin_actions_total", MetricKind::Counter, &["action"], "Admin API calls that changed something, by action."),
    recorded("rampart_controller_decisions_total", MetricKind::Counter, &["decision"], "Decisions of the server's controllers (breakers, hand-offs, degradation, monitors, releases, residency), by name."),
    recorded("rampart_request_duration_seconds", MetricKind::Histogram, &["model"], "Time from arrival to the last byte of the response."),
    recorded("rampart_time_to_first_token_seconds", MetricKind::Histogram, &["model"], "Time from arrival to the first generated token."),
    recorded("rampart_inter_token_latency_seconds", MetricKind::Histogram, &["model"], "Gaps between consecutive tokens of a response."),
    recorded("rampart_time_per_output_token_seconds", MetricKind::Histogram, &["model"], "Decode time divided by tokens after the first, per request."),
    recorded("rampart_queue_time_seconds", MetricKind::Histogram, &["model"], "Time a request waited for an admission slot."),
    recorded("rampart_token_entropy_nats", MetricKind::Histogram, &["model"], "Entropy of each generated token's distribution."),
    recorded("rampart_structured_requests_total", MetricKind::Counter, &["model", "kind", "outcome"], "Structured-output requests finished, by model, kind and outcome of the final check."),
    recorded("rampart_grammar_compile_seconds", MetricKind::Histogram, &["kind"], "Time to compile a structured-output grammar (cache misses), by kind."),
    recorded("rampart_grammar_mask_seconds", MetricKind::Histogram, &["kind"], "Time to compute one token's allowed-token mask, by kind."),
    recorded("rampart_grammar_cache_total", MetricKind::Counter, &["result"], "Compiled-grammar cache lookups, by result (hit, miss)."),
    recorded("rampart_tool_calls_total", MetricKind::Counter, &["model", "function"], "Tool calls in answers, by model and function (each model labels its first 64 function names; the rest count as _other)."),
    recorded("rampart_tool_calls_invalid_total", MetricKind::Counter, &["model"], "Tool-calling answers that ended by themselves yet failed the final check (expected 0)."),
    recorded("rampart_prompt_tokens_total", MetricKind::Counter, &["model"], "Prompt tokens of finished requests."),
    recorded("rampart_generated_tokens_total", MetricKind::Counter, &["model"], "Tokens generated for finished requests."),
    recorded("rampart_rejected_requests_total", MetricKind::Counter, &["model", "reason"], "Requests refused before any compute, by reason."),
    recorded("rampart_tokenize_rejected_total", MetricKind::Counter, &["reason"], "/tokenize and /detokenize requests refused before their body was read, by reason (rate_limited, queue_full, shedding, timeout)."),
    recorded("rampart_lane_jobs_total", MetricKind::Counter, &["lane"], "Jobs sent to a background lane (pre-work below the compute's CPU priority), by lane (tokenize, prepare, guard, guard-short)."),
    recorded("rampart_lane_waiting", MetricKind::Gauge, &["lane"], "Jobs sent to a background lane and not yet started, by lane."),
    recorded("rampart_lane_job_seconds", MetricKind::Histogram, &["lane"], "How long each job of a background lane ran, by lane."),
    recorded("rampart_abnormal_requests_total", MetricKind::Counter, &["model"], "Requests whose mean token entropy fell outside the model's band."),
    recorded("rampart_queue_depth", MetricKind::Gauge, &["model"], "Requests waiting for an admission slot."),
    recorded("rampart_requests_in_flight", MetricKind::Gauge, &["model"], "Requests holding an admission slot."),
    recorded("rampart_engine_running_sequences", MetricKind::Gauge, &["model"], "Sequences in the engine's running batch."),
    recorded("rampart_engine_waiting_sequences", MetricKind::Gauge, &["model"], "Sequences waiting inside the engine."),
    recorded("rampart_kv_blocks_used", MetricKind::Gauge, &["model"], "KV blocks held by sequences."),
    recorded("rampart_kv_blocks_total", MetricKind::Gauge, &["model"], "KV blocks in the pool."),
    recorded("rampart_kv_blocks_cached", MetricKind::Gauge, &["model"], "Unreferenced KV blocks kept for prefix reuse."),
    recorded("rampart_kv_blocks_resident", MetricKind::Gauge, &["model"], "KV blocks whose memory pages are mapped (written since the pool started or since last given back)."),
    recorded("rampart_kv_released_bytes_total", MetricKind::Counter, &["model"], "Bytes of free KV pages given back to the system under memory pressure."),
    recorded("rampart_prefix_cache_hits_total", MetricKind::Counter, &["model"], "Prompt blocks found in the prefix cache."),
    recorded("rampart_prefix_cache_lookups_total", MetricKind::Counter, &["model"], "Prompt blocks looked up in the prefix cache."),
    recorded("rampart_preemptions_total", MetricKind::Counter, &["model"], "Sequences preempted for lack of KV blocks."),
    recorded("rampart_speculative_tokens_total", MetricKind::Counter, &["model"], "Tokens guessed by prompt lookup (speculative decoding without a draft model) and verified."),
    recorded("rampart_speculative_accepted_total", MetricKind::Counter, &["model"], "Tokens guessed by prompt lookup that the model's own sampling kept."),
    recorded("rampart_record_dropped_total", MetricKind::Counter, &["sink", "reason"], "Records a sink's lane lost, by sink and reason (lane_full, overflow, timeout, closed, write_failed)."),
    recorded("rampart_record_written_total", MetricKind::Counter, &["sink"], "Records a sink wrote, by sink."),
    recorded("rampart_model_ready", MetricKind::Gauge, &["model"], "1 while the model is loaded and its last readiness check passed, 0 while it fails (stalled, stopped)."),
    recorded("rampart_feature_drift_score", MetricKind::Gauge, &["model", "version", "feature"], "The drift monitor's last statistic per feature (KS distance, or the chi-squared test's Cramér's V for categorical features), window against baseline."),
    recorded("rampart_feature_drift_pvalue", MetricKind::Gauge, &["model", "version", "feature"], "The drift monitor's last p-value per feature."),
    recorded("rampart_drift_active", MetricKind::Gauge, &["model", "version"], "1 while any feature of the model version is in drift alarm."),
    recorded("rampart_drift_alarms_total", MetricKind::Counter, &["model", "version", "feature"], "Drift alarms raised, by model, version and feature (output monitors included)."),
    recorded("rampart_output_entropy_window_mean", MetricKind::Gauge, &["model", "version"], "Sliding-window mean of the requests' mean token entropy (nats)."),
    recorded("rampart_output_entropy_window_std", MetricKind::Gauge, &["model", "version"], "Sliding-window standard deviation of the requests' mean token entropy (nats)."),
    recorded("rampart_output_confidence_window_mean", MetricKind::Gauge, &["model", "version"], "Sliding-window mean of a classifier's or detector's request confidence."),
    recorded("rampart_monitor_window_requests", MetricKind::Gauge, &["model", "version"], "Requests in the monitor's current window, per model version."),
    recorded("rampart_batch_limit", MetricKind::Gauge, &["model", "version", "kind"], "The degradation controller's current limit, by kind: max_num_seqs, max_num_batched_tokens, max_prefill_tokens (prompt tokens per step), max_in_flight (requests let in at once)."),
    recorded("rampart_degradation_level", MetricKind::Gauge, &["model", "version"], "How degraded the model is: 0 every limit at its ceiling, 1 only the prefill budget trimmed, 2 the batch or admission reduced, 3 saturated (no new prefill)."),
    recorded("rampart_capacity_admitted_per_second", MetricKind::Gauge, &["model", "version"], "Prompts the first-token gate let in per second over the last degradation window (a capacity signal for an autoscaler)."),
    recorded("rampart_capacity_shed_per_second", MetricKind::Gauge, &["model", "version"], "Prompts the first-token gate refused per second over the last window (every retry counted)."),
    recorded("rampart_capacity_predicted_wait_seconds", MetricKind::Gauge, &["model", "version"], "How long a new prompt would be predicted to wait to be read now: the backlog, every booking and the gate's margin over the reading rate; above the gate, the model needs more capacity."),
    recorded("rampart_reservations_outstanding", MetricKind::Gauge, &["model", "version"], "Bookings of refused requests the first-token gate holds (the reservation backlog)."),
    recorded("rampart_reservation_tokens", MetricKind::Gauge, &["model", "version"], "Prompt tokens of those bookings."),
    recorded("rampart_reservations_total", MetricKind::Counter, &["model", "version", "outcome"], "What became of the gate's bookings: issued, honoured (the holder came back and was let in), rebooked (it came back too early), expired (nobody came back), evicted (pushed out by an earlier place in the fair order), unbooked (a refusal with no booking: the ledger full)."),
    recorded("rampart_degradation_changes_total", MetricKind::Counter, &["model", "cause"], "Limit changes of the degradation controller, by cause (memory, memory_saturated, kv_saturated, ttft, itl, rule, recovery)."),
    recorded("rampart_memory_pressure_ratio", MetricKind::Gauge, &[], "Memory used over the limit the degradation controllers measure against ([memory] limit, the cgroup's or the host's)."),
    recorded("rampart_model_loads_total", MetricKind::Counter, &["model", "cause"], "Models loaded after the start, by cause (request: a cold model's first request; admin: POST /v2/repository/models/{name}/load)."),
    recorded("rampart_model_unloads_total", MetricKind::Counter, &["model", "cause"], "Models unloaded, by cause (admin: POST .../unload; evicted: the models' budget needed room)."),
    recorded("rampart_models_memory_bytes", MetricKind::Gauge, &[], "What the loaded models take together: their files plus their KV pools (bytes)."),
    recorded("rampart_models_budget_bytes", MetricKind::Gauge, &[], "The models' memory budget ([memory] models_budget), when set (bytes)."),
    recorded("rampart_release_weight", MetricKind::Gauge, &["model", "version"], "The share of the model's routed requests a version serves under its release plan (stable 1 − w, candidate w)."),
    recorded("rampart_release_phase", MetricKind::Gauge, &["model"], "The release's phase: 0 idle, 1 gating, 2 awaiting approval, 3 running, 4 paused, 5 holding (no data), 6 promoted, 7 rolled back."),
    recorded("rampart_release_decisions_total", MetricKind::Counter, &["model", "result", "reason"], "Release decisions, by model, result (start, step, promote, rollback, hold, resume, pause, approve, gate_failed) and reason (the judge's metric, schedule, no_data, gates or command)."),
    recorded("rampart_fleet_store_up", MetricKind::Gauge, &["replica"], "Fleet mode: 1 while the fleet's PostgreSQL answers this replica, 0 while it does not (the replica serves its last known plans; no release decides)."),
    recorded("rampart_fleet_judge", MetricKind::Gauge, &["replica"], "Fleet mode: 1 while this replica holds the judge's lease (it decides every release of the fleet)."),
    recorded("rampart_fleet_judge_changes_total", MetricKind::Counter, &["replica", "to"], "Fleet mode: this replica became the judge (to=judge) or stopped being it (to=follower)."),
    recorded("rampart_fleet_store_calls_total", MetricKind::Counter, &["replica", "op"], "Fleet mode: calls to the fleet's PostgreSQL, by operation (the load this replica puts on it)."),
    recorded("rampart_fleet_store_errors_total", MetricKind::Counter, &["replica", "op"], "Fleet mode: calls to the fleet's PostgreSQL that failed, by operation (lease, heartbeat, plan, window, decide, command, rate, discover, view, fault, faults, claim)."),
    recorded("rampart_release_mirrored_total", MetricKind::Counter, &["model", "result"], "Shadow releases: mirrored requests by whether the candidate's answer agreed with the control's (agreed, disagreed, or incomplete when one of them did not answer)."),
    recorded("rampart_feedback_total", MetricKind::Counter, &["model", "version", "class", "rating"], "Feedback taken (POST /v1/feedback), by the response's model, version and class (none without one) and the rating (helpful, not_helpful, 1 to 5, none for corrections without a rating)."),
    recorded("rampart_feedback_corrections_total", MetricKind::Counter, &["model", "version", "kind"], "Feedback that corrected the answer, by kind (label: the right class; text: the right answer)."),
    recorded("rampart_feedback_refused_total", MetricKind::Counter, &["reason"], "Feedback refused, by reason (malformed, not_found, unauthorized, other_tenant, other_response, feedback_token_expired, feedback_token_forged, feedback_token_malformed, store, off)."),
    recorded("rampart_feedback_retrains_total", MetricKind::Counter, &["model", "trigger", "outcome"], "Runs of the retrain hook ([feedback.retrain] command), by trigger (alert, admin) and outcome (started, succeeded, failed)."),
    recorded("rampart_feedback_streamed_total", MetricKind::Counter, &["outcome"], "Lines of the correction log sent to NATS JetStream ([feedback.nats]), by outcome (published; duplicate: the stream had it already, a replay after a restart; skipped: not a JSON object)."),
    recorded("rampart_feedback_stream_errors_total", MetricKind::Counter, &["stage"], "Failures of the correction stream, by stage (credentials, connect, stream, read, publish, ack, cursor); it retries with a backoff up to 30 s, from the last acknowledged line."),
    recorded("rampart_feedback_stream_up", MetricKind::Gauge, &[], "1 while the correction stream is connected to NATS and its stream exists, else 0."),
    recorded("rampart_feedback_stream_lag_bytes", MetricKind::Gauge, &[], "Bytes of the correction log not yet acknowledged by the stream."),
    recorded("rampart_class_error_rate", MetricKind::Gauge, &["model", "version", "class"], "Share of the class's feedback in the window ([feedback] window_s, 1 h) that says the answer was wrong (not_helpful, 1-2 stars, or another label)."),
    recorded("rampart_class_error_rate_lower", MetricKind::Gauge, &["model", "version", "class"], "The Wilson 95 % lower bound of rampart_class_error_rate: above the objective, the class is worse than it with 97.5 % confidence."),
    recorded("rampart_class_feedback", MetricKind::Gauge, &["model", "version", "class"], "Feedback rows of the class in the window (the error rate's sample size)."),
    recorded("rampart_release_plan_errors_total", MetricKind::Counter, &["model"], "Release plan files that could not be read (changed on disk) or written."),
    recorded("rampart_guard_decisions_total", MetricKind::Counter, &["model", "verdict", "channel", "tier", "reason"], "Input guard decisions, by model, verdict, channel of the deciding text, tier and strongest reason."),
    recorded("rampart_guard_seconds", MetricKind::Histogram, &["model"], "Time the input guard took per request."),
    recorded("rampart_guard_output_total", MetricKind::Counter, &["model", "verdict"], "Outputs that repeated the system message's canary or opening (flag) or were cut before it (cut)."),
    recorded("rampart_audit_appended_total", MetricKind::Counter, &[], "Entries made durable in the audit log (requests and actions)."),
    recorded("rampart_audit_dropped_total", MetricKind::Counter, &[], "Records the audit lane lost (best_effort: queue full; fail_closed: write failures, whose requests were refused)."),
    recorded("rampart_audit_queue_depth", MetricKind::Gauge, &[], "Records waiting in the audit lane."),
    recorded("rampart_audit_fsync_seconds", MetricKind::Histogram, &[], "One audit group commit: the write and its fdatasync."),
    recorded("rampart_audit_checkpoint_age_seconds", MetricKind::Gauge, &[], "How long the newest audit entries have waited for a signed checkpoint (0: all covered)."),
    recorded("rampart_audit_healthy", MetricKind::Gauge, &[], "1 while the audit log persists; 0: in fail_closed every request is refused."),
    recorded("rampart_audit_ship_lag_seconds", MetricKind::Gauge, &[], "Age of the oldest sealed audit segment not yet shipped and verified on S3."),
    recorded("rampart_audit_ship_failures_total", MetricKind::Counter, &[], "Audit shipping rounds that failed (retried with backoff; the local copy stays)."),
    recorded("rampart_audit_s3_retries_total", MetricKind::Counter, &[], "S3 requests retried after a transport error or a 5xx."),
    recorded("rampart_tls_reloads_total", MetricKind::Counter, &["result"], "TLS certificate reloads ([tls]), by result: ok (new connections get the new files), error (they did not build: the previous certificate stays; each broken set of files counted once)."),
    recorded("rampart_tls_handshake_failures_total", MetricKind::Counter, &["door", "reason"], "TLS handshakes that failed, by port (http, grpc) and reason: client_certificate (none where one is required, or one the client CA did not sign), timeout (handshake_timeout_ms), protocol (anything else)."),
    recorded("rampart_trace_spans_exported_total", MetricKind::Counter, &[], "Spans the trace sink exported over OTLP ([tracing] on)."),
    recorded("rampart_trace_spans_dropped_total", MetricKind::Counter, &["reason"], "Spans the trace sink dropped, by reason (export_failed, timeout); records its lane dropped are in rampart_record_dropped_total{sink=\"traces\"}."),
    recorded("gen_ai_server_request_duration_seconds", MetricKind::Histogram, &["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model", "error_type"], "GenAI semantic conventions' gen_ai.server.request.duration: time to the last byte of the response, per generation or embedding request."),
    recorded("gen_ai_server_time_to_first_token_seconds", MetricKind::Histogram, &["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model"], "GenAI semantic conventions' gen_ai.server.time_to_first_token: time to the first generated token of successful responses."),
    recorded("gen_ai_server_time_per_output_token_seconds", MetricKind::Histogram, &["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model", "gen_ai_response_model"], "GenAI semantic conventions' gen_ai.server.time_per_output_token: decode time per token after the first, of successful responses."),
];

/// The recorder's metrics and the host telemetry's ([`crate::telemetry::HOST_METRICS`]).
pub fn all_metrics() -> impl Iterator<Item = &'static MetricInfo> {
    METRICS.iter().chain(crate::telemetry::HOST_METRICS.iter())
}

/// Metrics or logging could not be set up.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct ObserveError(pub String);

/// Installs the Prometheus recorder (once per process) and describes every metric.
pub fn install_metrics() -> Result<PrometheusHandle, ObserveError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_inter_token_latency_seconds".into()),
                TOKEN_LATENCY_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_time_per_output_token_seconds".into()),
                TOKEN_LATENCY_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_token_entropy_nats".into()),
                ENTROPY_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("gen_ai_server_request_duration_seconds".into()),
                GEN_AI_REQUEST_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("gen_ai_server_time_to_first_token_seconds".into()),
                GEN_AI_TTFT_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("gen_ai_server_time_per_output_token_seconds".into()),
                GEN_AI_TPOT_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_grammar_mask_seconds".into()),
                MASK_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_grammar_compile_seconds".into()),
                COMPILE_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_output_confidence".into()),
                &[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0],
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_lane_job_seconds".into()),
                LATENCY_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                Matcher::Full("rampart_tensor_batch_size".into()),
                &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0],
            )
        })
        .map_err(|e| ObserveError(e.to_string()))?
        .install_recorder()
        .map_err(|e| ObserveError(e.to_string()))?;
    for m in METRICS {
        match m.kind {
            MetricKind::Counter => describe_counter!(m.name, m.help),
            MetricKind::Gauge => describe_gauge!(m.name, m.help),
            MetricKind::Histogram => describe_histogram!(m.name, m.help),
        }
    }
    Ok(handle)
}

/// Refreshes the per-model gauges from the engines' snapshots, and the record bus's counters
/// (called before each scrape).
pub fn refresh_gauges(registry: &Registry, handoffs: &crate::handoff::Handoffs, bus: &Bus) {
    for h in handoffs.all() {
        let view = h.view();
        gauge!("rampart_handoff_active", "model" => view.model)
            .set(f64::from(u8::from(view.active)));
    }
    for e in registry.all() {
        for b in e.backends() {
            gauge!("rampart_breaker_state", "backend" => b.id.clone())
                .set(f64::from(b.breaker.state().gauge()));
        }
        // The last periodic readiness check (`spawn_readiness`), so a model that stalls or
        // stops reads 0 and readiness flapping shows as changes of this gauge.
        gauge!("rampart_model_ready", "model" => e.name.clone())
            .set(f64::from(u8::from(e.is_ready())));
        let Some(s) = e.backend.engine_snapshot() else {
            continue;
        };
        let labels = [("model", e.name.clone())];
        gauge!("rampart_queue_depth", &labels).set(e.admission.waiting() as f64);
        gauge!("rampart_requests_in_flight", &labels).set(e.admission.in_flight() as f64);
        gauge!("rampart_engine_running_sequences", &labels).set(s.running as f64);
        gauge!("rampart_engine_waiting_sequences", &labels).set(s.waiting as f64);
        gauge!("rampart_kv_blocks_used", &labels).set(s.blocks_used as f64);
        gauge!("rampart_kv_blocks_total", &labels).set(s.blocks_total as f64);
        gauge!("rampart_kv_blocks_cached", &labels).set(s.blocks_cached as f64);
        gauge!("rampart_kv_blocks_resident", &labels).set(s.blocks_resident as f64);
        counter!("rampart_kv_released_bytes_total", &labels).absolute(s.kv_released_bytes);
        counter!("rampart_prefix_cache_hits_total", &labels).absolute(s.prefix.hits);
        counter!("rampart_prefix_cache_lookups_total", &labels)
            .absolute(s.prefix.hits + s.prefix.misses);
        counter!("rampart_preemptions_total", &labels).absolute(s.preemptions);
        counter!("rampart_speculative_tokens_total", &labels).absolute(s.speculated_tokens);
        counter!("rampart_speculative_accepted_total", &labels).absolute(s.speculated_accepted);
    }
    for lane in bus.counters() {
        for (reason, n) in &lane.dropped {
            counter!(
                "rampart_record_dropped_total",
                "sink" => lane.sink,
                "reason" => reason.as_str()
            )
            .absolute(*n);
        }
        counter!("rampart_record_written_total", "sink" => lane.sink).absolute(lane.written);
    }
}

/// The structured log: one JSON line per record (`message: "inference record"`), fields at the
/// top level. Lossy: a log that cannot keep up loses lines, counted, and never slows requests.
#[derive(Debug)]
pub struct LogSink {
    capacity: usize,
    /// The audit log's redaction of identities applies to the log lines too (else the lines
    /// would join a hashed entry to the person by its `audit_id`).
    redact: audit::RedactionPolicy,
}

impl LogSink {
    pub fn new(capacity: usize) -> Self {
        Self::redacting(capacity, audit::RedactionPolicy::default())
    }

    /// A log sink that writes `user`, `operator` and `principal` as `redact` says.
    pub fn redacting(capacity: usize, redact: audit::RedactionPolicy) -> Self {
        Self { capacity, redact }
    }
}

impl Sink for LogSink {
    fn name(&self) -> &'static str {
        "log"
    }

    /// One summary line per interval instead (crate::unauthenticated: refusals before
    /// authentication and past a key's rate limit).
    fn takes_summarised_refusals(&self) -> bool {
        false
    }

    fn delivery(&self) -> Delivery {
        Delivery::Lossy {
            capacity: self.capacity,
        }
    }

    /// An admin action is a `rampart::admin` line (warn), with the caller's identities redacted
    /// as the records' are; a controller decision a `rampart::decision` line (its controller
    /// logged the details when it decided).
    fn takes_actions(&self) -> bool {
        true
    }

    fn write_action<'a>(&'a mut self, action: &'a ActionRecord) -> SinkFuture<'a> {
        let shown = |v: &str, a| audit::entry::redact_string(v, a).unwrap_or_default();
        match &action.by {
            Actor::Key {
                principal,
                operator,
            } => tracing::warn!(
                target: "rampart::admin",
                action = %action.action.name,
                by = %shown(principal, self.redact.principal),
                operator = %operator.as_deref().map(|o| shown(o, self.redact.operator)).unwrap_or_default(),
                on = action.action.target.as_deref().unwrap_or(""),
                cause = action.action.cause.as_deref().unwrap_or(""),
                outcome = %action.action.outcome,
                "admin action"
            ),
            Actor::Controller => tracing::info!(
                target: "rampart::decision",
                decision = %action.action.name,
                model = action.model.as_deref().unwrap_or(""),
                on = action.action.target.as_deref().unwrap_or(""),
                cause = action.action.cause.as_deref().unwrap_or(""),
                "controller decision"
            ),
        }
        Box::pin(std::future::ready(Ok(())))
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        let p = &self.redact;
        let identities = [p.user, p.operator, p.principal];
        if identities.iter().all(|a| *a == audit::RedactAction::Keep) {
            log_record(&envelope.record);
        } else {
            let mut r = envelope.record.clone();
            let redact = |v: &str, a| audit::entry::redact_string(v, a);
            r.user = r.user.as_deref().and_then(|u| redact(u, p.user));
            r.operator = r.operator.as_deref().and_then(|o| redact(o, p.operator));
            r.principal = redact(&r.principal, p.principal).unwrap_or_default();
            log_record(&r);
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

/// A record's attempts as one JSON array in its log line.
struct Attempts<'a>(&'a [record::Attempt]);

impl std::fmt::Display for Attempts<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&serde_json::to_string(self.0).unwrap_or_default())
    }
}

/// A record's guard reasons as one comma-separated field.
struct GuardReasons<'a>(&'a [String]);

impl std::fmt::Display for GuardReasons<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.join(","))
    }
}

fn log_record(r: &InferenceRecord) {
    tracing::info!(
        target: "rampart::record",
        request_id = %r.request_id,
        audit_id = %r.audit_id,
        time_ms = r.time_ms,
        principal = %r.principal,
        user = r.user.as_deref(),
        operator = r.operator.as_deref(),
        trace_id = r.trace_id.as_deref(),
        endpoint = r.endpoint,
        model = %r.model,
        version = %r.version,
        version_digest = %r.version_digest,
        lineage_commit = r.lineage_commit.as_deref(),
        dataset_version = r.dataset_version.as_deref(),
        variant = r.variant,
        route_reason = r.route_reason,
        gpu_utilization = r.gpu_utilization,
        input_sha256 = %r.input_sha256,
        output_sha256 = %r.output_sha256,
        guard_verdict = r.guard_verdict.as_deref(),
        guard_reasons = %GuardReasons(&r.guard_reasons),
        guard_score = r.guard_score,
        guard_ms = r.guard_ms,
        guard_output = r.guard_output,
        prompt_tokens = r.prompt_tokens,
        completion_tokens = r.completion_tokens,
        cached_prompt_tokens = r.cached_prompt_tokens,
        speculated_tokens = r.speculated_tokens,
        speculated_accepted = r.speculated_accepted,
        queue_ms = r.queue_ms,
        prefill_ms = r.prefill_ms,
        ttft_ms = r.ttft_ms,
        decode_ms = r.decode_ms,
        total_ms = r.total_ms,
        entropy_mean = r.entropy_mean,
        entropy_min = r.entropy_min,
        abnormal = r.abnormal,
        finish_reason = r.finish_reason.as_deref(),
        status = r.status,
        error_type = r.error_type.as_deref(),
        error_code = r.error_code.as_deref(),
        refusal = r.refusal,
        fallback_level = r.fallback_level,
        fallback_backend = r.fallback_backend.as_deref(),
        fallback_reason = r.fallback_reason,
        attempts = %Attempts(&r.attempts),
        stream = r.stream,
        structured = r.structured.as_ref().map(|s| s.kind),
        structured_outcome = r.structured.as_ref().and_then(|s| s.outcome),
        structured_problem = r.structured.as_ref().and_then(|s| s.problem.as_deref()),
        grammar_sha256 = r.structured.as_ref().map(|s| s.grammar_sha256.as_str()),
        grammar_compile_ms = r.structured.as_ref().map(|s| s.compile_ms),
        tool_calls = %GuardReasons(&r.tool_calls),
        items = r.items,
        compute_ms = r.compute_ms,
        confidence = r.confidence,
        confidence_min = r.confidence_min,
        "inference record"
    );
}

/// The Prometheus metrics of each request (docs/metrics.md): counts, latencies, tokens,
/// entropies, confidences, refusals. Lossy, like the log.
#[derive(Debug)]
pub struct MetricsSink {
    capacity: usize,
}

impl MetricsSink {
    pub fn new(capacity: usize) -> Self {
        Self { capacity }
    }
}

/// The metrics sink's name; a scrape waits for it to catch up ([`Bus::caught_up`]).
pub const METRICS_SINK: &str = "metrics";

impl Sink for MetricsSink {
    fn name(&self) -> &'static str {
        METRICS_SINK
    }

    fn delivery(&self) -> Delivery {
        Delivery::Lossy {
            capacity: self.capacity,
        }
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        count_record(envelope);
        Box::pin(std::future::ready(Ok(())))
    }

    fn takes_actions(&self) -> bool {
        true
    }

    fn write_action<'a>(&'a mut self, action: &'a ActionRecord) -> SinkFuture<'a> {
        let name = action.action.name.clone();
        match action.by {
            Actor::Key { .. } => counter!("rampart_admin_actions_total", "action" => name),
            Actor::Controller => {
                counter!("rampart_controller_decisions_total", "decision" => name)
            }
        }
        .increment(1);
        Box::pin(std::future::ready(Ok(())))
    }
}

fn count_record(envelope: &Envelope) {
    let r = &envelope.record;
    if let Some(reason) = r.refusal {
        let model = if r.model.is_empty() {
            "none".to_string()
        } else {
            r.model.clone()
        };
        counter!("rampart_rejected_requests_total", "model" => model, "reason" => reason)
            .increment(1);
    }
    if r.model.is_empty() {
        // Refused before a model was chosen: counted, not timed.
        counter!(
            "rampart_requests_total",
            "model" => "none",
            "endpoint" => r.endpoint,
            "status" => r.status.to_string()
        )
        .increment(1);
        return;
    }
    let model = r.model.clone();
    counter!(
        "rampart_requests_total",
        "model" => model.clone(),
        "endpoint" => r.endpoint,
        "status" => r.status.to_string()
    )
    .increment(1);
    if let (Some(to), Some(reason)) = (&r.fallback_backend, r.fallback_reason) {
        counter!(
            "rampart_fallback_total",
            "model" => model.clone(),
            "to" => to.clone(),
            "reason" => reason
        )
        .increment(1);
        if r.fallback_level == 2 {
            counter!("rampart_canned_responses_total", "model" => model.clone()).increment(1);
        }
    }
    if let Some(s) = &r.structured {
        counter!(
            "rampart_structured_requests_total",
            "model" => model.clone(),
            "kind" => s.kind,
            "outcome" => s.outcome.unwrap_or("none")
        )
        .increment(1);
    }
    let labels = [("model", model)];
    histogram!("rampart_request_duration_seconds", &labels).record(r.total_ms / 1e3);
    histogram!("rampart_queue_time_seconds", &labels).record(r.queue_ms / 1e3);
    if r.completion_tokens > 0 {
        histogram!("rampart_time_to_first_token_seconds", &labels).record(r.ttft_ms / 1e3);
    }
    if r.completion_tokens > 1 {
        histogram!("rampart_time_per_output_token_seconds", &labels)
            .record(r.decode_ms / 1e3 / (r.completion_tokens - 1) as f64);
    }
    let itl = histogram!("rampart_inter_token_latency_seconds", &labels);
    for &gap in &envelope.token_gaps_s {
        itl.record(gap);
    }
    let entropy = histogram!("rampart_token_entropy_nats", &labels);
    for &e in &envelope.token_entropies {
        entropy.record(f64::from(e));
    }
    counter!("rampart_prompt_tokens_total", &labels).increment(r.prompt_tokens as u64);
    counter!("rampart_generated_tokens_total", &labels).increment(r.completion_tokens as u64);
    if r.abnormal {
        counter!("rampart_abnormal_requests_total", &labels).increment(1);
    }
    if let Some(c) = r.confidence {
        histogram!("rampart_output_confidence", &labels).record(f64::from(c));
    }
    if r.items > 0 {
        counter!("rampart_inputs_total", &labels).increment(r.items as u64);
    }
    gen_ai_metrics(r);
}

/// The GenAI semantic conventions' server metrics, for generations and embeddings (tensor
/// models are not generative AI). Labels are the conventions' attributes with `_` for `.`.
fn gen_ai_metrics(r: &InferenceRecord) {
    let operation = match r.endpoint {
        "chat.completions" => "chat",
        "completions" => "text_completion",
        "embeddings" => "embeddings",
        _ => return,
    };
    let response_model = if r.status < 400 {
        r.fallback_backend.as_deref().map_or_else(
            || r.model.clone(),
            |b| b.split('@').next().unwrap_or(b).to_string(),
        )
    } else {
        String::new()
    };
    let common = [
        ("gen_ai_operation_name", operation.to_string()),
        ("gen_ai_provider_name", crate::traces::PROVIDER.to_string()),
        ("gen_ai_request_model", r.model.clone()),
        ("gen_ai_response_model", response_model),
    ];
    let error = if r.status >= 400 {
        r.error_code
            .clone()
            .or_else(|| r.error_type.clone())
            .unwrap_or_else(|| r.status.to_string())
    } else {
        String::new()
    };
    let mut with_error = common.to_vec();
    with_error.push(("error_type", error));
    histogram!("gen_ai_server_request_duration_seconds", &with_error[..]).record(r.total_ms / 1e3);
    if r.status >= 400 {
        return;
    }
    if r.completion_tokens > 0 {
        histogram!("gen_ai_server_time_to_first_token_seconds", &common).record(r.ttft_ms / 1e3);
    }
    if r.completion_tokens > 1 {
        histogram!("gen_ai_server_time_per_output_token_seconds", &common)
            .record(r.decode_ms / 1e3 / (r.completion_tokens - 1) as f64);
    }
}

/// A JSON log line's writer that puts `"replica":"<id>"` first in every line (a replica of a
/// fleet names itself in each of its lines). The formatter writes one whole line per call.
struct Tagged<W> {
    inner: W,
    prefix: std::sync::Arc<[u8]>,
}

impl<W: std::io::Write> std::io::Write for Tagged<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match buf.strip_prefix(b"{") {
            Some(rest) => {
                self.inner.write_all(&self.prefix)?;
                self.inner.write_all(rest)?;
            }
            None => self.inner.write_all(buf)?,
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

struct TaggedWriter {
    inner: tracing_subscriber::fmt::writer::BoxMakeWriter,
    prefix: std::sync::Arc<[u8]>,
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for TaggedWriter {
    type Writer = Tagged<Box<dyn std::io::Write + 'a>>;

    fn make_writer(&'a self) -> Self::Writer {
        Tagged {
            inner: self.inner.make_writer(),
            prefix: std::sync::Arc::clone(&self.prefix),
        }
    }
}

/// Sets up `tracing`: JSON lines (fields at the top level) or text, to stdout or a file. A
/// replica of a fleet (`replica`) names itself in every JSON line (`"replica"`, first).
pub fn init_logging(log: &Log, replica: Option<&str>) -> Result<(), ObserveError> {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&log.level))
        .map_err(|e| ObserveError(format!("log.level {:?}: {e}", log.level)))?;
    let writer: tracing_subscriber::fmt::writer::BoxMakeWriter = match &log.file {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| ObserveError(format!("log file {}: {e}", path.display())))?;
            tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::sync::Mutex::new(file))
        }
        None => tracing_subscriber::fmt::writer::BoxMakeWriter::new(std::io::stdout),
    };
    let writer = match (replica, log.format) {
        (Some(replica), LogFormat::Json) => {
            let prefix = format!("{{\"replica\":{},", serde_json::Value::from(replica));
            tracing_subscriber::fmt::writer::BoxMakeWriter::new(TaggedWriter {
                inner: writer,
                prefix: std::sync::Arc::from(prefix.into_bytes()),
            })
        }
        _ => writer,
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer);
    let result = match log.format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
    result.map_err(|e| ObserveError(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `counter!/gauge!/histogram!("rampart_…"` in the workspace's sources.
    fn emitted_names() -> std::collections::BTreeSet<String> {
        fn walk(dir: &std::path::Path, found: &mut std::collections::BTreeSet<String>) {
            let Ok(entries) = std::fs::read_dir(dir) else {
                return;
            };
            for entry in entries.flatten() {
                let path = entry.path();
                if path.is_dir() {
                    walk(&path, found);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    for macro_name in ["counter!(", "gauge!(", "histogram!("] {
                        for (at, _) in text.match_indices(macro_name) {
                            let rest = text[at + macro_name.len()..].trim_start();
                            for prefix in ["rampart_", "gen_ai_"] {
                                let Some(rest) = rest.strip_prefix(&format!("\"{prefix}")) else {
                                    continue;
                                };
                                let end = rest.find('"').unwrap_or(0);
                                let tail = &rest[..end];
                                let plain = |c: char| {
                                    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'
                                };
                                if !tail.is_empty() && tail.chars().all(plain) {
                                    found.insert(format!("{prefix}{tail}"));
                                }
                            }
                        }
                    }
                }
            }
        }
        let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut found = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(&crates).expect("crates dir").flatten() {
            walk(&entry.path().join("src"), &mut found);
        }
        found
    }

    #[test]
    fn metric_table_covers_every_emitted_name() {
        let names: std::collections::BTreeSet<&str> = all_metrics().map(|m| m.name).collect();
        assert_eq!(
            names.len(),
            all_metrics().count(),
            "a metric is listed twice"
        );
        let emitted = emitted_names();
        assert!(emitted.len() > 40, "the scan found too little: {emitted:?}");
        for name in &emitted {
            assert!(
                names.contains(name.as_str()),
                "{name} is emitted but not in METRICS"
            );
        }
        for name in [
            "gen_ai_server_request_duration_seconds",
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai_server_time_per_output_token_seconds",
        ] {
            assert!(emitted.contains(name), "{name} is not emitted");
        }
        for m in all_metrics() {
            // Ours are rampart_*; the GenAI conventions' server metrics keep their own names.
            assert!(
                m.name.starts_with("rampart_") || m.name.starts_with("gen_ai_server_"),
                "{}",
                m.name
            );
            assert!(!m.help.is_empty(), "{}", m.name);
            // Counters end in _total; histograms must not (their series add _bucket, _sum,
            // _count). A gauge may count a total (rampart_kv_blocks_total: blocks in the pool).
            let total = m.name.ends_with("_total");
            match m.kind {
                MetricKind::Counter => assert!(total, "{}: a counter ends in _total", m.name),
                MetricKind::Histogram => assert!(!total, "{}", m.name),
                MetricKind::Gauge => {}
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_log_and_metrics_sinks_pass_the_sink_contract() {
        record::testing::check_sink(|| LogSink::new(64)).await;
        record::testing::check_sink(|| MetricsSink::new(64)).await;
    }
}
