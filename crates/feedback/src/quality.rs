//! Per-class quality over a window: error rates with their Wilson bounds, held back below a
//! minimum sample size, and the calibration table (helpful rate and accuracy per confidence
//! bucket).

use serde::Serialize;

use crate::class::wilson;
use crate::store::{ClassStat, Filter, Store};
use crate::FeedbackError;

/// z of the two-sided 95 % interval.
pub const Z95: f64 = 1.959_963_984_540_054;

/// One (model, version, class) row of the quality table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClassQuality {
    pub model: String,
    pub version: String,
    /// `none` when the responses had no class.
    pub class: String,
    pub feedback: u64,
    pub errors: u64,
    pub error_rate: f64,
    /// The Wilson 95 % interval of the error rate.
    pub error_rate_lower: f64,
    pub error_rate_upper: f64,
    /// Ratings that said helpful or not, and the share that said helpful.
    pub rated: u64,
    pub helpful_rate: Option<f64>,
    /// Whether there is enough feedback (`min_samples`) for the rate to be judged.
    pub enough: bool,
}

/// The class label of a stat (`none` for responses without a class).
pub fn class_label(class: &str) -> &str {
    if class.is_empty() {
        "none"
    } else {
        class
    }
}

pub fn table(stats: &[ClassStat], min_samples: u64) -> Vec<ClassQuality> {
    stats
        .iter()
        .map(|s| {
            let (lo, hi) = wilson(s.errors, s.n, Z95);
            ClassQuality {
                model: s.model.clone(),
                version: s.version.clone(),
                class: class_label(&s.class).to_string(),
                feedback: s.n,
                errors: s.errors,
                error_rate: if s.n == 0 {
                    0.0
                } else {
                    s.errors as f64 / s.n as f64
                },
                error_rate_lower: lo,
                error_rate_upper: hi,
                rated: s.rated,
                helpful_rate: (s.rated > 0).then(|| s.helpful as f64 / s.rated as f64),
                enough: s.n >= min_samples,
            }
        })
        .collect()
}

/// The quality table of a window.
pub fn classes(
    store: &Store,
    filter: &Filter,
    min_samples: u64,
) -> Result<Vec<ClassQuality>, FeedbackError> {
    Ok(table(&store.class_stats(filter)?, min_samples))
}

/// One confidence bucket of the calibration table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Bucket {
    /// [low, high) of the confidence (the last bucket includes 1).
    pub low: f64,
    pub high: f64,
    /// Feedback rows whose response had a confidence here.
    pub feedback: u64,
    pub mean_confidence: Option<f64>,
    pub rated: u64,
    /// The share of ratings that said helpful.
    pub helpful_rate: Option<f64>,
    /// Rows with a label, and the share whose label was the class given.
    pub labelled: u64,
    pub accuracy: Option<f64>,
}

/// Helpful rate and accuracy per confidence bucket (`buckets` equal widths over 0–1).
pub fn calibration(rows: &[crate::store::Judged], buckets: usize) -> Vec<Bucket> {
    let buckets = buckets.clamp(1, 100);
    let width = 1.0 / buckets as f64;
    let mut out: Vec<Bucket> = (0..buckets)
        .map(|i| Bucket {
            low: i as f64 * width,
            high: (i + 1) as f64 * width,
            feedback: 0,
            mean_confidence: None,
            rated: 0,
            helpful_rate: None,
            labelled: 0,
            accuracy: None,
        })
        .collect();
    let mut sums = vec![(0.0f64, 0u64, 0u64); buckets];
    for &(c, helpful, correct) in rows {
        let c = f64::from(c).clamp(0.0, 1.0);
        let i = ((c / width) as usize).min(buckets - 1);
        out[i].feedback += 1;
        sums[i].0 += c;
        if let Some(h) = helpful {
            out[i].rated += 1;
            sums[i].1 += u64::from(h);
        }
        if let Some(ok) = correct {
            out[i].labelled += 1;
            sums[i].2 += u64::from(ok);
        }
    }
    for (b, (conf, helpful, correct)) in out.iter_mut().zip(sums) {
        if b.feedback > 0 {
            b.mean_confidence = Some(conf / b.feedback as f64);
        }
        if b.rated > 0 {
            b.helpful_rate = Some(helpful as f64 / b.rated as f64);
        }
        if b.labelled > 0 {
            b.accuracy = Some(correct as f64 / b.labelled as f64);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_bounds_each_class_and_holds_back_small_samples() {
        let stats = [
            ClassStat {
                model: "m".into(),
                version: "1".into(),
                class: "customs".into(),
                n: 100,
                errors: 10,
                rated: 80,
                helpful: 60,
            },
            ClassStat {
                model: "m".into(),
                version: "1".into(),
                class: String::new(),
                n: 3,
                errors: 3,
                rated: 0,
                helpful: 0,
            },
        ];
        let t = table(&stats, 20);
        assert!((t[0].error_rate - 0.1).abs() < 1e-12);
        assert!(t[0].error_rate_lower > 0.05 && t[0].enough);
        assert_eq!(t[0].helpful_rate, Some(0.75));
        assert_eq!(t[1].class, "none");
        assert!(!t[1].enough && t[1].helpful_rate.is_none());
    }

    #[test]
    fn calibration_buckets_by_confidence() {
        let rows = [
            (0.95, Some(true), Some(true)),
            (0.91, Some(false), Some(true)),
            (1.0, None, Some(false)),
            (0.05, Some(false), None),
        ];
        let b = calibration(&rows, 10);
        assert_eq!(b.len(), 10);
        assert_eq!(b[9].feedback, 3);
        assert_eq!(b[9].helpful_rate, Some(0.5));
        assert!((b[9].accuracy.unwrap() - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(b[0].feedback, 1);
        assert_eq!(b[5].mean_confidence, None);
    }
}
