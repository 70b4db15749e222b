//! The fleet store on a real PostgreSQL (started by the test; skipped when PostgreSQL is not
//! installed unless `RAMPART_REQUIRE_MODELS=1`), with three stores as three replicas.

use std::time::{Duration, Instant};

use release::controller::{Command, Controller};
use release::judge::{Sample, StepWindow};
use release::plan::{ReleasePlan, Variant};

use super::*;

fn replicas(pg: &testkit::postgres::Postgres) -> Vec<FleetStore> {
    ["r1", "r2", "r3"]
        .iter()
        .map(|r| FleetStore::connect(&pg.url(), r, Duration::from_secs(2)).unwrap())
        .collect()
}

fn running_plan() -> ReleasePlan {
    let mut c = Controller::new(ReleasePlan::new("1.0.0"));
    c.command(
        Command::Start {
            candidate: "1.1.0".into(),
            mode: None,
            tokenizer_change: None,
            gates_passed: Some(true),
        },
        1_000,
        "ops",
    )
    .unwrap();
    c.plan().clone()
}

#[test]
fn one_judge_at_a_time_and_the_next_takes_over_when_it_goes() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let fleet = replicas(&pg);
    let held: Vec<bool> = fleet.iter().map(|s| s.hold_judge().unwrap()).collect();
    assert_eq!(held, [true, false, false]);
    // Holding again keeps it; the others still cannot take it.
    assert!(fleet[0].hold_judge().unwrap());
    assert!(!fleet[1].hold_judge().unwrap());
    assert_eq!(fleet[2].judge().unwrap().as_deref(), Some("r1"));
    // The holder goes (its session closes, as when its process dies): the next try wins.
    let began = Instant::now();
    fleet[0].release_judge();
    let taken = loop {
        if fleet[1].hold_judge().unwrap() {
            break began.elapsed();
        }
        assert!(began.elapsed() < Duration::from_secs(5), "never taken over");
        std::thread::sleep(Duration::from_millis(20));
    };
    eprintln!("taken over after {taken:?}");
    assert!(!fleet[2].hold_judge().unwrap());
    assert_eq!(fleet[0].judge().unwrap().as_deref(), Some("r2"));
    // A holder that stops talking loses the lease after its timeout (2 s here).
    let began = Instant::now();
    let taken = loop {
        if fleet[2].hold_judge().unwrap() {
            break began.elapsed();
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "never taken over"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("a silent judge's lease taken over after {taken:?}");
    assert!(taken >= Duration::from_millis(1500), "{taken:?}");
    // The silent one finds out at its next look.
    assert!(fleet[1].hold_judge().is_err() || !fleet[1].hold_judge().unwrap());
}

#[test]
fn plans_are_compare_and_set_and_a_file_is_adopted_once() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let fleet = replicas(&pg);
    let first = ReleasePlan::new("1.0.0");
    let seeded = fleet[0].seed_plan("m", &first, Some("d1")).unwrap();
    assert_eq!(seeded.revision, 1);
    // A second seed finds the first.
    let again = fleet[1]
        .seed_plan("m", &running_plan(), Some("d2"))
        .unwrap();
    assert_eq!(again.revision, 1);
    assert_eq!(again.plan, first);
    // Two writers on revision 1: one wins, the other is told.
    let plan = running_plan();
    let d = plan.history.last().unwrap().clone();
    assert_eq!(
        fleet[1]
            .write_plan("m", 1, &plan, std::slice::from_ref(&d))
            .unwrap(),
        Some(2)
    );
    assert_eq!(fleet[2].write_plan("m", 1, &plan, &[d]).unwrap(), None);
    let decisions = fleet[0].decisions("m", 10).unwrap();
    assert_eq!(decisions.len(), 1);
    assert_eq!(decisions[0].replica, "r2");
    assert_eq!(decisions[0].revision, 2);
    // The file the fleet started from is not adopted again; a new one is, once.
    assert_eq!(fleet[2].adopt_file("m", &first, "d1").unwrap(), None);
    assert_eq!(fleet[0].adopt_file("m", &first, "d3").unwrap(), Some(3));
    assert_eq!(fleet[1].adopt_file("m", &first, "d3").unwrap(), None);
    let row = fleet[1].plan("m").unwrap().unwrap();
    assert_eq!((row.revision, row.file_digest.as_deref()), (3, Some("d3")));
    assert_eq!(row.plan, first);
    assert!(fleet[0].plan("other").unwrap().is_none());
}

#[test]
fn windows_pool_and_ratings_count_each_answer_once() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let fleet = replicas(&pg);
    for (i, store) in fleet.iter().enumerate() {
        let mut w = StepWindow::new(1_000);
        for k in 0..10 {
            w.push(&Sample {
                variant: if k < 2 {
                    Variant::Candidate
                } else {
                    Variant::Stable
                },
                time_ms: 1_000 + k,
                error: i == 0 && k == 0,
                ttft_ms: Some(100.0),
                tpot_ms: Some(10.0),
                e2e_ms: 200.0,
                entropy_mean: Some(1.0),
                confidence: None,
                helpful: None,
            });
        }
        store.publish_window("m", "rel", 0, &w).unwrap();
        // Published twice: the second replaces the first.
        store.publish_window("m", "rel", 0, &w).unwrap();
    }
    fleet[0]
        .publish_window("m", "rel", 1, &StepWindow::new(5))
        .unwrap();
    let rows = fleet[1].windows("m", "rel", 0).unwrap();
    assert_eq!(rows.len(), 3);
    let pooled = StepWindow::pooled(rows.iter().map(|r| &r.window)).unwrap();
    assert_eq!(pooled.samples(Variant::Candidate), 6);
    assert_eq!(pooled.samples(Variant::Stable), 24);
    assert_eq!(pooled.errors(Variant::Candidate), 1);
    // The same answer rated through two replicas is one sample with its latest rating.
    fleet[0]
        .rate("m", "rel", "a1", Variant::Candidate, Some(true), 2_000)
        .unwrap();
    fleet[2]
        .rate("m", "rel", "a1", Variant::Candidate, Some(false), 2_000)
        .unwrap();
    fleet[1]
        .rate("m", "rel", "a2", Variant::Stable, Some(true), 2_000)
        .unwrap();
    fleet[1]
        .rate("m", "rel", "old", Variant::Stable, Some(true), 10)
        .unwrap();
    let r = fleet[0].ratings("m", "rel", 1_000).unwrap();
    assert_eq!(r.candidate, (0, 1));
    assert_eq!(r.stable, (1, 1));
    fleet[0]
        .rate("m", "rel", "a1", Variant::Candidate, None, 2_000)
        .unwrap();
    assert_eq!(fleet[0].ratings("m", "rel", 0).unwrap().candidate, (0, 0));
}

#[test]
fn heartbeats_list_the_replicas() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let fleet = replicas(&pg);
    for (i, s) in fleet.iter().enumerate() {
        s.heartbeat(&Beat {
            ready: i != 2,
            serving: vec!["m@1.0.0".into()],
            in_flight: i as u64,
            build: "0.1.0".into(),
            ..Beat::default()
        })
        .unwrap();
    }
    let seen = fleet[0].replicas().unwrap();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|r| r.last_seen_ms < 5_000));
    let r3 = seen.iter().find(|r| r.replica == "r3").unwrap();
    assert!(!r3.beat.ready);
    assert_eq!(r3.beat.in_flight, 2);
}

#[test]
fn a_bad_address_is_a_clear_error() {
    let e = FleetStore::connect(
        "postgresql://x@127.0.0.1:1/db",
        "r1",
        Duration::from_secs(5),
    )
    .unwrap_err();
    assert!(e.to_string().contains("PostgreSQL"), "{e}");
    let e = FleetStore::connect("not a url", "r1", Duration::from_secs(5)).unwrap_err();
    assert!(matches!(e, FleetError::Url(_)), "{e}");
    assert_eq!(
        shown_url("postgresql://ops:secret@db:5432/rampart"),
        "postgresql://ops@db:5432/rampart"
    );
}

/// Dropped on an async runtime's thread (a server's shutdown), the store closes its
/// connections without panicking (the blocking client's own drop would).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_dropped_on_an_async_runtime_closes_cleanly() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let url = pg.url();
    let store = tokio::task::spawn_blocking(move || {
        let store = FleetStore::connect(&url, "r1", Duration::from_secs(5)).unwrap();
        assert!(store.hold_judge().unwrap());
        store
    })
    .await
    .unwrap();
    drop(store);
}

#[test]
fn a_claim_is_won_once_per_cool_down_whoever_asks() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let fleet = replicas(&pg);
    let won: Vec<bool> = fleet
        .iter()
        .map(|s| s.claim("retrain", "m", 60_000).unwrap())
        .collect();
    assert_eq!(won, [true, false, false]);
    assert!(fleet[1].claim("retrain", "other", 60_000).unwrap());
    // Past the cool-down (0 here), the next one wins again.
    assert!(fleet[2].claim("retrain", "m", 0).unwrap());
    assert!(!fleet[0].claim("retrain", "m", 60_000).unwrap());
}

#[test]
fn fleet_faults_are_seen_by_every_replica_until_cleared() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let fleet = replicas(&pg);
    let a = fleet[0]
        .add_fault(r#"{"backend":"m","mode":"fail"}"#, "ops", 60_000)
        .unwrap();
    let b = fleet[1]
        .add_fault(r#"{"backend":"n","mode":"fail"}"#, "ops", 60_000)
        .unwrap();
    fleet[1]
        .add_fault(r#"{"backend":"old","mode":"fail"}"#, "ops", 0)
        .unwrap();
    let seen: Vec<i64> = fleet[2]
        .active_faults()
        .unwrap()
        .iter()
        .map(|f| f.id)
        .collect();
    assert_eq!(seen, [a, b]);
    assert_eq!(fleet[2].clear_faults(&[a]).unwrap(), 1);
    assert_eq!(fleet[2].clear_faults(&[a]).unwrap(), 0);
    let seen: Vec<i64> = fleet[0]
        .active_faults()
        .unwrap()
        .iter()
        .map(|f| f.id)
        .collect();
    assert_eq!(seen, [b]);
}

#[test]
fn a_handoff_is_one_row_per_model_with_its_latest_change() {
    let Some(pg) = testkit::postgres::Postgres::start() else {
        return;
    };
    let fleet = replicas(&pg);
    assert!(fleet[0].handoffs().unwrap().is_empty());
    let first = fleet[0]
        .set_handoff("m", true, "12 fallbacks in 60 s", Some(300_000))
        .unwrap();
    let second = fleet[1]
        .set_handoff("m", false, "resumed by ops", None)
        .unwrap();
    assert!(second > first);
    let rows = fleet[2].handoffs().unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].active, rows[0].replica.as_str()), (false, "r2"));
    assert_eq!(rows[0].until_ms, None);
}
