//! This replica in a fleet (`[fleet]`, docs/fleet.md): the shared store's calls off the async
//! runtime with their health (up or down, an error said once per outage), the heartbeat task
//! that also holds or seeks the judge's lease, and what `GET /admin/fleet` shows. The releases'
//! part (shared plans, pooled judge) is `release_plans`'s.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::{counter, gauge};
use serde::Serialize;

use crate::config::FleetConfig;

/// The fleet's store as this replica uses it.
pub struct Fleet {
    pub store: Arc<fleet::FleetStore>,
    pub cfg: FleetConfig,
    pub replica: String,
    judge: AtomicBool,
    up: AtomicBool,
    /// When the store last failed, and whether that outage was said.
    outage: Mutex<Option<Instant>>,
    /// `GET /admin/fleet`'s last answer and when it was read: the view is read from the
    /// database at most once per `VIEW_TTL` however often it is asked (callers that come while
    /// it is being read wait for that read).
    view: tokio::sync::Mutex<Option<(Instant, Arc<FleetView>)>>,
}

/// How long `GET /admin/fleet`'s answer is reused.
const VIEW_TTL: Duration = Duration::from_millis(500);

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet")
            .field("replica", &self.replica)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl Fleet {
    /// The fleet of `[fleet]`, if it is on (nothing is connected yet: a database that is down
    /// at start is an outage like any other).
    pub fn open(
        cfg: &FleetConfig,
        feedback: &crate::config::FeedbackConfig,
    ) -> Result<Option<Arc<Fleet>>, fleet::FleetError> {
        let Some(url) = cfg.effective_url(feedback) else {
            return Ok(None);
        };
        let replica = cfg.replica_id();
        let store = fleet::FleetStore::new(
            &url,
            &replica,
            Duration::from_secs(cfg.lease_timeout_s.max(1)),
        )?;
        tracing::info!(target: "rampart::fleet", replica, database = store.location(), "fleet mode: the releases' state is shared in PostgreSQL");
        gauge!("rampart_fleet_store_up", "replica" => replica.clone()).set(0.0);
        gauge!("rampart_fleet_judge", "replica" => replica.clone()).set(0.0);
        Ok(Some(Arc::new(Fleet {
            store: Arc::new(store),
            cfg: cfg.clone(),
            replica,
            judge: AtomicBool::new(false),
            up: AtomicBool::new(false),
            outage: Mutex::new(None),
            view: tokio::sync::Mutex::new(None),
        })))
    }

    /// Whether this replica holds the judge's lease (as of its last heartbeat).
    pub fn is_judge(&self) -> bool {
        self.judge.load(Ordering::Relaxed)
    }

    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    fn set_judge(&self, judge: bool) {
        let was = self.judge.swap(judge, Ordering::Relaxed);
        if was != judge {
            if judge {
                tracing::warn!(target: "rampart::fleet", replica = %self.replica, "this replica is now the fleet's judge (it holds the lease)");
            } else {
                tracing::warn!(target: "rampart::fleet", replica = %self.replica, "this replica is no longer the fleet's judge");
            }
            counter!("rampart_fleet_judge_changes_total", "replica" => self.replica.clone(), "to" => if judge { "judge" } else { "follower" }).increment(1);
        }
        gauge!("rampart_fleet_judge", "replica" => self.replica.clone())
            .set(f64::from(u8::from(judge)));
    }

    /// `f` on the store, on a blocking thread; `None` when the store failed (said once per
    /// outage, counted each time: decisions wait, the replica serves its last plan).
    pub async fn call<T: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&fleet::FleetStore) -> Result<T, fleet::FleetError> + Send + 'static,
    ) -> Option<T> {
        counter!("rampart_fleet_store_calls_total", "replica" => self.replica.clone(), "op" => op)
            .increment(1);
        let store = Arc::clone(&self.store);
        let result = tokio::task::spawn_blocking(move || f(&store))
            .await
            .unwrap_or_else(|e| {
                Err(fleet::FleetError::Url(format!(
                    "the fleet task failed: {e}"
                )))
            });
        match result {
            Ok(v) => {
                if !self.up.swap(true, Ordering::Relaxed) {
                    let down_for = self
                        .outage
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .take()
                        .map(|t| t.elapsed().as_secs_f64());
                    tracing::info!(target: "rampart::fleet", replica = %self.replica, database = self.store.location(), down_for_s = down_for, "the fleet's database is reachable");
                    gauge!("rampart_fleet_store_up", "replica" => self.replica.clone()).set(1.0);
                }
                Some(v)
            }
            Err(e) => {
                counter!("rampart_fleet_store_errors_total", "replica" => self.replica.clone(), "op" => op).increment(1);
                let mut outage = self.outage.lock().unwrap_or_else(|e| e.into_inner());
                if self.up.swap(false, Ordering::Relaxed) || outage.is_none() {
                    outage.get_or_insert_with(Instant::now);
                    tracing::error!(target: "rampart::fleet", replica = %self.replica, database = self.store.location(), op, error = %e, "the fleet's database cannot be reached: this replica serves its last known plans and no release decides until it is back");
                    gauge!("rampart_fleet_store_up", "replica" => self.replica.clone()).set(0.0);
                } else {
                    tracing::debug!(target: "rampart::fleet", op, error = %e, "fleet database still unreachable");
                }
                None
            }
        }
    }
}

/// What this replica says of itself.
fn beat(state: &crate::state::AppState, judge: bool) -> fleet::Beat {
    let entries = state.front.registry.all();
    let mut serving: Vec<String> = entries
        .iter()
        .map(|e| format!("{}@{}", e.name, e.version))
        .collect();
    serving.sort();
    serving.dedup();
    let not_ready = state.not_ready_reason();
    fleet::Beat {
        ready: not_ready.is_none(),
        not_ready,
        draining: state.front.is_draining() || state.is_leaving(),
        serving,
        in_flight: entries.iter().map(|e| e.admission.in_flight() as u64).sum(),
        waiting: entries.iter().map(|e| e.admission.waiting() as u64).sum(),
        build: env!("CARGO_PKG_VERSION").to_string(),
        judge,
    }
}

/// The heartbeat task: every `[releases] tick_ms`, hold (or seek) the judge's lease and say
/// this replica's state. A draining replica gives the lease up at once, so that another judges
/// while it finishes its streams.
pub fn spawn_heartbeat(state: Arc<crate::state::AppState>, fleet: Arc<Fleet>, tick_ms: u64) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(tick_ms.max(10)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tried = std::collections::HashSet::new();
        let mut seen = std::collections::HashMap::new();
        loop {
            tick.tick().await;
            let draining = state.front.is_draining() || state.is_leaving();
            let judge = if draining {
                if fleet.is_judge() {
                    let store = Arc::clone(&fleet.store);
                    let _ = tokio::task::spawn_blocking(move || store.release_judge()).await;
                    tracing::warn!(target: "rampart::fleet", replica = %fleet.replica, "draining: the judge's lease is given up for another replica");
                }
                false
            } else {
                fleet
                    .call("lease", |s| s.hold_judge())
                    .await
                    .unwrap_or(false)
            };
            fleet.set_judge(judge);
            let b = beat(&state, judge);
            fleet.call("heartbeat", move |s| s.heartbeat(&b)).await;
            sync_faults(&state, &fleet, &mut tried).await;
            sync_handoffs(&state, &fleet, &mut seen).await;
        }
    });
}

/// Keeps each model's hand-off the fleet's: a hand-off this replica made (its fallbacks
/// crossed the threshold) or ended (its cool-down) is written to the fleet's table; another
/// replica's is followed (until its cool-down ends, or until resumed), and its end resumes
/// here. An admin's pause or resume is written by the admin route itself.
async fn sync_handoffs(
    state: &Arc<crate::state::AppState>,
    fleet: &Arc<Fleet>,
    seen: &mut std::collections::HashMap<String, i64>,
) {
    use pipeline::handoff::Why;
    let Some(rows) = fleet.call("handoffs", |s| s.handoffs()).await else {
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut handoffs = state.front.handoffs.all();
    let served = state.front.registry.all();
    for row in rows.iter().filter(|r| r.active) {
        let known = handoffs.iter().any(|h| h.view().model == row.model);
        if !known && served.iter().any(|e| e.name == row.model) {
            handoffs.push(state.front.handoffs.get(&row.model));
        }
    }
    for h in handoffs {
        let view = h.view();
        let row = rows.iter().find(|r| r.model == view.model);
        let following = matches!(view.why, Some(Why::Fleet { .. }));
        if let Some(row) = row {
            let new = seen.get(&row.model).is_none_or(|s| row.seq > *s);
            seen.insert(row.model.clone(), row.seq);
            if new && row.replica != fleet.replica {
                let still = row.until_ms.is_none_or(|u| u > now);
                if row.active && still && !view.active {
                    h.follow(
                        Why::Fleet {
                            replica: row.replica.clone(),
                            cause: row.why.clone(),
                        },
                        row.until_ms.map(|u| u.saturating_sub(now).div_ceil(1000)),
                    );
                    tracing::warn!(target: "rampart::fleet", model = %row.model, from = %row.replica, cause = %row.why, "following the fleet's hand-off");
                } else if !row.active && view.active {
                    h.resume(&format!("fleet:{}", row.replica));
                    tracing::warn!(target: "rampart::fleet", model = %row.model, from = %row.replica, cause = %row.why, "the fleet's hand-off ended: resumed here");
                }
                continue;
            }
        }
        // This replica's own hand-off, or its end, for the others.
        let published = row.is_some_and(|r| r.active && r.replica == fleet.replica);
        let own = view.active && !following;
        if own != published && (own || row.is_some_and(|r| r.replica == fleet.replica)) {
            let model = view.model.clone();
            let why = view
                .why
                .as_ref()
                .map_or_else(|| "the cool-down is over".to_string(), ToString::to_string);
            let for_ms = view.resumes_in_s.map(|s| s * 1000);
            if let Some(seq) = fleet
                .call("handoff", move |s| s.set_handoff(&model, own, &why, for_ms))
                .await
            {
                seen.insert(view.model.clone(), seq);
            }
        }
    }
}

/// Applies the fleet's faults here (a fault scoped to the fleet, injected on any replica) and
/// drops the ones that ended or were cleared elsewhere. A fault whose backend this replica does
/// not serve (yet) is said once and tried again at every tick.
async fn sync_faults(
    state: &Arc<crate::state::AppState>,
    fleet: &Arc<Fleet>,
    tried: &mut std::collections::HashSet<i64>,
) {
    if !state.front.faults.enabled() {
        return;
    }
    let Some(active) = fleet.call("faults", |s| s.active_faults()).await else {
        return;
    };
    let local = state.front.faults.list();
    let wanted: std::collections::HashSet<i64> = active.iter().map(|f| f.id).collect();
    for f in local
        .iter()
        .filter(|f| f.fleet_id.is_some_and(|id| !wanted.contains(&id)))
    {
        state.front.faults.clear(Some(f.id), "fleet");
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    for f in active {
        if local.iter().any(|l| l.fleet_id == Some(f.id)) || tried.contains(&f.id) {
            continue;
        }
        tried.insert(f.id);
        let Ok(mut request) = serde_json::from_str::<pipeline::faults::FaultRequest>(&f.body)
        else {
            tracing::error!(target: "rampart::fleet", fleet_fault = f.id, "a fleet fault this replica cannot read: skipped");
            continue;
        };
        request.duration_s = f.until_ms.saturating_sub(now) as f64 / 1e3;
        let known = |backend: &str| {
            state.front.registry.all().iter().any(|e| {
                e.backends()
                    .iter()
                    .any(|b| pipeline::faults::covers(backend, &b.id))
            })
        };
        match state.front.faults.inject(request, &f.by, known) {
            Ok(fault) => {
                state.front.faults.set_fleet_id(fault.id, f.id);
                tracing::warn!(target: "rampart::fleet", fault = fault.id, fleet_fault = f.id, backend = %fault.backend, by = %f.by, "a fleet fault applied on this replica");
            }
            // (Its backend may still be loading here: tried again at the next tick.)
            Err(e) if tried.insert(f.id) => {
                tracing::warn!(target: "rampart::fleet", fleet_fault = f.id, error = %e, "a fleet fault cannot apply on this replica yet");
            }
            Err(_) => {}
        }
    }
}

/// A replica in `GET /admin/fleet`.
#[derive(Debug, Serialize)]
pub struct ReplicaView {
    #[serde(flatten)]
    pub replica: fleet::Replica,
    /// Not heard from for `[fleet] stale_after_s`.
    pub gone: bool,
}

/// What `GET /admin/fleet` shows: the replicas, the judge and every release's pooled state.
#[derive(Debug, Serialize)]
pub struct FleetView {
    /// The replica that answered.
    pub replica: String,
    pub database: String,
    pub database_up: bool,
    /// The judge's holder, as PostgreSQL's lock table says.
    pub judge: Option<String>,
    pub replicas: Vec<ReplicaView>,
    pub releases: Vec<FleetRelease>,
}

/// One release as the fleet holds it.
#[derive(Debug, Serialize)]
pub struct FleetRelease {
    pub model: String,
    pub revision: Option<i64>,
    pub updated_by: Option<String>,
    /// The judge's view: the pooled status of every replica's window.
    pub status: release::controller::Status,
    /// Each replica's share of the current step: samples per variant, when last published.
    pub windows: Vec<WindowShare>,
}

#[derive(Debug, Serialize)]
pub struct WindowShare {
    pub replica: String,
    pub samples_stable: u64,
    pub samples_control: u64,
    pub samples_candidate: u64,
    pub updated_ms: u64,
}

/// The fleet's state, read from the database at most once per `VIEW_TTL` (an admin key polling
/// in a loop costs the database two reads a second, not one per request).
pub async fn cached_view(
    fleet: &Arc<Fleet>,
    releases: &crate::release_plans::Releases,
) -> Arc<FleetView> {
    let mut cached = fleet.view.lock().await;
    if let Some((at, view)) = cached.as_ref() {
        if at.elapsed() < VIEW_TTL {
            return Arc::clone(view);
        }
    }
    let fresh = Arc::new(view(fleet, releases).await);
    *cached = Some((Instant::now(), Arc::clone(&fresh)));
    fresh
}

/// The fleet's state as this replica reads it now.
pub async fn view(fleet: &Arc<Fleet>, releases: &crate::release_plans::Releases) -> FleetView {
    let models: Vec<(String, String, usize)> = releases
        .all()
        .iter()
        .map(|m| {
            let p = m.plan();
            (m.name.clone(), p.state.release_id.clone(), p.state.step)
        })
        .collect();
    let stale_ms = fleet.cfg.stale_after_s.saturating_mul(1000);
    let read = fleet
        .call("view", move |s| {
            let replicas = s.replicas()?;
            let judge = s.judge()?;
            let mut rows = Vec::new();
            for (model, release_id, step) in models {
                let plan = s.plan(&model)?;
                let windows = s.windows(&model, &release_id, step)?;
                rows.push((model, plan, windows));
            }
            Ok((replicas, judge, rows))
        })
        .await;
    let (replicas, judge, rows) = read.unwrap_or_default();
    let releases = rows
        .into_iter()
        .filter_map(|(model, plan, windows)| {
            let m = releases.get(&model)?;
            Some(FleetRelease {
                status: m.status(),
                model,
                revision: plan.as_ref().map(|p| p.revision),
                updated_by: plan.map(|p| p.updated_by),
                windows: windows
                    .into_iter()
                    .map(|w| WindowShare {
                        replica: w.replica,
                        samples_stable: w.window.samples(release::plan::Variant::Stable),
                        samples_control: w.window.samples(release::plan::Variant::Control),
                        samples_candidate: w.window.samples(release::plan::Variant::Candidate),
                        updated_ms: w.updated_ms,
                    })
                    .collect(),
            })
        })
        .collect();
    FleetView {
        replica: fleet.replica.clone(),
        database: fleet.store.location().to_string(),
        database_up: fleet.is_up(),
        judge,
        replicas: replicas
            .into_iter()
            .map(|r| ReplicaView {
                gone: r.last_seen_ms > stale_ms,
                replica: r,
            })
            .collect(),
        releases,
    }
}
