//! What a doctor run finds: one [`Check`] per judged setting, the [`Report`] that holds them,
//! and its three renderings (text for people, JSON through serde, a fix script).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The part of the host a check is about; `--only AREA` runs one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Area {
    Memory,
    Cpu,
    Numa,
    Storage,
    Network,
    Limits,
    Kernel,
    Gpu,
    Rampart,
}

impl Area {
    pub const ALL: [Area; 9] = [
        Area::Memory,
        Area::Cpu,
        Area::Numa,
        Area::Storage,
        Area::Network,
        Area::Limits,
        Area::Kernel,
        Area::Gpu,
        Area::Rampart,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Area::Memory => "memory",
            Area::Cpu => "cpu",
            Area::Numa => "numa",
            Area::Storage => "storage",
            Area::Network => "network",
            Area::Limits => "limits",
            Area::Kernel => "kernel",
            Area::Gpu => "gpu",
            Area::Rampart => "rampart",
        }
    }
}

impl fmt::Display for Area {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An area name that is not one of [`Area::ALL`].
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown area {0:?}; one of memory, cpu, numa, storage, network, limits, kernel, gpu, rampart"
)]
pub struct UnknownArea(pub String);

impl FromStr for Area {
    type Err = UnknownArea;

    fn from_str(s: &str) -> Result<Area, UnknownArea> {
        Area::ALL
            .into_iter()
            .find(|a| a.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownArea(s.to_string()))
    }
}

/// How a check came out. `unknown` means it could not be judged (a file absent in a container,
/// no GPU, no value given): never a failure by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Unknown,
    Warn,
    Error,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Unknown => "unknown",
            Status::Warn => "warn",
            Status::Error => "error",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One judged setting.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Check {
    /// Stable identifier (`memory.swappiness`); docs/doctor.md lists them all.
    pub id: String,
    pub area: Area,
    /// What the check is about when there are several of it: a GPU (`gpu0`), an interface
    /// (`eth0`), a directory role (`audit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    pub status: Status,
    /// What was found, or why it could not be judged.
    pub observed: String,
    pub expected: String,
    /// Why it matters, with the source of the recommendation.
    pub why: String,
    /// The exact command(s) that fix it; empty when there is nothing to run.
    pub fix: String,
}

/// How many checks came out each way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Counts {
    pub ok: usize,
    pub warn: usize,
    pub error: usize,
    pub unknown: usize,
}

/// The host in one line each, at the head of a report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostSummary {
    /// The tree that was read: `/`, or a fixture directory.
    pub root: String,
    pub hostname: Option<String>,
    pub os: Option<String>,
    pub kernel_release: Option<String>,
    pub cpu_model: Option<String>,
    pub logical_cpus: Option<usize>,
    pub memory_total_bytes: Option<u64>,
    pub gpus: usize,
}

/// The result of [`crate::run`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Report {
    /// Bumped when a field changes meaning; docs/doctor.schema.json describes this version.
    pub schema_version: u32,
    pub host: HostSummary,
    /// The area asked for with `--only`, if any.
    pub only: Option<Area>,
    /// Whether PCIe links were sampled under a short GPU load.
    pub gpu_load_sample: bool,
    /// Wall time of the run.
    pub elapsed_ms: u64,
    pub counts: Counts,
    pub checks: Vec<Check>,
}

pub const SCHEMA_VERSION: u32 = 1;

impl Report {
    pub(crate) fn new(
        host: HostSummary,
        only: Option<Area>,
        gpu_load_sample: bool,
        checks: Vec<Check>,
    ) -> Report {
        let mut report = Report {
            schema_version: SCHEMA_VERSION,
            host,
            only,
            gpu_load_sample,
            elapsed_ms: 0,
            counts: Counts::default(),
            checks,
        };
        report.recount();
        report
    }

    fn recount(&mut self) {
        let mut counts = Counts::default();
        for check in &self.checks {
            match check.status {
                Status::Ok => counts.ok += 1,
                Status::Warn => counts.warn += 1,
                Status::Error => counts.error += 1,
                Status::Unknown => counts.unknown += 1,
            }
        }
        self.counts = counts;
    }

    /// The worst status found (`unknown` counts as `ok`: it is not a finding).
    pub fn worst(&self) -> Status {
        self.checks
            .iter()
            .map(|c| c.status)
            .filter(|s| *s != Status::Unknown)
            .max()
            .unwrap_or(Status::Ok)
    }

    /// 0 when every check is ok or unknown, 1 when any warns, 2 when any is an error.
    pub fn exit_code(&self) -> i32 {
        match self.worst() {
            Status::Error => 2,
            Status::Warn => 1,
            Status::Ok | Status::Unknown => 0,
        }
    }

    /// The checks with this id (one per subject).
    pub fn checks_with_id<'a>(&'a self, id: &'a str) -> impl Iterator<Item = &'a Check> + 'a {
        self.checks.iter().filter(move |c| c.id == id)
    }

    /// The check with this id, or with this id and subject when there are several.
    pub fn check(&self, id: &str, subject: Option<&str>) -> Option<&Check> {
        self.checks
            .iter()
            .find(|c| c.id == id && (subject.is_none() || c.subject.as_deref() == subject))
    }

    /// A table grouped by area for a terminal: one line per check, and under each finding
    /// (warn or error) why it matters and the fix. Unknowns say why in the observed column.
    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let host = &self.host;
        out.push_str("rampart doctor");
        if host.root != "/" {
            out.push_str(&format!(" (root {})", host.root));
        }
        out.push('\n');
        let mut facts = Vec::new();
        if let Some(h) = &host.hostname {
            facts.push(h.clone());
        }
        if let Some(os) = &host.os {
            facts.push(os.clone());
        }
        if let Some(k) = &host.kernel_release {
            facts.push(format!("kernel {k}"));
        }
        if let Some(cpu) = &host.cpu_model {
            let cpus = host
                .logical_cpus
                .map(|n| format!(" ({n} CPUs)"))
                .unwrap_or_default();
            facts.push(format!("{cpu}{cpus}"));
        }
        if let Some(m) = host.memory_total_bytes {
            facts.push(format!("{} memory", crate::tree::human_bytes(m)));
        }
        facts.push(match host.gpus {
            0 => "no NVIDIA GPU".to_string(),
            1 => "1 GPU".to_string(),
            n => format!("{n} GPUs"),
        });
        out.push_str(&format!("  {}\n", facts.join(" · ")));

        let id_width = self
            .checks
            .iter()
            .map(|c| c.id.len() + c.subject.as_ref().map_or(0, |s| s.len() + 3))
            .max()
            .unwrap_or(20)
            .min(40);
        for area in Area::ALL {
            let checks: Vec<&Check> = self.checks.iter().filter(|c| c.area == area).collect();
            if checks.is_empty() {
                continue;
            }
            out.push_str(&format!("\n{}\n", area.name().to_uppercase()));
            for check in checks {
                let label = match &check.subject {
                    Some(s) => format!("{} [{s}]", check.id),
                    None => check.id.clone(),
                };
                let mark = match check.status {
                    Status::Ok => "ok     ",
                    Status::Warn => "WARN   ",
                    Status::Error => "ERROR  ",
                    Status::Unknown => "unknown",
                };
                out.push_str(&format!(
                    "  {mark} {label:<id_width$}  {}\n",
                    one_line(&check.observed)
                ));
                if matches!(check.status, Status::Warn | Status::Error) {
                    let pad = " ".repeat(10);
                    out.push_str(&format!("{pad}expected: {}\n", one_line(&check.expected)));
                    out.push_str(&format!("{pad}why: {}\n", one_line(&check.why)));
                    for (i, line) in check.fix.lines().enumerate() {
                        let head = if i == 0 { "fix: " } else { "     " };
                        out.push_str(&format!("{pad}{head}{line}\n"));
                    }
                }
            }
        }
        let c = &self.counts;
        out.push_str(&format!(
            "\n{} ok, {} warn, {} error, {} unknown in {} ms{}\n",
            c.ok,
            c.warn,
            c.error,
            c.unknown,
            self.elapsed_ms,
            if self.gpu_load_sample {
                " (with the GPU load sample)"
            } else {
                ""
            }
        ));
        out
    }

    /// A shell script with the commands that fix the findings, each under a comment saying
    /// what it fixes. Nothing here runs them: an operator reads, edits and runs the script.
    pub fn fix_script(&self) -> String {
        let mut out = String::from(
            "#!/bin/sh\n\
             # Fixes proposed by `rampart doctor`. Nothing has been run: read each command,\n\
             # keep the ones that fit this host, then run the script as root.\n\
             # sysctl settings go to /etc/sysctl.d/90-rampart.conf so they survive a reboot;\n\
             # boot parameters need a bootloader update and a reboot.\n\
             set -eu\n",
        );
        let mut any = false;
        for check in &self.checks {
            if !matches!(check.status, Status::Warn | Status::Error) || check.fix.trim().is_empty()
            {
                continue;
            }
            any = true;
            let label = match &check.subject {
                Some(s) => format!("{} [{s}]", check.id),
                None => check.id.clone(),
            };
            out.push_str(&format!(
                "\n# {label} ({}): {}\n#   expected: {}\n",
                check.status,
                one_line(&check.observed),
                one_line(&check.expected)
            ));
            for line in check.fix.lines() {
                out.push_str(line);
                out.push('\n');
            }
        }
        if !any {
            out.push_str("\n# Nothing to fix.\n");
        }
        out
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(id: &str, status: Status) -> Check {
        Check {
            id: id.to_string(),
            area: Area::Memory,
            subject: None,
            status,
            observed: "x".into(),
            expected: "y".into(),
            why: "z".into(),
            fix: "sysctl -w vm.swappiness=1".into(),
        }
    }

    #[test]
    fn exit_codes_follow_the_worst_finding() {
        let host = HostSummary::default();
        let r = Report::new(host.clone(), None, false, vec![check("a", Status::Ok)]);
        assert_eq!(r.exit_code(), 0);
        let r = Report::new(
            host.clone(),
            None,
            false,
            vec![check("a", Status::Unknown), check("b", Status::Ok)],
        );
        assert_eq!(r.exit_code(), 0);
        let r = Report::new(
            host.clone(),
            None,
            false,
            vec![check("a", Status::Warn), check("b", Status::Unknown)],
        );
        assert_eq!(r.exit_code(), 1);
        let r = Report::new(
            host,
            None,
            false,
            vec![check("a", Status::Warn), check("b", Status::Error)],
        );
        assert_eq!(r.exit_code(), 2);
        assert_eq!(r.counts.warn, 1);
        assert_eq!(r.counts.error, 1);
    }

    #[test]
    fn fix_script_holds_only_findings() {
        let r = Report::new(
            HostSummary::default(),
            None,
            false,
            vec![
                check("memory.ok", Status::Ok),
                check("memory.bad", Status::Warn),
            ],
        );
        let script = r.fix_script();
        assert!(script.starts_with("#!/bin/sh\n"));
        assert!(script.contains("# memory.bad (warn)"));
        assert!(!script.contains("memory.ok"));
    }

    #[test]
    fn areas_parse_by_name() {
        assert_eq!("GPU".parse::<Area>().ok(), Some(Area::Gpu));
        assert!("disk".parse::<Area>().is_err());
    }
}
