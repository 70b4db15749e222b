//! The releases' controller task on this server: each tick it gives every plan's controller
//! the monitors' alarms and lets it decide (a step, a promotion, a rollback), loads a
//! candidate a plan names that this server does not serve yet, and keeps each release's control
//! (the stable's second copy) loaded while its release is under way. The plans, their route
//! and their judge are `release_plans`'s.

use std::sync::Arc;
use std::time::Duration;

use release::plan::Variant;

use crate::release_plans::{ModelRelease, Releases};

/// A version's active monitor alarm in words (drift, or an output monitor's), if any.
fn alarm_detail(v: &crate::monitors::MonitorView) -> Option<String> {
    if v.drift.active {
        let last = v.drift.recent.iter().rev().find(|a| a.event == "raised");
        return Some(match last {
            Some(a) => format!(
                "drift on {} ({} statistic {:.3} > {:.3}, p {:.2e})",
                a.feature, a.mode, a.statistic, a.threshold, a.p_value
            ),
            None => "drift".to_string(),
        });
    }
    v.outputs
        .iter()
        .find_map(|o| o.alarm.map(|a| format!("{} {a}", o.feature)))
}

/// Why a release's version could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum VersionLoadError {
    #[error("the loading task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
    #[error("{name}@{version} cannot be loaded: {message}")]
    Load {
        name: String,
        version: String,
        message: String,
    },
}

/// Loads `name@version` from the repository when this server does not serve it yet (with the
/// model's configured settings).
pub async fn ensure_loaded(
    state: &Arc<crate::state::AppState>,
    name: &str,
    version: &str,
) -> Result<(), VersionLoadError> {
    if state
        .front
        .registry
        .find(&crate::registry::ModelName::versioned(name, Some(version)))
        .is_some()
    {
        return Ok(());
    }
    let entry = load_version(state, name, version).await?;
    tracing::info!(target: "rampart::release", model = name, version, "candidate loaded for its release");
    state.serve(entry);
    Ok(())
}

/// A fresh copy of `name@version` from the repository, with the model's configured settings
/// (not added to the registry).
async fn load_version(
    state: &Arc<crate::state::AppState>,
    name: &str,
    version: &str,
) -> Result<crate::registry::Entry, VersionLoadError> {
    let mut model = state
        .config
        .model(name)
        .cloned()
        .unwrap_or_else(|| crate::config::ModelConfig::named(name));
    model.version = Some(version.to_string());
    let config = state.config.clone();
    let prepare = state.prepare_lane.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        let repository = repo::Repository::open(&config.repo);
        crate::loading::load(&config, &repository, &model, &prepare)
    })
    .await?;
    loaded.map_err(|e| VersionLoadError::Load {
        name: name.to_string(),
        version: version.to_string(),
        message: e.message,
    })
}

/// Loads the release's control (a second copy of the stable) when the plan wants one and drops
/// it when the release ended or no longer wants it; each is a controller decision (log, audit).
/// A copy that fails to load is tried once per release: the latency tests then wait for control
/// samples and the release holds (the error says how to judge against the stable instead).
async fn keep_control(
    state: &Arc<crate::state::AppState>,
    m: &ModelRelease,
    tried: &mut std::collections::HashSet<String>,
) {
    let plan = m.plan();
    let wanted = plan.candidate.is_some()
        && plan.state.phase.is_active()
        && plan.routing.reference() == Variant::Control;
    match (wanted, m.control()) {
        (false, None) => {}
        (false, Some(entry)) => {
            m.set_control(None);
            tracing::info!(target: "rampart::release", model = %m.name, control = %entry.id, phase = ?plan.state.phase, "the release's control is unloaded");
            state.front.decisions.note(
                "release.control_unloaded",
                Some(&m.name),
                &entry.id,
                "the release ended or no longer judges against a control",
                serde_json::json!({ "phase": plan.state.phase }),
            );
        }
        (true, Some(entry)) if entry.version == plan.stable => {}
        (true, _) => {
            if !tried.insert(format!("{}|{}", plan.state.release_id, plan.stable)) {
                return;
            }
            let began = std::time::Instant::now();
            match load_version(state, &m.name, &plan.stable).await {
                Ok(entry) => {
                    let entry = entry.with_id(format!("{}@{}:control", m.name, plan.stable));
                    let load_ms = began.elapsed().as_millis() as u64;
                    tracing::info!(target: "rampart::release", model = %m.name, control = %entry.id, load_ms, "the release's control is loaded: a copy of the stable serving as many users as the candidate, the judge's latency reference");
                    state.front.decisions.note(
                        "release.control_loaded",
                        Some(&m.name),
                        &entry.id,
                        "a release judges latency against a control",
                        serde_json::json!({ "release_id": plan.state.release_id, "load_ms": load_ms }),
                    );
                    m.set_control(Some(Arc::new(entry)));
                }
                Err(e) => {
                    tracing::error!(target: "rampart::release", model = %m.name, stable = %plan.stable, error = %e, "the release's control cannot be loaded: its users are served by the stable and the latency tests wait for control samples (set `[routing] control = false` in the plan to judge against the stable)");
                    state.front.decisions.note(
                        "release.control_failed",
                        Some(&m.name),
                        &format!("{}@{}", m.name, plan.stable),
                        &e.to_string(),
                        serde_json::json!({ "release_id": plan.state.release_id }),
                    );
                }
            }
        }
    }
}

/// The controller task: a tick every `[releases] tick_ms`, with the monitors' drift alarms.
pub fn spawn(state: Arc<crate::state::AppState>, releases: Arc<Releases>) {
    let every = Duration::from_millis(releases.cfg.tick_ms.max(10));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tried = std::collections::HashSet::new();
        let mut control_tried = std::collections::HashSet::new();
        let mut followed = std::collections::HashMap::new();
        loop {
            tick.tick().await;
            let views = state.monitors.get().map(|m| m.views()).unwrap_or_default();
            let drift = |model: &str, version: &str| -> Option<String> {
                views
                    .iter()
                    .find(|v| v.model == model && v.version == version)
                    .and_then(alarm_detail)
            };
            let mut names: Vec<String> = state
                .front
                .registry
                .all()
                .iter()
                .map(|e| e.name.clone())
                .collect();
            names.dedup();
            releases.discover(&names);
            releases.fleet_discover(&names).await;
            releases.tick(&drift).await;
            releases
                .follow_stables(&state.front.registry, &mut followed)
                .await;
            // A plan that names a candidate this server does not serve yet (a release started
            // on the file, or by Git): load it, once per version, after the start's loading.
            let loading = matches!(
                *state.loading.lock().unwrap_or_else(|e| e.into_inner()),
                crate::state::Loading::InProgress
            );
            for m in releases.all().into_iter().filter(|_| !loading) {
                let plan = m.plan();
                let Some(candidate) = plan.candidate.clone() else {
                    continue;
                };
                if !plan.state.phase.is_active()
                    || tried.contains(&(m.name.clone(), candidate.clone()))
                {
                    continue;
                }
                tried.insert((m.name.clone(), candidate.clone()));
                if let Err(e) = ensure_loaded(&state, &m.name, &candidate).await {
                    tracing::error!(target: "rampart::release", model = %m.name, candidate, error = %e, "the release's candidate cannot be loaded: its requests go to the stable");
                }
            }
            // A plan whose stable this server does not serve (a replica that started before the
            // fleet's promotion reached its repository): the name serves the plan's stable, so
            // it is loaded, once per version, when some version of the model is loaded.
            for m in releases.all().into_iter().filter(|_| !loading) {
                let stable = m.plan().stable.clone();
                let registry = &state.front.registry;
                if registry.versions(&m.name).is_empty()
                    || registry
                        .find(&crate::registry::ModelName::versioned(
                            &m.name,
                            Some(&stable),
                        ))
                        .is_some()
                    || !tried.insert((m.name.clone(), stable.clone()))
                {
                    continue;
                }
                match ensure_loaded(&state, &m.name, &stable).await {
                    Ok(()) => {
                        tracing::warn!(target: "rampart::release", model = %m.name, stable, "the release plan's stable was not loaded here: loaded, and the model's name serves it")
                    }
                    Err(e) => {
                        tracing::error!(target: "rampart::release", model = %m.name, stable, error = %e, "the release plan's stable cannot be loaded: requests for the model's name fail until it is")
                    }
                }
            }
            for m in releases.all().into_iter().filter(|_| !loading) {
                keep_control(&state, &m, &mut control_tried).await;
            }
        }
    });
}
