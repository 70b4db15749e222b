//! What a doctor run is told about Rampart's own configuration. Everything is optional: a bare
//! [`Context`] judges the host alone and reports the Rampart checks as `unknown`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The inputs of [`crate::run`] and [`crate::fingerprint`].
///
/// `root` re-roots the host's files (`<root>/proc/...`, `<root>/sys/...`, `<root>/etc/...`);
/// Rampart's own directories and ports are the real ones either way (they are checked by
/// writing, fsyncing and binding), except that a directory under `root` is looked up in the
/// fixture's mount table by its path relative to `root`.
#[derive(Clone, Debug)]
pub struct Context {
    /// `/` on a real host; a fixture tree in tests (`rampart doctor --root DIR`).
    pub root: PathBuf,
    /// The model repository (`repo` in the server configuration).
    pub repository_dir: Option<PathBuf>,
    /// The caller's verification of the repository (digests of every version): `Ok(summary)`
    /// or `Err(reason)`. `None`: not verified, only checked for existence and readability.
    pub repository_verification: Option<Result<String, String>>,
    /// The audit log's directory (`[audit] dir`).
    pub audit_dir: Option<PathBuf>,
    /// A cache directory (quantization cache, downloads).
    pub cache_dir: Option<PathBuf>,
    /// The configured CPU threads for the kernels' pool (`threads`); `None`: sized by the
    /// server itself.
    pub threads: Option<usize>,
    /// KV cache memory the configured models reserve, summed.
    pub kv_memory_bytes: Option<u64>,
    /// `[grpc] max_message_bytes`, when gRPC is on.
    pub grpc_max_message_bytes: Option<u64>,
    /// Addresses Rampart will listen on, checked by binding them. Leave empty when the server
    /// already holds them (a doctor run from a serving process).
    pub ports: Vec<PortToCheck>,
    /// Health-probe timings of the deployment, if known.
    pub probes: Option<ProbeTimings>,
    /// ISA extensions the binary's kernels dispatch to, by Rust feature name (`avx2`, `fma`,
    /// `avx512f`, `avx512vnni`, `amx-tile`). Defaults to [`default_kernel_isa`].
    pub kernel_isa: Vec<String>,
    /// The CUDA version a GPU backend of this binary needs (`"12.4"`); `None`: judge the
    /// driver against the CUDA 12 baseline only.
    pub cuda_required: Option<String>,
    /// Sample PCIe links several times under a short GPU load (about a second and a CUDA
    /// context per GPU). Off by default, because the default run must stay under 300 ms.
    pub gpu_load_sample: bool,
    /// Samples and window of the GPU load sample.
    pub gpu_load_samples: u32,
    pub gpu_load_window: Duration,
}

impl Default for Context {
    fn default() -> Context {
        Context {
            root: PathBuf::from("/"),
            repository_dir: None,
            repository_verification: None,
            audit_dir: None,
            cache_dir: None,
            threads: None,
            kv_memory_bytes: None,
            grpc_max_message_bytes: None,
            ports: Vec::new(),
            probes: None,
            kernel_isa: default_kernel_isa(),
            cuda_required: None,
            gpu_load_sample: false,
            gpu_load_samples: 10,
            gpu_load_window: Duration::from_millis(1000),
        }
    }
}

impl Context {
    /// A bare context reading the host's files under `root`.
    pub fn at_root(root: impl AsRef<Path>) -> Context {
        Context {
            root: root.as_ref().to_path_buf(),
            ..Context::default()
        }
    }
}

/// The extensions `rampart-kernels` dispatches to today (`crates/kernels/src/x86.rs`: AVX2
/// with FMA and F16C; nothing wider). A caller that links other kernels passes their list.
pub fn default_kernel_isa() -> Vec<String> {
    if cfg!(target_arch = "x86_64") {
        ["avx2", "fma", "f16c"]
            .into_iter()
            .map(String::from)
            .collect()
    } else {
        Vec::new()
    }
}

/// One address to bind.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortToCheck {
    /// What listens there (`http`, `grpc`, `metrics`).
    pub name: String,
    pub addr: SocketAddr,
}

/// A deployment's probe settings (Kubernetes `livenessProbe`, `readinessProbe`,
/// `startupProbe`, `terminationGracePeriodSeconds`) and what Rampart needs, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProbeTimings {
    pub liveness_period_ms: Option<u64>,
    pub liveness_timeout_ms: Option<u64>,
    pub readiness_period_ms: Option<u64>,
    pub readiness_timeout_ms: Option<u64>,
    /// `failureThreshold × periodSeconds` of the startup probe: how long a start may take.
    pub startup_budget_ms: Option<u64>,
    pub termination_grace_ms: Option<u64>,
    /// How long the health endpoint takes to answer (measured, p99).
    pub health_check_ms: Option<u64>,
    /// How long loading the configured models takes (measured or estimated).
    pub model_load_ms: Option<u64>,
    /// The server's drain timeout (`shutdown_timeout_s`).
    pub shutdown_timeout_ms: Option<u64>,
}
