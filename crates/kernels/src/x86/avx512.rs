//! AVX-512 kernels (F, BW, VL and VNNI on 512-bit registers): the packed quantized matmul two
//! groups of eight weight rows at a time, and the float dot products 16 lanes at a time.
//!
//! The packed kernel keeps the packed layout of [`crate::packed`] (eight rows interleaved per
//! group): a zmm register holds the same 32 bytes of two consecutive groups, group `g` in its low
//! half and group `g + 1` in its high half, so one `vpdpbusd` multiplies four quants of each of
//! 16 weight rows by the same four activations, broadcast from memory (no lane crossing), and the
//! 16 results of a pair of groups are adjacent in the output. The arithmetic per weight row is the
//! AVX2 kernel's, operation for operation (the same integer dot product per block, then the same
//! fused multiply-adds in the same order), so the results are bit-identical to the scalar
//! reference and to the 256-bit kernels, whatever the level and the batch. An odd last group runs
//! on the 256-bit VNNI kernel.
//!
//! Every function is `unsafe` because it must only run on a CPU with these extensions (and
//! AVX2, FMA and F16C), checked once by `dispatch`.

use std::arch::x86_64::*;

use super::{
    block_at, dot_packed_group_avx512vnni, f32_load, five_bit, half_block_sums, packed_block_bytes,
    packed_header, K_Q4_0, K_Q4_1, K_Q5_0, K_Q5_1, K_Q8_0, K_U4F, K_U4K, K_U5F, K_U6H, K_U6K, K_U8,
};
use crate::dtype::Q8X32_BLOCK_BYTES;

/// The 32 bytes at `p` (low half) and at `p + stride` (high half).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pair_si(p: *const u8, stride: usize) -> __m512i {
    let lo = _mm256_loadu_si256(p as *const __m256i);
    let hi = _mm256_loadu_si256(p.add(stride) as *const __m256i);
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// Eight f32 at `p` (low half) and eight at `p + stride` (high half).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pair_ps(p: *const u8, stride: usize) -> __m512 {
    _mm512_castsi512_ps(pair_si(p, stride))
}

/// Eight f16 at `p` (low half) and eight at `p + stride` (high half), as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn pair_ph(p: *const u8, stride: usize) -> __m512 {
    let lo = _mm_loadu_si128(p as *const __m128i);
    let hi = _mm_loadu_si128(p.add(stride) as *const __m128i);
    _mm512_cvtph_ps(_mm256_set_m128i(hi, lo))
}

/// [`super::u4k_scales`] of two groups (`stride` bytes apart).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn u4k_scales(blk: *const u8, sb: *const u8, stride: usize) -> (__m512, __m512) {
    let bytes = |p: *const u8| {
        let lo = _mm_loadl_epi64(p as *const __m128i);
        let hi = _mm_loadl_epi64(p.add(stride) as *const __m128i);
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi)))
    };
    let d = pair_ph(sb, stride);
    let dmin = pair_ph(sb.add(16), stride);
    (
        _mm512_mul_ps(d, bytes(blk)),
        _mm512_castsi512_ps(_mm512_xor_si512(
            _mm512_castps_si512(_mm512_mul_ps(dmin, bytes(blk.add(8)))),
            _mm512_set1_epi32(i32::MIN),
        )),
    )
}

/// [`super::u6k_scales`] of two groups (`stride` bytes apart).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn u6k_scales(blk: *const u8, sb: *const u8, stride: usize) -> (__m512, __m512) {
    let scales = |p: *const u8| {
        let lo = _mm_loadl_epi64(p as *const __m128i);
        let hi = _mm_loadl_epi64(p.add(stride) as *const __m128i);
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(lo, hi)))
    };
    let d = pair_ph(sb, stride);
    (
        _mm512_mul_ps(d, scales(blk)),
        _mm512_mul_ps(d, scales(blk.add(8))),
    )
}

/// `nibbles | (moved high bits & 0x30)` for chunk `c` (see [`super::high_bits_of_chunk`]), in
/// one ternary-logic instruction after the shift.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn with_high_bits(nibbles: __m512i, high: __m512i, c: usize) -> __m512i {
    let moved = match c {
        0 => _mm512_slli_epi16::<4>(high),
        1 => _mm512_slli_epi16::<2>(high),
        2 => high,
        _ => _mm512_srli_epi16::<2>(high),
    };
    // A | (B & C): 0xf0 | (0xcc & 0xaa).
    _mm512_ternarylogic_epi32::<0xf8>(nibbles, moved, _mm512_set1_epi8(0x30))
}

/// Four activation bytes at `p`, in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn broadcast_i32(p: *const u8) -> __m512i {
    _mm512_set1_epi32(std::ptr::read_unaligned(p as *const i32))
}

/// [`super::fifth_bits_of_chunk`] on both halves.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn fifth_bits_of_chunk(fifth: __m512i, bit: usize) -> __m512i {
    let moved = match bit {
        0 => _mm512_slli_epi16::<4>(fifth),
        1 => _mm512_slli_epi16::<3>(fifth),
        2 => _mm512_slli_epi16::<2>(fifth),
        3 => _mm512_slli_epi16::<1>(fifth),
        4 => fifth,
        5 => _mm512_srli_epi16::<1>(fifth),
        6 => _mm512_srli_epi16::<2>(fifth),
        _ => _mm512_srli_epi16::<3>(fifth),
    };
    _mm512_and_si512(moved, _mm512_set1_epi8(0x10))
}

/// How many groups ahead of the pair being multiplied the weights are prefetched (decode
/// streams them from memory).
const PREFETCH_AHEAD_GROUPS: usize = 4;

/// [`super::dot_packed_span`] at this level: groups two at a time, an odd last one on the
/// 256-bit VNNI kernel.
///
/// # Safety
/// As for [`super::dot_packed_span`], and the CPU has AVX512-F, BW, VL and VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn dot_packed_n<const K: u8, const N: usize>(
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
    let s: [*const i32; N] = std::array::from_fn(|i| {
        if K == K_U8 {
            sums[i].as_ptr()
        } else {
            std::ptr::null()
        }
    });
    let pbb = packed_block_bytes::<K>();
    let group_bytes = nb * pbb;
    let mut group = 0;
    while group < n_groups {
        let pair = group + 2 <= n_groups;
        let count = if pair { 2 } else { 1 };
        for next in group + PREFETCH_AHEAD_GROUPS..group + PREFETCH_AHEAD_GROUPS + count {
            if next < prefetch_groups {
                let ahead = groups.add(next * group_bytes);
                let mut line = 0;
                while line < group_bytes {
                    _mm_prefetch::<_MM_HINT_T0>(ahead.add(line) as *const i8);
                    line += 64;
                }
            }
        }
        let mut line = group * share;
        while line < spread.len().min((group + count) * share) {
            _mm_prefetch::<_MM_HINT_T1>(spread.as_ptr().add(line) as *const i8);
            line += 64;
        }
        let g = groups.add(group * group_bytes);
        if pair {
            let acc = dot_packed_pair::<K, N>(g, group_bytes, &a, &s, nb, pbb);
            for (i, v) in acc.iter().enumerate() {
                _mm512_storeu_ps(out.add(i * out_stride + 8 * group), *v);
            }
        } else {
            let acc = dot_packed_group_avx512vnni::<K, N>(g, &a, &s, nb, pbb);
            for (i, v) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(i * out_stride + 8 * group), *v);
            }
        }
        group += count;
    }
}

/// Groups at `g` and `g + group_bytes` against `N` activation rows: their 16 results per row
/// (see the 256-bit `dot_packed_group` for the arithmetic, which this repeats lane for lane).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn dot_packed_pair<const K: u8, const N: usize>(
    g: *const u8,
    group_bytes: usize,
    a: &[*const u8; N],
    s: &[*const i32; N],
    nb: usize,
    pbb: usize,
) -> [__m512; N] {
    let mask = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); N];
    let f32_header = matches!(K, K_U4F | K_U5F | K_U6H);
    let bytes = matches!(K, K_Q8_0 | K_U6H | K_U8);
    for b in 0..nb {
        let (blk, sb) = block_at::<K>(g, b, pbb);
        let u4k = if K == K_U4K {
            u4k_scales(blk, sb, group_bytes)
        } else if K == K_U6K {
            u6k_scales(blk, sb, group_bytes)
        } else {
            (_mm512_setzero_ps(), _mm512_setzero_ps())
        };
        let d = if K == K_U4K || K == K_U6K {
            u4k.0
        } else if f32_header {
            pair_ps(blk, group_bytes)
        } else {
            pair_ph(blk, group_bytes)
        };
        let ab: [*const u8; N] = std::array::from_fn(|i| a[i].add(b * Q8X32_BLOCK_BYTES));
        let mut dots = [_mm512_setzero_si512(); N];
        let mut dots_hi = [_mm512_setzero_si512(); N];
        if K == K_U6H {
            // Bytes `q + 32` (0..=63) times signed activation bytes; the bias comes off each
            // half block with the activation's sums.
            let qs = blk.add(64);
            for c in 0..8 {
                let w = pair_si(qs.add(32 * c), group_bytes);
                for i in 0..N {
                    let y = broadcast_i32(ab[i].add(8 + 4 * c));
                    if c < 4 {
                        dots[i] = _mm512_dpbusd_epi32(dots[i], w, y);
                    } else {
                        dots_hi[i] = _mm512_dpbusd_epi32(dots_hi[i], w, y);
                    }
                }
            }
            for i in 0..N {
                let (lo, hi) = half_block_sums(ab[i].add(8));
                let (lo, hi) = (_mm512_broadcast_i32x8(lo), _mm512_broadcast_i32x8(hi));
                dots[i] = _mm512_sub_epi32(dots[i], _mm512_slli_epi32::<5>(lo));
                dots_hi[i] = _mm512_sub_epi32(dots_hi[i], _mm512_slli_epi32::<5>(hi));
            }
        } else if K == K_U6K {
            // `q + 32` from the nibbles and the high bits (elements 4c.. of each half), then
            // as U6H: the same integers per half.
            let high_lo = pair_si(blk.add(16), group_bytes);
            let high_hi = pair_si(blk.add(48), group_bytes);
            let qs = blk.add(80);
            for c in 0..4 {
                let raw = pair_si(qs.add(32 * c), group_bytes);
                let lo = with_high_bits(_mm512_and_si512(raw, mask), high_lo, c);
                let hi = with_high_bits(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask),
                    high_hi,
                    c,
                );
                for i in 0..N {
                    let y_lo = broadcast_i32(ab[i].add(8 + 4 * c));
                    let y_hi = broadcast_i32(ab[i].add(8 + 16 + 4 * c));
                    dots[i] = _mm512_dpbusd_epi32(dots[i], lo, y_lo);
                    dots_hi[i] = _mm512_dpbusd_epi32(dots_hi[i], hi, y_hi);
                }
            }
            for i in 0..N {
                let (lo, hi) = half_block_sums(ab[i].add(8));
                let (lo, hi) = (_mm512_broadcast_i32x8(lo), _mm512_broadcast_i32x8(hi));
                dots[i] = _mm512_sub_epi32(dots[i], _mm512_slli_epi32::<5>(lo));
                dots_hi[i] = _mm512_sub_epi32(dots_hi[i], _mm512_slli_epi32::<5>(hi));
            }
        } else if K == K_U8 {
            // Unsigned weight bytes times signed activation bytes, then 128 times the
            // activation block's sum off: Q8_0's exact integer.
            let qs = blk.add(16);
            for c in 0..8 {
                let w = pair_si(qs.add(32 * c), group_bytes);
                for i in 0..N {
                    let y = broadcast_i32(ab[i].add(8 + 4 * c));
                    dots[i] = _mm512_dpbusd_epi32(dots[i], w, y);
                }
            }
            for i in 0..N {
                dots[i] = _mm512_sub_epi32(dots[i], _mm512_set1_epi32(*s[i].add(b)));
            }
        } else if bytes {
            // Signed bytes (Q8_0 packed for a CPU without VNNI): |w| times the activation
            // with w's sign (AVX-512 has no `vpsignb`: negate under the mask of negative w).
            let qs = blk.add(16);
            for c in 0..8 {
                let w = pair_si(qs.add(32 * c), group_bytes);
                let abs_w = _mm512_abs_epi8(w);
                let negative = _mm512_movepi8_mask(w);
                for i in 0..N {
                    let y = broadcast_i32(ab[i].add(8 + 4 * c));
                    let y = _mm512_mask_sub_epi8(y, negative, _mm512_setzero_si512(), y);
                    dots[i] = _mm512_dpbusd_epi32(dots[i], abs_w, y);
                }
            }
        } else {
            let five = five_bit::<K>();
            let fifth = if five {
                pair_si(blk.add(packed_header::<K>()), group_bytes)
            } else {
                _mm512_setzero_si512()
            };
            let qs = blk.add(packed_header::<K>() + if five { 32 } else { 0 });
            for c in 0..4 {
                let raw = pair_si(qs.add(32 * c), group_bytes);
                let mut lo = _mm512_and_si512(raw, mask);
                let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), mask);
                if five {
                    lo = _mm512_or_si512(lo, fifth_bits_of_chunk(fifth, c));
                    hi = _mm512_or_si512(hi, fifth_bits_of_chunk(fifth, 4 + c));
                }
                for i in 0..N {
                    let y_lo = broadcast_i32(ab[i].add(8 + 4 * c));
                    let y_hi = broadcast_i32(ab[i].add(8 + 16 + 4 * c));
                    dots[i] = _mm512_dpbusd_epi32(dots[i], lo, y_lo);
                    dots[i] = _mm512_dpbusd_epi32(dots[i], hi, y_hi);
                }
            }
        }
        // The second f32 row of the header: offsets (Q4_K, Q5_K) or second scales (Q3_K, Q6_K).
        let second = if f32_header {
            pair_ps(blk.add(32), group_bytes)
        } else if K == K_U6K {
            u4k.1
        } else {
            _mm512_setzero_ps()
        };
        let offset = match K {
            K_Q4_0 => _mm512_mul_ps(d, _mm512_set1_ps(-8.0)),
            K_Q5_0 => _mm512_mul_ps(d, _mm512_set1_ps(-16.0)),
            K_Q4_1 | K_Q5_1 => pair_ph(blk.add(16), group_bytes),
            K_U4F | K_U5F => second,
            K_U4K => u4k.1,
            _ => _mm512_setzero_ps(),
        };
        for i in 0..N {
            let da = _mm512_set1_ps(f32_load(ab[i]));
            acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(d, da), _mm512_cvtepi32_ps(dots[i]), acc[i]);
            if K == K_U6H || K == K_U6K {
                let scale_hi = _mm512_mul_ps(second, da);
                acc[i] = _mm512_fmadd_ps(scale_hi, _mm512_cvtepi32_ps(dots_hi[i]), acc[i]);
            } else if K != K_Q8_0 && K != K_U8 {
                acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(f32_load(ab[i].add(4))), acc[i]);
            }
        }
    }
    acc
}

/// `Σ a[i]·b[i]` over f32, 16 lanes at a time (four independent accumulators).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY (all loads below): i + 64 <= n, resp. i + 16 <= n, keeps every load in bounds.
    while i + 64 <= n {
        for (k, acc) in acc.iter_mut().enumerate() {
            let x = _mm512_loadu_ps(pa.add(i + 16 * k));
            let y = _mm512_loadu_ps(pb.add(i + 16 * k));
            *acc = _mm512_fmadd_ps(x, y, *acc);
        }
        i += 64;
    }
    while i + 16 <= n {
        acc[0] = _mm512_fmadd_ps(
            _mm512_loadu_ps(pa.add(i)),
            _mm512_loadu_ps(pb.add(i)),
            acc[0],
        );
        i += 16;
    }
    let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    let mut total = _mm512_reduce_add_ps(sum);
    while i < n {
        total += a[i] * b[i];
        i += 1;
    }
    total
}

/// Σ over f16 weights × f32 activations, converting 16 weights at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_f16_f32(w: &[u8], a: &[f32]) -> f32 {
    let n = a.len().min(w.len() / 2);
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: 32 halves = 64 bytes at byte offset 2i, inside `w`; 32 floats inside `a`.
        let h0 = _mm256_loadu_si256(w.as_ptr().add(2 * i) as *const __m256i);
        let h1 = _mm256_loadu_si256(w.as_ptr().add(2 * i + 32) as *const __m256i);
        acc0 = _mm512_fmadd_ps(
            _mm512_cvtph_ps(h0),
            _mm512_loadu_ps(a.as_ptr().add(i)),
            acc0,
        );
        acc1 = _mm512_fmadd_ps(
            _mm512_cvtph_ps(h1),
            _mm512_loadu_ps(a.as_ptr().add(i + 16)),
            acc1,
        );
        i += 32;
    }
    let mut total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while i < n {
        total += crate::quant::f16_at(w, 2 * i) * a[i];
        i += 1;
    }
    total
}

/// Sixteen bf16 at `p` (32 readable bytes) as f32: widened to 32 bits and shifted left by 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn bf16x16_load(p: *const u8) -> __m512 {
    let h = _mm256_loadu_si256(p as *const __m256i);
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// Σ over bf16 weights × f32 activations, 16 weights at a time (exact widening).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot_bf16_f32(w: &[u8], a: &[f32]) -> f32 {
    let n = a.len().min(w.len() / 2);
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: 32 bf16 = 64 bytes at byte offset 2i, inside `w`; 32 floats inside `a`.
        acc0 = _mm512_fmadd_ps(
            bf16x16_load(w.as_ptr().add(2 * i)),
            _mm512_loadu_ps(a.as_ptr().add(i)),
            acc0,
        );
        acc1 = _mm512_fmadd_ps(
            bf16x16_load(w.as_ptr().add(2 * i + 32)),
            _mm512_loadu_ps(a.as_ptr().add(i + 16)),
            acc1,
        );
        i += 32;
    }
    let mut total = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while i < n {
        let bits = u32::from(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) << 16;
        total += f32::from_bits(bits) * a[i];
        i += 1;
    }
    total
}

/// The wrapping sum of `words`, 32 words (four 64-byte lines) per iteration.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn sum_words(words: &[u64]) -> u64 {
    let p = words.as_ptr();
    let mut acc = [_mm512_setzero_si512(); 4];
    let mut i = 0;
    while i + 32 <= words.len() {
        for (k, acc) in acc.iter_mut().enumerate() {
            // SAFETY: i + 32 <= len keeps the four loads of 8 words in bounds.
            *acc = _mm512_add_epi64(*acc, _mm512_loadu_si512(p.add(i + 8 * k) as *const _));
        }
        i += 32;
    }
    let sum = _mm512_add_epi64(
        _mm512_add_epi64(acc[0], acc[1]),
        _mm512_add_epi64(acc[2], acc[3]),
    );
    let mut total = _mm512_reduce_add_epi64(sum) as u64;
    for &w in &words[i..] {
        total = total.wrapping_add(w);
    }
    total
}
