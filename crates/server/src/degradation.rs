//! The degradation controllers' task: once per window (`[degradation] window_ms`) it reads the
//! host's memory (cgroup, process, PSI) and, for every language model served, the engine's
//! latency samples and scheduler state and the admission's counters; each model's controller
//! (crate `degrade`) judges the window, and its limits go to the engine (batch, prefill
//! budget, saturation switch) and to the admission (requests let in at once).
//!
//! Every change is a controller decision: a log line with its cause, the counter
//! `rampart_degradation_changes_total{model,cause}`, and an audit entry when the audit log is
//! on. The state is at `GET /admin/degradation` and in `GET /admin/backends`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use degrade::{Cause, Change, Controller, Decision, Limits, Settings, Signals};
use engine::{Engine, KvMemory};
use metrics::{counter, gauge};
use serde::Serialize;

use crate::config::{MemoryConfig, ModelConfig, ServerConfig};
use crate::registry::Entry;
use crate::state::AppState;

/// Changes remembered per model for the admin view.
const RECENT: usize = 32;

/// One memory reading and what it was measured against.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct MemoryReading {
    /// `used_bytes / limit_bytes`.
    pub ratio: Option<f64>,
    pub used_bytes: Option<u64>,
    pub limit_bytes: Option<u64>,
    /// `rss` (the process against `[memory] limit`), `cgroup` (its usage against its limit)
    /// or `host` (used against total memory).
    pub source: &'static str,
    /// Memory PSI `some avg10`, percent.
    pub psi_some_avg10: Option<f64>,
}

/// Reads memory as `[memory]` says.
pub fn read_memory(sample: &host::TelemetrySample, config: &MemoryConfig) -> MemoryReading {
    let psi_some_avg10 = sample
        .pressure
        .iter()
        .find(|p| p.resource == "memory" && p.kind == "some")
        .map(|p| p.avg10_percent);
    let limit = config
        .limit
        .as_deref()
        .and_then(|l| l.parse::<KvMemory>().ok());
    // The cgroup's working set: usage minus the page cache the kernel drops first (the model
    // file read through the cache, logs), as the OOM killer and the kubelet see it.
    let cgroup = match (
        sample.cgroup.memory_usage_bytes,
        sample.cgroup.memory_limit_bytes,
    ) {
        (Some(used), Some(limit)) => Some((
            used.saturating_sub(sample.cgroup.memory_inactive_file_bytes.unwrap_or(0)),
            limit,
        )),
        _ => None,
    };
    let host = match (sample.memory.total_bytes, sample.memory.available_bytes) {
        (Some(total), Some(available)) => Some((total.saturating_sub(available), total)),
        _ => None,
    };
    let (source, used, limit) = match limit {
        Some(KvMemory::Bytes(bytes)) => ("rss", sample.process.resident_bytes, Some(bytes)),
        other => {
            let share = match other {
                Some(KvMemory::Fraction(f)) => f,
                _ => 1.0,
            };
            match (cgroup, host) {
                (Some((used, limit)), _) => {
                    ("cgroup", Some(used), Some((limit as f64 * share) as u64))
                }
                (None, Some((used, total))) => {
                    ("host", Some(used), Some((total as f64 * share) as u64))
                }
                (None, None) => ("none", None, None),
            }
        }
    };
    let ratio = match (used, limit) {
        (Some(u), Some(l)) if l > 0 => Some(u as f64 / l as f64),
        _ => None,
    };
    MemoryReading {
        ratio,
        used_bytes: used,
        limit_bytes: limit,
        source,
        psi_some_avg10,
    }
}

/// The latency objectives a model's controller keeps.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Objectives {
    pub ttft_p99_ms: Option<u64>,
    pub itl_p99_ms: Option<u64>,
}

/// One change, as the admin API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ChangeView {
    /// Unix milliseconds.
    pub at_ms: u64,
    pub window: u64,
    #[serde(flatten)]
    pub change: Change,
}

/// One model version's controller, as the admin API shows it.
#[derive(Debug, Clone, Serialize)]
pub struct ModelView {
    /// The backend id (`name@version`).
    pub backend: String,
    pub model: String,
    /// 0 every limit at its ceiling; 1 only the prefill budget trimmed; 2 the batch or
    /// admission reduced; 3 saturated (no new prefill).
    pub level: u8,
    pub limits: Limits,
    pub ceilings: Limits,
    pub objectives: Objectives,
    /// What the last window was judged on.
    pub signals: Signals,
    pub window: u64,
    /// The latest changes, newest last.
    pub recent: VecDeque<ChangeView>,
    /// The first-token gate (with a TTFT objective): prompts predicted to wait longer than
    /// `max_wait_ms` to be read are refused at submission.
    pub first_token_gate: Option<GateView>,
    /// While new prefills are stopped, a request that has not started is refused (429
    /// `shedding`) after this many milliseconds (`[degradation] saturation_wait_ms`; 0: it
    /// waits for the saturation to end).
    pub saturation_wait_ms: u64,
    /// Requests refused that way since the engine started.
    pub saturation_refused: u64,
    /// The prefill budget counts depth-0 tokens: a prompt token at depth `d` costs
    /// `1 + d / prefill_depth_equivalent`, fitted to the engine's steps (none before the fit is
    /// trusted: one each).
    pub prefill_depth_equivalent: Option<f64>,
    /// Where the latest window's inter-token gaps were measured, and their p99 at both places.
    pub itl_window: ItlWindow,
}

/// The inter-token gaps of one window. The controller keeps its objective on the gaps measured
/// where the server hands tokens to its clients (`delivered`: the step plus the way out of the
/// process, what the clients and `rampart_inter_token_latency_seconds` see); on the engine's
/// own gaps only when no response was delivered in the window (a backend that serves the
/// front no single-choice stream).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ItlWindow {
    /// `delivered` or `engine`; empty before the first gap.
    pub source: &'static str,
    pub engine_p99_ms: Option<f64>,
    pub delivered_p99_ms: Option<f64>,
}

/// The engine's first-token gate and what it predicts from.
#[derive(Debug, Clone, Serialize)]
pub struct GateView {
    pub max_wait_ms: u64,
    pub backlog_tokens: usize,
    pub prompt_tokens_per_second: f64,
    /// Added to every prediction: how much later than predicted the latest first tokens came
    /// (99th percentile of the last 256; 0 before 20).
    pub margin_ms: f64,
    /// Prompts it refused since the engine started.
    pub refused: u64,
    /// Capacity signals for an autoscaler: prompts the gate let in and refused per second
    /// over the last window (a refused client that retries is counted each time).
    pub admitted_per_second: f64,
    pub shed_per_second: f64,
    /// How long a new prompt would be predicted to wait to be read now: the backlog, every
    /// booking and the margin (none before the reading rate is measured). Above `max_wait_ms`
    /// the model needs more capacity than it has.
    pub predicted_wait_ms: Option<f64>,
    /// The bookings of refused requests (`[admission] reservations`): outstanding, their
    /// prompt tokens, and what became of them.
    pub reservations: engine::ReservationStats,
}

/// The share of the TTFT objective a prompt may be predicted to wait to be read (the rest is
/// for tokenizing, the first sampling and the way out).
const GATE_SHARE: f64 = 0.9;

struct ModelState {
    controller: Controller,
    engine: Arc<Engine>,
    /// The engine's count of steps that held prompts back, at the last window.
    held_steps: u64,
    /// The engine's count of prompts its first-token gate refused, at the last window.
    gate_refusals: u64,
    /// The gate's bookings' counters at the last window.
    reservations: engine::ReservationStats,
    view: ModelView,
}

/// Every language model's controller.
#[derive(Default)]
pub struct Degradation {
    models: Mutex<HashMap<String, ModelState>>,
    memory: Mutex<MemoryReading>,
}

impl std::fmt::Debug for Degradation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Degradation").finish_non_exhaustive()
    }
}

/// The whole state, for `GET /admin/degradation`.
#[derive(Debug, Clone, Serialize)]
pub struct DegradationView {
    pub enabled: bool,
    pub window_ms: u64,
    pub scaling: f64,
    pub saturation: f64,
    pub memory: MemoryReading,
    pub models: Vec<ModelView>,
}

fn model_config<'a>(config: &'a ServerConfig, name: &str) -> Option<&'a ModelConfig> {
    config.model(name)
}

/// The controller's settings for one model version, its ceilings read from the engine and
/// the admission before the controller first moves them.
fn settings(config: &ServerConfig, entry: &Entry, engine: &Engine) -> (Settings, Objectives) {
    let default_model = ModelConfig::named(entry.name.clone());
    let model = model_config(config, &entry.name).unwrap_or(&default_model);
    let limits = engine.limits();
    let ceilings = Limits {
        max_num_seqs: limits.max_num_seqs(),
        max_num_batched_tokens: limits.max_num_batched_tokens(),
        max_prefill_tokens: limits.max_prefill_tokens(),
        max_in_flight: entry.admission.max_in_flight(),
        admit_prefills: true,
        // The first-token gate: with a TTFT objective, a prompt predicted to be read later
        // than this is refused at once (429 `shedding`).
        first_token_gate_ms: model
            .slo
            .ttft_p99_ms
            .map_or(0, |ms| ((ms as f64 * GATE_SHARE) as usize).max(1)),
    };
    let d = &config.degradation;
    let mut s = Settings::new(ceilings);
    s.ttft_p99_ms = model.slo.ttft_p99_ms.map(|v| v as f64);
    s.itl_p99_ms = model.slo.itl_p99_ms.map(|v| v as f64);
    s.scaling = d.scaling;
    s.saturation = d.saturation;
    s.psi_some_avg10 = d.psi_some_avg10;
    s.horizon_windows = d.horizon_windows;
    s.rule = model.batch_degrade_threshold.map(|r| degrade::Rule {
        p99_latency_ms: r.p99_latency_ms as f64,
        batch_size: r.batch_size,
    });
    let objectives = Objectives {
        ttft_p99_ms: model.slo.ttft_p99_ms,
        itl_p99_ms: model.slo.itl_p99_ms,
    };
    (s, objectives)
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn apply(engine: &Engine, entry: &Entry, limits: &Limits) {
    let l = engine.limits();
    l.set_max_num_seqs(limits.max_num_seqs);
    l.set_max_num_batched_tokens(limits.max_num_batched_tokens);
    l.set_max_prefill_tokens(limits.max_prefill_tokens);
    l.set_admit_prefills(limits.admit_prefills);
    l.set_max_prefill_wait_ms(limits.first_token_gate_ms as u64);
    entry.admission.set_limit(limits.max_in_flight);
}

/// Logs, counts and keeps one change as a controller decision.
fn record(decisions: &pipeline::decisions::Decisions, entry: &Entry, change: &Change, level: u8) {
    let (model, backend) = (entry.name.as_str(), entry.id.as_str());
    let lever = change.lever.as_str();
    let cause = change.cause.as_str();
    let message = if change.lever == degrade::Lever::KvResidentBlocks {
        "degradation: free KV pages given back"
    } else if change.cause == Cause::Recovery {
        "degradation: limit raised"
    } else {
        "degradation: limit lowered"
    };
    if change.cause == Cause::Recovery {
        tracing::info!(
            model,
            backend,
            lever,
            from = change.from,
            to = change.to,
            cause,
            degradation_level = level,
            detail = %change.detail,
            "{message}"
        );
    } else {
        tracing::warn!(
            model,
            backend,
            lever,
            from = change.from,
            to = change.to,
            cause,
            degradation_level = level,
            detail = %change.detail,
            "{message}"
        );
    }
    counter!(
        "rampart_degradation_changes_total",
        "model" => model.to_string(),
        "cause" => cause
    )
    .increment(1);
    decisions.note(
        &format!("degradation.{lever}"),
        Some(model),
        backend,
        cause,
        serde_json::json!({
            "from": change.from,
            "to": change.to,
            "level": level,
            "detail": change.detail,
        }),
    );
}

fn gauges(entry: &Entry, d: &Decision) {
    let (model, version) = (entry.name.clone(), entry.version.clone());
    for (kind, value) in [
        ("max_num_seqs", d.limits.max_num_seqs),
        ("max_num_batched_tokens", d.limits.max_num_batched_tokens),
        ("max_prefill_tokens", d.limits.max_prefill_tokens),
        ("max_in_flight", d.limits.max_in_flight),
        ("first_token_gate_ms", d.limits.first_token_gate_ms),
    ] {
        gauge!(
            "rampart_batch_limit",
            "model" => model.clone(),
            "version" => version.clone(),
            "kind" => kind
        )
        .set(value as f64);
    }
    gauge!(
        "rampart_degradation_level",
        "model" => model,
        "version" => version
    )
    .set(f64::from(d.level));
}

/// The capacity signals an autoscaler scales on, and what became of the gate's bookings.
fn capacity_metrics(entry: &Entry, gate: &GateView, before: &engine::ReservationStats) {
    let (model, version) = (entry.name.clone(), entry.version.clone());
    let r = &gate.reservations;
    for (name, value) in [
        (
            "rampart_capacity_admitted_per_second",
            gate.admitted_per_second,
        ),
        ("rampart_capacity_shed_per_second", gate.shed_per_second),
        (
            "rampart_capacity_predicted_wait_seconds",
            gate.predicted_wait_ms.unwrap_or(0.0) / 1e3,
        ),
        ("rampart_reservations_outstanding", r.outstanding as f64),
        ("rampart_reservation_tokens", r.tokens as f64),
    ] {
        gauge!(name, "model" => model.clone(), "version" => version.clone()).set(value);
    }
    for (outcome, now, then) in [
        ("issued", r.issued, before.issued),
        ("honoured", r.honoured, before.honoured),
        ("rebooked", r.rebooked, before.rebooked),
        ("expired", r.expired, before.expired),
        ("evicted", r.evicted, before.evicted),
        ("unbooked", r.unbooked, before.unbooked),
    ] {
        counter!(
            "rampart_reservations_total",
            "model" => model.clone(),
            "version" => version.clone(),
            "outcome" => outcome
        )
        .increment(now.saturating_sub(then));
    }
}

/// The 99th percentile of one window's samples, to a tenth of a millisecond.
fn window_p99(samples: &[f32]) -> Option<f64> {
    degrade::p99_of(to_f64(samples), 1).map(|p| (p * 10.0).round() / 10.0)
}

fn to_f64(samples: &[f32]) -> Vec<f64> {
    samples.iter().map(|&v| f64::from(v)).collect()
}

/// What the engine enforces per request before the controller's first window: the
/// first-token gate at its ceiling, the saturation wait and the TTFT objective the prefill
/// order serves.
fn arm_engine(config: &ServerConfig, engine: &Engine, ceilings: &Limits, objectives: &Objectives) {
    let limits = engine.limits();
    limits.set_max_prefill_wait_ms(ceilings.first_token_gate_ms as u64);
    limits.set_saturation_wait_ms(config.degradation.saturation_wait_ms);
    // Prompts read within the TTFT objective are read earliest deadline first.
    limits.set_ttft_objective_ms(objectives.ttft_p99_ms.unwrap_or(0));
    limits.set_max_reservations(config.admission.reservations);
}

/// Arms a language model's engine as its version is added to the registry, before its first
/// request (with `[degradation] enabled`). The controller's task creates the model's state
/// at its next window, up to `window_ms` later; a burst in between (a server that just became
/// ready, a model loaded on demand, a release's candidate) would otherwise be let in with no
/// first-token gate at all, seconds to a first token for the whole burst.
pub fn arm(config: &ServerConfig, entry: &Entry) {
    if !config.degradation.enabled {
        return;
    }
    if let Some(engine) = entry.engine.clone() {
        let (settings, objectives) = settings(config, entry, &engine);
        arm_engine(config, &engine, &settings.ceilings, &objectives);
    }
}

impl Degradation {
    /// Judges one window for every language model in the registry.
    pub fn tick(
        &self,
        config: &ServerConfig,
        entries: &[Arc<Entry>],
        memory: MemoryReading,
        decisions: &pipeline::decisions::Decisions,
    ) {
        if let Some(ratio) = memory.ratio {
            gauge!("rampart_memory_pressure_ratio").set(ratio);
        }
        let window_s = (config.degradation.window_ms.max(1) as f64) / 1e3;
        let mut models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let mut live = HashSet::new();
        for entry in entries {
            let Some(engine) = entry.engine.clone() else {
                continue;
            };
            live.insert(entry.id.clone());
            if models
                .get(&entry.id)
                .is_some_and(|m| !Arc::ptr_eq(&m.engine, &engine))
            {
                // The version was reloaded under the same id: start over with its engine.
                models.remove(&entry.id);
            }
            let state = models.entry(entry.id.clone()).or_insert_with(|| {
                let (settings, objectives) = settings(config, entry, &engine);
                let ceilings = settings.ceilings;
                arm_engine(config, &engine, &ceilings, &objectives);
                ModelState {
                    controller: Controller::new(settings),
                    engine: Arc::clone(&engine),
                    held_steps: engine.snapshot().prefill_held_steps,
                    gate_refusals: engine.limits().gate_refusals(),
                    reservations: engine.limits().reservations(),
                    view: ModelView {
                        backend: entry.id.clone(),
                        model: entry.name.clone(),
                        level: 0,
                        limits: ceilings,
                        ceilings,
                        objectives,
                        signals: Signals::default(),
                        window: 0,
                        recent: VecDeque::new(),
                        first_token_gate: None,
                        saturation_wait_ms: config.degradation.saturation_wait_ms,
                        saturation_refused: 0,
                        prefill_depth_equivalent: None,
                        itl_window: ItlWindow::default(),
                    },
                }
            });
            let latency = state.engine.drain_latency();
            let now = Instant::now();
            let ttft_arrived_windows_ago = latency
                .ttft_arrived
                .iter()
                .map(|at| (now.saturating_duration_since(*at).as_secs_f64() / window_s) as u32)
                .collect();
            let snapshot = state.engine.snapshot();
            let (in_flight_peak, shed) = entry.admission.take_window();
            let gate_refusals = state.engine.limits().gate_refusals();
            let observation = degrade::Observation {
                memory_ratio: memory.ratio,
                memory_psi_some_avg10: memory.psi_some_avg10,
                kv_ratio: (snapshot.blocks_total > 0)
                    .then(|| snapshot.blocks_used as f64 / snapshot.blocks_total as f64),
                ttft_ms: to_f64(&latency.ttft_ms),
                ttft_arrived_windows_ago,
                itl_ms: to_f64(if latency.delivered_itl_ms.is_empty() {
                    &latency.itl_ms
                } else {
                    &latency.delivered_itl_ms
                }),
                e2e_ms: to_f64(&latency.e2e_ms),
                running: snapshot.running,
                waiting: snapshot.waiting,
                in_flight_peak,
                shed,
                gate_refused: gate_refusals.saturating_sub(state.gate_refusals),
                prefill_held: snapshot.prefill_held_steps > state.held_steps,
                kv_resident_blocks: snapshot.blocks_resident,
                kv_held_blocks: snapshot.blocks_used,
            };
            let itl_window = ItlWindow {
                source: match (
                    latency.delivered_itl_ms.is_empty(),
                    latency.itl_ms.is_empty(),
                ) {
                    (false, _) => "delivered",
                    (true, false) => "engine",
                    (true, true) => state.view.itl_window.source,
                },
                engine_p99_ms: window_p99(&latency.itl_ms),
                delivered_p99_ms: window_p99(&latency.delivered_itl_ms),
            };
            state.held_steps = snapshot.prefill_held_steps;
            state.gate_refusals = gate_refusals;
            let decision = state.controller.observe(&observation);
            if !decision.changes.is_empty() {
                apply(&state.engine, entry, &decision.limits);
            }
            if decision
                .changes
                .iter()
                .any(|c| c.lever == degrade::Lever::KvResidentBlocks)
            {
                state.engine.release_memory();
            }
            let at_ms = unix_ms();
            for change in &decision.changes {
                record(decisions, entry, change, decision.level);
                if state.view.recent.len() == RECENT {
                    state.view.recent.pop_front();
                }
                state.view.recent.push_back(ChangeView {
                    at_ms,
                    window: decision.window,
                    change: change.clone(),
                });
            }
            gauges(entry, &decision);
            state.view.level = decision.level;
            state.view.limits = decision.limits;
            state.view.signals = decision.signals;
            state.view.window = decision.window;
            let gate = state.engine.limits();
            let reservations = gate.reservations();
            let before = std::mem::replace(&mut state.reservations, reservations);
            state.view.first_token_gate = (gate.max_prefill_wait_ms() > 0).then(|| GateView {
                max_wait_ms: gate.max_prefill_wait_ms(),
                backlog_tokens: gate.prefill_backlog(),
                prompt_tokens_per_second: gate.prefill_rate(),
                margin_ms: gate.first_token_margin_ms(),
                refused: gate.gate_refusals(),
                admitted_per_second: reservations.admitted.saturating_sub(before.admitted) as f64
                    / window_s,
                shed_per_second: observation.gate_refused as f64 / window_s,
                predicted_wait_ms: gate.predicted_wait_ms(0),
                reservations,
            });
            if let Some(view) = &state.view.first_token_gate {
                capacity_metrics(entry, view, &before);
            }
            state.view.saturation_refused = gate.saturation_refusals();
            state.view.prefill_depth_equivalent = snapshot.prefill_depth_equivalent;
            state.view.itl_window = itl_window;
        }
        // Versions no longer served: their controllers go; limits die with their engines.
        models.retain(|id, _| live.contains(id));
        drop(models);
        *self.memory.lock().unwrap_or_else(|e| e.into_inner()) = memory;
    }

    /// One backend's controller view.
    pub fn model(&self, backend: &str) -> Option<ModelView> {
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        models.get(backend).map(|m| m.view.clone())
    }

    pub fn view(&self, config: &ServerConfig) -> DegradationView {
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        let mut list: Vec<ModelView> = models.values().map(|m| m.view.clone()).collect();
        list.sort_by(|a, b| a.backend.cmp(&b.backend));
        DegradationView {
            enabled: config.degradation.enabled,
            window_ms: config.degradation.window_ms,
            scaling: config.degradation.scaling,
            saturation: config.degradation.saturation,
            memory: self
                .memory
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            models: list,
        }
    }
}

/// Starts the controllers' task (`[degradation] enabled`).
pub fn spawn(state: Arc<AppState>) {
    let config = &state.config.degradation;
    if !config.enabled {
        tracing::info!("degradation controllers off ([degradation] enabled = false)");
        return;
    }
    let every = Duration::from_millis(config.window_ms.max(100));
    tokio::spawn(async move {
        let telemetry = host::Telemetry::with_gpu(Path::new(&state.config.telemetry.root), None);
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let memory = read_memory(&telemetry.sample(), &state.config.memory);
            let entries = state.front.registry.all();
            state
                .degradation
                .tick(&state.config, &entries, memory, &state.front.decisions);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> host::TelemetrySample {
        host::TelemetrySample {
            process: host::ProcessStats {
                resident_bytes: Some(3 << 30),
                ..Default::default()
            },
            cgroup: host::CgroupStats::default(),
            pressure_source: Some("proc"),
            pressure: vec![host::Pressure {
                resource: "memory",
                kind: "some",
                avg10_percent: 1.5,
                total_seconds: 10.0,
            }],
            memory: host::HostMemory {
                total_bytes: Some(16 << 30),
                available_bytes: Some(4 << 30),
            },
            gpus: Vec::new(),
        }
    }

    #[test]
    fn memory_is_measured_against_the_configured_limit_the_cgroup_or_the_host() {
        let host = read_memory(&sample(), &MemoryConfig::default());
        assert_eq!(host.source, "host");
        assert_eq!(host.ratio, Some(0.75));
        assert_eq!(host.psi_some_avg10, Some(1.5));
        let rss = read_memory(
            &sample(),
            &MemoryConfig {
                limit: Some("4GiB".into()),
                ..MemoryConfig::default()
            },
        );
        assert_eq!((rss.source, rss.ratio), ("rss", Some(0.75)));
        let mut s = sample();
        s.cgroup.memory_usage_bytes = Some(1 << 30);
        s.cgroup.memory_limit_bytes = Some(2 << 30);
        let cgroup = read_memory(
            &s,
            &MemoryConfig {
                limit: Some("0.5".into()),
                ..MemoryConfig::default()
            },
        );
        assert_eq!((cgroup.source, cgroup.ratio), ("cgroup", Some(1.0)));
        // Inactive page cache is not counted: it goes before the OOM killer comes.
        s.cgroup.memory_inactive_file_bytes = Some(256 << 20);
        let working_set = read_memory(&s, &MemoryConfig::default());
        assert_eq!(working_set.used_bytes, Some(768 << 20));
        assert_eq!(working_set.ratio, Some(0.375));
        let mut bare = sample();
        bare.memory = host::HostMemory::default();
        assert_eq!(read_memory(&bare, &MemoryConfig::default()).ratio, None);
    }
}
