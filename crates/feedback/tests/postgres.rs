//! The feedback store on a real PostgreSQL (started by the test; skipped when PostgreSQL is not
//! installed unless `RAMPART_REQUIRE_MODELS=1`): the same operations as on SQLite, two stores
//! (two replicas) sharing one database, the same datasets from both backends.

use feedback::export::{self, Format, Options};
use feedback::store::{Filter, Store};
use feedback::{Submission, Submitted, Target};
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
        .submit(&a, &body(json!({"rating": "not_helpful", "label": "customs", "correction": "{\"category\": \"customs\"}"})), "agent", "ops", "key", 2_000)
        .unwrap();
    store
        .submit(
            &b,
            &body(json!({"rating": 5})),
            "agent",
            "ops",
            "key",
            2_001,
        )
        .unwrap();
    store
        .submit(
            &b,
            &body(json!({"rating": 2, "comment": "slow"})),
            "link:u1",
            "link",
            "link",
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
            "agent",
            "ops",
            "key",
            3_000,
        )
        .unwrap();
    let again_lite = lite
        .submit(
            &a,
            &body(json!({"rating": "helpful"})),
            "agent",
            "ops",
            "key",
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
