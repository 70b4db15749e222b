//! `rampart audit …`: read, verify and prove the audit log, on a local log directory or on what
//! was shipped to S3 alone. Read-only: it never changes the log (a running server may be
//! writing it).
//!
//! A fleet's replicas each keep their own log (their own origin and key) and ship it to
//! `<prefix>/<replica>` (docs/fleet.md): `--s3 s3://bucket/<prefix>` finds every origin there and
//! reads each; `verify` verifies each and reports each, and fails when one fails.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use audit::read::{self, Log};

#[derive(Debug, clap::Args)]
pub struct AuditArgs {
    /// The local audit log directory.
    #[arg(
        long,
        global = true,
        env = "RAMPART_AUDIT_DIR",
        default_value = "audit",
        value_name = "DIR"
    )]
    pub dir: PathBuf,
    /// Read what was shipped to S3 instead (`s3://bucket/prefix`), from S3 alone.
    #[arg(long, global = true, value_name = "URL")]
    pub s3: Option<String>,
    /// The S3 service root (with --s3).
    #[arg(
        long,
        global = true,
        env = "RAMPART_AUDIT_S3_ENDPOINT",
        value_name = "URL"
    )]
    pub s3_endpoint: Option<String>,
    #[arg(long, global = true, default_value = "us-east-1")]
    pub s3_region: String,
    /// Virtual-hosted-style addressing instead of path style.
    #[arg(long, global = true)]
    pub s3_virtual_hosted: bool,
    /// Pin the log's public key (hex) instead of trusting the one stored beside it.
    #[arg(long, global = true, value_name = "HEX")]
    pub public_key: Option<String>,
    /// Print JSON.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: AuditCommand,
}

#[derive(Debug, clap::Subcommand)]
pub enum AuditCommand {
    /// Print the entry with this audit id.
    Get { audit_id: String },
    /// List a user's entries (exact user id), optionally between two times (ms or RFC 3339).
    List {
        #[arg(long)]
        user: String,
        #[arg(long)]
        from: Option<String>,
        #[arg(long)]
        to: Option<String>,
    },
    /// Verify the whole log: every entry's hash and place, every sealed file, every signed
    /// checkpoint. Exit 1 naming the first bad entry.
    Verify,
    /// Print and check the inclusion proof of an entry against a signed checkpoint.
    Prove { audit_id: String },
    /// Write every entry, in order, as JSON lines (to stdout or --out).
    Export {
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

/// One log read: from the directory, or one origin found under the S3 prefix (its temporary
/// copy is kept while in use).
struct Opened {
    /// The origin's prefix when read from S3.
    origin: Option<String>,
    log: Log,
    _copy: Option<tempfile::TempDir>,
}

/// The logs under an S3 prefix: the prefix itself when a log's public key is there, else each
/// folder right under it that holds one (a fleet's replicas).
fn origins(keys: &[String], prefix: &str) -> Vec<String> {
    let at = |p: &str| audit::ship::remote_key(p, audit::ship::REMOTE_KEY);
    if keys.iter().any(|k| *k == at(prefix)) {
        return vec![prefix.to_string()];
    }
    let under = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}/")
    };
    let mut found: Vec<String> = keys
        .iter()
        .filter_map(|k| {
            let rest = k.strip_prefix(&under)?;
            let origin = rest.strip_suffix(&format!("/{}", audit::ship::REMOTE_KEY))?;
            (!origin.is_empty() && !origin.contains('/')).then(|| format!("{under}{origin}"))
        })
        .collect();
    found.sort();
    found
}

/// The logs the arguments name.
fn open(args: &AuditArgs) -> anyhow::Result<Vec<Opened>> {
    let key = args
        .public_key
        .as_deref()
        .map(audit::checkpoint::parse_public_key)
        .transpose()?;
    let Some(url) = &args.s3 else {
        if !args.dir.exists() {
            bail!(
                "no audit log at {} (give --dir or --s3)",
                args.dir.display()
            );
        }
        return Ok(vec![Opened {
            origin: None,
            log: read::load(&args.dir, key),
            _copy: None,
        }]);
    };
    let endpoint = args
        .s3_endpoint
        .clone()
        .context("--s3 needs --s3-endpoint (or RAMPART_AUDIT_S3_ENDPOINT)")?;
    let ship = audit::config::ShipConfig {
        url: url.clone(),
        endpoint,
        region: args.s3_region.clone(),
        path_style: !args.s3_virtual_hosted,
        ..Default::default()
    };
    let (client, prefix) = audit::ship::client_for(&ship)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let listed = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}/")
    };
    let keys = runtime.block_on(client.list(&listed))?;
    let found = origins(&keys, &prefix);
    if found.is_empty() {
        bail!(
            "no audit log under {url} (no {} there or one level below)",
            audit::ship::REMOTE_KEY
        );
    }
    let mut out = Vec::new();
    for origin in found {
        let copy = tempfile::tempdir()?;
        let n = runtime.block_on(audit::ship::download(&client, &origin, copy.path()))?;
        if n == 0 {
            bail!("nothing under s3://{}/{origin}", client.bucket());
        }
        out.push(Opened {
            origin: Some(origin),
            log: read::load(copy.path(), key),
            _copy: Some(copy),
        });
    }
    Ok(out)
}

fn time(text: &Option<String>) -> anyhow::Result<Option<u64>> {
    text.as_deref()
        .map(|t| {
            t.parse::<u64>().or_else(|_| {
                audit::s3::parse_rfc3339(t)
                    .ok()
                    .and_then(|s| s.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_millis() as u64)
                    .with_context(|| {
                        format!("{t:?} is neither ms since the epoch nor an RFC 3339 time")
                    })
            })
        })
        .transpose()
}

/// `verify` of one log: its lines (or JSON report) and whether it verified.
fn verify(log: &Log, json: bool) -> (bool, serde_json::Value) {
    let report = log.report();
    if json {
        return (report.ok, serde_json::to_value(&report).unwrap_or_default());
    }
    if let Some(p) = &report.problem {
        println!("FAILED: {p}");
        println!(
            "(read {} entries and {} checkpoints before it)",
            report.entries, report.checkpoints
        );
    } else {
        println!(
            "ok: {} entries, {} sealed files, {} signed checkpoints; root {}",
            report.entries, report.sealed_files, report.checkpoints, report.root
        );
        if let Some(c) = &report.newest_checkpoint {
            println!(
                "newest checkpoint: size {} signed at {} ms by key {}",
                c.size, c.time_ms, c.key_id
            );
        }
        if report.uncovered > 0 {
            println!(
                "note: the newest {} entries are not yet covered by a signed checkpoint (a running server signs one within a second; a clean stop signs everything)",
                report.uncovered
            );
        }
        if let Some(t) = &report.torn_tail {
            println!("note: a torn tail after the last checkpoint (a crash mid-write; the server cuts it on start): {t}");
        }
    }
    (report.ok, serde_json::Value::Null)
}

pub fn run(args: AuditArgs) -> anyhow::Result<ExitCode> {
    let opened = open(&args)?;
    if let AuditCommand::Verify = args.command {
        let several = opened.len() > 1;
        let mut failed = 0;
        let mut reports = Vec::new();
        for o in &opened {
            if several && !args.json {
                println!("origin {}:", o.origin.as_deref().unwrap_or("?"));
            }
            let (ok, report) = verify(&o.log, args.json);
            failed += usize::from(!ok);
            reports.push(serde_json::json!({ "origin": o.origin, "report": report }));
        }
        if args.json {
            let out = if several {
                serde_json::Value::Array(reports)
            } else {
                reports.remove(0)["report"].take()
            };
            println!("{}", serde_json::to_string_pretty(&out)?);
        } else if several {
            println!(
                "{} origins: {} verified, {failed} failed",
                opened.len(),
                opened.len() - failed
            );
        }
        return Ok(if failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        });
    }
    for o in &opened {
        if let Some(p) = &o.log.problem {
            eprintln!(
                "warning: the log{} does not verify ({p}); showing what was read before it",
                o.origin
                    .as_deref()
                    .map(|o| format!(" of {o}"))
                    .unwrap_or_default()
            );
        }
    }
    let logs: Vec<&Log> = opened.iter().map(|o| &o.log).collect();
    match args.command {
        AuditCommand::Verify => unreachable!("answered above"),
        AuditCommand::Get { audit_id } => {
            let Some(l) = logs.iter().find_map(|log| log.get(&audit_id)) else {
                bail!("no audit entry {audit_id:?}");
            };
            println!("{}", serde_json::to_string_pretty(&l.entry)?);
        }
        AuditCommand::List { user, from, to } => {
            let (from, to) = (time(&from)?, time(&to)?);
            let found: Vec<_> = logs
                .iter()
                .flat_map(|log| log.by_user(&user, from, to))
                .map(|l| &l.entry)
                .collect();
            if args.json {
                println!("{}", serde_json::to_string_pretty(&found)?);
            } else {
                for e in &found {
                    let r = e.record.as_ref();
                    let field = |k: &str| {
                        r.and_then(|r| r.get(k))
                            .map(|v| v.to_string())
                            .unwrap_or_default()
                    };
                    println!(
                        "{:>8}  {}  {}  {}  {} status={}",
                        e.index,
                        e.time_ms,
                        e.audit_id,
                        e.model,
                        field("endpoint"),
                        field("status")
                    );
                }
                println!("{} entries for user {user:?}", found.len());
            }
        }
        AuditCommand::Prove { audit_id } => {
            let Some(proof) = logs.iter().find_map(|log| log.prove(&audit_id)) else {
                bail!("no audit entry {audit_id:?} covered by a signed checkpoint");
            };
            let verified = proof.verify();
            let mut out = serde_json::to_value(&proof)?;
            out["verified"] = verified.into();
            println!("{}", serde_json::to_string_pretty(&out)?);
            if !verified {
                return Ok(ExitCode::from(1));
            }
        }
        AuditCommand::Export { out } => {
            let mut sink: Box<dyn Write> = match &out {
                Some(p) => Box::new(std::io::BufWriter::new(
                    std::fs::File::create(p).with_context(|| p.display().to_string())?,
                )),
                None => Box::new(std::io::stdout().lock()),
            };
            let mut n = 0;
            for l in logs.iter().flat_map(|log| &log.entries) {
                serde_json::to_writer(&mut sink, &l.entry)?;
                sink.write_all(b"\n")?;
                n += 1;
            }
            sink.flush()?;
            if let Some(p) = out {
                eprintln!("{n} entries written to {}", p.display());
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    #[test]
    fn origins_are_the_prefix_or_each_folder_with_a_key() {
        let keys = |k: &[&str]| k.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let one = keys(&["prod/_key.pub", "prod/segments/a.parquet"]);
        assert_eq!(super::origins(&one, "prod"), ["prod"]);
        let fleet = keys(&[
            "prod/r2/_key.pub",
            "prod/r1/_key.pub",
            "prod/r1/segments/a.parquet",
            "prod/r1/nested/_key.pub",
            "prod/stray.txt",
        ]);
        assert_eq!(super::origins(&fleet, "prod"), ["prod/r1", "prod/r2"]);
        assert_eq!(super::origins(&keys(&["r1/_key.pub"]), ""), ["r1"]);
        assert!(super::origins(&keys(&["prod/x"]), "prod").is_empty());
    }
}
