//! `LINEAGE.json`: where a version came from and on what it was imported.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::RepoError;

/// File name of the lineage record in a version folder.
pub const LINEAGE_FILE: &str = "LINEAGE.json";

/// The build of rampart that imported a version (filled in by the binary at compile time).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildInfo {
    pub version: String,
    /// Git commit of the rampart source, when built from a checkout.
    pub git_commit: Option<String>,
    /// `rustc --version` of the compiler that built it.
    pub rustc: Option<String>,
}

/// One source file and its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

/// What was imported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    /// Absolute path of the file or folder given to `import`.
    pub path: String,
    /// `file` or `folder`.
    pub kind: String,
    /// sha256 of the file; for a folder, the digest of its file list (as a version digest).
    pub sha256: String,
    pub files: Vec<SourceFile>,
}

/// A GPU seen at import.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub name: String,
    pub driver: String,
    pub memory_mib: Option<u64>,
}

/// The host the import ran on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Environment {
    pub os: Option<String>,
    pub kernel: Option<String>,
    pub arch: String,
    pub cpu_model: Option<String>,
    pub logical_cpus: usize,
    /// The CPU's SIMD and crypto features that matter to inference kernels.
    pub cpu_flags: Vec<String>,
    pub memory_bytes: Option<u64>,
    pub gpus: Vec<Gpu>,
    pub cuda_version: Option<String>,
    /// The full hardware fingerprint ([`host::Fingerprint`]: CPU flags, GPU UUIDs, driver,
    /// VBIOS, PCIe topology), kept as JSON so that a fingerprint of a newer schema still
    /// reads; versions imported before it have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fingerprint: Option<serde_json::Value>,
}

/// The lineage record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lineage {
    pub lineage_version: u32,
    pub name: String,
    pub version: String,
    pub source: Source,
    /// `copy` or `hardlink`.
    pub import_mode: String,
    /// RFC 3339, UTC.
    pub imported_at: String,
    /// The OS user that ran the import.
    pub imported_by: Option<String>,
    pub rampart: BuildInfo,
    /// Commit of the training/export code, as given with `--git-commit`.
    pub git_commit: Option<String>,
    /// Dataset version, as given with `--dataset-version`.
    pub dataset_version: Option<String>,
    pub environment: Environment,
    /// How this version was made from another model (quantization), when it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub derived_from: Option<Derivation>,
}

/// The model a version was derived from and how.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Derivation {
    /// `name@version` in the repository, or the source file's path.
    pub model: String,
    /// sha256 of the source: its version digest when it came from the repository, else the file's.
    pub sha256: String,
    /// What was done: `quantize`.
    pub operation: String,
    /// The operation's parameters as given (for `quantize`: the plan, in TOML).
    pub parameters: String,
}

impl Lineage {
    pub fn write(&self, dir: &Path) -> Result<(), RepoError> {
        let path = dir.join(LINEAGE_FILE);
        let mut text = serde_json::to_string_pretty(self).map_err(|e| RepoError::Io {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        text.push('\n');
        std::fs::write(&path, text).map_err(RepoError::io(&path))
    }

    pub fn read(dir: &Path) -> Result<Self, RepoError> {
        let path = dir.join(LINEAGE_FILE);
        let text = std::fs::read_to_string(&path).map_err(RepoError::io(&path))?;
        serde_json::from_str(&text).map_err(|e| RepoError::BadManifest {
            path,
            reason: e.to_string(),
        })
    }
}

/// CPU flags worth recording: they decide which kernels run and how fast.
const INTERESTING_FLAGS: &[&str] = &[
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "bmi2",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512cd",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx512vbmi",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "sha_ni",
    "neon",
    "asimd",
    "asimddp",
    "sve",
    "sve2",
    "i8mm",
];

impl Environment {
    /// Reads the host's facts (the hardware fingerprint is the importer's to add: `host` is
    /// not a dependency of the repository). Missing sources (no `/proc`, no `nvidia-smi`) leave fields empty.
    pub fn snapshot() -> Self {
        let os = std::fs::read_to_string("/etc/os-release")
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix("PRETTY_NAME="))
                    .map(|v| v.trim_matches('"').to_string())
            });
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .ok()
            .map(|s| s.trim().to_string());
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim().to_string())
            })
        };
        let cpu_model = field("model name").or_else(|| field("Model"));
        let flags_line = field("flags")
            .or_else(|| field("Features"))
            .unwrap_or_default();
        let present: std::collections::HashSet<&str> = flags_line.split_whitespace().collect();
        let cpu_flags = INTERESTING_FLAGS
            .iter()
            .filter(|f| present.contains(*f))
            .map(|f| f.to_string())
            .collect();
        let memory_bytes = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|text| {
                text.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                    .map(|kib| kib * 1024)
            });
        let (gpus, cuda_version) = nvidia_gpus();
        Self {
            os,
            kernel,
            arch: std::env::consts::ARCH.to_string(),
            cpu_model,
            logical_cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_flags,
            memory_bytes,
            gpus,
            cuda_version,
            fingerprint: None,
        }
    }
}

/// Runs a command with a deadline; `None` if it is absent, fails or hangs (a wedged GPU driver
/// can make `nvidia-smi` block for minutes).
fn run_with_timeout(program: &str, args: &[&str], timeout: Duration) -> Option<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => {
                if !status.success() {
                    return None;
                }
                let mut out = String::new();
                std::io::Read::read_to_string(&mut child.stdout.take()?, &mut out).ok()?;
                return Some(out);
            }
            Ok(None) if start.elapsed() < timeout => std::thread::sleep(Duration::from_millis(20)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

fn nvidia_gpus() -> (Vec<Gpu>, Option<String>) {
    let timeout = Duration::from_secs(5);
    let Some(csv) = run_with_timeout(
        "nvidia-smi",
        &[
            "--query-gpu=name,driver_version,memory.total",
            "--format=csv,noheader,nounits",
        ],
        timeout,
    ) else {
        return (Vec::new(), None);
    };
    let gpus = csv
        .lines()
        .filter_map(|line| {
            let mut parts = line.split(',').map(str::trim);
            Some(Gpu {
                name: parts.next()?.to_string(),
                driver: parts.next()?.to_string(),
                memory_mib: parts.next().and_then(|m| m.parse().ok()),
            })
        })
        .collect();
    let cuda_version = run_with_timeout("nvidia-smi", &[], timeout).and_then(|text| {
        let at = text.find("CUDA Version:")?;
        text[at + "CUDA Version:".len()..]
            .split_whitespace()
            .next()
            .map(str::to_string)
    });
    (gpus, cuda_version)
}

/// The name of the user running this process: `$USER`, `$LOGNAME`, or the password-file entry of
/// the process's uid (containers often set neither variable).
pub fn current_user() -> Option<String> {
    if let Some(name) = ["USER", "LOGNAME"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
    {
        return Some(name);
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .to_string();
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut fields = line.split(':');
        let name = fields.next()?;
        (fields.nth(1)? == uid).then(|| name.to_string())
    })
}

/// The current time as RFC 3339 UTC, to the second.
pub fn now_rfc3339() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_reads_this_host() {
        let env = Environment::snapshot();
        assert!(env.logical_cpus >= 1);
        assert!(!env.arch.is_empty());
        if cfg!(target_os = "linux") {
            assert!(env.kernel.is_some());
            assert!(env.memory_bytes.unwrap_or(0) > 1 << 20);
        }
    }

    #[test]
    fn an_environment_without_a_fingerprint_still_reads() {
        // What versions imported before the fingerprint have.
        let old = r#"{"os": "Ubuntu", "kernel": "6.8.0", "arch": "x86_64", "cpu_model": null,
            "logical_cpus": 8, "cpu_flags": ["avx2"], "memory_bytes": 1024, "gpus": [],
            "cuda_version": null}"#;
        let env: Environment = serde_json::from_str(old).expect("old environments read");
        assert_eq!(env.fingerprint, None);
        assert!(!serde_json::to_string(&env).unwrap().contains("fingerprint"));
        // A fingerprint of a newer schema is kept, if not understood.
        let newer = old.replacen(
            '{',
            r#"{"fingerprint": {"schema_version": 99, "new": 1},"#,
            1,
        );
        let env: Environment = serde_json::from_str(&newer).expect("newer fingerprints read");
        assert!(env.fingerprint.is_some());
        assert!(host::Fingerprint::from_json(env.fingerprint.as_ref().unwrap()).is_none());
    }

    #[test]
    fn absent_programs_and_timeouts_give_none() {
        assert_eq!(
            run_with_timeout("rampart-no-such-program", &[], Duration::from_secs(1)),
            None
        );
        let started = Instant::now();
        assert_eq!(
            run_with_timeout("sleep", &["5"], Duration::from_millis(200)),
            None
        );
        assert!(started.elapsed() < Duration::from_secs(3));
        assert_eq!(
            run_with_timeout("echo", &["hi"], Duration::from_secs(5)).as_deref(),
            Some("hi\n")
        );
    }
}
