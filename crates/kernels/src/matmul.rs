//! Matrix multiply of M activation rows by a (quantized) weight matrix.
//!
//! Layout: the weight matrix is `rows × cols`, each row `cols` elements of its dtype stored
//! contiguously (a GGUF tensor with dims `[cols, rows]`); activations are `m × cols` f32, row-major;
//! the output is `m × rows`, row-major (`out[i·rows + r] = W[r] · x[i]`).
//!
//! The activations are quantized once into the weight type's activation format, then the work is
//! split over tiles of weight rows. Within a tile each weight row is read from memory once and
//! multiplied with every activation row (in blocks that stay in cache), so decode with several
//! sequences and prefill both pay for the weights once.

use crate::dispatch::{prefetch, quantize_activations, vec_dot, vec_dot_rows, Isa, DOT_ROWS};
use crate::dtype::DType;
use crate::packed::{
    act_block_sums, dot_packed_span, needs_act_sums, packable, packed_block_bytes, PACK_ACTS,
    PACK_ROWS,
};
use crate::pool::ThreadPool;

/// Why bytes are not the matrix (or packed matrix) they were said to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum MatrixError {
    /// A row of `cols` elements does not end on a block boundary of `dtype`.
    #[error("{cols} columns is not a whole number of {dtype} blocks")]
    PartialBlock { dtype: DType, cols: usize },
    /// The data is not exactly `rows × cols` elements of `dtype`.
    #[error("{rows}×{cols} {dtype} needs {expected_bytes} bytes, got {actual_bytes}")]
    DataSize {
        dtype: DType,
        rows: usize,
        cols: usize,
        expected_bytes: usize,
        actual_bytes: usize,
    },
    /// The packed bytes do not fit the matrix (wrong size, or a type or row count that does not pack).
    #[error("{packed_bytes} bytes are not a packed {rows}×{cols} {dtype} matrix")]
    NotPacked {
        dtype: DType,
        rows: usize,
        cols: usize,
        packed_bytes: usize,
    },
}

/// A weight matrix in its stored layout, and optionally the same weights packed for the
/// batched kernel ([`crate::packed`]), which is then used for every multiplication.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    pub dtype: DType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub packed: Option<&'a [u8]>,
}

impl<'a> Matrix<'a> {
    /// Checks that `data` holds `rows × cols` elements of `dtype`.
    pub fn new(
        dtype: DType,
        data: &'a [u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, MatrixError> {
        let row_bytes = dtype
            .row_bytes(cols)
            .ok_or(MatrixError::PartialBlock { dtype, cols })?;
        if data.len() != row_bytes * rows {
            return Err(MatrixError::DataSize {
                dtype,
                rows,
                cols,
                expected_bytes: row_bytes * rows,
                actual_bytes: data.len(),
            });
        }
        Ok(Self {
            dtype,
            data,
            rows,
            cols,
            packed: None,
        })
    }

    /// The same matrix with its packed form attached (see [`crate::packed::pack`]).
    pub fn with_packed(self, packed: &'a [u8]) -> Result<Self, MatrixError> {
        let need =
            self.rows / PACK_ROWS * (self.cols / crate::dtype::QK) * packed_block_bytes(self.dtype);
        if !packable(self.dtype) || !self.rows.is_multiple_of(PACK_ROWS) || packed.len() != need {
            return Err(MatrixError::NotPacked {
                dtype: self.dtype,
                rows: self.rows,
                cols: self.cols,
                packed_bytes: packed.len(),
            });
        }
        Ok(Self {
            packed: Some(packed),
            ..self
        })
    }

    /// The activation format this matrix is multiplied with: Q8x32 once packed (K-quants
    /// too), else its type's.
    pub fn activation_format(&self) -> crate::dtype::ActFormat {
        if self.packed.is_some() {
            crate::dtype::ActFormat::Q8x32
        } else {
            self.dtype.activation_format()
        }
    }

    pub fn row_bytes(&self) -> usize {
        self.data.len() / self.rows.max(1)
    }

    /// The bytes of row `r`.
    pub fn row(&self, r: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[r * rb..(r + 1) * rb]
    }
}

/// Reusable buffers for quantized activations, grown on first use and then reused, so the
/// steady-state decode loop allocates nothing.
#[derive(Debug, Default)]
pub struct Scratch {
    /// u32-backed so f32 activation rows are aligned.
    words: Vec<u32>,
    /// The activation blocks' sums, where a packed kernel needs them.
    sums: Vec<i32>,
}

/// `len` bytes of u32-backed storage.
fn bytes_of(words: &mut Vec<u32>, len: usize) -> &mut [u8] {
    let n = len.div_ceil(4);
    if words.len() < n {
        words.resize(n, 0);
    }
    // SAFETY: u32 storage reinterpreted as bytes, within its length.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, len) }
}

/// A raw output pointer shared by the workers of one parallel loop, each writing disjoint
/// elements.
#[derive(Clone, Copy)]
pub(crate) struct SharedOut(*mut f32);
// SAFETY: workers write disjoint indices of one live slice; `for_each` returns only after all
// writes are done.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    pub(crate) fn new(ptr: *mut f32) -> Self {
        Self(ptr)
    }

    /// The pointer (a method, so closures capture the `Sync` wrapper, not the raw field).
    pub(crate) fn get(&self) -> *mut f32 {
        self.0
    }
}

/// How many weight rows ahead of the current one are requested from memory.
const PREFETCH_ROWS: usize = 2;

/// Activation rows processed together against one weight row.
const ACT_BLOCK: usize = 32;

/// `out[i·rows + r] = W[r] · x[i]` for `i < m`, `r < rows`.
pub fn matmul(
    pool: &ThreadPool,
    isa: Isa,
    w: &Matrix<'_>,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    scratch: &mut Scratch,
) {
    matmul_many(pool, isa, &[*w], x, m, &mut [out], scratch);
}

/// Most weight matrices one [`matmul_many`] call fuses.
pub const MAX_FUSED: usize = 4;

/// Packed weights one claimed tile of a batched matmul covers at most: long runs for the
/// hardware prefetchers (a thread's tiles are not adjacent), small enough to balance threads.
const TILE_BYTES: usize = 512 << 10;
/// Packed weights every activation row passes over before the next span: they stay in L2.
const SPAN_BYTES: usize = 48 << 10;

/// Bytes of one group of PACK_ROWS packed rows.
fn packed_group_bytes(w: &Matrix<'_>) -> usize {
    (w.cols / crate::dtype::QK) * packed_block_bytes(w.dtype)
}

/// Several matrices applied to the same activations (Q/K/V, gate/up): the activations are
/// quantized once and the tiles of all matrices share one parallel loop. Matrices whose weight
/// types need different activation formats run as separate groups.
pub fn matmul_many(
    pool: &ThreadPool,
    isa: Isa,
    ws: &[Matrix<'_>],
    x: &[f32],
    m: usize,
    outs: &mut [&mut [f32]],
    scratch: &mut Scratch,
) {
    assert!(
        !ws.is_empty() && ws.len() == outs.len() && ws.len() <= MAX_FUSED,
        "1..={MAX_FUSED} matrices, one output each"
    );
    let format = ws[0].activation_format();
    if let Some(split) = ws.iter().position(|w| w.activation_format() != format) {
        let (first_outs, rest_outs) = outs.split_at_mut(split);
        matmul_many(pool, isa, &ws[..split], x, m, first_outs, scratch);
        matmul_many(pool, isa, &ws[split..], x, m, rest_outs, scratch);
        return;
    }
    let cols = ws[0].cols;
    assert_eq!(x.len(), m * cols, "activations must be m × cols");
    for (w, out) in ws.iter().zip(outs.iter()) {
        assert_eq!(w.cols, cols, "fused matrices share their input width");
        assert_eq!(out.len(), m * w.rows, "output must be m × rows");
    }
    let act_row = format.row_bytes(cols);
    let Scratch { words, sums } = scratch;
    let acts = bytes_of(words, act_row * m);
    if m >= 4 {
        let acts_out = SharedOut::new(acts.as_mut_ptr() as *mut f32);
        pool.for_each(m, &|i| {
            // SAFETY: row i of the scratch is written by item i only.
            let row = unsafe {
                std::slice::from_raw_parts_mut(
                    (acts_out.get() as *mut u8).add(i * act_row),
                    act_row,
                )
            };
            quantize_activations(isa, format, &x[i * cols..(i + 1) * cols], row);
        });
    } else {
        for i in 0..m {
            quantize_activations(
                isa,
                format,
                &x[i * cols..(i + 1) * cols],
                &mut acts[i * act_row..(i + 1) * act_row],
            );
        }
    }
    let acts: &[u8] = acts;
    // Per activation row, its blocks' sums (Q8_0 packed unsigned takes them off).
    let nb = cols / crate::dtype::QK;
    let sums: &[i32] = if ws
        .iter()
        .any(|w| w.packed.is_some() && needs_act_sums(w.dtype))
    {
        sums.resize(m * nb, 0);
        for (i, row) in sums.chunks_exact_mut(nb).enumerate() {
            act_block_sums(&acts[i * act_row..(i + 1) * act_row], cols, row);
        }
        sums
    } else {
        &[]
    };

    // Enough tiles to balance the threads, few enough that each is worth a hand-off.
    let threads = pool.threads();
    let mut tile = [0usize; MAX_FUSED];
    let mut first_tile = [0usize; MAX_FUSED + 1];
    let mut out_ptrs = [SharedOut::new(std::ptr::null_mut()); MAX_FUSED];
    for (j, w) in ws.iter().enumerate() {
        // Packed matrices are tiled in groups of PACK_ROWS rows.
        let unit = if w.packed.is_some() { PACK_ROWS } else { 1 };
        let units = w.rows / unit;
        tile[j] = unit
            * if m == 1 {
                // Decode streams the weights: one long contiguous run per thread keeps the
                // hardware prefetchers ahead.
                units.div_ceil(threads).max(1)
            } else if w.packed.is_some() {
                // Runs of up to TILE_BYTES of weights (spans of SPAN_BYTES inside, see below):
                // long enough to stream from memory, enough of them to balance the threads.
                let group = packed_group_bytes(w);
                let span = (SPAN_BYTES / group).max(1);
                (units / (threads * 4)).clamp(span, (TILE_BYTES / group).max(span))
            } else {
                (units / (threads * 4)).clamp(1, 64usize.div_ceil(unit))
            };
        first_tile[j + 1] = first_tile[j] + w.rows.div_ceil(tile[j]);
        out_ptrs[j] = SharedOut::new(outs[j].as_mut_ptr());
    }
    let tiles = first_tile[ws.len()];
    pool.for_each(tiles, &|t| {
        let j = (0..ws.len()).rfind(|&j| first_tile[j] <= t).unwrap_or(0);
        let (w, out_ptr, tile) = (&ws[j], &out_ptrs[j], tile[j]);
        let rows = w.rows;
        let local = t - first_tile[j];
        let (r0, r1) = (local * tile, ((local + 1) * tile).min(rows));
        let act = |i: usize| &acts[i * act_row..(i + 1) * act_row];
        if let Some(packed) = w.packed {
            let (g0, g1) = (r0 / PACK_ROWS, r1 / PACK_ROWS);
            // Spans that stay in cache while every activation row (PACK_ACTS at a time) passes
            // over them; each span's passes prefetch the next span.
            let span = (SPAN_BYTES / packed_group_bytes(w)).max(1);
            let passes = m.div_ceil(PACK_ACTS);
            let mut s0 = g0;
            while s0 < g1 {
                let s1 = (s0 + span).min(g1);
                // With several passes over this span, each brings a share of the next one into
                // L2 (and reads ahead within the span only); a single pass streams two groups
                // ahead, into the next span too.
                let next = s1..(s1 + span).min(g1);
                let mut i = 0;
                while i < m {
                    let n = (m - i).min(PACK_ACTS);
                    let pass = i / PACK_ACTS;
                    let prefetch = if passes == 1 {
                        (g1, 0..0)
                    } else {
                        let share = |p: usize| next.start + next.len() * p / passes;
                        (s1, share(pass)..share(pass + 1))
                    };
                    let rows_in: [&[u8]; PACK_ACTS] =
                        std::array::from_fn(|k| act(i + k.min(n - 1)));
                    let sums_in: [&[i32]; PACK_ACTS] = std::array::from_fn(|k| {
                        let at = (i + k.min(n - 1)) * nb;
                        sums.get(at..at + nb).unwrap_or(&[])
                    });
                    // SAFETY: this tile alone writes columns 8·s0..8·s1 of output rows
                    // i..i + n, all inside the m × rows output.
                    unsafe {
                        dot_packed_span(
                            isa,
                            w.dtype,
                            packed,
                            s0,
                            s1 - s0,
                            (&rows_in[..n], &sums_in[..n]),
                            cols,
                            out_ptr.get().add(i * rows),
                            rows,
                            prefetch,
                        )
                    };
                    i += n;
                }
                s0 = s1;
            }
            return;
        }
        for i0 in (0..m).step_by(ACT_BLOCK) {
            let i1 = (i0 + ACT_BLOCK).min(m);
            for r in r0..r1 {
                let wr = w.row(r);
                if r + PREFETCH_ROWS < r1 {
                    prefetch(w.row(r + PREFETCH_ROWS));
                }
                let mut i = i0;
                while i + DOT_ROWS <= i1 {
                    let rows4 = std::array::from_fn(|k| act(i + k));
                    let values = vec_dot_rows(isa, w.dtype, wr, rows4, cols);
                    for (k, v) in values.into_iter().enumerate() {
                        // SAFETY: element (i + k, r) belongs to this tile's rows only; in
                        // bounds as the output is m × rows.
                        unsafe { *out_ptr.get().add((i + k) * rows + r) = v };
                    }
                    i += DOT_ROWS;
                }
                for i in i..i1 {
                    let v = vec_dot(isa, w.dtype, wr, act(i), cols);
                    // SAFETY: as above.
                    unsafe { *out_ptr.get().add(i * rows + r) = v };
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::dequantize_row;
    use crate::testing::{random_f32, random_row};

    #[test]
    fn fused_matmuls_equal_separate_ones() {
        let pool = ThreadPool::new(2);
        let cols = 256;
        let specs = [(DType::Q4_1, 40), (DType::Q4_1, 24), (DType::Q6_K, 24)];
        let data: Vec<Vec<u8>> = specs
            .iter()
            .enumerate()
            .map(|(j, &(d, rows))| {
                (0..rows)
                    .flat_map(|r| random_row(d, cols, (j * 100 + r) as u64))
                    .collect()
            })
            .collect();
        let ws: Vec<Matrix> = specs
            .iter()
            .zip(&data)
            .map(|(&(d, rows), bytes)| Matrix::new(d, bytes, rows, cols).unwrap())
            .collect();
        for m in [1, 5] {
            let x = random_f32(m * cols, 7);
            let mut fused: Vec<Vec<f32>> = ws.iter().map(|w| vec![0f32; m * w.rows]).collect();
            let mut outs: Vec<&mut [f32]> = fused.iter_mut().map(|v| v.as_mut_slice()).collect();
            let mut scratch = Scratch::default();
            matmul_many(&pool, Isa::detect(), &ws, &x, m, &mut outs, &mut scratch);
            for (w, got) in ws.iter().zip(&fused) {
                let mut alone = vec![0f32; m * w.rows];
                matmul(&pool, Isa::detect(), w, &x, m, &mut alone, &mut scratch);
                assert_eq!(&alone, got);
            }
        }
    }

    #[test]
    fn packed_matmuls_match_row_kernels_and_do_not_depend_on_the_batch() {
        let pool = ThreadPool::new(3);
        for (dtype, cols, rows) in [
            // Wide rows: a group is more than SPAN_BYTES, so a tile holds several spans.
            (DType::Q8_0, 6144, 208),
            (DType::Q4_0, 160, 48),
            (DType::Q4_1, 160, 48),
            (DType::Q8_0, 160, 48),
            (DType::Q5_1, 160, 48),
            (DType::Q4_K, 512, 48),
            (DType::Q5_K, 512, 48),
            (DType::Q6_K, 512, 48),
            (DType::Q3_K, 512, 48),
        ] {
            // K-quants' row kernels take Q8xK activations (blocks of 256), their packed kernel
            // Q8x32: the two differ by the activations' rounding.
            let tolerance = if dtype.activation_format() == crate::dtype::ActFormat::Q8x32 {
                1e-4
            } else {
                2e-2
            };
            let data: Vec<u8> = (0..rows)
                .flat_map(|r| random_row(dtype, cols, r as u64 + 7))
                .collect();
            let plain = Matrix::new(dtype, &data, rows, cols).unwrap();
            let packed_bytes = crate::packed::pack(dtype, &data, rows, cols).unwrap();
            let packed = plain.with_packed(&packed_bytes).unwrap();
            let m = 37;
            let x = random_f32(m * cols, 5);
            let mut scratch = Scratch::default();
            for isa in Isa::available() {
                let (mut a, mut b) = (vec![0f32; m * rows], vec![0f32; m * rows]);
                matmul(&pool, isa, &plain, &x, m, &mut a, &mut scratch);
                matmul(&pool, isa, &packed, &x, m, &mut b, &mut scratch);
                let rms = (a.iter().map(|v| v * v).sum::<f32>() / a.len() as f32).sqrt();
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    assert!(
                        (p - q).abs() <= tolerance * p.abs().max(rms).max(1.0),
                        "{dtype} {isa:?} {i}: {p} vs {q}"
                    );
                }
                // Each row alone gives exactly what it gave in the batch.
                for i in [0, 3, 36] {
                    let mut one = vec![0f32; rows];
                    let xi = &x[i * cols..(i + 1) * cols];
                    matmul(&pool, isa, &packed, xi, 1, &mut one, &mut scratch);
                    assert_eq!(one, b[i * rows..(i + 1) * rows], "{dtype} {isa:?} row {i}");
                }
            }
        }
        let data = random_row(DType::Q4_1, 64, 1).repeat(8);
        let w = Matrix::new(DType::Q4_1, &data, 8, 64).unwrap();
        assert!(w.with_packed(&[0u8; 3]).is_err());
    }

    #[test]
    fn matches_dequantized_reference() {
        let pool = ThreadPool::new(3);
        for dtype in [
            DType::F32,
            DType::F16,
            DType::BF16,
            DType::Q4_1,
            DType::Q8_0,
            DType::Q4_K,
            DType::Q6_K,
        ] {
            let cols = 512;
            for (rows, m) in [(7, 1), (33, 3), (70, 5)] {
                let data: Vec<u8> = (0..rows)
                    .flat_map(|r| random_row(dtype, cols, r as u64 + 1))
                    .collect();
                let w = Matrix::new(dtype, &data, rows, cols).unwrap();
                let x = random_f32(m * cols, 99);
                let mut out = vec![0f32; m * rows];
                let mut scratch = Scratch::default();
                for isa in Isa::available() {
                    matmul(&pool, isa, &w, &x, m, &mut out, &mut scratch);
                    let mut wrow = vec![0f32; cols];
                    for r in 0..rows {
                        dequantize_row(dtype, w.row(r), &mut wrow);
                        for i in 0..m {
                            let exact: f32 = wrow
                                .iter()
                                .zip(&x[i * cols..(i + 1) * cols])
                                .map(|(a, b)| a * b)
                                .sum();
                            let norm: f32 = wrow.iter().map(|v| v.abs()).sum::<f32>() + 1.0;
                            let got = out[i * rows + r];
                            // Quantized activations: error ≲ |w|₁ · max|x| / 127.
                            assert!(
                                (got - exact).abs() <= norm * 0.02,
                                "{dtype} {isa:?} r{r} i{i}: {got} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }
}
