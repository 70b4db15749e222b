//! Maturity: the level a model version has reached, from checks of what the serving process
//! actually has (docs/maturity.md).
//!
//! Checks fall in six sections (after Breck et al., "The ML Test Score", 2017, whose score is
//! the minimum over its sections): lineage and reproducibility, evaluation, release safety,
//! monitoring, resilience, audit and security. Each check is required from one level on:
//!
//! - `experimental` (1): the makers may try it on real traffic they watch;
//! - `staging` (2): it may face users through a release;
//! - `production` (3): it may be what users get, unattended.
//!
//! A section's level is the highest level whose checks (and every lower level's) all pass; the
//! report's level is the lowest section's. The evidence is gathered elsewhere (the server reads
//! its repository, configuration and running state): this module only holds the shapes, the
//! levels and the verdict, so that both the command line and the server compute them alike.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A maturity level. Ordered: `None < Experimental < Staging < Production`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Level {
    /// Not even experimental: a level-1 check fails.
    None,
    Experimental,
    Staging,
    Production,
}

impl Level {
    pub const ALL: [Level; 3] = [Level::Experimental, Level::Staging, Level::Production];

    pub fn as_str(self) -> &'static str {
        match self {
            Level::None => "none",
            Level::Experimental => "experimental",
            Level::Staging => "staging",
            Level::Production => "production",
        }
    }

    pub fn number(self) -> u8 {
        self as u8
    }
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Level {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "none" | "0" => Ok(Level::None),
            "experimental" | "1" => Ok(Level::Experimental),
            "staging" | "2" => Ok(Level::Staging),
            "production" | "3" => Ok(Level::Production),
            other => Err(format!(
                "unknown maturity level {other:?}: use experimental, staging or production"
            )),
        }
    }
}

/// The report's sections, in the order they are shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Section {
    Lineage,
    Evaluation,
    ReleaseSafety,
    Monitoring,
    Resilience,
    AuditSecurity,
}

impl Section {
    pub const ALL: [Section; 6] = [
        Section::Lineage,
        Section::Evaluation,
        Section::ReleaseSafety,
        Section::Monitoring,
        Section::Resilience,
        Section::AuditSecurity,
    ];

    pub fn title(self) -> &'static str {
        match self {
            Section::Lineage => "lineage and reproducibility",
            Section::Evaluation => "evaluation",
            Section::ReleaseSafety => "release safety",
            Section::Monitoring => "monitoring",
            Section::Resilience => "resilience",
            Section::AuditSecurity => "audit and security",
        }
    }
}

/// One check's outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Pass,
    Fail,
    /// It does not apply to this model (an entropy band for a classifier): counts as passed.
    NotApplicable,
}

/// One check: what it asks, from which level, what was found, and how to pass it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Check {
    /// Stable id (`lineage.commit`).
    pub id: String,
    pub section: Section,
    /// The level from which it is required.
    pub required_from: Level,
    /// What it asks, in a line.
    pub title: String,
    pub outcome: Outcome,
    /// What was found (file, setting, measurement).
    pub evidence: String,
    /// How to pass it (empty when it passes).
    pub fix: String,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.outcome != Outcome::Fail
    }
}

/// One section's checks and level.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SectionReport {
    pub section: Section,
    pub title: String,
    pub level: Level,
    pub checks: Vec<Check>,
}

/// A version's maturity report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub model: String,
    pub version: String,
    /// `sha256:…`: the version the report is about.
    pub digest: String,
    /// The overall level: the lowest section's.
    pub level: Level,
    pub sections: Vec<SectionReport>,
    /// RFC 3339.
    pub made_at: String,
}

/// The level of a set of checks: the highest level whose checks, and every lower level's,
/// all pass.
pub fn level_of<'a>(checks: impl IntoIterator<Item = &'a Check> + Clone) -> Level {
    let mut reached = Level::None;
    for level in Level::ALL {
        let ok = checks
            .clone()
            .into_iter()
            .filter(|c| c.required_from <= level)
            .all(Check::passed);
        if !ok {
            break;
        }
        reached = level;
    }
    reached
}

impl Report {
    /// Sorts the checks into their sections and computes every level.
    pub fn new(
        model: &str,
        version: &str,
        digest: &str,
        checks: Vec<Check>,
        made_at: String,
    ) -> Self {
        let sections: Vec<SectionReport> = Section::ALL
            .iter()
            .map(|&section| {
                let checks: Vec<Check> = checks
                    .iter()
                    .filter(|c| c.section == section)
                    .cloned()
                    .collect();
                SectionReport {
                    section,
                    title: section.title().to_string(),
                    level: level_of(&checks),
                    checks,
                }
            })
            .collect();
        let level = sections
            .iter()
            .map(|s| s.level)
            .min()
            .unwrap_or(Level::None);
        Self {
            model: model.to_string(),
            version: version.to_string(),
            digest: digest.to_string(),
            level,
            sections,
            made_at,
        }
    }

    /// The failing checks that keep the version below `level` (empty when it reaches it).
    pub fn missing_for(&self, level: Level) -> Vec<&Check> {
        self.sections
            .iter()
            .flat_map(|s| &s.checks)
            .filter(|c| c.required_from <= level && !c.passed())
            .collect()
    }

    /// `model@version is staging, below production: lineage.commit (…), …` — what a refusal says.
    pub fn shortfall(&self, level: Level) -> Option<String> {
        let missing = self.missing_for(level);
        if missing.is_empty() {
            return None;
        }
        let named: Vec<String> = missing
            .iter()
            .map(|c| format!("{} ({})", c.id, c.title))
            .collect();
        Some(format!(
            "{}@{} is {}, below {level}: failing {}",
            self.model,
            self.version,
            self.level,
            named.join("; ")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(id: &str, section: Section, from: Level, outcome: Outcome) -> Check {
        Check {
            id: id.into(),
            section,
            required_from: from,
            title: id.into(),
            outcome,
            evidence: String::new(),
            fix: String::new(),
        }
    }

    #[test]
    fn a_section_reaches_the_highest_level_whose_checks_and_the_lower_ones_pass() {
        use Level::*;
        use Outcome::*;
        let s = Section::Lineage;
        assert_eq!(level_of(&[] as &[Check]), Production);
        let checks = [
            check("a", s, Experimental, Pass),
            check("b", s, Staging, Fail),
            check("c", s, Production, Pass),
        ];
        assert_eq!(level_of(&checks), Experimental);
        let checks = [
            check("a", s, Experimental, Fail),
            check("b", s, Staging, Pass),
        ];
        assert_eq!(level_of(&checks), None);
        let checks = [
            check("a", s, Experimental, Pass),
            check("b", s, Staging, NotApplicable),
            check("c", s, Production, Pass),
        ];
        assert_eq!(level_of(&checks), Production);
    }

    #[test]
    fn the_report_is_the_lowest_section_and_names_what_is_missing() {
        use Level::*;
        use Outcome::*;
        let checks = vec![
            check("lineage.digests", Section::Lineage, Experimental, Pass),
            check("lineage.commit", Section::Lineage, Staging, Pass),
            check("evaluation.golden", Section::Evaluation, Staging, Fail),
            check("audit.required", Section::AuditSecurity, Production, Fail),
        ];
        let r = Report::new("m", "1.0.0", "sha256:x", checks, "t".into());
        assert_eq!(r.level, Experimental);
        assert_eq!(r.sections.len(), 6);
        assert_eq!(r.sections[0].level, Production);
        assert_eq!(r.sections[1].level, Experimental);
        assert!(r.shortfall(Experimental).is_none());
        let why = r.shortfall(Production).unwrap();
        assert!(
            why.contains("m@1.0.0 is experimental, below production")
                && why.contains("evaluation.golden")
                && why.contains("audit.required"),
            "{why}"
        );
        assert_eq!(r.missing_for(Staging).len(), 1);
    }

    #[test]
    fn levels_parse_and_order() {
        assert_eq!("Production".parse::<Level>().unwrap(), Level::Production);
        assert_eq!("2".parse::<Level>().unwrap(), Level::Staging);
        assert!("gold".parse::<Level>().is_err());
        assert!(Level::Staging < Level::Production);
        assert_eq!(
            serde_json::to_string(&Level::Experimental).unwrap(),
            "\"experimental\""
        );
    }
}
