//! The doctor (crate `host`) on this server's configuration: the Rampart checks' inputs taken
//! from a [`ServerConfig`], the findings and the hardware fingerprint logged at start, and what
//! `GET /admin/doctor` ([`crate::admin`]) answers. The checks themselves are the `host` crate's.

use serde::{Deserialize, Serialize};

use crate::config::ServerConfig;

/// The doctor's inputs for `config` before it is served (`rampart doctor`): the repository,
/// the audit directory, threads, KV memory, the gRPC message limit, the drain timeout, and the
/// listen addresses, which are checked by binding them. The repository is not verified here;
/// the caller sets `repository_verification` if it verified it.
pub fn context(config: &ServerConfig) -> host::Context {
    let mut ports = vec![host::PortToCheck {
        name: "http".into(),
        addr: config.listen,
    }];
    if config.grpc.enabled {
        ports.push(host::PortToCheck {
            name: "grpc".into(),
            addr: config.grpc.listen,
        });
    }
    host::Context {
        ports,
        ..serving_context(config)
    }
}

/// [`context`] for a server that already holds its ports (they are not bound again).
pub fn serving_context(config: &ServerConfig) -> host::Context {
    // Quantized weights are written at load, into the first configured cache directory.
    let cache_dir = config
        .models
        .iter()
        .find(|m| m.quantization.is_some())
        .map(|m| {
            m.quantization_cache_dir
                .clone()
                .unwrap_or_else(engine::convert::InSitu::default_cache_dir)
        });
    host::Context {
        repository_dir: Some(absolute(&config.repo)),
        audit_dir: config.audit.enabled.then(|| absolute(&config.audit.dir)),
        cache_dir: cache_dir.as_deref().map(absolute),
        threads: config.threads,
        kv_memory_bytes: kv_memory_bytes(config),
        grpc_max_message_bytes: config
            .grpc
            .enabled
            .then_some(config.grpc.max_message_bytes as u64),
        probes: probe_timings(config, |name| std::env::var(name).ok()),
        ..host::Context::default()
    }
}

/// The deployment's probes, as the Helm chart (deploy/helm/rampart) echoes them into the
/// container's environment in seconds, beside what Rampart needs: the drain (`drain_delay_s` +
/// `shutdown_timeout_s`) and an estimate of the model load. `None` outside such a deployment
/// (no `RAMPART_PROBE_*` variable set): the check then says it has nothing to judge.
pub fn probe_timings(
    config: &ServerConfig,
    env: impl Fn(&str) -> Option<String>,
) -> Option<host::ProbeTimings> {
    let ms = |name: &str| -> Option<u64> {
        let text = env(name)?;
        let seconds: f64 = text.trim().parse().ok().filter(|s: &f64| *s >= 0.0)?;
        Some((seconds * 1000.0).round() as u64)
    };
    let probes = host::ProbeTimings {
        liveness_period_ms: ms("RAMPART_PROBE_LIVENESS_PERIOD_S"),
        liveness_timeout_ms: ms("RAMPART_PROBE_LIVENESS_TIMEOUT_S"),
        readiness_period_ms: ms("RAMPART_PROBE_READINESS_PERIOD_S"),
        readiness_timeout_ms: ms("RAMPART_PROBE_READINESS_TIMEOUT_S"),
        startup_budget_ms: ms("RAMPART_PROBE_STARTUP_BUDGET_S"),
        termination_grace_ms: ms("RAMPART_TERMINATION_GRACE_S"),
        ..host::ProbeTimings::default()
    };
    if probes == host::ProbeTimings::default() {
        return None;
    }
    Some(host::ProbeTimings {
        // The health routes answer from memory (no model runs): well under a millisecond here,
        // 100 ms is the margin a loaded node's scheduler may add.
        health_check_ms: Some(100),
        model_load_ms: model_load_estimate_ms(config),
        shutdown_timeout_ms: Some((config.drain_delay_s + config.shutdown_timeout_s) * 1000),
        ..probes
    })
}

/// Reading (and hashing) the models served at start at 100 MiB/s, a network volume's pace,
/// plus 5 s to start: each hot model's configured (else stable) version, or the stable one of
/// every model when none is listed. `None` when the repository cannot be read.
fn model_load_estimate_ms(config: &ServerConfig) -> Option<u64> {
    let repository = repo::Repository::open(&config.repo);
    let served: Vec<(String, Option<String>)> = if config.models.is_empty() {
        repository
            .models()
            .ok()?
            .into_iter()
            .map(|n| (n, None))
            .collect()
    } else {
        config
            .models
            .iter()
            .filter(|m| m.residency == crate::config::Residency::Hot)
            .map(|m| (m.name.clone(), m.version.clone()))
            .collect()
    };
    let mut bytes = 0u64;
    for (name, version) in served {
        let versions = repository.versions(&name).unwrap_or_default();
        let chosen = match &version {
            Some(v) => versions.iter().find(|m| m.version.to_string() == *v),
            None => versions.last(),
        };
        let Some(chosen) = chosen else {
            continue;
        };
        if let Ok(manifest) = repository.manifest(chosen) {
            bytes += manifest.files.iter().map(|f| f.bytes).sum::<u64>();
        }
    }
    Some(5_000 + bytes / (100 * 1024 * 1024 / 1000))
}

/// The report names directories by their absolute path: `audit` alone does not say where.
fn absolute(path: &std::path::Path) -> std::path::PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// The KV cache the configured models reserve, summed over those that give it in bytes
/// (`kv_cache_memory = "2GiB"`); a fraction of available memory (the default, 0.2) is sized
/// by the engine at load and is not counted. `None` when no model gives bytes.
pub fn kv_memory_bytes(config: &ServerConfig) -> Option<u64> {
    let bytes: Vec<u64> = config
        .models
        .iter()
        .filter_map(|m| m.kv_cache_memory.as_deref())
        .filter_map(|text| match text.parse::<engine::KvMemory>() {
            Ok(engine::KvMemory::Bytes(b)) => Some(b),
            _ => None,
        })
        .collect();
    (!bytes.is_empty()).then(|| bytes.iter().sum())
}

/// What `GET /admin/doctor` answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DoctorView {
    pub report: host::Report,
    pub fingerprint: host::Fingerprint,
}

/// Runs the checks (without the GPU load sample) and takes the fingerprint of this host, for
/// a serving process. Blocking: reads /proc and /sys, fsyncs in the audit directory.
pub fn examine(config: &ServerConfig) -> DoctorView {
    let context = serving_context(config);
    let mut report = host::run(&context, None);
    let mut held = vec![format!("http {}", config.listen)];
    if config.grpc.enabled {
        held.push(format!("grpc {}", config.grpc.listen));
    }
    for check in report
        .checks
        .iter_mut()
        .filter(|c| c.id == "rampart.ports" && c.status == host::Status::Unknown)
    {
        check.observed = format!(
            "not bound again: this server holds them ({})",
            held.join(", ")
        );
    }
    DoctorView {
        report,
        fingerprint: host::fingerprint(&context),
    }
}

/// At `rampart serve` start, on a blocking thread (start does not wait for it): the
/// fingerprint in one line, then one line per warning or error with its id, what was observed
/// and the fix.
pub fn log_at_start(config: &ServerConfig) {
    let config = config.clone();
    tokio::task::spawn_blocking(move || log_view(&examine(&config)));
}

fn log_view(view: &DoctorView) {
    let counts = &view.report.counts;
    tracing::info!(
        target: "rampart::doctor",
        fingerprint = %view.fingerprint.summary(),
        ok = counts.ok,
        warn = counts.warn,
        error = counts.error,
        unknown = counts.unknown,
        elapsed_ms = view.report.elapsed_ms,
        "host checked"
    );
    for check in &view.report.checks {
        let subject = check.subject.as_deref().unwrap_or("");
        let observed = one_line(&check.observed);
        let fix = one_line(&check.fix.lines().collect::<Vec<_>>().join("; "));
        match check.status {
            host::Status::Warn => tracing::warn!(
                target: "rampart::doctor",
                id = %check.id,
                subject,
                observed = %observed,
                fix = %fix,
                "host check warns"
            ),
            host::Status::Error => tracing::error!(
                target: "rampart::doctor",
                id = %check.id,
                subject,
                observed = %observed,
                fix = %fix,
                "host check fails"
            ),
            host::Status::Ok | host::Status::Unknown => {}
        }
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn the_context_follows_the_configuration() {
        let mut a = ModelConfig::named("a");
        a.kv_cache_memory = Some("2GiB".into());
        let mut b = ModelConfig::named("b");
        b.kv_cache_memory = Some("0.3".into());
        let mut c = ModelConfig::named("c");
        c.kv_cache_memory = Some("512MiB".into());
        c.quantization = Some("Q4_K".into());
        c.quantization_cache_dir = Some("/var/cache/q".into());
        let mut config = ServerConfig {
            threads: Some(6),
            models: vec![a, b, c],
            ..ServerConfig::default()
        };
        config.grpc.max_message_bytes = 4 << 20;
        let ctx = context(&config);
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(ctx.repository_dir, Some(cwd.join(&config.repo)));
        assert_eq!(ctx.audit_dir, Some(cwd.join(&config.audit.dir)));
        assert_eq!(
            ctx.cache_dir.as_deref(),
            Some(std::path::Path::new("/var/cache/q"))
        );
        assert_eq!(ctx.threads, Some(6));
        assert_eq!(ctx.kv_memory_bytes, Some((2 << 30) + (512 << 20)));
        assert_eq!(ctx.grpc_max_message_bytes, Some(4 << 20));
        let ports: Vec<&str> = ctx.ports.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(ports, ["http", "grpc"]);
        assert_eq!(ctx.ports[0].addr, config.listen);
        assert!(!ctx.gpu_load_sample);
        // A serving process holds its ports; gRPC off, audit off: nothing of theirs is checked.
        config.grpc.enabled = false;
        config.audit.enabled = false;
        config.models.clear();
        let ctx = serving_context(&config);
        assert!(ctx.ports.is_empty());
        assert_eq!(ctx.grpc_max_message_bytes, None);
        assert_eq!(ctx.audit_dir, None);
        assert_eq!(ctx.kv_memory_bytes, None);
        assert_eq!(ctx.cache_dir, None);
        assert_eq!(context(&config).ports.len(), 1);
    }

    #[test]
    fn the_pods_probes_come_from_its_environment() {
        let repo = tempfile::tempdir().unwrap();
        let config = ServerConfig {
            repo: repo.path().to_path_buf(),
            shutdown_timeout_s: 30,
            drain_delay_s: 5,
            ..ServerConfig::default()
        };
        assert_eq!(probe_timings(&config, |_| None), None, "outside a pod");
        let pod = [
            ("RAMPART_PROBE_LIVENESS_PERIOD_S", "10"),
            ("RAMPART_PROBE_LIVENESS_TIMEOUT_S", "0.05"),
            ("RAMPART_PROBE_READINESS_PERIOD_S", "5"),
            ("RAMPART_PROBE_READINESS_TIMEOUT_S", "3"),
            ("RAMPART_PROBE_STARTUP_BUDGET_S", "4"),
            ("RAMPART_TERMINATION_GRACE_S", "30"),
        ];
        let env = |name: &str| {
            pod.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        };
        let probes = probe_timings(&config, env).unwrap();
        assert_eq!(probes.liveness_timeout_ms, Some(50));
        assert_eq!(probes.readiness_period_ms, Some(5000));
        assert_eq!(probes.shutdown_timeout_ms, Some(35_000), "delay + drain");
        assert_eq!(
            probes.model_load_ms,
            Some(5_000),
            "an empty repository: the start alone"
        );
        let ctx = host::Context {
            probes: Some(probes),
            ..host::Context::default()
        };
        let report = host::run(&ctx, Some(host::Area::Rampart));
        let check = report
            .checks_with_id("rampart.probe_timings")
            .next()
            .unwrap();
        assert_eq!(check.status, host::Status::Error, "{check:?}");
        let fix = &check.fix;
        for wanted in [
            "--set probes.startup.failureThreshold=1",
            "--set probes.liveness.timeoutSeconds=1",
            "--set terminationGracePeriodSeconds=45",
        ] {
            assert!(fix.contains(wanted), "{wanted} not in {fix}");
        }
        assert!(!fix.contains("probes.readiness"), "{fix}");
    }
}
