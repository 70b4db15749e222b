//! The checks, one module per area. Each check has a [`CheckSpec`] (its id, what it reads,
//! what is expected and why, with the source) shared by the report and the docs; the area's
//! function turns what it reads into [`Check`]s.

mod cpu;
mod gpu;
mod kernel;
mod limits;
mod memory;
mod network;
mod numa;
mod rampart;
mod storage;

pub(crate) use gpu::cuda_version_text;

use crate::cgroup::Cgroup;
use crate::context::Context;
use crate::cpuinfo::CpuInfo;
use crate::gpu::{GpuDevice, GpuProbe, GpuSystem};
use crate::mounts::Mount;
use crate::report::{Area, Check, Status};
use crate::tree::{parse_cpu_list, parse_kv_sizes, HostTree, Unreadable};
use std::cell::OnceCell;
use std::collections::BTreeMap;
use std::fmt::Display;

/// The fixed description of one check.
#[derive(Debug)]
pub struct CheckSpec {
    pub id: &'static str,
    pub area: Area,
    /// The files or calls it reads.
    pub reads: &'static str,
    pub expected: &'static str,
    /// Why it matters, with the source of the recommendation.
    pub why: &'static str,
}

impl CheckSpec {
    pub(crate) fn check(
        &self,
        status: Status,
        observed: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            id: self.id.to_string(),
            area: self.area,
            subject: None,
            status,
            observed: observed.into(),
            expected: self.expected.to_string(),
            why: self.why.to_string(),
            fix: fix.into(),
        }
    }

    pub(crate) fn ok(&self, observed: impl Into<String>) -> Check {
        self.check(Status::Ok, observed, "")
    }

    pub(crate) fn warn(&self, observed: impl Into<String>, fix: impl Into<String>) -> Check {
        self.check(Status::Warn, observed, fix)
    }

    pub(crate) fn error(&self, observed: impl Into<String>, fix: impl Into<String>) -> Check {
        self.check(Status::Error, observed, fix)
    }

    pub(crate) fn unknown(&self, reason: impl Display) -> Check {
        self.check(Status::Unknown, reason.to_string(), "")
    }
}

impl Check {
    pub(crate) fn on(mut self, subject: impl Into<String>) -> Check {
        self.subject = Some(subject.into());
        self
    }

    pub(crate) fn expecting(mut self, expected: impl Into<String>) -> Check {
        self.expected = expected.into();
        self
    }
}

/// Every check, in report order.
pub fn catalogue() -> Vec<&'static CheckSpec> {
    [
        memory::SPECS,
        cpu::SPECS,
        numa::SPECS,
        storage::SPECS,
        network::SPECS,
        limits::SPECS,
        kernel::SPECS,
        gpu::SPECS,
        rampart::SPECS,
    ]
    .concat()
}

pub(crate) fn run_area(env: &Env, area: Area) -> Vec<Check> {
    match area {
        Area::Memory => memory::checks(env),
        Area::Cpu => cpu::checks(env),
        Area::Numa => numa::checks(env),
        Area::Storage => storage::checks(env),
        Area::Network => network::checks(env),
        Area::Limits => limits::checks(env),
        Area::Kernel => kernel::checks(env),
        Area::Gpu => gpu::checks(env),
        Area::Rampart => rampart::checks(env),
    }
}

/// What the checks share, read once per run.
pub(crate) struct Env<'a> {
    pub ctx: &'a Context,
    pub tree: HostTree,
    pub cpu: CpuInfo,
    pub meminfo: Result<BTreeMap<String, u64>, Unreadable>,
    pub mounts: Result<Vec<Mount>, Unreadable>,
    pub cgroup: Cgroup,
    /// `Cpus_allowed_list` of this process.
    pub process_cpus: Option<Vec<u32>>,
    gpus: OnceCell<GpuFacts>,
    injected_probe: Option<&'a dyn GpuProbe>,
}

impl<'a> Env<'a> {
    pub fn new(ctx: &'a Context, injected_probe: Option<&'a dyn GpuProbe>) -> Env<'a> {
        let tree = HostTree::new(&ctx.root);
        let cpu = CpuInfo::read(&tree);
        let meminfo = tree.read("/proc/meminfo").map(|t| parse_kv_sizes(&t));
        let mounts = crate::mounts::read_mounts(&tree);
        let cgroup = Cgroup::read(&tree, mounts.as_deref().unwrap_or(&[]));
        let process_cpus = tree.read("/proc/self/status").ok().and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
                .map(parse_cpu_list)
        });
        Env {
            ctx,
            tree,
            cpu,
            meminfo,
            mounts,
            cgroup,
            process_cpus,
            gpus: OnceCell::new(),
            injected_probe,
        }
    }

    /// The GPUs, asked for once and only by the areas that need them (NVML's start costs).
    pub fn gpus(&self) -> &GpuFacts {
        self.gpus
            .get_or_init(|| GpuFacts::gather(&self.tree, self.injected_probe))
    }

    /// GPUs counted without opening NVML when no check asked for them.
    pub fn gpus_if_gathered(&self) -> usize {
        match self.gpus.get() {
            Some(g) => g.devices.len().max(g.pci_devices.len()),
            None => nvidia_pci_devices(&self.tree).len(),
        }
    }

    /// The probe in use: the caller's, else the one this run opened.
    pub fn gpu_probe(&self) -> Option<&dyn GpuProbe> {
        self.injected_probe.or(self.gpus().owned_probe.as_deref())
    }

    pub fn meminfo_value(&self, key: &str) -> Result<u64, ProcValueError> {
        match &self.meminfo {
            Ok(map) => map
                .get(key)
                .copied()
                .ok_or_else(|| ProcValueError::Missing {
                    what: key.to_string(),
                    path: "/proc/meminfo".to_string(),
                }),
            Err(e) => Err(ProcValueError::Unreadable(e.clone())),
        }
    }

    /// CPUs this process may run on: online, in its cpuset and affinity mask.
    pub fn usable_cpus(&self) -> Vec<u32> {
        let mut cpus = self.cpu.online.clone();
        if let Some(set) = &self.cgroup.cpuset {
            cpus.retain(|c| set.contains(c));
        }
        if let Some(allowed) = &self.process_cpus {
            if !allowed.is_empty() {
                cpus.retain(|c| allowed.contains(c));
            }
        }
        cpus
    }

    /// CPU ids per NUMA node, from `/sys/devices/system/node/node*/cpulist`.
    pub fn numa_nodes(&self) -> Result<Vec<(u32, Vec<u32>)>, Unreadable> {
        let dir = "/sys/devices/system/node";
        let mut nodes = Vec::new();
        for name in self.tree.list(dir) {
            let Some(id) = name
                .strip_prefix("node")
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let cpus = self
                .tree
                .value(&format!("{dir}/{name}/cpulist"))
                .map(|t| parse_cpu_list(&t))
                .unwrap_or_default();
            nodes.push((id, cpus));
        }
        if nodes.is_empty() {
            return Err(Unreadable {
                path: dir.into(),
                reason: "no node directories".into(),
            });
        }
        Ok(nodes)
    }
}

/// The GPUs as the probe and sysfs see them.
pub(crate) struct GpuFacts {
    /// The probe this run opened (NVML or a fixture), unless the caller passed one.
    owned_probe: Option<Box<dyn GpuProbe>>,
    /// Why there is no probe.
    pub probe_error: Option<String>,
    pub system: Option<GpuSystem>,
    pub devices: Vec<GpuDevice>,
    /// NVIDIA display and 3D controllers on the PCI bus (sysfs), as bus ids.
    pub pci_devices: Vec<String>,
    /// `/proc/driver/nvidia/version`, first line.
    pub proc_version: Option<String>,
}

impl GpuFacts {
    fn gather(tree: &HostTree, injected: Option<&dyn GpuProbe>) -> GpuFacts {
        let mut facts = GpuFacts {
            owned_probe: None,
            probe_error: None,
            system: None,
            devices: Vec::new(),
            pci_devices: nvidia_pci_devices(tree),
            proc_version: tree
                .read("/proc/driver/nvidia/version")
                .ok()
                .and_then(|t| t.lines().next().map(|l| l.trim().to_string())),
        };
        if injected.is_none() {
            match crate::gpu::probe_for_root(tree.root()) {
                Ok(p) => facts.owned_probe = Some(p),
                Err(e) => facts.probe_error = Some(e.to_string()),
            }
        }
        if let Some(probe) = injected.or(facts.owned_probe.as_deref()) {
            let system = probe.system();
            let count = system.device_count.clone().unwrap_or(0).min(64);
            facts.devices = (0..count).map(|i| probe.device(i)).collect();
            facts.system = Some(system);
        }
        facts
    }

    /// Any NVIDIA GPU: seen by the probe or on the PCI bus.
    pub fn present(&self) -> bool {
        !self.devices.is_empty() || !self.pci_devices.is_empty()
    }

    pub fn driver_version(&self) -> Option<String> {
        if let Some(Ok(v)) = self.system.as_ref().map(|s| &s.driver_version) {
            return Some(v.clone());
        }
        // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ..."
        self.proc_version.as_ref().and_then(|line| {
            line.split_whitespace()
                .find(|w| w.contains('.') && w.chars().all(|c| c.is_ascii_digit() || c == '.'))
                .map(String::from)
        })
    }

    /// Why the GPU checks cannot judge anything, when they cannot.
    pub fn absent_reason(&self) -> String {
        match &self.probe_error {
            Some(e) if self.pci_devices.is_empty() => {
                format!("no NVIDIA GPU found (none on the PCI bus; {e})")
            }
            Some(e) => format!("NVML not available: {e}"),
            None => "NVML reports no GPU".to_string(),
        }
    }

    /// [`GpuFacts::absent_reason`] for the GPU checks after `gpu.nvml`, which gives it whole:
    /// one long dlopen message repeated on every line reads as noise.
    pub fn absent_reason_short(&self) -> String {
        match &self.probe_error {
            Some(_) if self.pci_devices.is_empty() => "no NVIDIA GPU found (see gpu.nvml)".into(),
            Some(_) => "NVML not available (see gpu.nvml)".into(),
            None => "NVML reports no GPU".to_string(),
        }
    }

    /// A device's label for the report: `gpu0`.
    pub fn label(device: &GpuDevice) -> String {
        format!("gpu{}", device.index)
    }
}

/// NVIDIA (vendor 0x10de) VGA or 3D controllers (class 0x0300xx, 0x0302xx) in sysfs.
fn nvidia_pci_devices(tree: &HostTree) -> Vec<String> {
    let dir = "/sys/bus/pci/devices";
    tree.list(dir)
        .into_iter()
        .filter(|bdf| {
            let vendor = tree
                .value(&format!("{dir}/{bdf}/vendor"))
                .unwrap_or_default();
            let class = tree
                .value(&format!("{dir}/{bdf}/class"))
                .unwrap_or_default();
            vendor.eq_ignore_ascii_case("0x10de")
                && (class.starts_with("0x0300") || class.starts_with("0x0302"))
        })
        .collect()
}

/// `sysctl -w` now and a line in /etc/sysctl.d so it survives a reboot.
pub(crate) fn sysctl_fix(key: &str, value: &str) -> String {
    format!("sysctl -w {key}={value}\necho '{key} = {value}' >> /etc/sysctl.d/90-rampart.conf")
}

/// Reads a sysctl as a number under `/proc/sys`.
pub(crate) fn sysctl_number(env: &Env, key: &str) -> Result<i64, Unreadable> {
    env.tree.number(&sysctl_path(key))
}

pub(crate) fn sysctl_path(key: &str) -> String {
    format!("/proc/sys/{}", key.replace('.', "/"))
}

/// Why a value of a `/proc` file is unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ProcValueError {
    #[error(transparent)]
    Unreadable(#[from] Unreadable),
    #[error("no {what} in {path}")]
    Missing { what: String, path: String },
}

/// Pressure stall information: `some avg10` of `/proc/pressure/<what>`.
pub(crate) fn pressure_some_avg10(env: &Env, what: &str) -> Result<f64, ProcValueError> {
    let path = format!("/proc/pressure/{what}");
    let text = env.tree.read(&path)?;
    text.lines()
        .find(|l| l.starts_with("some"))
        .and_then(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("avg10="))
                .and_then(|v| v.parse().ok())
        })
        .ok_or_else(|| ProcValueError::Missing {
            what: "`some avg10`".to_string(),
            path,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn catalogue_ids_are_unique_and_namespaced() {
        let specs = catalogue();
        assert!(specs.len() >= 40, "{} checks", specs.len());
        let mut seen = BTreeSet::new();
        for spec in &specs {
            assert!(seen.insert(spec.id), "duplicate id {}", spec.id);
            assert!(
                spec.id.starts_with(&format!("{}.", spec.area.name())),
                "{} is not under its area {}",
                spec.id,
                spec.area
            );
            assert!(!spec.why.is_empty() && !spec.expected.is_empty() && !spec.reads.is_empty());
        }
    }
}
