//! AVX2 + FMA kernels (x86_64; the AVX-512 ones in [`avx512`]). Each function here has a scalar
//! reference in `quant`, `ops` or `paged` and is tested against it on random inputs of awkward
//! sizes.
//!
//! Every function is `unsafe` because it must only run on a CPU with AVX2, FMA and F16C
//! (checked once by `dispatch`); each unaligned load reads inside the slices it is given.

#![allow(clippy::missing_safety_doc)]

use std::arch::x86_64::*;

pub(crate) mod avx512;
use avx512::dot_packed_n as dot_packed_n_avx512;

use crate::dtype::{DType, Q8X32_BLOCK_BYTES, Q8XK_BLOCK_BYTES, QK, QK_K};
use crate::packed::Layout;
use crate::paged::{KvDType, Q8_0_BLOCK, Q8_0_BLOCK_BYTES};
use crate::quant::{f16_at, scale_min_k4};

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_ps(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// `Σ a[i]·b[i]` over f32.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (all loads below): i + 32 <= n, resp. i + 8 <= n, keeps every load in bounds.
    while i + 32 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let x = _mm256_loadu_ps(pa.add(i + 8 * k));
            let y = _mm256_loadu_ps(pb.add(i + 8 * k));
            *acc = _mm256_fmadd_ps(x, y, *acc);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(
            _mm256_loadu_ps(pa.add(i)),
            _mm256_loadu_ps(pb.add(i)),
            acc[0],
        );
        i += 8;
    }
    let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let mut total = hsum_ps(sum);
    while i < n {
        total += a[i] * b[i];
        i += 1;
    }
    total
}

/// The wrapping sum of `words`, 16 words (two 64-byte lines) per iteration.
#[target_feature(enable = "avx2")]
pub unsafe fn sum_words(words: &[u64]) -> u64 {
    let p = words.as_ptr();
    let mut acc = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i + 16 <= words.len() {
        for (k, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 16 <= len keeps the four loads of 4 words in bounds.
            *acc = _mm256_add_epi64(*acc, _mm256_loadu_si256(p.add(i + 4 * k) as *const __m256i));
        }
        i += 16;
    }
    let sum = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    let mut lanes = [0u64; 4];
    _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, sum);
    let mut total = lanes.iter().fold(0u64, |a, &w| a.wrapping_add(w));
    for &w in &words[i..] {
        total = total.wrapping_add(w);
    }
    total
}

/// Σ over f16 weights × f32 activations, converting 8 weights at a time with F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_f32(w: &[u8], a: &[f32]) -> f32 {
    let n = a.len().min(w.len() / 2);
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 halves = 32 bytes at byte offset 2i, inside `w`; 16 floats inside `a`.
        let h0 = _mm_loadu_si128(w.as_ptr().add(2 * i) as *const __m128i);
        let h1 = _mm_loadu_si128(w.as_ptr().add(2 * i + 16) as *const __m128i);
        acc0 = _mm256_fmadd_ps(
            _mm256_cvtph_ps(h0),
            _mm256_loadu_ps(a.as_ptr().add(i)),
            acc0,
        );
        acc1 = _mm256_fmadd_ps(
            _mm256_cvtph_ps(h1),
            _mm256_loadu_ps(a.as_ptr().add(i + 8)),
            acc1,
        );
        i += 16;
    }
    let mut total = hsum_ps(_mm256_add_ps(acc0, acc1));
    while i < n {
        total += f16_at(w, 2 * i) * a[i];
        i += 1;
    }
    total
}

/// Eight bf16 at `p` (16 readable bytes, any alignment) as f32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bf16x8_load(p: *const u8) -> __m256 {
    let h = _mm_loadu_si128(p as *const __m128i);
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
}

/// Σ over bf16 weights × f32 activations. A bf16 is the upper half of an f32, so 8 weights
/// widen to 32 bits and shift left by 16 (exact, no rounding).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_bf16_f32(w: &[u8], a: &[f32]) -> f32 {
    let n = a.len().min(w.len() / 2);
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: 16 bf16 = 32 bytes at byte offset 2i, inside `w`; 16 floats inside `a`.
        acc0 = _mm256_fmadd_ps(
            bf16x8_load(w.as_ptr().add(2 * i)),
            _mm256_loadu_ps(a.as_ptr().add(i)),
            acc0,
        );
        acc1 = _mm256_fmadd_ps(
            bf16x8_load(w.as_ptr().add(2 * i + 16)),
            _mm256_loadu_ps(a.as_ptr().add(i + 8)),
            acc1,
        );
        i += 16;
    }
    let mut total = hsum_ps(_mm256_add_ps(acc0, acc1));
    while i < n {
        let bits = u32::from(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) << 16;
        total += f32::from_bits(bits) * a[i];
        i += 1;
    }
    total
}

/// The 32 low/high nibbles of 16 bytes as 32 bytes: elements 0..16 from the low nibbles,
/// 16..32 from the high nibbles (the Q4/Q5 layout).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles_32(p: *const u8) -> __m256i {
    let raw = _mm_loadu_si128(p as *const __m128i);
    let mask = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    _mm256_set_m128i(hi, lo)
}

/// Byte `i` = 0x10 where bit `i` of `bits` is set, else 0 (the fifth bit of Q5 quants).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn fifth_bits(bits: u32) -> __m256i {
    // Spread byte k of `bits` over bytes 8k..8k+8, then test one bit per byte.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    let select = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Σ over one block: unsigned weight bytes (0..=63) × signed activation bytes, as 8 i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn mul_u8_i8(q: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), _mm256_set1_epi16(1))
}

/// An f16 at `p` (any alignment) as f32, converted by F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_load(p: *const u8) -> f32 {
    let bits = std::ptr::read_unaligned(p as *const u16);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

#[inline]
unsafe fn f32_load(p: *const u8) -> f32 {
    std::ptr::read_unaligned(p as *const f32)
}

// The 32-element formats, as const-generic kernel parameters.
const K_Q4_0: u8 = 0;
const K_Q4_1: u8 = 1;
const K_Q5_0: u8 = 2;
const K_Q5_1: u8 = 3;
const K_Q8_0: u8 = 4;

/// One block of a 32-element format against one Q8x32 activation block: returns the integer
/// dot as 8 i32 lanes and adds the block's offset term (`-8·d·s`, `-16·d·s` or `m·s`) to `offset`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_q32<const K: u8>(
    wb: *const u8,
    ab: *const u8,
    dw: f32,
    offset: &mut f32,
) -> __m256i {
    let y = _mm256_loadu_si256(ab.add(8) as *const __m256i);
    let sa = f32_load(ab.add(4));
    match K {
        K_Q4_0 => {
            *offset -= 8.0 * dw * sa;
            mul_u8_i8(nibbles_32(wb.add(2)), y)
        }
        K_Q4_1 => {
            *offset += f16_load(wb.add(2)) * sa;
            mul_u8_i8(nibbles_32(wb.add(4)), y)
        }
        K_Q5_0 | K_Q5_1 => {
            let header = if K == K_Q5_0 { 2 } else { 4 };
            let qh = std::ptr::read_unaligned(wb.add(header) as *const u32);
            let q = _mm256_or_si256(nibbles_32(wb.add(header + 4)), fifth_bits(qh));
            if K == K_Q5_0 {
                *offset -= 16.0 * dw * sa;
            } else {
                *offset += f16_load(wb.add(2)) * sa;
            }
            mul_u8_i8(q, y)
        }
        _ => {
            // Both operands signed: move the sign of x onto y, multiply |x| (unsigned) by it.
            let x = _mm256_loadu_si256(wb.add(2) as *const __m256i);
            mul_u8_i8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q32<const K: u8>(w: *const u8, a: *const u8, nb: usize, bb: usize) -> f32 {
    // Two independent accumulator chains hide the FMA latency.
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut off0, mut off1) = (0f32, 0f32);
    let mut b = 0;
    while b + 2 <= nb {
        let (w0, a0) = (w.add(b * bb), a.add(b * Q8X32_BLOCK_BYTES));
        let (w1, a1) = (w0.add(bb), a0.add(Q8X32_BLOCK_BYTES));
        let (d0, d1) = (f16_load(w0), f16_load(w1));
        let s0 = block_q32::<K>(w0, a0, d0, &mut off0);
        let s1 = block_q32::<K>(w1, a1, d1, &mut off1);
        acc0 = _mm256_fmadd_ps(
            _mm256_set1_ps(d0 * f32_load(a0)),
            _mm256_cvtepi32_ps(s0),
            acc0,
        );
        acc1 = _mm256_fmadd_ps(
            _mm256_set1_ps(d1 * f32_load(a1)),
            _mm256_cvtepi32_ps(s1),
            acc1,
        );
        b += 2;
    }
    if b < nb {
        let (w0, a0) = (w.add(b * bb), a.add(b * Q8X32_BLOCK_BYTES));
        let d0 = f16_load(w0);
        let s0 = block_q32::<K>(w0, a0, d0, &mut off0);
        acc0 = _mm256_fmadd_ps(
            _mm256_set1_ps(d0 * f32_load(a0)),
            _mm256_cvtepi32_ps(s0),
            acc0,
        );
    }
    hsum_ps(_mm256_add_ps(acc0, acc1)) + off0 + off1
}

/// Decodes one weight block of a 32-element format once: the quants as bytes (unsigned for
/// Q4/Q5, signed for Q8_0), the scale, and the per-block offset factor applied to the
/// activations' sums (`-8·d`, `-16·d`, `m`; 0 for Q8_0).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_q32<const K: u8>(wb: *const u8) -> (__m256i, f32, f32) {
    let d = f16_load(wb);
    match K {
        K_Q4_0 => (nibbles_32(wb.add(2)), d, -8.0 * d),
        K_Q4_1 => (nibbles_32(wb.add(4)), d, f16_load(wb.add(2))),
        K_Q5_0 | K_Q5_1 => {
            let header = if K == K_Q5_0 { 2 } else { 4 };
            let qh = std::ptr::read_unaligned(wb.add(header) as *const u32);
            let q = _mm256_or_si256(nibbles_32(wb.add(header + 4)), fifth_bits(qh));
            (
                q,
                d,
                if K == K_Q5_0 {
                    -16.0 * d
                } else {
                    f16_load(wb.add(2))
                },
            )
        }
        _ => (_mm256_loadu_si256(wb.add(2) as *const __m256i), d, 0.0),
    }
}

/// Activation rows multiplied with each decoded weight block (the weight bytes are read and
/// unpacked once for all of them).
pub const ROWS: usize = 4;

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q32_rows<const K: u8>(
    w: *const u8,
    acts: [*const u8; ROWS],
    nb: usize,
    bb: usize,
) -> [f32; ROWS] {
    // Even and odd blocks accumulate separately and are summed in the same order as
    // [`dot_q32`], so a row gets bit-identical results alone or batched with others.
    let mut acc = [[_mm256_setzero_ps(); ROWS]; 2];
    let mut off = [[0f32; ROWS]; 2];
    let mut block = |b: usize, chain: usize| {
        let (q, d, offset) = decode_q32::<K>(w.add(b * bb));
        let abs_q = if K == K_Q8_0 {
            _mm256_sign_epi8(q, q)
        } else {
            q
        };
        for r in 0..ROWS {
            let ab = acts[r].add(b * Q8X32_BLOCK_BYTES);
            let y = _mm256_loadu_si256(ab.add(8) as *const __m256i);
            let sum = if K == K_Q8_0 {
                mul_u8_i8(abs_q, _mm256_sign_epi8(y, q))
            } else {
                mul_u8_i8(q, y)
            };
            acc[chain][r] = _mm256_fmadd_ps(
                _mm256_set1_ps(d * f32_load(ab)),
                _mm256_cvtepi32_ps(sum),
                acc[chain][r],
            );
            off[chain][r] += offset * f32_load(ab.add(4));
        }
    };
    let mut b = 0;
    while b + 2 <= nb {
        block(b, 0);
        block(b + 1, 1);
        b += 2;
    }
    if b < nb {
        block(b, 0);
    }
    std::array::from_fn(|r| hsum_ps(_mm256_add_ps(acc[0][r], acc[1][r])) + off[0][r] + off[1][r])
}

/// [`vec_dot_q32`] of one weight row against [`ROWS`] activation rows at once.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q32_rows(
    dtype: DType,
    w: &[u8],
    acts: [&[u8]; ROWS],
    n: usize,
) -> [f32; ROWS] {
    let nb = n / QK;
    let bb = dtype.block_bytes();
    assert!(w.len() >= nb * bb, "weight row too short");
    assert!(
        acts.iter().all(|a| a.len() >= nb * Q8X32_BLOCK_BYTES),
        "activation row too short"
    );
    // SAFETY: the lengths were checked above; every block read stays inside them.
    let ptrs = acts.map(|a| a.as_ptr());
    let w = w.as_ptr();
    match dtype {
        DType::Q4_0 => dot_q32_rows::<K_Q4_0>(w, ptrs, nb, bb),
        DType::Q4_1 => dot_q32_rows::<K_Q4_1>(w, ptrs, nb, bb),
        DType::Q5_0 => dot_q32_rows::<K_Q5_0>(w, ptrs, nb, bb),
        DType::Q5_1 => dot_q32_rows::<K_Q5_1>(w, ptrs, nb, bb),
        DType::Q8_0 => dot_q32_rows::<K_Q8_0>(w, ptrs, nb, bb),
        other => panic!("vec_dot_q32_rows called for {other}"),
    }
}

/// Dot product of a row of a 32-element format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with a Q8x32
/// activation row of `n` elements.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q32(dtype: DType, w: &[u8], a: &[u8], n: usize) -> f32 {
    let nb = n / QK;
    let bb = dtype.block_bytes();
    assert!(
        w.len() >= nb * bb && a.len() >= nb * Q8X32_BLOCK_BYTES,
        "rows too short"
    );
    // SAFETY: the lengths were checked above; every block read stays inside them.
    let (w, a) = (w.as_ptr(), a.as_ptr());
    match dtype {
        DType::Q4_0 => dot_q32::<K_Q4_0>(w, a, nb, bb),
        DType::Q4_1 => dot_q32::<K_Q4_1>(w, a, nb, bb),
        DType::Q5_0 => dot_q32::<K_Q5_0>(w, a, nb, bb),
        DType::Q5_1 => dot_q32::<K_Q5_1>(w, a, nb, bb),
        DType::Q8_0 => dot_q32::<K_Q8_0>(w, a, nb, bb),
        other => panic!("vec_dot_q32 called for {other}"),
    }
}

/// Q4_K or Q5_K row × Q8xK activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q45k(dtype: DType, w: &[u8], a: &[u8], n: usize) -> f32 {
    let nb = n / QK_K;
    let bb = dtype.block_bytes();
    assert!(
        w.len() >= nb * bb && a.len() >= nb * Q8XK_BLOCK_BYTES,
        "rows too short"
    );
    let five = dtype == DType::Q5_K;
    let mask = _mm256_set1_epi8(0x0f);
    let mut total = 0f32;
    for b in 0..nb {
        let wb = &w[b * bb..];
        let ab = &a[b * Q8XK_BLOCK_BYTES..];
        let da = f32_load(ab.as_ptr());
        let (d, dmin) = (
            f16_load(wb.as_ptr()) * da,
            f16_load(wb.as_ptr().add(2)) * da,
        );
        let mut mins = 0i32;
        let mut scales = [0i16; 8];
        for (j, s) in scales.iter_mut().enumerate() {
            let (sc, m) = scale_min_k4(j, &wb[4..16]);
            *s = i16::from(sc);
            let bsum = i16::from_le_bytes([ab[260 + 4 * j], ab[261 + 4 * j]]) as i32
                + i16::from_le_bytes([ab[262 + 4 * j], ab[263 + 4 * j]]) as i32;
            mins += i32::from(m) * bsum;
        }
        let (qh, qs) = if five {
            (&wb[16..48], &wb[48..176])
        } else {
            (&wb[16..16], &wb[16..144])
        };
        // SAFETY: qh is 32 bytes when present.
        let high = if five {
            _mm256_loadu_si256(qh.as_ptr() as *const __m256i)
        } else {
            _mm256_setzero_si256()
        };
        let mut sum = _mm256_setzero_si256();
        for chunk in 0..4 {
            // SAFETY: 32 bytes of quants per chunk; 64 activation bytes per chunk.
            let raw = _mm256_loadu_si256(qs.as_ptr().add(chunk * 32) as *const __m256i);
            let mut lo = _mm256_and_si256(raw, mask);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
            if five {
                let bit_lo = _mm256_set1_epi8(1 << (2 * chunk));
                let bit_hi = _mm256_set1_epi8((1u8 << (2 * chunk + 1)) as i8);
                let h_lo = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit_lo), bit_lo);
                let h_hi = _mm256_cmpeq_epi8(_mm256_and_si256(high, bit_hi), bit_hi);
                lo = _mm256_or_si256(lo, _mm256_and_si256(h_lo, _mm256_set1_epi8(0x10)));
                hi = _mm256_or_si256(hi, _mm256_and_si256(h_hi, _mm256_set1_epi8(0x10)));
            }
            let y_lo = _mm256_loadu_si256(ab.as_ptr().add(4 + chunk * 64) as *const __m256i);
            let y_hi = _mm256_loadu_si256(ab.as_ptr().add(4 + chunk * 64 + 32) as *const __m256i);
            let p_lo = _mm256_madd_epi16(
                _mm256_maddubs_epi16(lo, y_lo),
                _mm256_set1_epi16(scales[2 * chunk]),
            );
            let p_hi = _mm256_madd_epi16(
                _mm256_maddubs_epi16(hi, y_hi),
                _mm256_set1_epi16(scales[2 * chunk + 1]),
            );
            sum = _mm256_add_epi32(sum, _mm256_add_epi32(p_lo, p_hi));
        }
        total += d * hsum_epi32(sum) as f32 - dmin * mins as f32;
    }
    total
}

/// Q2_K or Q3_K row × Q8xK activations. Both store 2 low bits per quant in the same order; Q3_K
/// adds a high bit (from `hmask`) and signed 6-bit scales, Q2_K 4-bit scales and mins.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q23k(dtype: DType, w: &[u8], a: &[u8], n: usize) -> f32 {
    let nb = n / QK_K;
    let bb = dtype.block_bytes();
    assert!(
        w.len() >= nb * bb && a.len() >= nb * Q8XK_BLOCK_BYTES,
        "rows too short"
    );
    let three = dtype == DType::Q3_K;
    let m3 = _mm256_set1_epi8(3);
    let mut total = 0f32;
    for b in 0..nb {
        let wb = w.as_ptr().add(b * bb);
        let ab = a.as_ptr().add(b * Q8XK_BLOCK_BYTES);
        let da = f32_load(ab);
        // Per-group scales (and Q2_K mins), and the correction applied through the group sums.
        let mut scales = [0i16; 16];
        let correction: i32;
        let d: f32;
        let mut dmin = 0f32;
        let bsum =
            |g: usize| i32::from(std::ptr::read_unaligned(ab.add(260 + 2 * g) as *const i16));
        let (qs, hmask) = if three {
            let sc = crate::quant::q3k_scales(std::slice::from_raw_parts(wb.add(96), 12));
            let mut c = 0;
            for g in 0..16 {
                scales[g] = i16::from(sc[g]);
                c += i32::from(sc[g]) * bsum(g);
            }
            // Quants are stored +4 (the high bit set means "no -4"), so subtract 4·Σ scale·sum.
            correction = 4 * c;
            d = f16_load(wb.add(108)) * da;
            (wb.add(32), _mm256_loadu_si256(wb as *const __m256i))
        } else {
            let mut mins = 0;
            for (g, scale) in scales.iter_mut().enumerate() {
                let s = *wb.add(g);
                *scale = i16::from(s & 0x0f);
                mins += i32::from(s >> 4) * bsum(g);
            }
            correction = 0;
            d = f16_load(wb.add(80)) * da;
            dmin = f16_load(wb.add(82)) * da * mins as f32;
            (wb.add(16), _mm256_setzero_si256())
        };
        let mut sum = _mm256_setzero_si256();
        for half in 0..2 {
            let raw = _mm256_loadu_si256(qs.add(half * 32) as *const __m256i);
            for step in 0..4 {
                let mut q = _mm256_and_si256(
                    _mm256_srlv_epi32(raw, _mm256_set1_epi32(2 * step as i32)),
                    m3,
                );
                if three {
                    let bit = _mm256_set1_epi8((1u8 << (half * 4 + step)) as i8);
                    let high = _mm256_cmpeq_epi8(_mm256_and_si256(hmask, bit), bit);
                    q = _mm256_or_si256(q, _mm256_and_si256(high, _mm256_set1_epi8(4)));
                }
                let y = _mm256_loadu_si256(ab.add(4 + half * 128 + step * 32) as *const __m256i);
                let g = half * 8 + step * 2;
                let sc = _mm256_set_m128i(_mm_set1_epi16(scales[g + 1]), _mm_set1_epi16(scales[g]));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), sc));
            }
        }
        total += d * (hsum_epi32(sum) - correction) as f32 - dmin;
    }
    total
}

/// Q6_K row × Q8xK activations.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn vec_dot_q6k(w: &[u8], a: &[u8], n: usize) -> f32 {
    let nb = n / QK_K;
    let bb = DType::Q6_K.block_bytes();
    assert!(
        w.len() >= nb * bb && a.len() >= nb * Q8XK_BLOCK_BYTES,
        "rows too short"
    );
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(0x03);
    let mut total = 0f32;
    for b in 0..nb {
        let wb = &w[b * bb..];
        let ab = &a[b * Q8XK_BLOCK_BYTES..];
        let d = f16_load(wb.as_ptr().add(208)) * f32_load(ab.as_ptr());
        let scales: [i8; 16] = std::array::from_fn(|g| wb[192 + g] as i8);
        // The -32 bias of every quant, applied once through the group sums of the activations.
        let mut bias = 0i32;
        for (g, &sc) in scales.iter().enumerate() {
            bias +=
                i32::from(sc) * i32::from(i16::from_le_bytes([ab[260 + 2 * g], ab[261 + 2 * g]]));
        }
        let mut sum = _mm256_setzero_si256();
        for half in 0..2 {
            // SAFETY: ql is 64 bytes and qh 32 bytes per half; activations 128 bytes per half.
            let ql0 = _mm256_loadu_si256(wb.as_ptr().add(half * 64) as *const __m256i);
            let ql1 = _mm256_loadu_si256(wb.as_ptr().add(half * 64 + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(wb.as_ptr().add(128 + half * 32) as *const __m256i);
            let quants = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4),
                ),
            ];
            for (k, q) in quants.into_iter().enumerate() {
                let offset = half * 128 + k * 32;
                let y = _mm256_loadu_si256(ab.as_ptr().add(4 + offset) as *const __m256i);
                let g = offset / 16;
                let sc = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(scales[g + 1])),
                    _mm_set1_epi16(i16::from(scales[g])),
                );
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(q, y), sc));
            }
        }
        total += d * (hsum_epi32(sum) - 32 * bias) as f32;
    }
    total
}

/// Quantizes activations into Q8x32 blocks (same rounding as the reference: nearest, ties to
/// even).
#[target_feature(enable = "avx2,fma")]
pub unsafe fn quantize_q8x32(x: &[f32], out: &mut [u8]) {
    let sign_mask = _mm256_set1_ps(-0.0);
    for (block, xs) in out
        .chunks_exact_mut(Q8X32_BLOCK_BYTES)
        .zip(x.chunks_exact(QK))
    {
        // SAFETY: each chunk holds 32 floats.
        let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(xs.as_ptr().add(8 * k)));
        let mut amax = _mm256_andnot_ps(sign_mask, v[0]);
        for vk in &v[1..] {
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, *vk));
        }
        let m128 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        let m128 = _mm_max_ps(m128, _mm_movehl_ps(m128, m128));
        let m128 = _mm_max_ss(m128, _mm_movehdup_ps(m128));
        let max = _mm_cvtss_f32(m128);
        let d = max / 127.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let mut ints = [_mm256_setzero_si256(); 4];
        for k in 0..4 {
            let scaled = _mm256_mul_ps(v[k], inv);
            // The default MXCSR rounding is to nearest, ties to even.
            ints[k] = _mm256_cvtps_epi32(scaled);
        }
        let sum = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        let s = hsum_epi32(sum);
        // Pack 32 i32 → 32 i8 and undo the lane interleaving of the packs.
        let p01 = _mm256_packs_epi32(ints[0], ints[1]);
        let p23 = _mm256_packs_epi32(ints[2], ints[3]);
        let p = _mm256_packs_epi16(p01, p23);
        let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        block[0..4].copy_from_slice(&d.to_le_bytes());
        block[4..8].copy_from_slice(&(d * s as f32).to_le_bytes());
        _mm256_storeu_si256(block.as_mut_ptr().add(8) as *mut __m256i, p);
    }
}

/// e^x for 8 lanes: range reduction x = n·ln2 + r (|r| ≤ ln2/2), a degree-6 polynomial for
/// e^r, and 2^n built in the exponent bits. Relative error < 2e-7 for x in [-87, 88]; inputs
/// below -87 give 0 (softmax weights that small do not matter).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_ps(x: __m256) -> __m256 {
    let x = _mm256_min_ps(x, _mm256_set1_ps(88.0));
    let underflow = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(-87.0));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    // r = x - n·ln2 in two steps for precision.
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm256_set1_ps(1.0 / 720.0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 120.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 24.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0 / 6.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0));
    let pow2n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    _mm256_andnot_ps(underflow, _mm256_mul_ps(p, pow2n))
}

/// `gate[i] = act(gate[i]) · up[i]` for the gated feed-forward activations, both of the form
/// `x / (1 + e^(-k))`: SiLU with `k = x`, GELU's tanh form with `k = 2·√(2/π)·(x + 0.044715·x³)`
/// (`0.5·x·(1 + tanh(u)) = x·σ(2u)`). The tail past a multiple of 8 uses the scalar functions.
///
/// # Safety
/// AVX2 and FMA must be present.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gated_activation(gelu: bool, gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let (g, u) = (gate.as_mut_ptr(), up.as_ptr());
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    while i + 8 <= n {
        let x = _mm256_loadu_ps(g.add(i));
        let k = if gelu {
            // 2·√(2/π)·(x + 0.044715·x³) = x·(c1 + c3·x²)
            let x2 = _mm256_mul_ps(x, x);
            let poly = _mm256_fmadd_ps(
                x2,
                _mm256_set1_ps(1.595_769_2 * 0.044_715),
                _mm256_set1_ps(1.595_769_2),
            );
            _mm256_mul_ps(x, poly)
        } else {
            x
        };
        let e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), k));
        let act = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(g.add(i), _mm256_mul_ps(act, _mm256_loadu_ps(u.add(i))));
        i += 8;
    }
    for j in i..n {
        let x = *g.add(j);
        let act = if gelu {
            crate::ops::gelu(x)
        } else {
            crate::ops::silu(x)
        };
        *g.add(j) = act * *u.add(j);
    }
}

/// One query head attending over `keys` cached positions: `out = softmax(q·Kᵀ·scale)·V`.
/// `k`/`v` rows are `stride` floats apart, the head's slice starting at `offset`; `head_dim` is
/// 16, 32, 64, 80, 96 or 128 (other sizes use the scalar reference); `scores` holds at least `keys`
/// floats.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    keys: usize,
    stride: usize,
    offset: usize,
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> bool {
    let hd = q.len();
    assert!(out.len() == hd && scores.len() >= keys);
    assert!(keys == 0 || (keys - 1) * stride + offset + hd <= k.len().min(v.len()));
    match hd {
        16 => attend_lanes::<2>(q, k, v, keys, stride, offset, scale, scores, out),
        32 => attend_lanes::<4>(q, k, v, keys, stride, offset, scale, scores, out),
        64 => attend_lanes::<8>(q, k, v, keys, stride, offset, scale, scores, out),
        80 => attend_lanes::<10>(q, k, v, keys, stride, offset, scale, scores, out),
        96 => attend_lanes::<12>(q, k, v, keys, stride, offset, scale, scores, out),
        128 => attend_lanes::<16>(q, k, v, keys, stride, offset, scale, scores, out),
        _ => return false,
    }
    true
}

#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_lanes<const LANES: usize>(
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
    let qv: [__m256; LANES] = std::array::from_fn(|j| _mm256_loadu_ps(q.as_ptr().add(8 * j)));
    let dot = |t: usize| -> __m256 {
        let kp = k.as_ptr().add(t * stride + offset);
        let mut acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kp));
        for (j, lane) in qv.iter().enumerate().skip(1) {
            acc = _mm256_fmadd_ps(*lane, _mm256_loadu_ps(kp.add(8 * j)), acc);
        }
        acc
    };
    let vscale = _mm_set1_ps(scale);
    let mut vmax4 = _mm_set1_ps(f32::NEG_INFINITY);
    let mut t = 0;
    // Four keys at a time: three horizontal adds reduce four dot products at once.
    while t + 4 <= keys {
        let (a0, a1, a2, a3) = (dot(t), dot(t + 1), dot(t + 2), dot(t + 3));
        let h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        let s4 = _mm_mul_ps(
            _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h)),
            vscale,
        );
        _mm_storeu_ps(scores.as_mut_ptr().add(t), s4);
        vmax4 = _mm_max_ps(vmax4, s4);
        t += 4;
    }
    let vmax4 = _mm_max_ps(vmax4, _mm_movehl_ps(vmax4, vmax4));
    let mut max = _mm_cvtss_f32(_mm_max_ss(vmax4, _mm_movehdup_ps(vmax4)));
    while t < keys {
        let s = hsum_ps(dot(t)) * scale;
        scores[t] = s;
        max = max.max(s);
        t += 1;
    }
    // exp and sum, 8 scores at a time.
    let vmax = _mm256_set1_ps(max);
    let mut vsum = _mm256_setzero_ps();
    let mut t = 0;
    while t + 8 <= keys {
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(scores.as_ptr().add(t)), vmax));
        _mm256_storeu_ps(scores.as_mut_ptr().add(t), e);
        vsum = _mm256_add_ps(vsum, e);
        t += 8;
    }
    let mut sum = hsum_ps(vsum);
    while t < keys {
        let e = (scores[t] - max).exp();
        scores[t] = e;
        sum += e;
        t += 1;
    }
    let mut acc = [_mm256_setzero_ps(); LANES];
    for (t, &p) in scores.iter().enumerate().take(keys) {
        let vp = v.as_ptr().add(t * stride + offset);
        let w = _mm256_set1_ps(p);
        for (j, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(w, _mm256_loadu_ps(vp.add(8 * j)), *a);
        }
    }
    let inv = _mm256_set1_ps(1.0 / sum);
    for (j, a) in acc.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * j), _mm256_mul_ps(*a, inv));
    }
}

// KV cache element types, as const-generic kernel parameters.
const KV_F32: u8 = 0;
const KV_F16: u8 = 1;
const KV_Q8_0: u8 = 2;

/// Query heads the value kernel accumulates at once (each value chunk is decoded once for them).
const KV_VALUE_TILE: usize = 4;

/// 8-value chunks of a KV head row that share one scale (a Q8_0 block; 1 for float types).
const fn kv_scale_span(d: u8) -> usize {
    if d == KV_Q8_0 {
        Q8_0_BLOCK / 8
    } else {
        1
    }
}

/// The scale of chunk `c` of a KV head row of format `D` starting at `row`: the f16 scale of
/// Q8_0 block `c/4`, broadcast (unused by the float types).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kv_scale<const D: u8>(row: *const u8, c: usize) -> __m256 {
    if D == KV_Q8_0 {
        _mm256_set1_ps(f16_load(row.add(c / 4 * Q8_0_BLOCK_BYTES)))
    } else {
        _mm256_setzero_ps()
    }
}

/// Values `8c..8c+8` of a KV head row of format `D` starting at `row`, as f32: loaded (f32),
/// converted by F16C (f16), or dequantized as `scale·q` from Q8_0 block `c/4` (an f16 scale,
/// then 32 signed quants; `scale` from [`kv_scale`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kv_load8<const D: u8>(row: *const u8, c: usize, scale: __m256) -> __m256 {
    match D {
        KV_F32 => _mm256_loadu_ps(row.add(32 * c) as *const f32),
        KV_F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(16 * c) as *const __m128i)),
        _ => {
            let quants = row.add(c / 4 * Q8_0_BLOCK_BYTES + 2 + c % 4 * 8);
            let q = _mm_loadl_epi64(quants as *const __m128i);
            _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale)
        }
    }
}

/// The four horizontal sums of `a`, `b`, `c`, `d`, in that order.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum4_ps(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))
}

/// Dot products of `G` query heads (`q`, `head_dim` apart) with `S` key rows (`stride` bytes
/// apart from `k`), as `S·G` vectors to reduce: each chunk of a key row is decoded once for all
/// `G` heads, each query chunk loaded once for all `S` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn kv_dots<const D: u8, const G: usize, const S: usize>(
    k: *const u8,
    stride: usize,
    q: *const f32,
    head_dim: usize,
) -> [[__m256; G]; S] {
    let mut acc = [[_mm256_setzero_ps(); G]; S];
    let span = kv_scale_span(D);
    // head_dim is a multiple of 8, and of 32 for Q8_0 (checked by the callers).
    for first in (0..head_dim / 8).step_by(span) {
        let scales: [__m256; S] = std::array::from_fn(|s| kv_scale::<D>(k.add(s * stride), first));
        for c in first..first + span {
            let qv: [__m256; G] =
                std::array::from_fn(|g| _mm256_loadu_ps(q.add(g * head_dim + 8 * c)));
            for (s, acc_s) in acc.iter_mut().enumerate() {
                let key = kv_load8::<D>(k.add(s * stride), c, scales[s]);
                for (a, qg) in acc_s.iter_mut().zip(&qv) {
                    *a = _mm256_fmadd_ps(*qg, key, *a);
                }
            }
        }
    }
    acc
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn kv_scores_tile<const D: u8, const G: usize>(
    k: *const u8,
    stride: usize,
    slots: usize,
    q: *const f32,
    head_dim: usize,
    scale: f32,
    scores: *mut f32,
    score_stride: usize,
) {
    let vscale = _mm_set1_ps(scale);
    let mut s = 0;
    // Four key rows at a time: one horizontal reduction gives a head's four scores at once.
    while s + 4 <= slots {
        let [a0, a1, a2, a3] = kv_dots::<D, G, 4>(k.add(s * stride), stride, q, head_dim);
        for g in 0..G {
            let sums = hsum4_ps(a0[g], a1[g], a2[g], a3[g]);
            _mm_storeu_ps(scores.add(g * score_stride + s), _mm_mul_ps(sums, vscale));
        }
        s += 4;
    }
    while s < slots {
        let [row] = kv_dots::<D, G, 1>(k.add(s * stride), stride, q, head_dim);
        for (g, a) in row.iter().enumerate() {
            *scores.add(g * score_stride + s) = hsum_ps(*a) * scale;
        }
        s += 1;
    }
}

/// Query heads the score kernel carries in registers at once (with four key rows: 12
/// accumulators).
const KV_SCORE_TILE: usize = 3;

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn kv_scores_typed<const D: u8>(
    k: *const u8,
    stride: usize,
    slots: usize,
    q: *const f32,
    group: usize,
    head_dim: usize,
    scale: f32,
    scores: *mut f32,
    score_stride: usize,
) {
    let mut g = 0;
    while g < group {
        // Four heads go as two pairs rather than three and one.
        let tile = match group - g {
            4 => 2,
            left => left.min(KV_SCORE_TILE),
        };
        let (q, scores) = (q.add(g * head_dim), scores.add(g * score_stride));
        let tile_fn = match tile {
            1 => kv_scores_tile::<D, 1>,
            2 => kv_scores_tile::<D, 2>,
            _ => kv_scores_tile::<D, 3>,
        };
        tile_fn(k, stride, slots, q, head_dim, scale, scores, score_stride);
        g += tile;
    }
}

/// Paged-attention scores: `scores[g·score_stride + s] = q_g · K_s · scale` for the query heads
/// `q` (`group × head_dim`) and `slots` key rows of `dtype`, row `s` starting at byte
/// `s·stride` of `k` (the head's values within a token slot). `head_dim` is a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn kv_scores(
    dtype: KvDType,
    k: &[u8],
    stride: usize,
    slots: usize,
    q: &[f32],
    head_dim: usize,
    scale: f32,
    scores: &mut [f32],
    score_stride: usize,
) {
    let group = q.len() / head_dim;
    assert!(head_dim.is_multiple_of(8) && dtype.supports(head_dim) && q.len() == group * head_dim);
    if slots == 0 || group == 0 {
        return;
    }
    assert!(
        (slots - 1) * stride + dtype.row_bytes(head_dim) <= k.len(),
        "key rows outside the cache slice"
    );
    assert!(
        (group - 1) * score_stride + slots <= scores.len(),
        "scores outside their buffer"
    );
    // SAFETY: every key row and score written lies inside the slices (checked above).
    let (k, q, out) = (k.as_ptr(), q.as_ptr(), scores.as_mut_ptr());
    match dtype {
        KvDType::F32 => kv_scores_typed::<KV_F32>(
            k,
            stride,
            slots,
            q,
            group,
            head_dim,
            scale,
            out,
            score_stride,
        ),
        KvDType::F16 => kv_scores_typed::<KV_F16>(
            k,
            stride,
            slots,
            q,
            group,
            head_dim,
            scale,
            out,
            score_stride,
        ),
        KvDType::Q8_0 => kv_scores_typed::<KV_Q8_0>(
            k,
            stride,
            slots,
            q,
            group,
            head_dim,
            scale,
            out,
            score_stride,
        ),
    }
}

/// `C` chunks (from chunk `first`) of `G` heads' accumulators over all `slots` value rows: the
/// `C·G` accumulators stay in registers as independent FMA chains, and each value chunk is
/// decoded once for all `G` heads. `first` is a multiple of `C`, `C` a power of two, so the
/// tile's chunks `j` use Q8_0 blocks `first/4 + j/4`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn kv_values_tile<const D: u8, const G: usize, const C: usize>(
    v: *const u8,
    stride: usize,
    slots: usize,
    probs: *const f32,
    prob_stride: usize,
    acc: *mut f32,
    head_dim: usize,
    first: usize,
) {
    let mut sums: [[__m256; C]; G] = std::array::from_fn(|g| {
        std::array::from_fn(|j| _mm256_loadu_ps(acc.add(g * head_dim + 8 * (first + j))))
    });
    for s in 0..slots {
        let row = v.add(s * stride);
        let p: [__m256; G] =
            std::array::from_fn(|g| _mm256_set1_ps(*probs.add(g * prob_stride + s)));
        let mut scale = _mm256_setzero_ps();
        for j in 0..C {
            if j % 4 == 0 {
                scale = kv_scale::<D>(row, first + j);
            }
            let value = kv_load8::<D>(row, first + j, scale);
            for (sums_g, p_g) in sums.iter_mut().zip(&p) {
                sums_g[j] = _mm256_fmadd_ps(*p_g, value, sums_g[j]);
            }
        }
    }
    for (g, sums_g) in sums.iter().enumerate() {
        for (j, sum) in sums_g.iter().enumerate() {
            _mm256_storeu_ps(acc.add(g * head_dim + 8 * (first + j)), *sum);
        }
    }
}

/// Signature of the value tile kernels.
type ValuesTile = unsafe fn(*const u8, usize, usize, *const f32, usize, *mut f32, usize, usize);

/// The value tile of `G` heads and `chunks` chunks.
fn kv_values_tile_fn<const D: u8, const G: usize>(chunks: usize) -> ValuesTile {
    match chunks {
        8 => kv_values_tile::<D, G, 8>,
        4 => kv_values_tile::<D, G, 4>,
        2 => kv_values_tile::<D, G, 2>,
        _ => kv_values_tile::<D, G, 1>,
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn kv_values_typed<const D: u8>(
    v: *const u8,
    stride: usize,
    slots: usize,
    probs: *const f32,
    prob_stride: usize,
    acc: *mut f32,
    group: usize,
    head_dim: usize,
) {
    let chunks = head_dim / 8;
    let mut g = 0;
    while g < group {
        let heads = (group - g).min(KV_VALUE_TILE);
        // About eight accumulators per tile (enough chains to hide the FMA latency, few enough
        // to leave registers for the probabilities and values).
        let widest = match heads {
            1 => 8,
            2 => 4,
            _ => 2,
        };
        let (p, a) = (probs.add(g * prob_stride), acc.add(g * head_dim));
        let mut first = 0;
        while first < chunks {
            // Descending powers of two keep `first` a multiple of the tile width.
            let mut width = widest;
            while width > chunks - first {
                width /= 2;
            }
            let tile = match heads {
                1 => kv_values_tile_fn::<D, 1>(width),
                2 => kv_values_tile_fn::<D, 2>(width),
                3 => kv_values_tile_fn::<D, 3>(width),
                _ => kv_values_tile_fn::<D, 4>(width),
            };
            tile(v, stride, slots, p, prob_stride, a, head_dim, first);
            first += width;
        }
        g += heads;
    }
}

/// Paged-attention weighted values: `acc[g·head_dim..][..head_dim] += Σ_s probs[g·prob_stride
/// + s] · V_s` for `slots` value rows of `dtype`, row `s` starting at byte `s·stride` of `v`.
/// `acc` holds `group × head_dim` floats; `head_dim` is a multiple of 8.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn kv_values(
    dtype: KvDType,
    v: &[u8],
    stride: usize,
    slots: usize,
    probs: &[f32],
    prob_stride: usize,
    acc: &mut [f32],
    head_dim: usize,
) {
    let group = acc.len() / head_dim;
    assert!(
        head_dim.is_multiple_of(8) && dtype.supports(head_dim) && acc.len() == group * head_dim
    );
    if slots == 0 || group == 0 {
        return;
    }
    assert!(
        (slots - 1) * stride + dtype.row_bytes(head_dim) <= v.len(),
        "value rows outside the cache slice"
    );
    assert!(
        (group - 1) * prob_stride + slots <= probs.len(),
        "probabilities outside their buffer"
    );
    // SAFETY: every value row, probability and output touched lies inside the slices (checked
    // above).
    let (v, p, a) = (v.as_ptr(), probs.as_ptr(), acc.as_mut_ptr());
    match dtype {
        KvDType::F32 => {
            kv_values_typed::<KV_F32>(v, stride, slots, p, prob_stride, a, group, head_dim)
        }
        KvDType::F16 => {
            kv_values_typed::<KV_F16>(v, stride, slots, p, prob_stride, a, group, head_dim)
        }
        KvDType::Q8_0 => {
            kv_values_typed::<KV_Q8_0>(v, stride, slots, p, prob_stride, a, group, head_dim)
        }
    }
}

/// Replaces `scores` by `exp(score - max)` (the softmax numerators) and returns their sum.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn softmax_numerators(scores: &mut [f32]) -> f32 {
    let n = scores.len();
    let p = scores.as_mut_ptr();
    let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut t = 0;
    // SAFETY (all loads and stores below): t + 8 <= n keeps them inside `scores`.
    while t + 8 <= n {
        vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p.add(t)));
        t += 8;
    }
    let m128 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    let m128 = _mm_max_ps(m128, _mm_movehl_ps(m128, m128));
    let mut max = _mm_cvtss_f32(_mm_max_ss(m128, _mm_movehdup_ps(m128)));
    for &s in &scores[t..] {
        max = max.max(s);
    }
    let vmax = _mm256_set1_ps(max);
    let mut vsum = _mm256_setzero_ps();
    let mut t = 0;
    while t + 8 <= n {
        let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(p.add(t)), vmax));
        _mm256_storeu_ps(p.add(t), e);
        vsum = _mm256_add_ps(vsum, e);
        t += 8;
    }
    let mut sum = hsum_ps(vsum);
    for s in &mut scores[t..] {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

/// The largest value of `x`, NaN values ignored (−∞ when there is none).
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2")]
pub unsafe fn max_value(x: &[f32]) -> f32 {
    let mut acc = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
    let mut i = 0;
    while i + 32 <= x.len() {
        for (k, a) in acc.iter_mut().enumerate() {
            // maxps returns its second operand when either is NaN: the running maximum.
            *a = _mm256_max_ps(_mm256_loadu_ps(x.as_ptr().add(i + 8 * k)), *a);
        }
        i += 32;
    }
    let mut lanes = [0f32; 8];
    let m = _mm256_max_ps(_mm256_max_ps(acc[0], acc[1]), _mm256_max_ps(acc[2], acc[3]));
    _mm256_storeu_ps(lanes.as_mut_ptr(), m);
    lanes
        .iter()
        .chain(&x[i..])
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

/// The first index of `x` whose value equals `value`.
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2")]
pub unsafe fn position_of(x: &[f32], value: f32) -> Option<usize> {
    let target = _mm256_set1_ps(value);
    let mut i = 0;
    while i + 8 <= x.len() {
        let equal = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(x.as_ptr().add(i)), target);
        let bits = _mm256_movemask_ps(equal);
        if bits != 0 {
            return Some(i + bits.trailing_zeros() as usize);
        }
        i += 8;
    }
    x[i..].iter().position(|&v| v == value).map(|p| i + p)
}

/// `(Σ e, Σ e·s)` with `s = x − max` and `e = exp(s)` over `x` (the moments a log-softmax and
/// its entropy need). Partial sums of 1,024 values are added in f64.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn exp_moments(x: &[f32], max: f32) -> (f64, f64) {
    let vmax = _mm256_set1_ps(max);
    let neg_inf = _mm256_set1_ps(f32::NEG_INFINITY);
    let (mut total_e, mut total_es) = (0f64, 0f64);
    for chunk in x.chunks(1024) {
        let (mut se, mut ses) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 8 <= chunk.len() {
            let v = _mm256_loadu_ps(chunk.as_ptr().add(i));
            // Masked-out tokens (-inf) contribute nothing: zero both e and s (0 · -inf is NaN).
            let keep = _mm256_cmp_ps::<_CMP_NEQ_OQ>(v, neg_inf);
            let s = _mm256_and_ps(_mm256_sub_ps(v, vmax), keep);
            let e = _mm256_and_ps(exp_ps(s), keep);
            se = _mm256_add_ps(se, e);
            ses = _mm256_fmadd_ps(e, s, ses);
            i += 8;
        }
        let (mut e_sum, mut es_sum) = (f64::from(hsum_ps(se)), f64::from(hsum_ps(ses)));
        for &v in &chunk[i..] {
            if v == f32::NEG_INFINITY {
                continue;
            }
            let s = v - max;
            let e = s.exp();
            e_sum += f64::from(e);
            es_sum += f64::from(e * s);
        }
        total_e += e_sum;
        total_es += es_sum;
    }
    (total_e, total_es)
}

/// [`crate::packed::dot_packed_span`]: consecutive packed groups of eight weight rows against
/// 1..=4 Q8x32 activation rows (see the layout in [`crate::packed`]); the eight results of group
/// `g` for activation row `i` go to `out[i·out_stride + 8g ..]`.
///
/// # Safety
/// AVX2, FMA and F16C must be present (and AVX512-F, BW, VL and VNNI with `wide`); `groups`
/// holds at least `n_groups` groups of `nb`
/// packed blocks (those past `n_groups` are only prefetched), every activation row `nb` Q8x32
/// blocks, and `out` is valid for every element written.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_packed_span(
    (vnni, wide): (bool, bool),
    layout: Layout,
    groups: &[u8],
    n_groups: usize,
    spread: &[u8],
    acts: &[&[u8]],
    sums: &[&[i32]],
    nb: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let g = groups.as_ptr();
    let pbb = crate::packed::layout_block_bytes(layout);
    let ahead = groups.len() / (nb * pbb).max(1);
    debug_assert!(ahead >= n_groups);
    let flavour = if vnni { vnni_flavour() } else { None };
    macro_rules! run_with {
        ($f:ident, $k:expr) => {
            match acts.len() {
                1 => $f::<$k, 1>(g, n_groups, ahead, spread, acts, sums, nb, out, out_stride),
                2 => $f::<$k, 2>(g, n_groups, ahead, spread, acts, sums, nb, out, out_stride),
                3 => $f::<$k, 3>(g, n_groups, ahead, spread, acts, sums, nb, out, out_stride),
                4 => $f::<$k, 4>(g, n_groups, ahead, spread, acts, sums, nb, out, out_stride),
                n => panic!("no packed kernel for {n} activation rows"),
            }
        };
    }
    macro_rules! run {
        ($k:expr) => {
            match flavour {
                // SAFETY: `wide` only where the CPU has AVX512-F, BW, VL and VNNI (Isa::Avx512).
                _ if wide => run_with!(dot_packed_n_avx512, $k),
                Some(Vnni::Avx) => run_with!(dot_packed_n_avxvnni, $k),
                Some(Vnni::Avx512) => run_with!(dot_packed_n_avx512vnni, $k),
                None => run_with!(dot_packed_n, $k),
            }
        };
    }
    match layout {
        Layout::Q4_0 => run!(K_Q4_0),
        Layout::Q4_1 => run!(K_Q4_1),
        Layout::Q5_0 => run!(K_Q5_0),
        Layout::Q5_1 => run!(K_Q5_1),
        Layout::Q8_0 => run!(K_Q8_0),
        Layout::U8 => run!(K_U8),
        Layout::U4K => run!(K_U4K),
        Layout::U4F => run!(K_U4F),
        Layout::U5F => run!(K_U5F),
        Layout::U6H => run!(K_U6H),
        Layout::U6K => run!(K_U6K),
    }
}

// The packed layouts that unpack their weights at load ([`crate::packed`]): Q4_K's nibbles with
// their scales and mins as bytes, 5-bit with f32 scale and offset, 8-bit with two f32 half-block
// scales.
const K_U4K: u8 = 5;
const K_U4F: u8 = 9;
const K_U5F: u8 = 6;
const K_U6H: u8 = 7;
/// Q6_K's nibbles and high bits with its 8-bit scales.
const K_U6K: u8 = 10;
/// Q8_0 packed as `q + 128`.
const K_U8: u8 = 8;

/// Bytes of a packed block's scales and offsets (before its fifth bits or quants).
const fn packed_header<const K: u8>() -> usize {
    match K {
        K_Q4_0 | K_Q5_0 | K_Q8_0 | K_U8 | K_U4K | K_U6K => 16,
        K_Q4_1 | K_Q5_1 => 32,
        _ => 64,
    }
}

/// Whether the layout `K` has 5-bit quants (nibbles and a u32 of fifth bits per row).
const fn five_bit<const K: u8>() -> bool {
    matches!(K, K_Q5_0 | K_Q5_1 | K_U5F)
}

/// Bytes of one packed block of the layout `K` (for Q4_K's, a super-block's share).
const fn packed_block_bytes<const K: u8>() -> usize {
    if K == K_U4K {
        return crate::packed::U4K_SUPER_BYTES / 8;
    }
    if K == K_U6K {
        return crate::packed::U6K_SUPER_BYTES / 8;
    }
    let quants = if matches!(K, K_Q8_0 | K_U6H | K_U8) {
        256
    } else {
        128
    };
    packed_header::<K>() + if five_bit::<K>() { 32 } else { 0 } + quants
}

/// Block `b` of the packed group at `g` (blocks `pbb` bytes apart, or by super-blocks for Q4_K
/// and Q6_K), and the start of its super-block (Q4_K's `d` and `dmin`, Q6_K's `d`).
#[inline(always)]
unsafe fn block_at<const K: u8>(g: *const u8, b: usize, pbb: usize) -> (*const u8, *const u8) {
    use crate::packed::{
        U4K_BLOCK_BYTES, U4K_SUPER_BYTES, U4K_SUPER_HEADER, U6K_BLOCK_BYTES, U6K_SUPER_BYTES,
        U6K_SUPER_HEADER,
    };
    if K == K_U4K {
        let sb = g.add(b / 8 * U4K_SUPER_BYTES);
        (sb.add(U4K_SUPER_HEADER + b % 8 * U4K_BLOCK_BYTES), sb)
    } else if K == K_U6K {
        let sb = g.add(b / 8 * U6K_SUPER_BYTES);
        (sb.add(U6K_SUPER_HEADER + b % 8 * U6K_BLOCK_BYTES), sb)
    } else {
        (g.add(b * pbb), g.add(b * pbb))
    }
}

/// Q4_K's eight scales `d·sc` and offsets `-(dmin·m)` of the packed block at `blk` (its 6-bit
/// scales and mins as bytes) in the super-block at `sb` (f16 `d`, then f16 `dmin`): exact, as an
/// f16 times a 6-bit integer fits f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u4k_scales(blk: *const u8, sb: *const u8) -> (__m256, __m256) {
    let bytes = |p: *const u8| {
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    };
    let d = _mm256_cvtph_ps(_mm_loadu_si128(sb as *const __m128i));
    let dmin = _mm256_cvtph_ps(_mm_loadu_si128(sb.add(16) as *const __m128i));
    (
        _mm256_mul_ps(d, bytes(blk)),
        _mm256_xor_ps(_mm256_mul_ps(dmin, bytes(blk.add(8))), _mm256_set1_ps(-0.0)),
    )
}

/// Q6_K's eight scales `d·sc` of the first and of the second half of the packed block at `blk`
/// (its 8-bit scales) in the super-block at `sb` (f16 `d`): exact, as an f16 times an 8-bit
/// integer fits f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u6k_scales(blk: *const u8, sb: *const u8) -> (__m256, __m256) {
    let scales = |p: *const u8| {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    };
    let d = _mm256_cvtph_ps(_mm_loadu_si128(sb as *const __m128i));
    (
        _mm256_mul_ps(d, scales(blk)),
        _mm256_mul_ps(d, scales(blk.add(8))),
    )
}

/// The high two bits of `q + 32` of chunk `c`, as bits 4 and 5 of each byte (0x30), from 32
/// bytes of a half's high bits (see [`crate::packed::high_bit_bytes`]): shifts of 16-bit lanes
/// by at most 4 keep every byte's bits in that byte.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn high_bits_of_chunk(high: __m256i, c: usize) -> __m256i {
    let moved = match c {
        0 => _mm256_slli_epi16::<4>(high),
        1 => _mm256_slli_epi16::<2>(high),
        2 => high,
        _ => _mm256_srli_epi16::<2>(high),
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(0x30))
}

/// The fifth bits of chunk `c`'s low (`bit = c`) or high (`bit = 4 + c`) nibbles, as 0x10 in
/// each byte, from the block's 32 bytes of fifth bits (see [`crate::packed::fifth_bit_bytes`]).
/// Shifts of 16-bit lanes by at most 4 move bit `bit` of every byte to bit 4 of the same byte.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn fifth_bits_of_chunk(fifth: __m256i, bit: usize) -> __m256i {
    let moved = match bit {
        0 => _mm256_slli_epi16::<4>(fifth),
        1 => _mm256_slli_epi16::<3>(fifth),
        2 => _mm256_slli_epi16::<2>(fifth),
        3 => _mm256_slli_epi16::<1>(fifth),
        4 => fifth,
        5 => _mm256_srli_epi16::<1>(fifth),
        6 => _mm256_srli_epi16::<2>(fifth),
        _ => _mm256_srli_epi16::<3>(fifth),
    };
    _mm256_and_si256(moved, _mm256_set1_epi8(0x10))
}

/// The sums of a 32-byte activation block's elements 0..16 and 16..32, each in all eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn half_block_sums(a: *const u8) -> (__m256i, __m256i) {
    let y = _mm256_loadu_si256(a as *const __m256i);
    // Lane k: the sum of elements 4k..4k+4.
    let quads = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi8(1), y),
        _mm256_set1_epi16(1),
    );
    // Within each 128-bit half: every lane the half's total.
    let t = _mm256_add_epi32(quads, _mm256_shuffle_epi32::<0b01_00_11_10>(quads));
    let t = _mm256_add_epi32(t, _mm256_shuffle_epi32::<0b10_11_00_01>(t));
    (
        _mm256_permute2x128_si256::<0x00>(t, t),
        _mm256_permute2x128_si256::<0x11>(t, t),
    )
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn broadcast_i32(p: *const u8) -> __m256i {
    _mm256_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// Which 256-bit VNNI this CPU has: `vpdpbusd` on ymm registers from AVX-VNNI, or from
/// AVX512-VNNI with AVX512-VL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Vnni {
    Avx,
    Avx512,
}

pub(crate) fn vnni_flavour() -> Option<Vnni> {
    if is_x86_feature_detected!("avxvnni") {
        Some(Vnni::Avx)
    } else if is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl") {
        Some(Vnni::Avx512)
    } else {
        None
    }
}

/// The packed kernel, three times: with AVX2 alone (`vpmaddubsw` then `vpmaddwd` into 32
/// bits) and with either VNNI (`vpdpbusd`: the four byte products of each lane added to it in
/// one instruction, exactly, with no 16-bit stage). The integers are the same, so the results
/// are too.
macro_rules! packed_kernel {
    ($n:ident, $group:ident, $features:tt, $vnni:expr, $dpbusd:path) => {
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $n<const K: u8, const N: usize>(
            groups: *const u8,
            n_groups: usize,
            prefetch_groups: usize,
            spread: &[u8],
            acts: &[&[u8]],
            sums: &[&[i32]],
            nb: usize,
            out: *mut f32,
            out_stride: usize,
        ) {
            // Lines of `spread` into L2, an equal share per group.
            let share = spread.len().div_ceil(n_groups.max(1)).next_multiple_of(64);
            let a: [*const u8; N] = std::array::from_fn(|i| acts[i].as_ptr());
            // The activation blocks' sums, for Q8_0 packed unsigned.
            let s: [*const i32; N] = std::array::from_fn(|i| {
                if K == K_U8 {
                    sums[i].as_ptr()
                } else {
                    std::ptr::null()
                }
            });
            let pbb = packed_block_bytes::<K>();
            let group_bytes = nb * pbb;
            for group in 0..n_groups {
                let g = groups.add(group * group_bytes);
                // Two groups ahead, a few lines per block: the weights stream from memory (also
                // past the span's end, into the groups the caller runs next).
                if group + 2 < prefetch_groups {
                    let ahead = g.add(2 * group_bytes);
                    let mut line = 0;
                    while line < group_bytes {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.add(line) as *const i8);
                        line += 64;
                    }
                }
                let mut line = group * share;
                while line < spread.len().min((group + 1) * share) {
                    _mm_prefetch::<_MM_HINT_T1>(spread.as_ptr().add(line) as *const i8);
                    line += 64;
                }
                let acc = $group::<K, N>(g, &a, &s, nb, pbb);
                for (i, v) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(i * out_stride + 8 * group), *v);
                }
            }
        }

        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $group<const K: u8, const N: usize>(
            g: *const u8,
            a: &[*const u8; N],
            s: &[*const i32; N],
            nb: usize,
            pbb: usize,
        ) -> [__m256; N] {
            let mask = _mm256_set1_epi8(0x0f);
            let ones = _mm256_set1_epi16(1);
            let mut acc = [_mm256_setzero_ps(); N];
            let f32_header = matches!(K, K_U4F | K_U5F | K_U6H);
            let bytes = matches!(K, K_Q8_0 | K_U6H | K_U8);
            for b in 0..nb {
                let (blk, sb) = block_at::<K>(g, b, pbb);
                let u4k = if K == K_U4K {
                    u4k_scales(blk, sb)
                } else if K == K_U6K {
                    u6k_scales(blk, sb)
                } else {
                    (_mm256_setzero_ps(), _mm256_setzero_ps())
                };
                let d = if K == K_U4K || K == K_U6K {
                    u4k.0
                } else if f32_header {
                    _mm256_loadu_ps(blk as *const f32)
                } else {
                    _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i))
                };
                let ab: [*const u8; N] = std::array::from_fn(|i| a[i].add(b * Q8X32_BLOCK_BYTES));
                // Q3_K and Q6_K: the dot products of elements 0..16 (chunks 0..4) and 16..32 apart.
                let mut dots = [_mm256_setzero_si256(); N];
                let mut dots_hi = [_mm256_setzero_si256(); N];
                if K == K_U6H {
                    // Bytes `q + 32` (0..=63) times signed activation bytes need no sign step,
                    // and two chunks' pair sums (at most 2·2·63·127 = 32,004) still fit 16 bits:
                    // one widening per two chunks (none with VNNI). The bias comes off each half
                    // with the activation's sums.
                    let qs = blk.add(64);
                    for h in 0..2 {
                        for pair in 0..2 {
                            let c = 4 * h + 2 * pair;
                            let w0 = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                            let w1 = _mm256_loadu_si256(qs.add(32 * (c + 1)) as *const __m256i);
                            for i in 0..N {
                                let (y0, y1) = (
                                    broadcast_i32(ab[i].add(8 + 4 * c)),
                                    broadcast_i32(ab[i].add(8 + 4 * (c + 1))),
                                );
                                let acc = if h == 0 {
                                    &mut dots[i]
                                } else {
                                    &mut dots_hi[i]
                                };
                                if $vnni {
                                    *acc = $dpbusd(*acc, w0, y0);
                                    *acc = $dpbusd(*acc, w1, y1);
                                } else {
                                    let p0 = _mm256_maddubs_epi16(w0, y0);
                                    let p1 = _mm256_maddubs_epi16(w1, y1);
                                    let pairs = _mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones);
                                    *acc = _mm256_add_epi32(*acc, pairs);
                                }
                            }
                        }
                    }
                    for i in 0..N {
                        let (lo, hi) = half_block_sums(ab[i].add(8));
                        dots[i] = _mm256_sub_epi32(dots[i], _mm256_slli_epi32::<5>(lo));
                        dots_hi[i] = _mm256_sub_epi32(dots_hi[i], _mm256_slli_epi32::<5>(hi));
                    }
                } else if K == K_U6K {
                    // `q + 32` of elements 4c..4c+4 (the nibbles' low halves) and 16+4c.. (high
                    // halves) of each row, with their high bits, as the unpacked bytes of
                    // U6H: the same integers, so the same per-half arithmetic.
                    let high_lo = _mm256_loadu_si256(blk.add(16) as *const __m256i);
                    let high_hi = _mm256_loadu_si256(blk.add(48) as *const __m256i);
                    let qs = blk.add(80);
                    let mut sums_lo = [_mm256_setzero_si256(); N];
                    let mut sums_hi = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        let raw = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                        let lo = _mm256_or_si256(
                            _mm256_and_si256(raw, mask),
                            high_bits_of_chunk(high_lo, c),
                        );
                        let hi = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask),
                            high_bits_of_chunk(high_hi, c),
                        );
                        for i in 0..N {
                            let y_lo = broadcast_i32(ab[i].add(8 + 4 * c));
                            let y_hi = broadcast_i32(ab[i].add(8 + 16 + 4 * c));
                            if $vnni {
                                dots[i] = $dpbusd(dots[i], lo, y_lo);
                                dots_hi[i] = $dpbusd(dots_hi[i], hi, y_hi);
                            } else {
                                // Two chunks' pair sums (at most 2·2·63·127) fit 16 bits.
                                sums_lo[i] =
                                    _mm256_add_epi16(sums_lo[i], _mm256_maddubs_epi16(lo, y_lo));
                                sums_hi[i] =
                                    _mm256_add_epi16(sums_hi[i], _mm256_maddubs_epi16(hi, y_hi));
                            }
                        }
                        if c % 2 == 1 && !$vnni {
                            for i in 0..N {
                                dots[i] =
                                    _mm256_add_epi32(dots[i], _mm256_madd_epi16(sums_lo[i], ones));
                                dots_hi[i] = _mm256_add_epi32(
                                    dots_hi[i],
                                    _mm256_madd_epi16(sums_hi[i], ones),
                                );
                                sums_lo[i] = _mm256_setzero_si256();
                                sums_hi[i] = _mm256_setzero_si256();
                            }
                        }
                    }
                    for i in 0..N {
                        let (lo, hi) = half_block_sums(ab[i].add(8));
                        dots[i] = _mm256_sub_epi32(dots[i], _mm256_slli_epi32::<5>(lo));
                        dots_hi[i] = _mm256_sub_epi32(dots_hi[i], _mm256_slli_epi32::<5>(hi));
                    }
                } else if K == K_U8 && $vnni {
                    // Unsigned weight bytes times signed activation bytes, as they are; then
                    // 128 times the activation block's sum off: Q8_0's exact integer.
                    let qs = blk.add(16);
                    for c in 0..8 {
                        let w = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                        for i in 0..N {
                            let y = broadcast_i32(ab[i].add(8 + 4 * c));
                            dots[i] = $dpbusd(dots[i], w, y);
                        }
                    }
                    for i in 0..N {
                        dots[i] = _mm256_sub_epi32(dots[i], _mm256_set1_epi32(*s[i].add(b)));
                    }
                } else if bytes {
                    // Signed bytes (Q8_0; Q8_0 packed `q + 128` without VNNI, which happens only
                    // when a process packed for VNNI runs the AVX2 kernel, as the tests do, gets
                    // its signed bytes back by flipping the top bit).
                    let qs = blk.add(16);
                    for c in 0..8 {
                        let mut w = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                        if K == K_U8 {
                            w = _mm256_xor_si256(w, _mm256_set1_epi8(-128));
                        }
                        let abs_w = _mm256_sign_epi8(w, w);
                        for i in 0..N {
                            let y = _mm256_sign_epi8(broadcast_i32(ab[i].add(8 + 4 * c)), w);
                            if $vnni {
                                dots[i] = $dpbusd(dots[i], abs_w, y);
                            } else {
                                let pairs = _mm256_madd_epi16(_mm256_maddubs_epi16(abs_w, y), ones);
                                dots[i] = _mm256_add_epi32(dots[i], pairs);
                            }
                        }
                    }
                } else {
                    let five = five_bit::<K>();
                    let fifth = if five {
                        _mm256_loadu_si256(blk.add(packed_header::<K>()) as *const __m256i)
                    } else {
                        _mm256_setzero_si256()
                    };
                    let qs = blk.add(packed_header::<K>() + if five { 32 } else { 0 });
                    // 16-bit sums: 8 products pairs of at most 2·15·127 each stay below 2^15;
                    // with fifth bits (2·31·127) they go to 32 bits every two chunks. VNNI
                    // adds into 32 bits directly.
                    let mut sums = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        let raw = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
                        let mut lo = _mm256_and_si256(raw, mask);
                        let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), mask);
                        if five {
                            lo = _mm256_or_si256(lo, fifth_bits_of_chunk(fifth, c));
                            hi = _mm256_or_si256(hi, fifth_bits_of_chunk(fifth, 4 + c));
                        }
                        for i in 0..N {
                            let y_lo = broadcast_i32(ab[i].add(8 + 4 * c));
                            let y_hi = broadcast_i32(ab[i].add(8 + 16 + 4 * c));
                            if $vnni {
                                dots[i] = $dpbusd(dots[i], lo, y_lo);
                                dots[i] = $dpbusd(dots[i], hi, y_hi);
                            } else {
                                sums[i] = _mm256_add_epi16(sums[i], _mm256_maddubs_epi16(lo, y_lo));
                                sums[i] = _mm256_add_epi16(sums[i], _mm256_maddubs_epi16(hi, y_hi));
                            }
                        }
                        if five && c == 1 && !$vnni {
                            for i in 0..N {
                                dots[i] = _mm256_madd_epi16(sums[i], ones);
                                sums[i] = _mm256_setzero_si256();
                            }
                        }
                    }
                    if !$vnni {
                        for i in 0..N {
                            dots[i] = _mm256_add_epi32(dots[i], _mm256_madd_epi16(sums[i], ones));
                        }
                    }
                }
                // The second f32 row of the header: offsets (Q4_K, Q5_x) or second scales (Q3_K,
                // Q6_K).
                let second = if f32_header {
                    _mm256_loadu_ps(blk.add(32) as *const f32)
                } else if K == K_U6K {
                    u4k.1
                } else {
                    _mm256_setzero_ps()
                };
                let offset = match K {
                    K_Q4_0 => _mm256_mul_ps(d, _mm256_set1_ps(-8.0)),
                    K_Q5_0 => _mm256_mul_ps(d, _mm256_set1_ps(-16.0)),
                    K_Q4_1 | K_Q5_1 => {
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i))
                    }
                    K_U4F | K_U5F => second,
                    K_U4K => u4k.1,
                    _ => _mm256_setzero_ps(),
                };
                for i in 0..N {
                    let da = _mm256_set1_ps(f32_load(ab[i]));
                    acc[i] =
                        _mm256_fmadd_ps(_mm256_mul_ps(d, da), _mm256_cvtepi32_ps(dots[i]), acc[i]);
                    if K == K_U6H || K == K_U6K {
                        let scale_hi = _mm256_mul_ps(second, da);
                        acc[i] = _mm256_fmadd_ps(scale_hi, _mm256_cvtepi32_ps(dots_hi[i]), acc[i]);
                    } else if K != K_Q8_0 && K != K_U8 {
                        acc[i] =
                            _mm256_fmadd_ps(offset, _mm256_set1_ps(f32_load(ab[i].add(4))), acc[i]);
                    }
                }
            }
            acc
        }
    };
}

/// Stands in for `vpdpbusd` in the AVX2 copy, which never calls it.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn no_dpbusd(_: __m256i, _: __m256i, _: __m256i) -> __m256i {
    unreachable!("the AVX2 packed kernel has no VNNI")
}

packed_kernel!(
    dot_packed_n,
    dot_packed_group,
    "avx2,fma,f16c",
    false,
    no_dpbusd
);
packed_kernel!(
    dot_packed_n_avxvnni,
    dot_packed_group_avxvnni,
    "avx2,fma,f16c,avxvnni",
    true,
    _mm256_dpbusd_avx_epi32
);
packed_kernel!(
    dot_packed_n_avx512vnni,
    dot_packed_group_avx512vnni,
    "avx2,fma,f16c,avx512vnni,avx512vl",
    true,
    _mm256_dpbusd_epi32
);

/// erf for 8 lanes: Eigen's rational approximation on [-4, 4] (±1 beyond, where f32 cannot
/// tell erf from ±1). Absolute error below 5e-7.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn erf_ps(x: __m256) -> __m256 {
    let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(4.0)), _mm256_set1_ps(-4.0));
    let x2 = _mm256_mul_ps(x, x);
    let mut p = _mm256_set1_ps(-2.726_142_4e-10);
    for c in [
        2.770_681_5e-8,
        -2.101_024e-6,
        -5.692_506_2e-5,
        -7.349_906_4e-4,
        -2.954_6e-3,
        -1.609_603_3e-2,
    ] {
        p = _mm256_fmadd_ps(x2, p, _mm256_set1_ps(c));
    }
    let p = _mm256_mul_ps(x, p);
    let mut q = _mm256_set1_ps(-1.456_607_15e-5);
    for c in [
        -2.133_740_5e-4,
        -1.682_827e-3,
        -7.373_329_3e-3,
        -1.426_473_9e-2,
    ] {
        q = _mm256_fmadd_ps(x2, q, _mm256_set1_ps(c));
    }
    _mm256_div_ps(p, q)
}

/// Exact GELU for 8 lanes, `0.5·x·(1 + erf(x/√2))`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn gelu_erf_ps(x: __m256) -> __m256 {
    let e = erf_ps(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::FRAC_1_SQRT_2),
    ));
    let half_x = _mm256_mul_ps(x, _mm256_set1_ps(0.5));
    _mm256_fmadd_ps(half_x, e, half_x)
}

/// [`crate::gemm`]'s micro-kernel: a tile of `t.mr ≤ 6` rows × 16 columns over one input block,
/// twelve accumulators (two vectors per row), one broadcast of `x` per row and input.
///
/// # Safety
/// AVX2 and FMA must be present and the pointers of `t` valid for the tile (see
/// [`crate::gemm::Tile`]).
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gemm_tile(t: &crate::gemm::Tile) {
    match t.mr {
        6 => gemm_tile_rows::<6>(t),
        5 => gemm_tile_rows::<5>(t),
        4 => gemm_tile_rows::<4>(t),
        3 => gemm_tile_rows::<3>(t),
        2 => gemm_tile_rows::<2>(t),
        1 => gemm_tile_rows::<1>(t),
        _ => unreachable!("tiles have 1..=6 rows"),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn gemm_tile_rows<const R: usize>(t: &crate::gemm::Tile) {
    use crate::gemm::{Activation, NR};
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let a: [*const f32; R] = std::array::from_fn(|i| t.a.add(i * t.lda));
    let mut b = t.b;
    // SAFETY (loads): row i of the tile has kc inputs from a[i]; the panel stretch kc × NR.
    for k in 0..t.kc {
        let b0 = _mm256_load_ps(b);
        let b1 = _mm256_load_ps(b.add(8));
        for (i, row) in acc.iter_mut().enumerate() {
            let av = _mm256_broadcast_ss(&*a[i].add(k));
            row[0] = _mm256_fmadd_ps(av, b0, row[0]);
            row[1] = _mm256_fmadd_ps(av, b1, row[1]);
        }
        b = b.add(NR);
    }
    // The sums leave the registers here once, so that the epilogue's branches below do not
    // keep the accumulators in memory during the loop above.
    let mut sums = [[0f32; NR]; R];
    for (row, s) in acc.iter().zip(sums.iter_mut()) {
        _mm256_storeu_ps(s.as_mut_ptr(), row[0]);
        _mm256_storeu_ps(s.as_mut_ptr().add(8), row[1]);
    }
    // A partial tile (fewer than 16 columns) goes through a full-width copy of its elements.
    let mut c_copy = [[0f32; NR]; R];
    let mut r_copy = [[0f32; NR]; R];
    let full = t.nr == NR;
    let (c, ldc) = if full {
        (t.c, t.ldc)
    } else {
        for (i, row) in c_copy.iter_mut().enumerate() {
            if !t.first {
                std::ptr::copy_nonoverlapping(t.c.add(i * t.ldc), row.as_mut_ptr(), t.nr);
            }
        }
        (c_copy.as_mut_ptr() as *mut f32, NR)
    };
    let residual = if full || t.residual.is_null() {
        t.residual
    } else {
        for (i, row) in r_copy.iter_mut().enumerate() {
            std::ptr::copy_nonoverlapping(t.residual.add(i * t.ldc), row.as_mut_ptr(), t.nr);
        }
        r_copy.as_ptr() as *const f32
    };
    let gelu = t.last && t.activation == Activation::GeluErf;
    for (i, row) in sums.iter().enumerate() {
        for h in 0..2 {
            let dst = c.add(i * ldc + 8 * h);
            let mut v = _mm256_loadu_ps(row.as_ptr().add(8 * h));
            if t.first {
                if !t.bias.is_null() {
                    v = _mm256_add_ps(v, _mm256_loadu_ps(t.bias.add(8 * h)));
                }
                if !residual.is_null() {
                    v = _mm256_add_ps(v, _mm256_loadu_ps(residual.add(i * ldc + 8 * h)));
                }
            } else {
                v = _mm256_add_ps(v, _mm256_loadu_ps(dst));
            }
            if gelu {
                v = gelu_erf_ps(v);
            }
            _mm256_storeu_ps(dst, v);
        }
    }
    if !full {
        for (i, row) in c_copy.iter().enumerate() {
            std::ptr::copy_nonoverlapping(row.as_ptr(), t.c.add(i * t.ldc), t.nr);
        }
    }
}

/// [`crate::ops::layer_norm`] of one row: `out = (x − mean)/sqrt(var + eps)·weight + bias`, the
/// mean and the variance in two passes as the reference does.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    assert!(weight.len() == n && bias.len() == n && out.len() == n);
    let px = x.as_ptr();
    let vectors = n / 8 * 8;
    // SAFETY (all loads and stores below): i + 8 <= vectors <= n.
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < vectors {
        acc = _mm256_add_ps(acc, _mm256_loadu_ps(px.add(i)));
        i += 8;
    }
    let mut sum = hsum_ps(acc);
    for &v in &x[vectors..] {
        sum += v;
    }
    let mean = sum / n as f32;
    let vmean = _mm256_set1_ps(mean);
    let mut acc = _mm256_setzero_ps();
    let mut i = 0;
    while i < vectors {
        let d = _mm256_sub_ps(_mm256_loadu_ps(px.add(i)), vmean);
        acc = _mm256_fmadd_ps(d, d, acc);
        i += 8;
    }
    let mut squares = hsum_ps(acc);
    for &v in &x[vectors..] {
        squares += (v - mean) * (v - mean);
    }
    let scale = 1.0 / (squares / n as f32 + eps).sqrt();
    let vscale = _mm256_set1_ps(scale);
    let mut i = 0;
    while i < vectors {
        let d = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(px.add(i)), vmean), vscale);
        let v = _mm256_fmadd_ps(
            d,
            _mm256_loadu_ps(weight.as_ptr().add(i)),
            _mm256_loadu_ps(bias.as_ptr().add(i)),
        );
        _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
        i += 8;
    }
    for i in vectors..n {
        out[i] = (x[i] - mean) * scale * weight[i] + bias[i];
    }
}

/// Bidirectional attention of one head over one sequence of `len` rows (see
/// [`crate::ops::attention_within_sequences`]): every query row attends to all `len` key/value
/// rows. `q`, `k`, `v` point at the head's slice of the sequence's first row, rows `stride`
/// floats apart; `out` likewise with rows `out_stride` apart. `head_dim` is 16, 32 or 64 (other
/// sizes return `false` and use [`attend`] per row).
///
/// The keys are transposed once into `scratch`, so the scores of two query rows against eight
/// keys at a time are plain FMAs (no horizontal sums), and each value row is read once for two
/// query rows.
///
/// # Safety
/// AVX2 and FMA must be present; `q`, `k`, `v` valid for `len` rows of `head_dim` floats at
/// `stride`, `out` for `len` rows at `out_stride`.
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn attend_sequence(
    q: *const f32,
    k: *const f32,
    v: *const f32,
    stride: usize,
    len: usize,
    head_dim: usize,
    scale: f32,
    out: *mut f32,
    out_stride: usize,
    scratch: &mut Vec<f32>,
) -> bool {
    match head_dim {
        16 => attend_sequence_lanes::<2>(q, k, v, stride, len, scale, out, out_stride, scratch),
        32 => attend_sequence_lanes::<4>(q, k, v, stride, len, scale, out, out_stride, scratch),
        64 => attend_sequence_lanes::<8>(q, k, v, stride, len, scale, out, out_stride, scratch),
        _ => return false,
    }
    true
}

#[target_feature(enable = "avx2,fma")]
// Indexed loops over pairs of accumulator arrays read more plainly than zipped iterators.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
unsafe fn attend_sequence_lanes<const LANES: usize>(
    q: *const f32,
    k: *const f32,
    v: *const f32,
    stride: usize,
    len: usize,
    scale: f32,
    out: *mut f32,
    out_stride: usize,
    scratch: &mut Vec<f32>,
) {
    let head_dim = 8 * LANES;
    // Keys rounded up to whole vectors; the padding keys get a score of -inf.
    let padded = len.div_ceil(8) * 8;
    let need = head_dim * padded + 2 * padded;
    if scratch.len() < need {
        scratch.resize(need, 0.0);
    }
    let (keys_t, scores) = scratch.split_at_mut(head_dim * padded);
    // keys_t[d·padded + t] = k[t][d].
    for t in 0..len {
        let row = k.add(t * stride);
        for d in 0..head_dim {
            keys_t[d * padded + t] = *row.add(d);
        }
    }
    for d in 0..head_dim {
        keys_t[d * padded + len..(d + 1) * padded].fill(0.0);
    }
    let vscale = _mm256_set1_ps(scale);
    let lane = _mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0);
    let mut i = 0;
    while i < len {
        // Two query rows at a time (the last one twice when len is odd).
        let rows = [i, (i + 1).min(len - 1)];
        let qp = rows.map(|r| q.add(r * stride));
        // Scores, four key vectors (32 keys) at a time: eight independent accumulators.
        let mut t = 0;
        while t < padded {
            let chunks = ((padded - t) / 8).min(4);
            let mut acc = [[_mm256_setzero_ps(); 4]; 2];
            for d in 0..head_dim {
                let kt = keys_t.as_ptr().add(d * padded + t);
                let b = [_mm256_set1_ps(*qp[0].add(d)), _mm256_set1_ps(*qp[1].add(d))];
                for c in 0..4 {
                    if c < chunks {
                        let kv = _mm256_loadu_ps(kt.add(8 * c));
                        acc[0][c] = _mm256_fmadd_ps(b[0], kv, acc[0][c]);
                        acc[1][c] = _mm256_fmadd_ps(b[1], kv, acc[1][c]);
                    }
                }
            }
            for (r, row_acc) in acc.iter().enumerate() {
                for (c, &a) in row_acc.iter().enumerate().take(chunks) {
                    let first = t + 8 * c;
                    // Keys at or beyond len are padding: -inf, so exp gives 0.
                    let index = _mm256_add_ps(lane, _mm256_set1_ps(first as f32));
                    let valid = _mm256_cmp_ps::<_CMP_LT_OQ>(index, _mm256_set1_ps(len as f32));
                    let s = _mm256_blendv_ps(
                        _mm256_set1_ps(f32::NEG_INFINITY),
                        _mm256_mul_ps(a, vscale),
                        valid,
                    );
                    _mm256_storeu_ps(scores.as_mut_ptr().add(r * padded + first), s);
                }
            }
            t += 8 * chunks;
        }
        // Softmax numerators and their sums.
        let mut inv = [0f32; 2];
        for (r, inv) in inv.iter_mut().enumerate() {
            let s = scores.as_mut_ptr().add(r * padded);
            let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
            for c in (0..padded).step_by(8) {
                vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s.add(c)));
            }
            let m = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let max = _mm256_set1_ps(_mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))));
            let mut vsum = _mm256_setzero_ps();
            for c in (0..padded).step_by(8) {
                let e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s.add(c)), max));
                _mm256_storeu_ps(s.add(c), e);
                vsum = _mm256_add_ps(vsum, e);
            }
            *inv = 1.0 / hsum_ps(vsum);
        }
        // Weighted values: each value row read once for both query rows.
        let mut acc = [[_mm256_setzero_ps(); LANES]; 2];
        for t in 0..len {
            let vp = v.add(t * stride);
            let p = [
                _mm256_set1_ps(scores[t]),
                _mm256_set1_ps(scores[padded + t]),
            ];
            for j in 0..LANES {
                let vv = _mm256_loadu_ps(vp.add(8 * j));
                acc[0][j] = _mm256_fmadd_ps(p[0], vv, acc[0][j]);
                acc[1][j] = _mm256_fmadd_ps(p[1], vv, acc[1][j]);
            }
        }
        for (r, row_acc) in acc.iter().enumerate() {
            if r == 1 && rows[1] == rows[0] {
                break;
            }
            let dst = out.add(rows[r] * out_stride);
            let vinv = _mm256_set1_ps(inv[r]);
            for (j, &a) in row_acc.iter().enumerate() {
                _mm256_storeu_ps(dst.add(8 * j), _mm256_mul_ps(a, vinv));
            }
        }
        i += 2;
    }
}
