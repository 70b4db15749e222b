//! Rampart's fleet: what several replicas of one deployment share, in PostgreSQL.
//!
//! One process keeps its releases in the plan file (`crate release`). Several replicas behind a
//! load balancer must route the same way, be judged once on all of their traffic and decide
//! once; they share this database instead (docs/fleet.md):
//!
//! - `rampart_release_plans`: each model's plan (JSON of `release::plan::ReleasePlan`) with a
//!   revision. Every write is a compare-and-set on the revision, so two writers never both win;
//!   every replica adopts a new revision at its next tick.
//! - `rampart_release_decisions`: every decision once, with the replica that made it.
//! - `rampart_release_files`: the plan files adopted (by digest): a file changed by Git is
//!   adopted once, and a replica with an older copy of the file never brings it back.
//! - `rampart_release_windows`: each replica's step window (`release::judge::StepWindow`: counts,
//!   moments and latency histograms, not records), which the judge pools.
//! - `rampart_release_ratings`: the helpful-rate test's samples, one row per rated answer
//!   whatever replica served or rated it.
//! - `rampart_fleet_replicas`: heartbeats (readiness, draining, load, versions served).
//! - `rampart_fleet_handoffs`: each model's hand-off to people, fleet-wide (the replica that
//!   handed it off or resumed it, why, until when).
//! - `rampart_fleet_faults`: fault drills scoped to the whole fleet (each replica applies them).
//! - `rampart_fleet_claims`: what must happen once for the fleet however many replicas see
//!   its trigger (the retrain hook: once per cool-down), claimed by the first.
//!
//! The judge is whoever holds a session advisory lock ([`FleetStore::hold_judge`]) on a
//! connection of its own. When the holder dies its connection closes and PostgreSQL releases
//! the lock at once; when it hangs, `idle_session_timeout` ends its session after
//! `lease_timeout`. Its writes are compare-and-set anyway: a judge that lost its lease without
//! knowing it cannot overwrite a newer plan.
//!
//! Blocking (the `postgres` client): the server calls it from blocking threads.

use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use release::controller::Decision;
use release::judge::StepWindow;
use release::plan::{ReleasePlan, Variant};
use serde::{Deserialize, Serialize};

/// The judge's advisory lock (two 32-bit keys: shown in `pg_locks` as classid, objid).
const JUDGE_LOCK: (i32, i32) = (72_270, 46);
/// The schema is made under this transaction lock (replicas may start at once).
const SCHEMA_LOCK: i64 = 7_227_010_046;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS rampart_fleet_replicas (
    replica text PRIMARY KEY,
    started_ms bigint NOT NULL,
    seen timestamptz NOT NULL,
    beat text NOT NULL
);
CREATE TABLE IF NOT EXISTS rampart_release_plans (
    model text PRIMARY KEY,
    revision bigint NOT NULL,
    plan text NOT NULL,
    file_digest text,
    updated_ms bigint NOT NULL,
    updated_by text NOT NULL
);
CREATE TABLE IF NOT EXISTS rampart_release_files (
    model text NOT NULL,
    digest text NOT NULL,
    adopted_ms bigint NOT NULL,
    replica text NOT NULL,
    PRIMARY KEY (model, digest)
);
CREATE TABLE IF NOT EXISTS rampart_release_decisions (
    id bigserial PRIMARY KEY,
    model text NOT NULL,
    release_id text NOT NULL,
    revision bigint NOT NULL,
    time_ms bigint NOT NULL,
    action text NOT NULL,
    replica text NOT NULL,
    decision text NOT NULL
);
CREATE INDEX IF NOT EXISTS rampart_release_decisions_model ON rampart_release_decisions (model, id);
CREATE TABLE IF NOT EXISTS rampart_release_windows (
    model text NOT NULL,
    release_id text NOT NULL,
    step integer NOT NULL,
    replica text NOT NULL,
    body text NOT NULL,
    updated_ms bigint NOT NULL,
    PRIMARY KEY (model, release_id, step, replica)
);
CREATE TABLE IF NOT EXISTS rampart_fleet_claims (
    name text NOT NULL,
    key text NOT NULL,
    claimed_ms bigint NOT NULL,
    replica text NOT NULL,
    PRIMARY KEY (name, key)
);
CREATE TABLE IF NOT EXISTS rampart_fleet_faults (
    id bigserial PRIMARY KEY,
    body text NOT NULL,
    by_principal text NOT NULL,
    replica text NOT NULL,
    until_ms bigint NOT NULL,
    cleared_ms bigint
);
CREATE TABLE IF NOT EXISTS rampart_fleet_handoffs (
    model text PRIMARY KEY,
    seq bigint NOT NULL,
    active boolean NOT NULL,
    why text NOT NULL,
    replica text NOT NULL,
    until_ms bigint,
    changed_ms bigint NOT NULL
);
CREATE TABLE IF NOT EXISTS rampart_release_ratings (
    model text NOT NULL,
    release_id text NOT NULL,
    answer text NOT NULL,
    variant text NOT NULL,
    helpful boolean NOT NULL,
    answered_ms bigint NOT NULL,
    PRIMARY KEY (model, release_id, answer)
);
";

/// Why the shared state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("PostgreSQL: {0}")]
    Postgres(#[from] postgres::Error),
    #[error("the shared state holds something this replica cannot read: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the fleet database address is not valid: {0}")]
    Url(String),
}

/// What a replica says of itself at every tick.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Beat {
    pub ready: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<String>,
    pub draining: bool,
    /// `name@version` of every version it serves.
    pub serving: Vec<String>,
    /// Requests in flight and waiting, over every model.
    pub in_flight: u64,
    pub waiting: u64,
    /// The binary's version.
    pub build: String,
    /// Whether it holds the judge's lease (as it believes).
    pub judge: bool,
}

/// A replica as the database last heard of it.
#[derive(Debug, Clone, Serialize)]
pub struct Replica {
    pub replica: String,
    pub started_ms: u64,
    /// Milliseconds since its last heartbeat, by the database's clock.
    pub last_seen_ms: u64,
    #[serde(flatten)]
    pub beat: Beat,
}

/// A model's shared plan and its revision.
#[derive(Debug, Clone)]
pub struct PlanRow {
    pub revision: i64,
    pub plan: ReleasePlan,
    /// The digest of the plan file this revision line last adopted.
    pub file_digest: Option<String>,
    pub updated_ms: u64,
    pub updated_by: String,
}

/// One decision as the fleet recorded it.
#[derive(Debug, Clone, Serialize)]
pub struct DecisionRow {
    pub id: i64,
    pub revision: i64,
    pub replica: String,
    pub release_id: String,
    pub decision: Decision,
}

/// One replica's window of a step.
#[derive(Debug, Clone)]
pub struct WindowRow {
    pub replica: String,
    pub updated_ms: u64,
    pub window: StepWindow,
}

/// A model's hand-off as the fleet holds it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FleetHandoff {
    pub model: String,
    /// Grows with every change.
    pub seq: i64,
    pub active: bool,
    pub why: String,
    /// The replica whose change this is.
    pub replica: String,
    /// When it resumes by itself (ms since the epoch), if it does.
    pub until_ms: Option<u64>,
}

/// A fault drill for every replica of the fleet.
#[derive(Debug, Clone)]
pub struct FleetFault {
    pub id: i64,
    /// The injection's request, as JSON (`POST /admin/faults`'s body).
    pub body: String,
    pub by: String,
    /// When it ends (ms since the epoch, the injecting replica's clock).
    pub until_ms: u64,
}

/// Ratings of a release's answers, per side: (helpful, rated answers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Ratings {
    pub stable: (u64, u64),
    pub candidate: (u64, u64),
}

struct Lease {
    client: Option<postgres::Client>,
    held: bool,
}

/// The fleet's shared state, seen from one replica.
pub struct FleetStore {
    config: postgres::Config,
    shown: String,
    replica: String,
    started_ms: u64,
    lease_timeout: Duration,
    conn: Mutex<Option<postgres::Client>>,
    lease: Mutex<Lease>,
}

impl std::fmt::Debug for FleetStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FleetStore")
            .field("database", &self.shown)
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

/// The blocking client's drop blocks on a runtime of its own, which panics (and aborts a
/// shutting-down server) on an async runtime's thread: its connections close on a thread of
/// their own.
impl Drop for FleetStore {
    fn drop(&mut self) {
        let conn = lock(&self.conn).take();
        let lease = lock(&self.lease).client.take();
        if conn.is_some() || lease.is_some() {
            let _ = std::thread::spawn(move || drop((conn, lease))).join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The database address without its password, for logs.
pub fn shown_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}@{}", &url[..s + 3], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

fn variant_name(v: Variant) -> &'static str {
    match v {
        Variant::Stable | Variant::Control => "stable",
        Variant::Candidate => "candidate",
    }
}

impl FleetStore {
    /// Connects as `replica` (`postgresql://user:password@host:port/db`) and makes the schema
    /// when it is not there. `lease_timeout`: how long a judge that stopped ticking keeps its
    /// lease.
    pub fn connect(
        url: &str,
        replica: &str,
        lease_timeout: Duration,
    ) -> Result<FleetStore, FleetError> {
        let store = Self::new(url, replica, lease_timeout)?;
        store.with(|_| Ok(()))?;
        Ok(store)
    }

    /// The store without connecting yet: the first call connects (and makes the schema), a
    /// database that is down at start is one that is down later (replicas serve, decisions
    /// wait).
    pub fn new(
        url: &str,
        replica: &str,
        lease_timeout: Duration,
    ) -> Result<FleetStore, FleetError> {
        let mut config: postgres::Config = url
            .parse()
            .map_err(|e: postgres::Error| FleetError::Url(e.to_string()))?;
        let application: String = format!("rampart:{replica}").chars().take(63).collect();
        config
            .application_name(&application)
            .connect_timeout(Duration::from_secs(3))
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(5));
        Ok(FleetStore {
            config,
            shown: shown_url(url),
            replica: replica.to_string(),
            started_ms: now_ms(),
            lease_timeout,
            conn: Mutex::new(None),
            lease: Mutex::new(Lease {
                client: None,
                held: false,
            }),
        })
    }

    /// The database, without its password.
    pub fn location(&self) -> &str {
        &self.shown
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// Runs `f` on the shared connection, connecting first when there is none; a failed call
    /// drops the connection (the next one reconnects: PostgreSQL may have restarted).
    fn with<T>(
        &self,
        f: impl FnOnce(&mut postgres::Client) -> Result<T, postgres::Error>,
    ) -> Result<T, FleetError> {
        let mut conn = lock(&self.conn);
        if conn.is_none() {
            let mut client = self.config.connect(postgres::NoTls)?;
            // One schema for all replicas: whoever connects first makes it, under a lock.
            let mut tx = client.transaction()?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])?;
            tx.batch_execute(SCHEMA)?;
            tx.commit()?;
            *conn = Some(client);
        }
        let client = conn.as_mut().expect("connected above");
        match f(client) {
            Ok(v) => Ok(v),
            Err(e) => {
                *conn = None;
                Err(e.into())
            }
        }
    }

    /// Says this replica is alive, with what it serves and how loaded it is.
    pub fn heartbeat(&self, beat: &Beat) -> Result<(), FleetError> {
        let body = serde_json::to_string(beat)?;
        let started = self.started_ms as i64;
        self.with(|c| {
            c.execute(
                "INSERT INTO rampart_fleet_replicas (replica, started_ms, seen, beat)
                 VALUES ($1, $2, clock_timestamp(), $3)
                 ON CONFLICT (replica) DO UPDATE
                 SET started_ms = EXCLUDED.started_ms, seen = EXCLUDED.seen, beat = EXCLUDED.beat",
                &[&self.replica, &started, &body],
            )
            .map(drop)
        })
    }

    /// Every replica heard of, the most recently seen first.
    pub fn replicas(&self) -> Result<Vec<Replica>, FleetError> {
        let rows = self.with(|c| {
            c.query(
                "SELECT replica, started_ms,
                        (EXTRACT(EPOCH FROM (clock_timestamp() - seen)) * 1000)::bigint, beat
                 FROM rampart_fleet_replicas ORDER BY seen DESC",
                &[],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(Replica {
                    replica: r.get(0),
                    started_ms: r.get::<_, i64>(1).max(0) as u64,
                    last_seen_ms: r.get::<_, i64>(2).max(0) as u64,
                    beat: serde_json::from_str(r.get::<_, &str>(3))?,
                })
            })
            .collect()
    }

    /// Takes the judge's lease, or keeps it: `true` while this replica holds it. The lease
    /// lives on a connection of its own; an error means this replica is not the judge (its
    /// session is gone, and with it the lock).
    pub fn hold_judge(&self) -> Result<bool, FleetError> {
        let mut lease = lock(&self.lease);
        if lease.client.is_none() {
            let mut client = self.config.connect(postgres::NoTls)?;
            // A holder that stops talking (hung, stopped, its node gone without a FIN) loses
            // the lease when its session ends.
            let timeout = format!("{}ms", self.lease_timeout.as_millis().max(1000));
            if let Err(e) = client.execute(
                "SELECT set_config('idle_session_timeout', $1, false)",
                &[&timeout],
            ) {
                tracing::warn!(target: "rampart::fleet", error = %e, "PostgreSQL has no idle_session_timeout (before 14): a hung judge keeps its lease until its connection closes");
            }
            lease.held = false;
            lease.client = Some(client);
        }
        let held = lease.held;
        let client = lease.client.as_mut().expect("connected above");
        let result = if held {
            client.simple_query("SELECT 1").map(|_| true)
        } else {
            client
                .query_one(
                    "SELECT pg_try_advisory_lock($1, $2)",
                    &[&JUDGE_LOCK.0, &JUDGE_LOCK.1],
                )
                .map(|r| r.get::<_, bool>(0))
        };
        match result {
            Ok(h) => {
                lease.held = h;
                Ok(h)
            }
            Err(e) => {
                lease.client = None;
                lease.held = false;
                Err(e.into())
            }
        }
    }

    /// Gives the judge's lease up (shutdown): its connection closes.
    pub fn release_judge(&self) {
        let mut lease = lock(&self.lease);
        lease.client = None;
        lease.held = false;
    }

    /// The replica holding the judge's lease, as PostgreSQL's lock table says.
    pub fn judge(&self) -> Result<Option<String>, FleetError> {
        let row = self.with(|c| {
            c.query_opt(
                "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                 WHERE l.locktype = 'advisory' AND l.granted
                   AND l.classid = $1::oid AND l.objid = $2::oid AND l.objsubid = 2",
                &[&(JUDGE_LOCK.0 as u32), &(JUDGE_LOCK.1 as u32)],
            )
        })?;
        Ok(row.map(|r| {
            let name: String = r.get(0);
            name.strip_prefix("rampart:").unwrap_or(&name).to_string()
        }))
    }

    /// The shared plan of `model`, if the fleet has one.
    pub fn plan(&self, model: &str) -> Result<Option<PlanRow>, FleetError> {
        let row = self.with(|c| {
            c.query_opt(
                "SELECT revision, plan, file_digest, updated_ms, updated_by
                 FROM rampart_release_plans WHERE model = $1",
                &[&model],
            )
        })?;
        row.map(|r| {
            Ok(PlanRow {
                revision: r.get(0),
                plan: serde_json::from_str(r.get::<_, &str>(1))?,
                file_digest: r.get(2),
                updated_ms: r.get::<_, i64>(3).max(0) as u64,
                updated_by: r.get(4),
            })
        })
        .transpose()
    }

    /// The shared plan of `model`, made from `plan` (this replica's, read from the file whose
    /// digest is `file_digest`) when the fleet has none yet.
    pub fn seed_plan(
        &self,
        model: &str,
        plan: &ReleasePlan,
        file_digest: Option<&str>,
    ) -> Result<PlanRow, FleetError> {
        let body = serde_json::to_string(plan)?;
        let now = now_ms() as i64;
        self.with(|c| {
            let mut tx = c.transaction()?;
            tx.execute(
                "INSERT INTO rampart_release_plans (model, revision, plan, file_digest, updated_ms, updated_by)
                 VALUES ($1, 1, $2, $3, $4, $5) ON CONFLICT (model) DO NOTHING",
                &[&model, &body, &file_digest, &now, &self.replica],
            )?;
            if let Some(digest) = file_digest {
                tx.execute(
                    "INSERT INTO rampart_release_files (model, digest, adopted_ms, replica)
                     VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                    &[&model, &digest, &now, &self.replica],
                )?;
            }
            tx.commit()
        })?;
        self.plan(model)?.ok_or_else(|| {
            FleetError::Url(format!("the plan of {model} vanished after its insert"))
        })
    }

    /// Adopts a plan file never seen before (a human's edit, a Git checkout): the plan becomes
    /// the fleet's next revision. `None` when this digest was adopted before (by any replica:
    /// an older copy of a file never comes back).
    pub fn adopt_file(
        &self,
        model: &str,
        plan: &ReleasePlan,
        file_digest: &str,
    ) -> Result<Option<i64>, FleetError> {
        let body = serde_json::to_string(plan)?;
        let now = now_ms() as i64;
        self.with(|c| {
            let mut tx = c.transaction()?;
            let new = tx.execute(
                "INSERT INTO rampart_release_files (model, digest, adopted_ms, replica)
                 VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
                &[&model, &file_digest, &now, &self.replica],
            )?;
            if new == 0 {
                return Ok(None);
            }
            let row = tx.query_one(
                "INSERT INTO rampart_release_plans (model, revision, plan, file_digest, updated_ms, updated_by)
                 VALUES ($1, 1, $2, $3, $4, $5)
                 ON CONFLICT (model) DO UPDATE SET revision = rampart_release_plans.revision + 1,
                    plan = EXCLUDED.plan, file_digest = EXCLUDED.file_digest,
                    updated_ms = EXCLUDED.updated_ms, updated_by = EXCLUDED.updated_by
                 RETURNING revision",
                &[&model, &body, &file_digest, &now, &self.replica],
            )?;
            tx.commit()?;
            Ok(Some(row.get(0)))
        })
    }

    /// Writes `plan` as the revision after `expected` with the decisions that made it, if the
    /// fleet's plan is still at `expected` (compare-and-set). `None` when another replica wrote
    /// first: nothing is written, and this replica adopts the newer plan instead.
    pub fn write_plan(
        &self,
        model: &str,
        expected: i64,
        plan: &ReleasePlan,
        decisions: &[Decision],
    ) -> Result<Option<i64>, FleetError> {
        let body = serde_json::to_string(plan)?;
        let rows: Vec<(String, String, i64)> = decisions
            .iter()
            .map(|d| {
                Ok((
                    serde_json::to_string(d)?,
                    serde_json::to_value(d.action)?
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                    d.time_ms as i64,
                ))
            })
            .collect::<Result<_, serde_json::Error>>()?;
        let now = now_ms() as i64;
        self.with(|c| {
            let mut tx = c.transaction()?;
            let updated = tx.query_opt(
                "UPDATE rampart_release_plans SET revision = revision + 1, plan = $3,
                    updated_ms = $4, updated_by = $5
                 WHERE model = $1 AND revision = $2 RETURNING revision",
                &[&model, &expected, &body, &now, &self.replica],
            )?;
            let Some(updated) = updated else {
                return Ok(None);
            };
            let revision: i64 = updated.get(0);
            for (decision, action, time_ms) in &rows {
                tx.execute(
                    "INSERT INTO rampart_release_decisions
                        (model, release_id, revision, time_ms, action, replica, decision)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)",
                    &[
                        &model,
                        &plan.state.release_id,
                        &revision,
                        time_ms,
                        action,
                        &self.replica,
                        decision,
                    ],
                )?;
            }
            tx.commit()?;
            Ok(Some(revision))
        })
    }

    /// The fleet's decisions of `model`, oldest first (at most `limit`, the latest).
    pub fn decisions(&self, model: &str, limit: i64) -> Result<Vec<DecisionRow>, FleetError> {
        let rows = self.with(|c| {
            c.query(
                "SELECT id, revision, replica, release_id, decision FROM (
                    SELECT * FROM rampart_release_decisions WHERE model = $1
                    ORDER BY id DESC LIMIT $2) d ORDER BY id",
                &[&model, &limit],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(DecisionRow {
                    id: r.get(0),
                    revision: r.get(1),
                    replica: r.get(2),
                    release_id: r.get(3),
                    decision: serde_json::from_str(r.get::<_, &str>(4))?,
                })
            })
            .collect()
    }

    /// Publishes this replica's window of a release's step (its ratings are counted apart).
    pub fn publish_window(
        &self,
        model: &str,
        release_id: &str,
        step: usize,
        window: &StepWindow,
    ) -> Result<(), FleetError> {
        let body = serde_json::to_string(&window.without_ratings())?;
        let now = now_ms() as i64;
        let step = step as i32;
        self.with(|c| {
            c.execute(
                "INSERT INTO rampart_release_windows (model, release_id, step, replica, body, updated_ms)
                 VALUES ($1, $2, $3, $4, $5, $6)
                 ON CONFLICT (model, release_id, step, replica) DO UPDATE
                 SET body = EXCLUDED.body, updated_ms = EXCLUDED.updated_ms",
                &[&model, &release_id, &step, &self.replica, &body, &now],
            )
            .map(drop)
        })
    }

    /// Every replica's window of a release's step.
    pub fn windows(
        &self,
        model: &str,
        release_id: &str,
        step: usize,
    ) -> Result<Vec<WindowRow>, FleetError> {
        let step = step as i32;
        let rows = self.with(|c| {
            c.query(
                "SELECT replica, updated_ms, body FROM rampart_release_windows
                 WHERE model = $1 AND release_id = $2 AND step = $3 ORDER BY replica",
                &[&model, &release_id, &step],
            )
        })?;
        rows.iter()
            .map(|r| {
                Ok(WindowRow {
                    replica: r.get(0),
                    updated_ms: r.get::<_, i64>(1).max(0) as u64,
                    window: serde_json::from_str(r.get::<_, &str>(2))?,
                })
            })
            .collect()
    }

    /// Every model's hand-off state in the fleet.
    pub fn handoffs(&self) -> Result<Vec<FleetHandoff>, FleetError> {
        let rows = self.with(|c| {
            c.query(
                "SELECT model, seq, active, why, replica, until_ms FROM rampart_fleet_handoffs",
                &[],
            )
        })?;
        Ok(rows
            .iter()
            .map(|r| FleetHandoff {
                model: r.get(0),
                seq: r.get(1),
                active: r.get(2),
                why: r.get(3),
                replica: r.get(4),
                until_ms: r.get::<_, Option<i64>>(5).map(|v| v.max(0) as u64),
            })
            .collect())
    }

    /// This replica hands `model` off (`active`, why, until `for_ms` from now or until resumed)
    /// or resumes it, for the fleet; the change's sequence number.
    pub fn set_handoff(
        &self,
        model: &str,
        active: bool,
        why: &str,
        for_ms: Option<u64>,
    ) -> Result<i64, FleetError> {
        let now = now_ms() as i64;
        let until = for_ms.map(|ms| now.saturating_add(ms as i64));
        let row = self.with(|c| {
            c.query_one(
                "INSERT INTO rampart_fleet_handoffs (model, seq, active, why, replica, until_ms, changed_ms)
                 VALUES ($1, 1, $2, $3, $4, $5, $6)
                 ON CONFLICT (model) DO UPDATE SET seq = rampart_fleet_handoffs.seq + 1,
                    active = EXCLUDED.active, why = EXCLUDED.why, replica = EXCLUDED.replica,
                    until_ms = EXCLUDED.until_ms, changed_ms = EXCLUDED.changed_ms
                 RETURNING seq",
                &[&model, &active, &why, &self.replica, &until, &now],
            )
        })?;
        Ok(row.get(0))
    }

    /// Records a fault for every replica (`body`: the injection's request as JSON), lasting
    /// `duration_ms`; its id.
    pub fn add_fault(&self, body: &str, by: &str, duration_ms: u64) -> Result<i64, FleetError> {
        let until = now_ms().saturating_add(duration_ms) as i64;
        let row = self.with(|c| {
            c.query_one(
                "INSERT INTO rampart_fleet_faults (body, by_principal, replica, until_ms)
                 VALUES ($1, $2, $3, $4) RETURNING id",
                &[&body, &by, &self.replica, &until],
            )
        })?;
        Ok(row.get(0))
    }

    /// The fleet's faults that have not ended and were not cleared.
    pub fn active_faults(&self) -> Result<Vec<FleetFault>, FleetError> {
        let now = now_ms() as i64;
        let rows = self.with(|c| {
            c.query(
                "SELECT id, body, by_principal, until_ms FROM rampart_fleet_faults
                 WHERE cleared_ms IS NULL AND until_ms > $1 ORDER BY id",
                &[&now],
            )
        })?;
        Ok(rows
            .iter()
            .map(|r| FleetFault {
                id: r.get(0),
                body: r.get(1),
                by: r.get(2),
                until_ms: r.get::<_, i64>(3).max(0) as u64,
            })
            .collect())
    }

    /// Clears fleet faults (every replica drops them at its next tick); how many.
    pub fn clear_faults(&self, ids: &[i64]) -> Result<u64, FleetError> {
        let now = now_ms() as i64;
        self.with(|c| {
            c.execute(
                "UPDATE rampart_fleet_faults SET cleared_ms = $1
                 WHERE id = ANY($2) AND cleared_ms IS NULL",
                &[&now, &ids],
            )
        })
    }

    /// Claims `name` for `key` (the retrain hook for a model) unless some replica claimed it
    /// less than `cooldown_ms` ago: `true` when this replica has it and should act. Atomic: of
    /// replicas that see the same trigger at once, one wins.
    pub fn claim(&self, name: &str, key: &str, cooldown_ms: u64) -> Result<bool, FleetError> {
        let now = now_ms() as i64;
        let before = now.saturating_sub(cooldown_ms as i64);
        let row = self.with(|c| {
            c.query_opt(
                "INSERT INTO rampart_fleet_claims (name, key, claimed_ms, replica)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (name, key) DO UPDATE
                 SET claimed_ms = EXCLUDED.claimed_ms, replica = EXCLUDED.replica
                 WHERE rampart_fleet_claims.claimed_ms <= $5
                 RETURNING replica",
                &[&name, &key, &now, &self.replica, &before],
            )
        })?;
        Ok(row.is_some())
    }

    /// The latest rating of an answer a variant of a release gave at `answered_ms`: helpful
    /// or not, or `None` when nothing rates it any more (the row goes).
    pub fn rate(
        &self,
        model: &str,
        release_id: &str,
        answer: &str,
        variant: Variant,
        helpful: Option<bool>,
        answered_ms: u64,
    ) -> Result<(), FleetError> {
        let answered = answered_ms as i64;
        let variant = variant_name(variant);
        self.with(|c| match helpful {
            Some(helpful) => c
                .execute(
                    "INSERT INTO rampart_release_ratings
                        (model, release_id, answer, variant, helpful, answered_ms)
                     VALUES ($1, $2, $3, $4, $5, $6)
                     ON CONFLICT (model, release_id, answer) DO UPDATE
                     SET variant = EXCLUDED.variant, helpful = EXCLUDED.helpful",
                    &[&model, &release_id, &answer, &variant, &helpful, &answered],
                )
                .map(drop),
            None => c
                .execute(
                    "DELETE FROM rampart_release_ratings
                     WHERE model = $1 AND release_id = $2 AND answer = $3",
                    &[&model, &release_id, &answer],
                )
                .map(drop),
        })
    }

    /// The rated answers of a release given since `since_ms` (the step's start), per side.
    pub fn ratings(
        &self,
        model: &str,
        release_id: &str,
        since_ms: u64,
    ) -> Result<Ratings, FleetError> {
        let since = since_ms as i64;
        let rows = self.with(|c| {
            c.query(
                "SELECT variant, COUNT(*) FILTER (WHERE helpful), COUNT(*)
                 FROM rampart_release_ratings
                 WHERE model = $1 AND release_id = $2 AND answered_ms >= $3 GROUP BY variant",
                &[&model, &release_id, &since],
            )
        })?;
        let mut out = Ratings::default();
        for r in rows {
            let counts = (
                r.get::<_, i64>(1).max(0) as u64,
                r.get::<_, i64>(2).max(0) as u64,
            );
            match r.get::<_, &str>(0) {
                "candidate" => out.candidate = counts,
                _ => out.stable = counts,
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests;
