//! Cost of one host telemetry reading (what a metrics scrape pays): on this machine (`/`,
//! NVML when it loads) and on the v2 fixture with two GPUs. The goal is under 1 ms.
//! `cargo bench -p rampart-host --bench telemetry`; RAMPART_TELEMETRY_RUNS sets the runs (2000).

use std::path::Path;
use std::time::{Duration, Instant};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn measure(name: &str, runs: usize, t: &host::Telemetry) {
    std::hint::black_box(t.sample());
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(t.sample());
            start.elapsed()
        })
        .collect();
    times.sort();
    println!(
        "{name:<16} gpus {}  runs {runs:>5}  p50 {:>7.1} µs  p99 {:>7.1} µs  max {:>7.1} µs",
        t.gpus().len(),
        percentile(&times, 0.50).as_secs_f64() * 1e6,
        percentile(&times, 0.99).as_secs_f64() * 1e6,
        times[times.len() - 1].as_secs_f64() * 1e6,
    );
}

fn main() {
    let runs = std::env::var("RAMPART_TELEMETRY_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let real = host::Telemetry::open(Path::new("/"));
    if let Some(why) = real.gpu_absent() {
        println!("this host: no GPU readings ({why})");
    }
    measure("this host", runs, &real);
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/telemetry-v2");
    measure("fixture v2", runs, &host::Telemetry::open(&fixture));
}
