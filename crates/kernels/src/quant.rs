//! Block formats: unpacking, dequantization, activation quantization and the scalar reference
//! dot products that every SIMD kernel is tested against.
//!
//! Every weight block unpacks to small integers with per-group scales and offsets:
//! - 32-element formats: `value = scale · q + offset` for one group of 32;
//! - K-quants: `value = scale_g · q - min_g` for 16 groups of 16 (formats with groups of 32
//!   repeat each group's scale twice).
//!
//! Dequantization and the reference dot products are both written on top of that one unpacking,
//! so the two cannot disagree about a layout.

use half::{bf16, f16};

use crate::dtype::{ActFormat, DType, Q8X32_BLOCK_BYTES, Q8XK_BLOCK_BYTES, QK, QK_K};

#[inline]
pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

#[inline]
pub(crate) fn f32_at(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// A 32-element block unpacked: `value[i] = scale · q[i] + offset`.
#[derive(Debug, Clone, Copy)]
pub struct Unpacked32 {
    pub q: [i8; QK],
    pub scale: f32,
    pub offset: f32,
}

/// Unpacks one block of a 32-element format. The nibble layout of Q4/Q5: byte `j` holds element
/// `j` in its low nibble and element `j + 16` in its high nibble; Q5's fifth bits are a
/// little-endian `u32` with bit `i` for element `i`.
pub fn unpack32(dtype: DType, block: &[u8]) -> Unpacked32 {
    let mut q = [0i8; QK];
    match dtype {
        DType::Q4_0 => {
            for j in 0..16 {
                q[j] = (block[2 + j] & 0x0f) as i8 - 8;
                q[j + 16] = (block[2 + j] >> 4) as i8 - 8;
            }
            Unpacked32 {
                q,
                scale: f16_at(block, 0),
                offset: 0.0,
            }
        }
        DType::Q4_1 => {
            for j in 0..16 {
                q[j] = (block[4 + j] & 0x0f) as i8;
                q[j + 16] = (block[4 + j] >> 4) as i8;
            }
            Unpacked32 {
                q,
                scale: f16_at(block, 0),
                offset: f16_at(block, 2),
            }
        }
        DType::Q5_0 | DType::Q5_1 => {
            let (header, bias) = if dtype == DType::Q5_0 {
                (2, 16)
            } else {
                (4, 0)
            };
            let qh = u32::from_le_bytes([
                block[header],
                block[header + 1],
                block[header + 2],
                block[header + 3],
            ]);
            let qs = &block[header + 4..header + 20];
            for j in 0..16 {
                let hi0 = ((qh >> j) & 1) as u8;
                let hi1 = ((qh >> (j + 16)) & 1) as u8;
                q[j] = ((qs[j] & 0x0f) | (hi0 << 4)) as i8 - bias;
                q[j + 16] = ((qs[j] >> 4) | (hi1 << 4)) as i8 - bias;
            }
            Unpacked32 {
                q,
                scale: f16_at(block, 0),
                offset: if dtype == DType::Q5_1 {
                    f16_at(block, 2)
                } else {
                    0.0
                },
            }
        }
        DType::Q8_0 => {
            for (dst, &src) in q.iter_mut().zip(&block[2..34]) {
                *dst = src as i8;
            }
            Unpacked32 {
                q,
                scale: f16_at(block, 0),
                offset: 0.0,
            }
        }
        other => panic!("unpack32 called for {other}, which is not a 32-element format"),
    }
}

/// A 256-element super-block unpacked: `value[i] = scales[i / 16] · q[i] - mins[i / 16]`.
#[derive(Debug, Clone, Copy)]
pub struct UnpackedK {
    pub q: [i8; QK_K],
    pub scales: [f32; 16],
    pub mins: [f32; 16],
}

/// The 6-bit scale and min `j` (0..8) of Q4_K/Q5_K, packed in 12 bytes: the first four pairs in
/// the low 6 bits of bytes 0..4 (scales) and 4..8 (mins); the last four in the nibbles of bytes
/// 8..12 with their top two bits in the high bits of bytes 0..8.
#[inline]
pub(crate) fn scale_min_k4(j: usize, packed: &[u8]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        (
            (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// The sixteen 6-bit scales of Q3_K (stored with a bias of 32) from their 12 packed bytes: the
/// low four bits of scale `i` are nibble `i` of bytes 0..8, the high two bits are the 2-bit
/// field `i % 4` of byte `8 + i / 4`.
#[inline]
pub(crate) fn q3k_scales(packed: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, s) in out.iter_mut().enumerate() {
        let low = if i < 8 {
            packed[i] & 0x0f
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *s = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Unpacks one K-quant super-block.
pub fn unpack_k(dtype: DType, block: &[u8]) -> UnpackedK {
    let mut out = UnpackedK {
        q: [0; QK_K],
        scales: [0.0; 16],
        mins: [0.0; 16],
    };
    match dtype {
        DType::Q2_K => {
            // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
            let (scales, qs) = (&block[0..16], &block[16..80]);
            let (d, dmin) = (f16_at(block, 80), f16_at(block, 82));
            for half in 0..2 {
                for shift_step in 0..4 {
                    for sub in 0..2 {
                        let group = half * 8 + shift_step * 2 + sub;
                        for l in 0..16 {
                            let byte = qs[half * 32 + sub * 16 + l];
                            out.q[group * 16 + l] = ((byte >> (2 * shift_step)) & 3) as i8;
                        }
                        out.scales[group] = d * f32::from(scales[group] & 0x0f);
                        out.mins[group] = dmin * f32::from(scales[group] >> 4);
                    }
                }
            }
        }
        DType::Q3_K => {
            // hmask[32], qs[64], scales[12], d.
            let (hmask, qs) = (&block[0..32], &block[32..96]);
            let scales = q3k_scales(&block[96..108]);
            let d = f16_at(block, 108);
            for half in 0..2 {
                for shift_step in 0..4 {
                    let bit = 1u8 << (half * 4 + shift_step);
                    for sub in 0..2 {
                        let group = half * 8 + shift_step * 2 + sub;
                        for l in 0..16 {
                            let idx = sub * 16 + l;
                            let low = (qs[half * 32 + idx] >> (2 * shift_step)) & 3;
                            let high_missing = if hmask[idx] & bit != 0 { 0 } else { 4 };
                            out.q[group * 16 + l] = low as i8 - high_missing;
                        }
                        out.scales[group] = d * f32::from(scales[group]);
                    }
                }
            }
        }
        DType::Q4_K | DType::Q5_K => {
            // d, dmin, scales[12], [qh[32] for Q5_K], qs[128].
            let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
            let packed = &block[4..16];
            let (qh, qs) = if dtype == DType::Q5_K {
                (Some(&block[16..48]), &block[48..176])
            } else {
                (None, &block[16..144])
            };
            for chunk in 0..4 {
                for nibble in 0..2 {
                    let sub = chunk * 2 + nibble;
                    let (sc, m) = scale_min_k4(sub, packed);
                    for l in 0..32 {
                        let byte = qs[chunk * 32 + l];
                        let mut v = if nibble == 0 { byte & 0x0f } else { byte >> 4 };
                        if let Some(qh) = qh {
                            v |= ((qh[l] >> sub) & 1) << 4;
                        }
                        out.q[sub * 32 + l] = v as i8;
                    }
                    for g in [sub * 2, sub * 2 + 1] {
                        out.scales[g] = d * f32::from(sc);
                        out.mins[g] = dmin * f32::from(m);
                    }
                }
            }
        }
        DType::Q6_K => {
            // ql[128], qh[64], scales[16] (i8), d.
            let (ql, qh) = (&block[0..128], &block[128..192]);
            let scales = &block[192..208];
            let d = f16_at(block, 208);
            for half in 0..2 {
                for l in 0..32 {
                    let (lo, hi) = (&ql[half * 64..], qh[half * 32 + l]);
                    let base = half * 128;
                    out.q[base + l] = ((lo[l] & 0x0f) | ((hi & 3) << 4)) as i8 - 32;
                    out.q[base + l + 32] =
                        ((lo[l + 32] & 0x0f) | (((hi >> 2) & 3) << 4)) as i8 - 32;
                    out.q[base + l + 64] = ((lo[l] >> 4) | (((hi >> 4) & 3) << 4)) as i8 - 32;
                    out.q[base + l + 96] = ((lo[l + 32] >> 4) | (((hi >> 6) & 3) << 4)) as i8 - 32;
                }
            }
            for (g, s) in out.scales.iter_mut().enumerate() {
                *s = d * f32::from(scales[g] as i8);
            }
        }
        DType::Q8_K => {
            let d = f32_at(block, 0);
            for (dst, &src) in out.q.iter_mut().zip(&block[4..260]) {
                *dst = src as i8;
            }
            out.scales = [d; 16];
        }
        other => panic!("unpack_k called for {other}, which is not a K-quant"),
    }
    out
}

/// Dequantizes `dst.len()` elements from a row in format `dtype` (reference implementation; the
/// engine only dequantizes rows off the hot path, such as one embedding row per token).
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let n = dst.len();
    let bs = dtype.block_size();
    assert_eq!(
        n % bs,
        0,
        "{n} elements is not a whole number of {dtype} blocks"
    );
    assert!(
        src.len() >= n / bs * dtype.block_bytes(),
        "source row too short"
    );
    match dtype {
        DType::F32 => {
            for (i, v) in dst.iter_mut().enumerate() {
                *v = f32_at(src, i * 4);
            }
        }
        DType::F16 => {
            for (i, v) in dst.iter_mut().enumerate() {
                *v = f16_at(src, i * 2);
            }
        }
        DType::BF16 => {
            for (i, v) in dst.iter_mut().enumerate() {
                *v = bf16::from_le_bytes([src[i * 2], src[i * 2 + 1]]).to_f32();
            }
        }
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => {
            for (b, out) in dst.chunks_exact_mut(QK).enumerate() {
                let u = unpack32(dtype, &src[b * dtype.block_bytes()..]);
                for (o, &q) in out.iter_mut().zip(&u.q) {
                    *o = u.scale * f32::from(q) + u.offset;
                }
            }
        }
        DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::Q8_K => {
            for (b, out) in dst.chunks_exact_mut(QK_K).enumerate() {
                let u = unpack_k(dtype, &src[b * dtype.block_bytes()..]);
                for (i, o) in out.iter_mut().enumerate() {
                    *o = u.scales[i / 16] * f32::from(u.q[i]) - u.mins[i / 16];
                }
            }
        }
    }
}

/// Quantizes an activation row into `format` (reference implementation).
pub fn quantize_activations_ref(format: ActFormat, x: &[f32], out: &mut [u8]) {
    assert_eq!(out.len(), format.row_bytes(x.len()), "output buffer size");
    match format {
        ActFormat::F32 => {
            for (chunk, v) in out.chunks_exact_mut(4).zip(x) {
                chunk.copy_from_slice(&v.to_le_bytes());
            }
        }
        ActFormat::Q8x32 => {
            for (block, xs) in out
                .chunks_exact_mut(Q8X32_BLOCK_BYTES)
                .zip(x.chunks_exact(QK))
            {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                let mut sum = 0i32;
                for (dst, v) in block[8..].iter_mut().zip(xs) {
                    let q = (v * inv).round_ties_even() as i8;
                    sum += i32::from(q);
                    *dst = q as u8;
                }
                block[0..4].copy_from_slice(&d.to_le_bytes());
                block[4..8].copy_from_slice(&(d * sum as f32).to_le_bytes());
            }
        }
        ActFormat::Q8xK => {
            for (block, xs) in out
                .chunks_exact_mut(Q8XK_BLOCK_BYTES)
                .zip(x.chunks_exact(QK_K))
            {
                let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
                block[0..4].copy_from_slice(&d.to_le_bytes());
                for g in 0..16 {
                    let mut sum = 0i16;
                    for l in 0..16 {
                        let q = (xs[g * 16 + l] * inv).round_ties_even() as i8;
                        sum += i16::from(q);
                        block[4 + g * 16 + l] = q as u8;
                    }
                    block[260 + g * 2..262 + g * 2].copy_from_slice(&sum.to_le_bytes());
                }
            }
        }
    }
}

/// Reference dot product of a weight row (`n` elements of `dtype`) with an activation row in the
/// matching [`ActFormat`].
pub fn vec_dot_ref(dtype: DType, w: &[u8], a: &[u8], n: usize) -> f32 {
    match dtype.activation_format() {
        ActFormat::F32 => {
            let mut row = vec![0f32; n];
            dequantize_row(dtype, w, &mut row);
            (0..n).map(|i| row[i] * f32_at(a, i * 4)).sum()
        }
        ActFormat::Q8x32 => {
            let mut total = 0f32;
            for b in 0..n / QK {
                let u = unpack32(dtype, &w[b * dtype.block_bytes()..]);
                let act = &a[b * Q8X32_BLOCK_BYTES..];
                let (d, s) = (f32_at(act, 0), f32_at(act, 4));
                let dot: i32 = (0..QK)
                    .map(|i| i32::from(u.q[i]) * i32::from(act[8 + i] as i8))
                    .sum();
                total += u.scale * d * dot as f32 + u.offset * s;
            }
            total
        }
        ActFormat::Q8xK => {
            let mut total = 0f32;
            for b in 0..n / QK_K {
                let u = unpack_k(dtype, &w[b * dtype.block_bytes()..]);
                let act = &a[b * Q8XK_BLOCK_BYTES..];
                let d = f32_at(act, 0);
                for g in 0..16 {
                    let mut dot = 0i32;
                    let mut sum = 0i32;
                    for l in 0..16 {
                        let x = i32::from(act[4 + g * 16 + l] as i8);
                        dot += i32::from(u.q[g * 16 + l]) * x;
                        sum += x;
                    }
                    total += d * (u.scales[g] * dot as f32 - u.mins[g] * sum as f32);
                }
            }
            total
        }
    }
}
