//! Weight quantization: f32 rows into the GGUF block formats, for converting models offline.
//!
//! The output is bit-compatible with ggml's reference quantizers (`quantize_row_*_ref` in
//! `ggml-quants.c`, which is what `llama-quantize` runs when it has no importance matrix): same
//! block layouts, same scale searches, same rounding. It round-trips through
//! [`crate::quant::dequantize_row`].
//!
//! - F32, F16, BF16: conversion, rounding to nearest even.
//! - Q8_0: `d = amax / 127`, quants rounded half away from zero.
//! - Q4_0, Q5_0: the element of largest magnitude maps to the extra negative level (-8, -16), so
//!   `d` takes its sign and the side of the grid that holds the extreme gets the extra level.
//! - Q4_1, Q5_1: `d = (max - min) / levels`, offset `min`.
//! - Q4_K, Q5_K: per sub-block of 32 a weighted least-squares fit of `x ≈ scale·q - min` over a
//!   sweep of candidate grids; the eight scales and mins are then stored as 6-bit multiples of
//!   the super-block's `d` and `dmin`, and the quants recomputed against the stored values.
//! - Q6_K: per sub-block of 16 a symmetric fit (weights `x²`) over a sweep of candidate grids;
//!   the sixteen scales are stored as signed 8-bit multiples of the super-block's `d`.
//!
//! Scalar code: this is the offline path, not the hot path. Rows are independent, so a caller
//! that wants more speed quantizes several rows at once on its own threads.

use std::fmt;

use half::{bf16, f16};

use crate::dtype::{DType, QK, QK_K};

/// Below this magnitude a group is treated as all zeros (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Why a row was not quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantizeError {
    /// There is no quantizer for this type (see [`quantizable`]).
    Unsupported(DType),
    /// The row is not a whole number of blocks.
    PartialBlock { dtype: DType, elements: usize },
    /// The output buffer is not exactly the size of the quantized row.
    OutputSize {
        dtype: DType,
        expected_bytes: usize,
        actual_bytes: usize,
    },
}

impl fmt::Display for QuantizeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            QuantizeError::Unsupported(dtype) => write!(f, "no quantizer for {dtype}"),
            QuantizeError::PartialBlock { dtype, elements } => write!(
                f,
                "{elements} elements is not a whole number of {dtype} blocks of {}",
                dtype.block_size()
            ),
            QuantizeError::OutputSize {
                dtype,
                expected_bytes,
                actual_bytes,
            } => write!(
                f,
                "a {dtype} row needs an output of {expected_bytes} bytes, got {actual_bytes}"
            ),
        }
    }
}

impl std::error::Error for QuantizeError {}

/// Whether [`quantize_row`] can produce `dtype`: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
/// Q4_K, Q5_K and Q6_K (not Q2_K, Q3_K, or Q8_K, which is an activation format).
pub fn quantizable(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32
            | DType::F16
            | DType::BF16
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
    )
}

/// Quantizes `src` into `dst` in format `dtype`.
///
/// `src.len()` must be a whole number of `dtype` blocks and `dst.len()` exactly
/// `dtype.row_bytes(src.len())`; otherwise nothing is written and an error says which. Inputs are
/// expected finite (as weights are); NaN or infinite elements give unspecified, but in-bounds,
/// blocks.
pub fn quantize_row(dtype: DType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantizeError> {
    if !quantizable(dtype) {
        return Err(QuantizeError::Unsupported(dtype));
    }
    let expected_bytes = dtype
        .row_bytes(src.len())
        .ok_or(QuantizeError::PartialBlock {
            dtype,
            elements: src.len(),
        })?;
    if dst.len() != expected_bytes {
        return Err(QuantizeError::OutputSize {
            dtype,
            expected_bytes,
            actual_bytes: dst.len(),
        });
    }
    let blocks = src
        .chunks_exact(dtype.block_size())
        .zip(dst.chunks_exact_mut(dtype.block_bytes()));
    match dtype {
        DType::F32 => blocks.for_each(|(x, out)| out.copy_from_slice(&x[0].to_le_bytes())),
        DType::F16 => {
            blocks.for_each(|(x, out)| out.copy_from_slice(&f16::from_f32(x[0]).to_le_bytes()))
        }
        DType::BF16 => {
            blocks.for_each(|(x, out)| out.copy_from_slice(&bf16::from_f32(x[0]).to_le_bytes()))
        }
        DType::Q8_0 => blocks.for_each(|(x, out)| q8_0_block(block32(x), out)),
        DType::Q4_0 => blocks.for_each(|(x, out)| absmax_block(block32(x), 4, out)),
        DType::Q5_0 => blocks.for_each(|(x, out)| absmax_block(block32(x), 5, out)),
        DType::Q4_1 => blocks.for_each(|(x, out)| min_max_block(block32(x), 4, out)),
        DType::Q5_1 => blocks.for_each(|(x, out)| min_max_block(block32(x), 5, out)),
        DType::Q4_K => blocks.for_each(|(x, out)| k_min_block(block_k(x), KMinFormat::Q4_K, out)),
        DType::Q5_K => blocks.for_each(|(x, out)| k_min_block(block_k(x), KMinFormat::Q5_K, out)),
        DType::Q6_K => blocks.for_each(|(x, out)| q6_k_block(block_k(x), out)),
        DType::Q2_K | DType::Q3_K | DType::Q8_K => unreachable!("refused by quantizable above"),
    }
    Ok(())
}

/// Quantizes `src` into a new row of `dtype` (see [`quantize_row`] for the contract).
pub fn quantize(dtype: DType, src: &[f32]) -> Result<Vec<u8>, QuantizeError> {
    if !quantizable(dtype) {
        return Err(QuantizeError::Unsupported(dtype));
    }
    let bytes = dtype
        .row_bytes(src.len())
        .ok_or(QuantizeError::PartialBlock {
            dtype,
            elements: src.len(),
        })?;
    let mut out = vec![0u8; bytes];
    quantize_row(dtype, src, &mut out)?;
    Ok(out)
}

fn block32(x: &[f32]) -> &[f32; QK] {
    x.try_into()
        .expect("chunks_exact(QK) yields blocks of QK elements")
}

fn block_k(x: &[f32]) -> &[f32; QK_K] {
    x.try_into()
        .expect("chunks_exact(QK_K) yields blocks of QK_K elements")
}

/// The level nearest to `v` (ties to even, as ggml's `nearest_int`) clamped to
/// `lowest..=highest`, as an f32 holding an integer: the scale searches do their sums in f32,
/// and staying there spares two conversions per element in the hot loops.
///
/// Adding 1.5·2²³ leaves no fraction bits, so the FPU rounds (ties to even) and subtracting it
/// back is exact, for |v| ≤ 2²²; beyond that the result is still far outside any quant range
/// and the clamp puts it on the right end (plain adds also vectorize, where `round_ties_even`
/// is a library call on baseline x86-64). NaN stays NaN, which `as` casts turn into 0.
#[inline]
fn nearest_level(v: f32, lowest: f32, highest: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    ((v + MAGIC) - MAGIC).clamp(lowest, highest)
}

/// Stores `v` as little-endian f16 at `at` and returns the stored value, which is what the
/// quants must be computed against.
#[inline]
fn put_f16(out: &mut [u8], at: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    out[at..at + 2].copy_from_slice(&h.to_le_bytes());
    h.to_f32()
}

/// The element of largest magnitude, sign kept (the first one on ties).
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

/// Q8_0 (`d: f16, qs: [i8; 32]`): `d = amax / 127`, `q = round(x / d)` half away from zero (C's
/// `roundf`, as ggml).
fn q8_0_block(x: &[f32; QK], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let inv_d = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, 0, d);
    for (q, &v) in out[2..2 + QK].iter_mut().zip(x) {
        *q = (v * inv_d).round() as i8 as u8;
    }
}

/// Packs 32 quants of `bits` (4 or 5) bits: byte `j` of `qs` holds quant `j` in its low nibble
/// and quant `j + 16` in its high nibble; with 5 bits, `qh` (a little-endian u32) holds the fifth
/// bit of quant `i` at bit `i`.
fn pack32(q: &[u8; QK], bits: u32, out: &mut [u8]) {
    let (qh_at, qs_at) = match (bits, out.len()) {
        (4, 18) => (None, 2),
        (4, 20) => (None, 4),
        (5, 22) => (Some(2), 6),
        (5, 24) => (Some(4), 8),
        _ => unreachable!("pack32 is only called with the Q4_0/Q4_1/Q5_0/Q5_1 block sizes"),
    };
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        let (lo, hi) = (q[j], q[j + QK / 2]);
        out[qs_at + j] = (lo & 0x0f) | ((hi & 0x0f) << 4);
        qh |= u32::from(lo >> 4) << j;
        qh |= u32::from(hi >> 4) << (j + QK / 2);
    }
    if let Some(at) = qh_at {
        out[at..at + 4].copy_from_slice(&qh.to_le_bytes());
    }
}

/// Q4_0 (`d, qs[16]`) and Q5_0 (`d, qh: u32, qs[16]`), stored `q = level + 2^(bits-1)`.
///
/// The element of largest magnitude maps to level `-2^(bits-1)`, so `d = max / -2^(bits-1)`
/// carries its sign and the opposite extreme rounds to the top level. The rounding is ggml's:
/// `floor(x/d + 2^(bits-1) + 0.5)` (half up), clamped to the top level.
fn absmax_block(x: &[f32; QK], bits: u32, out: &mut [u8]) {
    let half_range = (1u32 << (bits - 1)) as f32;
    let top = (1i8 << bits) - 1;
    let d = signed_absmax(x) / -half_range;
    let inv_d = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, 0, d);
    // x·inv_d is at least -half_range (up to rounding), so the truncating cast floors.
    let q: [u8; QK] =
        std::array::from_fn(|i| ((x[i] * inv_d + half_range + 0.5) as i8).min(top) as u8);
    pack32(&q, bits, out);
}

/// Q4_1 (`d, m, qs[16]`) and Q5_1 (`d, m, qh: u32, qs[16]`): `d = (max - min) / (2^bits - 1)`,
/// `m = min`, `q = floor((x - min)/d + 0.5)`.
fn min_max_block(x: &[f32; QK], bits: u32, out: &mut [u8]) {
    let top = (1u8 << bits) - 1;
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / f32::from(top);
    let inv_d = if d != 0.0 { 1.0 / d } else { 0.0 };
    put_f16(out, 0, d);
    put_f16(out, 2, min);
    let q: [u8; QK] = std::array::from_fn(|i| (((x[i] - min) * inv_d + 0.5) as u8).min(top));
    pack32(&q, bits, out);
}

/// The two K-quants with 6-bit scales and mins per sub-block of 32.
#[derive(Clone, Copy, PartialEq, Eq)]
#[allow(non_camel_case_types)]
enum KMinFormat {
    Q4_K,
    Q5_K,
}

impl KMinFormat {
    /// The top quant level.
    fn nmax(self) -> u8 {
        match self {
            KMinFormat::Q4_K => 15,
            KMinFormat::Q5_K => 31,
        }
    }

    /// The sweep of candidate grids: `nmax + first_offset + 0.1·step` levels across the range
    /// for `step` in `0..=steps` (ggml's choice per format).
    fn sweep(self) -> (f32, usize) {
        match self {
            KMinFormat::Q4_K => (-1.0, 20),
            KMinFormat::Q5_K => (-0.5, 15),
        }
    }
}

/// Fits `x ≈ scale·q - min` with `q` in `0..=nmax` and `min ≥ 0`, minimising `Σ w·err²`
/// (ggml's `make_qkx2_quants`).
///
/// Starts from the grid spanning `[min(x, 0), max(x)]`, then for each candidate grid of the sweep
/// takes its quants, solves the weighted least-squares scale and offset for them (the offset
/// pinned to zero when it would be positive, i.e. when `min` would go negative) and keeps the
/// best. Later candidates span `[offset, max(x)]` from the best offset so far (as in ggml; keeping
/// the lower end at `min(x, 0)` measured 0.3-1% worse RMS error). Writes the chosen quants to `q`
/// and returns `(scale, min)`.
fn fit_scale_min(
    x: &[f32; 32],
    weights: &[f32; 32],
    nmax: u8,
    (first_offset, steps): (f32, usize),
    q: &mut [u8; 32],
) -> (f32, f32) {
    let (mut lo, mut hi) = (x[0], x[0]);
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &w) in x.iter().zip(weights).skip(1) {
        if v < lo {
            lo = v;
        }
        if v > hi {
            hi = v;
        }
        sum_w += w;
        sum_x += w * v;
    }
    if lo > 0.0 {
        lo = 0.0;
    }
    if hi == lo {
        q.fill(0);
        return (0.0, -lo);
    }
    let top = f32::from(nmax);
    let quantize_at = |inv_scale: f32, offset: f32, levels: &mut [f32; 32]| {
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = nearest_level(inv_scale * (v - offset), 0.0, top);
        }
    };
    let weighted_error = |scale: f32, offset: f32, levels: &[f32; 32]| -> f32 {
        let mut error = 0f32;
        for ((&v, &w), &l) in x.iter().zip(weights).zip(levels) {
            let diff = scale * l + offset - v;
            error += w * (diff * diff);
        }
        error
    };

    // `offset` is the value of level 0, i.e. -min; it stays ≤ 0.
    let inv_scale = top / (hi - lo);
    let (mut scale, mut offset) = (1.0 / inv_scale, lo);
    let mut best = [0f32; 32];
    quantize_at(inv_scale, offset, &mut best);
    let mut best_error = weighted_error(scale, offset, &best);

    let mut candidate = [0f32; 32];
    for step in 0..=steps {
        let inv_scale = (first_offset + 0.1 * step as f32 + top) / (hi - offset);
        quantize_at(inv_scale, offset, &mut candidate);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((&l, &v), &w) in candidate.iter().zip(x).zip(weights) {
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_offset = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_offset > 0.0 {
                this_offset = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let error = weighted_error(this_scale, this_offset, &candidate);
            if error < best_error {
                best = candidate;
                best_error = error;
                scale = this_scale;
                offset = this_offset;
            }
        }
    }
    for (l, &level) in q.iter_mut().zip(&best) {
        *l = level as u8;
    }
    (scale, -offset)
}

/// Packs the eight 6-bit scales and mins of Q4_K/Q5_K into 12 bytes (the inverse of
/// [`crate::quant::scale_min_k4`]).
fn pack_scale_min_k4(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = scales[j] | ((scales[j + 4] >> 4) << 6);
        packed[j + 4] = mins[j] | ((mins[j + 4] >> 4) << 6);
        packed[j + 8] = (scales[j + 4] & 0x0f) | ((mins[j + 4] & 0x0f) << 4);
    }
    packed
}

/// Q4_K (`d, dmin, scales[12], qs[128]`) and Q5_K (`d, dmin, scales[12], qh[32], qs[128]`).
///
/// Each sub-block of 32 gets its own fit with weights `rms(sub-block) + |x|` (large elements
/// matter more); its scale and min become 6-bit multiples of `d = max scale / 63` and
/// `dmin = max min / 63`, and the quants are recomputed against those stored values. A
/// sub-block whose stored scale rounds to zero keeps the fit's quants (they multiply zero).
fn k_min_block(x: &[f32; QK_K], format: KMinFormat, out: &mut [u8]) {
    let nmax = format.nmax();
    let mut q = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (j, (sub, sub_q)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let sub: &[f32; 32] = sub.try_into().expect("sub-blocks of 32");
        let sub_q: &mut [u8; 32] = sub_q.try_into().expect("sub-blocks of 32");
        let sum_x2 = sub.iter().fold(0f32, |s, &v| s + v * v);
        let rms = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|i| rms + sub[i].abs());
        (scales[j], mins[j]) = fit_scale_min(sub, &weights, nmax, format.sweep(), sub_q);
    }
    // Scales and mins are ≥ 0 (a negative one can only come from a degenerate fit; it is
    // stored as 0).
    let max_scale = scales.iter().fold(0f32, |m, &s| if s > m { s } else { m });
    let max_min = mins.iter().fold(0f32, |m, &s| if s > m { s } else { m });
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let stored_scales: [u8; 8] =
        std::array::from_fn(|j| nearest_level(inv_scale * scales[j], 0.0, 63.0) as u8);
    let stored_mins: [u8; 8] =
        std::array::from_fn(|j| nearest_level(inv_min * mins[j], 0.0, 63.0) as u8);

    let d = put_f16(out, 0, max_scale / 63.0);
    let dmin = put_f16(out, 2, max_min / 63.0);
    out[4..16].copy_from_slice(&pack_scale_min_k4(&stored_scales, &stored_mins));

    let top = f32::from(nmax);
    for (j, (sub, sub_q)) in x.chunks_exact(32).zip(q.chunks_exact_mut(32)).enumerate() {
        let scale = d * f32::from(stored_scales[j]);
        if scale == 0.0 {
            continue;
        }
        let min = dmin * f32::from(stored_mins[j]);
        for (l, &v) in sub_q.iter_mut().zip(sub) {
            *l = nearest_level((v + min) / scale, 0.0, top) as u8;
        }
    }

    // Byte `l` of chunk `c` holds sub-block 2c in its low nibble and 2c + 1 in its high nibble;
    // Q5_K's fifth bit of sub-block `s` is bit `s` of `qh[l]`.
    let qs_at = if format == KMinFormat::Q5_K { 48 } else { 16 };
    if format == KMinFormat::Q5_K {
        out[16..48].fill(0);
    }
    for chunk in 0..QK_K / 64 {
        for l in 0..32 {
            let (lo, hi) = (q[chunk * 64 + l], q[chunk * 64 + 32 + l]);
            out[qs_at + chunk * 32 + l] = (lo & 0x0f) | ((hi & 0x0f) << 4);
            if format == KMinFormat::Q5_K {
                out[16 + l] |= ((lo >> 4) << (2 * chunk)) | ((hi >> 4) << (2 * chunk + 1));
            }
        }
    }
}

/// Fits `x ≈ scale·l` with `l` in `-nmax..nmax` (one more level below zero than above),
/// minimising `Σ x²·err²` (ggml's `make_qx_quants` with `rmse_type = 1`).
///
/// The element of largest magnitude sets the starting grid (it maps to `-nmax`); nine narrower
/// and nine wider grids are tried, each with its least-squares scale, and the best kept. Writes
/// `l + nmax` to `q` and returns the scale, whose sign is opposite to that element's.
fn fit_symmetric_scale(x: &[f32; 16], nmax: f32, q: &mut [u8; 16]) -> f32 {
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        q.fill(0);
        return 0.0;
    }
    let level_at = |inv_scale: f32, v: f32| nearest_level(inv_scale * v, -nmax, nmax - 1.0);
    // Σ w·x·l and Σ w·l² with w = x², for the quants of grid `inv_scale`.
    let sums = |inv_scale: f32| {
        let (mut sum_lx, mut sum_l2) = (0f32, 0f32);
        for &v in x {
            let l = level_at(inv_scale, v);
            let w = v * v;
            sum_lx += w * v * l;
            sum_l2 += w * l * l;
        }
        (sum_lx, sum_l2)
    };
    let mut store = |inv_scale: f32| {
        for (l, &v) in q.iter_mut().zip(x) {
            *l = (level_at(inv_scale, v) + nmax) as u8;
        }
    };

    let inv_scale = -nmax / max;
    store(inv_scale);
    let (sum_lx, sum_l2) = sums(inv_scale);
    let mut scale = if sum_l2 != 0.0 { sum_lx / sum_l2 } else { 0.0 };
    // The fitted error is Σw·x² - best, so a larger `best = Σw·x·l · scale` is better.
    let mut best = scale * sum_lx;
    for step in (-9..=9).filter(|&s| s != 0) {
        let inv_scale = -(nmax + 0.1 * step as f32) / max;
        let (sum_lx, sum_l2) = sums(inv_scale);
        if sum_l2 > 0.0 && sum_lx * sum_lx > best * sum_l2 {
            store(inv_scale);
            scale = sum_lx / sum_l2;
            best = scale * sum_lx;
        }
    }
    scale
}

/// Q6_K (`ql[128], qh[64], scales: [i8; 16], d`), stored `q = level + 32` in 6 bits.
///
/// Each sub-block of 16 gets its own symmetric fit; the scale of largest magnitude maps to -128,
/// so `d = -max scale / 128` and the other scales are rounded multiples of it (clamped to 127);
/// the quants are recomputed against the stored scales. A block of zeros is all zero bytes.
fn q6_k_block(x: &[f32; QK_K], out: &mut [u8]) {
    const NMAX: f32 = 32.0;
    let mut q = [0u8; QK_K];
    let mut scales = [0f32; 16];
    for (j, (sub, sub_q)) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)).enumerate() {
        let sub: &[f32; 16] = sub.try_into().expect("sub-blocks of 16");
        let sub_q: &mut [u8; 16] = sub_q.try_into().expect("sub-blocks of 16");
        scales[j] = fit_symmetric_scale(sub, NMAX, sub_q);
    }
    let max_scale = signed_absmax(&scales);
    if max_scale.abs() < GROUP_MAX_EPS {
        out.fill(0);
        return;
    }
    let inv_scale = -128.0 / max_scale;
    let d = put_f16(out, 208, 1.0 / inv_scale);
    let stored_scales: [i8; 16] =
        std::array::from_fn(|j| nearest_level(inv_scale * scales[j], -128.0, 127.0) as i8);
    for (byte, &s) in out[192..208].iter_mut().zip(&stored_scales) {
        *byte = s as u8;
    }
    for (j, (sub, sub_q)) in x.chunks_exact(16).zip(q.chunks_exact_mut(16)).enumerate() {
        let scale = d * f32::from(stored_scales[j]);
        if scale == 0.0 {
            continue;
        }
        for (l, &v) in sub_q.iter_mut().zip(sub) {
            *l = (nearest_level(v / scale, -NMAX, NMAX - 1.0) + NMAX) as u8;
        }
    }

    // Per half of 128: `ql[l]` holds elements l (low nibble) and l + 64 (high), `ql[l + 32]`
    // elements l + 32 and l + 96; `qh[l]` their top two bits at 0, 2, 4, 6 for l, l + 32,
    // l + 64, l + 96.
    let (ql, rest) = out.split_at_mut(128);
    let qh = &mut rest[..64];
    for half in 0..2 {
        let (q, ql, qh) = (&q[half * 128..], &mut ql[half * 64..], &mut qh[half * 32..]);
        for l in 0..32 {
            let (a, b, c, e) = (q[l], q[l + 32], q[l + 64], q[l + 96]);
            ql[l] = (a & 0x0f) | ((c & 0x0f) << 4);
            ql[l + 32] = (b & 0x0f) | ((e & 0x0f) << 4);
            qh[l] = (a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;
    use crate::rng::SplitMix64;

    /// Standard normal samples (Box–Muller).
    fn normal(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed);
        (0..n)
            .map(|_| {
                let u1 = 1.0 - rng.unit_f64(); // in (0, 1]
                let u2 = rng.unit_f64();
                ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
            })
            .collect()
    }

    /// Normal samples with about one element in 64 scaled up 8-16x, as in real weight matrices.
    fn with_outliers(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = SplitMix64::new(seed ^ 0xdead_beef);
        let mut x = normal(n, seed);
        for v in &mut x {
            if rng.next_u64().is_multiple_of(64) {
                *v *= 8.0 + 8.0 * rng.unit_f64() as f32;
            }
        }
        x
    }

    fn round_trip(dtype: DType, x: &[f32]) -> Vec<f32> {
        let bytes = quantize(dtype, x).expect("whole blocks of a quantizable type");
        let mut y = vec![0f32; x.len()];
        dequantize_row(dtype, &bytes, &mut y);
        y
    }

    /// RMS of the round-trip error relative to the RMS of the input.
    fn relative_rms_error(dtype: DType, x: &[f32]) -> f64 {
        let y = round_trip(dtype, x);
        let err: f64 = x
            .iter()
            .zip(&y)
            .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
            .sum();
        let norm: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
        (err / norm).sqrt()
    }

    const N: usize = 64 * QK_K;

    /// (type, bound on normal data, bound with outliers): the measured relative RMS error
    /// (in the comment; ggml's reference quantizers give the same, bit for bit) plus about 10%.
    const BOUNDS: [(DType, f64, f64); 11] = [
        (DType::F32, 0.0, 0.0),
        (DType::F16, 2.3e-4, 2.3e-4),    // 0.00021, 0.00021
        (DType::BF16, 1.85e-3, 1.85e-3), // 0.00166, 0.00165
        (DType::Q8_0, 0.0059, 0.0115),   // 0.00535, 0.01047
        (DType::Q6_K, 0.0196, 0.0335),   // 0.01785, 0.03045
        (DType::Q5_1, 0.042, 0.057),     // 0.03787, 0.05142
        (DType::Q5_0, 0.047, 0.092),     // 0.04258, 0.08359
        (DType::Q5_K, 0.040, 0.055),     // 0.03604, 0.04973
        (DType::Q4_1, 0.086, 0.116),     // 0.07808, 0.10557
        (DType::Q4_0, 0.095, 0.165),     // 0.08591, 0.15028
        (DType::Q4_K, 0.079, 0.107),     // 0.07158, 0.09757
    ];

    #[test]
    fn round_trip_error_within_bounds() {
        let normal_data = normal(N, 1);
        let outlier_data = with_outliers(N, 2);
        for (dtype, normal_bound, outlier_bound) in BOUNDS {
            let e_normal = relative_rms_error(dtype, &normal_data);
            let e_outliers = relative_rms_error(dtype, &outlier_data);
            eprintln!("{dtype}: normal {e_normal:.5}, outliers {e_outliers:.5}");
            assert!(
                e_normal <= normal_bound,
                "{dtype} normal: {e_normal} > {normal_bound}"
            );
            assert!(
                e_outliers <= outlier_bound,
                "{dtype} outliers: {e_outliers} > {outlier_bound}"
            );
        }
    }

    #[test]
    fn more_bits_less_error() {
        for x in [normal(N, 3), with_outliers(N, 4)] {
            let e = |dtype| relative_rms_error(dtype, &x);
            assert!(e(DType::Q8_0) < e(DType::Q6_K));
            assert!(e(DType::Q6_K) < e(DType::Q5_K));
            assert!(e(DType::Q5_K) < e(DType::Q4_K));
            assert!(e(DType::Q5_0) < e(DType::Q4_0));
            assert!(e(DType::Q5_1) < e(DType::Q4_1));
            assert!(e(DType::F16) < e(DType::BF16));
        }
    }

    #[test]
    fn k_quants_beat_the_32_element_formats_of_the_same_width() {
        for x in [normal(N, 5), with_outliers(N, 6)] {
            let e = |dtype| relative_rms_error(dtype, &x);
            assert!(e(DType::Q4_K) < e(DType::Q4_0));
            assert!(e(DType::Q4_K) < e(DType::Q4_1));
            assert!(e(DType::Q5_K) < e(DType::Q5_0));
        }
    }

    #[test]
    fn zeros_quantize_to_zeros() {
        let x = vec![0f32; 2 * QK_K];
        for dtype in DType::ALL.into_iter().filter(|&d| quantizable(d)) {
            let y = round_trip(dtype, &x);
            assert!(y.iter().all(|&v| v == 0.0), "{dtype}: {y:?}");
        }
        // Formats whose zero level is code 0 give all-zero bytes, like ggml.
        for dtype in [
            DType::Q4_1,
            DType::Q5_1,
            DType::Q4_K,
            DType::Q5_K,
            DType::Q6_K,
        ] {
            let bytes = quantize(dtype, &x).expect("whole blocks");
            assert!(bytes.iter().all(|&b| b == 0), "{dtype}: {bytes:?}");
        }
    }

    #[test]
    fn zero_blocks_stay_zero_beside_nonzero_ones() {
        // One zero sub-block (and one zero 32-block) inside otherwise normal data.
        let mut x = normal(QK_K, 7);
        x[32..64].fill(0.0);
        for dtype in DType::ALL.into_iter().filter(|&d| quantizable(d)) {
            let y = round_trip(dtype, &x);
            assert!(y.iter().all(|v| v.is_finite()), "{dtype}");
            let zero_block = &y[32..64];
            assert!(
                zero_block.iter().all(|&v| v == 0.0),
                "{dtype}: {zero_block:?}"
            );
        }
    }

    #[test]
    fn constant_blocks_are_exact_up_to_f16_scales() {
        // Not small values: a K-quant super-block scale is about value / (63·31) in f16, which
        // goes subnormal (and coarse) below about 0.1.
        for value in [0.3f32, -0.7, 2.0, -250.0] {
            let x = vec![value; QK_K];
            for dtype in DType::ALL.into_iter().filter(|&d| quantizable(d)) {
                // BF16 keeps 8 significant bits, the others' scales are f16 (11 bits).
                let bound = if dtype == DType::BF16 { 4e-3 } else { 1e-3 };
                let y = round_trip(dtype, &x);
                for &v in &y {
                    let relative = ((v - value) / value).abs();
                    assert!(relative < bound, "{dtype} {value}: got {v}");
                }
            }
        }
    }

    #[test]
    fn f32_is_exact_and_halves_round_to_nearest() {
        let x = with_outliers(1000, 8);
        assert_eq!(round_trip(DType::F32, &x), x);
        let halves = round_trip(DType::F16, &x);
        let brains = round_trip(DType::BF16, &x);
        for ((&v, &h), &b) in x.iter().zip(&halves).zip(&brains) {
            assert_eq!(h, f16::from_f32(v).to_f32());
            assert_eq!(b, bf16::from_f32(v).to_f32());
        }
    }

    /// Eight super-blocks: normal data, data with outliers, then a zero block, a constant
    /// negative block, a single spike and a block of exact ties between levels.
    fn golden_input() -> Vec<f32> {
        let mut x = normal(2 * QK_K, 21);
        x.extend(with_outliers(2 * QK_K, 22));
        x.extend([0f32; QK_K]);
        x.extend([-0.7f32; QK_K]);
        x.extend((0..QK_K).map(|i| if i == 77 { 2.5f32 } else { 0.0 }));
        x.extend((0..QK_K).map(|i| (i % 17) as f32 / 2.0 - 4.0));
        x
    }

    /// FNV-1a, 64 bits.
    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
    }

    /// Hashes of ggml's output for [`golden_input`] as one row: `ggml_quantize_chunk` without
    /// an importance matrix (so `quantize_row_*_ref`) from the llama.cpp vendored by
    /// llama-cpp-python 0.3.36.
    const GGML_GOLDEN: [(DType, u64); 10] = [
        (DType::Q8_0, 0x4051_efad_36e3_a9ea),
        (DType::Q6_K, 0xe176_83e4_cd5a_99f6),
        (DType::Q5_K, 0xbab9_4f74_6c37_2059),
        (DType::Q5_1, 0x0d30_99e0_0de6_dc6b),
        (DType::Q5_0, 0xb27b_3807_d0fd_8c65),
        (DType::Q4_K, 0x2fb4_e7ee_3f87_ce55),
        (DType::Q4_1, 0xdc71_b135_2d81_9788),
        (DType::Q4_0, 0x0da1_374c_9785_1c8f),
        (DType::F16, 0x2b1b_955f_af77_6178),
        (DType::BF16, 0xa685_c9ee_800b_4abe),
    ];

    #[test]
    fn bit_identical_to_ggml_reference_quantizers() {
        let x = golden_input();
        for (dtype, expected) in GGML_GOLDEN {
            let bytes = quantize(dtype, &x).expect("whole blocks");
            assert_eq!(fnv1a(&bytes), expected, "{dtype} differs from ggml");
        }
    }

    #[test]
    fn extreme_inputs_give_blocks_without_panicking() {
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            -f32::MAX,
            1e30,
            -1e-40, // subnormal
            f32::MIN_POSITIVE,
            0.0,
        ];
        let mut rng = SplitMix64::new(9);
        for dtype in DType::ALL.into_iter().filter(|&d| quantizable(d)) {
            for &special in &specials {
                // The special value alone, and sprinkled into normal data.
                let mut x = normal(QK_K, 10);
                for v in &mut x {
                    if rng.next_u64().is_multiple_of(8) {
                        *v = special;
                    }
                }
                for row in [vec![special; QK_K], x] {
                    let bytes = quantize(dtype, &row).expect("whole blocks");
                    let mut y = vec![0f32; QK_K];
                    dequantize_row(dtype, &bytes, &mut y);
                }
            }
        }
        // Finite data within f16 range gives finite values (tiny data may flush to zero).
        for scale in [1e-30f32, 1e-8, 100.0] {
            let x: Vec<f32> = with_outliers(QK_K, 11).iter().map(|v| v * scale).collect();
            for dtype in DType::ALL.into_iter().filter(|&d| quantizable(d)) {
                let y = round_trip(dtype, &x);
                assert!(y.iter().all(|v| v.is_finite()), "{dtype} at {scale}");
            }
        }
    }

    #[test]
    fn bad_lengths_and_types_are_errors() {
        let x = vec![1f32; QK_K + QK];
        assert_eq!(
            quantize(DType::Q4_K, &x),
            Err(QuantizeError::PartialBlock {
                dtype: DType::Q4_K,
                elements: QK_K + QK
            })
        );
        assert!(quantize(DType::Q4_0, &x).is_ok());
        let mut short = vec![0u8; DType::Q4_0.block_bytes() * 8];
        assert_eq!(
            quantize_row(DType::Q4_0, &x, &mut short),
            Err(QuantizeError::OutputSize {
                dtype: DType::Q4_0,
                expected_bytes: 9 * 18,
                actual_bytes: 8 * 18
            })
        );
        assert!(short.iter().all(|&b| b == 0), "nothing written on error");
        for dtype in [DType::Q2_K, DType::Q3_K, DType::Q8_K] {
            assert!(!quantizable(dtype));
            assert_eq!(
                quantize(dtype, &x[..QK_K]),
                Err(QuantizeError::Unsupported(dtype))
            );
        }
        assert_eq!(quantize(DType::Q6_K, &[]), Ok(Vec::new()));
    }
}
