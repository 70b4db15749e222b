//! CPU: frequency policy, boost, SMT, the ISA the kernels use against what the CPU has,
//! thermal throttling, the cgroup's CPU quota, CPU pressure.

use super::{pressure_some_avg10, CheckSpec, Env};
use crate::cpuinfo::normalise_flag;
use crate::report::{Area, Check};
use std::collections::BTreeMap;

const GOVERNOR: CheckSpec = CheckSpec {
    id: "cpu.governor",
    area: Area::Cpu,
    reads: "/sys/devices/system/cpu/cpu*/cpufreq/scaling_governor",
    expected: "performance",
    why: "Frequency ramps of powersave or schedutil add latency to bursty decode steps. tuned's \
          throughput-performance, latency-performance and accelerator-performance profiles all \
          set governor=performance. Often absent in VMs (the host decides).",
};

const ENERGY_PREFERENCE: CheckSpec = CheckSpec {
    id: "cpu.energy_preference",
    area: Area::Cpu,
    reads: "/sys/devices/system/cpu/cpu*/cpufreq/energy_performance_preference",
    expected: "performance (balance_performance acceptable)",
    why: "With intel_pstate or amd-pstate in active mode the hardware picks frequencies by this \
          hint; power-leaning hints slow the CPU under load. tuned's throughput-performance sets \
          energy_perf_bias=performance.",
};

const BOOST: CheckSpec = CheckSpec {
    id: "cpu.boost",
    area: Area::Cpu,
    reads: "/sys/devices/system/cpu/cpufreq/boost, /sys/devices/system/cpu/intel_pstate/no_turbo",
    expected: "boost on",
    why: "Turbo/boost frequencies are a large share of single-thread and memory-bound speed. \
          tuned's accelerator-performance profile sets boost=1.",
};

const SMT: CheckSpec = CheckSpec {
    id: "cpu.smt",
    area: Area::Cpu,
    reads: "/sys/devices/system/cpu/smt/control, /proc/cpuinfo (core ids)",
    expected: "compute threads ≤ physical cores when SMT is on",
    why: "SMT siblings share one core's vector units and caches; matmul and attention kernels \
          gain little from a second thread per core and lose to contention, which is why \
          rampart-kernels (like llama.cpp) default to one thread per physical core.",
};

const ISA_AVX2: CheckSpec = CheckSpec {
    id: "cpu.isa_avx2",
    area: Area::Cpu,
    reads: "flags in /proc/cpuinfo; the kernels' ISA (Context.kernel_isa)",
    expected: "the CPU has every AVX2-family extension the kernels use (avx2, fma, f16c)",
    why: "The kernels dispatch at run time to the widest ISA both they and the CPU support; \
          without an extension they use, they run the scalar path, several times slower \
          (mistral.rs's doctor warns without AVX2 for the same reason).",
};

const ISA_AVX512: CheckSpec = CheckSpec {
    id: "cpu.isa_avx512",
    area: Area::Cpu,
    reads: "flags in /proc/cpuinfo; the kernels' ISA (Context.kernel_isa)",
    expected: "the CPU has every AVX-512 extension the kernels use",
    why: "AVX-512 doubles vector width over AVX2. Present on the CPU but unused by the kernels \
          is headroom, not a fault; used by the kernels but absent means a slower path.",
};

const ISA_VNNI: CheckSpec = CheckSpec {
    id: "cpu.isa_vnni",
    area: Area::Cpu,
    reads: "flags in /proc/cpuinfo (avx512_vnni, avx_vnni); the kernels' ISA",
    expected: "the CPU has the VNNI extensions the kernels use",
    why: "VNNI fuses the int8 multiply-add of quantized dot products into one instruction \
          (vpdpbusd); int8 kernels without it take three.",
};

const ISA_AMX: CheckSpec = CheckSpec {
    id: "cpu.isa_amx",
    area: Area::Cpu,
    reads: "flags in /proc/cpuinfo (amx_tile, amx_int8, amx_bf16); the kernels' ISA",
    expected: "the CPU has the AMX extensions the kernels use",
    why: "AMX tile units (Sapphire Rapids and later) multiply int8/bf16 matrices an order of \
          magnitude faster than AVX-512 for prompt processing; Linux needs the process to ask \
          for AMX state (arch_prctl), which the kernels do when they use it.",
};

const THROTTLE: CheckSpec = CheckSpec {
    id: "cpu.thermal_throttle",
    area: Area::Cpu,
    reads: "/sys/devices/system/cpu/cpu*/thermal_throttle/{core,package}_throttle_count",
    expected: "0 throttle events",
    why: "The CPU counts each time a core or package hit its thermal limit and slowed down; \
          a nonzero count means the host lost compute to heat since boot (Linux x86 \
          thermal_throttle interface). Absent on AMD and in most VMs.",
};

const CGROUP_QUOTA: CheckSpec = CheckSpec {
    id: "cpu.cgroup_quota",
    area: Area::Cpu,
    reads: "cpu.max (cgroup v2) or cpu.cfs_quota_us/cpu.cfs_period_us (v1); Context.threads",
    expected: "configured threads ≤ the CPU quota",
    why: "A container's CPU quota is enforced by CFS bandwidth control: more busy threads than \
          the quota get throttled for the rest of each 100 ms period, and a thread pool that \
          waits on its slowest thread stalls. Kernel doc scheduler/sched-bwc.rst.",
};

const PRESSURE: CheckSpec = CheckSpec {
    id: "cpu.pressure",
    area: Area::Cpu,
    reads: "/proc/pressure/cpu",
    expected: "some avg10 < 20 %",
    why: "The share of the last 10 s in which runnable tasks waited for a CPU: other work (or \
          a too large pool) is competing with the kernels. Kernel doc accounting/psi.rst.",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &GOVERNOR,
    &ENERGY_PREFERENCE,
    &BOOST,
    &SMT,
    &ISA_AVX2,
    &ISA_AVX512,
    &ISA_VNNI,
    &ISA_AMX,
    &THROTTLE,
    &CGROUP_QUOTA,
    &PRESSURE,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    vec![
        governor(env),
        energy_preference(env),
        boost(env),
        smt(env),
        isa(env, &ISA_AVX2, "AVX2", &["avx", "avx2", "fma", "f16c"]),
        isa(
            env,
            &ISA_AVX512,
            "AVX-512",
            &[
                "avx512f",
                "avx512bw",
                "avx512vl",
                "avx512dq",
                "avx512cd",
                "avx512bf16",
                "avx512fp16",
                "avx512vbmi",
            ],
        ),
        isa(env, &ISA_VNNI, "VNNI", &["avx512vnni", "avxvnni"]),
        isa(
            env,
            &ISA_AMX,
            "AMX",
            &["amxtile", "amxint8", "amxbf16", "amxfp16"],
        ),
        thermal_throttle(env),
        cgroup_quota(env),
        pressure(env),
    ]
}

/// Values of one per-CPU cpufreq file, counted: `{"performance": 62, "powersave": 2}`.
fn per_cpu_values(env: &Env, file: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for cpu in &env.cpu.online {
        if let Ok(v) = env
            .tree
            .value(&format!("/sys/devices/system/cpu/cpu{cpu}/cpufreq/{file}"))
        {
            *counts.entry(v).or_default() += 1;
        }
    }
    counts
}

fn describe_counts(counts: &BTreeMap<String, usize>) -> String {
    let total: usize = counts.values().sum();
    counts
        .iter()
        .map(|(v, n)| format!("{v} on {n} of {total} CPUs"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn governor(env: &Env) -> Check {
    let counts = per_cpu_values(env, "scaling_governor");
    if counts.is_empty() {
        return GOVERNOR.unknown(
            "not readable: /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor (no cpufreq driver: a VM, or frequency is managed by the platform)",
        );
    }
    let observed = describe_counts(&counts);
    if counts.keys().all(|g| g == "performance") {
        GOVERNOR.ok(observed)
    } else {
        GOVERNOR.warn(
            observed,
            "cpupower frequency-set -g performance\n# or for the whole profile: tuned-adm profile throughput-performance",
        )
    }
}

fn energy_preference(env: &Env) -> Check {
    let counts = per_cpu_values(env, "energy_performance_preference");
    if counts.is_empty() {
        return ENERGY_PREFERENCE.unknown(
            "not readable: /sys/devices/system/cpu/cpu*/cpufreq/energy_performance_preference (no intel_pstate/amd-pstate active mode)",
        );
    }
    let observed = describe_counts(&counts);
    if counts
        .keys()
        .all(|p| p == "performance" || p == "balance_performance" || p == "default")
    {
        ENERGY_PREFERENCE.ok(observed)
    } else {
        ENERGY_PREFERENCE.warn(
            observed,
            "for f in /sys/devices/system/cpu/cpu*/cpufreq/energy_performance_preference; do echo performance > \"$f\"; done",
        )
    }
}

fn boost(env: &Env) -> Check {
    let boost = "/sys/devices/system/cpu/cpufreq/boost";
    let no_turbo = "/sys/devices/system/cpu/intel_pstate/no_turbo";
    if let Ok(v) = env.tree.number(boost) {
        return if v == 1 {
            BOOST.ok(format!("{boost} = 1"))
        } else {
            BOOST.warn(format!("{boost} = {v}"), format!("echo 1 > {boost}"))
        };
    }
    match env.tree.number(no_turbo) {
        Ok(0) => BOOST.ok(format!("{no_turbo} = 0")),
        Ok(v) => BOOST.warn(format!("{no_turbo} = {v}"), format!("echo 0 > {no_turbo}")),
        Err(_) => BOOST.unknown(format!(
            "not readable: {boost} or {no_turbo} (no boost control exposed: a VM, or the platform decides)"
        )),
    }
}

fn smt(env: &Env) -> Check {
    let control = env.tree.value("/sys/devices/system/cpu/smt/control");
    let logical = env.cpu.logical_cpus().unwrap_or(0);
    let physical = env.cpu.physical_cores;
    let siblings = match physical {
        Some(p) if p > 0 && logical > p => Some(logical / p),
        _ => None,
    };
    let state = match (&control, siblings) {
        (Ok(c), _) => c.clone(),
        (Err(_), Some(_)) => "on (from core ids)".to_string(),
        (Err(e), None) if physical.is_none() => return SMT.unknown(e),
        (Err(_), None) => "off (one thread per core)".to_string(),
    };
    let topology = match physical {
        Some(p) => format!("{logical} CPUs on {p} physical cores"),
        None => format!("{logical} CPUs"),
    };
    let observed = format!("SMT {state}; {topology}");
    let smt_on = state.starts_with("on") && siblings.is_some();
    match (env.ctx.threads, physical) {
        (Some(threads), Some(cores)) if smt_on && threads > cores => SMT.warn(
            format!("{observed}; {threads} compute threads configured"),
            format!("# set threads = {cores} in the server configuration (one per physical core)"),
        ),
        _ => SMT.ok(observed),
    }
}

fn isa(env: &Env, spec: &CheckSpec, family: &str, members: &[&str]) -> Check {
    if env.cpu.flags.is_empty() {
        return spec.unknown("not readable: flags in /proc/cpuinfo");
    }
    let is_x86 = env.cpu.has("sse2") || env.cpu.has("avx") || env.cpu.has("lm");
    if !is_x86 {
        return spec.ok(format!("not an x86 CPU: no {family}"));
    }
    let used: Vec<&String> = env
        .ctx
        .kernel_isa
        .iter()
        .filter(|k| members.contains(&normalise_flag(k).as_str()))
        .collect();
    let cpu_has: Vec<&str> = members.iter().copied().filter(|m| env.cpu.has(m)).collect();
    let missing: Vec<&str> = used
        .iter()
        .filter(|u| !env.cpu.has(u))
        .map(|u| u.as_str())
        .collect();
    let list = |v: &[&str]| {
        if v.is_empty() {
            "none".to_string()
        } else {
            v.join(", ")
        }
    };
    let used_names: Vec<&str> = used.iter().map(|s| s.as_str()).collect();
    match (used.is_empty(), missing.is_empty()) {
        (false, false) => spec.warn(
            format!(
                "the kernels use {}; this CPU lacks {}: they run a slower path",
                list(&used_names),
                list(&missing)
            ),
            "# run on a CPU with these extensions, or accept the slower path",
        ),
        (false, true) => spec.ok(format!(
            "the kernels use {}; the CPU has them",
            list(&used_names)
        )),
        (true, _) if cpu_has.is_empty() => spec.ok(format!(
            "no {family} on this CPU; the kernels do not use it"
        )),
        (true, _) => spec.ok(format!(
            "the CPU has {} (the kernels do not use {family})",
            list(&cpu_has)
        )),
    }
}

fn thermal_throttle(env: &Env) -> Check {
    let mut core = 0u64;
    let mut package = 0u64;
    let mut read_any = false;
    for cpu in &env.cpu.online {
        let dir = format!("/sys/devices/system/cpu/cpu{cpu}/thermal_throttle");
        if let Ok(n) = env.tree.number(&format!("{dir}/core_throttle_count")) {
            core += n.max(0) as u64;
            read_any = true;
        }
        if let Ok(n) = env.tree.number(&format!("{dir}/package_throttle_count")) {
            // Every CPU of a package repeats its count: keep the largest.
            package = package.max(n.max(0) as u64);
            read_any = true;
        }
    }
    if !read_any {
        return THROTTLE.unknown(
            "not readable: /sys/devices/system/cpu/cpu*/thermal_throttle (not an Intel CPU, or a VM)",
        );
    }
    let observed = format!("core throttle events {core}, package {package} since boot");
    if core + package > 0 {
        THROTTLE.warn(
            observed,
            "# check cooling, fans and power limits; watch it live with: turbostat --show PkgTmp,CoreTmp,Bzy_MHz --interval 5",
        )
    } else {
        THROTTLE.ok(observed)
    }
}

fn cgroup_quota(env: &Env) -> Check {
    let quota = match &env.cgroup.cpu_quota {
        Err(e) => return CGROUP_QUOTA.unknown(e),
        Ok(None) => return CGROUP_QUOTA.ok("no CPU quota"),
        Ok(Some(q)) => *q,
    };
    let whole = quota.floor().max(1.0) as usize;
    let observed = format!("quota {quota:.2} CPUs");
    match env.ctx.threads {
        Some(threads) if threads as f64 > quota + 1e-9 => CGROUP_QUOTA.error(
            format!("{observed}; {threads} compute threads configured"),
            format!("# set threads = {whole} in the server configuration, or raise the container's CPU limit to {threads}\n# (Helm chart: --set resources.limits.cpu={threads} --set resources.requests.cpu={threads}; a whole-number limit sets threads)"),
        ),
        Some(threads) => CGROUP_QUOTA.ok(format!("{observed}; {threads} compute threads configured")),
        None => CGROUP_QUOTA.ok(format!(
            "{observed}; threads not set (the default honours the quota through available_parallelism)"
        )),
    }
}

fn pressure(env: &Env) -> Check {
    match pressure_some_avg10(env, "cpu") {
        Err(e) => PRESSURE.unknown(e),
        Ok(v) if v >= 20.0 => PRESSURE.warn(format!("some avg10 {v:.1} %"), "# see what competes for the CPUs: top -H; lower threads or move other work off the host"),
        Ok(v) => PRESSURE.ok(format!("some avg10 {v:.1} %")),
    }
}
