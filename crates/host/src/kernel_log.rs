//! NVIDIA XID errors from the kernel log (`NVRM: Xid (PCI:0000:3b:00): 79, pid=…, …`).
//!
//! Reading the log needs CAP_SYSLOG when `kernel.dmesg_restrict` is 1, so an unreadable log is
//! reported as such, never as "no errors".

use crate::tree::HostTree;
use std::collections::BTreeMap;
use std::io::Read;

/// Log files are read from their end: recent lines matter and files can be large.
const LOG_TAIL_BYTES: u64 = 8 << 20;

/// Why no kernel log could be read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum KernelLogError {
    /// The fixture's `dmesg.txt` exists but could not be read.
    #[error("{path}: {source}")]
    Fixture {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Every log tried was unreadable: which, and why (`/dev/kmsg (permission denied), ...`).
    #[error("kernel log not readable: {tried}{restrict}")]
    NotReadable { tried: String, restrict: String },
}

pub(crate) struct KernelLog {
    /// Where the lines came from (`/dev/kmsg`, `/var/log/kern.log`, a fixture file).
    pub source: String,
    pub text: String,
}

/// The first readable kernel log: a fixture's `dmesg.txt`, `/dev/kmsg` on a real host, then the
/// syslog files. `Err` lists what was tried.
pub(crate) fn read(tree: &HostTree) -> Result<KernelLog, KernelLogError> {
    if let Some(path) = tree.fixture_file("dmesg.txt") {
        return std::fs::read_to_string(&path)
            .map(|text| KernelLog {
                source: ".rampart-fixture/dmesg.txt".into(),
                text,
            })
            .map_err(|source| KernelLogError::Fixture {
                path: path.display().to_string(),
                source,
            });
    }
    let mut tried = Vec::new();
    if tree.is_real_host() {
        match read_kmsg() {
            Ok(text) => {
                return Ok(KernelLog {
                    source: "/dev/kmsg".into(),
                    text,
                })
            }
            Err(e) => tried.push(format!("/dev/kmsg ({})", crate::tree::io_reason(&e))),
        }
    }
    for path in ["/var/log/kern.log", "/var/log/messages", "/var/log/syslog"] {
        match tree.tail(path, LOG_TAIL_BYTES) {
            Ok(text) => {
                return Ok(KernelLog {
                    source: path.into(),
                    text,
                })
            }
            Err(e) => tried.push(format!("{path} ({})", e.reason)),
        }
    }
    let restrict = tree
        .value("/proc/sys/kernel/dmesg_restrict")
        .ok()
        .map(|v| format!("; kernel.dmesg_restrict = {v}"))
        .unwrap_or_default();
    Err(KernelLogError::NotReadable {
        tried: tried.join(", "),
        restrict,
    })
}

/// Every record in the kernel's ring buffer, without blocking: a read past the last record
/// answers EAGAIN.
fn read_kmsg() -> std::io::Result<String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/dev/kmsg")?;
    let mut text = String::new();
    // One record per read; 8 KiB is larger than any record (the kernel caps them near 1 KiB).
    let mut buffer = vec![0u8; 8192];
    // The ring buffer is bounded, so this ends; the cap guards against a device that never
    // answers EAGAIN.
    for _ in 0..200_000 {
        match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => {
                let record = String::from_utf8_lossy(&buffer[..n]);
                // "prio,seq,time,flags;message"
                let message = record.split_once(';').map_or(&*record, |(_, m)| m);
                text.push_str(message.lines().next().unwrap_or(""));
                text.push('\n');
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            // A record overwritten while we read: skip to the next.
            Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(text)
}

/// XID counts by (PCI device, code), and the last message of each.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct XidSummary {
    pub counts: BTreeMap<(String, u32), usize>,
    pub last_message: BTreeMap<u32, String>,
}

pub(crate) fn scan_xids(text: &str) -> XidSummary {
    let mut summary = XidSummary::default();
    for line in text.lines() {
        let Some(at) = line.find("NVRM: Xid (") else {
            continue;
        };
        let rest = &line[at + "NVRM: Xid (".len()..];
        let Some((device, after)) = rest.split_once(')') else {
            continue;
        };
        let after = after.trim_start_matches(':').trim_start();
        let digits: String = after.chars().take_while(|c| c.is_ascii_digit()).collect();
        let Ok(code) = digits.parse::<u32>() else {
            continue;
        };
        let device = device.trim_start_matches("PCI:").to_string();
        *summary.counts.entry((device, code)).or_default() += 1;
        summary
            .last_message
            .insert(code, after.chars().take(160).collect());
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_xids_by_device_and_code() {
        let log = "[  12.1] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus.\n\
                   [  13.0] NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.\n\
                   [  14.0] NVRM: Xid (PCI:0000:86:00): 13, pid=99, Graphics Exception\n\
                   [  15.0] nvidia-modeset: unrelated\n";
        let summary = scan_xids(log);
        assert_eq!(summary.counts[&("0000:3b:00".to_string(), 79)], 2);
        assert_eq!(summary.counts[&("0000:86:00".to_string(), 13)], 1);
        assert_eq!(summary.counts.len(), 2);
    }
}
