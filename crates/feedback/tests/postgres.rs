//! The feedback store on a real PostgreSQL (started by the test; skipped when PostgreSQL is not
//! installed unless `RAMPART_REQUIRE_MODELS=1`): the same operations as on SQLite, two stores
//! (two replicas) sharing one database, the same datasets from both backends.

use feedback::export::{self, Format, Options};
use feedback::store::{Filter, Store};
use feedback::{Rater, Submission, Submitted, Target};
use serde_json::json;

use feedback::testing::response;

fn body(v: serde_json::Value) -> Submission {
    Submission::parse(&v, true).unwrap()
}

/// The same feedback into a store.
fn fill(store: &Store) {
    let a = response("a", "logistics", 0.9, 1_000);
    let b = response("b", "refunds", 0.55, 1_001);
    let old = response("old", "refunds", 0.1, 5);
    store
        .index(&[a.clone(), b.clone(), a.clone(), old])
        .unwrap();
    store
        .submit(&a, &body(json!({"rating": "not_helpful", "label": "customs", "correction": "{\"category\": \"customs\"}"})), &Rater::key("agent", "ops"), 2_000)
        .unwrap();
    store
        .submit(
            &b,
            &body(json!({"rating": 5})),
            &Rater::key("agent", "ops"),
            2_001,
        )
        .unwrap();
    store
        .submit(
            &b,
            &body(json!({"rating": 2, "comment": "slow"})),
            &Rater::Link,
            2_002,
        )
        .unwrap();
}

#[test]
fn the_store_on_postgresql_matches_sqlite_and_replicas_share_it() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let one = Store::connect(&pg.url()).unwrap();
    let two = Store::connect(&pg.url()).unwrap();
    assert_eq!(one.kind(), "postgres");
    assert!(!one.location().contains("password"));
    let lite = Store::in_memory().unwrap();
    fill(&one);
    fill(&lite);

    // Found by any id, from the other replica too.
    let a = two
        .find(&Target::Response("chatcmpl-a".into()))
        .unwrap()
        .unwrap();
    assert_eq!(a, response("a", "logistics", 0.9, 1_000));
    assert_eq!(
        two.find(&Target::Request("req-b".into()))
            .unwrap()
            .unwrap()
            .audit_id,
        "b"
    );
    assert!(two.find(&Target::Audit("none".into())).unwrap().is_none());

    // Idempotent per rater across replicas: the second replica replaces the first's row.
    let again = two
        .submit(
            &a,
            &body(json!({"rating": "helpful"})),
            &Rater::key("agent", "ops"),
            3_000,
        )
        .unwrap();
    let again_lite = lite
        .submit(
            &a,
            &body(json!({"rating": "helpful"})),
            &Rater::key("agent", "ops"),
            3_000,
        )
        .unwrap();
    assert!(matches!(again, Submitted::Updated(_)));
    assert!(matches!(again_lite, Submitted::Updated(_)));
    assert!(!again.feedback().error);

    // The same tables from both backends.
    let all = Filter::default();
    assert_eq!(
        one.class_stats(&all).unwrap(),
        lite.class_stats(&all).unwrap()
    );
    assert_eq!(
        one.confidences(&all).unwrap(),
        lite.confidences(&all).unwrap()
    );
    assert_eq!(one.counts().unwrap(), (3, 3));
    let examples = one
        .examples(&Filter {
            model: Some("tickets".into()),
            ..all.clone()
        })
        .unwrap();
    assert_eq!(examples.len(), 3);
    let lite_examples = lite
        .examples(&Filter {
            model: Some("tickets".into()),
            ..all.clone()
        })
        .unwrap();
    let strip = |e: &feedback::store::Example| {
        (
            e.response.clone(),
            e.feedback.rater.clone(),
            e.feedback.rating,
            e.feedback.label.clone(),
            e.feedback.error,
        )
    };
    assert_eq!(
        examples.iter().map(strip).collect::<Vec<_>>(),
        lite_examples.iter().map(strip).collect::<Vec<_>>()
    );
    for format in [Format::Csv, Format::PreferenceJsonl, Format::Parquet] {
        let options = Options {
            filter: Filter {
                model: Some("tickets".into()),
                ..Filter::default()
            },
            format,
            scrub_pii: false,
            include_helpful: true,
        };
        let (_, pg_summary) = export::export(&one, &options).unwrap();
        let (_, lite_summary) = export::export(&lite, &options).unwrap();
        assert_eq!(pg_summary.rows, lite_summary.rows, "{format:?}");
    }
    // Pruning keeps what has feedback.
    assert_eq!(one.prune(1_500).unwrap(), 1);
    assert_eq!(two.counts().unwrap(), (2, 3));
}

/// The feedback table as servers made it before a link was one rater (no link index).
const OLD_FEEDBACK_TABLE: &str = "CREATE TABLE feedback (
    id TEXT PRIMARY KEY, audit_id TEXT NOT NULL, item BIGINT NOT NULL, rater TEXT NOT NULL,
    principal TEXT NOT NULL, via TEXT NOT NULL, time_ms BIGINT NOT NULL, model TEXT NOT NULL,
    version TEXT NOT NULL, class TEXT, confidence DOUBLE PRECISION, rating TEXT, helpful BIGINT,
    label TEXT, correction TEXT, comment TEXT, error BIGINT NOT NULL,
    UNIQUE (audit_id, item, rater))";

#[test]
fn on_postgresql_a_link_is_one_rater_and_an_old_store_is_converted() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    // A store an older server filled: one link row per rater its client claimed.
    let mut raw = postgres::Client::connect(&pg.url(), postgres::NoTls).unwrap();
    raw.batch_execute(OLD_FEEDBACK_TABLE).unwrap();
    for i in 0..30i64 {
        raw.execute(
            "INSERT INTO feedback (id, audit_id, item, rater, principal, via, time_ms, model, \
             version, error, helpful) VALUES ($1, 'a', 0, $2, 'link', 'link', $3, 'tickets', \
             '1.0.0', 0, $4)",
            &[
                &format!("f{i:02}"),
                &format!("link:user-{i}"),
                &(100 + i),
                &(i % 2),
            ],
        )
        .unwrap();
    }
    let one = Store::connect(&pg.url()).unwrap();
    let two = Store::connect(&pg.url()).unwrap();
    assert_eq!(one.counts().unwrap(), (0, 1), "the latest link row is kept");
    assert_eq!(one.answer_rating("a").unwrap(), Some(true), "f29's");

    // Two replicas take the same link's replays: one row, replaced.
    let b = response("b", "refunds", 0.55, 1_001);
    one.index(std::slice::from_ref(&b)).unwrap();
    let mut ids = std::collections::BTreeSet::new();
    for i in 0..20u64 {
        let store = if i % 2 == 0 { &one } else { &two };
        let s = body(json!({"rating": if i % 2 == 0 { 1 } else { 5 }, "rater": format!("u{i}")}));
        let done = store.submit(&b, &s, &Rater::Link, 2_000 + i).unwrap();
        assert_eq!(matches!(done, Submitted::Created(_)), i == 0);
        ids.insert(done.feedback().id.clone());
    }
    assert_eq!(ids.len(), 1);
    assert_eq!(two.answer_rating("b").unwrap(), Some(true));
    // Keys' raters keep theirs, and may not be named like a link.
    two.submit(
        &b,
        &body(json!({"rating": 2})),
        &Rater::key("agent", "ops"),
        3_000,
    )
    .unwrap();
    assert!(two
        .submit(
            &b,
            &body(json!({"rating": 2})),
            &Rater::key("link", "ops"),
            3_001
        )
        .is_err());
    assert_eq!(one.counts().unwrap(), (1, 3));
    // The database refuses a second link row on an answer's item, as an older replica would
    // write it.
    let second = raw.execute(
        "INSERT INTO feedback (id, audit_id, item, rater, principal, via, time_ms, model, \
         version, error) VALUES ('x', 'b', 0, 'link:other', 'link', 'link', 1, 'tickets', \
         '1.0.0', 0)",
        &[],
    );
    assert!(second.is_err(), "one link row per answer and item");
}

/// A server drops its state (and the store) on a runtime thread at shutdown: the blocking
/// client's connection closes without panicking there (it aborted the process before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_dropped_on_the_async_runtime_closes_cleanly() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let url = pg.url();
    let store = tokio::task::spawn_blocking(move || Store::connect(&url).unwrap())
        .await
        .unwrap();
    drop(store);
}
