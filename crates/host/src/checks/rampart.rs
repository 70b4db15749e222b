//! Rampart itself: the KV cache fits, threads fit the cores, the repository is there (and
//! verified, when the caller verified it), the audit directory takes a durable write, the
//! ports are free, the gRPC message limit and the probe timings make sense.

use super::{CheckSpec, Env};
use crate::report::{Area, Check};
use crate::tree::{format_cpu_list, human_bytes};
use std::io::Write;
use std::path::Path;
use std::time::Instant;

const KV_MEMORY: CheckSpec = CheckSpec {
    id: "rampart.kv_memory",
    area: Area::Rampart,
    reads:
        "MemAvailable in /proc/meminfo; the cgroup's memory limit and use; Context.kv_memory_bytes",
    expected: "KV cache memory ≤ 80 % of what is available (memory and cgroup headroom)",
    why: "The KV pool is allocated when a model loads; weights (mapped from files, so in page \
          cache) and activations need the rest. A pool larger than what is available ends in \
          swap or the OOM killer instead of an admission error.",
};

const THREADS: CheckSpec = CheckSpec {
    id: "rampart.threads",
    area: Area::Rampart,
    reads: "Context.threads; online CPUs, cpuset and affinity (/proc/self/status), physical cores",
    expected: "threads ≤ the CPUs this process may use (≤ physical cores for best speed)",
    why: "The kernels' pool splits each step across its threads and waits for the slowest: more \
          threads than usable CPUs time-slice and stall every step. The default is one thread \
          per physical core (kernels::backend::physical_cores).",
};

const REPOSITORY: CheckSpec = CheckSpec {
    id: "rampart.repository",
    area: Area::Rampart,
    reads: "the repository directory (read_dir); the caller's verification result",
    expected: "exists, readable, and verifies (every version's digests match)",
    why: "The server refuses a version whose digests do not match (docs/model-repository.md); \
          finding that before serving beats a model that fails to load at start.",
};

const AUDIT_DIR: CheckSpec = CheckSpec {
    id: "rampart.audit_dir",
    area: Area::Rampart,
    reads: "a 4 KiB temporary file written, fsynced (file and directory) and removed in the audit directory (up to 3 tries, the fastest counts)",
    expected: "writable; fsync under 20 ms",
    why: "Audit entries are durable only after fsync; in fail-closed mode every answer waits for \
          one group commit, so a slow fsync is added to each request's latency, and an \
          unwritable directory means 503 for every request (docs/audit.md).",
};

const PORTS: CheckSpec = CheckSpec {
    id: "rampart.ports",
    area: Area::Rampart,
    reads: "bind() on each address of Context.ports (released at once)",
    expected: "every address free to bind",
    why: "A port already taken makes the server fail at start (or, behind SO_REUSEPORT, share \
          traffic with a stranger); ports below 1024 need CAP_NET_BIND_SERVICE.",
};

const GRPC_MESSAGE_LIMIT: CheckSpec = CheckSpec {
    id: "rampart.grpc_message_limit",
    area: Area::Rampart,
    reads: "Context.grpc_max_message_bytes ([grpc] max_message_bytes)",
    expected: "≥ 100 MiB (104857600, the default)",
    why: "KServe v2 tensor requests and responses travel as single gRPC messages; a batch of \
          images or embeddings beyond the limit fails with RESOURCE_EXHAUSTED. gRPC's own \
          default (4 MiB) is far too small for tensors (docs/configuration.md).",
};

const PROBE_TIMINGS: CheckSpec = CheckSpec {
    id: "rampart.probe_timings",
    area: Area::Rampart,
    reads: "Context.probes (the deployment's liveness, readiness and startup probes and grace period: the Helm chart's RAMPART_PROBE_* and RAMPART_TERMINATION_GRACE_S in the pod; the drain, drain_delay_s + shutdown_timeout_s; the model load, estimated from the served versions' bytes at 100 MiB/s + 5 s)",
    expected: "timeouts above the health check's time, periods ≥ timeouts, a startup budget above the model load time, a grace period above the drain timeout",
    why: "A liveness timeout shorter than the check restarts healthy pods; a startup budget \
          shorter than the model load kills the pod before it serves; a grace period shorter \
          than the drain cuts in-flight requests. Kubernetes docs, \"Configure Liveness, \
          Readiness and Startup Probes\".",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &KV_MEMORY,
    &THREADS,
    &REPOSITORY,
    &AUDIT_DIR,
    &PORTS,
    &GRPC_MESSAGE_LIMIT,
    &PROBE_TIMINGS,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let mut out = vec![
        kv_memory(env),
        threads(env),
        repository(env),
        audit_dir(env),
    ];
    out.extend(ports(env));
    out.push(grpc_message_limit(env));
    out.push(probe_timings(env));
    out
}

fn kv_memory(env: &Env) -> Check {
    let Some(kv) = env.ctx.kv_memory_bytes else {
        return KV_MEMORY.unknown("no KV cache memory given");
    };
    let available = env.meminfo_value("MemAvailable");
    let headroom = match (
        &env.cgroup.memory_limit_bytes,
        env.cgroup.memory_current_bytes,
    ) {
        (Ok(Some(limit)), current) => Some(limit.saturating_sub(current.unwrap_or(0))),
        _ => None,
    };
    let room = match (&available, headroom) {
        (Ok(a), Some(h)) => (*a).min(h),
        (Ok(a), None) => *a,
        (Err(_), Some(h)) => h,
        (Err(e), None) => return KV_MEMORY.unknown(e),
    };
    let mut parts = vec![format!("KV cache {}", human_bytes(kv))];
    if let Ok(a) = &available {
        parts.push(format!("{} available", human_bytes(*a)));
    }
    if let Some(h) = headroom {
        parts.push(format!("{} left under the cgroup limit", human_bytes(h)));
    }
    let observed = parts.join(", ");
    let fix = "# lower kv_cache_memory of the models (or serve fewer at once), or give the host/container more memory\n# (Helm chart: resources.limits.memory and resources.requests.memory)";
    if kv > room {
        KV_MEMORY.error(observed, fix)
    } else if kv as f64 > room as f64 * 0.8 {
        KV_MEMORY.warn(observed, fix)
    } else {
        KV_MEMORY.ok(observed)
    }
}

fn threads(env: &Env) -> Check {
    let usable = env.usable_cpus();
    let usable_count = if usable.is_empty() {
        env.cpu.logical_cpus().unwrap_or(0)
    } else {
        usable.len()
    };
    if usable_count == 0 {
        return THREADS.unknown(
            "not readable: the online CPUs (/sys/devices/system/cpu/online, /proc/cpuinfo)",
        );
    }
    let physical = if usable.is_empty() {
        env.cpu.physical_cores
    } else {
        env.cpu.cores_among(&usable)
    }
    .unwrap_or(usable_count)
    .min(usable_count);
    let quota = env.cgroup.cpu_quota.as_ref().ok().copied().flatten();
    let quota_text = quota
        .map(|q| format!(", quota {q:.2} CPUs"))
        .unwrap_or_default();
    let cpus = if usable.is_empty() {
        format!("{usable_count} CPUs")
    } else {
        format!("{usable_count} usable CPUs ({})", format_cpu_list(&usable))
    };
    let Some(threads) = env.ctx.threads else {
        return THREADS.ok(format!(
            "not set: the default is {physical} (physical cores); {cpus}{quota_text}"
        ));
    };
    let observed = format!("{threads} threads; {cpus} on {physical} physical cores{quota_text}");
    let limit = quota.map_or(usable_count, |q| {
        (q.floor() as usize).clamp(1, usable_count)
    });
    if threads > limit {
        THREADS.error(
            observed,
            format!(
                "# set threads = {} in the server configuration",
                physical.min(limit)
            ),
        )
    } else if threads > physical {
        THREADS.warn(
            observed,
            format!("# set threads = {physical} (one per physical core)"),
        )
    } else {
        THREADS.ok(observed)
    }
}

fn repository(env: &Env) -> Check {
    let Some(dir) = &env.ctx.repository_dir else {
        return REPOSITORY.unknown("no repository directory given");
    };
    let shown = dir.display();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries.count(),
        Err(e) => {
            return REPOSITORY.error(
                format!("{shown}: {}", crate::tree::io_reason(&e)),
                format!(
                    "mkdir -p {shown}   # or point `repo` in the configuration at the repository"
                ),
            )
        }
    };
    match &env.ctx.repository_verification {
        Some(Err(reason)) => REPOSITORY.error(
            format!("{shown}: verification failed: {reason}"),
            "rampart model verify   # lists each version whose digests do not match; re-import it",
        ),
        Some(Ok(summary)) => REPOSITORY.ok(format!("{shown}: verified ({summary})")),
        None => REPOSITORY.ok(format!(
            "{shown}: readable, {entries} entries (not verified by this run)"
        )),
    }
}

fn audit_dir(env: &Env) -> Check {
    let Some(dir) = &env.ctx.audit_dir else {
        return AUDIT_DIR.unknown("no audit directory given");
    };
    if !dir.exists() {
        let parent = crate::mounts::nearest_existing(dir);
        return if writable(&parent) {
            AUDIT_DIR.ok(format!(
                "{} does not exist yet; {} is writable, so serve can create it",
                dir.display(),
                parent.display()
            ))
        } else {
            AUDIT_DIR.error(
                format!(
                    "{} does not exist and {} is not writable",
                    dir.display(),
                    parent.display()
                ),
                format!(
                    "mkdir -p {} && chown <server user> {}",
                    dir.display(),
                    dir.display()
                ),
            )
        };
    }
    // One fsync is noisy (a neighbour's flush lands in it): up to three tries, judged on the
    // fastest, stopping at the first under the limit.
    let mut fastest = f64::INFINITY;
    let mut tries = 0;
    while tries < 3 && fastest > FSYNC_WARN_MS {
        tries += 1;
        match durable_write(dir) {
            Ok(ms) => fastest = fastest.min(ms),
            Err(e) => {
                return AUDIT_DIR.error(
                    format!("{}: {e}", dir.display()),
                    format!(
                        "chown <server user> {}   # and check the volume is mounted read-write",
                        dir.display()
                    ),
                )
            }
        }
    }
    let observed = match tries {
        1 => format!(
            "{}: write + fsync + remove in {fastest:.1} ms",
            dir.display()
        ),
        n => format!(
            "{}: write + fsync + remove in {fastest:.1} ms (fastest of {n})",
            dir.display()
        ),
    };
    if fastest > FSYNC_WARN_MS {
        AUDIT_DIR.warn(observed, "# put the audit log on a faster (local SSD/NVMe) volume, or accept the latency in fail_closed mode")
    } else {
        AUDIT_DIR.ok(observed)
    }
}

const FSYNC_WARN_MS: f64 = 20.0;

fn writable(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(path) = std::ffi::CString::new(dir.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `path` is NUL-terminated and lives across the call; access() only reads it.
    unsafe { libc::access(path.as_ptr(), libc::W_OK | libc::X_OK) == 0 }
}

/// Why the durable write test failed.
#[derive(Debug, thiserror::Error)]
enum DurableWriteError {
    #[error("write + fsync failed: {0}")]
    Write(#[source] std::io::Error),
    #[error("removing the test file failed: {0}")]
    Remove(#[source] std::io::Error),
}

/// Writes, fsyncs (file then directory) and removes a temporary file; the time it took.
fn durable_write(dir: &Path) -> Result<f64, DurableWriteError> {
    let name = format!(
        ".rampart-doctor-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0)
    );
    let path = dir.join(name);
    let start = Instant::now();
    let result = (|| -> std::io::Result<()> {
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        file.write_all(&[0u8; 4096])?;
        file.sync_all()?;
        std::fs::File::open(dir)?.sync_all()?;
        Ok(())
    })();
    let removed = std::fs::remove_file(&path);
    let elapsed = start.elapsed().as_secs_f64() * 1000.0;
    result.map_err(DurableWriteError::Write)?;
    removed.map_err(DurableWriteError::Remove)?;
    Ok(elapsed)
}

fn ports(env: &Env) -> Vec<Check> {
    if env.ctx.ports.is_empty() {
        return vec![PORTS.unknown("no ports given")];
    }
    env.ctx
        .ports
        .iter()
        .map(|port| {
            let check = match std::net::TcpListener::bind(port.addr) {
                Ok(listener) => {
                    drop(listener);
                    PORTS.ok(format!("{} free", port.addr))
                }
                Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => PORTS.error(
                    format!("{} in use", port.addr),
                    format!("ss -ltnp 'sport = :{}'   # shows who holds it; stop it or choose another port", port.addr.port()),
                ),
                Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => PORTS.error(
                    format!("{}: permission denied", port.addr),
                    "# ports below 1024 need CAP_NET_BIND_SERVICE: setcap cap_net_bind_service=+ep $(command -v rampart), or use a port ≥ 1024",
                ),
                Err(e) => PORTS.error(format!("{}: {e}", port.addr), ""),
            };
            check.on(port.name.clone())
        })
        .collect()
}

const MIN_GRPC_MESSAGE_BYTES: u64 = 100 << 20;

fn grpc_message_limit(env: &Env) -> Check {
    match env.ctx.grpc_max_message_bytes {
        None => GRPC_MESSAGE_LIMIT.unknown("no gRPC message limit given (gRPC off?)"),
        Some(b) if b >= MIN_GRPC_MESSAGE_BYTES => {
            GRPC_MESSAGE_LIMIT.ok(format!("{b} bytes ({})", human_bytes(b)))
        }
        Some(b) => GRPC_MESSAGE_LIMIT.warn(
            format!("{b} bytes ({})", human_bytes(b)),
            "# in the server configuration:\n# [grpc]\n# max_message_bytes = 104857600",
        ),
    }
}

fn probe_timings(env: &Env) -> Check {
    let Some(p) = &env.ctx.probes else {
        return PROBE_TIMINGS.unknown("no probe timings given");
    };
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let mut facts = Vec::new();
    for (kind, timeout, period) in [
        ("liveness", p.liveness_timeout_ms, p.liveness_period_ms),
        ("readiness", p.readiness_timeout_ms, p.readiness_period_ms),
    ] {
        if let Some(t) = timeout {
            facts.push(format!("{kind} timeout {t} ms"));
            if let Some(check) = p.health_check_ms {
                if t <= check {
                    errors.push(format!(
                        "{kind} timeout {t} ms ≤ the health check's {check} ms"
                    ));
                } else if t < check * 2 {
                    warnings.push(format!(
                        "{kind} timeout {t} ms leaves little margin over the check's {check} ms"
                    ));
                }
            }
            if let Some(period) = period {
                if period < t {
                    warnings.push(format!(
                        "{kind} period {period} ms < its timeout {t} ms (probes overlap)"
                    ));
                }
            }
        }
    }
    if let (Some(budget), Some(load)) = (p.startup_budget_ms, p.model_load_ms) {
        facts.push(format!("startup budget {budget} ms, model load {load} ms"));
        if budget <= load {
            errors.push(format!(
                "startup budget {budget} ms ≤ model load {load} ms: killed before serving"
            ));
        } else if (budget as f64) < load as f64 * 1.5 {
            warnings.push(format!(
                "startup budget {budget} ms is within 50 % of the model load {load} ms"
            ));
        }
    }
    if let (Some(grace), Some(drain)) = (p.termination_grace_ms, p.shutdown_timeout_ms) {
        facts.push(format!("grace {grace} ms, drain {drain} ms"));
        if grace <= drain {
            warnings.push(format!("termination grace {grace} ms ≤ drain timeout {drain} ms: in-flight requests are cut"));
        }
    }
    if facts.is_empty() {
        return PROBE_TIMINGS.unknown("probe timings given without values");
    }
    // The Helm chart's values (deploy/helm/rampart/values.yaml), as the pod echoes them.
    let mut sets = Vec::new();
    if let (Some(budget), Some(load)) = (p.startup_budget_ms, p.model_load_ms) {
        if (budget as f64) < load as f64 * 1.5 {
            sets.push(format!(
                "# startup budget (failureThreshold × periodSeconds) ≥ {} s, twice the model load:\n\
                 #   --set probes.startup.failureThreshold={}  (with probes.startup.periodSeconds=10)",
                (load * 2).div_ceil(1000),
                (load * 2).div_ceil(10_000)
            ));
        }
    }
    if let Some(check) = p.health_check_ms {
        for (kind, timeout) in [
            ("liveness", p.liveness_timeout_ms),
            ("readiness", p.readiness_timeout_ms),
        ] {
            if timeout.is_some_and(|t| t < check * 2) {
                sets.push(format!(
                    "#   --set probes.{kind}.timeoutSeconds={}",
                    (check * 2).div_ceil(1000).max(1)
                ));
            }
        }
    }
    if let (Some(grace), Some(drain)) = (p.termination_grace_ms, p.shutdown_timeout_ms) {
        if grace <= drain {
            sets.push(format!(
                "#   --set terminationGracePeriodSeconds={}  (drain_delay_s + shutdown_timeout_s + 10)",
                drain.div_ceil(1000) + 10
            ));
        }
    }
    let fix = format!(
        "# the Deployment's probes: with the Helm chart (deploy/helm/rampart), helm upgrade RELEASE deploy/helm/rampart --reuse-values with\n{}",
        if sets.is_empty() {
            "#   probes.liveness/readiness.timeoutSeconds and periodSeconds (period ≥ timeout)".to_string()
        } else {
            sets.join("\n")
        }
    );
    if !errors.is_empty() {
        errors.extend(warnings);
        PROBE_TIMINGS.error(errors.join("; "), fix)
    } else if !warnings.is_empty() {
        PROBE_TIMINGS.warn(warnings.join("; "), fix)
    } else {
        PROBE_TIMINGS.ok(facts.join(", "))
    }
}
