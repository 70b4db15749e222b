//! What the GPUs say about themselves, behind one seam: [`GpuProbe`]. The real probe is NVML,
//! opened at run time ([`Nvml`]); tests answer from a JSON file ([`FixtureGpu`]). Every
//! answer is a [`Probed`] value, so a function the driver lacks makes one check `unknown`
//! and nothing else.

mod fixture;
mod nvml;

pub use fixture::{FixtureDevice, FixtureError, FixtureGpu, FixtureSystem, FixtureTelemetry};
pub use nvml::{Nvml, NvmlLoadError};

use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// One answer from a GPU probe.
pub type Probed<T> = Result<T, Unavailable>;

/// Why a GPU value is missing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    /// The GPU or driver does not support the query (NVML_ERROR_NOT_SUPPORTED, or absent from
    /// a fixture).
    #[error("not supported by this GPU or driver")]
    NotSupported,
    /// The loaded libnvidia-ml has no such function (an older driver).
    #[error("libnvidia-ml has no {0}")]
    MissingSymbol(String),
    /// The query failed.
    #[error("{0}")]
    Failed(String),
}

/// Driver-wide facts.
#[derive(Clone, Debug)]
pub struct GpuSystem {
    pub driver_version: Probed<String>,
    /// The newest CUDA version the driver supports, as NVML encodes it (12040 = 12.4).
    pub cuda_driver_version: Probed<i32>,
    pub nvml_version: Probed<String>,
    pub device_count: Probed<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EccMode {
    pub current: bool,
    pub pending: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EccCounts {
    /// Since the last driver load.
    pub volatile: u64,
    /// Over the GPU's life.
    pub aggregate: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetiredPages {
    pub single_bit: u32,
    pub double_bit: u32,
    /// Retirements that take effect at the next reset.
    pub pending: bool,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RowRemap {
    pub correctable: u32,
    pub uncorrectable: u32,
    pub pending: bool,
    pub failure: bool,
}

/// A PCIe link: generation (1–6) and lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcieLink {
    pub gen: u32,
    pub width: u32,
}

/// One reading of the current link, and whether the GPU was busy then (utilisation above
/// zero or no idle clock reason), when known.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcieSample {
    pub gen: u32,
    pub width: u32,
    #[serde(default)]
    pub busy: Option<bool>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MigMode {
    pub current: bool,
    pub pending: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NvLink {
    pub link: u32,
    pub active: bool,
    #[serde(default)]
    pub version: Option<u32>,
}

/// Everything one GPU answers in a snapshot.
#[derive(Clone, Debug)]
pub struct GpuDevice {
    pub index: u32,
    pub name: Probed<String>,
    pub uuid: Probed<String>,
    /// In sysfs form, lower case: `0000:3b:00.0`.
    pub pci_bus_id: Probed<String>,
    pub vbios_version: Probed<String>,
    pub compute_capability: Probed<(i32, i32)>,
    pub memory_total_bytes: Probed<u64>,
    pub persistence_mode: Probed<bool>,
    pub ecc_mode: Probed<EccMode>,
    pub ecc_uncorrected: Probed<EccCounts>,
    pub retired_pages: Probed<RetiredPages>,
    pub row_remap: Probed<RowRemap>,
    /// The fastest link the GPU and its slot both support.
    pub pcie_max: Probed<PcieLink>,
    /// NVML clock event reasons (formerly throttle reasons), a bit mask.
    pub clock_event_reasons: Probed<u64>,
    pub temperature_c: Probed<u32>,
    pub slowdown_temperature_c: Probed<u32>,
    pub power_usage_mw: Probed<u32>,
    pub power_limit_mw: Probed<u32>,
    pub power_default_limit_mw: Probed<u32>,
    pub mig_mode: Probed<MigMode>,
    pub nvlinks: Probed<Vec<NvLink>>,
}

/// One reading of a GPU's run-time state, for the server's metrics: cheap calls only (no
/// strings, no NVLink walk), so a scrape can take one per GPU.
#[derive(Clone, Debug)]
pub struct GpuTelemetry {
    pub index: u32,
    /// Percent of the last sample period a kernel ran (NVML's "GPU utilization").
    pub utilization_gpu_percent: Probed<u32>,
    /// Percent of the last sample period device memory was read or written.
    pub utilization_memory_percent: Probed<u32>,
    pub memory_used_bytes: Probed<u64>,
    pub memory_total_bytes: Probed<u64>,
    pub temperature_c: Probed<u32>,
    pub power_usage_mw: Probed<u32>,
    pub power_limit_mw: Probed<u32>,
    pub sm_clock_mhz: Probed<u32>,
    pub sm_clock_max_mhz: Probed<u32>,
    pub memory_clock_mhz: Probed<u32>,
    pub memory_clock_max_mhz: Probed<u32>,
    /// NVML clock event (throttle) reasons, a bit mask ([`clock_reasons`]).
    pub clock_event_reasons: Probed<u64>,
    pub pcie_current: Probed<PcieLink>,
    pub pcie_max: Probed<PcieLink>,
    /// ECC errors since the last driver load.
    pub ecc_corrected_volatile: Probed<u64>,
    pub ecc_uncorrected_volatile: Probed<u64>,
    /// Critical XID events seen since the probe was opened.
    pub xid_errors: Probed<u64>,
}

/// What load, if any, was applied while the links were sampled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LoadApplied {
    /// Host-to-device copies through the CUDA driver.
    Copies { bytes: u64, elapsed_ms: u64 },
    /// A fixture's readings, which stand for a sampling under load.
    Fixture,
    /// Sampled without a load, and why.
    None(String),
}

/// Several readings of one GPU's link.
#[derive(Clone, Debug)]
pub struct PcieSampling {
    pub samples: Vec<Probed<PcieSample>>,
    pub load: LoadApplied,
}

/// The seam between the GPU checks and a driver.
pub trait GpuProbe: Send + Sync {
    /// Where the answers come from (`NVML 12.550.54.15`, `fixture …/nvml.json`).
    fn source(&self) -> String;
    fn system(&self) -> GpuSystem;
    fn device(&self, index: u32) -> GpuDevice;
    /// One reading of the current PCIe link.
    fn pcie_sample(&self, index: u32) -> Probed<PcieSample>;
    /// One reading of the GPU's run-time state. The default takes what [`GpuProbe::device`]
    /// and [`GpuProbe::pcie_sample`] answer and leaves the rest unsupported; NVML and the
    /// fixture answer all of it.
    fn telemetry(&self, index: u32) -> GpuTelemetry {
        let d = self.device(index);
        GpuTelemetry {
            index,
            utilization_gpu_percent: Err(Unavailable::NotSupported),
            utilization_memory_percent: Err(Unavailable::NotSupported),
            memory_used_bytes: Err(Unavailable::NotSupported),
            memory_total_bytes: d.memory_total_bytes,
            temperature_c: d.temperature_c,
            power_usage_mw: d.power_usage_mw,
            power_limit_mw: d.power_limit_mw,
            sm_clock_mhz: Err(Unavailable::NotSupported),
            sm_clock_max_mhz: Err(Unavailable::NotSupported),
            memory_clock_mhz: Err(Unavailable::NotSupported),
            memory_clock_max_mhz: Err(Unavailable::NotSupported),
            clock_event_reasons: d.clock_event_reasons,
            pcie_current: self.pcie_sample(index).map(|s| PcieLink {
                gen: s.gen,
                width: s.width,
            }),
            pcie_max: d.pcie_max,
            ecc_corrected_volatile: Err(Unavailable::NotSupported),
            ecc_uncorrected_volatile: d.ecc_uncorrected.map(|c| c.volatile),
            xid_errors: Err(Unavailable::NotSupported),
        }
    }
    /// `samples` readings spread over `window`, under a short load where the probe can apply
    /// one. The default applies none.
    fn pcie_under_load(&self, index: u32, samples: u32, window: Duration) -> PcieSampling {
        PcieSampling {
            samples: sample_spread(|| self.pcie_sample(index), samples, window),
            load: LoadApplied::None("this probe applies no load".into()),
        }
    }
}

/// Takes `samples` readings, evenly spaced over `window`.
pub(crate) fn sample_spread<T>(
    mut read: impl FnMut() -> T,
    samples: u32,
    window: Duration,
) -> Vec<T> {
    let samples = samples.max(1);
    let step = window / samples;
    let start = Instant::now();
    let mut out = Vec::with_capacity(samples as usize);
    for i in 0..samples {
        let due = start + step * i;
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        out.push(read());
    }
    out
}

/// Why a root has no GPU probe.
#[derive(Debug, thiserror::Error)]
pub enum NoGpuProbe {
    /// The fixture's `nvml.json` is there but unusable.
    #[error(transparent)]
    Fixture(#[from] FixtureError),
    /// A fixture tree without `nvml.json`.
    #[error("the fixture tree has no .rampart-fixture/nvml.json")]
    NoFixture,
    /// A real host where NVML would not load.
    #[error(transparent)]
    Nvml(#[from] NvmlLoadError),
}

/// Picks the probe for a root: the fixture's `nvml.json` when there is one, NVML on a real
/// host, nothing otherwise. The error says why there is none.
pub fn probe_for_root(root: &std::path::Path) -> Result<Box<dyn GpuProbe>, NoGpuProbe> {
    let fixture = root.join(".rampart-fixture").join("nvml.json");
    if fixture.is_file() {
        return Ok(Box::new(FixtureGpu::load(&fixture)?));
    }
    if root != std::path::Path::new("/") {
        return Err(NoGpuProbe::NoFixture);
    }
    Ok(Box::new(Nvml::load()?))
}

/// NVML clock event reason bits (nvml.h `nvmlClocksEventReason*`, renamed from
/// `nvmlClocksThrottleReason*` in R535; same values).
pub mod clock_reasons {
    pub const GPU_IDLE: u64 = 0x1;
    pub const APPLICATIONS_CLOCKS_SETTING: u64 = 0x2;
    pub const SW_POWER_CAP: u64 = 0x4;
    pub const HW_SLOWDOWN: u64 = 0x8;
    pub const SYNC_BOOST: u64 = 0x10;
    pub const SW_THERMAL_SLOWDOWN: u64 = 0x20;
    pub const HW_THERMAL_SLOWDOWN: u64 = 0x40;
    pub const HW_POWER_BRAKE_SLOWDOWN: u64 = 0x80;
    pub const DISPLAY_CLOCK_SETTING: u64 = 0x100;

    pub const NAMES: &[(u64, &str)] = &[
        (GPU_IDLE, "gpu_idle"),
        (APPLICATIONS_CLOCKS_SETTING, "applications_clocks_setting"),
        (SW_POWER_CAP, "sw_power_cap"),
        (HW_SLOWDOWN, "hw_slowdown"),
        (SYNC_BOOST, "sync_boost"),
        (SW_THERMAL_SLOWDOWN, "sw_thermal_slowdown"),
        (HW_THERMAL_SLOWDOWN, "hw_thermal_slowdown"),
        (HW_POWER_BRAKE_SLOWDOWN, "hw_power_brake_slowdown"),
        (DISPLAY_CLOCK_SETTING, "display_clock_setting"),
    ];

    pub fn names(mask: u64) -> Vec<&'static str> {
        NAMES
            .iter()
            .filter(|(bit, _)| mask & bit != 0)
            .map(|(_, n)| *n)
            .collect()
    }
}

/// NVML's bus id (`00000000:3B:00.0`) in sysfs form (`0000:3b:00.0`).
pub(crate) fn sysfs_bus_id(nvml_bus_id: &str) -> String {
    let lower = nvml_bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_take_sysfs_form() {
        assert_eq!(sysfs_bus_id("00000000:3B:00.0"), "0000:3b:00.0");
        assert_eq!(sysfs_bus_id("0000:3b:00.0"), "0000:3b:00.0");
    }

    #[test]
    fn samples_spread_over_the_window() {
        let start = Instant::now();
        let out = sample_spread(|| 1, 4, Duration::from_millis(40));
        assert_eq!(out.len(), 4);
        assert!(start.elapsed() >= Duration::from_millis(30));
    }
}
