//! The server's configuration: one typed file (`rampart.toml` given with `--config`), every limit a
//! named setting with a default that serves one machine, environment variables over the file,
//! command-line flags over both. docs/configuration.md lists every setting.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

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
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are cancelled.
    pub shutdown_timeout_s: u64,
    /// Readiness fails when sequences are running and no token came for this many seconds.
    pub stall_timeout_s: u64,
    /// Compute threads per model (default: physical cores).
    pub threads: Option<usize>,
    pub limits: Limits,
    pub admission: Admission,
    pub rate_limit: RateLimit,
    pub log: Log,
    /// Tensor models: which backend runs ONNX graphs.
    pub tensor: TensorConfig,
    /// The KServe v2 gRPC endpoint.
    pub grpc: GrpcConfig,
    /// The record bus: the lanes that carry each request's record to its sinks.
    pub records: RecordsConfig,
    /// Models to serve; empty: the latest version of every LLM in the repository.
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
            shutdown_timeout_s: 30,
            stall_timeout_s: 60,
            threads: None,
            limits: Limits::default(),
            admission: Admission::default(),
            rate_limit: RateLimit::default(),
            log: Log::default(),
            tensor: TensorConfig::default(),
            grpc: GrpcConfig::default(),
            records: RecordsConfig::default(),
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
            max_prompts: 16,
            max_grammar_bytes: 64 * 1024,
            grammar_compile_timeout_ms: 2000,
            grammar_cache_entries: 128,
            max_embedding_inputs: 2048,
            max_tensor_body_bytes: 100 << 20,
            max_tensor_elements: 64 << 20,
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

/// Admission and load shedding, per model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admission {
    /// Requests handed to the engine at once.
    pub max_in_flight: usize,
    /// Requests waiting for one of those slots; beyond this, 429.
    pub max_waiting: usize,
    /// Longest wait for a slot; beyond this, 503.
    pub queue_timeout_ms: u64,
}

impl Default for Admission {
    fn default() -> Self {
        Self {
            max_in_flight: 64,
            max_waiting: 128,
            queue_timeout_ms: 30_000,
        }
    }
}

/// Per-key rate limits (token buckets); 0 turns a limit off.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RateLimit {
    pub requests_per_second: f64,
    /// Prompt plus generated tokens per minute.
    pub tokens_per_minute: u64,
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

/// One served model.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Name in the repository (the model id in the API).
    pub name: String,
    /// Version to serve (default: the latest).
    pub version: Option<String>,
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
    /// Quantize the weights at load: a type (`Q4_K`) or a plan file (docs/quantization.md).
    pub quantization: Option<String>,
    /// Where in-situ quantized weights are kept (default: ~/.cache/rampart/quantized).
    pub quantization_cache_dir: Option<PathBuf>,
}

/// A configuration problem, said plainly.
#[derive(Debug, thiserror::Error)]
#[error("configuration: {0}")]
pub struct ConfigError(pub String);

impl ServerConfig {
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
    /// `RAMPART_MAX_WAITING`, `RAMPART_GRPC_LISTEN`, `RAMPART_GRPC_ENABLED`).
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
        let l = &self.limits;
        if l.max_body_bytes < 1024 || l.max_tokens == 0 || l.max_n == 0 || l.max_prompts == 0 {
            return Err(ConfigError(
                "limits.max_body_bytes must be at least 1024 and max_tokens, max_n, max_prompts at least 1"
                    .into(),
            ));
        }
        if self.admission.max_in_flight == 0 {
            return Err(ConfigError(
                "admission.max_in_flight must be at least 1".into(),
            ));
        }
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
        for m in &self.models {
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
}
