//! The embedded feedback store: one SQLite file in the data directory (WAL, so the export
//! command reads while the server writes).
//!
//! Two tables: `responses` (every served response, its ids, class and content, kept for the
//! retention window unless it has feedback) and `feedback` (one row per response, item and
//! rater; a second submission by the same rater replaces the first).
//!
//! Who rated is a [`Rater`]: a key's rater (its `rater`, `X-Operator-Id` or key id; each keeps
//! its row) or the answer's signed link, which is one rater whatever its client claims: one row
//! per (answer, item) for links, enforced by the database itself (a partial unique index) as
//! well as by the rater name `link` that only links have.

use std::path::Path;
use std::sync::{Mutex, PoisonError};

use rusqlite::Connection;
use serde::Serialize;
use serde_json::Value;

use crate::submission::{Correction, Rating, Submission, Target};
use crate::FeedbackError;

/// A served response, as the index keeps it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Response {
    pub audit_id: String,
    pub request_id: String,
    /// The response body's `id` (`chatcmpl-…`), when it has one.
    pub response_id: Option<String>,
    pub time_ms: u64,
    /// The key that asked.
    pub principal: String,
    pub user: Option<String>,
    pub model: String,
    pub version: String,
    pub endpoint: String,
    /// Each item's class (one for a single answer; one per input of a batch).
    pub classes: Vec<Option<String>>,
    /// Each item's confidence (classifiers' top score).
    pub confidences: Vec<Option<f32>>,
    pub input_sha256: String,
    pub output_sha256: String,
    /// The input and output as the record bus carried them (absent when content is not kept).
    pub input: Option<Value>,
    pub output: Option<Value>,
}

/// One rater's feedback on one item of a response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Feedback {
    pub id: String,
    pub audit_id: String,
    pub item: usize,
    pub rater: String,
    /// The key (or `link`) it came with.
    pub principal: String,
    /// `key` or `link`.
    pub via: String,
    pub time_ms: u64,
    pub model: String,
    pub version: String,
    /// The class the response gave (what the error counts under).
    pub class: Option<String>,
    pub confidence: Option<f32>,
    pub rating: Option<Rating>,
    pub label: Option<String>,
    #[serde(serialize_with = "correction_json")]
    pub correction: Option<Correction>,
    pub comment: Option<String>,
    /// The rater says the answer was wrong: `not_helpful`, 1–2 stars, or a label other than
    /// the class given.
    pub error: bool,
}

fn correction_json<S: serde::Serializer>(c: &Option<Correction>, s: S) -> Result<S::Ok, S::Error> {
    c.as_ref().map(Correction::to_json).serialize(s)
}

/// Who gives a submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rater {
    /// The answer's signed feedback link: one rater per answer (the end user it was given to),
    /// whatever `rater` or `X-Operator-Id` its client sends. Its rows' rater is [`LINK_RATER`].
    Link,
    /// A key with the `feedback` scope: `rater` (the body's, else `X-Operator-Id`, else the
    /// key's id) keeps its own row; `principal` is the key's id.
    Key { rater: String, principal: String },
}

/// The rater (and principal) of every row a signed link gave; a key's rater may not be it, nor
/// start with `link:` (the raters links had before one link was one rater).
pub const LINK_RATER: &str = "link";

impl Rater {
    /// A key's rater.
    pub fn key(rater: impl Into<String>, principal: impl Into<String>) -> Rater {
        Rater::Key {
            rater: rater.into(),
            principal: principal.into(),
        }
    }

    /// Whether a key may rate under this name (links' names are reserved).
    pub fn reserved(name: &str) -> bool {
        name == LINK_RATER || name.starts_with("link:")
    }

    /// (rater, principal, via) as the row keeps them.
    fn columns(&self) -> (&str, &str, &'static str) {
        match self {
            Rater::Link => (LINK_RATER, LINK_RATER, "link"),
            Rater::Key { rater, principal } => (rater, principal, "key"),
        }
    }
}

/// What a submission did.
#[derive(Debug, Clone, PartialEq)]
pub enum Submitted {
    Created(Feedback),
    /// The rater had given feedback on this item before; this one replaced it.
    Updated(Feedback),
}

impl Submitted {
    pub fn feedback(&self) -> &Feedback {
        match self {
            Submitted::Created(f) | Submitted::Updated(f) => f,
        }
    }
}

/// Feedback counts of one (model, version, class) over a window.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassStat {
    pub model: String,
    pub version: String,
    /// Empty when the responses had no class.
    pub class: String,
    /// Feedback rows (ratings and corrections).
    pub n: u64,
    pub errors: u64,
    /// Rows with a rating that says helpful or not.
    pub rated: u64,
    pub helpful: u64,
}

/// A feedback row's (confidence, helpful, correct): the calibration table's input.
pub type Judged = (f32, Option<bool>, Option<bool>);

/// One feedback row joined to the response it is about (what exports read).
#[derive(Debug, Clone, PartialEq)]
pub struct Example {
    pub feedback: Feedback,
    pub response: Response,
}

/// Which rows an export or a table reads.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub model: Option<String>,
    pub version: Option<String>,
    pub class: Option<String>,
    pub since_ms: Option<u64>,
    pub until_ms: Option<u64>,
}

/// The schema, in the SQL both SQLite and PostgreSQL take.
const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS responses (
    audit_id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    response_id TEXT,
    time_ms BIGINT NOT NULL,
    principal TEXT NOT NULL,
    user_id TEXT,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    classes TEXT NOT NULL,
    confidences TEXT NOT NULL,
    input_sha256 TEXT NOT NULL,
    output_sha256 TEXT NOT NULL,
    input TEXT,
    output TEXT
);
CREATE INDEX IF NOT EXISTS responses_request ON responses(request_id);
CREATE INDEX IF NOT EXISTS responses_response ON responses(response_id);
CREATE INDEX IF NOT EXISTS responses_time ON responses(time_ms);
CREATE TABLE IF NOT EXISTS feedback (
    id TEXT PRIMARY KEY,
    audit_id TEXT NOT NULL,
    item BIGINT NOT NULL,
    rater TEXT NOT NULL,
    principal TEXT NOT NULL,
    via TEXT NOT NULL,
    time_ms BIGINT NOT NULL,
    model TEXT NOT NULL,
    version TEXT NOT NULL,
    class TEXT,
    confidence DOUBLE PRECISION,
    rating TEXT,
    helpful BIGINT,
    label TEXT,
    correction TEXT,
    comment TEXT,
    error BIGINT NOT NULL,
    UNIQUE (audit_id, item, rater)
);
CREATE INDEX IF NOT EXISTS feedback_model_time ON feedback(model, time_ms);
CREATE INDEX IF NOT EXISTS feedback_time ON feedback(time_ms);
";

/// The index that makes a link one rater: one row per (answer, item) of those links gave.
const LINK_INDEX: &str = "feedback_one_per_link";

/// Makes a store written before a link was one rater (its links' rows were `link:<rater>`, one
/// per claimed rater) hold one link row per (answer, item), then adds [`LINK_INDEX`]: keeps the
/// latest link row of each (answer, item), names it `link`, drops the others. Runs once, when
/// the index is missing, in the SQL both backends take.
const LINK_MIGRATION: &str = "
DELETE FROM feedback WHERE via = 'link' AND EXISTS (SELECT 1 FROM feedback g
    WHERE g.via = 'link' AND g.audit_id = feedback.audit_id AND g.item = feedback.item
    AND (g.time_ms > feedback.time_ms OR (g.time_ms = feedback.time_ms AND g.id > feedback.id)));
UPDATE feedback SET rater = 'link', principal = 'link' WHERE via = 'link' AND rater <> 'link'
    AND NOT EXISTS (SELECT 1 FROM feedback k WHERE k.audit_id = feedback.audit_id
    AND k.item = feedback.item AND k.rater = 'link');
CREATE UNIQUE INDEX IF NOT EXISTS feedback_one_per_link ON feedback(audit_id, item)
    WHERE via = 'link';
";

/// Where the rows live.
enum Backend {
    /// The embedded default: one SQLite file.
    Sqlite(Mutex<Connection>),
    /// Several replicas' shared store (the connection is remade when it breaks).
    Postgres {
        url: String,
        client: Mutex<Option<Box<PgConn>>>,
    },
}

/// A PostgreSQL connection and its prepared statements (one round trip per query instead of
/// two).
struct PgConn {
    client: postgres::Client,
    statements: std::collections::HashMap<String, postgres::Statement>,
}

impl PgConn {
    fn connect(url: &str) -> Result<Box<PgConn>, FeedbackError> {
        Ok(Box::new(PgConn {
            client: pg_connect(url)?,
            statements: Default::default(),
        }))
    }

    fn prepared(&mut self, sql: &str) -> Result<postgres::Statement, postgres::Error> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = self.client.prepare(sql)?;
        self.statements.insert(sql.to_string(), s.clone());
        Ok(s)
    }
}

/// The blocking PostgreSQL client's drop blocks on a runtime of its own, which panics on an async
/// runtime's thread (a server dropping its state at shutdown aborted so): the connection closes
/// on a thread of its own.
impl Drop for Backend {
    fn drop(&mut self) {
        if let Backend::Postgres { client, .. } = self {
            let conn = client.get_mut().unwrap_or_else(|e| e.into_inner()).take();
            if conn.is_some() {
                let _ = std::thread::spawn(move || drop(conn)).join();
            }
        }
    }
}

/// The feedback store.
pub struct Store {
    backend: Backend,
    location: String,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("location", &self.location)
            .finish()
    }
}

fn setup(conn: &Connection) -> Result<(), FeedbackError> {
    conn.busy_timeout(std::time::Duration::from_secs(5))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "NORMAL")?;
    conn.execute_batch(SCHEMA)?;
    migrate_sqlite(conn)
}

/// [`LINK_MIGRATION`] on SQLite, when the index is missing.
fn migrate_sqlite(conn: &Connection) -> Result<(), FeedbackError> {
    let present: i64 = conn.query_row(
        "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = ?1",
        [LINK_INDEX],
        |r| r.get(0),
    )?;
    if present == 0 {
        conn.execute_batch(&format!("BEGIN; {LINK_MIGRATION} COMMIT;"))?;
    }
    Ok(())
}

fn json_or_null(v: &Option<Value>) -> Option<String> {
    v.as_ref().map(Value::to_string)
}

/// A query parameter, typed the same for both backends.
#[derive(Debug, Clone)]
enum Val {
    Text(Option<String>),
    Int(Option<i64>),
    Real(Option<f64>),
}

impl rusqlite::ToSql for Val {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        match self {
            Val::Text(v) => v.to_sql(),
            Val::Int(v) => v.to_sql(),
            Val::Real(v) => v.to_sql(),
        }
    }
}

fn text(s: impl Into<String>) -> Val {
    Val::Text(Some(s.into()))
}

fn int(i: i64) -> Val {
    Val::Int(Some(i))
}

/// The `$n` placeholders PostgreSQL takes for SQLite's `?n`.
fn dollars(sql: &str) -> String {
    sql.replace('?', "$")
}

/// A row of either backend, read by column index.
trait Cells {
    fn text(&self, i: usize) -> Result<Option<String>, FeedbackError>;
    fn int(&self, i: usize) -> Result<Option<i64>, FeedbackError>;
    fn real(&self, i: usize) -> Result<Option<f64>, FeedbackError>;

    fn string(&self, i: usize) -> Result<String, FeedbackError> {
        Ok(self.text(i)?.unwrap_or_default())
    }
    fn int0(&self, i: usize) -> Result<i64, FeedbackError> {
        Ok(self.int(i)?.unwrap_or(0))
    }
}

impl Cells for rusqlite::Row<'_> {
    fn text(&self, i: usize) -> Result<Option<String>, FeedbackError> {
        Ok(self.get(i)?)
    }
    fn int(&self, i: usize) -> Result<Option<i64>, FeedbackError> {
        Ok(self.get(i)?)
    }
    fn real(&self, i: usize) -> Result<Option<f64>, FeedbackError> {
        Ok(self.get(i)?)
    }
}

impl Cells for postgres::Row {
    fn text(&self, i: usize) -> Result<Option<String>, FeedbackError> {
        Ok(self.try_get(i)?)
    }
    fn int(&self, i: usize) -> Result<Option<i64>, FeedbackError> {
        Ok(self.try_get(i)?)
    }
    fn real(&self, i: usize) -> Result<Option<f64>, FeedbackError> {
        Ok(self.try_get(i)?)
    }
}

fn pg_params(values: &[Val]) -> Vec<Box<dyn postgres::types::ToSql + Sync>> {
    values
        .iter()
        .map(|v| -> Box<dyn postgres::types::ToSql + Sync> {
            match v.clone() {
                Val::Text(t) => Box::new(t),
                Val::Int(i) => Box::new(i),
                Val::Real(r) => Box::new(r),
            }
        })
        .collect()
}

fn pg_connect(url: &str) -> Result<postgres::Client, FeedbackError> {
    let mut client = postgres::Client::connect(url, postgres::NoTls)
        .map_err(|e| FeedbackError::Store(format!("PostgreSQL: {e}")))?;
    // One schema for all replicas: whoever starts first makes it, under a lock.
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock(7227010001)", &[])?;
    tx.batch_execute(SCHEMA)?;
    let present = tx.query_one(
        "SELECT COUNT(*) FROM pg_indexes WHERE schemaname = current_schema() AND indexname = $1",
        &[&LINK_INDEX],
    )?;
    if present.get::<_, i64>(0) == 0 {
        tx.batch_execute(LINK_MIGRATION)?;
    }
    tx.commit()?;
    Ok(client)
}

/// The PostgreSQL address without its password, for logs.
fn shown_url(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}@{}", &url[..s + 3], &url[at + 1..])
        }
        _ => url.to_string(),
    }
}

impl Store {
    /// Opens (or makes) the store file.
    pub fn open(path: &Path) -> Result<Store, FeedbackError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let conn = Connection::open(path)?;
        setup(&conn)?;
        Ok(Store {
            backend: Backend::Sqlite(Mutex::new(conn)),
            location: path.display().to_string(),
        })
    }

    /// Connects to a PostgreSQL database (`postgresql://user:password@host:port/db`) and makes
    /// the schema when it is not there. Blocking: call it off the async runtime.
    pub fn connect(url: &str) -> Result<Store, FeedbackError> {
        let client = PgConn::connect(url)?;
        Ok(Store {
            backend: Backend::Postgres {
                url: url.to_string(),
                client: Mutex::new(Some(client)),
            },
            location: shown_url(url),
        })
    }

    /// Opens an existing store without writing to it (the export command beside a running
    /// server).
    pub fn open_read_only(path: &Path) -> Result<Store, FeedbackError> {
        if !path.exists() {
            return Err(FeedbackError::Store(format!(
                "{}: no feedback store there (the server makes it in its data directory)",
                path.display()
            )));
        }
        let conn = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        Ok(Store {
            backend: Backend::Sqlite(Mutex::new(conn)),
            location: path.display().to_string(),
        })
    }

    /// A store in memory (tests, benchmarks).
    pub fn in_memory() -> Result<Store, FeedbackError> {
        let conn = Connection::open_in_memory()?;
        conn.execute_batch(SCHEMA)?;
        migrate_sqlite(&conn)?;
        Ok(Store {
            backend: Backend::Sqlite(Mutex::new(conn)),
            location: ":memory:".into(),
        })
    }

    pub fn location(&self) -> &str {
        &self.location
    }

    /// `sqlite` or `postgres`.
    pub fn kind(&self) -> &'static str {
        match self.backend {
            Backend::Sqlite(_) => "sqlite",
            Backend::Postgres { .. } => "postgres",
        }
    }

    /// Runs `f` on the PostgreSQL connection, remade once when it broke.
    fn with_pg<T>(
        url: &str,
        client: &Mutex<Option<Box<PgConn>>>,
        f: impl Fn(&mut PgConn) -> Result<T, postgres::Error>,
    ) -> Result<T, FeedbackError> {
        let mut guard = client.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.as_ref().is_none_or(|c| c.client.is_closed()) {
            *guard = Some(PgConn::connect(url)?);
        }
        let c = guard.as_mut().expect("connected above");
        match f(c) {
            Ok(v) => Ok(v),
            Err(e) if c.client.is_closed() => {
                tracing::warn!(error = %e, "the feedback store's PostgreSQL connection broke; reconnecting");
                *guard = Some(PgConn::connect(url)?);
                Ok(f(guard.as_mut().expect("connected above"))?)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Rows of a query (`?n` placeholders), each read by `row`.
    fn query<T>(
        &self,
        sql: &str,
        values: &[Val],
        row: impl Fn(&dyn Cells) -> Result<T, FeedbackError>,
    ) -> Result<Vec<T>, FeedbackError> {
        match &self.backend {
            Backend::Sqlite(conn) => {
                let conn = conn.lock().unwrap_or_else(PoisonError::into_inner);
                let mut stmt = conn.prepare_cached(sql)?;
                let mut rows = stmt.query(rusqlite::params_from_iter(values.iter()))?;
                let mut out = Vec::new();
                while let Some(r) = rows.next()? {
                    out.push(row(r)?);
                }
                Ok(out)
            }
            Backend::Postgres { url, client } => {
                let sql = dollars(sql);
                let params = pg_params(values);
                let refs: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p.as_ref()).collect();
                let rows = Self::with_pg(url, client, |c| {
                    let statement = c.prepared(&sql)?;
                    c.client.query(&statement, &refs)
                })?;
                rows.iter().map(|r| row(r)).collect()
            }
        }
    }

    /// Runs a statement; returns the rows it changed.
    fn execute(&self, sql: &str, values: &[Val]) -> Result<u64, FeedbackError> {
        match &self.backend {
            Backend::Sqlite(conn) => {
                let conn = conn.lock().unwrap_or_else(PoisonError::into_inner);
                Ok(conn.execute(sql, rusqlite::params_from_iter(values.iter()))? as u64)
            }
            Backend::Postgres { url, client } => {
                let sql = dollars(sql);
                let params = pg_params(values);
                let refs: Vec<&(dyn postgres::types::ToSql + Sync)> =
                    params.iter().map(|p| p.as_ref()).collect();
                Self::with_pg(url, client, |c| {
                    let statement = c.prepared(&sql)?;
                    c.client.execute(&statement, &refs)
                })
            }
        }
    }

    /// Indexes served responses, in one transaction. A response indexed twice keeps its first
    /// row.
    pub fn index(&self, responses: &[Response]) -> Result<(), FeedbackError> {
        const INSERT: &str = "INSERT INTO responses (audit_id, request_id, response_id, time_ms, \
             principal, user_id, model, version, endpoint, classes, confidences, \
             input_sha256, output_sha256, input, output) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15) \
             ON CONFLICT (audit_id) DO NOTHING";
        let rows: Vec<Vec<Val>> = responses
            .iter()
            .map(|r| {
                vec![
                    text(&r.audit_id),
                    text(&r.request_id),
                    Val::Text(r.response_id.clone()),
                    int(r.time_ms as i64),
                    text(&r.principal),
                    Val::Text(r.user.clone()),
                    text(&r.model),
                    text(&r.version),
                    text(&r.endpoint),
                    text(serde_json::to_string(&r.classes).unwrap_or_else(|_| "[]".into())),
                    text(serde_json::to_string(&r.confidences).unwrap_or_else(|_| "[]".into())),
                    text(&r.input_sha256),
                    text(&r.output_sha256),
                    Val::Text(json_or_null(&r.input)),
                    Val::Text(json_or_null(&r.output)),
                ]
            })
            .collect();
        match &self.backend {
            Backend::Sqlite(conn) => {
                let mut conn = conn.lock().unwrap_or_else(PoisonError::into_inner);
                let tx = conn.transaction()?;
                {
                    let mut insert = tx.prepare_cached(INSERT)?;
                    for row in &rows {
                        insert.execute(rusqlite::params_from_iter(row.iter()))?;
                    }
                }
                tx.commit()?;
                Ok(())
            }
            Backend::Postgres { url, client } => {
                let sql = dollars(INSERT);
                let params: Vec<_> = rows.iter().map(|r| pg_params(r)).collect();
                Self::with_pg(url, client, |c| {
                    let insert = c.prepared(&sql)?;
                    let mut tx = c.client.transaction()?;
                    for p in &params {
                        let refs: Vec<&(dyn postgres::types::ToSql + Sync)> =
                            p.iter().map(|p| p.as_ref()).collect();
                        tx.execute(&insert, &refs)?;
                    }
                    tx.commit()
                })
            }
        }
    }

    /// The response a reference names.
    pub fn find(&self, target: &Target) -> Result<Option<Response>, FeedbackError> {
        let (column, id) = match target {
            Target::Audit(id) => ("audit_id", id),
            Target::Request(id) => ("request_id", id),
            Target::Response(id) => ("response_id", id),
        };
        let sql = format!(
            "SELECT audit_id, request_id, response_id, time_ms, principal, user_id, model, \
             version, endpoint, classes, confidences, input_sha256, output_sha256, input, output \
             FROM responses WHERE {column} = ?1 ORDER BY time_ms DESC LIMIT 1"
        );
        Ok(self.query(&sql, &[text(id)], |r| response_row(r, 0))?.pop())
    }

    /// Joins a submission to its response: a new row, or the rater's earlier row replaced (a
    /// link's earlier row on that item, whoever its client said it was).
    pub fn submit(
        &self,
        response: &Response,
        s: &Submission,
        by: &Rater,
        time_ms: u64,
    ) -> Result<Submitted, FeedbackError> {
        let (rater, principal, via) = by.columns();
        if via == "key" && Rater::reserved(rater) {
            return Err(FeedbackError::ReservedRater(rater.to_string()));
        }
        let class = response.classes.get(s.item).cloned().flatten();
        let confidence = response.confidences.get(s.item).copied().flatten();
        let wrong_label =
            matches!((&s.label, &class), (Some(label), Some(class)) if label != class);
        let error = s.rating.and_then(|r| r.helpful()) == Some(false) || wrong_label;
        let mut f = Feedback {
            id: uuid::Uuid::new_v4().to_string(),
            audit_id: response.audit_id.clone(),
            item: s.item,
            rater: rater.to_string(),
            principal: principal.to_string(),
            via: via.to_string(),
            time_ms,
            model: response.model.clone(),
            version: response.version.clone(),
            class,
            confidence,
            rating: s.rating,
            label: s.label.clone(),
            correction: s.correction.clone(),
            comment: s.comment.clone(),
            error,
        };
        // One statement: the row's id comes back, the new one or the rater's earlier one. A row
        // of the other kind under the same name (a key rater called `link` from before the
        // name was reserved) is not taken over: nothing comes back.
        let kept = self.query(
            "INSERT INTO feedback (id, audit_id, item, rater, principal, via, time_ms, model, \
             version, class, confidence, rating, helpful, label, correction, comment, error) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17) \
             ON CONFLICT (audit_id, item, rater) DO UPDATE SET principal = excluded.principal, \
             via = excluded.via, time_ms = excluded.time_ms, rating = excluded.rating, \
             helpful = excluded.helpful, label = excluded.label, \
             correction = excluded.correction, comment = excluded.comment, error = excluded.error \
             WHERE feedback.via = excluded.via RETURNING id",
            &[
                text(&f.id),
                text(&f.audit_id),
                int(f.item as i64),
                text(&f.rater),
                text(&f.principal),
                text(&f.via),
                int(f.time_ms as i64),
                text(&f.model),
                text(&f.version),
                Val::Text(f.class.clone()),
                Val::Real(f.confidence.map(f64::from)),
                Val::Text(f.rating.map(|r| r.as_str().to_string())),
                Val::Int(f.rating.and_then(Rating::helpful).map(i64::from)),
                Val::Text(f.label.clone()),
                Val::Text(f.correction.as_ref().map(|c| c.to_json().to_string())),
                Val::Text(f.comment.clone()),
                int(i64::from(f.error)),
            ],
            |r| r.string(0),
        )?;
        let id = kept
            .into_iter()
            .next()
            .ok_or_else(|| FeedbackError::Store("the feedback row was not kept".into()))?;
        let created = id == f.id;
        f.id = id;
        Ok(if created {
            Submitted::Created(f)
        } else {
            Submitted::Updated(f)
        })
    }

    /// What an answer's latest rating says (helpful or not), over all its raters and items;
    /// `None` when no row of it rates it either way. The release judge counts this, once per
    /// answer, whoever rated it and however often.
    pub fn answer_rating(&self, audit_id: &str) -> Result<Option<bool>, FeedbackError> {
        Ok(self
            .query(
                "SELECT helpful FROM feedback WHERE audit_id = ?1 AND helpful IS NOT NULL \
                 ORDER BY time_ms DESC, id DESC LIMIT 1",
                &[text(audit_id)],
                |r| r.int(0),
            )?
            .into_iter()
            .next()
            .flatten()
            .map(|h| h != 0))
    }

    /// Feedback counts per (model, version, class) of the rows the filter takes.
    pub fn class_stats(&self, filter: &Filter) -> Result<Vec<ClassStat>, FeedbackError> {
        let (clause, values) = where_clause(filter, "", "");
        let sql = format!(
            "SELECT model, version, COALESCE(class, ''), COUNT(*), CAST(SUM(error) AS BIGINT), \
             COUNT(helpful), CAST(COALESCE(SUM(helpful), 0) AS BIGINT) FROM feedback {clause} \
             GROUP BY model, version, COALESCE(class, '') ORDER BY 1, 2, 3"
        );
        self.query(&sql, &values, |r| {
            Ok(ClassStat {
                model: r.string(0)?,
                version: r.string(1)?,
                class: r.string(2)?,
                n: r.int0(3)? as u64,
                errors: r.int0(4)? as u64,
                rated: r.int0(5)? as u64,
                helpful: r.int0(6)? as u64,
            })
        })
    }

    /// (confidence, helpful, correct) of each feedback row with a confidence: the calibration
    /// table's input. `correct`: the label given matches the class (None without a label).
    pub fn confidences(&self, filter: &Filter) -> Result<Vec<Judged>, FeedbackError> {
        let (clause, values) = where_clause(filter, "confidence IS NOT NULL", "");
        let sql = format!(
            "SELECT confidence, helpful, label, class FROM feedback {clause} ORDER BY time_ms, id"
        );
        self.query(&sql, &values, |r| {
            let label = r.text(2)?;
            let class = r.text(3)?;
            Ok((
                r.real(0)?.unwrap_or(0.0) as f32,
                r.int(1)?.map(|h| h != 0),
                label.map(|l| Some(l) == class),
            ))
        })
    }

    /// Feedback rows joined to their responses, oldest first.
    pub fn examples(&self, filter: &Filter) -> Result<Vec<Example>, FeedbackError> {
        let (clause, values) = where_clause(filter, "", "f.");
        let sql = format!(
            "SELECT r.audit_id, r.request_id, r.response_id, r.time_ms, r.principal, r.user_id, \
             r.model, r.version, r.endpoint, r.classes, r.confidences, r.input_sha256, \
             r.output_sha256, r.input, r.output, \
             f.id, f.item, f.rater, f.principal, f.via, f.time_ms, f.class, f.confidence, \
             f.rating, f.label, f.correction, f.comment, f.error \
             FROM feedback f JOIN responses r ON r.audit_id = f.audit_id {clause} \
             ORDER BY f.time_ms, f.id"
        );
        self.query(&sql, &values, |r| {
            let response = response_row(r, 0)?;
            let rating = r.text(23)?;
            let correction = r.text(25)?;
            Ok(Example {
                feedback: Feedback {
                    id: r.string(15)?,
                    audit_id: response.audit_id.clone(),
                    item: r.int0(16)? as usize,
                    rater: r.string(17)?,
                    principal: r.string(18)?,
                    via: r.string(19)?,
                    time_ms: r.int0(20)? as u64,
                    model: response.model.clone(),
                    version: response.version.clone(),
                    class: r.text(21)?,
                    confidence: r.real(22)?.map(|c| c as f32),
                    rating: rating.as_deref().and_then(Rating::parse),
                    label: r.text(24)?,
                    correction: correction
                        .and_then(|c| serde_json::from_str(&c).ok())
                        .as_ref()
                        .and_then(Correction::from_json),
                    comment: r.text(26)?,
                    error: r.int0(27)? != 0,
                },
                response,
            })
        })
    }

    /// Forgets responses older than `before_ms` that nobody gave feedback on. Returns how many.
    pub fn prune(&self, before_ms: u64) -> Result<usize, FeedbackError> {
        Ok(self.execute(
            "DELETE FROM responses WHERE time_ms < ?1 AND NOT EXISTS \
             (SELECT 1 FROM feedback f WHERE f.audit_id = responses.audit_id)",
            &[int(before_ms as i64)],
        )? as usize)
    }

    /// Rows in each table (responses, feedback).
    pub fn counts(&self) -> Result<(u64, u64), FeedbackError> {
        let n = |t: &str| -> Result<u64, FeedbackError> {
            let sql = format!("SELECT COUNT(*) FROM {t}");
            Ok(self
                .query(&sql, &[], |r| r.int0(0))?
                .first()
                .copied()
                .unwrap_or(0) as u64)
        };
        Ok((n("responses")?, n("feedback")?))
    }
}

/// `WHERE …` for a filter over the feedback table's columns, with its values in order.
/// `table`: the columns' prefix (`f.` in a join).
fn where_clause(filter: &Filter, extra: &str, table: &str) -> (String, Vec<Val>) {
    let mut parts: Vec<String> = Vec::new();
    let mut values: Vec<Val> = Vec::new();
    if let Some(m) = &filter.model {
        values.push(text(m));
        parts.push(format!("{table}model = ?{}", values.len()));
    }
    if let Some(v) = &filter.version {
        values.push(text(v));
        parts.push(format!("{table}version = ?{}", values.len()));
    }
    if let Some(c) = &filter.class {
        values.push(text(c));
        parts.push(format!("COALESCE({table}class, '') = ?{}", values.len()));
    }
    if let Some(t) = filter.since_ms {
        values.push(int(t as i64));
        parts.push(format!("{table}time_ms >= ?{}", values.len()));
    }
    if let Some(t) = filter.until_ms {
        values.push(int(t as i64));
        parts.push(format!("{table}time_ms < ?{}", values.len()));
    }
    if !extra.is_empty() {
        parts.push(extra.to_string());
    }
    if parts.is_empty() {
        (String::new(), values)
    } else {
        (format!("WHERE {}", parts.join(" AND ")), values)
    }
}

/// A response from 15 columns starting at `at`.
fn response_row(r: &dyn Cells, at: usize) -> Result<Response, FeedbackError> {
    let classes = r.string(at + 9)?;
    let confidences = r.string(at + 10)?;
    Ok(Response {
        audit_id: r.string(at)?,
        request_id: r.string(at + 1)?,
        response_id: r.text(at + 2)?,
        time_ms: r.int0(at + 3)? as u64,
        principal: r.string(at + 4)?,
        user: r.text(at + 5)?,
        model: r.string(at + 6)?,
        version: r.string(at + 7)?,
        endpoint: r.string(at + 8)?,
        classes: serde_json::from_str(&classes).unwrap_or_default(),
        confidences: serde_json::from_str(&confidences).unwrap_or_default(),
        input_sha256: r.string(at + 11)?,
        output_sha256: r.string(at + 12)?,
        input: r.text(at + 13)?.and_then(|s| serde_json::from_str(&s).ok()),
        output: r.text(at + 14)?.and_then(|s| serde_json::from_str(&s).ok()),
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    pub use crate::testing::response;

    fn body(v: Value) -> Submission {
        Submission::parse(&v, true).unwrap()
    }

    #[test]
    fn responses_are_found_by_any_id_and_feedback_is_idempotent_per_rater() {
        let store = Store::in_memory().unwrap();
        let r = response("a1", "logistics", 0.9, 1_000);
        store.index(&[r.clone(), r.clone()]).unwrap();
        for t in [
            Target::Audit("a1".into()),
            Target::Request("req-a1".into()),
            Target::Response("chatcmpl-a1".into()),
        ] {
            assert_eq!(store.find(&t).unwrap().as_ref(), Some(&r));
        }
        assert_eq!(store.find(&Target::Audit("nope".into())).unwrap(), None);
        let first = store
            .submit(
                &r,
                &body(json!({"rating": "helpful"})),
                &Rater::key("agent", "ops"),
                2_000,
            )
            .unwrap();
        assert!(matches!(first, Submitted::Created(_)));
        assert!(!first.feedback().error);
        let again = store
            .submit(
                &r,
                &body(json!({"label": "customs"})),
                &Rater::key("agent", "ops"),
                3_000,
            )
            .unwrap();
        let Submitted::Updated(f) = again else {
            panic!("replaced")
        };
        assert_eq!(f.id, first.feedback().id, "the rater's row keeps its id");
        assert!(f.error, "a label other than the class is an error");
        store
            .submit(&r, &body(json!({"rating": 5})), &Rater::Link, 3_500)
            .unwrap();
        assert_eq!(store.counts().unwrap(), (1, 2));
        let stats = store.class_stats(&Filter::default()).unwrap();
        assert_eq!(
            stats,
            [ClassStat {
                model: "tickets".into(),
                version: "1.0.0".into(),
                class: "logistics".into(),
                n: 2,
                errors: 1,
                rated: 1,
                helpful: 1,
            }]
        );
        let examples = store
            .examples(&Filter {
                model: Some("tickets".into()),
                ..Filter::default()
            })
            .unwrap();
        assert_eq!(examples.len(), 2);
        assert_eq!(examples[0].feedback.label.as_deref(), Some("customs"));
        assert_eq!(examples[0].response, r);
    }

    #[test]
    fn a_link_is_one_rater_per_item_whatever_its_client_says() {
        let store = Store::in_memory().unwrap();
        let mut r = response("a1", "logistics", 0.9, 1_000);
        r.classes.push(Some("refunds".into()));
        r.confidences.push(Some(0.4));
        store.index(std::slice::from_ref(&r)).unwrap();
        // 50 submissions of one link, each claiming another rater: one row, replaced.
        let mut ids = std::collections::BTreeSet::new();
        for i in 0..50u64 {
            let rating = if i % 2 == 0 { "helpful" } else { "not_helpful" };
            let s = body(json!({"rating": rating, "rater": format!("user-{i}")}));
            let done = store.submit(&r, &s, &Rater::Link, 2_000 + i).unwrap();
            assert_eq!(matches!(done, Submitted::Created(_)), i == 0, "{i}");
            assert_eq!(done.feedback().rater, LINK_RATER);
            ids.insert(done.feedback().id.clone());
        }
        assert_eq!(ids.len(), 1, "one row, kept by every replacement");
        assert_eq!(store.counts().unwrap(), (1, 1));
        assert_eq!(
            store.answer_rating("a1").unwrap(),
            Some(false),
            "the last one"
        );
        // The link rates each item of a batch answer once.
        let second = body(json!({"rating": 5, "item": 1}));
        assert!(matches!(
            store.submit(&r, &second, &Rater::Link, 3_000).unwrap(),
            Submitted::Created(_)
        ));
        assert_eq!(store.answer_rating("a1").unwrap(), Some(true));
        // Keys' raters keep their own rows beside the link's, and may not pose as a link.
        let agent = Rater::key("agent-7", "agents");
        store
            .submit(&r, &body(json!({"rating": 1})), &agent, 3_100)
            .unwrap();
        assert_eq!(store.counts().unwrap(), (1, 3));
        assert_eq!(store.answer_rating("a1").unwrap(), Some(false));
        for name in ["link", "link:user-1"] {
            let posing = Rater::key(name, "agents");
            assert!(matches!(
                store.submit(&r, &body(json!({"rating": 5})), &posing, 3_200),
                Err(FeedbackError::ReservedRater(_))
            ));
        }
        // A comment alone takes the link's rating away; the answer's latest rating is then the
        // agent's.
        store
            .submit(&r, &body(json!({"comment": "hm"})), &Rater::Link, 3_300)
            .unwrap();
        store
            .submit(
                &r,
                &body(json!({"comment": "hm", "item": 1})),
                &Rater::Link,
                3_301,
            )
            .unwrap();
        assert_eq!(store.answer_rating("a1").unwrap(), Some(false));
        assert_eq!(store.answer_rating("nobody").unwrap(), None);
    }

    /// A store file as the server wrote it before a link was one rater: the schema without the
    /// link index, and one link row per rater its client claimed.
    fn old_store(path: &Path, links: u64) {
        let conn = Connection::open(path).unwrap();
        conn.execute_batch(SCHEMA).unwrap();
        let insert = "INSERT INTO feedback (id, audit_id, item, rater, principal, via, time_ms, \
                      model, version, error, helpful) VALUES (?1, ?2, 0, ?3, ?4, ?5, ?6, 'm', '1', 0, ?7)";
        for i in 0..links {
            conn.execute(
                insert,
                rusqlite::params![
                    format!("f{i}"),
                    "a1",
                    format!("link:user-{i}"),
                    "link",
                    "link",
                    100 + i as i64,
                    (i % 2) as i64
                ],
            )
            .unwrap();
        }
        conn.execute(
            insert,
            rusqlite::params!["k", "a1", "agent", "agents", "key", 50, 1],
        )
        .unwrap();
    }

    #[test]
    fn an_old_store_keeps_the_latest_link_row_of_each_answer_and_enforces_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("feedback.db");
        old_store(&path, 40);
        let store = Store::open(&path).unwrap();
        assert_eq!(
            store.counts().unwrap(),
            (0, 2),
            "the latest link row and the key's"
        );
        let rows = store.query(
            "SELECT id, rater, principal FROM feedback WHERE via = 'link'",
            &[],
            |r| Ok((r.string(0)?, r.string(1)?, r.string(2)?)),
        );
        assert_eq!(
            rows.unwrap(),
            [(
                "f39".to_string(),
                LINK_RATER.to_string(),
                LINK_RATER.to_string()
            )]
        );
        drop(store);
        // The database itself refuses a second link row on the answer's item (an older replica
        // still writing `link:<rater>` rows), and opening again changes nothing.
        let conn = Connection::open(&path).unwrap();
        let second = conn.execute(
            "INSERT INTO feedback (id, audit_id, item, rater, principal, via, time_ms, model, \
             version, error) VALUES ('x', 'a1', 0, 'link:someone', 'link', 'link', 1, 'm', '1', 0)",
            [],
        );
        assert!(second.is_err(), "one link row per answer and item");
        drop(conn);
        assert_eq!(Store::open(&path).unwrap().counts().unwrap(), (0, 2));
    }

    #[test]
    fn pruning_keeps_responses_with_feedback() {
        let store = Store::in_memory().unwrap();
        let old = response("old", "a", 0.5, 10);
        let rated = response("rated", "a", 0.5, 10);
        let new = response("new", "a", 0.5, 5_000);
        store.index(&[old, rated.clone(), new]).unwrap();
        store
            .submit(
                &rated,
                &body(json!({"rating": 1})),
                &Rater::key("r", "p"),
                20,
            )
            .unwrap();
        assert_eq!(store.prune(1_000).unwrap(), 1);
        assert_eq!(store.counts().unwrap(), (2, 1));
    }

    #[test]
    fn a_file_store_is_read_by_a_second_read_only_connection() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("feedback.db");
        let store = Store::open(&path).unwrap();
        let r = response("a", "x", 0.7, 1);
        store.index(std::slice::from_ref(&r)).unwrap();
        store
            .submit(
                &r,
                &body(json!({"rating": "not_helpful"})),
                &Rater::key("r", "p"),
                2,
            )
            .unwrap();
        let reader = Store::open_read_only(&path).unwrap();
        assert_eq!(reader.examples(&Filter::default()).unwrap().len(), 1);
        assert!(
            reader.index(&[response("b", "x", 0.1, 3)]).is_err(),
            "read only"
        );
        assert!(Store::open_read_only(&dir.path().join("none.db")).is_err());
    }
}
