//! Baselines: what a model version's features looked like on reference traffic. Numeric
//! features keep their rows (so a calibration can resample whole requests and keep the features'
//! correlations), categorical ones their counts. Bounded: at most [`MAX_ROWS`] rows, kept by
//! reservoir sampling.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::features::{Observation, Value};
use crate::stats::{bin_shares, decile_edges, mean_std, psi_of_shares, SplitMix};

/// Rows a baseline keeps at most.
pub const MAX_ROWS: usize = 5000;

/// A model version's baseline.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// Where it came from: `reference set <path>`, `first <n> requests`, `admin`, `release`.
    pub source: String,
    /// Milliseconds since the Unix epoch when it was frozen.
    pub created_ms: u64,
    /// Observations seen while capturing (rows holds a uniform sample of them).
    pub observations: u64,
    /// The numeric features, in the order of each row's values.
    pub columns: Vec<String>,
    /// One row per sampled observation; `None` where it lacked the feature.
    pub rows: Vec<Vec<Option<f64>>>,
    /// Categorical features: category → count.
    pub categorical: BTreeMap<String, BTreeMap<String, u64>>,
    /// The calibrated mode's threshold, once calibrated (the calibration is kept with the
    /// baseline so a restart does not redo it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<crate::drift::Calibration>,
}

/// One numeric feature's reference sample, sorted, with its mean and standard deviation.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub sorted: Vec<f64>,
    pub mean: f64,
    pub std: f64,
    /// The deciles' edges and the baseline's share in each bin (for the PSI).
    edges: Vec<f64>,
    shares: Vec<f64>,
}

impl Reference {
    fn new(sorted: Vec<f64>) -> Self {
        let (mean, std) = mean_std(&sorted);
        let edges = decile_edges(&sorted);
        let shares = bin_shares(&edges, &sorted);
        Self {
            sorted,
            mean,
            std,
            edges,
            shares,
        }
    }

    /// The population stability index of a window on this reference's deciles.
    pub fn psi(&self, window: &[f64]) -> f64 {
        if self.sorted.is_empty() || window.is_empty() {
            return 0.0;
        }
        psi_of_shares(&self.shares, &bin_shares(&self.edges, window))
    }
}

/// Why a baseline read from a file or the admin API cannot be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BaselineError {
    #[error("a row has {values} values for {columns} columns")]
    RowWidth { values: usize, columns: usize },
    #[error("{rows} rows, more than the {max} a baseline keeps", max = MAX_ROWS)]
    TooManyRows { rows: usize },
    #[error("a value is not a finite number")]
    NotFinite,
}

impl Baseline {
    /// The sorted reference sample of each numeric column.
    pub fn references(&self) -> Vec<Reference> {
        (0..self.columns.len())
            .map(|c| {
                let mut sorted: Vec<f64> = self.rows.iter().filter_map(|r| r[c]).collect();
                sorted.sort_by(f64::total_cmp);
                Reference::new(sorted)
            })
            .collect()
    }

    /// Checks a baseline read from a file or the admin API.
    pub fn validate(&self) -> Result<(), BaselineError> {
        if let Some(r) = self.rows.iter().find(|r| r.len() != self.columns.len()) {
            return Err(BaselineError::RowWidth {
                values: r.len(),
                columns: self.columns.len(),
            });
        }
        if self.rows.len() > MAX_ROWS {
            return Err(BaselineError::TooManyRows {
                rows: self.rows.len(),
            });
        }
        if self.rows.iter().flatten().flatten().any(|v| !v.is_finite()) {
            return Err(BaselineError::NotFinite);
        }
        Ok(())
    }

    /// Numeric features with fewer than `min` values in the baseline.
    pub fn thin_columns(&self, min: usize) -> Vec<&str> {
        (0..self.columns.len())
            .filter(|&c| self.rows.iter().filter(|r| r[c].is_some()).count() < min)
            .map(|c| self.columns[c].as_str())
            .collect()
    }
}

/// Collects observations into a baseline.
#[derive(Debug, Clone)]
pub struct BaselineBuilder {
    columns: Vec<String>,
    rows: Vec<Vec<Option<f64>>>,
    categorical: BTreeMap<String, BTreeMap<String, u64>>,
    seen: u64,
    rng: SplitMix,
}

impl Default for BaselineBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl BaselineBuilder {
    pub fn new() -> Self {
        Self {
            columns: Vec::new(),
            rows: Vec::new(),
            categorical: BTreeMap::new(),
            seen: 0,
            rng: SplitMix(0x5EED),
        }
    }

    pub fn observations(&self) -> u64 {
        self.seen
    }

    pub fn add(&mut self, o: &Observation) {
        self.seen += 1;
        let mut row = vec![None; self.columns.len()];
        for (name, v) in &o.values {
            match v {
                Value::Num(x) => {
                    let c = match self.columns.iter().position(|c| c == name) {
                        Some(c) => c,
                        None => {
                            self.columns.push(name.to_string());
                            for r in &mut self.rows {
                                r.push(None);
                            }
                            row.push(None);
                            self.columns.len() - 1
                        }
                    };
                    row[c] = Some(*x);
                }
                Value::Cat(s) => {
                    *self
                        .categorical
                        .entry(name.to_string())
                        .or_default()
                        .entry(s.clone())
                        .or_default() += 1;
                }
            }
        }
        if self.rows.len() < MAX_ROWS {
            self.rows.push(row);
        } else {
            let k = self.rng.below(self.seen as usize);
            if k < MAX_ROWS {
                self.rows[k] = row;
            }
        }
    }

    pub fn finish(self, source: String) -> Baseline {
        Baseline {
            source,
            created_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            observations: self.seen,
            columns: self.columns,
            rows: self.rows,
            categorical: self.categorical,
            calibration: None,
        }
    }
}
