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
use crate::pool::ThreadPool;

/// A weight matrix in its stored layout.
#[derive(Debug, Clone, Copy)]
pub struct Matrix<'a> {
    pub dtype: DType,
    pub data: &'a [u8],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Matrix<'a> {
    /// Checks that `data` holds `rows × cols` elements of `dtype`.
    pub fn new(dtype: DType, data: &'a [u8], rows: usize, cols: usize) -> Result<Self, String> {
        let row_bytes = dtype
            .row_bytes(cols)
            .ok_or_else(|| format!("{cols} columns is not a whole number of {dtype} blocks"))?;
        if data.len() != row_bytes * rows {
            return Err(format!(
                "{rows}×{cols} {dtype} needs {} bytes, got {}",
                row_bytes * rows,
                data.len()
            ));
        }
        Ok(Self {
            dtype,
            data,
            rows,
            cols,
        })
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
}

impl Scratch {
    fn bytes(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(4);
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        // SAFETY: u32 storage reinterpreted as bytes, within its length.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, len) }
    }
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
    let (rows, cols) = (w.rows, w.cols);
    assert_eq!(x.len(), m * cols, "activations must be m × cols");
    assert_eq!(out.len(), m * rows, "output must be m × rows");
    let format = w.dtype.activation_format();
    let act_row = format.row_bytes(cols);
    let acts = scratch.bytes(act_row * m);
    if m >= 4 {
        let acts_out = SharedOut(acts.as_mut_ptr() as *mut f32);
        pool.for_each(m, &|i| {
            let base = acts_out;
            // SAFETY: row i of the scratch is written by item i only.
            let row = unsafe {
                std::slice::from_raw_parts_mut((base.0 as *mut u8).add(i * act_row), act_row)
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

    // Enough tiles to balance the threads, few enough that each is worth a hand-off.
    let threads = pool.threads();
    let tile = (rows / (threads * 4)).clamp(1, 64);
    let tiles = rows.div_ceil(tile);
    let out_ptr = SharedOut::new(out.as_mut_ptr());
    pool.for_each(tiles, &|t| {
        let (r0, r1) = (t * tile, ((t + 1) * tile).min(rows));
        for i0 in (0..m).step_by(ACT_BLOCK) {
            let i1 = (i0 + ACT_BLOCK).min(m);
            for r in r0..r1 {
                let wr = w.row(r);
                if r + PREFETCH_ROWS < r1 {
                    prefetch(w.row(r + PREFETCH_ROWS));
                }
                let act = |i: usize| &acts[i * act_row..(i + 1) * act_row];
                let mut i = i0;
                while i + DOT_ROWS <= i1 {
                    let rows4 = std::array::from_fn(|k| act(i + k));
                    let values = vec_dot_rows(isa, w.dtype, wr, rows4, cols);
                    for (k, v) in values.into_iter().enumerate() {
                        // SAFETY: element (i + k, r) belongs to this tile's rows only; in
                        // bounds as out.len() == m × rows.
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
    fn matches_dequantized_reference() {
        let pool = ThreadPool::new(3);
        for dtype in [
            DType::F32,
            DType::F16,
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
