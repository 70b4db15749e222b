//! Memory policy: swap, swappiness, overcommit, huge pages, NUMA balancing, OOM kills,
//! pressure.

use super::{pressure_some_avg10, sysctl_fix, sysctl_number, CheckSpec, Env};
use crate::report::{Area, Check};
use crate::tree::human_bytes;

const SWAP: CheckSpec = CheckSpec {
    id: "memory.swap",
    area: Area::Memory,
    reads: "/proc/swaps, /proc/sys/vm/swappiness",
    expected: "no active swap, or swap kept for emergencies (vm.swappiness ≤ 1)",
    why: "Weights or KV cache paged out to swap turn a decoding step into disk reads: latency \
          grows by orders of magnitude instead of the process failing fast. The kubelet refuses \
          to start with swap on by default (failSwapOn) for the same reason.",
};

const SWAPPINESS: CheckSpec = CheckSpec {
    id: "memory.swappiness",
    area: Area::Memory,
    reads: "/proc/sys/vm/swappiness",
    expected: "1 on AI hosts (≤ 10 acceptable)",
    why: "How eagerly the kernel swaps anonymous memory (weights, KV cache) instead of dropping \
          page cache. tuned's throughput-performance and accelerator-performance profiles set \
          10; 1 keeps swap for emergencies only. Kernel doc admin-guide/sysctl/vm.rst \
          (swappiness).",
};

const OVERCOMMIT: CheckSpec = CheckSpec {
    id: "memory.overcommit_memory",
    area: Area::Memory,
    reads: "/proc/sys/vm/overcommit_memory, /proc/sys/vm/overcommit_ratio",
    expected: "0 (heuristic) or 1",
    why: "Mode 2 (strict) counts every writable private mapping against CommitLimit (swap plus \
          overcommit_ratio % of RAM, 50 % by default), so a large KV cache reservation fails \
          with ENOMEM while memory is free. Kernel doc mm/overcommit-accounting.rst.",
};

const THP: CheckSpec = CheckSpec {
    id: "memory.transparent_hugepages",
    area: Area::Memory,
    reads: "/sys/kernel/mm/transparent_hugepage/enabled",
    expected: "madvise (never also fine)",
    why: "`always` backs every large anonymous mapping with huge pages through khugepaged and \
          compaction, which adds latency spikes (tuned's network-latency profile sets never); \
          `madvise` lets the allocator ask for huge pages where they help. Kernel doc \
          admin-guide/mm/transhuge.rst.",
};

const THP_DEFRAG: CheckSpec = CheckSpec {
    id: "memory.thp_defrag",
    area: Area::Memory,
    reads: "/sys/kernel/mm/transparent_hugepage/defrag",
    expected: "madvise, defer, defer+madvise or never",
    why: "`always` makes an allocation that wants a huge page stall in direct compaction: a \
          request that allocates pays for defragmentation. Kernel doc \
          admin-guide/mm/transhuge.rst (defrag).",
};

const HUGEPAGES: CheckSpec = CheckSpec {
    id: "memory.hugepages",
    area: Area::Memory,
    reads: "HugePages_Total, HugePages_Free, Hugepagesize in /proc/meminfo",
    expected: "no large hugetlb pool left unused",
    why: "Pages reserved in the hugetlb pool are taken from general memory whether a process \
          uses them or not; Rampart allocates with malloc and mmap (transparent huge pages), \
          not hugetlbfs, so an unused pool is memory the KV cache cannot have. Kernel doc \
          admin-guide/mm/hugetlbpage.rst.",
};

const NUMA_BALANCING: CheckSpec = CheckSpec {
    id: "memory.numa_balancing",
    area: Area::Memory,
    reads: "/proc/sys/kernel/numa_balancing, /sys/devices/system/node",
    expected: "0 on hosts with more than one NUMA node",
    why: "Automatic NUMA balancing unmaps pages to sample accesses and migrates them, which \
          costs page faults in the hot loop. ggml warns when it is on (\"has been observed to \
          impair performance\"); tuned's network-latency profile sets kernel.numa_balancing=0.",
};

const OOM_KILLS: CheckSpec = CheckSpec {
    id: "memory.oom_kills",
    area: Area::Memory,
    reads:
        "oom_kill in /proc/vmstat and in the cgroup's memory.events (v2) or memory.oom_control (v1)",
    expected: "0",
    why: "The OOM killer ran: some process (perhaps an earlier server) died for want of memory. \
          Find it in the kernel log and size the KV cache and the limits so it does not recur. \
          Kernel doc admin-guide/cgroup-v2.rst (memory.events).",
};

const PRESSURE: CheckSpec = CheckSpec {
    id: "memory.pressure",
    area: Area::Memory,
    reads: "/proc/pressure/memory",
    expected: "some avg10 < 5 %",
    why: "Pressure stall information: the share of the last 10 s in which some task waited for \
          memory (reclaim, swap-in, thrashing). Sustained pressure slows every step. Kernel doc \
          accounting/psi.rst.",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &SWAP,
    &SWAPPINESS,
    &OVERCOMMIT,
    &THP,
    &THP_DEFRAG,
    &HUGEPAGES,
    &NUMA_BALANCING,
    &OOM_KILLS,
    &PRESSURE,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let swap = active_swap(env);
    let swappiness = sysctl_number(env, "vm.swappiness");
    vec![
        swap_check(&swap, &swappiness),
        swappiness_check(&swap, &swappiness),
        overcommit(env),
        thp(env),
        thp_defrag(env),
        hugepages(env),
        numa_balancing(env),
        oom_kills(env),
        pressure(env),
    ]
}

/// Active swap devices and their total size.
fn active_swap(env: &Env) -> Result<(usize, u64), crate::tree::Unreadable> {
    let text = env.tree.read("/proc/swaps")?;
    let mut devices = 0;
    let mut bytes = 0;
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() >= 3 {
            devices += 1;
            bytes += fields[2].parse::<u64>().unwrap_or(0) * 1024;
        }
    }
    Ok((devices, bytes))
}

fn swap_check(
    swap: &Result<(usize, u64), crate::tree::Unreadable>,
    swappiness: &Result<i64, crate::tree::Unreadable>,
) -> Check {
    match swap {
        Err(e) => SWAP.unknown(e),
        Ok((0, _)) => SWAP.ok("no swap active"),
        Ok((n, bytes)) => {
            let observed = format!("{n} swap device(s), {} active", human_bytes(*bytes));
            match swappiness {
                Ok(s) if *s <= 1 => SWAP.ok(format!("{observed}; vm.swappiness {s} keeps it for emergencies")),
                _ => SWAP.warn(
                    observed,
                    "swapoff -a\n# and comment out the swap lines in /etc/fstab (or keep swap and set vm.swappiness=1)",
                ),
            }
        }
    }
}

fn swappiness_check(
    swap: &Result<(usize, u64), crate::tree::Unreadable>,
    swappiness: &Result<i64, crate::tree::Unreadable>,
) -> Check {
    match swappiness {
        Err(e) => SWAPPINESS.unknown(e),
        Ok(s) if *s <= 10 => SWAPPINESS.ok(s.to_string()),
        Ok(s) => {
            if matches!(swap, Ok((0, _))) {
                SWAPPINESS.ok(format!("{s} (no swap active, so it has no effect)"))
            } else {
                SWAPPINESS.warn(s.to_string(), sysctl_fix("vm.swappiness", "1"))
            }
        }
    }
}

fn overcommit(env: &Env) -> Check {
    match sysctl_number(env, "vm.overcommit_memory") {
        Err(e) => OVERCOMMIT.unknown(e),
        Ok(2) => {
            let ratio = sysctl_number(env, "vm.overcommit_ratio")
                .map(|r| format!(", overcommit_ratio {r}"))
                .unwrap_or_default();
            OVERCOMMIT.warn(
                format!("2 (strict){ratio}"),
                sysctl_fix("vm.overcommit_memory", "0"),
            )
        }
        Ok(mode) => OVERCOMMIT.ok(mode.to_string()),
    }
}

/// The bracketed choice of a sysfs selector (`always [madvise] never`).
pub(crate) fn selected(text: &str) -> Option<String> {
    let start = text.find('[')?;
    let end = text[start..].find(']')? + start;
    Some(text[start + 1..end].to_string())
}

fn thp(env: &Env) -> Check {
    let path = "/sys/kernel/mm/transparent_hugepage/enabled";
    match env.tree.value(path) {
        Err(e) => THP.unknown(e),
        Ok(text) => match selected(&text).as_deref() {
            Some("always") => THP.warn(
                "always",
                format!("echo madvise > {path}\n# persist: add transparent_hugepage=madvise to the kernel command line"),
            ),
            Some(mode) => THP.ok(mode),
            None => THP.unknown(format!("unexpected content of {path}: {text:?}")),
        },
    }
}

fn thp_defrag(env: &Env) -> Check {
    let path = "/sys/kernel/mm/transparent_hugepage/defrag";
    match env.tree.value(path) {
        Err(e) => THP_DEFRAG.unknown(e),
        Ok(text) => match selected(&text).as_deref() {
            Some("always") => THP_DEFRAG.warn("always", format!("echo defer+madvise > {path}")),
            Some(mode) => THP_DEFRAG.ok(mode),
            None => THP_DEFRAG.unknown(format!("unexpected content of {path}: {text:?}")),
        },
    }
}

fn hugepages(env: &Env) -> Check {
    let (Ok(total), Ok(free)) = (
        env.meminfo_value("HugePages_Total"),
        env.meminfo_value("HugePages_Free"),
    ) else {
        return HUGEPAGES.unknown(
            env.meminfo_value("HugePages_Total")
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default(),
        );
    };
    if total == 0 {
        return HUGEPAGES.ok("no hugetlb pages reserved");
    }
    let size = env.meminfo_value("Hugepagesize").unwrap_or(2 << 20);
    let reserved = total.saturating_mul(size);
    let observed = format!(
        "{total} pages of {} reserved ({}), {free} free",
        human_bytes(size),
        human_bytes(reserved)
    );
    let memory = env.meminfo_value("MemTotal").unwrap_or(0);
    if free == total && memory > 0 && reserved.saturating_mul(20) > memory {
        HUGEPAGES.warn(
            format!("{observed}: all unused"),
            sysctl_fix("vm.nr_hugepages", "0")
                + "\n# (skip this if another service on the host maps hugetlbfs)",
        )
    } else {
        HUGEPAGES.ok(observed)
    }
}

fn numa_balancing(env: &Env) -> Check {
    let nodes = env.numa_nodes().map(|n| n.len()).unwrap_or(1);
    match sysctl_number(env, "kernel.numa_balancing") {
        Err(e) => NUMA_BALANCING.unknown(e),
        Ok(0) => NUMA_BALANCING.ok("0"),
        Ok(v) if nodes <= 1 => NUMA_BALANCING.ok(format!("{v} (one NUMA node: no effect)")),
        Ok(v) => NUMA_BALANCING.warn(
            format!("{v} on {nodes} NUMA nodes"),
            sysctl_fix("kernel.numa_balancing", "0"),
        ),
    }
}

fn oom_kills(env: &Env) -> Check {
    let since_boot = env.tree.read("/proc/vmstat").ok().and_then(|t| {
        t.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    });
    let in_cgroup = env.cgroup.oom_kills;
    let mut parts = Vec::new();
    if let Some(n) = since_boot {
        parts.push(format!("{n} since boot"));
    }
    if let Some(n) = in_cgroup {
        parts.push(format!("{n} in this cgroup"));
    }
    if parts.is_empty() {
        return OOM_KILLS
            .unknown("not readable: /proc/vmstat (oom_kill) and the cgroup's memory events");
    }
    let observed = parts.join(", ");
    if since_boot.unwrap_or(0) + in_cgroup.unwrap_or(0) > 0 {
        OOM_KILLS.warn(
            observed,
            "# find the victims and their size:\njournalctl -k | grep -iE 'out of memory|oom-kill'",
        )
    } else {
        OOM_KILLS.ok(observed)
    }
}

fn pressure(env: &Env) -> Check {
    match pressure_some_avg10(env, "memory") {
        Err(e) => PRESSURE.unknown(e),
        Ok(v) if v >= 5.0 => PRESSURE.warn(format!("some avg10 {v:.1} %"), "# see what reclaims or swaps: vmstat 1, and the largest processes: ps aux --sort=-rss | head; lower the KV cache or move other services off the host"),
        Ok(v) => PRESSURE.ok(format!("some avg10 {v:.1} %")),
    }
}
