//! A GPU probe that answers from a JSON file, so tests cover throttling, downtrained links and
//! memory errors without a GPU. A field left out of the file reads as "not supported".

use super::*;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Why a fixture could not serve as a probe.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("{path}: {reason}")]
    Parse { path: String, reason: String },
    /// The fixture stands for a driver that fails to initialise.
    #[error("{0}")]
    LoadFails(String),
}

/// The file's top level (`<root>/.rampart-fixture/nvml.json`).
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureSystem {
    /// When set, loading the probe fails with this message (nvmlInit failing).
    #[serde(default)]
    pub load_error: Option<String>,
    pub driver_version: Option<String>,
    pub cuda_driver_version: Option<i32>,
    pub nvml_version: Option<String>,
    #[serde(default)]
    pub devices: Vec<FixtureDevice>,
}

#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureDevice {
    pub name: Option<String>,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
    pub vbios_version: Option<String>,
    pub compute_capability: Option<(i32, i32)>,
    pub memory_total_bytes: Option<u64>,
    pub persistence_mode: Option<bool>,
    pub ecc_mode: Option<EccMode>,
    pub ecc_uncorrected: Option<EccCounts>,
    pub retired_pages: Option<RetiredPages>,
    pub row_remap: Option<RowRemap>,
    pub pcie_max: Option<PcieLink>,
    /// Successive readings of the current link; each call takes the next, the last repeats.
    #[serde(default)]
    pub pcie_samples: Vec<PcieSample>,
    pub clock_event_reasons: Option<u64>,
    pub temperature_c: Option<u32>,
    pub slowdown_temperature_c: Option<u32>,
    pub power_usage_mw: Option<u32>,
    pub power_limit_mw: Option<u32>,
    pub power_default_limit_mw: Option<u32>,
    pub mig_mode: Option<MigMode>,
    pub nvlinks: Option<Vec<NvLink>>,
    /// What the run-time readings ([`GpuProbe::telemetry`]) answer beyond the fields above.
    #[serde(default)]
    pub telemetry: Option<FixtureTelemetry>,
}

/// A fixture GPU's run-time readings; a field left out reads as "not supported".
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureTelemetry {
    pub utilization_gpu_percent: Option<u32>,
    pub utilization_memory_percent: Option<u32>,
    pub memory_used_bytes: Option<u64>,
    pub sm_clock_mhz: Option<u32>,
    pub sm_clock_max_mhz: Option<u32>,
    pub memory_clock_mhz: Option<u32>,
    pub memory_clock_max_mhz: Option<u32>,
    pub ecc_corrected_volatile: Option<u64>,
    pub xid_errors: Option<u64>,
}

pub struct FixtureGpu {
    path: String,
    system: FixtureSystem,
    next_sample: Vec<AtomicUsize>,
}

impl FixtureGpu {
    pub fn load(path: &Path) -> Result<FixtureGpu, FixtureError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| FixtureError::Read {
            path: shown.clone(),
            reason: e.to_string(),
        })?;
        let system: FixtureSystem =
            serde_json::from_str(&text).map_err(|e| FixtureError::Parse {
                path: shown.clone(),
                reason: e.to_string(),
            })?;
        if let Some(message) = &system.load_error {
            return Err(FixtureError::LoadFails(message.clone()));
        }
        Ok(FixtureGpu::new(shown, system))
    }

    pub fn new(path: String, system: FixtureSystem) -> FixtureGpu {
        let next_sample = system.devices.iter().map(|_| AtomicUsize::new(0)).collect();
        FixtureGpu {
            path,
            system,
            next_sample,
        }
    }
}

fn given<T: Clone>(value: &Option<T>) -> Probed<T> {
    value.clone().ok_or(Unavailable::NotSupported)
}

impl GpuProbe for FixtureGpu {
    fn source(&self) -> String {
        format!("fixture {}", self.path)
    }

    fn system(&self) -> GpuSystem {
        GpuSystem {
            driver_version: given(&self.system.driver_version),
            cuda_driver_version: given(&self.system.cuda_driver_version),
            nvml_version: given(&self.system.nvml_version),
            device_count: Ok(self.system.devices.len() as u32),
        }
    }

    fn device(&self, index: u32) -> GpuDevice {
        let d = self
            .system
            .devices
            .get(index as usize)
            .cloned()
            .unwrap_or_default();
        GpuDevice {
            index,
            name: given(&d.name),
            uuid: given(&d.uuid),
            pci_bus_id: given(&d.pci_bus_id).map(|b| sysfs_bus_id(&b)),
            vbios_version: given(&d.vbios_version),
            compute_capability: given(&d.compute_capability),
            memory_total_bytes: given(&d.memory_total_bytes),
            persistence_mode: given(&d.persistence_mode),
            ecc_mode: given(&d.ecc_mode),
            ecc_uncorrected: given(&d.ecc_uncorrected),
            retired_pages: given(&d.retired_pages),
            row_remap: given(&d.row_remap),
            pcie_max: given(&d.pcie_max),
            clock_event_reasons: given(&d.clock_event_reasons),
            temperature_c: given(&d.temperature_c),
            slowdown_temperature_c: given(&d.slowdown_temperature_c),
            power_usage_mw: given(&d.power_usage_mw),
            power_limit_mw: given(&d.power_limit_mw),
            power_default_limit_mw: given(&d.power_default_limit_mw),
            mig_mode: given(&d.mig_mode),
            nvlinks: given(&d.nvlinks),
        }
    }

    fn pcie_sample(&self, index: u32) -> Probed<PcieSample> {
        let device = self
            .system
            .devices
            .get(index as usize)
            .ok_or_else(|| Unavailable::Failed(format!("no GPU {index} in the fixture")))?;
        if device.pcie_samples.is_empty() {
            return Err(Unavailable::NotSupported);
        }
        let i = self.next_sample[index as usize].fetch_add(1, Ordering::Relaxed);
        Ok(device.pcie_samples[i.min(device.pcie_samples.len() - 1)])
    }

    fn telemetry(&self, index: u32) -> GpuTelemetry {
        let d = self
            .system
            .devices
            .get(index as usize)
            .cloned()
            .unwrap_or_default();
        let t = d.telemetry.clone().unwrap_or_default();
        GpuTelemetry {
            index,
            utilization_gpu_percent: given(&t.utilization_gpu_percent),
            utilization_memory_percent: given(&t.utilization_memory_percent),
            memory_used_bytes: given(&t.memory_used_bytes),
            memory_total_bytes: given(&d.memory_total_bytes),
            temperature_c: given(&d.temperature_c),
            power_usage_mw: given(&d.power_usage_mw),
            power_limit_mw: given(&d.power_limit_mw),
            sm_clock_mhz: given(&t.sm_clock_mhz),
            sm_clock_max_mhz: given(&t.sm_clock_max_mhz),
            memory_clock_mhz: given(&t.memory_clock_mhz),
            memory_clock_max_mhz: given(&t.memory_clock_max_mhz),
            clock_event_reasons: given(&d.clock_event_reasons),
            // The last reading stands for the link now (the first ones may be from idle).
            pcie_current: d
                .pcie_samples
                .last()
                .map(|s| PcieLink {
                    gen: s.gen,
                    width: s.width,
                })
                .ok_or(Unavailable::NotSupported),
            pcie_max: given(&d.pcie_max),
            ecc_corrected_volatile: given(&t.ecc_corrected_volatile),
            ecc_uncorrected_volatile: given(&d.ecc_uncorrected).map(|c| c.volatile),
            xid_errors: given(&t.xid_errors),
        }
    }

    fn pcie_under_load(&self, index: u32, samples: u32, _window: Duration) -> PcieSampling {
        // The fixture's readings stand for a sampling under load; no need to wait.
        PcieSampling {
            samples: (0..samples.max(1))
                .map(|_| self.pcie_sample(index))
                .collect(),
            load: LoadApplied::Fixture,
        }
    }
}
