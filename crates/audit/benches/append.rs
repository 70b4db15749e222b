//! The audit log's write path, as the server drives it: records published on the bus, the
//! audit sink in `fail_closed` (lossless, acknowledged), each publisher waiting for its
//! receipt (the entry's fsync) before it publishes the next, as a response waits before it is
//! sent. Group commit: every batch the sink takes is one write and one `fdatasync`.
//!
//! Reports entries/s, entries per fsync, the receipt wait (p50/p99) and the largest checkpoint
//! age seen while the upkeep task signs checkpoints every second. Run on one core:
//!
//! `taskset -c 0 cargo bench -p rampart-audit --bench append`
//!
//! `RAMPART_AUDIT_BENCH_DIR` puts the log on another file system (default: a temp dir).

use std::sync::Arc;
use std::time::{Duration, Instant};

use audit::{AuditConfig, AuditLog, AuditSink, Mode, Service};
use record::{Bus, Envelope, InferenceRecord, Payload, Sink};

/// A chat request's envelope with a ~1 KB input and a short output.
fn envelope(i: usize) -> Envelope {
    let mut r = InferenceRecord::new(format!("req-{i}"), "bench-key".into(), "chat.completions");
    r.model = "smollm2-135m".into();
    r.version = "1.0.0".into();
    r.user = Some(format!("user-{}", i % 100));
    r.prompt_tokens = 200;
    r.completion_tokens = 32;
    r.finish_reason = Some("stop".into());
    let prompt = "Summarise the patient's discharge note in plain words. ".repeat(18);
    Envelope {
        record: r,
        token_gaps_s: Vec::new(),
        token_entropies: Vec::new(),
        observations: Vec::new(),
        timeline: None,
        payload: Some(Payload {
            input: Some(serde_json::json!({ "messages": [{ "role": "user", "content": prompt }] })),
            output: Some(
                serde_json::json!({ "choices": ["The patient went home well, with two follow-up visits."] }),
            ),
        }),
    }
}

fn run(publishers: usize, seconds: f64) {
    let dir = match std::env::var_os("RAMPART_AUDIT_BENCH_DIR") {
        Some(d) => tempfile::tempdir_in(d),
        None => tempfile::tempdir(),
    }
    .expect("a temp dir");
    let config = AuditConfig {
        required: true,
        mode: Some(Mode::FailClosed),
        dir: dir.path().to_path_buf(),
        ..Default::default()
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    runtime.block_on(async {
        let log = AuditLog::open(config.log_options()).expect("the log opens");
        let sink: Box<dyn Sink> = Box::new(AuditSink::new(Arc::clone(&log), &config));
        let bus = Bus::start(vec![sink]).expect("a bus");
        let service = Service {
            log: Arc::clone(&log),
            shipper: None,
            interval: Duration::from_millis(config.checkpoint_interval_ms),
        };
        tokio::spawn(service.run(|| (0, 0)));
        let deadline = Instant::now() + Duration::from_secs_f64(seconds);
        let started = Instant::now();
        let worst_age = Arc::new(std::sync::Mutex::new(0f64));
        let watcher = {
            let (log, worst) = (Arc::clone(&log), Arc::clone(&worst_age));
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let age = log.checkpoint_age_s();
                    let mut w = worst.lock().unwrap();
                    *w = w.max(age);
                }
            })
        };
        let tasks: Vec<_> = (0..publishers)
            .map(|p| {
                let bus = Arc::clone(&bus);
                tokio::spawn(async move {
                    let mut waits = Vec::new();
                    let mut i = p;
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        bus.publish(envelope(i)).wait().await.expect("durable");
                        waits.push(t.elapsed().as_secs_f64() * 1e3);
                        i += publishers;
                    }
                    waits
                })
            })
            .collect();
        let mut waits = Vec::new();
        for t in tasks {
            waits.extend(t.await.expect("a publisher"));
        }
        let elapsed = started.elapsed().as_secs_f64();
        let _ = watcher.await;
        waits.sort_by(f64::total_cmp);
        let q = |p: f64| waits[((waits.len() - 1) as f64 * p) as usize];
        let n = waits.len();
        let fsyncs = fsync_count(&log);
        println!(
            "publishers {publishers:>4}: {:>7.0} entries/s  ({n} entries in {elapsed:.1} s, {:.1} entries/fsync), receipt p50 {:.2} ms p99 {:.2} ms, checkpoint age max {:.2} s",
            n as f64 / elapsed,
            n as f64 / fsyncs.max(1) as f64,
            q(0.5),
            q(0.99),
            *worst_age.lock().unwrap(),
        );
        bus.shutdown(Duration::from_secs(5)).await;
    });
}

/// The group commits the log made (one fsync each).
fn fsync_count(log: &AuditLog) -> u64 {
    log.batches()
}

fn main() {
    let seconds = std::env::var("RAMPART_AUDIT_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    for publishers in [1, 16, 64, 256] {
        run(publishers, seconds);
    }
}
