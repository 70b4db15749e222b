//! Elementwise and normalization kernels, RoPE, softmax and attention, all on f32.

use crate::dispatch::{dot_f32, Isa};
use crate::matmul::SharedOut;
use crate::pool::ThreadPool;

/// `out = x / rms(x) · weight`, with `rms(x) = sqrt(mean(x²) + eps)`.
pub fn rms_norm(isa: Isa, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let mean_sq = dot_f32(isa, x, x) / n as f32;
    let scale = 1.0 / (mean_sq + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// `out = (x - mean) / sqrt(var + eps) · weight + bias`.
pub fn layer_norm(x: &[f32], weight: &[f32], bias: Option<&[f32]>, eps: f32, out: &mut [f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let scale = 1.0 / (var + eps).sqrt();
    for (i, o) in out.iter_mut().enumerate() {
        *o = (x[i] - mean) * scale * weight[i] + bias.map_or(0.0, |b| b[i]);
    }
}

/// [`layer_norm`] of each `weight.len()`-long row of `x` into `out`, rows spread over the pool.
pub fn layer_norm_rows(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    weight: &[f32],
    bias: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let n = weight.len();
    assert!(
        n > 0 && bias.len() == n && x.len().is_multiple_of(n) && out.len() == x.len(),
        "x and out must be whole rows of weight.len()"
    );
    let rows = x.len() / n;
    // Rows per item: enough work to be worth a hand-off.
    let chunk = 16;
    let out_ptr = SharedOut::new(out.as_mut_ptr());
    pool.for_each(rows.div_ceil(chunk), &|item| {
        for r in item * chunk..((item + 1) * chunk).min(rows) {
            let src = &x[r * n..(r + 1) * n];
            // SAFETY: row r of out is written by this item only; in bounds as out is rows × n.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(r * n), n) };
            #[cfg(target_arch = "x86_64")]
            if isa.runs(Isa::Avx2) {
                // SAFETY: AVX2 and FMA are present (see Isa::detect).
                unsafe { crate::x86::layer_norm(src, weight, bias, eps, dst) };
                continue;
            }
            let _ = isa;
            layer_norm(src, weight, Some(bias), eps, dst);
        }
    });
}

/// Softmax in place (max-subtracted for stability).
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// The largest value of `x`, NaN values ignored (−∞ when there is none).
pub fn max_value(isa: Isa, x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: AVX2 is present.
        return unsafe { crate::x86::max_value(x) };
    }
    let _ = isa;
    x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// The first index whose value equals `value` (`==`: never for NaN).
pub fn position_of(isa: Isa, x: &[f32], value: f32) -> Option<usize> {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: AVX2 is present.
        return unsafe { crate::x86::position_of(x, value) };
    }
    let _ = isa;
    x.iter().position(|&v| v == value)
}

/// What sampling needs of a distribution given by logits, without writing its log-softmax out:
/// the largest logit, the log of the partition function and the entropy in nats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SoftmaxStats {
    pub max: f32,
    /// `ln Σ exp(x)`; +∞ when no logit is finite or one is +∞.
    pub log_z: f32,
    pub entropy: f32,
}

impl SoftmaxStats {
    /// The log-probability of a token whose logit is `logit`.
    pub fn logprob(&self, logit: f32) -> f32 {
        if self.log_z == f32::INFINITY {
            f32::NEG_INFINITY
        } else {
            logit - self.log_z
        }
    }
}

/// [`SoftmaxStats`] of `logits` (`H = ln S − Σ e·s / S` with `s = x − max`, `e = exp(s)`,
/// `S = Σ e`: one exp per value, two passes over the logits). Values of −∞ (masked tokens) add
/// nothing.
pub fn softmax_stats(isa: Isa, logits: &[f32]) -> SoftmaxStats {
    let max = max_value(isa, logits);
    if !max.is_finite() {
        return SoftmaxStats {
            max,
            log_z: f32::INFINITY,
            entropy: 0.0,
        };
    }
    let (sum_e, sum_es) = {
        #[cfg(target_arch = "x86_64")]
        {
            if isa.runs(Isa::Avx2) {
                // SAFETY: AVX2 and FMA are present.
                unsafe { crate::x86::exp_moments(logits, max) }
            } else {
                exp_moments_scalar(logits, max)
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            exp_moments_scalar(logits, max)
        }
    };
    let log_sum = sum_e.ln();
    SoftmaxStats {
        max,
        log_z: max + log_sum as f32,
        entropy: (log_sum - sum_es / sum_e).max(0.0) as f32,
    }
}

/// Log-softmax of `logits` into `logprobs`, and the entropy of the distribution in nats
/// (`H = ln S − Σ e·s / S` with `s = x − max`, `e = exp(s)`, `S = Σ e`: one exp per value).
/// Values of −∞ (masked tokens) get a log-probability of −∞ and add nothing to the entropy.
pub fn log_softmax_entropy(isa: Isa, logits: &[f32], logprobs: &mut Vec<f32>) -> f32 {
    let stats = softmax_stats(isa, logits);
    logprobs.clear();
    logprobs.extend(logits.iter().map(|&v| stats.logprob(v)));
    stats.entropy
}

fn exp_moments_scalar(logits: &[f32], max: f32) -> (f64, f64) {
    let (mut sum_e, mut sum_es) = (0f64, 0f64);
    for &v in logits {
        if v == f32::NEG_INFINITY {
            continue;
        }
        let s = f64::from(v - max);
        let e = s.exp();
        sum_e += e;
        sum_es += e * s;
    }
    (sum_e, sum_es)
}

/// SiLU (x·σ(x)).
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (as GPT-2/BERT exports use): `0.5·x·(1 + tanh(u))` with
/// `u = √(2/π)·(x + 0.044715·x³)`, computed as `x·σ(2u)`, which equals it and keeps its digits
/// for negative `x` (where `1 + tanh(u)` cancels).
#[inline]
pub fn gelu(x: f32) -> f32 {
    const TWO_SQRT_2_OVER_PI: f32 = 1.595_769_2;
    x / (1.0 + (-TWO_SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).exp())
}

/// The error function, Abramowitz & Stegun 7.1.26 evaluated in f64 (absolute error below
/// 1.5e-7, under f32 precision for the GELU it feeds).
#[inline]
pub fn erf(x: f32) -> f32 {
    const P: f64 = 0.327_591_1;
    const A: [f64; 5] = [
        0.254_829_592,
        -0.284_496_736,
        1.421_413_741,
        -1.453_152_027,
        1.061_405_429,
    ];
    let x = f64::from(x);
    let t = 1.0 / (1.0 + P * x.abs());
    let poly = t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4]))));
    let y = 1.0 - poly * (-x * x).exp();
    (if x < 0.0 { -y } else { y }) as f32
}

/// GELU, exact: `x·Φ(x) = 0.5·x·(1 + erf(x/√2))` (BERT's `hidden_act = "gelu"`).
#[inline]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `gate[i] = silu(gate[i]) · up[i]` (the SwiGLU of llama-family MLPs).
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * u;
    }
}

/// `gate[i] = gelu(gate[i]) · up[i]` (GELU, tanh approximation: Gemma's gated MLP).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu(*g) * u;
    }
}

/// `x[i] += y[i]`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// How RoPE frequencies are scaled for contexts longer than training.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1: low frequencies divided by `factor`, high ones kept, smooth in between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_context: f32,
    },
}

/// Rotary position embedding for one model.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Rotated dimensions per head (≤ head_dim; the rest pass through).
    pub dims: usize,
    /// NeoX layout rotates pairs `(i, i + dims/2)`; the normal (GPT-J) layout pairs `(2i, 2i+1)`.
    /// Llama GGUFs store Q/K permuted for the normal layout; Qwen2 uses NeoX.
    pub neox: bool,
    position_scale: f32,
    inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(dims: usize, theta: f32, neox: bool, scaling: RopeScaling) -> Self {
        let mut inv_freq: Vec<f32> = (0..dims / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f32 / dims as f32))
            .collect();
        let mut position_scale = 1.0;
        match scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => position_scale = 1.0 / factor,
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let low_wavelen = original_context / low_freq_factor;
                let high_wavelen = original_context / high_freq_factor;
                for f in inv_freq.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (original_context / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        Self {
            dims,
            neox,
            position_scale,
            inv_freq,
        }
    }

    /// Divides each frequency by a per-dimension factor (Llama 3.1's `rope_freqs` tensor).
    pub fn divide_frequencies(&mut self, factors: &[f32]) {
        for (f, d) in self.inv_freq.iter_mut().zip(factors) {
            *f /= d;
        }
    }

    /// Rotates `heads` vectors of `head_dim` in `x` for position `pos`.
    pub fn apply(&self, x: &mut [f32], heads: usize, head_dim: usize, pos: usize) {
        let half = self.dims / 2;
        let p = pos as f32 * self.position_scale;
        // cos/sin of this position, computed once for all heads.
        let mut cs = [(0f32, 0f32); 256];
        assert!(half <= cs.len(), "RoPE over more than 512 dimensions");
        for (i, c) in cs.iter_mut().take(half).enumerate() {
            let (s, co) = (p * self.inv_freq[i]).sin_cos();
            *c = (co, s);
        }
        for h in 0..heads {
            let v = &mut x[h * head_dim..h * head_dim + self.dims];
            for (i, &(c, s)) in cs.iter().take(half).enumerate() {
                let (a, b) = if self.neox {
                    (i, i + half)
                } else {
                    (2 * i, 2 * i + 1)
                };
                let (x0, x1) = (v[a], v[b]);
                v[a] = x0 * c - x1 * s;
                v[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// Shapes of an attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Position of the first query row; query `i` sees keys `0..=first_pos + i`.
    pub first_pos: usize,
}

/// Causal multi-head attention with grouped KV heads.
///
/// - `q`: `m × heads·head_dim` query rows (RoPE applied);
/// - `k`, `v`: `n_keys × kv_heads·head_dim`, the cache up to and including the last query;
/// - `out`: `m × heads·head_dim`.
///
/// Each (row, head) item computes its scores into a per-thread buffer, then the softmax and
/// the weighted sum of values (SIMD with a vectorized exp where available).
pub fn attention(
    pool: &ThreadPool,
    isa: Isa,
    shape: AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
) {
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        first_pos,
    } = shape;
    assert!(head_dim <= 256, "head_dim {head_dim} exceeds 256");
    assert!(
        heads % kv_heads == 0,
        "heads must be a multiple of kv heads"
    );
    let q_stride = heads * head_dim;
    let kv_stride = kv_heads * head_dim;
    let m = q.len() / q_stride;
    assert_eq!(out.len(), q.len());
    assert!(
        k.len() >= (first_pos + m) * kv_stride && v.len() >= (first_pos + m) * kv_stride,
        "cache too short"
    );
    let group = heads / kv_heads;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let out_ptr = SharedOut::new(out.as_mut_ptr());
    pool.for_each(m * heads, &|item| {
        let (i, h) = (item / heads, item % heads);
        let keys = first_pos + i + 1;
        let qv = &q[i * q_stride + h * head_dim..i * q_stride + (h + 1) * head_dim];
        // SAFETY: this item owns out[i, h, ..]; in bounds by the asserts above.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(out_ptr.get().add(i * q_stride + h * head_dim), head_dim)
        };
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            if scores.len() < keys {
                scores.resize(keys.next_power_of_two(), 0.0);
            }
            attend(
                isa,
                qv,
                k,
                v,
                keys,
                kv_stride,
                (h / group) * head_dim,
                scale,
                &mut scores,
                dst,
            );
        });
    });
}

/// Bidirectional multi-head attention over a packed batch of sequences (an encoder's attention):
/// every token attends to every token of its own sequence and to nothing else, so sequences of
/// different lengths share one call with no padding and no mask.
///
/// - `qkv`: `n × 3·heads·head_dim`, the rows of all sequences one after another, each row its
///   query, key and value vectors side by side (the output of one fused projection);
/// - `sequences`: the row ranges of the sequences, disjoint, within `0..n`; rows outside every
///   range are left untouched in `out`;
/// - `out`: `n × heads·head_dim`.
pub fn attention_within_sequences(
    pool: &ThreadPool,
    isa: Isa,
    heads: usize,
    head_dim: usize,
    qkv: &[f32],
    sequences: &[std::ops::Range<usize>],
    out: &mut [f32],
) {
    let width = heads * head_dim;
    let stride = 3 * width;
    assert!(
        head_dim > 0 && head_dim <= 256,
        "head_dim {head_dim} outside 1..=256"
    );
    assert!(
        qkv.len().is_multiple_of(stride) && out.len() == qkv.len() / 3,
        "qkv must be n × 3·heads·head_dim and out n × heads·head_dim"
    );
    let n = qkv.len() / stride;
    let mut covered = vec![false; n];
    for range in sequences {
        assert!(range.end <= n, "sequence {range:?} beyond {n} rows");
        for c in &mut covered[range.clone()] {
            assert!(!*c, "sequences overlap at {range:?}");
            *c = true;
        }
    }
    let scale = 1.0 / (head_dim as f32).sqrt();
    let out_ptr = SharedOut::new(out.as_mut_ptr());
    // Items are (sequence, head) pairs: every query row of the head reads the same keys.
    pool.for_each(sequences.len() * heads, &|item| {
        let range = &sequences[item / heads];
        let h = item % heads;
        let keys = range.len();
        let first = range.start * stride;
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX2 and FMA are present; the sequence's rows lie inside qkv and out (the
            // asserts above) and this item alone writes its head's slice of them.
            if isa.runs(Isa::Avx2)
                && unsafe {
                    crate::x86::attend_sequence(
                        qkv.as_ptr().add(first + h * head_dim),
                        qkv.as_ptr().add(first + width + h * head_dim),
                        qkv.as_ptr().add(first + 2 * width + h * head_dim),
                        stride,
                        keys,
                        head_dim,
                        scale,
                        out_ptr.get().add(range.start * width + h * head_dim),
                        width,
                        &mut scores,
                    )
                }
            {
                return;
            }
            if scores.len() < keys {
                scores.resize(keys.next_power_of_two(), 0.0);
            }
            for row in range.clone() {
                let q = &qkv[row * stride + h * head_dim..row * stride + (h + 1) * head_dim];
                // SAFETY: this item alone writes out[row, h, ..] (rows are distinct across
                // sequences, as the ranges were checked to be disjoint); in bounds by the asserts
                // above.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        out_ptr.get().add(row * width + h * head_dim),
                        head_dim,
                    )
                };
                attend(
                    isa,
                    q,
                    &qkv[first + width..],
                    &qkv[first + 2 * width..],
                    keys,
                    stride,
                    h * head_dim,
                    scale,
                    &mut scores,
                    dst,
                );
            }
        });
    });
}

thread_local! {
    /// Per-thread attention scores, grown to the longest context seen on the thread.
    static SCORES: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One query head over `keys` positions (see [`attention`]): scores, softmax, weighted values.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    isa: Isa,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    keys: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let hd = q.len();
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2 and FMA are present; the kernel checks its bounds and declines head sizes it
    // has no variant for.
    if isa.runs(Isa::Avx2)
        && unsafe { crate::x86::attend(q, k, v, keys, stride, offset, scale, scores, out) }
    {
        return;
    }
    let _ = isa;
    let mut max = f32::NEG_INFINITY;
    for (t, s) in scores.iter_mut().enumerate().take(keys) {
        let kv = &k[t * stride + offset..t * stride + offset + hd];
        *s = q.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * scale;
        max = max.max(*s);
    }
    let mut sum = 0.0;
    for s in scores.iter_mut().take(keys) {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.iter_mut().for_each(|o| *o = 0.0);
    for (t, &p) in scores.iter().enumerate().take(keys) {
        let vv = &v[t * stride + offset..t * stride + offset + hd];
        for (o, &x) in out.iter_mut().zip(vv) {
            *o += p * x;
        }
    }
    let inv = 1.0 / sum;
    out.iter_mut().for_each(|o| *o *= inv);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::random_f32;

    #[test]
    fn gated_activations_match_the_scalar_functions_on_every_isa() {
        // Ordinary activations, large ones of both signs (where e^x saturates) and a tail that
        // is not a multiple of eight.
        let mut gate: Vec<f32> = random_f32(1003, 11).iter().map(|v| 6.0 * v).collect();
        gate.extend([
            0.0, -0.0, 90.0, -90.0, 200.0, -200.0, 1e-30, -1e-30, 20.0, -20.0,
        ]);
        let up = random_f32(gate.len(), 12);
        for gelu in [false, true] {
            for isa in crate::dispatch::Isa::available() {
                let mut got = gate.clone();
                crate::dispatch::gated_activation(isa, gelu, &mut got, &up);
                for (i, (&x, &u)) in gate.iter().zip(&up).enumerate() {
                    // Against the functions in f64 (the f32 scalar GELU loses digits to
                    // cancellation in `1 + tanh` for negative inputs; the kernel's σ form does
                    // not).
                    let (x64, u64_) = (f64::from(x), f64::from(u));
                    let act = if gelu {
                        let t = (0.797_884_560_802_865_4 * (x64 + 0.044_715 * x64.powi(3))).tanh();
                        0.5 * x64 * (1.0 + t)
                    } else {
                        x64 / (1.0 + (-x64).exp())
                    };
                    let want = act * u64_;
                    assert!(
                        (f64::from(got[i]) - want).abs() <= 4e-6 * want.abs() + 1e-30,
                        "gelu {gelu} {isa:?}: act({x}) · {u} = {} (f64 {want}, scalar {})",
                        got[i],
                        if gelu { gelu_fn(x) } else { silu(x) } * u
                    );
                }
            }
        }
    }

    fn gelu_fn(x: f32) -> f32 {
        gelu(x)
    }

    #[test]
    fn erf_and_exact_gelu_match_known_values() {
        // erf from tables (to 1e-9); GELU(x) = x·Φ(x).
        for (x, want) in [
            (0.0f32, 0.0f64),
            (0.5, 0.520_499_878),
            (1.0, 0.842_700_793),
            (-1.0, -0.842_700_793),
            (2.0, 0.995_322_265),
            (-3.5, -0.999_999_257),
        ] {
            assert!((f64::from(erf(x)) - want).abs() < 2e-7, "erf({x})");
        }
        for (x, want) in [
            (1.0f32, 0.841_344_8_f32),
            (-1.0, -0.158_655_26),
            (0.1, 0.053_982_784),
            (-6.0, -5.9e-9),
        ] {
            assert!((gelu_erf(x) - want).abs() < 1e-6, "gelu_erf({x})");
        }
    }

    /// Reference: each sequence's attention computed alone, naively, in f64.
    fn attention_reference(
        heads: usize,
        head_dim: usize,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        range: std::ops::Range<usize>,
        out: &mut [f32],
    ) {
        let stride = heads * head_dim;
        let scale = 1.0 / (head_dim as f64).sqrt();
        for i in range.clone() {
            for h in 0..heads {
                let at =
                    |m: &[f32], t: usize, d: usize| f64::from(m[t * stride + h * head_dim + d]);
                let scores: Vec<f64> = range
                    .clone()
                    .map(|t| {
                        (0..head_dim)
                            .map(|d| at(q, i, d) * at(k, t, d))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..head_dim {
                    let o: f64 = range
                        .clone()
                        .zip(&e)
                        .map(|(t, p)| p * at(v, t, d))
                        .sum::<f64>()
                        / sum;
                    out[i * stride + h * head_dim + d] = o as f32;
                }
            }
        }
    }

    #[test]
    fn layer_norm_rows_match_the_reference() {
        let pool = ThreadPool::new(2);
        for (rows, n) in [(1usize, 1usize), (3, 7), (40, 384), (17, 37)] {
            let x: Vec<f32> = random_f32(rows * n, n as u64)
                .iter()
                .map(|v| v * 3.0 + 0.5)
                .collect();
            let weight = random_f32(n, 2);
            let bias = random_f32(n, 3);
            let mut want = vec![0f32; rows * n];
            for (src, dst) in x.chunks_exact(n).zip(want.chunks_exact_mut(n)) {
                layer_norm(src, &weight, Some(&bias), 1e-12, dst);
            }
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; rows * n];
                layer_norm_rows(&pool, isa, &x, &weight, &bias, 1e-12, &mut got);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!((a - b).abs() < 1e-5, "{isa:?} {rows}×{n} [{i}]: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn attention_within_sequences_matches_each_sequence_alone() {
        let pool = ThreadPool::new(3);
        for (heads, head_dim, lengths) in [
            (1usize, 1usize, vec![1usize]),
            (3, 32, vec![5, 1, 17]),
            (2, 7, vec![3, 0, 9, 2]),
            (12, 64, vec![40, 13]),
            (2, 16, vec![8, 33, 64, 1]),
        ] {
            let stride = heads * head_dim;
            let n: usize = lengths.iter().sum();
            let q = random_f32(n * stride, 1 + n as u64);
            let k = random_f32(n * stride, 2 + n as u64);
            let v = random_f32(n * stride, 3 + n as u64);
            let mut ranges = Vec::new();
            let mut start = 0;
            for len in &lengths {
                ranges.push(start..start + len);
                start += len;
            }
            let mut want = vec![0.0; n * stride];
            for range in &ranges {
                attention_reference(heads, head_dim, &q, &k, &v, range.clone(), &mut want);
            }
            let qkv: Vec<f32> = (0..n)
                .flat_map(|i| {
                    let row = i * stride..(i + 1) * stride;
                    [&q[row.clone()], &k[row.clone()], &v[row]].concat()
                })
                .collect();
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; n * stride];
                attention_within_sequences(&pool, isa, heads, head_dim, &qkv, &ranges, &mut got);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (a - b).abs() < 1e-5,
                        "{isa:?} {heads}×{head_dim} {lengths:?} [{i}]: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn max_and_position_match_the_scalar_definitions() {
        for n in [0usize, 1, 7, 8, 9, 33, 262_147] {
            let mut x: Vec<f32> = random_f32(n, 5 + n as u64);
            if n > 20 {
                x[3] = f32::NAN;
                x[n - 2] = 7.0;
                x[n - 1] = 7.0;
                x[11] = f32::NAN;
            }
            let want = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            for isa in Isa::available() {
                let got = max_value(isa, &x);
                assert_eq!(got.to_bits(), want.to_bits(), "{isa:?} n{n}");
                assert_eq!(
                    position_of(isa, &x, got),
                    x.iter().position(|&v| v == want),
                    "{isa:?} n{n}"
                );
                assert_eq!(position_of(isa, &x, f32::NAN), None);
            }
        }
        let all_nan = [f32::NAN; 13];
        for isa in Isa::available() {
            assert_eq!(max_value(isa, &all_nan), f32::NEG_INFINITY);
        }
    }

    #[test]
    fn log_softmax_entropy_matches_the_definition() {
        for n in [1usize, 7, 49_152, 50_001] {
            let logits: Vec<f32> = random_f32(n, n as u64).iter().map(|v| v * 12.0).collect();
            let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let z: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
            let lps: Vec<f64> = logits.iter().map(|&v| v as f64 - max - z.ln()).collect();
            let h: f64 = -lps.iter().map(|lp| lp.exp() * lp).sum::<f64>();
            for isa in Isa::available() {
                let mut out = Vec::new();
                let got = log_softmax_entropy(isa, &logits, &mut out);
                assert!(
                    (f64::from(got) - h).abs() < 1e-4 * h.max(1.0),
                    "{isa:?} n{n}: {got} vs {h}"
                );
                for (a, b) in out.iter().zip(&lps) {
                    assert!((f64::from(*a) - b).abs() < 1e-4, "{isa:?} n{n}");
                }
            }
        }
        let mut out = Vec::new();
        let h = log_softmax_entropy(Isa::detect(), &[0.0, f32::NEG_INFINITY, 0.0], &mut out);
        assert!((h - 2f32.ln()).abs() < 1e-6);
        assert_eq!(out[1], f32::NEG_INFINITY);
        // A grammar mask: most of a large vocabulary at -inf; every kernel agrees with the
        // definition over the allowed tokens.
        let mut logits: Vec<f32> = random_f32(49_155, 9).iter().map(|v| v * 8.0).collect();
        for (i, v) in logits.iter_mut().enumerate() {
            if i % 7 != 3 {
                *v = f32::NEG_INFINITY;
            }
        }
        let allowed: Vec<f64> = logits
            .iter()
            .filter(|v| v.is_finite())
            .map(|&v| f64::from(v))
            .collect();
        let max = allowed.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v));
        let z: f64 = allowed.iter().map(|v| (v - max).exp()).sum();
        let h: f64 = -allowed
            .iter()
            .map(|v| {
                let lp = v - max - z.ln();
                lp.exp() * lp
            })
            .sum::<f64>();
        for isa in Isa::available() {
            let got = log_softmax_entropy(isa, &logits, &mut out);
            assert!(
                (f64::from(got) - h).abs() < 1e-4 * h.max(1.0),
                "{isa:?}: {got} vs {h}"
            );
            assert!(out.iter().all(|v| !v.is_nan()), "{isa:?}");
            assert_eq!(out[0], f32::NEG_INFINITY);
        }
    }

    #[test]
    fn rms_norm_matches_definition() {
        let x = random_f32(77, 1);
        let w = random_f32(77, 2);
        for isa in Isa::available() {
            let mut out = vec![0f32; 77];
            rms_norm(isa, &x, &w, 1e-5, &mut out);
            let rms = (x.iter().map(|v| v * v).sum::<f32>() / 77.0 + 1e-5).sqrt();
            for i in 0..77 {
                assert!((out[i] - x[i] / rms * w[i]).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn rope_preserves_norms_and_relative_positions() {
        for neox in [false, true] {
            let rope = Rope::new(64, 10000.0, neox, RopeScaling::None);
            let q = random_f32(64, 3);
            let k = random_f32(64, 4);
            let rotated_dot = |pq: usize, pk: usize| {
                let (mut a, mut b) = (q.clone(), k.clone());
                rope.apply(&mut a, 1, 64, pq);
                rope.apply(&mut b, 1, 64, pk);
                a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>()
            };
            // Attention scores depend only on the distance between positions.
            assert!((rotated_dot(5, 2) - rotated_dot(105, 102)).abs() < 1e-3);
            let mut a = q.clone();
            rope.apply(&mut a, 1, 64, 17);
            let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
            assert!((norm(&a) - norm(&q)).abs() < 1e-3);
            let mut z = q.clone();
            rope.apply(&mut z, 1, 64, 0);
            assert_eq!(z, q, "position 0 is the identity");
        }
    }

    #[test]
    fn attention_matches_naive_softmax() {
        for (heads, kv_heads, head_dim, first_pos, m) in [
            (6, 2, 16, 5, 3),
            (9, 3, 64, 90, 4),
            (4, 4, 12, 20, 2),
            (4, 2, 80, 33, 2),
            (2, 1, 96, 9, 3),
            (2, 2, 128, 17, 2),
        ] {
            check_attention(heads, kv_heads, head_dim, first_pos, m);
        }
    }

    fn check_attention(heads: usize, kv_heads: usize, head_dim: usize, first_pos: usize, m: usize) {
        let pool = ThreadPool::new(2);
        let n_keys = first_pos + m;
        let q = random_f32(m * heads * head_dim, 5);
        let k = random_f32(n_keys * kv_heads * head_dim, 6);
        let v = random_f32(n_keys * kv_heads * head_dim, 7);
        for isa in Isa::available() {
            let mut out = vec![0f32; q.len()];
            let shape = AttentionShape {
                heads,
                kv_heads,
                head_dim,
                first_pos,
            };
            attention(&pool, isa, shape, &q, &k, &v, &mut out);
            for i in 0..m {
                for h in 0..heads {
                    let kvh = h / (heads / kv_heads);
                    let qv = &q[(i * heads + h) * head_dim..][..head_dim];
                    let mut scores: Vec<f32> = (0..=first_pos + i)
                        .map(|t| {
                            let kv = &k[(t * kv_heads + kvh) * head_dim..][..head_dim];
                            qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>()
                                / (head_dim as f32).sqrt()
                        })
                        .collect();
                    softmax(&mut scores);
                    for d in 0..head_dim {
                        let expected: f32 = scores
                            .iter()
                            .enumerate()
                            .map(|(t, p)| p * v[(t * kv_heads + kvh) * head_dim + d])
                            .sum();
                        let got = out[(i * heads + h) * head_dim + d];
                        assert!(
                            (got - expected).abs() < 1e-5,
                            "{isa:?} i{i} h{h} d{d}: {got} vs {expected}"
                        );
                    }
                }
            }
        }
    }
}
