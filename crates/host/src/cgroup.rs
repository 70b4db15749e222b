//! The control group this process runs in (v2, v1, or both) and the limits it sets: they
//! decide what a server in a container may use, whatever the machine has.

use crate::mounts::Mount;
use crate::tree::{parse_cpu_list, HostTree, Unreadable};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CgroupVersion {
    V2,
    V1,
    /// v1 controllers with a v2 hierarchy beside them (often holding none).
    Hybrid,
}

impl CgroupVersion {
    pub fn name(self) -> &'static str {
        match self {
            CgroupVersion::V2 => "v2",
            CgroupVersion::V1 => "v1",
            CgroupVersion::Hybrid => "hybrid (v1 controllers, v2 beside them)",
        }
    }
}

/// Values read from the cgroup; each one `None` when no limit is set, `Err` when unreadable.
#[derive(Clone, Debug)]
pub(crate) struct Cgroup {
    pub version: Result<CgroupVersion, Unreadable>,
    /// The tightest memory limit on the path to the root of the hierarchy.
    pub memory_limit_bytes: Result<Option<u64>, Unreadable>,
    pub memory_current_bytes: Option<u64>,
    /// CPU quota in CPUs (`cpu.max` 200000 100000 → 2.0), tightest on the path.
    pub cpu_quota: Result<Option<f64>, Unreadable>,
    pub cpuset: Option<Vec<u32>>,
    pub oom_kills: Option<u64>,
    /// Where the values came from, for the observed text.
    pub memory_path: Option<String>,
    pub cpu_path: Option<String>,
}

/// v1 writes "no limit" as a page-rounded i64::MAX; anything this large is no limit.
const NO_LIMIT_V1: u64 = 1 << 60;

struct Line {
    controllers: Vec<String>,
    path: String,
}

impl Cgroup {
    pub fn read(tree: &HostTree, mounts: &[Mount]) -> Cgroup {
        let lines = match tree.read("/proc/self/cgroup") {
            Ok(text) => parse_proc_cgroup(&text),
            Err(e) => return Cgroup::unreadable(e),
        };
        let v2_line = lines.iter().find(|l| l.controllers.is_empty());
        let v1_lines: Vec<&Line> = lines.iter().filter(|l| !l.controllers.is_empty()).collect();
        let v2_mount = mounts.iter().find(|m| m.fs_type == "cgroup2");
        let v2_dir = match (v2_line, v2_mount) {
            (Some(line), Some(mount)) => Some(join_cgroup(mount, &line.path)),
            _ => None,
        };
        let version = match (v2_dir.is_some(), v1_lines.is_empty()) {
            (true, true) => Ok(CgroupVersion::V2),
            (true, false) => Ok(CgroupVersion::Hybrid),
            (false, false) => Ok(CgroupVersion::V1),
            (false, true) => Err(Unreadable {
                path: "/proc/self/cgroup".into(),
                reason: "no cgroup hierarchy is mounted".into(),
            }),
        };
        let v1_dir = |controller: &str| -> Option<(String, String)> {
            let line = v1_lines
                .iter()
                .find(|l| l.controllers.iter().any(|c| c == controller))?;
            let mount = mounts.iter().find(|m| {
                m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == controller)
            })?;
            Some((mount.mount_point.clone(), join_cgroup(mount, &line.path)))
        };
        let v2_controllers = v2_dir
            .as_ref()
            .and_then(|d| tree.value(&format!("{d}/cgroup.controllers")).ok())
            .unwrap_or_default();
        let v2_has = |c: &str| v2_controllers.split_whitespace().any(|x| x == c);
        let v2_top = v2_mount.map(|m| m.mount_point.clone());

        let mut cgroup = Cgroup {
            version,
            memory_limit_bytes: Ok(None),
            memory_current_bytes: None,
            cpu_quota: Ok(None),
            cpuset: None,
            oom_kills: None,
            memory_path: None,
            cpu_path: None,
        };

        // Memory.
        if let (Some(dir), Some(top), true) = (&v2_dir, &v2_top, v2_has("memory")) {
            cgroup.memory_limit_bytes = tightest(tree, dir, top, "memory.max", |t| {
                if t == "max" {
                    Some(None)
                } else {
                    t.parse().ok().map(Some)
                }
            });
            cgroup.memory_current_bytes = tree
                .value(&format!("{dir}/memory.current"))
                .ok()
                .and_then(|t| t.parse().ok());
            cgroup.oom_kills = tree
                .read(&format!("{dir}/memory.events"))
                .ok()
                .and_then(|t| field(&t, "oom_kill"));
            cgroup.memory_path = Some(format!("{dir}/memory.max"));
        } else if let Some((top, dir)) = v1_dir("memory") {
            cgroup.memory_limit_bytes = tightest(tree, &dir, &top, "memory.limit_in_bytes", |t| {
                t.parse::<u64>()
                    .ok()
                    .map(|v| (v < NO_LIMIT_V1).then_some(v))
            });
            cgroup.memory_current_bytes = tree
                .value(&format!("{dir}/memory.usage_in_bytes"))
                .ok()
                .and_then(|t| t.parse().ok());
            cgroup.oom_kills = tree
                .read(&format!("{dir}/memory.oom_control"))
                .ok()
                .and_then(|t| field(&t, "oom_kill"));
            cgroup.memory_path = Some(format!("{dir}/memory.limit_in_bytes"));
        }

        // CPU quota.
        if let (Some(dir), Some(top), true) = (&v2_dir, &v2_top, v2_has("cpu")) {
            cgroup.cpu_quota = tightest_f64(tree, dir, top, "cpu.max", |t| {
                let mut parts = t.split_whitespace();
                let quota = parts.next()?;
                let period: f64 = parts.next().unwrap_or("100000").parse().ok()?;
                if quota == "max" {
                    return Some(None);
                }
                let quota: f64 = quota.parse().ok()?;
                (period > 0.0).then_some(Some(quota / period))
            });
            cgroup.cpu_path = Some(format!("{dir}/cpu.max"));
        } else if let Some((top, dir)) = v1_dir("cpu") {
            cgroup.cpu_quota = tightest_f64(tree, &dir, &top, "cpu.cfs_quota_us", |t| {
                let quota: i64 = t.parse().ok()?;
                if quota < 0 {
                    return Some(None);
                }
                Some(Some(quota as f64))
            })
            .map(|q| {
                let period = tree
                    .number(&format!("{dir}/cpu.cfs_period_us"))
                    .unwrap_or(100_000)
                    .max(1) as f64;
                q.map(|q| q / period)
            });
            cgroup.cpu_path = Some(format!("{dir}/cpu.cfs_quota_us"));
        }

        // CPU set.
        if let (Some(dir), true) = (&v2_dir, v2_has("cpuset")) {
            cgroup.cpuset = tree
                .value(&format!("{dir}/cpuset.cpus.effective"))
                .ok()
                .map(|t| parse_cpu_list(&t))
                .filter(|c| !c.is_empty());
        } else if let Some((_, dir)) = v1_dir("cpuset") {
            cgroup.cpuset = tree
                .value(&format!("{dir}/cpuset.effective_cpus"))
                .or_else(|_| tree.value(&format!("{dir}/cpuset.cpus")))
                .ok()
                .map(|t| parse_cpu_list(&t))
                .filter(|c| !c.is_empty());
        }
        cgroup
    }

    fn unreadable(e: Unreadable) -> Cgroup {
        Cgroup {
            version: Err(e.clone()),
            memory_limit_bytes: Err(e.clone()),
            memory_current_bytes: None,
            cpu_quota: Err(e),
            cpuset: None,
            oom_kills: None,
            memory_path: None,
            cpu_path: None,
        }
    }
}

/// Where this process's cgroup files are, found once so each telemetry reading only reads
/// the counters. v2 when the process has a v2 cgroup with the controller, else v1.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct CgroupDirs {
    /// The v2 directory, when the process has one (`/sys/fs/cgroup/system.slice/x.service`).
    pub v2: Option<String>,
    /// The v2 controllers enabled there (`cpu memory io …`).
    pub v2_controllers: Vec<String>,
    pub v1_memory: Option<String>,
    pub v1_cpu: Option<String>,
    pub v1_cpuacct: Option<String>,
}

impl CgroupDirs {
    pub fn locate(tree: &HostTree, mounts: &[Mount]) -> CgroupDirs {
        let Ok(text) = tree.read("/proc/self/cgroup") else {
            return CgroupDirs::default();
        };
        let lines = parse_proc_cgroup(&text);
        let v2 = lines
            .iter()
            .find(|l| l.controllers.is_empty())
            .zip(mounts.iter().find(|m| m.fs_type == "cgroup2"))
            .map(|(line, mount)| join_cgroup(mount, &line.path));
        let v2_controllers = v2
            .as_ref()
            .and_then(|d| tree.value(&format!("{d}/cgroup.controllers")).ok())
            .map(|t| t.split_whitespace().map(String::from).collect())
            .unwrap_or_default();
        let v1 = |controller: &str| -> Option<String> {
            let line = lines
                .iter()
                .find(|l| l.controllers.iter().any(|c| c == controller))?;
            let mount = mounts.iter().find(|m| {
                m.fs_type == "cgroup" && m.super_options.iter().any(|o| o == controller)
            })?;
            Some(join_cgroup(mount, &line.path))
        };
        CgroupDirs {
            v2,
            v2_controllers,
            v1_memory: v1("memory"),
            v1_cpu: v1("cpu"),
            v1_cpuacct: v1("cpuacct"),
        }
    }

    /// The v2 directory when it has `controller` enabled.
    pub fn v2_with(&self, controller: &str) -> Option<&str> {
        self.v2
            .as_deref()
            .filter(|_| self.v2_controllers.iter().any(|c| c == controller))
    }
}

/// `v1` writes "no limit" as a page-rounded i64::MAX.
pub(crate) fn v1_limit(value: u64) -> Option<u64> {
    (value < NO_LIMIT_V1).then_some(value)
}

/// `key value` lines, all of them.
pub(crate) fn fields(text: &str) -> impl Iterator<Item = (&str, u64)> {
    text.lines().filter_map(|line| {
        let (k, v) = line.split_once(' ')?;
        Some((k, v.trim().parse().ok()?))
    })
}

fn parse_proc_cgroup(text: &str) -> Vec<Line> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?.to_string();
            Some(Line {
                controllers: controllers
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(String::from)
                    .collect(),
                path,
            })
        })
        .collect()
}

/// The directory of a cgroup path under a mount. In a container the mount's root is the
/// container's own cgroup, so that prefix is not repeated.
fn join_cgroup(mount: &Mount, path: &str) -> String {
    let relative = path
        .strip_prefix(mount.root.as_str())
        .filter(|_| mount.root != "/")
        .unwrap_or(path);
    let relative = relative.trim_start_matches('/');
    let point = mount.mount_point.trim_end_matches('/');
    if relative.is_empty() {
        point.to_string()
    } else {
        format!("{point}/{relative}")
    }
}

/// Reads `file` in `dir` and each parent up to `top`, keeping the smallest limit. The cgroup's
/// own file must be readable (a parent may not exist in a container's view).
fn tightest(
    tree: &HostTree,
    dir: &str,
    top: &str,
    file: &str,
    parse: impl Fn(&str) -> Option<Option<u64>>,
) -> Result<Option<u64>, Unreadable> {
    let own = format!("{dir}/{file}");
    let text = tree.value(&own)?;
    let mut best = parse(&text).ok_or_else(|| Unreadable {
        path: own.clone(),
        reason: format!("unexpected value {text:?}"),
    })?;
    let mut current = dir.to_string();
    while current.len() > top.len() {
        let Some((parent, _)) = current.rsplit_once('/') else {
            break;
        };
        current = parent.to_string();
        if let Some(Some(limit)) = tree
            .value(&format!("{current}/{file}"))
            .ok()
            .and_then(|t| parse(&t))
        {
            best = Some(best.map_or(limit, |b| b.min(limit)));
        }
    }
    Ok(best)
}

fn tightest_f64(
    tree: &HostTree,
    dir: &str,
    top: &str,
    file: &str,
    parse: impl Fn(&str) -> Option<Option<f64>>,
) -> Result<Option<f64>, Unreadable> {
    // Quotas are compared as micro-CPUs so the u64 walk above serves both.
    tightest(tree, dir, top, file, |t| {
        parse(t).map(|q| q.map(|q| (q * 1_000_000.0).round().max(0.0) as u64))
    })
    .map(|q| q.map(|q| q as f64 / 1_000_000.0))
}

/// `key value` lines (memory.events, memory.oom_control).
fn field(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn joins_paths_inside_containers() {
        let mount = Mount {
            mount_point: "/sys/fs/cgroup".into(),
            root: "/kubepods/pod1".into(),
            major_minor: "0:30".into(),
            fs_type: "cgroup2".into(),
            source: "cgroup2".into(),
            options: vec![],
            super_options: vec![],
        };
        assert_eq!(join_cgroup(&mount, "/kubepods/pod1"), "/sys/fs/cgroup");
        assert_eq!(join_cgroup(&mount, "/"), "/sys/fs/cgroup");
        let host = Mount {
            root: "/".into(),
            ..mount
        };
        assert_eq!(
            join_cgroup(&host, "/system.slice/rampart.service"),
            "/sys/fs/cgroup/system.slice/rampart.service"
        );
    }
}
