//! Shipped tables: which NVIDIA driver each CUDA release needs, kernel/driver combinations
//! known to misbehave, and what each XID error means. Each row names its source; rows without
//! a primary source say so, so nobody mistakes them for NVIDIA's word.

use crate::report::Status;
use crate::tree::{parse_version, version_cmp};
use std::cmp::Ordering;

/// The oldest Linux driver each CUDA toolkit release needs (its GA release).
pub struct CudaDriverRow {
    pub cuda: &'static str,
    pub min_driver: &'static str,
}

/// Source: NVIDIA CUDA Toolkit Release Notes, table "CUDA Toolkit and Corresponding Driver
/// Versions" (Linux x86_64, GA releases), as remembered for this table: verify against the
/// current notes before relying on a row near the edge.
pub const CUDA_DRIVERS: &[CudaDriverRow] = &[
    CudaDriverRow {
        cuda: "11.0",
        min_driver: "450.36.06",
    },
    CudaDriverRow {
        cuda: "11.1",
        min_driver: "455.23",
    },
    CudaDriverRow {
        cuda: "11.2",
        min_driver: "460.27.03",
    },
    CudaDriverRow {
        cuda: "11.3",
        min_driver: "465.19.01",
    },
    CudaDriverRow {
        cuda: "11.4",
        min_driver: "470.42.01",
    },
    CudaDriverRow {
        cuda: "11.5",
        min_driver: "495.29.05",
    },
    CudaDriverRow {
        cuda: "11.6",
        min_driver: "510.39.01",
    },
    CudaDriverRow {
        cuda: "11.7",
        min_driver: "515.43.04",
    },
    CudaDriverRow {
        cuda: "11.8",
        min_driver: "520.61.05",
    },
    CudaDriverRow {
        cuda: "12.0",
        min_driver: "525.60.13",
    },
    CudaDriverRow {
        cuda: "12.1",
        min_driver: "530.30.02",
    },
    CudaDriverRow {
        cuda: "12.2",
        min_driver: "535.54.03",
    },
    CudaDriverRow {
        cuda: "12.3",
        min_driver: "545.23.06",
    },
    CudaDriverRow {
        cuda: "12.4",
        min_driver: "550.54.14",
    },
    CudaDriverRow {
        cuda: "12.5",
        min_driver: "555.42.02",
    },
    CudaDriverRow {
        cuda: "12.6",
        min_driver: "560.28.03",
    },
    CudaDriverRow {
        cuda: "12.8",
        min_driver: "570.26",
    },
    CudaDriverRow {
        cuda: "12.9",
        min_driver: "575.51.03",
    },
    CudaDriverRow {
        cuda: "13.0",
        min_driver: "580.65.06",
    },
];

/// CUDA minor version compatibility: any toolkit of a major release runs on the oldest driver
/// of that major, without PTX JIT of newer PTX and without features that need a newer driver.
/// Source: CUDA Compatibility guide ("Minor Version Compatibility"), same caveat as above.
pub const CUDA_MINOR_COMPAT: &[CudaDriverRow] = &[
    CudaDriverRow {
        cuda: "11",
        min_driver: "450.80.02",
    },
    CudaDriverRow {
        cuda: "12",
        min_driver: "525.60.13",
    },
    CudaDriverRow {
        cuda: "13",
        min_driver: "580.65.06",
    },
];

/// What the table says about a driver for a CUDA version.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum CudaFit {
    /// At or above the GA driver of that release.
    Full,
    /// Only through minor version compatibility.
    MinorCompat {
        ga_driver: &'static str,
    },
    TooOld {
        needs: &'static str,
    },
    /// The table has no row for that version.
    NotInTable,
}

pub(crate) fn cuda_fit(driver: &str, cuda: &str) -> CudaFit {
    let driver = parse_version(driver);
    let wanted = parse_version(cuda);
    let Some(row) = CUDA_DRIVERS
        .iter()
        .find(|r| version_cmp(&parse_version(r.cuda), &wanted) == Ordering::Equal)
    else {
        return CudaFit::NotInTable;
    };
    if version_cmp(&driver, &parse_version(row.min_driver)) != Ordering::Less {
        return CudaFit::Full;
    }
    let major = wanted.first().copied().unwrap_or(0).to_string();
    match CUDA_MINOR_COMPAT.iter().find(|r| r.cuda == major) {
        Some(compat)
            if version_cmp(&driver, &parse_version(compat.min_driver)) != Ordering::Less =>
        {
            CudaFit::MinorCompat {
                ga_driver: row.min_driver,
            }
        }
        Some(compat) => CudaFit::TooOld {
            needs: compat.min_driver,
        },
        None => CudaFit::TooOld {
            needs: row.min_driver,
        },
    }
}

/// The newest CUDA release whose GA driver this driver meets.
pub(crate) fn newest_cuda_for(driver: &str) -> Option<&'static str> {
    let driver = parse_version(driver);
    CUDA_DRIVERS
        .iter()
        .rev()
        .find(|r| version_cmp(&driver, &parse_version(r.min_driver)) != Ordering::Less)
        .map(|r| r.cuda)
}

/// Versions from `min` (inclusive) to `below` (exclusive); either end open.
#[derive(Clone, Copy, Debug)]
pub struct VersionRange {
    pub min: Option<&'static str>,
    pub below: Option<&'static str>,
}

impl VersionRange {
    pub const ANY: VersionRange = VersionRange {
        min: None,
        below: None,
    };

    pub(crate) fn holds(&self, version: &str) -> bool {
        let v = parse_version(version);
        if v.is_empty() {
            return false;
        }
        let above_min = self
            .min
            .is_none_or(|m| version_cmp(&v, &parse_version(m)) != Ordering::Less);
        let below_max = self
            .below
            .is_none_or(|b| version_cmp(&v, &parse_version(b)) == Ordering::Less);
        above_min && below_max
    }
}

/// A kernel and NVIDIA driver combination that misbehaves.
pub struct KnownIssue {
    pub id: &'static str,
    pub kernel: VersionRange,
    /// `None`: any host with an NVIDIA GPU; `Some(ANY)` would also match hosts without one.
    pub driver: Option<VersionRange>,
    pub status: Status,
    pub summary: &'static str,
    pub source: &'static str,
    pub fix: &'static str,
}

pub const KNOWN_ISSUES: &[KnownIssue] = &[
    KnownIssue {
        id: "uvm-5.9-before-450.66",
        kernel: VersionRange { min: Some("5.9"), below: None },
        driver: Some(VersionRange { min: None, below: Some("450.66") }),
        status: Status::Error,
        summary: "kernels from 5.9 break nvidia-uvm of drivers before 450.66: CUDA cannot start",
        source: "NVIDIA developer forum, \"NVIDIA driver not yet supported for Linux kernel 5.9\"; NixOS/nixpkgs#101259",
        fix: "install an NVIDIA driver of branch 450.66 or later (a current production branch)",
    },
    KnownIssue {
        id: "uvm-oops-6.18.10-595.45.04",
        kernel: VersionRange { min: Some("6.18.10"), below: Some("6.19") },
        driver: Some(VersionRange { min: Some("595.45.04"), below: Some("595.45.05") }),
        status: Status::Warn,
        summary: "nvidia_uvm oops with CUDA programs hanging; rolling back to driver 590.48.01 fixed it",
        source: "ublue-os/aurora#1895 (one user report, not confirmed by NVIDIA)",
        fix: "use another driver release (590.48.01 was reported to work) until NVIDIA ships a fix",
    },
    KnownIssue {
        id: "aspm-5.4",
        kernel: VersionRange { min: Some("5.4"), below: Some("5.5") },
        driver: None,
        status: Status::Warn,
        summary: "PCIe ASPM trouble with GPUs on 5.4 kernels (links dropping or downtraining)",
        source: "unverified: listed as an example in the doctor issue; no primary source found",
        fix: "boot with pcie_aspm=off, or move to a newer longterm kernel",
    },
    KnownIssue {
        id: "uvm-race-5.15-525",
        kernel: VersionRange { min: Some("5.15"), below: Some("5.16") },
        driver: Some(VersionRange { min: Some("525"), below: Some("526") }),
        status: Status::Warn,
        summary: "a race in nvidia-uvm of the 525 branch on 5.15 kernels",
        source: "unverified: listed as an example in the doctor issue; no primary source found",
        fix: "move to driver branch 535 or later",
    },
];

/// The known issues that match a kernel release and, when a GPU is present, its driver.
pub(crate) fn matching_issues(
    kernel: &str,
    driver: Option<&str>,
    gpu_present: bool,
) -> Vec<&'static KnownIssue> {
    KNOWN_ISSUES
        .iter()
        .filter(|issue| issue.kernel.holds(kernel))
        .filter(|issue| match (&issue.driver, driver) {
            (None, _) => gpu_present,
            (Some(range), Some(d)) => range.holds(d),
            (Some(_), None) => false,
        })
        .collect()
}

/// XID codes whose presence means the GPU, its memory or its link failed (not an
/// application's fault). Everything else in the log is a warning (often an application
/// error: 13, 31, 43, 45). Source: NVIDIA "XID Errors" (docs.nvidia.com/deploy/xid-errors).
pub const XID_HARDWARE: &[(u32, &str)] = &[
    (48, "double-bit ECC error"),
    (62, "internal micro-controller halt"),
    (64, "ECC page retirement or row remapping failure"),
    (74, "NVLink error"),
    (79, "GPU has fallen off the bus"),
    (95, "uncontained ECC error"),
    (119, "GSP RPC timeout"),
    (120, "GSP error"),
    (140, "unrecovered ECC error"),
    (
        154,
        "GPU recovery action changed (reset or reboot required)",
    ),
];

pub(crate) fn xid_meaning(code: u32) -> Option<&'static str> {
    XID_HARDWARE
        .iter()
        .find(|(c, _)| *c == code)
        .map(|(_, m)| *m)
        .or(match code {
            13 => Some("graphics engine exception"),
            31 => Some("GPU memory page fault"),
            43 => Some("GPU stopped processing"),
            45 => Some("preemptive cleanup"),
            63 => Some("ECC page retirement or row remapping recorded"),
            92 => Some("high single-bit ECC error rate"),
            94 => Some("contained ECC error"),
            _ => None,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_table_judges_drivers() {
        assert_eq!(cuda_fit("550.54.15", "12.4"), CudaFit::Full);
        assert_eq!(
            cuda_fit("535.104.05", "12.4"),
            CudaFit::MinorCompat {
                ga_driver: "550.54.14"
            }
        );
        assert_eq!(
            cuda_fit("520.61.05", "12.4"),
            CudaFit::TooOld { needs: "525.60.13" }
        );
        assert_eq!(cuda_fit("580.65.06", "13.0"), CudaFit::Full);
        assert_eq!(cuda_fit("550.54.15", "12.7"), CudaFit::NotInTable);
        assert_eq!(newest_cuda_for("550.54.15"), Some("12.4"));
        assert_eq!(newest_cuda_for("440.33"), None);
    }

    #[test]
    fn known_issues_match_kernel_and_driver() {
        let hits = matching_issues("5.10.0-21-amd64", Some("450.51.06"), true);
        assert_eq!(
            hits.iter().map(|i| i.id).collect::<Vec<_>>(),
            vec!["uvm-5.9-before-450.66"]
        );
        assert!(matching_issues("5.10.0", Some("550.54.15"), true).is_empty());
        assert!(matching_issues("5.4.0-150-generic", None, false).is_empty());
        assert_eq!(matching_issues("5.4.0-150-generic", None, true).len(), 1);
    }
}
