//! Limits: open files, locked memory, memory maps, the cgroup version and its memory limit
//! against the configured KV cache.

use super::{sysctl_fix, sysctl_number, CheckSpec, Env};
use crate::cgroup::CgroupVersion;
use crate::report::{Area, Check};
use crate::tree::human_bytes;

const OPEN_FILES: CheckSpec = CheckSpec {
    id: "limits.open_files",
    area: Area::Limits,
    reads: "Max open files in /proc/self/limits",
    expected: "soft limit ≥ 16384 (65536 recommended)",
    why: "Every client connection, model file and audit segment is a file descriptor; at the \
          limit accept() fails with EMFILE and clients see resets. Many shells still start with \
          a soft limit of 1024, and Rust programs do not raise it themselves. man 2 getrlimit.",
};

const LOCKED_MEMORY: CheckSpec = CheckSpec {
    id: "limits.locked_memory",
    area: Area::Limits,
    reads: "Max locked memory in /proc/self/limits",
    expected: "unlimited (or ≥ 64 MiB) on GPU hosts",
    why: "Page-locked (pinned) host buffers make host-to-GPU copies fast and count against \
          RLIMIT_MEMLOCK when a program locks them itself (mlock, io_uring buffers); the usual \
          default is 8 MiB. man 2 mlock.",
};

const MAX_MAP_COUNT: CheckSpec = CheckSpec {
    id: "limits.max_map_count",
    area: Area::Limits,
    reads: "/proc/sys/vm/max_map_count",
    expected: "≥ 65530 (the default; 262144 for hosts with many models)",
    why: "Each mmap of a model file and each allocator arena is a mapping; at the limit mmap and \
          malloc fail with ENOMEM while memory is free. Kernel doc admin-guide/sysctl/vm.rst.",
};

const CGROUP_VERSION: CheckSpec = CheckSpec {
    id: "limits.cgroup_version",
    area: Area::Limits,
    reads: "/proc/self/cgroup, /proc/self/mountinfo",
    expected: "cgroup v2",
    why: "Rampart's limit checks (memory, CPU quota, PSI per cgroup) read v2 first; v1 accounts \
          page cache differently, so its memory limit is less exact. Kubernetes moved v1 \
          support to maintenance mode (1.31) and systemd 256+ refuses v1 by default.",
};

const CGROUP_MEMORY: CheckSpec = CheckSpec {
    id: "limits.cgroup_memory",
    area: Area::Limits,
    reads: "memory.max (cgroup v2) or memory.limit_in_bytes (v1), up the hierarchy; Context.kv_memory_bytes",
    expected: "KV cache memory ≤ 80 % of the cgroup's memory limit",
    why: "The KV cache is reserved up front; weights, activations and the process itself need \
          the rest of the limit. Past the limit the kernel's OOM killer ends the server, not the \
          request. Kernel doc admin-guide/cgroup-v2.rst (memory.max).",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &OPEN_FILES,
    &LOCKED_MEMORY,
    &MAX_MAP_COUNT,
    &CGROUP_VERSION,
    &CGROUP_MEMORY,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let limits = env.tree.read("/proc/self/limits");
    vec![
        open_files(limits.as_deref()),
        locked_memory(env, limits.as_deref()),
        max_map_count(env),
        cgroup_version(env),
        cgroup_memory(env),
    ]
}

/// (soft, hard) of one `/proc/self/limits` row; `None` is unlimited.
fn limit_row(text: &str, name: &str) -> Option<(Option<u64>, Option<u64>)> {
    let line = text.lines().find(|l| l.starts_with(name))?;
    let mut values = line[name.len()..].split_whitespace();
    let parse = |v: Option<&str>| -> Option<Option<u64>> {
        match v? {
            "unlimited" => Some(None),
            n => n.parse().ok().map(Some),
        }
    };
    Some((parse(values.next())?, parse(values.next())?))
}

fn show(limit: Option<u64>, bytes: bool) -> String {
    match (limit, bytes) {
        (None, _) => "unlimited".to_string(),
        (Some(v), true) => human_bytes(v),
        (Some(v), false) => v.to_string(),
    }
}

fn open_files(limits: Result<&str, &crate::tree::Unreadable>) -> Check {
    let text = match limits {
        Ok(t) => t,
        Err(e) => return OPEN_FILES.unknown(e),
    };
    let Some((soft, hard)) = limit_row(text, "Max open files") else {
        return OPEN_FILES.unknown("no `Max open files` row in /proc/self/limits");
    };
    let observed = format!("soft {}, hard {}", show(soft, false), show(hard, false));
    let fix = "ulimit -n 65536   # in the shell or script that starts the server\n# systemd unit: LimitNOFILE=65536; Docker: --ulimit nofile=65536:65536";
    match soft {
        Some(s) if s < 1024 => OPEN_FILES.error(observed, fix),
        Some(s) if s < 16_384 => OPEN_FILES.warn(observed, fix),
        _ => OPEN_FILES.ok(observed),
    }
}

fn locked_memory(env: &Env, limits: Result<&str, &crate::tree::Unreadable>) -> Check {
    let text = match limits {
        Ok(t) => t,
        Err(e) => return LOCKED_MEMORY.unknown(e),
    };
    let Some((soft, hard)) = limit_row(text, "Max locked memory") else {
        return LOCKED_MEMORY.unknown("no `Max locked memory` row in /proc/self/limits");
    };
    let observed = format!("soft {}, hard {}", show(soft, true), show(hard, true));
    match soft {
        Some(s) if s < 64 << 20 && env.gpus().present() => LOCKED_MEMORY.warn(
            format!("{observed} on a GPU host"),
            "ulimit -l unlimited   # in the shell or script that starts the server\n# systemd unit: LimitMEMLOCK=infinity; Docker: --ulimit memlock=-1",
        ),
        Some(s) if s < 64 << 20 => {
            LOCKED_MEMORY.ok(format!("{observed} (enough without a GPU: Rampart locks no memory on CPU)"))
        }
        _ => LOCKED_MEMORY.ok(observed),
    }
}

fn max_map_count(env: &Env) -> Check {
    match sysctl_number(env, "vm.max_map_count") {
        Err(e) => MAX_MAP_COUNT.unknown(e),
        Ok(v) if v >= 65_530 => MAX_MAP_COUNT.ok(v.to_string()),
        Ok(v) => MAX_MAP_COUNT.warn(v.to_string(), sysctl_fix("vm.max_map_count", "262144")),
    }
}

fn cgroup_version(env: &Env) -> Check {
    match &env.cgroup.version {
        Err(e) => CGROUP_VERSION.unknown(e),
        Ok(CgroupVersion::V2) => CGROUP_VERSION.ok("v2"),
        Ok(v) => CGROUP_VERSION.warn(
            v.name(),
            "# boot with systemd.unified_cgroup_hierarchy=1 cgroup_no_v1=all to use cgroup v2 (needs a reboot)",
        ),
    }
}

fn cgroup_memory(env: &Env) -> Check {
    let limit = match &env.cgroup.memory_limit_bytes {
        Err(e) => return CGROUP_MEMORY.unknown(e),
        Ok(l) => *l,
    };
    let kv = env.ctx.kv_memory_bytes;
    let kv_text = kv.map_or("no KV cache memory given".to_string(), |k| {
        format!("KV cache {}", human_bytes(k))
    });
    let Some(limit) = limit else {
        return CGROUP_MEMORY.ok(format!("no memory limit; {kv_text}"));
    };
    let used = env
        .cgroup
        .memory_current_bytes
        .map(|u| format!(", {} in use", human_bytes(u)))
        .unwrap_or_default();
    let observed = format!("limit {}{used}; {kv_text}", human_bytes(limit));
    let fix = "# lower the models' kv_cache_memory, or raise the container's memory limit\n# (Helm chart: resources.limits.memory and resources.requests.memory; memory.modelsBudgetFraction is the models' share of it)";
    match kv {
        Some(k) if k > limit => CGROUP_MEMORY.error(observed, fix),
        Some(k) if k as f64 > limit as f64 * 0.8 => CGROUP_MEMORY.warn(observed, fix),
        _ => CGROUP_MEMORY.ok(observed),
    }
}
