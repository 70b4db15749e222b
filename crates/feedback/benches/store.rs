//! The feedback store's write and export paths, on the embedded SQLite file and on PostgreSQL:
//!
//! - **index**: answers indexed as the record bus's sink does (batches of 256, each one
//!   transaction), answers/s;
//! - **submit**: feedback submitted one at a time, as `POST /v1/feedback` does (a lookup by
//!   response id, then the upsert), submissions/s, and the p50/p99 of one;
//! - **export**: 100,000 feedback rows (each with its ~1 KB conversation) to chat JSONL and to
//!   Parquet, seconds.
//!
//! `cargo bench -p rampart-feedback --bench store` (PostgreSQL too when it is installed: the
//! bench starts its own; `RAMPART_BENCH_ROWS` changes the 100,000). Numbers: docs/perf.md.

use std::time::Instant;

use feedback::export::{self, Format, Options};
use feedback::store::{Filter, Response, Store};
use feedback::{Rater, Submission, Target};
use serde_json::json;

fn response(i: usize) -> Response {
    let classes = ["logistics", "refunds", "customs"];
    let class = classes[i % 3];
    Response {
        audit_id: format!("00000000-0000-4000-8000-{i:012}"),
        request_id: format!("req-{i}"),
        response_id: Some(format!("chatcmpl-{i:024}")),
        time_ms: 1_700_000_000_000 + i as u64,
        principal: "app".into(),
        user: Some(format!("user-{}", i % 1000)),
        model: "tickets".into(),
        version: "1.0.0".into(),
        endpoint: "chat.completions".into(),
        classes: vec![Some(class.into())],
        confidences: vec![None],
        input_sha256: format!("{i:064}"),
        output_sha256: format!("{:064}", i + 1),
        input: Some(json!({"messages": [
            {"role": "system", "content": "Route the support ticket. Answer in JSON with its category."},
            {"role": "user", "content": format!("Ticket {i}: {}", "My parcel is stuck at the border and nobody answers my mails. ".repeat(14))}
        ]})),
        output: Some(json!({"choices": [format!("{{\"category\": \"{class}\"}}")]})),
    }
}

fn percentile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn run(store: &Store, rows: usize) {
    println!("== {} ({})", store.kind(), store.location());
    // Index.
    let started = Instant::now();
    let mut batch = Vec::with_capacity(256);
    for i in 0..rows {
        batch.push(response(i));
        if batch.len() == 256 {
            store.index(&batch).unwrap();
            batch.clear();
        }
    }
    store.index(&batch).unwrap();
    let s = started.elapsed().as_secs_f64();
    println!(
        "index: {rows} answers in {s:.2} s = {:.0} answers/s (batches of 256)",
        rows as f64 / s
    );
    // Submit, one at a time.
    let submits = rows.min(20_000);
    let mut times = Vec::with_capacity(submits);
    let started = Instant::now();
    for i in 0..submits {
        let t = Instant::now();
        let found = store
            .find(&Target::Response(format!("chatcmpl-{i:024}")))
            .unwrap()
            .expect("indexed");
        let body = if i % 3 == 0 {
            json!({"rating": "not_helpful", "label": "customs", "correction": "{\"category\": \"customs\"}"})
        } else {
            json!({"rating": "helpful"})
        };
        let s = Submission::parse(&body, true).unwrap();
        store
            .submit(
                &found,
                &s,
                &Rater::key("agent", "ops"),
                1_800_000_000_000 + i as u64,
            )
            .unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let s = started.elapsed().as_secs_f64();
    println!(
        "submit: {submits} in {s:.2} s = {:.0} submissions/s (lookup + upsert), p50 {:.3} ms, p99 {:.3} ms",
        submits as f64 / s,
        percentile(&mut times, 0.5),
        percentile(&mut times, 0.99)
    );
    // The rest of the rows get feedback in bulk (the export needs `rows` rows).
    for chunk in (submits..rows).collect::<Vec<_>>().chunks(5000) {
        for &i in chunk {
            let r = response(i);
            let s = Submission::parse(&json!({"rating": "not_helpful", "label": "refunds", "correction": "{\"category\": \"refunds\"}"}), true).unwrap();
            store
                .submit(
                    &r,
                    &s,
                    &Rater::key("agent", "ops"),
                    1_800_000_000_000 + i as u64,
                )
                .unwrap();
        }
    }
    for format in [Format::OpenAiChatJsonl, Format::Parquet] {
        let options = Options {
            filter: Filter {
                model: Some("tickets".into()),
                ..Filter::default()
            },
            format,
            scrub_pii: false,
            include_helpful: true,
        };
        let started = Instant::now();
        let (bytes, summary) = export::export(store, &options).unwrap();
        println!(
            "export {}: {} rows of {} read, {:.1} MB, in {:.2} s",
            format.as_str(),
            summary.rows,
            summary.read,
            bytes.len() as f64 / 1e6,
            started.elapsed().as_secs_f64()
        );
    }
}

fn main() {
    let rows: usize = std::env::var("RAMPART_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("feedback.db")).unwrap();
    run(&store, rows);
    drop(store);
    if let Some(pg) = testkit::postgres::Postgres::start() {
        let store = Store::connect(&pg.url()).unwrap();
        run(&store, rows);
    }
}
