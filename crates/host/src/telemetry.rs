//! How the host is doing, read at each metrics scrape: this process's CPU time, memory, files
//! and threads; its cgroup's memory and CPU limits, usage and throttling (v2, v1 fallback);
//! pressure stall information; the host's available memory; and each GPU's run-time state
//! when a GPU probe is open.
//!
//! A [`Telemetry`] finds the cgroup's files and opens the GPU probe once; each
//! [`Telemetry::sample`] then reads a dozen small files and a few NVML calls per GPU (well
//! under a millisecond, see docs/perf.md). A value that cannot be read is `None`, never an
//! error: a metric that is absent is better than a scrape that fails.

use std::path::Path;

use crate::cgroup::{self, CgroupDirs};
use crate::gpu::{GpuProbe, GpuTelemetry};
use crate::mounts::read_mounts;
use crate::tree::{parse_kv_sizes, HostTree};

/// This process, from `/proc/self`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessStats {
    /// User plus system CPU time.
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<u64>,
    pub virtual_bytes: Option<u64>,
    pub open_fds: Option<u64>,
    /// The soft `RLIMIT_NOFILE`.
    pub max_fds: Option<u64>,
    pub threads: Option<u64>,
}

/// This process's control group. Limits are `None` when none is set.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CgroupStats {
    /// `v2` or `v1`; `None`: no cgroup found.
    pub version: Option<&'static str>,
    pub memory_usage_bytes: Option<u64>,
    pub memory_limit_bytes: Option<u64>,
    /// Page cache not used lately (`memory.stat` `inactive_file`, v1 `total_inactive_file`):
    /// the first thing the kernel reclaims. Usage minus this is the working set, what the OOM
    /// killer and the kubelet's eviction judge.
    pub memory_inactive_file_bytes: Option<u64>,
    /// `cpu.max` (or `cfs_quota_us / cfs_period_us`) in CPUs.
    pub cpu_quota_cores: Option<f64>,
    pub cpu_usage_seconds: Option<f64>,
    pub cpu_periods: Option<u64>,
    pub cpu_throttled_periods: Option<u64>,
    pub cpu_throttled_seconds: Option<f64>,
    pub oom_kills: Option<u64>,
}

/// One line of a PSI file: the share of time some (or all, `full`) tasks stalled on a
/// resource.
#[derive(Clone, Debug, PartialEq)]
pub struct Pressure {
    /// `cpu`, `memory`, `io`.
    pub resource: &'static str,
    /// `some`, `full`.
    pub kind: &'static str,
    /// Percent of the last 10 s, as the kernel writes it (0–100).
    pub avg10_percent: f64,
    /// Stalled time since boot (or since the cgroup was made).
    pub total_seconds: f64,
}

/// The host's memory, from `/proc/meminfo`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostMemory {
    pub total_bytes: Option<u64>,
    pub available_bytes: Option<u64>,
}

/// One GPU's name and identity, read once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuIdentity {
    pub index: u32,
    pub name: Option<String>,
    pub uuid: Option<String>,
}

/// One reading of everything above.
#[derive(Clone, Debug)]
pub struct TelemetrySample {
    pub process: ProcessStats,
    pub cgroup: CgroupStats,
    /// Where the PSI lines came from: the cgroup's own files (v2) or `/proc/pressure`.
    pub pressure_source: Option<&'static str>,
    pub pressure: Vec<Pressure>,
    pub memory: HostMemory,
    pub gpus: Vec<GpuTelemetry>,
}

/// The host's telemetry source: the cgroup's files, found once, and the GPU probe.
pub struct Telemetry {
    tree: HostTree,
    cgroup: CgroupDirs,
    gpu: Option<Box<dyn GpuProbe>>,
    gpus: Vec<GpuIdentity>,
    /// Why there are no GPU readings, when there are none.
    gpu_absent: Option<String>,
    clock_ticks_per_second: f64,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("root", &self.tree.root())
            .field("cgroup", &self.cgroup)
            .field("gpus", &self.gpus)
            .field("gpu_absent", &self.gpu_absent)
            .finish()
    }
}

const PSI_RESOURCES: [&str; 3] = ["cpu", "memory", "io"];

impl Telemetry {
    /// Telemetry of the host under `root` (`/` on a real host), with the GPU probe
    /// [`crate::gpu::probe_for_root`] picks: NVML on a real host, the fixture's file in a
    /// fixture tree. No probe: no GPU readings, and [`Telemetry::gpu_absent`] says why.
    pub fn open(root: &Path) -> Telemetry {
        match crate::gpu::probe_for_root(root) {
            Ok(probe) => Telemetry::with_gpu(root, Some(probe)),
            Err(why) => {
                let mut t = Telemetry::with_gpu(root, None);
                t.gpu_absent = Some(why.to_string());
                t
            }
        }
    }

    /// Telemetry with the caller's GPU probe (or none).
    pub fn with_gpu(root: &Path, gpu: Option<Box<dyn GpuProbe>>) -> Telemetry {
        let tree = HostTree::new(root);
        let mounts = read_mounts(&tree).unwrap_or_default();
        let cgroup = CgroupDirs::locate(&tree, &mounts);
        let (gpus, gpu_absent) = match &gpu {
            Some(probe) => match probe.system().device_count {
                Ok(count) => (
                    (0..count)
                        .map(|index| {
                            let d = probe.device(index);
                            GpuIdentity {
                                index,
                                name: d.name.ok(),
                                uuid: d.uuid.ok(),
                            }
                        })
                        .collect(),
                    None,
                ),
                Err(e) => (Vec::new(), Some(format!("GPU count: {e}"))),
            },
            None => (Vec::new(), Some("no GPU probe".to_string())),
        };
        Telemetry {
            tree,
            cgroup,
            gpu,
            gpus,
            gpu_absent,
            clock_ticks_per_second: clock_ticks_per_second(),
        }
    }

    /// The GPUs readings are taken of.
    pub fn gpus(&self) -> &[GpuIdentity] {
        &self.gpus
    }

    /// Why there are no GPU readings (no NVML, no device), when there are none.
    pub fn gpu_absent(&self) -> Option<&str> {
        self.gpu_absent.as_deref()
    }

    /// One reading.
    pub fn sample(&self) -> TelemetrySample {
        let (pressure_source, pressure) = self.pressure();
        TelemetrySample {
            process: self.process(),
            cgroup: self.cgroup_stats(),
            pressure_source,
            pressure,
            memory: self.memory(),
            gpus: match &self.gpu {
                Some(probe) => self.gpus.iter().map(|g| probe.telemetry(g.index)).collect(),
                None => Vec::new(),
            },
        }
    }

    fn process(&self) -> ProcessStats {
        let mut stats = ProcessStats::default();
        if let Ok(stat) = self.tree.read("/proc/self/stat") {
            // Fields after the command name, which is in parentheses and may hold spaces.
            if let Some((_, rest)) = stat.rsplit_once(')') {
                let fields: Vec<&str> = rest.split_whitespace().collect();
                // utime and stime are fields 14 and 15 of proc(5); `rest` starts at field 3.
                let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
                if let (Some(user), Some(system)) = (ticks(11), ticks(12)) {
                    stats.cpu_seconds = Some((user + system) as f64 / self.clock_ticks_per_second);
                }
            }
        }
        if let Ok(status) = self.tree.read("/proc/self/status") {
            let values = parse_kv_sizes(&status);
            stats.resident_bytes = values.get("VmRSS").copied();
            stats.virtual_bytes = values.get("VmSize").copied();
            stats.threads = values.get("Threads").copied();
        }
        let fd_dir = self.tree.resolve("/proc/self/fd");
        if let Ok(entries) = std::fs::read_dir(fd_dir) {
            stats.open_fds = Some(entries.count() as u64);
        }
        if let Ok(limits) = self.tree.read("/proc/self/limits") {
            stats.max_fds = limits
                .lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l["Max open files".len()..].split_whitespace().next())
                .and_then(|v| v.parse().ok());
        }
        stats
    }

    fn cgroup_stats(&self) -> CgroupStats {
        let mut stats = CgroupStats::default();
        let number = |path: String| -> Option<u64> { self.tree.value(&path).ok()?.parse().ok() };
        let stat = |dir: &str, key: &str| -> Option<u64> {
            let text = self.tree.read(&format!("{dir}/memory.stat")).ok()?;
            let found = cgroup::fields(&text).find(|(k, _)| *k == key);
            found.map(|f| f.1)
        };
        if let Some(dir) = self.cgroup.v2_with("memory") {
            stats.version = Some("v2");
            stats.memory_usage_bytes = number(format!("{dir}/memory.current"));
            stats.memory_limit_bytes = number(format!("{dir}/memory.max"));
            stats.memory_inactive_file_bytes = stat(dir, "inactive_file");
            stats.oom_kills = self
                .tree
                .read(&format!("{dir}/memory.events"))
                .ok()
                .and_then(|t| {
                    cgroup::fields(&t)
                        .find(|(k, _)| *k == "oom_kill")
                        .map(|f| f.1)
                });
        } else if let Some(dir) = &self.cgroup.v1_memory {
            stats.version = Some("v1");
            stats.memory_usage_bytes = number(format!("{dir}/memory.usage_in_bytes"));
            stats.memory_limit_bytes =
                number(format!("{dir}/memory.limit_in_bytes")).and_then(cgroup::v1_limit);
            // The hierarchical count, as the limit applies to the subtree.
            stats.memory_inactive_file_bytes = stat(dir, "total_inactive_file");
        }
        if let Some(dir) = self.cgroup.v2.as_deref() {
            // cpu.stat's usage lines are there even without the cpu controller; the
            // throttling lines and cpu.max need it.
            stats.version.get_or_insert("v2");
            if let Ok(text) = self.tree.read(&format!("{dir}/cpu.stat")) {
                for (key, value) in cgroup::fields(&text) {
                    match key {
                        "usage_usec" => stats.cpu_usage_seconds = Some(value as f64 / 1e6),
                        "nr_periods" => stats.cpu_periods = Some(value),
                        "nr_throttled" => stats.cpu_throttled_periods = Some(value),
                        "throttled_usec" => stats.cpu_throttled_seconds = Some(value as f64 / 1e6),
                        _ => {}
                    }
                }
            }
            if let Ok(text) = self.tree.value(&format!("{dir}/cpu.max")) {
                let mut parts = text.split_whitespace();
                let quota = parts.next().and_then(|q| q.parse::<f64>().ok());
                let period = parts.next().and_then(|p| p.parse::<f64>().ok());
                if let (Some(quota), Some(period)) = (quota, period) {
                    stats.cpu_quota_cores = (period > 0.0).then_some(quota / period);
                }
            }
        } else if let Some(dir) = &self.cgroup.v1_cpu {
            stats.version.get_or_insert("v1");
            if let Ok(text) = self.tree.read(&format!("{dir}/cpu.stat")) {
                for (key, value) in cgroup::fields(&text) {
                    match key {
                        "nr_periods" => stats.cpu_periods = Some(value),
                        "nr_throttled" => stats.cpu_throttled_periods = Some(value),
                        "throttled_time" => stats.cpu_throttled_seconds = Some(value as f64 / 1e9),
                        _ => {}
                    }
                }
            }
            let quota = self.tree.number(&format!("{dir}/cpu.cfs_quota_us")).ok();
            let period = self.tree.number(&format!("{dir}/cpu.cfs_period_us")).ok();
            if let (Some(quota), Some(period)) = (quota, period) {
                stats.cpu_quota_cores =
                    (quota > 0 && period > 0).then(|| quota as f64 / period as f64);
            }
            let acct = self.cgroup.v1_cpuacct.as_deref().unwrap_or(dir);
            stats.cpu_usage_seconds =
                number(format!("{acct}/cpuacct.usage")).map(|ns| ns as f64 / 1e9);
        }
        stats
    }

    /// The cgroup's own PSI files when it has them (what this workload suffers), else the
    /// host's.
    fn pressure(&self) -> (Option<&'static str>, Vec<Pressure>) {
        for (source, dir) in [
            ("cgroup", self.cgroup.v2.clone()),
            ("host", Some("/proc/pressure".to_string())),
        ] {
            let Some(dir) = dir else { continue };
            let mut lines = Vec::new();
            for resource in PSI_RESOURCES {
                let path = if source == "cgroup" {
                    format!("{dir}/{resource}.pressure")
                } else {
                    format!("{dir}/{resource}")
                };
                if let Ok(text) = self.tree.read(&path) {
                    lines.extend(parse_psi(resource, &text));
                }
            }
            if !lines.is_empty() {
                return (Some(source), lines);
            }
        }
        (None, Vec::new())
    }

    fn memory(&self) -> HostMemory {
        let Ok(text) = self.tree.read("/proc/meminfo") else {
            return HostMemory::default();
        };
        let values = parse_kv_sizes(&text);
        HostMemory {
            total_bytes: values.get("MemTotal").copied(),
            available_bytes: values.get("MemAvailable").copied(),
        }
    }
}

/// `some avg10=0.12 avg60=0.05 avg300=0.01 total=123456` (total in microseconds).
fn parse_psi(resource: &'static str, text: &str) -> Vec<Pressure> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let kind = match words.next()? {
                "some" => "some",
                "full" => "full",
                _ => return None,
            };
            let mut avg10 = None;
            let mut total = None;
            for word in words {
                match word.split_once('=') {
                    Some(("avg10", v)) => avg10 = v.parse::<f64>().ok(),
                    Some(("total", v)) => total = v.parse::<u64>().ok(),
                    _ => {}
                }
            }
            Some(Pressure {
                resource,
                kind,
                avg10_percent: avg10?,
                total_seconds: total? as f64 / 1e6,
            })
        })
        .collect()
}

fn clock_ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions; it returns -1 for an unknown name.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_lines_parse() {
        let text = "some avg10=1.50 avg60=0.20 avg300=0.00 total=2500000\n\
                    full avg10=0.25 avg60=0.00 avg300=0.00 total=500000\n";
        let lines = parse_psi("memory", text);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].kind, "some");
        assert_eq!(lines[0].avg10_percent, 1.5);
        assert_eq!(lines[0].total_seconds, 2.5);
        assert_eq!(lines[1].kind, "full");
        assert!(parse_psi("cpu", "garbage\nsome avg10=x total=1").is_empty());
    }

    #[test]
    fn the_real_process_reads() {
        let t = Telemetry::with_gpu(Path::new("/"), None);
        let s = t.sample();
        assert!(s.process.resident_bytes.unwrap_or(0) > 0);
        assert!(s.process.threads.unwrap_or(0) >= 1);
        assert!(s.process.open_fds.unwrap_or(0) >= 3);
        assert!(s.process.cpu_seconds.is_some());
        assert!(s.memory.total_bytes.unwrap_or(0) > 0);
        assert!(s.gpus.is_empty());
    }
}
