//! Which file system and block device hold a directory, and how much room is left on it.

use crate::tree::{HostTree, Unreadable};
use std::path::{Path, PathBuf};

/// One line of `/proc/self/mountinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mount {
    /// The directory the file system is mounted on, in the mount namespace's view.
    pub mount_point: String,
    /// The subtree of the file system that is mounted there (cgroup mounts in containers).
    pub root: String,
    pub major_minor: String,
    pub fs_type: String,
    pub source: String,
    /// Per-mount options, then the file system's own.
    pub options: Vec<String>,
    pub super_options: Vec<String>,
}

impl Mount {
    pub fn has_option(&self, option: &str) -> bool {
        self.options.iter().any(|o| o == option) || self.super_options.iter().any(|o| o == option)
    }
}

pub(crate) fn read_mounts(tree: &HostTree) -> Result<Vec<Mount>, Unreadable> {
    tree.read("/proc/self/mountinfo")
        .map(|t| parse_mountinfo(&t))
}

pub(crate) fn parse_mountinfo(text: &str) -> Vec<Mount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if dash < 6 || fields.len() < dash + 3 {
            continue;
        }
        mounts.push(Mount {
            major_minor: fields[2].to_string(),
            root: unescape(fields[3]),
            mount_point: unescape(fields[4]),
            options: fields[5].split(',').map(String::from).collect(),
            fs_type: fields[dash + 1].to_string(),
            source: unescape(fields[dash + 2]),
            super_options: fields
                .get(dash + 3)
                .map(|o| o.split(',').map(String::from).collect())
                .unwrap_or_default(),
        });
    }
    mounts
}

/// mountinfo writes space, tab, newline and backslash as `\040`-style octal escapes.
fn unescape(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..i + 4];
            if digits.iter().all(|b| (b'0'..=b'7').contains(b)) {
                let digits = std::str::from_utf8(digits).unwrap_or("0");
                if let Ok(value) = u8::from_str_radix(digits, 8) {
                    out.push(value);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The mount that holds a path: the longest mount point that is a whole-component prefix.
/// Later mounts on the same point hide earlier ones, so the last such line wins.
pub(crate) fn mount_for<'a>(mounts: &'a [Mount], host_path: &str) -> Option<&'a Mount> {
    let mut best: Option<&Mount> = None;
    for mount in mounts {
        let point = mount.mount_point.trim_end_matches('/');
        let holds = point.is_empty()
            || host_path == point
            || host_path
                .strip_prefix(point)
                .is_some_and(|rest| rest.starts_with('/'));
        if holds && best.is_none_or(|b| point.len() >= b.mount_point.trim_end_matches('/').len()) {
            best = Some(mount);
        }
    }
    best
}

/// How a Rampart directory is named in the host's view: canonical on a real host, relative to
/// the root when it lies inside a fixture tree, as given otherwise.
pub(crate) fn host_view(tree: &HostTree, path: &Path) -> String {
    let existing = nearest_existing(path);
    let missing_tail = path.strip_prefix(&existing).ok().map(Path::to_path_buf);
    let mut absolute = std::fs::canonicalize(&existing).unwrap_or_else(|_| existing.clone());
    if let Some(tail) = missing_tail.filter(|t| !t.as_os_str().is_empty()) {
        absolute.push(tail);
    }
    if !tree.is_real_host() {
        let root = std::fs::canonicalize(tree.root()).unwrap_or_else(|_| tree.root().into());
        if let Ok(inside) = absolute.strip_prefix(&root) {
            return format!("/{}", inside.display());
        }
    }
    absolute.display().to_string()
}

/// The path itself when it exists, else its closest existing ancestor (a directory that
/// `serve` would create lives on the file system of its parent).
/// A relative path's last ancestor is the working directory (`audit`'s parent is `""`, which
/// names nothing: `.` does).
pub(crate) fn nearest_existing(path: &Path) -> PathBuf {
    let mut current = path.to_path_buf();
    loop {
        if current.exists() {
            return current;
        }
        match current.parent() {
            Some(parent) if parent.as_os_str().is_empty() => return PathBuf::from("."),
            Some(parent) if parent != current => current = parent.to_path_buf(),
            _ => return path.to_path_buf(),
        }
    }
}

/// Why a mount has no block device we can name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NoBlockDevice {
    #[error(
        "on an overlay (a container layer): mount the directory from a volume to judge its device"
    )]
    Overlay,
    #[error("on {fs_type} (memory, no block device)")]
    Memory { fs_type: String },
    #[error("on a network file system ({fs_type})")]
    Network { fs_type: String },
    #[error("no block device found for {source_device} ({fs_type})")]
    NotFound {
        source_device: String,
        fs_type: String,
    },
}

/// Why the room on a file system is unknown.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SpaceError {
    #[error("the fixture tree has no .rampart-fixture/statvfs.json")]
    NoFixture,
    #[error(transparent)]
    FixtureRead(std::io::Error),
    #[error("statvfs.json: {0}")]
    FixtureJson(#[source] serde_json::Error),
    #[error("statvfs.json has no entry for {0}")]
    NoFixtureEntry(String),
    #[error("path holds a NUL byte")]
    NulInPath,
    #[error("statvfs({path}): {source}")]
    Statvfs {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The block device under a mount, as a `/sys/block/<disk>` directory name (the disk, not the
/// partition: the queue settings live on the disk).
pub(crate) fn block_device(tree: &HostTree, mount: &Mount) -> Result<String, NoBlockDevice> {
    let name = mount
        .source
        .strip_prefix("/dev/")
        .map(|n| n.rsplit('/').next().unwrap_or(n).to_string());
    if let Some(name) = &name {
        if tree.exists(&format!("/sys/block/{name}/queue")) {
            return Ok(name.clone());
        }
        for disk in tree.list("/sys/block") {
            if tree.exists(&format!("/sys/block/{disk}/{name}/partition")) {
                return Ok(disk);
            }
        }
    }
    // Device mapper and friends: /sys/dev/block/MAJ:MIN links to the device's directory.
    if let Some(target) = tree.link_target(&format!("/sys/dev/block/{}", mount.major_minor)) {
        let names: Vec<String> = target
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if let Some(last) = names.last() {
            if tree.exists(&format!("/sys/block/{last}/queue")) {
                return Ok(last.clone());
            }
            if names.len() >= 2 {
                let parent = &names[names.len() - 2];
                if tree.exists(&format!("/sys/block/{parent}/queue")) {
                    return Ok(parent.clone());
                }
            }
        }
    }
    let fs_type = mount.fs_type.clone();
    Err(match mount.fs_type.as_str() {
        "overlay" => NoBlockDevice::Overlay,
        "tmpfs" | "ramfs" => NoBlockDevice::Memory { fs_type },
        t if is_network_fs(t) => NoBlockDevice::Network { fs_type },
        _ => NoBlockDevice::NotFound {
            source_device: mount.source.clone(),
            fs_type,
        },
    })
}

pub(crate) fn is_network_fs(fs_type: &str) -> bool {
    matches!(
        fs_type,
        "nfs" | "nfs4" | "cifs" | "smb3" | "9p" | "ceph" | "glusterfs" | "lustre" | "virtiofs"
    ) || fs_type.starts_with("fuse")
}

/// Room on a file system.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
pub(crate) struct Space {
    pub total_bytes: u64,
    /// What an unprivileged process may still write (`f_bavail`).
    pub available_bytes: u64,
}

/// statvfs on a real host; on a fixture tree, `.rampart-fixture/statvfs.json` maps mount points
/// to their space.
pub(crate) fn space(
    tree: &HostTree,
    real_path: &Path,
    mount: Option<&Mount>,
) -> Result<Space, SpaceError> {
    if !tree.is_real_host() {
        let Some(file) = tree.fixture_file("statvfs.json") else {
            return Err(SpaceError::NoFixture);
        };
        let text = std::fs::read_to_string(&file).map_err(SpaceError::FixtureRead)?;
        let table: std::collections::BTreeMap<String, Space> =
            serde_json::from_str(&text).map_err(SpaceError::FixtureJson)?;
        let point = mount.map(|m| m.mount_point.as_str()).unwrap_or("/");
        return table
            .get(point)
            .copied()
            .ok_or_else(|| SpaceError::NoFixtureEntry(point.to_string()));
    }
    statvfs(&nearest_existing(real_path))
}

fn statvfs(path: &Path) -> Result<Space, SpaceError> {
    use std::os::unix::ffi::OsStrExt;
    let c_path =
        std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| SpaceError::NulInPath)?;
    // SAFETY: `libc::statvfs` is plain old data, so all-zero bytes are a valid value.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c_path` is a NUL-terminated string and `stat` a valid out-pointer; both live
    // across the call.
    let rc = unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) };
    if rc != 0 {
        return Err(SpaceError::Statvfs {
            path: path.display().to_string(),
            source: std::io::Error::last_os_error(),
        });
    }
    let block = stat.f_frsize as u64;
    Ok(Space {
        total_bytes: (stat.f_blocks as u64).saturating_mul(block),
        available_bytes: (stat.f_bavail as u64).saturating_mul(block),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 259:2 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p2 rw
23 22 0:21 / /proc rw,nosuid - proc proc rw
30 22 259:3 / /srv/models rw,noatime - xfs /dev/nvme1n1 rw,attr2
31 22 0:40 / /mnt/my\\040disk rw - nfs4 server:/x rw
";

    #[test]
    fn finds_the_longest_mount() {
        let mounts = parse_mountinfo(MOUNTINFO);
        assert_eq!(mounts.len(), 4);
        assert_eq!(mount_for(&mounts, "/srv/models/a").unwrap().fs_type, "xfs");
        assert_eq!(mount_for(&mounts, "/srv/modelsx").unwrap().fs_type, "ext4");
        assert_eq!(mount_for(&mounts, "/srv/models").unwrap().fs_type, "xfs");
        assert_eq!(mounts[3].mount_point, "/mnt/my disk");
        assert!(mounts[2].has_option("noatime"));
    }

    #[test]
    fn a_missing_relative_directory_lives_in_the_working_directory() {
        let dir = tempfile::tempdir().expect("temp dir");
        let inside = dir.path().join("a/b");
        assert_eq!(nearest_existing(&inside), dir.path());
        assert_eq!(
            nearest_existing(Path::new("rampart-no-such-dir/audit")),
            Path::new(".")
        );
        assert_eq!(
            nearest_existing(Path::new("rampart-no-such-dir")),
            Path::new(".")
        );
    }
}
