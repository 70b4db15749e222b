//! `rampart model maturity NAME[@VERSION]`: a version's maturity report from the repository,
//! the server's configuration (`--config`), the doctor on this host and the Prometheus the
//! configuration names (docs/maturity.md). The server answers the same report at
//! `GET /admin/models/{name}/maturity`.

use std::path::Path;
use std::process::ExitCode;

use anyhow::{Context, Result};
use release::maturity::{Level, Outcome, Report};
use server::config::ServerConfig;

use crate::render::table;

/// Exit status when the report is below `--require`.
pub const EXIT_BELOW: u8 = 4;

pub fn run(
    repo_dir: &Path,
    model: &str,
    config: Option<&Path>,
    require: Option<&str>,
    json: bool,
) -> Result<ExitCode> {
    let require = require
        .map(str::parse::<Level>)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let mut config = ServerConfig::load(config)?;
    config.repo = repo_dir.to_path_buf();
    config.validate()?;
    let repository = repo::Repository::open(&config.repo);
    let version = server::maturity::version_of(&repository, model)?;
    let alerts_loaded = match &config.maturity.prometheus_url {
        Some(url) => Some(
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("a runtime for the Prometheus query")?
                .block_on(server::maturity::alerts_loaded(url)),
        ),
        None => None,
    };
    let live = server::maturity::Live {
        verified: None,
        doctor: Some(server::doctor::examine(&config).report),
        alerts_loaded,
    };
    let report = server::maturity::report(&config, &repository, &version, &live)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report, require));
    }
    Ok(match require {
        Some(level) if report.level < level => ExitCode::from(EXIT_BELOW),
        _ => ExitCode::SUCCESS,
    })
}

fn mark(outcome: Outcome) -> &'static str {
    match outcome {
        Outcome::Pass => "pass",
        Outcome::Fail => "FAIL",
        Outcome::NotApplicable => "n/a",
    }
}

/// The report for a terminal: one table per section, then the level and what is missing.
pub fn render(report: &Report, require: Option<Level>) -> String {
    let mut out = format!(
        "{}@{} ({})\nlevel: {}\n\n",
        report.model, report.version, report.digest, report.level
    );
    for s in &report.sections {
        out.push_str(&format!("{} — {}\n", s.title, s.level));
        let rows: Vec<Vec<String>> = s
            .checks
            .iter()
            .map(|c| {
                vec![
                    mark(c.outcome).to_string(),
                    c.required_from.to_string(),
                    c.id.clone(),
                    c.evidence.clone(),
                ]
            })
            .collect();
        out.push_str(&table(&["", "FROM", "CHECK", "EVIDENCE"], &rows));
        out.push('\n');
    }
    let next = require.or(match report.level {
        Level::None => Some(Level::Experimental),
        Level::Experimental => Some(Level::Staging),
        Level::Staging => Some(Level::Production),
        Level::Production => None,
    });
    if let Some(level) = next {
        let missing = report.missing_for(level);
        if !missing.is_empty() {
            out.push_str(&format!("to reach {level}:\n"));
            for c in missing {
                out.push_str(&format!("  - {}: {}\n", c.id, c.fix));
            }
        }
    }
    out
}
