//! Kernel: its version, known-bad kernel/driver combinations, boot parameters, taint flags, the
//! clock source.

use super::{CheckSpec, Env};
use crate::known_issues::matching_issues;
use crate::report::{Area, Check, Status};
use crate::tree::{parse_version, version_cmp};

const VERSION: CheckSpec = CheckSpec {
    id: "kernel.version",
    area: Area::Kernel,
    reads: "/proc/sys/kernel/osrelease",
    expected: "≥ 5.10 (the oldest kernel.org longterm branch still maintained)",
    why: "Older kernels lack PSI (4.20), a complete cgroup v2 (5.x) and years of fixes; \
          kernel.org's longterm list is the reference. Vendor kernels (RHEL 8's 4.18) are \
          maintained by their vendor: judge those by the vendor's support dates.",
};

const KNOWN_ISSUES: CheckSpec = CheckSpec {
    id: "kernel.known_issues",
    area: Area::Kernel,
    reads: "/proc/sys/kernel/osrelease; the NVIDIA driver version; the shipped table (host::known_issues::KNOWN_ISSUES)",
    expected: "no known-bad kernel/driver combination",
    why: "Some kernel and NVIDIA driver combinations are known to break CUDA or the PCIe link; \
          each table row names its source (some rows are unverified examples and say so).",
};

const BOOT_PARAMETERS: CheckSpec = CheckSpec {
    id: "kernel.boot_parameters",
    area: Area::Kernel,
    reads: "/proc/cmdline",
    expected: "no parameters that hide memory or CPUs or force PCIe power saving",
    why: "mem=, maxcpus= and nr_cpus= hide hardware from the server; pcie_aspm=force puts GPU \
          and NVMe links into power-saving states; an IOMMU in translated mode slows GPU DMA \
          unless passthrough (iommu=pt) is set. Kernel doc admin-guide/kernel-parameters.txt.",
};

const TAINTED: CheckSpec = CheckSpec {
    id: "kernel.tainted",
    area: Area::Kernel,
    reads: "/proc/sys/kernel/tainted",
    expected: "no machine-check, bad-page, oops, warning or soft-lockup taint",
    why: "The kernel records serious events as taint flags: a machine check (M) or bad page (B) \
          points at failing hardware, an oops (D), warning (W) or soft lockup (L) at a kernel or \
          driver bug that may recur. Proprietary (P) and out-of-tree (O) modules, as NVIDIA's, \
          are expected. Kernel doc admin-guide/tainted-kernels.rst.",
};

const CLOCKSOURCE: CheckSpec = CheckSpec {
    id: "kernel.clocksource",
    area: Area::Kernel,
    reads: "/sys/devices/system/clocksource/clocksource0/current_clocksource",
    expected: "tsc (or a paravirtual clock in a VM: kvm-clock, hyperv_clocksource_tsc_page)",
    why: "hpet and acpi_pm make every clock read a slow device access; latency metrics and \
          timeouts read the clock on every token. The kernel falls back to them when it \
          distrusts the TSC. Kernel doc timers/timekeeping.rst.",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &VERSION,
    &KNOWN_ISSUES,
    &BOOT_PARAMETERS,
    &TAINTED,
    &CLOCKSOURCE,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let release = env.tree.value("/proc/sys/kernel/osrelease");
    vec![
        version(&release),
        known_issues(env, &release),
        boot_parameters(env),
        tainted(env),
        clocksource(env),
    ]
}

fn version(release: &Result<String, crate::tree::Unreadable>) -> Check {
    let release = match release {
        Ok(r) => r,
        Err(e) => return VERSION.unknown(e),
    };
    let parsed = parse_version(release);
    if parsed.is_empty() {
        return VERSION.unknown(format!("unexpected release {release:?}"));
    }
    if version_cmp(&parsed, &[5, 10]).is_lt() {
        VERSION.warn(
            release.clone(),
            "# move to a maintained longterm kernel (your distribution's current one), unless the vendor maintains this one",
        )
    } else {
        VERSION.ok(release.clone())
    }
}

fn known_issues(env: &Env, release: &Result<String, crate::tree::Unreadable>) -> Check {
    let release = match release {
        Ok(r) => r,
        Err(e) => return KNOWN_ISSUES.unknown(e),
    };
    let gpus = env.gpus();
    let driver = gpus.driver_version();
    let hits = matching_issues(release, driver.as_deref(), gpus.present());
    let against = match &driver {
        Some(d) => format!("kernel {release}, NVIDIA driver {d}"),
        None => format!("kernel {release}, no NVIDIA driver"),
    };
    if hits.is_empty() {
        return KNOWN_ISSUES.ok(format!("{against}: no entry of the table matches"));
    }
    let worst = hits.iter().map(|h| h.status).max().unwrap_or(Status::Warn);
    let observed = format!(
        "{against}: {}",
        hits.iter()
            .map(|h| format!("{} ({}; source: {})", h.id, h.summary, h.source))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let fix = hits
        .iter()
        .map(|h| format!("# {}: {}", h.id, h.fix))
        .collect::<Vec<_>>()
        .join("\n");
    KNOWN_ISSUES.check(worst, observed, fix)
}

fn boot_parameters(env: &Env) -> Check {
    let cmdline = match env.tree.value("/proc/cmdline") {
        Ok(c) => c,
        Err(e) => return BOOT_PARAMETERS.unknown(e),
    };
    let words: Vec<&str> = cmdline
        .split(" -- ")
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let has = |prefix: &str| words.iter().find(|w| w.starts_with(prefix)).copied();
    let mut findings = Vec::new();
    let mut notes = Vec::new();
    for hiding in ["mem=", "maxcpus=", "nr_cpus="] {
        if let Some(w) = has(hiding) {
            findings.push(format!("{w} hides hardware"));
        }
    }
    if let Some(w) = has("pcie_aspm=force") {
        findings.push(format!("{w} forces PCIe link power saving"));
    }
    if let Some(w) = has("transparent_hugepage=always") {
        findings.push(format!("{w} (see memory.transparent_hugepages)"));
    }
    let iommu_on = words
        .iter()
        .any(|w| *w == "intel_iommu=on" || *w == "amd_iommu=on" || *w == "amd_iommu=force");
    let passthrough = words
        .iter()
        .any(|w| *w == "iommu=pt" || *w == "iommu.passthrough=1");
    if iommu_on && !passthrough && env.gpus().present() {
        findings.push("IOMMU on without iommu=pt on a GPU host (translated DMA)".to_string());
    }
    for informative in [
        "isolcpus=",
        "nohz_full=",
        "mitigations=",
        "nosmt",
        "iommu=",
        "pcie_aspm=",
    ] {
        if let Some(w) = has(informative) {
            if !findings.iter().any(|f| f.starts_with(w)) {
                notes.push(w.to_string());
            }
        }
    }
    if findings.is_empty() {
        let observed = if notes.is_empty() {
            "no parameter that matters here".to_string()
        } else {
            format!("of note: {}", notes.join(" "))
        };
        return BOOT_PARAMETERS.ok(observed);
    }
    BOOT_PARAMETERS.warn(
        findings.join("; "),
        "# edit GRUB_CMDLINE_LINUX in /etc/default/grub (remove the parameters above; add iommu=pt on GPU hosts), then:\n\
         update-grub   # Debian/Ubuntu; RHEL/Fedora: grub2-mkconfig -o /boot/grub2/grub.cfg (or grubby --update-kernel=ALL --args=...)\n\
         # and reboot",
    )
}

/// Taint bits and letters (admin-guide/tainted-kernels.rst) that point at trouble.
const TAINT_ERRORS: &[(u32, char, &str)] = &[(4, 'M', "machine check"), (5, 'B', "bad page")];
const TAINT_WARNINGS: &[(u32, char, &str)] = &[
    (7, 'D', "kernel oops"),
    (9, 'W', "kernel warning"),
    (14, 'L', "soft lockup"),
];

fn tainted(env: &Env) -> Check {
    let value = match env.tree.number("/proc/sys/kernel/tainted") {
        Ok(v) => v.max(0) as u64,
        Err(e) => return TAINTED.unknown(e),
    };
    if value == 0 {
        return TAINTED.ok("0 (not tainted)");
    }
    let named = |table: &[(u32, char, &str)]| -> Vec<String> {
        table
            .iter()
            .filter(|(bit, _, _)| value & (1 << bit) != 0)
            .map(|(_, letter, what)| format!("{letter} ({what})"))
            .collect()
    };
    let errors = named(TAINT_ERRORS);
    let warnings = named(TAINT_WARNINGS);
    let mut expected_flags = Vec::new();
    if value & 1 != 0 {
        expected_flags.push("P (proprietary module)");
    }
    if value & (1 << 12) != 0 {
        expected_flags.push("O (out-of-tree module)");
    }
    if value & (1 << 13) != 0 {
        expected_flags.push("E (unsigned module)");
    }
    let mut parts = errors.clone();
    parts.extend(warnings.iter().cloned());
    parts.extend(expected_flags.iter().map(|s| s.to_string()));
    let observed = format!(
        "{value}: {}",
        if parts.is_empty() {
            "other flags".to_string()
        } else {
            parts.join(", ")
        }
    );
    let fix = "# read the cause in the kernel log (journalctl -k -b | grep -iE 'mce|bad page|oops|WARNING|soft lockup'); a reboot clears the flag, not the cause";
    if !errors.is_empty() {
        TAINTED.error(observed, fix)
    } else if !warnings.is_empty() {
        TAINTED.warn(observed, fix)
    } else {
        TAINTED.ok(observed)
    }
}

fn clocksource(env: &Env) -> Check {
    let dir = "/sys/devices/system/clocksource/clocksource0";
    let current = match env.tree.value(&format!("{dir}/current_clocksource")) {
        Ok(c) => c,
        Err(e) => return CLOCKSOURCE.unknown(e),
    };
    let available = env
        .tree
        .value(&format!("{dir}/available_clocksource"))
        .unwrap_or_default();
    match current.as_str() {
        "hpet" | "acpi_pm" | "jiffies" | "pit" => {
            let fix = if available.split_whitespace().any(|c| c == "tsc") {
                format!("echo tsc > {dir}/current_clocksource\n# check dmesg for why the kernel marked the TSC unstable first")
            } else {
                "# the TSC is not offered: check the BIOS (C-states, TSC sync) and dmesg for 'TSC unstable'".to_string()
            };
            CLOCKSOURCE.warn(format!("{current} (available: {available})"), fix)
        }
        _ => CLOCKSOURCE.ok(current),
    }
}
