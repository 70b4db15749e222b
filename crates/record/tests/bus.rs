//! The bus: the sink contract for both kinds of lane, drops counted by reason, receipts, records
//! published from `Drop` on threads outside the runtime, shutdown.

use std::time::Duration;

use record::testing::{check_sink, sample_envelope, CollectingSink, Gate, GatedSink, Written};
use record::{ActionRecord, Bus, BusError, Delivery, DropReason, RecordBuilder, SinkEnd};

const LOSSLESS: Delivery = Delivery::Lossless {
    capacity: 16,
    timeout: Duration::from_secs(5),
    acknowledge: true,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn collecting_sinks_pass_the_contract_on_both_kinds_of_lane() {
    check_sink(|| CollectingSink::new("lossy", Delivery::Lossy { capacity: 32 }).0).await;
    check_sink(|| CollectingSink::new("lossless", LOSSLESS).0).await;
    check_sink(|| CollectingSink::new("audit-like", LOSSLESS).0.with_payload()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_lossy_sink_drops_and_counts_while_the_others_get_everything() {
    let gate = Gate::closed();
    let (stuck, _) = CollectingSink::new("stuck", Delivery::Lossy { capacity: 4 });
    let (fine, got) = CollectingSink::new("fine", Delivery::Lossy { capacity: 20_000 });
    let bus = Bus::start(vec![Box::new(fine), Box::new(GatedSink::new(stuck, &gate))]).unwrap();
    for i in 0..10_000 {
        let _ = bus.publish(sample_envelope(i));
    }
    let report = bus.shutdown(Duration::from_millis(200)).await;
    let (_, stuck_end, stuck) = &report.sinks[1];
    assert_eq!(
        *stuck_end,
        SinkEnd::TimedOut,
        "the stuck sink is stopped at the deadline"
    );
    // Four in the lane, at most one inside the stuck write: the rest dropped and counted.
    assert!(
        (9_995..=9_996).contains(&stuck.dropped(DropReason::LaneFull)),
        "{stuck:?}"
    );
    assert_eq!(report.sinks[0].1, SinkEnd::Drained);
    assert_eq!(got.len(), 10_000);
    assert_eq!(report.sinks[0].2.dropped_total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_lossless_lane_bounds_its_waiters_and_counts_overflow_and_timeouts() {
    let gate = Gate::closed();
    let delivery = Delivery::Lossless {
        capacity: 2,
        timeout: Duration::from_millis(100),
        acknowledge: true,
    };
    let (sink, got) = CollectingSink::new("audit", delivery);
    let bus = Bus::start(vec![Box::new(GatedSink::new(sink, &gate))]).unwrap();
    let mut receipts = vec![bus.publish(sample_envelope(0))];
    // The sink holds the first record at its gate before the rest arrive.
    while gate.reached() == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    for i in 1..10 {
        receipts.push(bus.publish(sample_envelope(i)));
    }
    // One in the stuck write, two in the lane, two waiting for room: five overflowed at once.
    let c = bus.counters().remove(0);
    assert_eq!(c.dropped(DropReason::Overflow), 5, "{c:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let c = bus.counters().remove(0);
    assert_eq!(
        c.dropped(DropReason::Timeout),
        2,
        "the two waiters gave up: {c:?}"
    );
    gate.open();
    let mut ok = 0;
    let mut lost = 0;
    for r in receipts {
        match r.wait().await {
            Ok(()) => ok += 1,
            Err(_) => lost += 1,
        }
    }
    assert_eq!((ok, lost), (3, 7), "receipts tell written from lost");
    assert_eq!(got.len(), 3);
    let report = bus.shutdown(Duration::from_secs(5)).await;
    assert!(report.all_drained());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_dropped_on_other_threads_reach_a_lossless_sink() {
    // 64 records at once fit the lane (32) plus its waiters (32): none may be lost.
    let delivery = Delivery::Lossless {
        capacity: 32,
        timeout: Duration::from_secs(5),
        acknowledge: false,
    };
    let (sink, got) = CollectingSink::new("audit", delivery);
    let bus = Bus::start(vec![Box::new(sink)]).unwrap();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let bus = bus.clone();
            std::thread::spawn(move || {
                for i in 0..8 {
                    // A request whose client went away: the builder is dropped unfinished.
                    let mut b = RecordBuilder::new(
                        bus.clone(),
                        format!("t{t}-{i}"),
                        "p".into(),
                        "chat.completions",
                    );
                    b.record.model = "m".into();
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let report = bus.shutdown(Duration::from_secs(10)).await;
    assert!(report.all_drained(), "{report:?}");
    let records = got.records();
    assert_eq!(records.len(), 64, "{:?}", report.sinks[0].2);
    assert!(records
        .iter()
        .all(|r| r.status == 499 && r.finish_reason.as_deref() == Some("cancelled")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payload_goes_only_to_sinks_that_ask() {
    let (audit, audit_got) = CollectingSink::new("audit", LOSSLESS);
    let (log, log_got) = CollectingSink::new("log", Delivery::Lossy { capacity: 8 });
    let bus = Bus::start(vec![Box::new(audit.with_payload()), Box::new(log)]).unwrap();
    assert!(bus.wants_payload());
    let mut b = RecordBuilder::new(bus.clone(), "r".into(), "p".into(), "completions");
    b.payload_input(|| serde_json::json!({"prompt": "secret"}));
    b.record.finish_reason = Some("stop".into());
    b.finish().wait().await.unwrap();
    bus.shutdown(Duration::from_secs(5)).await;
    let audit = audit_got.envelopes();
    assert_eq!(
        audit[0].payload.as_ref().unwrap().input,
        Some(serde_json::json!({"prompt": "secret"}))
    );
    assert!(log_got.envelopes()[0].payload.is_none());
    assert_eq!(audit[0].record, log_got.records()[0]);
}

#[tokio::test]
async fn builders_publish_once_and_buses_refuse_bad_setups() {
    let (sink, got) = CollectingSink::new("s", Delivery::Lossy { capacity: 8 });
    let bus = Bus::start(vec![Box::new(sink)]).unwrap();
    let mut b = RecordBuilder::new(bus.clone(), "r".into(), "p".into(), "embeddings");
    b.fail(429, "rate_limit_error", Some("queue_full"));
    b.refuse("queue_full");
    let _ = b.finish();
    let _ = b.finish();
    drop(b);
    bus.shutdown(Duration::from_secs(5)).await;
    let records = got.records();
    assert_eq!(records.len(), 1);
    assert_eq!(records[0].error_code.as_deref(), Some("queue_full"));
    assert_eq!(records[0].refusal, Some("queue_full"));

    let (a, _) = CollectingSink::new("same", Delivery::Lossy { capacity: 1 });
    let (b, _) = CollectingSink::new("same", Delivery::Lossy { capacity: 1 });
    assert!(matches!(
        Bus::start(vec![Box::new(a), Box::new(b)]),
        Err(BusError::DuplicateSink("same"))
    ));
    let nowhere = Bus::disconnected();
    assert!(!nowhere.publish(sample_envelope(1)).is_pending());
}

#[test]
fn a_bus_needs_a_runtime() {
    let (sink, _) = CollectingSink::new("s", Delivery::Lossy { capacity: 1 });
    assert!(matches!(
        Bus::start(vec![Box::new(sink)]),
        Err(BusError::NoRuntime)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caught_up_waits_for_everything_published_before_it() {
    let gate = Gate::closed();
    let (sink, got) = CollectingSink::new("metrics", Delivery::Lossy { capacity: 64 });
    let bus = Bus::start(vec![Box::new(GatedSink::new(sink, &gate))]).unwrap();
    for i in 0..10 {
        let _ = bus.publish(sample_envelope(i));
    }
    assert!(
        !bus.caught_up("metrics", Duration::from_millis(50)).await,
        "the sink is stuck"
    );
    gate.open();
    assert!(bus.caught_up("metrics", Duration::from_secs(5)).await);
    assert_eq!(got.len(), 10, "every record before the call was written");
    assert!(!bus.caught_up("nope", Duration::from_secs(1)).await);
    bus.shutdown(Duration::from_secs(5)).await;
    assert!(!bus.caught_up("metrics", Duration::from_secs(1)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_reach_the_sinks_that_keep_them_in_order_with_the_records() {
    let (log, logged) = CollectingSink::new("log", Delivery::Lossy { capacity: 64 });
    let (audit, audited) = CollectingSink::new("audit", LOSSLESS);
    let (monitors, monitored) = CollectingSink::new("monitors", Delivery::Lossy { capacity: 64 });
    // The audit log takes records in group commits: an action between records keeps its place.
    let bus = Bus::start(vec![
        Box::new(log.with_actions()),
        Box::new(audit.with_actions().with_batches(16)),
        Box::new(monitors),
    ])
    .unwrap();
    let decision = |n: usize| {
        ActionRecord::decision(
            "breaker.open",
            Some("m"),
            &format!("m@{n}"),
            "5 failures in a row",
            serde_json::json!({"n": n}),
        )
    };
    let mut receipts = Vec::new();
    for n in 0..3 {
        let _ = bus.publish(sample_envelope(2 * n));
        receipts.push(bus.publish_action(decision(n)));
        let _ = bus.publish(sample_envelope(2 * n + 1));
    }
    for receipt in receipts {
        assert!(
            receipt.is_pending(),
            "the lossless sink acknowledges actions"
        );
        receipt.wait().await.unwrap();
    }
    bus.shutdown(Duration::from_secs(5)).await;
    let expected: Vec<Written> = (0..3)
        .flat_map(|n| {
            [
                Written::Record(format!("req-{}", 2 * n)),
                Written::Action(Box::new(decision(n))),
                Written::Record(format!("req-{}", 2 * n + 1)),
            ]
        })
        .collect();
    assert_eq!(audited.written(), expected);
    assert_eq!(logged.written(), expected);
    assert!(
        monitored.actions().is_empty(),
        "a sink that does not keep actions gets none"
    );
    assert_eq!(monitored.len(), 6);
}
