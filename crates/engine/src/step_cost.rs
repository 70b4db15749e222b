//! What a prompt token costs deep in its context, learned from the engine's own steps.
//!
//! A step's time grows with its tokens (the weights' matrix products, once per token) and with
//! the positions each token attends to (attention reads every key and value before it). On two
//! cores with SmolLM2-135M a prompt token at depth 3,000 costs about six times one at depth 0,
//! so a prefill budget counted in tokens lets a document's deep chunk stall every running stream
//! where a short prompt's chunk of the same size does not. The scheduler counts prompt tokens
//! in **depth-0 equivalents** instead, while the budget is trimmed below its configured size
//! (see `SchedulerLimits::prefill_ceiling`): a token at depth `d` costs `1 + d / D`, where `D` is
//! the number of attended positions that cost as much as one token's matrix products.
//!
//! `D` is fitted online to the steps the engine actually runs: `seconds ≈ c0 + c1 · tokens +
//! c2 · positions`, by exponentially weighted least squares, and `D = c1 / c2`. It depends on the
//! model's shape, the weights' type, the KV cache's type and the machine's kernels, none of
//! which a formula from the shape alone sees. Until the fit has seen enough steps that tell
//! tokens from positions apart (and whenever it comes out unphysical), prompt tokens count one
//! each, as before.

/// Each step's weight in the fit decays by this much per step (a memory of ~500 steps).
const DECAY: f64 = 0.998;
/// Steps seen before the fit is trusted.
const MIN_STEPS: u64 = 64;
/// The fit's `D` is kept above the first bound; above the second it is not believed.
const MIN_DEPTH: f64 = 64.0;
const MAX_DEPTH: f64 = 1.0e6;
/// Positions are counted in thousands inside the fit (keeps the normal equations balanced).
const POSITION_UNIT: f64 = 1000.0;

/// The online fit of a step's time to its tokens and attended positions.
#[derive(Debug, Clone, Default)]
pub struct StepCost {
    /// Weighted sums of `x xᵀ` and `x · seconds`, with `x = (1, tokens, positions / 1000)`.
    xx: [[f64; 3]; 3],
    xy: [f64; 3],
    steps: u64,
    /// Attended positions that cost as much as one token's matrix products, once fitted.
    depth: Option<f64>,
    /// Set by [`StepCost::fixed`]: the steps run do not move it.
    fixed: bool,
}

impl StepCost {
    /// A cost that does not learn: `depth` positions cost as much as a token (benchmarks and
    /// tests that need it known).
    pub fn fixed(depth: f64) -> Self {
        Self {
            depth: Some(depth.max(MIN_DEPTH)),
            fixed: true,
            ..Self::default()
        }
    }

    /// One step: how many tokens it computed, how many positions they attended to in all, and
    /// how long it took.
    pub fn observe(&mut self, tokens: usize, positions: u64, seconds: f64) {
        if self.fixed || tokens == 0 || !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let x = [1.0, tokens as f64, positions as f64 / POSITION_UNIT];
        for (r, row) in self.xx.iter_mut().enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                *v = *v * DECAY + x[r] * x[c];
            }
            self.xy[r] = self.xy[r] * DECAY + x[r] * seconds;
        }
        self.steps += 1;
        if self.steps >= MIN_STEPS {
            if let Some([_, per_token, per_thousand]) = solve(&self.xx, &self.xy) {
                let depth = per_token / per_thousand * POSITION_UNIT;
                // Positions that cost nothing, or less than nothing, are noise: the last
                // believable fit stays.
                if per_token > 0.0 && per_thousand > 0.0 && depth <= MAX_DEPTH {
                    self.depth = Some(depth.max(MIN_DEPTH));
                }
            }
        }
    }

    /// Attended positions that cost as much as one token's matrix products (none before the
    /// fit is trusted).
    pub fn depth(&self) -> Option<f64> {
        self.depth
    }

    /// What `n` prompt tokens from position `from` cost, in depth-0 tokens (at least `n`).
    pub fn chunk(&self, from: usize, n: usize) -> usize {
        match self.depth {
            None => n,
            Some(depth) => {
                // Token j (0-based) attends to from + j + 1 positions.
                let positions = n as f64 * from as f64 + (n * (n + 1)) as f64 / 2.0;
                n + (positions / depth).ceil() as usize
            }
        }
    }

    /// The most prompt tokens from position `from` (at most `pending`) that `budget` depth-0
    /// tokens pay for.
    pub fn affordable(&self, from: usize, pending: usize, budget: usize) -> usize {
        if self.chunk(from, pending) <= budget {
            return pending;
        }
        // The cost grows with n: the largest n with chunk(from, n) <= budget.
        let (mut lo, mut hi) = (0, pending);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            if self.chunk(from, mid) <= budget {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

/// Solves the 3×3 system `a · x = b` (Gaussian elimination with partial pivoting); none when it
/// is near singular (the steps did not tell the terms apart).
fn solve(a: &[[f64; 3]; 3], b: &[f64; 3]) -> Option<[f64; 3]> {
    let mut m = [[0.0; 4]; 3];
    for r in 0..3 {
        m[r][..3].copy_from_slice(&a[r]);
        m[r][3] = b[r];
    }
    let scale = a
        .iter()
        .flatten()
        .fold(0.0f64, |s, v| s.max(v.abs()))
        .max(f64::MIN_POSITIVE);
    for col in 0..3 {
        let pivot = (col..3).max_by(|&x, &y| m[x][col].abs().total_cmp(&m[y][col].abs()))?;
        if m[pivot][col].abs() < scale * 1e-10 {
            return None;
        }
        m.swap(col, pivot);
        let row = m[col];
        for (r, other) in m.iter_mut().enumerate() {
            if r != col {
                let f = other[col] / row[col];
                for (v, p) in other.iter_mut().zip(row.iter()).skip(col) {
                    *v -= f * p;
                }
            }
        }
    }
    Some([m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Steps of a machine where a token costs 0.5 ms and every thousand attended positions
    /// 0.9 ms (a depth equivalent of 556), plus 3 ms per step and some noise.
    #[test]
    fn the_fit_finds_the_depth_at_which_attention_costs_a_token() {
        let mut cost = StepCost::default();
        let mut seed = 7u64;
        let mut noise = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 0.004
        };
        for step in 0..400u64 {
            // Decode steps of 18 streams, some with a prompt chunk deep in a document.
            let (tokens, positions) = match step % 3 {
                0 => (18, 16 * 300 + 2 * 3300),
                1 => (40, 16 * 300 + 2 * 3300 + 22 * 3000),
                _ => (40, 16 * 300 + 2 * 3300 + 22 * 100),
            };
            let seconds = 0.003 + 0.0005 * tokens as f64 + 0.0009 * positions as f64 / 1000.0;
            assert_eq!(cost.depth().is_some(), step >= MIN_STEPS, "step {step}");
            cost.observe(tokens, positions, seconds + noise().abs() * 0.1);
        }
        let depth = cost.depth().unwrap();
        assert!((depth - 556.0).abs() < 60.0, "{depth}");
        // A chunk of 22 at depth 3,000 costs about 6.4 depth-0 tokens each.
        let deep = cost.chunk(3000, 22);
        assert!((130..=150).contains(&deep), "{deep}");
        assert_eq!(cost.chunk(0, 1), 1 + 1);
        assert!(cost.affordable(3000, 500, 22) >= 3 && cost.affordable(3000, 500, 22) <= 4);
        assert_eq!(cost.affordable(0, 5, 1000), 5);
        assert_eq!(cost.affordable(3000, 500, 0), 0);
    }

    #[test]
    fn without_a_fit_or_with_steps_that_cannot_tell_the_terms_apart_a_token_costs_one() {
        let mut cost = StepCost::default();
        assert_eq!(cost.chunk(3000, 22), 22);
        assert_eq!(cost.affordable(3000, 500, 22), 22);
        // Every step the same: tokens and positions cannot be told apart.
        for _ in 0..200 {
            cost.observe(18, 10_000, 0.05);
        }
        assert_eq!(cost.depth(), None);
        assert_eq!(cost.chunk(3000, 22), 22);
        // Positions that cost nothing (or less than nothing) are not believed either.
        let mut flat = StepCost::default();
        for step in 0..200u64 {
            let tokens = 10 + (step % 7) as usize;
            flat.observe(tokens, (step % 5) * 20_000, 0.002 * tokens as f64);
        }
        assert_eq!(flat.depth(), None);
    }
}
