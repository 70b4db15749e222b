//! Dense f32 matrix multiply for encoder layers: `out = act(x·Wᵀ + bias + residual)`, with `W`
//! packed once (at model load) into column panels and multiplied by register-tiled micro-kernels.
//!
//! Layouts:
//! - `W` is `rows × cols`, row-major (PyTorch's `nn.Linear`: outputs × inputs).
//! - Packed ([`PackedMatrix`]), the outputs are split into panels of [`NR`] (the last one padded
//!   with zero weights); panel `p` holds, for each input index `k` in order, the [`NR`] weights
//!   `W[p·NR + j][k]` side by side. A micro-kernel reads a stretch of one panel front to back.
//! - `x` is `m × cols` and `out` (and `residual`) `m × rows`, row-major.
//!
//! Blocking (BLIS order): the inputs are cut into at most [`KC`]-long blocks; within a block, one
//! panel stretch (`kc × NR`, L1-sized) is reused by every [`MR`]-row tile of a block of rows
//! whose `x` slice (`rows × kc`) stays in L2. Work items are (row block, panel range) pairs
//! claimed by the thread pool.
//!
//! Every output element is accumulated in the same order whatever `m` is (k blocks in order, `k`
//! ascending within a block, a tile's first block adding the bias), so a row's result does not
//! depend on the rows it is batched with.

use crate::dispatch::Isa;
use crate::matmul::SharedOut;
use crate::pool::ThreadPool;

/// Output columns of a panel (two AVX2 vectors).
pub const NR: usize = 16;
/// Rows of a micro-kernel tile.
pub const MR: usize = 6;
/// Longest input block: a panel stretch of `KC × NR` f32 is 24 KiB, most of a 32 KiB L1 (384
/// measured faster than 256 or 512 on Zen 3, and it is one block for 384-wide inputs).
pub const KC: usize = 384;
/// Rows per work item (a multiple of [`MR`]): `MC × KC` f32 of `x` stay in L2.
const MC: usize = 72;
/// Most panels per work item.
const MAX_ITEM_PANELS: usize = 8;
/// f32 per 64-byte cache line: the packed data starts on a line.
const LINE_FLOATS: usize = 16;

/// A weight matrix packed into [`NR`]-wide column panels (see the module docs).
#[derive(Clone)]
pub struct PackedMatrix {
    rows: usize,
    cols: usize,
    storage: Vec<f32>,
    /// Index of the first packed float in `storage` (aligned to a cache line).
    start: usize,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl PackedMatrix {
    /// Packs a row-major `rows × cols` matrix.
    pub fn pack(w: &[f32], rows: usize, cols: usize) -> Self {
        assert_eq!(w.len(), rows * cols, "w must be rows × cols");
        Self::pack_stacked(&[w], cols)
    }

    /// Packs matrices of `cols` columns stacked on top of each other (their rows one after
    /// another), e.g. the query, key and value projections as one `3h × h` matrix.
    pub fn pack_stacked(parts: &[&[f32]], cols: usize) -> Self {
        assert!(cols > 0, "matrices need at least one column");
        for part in parts {
            assert_eq!(
                part.len() % cols,
                0,
                "each part must be whole rows of {cols}"
            );
        }
        let rows: usize = parts.iter().map(|p| p.len() / cols).sum();
        let panels = rows.div_ceil(NR);
        let mut storage = vec![0f32; panels * NR * cols + LINE_FLOATS];
        let misalign = (storage.as_ptr() as usize / 4) % LINE_FLOATS;
        let start = (LINE_FLOATS - misalign) % LINE_FLOATS;
        let packed = &mut storage[start..start + panels * NR * cols];
        let row_at = |r: usize| -> &[f32] {
            let mut r = r;
            for part in parts {
                let part_rows = part.len() / cols;
                if r < part_rows {
                    return &part[r * cols..(r + 1) * cols];
                }
                r -= part_rows;
            }
            unreachable!("row index below the total")
        };
        for r in 0..rows {
            let (p, j) = (r / NR, r % NR);
            let panel = &mut packed[p * NR * cols..(p + 1) * NR * cols];
            for (k, &v) in row_at(r).iter().enumerate() {
                panel[k * NR + j] = v;
            }
        }
        Self {
            rows,
            cols,
            storage,
            start,
        }
    }

    /// Outputs (rows of `W`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Inputs (columns of `W`).
    pub fn cols(&self) -> usize {
        self.cols
    }

    fn panels(&self) -> usize {
        self.rows.div_ceil(NR)
    }

    /// The packed floats, `panels × cols × NR`.
    fn data(&self) -> &[f32] {
        &self.storage[self.start..self.start + self.panels() * NR * self.cols]
    }
}

/// What happens to `x·Wᵀ` before it is stored.
#[derive(Debug, Clone, Copy, Default)]
pub struct Epilogue<'a> {
    /// Added to every row (`rows` long).
    pub bias: Option<&'a [f32]>,
    /// Added element by element (`m × rows`, like the output): a residual connection.
    pub residual: Option<&'a [f32]>,
    /// Applied last.
    pub activation: Activation,
}

/// An elementwise function on the finished sums.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Activation {
    #[default]
    None,
    /// Exact GELU, `x·Φ(x)` (BERT's `gelu`).
    GeluErf,
}

/// One micro-kernel call: a tile of `mr ≤ MR` rows and `nr ≤ NR` columns over one input block.
#[derive(Clone, Copy)]
pub(crate) struct Tile {
    /// Input block length.
    pub kc: usize,
    /// `x` at the tile's first row and the block's first input; rows `lda` apart.
    pub a: *const f32,
    pub lda: usize,
    /// The panel stretch: `kc × NR` floats.
    pub b: *const f32,
    /// `out` at the tile's first element; rows `ldc` apart.
    pub c: *mut f32,
    pub ldc: usize,
    pub mr: usize,
    pub nr: usize,
    /// First input block: the sums start from `bias` (and `residual`) instead of `c`.
    pub first: bool,
    /// Last input block: the activation is applied.
    pub last: bool,
    /// `NR` biases of the tile's columns (zero-padded beyond `nr`), or null.
    pub bias: *const f32,
    /// The residual at the tile's first element (rows `ldc` apart), or null.
    pub residual: *const f32,
    pub activation: Activation,
}

/// `out = act(x·Wᵀ + bias + residual)` for `m` rows of `x` (see the module docs for layouts).
pub fn gemm(
    pool: &ThreadPool,
    isa: Isa,
    x: &[f32],
    m: usize,
    w: &PackedMatrix,
    epilogue: Epilogue<'_>,
    out: &mut [f32],
) {
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), m * k, "x must be m × cols");
    assert_eq!(out.len(), m * n, "out must be m × rows");
    if let Some(bias) = epilogue.bias {
        assert_eq!(bias.len(), n, "one bias per output");
    }
    if let Some(residual) = epilogue.residual {
        assert_eq!(residual.len(), m * n, "residual must be m × rows");
    }
    if m == 0 || n == 0 {
        return;
    }
    let panels = w.panels();
    // Biases padded to whole panels, so a tile always reads NR of them.
    let bias_padded: Option<Vec<f32>> = epilogue.bias.map(|b| {
        let mut v = b.to_vec();
        v.resize(panels * NR, 0.0);
        v
    });
    let k_blocks = k.div_ceil(KC);
    let kc = k.div_ceil(k_blocks);
    let row_blocks = m.div_ceil(MC);
    // Enough items to keep every thread busy, few enough that each reuses its panels.
    let wanted = (4 * pool.threads()).div_ceil(row_blocks);
    let item_panels = panels.div_ceil(wanted).clamp(1, MAX_ITEM_PANELS);
    let panel_groups = panels.div_ceil(item_panels);
    let data = w.data();
    let out_ptr = SharedOut::new(out.as_mut_ptr());
    let kernel = tile_kernel(isa);
    pool.for_each(row_blocks * panel_groups, &|item| {
        let (row_block, group) = (item / panel_groups, item % panel_groups);
        let (i0, i1) = (row_block * MC, ((row_block + 1) * MC).min(m));
        let (p0, p1) = (group * item_panels, ((group + 1) * item_panels).min(panels));
        for kb in 0..k_blocks {
            let k0 = kb * kc;
            let klen = kc.min(k - k0);
            for p in p0..p1 {
                let col = p * NR;
                let nr = NR.min(n - col);
                for i in (i0..i1).step_by(MR) {
                    let tile = Tile {
                        kc: klen,
                        a: x[i * k + k0..].as_ptr(),
                        lda: k,
                        b: data[p * NR * k + k0 * NR..].as_ptr(),
                        // SAFETY: element (i, col) is inside the m × n output.
                        c: unsafe { out_ptr.get().add(i * n + col) },
                        ldc: n,
                        mr: MR.min(i1 - i),
                        nr,
                        first: kb == 0,
                        last: kb + 1 == k_blocks,
                        bias: bias_padded
                            .as_ref()
                            .map_or(std::ptr::null(), |b| b[col..].as_ptr()),
                        residual: epilogue
                            .residual
                            .map_or(std::ptr::null(), |r| r[i * n + col..].as_ptr()),
                        activation: epilogue.activation,
                    };
                    // SAFETY: the tile's rows i..i + mr of x (inputs k0..k0 + klen) and of out
                    // (columns col..col + nr) are in bounds by the asserts above; this item alone
                    // writes rows i0..i1 × panels p0..p1 of out; the panel stretch holds
                    // klen × NR floats.
                    unsafe { kernel(&tile) };
                }
            }
        }
    });
}

type TileKernel = unsafe fn(&Tile);

fn tile_kernel(isa: Isa) -> TileKernel {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        return crate::x86::gemm_tile;
    }
    let _ = isa;
    tile_scalar
}

/// The scalar micro-kernel: the same tile, the same accumulation order.
///
/// # Safety
/// The pointers of `t` are valid for the tile (see [`Tile`]).
unsafe fn tile_scalar(t: &Tile) {
    let mut acc = [[0f32; NR]; MR];
    for k in 0..t.kc {
        let b = std::slice::from_raw_parts(t.b.add(k * NR), NR);
        for (i, row) in acc.iter_mut().enumerate().take(t.mr) {
            let a = *t.a.add(i * t.lda + k);
            for (c, &bv) in row.iter_mut().zip(b) {
                *c += a * bv;
            }
        }
    }
    for (i, row) in acc.iter().enumerate().take(t.mr) {
        for (j, &v) in row.iter().enumerate().take(t.nr) {
            let c = t.c.add(i * t.ldc + j);
            let mut v = v;
            if t.first {
                if !t.bias.is_null() {
                    v += *t.bias.add(j);
                }
                if !t.residual.is_null() {
                    v += *t.residual.add(i * t.ldc + j);
                }
            } else {
                v += *c;
            }
            if t.last && t.activation == Activation::GeluErf {
                v = crate::ops::gelu_erf(v);
            }
            *c = v;
        }
    }
}

/// The plain definition, for tests: `out = act(x·Wᵀ + bias + residual)` with `w` unpacked.
pub fn gemm_reference(
    x: &[f32],
    m: usize,
    w: &[f32],
    rows: usize,
    epilogue: Epilogue<'_>,
    out: &mut [f32],
) {
    let cols = w.len() / rows.max(1);
    for i in 0..m {
        for r in 0..rows {
            let xr = &x[i * cols..(i + 1) * cols];
            let wr = &w[r * cols..(r + 1) * cols];
            let mut v = xr
                .iter()
                .zip(wr)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>() as f32;
            v += epilogue.bias.map_or(0.0, |b| b[r]);
            v += epilogue.residual.map_or(0.0, |res| res[i * rows + r]);
            if epilogue.activation == Activation::GeluErf {
                v = crate::ops::gelu_erf(v);
            }
            out[i * rows + r] = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::random_f32;

    fn check(isa: Isa, pool: &ThreadPool, m: usize, rows: usize, cols: usize, seed: u64) {
        let w = random_f32(rows * cols, seed);
        let x = random_f32(m * cols, seed + 1);
        let bias = random_f32(rows, seed + 2);
        let residual = random_f32(m * rows, seed + 3);
        let packed = PackedMatrix::pack(&w, rows, cols);
        for (use_bias, use_residual, activation) in [
            (false, false, Activation::None),
            (true, false, Activation::GeluErf),
            (true, true, Activation::None),
        ] {
            let epilogue = Epilogue {
                bias: use_bias.then_some(bias.as_slice()),
                residual: use_residual.then_some(residual.as_slice()),
                activation,
            };
            let mut want = vec![0f32; m * rows];
            gemm_reference(&x, m, &w, rows, epilogue, &mut want);
            let mut got = vec![f32::NAN; m * rows];
            gemm(pool, isa, &x, m, &packed, epilogue, &mut got);
            // Sums of `cols` products of values in [-1, 1): f32 rounding grows like √cols.
            let tolerance = 1e-5 * (cols as f32).sqrt() * 4.0;
            for (e, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= tolerance * w.abs().max(1.0),
                    "{isa:?} m {m} rows {rows} cols {cols} {activation:?} [{}, {}]: {g} vs {w}",
                    e / rows,
                    e % rows
                );
            }
        }
    }

    #[test]
    fn matches_the_reference_on_awkward_shapes() {
        let pool = ThreadPool::new(3);
        for isa in Isa::available() {
            for (m, rows, cols) in [
                (1, 1, 1),
                (1, 16, 8),
                (5, 17, 3),
                (6, 32, 256),
                (7, 40, 257),
                (13, 33, 600),
                (73, 48, 100),
                (150, 100, 384),
                (2, 7, 1000),
            ] {
                check(
                    isa,
                    &pool,
                    m,
                    rows,
                    cols,
                    (m * 1000 + rows * 10 + cols) as u64,
                );
            }
        }
    }

    #[test]
    fn a_rows_result_does_not_depend_on_its_batch() {
        let pool = ThreadPool::new(2);
        let (rows, cols) = (48, 520);
        let w = random_f32(rows * cols, 1);
        let bias = random_f32(rows, 2);
        let packed = PackedMatrix::pack(&w, rows, cols);
        let m = 97;
        let x = random_f32(m * cols, 3);
        let epilogue = Epilogue {
            bias: Some(&bias),
            ..Epilogue::default()
        };
        for isa in Isa::available() {
            let mut all = vec![0f32; m * rows];
            gemm(&pool, isa, &x, m, &packed, epilogue, &mut all);
            for i in [0, 5, 6, 71, 72, 96] {
                let mut one = vec![0f32; rows];
                gemm(
                    &pool,
                    isa,
                    &x[i * cols..(i + 1) * cols],
                    1,
                    &packed,
                    epilogue,
                    &mut one,
                );
                assert_eq!(one, all[i * rows..(i + 1) * rows], "{isa:?} row {i}");
            }
        }
    }

    #[test]
    fn stacked_packing_equals_packing_the_concatenation() {
        let cols = 24;
        let (a, b) = (random_f32(20 * cols, 1), random_f32(9 * cols, 2));
        let stacked = PackedMatrix::pack_stacked(&[&a, &b], cols);
        let joined: Vec<f32> = a.iter().chain(&b).copied().collect();
        let whole = PackedMatrix::pack(&joined, 29, cols);
        assert_eq!(stacked.rows(), 29);
        assert_eq!(stacked.data(), whole.data());
        assert_eq!(stacked.data().as_ptr() as usize % 64, 0);
    }
}
