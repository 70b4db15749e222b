//! The server's configuration: one typed file (`rampart.toml` given with `--config`), every limit a
//! named setting with a default that serves one machine, environment variables over the file,
//! command-line flags over both. docs/configuration.md lists every setting.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

pub use pipeline::admission::AdmissionConfig as Admission;
pub use pipeline::breaker::BreakerSettings;
pub use pipeline::chain::{FallbackStep, Trigger};
pub use pipeline::faults::FaultsConfig;
pub use pipeline::guard_service::{Canary, GuardConfig, GuardOverride, GuardSetup, Refusal};
pub use pipeline::handoff::HandoffConfig;
pub use pipeline::rate_limit::RateLimit;

/// `[monitor]`: the drift detector and the output monitors of every served model version.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MonitorConfig {
    /// Monitors run (off the request path, in their record sink; tensor models also measure
    /// each decoded image).
    pub enabled: bool,
    /// Where baselines are kept; default: `<repo>/<model>/monitors/<version>.json`, beside the
    /// versions.
    pub dir: Option<PathBuf>,
    /// Records the monitors' lane holds before it drops (counted).
    pub lane_capacity: usize,
    /// The drift detector: mode, windows, thresholds, baseline capture, calibration.
    pub drift: monitor::DriftConfig,
    /// The output monitors (mean token entropy; classifier and detector confidence).
    pub output: monitor::OutputConfig,
}

impl Default for MonitorConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: None,
            lane_capacity: 4096,
            drift: monitor::DriftConfig::default(),
            output: monitor::OutputConfig::default(),
        }
    }
}

/// `[releases]`: canary, A/B and shadow releases, each steered by its model's
/// `release.toml` in the repository (docs/releases.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReleasesConfig {
    /// Release plans are read, routed by and judged (off: every request gets the version it
    /// names, or the model's stable one).
    pub enabled: bool,
    /// The header that names the end user when the request's `user` field does not; the
    /// route's sticky hash takes the `user`, else this header, else the API key's id.
    pub user_header: String,
    /// The header that names a request's A/B group (the plan's `[routing.groups]`).
    pub group_header: String,
    /// How often the controller judges each running release and looks for a changed plan file.
    pub tick_ms: u64,
    /// Records the releases' lane holds before it drops (counted).
    pub lane_capacity: usize,
}

impl Default for ReleasesConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            user_header: "x-user-id".into(),
            group_header: "x-rampart-group".into(),
            tick_ms: 1000,
            lane_capacity: 4096,
        }
    }
}

/// `[feedback]`: ratings and corrections on served responses, per-class quality, datasets
/// (docs/feedback.md).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FeedbackConfig {
    /// Responses are indexed and `POST /v1/feedback` takes feedback.
    pub enabled: bool,
    /// The embedded store (`feedback.db`), the link key (`link.key`) and the correction log
    /// (`corrections.jsonl`) live here.
    pub dir: PathBuf,
    /// Hours a response without feedback stays findable (and exportable) before it is pruned.
    pub retention_hours: u64,
    /// Keep each response's input and output in the store (exports need them); off: hashes
    /// only.
    pub keep_content: bool,
    /// Each answer carries `X-Rampart-Feedback-Token`, a signed link an end user's client
    /// rates with, without an API key.
    pub links: bool,
    /// How long a feedback link is valid, in seconds.
    pub link_ttl_s: u64,
    /// The window of the per-class error rates and the calibration table, in seconds.
    pub window_s: u64,
    /// Feedback rows a class needs in the window before its error rate is judged.
    pub min_samples: u64,
    /// How often the per-class gauges are refreshed from the store, in seconds.
    pub refresh_s: u64,
    /// Append each submission to `corrections.jsonl` in `dir` (the correction log).
    pub corrections_log: bool,
    /// How each language model's class is read from its answer: `MODEL = "category"` (a field
    /// of its JSON answer), `"field:/ticket/kind"` (a JSON pointer) or `"pattern:REGEX"`
    /// (the first group). Classifiers give their top class themselves.
    pub classes: std::collections::BTreeMap<String, String>,
    /// Records the index's lane holds (it waits for room, off the request path).
    pub lane_capacity: usize,
    /// Submissions of one signed link (one answer) a minute, the burst included (a bucket
    /// refilled at this rate); beyond it `429 rate_limited` with `Retry-After`, before the body
    /// is read, nothing stored or audited. 0: no limit.
    pub submissions_per_minute_per_link: u32,
    /// Submissions of one key (principal) a minute, the same way. 0: no limit.
    pub submissions_per_minute_per_principal: u32,
    /// The retrain hook: a command run when a class's error rate crosses its objective (or on
    /// `POST /admin/feedback/retrain`).
    pub retrain: RetrainConfig,
    /// The correction log streamed to NATS JetStream (off without a URL).
    pub nats: NatsConfig,
    /// A PostgreSQL database for the store instead of the embedded file (several replicas
    /// share feedback): `postgresql://user:password@host:5432/db`. The environment's
    /// `RAMPART_FEEDBACK_POSTGRES_URL` takes precedence (keeps the password out of the file).
    pub postgres_url: Option<String>,
}

impl Default for FeedbackConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            dir: PathBuf::from("feedback"),
            retention_hours: 168,
            keep_content: true,
            links: true,
            link_ttl_s: 86_400,
            window_s: 3_600,
            min_samples: 20,
            refresh_s: 10,
            corrections_log: true,
            classes: Default::default(),
            lane_capacity: 8192,
            submissions_per_minute_per_link: 6,
            submissions_per_minute_per_principal: 600,
            retrain: RetrainConfig::default(),
            nats: NatsConfig::default(),
            postgres_url: None,
        }
    }
}

/// `[feedback.retrain]`: the hook that closes the loop (docs/feedback.md#closing-the-loop).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetrainConfig {
    /// Run by `sh -c` with RAMPART_FEEDBACK_MODEL, _VERSION, _CLASS, _ERROR_RATE_LOWER,
    /// _TRIGGER (`alert` or `admin`), RAMPART_FEEDBACK_DIR, RAMPART_REPO and RAMPART_URL; its
    /// output goes to `<dir>/retrain/hook-*.log`. Typically `rampart feedback retrain --model
    /// "$RAMPART_FEEDBACK_MODEL" --train ./train.sh`. None: no hook.
    pub command: Option<String>,
    /// A class whose error rate's Wilson lower bound is above this (with `min_samples` rows)
    /// triggers the hook.
    pub error_rate: f64,
    /// Seconds before the hook runs again for the same model.
    pub cooldown_s: u64,
}

impl Default for RetrainConfig {
    fn default() -> Self {
        Self {
            command: None,
            error_rate: 0.05,
            cooldown_s: 86_400,
        }
    }
}

/// `[feedback.nats]`: each line of the correction log published to a NATS JetStream stream,
/// acknowledged, in order, resumed after a restart or an outage from a cursor beside the log
/// (docs/feedback.md#the-correction-stream).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    /// `nats://host:4222` (several, comma-separated; `nats://user:password@host:4222` or
    /// `nats://token@host:4222` to authenticate). The environment's
    /// `RAMPART_FEEDBACK_NATS_URL` takes precedence. None: no stream.
    pub url: Option<String>,
    /// Messages go to `SUBJECT.MODEL` (the model's name with `.`, `*`, `>` and spaces as `_`).
    pub subject: String,
    /// The JetStream stream that takes `SUBJECT.>`.
    pub stream: String,
    /// Create the stream when it is missing (file storage, a one-hour duplicate window); off:
    /// the operator creates it, and the server waits for it.
    pub create_stream: bool,
    /// A NATS credentials file (`.creds`: a user JWT and its NKey seed).
    pub credentials_file: Option<PathBuf>,
    /// Messages published before their acknowledgements are awaited.
    pub max_in_flight: usize,
}

impl Default for NatsConfig {
    fn default() -> Self {
        Self {
            url: None,
            subject: "rampart.feedback".into(),
            stream: "RAMPART_FEEDBACK".into(),
            create_stream: true,
            credentials_file: None,
            max_in_flight: 256,
        }
    }
}

impl NatsConfig {
    /// The URL in effect (the environment's first).
    pub fn effective_url(&self) -> Option<String> {
        std::env::var("RAMPART_FEEDBACK_NATS_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .or_else(|| self.url.clone().filter(|u| !u.is_empty()))
    }
}

/// `[maturity]`: the maturity gate (docs/maturity.md). A model's required level is its
/// `[[models]] min_maturity`, else `min_level` here. Releases refuse a candidate below it;
/// in `production` mode the server also refuses to serve a stable version below it.
#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct MaturityConfig {
    /// Production mode: a model whose stable version is below its required level is not
    /// served (unless its `maturity_override` says why, audited).
    pub production: bool,
    /// The level every model needs (experimental, staging, production); none: only the
    /// models that set `min_maturity` have one.
    pub min_level: Option<release::maturity::Level>,
    /// The shipped alert rules (deploy/monitoring/rules/rampart-alerts.yml) as deployed: the
    /// monitoring section's `alerts` check reads it.
    pub alert_rules: Option<PathBuf>,
    /// A Prometheus that should have loaded them (`http://prometheus:9090`): the check asks its
    /// `/api/v1/rules` whether Rampart's alert group is loaded.
    pub prometheus_url: Option<String>,
}

impl MaturityConfig {
    /// The level `model` must reach, if any.
    pub fn required(&self, model: &ModelConfig) -> Option<release::maturity::Level> {
        model.min_maturity.or(self.min_level)
    }
}

/// `[fleet]`: replicas that share their releases (docs/fleet.md). Off by default: one server
/// keeps its release plans in the plan files.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FleetConfig {
    /// Share the release state in PostgreSQL: `postgres_url`, or the feedback store's
    /// database when it has one. Setting `postgres_url` turns it on too.
    pub enabled: bool,
    /// `postgresql://user:password@host:5432/db`. The environment's
    /// `RAMPART_FLEET_POSTGRES_URL` takes precedence (keeps the password out of the file).
    pub postgres_url: Option<String>,
    /// This replica's id, in its heartbeats, decisions, logs, traces and audit origin. Default:
    /// `RAMPART_REPLICA`, else `POD_NAME`, else `HOSTNAME`, else the host's name.
    pub replica: Option<String>,
    /// A judge that stopped ticking (hung, stopped, its node gone) loses its lease after this
    /// many seconds; one that died loses it at once.
    pub lease_timeout_s: u64,
    /// A replica not heard from for this long is shown as gone in `/admin/fleet`.
    pub stale_after_s: u64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            postgres_url: None,
            replica: None,
            lease_timeout_s: 10,
            stale_after_s: 15,
        }
    }
}

fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl ServerConfig {
    /// Whether this server is a replica of a fleet (`[fleet]` on, with a database).
    pub fn in_fleet(&self) -> bool {
        self.fleet.effective_url(&self.feedback).is_some()
    }

    /// Names this replica where it was left to a default: the traces' `service.instance.id`
    /// and, in a fleet, the audit log's origin and its S3 prefix (`<url>/<replica>`: each
    /// replica's log is its own, verified on its own beside the others').
    pub fn identify(&mut self) {
        let replica = self.fleet.replica_id();
        if self.tracing.service_instance_id.is_empty() {
            self.tracing.service_instance_id = replica.clone();
        }
        if !self.in_fleet() {
            return;
        }
        if self.audit.origin == audit::AuditConfig::default().origin {
            self.audit.origin = replica.clone();
        }
        // Each replica's log ships beside the others', under the same prefix: `rampart audit
        // verify --s3 <url>` finds and verifies every origin there.
        if let Some(s3) = &mut self.audit.s3 {
            s3.url = format!("{}/{replica}", s3.url.trim_end_matches('/'));
        }
    }
}

impl FleetConfig {
    /// The database in effect, if the fleet is on: the environment's, the file's, or the
    /// feedback store's.
    pub fn effective_url(&self, feedback: &FeedbackConfig) -> Option<String> {
        let own = env_nonempty("RAMPART_FLEET_POSTGRES_URL")
            .or_else(|| self.postgres_url.clone().filter(|u| !u.is_empty()));
        if own.is_some() {
            return own;
        }
        if !self.enabled {
            return None;
        }
        env_nonempty("RAMPART_FEEDBACK_POSTGRES_URL")
            .or_else(|| feedback.postgres_url.clone().filter(|u| !u.is_empty()))
    }

    /// This replica's id (see `replica`).
    pub fn replica_id(&self) -> String {
        let raw = self
            .replica
            .clone()
            .filter(|r| !r.trim().is_empty())
            .or_else(|| env_nonempty("RAMPART_REPLICA"))
            .or_else(|| env_nonempty("POD_NAME"))
            .or_else(|| env_nonempty("HOSTNAME"))
            .or_else(|| {
                std::fs::read_to_string("/proc/sys/kernel/hostname")
                    .ok()
                    .map(|h| h.trim().to_string())
                    .filter(|h| !h.is_empty())
            })
            .unwrap_or_else(|| "rampart".to_string());
        // A label value, a key prefix and a log field: keep it to a safe alphabet.
        raw.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') {
                    c
                } else {
                    '-'
                }
            })
            .take(63)
            .collect()
    }
}

/// Everything `rampart serve` runs with.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// The model repository folder.
    pub repo: PathBuf,
    /// File of API keys (one per line, optionally `id:key`; `#` starts a comment).
    pub api_keys_file: Option<PathBuf>,
    /// Serve without keys on a non-loopback address (refused otherwise).
    pub insecure_no_auth: bool,
    /// Whether `/metrics` needs a key (when keys are configured).
    pub metrics_require_auth: bool,
    /// Requests refused before authentication (missing or invalid key) are counted and
    /// summarised every this many seconds: one log line and one `auth.refused` audit entry,
    /// never one entry each (`crate::unauthenticated`).
    pub unauthenticated_summary_s: u64,
    /// A request without a valid key is answered 401 after this long (the connection waits,
    /// no CPU is used): a closed-loop flood or a key-guessing loop gets a few answers a second
    /// per connection instead of thousands (`crate::identity`). 0 answers at once.
    pub unauthenticated_delay_ms: u64,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are cancelled.
    pub shutdown_timeout_s: u64,
    /// Seconds between SIGTERM and the drain: readiness fails at once, but new requests are
    /// still served for this long, so that a load balancer's health check takes the replica out
    /// before it refuses anyone (set it above the check's interval × its fall count; behind a
    /// Kubernetes Service, a few seconds). 0: refuse at once (one server, no balancer).
    pub drain_delay_s: u64,
    /// Readiness fails when sequences are running and no token came for this many seconds.
    pub stall_timeout_s: u64,
    /// Compute threads (default: physical cores), shared by the models, one forward pass at a time.
    pub threads: Option<usize>,
    pub limits: Limits,
    pub admission: Admission,
    pub rate_limit: RateLimit,
    pub log: Log,
    /// OpenTelemetry traces over OTLP (docs/observability.md); off by default.
    pub tracing: TracingConfig,
    /// Host and GPU telemetry on `/metrics` (docs/observability.md).
    pub telemetry: TelemetryConfig,
    /// Tensor models: which backend runs ONNX graphs.
    pub tensor: TensorConfig,
    /// The KServe v2 gRPC endpoint.
    pub grpc: GrpcConfig,
    /// HTTPS and gRPC over TLS (rustls); off unless a certificate is given.
    pub tls: TlsConfig,
    /// The record bus: the lanes that carry each request's record to its sinks.
    pub records: RecordsConfig,
    /// The circuit breaker every backend has (docs/resilience.md).
    pub breaker: BreakerSettings,
    /// Hand-off to people (level 3), for every model unless its own `[models.handoff]` says
    /// otherwise.
    pub handoff: HandoffConfig,
    /// Fault injection for drills and tests (`POST /admin/faults`); off unless enabled.
    pub faults: FaultsConfig,
    /// The WORM audit log (docs/audit.md).
    pub audit: audit::AuditConfig,
    /// The input guard: prompt-injection rules and classifier, per model and per key
    /// (docs/guard.md).
    pub guard: GuardConfig,
    /// The monitors: input drift, output entropy and confidence (docs/monitoring.md).
    pub monitor: MonitorConfig,
    /// Canary, A/B and shadow releases (docs/releases.md).
    pub releases: ReleasesConfig,
    /// The feedback loop (docs/feedback.md).
    pub feedback: FeedbackConfig,
    /// Several replicas sharing one release state in PostgreSQL (docs/fleet.md).
    pub fleet: FleetConfig,
    /// The degradation controllers: memory watermarks and latency objectives move each
    /// language model's batch limits, prefill budget and admission (docs/resilience.md).
    pub degradation: DegradationConfig,
    /// The memory the degradation controllers measure against.
    pub memory: MemoryConfig,
    /// The maturity gate (docs/maturity.md).
    pub maturity: MaturityConfig,
    /// Models to serve; empty: every model in the repository, each at its stable version.
    pub models: Vec<ModelConfig>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            repo: PathBuf::from("models"),
            api_keys_file: None,
            insecure_no_auth: false,
            metrics_require_auth: false,
            unauthenticated_summary_s: 60,
            unauthenticated_delay_ms: 200,
            shutdown_timeout_s: 30,
            drain_delay_s: 0,
            stall_timeout_s: 60,
            threads: None,
            limits: Limits::default(),
            admission: Admission::default(),
            rate_limit: RateLimit::default(),
            log: Log::default(),
            tracing: TracingConfig::default(),
            telemetry: TelemetryConfig::default(),
            tensor: TensorConfig::default(),
            grpc: GrpcConfig::default(),
            tls: TlsConfig::default(),
            records: RecordsConfig::default(),
            breaker: BreakerSettings::default(),
            handoff: HandoffConfig::default(),
            faults: FaultsConfig::default(),
            audit: audit::AuditConfig::default(),
            guard: GuardConfig::default(),
            monitor: MonitorConfig::default(),
            releases: ReleasesConfig::default(),
            feedback: FeedbackConfig::default(),
            fleet: FleetConfig::default(),
            degradation: DegradationConfig::default(),
            memory: MemoryConfig::default(),
            maturity: MaturityConfig::default(),
            models: Vec::new(),
        }
    }
}

/// Request limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest request body.
    pub max_body_bytes: usize,
    /// Largest `max_tokens` a request may ask for.
    pub max_tokens: usize,
    /// `max_tokens` when a request gives none (capped by what the context leaves).
    pub default_max_tokens: usize,
    /// Most choices per request (`n`).
    pub max_n: usize,
    /// Most stop strings per request.
    pub max_stop: usize,
    /// Most alternatives per token in `top_logprobs` / `logprobs`.
    pub max_top_logprobs: usize,
    /// Most attention weights one request may export (`explain.attention`: layers × heads ×
    /// top_k × exported tokens, over all its choices).
    pub max_attention_entries: usize,
    /// Most spans `explain.reasons` tries per answer (each costs one prompt's prefill).
    pub max_reason_segments: usize,
    /// Most prompts in one `/v1/completions` request.
    pub max_prompts: usize,
    /// Largest JSON schema, regex, choice list or grammar of a structured-output request.
    pub max_grammar_bytes: usize,
    /// Longest a structured-output grammar may take to compile (first use; then it is cached).
    pub grammar_compile_timeout_ms: u64,
    /// Compiled grammars kept per model (least recently used goes first).
    pub grammar_cache_entries: usize,
    /// Most inputs in one `/v1/embeddings` request (each input is limited to the model's
    /// `max_seq_len` tokens).
    pub max_embedding_inputs: usize,
    /// Largest body of a KServe v2 `infer` request (tensors and images are bigger than prompts).
    pub max_tensor_body_bytes: usize,
    /// Most elements one input tensor may hold (after image pre-processing).
    pub max_tensor_elements: usize,
    /// `/tokenize` and `/detokenize` requests worked on at once, server-wide (each takes a
    /// blocking thread while it tokenizes).
    pub tokenize_in_flight: usize,
    /// Those requests waiting for a place; beyond it they are refused at once (429
    /// `queue_full`), and one that waits longer than `tokenize_timeout_ms` gets 503.
    pub tokenize_waiting: usize,
    pub tokenize_timeout_ms: u64,
    /// A connection must send a request's headers within this long of starting to wait for
    /// them (new or kept alive); slower or silent connections are closed (crate::connections).
    pub header_read_timeout_ms: u64,
    /// A request's body must arrive whole within this long of its headers (a deadline, not an
    /// idle timer): 408 `request_timeout` after it.
    pub body_read_timeout_ms: u64,
    /// Most bytes the typed tensors of one KServe v2 request decode to, all inputs together
    /// (checked against the declared shapes before any buffer is made; a `BYTES` element
    /// counts its bytes and a 24-byte header). With the body limit it bounds what one request
    /// holds while it decodes: its body plus this.
    pub max_tensor_decoded_bytes: usize,
    /// How much lower (Linux niceness, 0–19) than the compute the threads run that do the work
    /// any client can make long before a model runs: `/tokenize` and the guard's judging
    /// (crate::lane). 0 runs them at the process's priority.
    pub background_nice: i32,
    /// A model name or version in a path that is refused (400 before the handler and its rate
    /// limit) is answered after this long, on a timer (crate::model_path). 0 answers at once.
    pub invalid_path_delay_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 4 << 20,
            max_tokens: 4096,
            default_max_tokens: 1024,
            max_n: 8,
            max_stop: 4,
            max_top_logprobs: 20,
            max_attention_entries: 131_072,
            max_reason_segments: 12,
            max_prompts: 16,
            max_grammar_bytes: 64 * 1024,
            grammar_compile_timeout_ms: 2000,
            grammar_cache_entries: 128,
            max_embedding_inputs: 2048,
            max_tensor_body_bytes: 100 << 20,
            max_tensor_elements: 64 << 20,
            tokenize_in_flight: 4,
            tokenize_waiting: 32,
            tokenize_timeout_ms: 5_000,
            header_read_timeout_ms: 10_000,
            body_read_timeout_ms: 60_000,
            max_tensor_decoded_bytes: 100 << 20,
            background_nice: 10,
            invalid_path_delay_ms: 200,
        }
    }
}

/// The KServe v2 / Open Inference Protocol gRPC endpoint (`inference.GRPCInferenceService`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcConfig {
    /// Serve gRPC at all.
    pub enabled: bool,
    /// Address of its own listener (beside the HTTP one).
    pub listen: SocketAddr,
    /// Largest message, received or sent (requests and responses carry whole tensors).
    pub max_message_bytes: usize,
    /// HTTP/2 keepalive: seconds between pings on an idle connection (0: no pings).
    pub keepalive_interval_s: u64,
    /// HTTP/2 keepalive: seconds to wait for a ping's answer before closing the connection.
    pub keepalive_timeout_s: u64,
    /// TCP keepalive probes after this many idle seconds (0: off).
    pub tcp_keepalive_s: u64,
    /// Concurrent HTTP/2 streams (calls) per connection.
    pub max_concurrent_streams: u32,
}

impl Default for GrpcConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            listen: SocketAddr::from(([127, 0, 0, 1], 8001)),
            max_message_bytes: 100 << 20,
            keepalive_interval_s: 60,
            keepalive_timeout_s: 20,
            tcp_keepalive_s: 60,
            max_concurrent_streams: 256,
        }
    }
}

/// `[tls]`: both front doors (HTTP and gRPC) serve TLS with rustls when `cert_file` and
/// `key_file` are given; the files are polled and a changed pair is taken for new connections
/// without a restart (docs/configuration.md#tls).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// The server's certificate chain (PEM, leaf first). None: no TLS.
    pub cert_file: Option<PathBuf>,
    /// Its private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: Option<PathBuf>,
    /// The CA (PEM, one or more certificates) that client certificates must chain to.
    pub client_ca_file: Option<PathBuf>,
    /// Client certificates: `off` (none asked), `optional` (one that is presented must chain to
    /// `client_ca_file`), `required` (a client without one is refused at the handshake).
    pub client_auth: ClientAuth,
    /// Seconds between checks of the files for change (0: read once, at start).
    pub reload_interval_s: u64,
    /// A connection's TLS handshake must finish within this (else it is closed).
    pub handshake_timeout_ms: u64,
    /// Handshakes in progress at once, per listener; more connections wait to be accepted.
    pub max_pending_handshakes: usize,
}

impl Default for TlsConfig {
    fn default() -> Self {
        Self {
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            client_auth: ClientAuth::Off,
            reload_interval_s: 5,
            handshake_timeout_ms: 10_000,
            max_pending_handshakes: 1024,
        }
    }
}

impl TlsConfig {
    /// Whether the front doors serve TLS.
    pub fn enabled(&self) -> bool {
        self.cert_file.is_some()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(ConfigError(
                "tls: cert_file and key_file go together (both, or neither for no TLS)".into(),
            ));
        }
        let asks_clients = self.client_auth != ClientAuth::Off;
        if !self.enabled() && (asks_clients || self.client_ca_file.is_some()) {
            return Err(ConfigError(
                "tls: client_auth and client_ca_file need cert_file and key_file (TLS is off without them)"
                    .into(),
            ));
        }
        if asks_clients && self.client_ca_file.is_none() {
            return Err(ConfigError(format!(
                "tls.client_auth = {:?} needs client_ca_file (the CA client certificates chain to)",
                self.client_auth.as_str()
            )));
        }
        if !asks_clients && self.client_ca_file.is_some() {
            return Err(ConfigError(
                "tls.client_ca_file is set but client_auth is \"off\": set client_auth to \"optional\" or \"required\""
                    .into(),
            ));
        }
        if self.handshake_timeout_ms == 0 || self.max_pending_handshakes == 0 {
            return Err(ConfigError(
                "tls.handshake_timeout_ms and tls.max_pending_handshakes must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// Whether TLS clients present certificates (`[tls] client_auth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ClientAuth {
    #[default]
    Off,
    Optional,
    Required,
}

impl ClientAuth {
    pub fn as_str(self) -> &'static str {
        match self {
            ClientAuth::Off => "off",
            ClientAuth::Optional => "optional",
            ClientAuth::Required => "required",
        }
    }
}

/// How tensor (ONNX) models run.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TensorConfig {
    /// `auto` (ONNX Runtime when its library loads, else tract), `tract` or `onnxruntime`.
    pub backend: classic::BackendChoice,
    /// The ONNX Runtime shared library; `ORT_DYLIB_PATH` or a Python `onnxruntime` package
    /// otherwise.
    pub onnxruntime_library: Option<PathBuf>,
    /// Intra-op threads of each ONNX Runtime session (0: one; instances run in parallel).
    pub threads: usize,
}

/// The record bus (docs/configuration.md, `[records]`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecordsConfig {
    /// Records each lossy lane (the log, the metrics) holds while its sink catches up; beyond
    /// it the newest records are dropped and counted in `rampart_record_dropped_total`.
    pub lane_capacity: usize,
}

impl Default for RecordsConfig {
    fn default() -> Self {
        Self {
            lane_capacity: 8192,
        }
    }
}

/// `[degradation]`: the controllers that steer each language model's limits.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DegradationConfig {
    pub enabled: bool,
    /// How often each controller judges (milliseconds).
    pub window_ms: u64,
    /// Memory share (of `[memory] limit`) where the batch starts to shrink.
    pub scaling: f64,
    /// Memory (or KV pool) share where new prefills stop and admission sheds.
    pub saturation: f64,
    /// Memory PSI `some avg10` (percent) that counts as reaching the scaling watermark.
    pub psi_some_avg10: f64,
    /// Windows of latency samples the p99s look at.
    pub horizon_windows: u64,
    /// While new prefills are stopped (saturation), how long (milliseconds) a request that
    /// has not started may wait, from its arrival or the saturation's onset, before it is
    /// refused with 429 `shedding` and `Retry-After`; 0: it waits for the saturation to end
    /// (and may reach the model's `first_token_timeout_ms`).
    pub saturation_wait_ms: u64,
}

impl Default for DegradationConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            window_ms: 1000,
            scaling: 0.80,
            saturation: 0.95,
            psi_some_avg10: 10.0,
            horizon_windows: 10,
            saturation_wait_ms: 2000,
        }
    }
}

/// `[memory]`: the limit memory is measured against.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryConfig {
    /// Bytes (`6GiB`) the process's resident memory is measured against, or a fraction
    /// (`0.9`) of the cgroup's limit (or of the host's memory when there is none). None: the
    /// cgroup's limit when one is set, else the host's memory.
    pub limit: Option<String>,
    /// The memory the loaded models may take together (weights plus KV pools): bytes
    /// (`8GiB`) or a fraction of the cgroup's limit or the host's memory. Loading a model
    /// beyond it evicts the least recently used idle `residency = "cold"` models first; none:
    /// no budget (docs/model-repository.md, "Many models, one memory budget").
    pub models_budget: Option<String>,
}

/// `[models.slo]`: the latency objectives the degradation controller keeps.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SloConfig {
    /// Time to first token, p99 (milliseconds); none (the default): admission is not
    /// steered by latency (refusing requests is a choice an operator makes).
    pub ttft_p99_ms: Option<u64>,
    /// Inter-token latency, p99 (milliseconds); none: the prefill budget is not steered.
    pub itl_p99_ms: Option<u64>,
}

impl Default for SloConfig {
    fn default() -> Self {
        Self {
            ttft_p99_ms: None,
            itl_p99_ms: Some(500),
        }
    }
}

/// `batch_degrade_threshold = { p99_latency_ms = 1200, batch_size = 32 }`: above the batch
/// size and the request latency p99, `max_num_seqs` drops to the batch size.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchDegradeThreshold {
    pub p99_latency_ms: u64,
    pub batch_size: usize,
}

/// Host and GPU telemetry, read at each scrape of `/metrics`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Export the process, cgroup, PSI, memory and GPU metrics.
    pub enabled: bool,
    /// Where the host's `/proc` and `/sys` are read: `/`, or a fixture tree in tests.
    pub root: PathBuf,
    /// Open NVML (at run time) for the GPU metrics; absent library → no GPU metrics.
    pub gpu: bool,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            root: PathBuf::from("/"),
            gpu: true,
        }
    }
}

/// Where and how the structured log goes.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Log {
    /// `json` (one object per line) or `text`.
    pub format: LogFormat,
    /// Append to this file instead of stdout.
    pub file: Option<PathBuf>,
    /// `tracing` filter (`info`, `rampart=debug,…`); `RUST_LOG` overrides.
    pub level: String,
}

impl Default for Log {
    fn default() -> Self {
        Self {
            format: LogFormat::Json,
            file: None,
            level: "info".into(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Json,
    Text,
}

/// `[tracing]`: OpenTelemetry traces, one per request, exported over OTLP. Off by default: then
/// no exporter exists and records keep no timeline.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TracingConfig {
    pub enabled: bool,
    /// The collector: `http://host:4317` for gRPC, the full URL (`http://host:4318/v1/traces`)
    /// for HTTP. Empty: the protocol's usual local address. Plain `http://` only (no TLS).
    pub endpoint: String,
    /// `grpc` (OTLP/gRPC) or `http` (OTLP/HTTP with protobuf bodies).
    pub protocol: TraceProtocol,
    /// Sent with every export (gRPC metadata or HTTP headers): an API key for the collector.
    pub headers: std::collections::BTreeMap<String, String>,
    /// Share of the traces the server starts that are kept (0 to 1). Parent-based: a request
    /// whose `traceparent` says sampled (or not) is kept (or not) whatever the ratio.
    pub sampling_ratio: f64,
    /// The resource's `service.name`.
    pub service_name: String,
    /// The resource's `service.instance.id`. Empty: the replica's id (`[fleet] replica`, the
    /// pod name by default).
    pub service_instance_id: String,
    /// Which GenAI semantic conventions the attribute names follow (`1.36`: `gen_ai.system`;
    /// `1.37` and later: `gen_ai.provider.name`, and `gen_ai.usage.cache_read.input_tokens`).
    pub semconv_version: String,
    /// Put the prompt and the answer on the server span (`gen_ai.input.messages`,
    /// `gen_ai.output.messages`). Off: neither leaves the server in a trace.
    pub capture_content: bool,
    /// Fraction of generated tokens that become events on the decode span (0 to 1; token text,
    /// logprob when asked for, entropy).
    pub token_events: f64,
    /// Longest wait for one export; the batch is dropped (counted) past it.
    pub export_timeout_ms: u64,
    /// Requests' records waiting for the exporter; beyond it they are dropped, counted.
    pub queue_capacity: usize,
    /// Most requests' spans sent in one export.
    pub max_batch: usize,
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            endpoint: String::new(),
            protocol: TraceProtocol::Grpc,
            headers: Default::default(),
            sampling_ratio: 1.0,
            service_name: "rampart".into(),
            service_instance_id: String::new(),
            semconv_version: SEMCONV_VERSIONS[SEMCONV_VERSIONS.len() - 1].into(),
            capture_content: false,
            token_events: 0.0,
            export_timeout_ms: 5000,
            queue_capacity: 2048,
            max_batch: 64,
        }
    }
}

/// The GenAI semantic-convention versions whose names the traces can follow (oldest first; the
/// default is the last).
pub const SEMCONV_VERSIONS: &[&str] = &["1.36", "1.37", "1.38"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceProtocol {
    Grpc,
    Http,
}

impl TracingConfig {
    /// The endpoint exports go to (the protocol's local default when none is given).
    pub fn resolved_endpoint(&self) -> String {
        if !self.endpoint.is_empty() {
            return self.endpoint.clone();
        }
        match self.protocol {
            TraceProtocol::Grpc => "http://127.0.0.1:4317".into(),
            TraceProtocol::Http => "http://127.0.0.1:4318/v1/traces".into(),
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let fraction = |name: &str, v: f64| {
            if (0.0..=1.0).contains(&v) {
                Ok(())
            } else {
                Err(ConfigError(format!(
                    "tracing.{name} = {v}: a fraction from 0 to 1"
                )))
            }
        };
        fraction("sampling_ratio", self.sampling_ratio)?;
        fraction("token_events", self.token_events)?;
        if !SEMCONV_VERSIONS.contains(&self.semconv_version.as_str()) {
            return Err(ConfigError(format!(
                "tracing.semconv_version = {:?}: one of {}",
                self.semconv_version,
                SEMCONV_VERSIONS.join(", ")
            )));
        }
        if !self.enabled {
            return Ok(());
        }
        let endpoint = self.resolved_endpoint();
        // The exporters are built without TLS (no TLS stack in the binary): a collector beyond
        // the host is reached through a local collector or sidecar.
        if endpoint.starts_with("https://") {
            return Err(ConfigError(format!(
                "tracing.endpoint = {endpoint:?}: TLS to the collector is not built in; export \
                 to a local OpenTelemetry Collector (http://) and let it forward over TLS"
            )));
        }
        if !endpoint.starts_with("http://") || endpoint.parse::<axum::http::Uri>().is_err() {
            return Err(ConfigError(format!(
                "tracing.endpoint = {endpoint:?}: an http:// URL"
            )));
        }
        for (name, value) in &self.headers {
            if axum::http::HeaderName::from_bytes(name.as_bytes()).is_err()
                || axum::http::HeaderValue::from_str(value).is_err()
                || name.chars().any(|c| c.is_ascii_uppercase())
            {
                return Err(ConfigError(format!(
                    "tracing.headers.{name}: header names are lowercase tokens and values visible ASCII"
                )));
            }
        }
        if self.export_timeout_ms == 0 || self.queue_capacity == 0 || self.max_batch == 0 {
            return Err(ConfigError(
                "tracing.export_timeout_ms, queue_capacity and max_batch must be above 0".into(),
            ));
        }
        Ok(())
    }
}

/// Most tokens prompt lookup may guess per step (`[[models]] speculative_tokens`): each is a
/// row of the step, computed whether it is kept or not.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// The longest n-gram prompt lookup may match (`prompt_lookup_max`).
pub const MAX_PROMPT_LOOKUP: usize = 16;

/// One served model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Name in the repository (the model id in the API).
    pub name: String,
    /// Version to serve (default: the stable version: the release plan's, else the
    /// repository's alias).
    pub version: Option<String>,
    /// `hot` (default): loaded at start, never evicted. `cold`: loaded by its first request
    /// (or `POST /v2/repository/models/{name}/load`), evicted least recently used when
    /// `[memory] models_budget` needs room and no request runs on it.
    #[serde(default)]
    pub residency: Residency,
    /// Token-entropy band (nats): a request whose mean token entropy falls outside is flagged
    /// `abnormal` in its record.
    pub entropy_band: Option<[f32; 2]>,
    /// Most positions per sequence (default: the model's context, at most 4096).
    pub context: Option<usize>,
    /// KV pool size: bytes (`2GiB`) or a fraction of available memory (`0.2`).
    pub kv_cache_memory: Option<String>,
    /// `f32`, `f16` or `q8_0`.
    pub kv_cache_dtype: Option<String>,
    pub max_num_seqs: Option<usize>,
    pub max_num_batched_tokens: Option<usize>,
    /// Most prompt tokens per engine step, after every running stream's decode token (the
    /// degradation controller's ceiling for the prefill budget; default: the batch's).
    pub max_prefill_tokens: Option<usize>,
    /// Prompt lookup: most tokens guessed per step from earlier occurrences of a sequence's
    /// last tokens, verified in the same step (0 or none: off; docs/engine.md).
    pub speculative_tokens: Option<usize>,
    /// The longest and shortest n-grams prompt lookup matches (default 4 and 2).
    pub prompt_lookup_max: Option<usize>,
    pub prompt_lookup_min: Option<usize>,
    /// The latency objectives the degradation controller keeps.
    #[serde(default)]
    pub slo: SloConfig,
    /// The explicit batch rule, beside the controller's own decisions.
    pub batch_degrade_threshold: Option<BatchDegradeThreshold>,
    /// Quantize the weights at load: a type (`Q4_K`) or a plan file (docs/quantization.md).
    pub quantization: Option<String>,
    /// Where in-situ quantized weights are kept (default: ~/.cache/rampart/quantized).
    pub quantization_cache_dir: Option<PathBuf>,
    /// The fallback chain, tried in order when this model fails (docs/resilience.md).
    #[serde(default)]
    pub fallback: Vec<FallbackStep>,
    /// Longest wait for the first content token (tensors and embeddings: for the answer)
    /// after admission; beyond it the request falls back (or gets a 503).
    #[serde(default = "default_first_token_timeout_ms")]
    pub first_token_timeout_ms: u64,
    /// Longest gap between two events of a generation.
    #[serde(default = "default_stall_timeout_ms")]
    pub stall_timeout_ms: u64,
    /// A call slower than this (generations: to the first token) counts as failed for the
    /// breaker; none: latency is not judged.
    pub latency_objective_ms: Option<u64>,
    /// This model's hand-off, instead of the server's `[handoff]`.
    pub handoff: Option<HandoffConfig>,
    /// `/v1/completions` prompts may carry control tokens (raw templated prompts): off by
    /// default, so special-token texts in a prompt stay plain text, token-id prompts holding
    /// control ids (but a leading BOS) are refused, and a request's `parse_special_tokens: true`
    /// is refused. On: special-token texts become control tokens unless the request says
    /// `false`. Chat content is always plain text.
    #[serde(default)]
    pub parse_special_tokens: bool,
    /// This model's guard settings over the server's `[guard]`.
    #[serde(default)]
    pub guard: GuardOverride,
    /// The maturity level its versions need (docs/maturity.md): releases refuse a candidate
    /// below it, and a production server (`[maturity] production`) a stable below it.
    pub min_maturity: Option<release::maturity::Level>,
    /// Serve the stable version although it is below its level, for this reason (an
    /// emergency): logged and audited at every start.
    pub maturity_override: Option<String>,
    /// The tool-call format of a model whose chat template has none, or another than the one
    /// its template shows: `hermes`, `llama3`, `mistral`, `phi4-mini` or `smollm2`
    /// (docs/api.md, Tool calling). Unset: the template's format, and requests with tools to
    /// a template without one are refused.
    pub tool_format: Option<String>,
}

fn default_first_token_timeout_ms() -> u64 {
    60_000
}

fn default_stall_timeout_ms() -> u64 {
    30_000
}

impl ModelConfig {
    /// A model served with every default.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            version: None,
            residency: Residency::Hot,
            entropy_band: None,
            context: None,
            kv_cache_memory: None,
            kv_cache_dtype: None,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            max_prefill_tokens: None,
            speculative_tokens: None,
            prompt_lookup_max: None,
            prompt_lookup_min: None,
            slo: SloConfig::default(),
            batch_degrade_threshold: None,
            quantization: None,
            quantization_cache_dir: None,
            fallback: Vec::new(),
            first_token_timeout_ms: default_first_token_timeout_ms(),
            stall_timeout_ms: default_stall_timeout_ms(),
            latency_objective_ms: None,
            handoff: None,
            parse_special_tokens: false,
            guard: GuardOverride::default(),
            min_maturity: None,
            maturity_override: None,
            tool_format: None,
        }
    }
}

/// When a model is loaded, and whether it may be evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Residency {
    #[default]
    Hot,
    Cold,
}

/// A guard policy's values in range and its channels known.
fn validate_guard(o: &GuardOverride, at: &str) -> Result<(), ConfigError> {
    if let Some(t) = o.classifier_threshold {
        if !(0.0..=1.0).contains(&t) {
            return Err(ConfigError(format!(
                "{at}.classifier_threshold = {t}: a score from 0 to 1"
            )));
        }
    }
    for (channel, t) in &o.thresholds {
        if guard::Channel::parse(channel).is_none() {
            return Err(ConfigError(format!(
                "{at}.thresholds: unknown channel {channel:?} (user, assistant, system, tool, prompt)"
            )));
        }
        if !(0.0..=1.0).contains(t) {
            return Err(ConfigError(format!(
                "{at}.thresholds.{channel} = {t}: thresholds are scores from 0 to 1"
            )));
        }
    }
    Ok(())
}

impl ServerConfig {
    /// What the pipeline's front is made from.
    pub fn front_setup(&self) -> pipeline::front::FrontSetup {
        pipeline::front::FrontSetup {
            rate_limit: self.rate_limit.clone(),
            handoff: self.handoff.clone(),
            model_handoffs: self
                .models
                .iter()
                .filter_map(|m| m.handoff.clone().map(|h| (m.name.clone(), h)))
                .collect(),
            faults: self.faults.clone(),
            guard: self.guard_setup(),
            token_events: self.tracing.token_events,
        }
    }

    /// What the guard service is made from.
    pub fn guard_setup(&self) -> GuardSetup {
        GuardSetup {
            config: self.guard.clone(),
            models: self
                .models
                .iter()
                .map(|m| (m.name.clone(), m.guard.clone()))
                .collect(),
            background_nice: self.limits.background_nice,
            threads: self.threads,
        }
    }
}

/// A configuration problem, said plainly.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

impl ServerConfig {
    /// The `[[models]]` entry of `name`, if it has one.
    pub fn model(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }

    /// Reads a file (when given), then applies `RAMPART_*` environment overrides.
    pub fn load(path: Option<&Path>) -> Result<Self, ConfigError> {
        let mut config = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?;
                toml::from_str(&text)
                    .map_err(|e| ConfigError(format!("{}: {e}", path.display())))?
            }
            None => ServerConfig::default(),
        };
        config.apply_env(|key| std::env::var(key).ok())?;
        Ok(config)
    }

    /// Environment overrides (`RAMPART_LISTEN`, `RAMPART_REPO`, `RAMPART_API_KEYS_FILE`,
    /// `RAMPART_SHUTDOWN_TIMEOUT_S`, `RAMPART_LOG_FORMAT`, `RAMPART_MAX_IN_FLIGHT`,
    /// `RAMPART_MAX_WAITING`, `RAMPART_GRPC_LISTEN`, `RAMPART_GRPC_ENABLED`,
    /// `RAMPART_TLS_CERT_FILE`, `RAMPART_TLS_KEY_FILE`, `RAMPART_GUARD_CLASSIFIER`).
    pub fn apply_env(&mut self, get: impl Fn(&str) -> Option<String>) -> Result<(), ConfigError> {
        fn parse<T: std::str::FromStr>(key: &str, value: &str) -> Result<T, ConfigError>
        where
            T::Err: std::fmt::Display,
        {
            value
                .parse()
                .map_err(|e| ConfigError(format!("{key}={value:?}: {e}")))
        }
        if let Some(v) = get("RAMPART_LISTEN") {
            self.listen = parse("RAMPART_LISTEN", &v)?;
        }
        if let Some(v) = get("RAMPART_REPO") {
            self.repo = PathBuf::from(v);
        }
        if let Some(v) = get("RAMPART_API_KEYS_FILE") {
            self.api_keys_file = Some(PathBuf::from(v));
        }
        if let Some(v) = get("RAMPART_SHUTDOWN_TIMEOUT_S") {
            self.shutdown_timeout_s = parse("RAMPART_SHUTDOWN_TIMEOUT_S", &v)?;
        }
        if let Some(v) = get("RAMPART_DRAIN_DELAY_S") {
            self.drain_delay_s = parse("RAMPART_DRAIN_DELAY_S", &v)?;
        }
        if let Some(v) = get("RAMPART_MAX_IN_FLIGHT") {
            self.admission.max_in_flight = parse("RAMPART_MAX_IN_FLIGHT", &v)?;
        }
        if let Some(v) = get("RAMPART_MAX_WAITING") {
            self.admission.max_waiting = parse("RAMPART_MAX_WAITING", &v)?;
        }
        if let Some(v) = get("RAMPART_GRPC_LISTEN") {
            self.grpc.listen = parse("RAMPART_GRPC_LISTEN", &v)?;
        }
        if let Some(v) = get("RAMPART_GRPC_ENABLED") {
            self.grpc.enabled = parse("RAMPART_GRPC_ENABLED", &v)?;
        }
        if let Some(v) = get("RAMPART_TLS_CERT_FILE") {
            self.tls.cert_file = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some(v) = get("RAMPART_TLS_KEY_FILE") {
            self.tls.key_file = (!v.is_empty()).then(|| PathBuf::from(v));
        }
        if let Some(v) = get("RAMPART_GUARD_CLASSIFIER") {
            self.guard.classifier = (!v.is_empty()).then_some(v);
        }
        if let Some(v) = get("RAMPART_LOG_FORMAT") {
            self.log.format = match v.as_str() {
                "json" => LogFormat::Json,
                "text" => LogFormat::Text,
                other => {
                    return Err(ConfigError(format!(
                        "RAMPART_LOG_FORMAT={other:?}: json or text"
                    )))
                }
            };
        }
        Ok(())
    }

    /// Checks values that parse but make no sense.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.tracing.validate()?;
        if self.fleet.enabled && self.fleet.effective_url(&self.feedback).is_none() {
            return Err(ConfigError(
                "[fleet] enabled = true needs a database: fleet.postgres_url, \
                 RAMPART_FLEET_POSTGRES_URL, or the feedback store's feedback.postgres_url"
                    .into(),
            ));
        }
        if self.fleet.effective_url(&self.feedback).is_some() && !self.releases.enabled {
            return Err(ConfigError(
                "[fleet] shares the releases' state, but [releases] enabled = false".into(),
            ));
        }
        if self.fleet.lease_timeout_s == 0 {
            return Err(ConfigError(
                "fleet.lease_timeout_s = 0: at least 1 (a judge must keep its lease between two ticks)"
                    .into(),
            ));
        }
        self.audit
            .validate()
            .map_err(|e| ConfigError(e.to_string()))?;
        validate_guard(&self.guard.policy(), "guard")?;
        for (name, v) in [
            ("max_texts", self.guard.max_texts),
            ("max_bytes", self.guard.max_bytes),
            ("workers", self.guard.workers),
        ] {
            if v == 0 {
                return Err(ConfigError(format!(
                    "guard.{name} = 0: at least 1 (the guard needs room to judge anything)"
                )));
            }
        }
        self.monitor
            .drift
            .validate()
            .map_err(|e| ConfigError(format!("[monitor.drift]: {e}")))?;
        for (id, o) in &self.guard.keys {
            validate_guard(o, &format!("guard.keys.{id}"))?;
        }
        for m in &self.models {
            validate_guard(&m.guard, &format!("models.{}.guard", m.name))?;
            if m.maturity_override
                .as_deref()
                .is_some_and(|r| r.trim().is_empty())
            {
                return Err(ConfigError(format!(
                    "models.{}.maturity_override is empty: say why the model is served below its maturity level",
                    m.name
                )));
            }
        }
        if self
            .maturity
            .prometheus_url
            .as_deref()
            .is_some_and(|u| !(u.starts_with("http://") || u.starts_with("https://")))
        {
            return Err(ConfigError(
                "maturity.prometheus_url must be an http:// or https:// URL".into(),
            ));
        }
        if let Some(budget) = &self.memory.models_budget {
            budget.parse::<engine::KvMemory>().map_err(|e| {
                ConfigError(format!(
                    "memory.models_budget {budget:?}: {e} (bytes like \"8GiB\" or a fraction like \"0.5\")"
                ))
            })?;
        }
        if self.guard.segment_tokens < 8 || self.guard.max_segments == 0 {
            return Err(ConfigError(
                "guard.segment_tokens must be at least 8 and guard.max_segments at least 1".into(),
            ));
        }
        let l = &self.limits;
        if l.max_body_bytes < 1024 || l.max_tokens == 0 || l.max_n == 0 || l.max_prompts == 0 {
            return Err(ConfigError(
                "limits.max_body_bytes must be at least 1024 and max_tokens, max_n, max_prompts at least 1"
                    .into(),
            ));
        }
        if l.max_tensor_body_bytes < 1024 || l.max_tensor_decoded_bytes < 1024 {
            return Err(ConfigError(
                "limits.max_tensor_body_bytes and max_tensor_decoded_bytes must be at least 1024"
                    .into(),
            ));
        }
        if !(0..=19).contains(&l.background_nice) {
            return Err(ConfigError(format!(
                "limits.background_nice must be 0 to 19, not {}",
                l.background_nice
            )));
        }
        let d = &self.degradation;
        if d.window_ms < 100
            || !(0.0 < d.scaling && d.scaling < d.saturation && d.saturation <= 1.0)
            || d.horizon_windows == 0
        {
            return Err(ConfigError(
                "degradation: window_ms must be at least 100, 0 < scaling < saturation <= 1, horizon_windows at least 1"
                    .into(),
            ));
        }
        if let Some(limit) = &self.memory.limit {
            limit
                .parse::<engine::KvMemory>()
                .map_err(|e| ConfigError(format!("memory.limit: {e}")))?;
        }
        for m in &self.models {
            let lookup_min = m.prompt_lookup_min.unwrap_or(2);
            let lookup_max = m.prompt_lookup_max.unwrap_or(4);
            if m.speculative_tokens.unwrap_or(0) > MAX_SPECULATIVE_TOKENS
                || lookup_min == 0
                || lookup_max < lookup_min
                || lookup_max > MAX_PROMPT_LOOKUP
            {
                return Err(ConfigError(format!(
                    "models.{}: speculative_tokens is at most {MAX_SPECULATIVE_TOKENS}, and \
                     1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_PROMPT_LOOKUP}",
                    m.name
                )));
            }
            if m.max_prefill_tokens == Some(0)
                || m.slo.ttft_p99_ms == Some(0)
                || m.slo.itl_p99_ms == Some(0)
                || m.batch_degrade_threshold
                    .is_some_and(|t| t.batch_size == 0 || t.p99_latency_ms == 0)
            {
                return Err(ConfigError(format!(
                    "models.{}: max_prefill_tokens, slo objectives and batch_degrade_threshold values must be at least 1",
                    m.name
                )));
            }
        }
        if self.admission.max_in_flight == 0 {
            return Err(ConfigError(
                "admission.max_in_flight must be at least 1".into(),
            ));
        }
        if self.admission.reservations > 1_000_000 {
            return Err(ConfigError(format!(
                "admission.reservations = {}: at most 1000000 bookings per model",
                self.admission.reservations
            )));
        }
        for (tenant, weight) in &self.admission.weights {
            if !(weight.is_finite() && (0.01..=1000.0).contains(weight)) {
                return Err(ConfigError(format!(
                    "admission.weights.{tenant} = {weight}: a weight between 0.01 and 1000"
                )));
            }
        }
        let f = &self.feedback;
        if f.link_ttl_s == 0 || f.window_s == 0 || f.refresh_s == 0 || f.lane_capacity == 0 {
            return Err(ConfigError(
                "feedback.link_ttl_s, window_s, refresh_s and lane_capacity must be at least 1"
                    .into(),
            ));
        }
        if !(f.retrain.error_rate > 0.0 && f.retrain.error_rate < 1.0) {
            return Err(ConfigError(format!(
                "feedback.retrain.error_rate = {}: a rate between 0 and 1",
                f.retrain.error_rate
            )));
        }
        if f.nats.effective_url().is_some() {
            if !f.corrections_log {
                return Err(ConfigError(
                    "feedback.nats streams the correction log: feedback.corrections_log must be on"
                        .into(),
                ));
            }
            let token = |s: &str| {
                !s.is_empty()
                    && s.split('.').all(|t| {
                        !t.is_empty()
                            && !t.contains(|c: char| c.is_whitespace() || c == '*' || c == '>')
                    })
            };
            if !token(&f.nats.subject) {
                return Err(ConfigError(format!(
                    "feedback.nats.subject = {:?}: dot-separated tokens without spaces, `*` or `>`",
                    f.nats.subject
                )));
            }
            if f.nats.stream.is_empty()
                || f.nats.stream.contains(|c: char| {
                    c.is_whitespace() || matches!(c, '.' | '*' | '>' | '/' | '\\')
                })
            {
                return Err(ConfigError(format!(
                    "feedback.nats.stream = {:?}: a name without spaces, `.`, `*`, `>` or slashes",
                    f.nats.stream
                )));
            }
            if f.nats.max_in_flight == 0 {
                return Err(ConfigError(
                    "feedback.nats.max_in_flight must be at least 1".into(),
                ));
            }
        }
        for (model, rule) in &f.classes {
            feedback::ClassRule::parse(rule)
                .map_err(|e| ConfigError(format!("feedback.classes.{model}: {e}")))?;
        }
        self.tls.validate()?;
        if self.records.lane_capacity == 0 {
            return Err(ConfigError(
                "records.lane_capacity must be at least 1".into(),
            ));
        }
        if self.rate_limit.requests_per_second < 0.0 {
            return Err(ConfigError(
                "rate_limit.requests_per_second must not be negative".into(),
            ));
        }
        let g = &self.grpc;
        if g.max_message_bytes < 1024 || g.max_concurrent_streams == 0 || g.keepalive_timeout_s == 0
        {
            return Err(ConfigError(
                "grpc.max_message_bytes must be at least 1024 and max_concurrent_streams, keepalive_timeout_s at least 1"
                    .into(),
            ));
        }
        if g.enabled && g.listen == self.listen {
            return Err(ConfigError(format!(
                "grpc.listen and listen are both {}: gRPC needs its own port",
                self.listen
            )));
        }
        let b = &self.breaker;
        if b.consecutive_failures == 0
            || b.probes == 0
            || b.min_calls == 0
            || b.window_s == 0
            || b.readiness_failures == 0
            || b.readiness_interval_ms == 0
            || !(0.0..=1.0).contains(&b.failure_rate)
            || !(0.0..1.0).contains(&b.jitter)
        {
            return Err(ConfigError(
                "breaker: consecutive_failures, probes, min_calls, window_s, readiness_failures and readiness_interval_ms must be at least 1, failure_rate in [0, 1], jitter in [0, 1)"
                    .into(),
            ));
        }
        for m in &self.models {
            for (i, step) in m.fallback.iter().enumerate() {
                let targets = [
                    step.model.is_some(),
                    step.canned.is_some(),
                    step.tensor_backend.is_some(),
                ];
                if targets.iter().filter(|t| **t).count() != 1 {
                    return Err(ConfigError(format!(
                        "models.{}: fallback step {} needs exactly one of model, canned, tensor_backend",
                        m.name,
                        i + 1
                    )));
                }
                if !step.languages.is_empty() && step.canned.is_none() {
                    return Err(ConfigError(format!(
                        "models.{}: fallback step {}: languages belong to a canned answer",
                        m.name,
                        i + 1
                    )));
                }
                if step.on.as_ref().is_some_and(Vec::is_empty) {
                    return Err(ConfigError(format!(
                        "models.{}: fallback step {}: `on` lists no trigger",
                        m.name,
                        i + 1
                    )));
                }
                if step.model.as_deref().is_some_and(|target| {
                    let t = crate::registry::ModelName::parse(target);
                    t.name == m.name && (t.version.is_none() || t.version == m.version)
                }) {
                    return Err(ConfigError(format!(
                        "models.{}: fallback step {} names the model itself",
                        m.name,
                        i + 1
                    )));
                }
            }
            if m.first_token_timeout_ms == 0 || m.stall_timeout_ms == 0 {
                return Err(ConfigError(format!(
                    "models.{}: first_token_timeout_ms and stall_timeout_ms must be at least 1",
                    m.name
                )));
            }
            let handoff = m.handoff.as_ref().unwrap_or(&self.handoff);
            if handoff.enabled && (handoff.window_s == 0 || handoff.cooldown_s == 0) {
                return Err(ConfigError(format!(
                    "models.{}: handoff window_s and cooldown_s must be at least 1",
                    m.name
                )));
            }
            if let Some([lo, hi]) = m.entropy_band {
                if lo.is_nan() || hi.is_nan() || lo > hi {
                    return Err(ConfigError(format!(
                        "models.{}: entropy_band [{lo}, {hi}] is not a range",
                        m.name
                    )));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracing_is_off_by_default_and_checked_when_given() {
        let c = ServerConfig::default();
        assert!(!c.tracing.enabled);
        assert_eq!(c.tracing.semconv_version, "1.38");
        assert!(!c.tracing.capture_content);
        assert_eq!(c.tracing.token_events, 0.0);
        let text = r#"
            [tracing]
            enabled = true
            protocol = "http"
            sampling_ratio = 0.25
            token_events = 0.1
            headers = { "x-api-key" = "secret" }
        "#;
        let c: ServerConfig = toml::from_str(text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.tracing.protocol, TraceProtocol::Http);
        assert_eq!(
            c.tracing.resolved_endpoint(),
            "http://127.0.0.1:4318/v1/traces"
        );
        let grpc: ServerConfig = toml::from_str("[tracing]\nenabled = true\n").unwrap();
        assert_eq!(grpc.tracing.resolved_endpoint(), "http://127.0.0.1:4317");
        for bad in [
            "sampling_ratio = 1.5",
            "token_events = -0.1",
            "semconv_version = \"2.0\"",
            "endpoint = \"127.0.0.1:4317\"",
            "endpoint = \"https://collector:4317\"",
            "headers = { \"X-Key\" = \"v\" }",
            "headers = { \"x-key\" = \"a\\nb\" }",
            "max_batch = 0",
        ] {
            let c: ServerConfig =
                toml::from_str(&format!("[tracing]\nenabled = true\n{bad}\n")).unwrap();
            assert!(c.validate().is_err(), "{bad} should be refused");
        }
        let unknown = toml::from_str::<ServerConfig>("[tracing]\nendpont = \"x\"\n");
        assert!(unknown.is_err(), "unknown keys are refused");
        let protocol = toml::from_str::<ServerConfig>("[tracing]\nprotocol = \"udp\"\n");
        assert!(protocol.is_err());
    }

    #[test]
    fn degradation_memory_and_objectives_parse_and_are_checked() {
        let c = ServerConfig::default();
        assert!(c.degradation.enabled);
        assert_eq!(ModelConfig::named("m").slo.itl_p99_ms, Some(500));
        assert_eq!(ModelConfig::named("m").slo.ttft_p99_ms, None);
        let text = r#"
            [degradation]
            window_ms = 500
            [memory]
            limit = "6GiB"
            [[models]]
            name = "smollm2-135m"
            max_prefill_tokens = 64
            batch_degrade_threshold = { p99_latency_ms = 1200, batch_size = 32 }
            [models.slo]
            ttft_p99_ms = 800
        "#;
        let c: ServerConfig = toml::from_str(text).unwrap();
        c.validate().unwrap();
        let m = &c.models[0];
        assert_eq!(m.slo.ttft_p99_ms, Some(800));
        assert_eq!(m.slo.itl_p99_ms, Some(500), "unset fields keep defaults");
        assert_eq!(m.max_prefill_tokens, Some(64));
        assert_eq!(m.batch_degrade_threshold.unwrap().batch_size, 32);
        for bad in [
            "[degradation]\nscaling = 0.96\n",
            "[degradation]\nwindow_ms = 10\n",
            "[memory]\nlimit = \"lots\"\n",
            "[[models]]\nname = \"m\"\n[models.slo]\nttft_p99_ms = 0\n",
        ] {
            let c: ServerConfig = toml::from_str(bad).unwrap();
            assert!(c.validate().is_err(), "{bad}");
        }
    }

    #[test]
    fn files_and_environment_override_defaults() {
        let text = r#"
            listen = "0.0.0.0:9000"
            shutdown_timeout_s = 5
            [admission]
            max_in_flight = 2
            [[models]]
            name = "smollm2-135m"
            entropy_band = [0.5, 4.0]
        "#;
        let mut c: ServerConfig = toml::from_str(text).unwrap();
        assert_eq!(c.listen.port(), 9000);
        assert_eq!(c.admission.max_in_flight, 2);
        assert_eq!(c.admission.max_waiting, 128, "unset fields keep defaults");
        c.apply_env(|k| (k == "RAMPART_LISTEN").then(|| "127.0.0.1:7000".to_string()))
            .unwrap();
        assert_eq!(c.listen.port(), 7000);
        c.validate().unwrap();
        let err = toml::from_str::<ServerConfig>("listn = \"x\"").unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
        let bad = c.apply_env(|k| (k == "RAMPART_MAX_WAITING").then(|| "lots".to_string()));
        assert!(bad.is_err());
    }

    #[test]
    fn grpc_section_defaults_overrides_and_checks() {
        let mut c: ServerConfig = toml::from_str("[grpc]\nlisten = \"127.0.0.1:9001\"\n").unwrap();
        assert!(c.grpc.enabled);
        assert_eq!(c.grpc.listen.port(), 9001);
        assert_eq!(
            c.grpc.max_message_bytes,
            100 << 20,
            "unset fields keep defaults"
        );
        c.apply_env(|k| match k {
            "RAMPART_GRPC_LISTEN" => Some("127.0.0.1:9002".into()),
            "RAMPART_GRPC_ENABLED" => Some("false".into()),
            _ => None,
        })
        .unwrap();
        assert_eq!(c.grpc.listen.port(), 9002);
        assert!(!c.grpc.enabled);
        c.validate().unwrap();
        let mut same = ServerConfig::default();
        same.grpc.listen = same.listen;
        let err = same.validate().unwrap_err();
        assert!(err.to_string().contains("its own port"), "{err}");
        let err = toml::from_str::<ServerConfig>("[grpc]\nport = 1\n").unwrap_err();
        assert!(err.to_string().contains("unknown field"), "{err}");
    }

    #[test]
    fn chains_parse_as_documented_and_bad_steps_are_named() {
        let text = r#"
            [handoff]
            threshold = 50
            [[models]]
            name = "smollm2-135m"
            version = "2.0.0"
            first_token_timeout_ms = 3000
            fallback = [
              { model = "smollm2-135m@1.0.0" },
              { model = "support-tickets", on = ["error", "circuit_open", "context_length"] },
              { canned = "Please try again shortly.", languages = { zh = "请稍后再试。" } },
            ]
            [models.handoff]
            threshold = 200
            [[models]]
            name = "vision"
            fallback = [{ tensor_backend = "tract" }]
        "#;
        let c: ServerConfig = toml::from_str(text).unwrap();
        c.validate().unwrap();
        let m = &c.models[0];
        assert_eq!(m.fallback.len(), 3);
        assert_eq!(m.fallback[0].triggers(), Trigger::DEFAULT.to_vec());
        assert!(m.fallback[1].triggers().contains(&Trigger::ContextLength));
        assert_eq!(m.fallback[2].languages["zh"], "请稍后再试。");
        assert_eq!(m.handoff.as_ref().unwrap().threshold, 200);
        assert_eq!(m.stall_timeout_ms, 30_000, "unset: the default");
        assert_eq!(c.handoff.threshold, 50);
        assert_eq!(
            c.models[1].fallback[0].tensor_backend,
            Some(classic::BackendChoice::Tract)
        );
        for (bad, says) in [
            (r#"{ model = "a", canned = "b" }"#, "exactly one"),
            (r#"{ on = ["error"] }"#, "exactly one"),
            (r#"{ model = "m" }"#, "the model itself"),
            (r#"{ model = "b", on = [] }"#, "no trigger"),
            (r#"{ model = "b", languages = { zh = "x" } }"#, "canned"),
        ] {
            let c: ServerConfig =
                toml::from_str(&format!("[[models]]\nname = \"m\"\nfallback = [{bad}]\n")).unwrap();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
        let err = toml::from_str::<ServerConfig>(
            "[[models]]\nname = \"m\"\nfallback = [{ model = \"b\", on = [\"sometimes\"] }]\n",
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown variant"), "{err}");
    }

    #[test]
    fn tls_is_off_by_default_and_its_settings_are_checked() {
        let c = ServerConfig::default();
        assert!(!c.tls.enabled());
        assert_eq!(c.tls.client_auth, ClientAuth::Off);
        assert_eq!(c.tls.reload_interval_s, 5);
        c.validate().unwrap();
        let c: ServerConfig = toml::from_str(
            "[tls]\ncert_file = \"s.pem\"\nkey_file = \"k.pem\"\nclient_ca_file = \"ca.pem\"\nclient_auth = \"required\"\nreload_interval_s = 0\n",
        )
        .unwrap();
        c.validate().unwrap();
        assert!(c.tls.enabled());
        assert_eq!(c.tls.client_auth, ClientAuth::Required);
        for (bad, says) in [
            ("cert_file = \"s.pem\"", "go together"),
            ("key_file = \"k.pem\"", "go together"),
            (
                "client_auth = \"optional\"\nclient_ca_file = \"ca.pem\"",
                "need cert_file",
            ),
            (
                "cert_file = \"s.pem\"\nkey_file = \"k.pem\"\nclient_auth = \"required\"",
                "needs client_ca_file",
            ),
            (
                "cert_file = \"s.pem\"\nkey_file = \"k.pem\"\nclient_ca_file = \"ca.pem\"",
                "client_auth is \"off\"",
            ),
            (
                "cert_file = \"s.pem\"\nkey_file = \"k.pem\"\nhandshake_timeout_ms = 0",
                "at least 1",
            ),
            (
                "cert_file = \"s.pem\"\nkey_file = \"k.pem\"\nmax_pending_handshakes = 0",
                "at least 1",
            ),
        ] {
            let c: ServerConfig = toml::from_str(&format!("[tls]\n{bad}\n")).unwrap();
            let err = c.validate().unwrap_err().to_string();
            assert!(err.contains(says), "{bad}: {err}");
        }
        for unknown in ["client_auth = \"sometimes\"", "certificate = \"s.pem\""] {
            assert!(toml::from_str::<ServerConfig>(&format!("[tls]\n{unknown}\n")).is_err());
        }
        let mut c = ServerConfig::default();
        c.apply_env(|k| match k {
            "RAMPART_TLS_CERT_FILE" => Some("/run/tls/tls.crt".into()),
            "RAMPART_TLS_KEY_FILE" => Some("/run/tls/tls.key".into()),
            _ => None,
        })
        .unwrap();
        assert!(c.tls.enabled());
        assert_eq!(
            c.tls.key_file.as_deref(),
            Some(Path::new("/run/tls/tls.key"))
        );
    }
}
