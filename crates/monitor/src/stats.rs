//! The statistics the detectors use: two-sample Kolmogorov–Smirnov with its p-value,
//! chi-squared goodness of fit, the Wasserstein-1 distance and the population stability index.

/// The two-sample Kolmogorov–Smirnov statistic `D = sup |F_a(x) − F_b(x)|` of two sorted samples.
/// Ties are handled: both ECDFs step past a shared value before they are compared.
pub fn ks_statistic(a: &[f64], b: &[f64]) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j) = (0usize, 0usize);
    let mut d: f64 = 0.0;
    while i < a.len() && j < b.len() {
        let x = a[i].min(b[j]);
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
        d = d.max((i as f64 / na - j as f64 / nb).abs());
    }
    d
}

/// The asymptotic p-value of a two-sample KS statistic `d` for sample sizes `n` and `m`
/// (Kolmogorov's distribution with Stephens' small-sample correction). Conservative when the
/// samples have ties.
pub fn ks_pvalue(d: f64, n: usize, m: usize) -> f64 {
    if n == 0 || m == 0 || d <= 0.0 {
        return 1.0;
    }
    let ne = (n as f64 * m as f64) / (n as f64 + m as f64);
    let s = ne.sqrt();
    let lambda = (s + 0.12 + 0.11 / s) * d;
    kolmogorov_q(lambda)
}

/// `Q(λ) = 2 Σ_{k≥1} (−1)^{k−1} exp(−2k²λ²)`, the Kolmogorov survival function.
fn kolmogorov_q(lambda: f64) -> f64 {
    if lambda < 1e-3 {
        return 1.0;
    }
    let a = -2.0 * lambda * lambda;
    let mut sum = 0.0;
    let mut sign = 1.0;
    let mut last = 0.0f64;
    for k in 1..=100 {
        let k = k as f64;
        let term = sign * (a * k * k).exp();
        sum += term;
        if term.abs() <= 1e-10 * last.abs().max(1e-300) || term.abs() < 1e-16 {
            return (2.0 * sum).clamp(0.0, 1.0);
        }
        sign = -sign;
        last = term;
    }
    // The series did not settle (λ tiny): the statistic is no evidence at all.
    1.0
}

/// The Wasserstein-1 distance between the empirical distributions of two sorted samples:
/// `∫ |F_a(x) − F_b(x)| dx`.
pub fn wasserstein1(a: &[f64], b: &[f64]) -> f64 {
    if a.is_empty() || b.is_empty() {
        return 0.0;
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let (mut i, mut j) = (0usize, 0usize);
    let mut prev = a[0].min(b[0]);
    let mut area = 0.0;
    while i < a.len() || j < b.len() {
        let x = match (a.get(i), b.get(j)) {
            (Some(&x), Some(&y)) => x.min(y),
            (Some(&x), None) => x,
            (None, Some(&y)) => y,
            (None, None) => break,
        };
        area += (i as f64 / na - j as f64 / nb).abs() * (x - prev);
        prev = x;
        while i < a.len() && a[i] <= x {
            i += 1;
        }
        while j < b.len() && b[j] <= x {
            j += 1;
        }
    }
    area
}

/// The population stability index of `window` against `baseline` (both sorted) on the
/// baseline's deciles; each bin's share is floored at 0.5/len so empty bins stay finite.
pub fn psi(baseline: &[f64], window: &[f64]) -> f64 {
    if baseline.is_empty() || window.is_empty() {
        return 0.0;
    }
    let edges = decile_edges(baseline);
    psi_of_shares(&bin_shares(&edges, baseline), &bin_shares(&edges, window))
}

/// The inner deciles of a sorted sample (duplicates merged): the PSI's bin edges.
pub fn decile_edges(sorted: &[f64]) -> Vec<f64> {
    if sorted.is_empty() {
        return Vec::new();
    }
    let mut edges: Vec<f64> = (1..10)
        .map(|k| sorted[(k * sorted.len() / 10).min(sorted.len() - 1)])
        .collect();
    edges.dedup();
    edges
}

/// Each bin's share of `values` (bins split at `edges`), floored at half a count.
pub fn bin_shares(edges: &[f64], values: &[f64]) -> Vec<f64> {
    let mut counts = vec![0usize; edges.len() + 1];
    for &v in values {
        counts[edges.partition_point(|&e| e < v)] += 1;
    }
    let n = values.len().max(1) as f64;
    counts
        .into_iter()
        .map(|c| (c as f64).max(0.5) / n)
        .collect()
}

/// The PSI of two binnings' shares: `Σ (q − p) ln(q / p)`.
pub fn psi_of_shares(p: &[f64], q: &[f64]) -> f64 {
    p.iter().zip(q).map(|(p, q)| (q - p) * (q / p).ln()).sum()
}

/// Pearson's chi-squared test of observed counts against expected proportions. Returns the
/// statistic, the degrees of freedom and the p-value. Categories with an expected share of zero
/// must be pooled by the caller.
pub fn chi_squared(observed: &[u64], expected_share: &[f64]) -> (f64, usize, f64) {
    let n: u64 = observed.iter().sum();
    if n == 0 || observed.len() < 2 {
        return (0.0, 0, 1.0);
    }
    let n = n as f64;
    let mut stat = 0.0;
    for (o, p) in observed.iter().zip(expected_share) {
        let e = n * p;
        if e > 0.0 {
            stat += (*o as f64 - e).powi(2) / e;
        }
    }
    let df = observed.len() - 1;
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

/// The chi-squared test of homogeneity of two samples' category counts (a 2×k contingency
/// table): whether the window's categories follow the baseline's, with the baseline's own
/// sampling error accounted for. Categories empty in both are left out. Returns the statistic,
/// the degrees of freedom and the p-value.
pub fn chi_squared_two_sample(a: &[u64], b: &[u64]) -> (f64, usize, f64) {
    let (na, nb): (u64, u64) = (a.iter().sum(), b.iter().sum());
    if na == 0 || nb == 0 {
        return (0.0, 0, 1.0);
    }
    let n = (na + nb) as f64;
    let mut stat = 0.0;
    let mut k = 0usize;
    for (&x, &y) in a.iter().zip(b) {
        let col = (x + y) as f64;
        if col == 0.0 {
            continue;
        }
        k += 1;
        for (o, row) in [(x, na), (y, nb)] {
            let e = row as f64 * col / n;
            stat += (o as f64 - e).powi(2) / e;
        }
    }
    if k < 2 {
        return (0.0, 0, 1.0);
    }
    let df = k - 1;
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}

/// The regularized upper incomplete gamma function `Q(a, x)` (series below `a + 1`, Lentz's
/// continued fraction above).
pub fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    if x < a + 1.0 {
        let mut sum = 1.0 / a;
        let mut term = sum;
        let mut ap = a;
        for _ in 0..1000 {
            ap += 1.0;
            term *= x / ap;
            sum += term;
            if term.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        let p = sum * (-x + a * x.ln() - ln_gamma(a)).exp();
        (1.0 - p).clamp(0.0, 1.0)
    } else {
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..1000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-15 {
                break;
            }
        }
        ((-x + a * x.ln() - ln_gamma(a)).exp() * h).clamp(0.0, 1.0)
    }
}

/// `ln Γ(x)` for `x > 0` (Lanczos, g = 7).
pub fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        let pi = std::f64::consts::PI;
        return (pi / (pi * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Mean and population standard deviation.
pub fn mean_std(values: &[f64]) -> (f64, f64) {
    if values.is_empty() {
        return (0.0, 0.0);
    }
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    (mean, var.max(0.0).sqrt())
}

/// A small deterministic generator (SplitMix64) for bootstrap resampling and reservoirs, so a
/// calibration is reproducible from its seed.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * n as f64) as usize % n.max(1)
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// A standard normal draw (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.unit().max(1e-300);
        let v = self.unit();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ks_of_identical_samples_is_zero_and_of_disjoint_ones_is_one() {
        let a = [1.0, 2.0, 3.0];
        assert_eq!(ks_statistic(&a, &a), 0.0);
        assert_eq!(ks_statistic(&a, &[4.0, 5.0]), 1.0);
        // Ties across the samples do not count as a difference.
        assert_eq!(ks_statistic(&[1.0, 1.0, 2.0], &[1.0, 2.0, 2.0]), 1.0 / 3.0);
    }

    #[test]
    fn ks_pvalue_matches_the_kolmogorov_table() {
        // Q(1.36) ≈ 0.049, Q(1.63) ≈ 0.0098: the classic 5% and 1% critical values.
        assert!((kolmogorov_q(1.358) - 0.05).abs() < 0.002);
        assert!((kolmogorov_q(1.628) - 0.01).abs() < 0.001);
        assert_eq!(ks_pvalue(0.0, 10, 10), 1.0);
        assert!(ks_pvalue(0.5, 1000, 1000) < 1e-10);
    }

    #[test]
    fn chi_squared_p_values_match_known_quantiles() {
        // df = 1: the statistic 3.841 has p = 0.05; df = 4: 13.277 has p = 0.01.
        assert!((gamma_q(0.5, 3.841 / 2.0) - 0.05).abs() < 1e-3);
        assert!((gamma_q(2.0, 13.277 / 2.0) - 0.01).abs() < 1e-4);
        let (stat, df, p) = chi_squared(&[50, 50], &[0.5, 0.5]);
        assert_eq!((stat, df), (0.0, 1));
        assert!((p - 1.0).abs() < 1e-12);
        let (_, _, p) = chi_squared(&[90, 10], &[0.5, 0.5]);
        assert!(p < 1e-10);
    }

    #[test]
    fn the_two_sample_chi_squared_accounts_for_both_samples() {
        let (stat, df, p) = chi_squared_two_sample(&[500, 500], &[50, 50]);
        assert_eq!((stat, df), (0.0, 1));
        assert!((p - 1.0).abs() < 1e-12);
        // The same difference is weaker evidence against a small baseline than against shares.
        let (_, _, p_small) = chi_squared_two_sample(&[60, 40], &[500, 500]);
        let (_, _, p_one) = chi_squared(&[60, 40], &[0.5, 0.5]);
        assert!(p_small > p_one, "{p_small} {p_one}");
        assert_eq!(chi_squared_two_sample(&[5, 0], &[7, 0]).1, 0);
    }

    #[test]
    fn wasserstein_of_a_shift_is_the_shift() {
        let a: Vec<f64> = (0..100).map(f64::from).collect();
        let b: Vec<f64> = a.iter().map(|v| v + 2.5).collect();
        assert!((wasserstein1(&a, &b) - 2.5).abs() < 1e-9);
        assert_eq!(wasserstein1(&a, &a), 0.0);
    }

    #[test]
    fn psi_is_near_zero_for_the_same_distribution_and_large_for_a_shift() {
        let mut rng = SplitMix(7);
        let mut a: Vec<f64> = (0..5000).map(|_| rng.normal()).collect();
        let mut b: Vec<f64> = (0..1000).map(|_| rng.normal()).collect();
        let mut c: Vec<f64> = (0..1000).map(|_| rng.normal() + 1.0).collect();
        for s in [&mut a, &mut b, &mut c] {
            s.sort_by(f64::total_cmp);
        }
        assert!(psi(&a, &b) < 0.05, "{}", psi(&a, &b));
        assert!(psi(&a, &c) > 0.5, "{}", psi(&a, &c));
    }

    #[test]
    fn ln_gamma_matches_factorials() {
        assert!((ln_gamma(5.0) - 24f64.ln()).abs() < 1e-10);
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-10);
    }
}
