//! The CPU as `/proc/cpuinfo` and `/sys/devices/system/cpu` describe it.

use crate::tree::{parse_cpu_list, HostTree};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Debug, Default)]
pub(crate) struct CpuInfo {
    pub model: Option<String>,
    pub vendor: Option<String>,
    /// x86 `flags`, or ARM `Features`.
    pub flags: BTreeSet<String>,
    /// `processor` entries.
    pub logical: usize,
    /// Distinct (physical id, core id) pairs, when the file lists them.
    pub physical_cores: Option<usize>,
    pub sockets: Option<usize>,
    /// CPUs online (`/sys/devices/system/cpu/online`), else the `processor` entries.
    pub online: Vec<u32>,
    /// (physical id, core id) of each CPU, when the file lists them.
    pub core_of: BTreeMap<u32, (String, String)>,
}

impl CpuInfo {
    pub fn read(tree: &HostTree) -> CpuInfo {
        let mut info = match tree.read("/proc/cpuinfo") {
            Ok(text) => parse(&text),
            Err(_) => CpuInfo::default(),
        };
        info.online = tree
            .value("/sys/devices/system/cpu/online")
            .map(|t| parse_cpu_list(&t))
            .unwrap_or_default();
        if info.online.is_empty() {
            info.online = (0..info.logical as u32).collect();
        }
        info
    }

    pub fn has(&self, flag: &str) -> bool {
        let wanted = normalise_flag(flag);
        self.flags.iter().any(|f| normalise_flag(f) == wanted)
    }

    /// Physical cores among these CPUs (each core counted once whatever its threads); `None`
    /// when the topology is unknown.
    pub fn cores_among(&self, cpus: &[u32]) -> Option<usize> {
        if self.core_of.is_empty() {
            return None;
        }
        let cores: BTreeSet<&(String, String)> =
            cpus.iter().filter_map(|c| self.core_of.get(c)).collect();
        Some(cores.len())
    }

    pub fn logical_cpus(&self) -> Option<usize> {
        match (self.online.len(), self.logical) {
            (0, 0) => None,
            (0, n) => Some(n),
            (n, _) => Some(n),
        }
    }
}

/// Flag names differ between the kernel (`avx512_vnni`, `amx_tile`) and Rust (`avx512vnni`,
/// `amx-tile`): compared without separators.
pub(crate) fn normalise_flag(flag: &str) -> String {
    flag.chars()
        .filter(|c| *c != '_' && *c != '-' && *c != '.')
        .flat_map(|c| c.to_lowercase())
        .collect()
}

pub(crate) fn parse(text: &str) -> CpuInfo {
    let mut info = CpuInfo::default();
    let mut cores = BTreeSet::new();
    let mut sockets = BTreeSet::new();
    let mut current: BTreeMap<&str, &str> = BTreeMap::new();
    let mut finish = |entry: &BTreeMap<&str, &str>, info: &mut CpuInfo| {
        if entry.contains_key("processor") {
            info.logical += 1;
        }
        if let (Some(p), Some(c)) = (entry.get("physical id"), entry.get("core id")) {
            cores.insert((p.to_string(), c.to_string()));
            sockets.insert(p.to_string());
            if let Some(Ok(n)) = entry.get("processor").map(|n| n.parse::<u32>()) {
                info.core_of.insert(n, (p.to_string(), c.to_string()));
            }
        }
    };
    for line in text.lines() {
        if line.trim().is_empty() {
            finish(&current, &mut info);
            current.clear();
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let key = key.trim();
        let value = value.trim();
        current.insert(key, value);
        match key {
            "model name" | "Model Name" if info.model.is_none() => {
                info.model = Some(value.to_string())
            }
            "vendor_id" | "CPU implementer" if info.vendor.is_none() => {
                info.vendor = Some(value.to_string())
            }
            "flags" | "Features" if info.flags.is_empty() => {
                info.flags = value.split_whitespace().map(String::from).collect();
            }
            _ => {}
        }
    }
    finish(&current, &mut info);
    if !cores.is_empty() {
        info.physical_cores = Some(cores.len());
        info.sockets = Some(sockets.len());
    }
    info
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_cores_and_threads() {
        let text = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\nphysical id\t: 0\ncore id\t: 0\nflags\t: fpu avx2 avx512_vnni\n\n\
                    processor\t: 1\nphysical id\t: 0\ncore id\t: 0\n\n\
                    processor\t: 2\nphysical id\t: 0\ncore id\t: 1\n";
        let info = parse(text);
        assert_eq!(info.logical, 3);
        assert_eq!(info.physical_cores, Some(2));
        assert_eq!(info.sockets, Some(1));
        assert_eq!(info.cores_among(&[0, 1]), Some(1));
        assert_eq!(info.cores_among(&[0, 1, 2]), Some(2));
        assert_eq!(info.model.as_deref(), Some("Xeon"));
        assert!(info.has("avx512vnni"));
        assert!(!info.has("amx-tile"));
    }
}
