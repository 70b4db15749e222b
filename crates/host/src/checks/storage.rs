//! Storage: the I/O scheduler and read-ahead of the device holding the repository, room for
//! the repository, the audit log and the cache, mount options, I/O pressure.

use super::{pressure_some_avg10, CheckSpec, Env};
use crate::mounts::{
    block_device, host_view, is_network_fs, mount_for, space, Mount, NoBlockDevice,
};
use crate::report::{Area, Check};
use crate::tree::{human_bytes, Unreadable};
use std::path::Path;

const SCHEDULER: CheckSpec = CheckSpec {
    id: "storage.scheduler",
    area: Area::Storage,
    reads: "/proc/self/mountinfo; /sys/block/<disk>/queue/{scheduler,rotational} of the repository's device",
    expected: "none for NVMe; mq-deadline or none for other SSDs",
    why: "NVMe devices have deep hardware queues: a software scheduler adds CPU cost and latency \
          per request and no benefit. Kernel doc block/blk-mq.rst; Red Hat's storage guide \
          recommends none for NVMe, mq-deadline for SATA SSDs and disks.",
};

const READ_AHEAD: CheckSpec = CheckSpec {
    id: "storage.read_ahead",
    area: Area::Storage,
    reads: "/sys/block/<disk>/queue/read_ahead_kb of the repository's device",
    expected: "≥ 1024 KiB (tuned's throughput-performance sets 4096)",
    why: "Model files are read sequentially when loaded or faulted in through mmap; a larger \
          read-ahead turns that into fewer, larger I/Os. tuned's throughput-performance profile \
          sets readahead=4096 (KiB).",
};

const REPOSITORY_SPACE: CheckSpec = CheckSpec {
    id: "storage.repository_space",
    area: Area::Storage,
    reads: "statvfs of the repository directory",
    expected: "≥ 10 GiB and ≥ 5 % free",
    why: "An import writes a whole version before it verifies and serves; a full volume fails \
          imports half way. mistral.rs's doctor warns below 10 GiB on its model cache.",
};

const AUDIT_SPACE: CheckSpec = CheckSpec {
    id: "storage.audit_space",
    area: Area::Storage,
    reads: "statvfs of the audit directory",
    expected: "≥ 10 GiB and ≥ 5 % free",
    why: "Every request appends an audit entry with its full input and output; when the volume \
          fills, a fail-closed audit log answers 503 to every request (docs/audit.md).",
};

const CACHE_SPACE: CheckSpec = CheckSpec {
    id: "storage.cache_space",
    area: Area::Storage,
    reads: "statvfs of the cache directory",
    expected: "≥ 10 GiB and ≥ 5 % free",
    why: "Quantized weights and downloads are written to the cache before use; a full volume \
          fails a model load that needs them.",
};

const MOUNT_OPTIONS: CheckSpec = CheckSpec {
    id: "storage.mount_options",
    area: Area::Storage,
    reads: "/proc/self/mountinfo (options and file system type of each directory's mount)",
    expected: "relatime or noatime; the audit log writable, local and without `sync`",
    why: "Strict atime writes an inode on every read of a model file; `sync` makes every audit \
          append synchronous on top of the log's own fsync; a network file system turns mmap \
          page faults into round trips and weakens fsync guarantees. man 8 mount, man 5 nfs.",
};

const PRESSURE: CheckSpec = CheckSpec {
    id: "storage.pressure",
    area: Area::Storage,
    reads: "/proc/pressure/io",
    expected: "some avg10 < 20 %",
    why: "The share of the last 10 s in which some task waited for I/O: loads, audit appends \
          and page faults on weights are queuing. Kernel doc accounting/psi.rst.",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &SCHEDULER,
    &READ_AHEAD,
    &REPOSITORY_SPACE,
    &AUDIT_SPACE,
    &CACHE_SPACE,
    &MOUNT_OPTIONS,
    &PRESSURE,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let ctx = env.ctx;
    let mut out = Vec::new();
    let repository = ctx.repository_dir.as_deref();
    let device = repository.map(|dir| repository_device(env, dir));
    out.push(scheduler(env, device.as_ref()));
    out.push(read_ahead(env, device.as_ref()));
    out.push(free_space(env, &REPOSITORY_SPACE, "repository", repository));
    out.push(free_space(
        env,
        &AUDIT_SPACE,
        "audit",
        ctx.audit_dir.as_deref(),
    ));
    out.push(free_space(
        env,
        &CACHE_SPACE,
        "cache",
        ctx.cache_dir.as_deref(),
    ));
    out.extend(mount_options(env));
    out.push(match pressure_some_avg10(env, "io") {
        Err(e) => PRESSURE.unknown(e),
        Ok(v) if v >= 20.0 => PRESSURE.warn(
            format!("some avg10 {v:.1} %"),
            "# see what waits for I/O: iostat -x 1 (sysstat) or iotop",
        ),
        Ok(v) => PRESSURE.ok(format!("some avg10 {v:.1} %")),
    });
    out
}

/// Why the repository's disk cannot be named.
#[derive(Debug, thiserror::Error)]
enum DeviceError {
    #[error(transparent)]
    Mounts(#[from] Unreadable),
    #[error("no mount holds {0}")]
    NoMount(String),
    #[error(transparent)]
    NoBlockDevice(#[from] NoBlockDevice),
}

/// The repository's disk as `/sys/block` names it, or why it cannot be named.
fn repository_device(env: &Env, dir: &Path) -> Result<(String, String), DeviceError> {
    let mounts = env.mounts.as_ref().map_err(|e| e.clone())?;
    let view = host_view(&env.tree, dir);
    let mount = mount_for(mounts, &view).ok_or_else(|| DeviceError::NoMount(view.clone()))?;
    let disk = block_device(&env.tree, mount)?;
    Ok((disk, view))
}

fn scheduler(env: &Env, device: Option<&Result<(String, String), DeviceError>>) -> Check {
    let (disk, view) = match device {
        None => return SCHEDULER.unknown("no repository directory given"),
        Some(Err(e)) => return SCHEDULER.unknown(e),
        Some(Ok(d)) => d,
    };
    let path = format!("/sys/block/{disk}/queue/scheduler");
    let text = match env.tree.value(&path) {
        Ok(t) => t,
        Err(e) => return SCHEDULER.unknown(e),
    };
    let chosen = super::memory::selected(&text).unwrap_or_else(|| text.clone());
    let rotational = env
        .tree
        .number(&format!("/sys/block/{disk}/queue/rotational"))
        .map(|r| r == 1)
        .unwrap_or(false);
    let kind = if disk.starts_with("nvme") {
        "NVMe"
    } else if rotational {
        "rotational (or a VM disk that says so)"
    } else {
        "non-rotational"
    };
    let observed = format!("{view} on {disk} ({kind}): {chosen}");
    let fix = format!(
        "echo none > {path}\n# persist with a udev rule:\necho 'ACTION==\"add|change\", KERNEL==\"nvme[0-9]*n[0-9]*\", ATTR{{queue/scheduler}}=\"none\"' > /etc/udev/rules.d/60-rampart-scheduler.rules"
    );
    if disk.starts_with("nvme") && chosen != "none" {
        SCHEDULER.warn(observed, fix)
    } else {
        SCHEDULER.ok(observed)
    }
}

fn read_ahead(env: &Env, device: Option<&Result<(String, String), DeviceError>>) -> Check {
    let (disk, view) = match device {
        None => return READ_AHEAD.unknown("no repository directory given"),
        Some(Err(e)) => return READ_AHEAD.unknown(e),
        Some(Ok(d)) => d,
    };
    let path = format!("/sys/block/{disk}/queue/read_ahead_kb");
    match env.tree.number(&path) {
        Err(e) => READ_AHEAD.unknown(e),
        Ok(kb) if kb >= 1024 => READ_AHEAD.ok(format!("{view} on {disk}: {kb} KiB")),
        Ok(kb) => READ_AHEAD.warn(
            format!("{view} on {disk}: {kb} KiB"),
            format!("echo 4096 > {path}\n# persist with a udev rule (ATTR{{queue/read_ahead_kb}}=\"4096\") or tuned's throughput-performance profile"),
        ),
    }
}

const GIB: u64 = 1 << 30;

fn free_space(env: &Env, spec: &CheckSpec, role: &str, dir: Option<&Path>) -> Check {
    let Some(dir) = dir else {
        return spec.unknown(format!("no {role} directory given"));
    };
    let view = host_view(&env.tree, dir);
    let mount = env.mounts.as_ref().ok().and_then(|m| mount_for(m, &view));
    let space = match space(&env.tree, dir, mount) {
        Ok(s) => s,
        Err(e) => return spec.unknown(e),
    };
    let percent = if space.total_bytes > 0 {
        space.available_bytes as f64 * 100.0 / space.total_bytes as f64
    } else {
        0.0
    };
    let on = mount
        .map(|m| format!(" on {} ({})", m.mount_point, m.fs_type))
        .unwrap_or_default();
    let observed = format!(
        "{view}{on}: {} free of {} ({percent:.0} %)",
        human_bytes(space.available_bytes),
        human_bytes(space.total_bytes)
    );
    let fix = format!("# free space on that volume, or move the {role} directory to a larger one");
    if space.available_bytes < GIB {
        spec.error(observed, fix)
    } else if space.available_bytes < 10 * GIB || percent < 5.0 {
        spec.warn(observed, fix)
    } else {
        spec.ok(observed)
    }
}

fn mount_options(env: &Env) -> Vec<Check> {
    let ctx = env.ctx;
    let dirs: Vec<(&str, &Path)> = [
        ("repository", ctx.repository_dir.as_deref()),
        ("audit", ctx.audit_dir.as_deref()),
        ("cache", ctx.cache_dir.as_deref()),
    ]
    .into_iter()
    .filter_map(|(role, dir)| dir.map(|d| (role, d)))
    .collect();
    if dirs.is_empty() {
        return vec![MOUNT_OPTIONS.unknown("no repository, audit or cache directory given")];
    }
    let mounts = match &env.mounts {
        Ok(m) => m,
        Err(e) => return vec![MOUNT_OPTIONS.unknown(e)],
    };
    dirs.into_iter()
        .map(|(role, dir)| {
            let view = host_view(&env.tree, dir);
            let Some(mount) = mount_for(mounts, &view) else {
                return MOUNT_OPTIONS
                    .unknown(format!("no mount holds {view}"))
                    .on(role);
            };
            judge_mount(role, &view, mount).on(role)
        })
        .collect()
}

fn judge_mount(role: &str, view: &str, mount: &Mount) -> Check {
    let observed = format!(
        "{view} on {} ({}, {})",
        mount.mount_point,
        mount.fs_type,
        mount.options.join(",")
    );
    let remount = |option: &str| {
        format!(
            "mount -o remount,{option} {}\n# and set the option in /etc/fstab",
            mount.mount_point
        )
    };
    if role == "audit" && mount.options.iter().any(|o| o == "ro") {
        return MOUNT_OPTIONS.error(format!("{observed}: read-only"), remount("rw"));
    }
    if role == "audit" && (mount.has_option("sync") || mount.has_option("dirsync")) {
        return MOUNT_OPTIONS.warn(format!("{observed}: synchronous writes"), remount("async"));
    }
    if is_network_fs(&mount.fs_type) {
        return MOUNT_OPTIONS.warn(
            format!("{observed}: network file system"),
            format!("# keep the {role} directory on a local disk (copy models in; ship the audit log with [audit.s3])"),
        );
    }
    let atime_managed = ["noatime", "relatime", "nodiratime"]
        .iter()
        .any(|o| mount.has_option(o))
        || matches!(
            mount.fs_type.as_str(),
            "tmpfs" | "overlay" | "proc" | "sysfs"
        )
        || mount.options.iter().any(|o| o == "ro");
    if !atime_managed {
        return MOUNT_OPTIONS.warn(format!("{observed}: strict atime"), remount("relatime"));
    }
    MOUNT_OPTIONS.ok(observed)
}
