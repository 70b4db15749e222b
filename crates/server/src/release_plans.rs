//! Releases in the server: each model's release plan (`<repo>/<name>/release.toml`, crate
//! `release`) routes its requests, is judged from its records and steered by a controller task.
//!
//! - The route ([`Releases::route`]) assigns a request that names a model without a version to
//!   the stable or the candidate (sticky by user); the record carries the variant and why.
//! - The record sink ([`ReleaseSink`]) turns each answered request of a variant into a judge
//!   sample (errors, TTFT, time per output token, E2E latency, entropy, confidence).
//! - The controller task ([`crate::release_control::spawn`]) ticks every `[releases]
//!   tick_ms`: it feeds the monitors' drift alarms, judges, moves weights, promotes and rolls
//!   back; each decision is written back to the plan file atomically, logged, counted and kept
//!   in the audit log. A plan file changed
//!   by someone else (an edit, a Git checkout) is read at the next tick and adopted.
//! - Commands (`/admin/releases/…`, `rampart release …`) go through [`Releases::command`].
//!
//! In a fleet (`[fleet]`, docs/fleet.md) the plan lives in PostgreSQL instead of the file: each
//! tick every replica adopts the fleet's newest revision, publishes its step window, and pools
//! every replica's windows; the replica holding the judge's lease decides on the pooled window
//! and writes the plan back (compare-and-set), so a decision is made once for the fleet. The
//! plan file is then Git's: a version of it never adopted before becomes the next revision.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::SystemTime;

use metrics::{counter, gauge};
use record::{Delivery, Envelope, InferenceRecord, Sink, SinkFuture};
use release::controller::{Action, Command, Controller, Decision, Status};
use release::judge::Sample;
use release::plan::{plan_path, Phase, ReleasePlan, Variant};
use release::router::{Route, RoutingKey};
use serde::Serialize;

use crate::config::ReleasesConfig;
use pipeline::decisions::Decisions;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// One model's release: its controller, the snapshot the route reads, and what the file looked
/// like when this process last read or wrote it.
pub struct ModelRelease {
    pub name: String,
    path: PathBuf,
    controller: Mutex<Controller>,
    /// The plan the route reads: replaced after every change, read without the controller's
    /// lock.
    routing: RwLock<Arc<ReleasePlan>>,
    /// The file's modification time after our last read or write: another one means someone
    /// else changed it.
    seen: Mutex<Option<SystemTime>>,
    /// Serializes writes of the file (controller ticks and commands).
    writing: tokio::sync::Mutex<()>,
    /// The control: a second copy of the stable version (`[routing] control`), loaded while a
    /// release runs and dropped when it ends. Not in the registry: only the route reaches it.
    control: RwLock<Option<Arc<crate::registry::Entry>>>,
    /// In a fleet: the shared plan's revision this replica routes by (0 before the first).
    revision: AtomicI64,
    /// In a fleet: the plan file's digest at the last look (a new one is offered to the fleet).
    file_digest: Mutex<Option<String>>,
    /// In a fleet: the status over every replica's window (what the judge judges).
    pooled: Mutex<Option<Status>>,
}

impl std::fmt::Debug for ModelRelease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelRelease")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl ModelRelease {
    fn new(name: String, path: PathBuf, plan: ReleasePlan) -> Self {
        let seen = modified(&path);
        Self {
            routing: RwLock::new(Arc::new(plan.clone())),
            controller: Mutex::new(Controller::new(plan)),
            name,
            path,
            seen: Mutex::new(seen),
            writing: tokio::sync::Mutex::new(()),
            control: RwLock::new(None),
            revision: AtomicI64::new(0),
            file_digest: Mutex::new(None),
            pooled: Mutex::new(None),
        }
    }

    /// In a fleet: routes by the fleet's plan at `revision` from now on (the window of this
    /// replica's step is kept when the release and step are the same).
    fn adopt(&self, plan: ReleasePlan, revision: i64) {
        self.controller().replace_plan(plan.clone());
        *self.routing.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(plan);
        self.revision.store(revision, Ordering::Relaxed);
    }

    /// In a fleet: the shared plan's revision this replica routes by.
    pub fn revision(&self) -> i64 {
        self.revision.load(Ordering::Relaxed)
    }

    /// The loaded control, if any.
    pub fn control(&self) -> Option<Arc<crate::registry::Entry>> {
        self.control
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub(crate) fn set_control(&self, entry: Option<Arc<crate::registry::Entry>>) {
        *self.control.write().unwrap_or_else(|e| e.into_inner()) = entry;
    }

    fn controller(&self) -> std::sync::MutexGuard<'_, Controller> {
        self.controller.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The plan as the route sees it.
    pub fn plan(&self) -> Arc<ReleasePlan> {
        Arc::clone(&self.routing.read().unwrap_or_else(|e| e.into_inner()))
    }

    /// The release's status: in a fleet, the pooled one (every replica's samples), while it
    /// describes the plan this replica routes by. A command applied here (a start, a pause)
    /// changes the plan before the next tick pools its window: until then the pooled status is
    /// the previous release's or step's, and this replica's own is shown (a start answered with
    /// the ended release's id sent a client waiting on the wrong release).
    pub fn status(&self) -> Status {
        let plan = self.plan();
        if let Some(pooled) = self
            .pooled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .filter(|s| {
                s.release_id == plan.state.release_id
                    && s.phase == plan.state.phase
                    && s.step == plan.state.step
            })
        {
            return pooled;
        }
        self.controller().status()
    }

    /// Publishes the controller's plan to the route and writes it to the file.
    async fn persist(&self) -> Result<(), release::plan::ReleaseError> {
        let _writing = self.writing.lock().await;
        let plan = self.controller().plan().clone();
        *self.routing.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(plan.clone());
        let path = self.path.clone();
        let saved = tokio::task::spawn_blocking(move || plan.save_atomic(&path).map(|()| path))
            .await
            .map_err(|e| release::plan::ReleaseError::Io {
                path: self.path.display().to_string(),
                source: std::io::Error::other(e.to_string()),
            })?;
        let path = saved?;
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = modified(&path);
        Ok(())
    }

    /// Adopts the file when someone else changed it since we last read or wrote it.
    fn reload_if_changed(&self) -> Option<Result<(), release::plan::ReleaseError>> {
        let now = modified(&self.path);
        {
            let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if now == *seen {
                return None;
            }
        }
        let loaded = match ReleasePlan::load(&self.path) {
            Ok(plan) => plan,
            Err(e) => {
                // Remember this version of the file so that the error is said once.
                *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = now;
                return Some(Err(e));
            }
        };
        *self.seen.lock().unwrap_or_else(|e| e.into_inner()) = now;
        self.controller().replace_plan(loaded.clone());
        *self.routing.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(loaded);
        Some(Ok(()))
    }
}

pub use pipeline::front::Routed;

/// The releases' part in the pipeline's route and shadow.
impl pipeline::front::Releases for Releases {
    fn route(&self, model: &str, key: &RoutingKey<'_>) -> Option<Routed> {
        Releases::route(self, model, key)
    }

    fn has_plan(&self, model: &str) -> bool {
        self.get(model).is_some()
    }

    fn control(&self, model: &str) -> Option<Arc<crate::registry::Entry>> {
        Releases::control(self, model)
    }

    fn mirror(&self, model: &str, request_id: &str) -> Option<pipeline::front::Mirror> {
        let release = self.get(model)?;
        let plan = release.plan();
        if !release::router::mirrored(&plan, request_id) {
            return None;
        }
        let candidate = plan.candidate.clone()?;
        let control = (plan.routing.reference() == Variant::Control)
            .then(|| release.control())
            .flatten();
        Some(pipeline::front::Mirror { candidate, control })
    }

    fn agreement(&self, model: &str, agreed: Option<bool>) {
        Releases::agreement(self, model, agreed)
    }
}

/// Every model's release, shared by the route, the sink, the controller task and the admin API.
#[derive(Debug)]
pub struct Releases {
    pub cfg: ReleasesConfig,
    repo: PathBuf,
    models: RwLock<BTreeMap<String, Arc<ModelRelease>>>,
    /// Plan files found unreadable, with their modification time (said once per version).
    unreadable: Mutex<BTreeMap<String, Option<SystemTime>>>,
    /// Where the controllers' decisions are published.
    decisions: Decisions,
    /// In a fleet, the shared store: the plans live there, not in the files.
    fleet: Option<Arc<crate::fleet::Fleet>>,
}

/// A command could not be carried out.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("{0}")]
    Refused(String),
    #[error("model {0:?} has no release plan and none can be made: {1}")]
    NoPlan(String, String),
    #[error("{0}")]
    Release(#[from] release::plan::ReleaseError),
    #[error("the fleet's database cannot be reached: the command cannot be made for every replica; try again")]
    FleetUnavailable,
}

impl Releases {
    /// Reads the plans of `names` that have one (a plan that does not parse is an error: the
    /// server must not guess how a release was meant to route).
    pub fn open(
        cfg: ReleasesConfig,
        repo: PathBuf,
        names: &[String],
        decisions: Decisions,
        fleet: Option<Arc<crate::fleet::Fleet>>,
    ) -> Result<Self, release::plan::ReleaseError> {
        let mut models = BTreeMap::new();
        for name in names {
            let path = plan_path(&repo, name)?;
            if !path.is_file() {
                continue;
            }
            let plan = ReleasePlan::load(&path)?;
            tracing::info!(
                target: "rampart::release",
                model = %name,
                stable = %plan.stable,
                candidate = plan.candidate.as_deref().unwrap_or(""),
                phase = ?plan.state.phase,
                weight = plan.state.weight,
                "release plan read"
            );
            let m = Arc::new(ModelRelease::new(name.clone(), path, plan));
            set_gauges(&m);
            models.insert(name.clone(), m);
        }
        Ok(Self {
            cfg,
            repo,
            models: RwLock::new(models),
            unreadable: Mutex::new(BTreeMap::new()),
            decisions,
            fleet,
        })
    }

    /// The fleet this server is a replica of, if any.
    pub fn fleet(&self) -> Option<&Arc<crate::fleet::Fleet>> {
        self.fleet.as_ref()
    }

    /// The versions a plan wants served: its stable, and its candidate while a release of it
    /// is under way. `None` without a plan.
    pub fn versions_wanted(repo: &Path, name: &str) -> Option<(String, Option<String>)> {
        let plan = ReleasePlan::load(&plan_path(repo, name).ok()?).ok()?;
        let candidate = plan
            .candidate
            .clone()
            .filter(|_| plan.state.phase.is_active());
        Some((plan.stable, candidate))
    }

    pub fn get(&self, name: &str) -> Option<Arc<ModelRelease>> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(name)
            .cloned()
    }

    pub fn all(&self) -> Vec<Arc<ModelRelease>> {
        self.models
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect()
    }

    /// The route of a request for `name` (no version named), or `None` when the model has no
    /// release plan.
    pub fn route(&self, name: &str, key: &RoutingKey<'_>) -> Option<Routed> {
        let models = self.models.read().unwrap_or_else(|e| e.into_inner());
        let m = models.get(name)?;
        let plan = m.plan();
        let r: Route = release::router::route(&plan, key);
        Some(Routed {
            version: r.version,
            variant: r.variant,
            why: r.why,
            shadow: r.shadow,
        })
    }

    /// The loaded control of `name`'s release, if any.
    pub fn control(&self, name: &str) -> Option<Arc<crate::registry::Entry>> {
        self.get(name)?.control()
    }

    /// Requests holding or waiting for a slot of the releases' controls (the drain waits for
    /// them as for the registry's).
    pub fn controls_busy(&self) -> usize {
        self.all()
            .iter()
            .filter_map(|m| m.control())
            .map(|e| e.admission.in_flight() + e.admission.waiting())
            .sum()
    }

    /// Drops every control (shutdown): their engines stop once the last request lets go.
    pub fn drop_controls(&self) {
        for m in self.all() {
            m.set_control(None);
        }
    }

    /// What the feedback loop's ratings of an answer of `name`@`version` (given at
    /// `answered_ms`, audit id `answer`) say now: its latest rating, or `None` when none rates
    /// it either way (the judge's helpful-rate test, `judge.helpful_rate_points`). The judge
    /// counts each answer once, whoever rated it and however often.
    pub fn feedback(
        &self,
        name: &str,
        version: &str,
        answered_ms: u64,
        answer: &str,
        helpful: Option<bool>,
    ) {
        let Some(m) = self.get(name) else {
            return;
        };
        let Some(fleet) = &self.fleet else {
            m.controller()
                .observe_feedback(version, answered_ms, answer, helpful);
            return;
        };
        // In a fleet the rating goes to the shared table (one row per answer, whichever
        // replica served or rated it): the judge counts it from there.
        let plan = m.plan();
        let variant = if plan.candidate.as_deref() == Some(version) {
            Variant::Candidate
        } else if plan.stable == version {
            Variant::Stable
        } else {
            return;
        };
        if !plan.state.phase.is_active() {
            return;
        }
        let (fleet, model, release_id, answer) = (
            Arc::clone(fleet),
            name.to_string(),
            plan.state.release_id.clone(),
            answer.to_string(),
        );
        tokio::spawn(async move {
            fleet
                .call("rate", move |s| {
                    s.rate(&model, &release_id, &answer, variant, helpful, answered_ms)
                })
                .await;
        });
    }

    /// One record into the judge of its model's release.
    pub fn take(&self, record: &InferenceRecord) {
        let Some(variant) = record_variant(record) else {
            return;
        };
        let Some(m) = self.get(&record.model) else {
            return;
        };
        if let Some(sample) = sample(record, variant) {
            m.controller().observe(&sample);
        }
    }

    /// Shadow mode: the candidate's and the control's answers to one mirrored request of `name`
    /// agreed or not (`None`: one of them did not answer, nothing to compare).
    pub fn agreement(&self, name: &str, agreed: Option<bool>) {
        let result = match agreed {
            Some(true) => "agreed",
            Some(false) => "disagreed",
            None => "incomplete",
        };
        counter!("rampart_release_mirrored_total", "model" => name.to_string(), "result" => result)
            .increment(1);
        if let (Some(agreed), Some(m)) = (agreed, self.get(name)) {
            m.controller().observe_agreement(agreed);
        }
    }

    /// The release of `name`, made with a fresh plan (stable: `stable`) when it has none.
    fn release_or_new(
        &self,
        name: &str,
        stable: Option<&str>,
    ) -> Result<Arc<ModelRelease>, CommandError> {
        if let Some(m) = self.get(name) {
            return Ok(m);
        }
        let Some(stable) = stable else {
            return Err(CommandError::NoPlan(
                name.to_string(),
                "no version of it is served".into(),
            ));
        };
        let path = plan_path(&self.repo, name)?;
        let plan = if path.is_file() {
            ReleasePlan::load(&path)?
        } else {
            ReleasePlan::new(stable)
        };
        let m = Arc::new(ModelRelease::new(name.to_string(), path, plan));
        let mut models = self.models.write().unwrap_or_else(|e| e.into_inner());
        Ok(Arc::clone(models.entry(name.to_string()).or_insert(m)))
    }

    /// Applies an operator's command to `name`'s release; the plan is written and the decision
    /// published before this returns. `stable` names the served version a new plan starts from.
    pub async fn command(
        &self,
        name: &str,
        stable: Option<&str>,
        command: Command,
        actor: &str,
    ) -> Result<Decision, CommandError> {
        let m = self.release_or_new(name, stable)?;
        if let Some(fleet) = &self.fleet {
            return self.fleet_command(fleet, &m, command, actor).await;
        }
        let decision = m
            .controller()
            .command(command, now_ms(), actor)
            .map_err(|e| CommandError::Refused(e.to_string()))?;
        m.persist().await?;
        publish(&m.name, &decision);
        set_gauges(&m);
        Ok(decision)
    }

    /// Reads the plans that appeared for served models since the start (a plan file written
    /// by hand or by Git for a model that had none).
    pub fn discover(&self, names: &[String]) {
        for name in names {
            if self.get(name).is_some() {
                continue;
            }
            let Ok(path) = plan_path(&self.repo, name) else {
                continue;
            };
            if !path.is_file() {
                continue;
            }
            let stamp = modified(&path);
            let mut unreadable = self.unreadable.lock().unwrap_or_else(|e| e.into_inner());
            if unreadable.get(name) == Some(&stamp) {
                continue;
            }
            match ReleasePlan::load(&path) {
                Ok(plan) => {
                    tracing::warn!(target: "rampart::release", model = %name, stable = %plan.stable, phase = ?plan.state.phase, "a release plan appeared: adopted");
                    let m = Arc::new(ModelRelease::new(name.clone(), path, plan));
                    set_gauges(&m);
                    self.models
                        .write()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(name.clone())
                        .or_insert(m);
                }
                Err(e) => {
                    tracing::error!(target: "rampart::release", model = %name, error = %e, "a release plan appeared but cannot be read");
                    counter!("rampart_release_plan_errors_total", "model" => name.clone())
                        .increment(1);
                    unreadable.insert(name.clone(), stamp);
                }
            }
        }
    }

    /// A controller's decision: its log line and counter, and the decision record (log, metrics,
    /// audit) with `detail`.
    fn announce(&self, model: &str, d: &Decision, detail: serde_json::Value) {
        publish(model, d);
        self.decisions.note(
            &format!("release.{}", action_name(d.action)),
            Some(model),
            &format!("{model}@{}", d.candidate.as_deref().unwrap_or(&d.stable)),
            &d.reason,
            detail,
        );
    }

    /// Keeps what a model's name serves with its plan's stable: after a promotion (decided
    /// here or by the fleet's judge) or an edit of the plan, the registry serves the new stable
    /// by name and the repository's stable alias follows it (cause `release <id>`), so a
    /// restart, a server without releases and `rampart model maturity` agree with the
    /// release. Each change is a decision (log, metrics, audit). `followed` remembers, per
    /// model, the stable already followed (a plan that did not move costs nothing).
    pub async fn follow_stables(
        &self,
        registry: &crate::registry::Registry,
        followed: &mut std::collections::HashMap<String, String>,
    ) {
        for m in self.all() {
            let plan = m.plan();
            if followed.get(&m.name) == Some(&plan.stable) {
                continue;
            }
            followed.insert(m.name.clone(), plan.stable.clone());
            let before = registry.set_stable(&m.name, &plan.stable);
            let (repo, name, stable) = (self.repo.clone(), m.name.clone(), plan.stable.clone());
            let cause = format!("release {}", plan.state.release_id);
            let by = self.fleet.as_ref().map_or_else(
                || "release controller".to_string(),
                |f| format!("release controller ({})", f.replica),
            );
            let cause_in = cause.clone();
            let written = tokio::task::spawn_blocking(move || {
                let repository = repo::Repository::open(&repo);
                let current = repository.stable(&name)?;
                if current.as_ref().is_some_and(|c| c.version == stable) {
                    return Ok(None);
                }
                let version = repository.resolve(&repo::ModelRef::new(&name, Some(&stable))?)?;
                repository
                    .set_stable(&version, &by, &cause_in)
                    .map(|s| Some((current, s)))
            })
            .await
            .map_err(|e| repo::RepoError::Io {
                path: self.repo.clone(),
                source: std::io::Error::other(e.to_string()),
            })
            .and_then(|r| r);
            match written {
                Ok(None) => {
                    if before.is_some_and(|b| b != plan.stable) {
                        tracing::info!(target: "rampart::release", model = %m.name, stable = %plan.stable, "the model's name serves the release plan's stable");
                    }
                }
                Ok(Some((previous, setting))) => {
                    let previous = previous.map(|p| p.version);
                    tracing::warn!(target: "rampart::release", model = %m.name, stable = %setting.version, previous = previous.as_deref().unwrap_or(""), cause, "the model's stable version follows its release: users get it by name, and the repository's alias says so");
                    self.decisions.note(
                        "model.stable",
                        Some(&m.name),
                        &format!("{}@{}", m.name, setting.version),
                        &cause,
                        serde_json::json!({
                            "version": setting.version,
                            "previous": previous,
                            "digest": setting.digest,
                            "by": setting.set_by,
                        }),
                    );
                }
                Err(e) => {
                    // A read-only repository (a pod's image): the registry follows the plan;
                    // a restart reads the plan again.
                    tracing::warn!(target: "rampart::release", model = %m.name, stable = %plan.stable, error = %e, "the repository's stable alias cannot follow the release plan: this process serves the plan's stable, a restart reads the plan again");
                }
            }
        }
    }

    /// One tick of every release: adopt changed files, feed drift, judge, decide, persist.
    pub async fn tick(&self, drift: &(dyn Fn(&str, &str) -> Option<String> + Sync)) {
        if let Some(fleet) = &self.fleet {
            for m in self.all() {
                self.fleet_tick(fleet, &m, drift).await;
            }
            return;
        }
        for m in self.all() {
            match m.reload_if_changed() {
                Some(Ok(())) => {
                    let plan = m.plan();
                    tracing::warn!(
                        target: "rampart::release",
                        model = %m.name,
                        stable = %plan.stable,
                        candidate = plan.candidate.as_deref().unwrap_or(""),
                        phase = ?plan.state.phase,
                        weight = plan.state.weight,
                        "release plan changed on disk: adopted"
                    );
                    self.decisions.note(
                        "release.plan_changed",
                        Some(&m.name),
                        &m.name,
                        "the plan file changed on disk",
                        serde_json::json!({
                            "stable": plan.stable,
                            "candidate": plan.candidate,
                            "phase": plan.state.phase,
                            "weight": plan.state.weight,
                        }),
                    );
                    set_gauges(&m);
                }
                Some(Err(e)) => {
                    tracing::error!(target: "rampart::release", model = %m.name, error = %e, "release plan changed on disk but cannot be read: the release keeps its last plan");
                    counter!("rampart_release_plan_errors_total", "model" => m.name.clone())
                        .increment(1);
                }
                None => {}
            }
            let (stable, candidate) = {
                let plan = m.plan();
                (plan.stable.clone(), plan.candidate.clone())
            };
            {
                let mut c = m.controller();
                let s = drift(&m.name, &stable);
                c.set_drift(Variant::Stable, s.is_some(), s.as_deref().unwrap_or(""));
                if let Some(candidate) = &candidate {
                    let d = drift(&m.name, candidate);
                    c.set_drift(Variant::Candidate, d.is_some(), d.as_deref().unwrap_or(""));
                }
            }
            let decisions = m.controller().tick(now_ms());
            if decisions.is_empty() {
                continue;
            }
            if let Err(e) = m.persist().await {
                tracing::error!(target: "rampart::release", model = %m.name, error = %e, "the release plan could not be written: the decision holds in memory and routes, but a restart would not know it");
                counter!("rampart_release_plan_errors_total", "model" => m.name.clone())
                    .increment(1);
            }
            for d in &decisions {
                self.announce(&m.name, d, serde_json::to_value(d).unwrap_or_default());
            }
            set_gauges(&m);
        }
    }
}

/// The variant a record was served as (`stable`, `candidate` or `control`).
fn record_variant(r: &InferenceRecord) -> Option<Variant> {
    match r.variant? {
        "stable" => Some(Variant::Stable),
        "candidate" => Some(Variant::Candidate),
        "control" => Some(Variant::Control),
        _ => None,
    }
}

/// The judge's sample of a record: refusals at the front and client errors (4xx) say nothing
/// about the version and give none; a server error or a fallback away from the version is an
/// error of it.
pub fn sample(r: &InferenceRecord, variant: Variant) -> Option<Sample> {
    if r.refusal.is_some() || (400..500).contains(&r.status) {
        return None;
    }
    let error = r.status >= 500 || r.fallback_level > 0;
    let generated = r.completion_tokens > 0 && !error;
    Some(Sample {
        variant,
        time_ms: r.time_ms,
        error,
        ttft_ms: generated.then_some(r.ttft_ms),
        tpot_ms: (generated && r.completion_tokens > 1)
            .then(|| r.decode_ms / (r.completion_tokens - 1) as f64),
        e2e_ms: r.total_ms,
        entropy_mean: r.entropy_mean.filter(|_| !error),
        confidence: r.confidence.filter(|_| !error),
        helpful: None,
    })
}

pub fn action_name(a: Action) -> &'static str {
    match a {
        Action::Start => "start",
        Action::Step => "step",
        Action::Promote => "promote",
        Action::Rollback => "rollback",
        Action::Hold => "hold",
        Action::Resume => "resume",
        Action::Pause => "pause",
        Action::Approve => "approve",
        Action::GateFailed => "gate_failed",
    }
}

/// The phase as the `rampart_release_phase` gauge's value (docs/metrics.md).
pub fn phase_code(p: Phase) -> f64 {
    match p {
        Phase::Idle => 0.0,
        Phase::Gating => 1.0,
        Phase::AwaitingApproval => 2.0,
        Phase::Running => 3.0,
        Phase::Paused => 4.0,
        Phase::Holding => 5.0,
        Phase::Promoted => 6.0,
        Phase::RolledBack => 7.0,
    }
}

/// A decision's log line and counter.
fn publish(model: &str, d: &Decision) {
    let action = action_name(d.action);
    let reason_label = match (&d.metric, d.actor.as_str()) {
        (Some(metric), _) => metric.clone(),
        (None, "controller") => match d.action {
            Action::Hold => "no_data".to_string(),
            Action::GateFailed => "gates".to_string(),
            _ => "schedule".to_string(),
        },
        (None, _) => "command".to_string(),
    };
    counter!(
        "rampart_release_decisions_total",
        "model" => model.to_string(),
        "result" => action,
        "reason" => reason_label
    )
    .increment(1);
    let level_warn = matches!(
        d.action,
        Action::Rollback | Action::Hold | Action::GateFailed
    );
    macro_rules! line {
        ($lvl:ident) => {
            tracing::$lvl!(
                target: "rampart::release",
                model,
                action,
                stable = %d.stable,
                candidate = d.candidate.as_deref().unwrap_or(""),
                from_weight = d.from_weight,
                to_weight = d.to_weight,
                metric = d.metric.as_deref().unwrap_or(""),
                statistic = d.statistic,
                threshold = d.threshold,
                e_value = d.e_value,
                p_value = d.p_value,
                samples_stable = d.samples_stable,
                samples_candidate = d.samples_candidate,
                actor = %d.actor,
                reason = %d.reason,
                "release decision"
            )
        };
    }
    if level_warn {
        line!(warn);
    } else {
        line!(info);
    }
}

/// `rampart_release_weight{model,version}` and `rampart_release_phase{model}`.
fn set_gauges(m: &ModelRelease) {
    let plan = m.plan();
    let w = plan.state.weight.clamp(0.0, 1.0);
    let candidate_serves = plan.candidate.is_some()
        && matches!(
            plan.state.phase,
            Phase::Running | Phase::Paused | Phase::Holding | Phase::AwaitingApproval
        );
    // A shadow release serves no user with the candidate (its mirrored share is in the status).
    let candidate_serves = candidate_serves && plan.mode != release::plan::Mode::Shadow;
    let (stable_w, candidate_w) = if candidate_serves {
        (1.0 - w, w)
    } else {
        (1.0, 0.0)
    };
    gauge!("rampart_release_weight", "model" => m.name.clone(), "version" => plan.stable.clone())
        .set(stable_w);
    if let Some(c) = &plan.candidate {
        gauge!("rampart_release_weight", "model" => m.name.clone(), "version" => c.clone())
            .set(candidate_w);
    }
    gauge!("rampart_release_phase", "model" => m.name.clone()).set(phase_code(plan.state.phase));
}

/// What `GET /admin/releases` shows of a model.
#[derive(Debug, Clone, Serialize)]
pub struct ReleaseView {
    pub model: String,
    pub plan_path: String,
    pub status: Status,
}

impl Releases {
    pub fn views(&self) -> Vec<ReleaseView> {
        self.all()
            .iter()
            .map(|m| ReleaseView {
                model: m.name.clone(),
                plan_path: m.path.display().to_string(),
                status: m.status(),
            })
            .collect()
    }
}

/// The record sink that feeds the releases' judges. Lossy: a judge that falls behind loses
/// samples (counted by the bus), never slows a request.
pub struct ReleaseSink {
    releases: Arc<Releases>,
}

impl ReleaseSink {
    pub fn new(releases: Arc<Releases>) -> Self {
        Self { releases }
    }
}

impl Sink for ReleaseSink {
    fn name(&self) -> &'static str {
        "releases"
    }

    fn delivery(&self) -> Delivery {
        Delivery::Lossy {
            capacity: self.releases.cfg.lane_capacity,
        }
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        self.releases.take(&envelope.record);
        Box::pin(std::future::ready(Ok(())))
    }
}

/// What a fleet tick found of the local plan file.
struct FileLook {
    /// The file's digest (`None`: no file).
    digest: Option<String>,
    /// It could not be read as a plan.
    error: Option<String>,
    /// The fleet adopted it as this revision.
    adopted: Option<i64>,
}

/// The plan file's bytes' digest and the plan they hold; `None` without a file.
fn read_plan_file(path: &Path) -> Option<(String, Result<ReleasePlan, String>)> {
    use sha2::Digest;
    let bytes = std::fs::read(path).ok()?;
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let plan = std::str::from_utf8(&bytes)
        .map_err(|e| e.to_string())
        .and_then(|t| ReleasePlan::from_toml_str(t).map_err(|e| e.to_string()));
    Some((digest, plan))
}

/// The fleet's side of the releases (`[fleet]`): shared plans, pooled judge, shared commands.
impl Releases {
    /// Models served here whose plan only the fleet has (started on another replica): their
    /// releases, so that this replica routes by the same plan.
    pub async fn fleet_discover(&self, names: &[String]) {
        let Some(fleet) = &self.fleet else {
            return;
        };
        let missing: Vec<String> = names
            .iter()
            .filter(|n| self.get(n).is_none())
            .cloned()
            .collect();
        if missing.is_empty() {
            return;
        }
        let Some(found) = fleet
            .call("discover", move |s| {
                let mut found = Vec::new();
                for name in missing {
                    if let Some(row) = s.plan(&name)? {
                        found.push((name, row));
                    }
                }
                Ok(found)
            })
            .await
        else {
            return;
        };
        for (name, row) in found {
            let Ok(path) = plan_path(&self.repo, &name) else {
                continue;
            };
            tracing::warn!(target: "rampart::release", model = %name, stable = %row.plan.stable, phase = ?row.plan.state.phase, revision = row.revision, "the fleet has a release plan for a model served here: adopted");
            let m = Arc::new(ModelRelease::new(name.clone(), path, row.plan.clone()));
            m.revision.store(row.revision, Ordering::Relaxed);
            set_gauges(&m);
            self.models
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .entry(name)
                .or_insert(m);
        }
    }

    /// One model's tick in a fleet: the shared plan (a changed plan file offered to it), this
    /// replica's window published, every replica's pooled and judged; the judge writes its
    /// decisions back.
    async fn fleet_tick(
        &self,
        fleet: &Arc<crate::fleet::Fleet>,
        m: &Arc<ModelRelease>,
        drift: &(dyn Fn(&str, &str) -> Option<String> + Sync),
    ) {
        let Some((row, look)) = self.fleet_plan(fleet, m).await else {
            return;
        };
        *m.file_digest.lock().unwrap_or_else(|e| e.into_inner()) = look.digest.clone();
        if let Some(error) = &look.error {
            tracing::error!(target: "rampart::release", model = %m.name, error = %error, "the release plan file changed but cannot be read: the fleet keeps its plan");
            counter!("rampart_release_plan_errors_total", "model" => m.name.clone()).increment(1);
        }
        if let Some(revision) = look.adopted {
            tracing::warn!(target: "rampart::release", model = %m.name, revision, stable = %row.plan.stable, phase = ?row.plan.state.phase, "release plan file changed: adopted by the fleet");
            self.decisions.note(
                "release.plan_changed",
                Some(&m.name),
                &m.name,
                "the plan file changed on disk: the fleet adopted it",
                serde_json::json!({
                    "revision": revision,
                    "stable": row.plan.stable,
                    "candidate": row.plan.candidate,
                    "phase": row.plan.state.phase,
                    "weight": row.plan.state.weight,
                }),
            );
        }
        if row.revision != m.revision() {
            let before = m.plan();
            m.adopt(row.plan.clone(), row.revision);
            if before.state != row.plan.state || before.candidate != row.plan.candidate {
                // How long after its write this replica routes by it (the writer's clock).
                let lag_ms = now_ms().saturating_sub(row.updated_ms);
                tracing::info!(target: "rampart::release", model = %m.name, revision = row.revision, by = %row.updated_by, phase = ?row.plan.state.phase, weight = row.plan.state.weight, lag_ms, "the fleet's plan changed: adopted");
            }
            set_gauges(m);
        }
        let plan = m.plan();
        if !plan.state.phase.is_active() {
            self.fleet_ended_status(fleet, m, &plan).await;
            return;
        }
        let window = {
            let mut c = m.controller();
            let s = drift(&m.name, &plan.stable);
            c.set_drift(Variant::Stable, s.is_some(), s.as_deref().unwrap_or(""));
            if let Some(candidate) = &plan.candidate {
                let d = drift(&m.name, candidate);
                c.set_drift(Variant::Candidate, d.is_some(), d.as_deref().unwrap_or(""));
            }
            c.window().clone()
        };
        let (name, release_id, step, started) = (
            m.name.clone(),
            plan.state.release_id.clone(),
            plan.state.step,
            plan.state.step_started_ms,
        );
        let Some((rows, ratings)) = fleet
            .call("window", move |s| {
                s.publish_window(&name, &release_id, step, &window)?;
                let rows = s.windows(&name, &release_id, step)?;
                let ratings = s.ratings(&name, &release_id, started)?;
                Ok((rows, ratings))
            })
            .await
        else {
            return;
        };
        let mut pooled = release::judge::StepWindow::pooled(rows.iter().map(|r| &r.window))
            .unwrap_or_else(|| release::judge::StepWindow::new(started));
        pooled.set_ratings(Variant::Stable, ratings.stable.0, ratings.stable.1);
        pooled.set_ratings(Variant::Candidate, ratings.candidate.0, ratings.candidate.1);
        let now = now_ms();
        // What the fleet's judge sees: a replica without the lease only looks (its status
        // shows the verdict, never a decision it did not make).
        let looked = || {
            let mut c = Controller::with_window((*plan).clone(), pooled.clone());
            c.look(now);
            c.status()
        };
        if !fleet.is_judge() {
            *m.pooled.lock().unwrap_or_else(|e| e.into_inner()) = Some(looked());
            return;
        }
        let mut judge = Controller::with_window((*plan).clone(), pooled.clone());
        let decisions = judge.tick(now);
        if decisions.is_empty() {
            *m.pooled.lock().unwrap_or_else(|e| e.into_inner()) = Some(judge.status());
            return;
        }
        let decided = judge.plan().clone();
        let (name, expected, plan_out, out) = (
            m.name.clone(),
            row.revision,
            decided.clone(),
            decisions.clone(),
        );
        match fleet
            .call("decide", move |s| {
                s.write_plan(&name, expected, &plan_out, &out)
            })
            .await
        {
            Some(Some(revision)) => {
                *m.pooled.lock().unwrap_or_else(|e| e.into_inner()) = Some(judge.status());
                m.adopt(decided, revision);
                let replicas: Vec<&str> = rows.iter().map(|r| r.replica.as_str()).collect();
                for d in &decisions {
                    self.announce(
                        &m.name,
                        d,
                        serde_json::json!({ "decision": d, "revision": revision, "replicas": replicas }),
                    );
                }
                set_gauges(m);
            }
            Some(None) => {
                *m.pooled.lock().unwrap_or_else(|e| e.into_inner()) = Some(looked());
                tracing::info!(target: "rampart::release", model = %m.name, "another replica changed the fleet's plan first: this tick's decisions are dropped, the newer plan is adopted at the next tick");
            }
            None => *m.pooled.lock().unwrap_or_else(|e| e.into_inner()) = Some(looked()),
        }
    }

    /// An ended release's status over every replica's window of its last step (once per plan:
    /// a follower's last pooled status was computed before the decision).
    async fn fleet_ended_status(
        &self,
        fleet: &Arc<crate::fleet::Fleet>,
        m: &Arc<ModelRelease>,
        plan: &Arc<ReleasePlan>,
    ) {
        let current = m
            .pooled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .is_some_and(|s| s.release_id == plan.state.release_id && s.phase == plan.state.phase);
        if current {
            return;
        }
        if plan.state.release_id.is_empty() {
            *m.pooled.lock().unwrap_or_else(|e| e.into_inner()) = None;
            return;
        }
        let (name, release_id, step) = (
            m.name.clone(),
            plan.state.release_id.clone(),
            plan.state.step,
        );
        let Some(rows) = fleet
            .call("window", move |s| s.windows(&name, &release_id, step))
            .await
        else {
            return;
        };
        let window = release::judge::StepWindow::pooled(rows.iter().map(|r| &r.window))
            .unwrap_or_else(|| release::judge::StepWindow::new(plan.state.step_started_ms));
        let status = Controller::with_window((**plan).clone(), window).status();
        *m.pooled.lock().unwrap_or_else(|e| e.into_inner()) = Some(status);
    }

    /// The fleet's plan of `m` (seeded from this replica's when the fleet has none), after
    /// offering it the plan file when that changed since the last look.
    async fn fleet_plan(
        &self,
        fleet: &Arc<crate::fleet::Fleet>,
        m: &Arc<ModelRelease>,
    ) -> Option<(fleet::PlanRow, FileLook)> {
        let local = (*m.plan()).clone();
        let path = m.path.clone();
        let known = m
            .file_digest
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let name = m.name.clone();
        fleet
            .call("plan", move |s| {
                let file = read_plan_file(&path);
                let digest = file.as_ref().map(|(d, _)| d.clone());
                let mut row = match s.plan(&name)? {
                    Some(row) => row,
                    None => s.seed_plan(&name, &local, digest.as_deref())?,
                };
                let mut look = FileLook {
                    digest: digest.clone(),
                    error: None,
                    adopted: None,
                };
                if digest != known {
                    match file {
                        Some((d, Ok(plan))) if row.file_digest.as_deref() != Some(d.as_str()) => {
                            if let Some(revision) = s.adopt_file(&name, &plan, &d)? {
                                look.adopted = Some(revision);
                                row = s.plan(&name)?.unwrap_or(row);
                            }
                        }
                        Some((_, Err(e))) => look.error = Some(e),
                        _ => {}
                    }
                }
                Ok((row, look))
            })
            .await
    }

    /// A command in a fleet: applied to the fleet's plan and written back compare-and-set (a
    /// command racing a judge's decision is applied to the newer plan), then adopted here.
    async fn fleet_command(
        &self,
        fleet: &Arc<crate::fleet::Fleet>,
        m: &Arc<ModelRelease>,
        command: Command,
        actor: &str,
    ) -> Result<Decision, CommandError> {
        for _ in 0..5 {
            let (name, local) = (m.name.clone(), (*m.plan()).clone());
            let row = fleet
                .call("command", move |s| match s.plan(&name)? {
                    Some(row) => Ok(row),
                    None => s.seed_plan(&name, &local, None),
                })
                .await
                .ok_or(CommandError::FleetUnavailable)?;
            let mut c = Controller::new(row.plan);
            let decision = c
                .command(command.clone(), now_ms(), actor)
                .map_err(|e| CommandError::Refused(e.to_string()))?;
            let plan = c.plan().clone();
            let (name, written, d) = (m.name.clone(), plan.clone(), decision.clone());
            match fleet
                .call("command", move |s| {
                    s.write_plan(&name, row.revision, &written, std::slice::from_ref(&d))
                })
                .await
            {
                None => return Err(CommandError::FleetUnavailable),
                Some(None) => continue,
                Some(Some(revision)) => {
                    m.adopt(plan, revision);
                    publish(&m.name, &decision);
                    set_gauges(m);
                    return Ok(decision);
                }
            }
        }
        Err(CommandError::Refused(
            "the fleet's plan changed under the command five times in a row: try again".into(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_release_sink_passes_the_sink_contract() {
        let dir = tempfile::tempdir().unwrap();
        let releases = Arc::new(
            Releases::open(
                ReleasesConfig::default(),
                dir.path().to_path_buf(),
                &[],
                Decisions::default(),
                None,
            )
            .unwrap(),
        );
        record::testing::check_sink(|| ReleaseSink::new(Arc::clone(&releases))).await;
    }
}
