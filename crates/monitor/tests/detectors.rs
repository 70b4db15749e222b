//! The detectors on synthetic streams with known truth: stationary streams raise (almost) no
//! alarm, shifts are caught within the window, the calibrated mode's run length between false
//! alarms is the one configured, and the output monitor sees an entropy collapse.

use monitor::stats::SplitMix;
use monitor::{
    calibrate, DriftConfig, DriftMonitor, Mode, Observation, OutputConfig, OutputMonitor,
};

/// Image-like features: four correlated channels from one latent brightness, plus a label.
fn observation(rng: &mut SplitMix, shift: f64, label_skew: bool) -> Observation {
    let latent = rng.normal();
    let mut o = Observation::default();
    o.num("image.brightness", 120.0 + 30.0 * latent + shift * 30.0);
    o.num("image.mean_r", 118.0 + 28.0 * latent + 8.0 * rng.normal());
    o.num("image.mean_g", 121.0 + 29.0 * latent + 8.0 * rng.normal());
    o.num("image.contrast", 40.0 + 10.0 * rng.normal().abs());
    let u = rng.unit();
    let label = if label_skew {
        if u < 0.8 {
            "0"
        } else {
            "90"
        }
    } else if u < 0.25 {
        "0"
    } else if u < 0.5 {
        "90"
    } else if u < 0.75 {
        "180"
    } else {
        "270"
    };
    o.cat("output.label", label);
    o
}

fn baseline_monitor(cfg: DriftConfig, rng: &mut SplitMix) -> DriftMonitor {
    let mut m = DriftMonitor::capturing(cfg);
    for _ in 0..m.config().baseline_requests {
        m.observe(&observation(rng, 0.0, false));
    }
    assert!(m.take_fresh_baseline().is_some());
    m
}

#[test]
fn a_stationary_stream_raises_alarms_in_at_most_one_percent_of_tests() {
    let mut rng = SplitMix(1);
    let cfg = DriftConfig {
        baseline_requests: 5000,
        ..DriftConfig::default()
    };
    let mut m = baseline_monitor(cfg, &mut rng);
    for _ in 0..20_000 {
        m.observe(&observation(&mut rng, 0.0, false));
    }
    assert!(m.tests() >= 190, "{} tests", m.tests());
    let share = m.alarming_tests() as f64 / m.tests() as f64;
    assert!(share <= 0.01, "false alarms in {share:.3} of tests");
}

#[test]
fn a_two_sigma_brightness_shift_and_a_label_skew_are_caught_within_300_requests() {
    let mut rng = SplitMix(2);
    let cfg = DriftConfig {
        baseline_requests: 5000,
        ..DriftConfig::default()
    };
    let mut m = baseline_monitor(cfg, &mut rng);
    for _ in 0..1500 {
        m.observe(&observation(&mut rng, 0.0, false));
    }
    assert!(!m.active());
    let mut at = None;
    for i in 0..1000 {
        let alarms = m.observe(&observation(&mut rng, -2.0, false));
        if let Some(a) = alarms.iter().find(|a| a.feature == "image.brightness") {
            assert_eq!(a.event, "raised");
            assert!(
                a.statistic > 0.15 && a.p_value < 0.01 && a.effect > 0.3,
                "{a:?}"
            );
            at = Some(i + 1);
            break;
        }
    }
    let at = at.expect("the shift raised no alarm");
    assert!(at <= 300, "caught after {at} requests");
    let mut label_at = None;
    for i in 0..1000 {
        let alarms = m.observe(&observation(&mut rng, -2.0, true));
        if alarms
            .iter()
            .any(|a| a.feature == "output.label" && a.event == "raised")
        {
            label_at = Some(i + 1);
            break;
        }
    }
    assert!(label_at.is_some_and(|n| n <= 300), "{label_at:?}");
}

#[test]
fn the_calibrated_mode_meets_its_run_length_and_catches_shifts_sooner() {
    // The run length is an expectation over baselines (one baseline's own sampling error moves
    // its run length by ±25%): pool the false alarms of six baselines, each calibrated on
    // itself and run on 100,000 stationary observations.
    let cfg = DriftConfig {
        mode: Mode::Calibrated,
        baseline_requests: 2000,
        run_length: 1_000,
        // A faster calibration than the default's (its threshold is noisier).
        calibration_factor: 100,
        ..DriftConfig::default()
    };
    let n = 100_000u64;
    let (mut alarms, mut observed) = (0u64, 0u64);
    let mut last = None;
    for seed in 1..=6u64 {
        let mut rng = SplitMix(seed * 7919);
        let mut m = baseline_monitor(cfg.clone(), &mut rng);
        assert!(m.needs_calibration());
        let c = calibrate(m.baseline().unwrap(), &cfg, seed);
        assert!(c.simulated_alarms >= 40, "{c:?}");
        assert!(c.threshold > 0.0 && c.threshold < 1.0);
        m.set_calibration(c.clone());
        assert!(!m.needs_calibration());
        for _ in 0..n {
            m.observe(&observation(&mut rng, 0.0, false));
        }
        eprintln!(
            "calibrated: threshold {:.4}, simulated run length {:.0}, measured {:.0} ({} alarms)",
            c.threshold,
            c.estimated_run_length,
            n as f64 / m.raises().max(1) as f64,
            m.raises()
        );
        alarms += m.raises();
        observed += n;
        last = Some((m, rng));
    }
    // The categorical feature keeps its own chi-squared rule (p < 0.01 / F per test), which
    // adds a few alarms to the calibrated numeric ones.
    let measured = observed as f64 / alarms.max(1) as f64;
    assert!(
        (measured / cfg.run_length as f64 - 1.0).abs() <= 0.2,
        "measured run length {measured:.0} over {alarms} alarms against {}",
        cfg.run_length
    );
    let (mut m, mut rng) = last.expect("six baselines");
    // A shift of one standard deviation in brightness is caught within one calibrated window.
    while m.active() {
        m.observe(&observation(&mut rng, 0.0, false));
    }
    let mut at = None;
    for i in 0..1000 {
        if m.observe(&observation(&mut rng, -1.0, false))
            .iter()
            .any(|a| a.event == "raised" && a.feature == "image.brightness")
        {
            at = Some(i + 1);
            break;
        }
    }
    assert!(at.is_some_and(|n| n <= 200), "{at:?}");
}

#[test]
fn the_output_monitor_sees_an_entropy_collapse_within_100_requests_and_no_alarm_before() {
    let mut rng = SplitMix(4);
    let mut m = OutputMonitor::new("output.entropy_mean", OutputConfig::default(), None, 500);
    let entropy = |rng: &mut SplitMix| (1.6 + 0.4 * rng.normal()).max(0.0);
    for _ in 0..10_000 {
        assert!(m.observe(entropy(&mut rng)).is_none(), "a false alarm");
    }
    let mut at = None;
    for i in 0..200 {
        if let Some(a) = m.observe(0.01 * rng.unit()) {
            assert_eq!((a.event, a.kind), ("raised", "collapse"));
            at = Some(i + 1);
            break;
        }
    }
    assert!(at.is_some_and(|n| n <= 100), "{at:?}");
    // It clears once the model is back.
    let mut cleared = false;
    for _ in 0..300 {
        if let Some(a) = m.observe(entropy(&mut rng)) {
            cleared |= a.event == "cleared";
        }
    }
    assert!(cleared && !m.active());
}

#[test]
fn memory_is_constant_and_a_replaced_baseline_starts_over() {
    let mut rng = SplitMix(5);
    let cfg = DriftConfig {
        baseline_requests: 200,
        ..DriftConfig::default()
    };
    let mut m = baseline_monitor(cfg, &mut rng);
    for _ in 0..5000 {
        m.observe(&observation(&mut rng, 0.0, false));
    }
    assert_eq!(m.window_len(), 1000);
    let b = m.baseline().unwrap().clone();
    let json = serde_json::to_string(&b).unwrap();
    let back: monitor::Baseline = serde_json::from_str(&json).unwrap();
    assert!(back.columns == b.columns && back.rows.len() == b.rows.len());
    assert_eq!(back.categorical, b.categorical);
    back.validate().unwrap();
    m.set_baseline(back);
    assert_eq!(m.window_len(), 0);
}
