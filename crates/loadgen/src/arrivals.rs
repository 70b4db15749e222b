//! How requests arrive at the server. A closed loop is N clients, each sending its next request
//! when its last one finished: the server's speed sets the arrival rate, so an overloaded server
//! is never sent more than N at once. An open loop sends requests on a schedule whatever is in
//! flight, as independent users do: Poisson arrivals at a mean rate, or bursts of requests at once
//! at a fixed period (over an optional Poisson background).
//!
//! The schedule ([`ArrivalSchedule`]) is a pure, seeded sequence of offsets from the start of a
//! level; the benchmark driver sleeps until each one.

use std::fmt;
use std::time::Duration;

use serde::Serialize;

use crate::error::LoadgenError;
use crate::workload::SplitMix64;

/// The arrival process of one level.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Arrivals {
    /// `concurrency` clients in a closed loop.
    Closed { concurrency: usize },
    /// An open loop with exponentially distributed gaps between arrivals, `rate_per_s` arrivals
    /// per second on average; the first arrives at the start.
    Poisson { rate_per_s: f64 },
    /// An open loop: `size` requests arrive at once at the start and every `every_s` seconds
    /// after it, and besides them Poisson arrivals at `rate_per_s` (0: bursts only).
    Burst {
        size: usize,
        every_s: f64,
        rate_per_s: f64,
    },
}

impl Arrivals {
    /// Open loops send on a schedule; a closed loop sends when a request finishes.
    pub fn is_open_loop(&self) -> bool {
        !matches!(self, Arrivals::Closed { .. })
    }

    pub fn validate(&self) -> Result<(), LoadgenError> {
        let invalid = |name, reason: String| Err(LoadgenError::InvalidSetting { name, reason });
        match *self {
            Arrivals::Closed { concurrency: 0 } => {
                invalid("concurrency", "must be at least 1".to_string())
            }
            Arrivals::Poisson { rate_per_s } if !(rate_per_s.is_finite() && rate_per_s > 0.0) => {
                invalid("rate", format!("{rate_per_s} is not a positive rate"))
            }
            Arrivals::Burst { size: 0, .. } => invalid("burst", "must be at least 1".to_string()),
            Arrivals::Burst { every_s, .. } if !(every_s.is_finite() && every_s > 0.0) => {
                invalid("every", format!("{every_s} is not a positive period"))
            }
            Arrivals::Burst { rate_per_s, .. }
                if !(rate_per_s.is_finite() && rate_per_s >= 0.0) =>
            {
                invalid("rate", format!("{rate_per_s} is not a rate of 0 or more"))
            }
            _ => Ok(()),
        }
    }
}

impl fmt::Display for Arrivals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Arrivals::Closed { concurrency } => write!(f, "concurrency {concurrency}"),
            Arrivals::Poisson { rate_per_s } => write!(f, "poisson {rate_per_s} req/s"),
            Arrivals::Burst {
                size,
                every_s,
                rate_per_s,
            } => {
                write!(f, "bursts of {size} every {every_s} s")?;
                if rate_per_s > 0.0 {
                    write!(f, " over poisson {rate_per_s} req/s")?;
                }
                Ok(())
            }
        }
    }
}

/// A gap of a Poisson process with `rate_per_s`, from `unit_random` uniform in `[0, 1)`
/// (inverse transform: `-ln(1 - u) / rate`, finite since `1 - u > 0`).
pub fn exponential_gap_s(rate_per_s: f64, unit_random: f64) -> f64 {
    -(1.0 - unit_random).ln() / rate_per_s
}

/// The offsets from the start at which an open loop's requests arrive, in order, endless (a
/// closed loop has none). The same arrivals and seed give the same offsets.
#[derive(Debug, Clone)]
pub struct ArrivalSchedule {
    rng: SplitMix64,
    /// Rate and next arrival, in seconds from the start.
    poisson: Option<(f64, f64)>,
    bursts: Option<Bursts>,
}

#[derive(Debug, Clone)]
struct Bursts {
    size: usize,
    every_s: f64,
    /// The burst being sent: it arrives at `index × every_s` (a product, so no drift).
    index: u64,
    left_in_burst: usize,
}

impl ArrivalSchedule {
    pub fn new(arrivals: Arrivals, seed: u64) -> Self {
        let (poisson_rate_per_s, bursts) = match arrivals {
            Arrivals::Closed { .. } => (0.0, None),
            Arrivals::Poisson { rate_per_s } => (rate_per_s, None),
            Arrivals::Burst {
                size,
                every_s,
                rate_per_s,
            } => (
                rate_per_s,
                (size > 0).then_some(Bursts {
                    size,
                    every_s,
                    index: 0,
                    left_in_burst: size,
                }),
            ),
        };
        Self {
            rng: SplitMix64::new(seed),
            poisson: (poisson_rate_per_s > 0.0).then_some((poisson_rate_per_s, 0.0)),
            bursts,
        }
    }
}

impl Iterator for ArrivalSchedule {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let burst_s = self
            .bursts
            .as_ref()
            .map(|bursts| bursts.index as f64 * bursts.every_s);
        let poisson_s = self.poisson.map(|(_, next_s)| next_s);
        let at_s = match (burst_s, poisson_s) {
            (Some(burst_s), poisson_s) if poisson_s.is_none_or(|p| burst_s <= p) => {
                let bursts = self.bursts.as_mut()?;
                bursts.left_in_burst -= 1;
                if bursts.left_in_burst == 0 {
                    bursts.index += 1;
                    bursts.left_in_burst = bursts.size;
                }
                burst_s
            }
            (_, Some(poisson_s)) => {
                let (rate_per_s, next_s) = self.poisson.as_mut()?;
                *next_s += exponential_gap_s(*rate_per_s, self.rng.unit_f64());
                poisson_s
            }
            _ => return None,
        };
        Duration::try_from_secs_f64(at_s).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offsets_s(arrivals: Arrivals, count: usize) -> Vec<f64> {
        ArrivalSchedule::new(arrivals, 7)
            .take(count)
            .map(|offset| offset.as_secs_f64())
            .collect()
    }

    #[test]
    fn poisson_gaps_average_one_over_the_rate() {
        for rate_per_s in [0.5, 4.0, 250.0] {
            let offsets = offsets_s(Arrivals::Poisson { rate_per_s }, 2001);
            assert_eq!(offsets[0], 0.0, "the first arrives at the start");
            let gaps: Vec<f64> = offsets.windows(2).map(|pair| pair[1] - pair[0]).collect();
            assert_eq!(gaps.len(), 2000);
            assert!(gaps.iter().all(|&gap| gap >= 0.0 && gap.is_finite()));
            let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
            let expected = 1.0 / rate_per_s;
            assert!(
                (mean - expected).abs() < 0.05 * expected,
                "rate {rate_per_s}: mean gap {mean} s, expected {expected} s"
            );
            // Exponential, not uniform or fixed: about e^-1 of the gaps exceed the mean.
            let long = gaps.iter().filter(|&&gap| gap > expected).count() as f64 / 2000.0;
            assert!(
                (0.33..0.41).contains(&long),
                "{long} of gaps above the mean"
            );
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_schedule() {
        let arrivals = Arrivals::Poisson { rate_per_s: 3.0 };
        let first: Vec<Duration> = ArrivalSchedule::new(arrivals, 1).take(50).collect();
        let again: Vec<Duration> = ArrivalSchedule::new(arrivals, 1).take(50).collect();
        let other: Vec<Duration> = ArrivalSchedule::new(arrivals, 2).take(50).collect();
        assert_eq!(first, again);
        assert_ne!(first, other);
    }

    #[test]
    fn bursts_arrive_together_at_each_period() {
        let bursts = Arrivals::Burst {
            size: 3,
            every_s: 2.5,
            rate_per_s: 0.0,
        };
        assert_eq!(
            offsets_s(bursts, 8),
            vec![0.0, 0.0, 0.0, 2.5, 2.5, 2.5, 5.0, 5.0]
        );
    }

    #[test]
    fn bursts_over_a_poisson_background_merge_in_order() {
        let arrivals = Arrivals::Burst {
            size: 4,
            every_s: 10.0,
            rate_per_s: 2.0,
        };
        let offsets = offsets_s(arrivals, 2000);
        assert!(offsets.windows(2).all(|pair| pair[0] <= pair[1]));
        let end_s = *offsets.last().expect("2000 offsets");
        let periods = (end_s / 10.0).floor();
        let in_bursts = offsets.iter().filter(|&&at| at % 10.0 == 0.0).count() as f64;
        // Every burst up to the end is complete (the last perhaps partly), and the background
        // keeps its rate between them.
        assert!(
            (in_bursts - 4.0 * (periods + 1.0)).abs() <= 4.0,
            "{in_bursts} in bursts"
        );
        let background_rate = (2000.0 - in_bursts) / end_s;
        assert!(
            (background_rate - 2.0).abs() < 0.15,
            "background {background_rate}/s"
        );
    }

    #[test]
    fn closed_loops_have_no_schedule_and_settings_are_checked() {
        assert_eq!(
            ArrivalSchedule::new(Arrivals::Closed { concurrency: 4 }, 0).next(),
            None
        );
        assert!(!Arrivals::Closed { concurrency: 4 }.is_open_loop());
        assert!(Arrivals::Poisson { rate_per_s: 1.0 }.is_open_loop());
        for invalid in [
            Arrivals::Closed { concurrency: 0 },
            Arrivals::Poisson { rate_per_s: 0.0 },
            Arrivals::Poisson {
                rate_per_s: f64::NAN,
            },
            Arrivals::Burst {
                size: 0,
                every_s: 1.0,
                rate_per_s: 0.0,
            },
            Arrivals::Burst {
                size: 2,
                every_s: 0.0,
                rate_per_s: 0.0,
            },
            Arrivals::Burst {
                size: 2,
                every_s: 1.0,
                rate_per_s: -1.0,
            },
        ] {
            assert!(invalid.validate().is_err(), "{invalid:?}");
        }
        assert!(Arrivals::Burst {
            size: 2,
            every_s: 1.0,
            rate_per_s: 0.0
        }
        .validate()
        .is_ok());
    }

    #[test]
    fn arrivals_describe_themselves() {
        assert_eq!(
            Arrivals::Closed { concurrency: 16 }.to_string(),
            "concurrency 16"
        );
        assert_eq!(
            Arrivals::Poisson { rate_per_s: 4.0 }.to_string(),
            "poisson 4 req/s"
        );
        assert_eq!(
            Arrivals::Burst {
                size: 8,
                every_s: 2.0,
                rate_per_s: 0.5
            }
            .to_string(),
            "bursts of 8 every 2 s over poisson 0.5 req/s"
        );
        let json = serde_json::to_value(Arrivals::Poisson { rate_per_s: 4.0 }).expect("serializes");
        assert_eq!(
            json,
            serde_json::json!({"kind": "poisson", "rate_per_s": 4.0})
        );
    }
}
