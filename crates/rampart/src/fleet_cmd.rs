//! `rampart fleet status`: a fleet as one of its replicas sees it (`GET /admin/fleet`, a key with
//! the `admin` scope): the replicas (last heartbeat, readiness, load, versions), the judge's
//! holder and every release's pooled statistics (docs/fleet.md).

use std::process::ExitCode;

use anyhow::{bail, Result};

use crate::release_cmd::Api;

#[derive(Debug, clap::Args)]
pub struct FleetArgs {
    /// A replica (`http://host:port`), or the load balancer in front of them.
    #[arg(long, global = true, env = "RAMPART_URL", value_name = "URL")]
    pub url: Option<String>,
    /// The API key (scope `admin`).
    #[arg(
        long,
        global = true,
        env = "RAMPART_API_KEY",
        value_name = "KEY",
        hide_env_values = true
    )]
    pub key: Option<String>,
    /// Print the JSON.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    command: FleetCommand,
}

#[derive(Debug, clap::Subcommand)]
enum FleetCommand {
    /// The replicas, the judge and the releases' pooled statistics.
    Status,
}

pub fn run(args: FleetArgs) -> Result<ExitCode> {
    let FleetCommand::Status = args.command;
    let Some(url) = &args.url else {
        bail!("`rampart fleet status` asks a running replica: give --url (or RAMPART_URL)");
    };
    let (status, v) = Api::new(url, args.key.clone())?.call("GET", "/admin/fleet", None)?;
    if status != 200 {
        let message = v["error"]["message"].as_str().unwrap_or("no message");
        bail!("GET /admin/fleet: {status}: {message}");
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(ExitCode::SUCCESS);
    }
    print!("{}", render(&v));
    Ok(ExitCode::SUCCESS)
}

/// The fleet as text: one line per replica, then one block per release.
fn render(v: &serde_json::Value) -> String {
    let mut out = String::new();
    let judge = v["judge"].as_str().unwrap_or("none");
    out.push_str(&format!(
        "fleet of {} (asked {}), database {} ({}), judge: {judge}\n",
        v["replicas"].as_array().map_or(0, Vec::len),
        v["replica"].as_str().unwrap_or("?"),
        v["database"].as_str().unwrap_or("?"),
        if v["database_up"].as_bool() == Some(true) {
            "up"
        } else {
            "DOWN"
        },
    ));
    out.push_str(&format!(
        "{:<24} {:>9} {:<10} {:>9} {:>8}  {}\n",
        "REPLICA", "SEEN", "STATE", "IN FLIGHT", "WAITING", "SERVING"
    ));
    for r in v["replicas"].as_array().into_iter().flatten() {
        let state = if r["gone"].as_bool() == Some(true) {
            "gone"
        } else if r["draining"].as_bool() == Some(true) {
            "draining"
        } else if r["ready"].as_bool() == Some(true) {
            "ready"
        } else {
            "not ready"
        };
        let name = format!(
            "{}{}",
            r["replica"].as_str().unwrap_or("?"),
            if r["replica"].as_str() == Some(judge) {
                " (judge)"
            } else {
                ""
            }
        );
        out.push_str(&format!(
            "{:<24} {:>7.1}s {:<10} {:>9} {:>8}  {}\n",
            name,
            r["last_seen_ms"].as_f64().unwrap_or(0.0) / 1000.0,
            state,
            r["in_flight"],
            r["waiting"],
            r["serving"]
                .as_array()
                .map(|s| s
                    .iter()
                    .filter_map(|x| x.as_str())
                    .collect::<Vec<_>>()
                    .join(" "))
                .unwrap_or_default(),
        ));
    }
    for rel in v["releases"].as_array().into_iter().flatten() {
        let s = &rel["status"];
        out.push_str(&format!(
            "\n{}: {} → {} {} step {} weight {:.0}% (revision {}, by {})\n  pooled: {} stable, {} control, {} candidate samples; errors {}/{}\n",
            rel["model"].as_str().unwrap_or("?"),
            s["stable"].as_str().unwrap_or("?"),
            s["candidate"].as_str().unwrap_or("-"),
            s["phase"].as_str().unwrap_or("?"),
            s["step"].as_u64().map_or(0, |x| x + 1),
            s["weight"].as_f64().unwrap_or(0.0) * 100.0,
            rel["revision"],
            rel["updated_by"].as_str().unwrap_or("?"),
            s["samples_stable"],
            s["samples_control"],
            s["samples_candidate"],
            s["errors_stable"],
            s["errors_candidate"],
        ));
        for w in rel["windows"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "  {:<22} {} stable, {} control, {} candidate\n",
                w["replica"].as_str().unwrap_or("?"),
                w["samples_stable"],
                w["samples_control"],
                w["samples_candidate"],
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn renders_replicas_the_judge_and_releases() {
        let v = serde_json::json!({
            "replica": "r1", "database": "postgresql://ops@db/rampart", "database_up": true,
            "judge": "r2",
            "replicas": [
                {"replica": "r2", "last_seen_ms": 120, "ready": true, "draining": false, "gone": false, "in_flight": 3, "waiting": 0, "serving": ["m@1.0.0", "m@1.1.0"]},
                {"replica": "r3", "last_seen_ms": 40000, "ready": false, "draining": false, "gone": true, "in_flight": 0, "waiting": 0, "serving": []}
            ],
            "releases": [{"model": "m", "revision": 7, "updated_by": "r2",
                "status": {"stable": "1.0.0", "candidate": "1.1.0", "phase": "running", "step": 0, "weight": 0.05,
                    "samples_stable": 300, "samples_control": 14, "samples_candidate": 15, "errors_stable": 0, "errors_candidate": 1},
                "windows": [{"replica": "r2", "samples_stable": 100, "samples_control": 5, "samples_candidate": 5}]}]
        });
        let text = super::render(&v);
        assert!(text.contains("judge: r2"), "{text}");
        assert!(text.contains("r2 (judge)"), "{text}");
        assert!(text.contains("gone"), "{text}");
        assert!(
            text.contains("m: 1.0.0 → 1.1.0 running step 1 weight 5%"),
            "{text}"
        );
        assert!(text.contains("revision 7, by r2"), "{text}");
    }
}
