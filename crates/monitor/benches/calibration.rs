//! How well the calibrated mode keeps its promise: for several synthetic baselines (four
//! correlated image-like features, no categorical one), calibrate the threshold for a run length,
//! run the detector on stationary observations of the same distribution, and count the false
//! alarms. One baseline's run length varies with its own sampling error; the run length pooled
//! over the baselines (observations / alarms) is what the calibration targets.
//!
//!   cargo bench -p rampart-monitor --bench calibration
//!   RUN_LENGTH=500 BASELINES=8 FACTOR=100 cargo bench -p rampart-monitor --bench calibration

use std::time::Instant;

use monitor::stats::SplitMix;
use monitor::{calibrate, DriftConfig, DriftMonitor, Mode, Observation};

fn observation(rng: &mut SplitMix) -> Observation {
    let latent = rng.normal();
    let mut o = Observation::default();
    o.num("image.brightness", 120.0 + 30.0 * latent);
    o.num("image.mean_r", 118.0 + 28.0 * latent + 8.0 * rng.normal());
    o.num("image.mean_g", 121.0 + 29.0 * latent + 8.0 * rng.normal());
    o.num("image.contrast", 40.0 + 10.0 * rng.normal().abs());
    o
}

fn setting(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let run_length = setting("RUN_LENGTH", 1000);
    let baselines = setting("BASELINES", 8);
    let factor = setting("FACTOR", DriftConfig::default().calibration_factor);
    let baseline_rows = setting("BASELINE_ROWS", 2000) as usize;
    let per_baseline = setting("OBSERVATIONS", 100 * run_length);
    let cfg = DriftConfig {
        mode: Mode::Calibrated,
        baseline_requests: baseline_rows,
        run_length,
        calibration_factor: factor,
        ..DriftConfig::default()
    };
    println!(
        "run length {run_length}, {baselines} baselines of {baseline_rows} rows, calibration \
         factor {factor}, {per_baseline} stationary observations each"
    );
    let (mut alarms, mut observed) = (0u64, 0u64);
    let mut calibration_seconds = 0.0;
    for seed in 1..=baselines {
        let mut rng = SplitMix(seed * 7919);
        let mut m = DriftMonitor::capturing(cfg.clone());
        for _ in 0..baseline_rows {
            m.observe(&observation(&mut rng));
        }
        let baseline = m.take_fresh_baseline().expect("the capture froze");
        let started = Instant::now();
        let c = calibrate(&baseline, &cfg, seed);
        calibration_seconds += started.elapsed().as_secs_f64();
        m.set_calibration(c.clone());
        for _ in 0..per_baseline {
            m.observe(&observation(&mut rng));
        }
        println!(
            "baseline {seed}: threshold {:.4} (simulated run length {:.0}); measured run length \
             {:.0} ({} alarms)",
            c.threshold,
            c.estimated_run_length,
            per_baseline as f64 / m.raises().max(1) as f64,
            m.raises()
        );
        alarms += m.raises();
        observed += per_baseline;
    }
    let pooled = observed as f64 / alarms.max(1) as f64;
    println!(
        "pooled run length {pooled:.0} over {alarms} alarms ({:+.1}% against {run_length}; \
         one standard error of the count is {:.1}%); calibration {:.2} s each",
        100.0 * (pooled / run_length as f64 - 1.0),
        100.0 / (alarms.max(1) as f64).sqrt(),
        calibration_seconds / baselines as f64
    );
}
