//! The hardware fingerprint: what a model version was imported, benchmarked or served on
//! (LINEAGE.json's environment, the serve-start log, `GET /admin/doctor`).

use crate::checks::Env;
use crate::tree::{human_bytes, HostTree};
use serde::{Deserialize, Serialize};

/// Bumped when a field changes meaning.
pub const FINGERPRINT_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fingerprint {
    pub schema_version: u32,
    pub hostname: Option<String>,
    /// `PRETTY_NAME` of /etc/os-release.
    pub os: Option<String>,
    pub kernel_release: Option<String>,
    /// The architecture this binary was built for.
    pub arch: String,
    pub cpu: CpuFingerprint,
    pub memory_total_bytes: Option<u64>,
    pub numa_nodes: Option<usize>,
    pub gpu_driver_version: Option<String>,
    /// The newest CUDA version the driver supports (`12.4`).
    pub cuda_driver_version: Option<String>,
    pub gpus: Vec<GpuFingerprint>,
    /// GPUs, NICs and NVMe drives on the PCI bus, with their links and upstream bridges.
    pub pcie: Vec<PcieDevice>,
}

impl Fingerprint {
    /// A fingerprint kept as JSON (a version's LINEAGE.json); `None` when it is of a schema
    /// this build does not know.
    pub fn from_json(value: &serde_json::Value) -> Option<Fingerprint> {
        serde_json::from_value(value.clone()).ok()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuFingerprint {
    pub model: Option<String>,
    pub vendor: Option<String>,
    /// Every flag of /proc/cpuinfo, sorted.
    pub flags: Vec<String>,
    pub logical_cpus: Option<usize>,
    pub physical_cores: Option<usize>,
    pub sockets: Option<usize>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuFingerprint {
    pub index: u32,
    pub name: Option<String>,
    pub uuid: Option<String>,
    pub pci_bus_id: Option<String>,
    pub vbios_version: Option<String>,
    /// `9.0`.
    pub compute_capability: Option<String>,
    pub memory_total_bytes: Option<u64>,
    pub pcie_max_gen: Option<u32>,
    pub pcie_max_width: Option<u32>,
    pub numa_node: Option<i64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PcieDevice {
    pub bus_id: String,
    /// `gpu`, `nic` or `nvme`.
    pub kind: String,
    /// `0x10de:0x2330`.
    pub id: String,
    pub numa_node: Option<i64>,
    /// `32.0 GT/s PCIe x16`.
    pub max_link: Option<String>,
    pub current_link: Option<String>,
    /// Root complex, then each bridge down to the device's parent (empty when sysfs does not
    /// show the hierarchy, as in fixture trees).
    pub upstream: Vec<String>,
}

impl Fingerprint {
    /// The fingerprint in one line, for a log: host, OS, kernel, CPU, memory, NUMA, driver,
    /// each GPU by name and UUID.
    pub fn summary(&self) -> String {
        let mut parts: Vec<String> = Vec::new();
        parts.extend(self.hostname.clone());
        parts.extend(self.os.clone());
        if let Some(k) = &self.kernel_release {
            parts.push(format!("kernel {k}"));
        }
        parts.push(self.arch.clone());
        parts.push(self.cpu.summary());
        if let Some(m) = self.memory_total_bytes {
            parts.push(format!("{} memory", human_bytes(m)));
        }
        match self.numa_nodes {
            Some(1) => parts.push("1 NUMA node".into()),
            Some(n) => parts.push(format!("{n} NUMA nodes")),
            None => {}
        }
        if self.gpus.is_empty() {
            parts.push("no NVIDIA GPU".into());
        } else {
            parts.push(self.driver_text());
            for gpu in &self.gpus {
                parts.push(gpu.summary());
            }
        }
        parts.join(" · ")
    }

    /// The fingerprint for a terminal (`rampart doctor --fingerprint`): one fact a line,
    /// each GPU and PCIe device on its own.
    pub fn render_text(&self) -> String {
        let unknown = || "unknown".to_string();
        let mut out = String::from("hardware fingerprint\n");
        let mut row = |name: &str, value: String| {
            out.push_str(&format!("  {name:<10} {value}\n"));
        };
        row("host", self.hostname.clone().unwrap_or_else(unknown));
        row("os", self.os.clone().unwrap_or_else(unknown));
        row(
            "kernel",
            format!(
                "{} ({})",
                self.kernel_release.clone().unwrap_or_else(unknown),
                self.arch
            ),
        );
        row("cpu", self.cpu.summary());
        row(
            "memory",
            self.memory_total_bytes
                .map(human_bytes)
                .unwrap_or_else(unknown),
        );
        row(
            "numa",
            self.numa_nodes
                .map(|n| format!("{n} node{}", if n == 1 { "" } else { "s" }))
                .unwrap_or_else(unknown),
        );
        row(
            "gpu",
            if self.gpus.is_empty() {
                "no NVIDIA GPU".into()
            } else {
                self.driver_text()
            },
        );
        for gpu in &self.gpus {
            let mut facts = vec![gpu.summary()];
            facts.extend(gpu.pci_bus_id.as_ref().map(|b| format!("bus {b}")));
            facts.extend(gpu.vbios_version.as_ref().map(|v| format!("VBIOS {v}")));
            facts.extend(
                gpu.compute_capability
                    .as_ref()
                    .map(|c| format!("compute {c}")),
            );
            facts.extend(gpu.memory_total_bytes.map(human_bytes));
            if let (Some(g), Some(w)) = (gpu.pcie_max_gen, gpu.pcie_max_width) {
                facts.push(format!("PCIe Gen{g} x{w} max"));
            }
            facts.extend(numa_text(gpu.numa_node));
            out.push_str(&format!("    gpu{}  {}\n", gpu.index, facts.join(", ")));
        }
        out.push_str(&format!(
            "  {:<10} {} device{} (GPUs, NICs, NVMe)\n",
            "pcie",
            self.pcie.len(),
            if self.pcie.len() == 1 { "" } else { "s" }
        ));
        for d in &self.pcie {
            let mut facts = vec![format!("{:<4} {}", d.kind, d.id)];
            match (&d.current_link, &d.max_link) {
                (Some(c), Some(m)) if c == m => facts.push(c.clone()),
                (Some(c), Some(m)) => facts.push(format!("{c} (max {m})")),
                (None, Some(m)) => facts.push(format!("max {m}")),
                (Some(c), None) => facts.push(c.clone()),
                (None, None) => {}
            }
            facts.extend(numa_text(d.numa_node));
            if !d.upstream.is_empty() {
                facts.push(format!("via {}", d.upstream.join(" > ")));
            }
            out.push_str(&format!("    {}  {}\n", d.bus_id, facts.join(", ")));
        }
        // About 90 columns a line: a server CPU has well over a hundred flags.
        let mut line = String::new();
        let mut head = "cpu flags";
        for flag in &self.cpu.flags {
            if !line.is_empty() && line.len() + flag.len() > 76 {
                out.push_str(&format!("  {head:<10} {line}\n"));
                head = "";
                line.clear();
            }
            if !line.is_empty() {
                line.push(' ');
            }
            line.push_str(flag);
        }
        if !line.is_empty() {
            out.push_str(&format!("  {head:<10} {line}\n"));
        }
        out
    }

    fn driver_text(&self) -> String {
        let driver = self
            .gpu_driver_version
            .as_deref()
            .map_or("NVIDIA driver unknown".to_string(), |d| {
                format!("NVIDIA driver {d}")
            });
        match &self.cuda_driver_version {
            Some(cuda) => format!("{driver} (CUDA {cuda})"),
            None => driver,
        }
    }
}

/// sysfs says -1 when the platform does not tell a device's node.
fn numa_text(node: Option<i64>) -> Option<String> {
    node.filter(|n| *n >= 0).map(|n| format!("NUMA node {n}"))
}

impl CpuFingerprint {
    fn summary(&self) -> String {
        let mut counts = Vec::new();
        if let Some(n) = self.logical_cpus {
            counts.push(format!("{n} CPUs"));
        }
        if let Some(n) = self.physical_cores {
            counts.push(format!("{n} cores"));
        }
        if let Some(n) = self.sockets {
            counts.push(format!("{n} socket{}", if n == 1 { "" } else { "s" }));
        }
        let model = self.model.clone().unwrap_or_else(|| "CPU unknown".into());
        if counts.is_empty() {
            model
        } else {
            format!("{model} ({})", counts.join(", "))
        }
    }
}

impl GpuFingerprint {
    fn summary(&self) -> String {
        let name = self.name.as_deref().unwrap_or("GPU");
        match &self.uuid {
            Some(uuid) => format!("gpu{} {name} ({uuid})", self.index),
            None => format!("gpu{} {name}", self.index),
        }
    }
}

pub(crate) fn build(env: &Env) -> Fingerprint {
    let tree = &env.tree;
    let gpus = env.gpus();
    let devices = gpus
        .devices
        .iter()
        .map(|d| {
            let bus = d.pci_bus_id.clone().ok();
            let numa_node = bus.as_ref().and_then(|b| {
                tree.number(&format!("/sys/bus/pci/devices/{b}/numa_node"))
                    .ok()
            });
            GpuFingerprint {
                index: d.index,
                name: d.name.clone().ok(),
                uuid: d.uuid.clone().ok(),
                pci_bus_id: bus,
                vbios_version: d.vbios_version.clone().ok(),
                compute_capability: d
                    .compute_capability
                    .clone()
                    .ok()
                    .map(|(a, b)| format!("{a}.{b}")),
                memory_total_bytes: d.memory_total_bytes.clone().ok(),
                pcie_max_gen: d.pcie_max.as_ref().ok().map(|l| l.gen),
                pcie_max_width: d.pcie_max.as_ref().ok().map(|l| l.width),
                numa_node,
            }
        })
        .collect();
    Fingerprint {
        schema_version: FINGERPRINT_VERSION,
        hostname: tree.value("/proc/sys/kernel/hostname").ok(),
        os: os_name(tree),
        kernel_release: tree.value("/proc/sys/kernel/osrelease").ok(),
        arch: std::env::consts::ARCH.to_string(),
        cpu: CpuFingerprint {
            model: env.cpu.model.clone(),
            vendor: env.cpu.vendor.clone(),
            flags: env.cpu.flags.iter().cloned().collect(),
            logical_cpus: env.cpu.logical_cpus(),
            physical_cores: env.cpu.physical_cores,
            sockets: env.cpu.sockets,
        },
        memory_total_bytes: env.meminfo_value("MemTotal").ok(),
        numa_nodes: env.numa_nodes().ok().map(|n| n.len()),
        gpu_driver_version: gpus.driver_version(),
        cuda_driver_version: gpus
            .system
            .as_ref()
            .and_then(|s| s.cuda_driver_version.clone().ok())
            .map(crate::checks::cuda_version_text),
        gpus: devices,
        pcie: pcie_devices(tree),
    }
}

pub(crate) fn os_name(tree: &HostTree) -> Option<String> {
    let text = tree
        .read("/etc/os-release")
        .or_else(|_| tree.read("/usr/lib/os-release"))
        .ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("PRETTY_NAME="))
        .map(|v| v.trim().trim_matches('"').to_string())
}

fn pcie_devices(tree: &HostTree) -> Vec<PcieDevice> {
    let dir = "/sys/bus/pci/devices";
    let mut out = Vec::new();
    for bdf in tree.list(dir) {
        let path = format!("{dir}/{bdf}");
        let class = tree.value(&format!("{path}/class")).unwrap_or_default();
        let vendor = tree.value(&format!("{path}/vendor")).unwrap_or_default();
        let kind = if vendor.eq_ignore_ascii_case("0x10de")
            && (class.starts_with("0x0300") || class.starts_with("0x0302"))
        {
            "gpu"
        } else if class.starts_with("0x0200") || class.starts_with("0x0207") {
            "nic"
        } else if class.starts_with("0x010802") {
            "nvme"
        } else {
            continue;
        };
        let device = tree.value(&format!("{path}/device")).unwrap_or_default();
        let link = |speed: &str, width: &str| -> Option<String> {
            let s = tree.value(&format!("{path}/{speed}")).ok()?;
            let w = tree.value(&format!("{path}/{width}")).ok()?;
            Some(format!("{s} x{w}"))
        };
        // /sys/bus/pci/devices/<bdf> links to ../../../devices/pci0000:00/0000:00:01.0/<bdf>.
        let upstream = tree
            .link_target(&path)
            .map(|target| {
                target
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy().into_owned())
                    .filter(|c| c.starts_with("pci") || c.contains(':'))
                    .filter(|c| c != &bdf)
                    .collect()
            })
            .unwrap_or_default();
        out.push(PcieDevice {
            bus_id: bdf.clone(),
            kind: kind.to_string(),
            id: format!("{vendor}:{device}"),
            numa_node: tree.number(&format!("{path}/numa_node")).ok(),
            max_link: link("max_link_speed", "max_link_width"),
            current_link: link("current_link_speed", "current_link_width"),
            upstream,
        });
    }
    out
}
