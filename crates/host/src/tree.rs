//! The host's files, read under a root (`/` on a real host, a fixture tree in tests).
//!
//! Every read names the host path it stands for (`/proc/sys/vm/swappiness`), never the fixture
//! path, so an `unknown` reads the same on a real host and in a test.

use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// A file that could not be read, or did not hold what was expected.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Unreadable {
    /// The host path (`/proc/...`), not the path under the root.
    pub path: String,
    pub reason: String,
}

impl fmt::Display for Unreadable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not readable: {} ({})", self.path, self.reason)
    }
}

impl std::error::Error for Unreadable {}

#[derive(Clone, Debug)]
pub(crate) struct HostTree {
    root: PathBuf,
}

impl HostTree {
    pub fn new(root: &Path) -> HostTree {
        HostTree {
            root: root.to_path_buf(),
        }
    }

    /// True when the root is the machine itself, so system calls (statvfs, ioctl, NVML) answer
    /// for it. Under a fixture root only the fixture's files answer.
    pub fn is_real_host(&self) -> bool {
        self.root == Path::new("/")
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where a host path lies under the root.
    pub fn resolve(&self, host_path: &str) -> PathBuf {
        self.root.join(host_path.trim_start_matches('/'))
    }

    /// The answers a fixture tree gives for what is not a file on a real host (NVML, statvfs,
    /// offloads, the kernel log).
    pub fn fixture_file(&self, name: &str) -> Option<PathBuf> {
        let path = self.root.join(".rampart-fixture").join(name);
        path.is_file().then_some(path)
    }

    pub fn exists(&self, host_path: &str) -> bool {
        self.resolve(host_path).exists()
    }

    pub fn read(&self, host_path: &str) -> Result<String, Unreadable> {
        std::fs::read_to_string(self.resolve(host_path)).map_err(|e| Unreadable {
            path: host_path.to_string(),
            reason: io_reason(&e),
        })
    }

    /// The file's content, trimmed: the shape of one sysctl or sysfs value.
    pub fn value(&self, host_path: &str) -> Result<String, Unreadable> {
        self.read(host_path).map(|s| s.trim().to_string())
    }

    pub fn number(&self, host_path: &str) -> Result<i64, Unreadable> {
        let text = self.value(host_path)?;
        text.parse::<i64>().map_err(|_| Unreadable {
            path: host_path.to_string(),
            reason: format!("not a number: {text:?}"),
        })
    }

    /// The last `max_bytes` of a file (logs can be large; recent lines matter).
    pub fn tail(&self, host_path: &str, max_bytes: u64) -> Result<String, Unreadable> {
        let unreadable = |e: std::io::Error| Unreadable {
            path: host_path.to_string(),
            reason: io_reason(&e),
        };
        let mut file = std::fs::File::open(self.resolve(host_path)).map_err(unreadable)?;
        let len = file.metadata().map_err(unreadable)?.len();
        if len > max_bytes {
            file.seek(SeekFrom::Start(len - max_bytes))
                .map_err(unreadable)?;
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(unreadable)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Entry names of a directory, sorted; empty when it cannot be read.
    pub fn list(&self, host_dir: &str) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.resolve(host_dir)) else {
            return Vec::new();
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().into_string().ok())
            .collect();
        names.sort_by(|a, b| natural_order(a, b));
        names
    }

    /// The last component of a symbolic link's target (sysfs links devices to their parents).
    pub fn link_target(&self, host_path: &str) -> Option<PathBuf> {
        std::fs::read_link(self.resolve(host_path)).ok()
    }
}

pub(crate) fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => e.to_string(),
    }
}

/// `cpu10` after `cpu9`: names compared by their digit runs as numbers.
pub(crate) fn natural_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn key(s: &str) -> (String, u64) {
        let digits: String = s.chars().rev().take_while(|c| c.is_ascii_digit()).collect();
        let stem = &s[..s.len() - digits.len()];
        let number = digits
            .chars()
            .rev()
            .collect::<String>()
            .parse()
            .unwrap_or(0);
        (stem.to_string(), number)
    }
    key(a).cmp(&key(b)).then_with(|| a.cmp(b))
}

/// A kernel CPU list (`0-3,8,10-11`) as CPU numbers.
pub(crate) fn parse_cpu_list(text: &str) -> Vec<u32> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
                    // A hostile or broken file cannot make us allocate without bound.
                    if b >= a && b - a < 65_536 {
                        cpus.extend(a..=b);
                    }
                }
            }
            None => {
                if let Ok(n) = part.trim().parse() {
                    cpus.push(n);
                }
            }
        }
    }
    cpus
}

/// A CPU list back in the kernel's short form.
pub(crate) fn format_cpu_list(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        let mut end = start;
        while i + 1 < sorted.len() && sorted[i + 1] == end + 1 {
            i += 1;
            end = sorted[i];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    parts.join(",")
}

/// Bytes in the units people read (`23.5 GiB`).
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `/proc/meminfo`-style `Key: 123 kB` lines as bytes (counts without a unit stay counts).
pub(crate) fn parse_kv_sizes(text: &str) -> std::collections::BTreeMap<String, u64> {
    let mut map = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some((key, rest)) = line.split_once(':') else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let Some(Ok(number)) = words.next().map(str::parse::<u64>) else {
            continue;
        };
        let value = match words.next() {
            Some("kB") => number.saturating_mul(1024),
            _ => number,
        };
        map.insert(key.trim().to_string(), value);
    }
    map
}

/// A dotted version (`6.8.0-45-generic`, `550.54.15`) as numbers, up to the first non-digit.
pub(crate) fn parse_version(text: &str) -> Vec<u64> {
    let mut parts = Vec::new();
    for piece in text.trim().split('.') {
        let digits: String = piece.chars().take_while(|c| c.is_ascii_digit()).collect();
        if digits.is_empty() {
            break;
        }
        parts.push(digits.parse().unwrap_or(0));
        if digits.len() != piece.len() {
            break;
        }
    }
    parts
}

/// Compares versions component by component, missing components counting as 0.
pub(crate) fn version_cmp(a: &[u64], b: &[u64]) -> std::cmp::Ordering {
    let len = a.len().max(b.len());
    for i in 0..len {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        match x.cmp(&y) {
            std::cmp::Ordering::Equal => continue,
            other => return other,
        }
    }
    std::cmp::Ordering::Equal
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_round_trip() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(format_cpu_list(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(parse_cpu_list(""), Vec::<u32>::new());
        assert_eq!(parse_cpu_list("5-2,x"), Vec::<u32>::new());
    }

    #[test]
    fn versions_compare_by_number() {
        assert_eq!(parse_version("6.8.0-45-generic"), vec![6, 8, 0]);
        assert_eq!(parse_version("550.54.15"), vec![550, 54, 15]);
        assert_eq!(parse_version("5.15.0-rc1"), vec![5, 15, 0]);
        assert!(version_cmp(&[570, 26], &[570, 26, 0]).is_eq());
        assert!(version_cmp(&[525, 60, 13], &[525, 105, 17]).is_lt());
    }

    #[test]
    fn names_sort_naturally() {
        let mut names = vec!["cpu10", "cpu2", "cpu1"];
        names.sort_by(|a, b| natural_order(a, b));
        assert_eq!(names, vec!["cpu1", "cpu2", "cpu10"]);
    }

    #[test]
    fn meminfo_sizes_are_bytes() {
        let map = parse_kv_sizes("MemTotal:  1024 kB\nHugePages_Total:   4\n");
        assert_eq!(map["MemTotal"], 1024 * 1024);
        assert_eq!(map["HugePages_Total"], 4);
    }
}
