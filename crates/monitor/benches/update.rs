//! The cost of one feature update: a drift detector (ks mode, 1,000-observation windows, a test
//! every 100) fed observations of 15 image-like features (14 numeric and a label), the tests'
//! sorting and KS included (amortized), an output monitor's update, and the per-request feature
//! extraction (a decoded 1280×720 image, a 2,000-character prompt, a 64-token generation).
//!
//!   cargo bench -p rampart-monitor --bench update

use std::hint::black_box;
use std::time::Instant;

use monitor::stats::SplitMix;
use monitor::{DriftConfig, DriftMonitor, Observation, OutputConfig, OutputMonitor};

const NUMERIC: [&str; 14] = [
    "image.mean_r",
    "image.mean_g",
    "image.mean_b",
    "image.std_r",
    "image.std_g",
    "image.std_b",
    "image.brightness",
    "image.contrast",
    "image.black_fraction",
    "image.saturated_fraction",
    "image.width",
    "image.height",
    "image.aspect",
    "output.confidence",
];

fn observation(rng: &mut SplitMix) -> Observation {
    let mut o = Observation::default();
    for name in NUMERIC {
        o.num(name, 100.0 + 20.0 * rng.normal());
    }
    o.cat("output.label", ["0", "90", "180", "270"][rng.below(4)]);
    o
}

fn main() {
    let mut rng = SplitMix(1);
    let test_every = std::env::var("RAMPART_MONITOR_BENCH_TEST_EVERY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let cfg = DriftConfig {
        baseline_requests: 5000,
        test_every,
        ..DriftConfig::default()
    };
    let mut m = DriftMonitor::capturing(cfg);
    for _ in 0..5000 {
        m.observe(&observation(&mut rng));
    }
    let stream: Vec<Observation> = (0..20_000).map(|_| observation(&mut rng)).collect();
    for o in &stream[..2000] {
        m.observe(o);
    }
    let started = Instant::now();
    for o in &stream {
        black_box(m.observe(o));
    }
    let per_obs = started.elapsed().as_secs_f64() / stream.len() as f64;
    let features = NUMERIC.len() + 1;
    println!(
        "drift (ks, window 1000, test every {test_every}, {features} features): {:.2} us per observation, {:.0} ns per feature update (tests amortized)",
        per_obs * 1e6,
        per_obs * 1e9 / features as f64
    );
    let mut out = OutputMonitor::new(
        "output.entropy_mean",
        OutputConfig::default(),
        Some((1.5, 0.4)),
        0,
    );
    let values: Vec<f64> = (0..1_000_000).map(|_| 1.5 + 0.4 * rng.normal()).collect();
    let started = Instant::now();
    for v in &values {
        black_box(out.observe(*v));
    }
    println!(
        "output monitor (window 100, test every 10): {:.0} ns per update",
        started.elapsed().as_secs_f64() * 1e9 / values.len() as f64
    );
    // What a request pays before the lane: extracting its features.
    let (w, h) = (1280, 720);
    let pixels: Vec<u8> = (0..w * h * 3)
        .map(|_| (rng.next_u64() >> 56) as u8)
        .collect();
    let rounds = 2000;
    let started = Instant::now();
    for _ in 0..rounds {
        black_box(monitor::features::image(black_box(&pixels), w, h, (w, h)));
    }
    println!(
        "image features ({w}x{h}, sampled grid): {:.1} us per image",
        started.elapsed().as_secs_f64() * 1e6 / rounds as f64
    );
    // A classifier's input tensor, [1, 3, 224, 224] f32: every value is read.
    let tensor: Vec<f32> = (0..3 * 224 * 224)
        .map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 - 0.5)
        .collect();
    let started = Instant::now();
    for _ in 0..rounds {
        black_box(monitor::features::tensor(
            "input",
            black_box(&tensor),
            f64::from,
        ));
    }
    println!(
        "tensor features ([1, 3, 224, 224] f32, every value): {:.1} us per tensor",
        started.elapsed().as_secs_f64() * 1e6 / rounds as f64
    );
    let prompt: String = "Please summarise the attached quarterly report, région par région. "
        .repeat(30)
        .chars()
        .take(2000)
        .collect();
    let specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"];
    let entropies: Vec<f32> = (0..64).map(|i| 0.5 + (i % 7) as f32 * 0.3).collect();
    let started = Instant::now();
    for _ in 0..rounds {
        black_box(monitor::features::text(black_box(&prompt), 500, &specials));
        black_box(monitor::features::generation(black_box(&entropies), 64));
    }
    println!(
        "text features (2,000 characters) and generation features (64 tokens): {:.1} us per request",
        started.elapsed().as_secs_f64() * 1e6 / rounds as f64
    );
}
