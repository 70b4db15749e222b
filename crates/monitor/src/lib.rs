//! Rampart's monitors: features of each request (`features`), baselines (`baseline`), the drift
//! detector (`drift`: KS and chi-squared with Bonferroni, or a bootstrap-calibrated run length),
//! and the output monitors (`output`: the sliding mean and spread of the requests' mean entropy,
//! or a classifier's confidence). Pure logic: the server feeds them from its record sink.

pub mod baseline;
pub mod drift;
pub mod features;
pub mod output;
pub mod stats;

pub use baseline::{Baseline, BaselineBuilder, BaselineError};
pub use drift::{
    calibrate, Alarm, Calibration, DriftConfig, DriftConfigError, DriftMonitor, DriftView, Mode,
};
pub use features::{Observation, Value};
pub use output::{OutputConfig, OutputMonitor, OutputView};
