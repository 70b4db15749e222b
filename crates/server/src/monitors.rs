//! The monitors' record sink: each answered request's features (its input as text or image
//! statistics, its output's entropy or confidence) feed the drift detector and the output
//! monitors of its model version. Off the request path (a lossy lane: a monitor that falls
//! behind loses observations, counted, and never slows a request).
//!
//! Baselines live beside the versions (`<repo>/<model>/monitors/<version>.json`, or under
//! `[monitor] dir`): read when a version is first seen, captured from its first requests when
//! there is none, replaced through the admin API. In the calibrated mode a new baseline is
//! calibrated on a blocking thread; until then the `ks` rule applies. Every alarm raised or
//! cleared is a controller decision: a log line, a metric and (with the audit log) an entry.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use metrics::{counter, gauge};
use monitor::{Baseline, DriftMonitor, DriftView, Observation, OutputMonitor, OutputView};
use record::{Delivery, Envelope, Sink, SinkFuture};
use serde::Serialize;

use crate::config::MonitorConfig;
use pipeline::decisions::Decisions;

/// Control-token texts of the common chat templates, whose share of a prompt is a feature.
const CONTROL_TEXTS: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "[INST]",
    "[/INST]",
    "<s>",
    "</s>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
    "<|end|>",
];

/// The output value each kind of model is watched on.
const ENTROPY: &str = "output.entropy_mean";
const CONFIDENCE: &str = "output.confidence";

/// One model version's monitors.
struct VersionMonitors {
    drift: DriftMonitor,
    outputs: Vec<OutputMonitor>,
    calibrating: bool,
    /// The features its manifest declares (`[pipeline.monitor]`); `None`: all of them.
    features: Option<repo::pipeline::MonitorFeatures>,
}

/// What `GET /admin/monitors` shows of a model version.
#[derive(Debug, Clone, Serialize)]
pub struct MonitorView {
    pub model: String,
    pub version: String,
    pub baseline_path: String,
    pub drift: DriftView,
    pub outputs: Vec<OutputView>,
}

/// Every model version's monitors, shared by the sink and the admin API.
pub struct Monitors {
    cfg: MonitorConfig,
    repo: PathBuf,
    versions: Mutex<HashMap<(String, String), VersionMonitors>>,
    /// Where alarms are published.
    decisions: Decisions,
}

impl std::fmt::Debug for Monitors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitors").finish_non_exhaustive()
    }
}

/// A baseline could not be read, kept or accepted.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MonitorError(pub String);

impl Monitors {
    pub fn new(cfg: MonitorConfig, repo: PathBuf, decisions: Decisions) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            repo,
            versions: Mutex::new(HashMap::new()),
            decisions,
        })
    }

    /// Where a version's baseline is kept.
    pub fn baseline_path(&self, model: &str, version: &str) -> Result<PathBuf, MonitorError> {
        baseline_path(&self.cfg, &self.repo, model, version)
    }

    fn load_baseline(&self, model: &str, version: &str) -> Option<Baseline> {
        let path = self.baseline_path(model, version).ok()?;
        let text = std::fs::read_to_string(&path).ok()?;
        match serde_json::from_str::<Baseline>(&text)
            .map_err(|e| e.to_string())
            .and_then(|b| b.validate().map(|()| b).map_err(|e| e.to_string()))
        {
            Ok(b) => Some(b),
            Err(e) => {
                tracing::error!(target: "rampart::monitor", model, version, path = %path.display(), error = %e, "the stored baseline is unreadable; capturing a new one");
                None
            }
        }
    }

    fn save_baseline(&self, model: &str, version: &str, b: &Baseline) -> Result<(), MonitorError> {
        write_baseline(&self.baseline_path(model, version)?, b)
    }

    fn fresh(&self, model: &str, version: &str) -> VersionMonitors {
        let drift = match self.load_baseline(model, version) {
            Some(b) => {
                tracing::info!(target: "rampart::monitor", model, version, source = %b.source, rows = b.rows.len(), "monitor baseline loaded");
                DriftMonitor::with_baseline(self.cfg.drift.clone(), b)
            }
            None => {
                tracing::info!(target: "rampart::monitor", model, version, requests = self.cfg.drift.baseline_requests, "no monitor baseline: capturing one from the first requests");
                DriftMonitor::capturing(self.cfg.drift.clone())
            }
        };
        let mut v = VersionMonitors {
            drift,
            outputs: Vec::new(),
            calibrating: false,
            features: declared_features(&self.repo, model, version),
        };
        seed_outputs(&mut v, &self.cfg.output);
        v
    }

    /// Every version's state.
    pub fn views(&self) -> Vec<MonitorView> {
        let versions = self.versions.lock().expect("monitors");
        let mut views: Vec<MonitorView> = versions
            .iter()
            .map(|((model, version), v)| MonitorView {
                model: model.clone(),
                version: version.clone(),
                baseline_path: self
                    .baseline_path(model, version)
                    .map_or_else(|e| e.to_string(), |p| p.display().to_string()),
                drift: v.drift.view(),
                outputs: v.outputs.iter().map(OutputMonitor::view).collect(),
            })
            .collect();
        views.sort_by(|a, b| (&a.model, &a.version).cmp(&(&b.model, &b.version)));
        views
    }

    /// Replaces a version's baseline (the admin API), kept on disk first.
    pub fn replace_baseline(
        self: &Arc<Self>,
        model: &str,
        version: &str,
        baseline: Baseline,
    ) -> Result<(), MonitorError> {
        baseline
            .validate()
            .map_err(|e| MonitorError(e.to_string()))?;
        if baseline.rows.is_empty() && baseline.categorical.is_empty() {
            return Err(MonitorError("the baseline holds no observation".into()));
        }
        self.save_baseline(model, version, &baseline)?;
        let mut versions = self.versions.lock().expect("monitors");
        let key = (model.to_string(), version.to_string());
        let v = versions
            .entry(key)
            .or_insert_with(|| self.fresh(model, version));
        v.drift.set_baseline(baseline);
        v.outputs.clear();
        seed_outputs(v, &self.cfg.output);
        self.calibrate_if_needed(model, version, v);
        Ok(())
    }

    /// Forgets a version's baseline: the next requests become the new one.
    pub fn recapture(&self, model: &str, version: &str) -> Result<bool, MonitorError> {
        let path = self.baseline_path(model, version)?;
        let existed = match std::fs::remove_file(&path) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => return Err(MonitorError(format!("{}: {e}", path.display()))),
        };
        let mut versions = self.versions.lock().expect("monitors");
        if let Some(v) = versions.get_mut(&(model.to_string(), version.to_string())) {
            v.drift.recapture();
            v.outputs.clear();
            return Ok(true);
        }
        Ok(existed)
    }

    fn calibrate_if_needed(self: &Arc<Self>, model: &str, version: &str, v: &mut VersionMonitors) {
        if v.calibrating || !v.drift.needs_calibration() {
            return;
        }
        let Some(baseline) = v.drift.baseline().cloned() else {
            return;
        };
        v.calibrating = true;
        let cfg = self.cfg.drift.clone();
        let this = Arc::clone(self);
        let (model, version) = (model.to_string(), version.to_string());
        std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let seed = baseline.created_ms ^ 0x9E37_79B9;
            let c = monitor::calibrate(&baseline, &cfg, seed);
            tracing::info!(target: "rampart::monitor", model = %model, version = %version, threshold = c.threshold, run_length = c.run_length, estimated_run_length = c.estimated_run_length, simulated = c.simulated_observations, seconds = started.elapsed().as_secs_f64(), "monitor calibrated");
            let mut versions = this.versions.lock().expect("monitors");
            let Some(v) = versions.get_mut(&(model.clone(), version.clone())) else {
                return;
            };
            v.calibrating = false;
            // The baseline may have been replaced meanwhile: keep the calibration only for the
            // one it was made on.
            if v.drift.baseline().map(|b| b.created_ms) != Some(baseline.created_ms) {
                return;
            }
            v.drift.set_calibration(c);
            if let Some(b) = v.drift.baseline().cloned() {
                if let Err(e) = this.save_baseline(&model, &version, &b) {
                    tracing::error!(target: "rampart::monitor", model = %model, version = %version, error = %e, "the calibrated baseline could not be kept");
                }
            }
        });
    }

    /// Feeds one record's observations to its version's monitors.
    fn take(self: &Arc<Self>, envelope: &Envelope) {
        let r = &envelope.record;
        // A shadow release's control answers a copy of a request the stable version already
        // answered (and its monitors saw): counting it again would weigh mirrored inputs twice.
        if r.endpoint == "shadow" && r.variant == Some("control") {
            return;
        }
        let mut observations = observations(envelope);
        if observations.is_empty() {
            return;
        }
        let mut versions = self.versions.lock().expect("monitors");
        let key = (r.model.clone(), r.version.clone());
        let v = match versions.entry(key) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let v = e.insert(self.fresh(&r.model, &r.version));
                // A stored baseline without a calibration for these settings (made offline,
                // or under the `ks` mode) is calibrated now, not never.
                self.calibrate_if_needed(&r.model, &r.version, v);
                v
            }
        };
        if let Some(f) = &v.features {
            for o in &mut observations {
                o.values.retain(|(name, _)| f.watches(name));
            }
        }
        let tests = v.drift.tests();
        for o in &observations {
            for a in v.drift.observe(o) {
                drift_alarm(&self.decisions, &r.model, &r.version, &a);
            }
            for m in &mut v.outputs {
                if let Some(monitor::Value::Num(x)) = o.get(m.feature()) {
                    if let Some(a) = m.observe(*x) {
                        output_alarm(&self.decisions, &r.model, &r.version, &a);
                    }
                }
            }
            if v.outputs.is_empty() {
                seed_outputs_from(v, o, &self.cfg.output);
            }
        }
        if let Some(b) = v.drift.take_fresh_baseline() {
            tracing::info!(target: "rampart::monitor", model = %r.model, version = %r.version, observations = b.observations, features = b.columns.len() + b.categorical.len(), "monitor baseline captured");
            if let Err(e) = self.save_baseline(&r.model, &r.version, &b) {
                tracing::error!(target: "rampart::monitor", model = %r.model, version = %r.version, error = %e, "the captured baseline could not be kept (it stays in memory)");
            }
            seed_outputs(v, &self.cfg.output);
            self.calibrate_if_needed(&r.model, &r.version, v);
        }
        let labels = [("model", r.model.clone()), ("version", r.version.clone())];
        gauge!("rampart_monitor_window_requests", &labels).set(v.drift.window_len() as f64);
        if v.drift.tests() != tests {
            gauge!("rampart_drift_active", &labels).set(f64::from(u8::from(v.drift.active())));
            for s in v.drift.states() {
                let l = [
                    ("model", r.model.clone()),
                    ("version", r.version.clone()),
                    ("feature", s.feature.clone()),
                ];
                gauge!("rampart_feature_drift_score", &l).set(s.statistic);
                gauge!("rampart_feature_drift_pvalue", &l).set(s.p_value);
            }
        }
        for m in &v.outputs {
            let Some((mean, std)) = m.window_stats() else {
                continue;
            };
            if m.feature() == ENTROPY {
                gauge!("rampart_output_entropy_window_mean", &labels).set(mean);
                gauge!("rampart_output_entropy_window_std", &labels).set(std);
            } else {
                gauge!("rampart_output_confidence_window_mean", &labels).set(mean);
            }
        }
    }
}

/// Where a version's baseline is kept: `<repo>/<model>/monitors/<version>.json`, or
/// `<dir>/<model>/<version>.json` under `[monitor] dir`. The name and version are checked as
/// a repository reference first ([`repo::ModelRef::new`]): nothing from a route or a command
/// can name a file outside those folders.
pub fn baseline_path(
    cfg: &MonitorConfig,
    repo: &std::path::Path,
    model: &str,
    version: &str,
) -> Result<PathBuf, MonitorError> {
    let checked = repo::ModelRef::new(model, Some(version))
        .map_err(|e| MonitorError(format!("no baseline path for {model:?}@{version:?}: {e}")))?;
    let file = format!("{}.json", checked.version_text().unwrap_or_default());
    Ok(match &cfg.dir {
        Some(dir) => dir.join(&checked.name).join(file),
        None => repo.join(&checked.name).join("monitors").join(file),
    })
}

/// Writes a baseline file whole or not at all (a temporary file renamed over it).
pub fn write_baseline(path: &std::path::Path, b: &Baseline) -> Result<(), MonitorError> {
    let io = |e: std::io::Error| MonitorError(format!("{}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let text = serde_json::to_vec(b).map_err(|e| MonitorError(e.to_string()))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)?;
    Ok(())
}

/// The features a version's manifest declares for the monitors (`[pipeline.monitor]`); `None`:
/// every feature (none declared, or the version's manifest is unreadable).
pub fn declared_features(
    repo: &std::path::Path,
    model: &str,
    version: &str,
) -> Option<repo::pipeline::MonitorFeatures> {
    let repository = repo::Repository::open(repo);
    let wanted = repo::ModelRef {
        name: model.to_string(),
        version: Some(semver::Version::parse(version).ok()?),
    };
    let features = repository
        .resolve(&wanted)
        .and_then(|v| repository.manifest(&v))
        .ok()?
        .pipeline?
        .monitor?;
    tracing::info!(target: "rampart::monitor", model, version, features = ?features.features, exclude = ?features.exclude, "monitor features declared by the manifest");
    Some(features)
}

/// The output monitors a baseline implies (entropy for LLMs, confidence for tensor models),
/// their baselines taken from it.
fn seed_outputs(v: &mut VersionMonitors, cfg: &monitor::OutputConfig) {
    let Some(b) = v.drift.baseline() else {
        return;
    };
    let refs = b.references();
    for (c, name) in b.columns.iter().enumerate() {
        if (name == ENTROPY || name == CONFIDENCE)
            && !v.outputs.iter().any(|m| m.feature() == name)
            && refs[c].sorted.len() >= 10
        {
            v.outputs.push(OutputMonitor::new(
                name,
                cfg.clone(),
                Some((refs[c].mean, refs[c].std)),
                0,
            ));
        }
    }
}

/// While capturing, an output monitor starts with the first observation that has its value.
fn seed_outputs_from(v: &mut VersionMonitors, o: &Observation, cfg: &monitor::OutputConfig) {
    for name in [ENTROPY, CONFIDENCE] {
        if o.get(name).is_some() {
            let n = v.drift.config().baseline_requests;
            v.outputs
                .push(OutputMonitor::new(name, cfg.clone(), None, n));
        }
    }
}

fn drift_alarm(decisions: &Decisions, model: &str, version: &str, a: &monitor::Alarm) {
    if a.event == "raised" {
        counter!("rampart_drift_alarms_total", "model" => model.to_string(), "version" => version.to_string(), "feature" => a.feature.clone()).increment(1);
        tracing::warn!(target: "rampart::monitor", model, version, feature = %a.feature, event = a.event, mode = a.mode, statistic = a.statistic, p_value = a.p_value, effect = a.effect, psi = a.psi, threshold = a.threshold, window = a.window, observation = a.observation, "drift alarm raised");
    } else {
        tracing::info!(target: "rampart::monitor", model, version, feature = %a.feature, event = a.event, mode = a.mode, statistic = a.statistic, p_value = a.p_value, effect = a.effect, window = a.window, observation = a.observation, "drift alarm cleared");
    }
    let cause = format!(
        "{}: {} statistic {:.4} (threshold {:.4}), p {:.2e}, effect {:.3}, window {}",
        a.feature, a.mode, a.statistic, a.threshold, a.p_value, a.effect, a.window
    );
    decisions.note(
        &format!("monitor.drift_{}", a.event),
        Some(model),
        &format!("{model}@{version}"),
        &cause,
        serde_json::to_value(a).unwrap_or_default(),
    );
}

fn output_alarm(
    decisions: &Decisions,
    model: &str,
    version: &str,
    a: &monitor::output::OutputAlarm,
) {
    if a.event == "raised" {
        counter!("rampart_drift_alarms_total", "model" => model.to_string(), "version" => version.to_string(), "feature" => a.feature.clone()).increment(1);
        tracing::warn!(target: "rampart::monitor", model, version, feature = %a.feature, event = a.event, kind = a.kind, window_mean = a.window_mean, window_std = a.window_std, baseline_mean = a.baseline_mean, baseline_std = a.baseline_std, z = a.z, window = a.window, "output monitor alarm raised");
    } else {
        tracing::info!(target: "rampart::monitor", model, version, feature = %a.feature, event = a.event, kind = a.kind, window_mean = a.window_mean, baseline_mean = a.baseline_mean, "output monitor alarm cleared");
    }
    let cause = format!(
        "{} {}: window mean {:.3} (std {:.3}) against baseline {:.3} (std {:.3}), z {:.1}",
        a.feature, a.kind, a.window_mean, a.window_std, a.baseline_mean, a.baseline_std, a.z
    );
    decisions.note(
        &format!("monitor.output_{}", a.event),
        Some(model),
        &format!("{model}@{version}"),
        &cause,
        serde_json::to_value(a).unwrap_or_default(),
    );
}

/// The features of a text input, made in the request path (a chat's message contents, a
/// prompt, embedding inputs): one pass over the characters.
pub fn text_observation(chat: bool, input_for_hash: &str) -> Observation {
    let joined;
    let text = if chat {
        match serde_json::from_str::<Vec<(String, String)>>(input_for_hash) {
            Ok(pairs) => {
                joined = pairs
                    .into_iter()
                    .map(|(_, content)| content)
                    .collect::<Vec<_>>()
                    .join("\n");
                joined.as_str()
            }
            Err(_) => input_for_hash,
        }
    } else {
        input_for_hash
    };
    monitor::features::text(text, 0, CONTROL_TEXTS)
}

/// The observations of one record: the ones the request path made (images, tensors, text),
/// with the token count and the generation's features added here. Refused, failed and fallback
/// answers are not the version's behaviour and are left out.
pub fn observations(envelope: &Envelope) -> Vec<Observation> {
    let r = &envelope.record;
    if r.status != 200 || r.refusal.is_some() || r.fallback_level != 0 || r.model.is_empty() {
        return Vec::new();
    }
    let mut out = envelope.observations.clone();
    let text = out.len() == 1 && out[0].get("text.chars").is_some();
    if text {
        if r.prompt_tokens > 0 {
            out[0].num("text.tokens", r.prompt_tokens as f64);
        }
        if !envelope.token_entropies.is_empty() {
            out[0].extend(monitor::features::generation(
                &envelope.token_entropies,
                r.completion_tokens,
            ));
        }
    }
    out
}

/// The record sink that feeds [`Monitors`].
pub struct MonitorSink {
    monitors: Arc<Monitors>,
}

impl MonitorSink {
    pub fn new(monitors: Arc<Monitors>) -> Self {
        Self { monitors }
    }
}

impl Sink for MonitorSink {
    fn name(&self) -> &'static str {
        "monitor"
    }

    fn delivery(&self) -> Delivery {
        Delivery::Lossy {
            capacity: self.monitors.cfg.lane_capacity,
        }
    }

    /// Records arrive in batches and are taken on a blocking thread: a version's first record
    /// reads its baseline file, a finished capture writes one, and the features cost CPU; none
    /// of it runs on the async workers.
    fn max_batch(&self) -> usize {
        MONITOR_BATCH
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        let envelopes = [Arc::new(envelope.clone())];
        Box::pin(async move { self.write_batch(&envelopes).await })
    }

    fn write_batch<'a>(&'a mut self, envelopes: &'a [Arc<Envelope>]) -> SinkFuture<'a> {
        let monitors = Arc::clone(&self.monitors);
        let envelopes = envelopes.to_vec();
        Box::pin(async move {
            tokio::task::spawn_blocking(move || {
                for e in &envelopes {
                    monitors.take(e);
                }
            })
            .await
            .map_err(|e| record::SinkError(format!("the monitors' task stopped: {e}")))
        })
    }
}

/// Records the monitors' lane hands over at once.
const MONITOR_BATCH: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_envelope(text: &str, entropy: f32) -> Envelope {
        let mut e = record::testing::sample_envelope(0);
        e.record.model = "m".into();
        e.record.version = "1.0.0".into();
        e.record.status = 200;
        e.record.refusal = None;
        e.record.fallback_level = 0;
        e.record.completion_tokens = 4;
        e.token_entropies = vec![entropy; 4];
        e.observations = vec![text_observation(
            true,
            &serde_json::to_string(&[("user", text)]).unwrap(),
        )];
        e
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_monitor_sink_passes_the_sink_contract() {
        let dir = tempfile::tempdir().unwrap();
        let monitors = Monitors::new(
            MonitorConfig::default(),
            dir.path().to_path_buf(),
            Decisions::default(),
        );
        record::testing::check_sink(|| MonitorSink::new(Arc::clone(&monitors))).await;
    }

    #[test]
    fn a_chat_record_gives_text_and_generation_features_and_refusals_give_none() {
        let e = chat_envelope("Hello <|im_start|> there", 1.5);
        let o = observations(&e);
        assert_eq!(o.len(), 1);
        assert!(o[0].get("text.chars").is_some());
        assert!(
            matches!(o[0].get(ENTROPY), Some(monitor::Value::Num(x)) if (*x - 1.5).abs() < 1e-6)
        );
        let mut refused = e.clone();
        refused.record.status = 429;
        assert!(observations(&refused).is_empty());
        let mut fallback = e;
        fallback.record.fallback_level = 1;
        assert!(observations(&fallback).is_empty());
    }

    #[test]
    fn a_version_captures_keeps_and_reloads_its_baseline_and_sees_a_collapse() {
        let dir = std::env::temp_dir().join(format!("rampart-monitors-{}", std::process::id()));
        let cfg = MonitorConfig {
            drift: monitor::DriftConfig {
                baseline_requests: 200,
                ..monitor::DriftConfig::default()
            },
            ..MonitorConfig::default()
        };
        let m = Monitors::new(cfg.clone(), dir.clone(), Decisions::default());
        let mut rng = monitor::stats::SplitMix(9);
        for i in 0..200 {
            let e = 1.5 + 0.3 * rng.normal() as f32;
            m.take(&chat_envelope(
                &format!("question number {i} about the weather"),
                e,
            ));
        }
        let path = m.baseline_path("m", "1.0.0").unwrap();
        assert!(path.is_file(), "{}", path.display());
        let views = m.views();
        assert_eq!(views[0].drift.phase, "watching");
        assert_eq!(views[0].outputs[0].feature, ENTROPY);
        // A restart reads it back.
        let again = Monitors::new(cfg, dir.clone(), Decisions::default());
        for _ in 0..100 {
            again.take(&chat_envelope(
                "what is the weather",
                1.5 + 0.3 * rng.normal() as f32,
            ));
        }
        let v = &again.views()[0];
        assert_eq!(
            v.drift.baseline_source.as_deref(),
            Some("first 200 requests")
        );
        assert_eq!(v.outputs[0].alarm, None);
        for _ in 0..60 {
            again.take(&chat_envelope("what is the weather", 0.001));
        }
        assert_eq!(again.views()[0].outputs[0].alarm, Some("collapse"));
        assert!(again.recapture("m", "1.0.0").unwrap());
        assert!(!path.exists());
        assert_eq!(again.views()[0].drift.phase, "capturing");
        let _ = std::fs::remove_dir_all(dir);
    }
}
