//! Weights re-laid out for batched multiplication: groups of [`PACK_ROWS`] rows whose blocks
//! are interleaved, so one vector instruction multiplies four quants of each of eight weight
//! rows by the same four activations.
//!
//! Layout of one packed block (block `b` of a group of rows `8g..8g+8`, for Q4_0, Q4_1, Q8_0):
//!
//! - the eight rows' scales `d` (f16 ×8), then for Q4_1 their minimums `m` (f16 ×8);
//! - the quants in 32-byte chunks: chunk `c` holds bytes `4c..4c+4` of each row's quant bytes,
//!   row after row (Q4: 4 chunks of packed nibbles, byte `j` holding elements `j` and `j+16`;
//!   Q8_0: 8 chunks of signed bytes).
//!
//! Each (weight row, activation row) result is computed the same way whatever else is in the
//! batch: per block the exact integer dot product, then `acc = (d·d_a)·dot + acc` and
//! `acc = offset·s_a + acc` with fused multiply-adds (`offset` is `-8d` for Q4_0, `m` for
//! Q4_1). The scalar reference performs the same fused operations, so the SIMD kernel matches it
//! bit for bit and a sequence's logits do not depend on what it is batched with.

use half::f16;

use crate::dispatch::Isa;
use crate::dtype::{DType, Q8X32_BLOCK_BYTES, QK};

/// Weight rows per packed group.
pub const PACK_ROWS: usize = 8;

/// Activation rows one packed kernel call multiplies.
pub const PACK_ACTS: usize = 4;

/// Whether matrices of this type (with rows a multiple of [`PACK_ROWS`]) can be packed.
pub fn packable(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q8_0)
}

/// Bytes of one packed block of a group.
pub fn packed_block_bytes(dtype: DType) -> usize {
    match dtype {
        DType::Q4_0 => 16 + 128,
        DType::Q4_1 => 32 + 128,
        DType::Q8_0 => 16 + 256,
        other => panic!("{other} is not packable"),
    }
}

/// Bytes of the quant header of a GGUF block of `dtype` (before its quant bytes) and the
/// number of quant bytes.
fn source_layout(dtype: DType) -> (usize, usize) {
    match dtype {
        DType::Q4_0 => (2, 16),
        DType::Q4_1 => (4, 16),
        DType::Q8_0 => (2, 32),
        other => panic!("{other} is not packable"),
    }
}

/// Packs a `rows × cols` matrix of `dtype` stored row after row (GGUF layout). `None` when the
/// type has no packed kernel or `rows` is not a multiple of [`PACK_ROWS`].
pub fn pack(dtype: DType, data: &[u8], rows: usize, cols: usize) -> Option<Vec<u8>> {
    if !packable(dtype) || !rows.is_multiple_of(PACK_ROWS) || !cols.is_multiple_of(QK) || rows == 0
    {
        return None;
    }
    let bb = dtype.block_bytes();
    let row_bytes = cols / QK * bb;
    if data.len() != rows * row_bytes {
        return None;
    }
    let nb = cols / QK;
    let pbb = packed_block_bytes(dtype);
    let (header, quant_bytes) = source_layout(dtype);
    let mut out = vec![0u8; rows / PACK_ROWS * nb * pbb];
    for g in 0..rows / PACK_ROWS {
        for b in 0..nb {
            let dst = &mut out[(g * nb + b) * pbb..][..pbb];
            for r in 0..PACK_ROWS {
                let src = &data[(g * PACK_ROWS + r) * row_bytes + b * bb..][..bb];
                dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                if dtype == DType::Q4_1 {
                    dst[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&src[2..4]);
                }
                let quants_at = if dtype == DType::Q4_1 { 32 } else { 16 };
                for c in 0..quant_bytes / 4 {
                    let to = quants_at + 32 * c + 4 * r;
                    dst[to..to + 4].copy_from_slice(&src[header + 4 * c..header + 4 * c + 4]);
                }
            }
        }
    }
    Some(out)
}

fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

fn f32_at(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// The scalar reference: one packed group (all its blocks) times one Q8x32 activation row of
/// `cols` elements; the eight rows' dot products.
pub fn dot_packed_ref(dtype: DType, group: &[u8], act: &[u8], cols: usize) -> [f32; PACK_ROWS] {
    let nb = cols / QK;
    let pbb = packed_block_bytes(dtype);
    let mut acc = [0f32; PACK_ROWS];
    for b in 0..nb {
        let blk = &group[b * pbb..(b + 1) * pbb];
        let a = &act[b * Q8X32_BLOCK_BYTES..(b + 1) * Q8X32_BLOCK_BYTES];
        let (da, sa) = (f32_at(a, 0), f32_at(a, 4));
        let aq = |i: usize| i32::from(a[8 + i] as i8);
        for (r, acc) in acc.iter_mut().enumerate() {
            let d = f16_at(blk, 2 * r);
            let mut dot = 0i32;
            match dtype {
                DType::Q8_0 => {
                    for c in 0..8 {
                        for k in 0..4 {
                            let w = i32::from(blk[16 + 32 * c + 4 * r + k] as i8);
                            dot += w * aq(4 * c + k);
                        }
                    }
                }
                _ => {
                    let at = if dtype == DType::Q4_1 { 32 } else { 16 };
                    for c in 0..4 {
                        for k in 0..4 {
                            let byte = blk[at + 32 * c + 4 * r + k];
                            dot += i32::from(byte & 0x0f) * aq(4 * c + k);
                            dot += i32::from(byte >> 4) * aq(16 + 4 * c + k);
                        }
                    }
                }
            }
            *acc = (d * da).mul_add(dot as f32, *acc);
            let offset = match dtype {
                DType::Q4_0 => -8.0 * d,
                DType::Q4_1 => f16_at(blk, 16 + 2 * r),
                _ => 0.0,
            };
            if dtype != DType::Q8_0 {
                *acc = offset.mul_add(sa, *acc);
            }
        }
    }
    acc
}

/// Groups `first_group..first_group + n_groups` of a packed matrix against `acts.len()`
/// (1..=[`PACK_ACTS`]) activation rows: the eight results of group `g` for activation row `i`
/// are written to `out[i·out_stride + 8g ..][..8]`.
///
/// # Safety
/// `out` must be valid for writes of every element named above, and no other thread may access
/// those elements during the call (threads of one matmul write disjoint column ranges).
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_packed_span(
    isa: Isa,
    dtype: DType,
    packed: &[u8],
    first_group: usize,
    n_groups: usize,
    acts: &[&[u8]],
    cols: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let nb = cols / QK;
    let group_bytes = nb * packed_block_bytes(dtype);
    assert!(
        (1..=PACK_ACTS).contains(&acts.len()),
        "1..={PACK_ACTS} activation rows"
    );
    let groups = &packed[first_group * group_bytes..(first_group + n_groups) * group_bytes];
    assert!(
        acts.iter().all(|a| a.len() >= nb * Q8X32_BLOCK_BYTES),
        "activation row too short"
    );
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx2 {
        // SAFETY: AVX2, FMA and F16C are present; group and activation extents were checked
        // above, the output's by the caller.
        unsafe {
            crate::x86::dot_packed_span(
                dtype,
                groups,
                n_groups,
                acts,
                nb,
                out.add(8 * first_group),
                out_stride,
            )
        };
        return;
    }
    let _ = isa;
    for g in 0..n_groups {
        let group = &groups[g * group_bytes..(g + 1) * group_bytes];
        for (i, a) in acts.iter().enumerate() {
            let values = dot_packed_ref(dtype, group, a, cols);
            let at = i * out_stride + 8 * (first_group + g);
            // SAFETY: the caller vouches for these elements.
            unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out.add(at), PACK_ROWS) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::quantize_activations;
    use crate::quant::vec_dot_ref;
    use crate::testing::{random_f32, random_row};

    fn act_row(cols: usize, seed: u64) -> Vec<u8> {
        let x = random_f32(cols, seed);
        let mut out = vec![0u8; cols / QK * Q8X32_BLOCK_BYTES];
        quantize_activations(Isa::Scalar, crate::ActFormat::Q8x32, &x, &mut out);
        out
    }

    #[test]
    fn packed_dots_match_the_row_reference_and_are_batch_invariant() {
        for dtype in [DType::Q4_0, DType::Q4_1, DType::Q8_0] {
            for cols in [32usize, 96, 576] {
                let rows = 16;
                let data: Vec<u8> = (0..rows)
                    .flat_map(|r| random_row(dtype, cols, 40 + r as u64))
                    .collect();
                let packed = pack(dtype, &data, rows, cols).unwrap();
                let group_bytes = cols / QK * packed_block_bytes(dtype);
                let acts: Vec<Vec<u8>> = (0..PACK_ACTS)
                    .map(|i| act_row(cols, 70 + i as u64))
                    .collect();
                let row_bytes = data.len() / rows;
                for g in 0..rows / PACK_ROWS {
                    let group = &packed[g * group_bytes..(g + 1) * group_bytes];
                    let reference: Vec<[f32; PACK_ROWS]> = acts
                        .iter()
                        .map(|a| dot_packed_ref(dtype, group, a, cols))
                        .collect();
                    for (i, a) in acts.iter().enumerate() {
                        for r in 0..PACK_ROWS {
                            let w = &data[(g * PACK_ROWS + r) * row_bytes..][..row_bytes];
                            let want = vec_dot_ref(dtype, w, a, cols);
                            let got = reference[i][r];
                            assert!(
                                (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                                "{dtype} cols {cols} g{g} r{r} i{i}: {got} vs {want}"
                            );
                        }
                    }
                    for isa in Isa::available() {
                        for n in 1..=PACK_ACTS {
                            for start in 0..=PACK_ACTS - n {
                                let rows_in: Vec<&[u8]> = acts[start..start + n]
                                    .iter()
                                    .map(|a| a.as_slice())
                                    .collect();
                                let mut out = vec![0f32; n * rows];
                                // SAFETY: out is n × rows, the span writes group g of each row.
                                unsafe {
                                    dot_packed_span(
                                        isa,
                                        dtype,
                                        &packed,
                                        g,
                                        1,
                                        &rows_in,
                                        cols,
                                        out.as_mut_ptr(),
                                        rows,
                                    )
                                };
                                for k in 0..n {
                                    let got = &out[k * rows + g * PACK_ROWS..][..PACK_ROWS];
                                    assert_eq!(
                                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                                        reference[start + k].map(f32::to_bits).to_vec(),
                                        "{dtype} cols {cols} {isa:?} n{n}: bit-identical"
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn only_whole_groups_of_supported_types_pack() {
        let q = random_row(DType::Q4_1, 64, 1);
        assert!(pack(DType::Q4_1, &q.repeat(7), 7, 64).is_none());
        assert!(pack(DType::Q4_1, &q.repeat(8), 8, 64).is_some());
        let k = random_row(DType::Q4_K, 256, 1);
        assert!(pack(DType::Q4_K, &k.repeat(8), 8, 256).is_none());
    }
}
