//! Wall time of a doctor run (without the GPU load sample) and of the fingerprint on this
//! machine: the 300 ms goal of `rampart doctor`. `cargo bench -p rampart-host`; set
//! RAMPART_DOCTOR_RUNS to change the number of runs (200).

use std::time::{Duration, Instant};

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

fn measure(name: &str, runs: usize, mut f: impl FnMut()) {
    f(); // warm the page cache and NVML's library load
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort();
    println!(
        "{name:<12} runs {runs:>4}  p50 {:>8.2} ms  p99 {:>8.2} ms  max {:>8.2} ms",
        percentile(&times, 0.50).as_secs_f64() * 1000.0,
        percentile(&times, 0.99).as_secs_f64() * 1000.0,
        times[times.len() - 1].as_secs_f64() * 1000.0,
    );
}

fn main() {
    let runs = std::env::var("RAMPART_DOCTOR_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let dir = std::env::temp_dir().join(format!("rampart-doctor-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir is writable");
    let ctx = host::Context {
        repository_dir: Some(dir.clone()),
        audit_dir: Some(dir.clone()),
        threads: Some(1),
        kv_memory_bytes: Some(1 << 30),
        grpc_max_message_bytes: Some(100 << 20),
        ports: vec![host::PortToCheck {
            name: "http".into(),
            addr: "127.0.0.1:0".parse().expect("literal address"),
        }],
        ..host::Context::default()
    };
    let report = host::run(&ctx, None);
    println!(
        "{} checks ({} ok, {} warn, {} error, {} unknown)",
        report.checks.len(),
        report.counts.ok,
        report.counts.warn,
        report.counts.error,
        report.counts.unknown
    );
    measure("run", runs, || {
        std::hint::black_box(host::run(&ctx, None));
    });
    measure("fingerprint", runs, || {
        std::hint::black_box(host::fingerprint(&ctx));
    });
    let _ = std::fs::remove_dir_all(&dir);
}
