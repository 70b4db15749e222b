//! The guard's rules tier (every view, the seed rules) per text, over the labelled sets in
//! examples/guard (566 texts, 9 languages): p50, p99 and max of `Guard::check`.
//!
//! `cargo bench -p rampart-guard --bench injection`

use std::time::Instant;

use guard::{Channel, Guard, Input, Policy};

fn main() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/guard/");
    let mut texts: Vec<(Channel, String)> = Vec::new();
    for file in ["dev.jsonl", "test.jsonl"] {
        let body = std::fs::read_to_string(format!("{dir}{file}")).expect("the labelled sets");
        for line in body.lines().filter(|l| !l.trim().is_empty()) {
            let row: serde_json::Value = serde_json::from_str(line).expect("JSON rows");
            let channel = Channel::parse(row["channel"].as_str().unwrap_or("user")).unwrap();
            texts.push((channel, row["text"].as_str().unwrap().to_string()));
        }
    }
    let guard = Guard::seed();
    let policy = Policy::default();
    let none = |_: &str| Vec::new();
    for (c, t) in &texts {
        guard.check(
            &[Input {
                channel: *c,
                text: t,
            }],
            &policy,
            &none,
        );
    }
    let mut ms = Vec::new();
    for _ in 0..5 {
        for (c, t) in &texts {
            let started = Instant::now();
            guard.check(
                &[Input {
                    channel: *c,
                    text: t,
                }],
                &policy,
                &none,
            );
            ms.push(started.elapsed().as_secs_f64() * 1e3);
        }
    }
    ms.sort_by(f64::total_cmp);
    let at = |p: f64| ms[((ms.len() - 1) as f64 * p) as usize];
    println!(
        "rules tier: {} checks of {} texts; p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms",
        ms.len(),
        texts.len(),
        at(0.5),
        at(0.99),
        ms[ms.len() - 1]
    );
}
