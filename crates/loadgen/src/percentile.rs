//! Percentiles as `numpy.percentile` computes them by default (linear interpolation between the
//! two nearest ranks), so numbers compare with vLLM's `benchmark_serving.py`.

use serde::Serialize;

/// The `p`-th percentile (0–100) of ascending `sorted` values; `None` when there are none.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let rank = (p.clamp(0.0, 100.0) / 100.0) * last as f64;
    let below = rank.floor() as usize;
    let above = rank.ceil() as usize;
    let fraction = rank - below as f64;
    Some(sorted[below] + (sorted[above] - sorted[below]) * fraction)
}

/// Mean and percentiles of one measurement (in whatever unit the values have).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Summary {
    pub mean: f64,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Summary {
    /// `None` when there are no values (a level where every request failed has no latencies).
    pub fn of(values: &[f64]) -> Option<Summary> {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let at = |p| percentile(&sorted, p).expect("non-empty values have percentiles");
        Some(Summary {
            mean: sorted.iter().sum::<f64>() / sorted.len() as f64,
            p50: at(50.0),
            p90: at(90.0),
            p99: at(99.0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn matches_numpy_linear_interpolation() {
        let one_to_hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        // numpy.percentile(range(1, 101), [0, 50, 90, 99, 100]) = [1, 50.5, 90.1, 99.01, 100]
        assert!(close(percentile(&one_to_hundred, 0.0).unwrap(), 1.0));
        assert!(close(percentile(&one_to_hundred, 50.0).unwrap(), 50.5));
        assert!(close(percentile(&one_to_hundred, 90.0).unwrap(), 90.1));
        assert!(close(percentile(&one_to_hundred, 99.0).unwrap(), 99.01));
        assert!(close(percentile(&one_to_hundred, 100.0).unwrap(), 100.0));
        assert!(close(percentile(&[1.0, 2.0, 3.0, 4.0], 50.0).unwrap(), 2.5));
        // numpy.percentile([10, 20, 30], 25) = 15
        assert!(close(percentile(&[10.0, 20.0, 30.0], 25.0).unwrap(), 15.0));
    }

    #[test]
    fn edge_cases() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7.0], 99.0), Some(7.0));
        assert_eq!(Summary::of(&[]), None);
        assert_eq!(Summary::of(&[f64::NAN]), None);
    }

    #[test]
    fn summary_sorts_its_input() {
        let summary = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert!(close(summary.mean, 2.5));
        assert!(close(summary.p50, 2.5));
        assert!(close(summary.p90, 3.7));
        assert!(close(summary.p99, 3.97));
    }

    #[test]
    fn percentiles_are_monotone_and_bounded_on_random_data() {
        let mut rng = crate::workload::SplitMix64::new(11);
        for len in 1..60 {
            let values: Vec<f64> = (0..len).map(|_| rng.below(1000) as f64 / 7.0).collect();
            let summary = Summary::of(&values).unwrap();
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            assert!(min <= summary.p50 && summary.p50 <= summary.p90);
            assert!(summary.p90 <= summary.p99 && summary.p99 <= max);
            assert!(min <= summary.mean && summary.mean <= max);
        }
    }
}
