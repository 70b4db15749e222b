//! GPU: the driver and CUDA against the shipped table, and per GPU: persistence, ECC and memory
//! errors, PCIe link (sampled, never judged on one idle reading), AER, NVLink, clock events,
//! temperature, power, MIG; XID errors from the kernel log.

use super::{CheckSpec, Env, GpuFacts};
use crate::gpu::{
    clock_reasons, GpuDevice, LoadApplied, PcieLink, PcieSample, PcieSampling, Unavailable,
};
use crate::known_issues::{cuda_fit, newest_cuda_for, xid_meaning, CudaFit, XID_HARDWARE};
use crate::report::{Area, Check};

const NVML: CheckSpec = CheckSpec {
    id: "gpu.nvml",
    area: Area::Gpu,
    reads: "libnvidia-ml.so.1 (nvmlInit_v2, nvmlDeviceGetCount_v2); NVIDIA devices in /sys/bus/pci/devices",
    expected: "NVML loads and sees every NVIDIA GPU on the PCI bus",
    why: "A GPU on the bus that the driver does not expose (driver not loaded, version mismatch \
          between library and kernel module, a GPU fallen off the bus) serves nothing. NVML \
          needs no root for these queries.",
};

const DRIVER_CUDA: CheckSpec = CheckSpec {
    id: "gpu.driver_cuda",
    area: Area::Gpu,
    reads: "nvmlSystemGetDriverVersion, nvmlSystemGetCudaDriverVersion_v2 (or /proc/driver/nvidia/version); host::known_issues::CUDA_DRIVERS",
    expected: "the driver meets the GA driver of the CUDA version the binary needs (CUDA 12.0: ≥ 525.60.13)",
    why: "A CUDA program needs a driver at least as new as its toolkit's; within a major \
          release, minor version compatibility runs it on the major's first driver without \
          newer PTX JIT. Source: NVIDIA CUDA Toolkit Release Notes (toolkit/driver table) and \
          the CUDA Compatibility guide.",
};

const KERNEL_MODULE: CheckSpec = CheckSpec {
    id: "gpu.kernel_module",
    area: Area::Gpu,
    reads: "/proc/driver/nvidia/version; compute capability and name of each GPU",
    expected: "the open kernel modules on Blackwell and Grace Hopper GPUs",
    why: "NVIDIA supports Grace Hopper and Blackwell only with the open GPU kernel modules (the \
          proprietary flavour does not drive them); from R560 the open modules are the default. \
          Source: NVIDIA, \"NVIDIA Transitions Fully Towards Open-Source GPU Kernel Modules\" (2024).",
};

const PERSISTENCE: CheckSpec = CheckSpec {
    id: "gpu.persistence_mode",
    area: Area::Gpu,
    reads: "nvmlDeviceGetPersistenceMode",
    expected: "enabled",
    why: "Without persistence the driver tears GPU state down when the last client exits and \
          rebuilds it on the next start (seconds per start and per NVML query burst). NVIDIA's \
          driver persistence documentation recommends the nvidia-persistenced daemon.",
};

const ECC_MODE: CheckSpec = CheckSpec {
    id: "gpu.ecc_mode",
    area: Area::Gpu,
    reads: "nvmlDeviceGetEccMode",
    expected: "enabled, with no change pending",
    why: "ECC detects and corrects memory errors; with it off a flipped bit silently corrupts \
          weights or activations. Data-centre GPUs ship with it on; a pending change takes \
          effect at the next reset. NVIDIA NVML reference (nvmlDeviceGetEccMode).",
};

const ECC_ERRORS: CheckSpec = CheckSpec {
    id: "gpu.ecc_errors",
    area: Area::Gpu,
    reads: "nvmlDeviceGetTotalEccErrors (uncorrected; volatile and aggregate)",
    expected: "0 uncorrected errors since the driver loaded",
    why: "An uncorrected ECC error means data was lost: the process that hit it got an error \
          (Xid 48/94/95) and the GPU may need a reset. Aggregate counts are the GPU's lifetime \
          history. NVIDIA GPU Memory Error Management guide.",
};

const RETIRED_PAGES: CheckSpec = CheckSpec {
    id: "gpu.retired_pages",
    area: Area::Gpu,
    reads: "nvmlDeviceGetRetiredPages, nvmlDeviceGetRetiredPagesPendingStatus",
    expected: "no retirement pending; fewer than 60 retired pages",
    why: "GPUs before A100 retire memory pages with repeated or double-bit errors; a pending \
          retirement takes effect only after a reset, and DCGM treats 60 retired pages as the \
          point to replace the board. NVIDIA Dynamic Page Retirement guide.",
};

const ROW_REMAP: CheckSpec = CheckSpec {
    id: "gpu.row_remap",
    area: Area::Gpu,
    reads: "nvmlDeviceGetRemappedRows",
    expected: "no remap pending or failed",
    why: "A100 and later remap memory rows with errors; a pending remap applies at the next \
          reset, and a failed remap means the GPU is out of spare rows and should be replaced. \
          NVIDIA GPU Memory Error Management guide (row remapping).",
};

const PCIE_LINK: CheckSpec = CheckSpec {
    id: "gpu.pcie_link",
    area: Area::Gpu,
    reads: "nvmlDeviceGetCurrPcieLink{Generation,Width} sampled (under a CUDA copy load with the GPU load sample), nvmlDeviceGetMaxPcieLink{Generation,Width}",
    expected: "the maximum generation and width observed while busy equal the link's maximum",
    why: "A GPU that trained at x8 or a lower generation halves host-to-GPU bandwidth, and \
          NVIDIA's own health monitor misses it (NVIDIA/NVSentinel#890). Idle links downshift \
          and renegotiate constantly (nvidia-smi: \"may be reduced when the GPU is not in \
          use\"; local-inference-lab/rtx6kpro#88), so one idle reading is never judged.",
};

const PCIE_AER: CheckSpec = CheckSpec {
    id: "gpu.pcie_aer",
    area: Area::Gpu,
    reads: "/sys/bus/pci/devices/<gpu>/aer_dev_{fatal,nonfatal,correctable}",
    expected: "no fatal or non-fatal errors; few correctable ones",
    why: "PCIe Advanced Error Reporting counts link errors since boot; fatal and non-fatal ones \
          reset or hang the GPU, a growing correctable count points at a marginal slot, riser \
          or cable (the threshold of 100 is Rampart's). Kernel doc PCI/pcieaer-howto.rst.",
};

const NVLINK: CheckSpec = CheckSpec {
    id: "gpu.nvlink",
    area: Area::Gpu,
    reads: "nvmlDeviceGetNvLinkState, nvmlDeviceGetNvLinkVersion for each link",
    expected: "every NVLink link active when any is",
    why: "A downed link among active ones cuts GPU-to-GPU bandwidth for tensor parallelism and \
          usually follows an Xid 74; on NVSwitch systems links stay down until the fabric \
          manager runs. NVIDIA NVML reference (NvLink queries).",
};

const CLOCK_EVENTS: CheckSpec = CheckSpec {
    id: "gpu.clock_events",
    area: Area::Gpu,
    reads: "nvmlDeviceGetCurrentClocksEventReasons (…ThrottleReasons before R535)",
    expected: "no hardware slowdown, thermal or power-brake reason",
    why: "The reasons the clocks are held down: hw_slowdown, hw_thermal_slowdown and \
          hw_power_brake_slowdown mean overheating or a power fault, sw_thermal_slowdown and \
          sw_power_cap mean the GPU runs at its thermal or power limit. gpu_idle, \
          applications_clocks_setting, sync_boost and display_clock_setting are benign. \
          nvidia-smi documentation (clocks_event_reasons).",
};

const TEMPERATURE: CheckSpec = CheckSpec {
    id: "gpu.temperature",
    area: Area::Gpu,
    reads: "nvmlDeviceGetTemperature, nvmlDeviceGetTemperatureThreshold (slowdown)",
    expected: "more than 5 °C below the slowdown threshold",
    why: "At the slowdown threshold the GPU cuts its clocks to cool down; a GPU that idles near \
          it will throttle under load. NVIDIA NVML reference (temperature thresholds).",
};

const POWER: CheckSpec = CheckSpec {
    id: "gpu.power",
    area: Area::Gpu,
    reads: "nvmlDeviceGetPowerUsage, nvmlDeviceGetEnforcedPowerLimit, nvmlDeviceGetPowerManagementDefaultLimit",
    expected: "enforced power limit ≥ 90 % of the default limit",
    why: "A power limit set below the board's default (by an operator, a data-centre power \
          policy or a previous job) caps clocks under load. NVIDIA NVML reference (power \
          management).",
};

const MIG: CheckSpec = CheckSpec {
    id: "gpu.mig",
    area: Area::Gpu,
    reads: "nvmlDeviceGetMigMode",
    expected: "no MIG mode change pending",
    why: "With MIG on, the GPU is split into instances and CUDA sees only the instances named in \
          CUDA_VISIBLE_DEVICES, never the whole GPU; a pending change applies at the next GPU \
          reset. NVIDIA Multi-Instance GPU user guide.",
};

const XID: CheckSpec = CheckSpec {
    id: "gpu.xid",
    area: Area::Gpu,
    reads: "/dev/kmsg (needs CAP_SYSLOG when kernel.dmesg_restrict=1), else /var/log/kern.log, /var/log/messages, /var/log/syslog",
    expected: "no Xid error in the kernel log",
    why: "The NVIDIA driver logs each GPU fault as an Xid: 48, 62, 64, 74, 79, 95, 119, 120, 140 \
          and 154 are hardware, memory, link or firmware failures; others (13, 31, 43, 45) \
          usually an application's. NVIDIA \"XID Errors\" (docs.nvidia.com/deploy/xid-errors).",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &NVML,
    &DRIVER_CUDA,
    &KERNEL_MODULE,
    &PERSISTENCE,
    &ECC_MODE,
    &ECC_ERRORS,
    &RETIRED_PAGES,
    &ROW_REMAP,
    &PCIE_LINK,
    &PCIE_AER,
    &NVLINK,
    &CLOCK_EVENTS,
    &TEMPERATURE,
    &POWER,
    &MIG,
    &XID,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let gpus = env.gpus();
    let mut out = vec![nvml(env, gpus), driver_cuda(env, gpus), kernel_module(gpus)];
    out.extend(per_device(gpus, &PERSISTENCE, persistence));
    out.extend(per_device(gpus, &ECC_MODE, ecc_mode));
    out.extend(per_device(gpus, &ECC_ERRORS, ecc_errors));
    out.extend(per_device(gpus, &RETIRED_PAGES, retired_pages));
    out.extend(per_device(gpus, &ROW_REMAP, row_remap));
    out.extend(pcie_links(env, gpus));
    out.extend(pcie_aer(env, gpus));
    out.extend(per_device(gpus, &NVLINK, nvlink));
    out.extend(per_device(gpus, &CLOCK_EVENTS, clock_events));
    out.extend(per_device(gpus, &TEMPERATURE, temperature));
    out.extend(per_device(gpus, &POWER, power));
    out.extend(per_device(gpus, &MIG, mig));
    out.push(xid(env));
    out
}

fn per_device(
    gpus: &GpuFacts,
    spec: &CheckSpec,
    judge: fn(&CheckSpec, &GpuDevice) -> Check,
) -> Vec<Check> {
    if gpus.devices.is_empty() {
        return vec![spec.unknown(gpus.absent_reason_short())];
    }
    gpus.devices
        .iter()
        .map(|d| judge(spec, d).on(GpuFacts::label(d)))
        .collect()
}

/// `unknown` for a value the GPU does not give, with why.
fn unavailable(spec: &CheckSpec, what: &str, e: &Unavailable) -> Check {
    spec.unknown(format!("{what}: {e}"))
}

fn nvml(env: &Env, gpus: &GpuFacts) -> Check {
    let on_bus = gpus.pci_devices.len();
    let fix = "# load the driver and check it: modprobe nvidia && nvidia-smi\n# a library/kernel module version mismatch needs the matching driver packages (or a reboot after an upgrade)";
    let Some(system) = &gpus.system else {
        return if on_bus > 0 {
            NVML.error(
                format!(
                    "{on_bus} NVIDIA GPU(s) on the PCI bus, but {}",
                    gpus.absent_reason()
                ),
                fix,
            )
        } else {
            NVML.unknown(gpus.absent_reason())
        };
    };
    let source = env.gpu_probe().map(|p| p.source()).unwrap_or_default();
    let count = match &system.device_count {
        Ok(c) => *c as usize,
        Err(e) => return NVML.error(format!("{source}: device count failed: {e}"), fix),
    };
    if count < on_bus {
        return NVML.error(
            format!("{source} sees {count} GPU(s); {on_bus} on the PCI bus"),
            "# a GPU the driver does not expose: check `dmesg | grep -i nvrm` (Xid 79: fallen off the bus), then reset or reboot",
        );
    }
    let names: Vec<String> = gpus
        .devices
        .iter()
        .map(|d| d.name.clone().unwrap_or_else(|_| "unnamed GPU".into()))
        .collect();
    let driver = system
        .driver_version
        .as_ref()
        .map(|d| format!(", driver {d}"))
        .unwrap_or_default();
    NVML.ok(format!(
        "{source}: {count} GPU(s){driver}: {}",
        names.join(", ")
    ))
}

/// NVML's CUDA version code (12040) as text (12.4).
pub(crate) fn cuda_version_text(code: i32) -> String {
    format!("{}.{}", code / 1000, (code % 1000) / 10)
}

fn driver_cuda(env: &Env, gpus: &GpuFacts) -> Check {
    let Some(driver) = gpus.driver_version() else {
        return DRIVER_CUDA.unknown(gpus.absent_reason_short());
    };
    let reported = gpus
        .system
        .as_ref()
        .and_then(|s| s.cuda_driver_version.clone().ok())
        .map(cuda_version_text);
    let table_newest = newest_cuda_for(&driver);
    let mut observed = format!(
        "driver {driver}; reports CUDA {}",
        reported.as_deref().unwrap_or("unknown")
    );
    if let Some(newest) = table_newest {
        observed.push_str(&format!("; the table's newest CUDA for it: {newest}"));
    }
    if let (Some(r), Some(t)) = (&reported, table_newest) {
        if crate::tree::version_cmp(
            &crate::tree::parse_version(r),
            &crate::tree::parse_version(t),
        )
        .is_gt()
        {
            observed.push_str(" (newer than the table: a CUDA forward-compatibility package?)");
        }
    }
    let upgrade = "# install a newer NVIDIA driver from the production branch your distribution ships (e.g. the cuda-drivers or nvidia-driver-<branch> package)";
    let required = env.ctx.cuda_required.as_deref();
    let wanted = required.unwrap_or("12.0");
    let check = match cuda_fit(&driver, wanted) {
        CudaFit::Full => DRIVER_CUDA.ok(observed),
        CudaFit::MinorCompat { ga_driver } => DRIVER_CUDA.warn(
            format!("{observed}; CUDA {wanted} runs only through minor version compatibility (GA driver {ga_driver})"),
            upgrade,
        ),
        CudaFit::TooOld { needs } if required.is_some() => {
            DRIVER_CUDA.error(format!("{observed}; CUDA {wanted} needs at least {needs}"), upgrade)
        }
        CudaFit::TooOld { needs } => DRIVER_CUDA.warn(
            format!("{observed}; older than CUDA 12 (needs {needs}): current CUDA libraries will not run"),
            upgrade,
        ),
        CudaFit::NotInTable => match &reported {
            Some(r) if crate::tree::version_cmp(&crate::tree::parse_version(r), &crate::tree::parse_version(wanted)).is_ge() => {
                DRIVER_CUDA.ok(format!("{observed}; CUDA {wanted} is not in the table, the driver reports {r}"))
            }
            _ => DRIVER_CUDA.unknown(format!("{observed}; CUDA {wanted} is not in the table")),
        },
    };
    match required {
        Some(r) => check.expecting(format!("the GA driver of CUDA {r} or newer")),
        None => check,
    }
}

fn kernel_module(gpus: &GpuFacts) -> Check {
    if !gpus.present() {
        return KERNEL_MODULE.unknown(gpus.absent_reason_short());
    }
    let Some(line) = &gpus.proc_version else {
        return KERNEL_MODULE
            .unknown("not readable: /proc/driver/nvidia/version (driver not loaded?)");
    };
    let open = line.contains("Open Kernel Module");
    let needs_open: Vec<String> = gpus
        .devices
        .iter()
        .filter(|d| {
            let blackwell = matches!(d.compute_capability, Ok((major, _)) if major >= 10);
            let grace_hopper = d.name.as_deref().is_ok_and(|n| n.contains("GH200"));
            blackwell || grace_hopper
        })
        .map(GpuFacts::label)
        .collect();
    let flavour = if open {
        "open kernel module"
    } else {
        "proprietary kernel module"
    };
    if !open && !needs_open.is_empty() {
        KERNEL_MODULE.error(
            format!("{flavour} with {} (Blackwell or Grace Hopper)", needs_open.join(", ")),
            "# install the open flavour of the same driver branch (e.g. nvidia-open, or the installer's -m=kernel-open), then reboot",
        )
    } else {
        KERNEL_MODULE.ok(format!("{flavour}: {line}"))
    }
}

fn persistence(spec: &CheckSpec, d: &GpuDevice) -> Check {
    match &d.persistence_mode {
        Ok(true) => spec.ok("enabled"),
        Ok(false) => spec.warn(
            "disabled",
            format!("nvidia-smi -i {} -pm 1\n# better, for every GPU and across reboots: systemctl enable --now nvidia-persistenced", d.index),
        ),
        Err(e) => unavailable(spec, "persistence mode", e),
    }
}

fn ecc_mode(spec: &CheckSpec, d: &GpuDevice) -> Check {
    match &d.ecc_mode {
        Ok(m) if m.current != m.pending => spec.warn(
            format!("{} now, {} after the next reset", on_off(m.current), on_off(m.pending)),
            format!("nvidia-smi -i {} -r   # or reboot: applies the pending ECC mode", d.index),
        ),
        Ok(m) if !m.current => spec.warn(
            "disabled",
            format!("nvidia-smi -i {} -e 1\nnvidia-smi -i {} -r   # ECC changes apply after a reset or reboot", d.index, d.index),
        ),
        Ok(_) => spec.ok("enabled"),
        Err(Unavailable::NotSupported) => spec.ok("this GPU has no ECC"),
        Err(e) => unavailable(spec, "ECC mode", e),
    }
}

fn on_off(b: bool) -> &'static str {
    if b {
        "enabled"
    } else {
        "disabled"
    }
}

fn ecc_errors(spec: &CheckSpec, d: &GpuDevice) -> Check {
    match &d.ecc_uncorrected {
        Ok(c) => {
            let observed = format!(
                "uncorrected: {} since the driver loaded, {} over the GPU's life",
                c.volatile, c.aggregate
            );
            if c.volatile > 0 {
                spec.error(
                    observed,
                    format!("# drain the GPU, then reset it: nvidia-smi -i {} -r\n# if errors recur, collect nvidia-bug-report.sh and ask for a replacement", d.index),
                )
            } else if c.aggregate > 0 {
                spec.warn(observed, "# lifetime errors: watch gpu.row_remap / gpu.retired_pages and the Xid log for new ones")
            } else {
                spec.ok(observed)
            }
        }
        Err(Unavailable::NotSupported) => spec.ok("this GPU has no ECC counters"),
        Err(e) => unavailable(spec, "ECC error counts", e),
    }
}

fn retired_pages(spec: &CheckSpec, d: &GpuDevice) -> Check {
    match &d.retired_pages {
        Ok(p) => {
            let total = p.single_bit + p.double_bit;
            let observed = format!(
                "{} retired ({} for repeated single-bit, {} for double-bit errors){}",
                total,
                p.single_bit,
                p.double_bit,
                if p.pending {
                    "; retirement pending"
                } else {
                    ""
                }
            );
            if p.pending {
                spec.error(
                    observed,
                    format!(
                        "nvidia-smi -i {} -r   # or reboot: applies the pending retirement",
                        d.index
                    ),
                )
            } else if total >= 60 {
                spec.error(observed, "# 60 or more retired pages: collect nvidia-bug-report.sh and ask for a replacement")
            } else if total > 0 {
                spec.warn(
                    observed,
                    "# watch the count; a rising count means failing memory",
                )
            } else {
                spec.ok(observed)
            }
        }
        Err(Unavailable::NotSupported) => {
            spec.ok("not used by this GPU (row remapping on A100 and later, or no ECC)")
        }
        Err(e) => unavailable(spec, "retired pages", e),
    }
}

fn row_remap(spec: &CheckSpec, d: &GpuDevice) -> Check {
    match &d.row_remap {
        Ok(r) => {
            let observed = format!(
                "{} rows remapped for correctable, {} for uncorrectable errors{}{}",
                r.correctable,
                r.uncorrectable,
                if r.pending { "; remap pending" } else { "" },
                if r.failure { "; a remap FAILED" } else { "" }
            );
            if r.failure {
                spec.error(
                    observed,
                    "# out of spare rows: collect nvidia-bug-report.sh and ask for a replacement",
                )
            } else if r.pending {
                spec.warn(
                    observed,
                    format!(
                        "nvidia-smi -i {} -r   # or reboot: applies the pending row remap",
                        d.index
                    ),
                )
            } else {
                spec.ok(observed)
            }
        }
        Err(Unavailable::NotSupported) => {
            spec.ok("not supported by this GPU (page retirement before A100)")
        }
        Err(e) => unavailable(spec, "remapped rows", e),
    }
}

fn pcie_links(env: &Env, gpus: &GpuFacts) -> Vec<Check> {
    if gpus.devices.is_empty() {
        return vec![PCIE_LINK.unknown(gpus.absent_reason_short())];
    }
    let Some(probe) = env.gpu_probe() else {
        return vec![PCIE_LINK.unknown(gpus.absent_reason_short())];
    };
    let ctx = env.ctx;
    // Sample every GPU at once: with the load sample each takes about a second.
    let samplings: Vec<PcieSampling> = std::thread::scope(|scope| {
        let handles: Vec<_> = gpus
            .devices
            .iter()
            .map(|d| {
                let index = d.index;
                scope.spawn(move || {
                    if ctx.gpu_load_sample {
                        probe.pcie_under_load(index, ctx.gpu_load_samples, ctx.gpu_load_window)
                    } else {
                        PcieSampling {
                            samples: vec![probe.pcie_sample(index)],
                            load: LoadApplied::None("the GPU load sample is off".into()),
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| PcieSampling {
                    samples: vec![Err(Unavailable::Failed("sampling thread panicked".into()))],
                    load: LoadApplied::None("sampling thread panicked".into()),
                })
            })
            .collect()
    });
    gpus.devices
        .iter()
        .zip(samplings)
        .map(|(d, sampling)| {
            let check = match &d.pcie_max {
                Err(e) => unavailable(&PCIE_LINK, "maximum link", e),
                Ok(max) => judge_pcie(*max, &sampling, ctx.gpu_load_sample),
            };
            check.on(GpuFacts::label(d))
        })
        .collect()
}

/// Judges a link on the best reading of its samples, and only when the GPU was busy during
/// them (a load was applied, or the GPU reported itself busy).
pub(crate) fn judge_pcie(max: PcieLink, sampling: &PcieSampling, load_sampled: bool) -> Check {
    let readings: Vec<PcieSample> = sampling
        .samples
        .iter()
        .filter_map(|s| s.clone().ok())
        .collect();
    if readings.is_empty() {
        return match sampling.samples.first() {
            Some(Err(e)) => unavailable(&PCIE_LINK, "current link", e),
            _ => PCIE_LINK.unknown("no link reading"),
        };
    }
    let best_gen = readings.iter().map(|r| r.gen).max().unwrap_or(0);
    let best_width = readings.iter().map(|r| r.width).max().unwrap_or(0);
    let changes = readings
        .windows(2)
        .filter(|w| (w[0].gen, w[0].width) != (w[1].gen, w[1].width))
        .count();
    let loaded = matches!(
        sampling.load,
        LoadApplied::Copies { .. } | LoadApplied::Fixture
    ) || readings.iter().any(|r| r.busy == Some(true));
    let count = match readings.len() {
        1 => "1 reading".to_string(),
        n => format!("{n} readings"),
    };
    let how = match &sampling.load {
        LoadApplied::Copies { bytes, elapsed_ms } => format!(
            "{count} during {:.1} GiB of host-to-GPU copies in {elapsed_ms} ms",
            *bytes as f64 / (1u64 << 30) as f64
        ),
        LoadApplied::Fixture => format!("{count} from a fixture, under load"),
        LoadApplied::None(why) if load_sampled => format!("{count} without load: {why}"),
        LoadApplied::None(_) => count,
    };
    let changed = match changes {
        0 => String::new(),
        1 => "; the link changed once".to_string(),
        n => format!("; the link changed {n} times"),
    };
    let observed = format!(
        "best Gen{best_gen} x{best_width} of Gen{} x{} over {how}{changed}",
        max.gen, max.width
    );
    if best_gen >= max.gen && best_width >= max.width {
        return PCIE_LINK.ok(observed);
    }
    if !loaded {
        return PCIE_LINK.unknown(format!(
            "{observed}, while idle: links downshift at idle, so this is not judged; run with the GPU load sample (Context.gpu_load_sample)"
        ));
    }
    let several = readings.len() > 1;
    if best_width < max.width {
        let fix = "# the link trained narrower than the slot and GPU allow: reseat the GPU and its riser, check the slot's lane wiring (board manual: shared lanes, bifurcation) and BIOS PCIe settings";
        if several {
            PCIE_LINK.error(format!("{observed}: width below maximum under load"), fix)
        } else {
            PCIE_LINK.warn(
                format!("{observed}: width below maximum on one busy reading"),
                fix,
            )
        }
    } else {
        PCIE_LINK.warn(
            format!("{observed}: generation below maximum while busy"),
            "# check the BIOS PCIe speed setting (Auto or the slot's generation), risers and retimers; confirm under real load with: nvidia-smi -q -d PCIE",
        )
    }
}

fn pcie_aer(env: &Env, gpus: &GpuFacts) -> Vec<Check> {
    let mut targets: Vec<(String, String)> = gpus
        .devices
        .iter()
        .filter_map(|d| d.pci_bus_id.clone().ok().map(|b| (GpuFacts::label(d), b)))
        .collect();
    if targets.is_empty() {
        targets = gpus
            .pci_devices
            .iter()
            .enumerate()
            .map(|(i, b)| (format!("gpu{i}"), b.clone()))
            .collect();
    }
    if targets.is_empty() {
        return vec![PCIE_AER.unknown(gpus.absent_reason_short())];
    }
    targets
        .into_iter()
        .map(|(label, bus)| {
            let dir = format!("/sys/bus/pci/devices/{bus}");
            let total = |kind: &str| -> Result<u64, crate::tree::Unreadable> {
                let text = env.tree.read(&format!("{dir}/aer_dev_{kind}"))?;
                Ok(text
                    .lines()
                    .find(|l| l.starts_with("TOTAL_"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(0))
            };
            let check = match (total("fatal"), total("nonfatal"), total("correctable")) {
                (Ok(fatal), Ok(nonfatal), Ok(correctable)) => {
                    let observed = format!("{bus}: fatal {fatal}, non-fatal {nonfatal}, correctable {correctable} since boot");
                    let fix = "# reseat the GPU, its riser and cables; check the slot with another card; lspci -vvv -s <bus> shows the link's error status";
                    if fatal > 0 {
                        PCIE_AER.error(observed, fix)
                    } else if nonfatal > 0 || correctable > 100 {
                        PCIE_AER.warn(observed, fix)
                    } else {
                        PCIE_AER.ok(observed)
                    }
                }
                (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
                    PCIE_AER.unknown(format!("{e} (AER not enabled, or a VM without it)"))
                }
            };
            check.on(label)
        })
        .collect()
}

fn nvlink(spec: &CheckSpec, d: &GpuDevice) -> Check {
    match &d.nvlinks {
        Ok(links) if links.is_empty() => spec.ok("no NVLink links"),
        Ok(links) => {
            let active: Vec<u32> = links.iter().filter(|l| l.active).map(|l| l.link).collect();
            let down: Vec<u32> = links.iter().filter(|l| !l.active).map(|l| l.link).collect();
            let version = links
                .iter()
                .filter_map(|l| l.version)
                .max()
                .map(|v| format!(" (NVLink version {v})"))
                .unwrap_or_default();
            let list = |v: &[u32]| v.iter().map(u32::to_string).collect::<Vec<_>>().join(", ");
            if active.is_empty() {
                spec.ok(format!(
                    "{} links, none active{version}: fine without a bridge or switch; on NVSwitch systems start nvidia-fabricmanager",
                    links.len()
                ))
            } else if down.is_empty() {
                spec.ok(format!(
                    "{} of {} links active{version}",
                    active.len(),
                    links.len()
                ))
            } else {
                spec.warn(
                    format!("links {} down, {} active{version}", list(&down), active.len()),
                    format!("nvidia-smi nvlink -s -i {}   # link status and speeds\n# then reset the GPU (nvidia-smi -i {} -r) or, on NVSwitch systems, restart nvidia-fabricmanager", d.index, d.index),
                )
            }
        }
        Err(Unavailable::NotSupported) => spec.ok("this GPU has no NVLink"),
        Err(e) => unavailable(spec, "NVLink state", e),
    }
}

const HARDWARE_REASONS: u64 = clock_reasons::HW_SLOWDOWN
    | clock_reasons::HW_THERMAL_SLOWDOWN
    | clock_reasons::HW_POWER_BRAKE_SLOWDOWN;
const LIMIT_REASONS: u64 = clock_reasons::SW_THERMAL_SLOWDOWN | clock_reasons::SW_POWER_CAP;

fn clock_events(spec: &CheckSpec, d: &GpuDevice) -> Check {
    let mask = match &d.clock_event_reasons {
        Ok(m) => *m,
        Err(e) => return unavailable(spec, "clock event reasons", e),
    };
    let names = clock_reasons::names(mask);
    let observed = if names.is_empty() {
        format!("{mask:#x}: none")
    } else {
        format!("{mask:#x}: {}", names.join(", "))
    };
    if mask & HARDWARE_REASONS != 0 {
        spec.error(
            observed,
            format!("# check cooling, airflow, inlet temperature and the board's power cables; details: nvidia-smi -i {} -q -d PERFORMANCE", d.index),
        )
    } else if mask & LIMIT_REASONS != 0 {
        spec.warn(
            observed,
            format!("# the GPU is at its thermal or power limit: see gpu.temperature and gpu.power; details: nvidia-smi -i {} -q -d PERFORMANCE", d.index),
        )
    } else {
        spec.ok(observed)
    }
}

fn temperature(spec: &CheckSpec, d: &GpuDevice) -> Check {
    let temp = match &d.temperature_c {
        Ok(t) => *t,
        Err(e) => return unavailable(spec, "temperature", e),
    };
    let slowdown = match &d.slowdown_temperature_c {
        Ok(s) => *s,
        Err(e) => return spec.unknown(format!("{temp} °C; slowdown threshold: {e}")),
    };
    let observed = format!("{temp} °C, slowdown at {slowdown} °C");
    let fix = "# improve cooling: fans, airflow, inlet temperature, dust; check with nvidia-smi -q -d TEMPERATURE";
    if temp >= slowdown {
        spec.error(observed, fix)
    } else if temp + 5 >= slowdown {
        spec.warn(observed, fix)
    } else {
        spec.ok(observed)
    }
}

fn watts(milliwatts: u32) -> String {
    format!("{:.0} W", milliwatts as f64 / 1000.0)
}

fn power(spec: &CheckSpec, d: &GpuDevice) -> Check {
    let limit = match &d.power_limit_mw {
        Ok(l) => *l,
        Err(e) => return unavailable(spec, "power limit", e),
    };
    let usage = d
        .power_usage_mw
        .as_ref()
        .map(|u| format!("drawing {} of ", watts(*u)))
        .unwrap_or_default();
    match &d.power_default_limit_mw {
        Ok(default) => {
            let observed = format!(
                "{usage}a {} limit (default {})",
                watts(limit),
                watts(*default)
            );
            if (limit as f64) < *default as f64 * 0.9 {
                spec.warn(
                    observed,
                    format!("nvidia-smi -i {} -pl {}", d.index, default / 1000),
                )
            } else {
                spec.ok(observed)
            }
        }
        Err(e) => spec.unknown(format!(
            "{usage}a {} limit; default limit: {e}",
            watts(limit)
        )),
    }
}

fn mig(spec: &CheckSpec, d: &GpuDevice) -> Check {
    match &d.mig_mode {
        Ok(m) if m.current != m.pending => spec.warn(
            format!("MIG {} now, {} after the next reset", on_off(m.current), on_off(m.pending)),
            format!("nvidia-smi -i {} -r   # applies the pending MIG mode (stop every process on the GPU first)", d.index),
        ),
        Ok(m) if m.current => spec.ok("MIG enabled: CUDA sees the instances named in CUDA_VISIBLE_DEVICES (MIG-<uuid>), not the whole GPU"),
        Ok(_) => spec.ok("MIG disabled"),
        Err(Unavailable::NotSupported) => spec.ok("this GPU has no MIG"),
        Err(e) => unavailable(spec, "MIG mode", e),
    }
}

fn xid(env: &Env) -> Check {
    let log = match crate::kernel_log::read(&env.tree) {
        Ok(l) => l,
        Err(reason) => return XID.unknown(reason),
    };
    let summary = crate::kernel_log::scan_xids(&log.text);
    if summary.counts.is_empty() {
        return XID.ok(format!("no Xid in {}", log.source));
    }
    let mut hardware = false;
    let parts: Vec<String> = summary
        .counts
        .iter()
        .map(|((device, code), n)| {
            if XID_HARDWARE.iter().any(|(c, _)| c == code) {
                hardware = true;
            }
            let meaning = xid_meaning(*code)
                .map(|m| format!(" ({m})"))
                .unwrap_or_default();
            format!("{device}: Xid {code}{meaning} ×{n}")
        })
        .collect();
    let observed = format!("in {}: {}", log.source, parts.join("; "));
    let fix = "# hardware Xids: drain the GPU and reset it (nvidia-smi -i <index> -r) or reboot; if they recur, collect nvidia-bug-report.sh for the vendor\n# application Xids: see the failing process's own log";
    if hardware {
        XID.error(observed, fix)
    } else {
        XID.warn(observed, fix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::Probed;
    use crate::report::Status;

    fn sampling(samples: &[(u32, u32, Option<bool>)], load: LoadApplied) -> PcieSampling {
        PcieSampling {
            samples: samples
                .iter()
                .map(|&(gen, width, busy)| {
                    Ok(PcieSample { gen, width, busy }) as Probed<PcieSample>
                })
                .collect(),
            load,
        }
    }

    const MAX: PcieLink = PcieLink { gen: 5, width: 16 };

    #[test]
    fn an_idle_downshift_is_not_judged() {
        let s = sampling(&[(1, 16, Some(false))], LoadApplied::None("off".into()));
        assert_eq!(judge_pcie(MAX, &s, false).status, Status::Unknown);
    }

    #[test]
    fn the_best_reading_under_load_decides() {
        let s = sampling(
            &[
                (1, 16, Some(false)),
                (5, 16, Some(true)),
                (2, 16, Some(true)),
            ],
            LoadApplied::Copies {
                bytes: 1 << 30,
                elapsed_ms: 1000,
            },
        );
        let check = judge_pcie(MAX, &s, true);
        assert_eq!(check.status, Status::Ok, "{}", check.observed);
        assert!(check.observed.contains("changed 2 times"));
    }

    #[test]
    fn narrow_under_load_is_an_error_and_slow_is_a_warning() {
        let narrow = sampling(
            &[(5, 8, Some(true)), (5, 8, Some(true))],
            LoadApplied::Fixture,
        );
        assert_eq!(judge_pcie(MAX, &narrow, true).status, Status::Error);
        let slow = sampling(
            &[(3, 16, Some(true)), (4, 16, Some(true))],
            LoadApplied::Fixture,
        );
        assert_eq!(judge_pcie(MAX, &slow, true).status, Status::Warn);
        let one_busy = sampling(&[(5, 8, Some(true))], LoadApplied::None("off".into()));
        assert_eq!(judge_pcie(MAX, &one_busy, false).status, Status::Warn);
    }

    #[test]
    fn cuda_codes_read_as_versions() {
        assert_eq!(cuda_version_text(12040), "12.4");
        assert_eq!(cuda_version_text(13000), "13.0");
    }
}
