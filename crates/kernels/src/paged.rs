//! Attention over a paged KV cache.
//!
//! A layer's keys and values live in fixed-size blocks of `block_tokens` token slots anywhere in
//! one storage buffer; each sequence finds its positions through its block table. Rows are
//! stored as f32, f16 or Q8_0 (the GGUF block layout), decoded on the fly by the kernels.
//!
//! One work item per (query row, KV head) computes every query head that shares the KV head, so
//! a query row reads each cached key and value once per KV head rather than once per query head
//! (SmolLM2's 9 heads over 3 KV heads: 3 reads, not 9). An item computes its scores block by
//! block into a per-thread buffer, takes the softmax, then sums the values block by block.

use std::cell::RefCell;

use half::f16;

use crate::dispatch::Isa;
use crate::matmul::SharedOut;
use crate::pool::ThreadPool;

/// Values per Q8_0 block.
pub(crate) const Q8_0_BLOCK: usize = 32;
/// Bytes per Q8_0 block: an f16 scale, then 32 signed quants (GGUF's `block_q8_0`).
pub(crate) const Q8_0_BLOCK_BYTES: usize = 34;

/// Element type of the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum KvDType {
    F32,
    F16,
    /// Blocks of 32 values: an f16 scale `d` and 32 `i8` quants, `value = d·q`.
    Q8_0,
}

impl KvDType {
    pub const ALL: [KvDType; 3] = [KvDType::F32, KvDType::F16, KvDType::Q8_0];

    pub fn name(self) -> &'static str {
        match self {
            KvDType::F32 => "f32",
            KvDType::F16 => "f16",
            KvDType::Q8_0 => "q8_0",
        }
    }

    /// The type named `s` (`f32`, `f16`, `q8_0` or `q8`, any case).
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(KvDType::F32),
            "f16" => Some(KvDType::F16),
            "q8_0" | "q8" => Some(KvDType::Q8_0),
            _ => None,
        }
    }

    /// Bytes of one row of `elems` values (Q8_0: blocks of 32 = f16 scale + 32 i8, 34 bytes, as
    /// GGUF's Q8_0; a partial block would take a whole one, but [`KvDType::store_row`] only
    /// stores whole blocks).
    pub fn row_bytes(self, elems: usize) -> usize {
        match self {
            KvDType::F32 => 4 * elems,
            KvDType::F16 => 2 * elems,
            KvDType::Q8_0 => elems.div_ceil(Q8_0_BLOCK) * Q8_0_BLOCK_BYTES,
        }
    }

    /// Whether rows of `head_dim`-sized heads can be stored (Q8_0 needs `head_dim % 32 == 0`,
    /// so that every head starts on a block).
    pub fn supports(self, head_dim: usize) -> bool {
        head_dim > 0
            && match self {
                KvDType::F32 | KvDType::F16 => true,
                KvDType::Q8_0 => head_dim.is_multiple_of(Q8_0_BLOCK),
            }
    }

    /// Encodes `src` into `dst` (`dst.len() == row_bytes(src.len())`). F16 rounds to nearest;
    /// Q8_0 rounds like GGUF's `quantize_row_q8_0` (`d = amax/127`, `q = round(x/d)`, ties away
    /// from zero, `d` stored as f16).
    pub fn store_row(self, src: &[f32], dst: &mut [u8]) {
        assert_eq!(
            dst.len(),
            self.row_bytes(src.len()),
            "{self} row of {} values",
            src.len()
        );
        match self {
            KvDType::F32 => {
                for (d, v) in dst.chunks_exact_mut(4).zip(src) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
            KvDType::F16 => {
                for (d, v) in dst.chunks_exact_mut(2).zip(src) {
                    d.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            KvDType::Q8_0 => {
                assert_eq!(
                    src.len() % Q8_0_BLOCK,
                    0,
                    "q8_0 rows are whole blocks of 32"
                );
                for (block, xs) in dst
                    .chunks_exact_mut(Q8_0_BLOCK_BYTES)
                    .zip(src.chunks_exact(Q8_0_BLOCK))
                {
                    let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let inv = if d != 0.0 { 1.0 / d } else { 0.0 };
                    block[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
                    for (q, x) in block[2..].iter_mut().zip(xs) {
                        *q = (x * inv).round() as i8 as u8;
                    }
                }
            }
        }
    }

    /// Decodes a row (`src.len() == row_bytes(dst.len())`).
    pub fn load_row(self, src: &[u8], dst: &mut [f32]) {
        assert_eq!(
            src.len(),
            self.row_bytes(dst.len()),
            "{self} row of {} values",
            dst.len()
        );
        match self {
            KvDType::F32 => {
                for (v, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                    *v = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                }
            }
            KvDType::F16 => {
                for (v, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
                    *v = f16::from_le_bytes([s[0], s[1]]).to_f32();
                }
            }
            KvDType::Q8_0 => {
                assert_eq!(
                    dst.len() % Q8_0_BLOCK,
                    0,
                    "q8_0 rows are whole blocks of 32"
                );
                for (xs, block) in dst
                    .chunks_exact_mut(Q8_0_BLOCK)
                    .zip(src.chunks_exact(Q8_0_BLOCK_BYTES))
                {
                    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                    for (x, &q) in xs.iter_mut().zip(&block[2..]) {
                        *x = d * f32::from(q as i8);
                    }
                }
            }
        }
    }
}

impl std::fmt::Display for KvDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A name that is no [`KvDType`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown KV cache type `{name}` (expected f32, f16, q8_0 or q8)")]
pub struct UnknownKvDType {
    pub name: String,
}

impl std::str::FromStr for KvDType {
    type Err = UnknownKvDType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        KvDType::parse(s).ok_or_else(|| UnknownKvDType {
            name: s.to_string(),
        })
    }
}

/// One layer's paged key/value storage. Block `b` occupies bytes `[b·block_bytes,
/// (b+1)·block_bytes)` of `k` (and of `v`); token slot `s` of a block starts at `s·row_bytes`
/// within it; a row holds `kv_heads·head_dim` values in `dtype`, head `h` being values
/// `h·head_dim..(h+1)·head_dim`.
#[derive(Debug, Clone, Copy)]
pub struct PagedKv<'a> {
    pub dtype: KvDType,
    pub k: &'a [u8],
    pub v: &'a [u8],
    pub block_tokens: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PagedKv<'_> {
    /// Bytes of one token slot (all KV heads).
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.kv_heads * self.head_dim)
    }

    /// Bytes of one block of `block_tokens` slots.
    pub fn block_bytes(&self) -> usize {
        self.row_bytes() * self.block_tokens
    }
}

/// One query row: it sees positions `first..keys` of its sequence, position `p` living in block
/// `table[p / block_tokens]`, slot `p % block_tokens`. `first` is 0 for full causal attention
/// and `keys − window` (at least 0) for a sliding-window layer; blocks wholly before `first` are
/// not read (their table entries may be anything).
#[derive(Debug, Clone, Copy)]
pub struct QueryRow<'a> {
    pub table: &'a [u32],
    pub first: usize,
    pub keys: usize,
}

/// One exported attention weight: a key position (absolute, in its sequence) and the softmax
/// weight a query head gave it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Attended {
    pub position: u32,
    pub weight: f32,
}

impl Attended {
    /// An unused entry (a row with fewer keys than `top_k`).
    pub const NONE: Attended = Attended {
        position: u32::MAX,
        weight: 0.0,
    };
}

/// A query row that is not captured in [`Capture::slots`].
pub const NOT_CAPTURED: u32 = u32::MAX;

/// What one [`paged_attention`] call exports: for every query head of the chosen rows, the
/// `top_k` keys it attends to most, with their softmax weights. Only captured rows pay (a
/// selection over the scores the kernel computed anyway); the rest run as without a capture.
#[derive(Debug)]
pub struct Capture<'a> {
    /// Per query row: its slot among the captured rows, or [`NOT_CAPTURED`].
    pub slots: &'a [u32],
    pub top_k: usize,
    /// `slots × heads × top_k` entries: slot `s`, head `h` at `(s·heads + h)·top_k`, each
    /// head's in descending weight (ties: the lower position first), [`Attended::NONE`] past
    /// the row's keys.
    pub out: &'a mut [Attended],
}

/// Grouped-query attention of `rows.len()` query rows (`q`: rows × heads·head_dim, RoPE already
/// applied) over paged K/V; `out` like `q`. Scale 1/sqrt(head_dim); `heads % kv_heads == 0`.
///
/// Panics on inconsistent sizes, a query row with no keys, a table shorter than its row's keys
/// need, or a block id outside the storage (the engine guarantees all of these; they are checked
/// on the calling thread before any work is handed out).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    pool: &ThreadPool,
    isa: Isa,
    heads: usize,
    q: &[f32],
    rows: &[QueryRow<'_>],
    kv: &PagedKv<'_>,
    out: &mut [f32],
    capture: Option<&mut Capture<'_>>,
) {
    let PagedKv {
        dtype,
        k,
        v,
        block_tokens,
        kv_heads,
        head_dim,
    } = *kv;
    assert!(
        kv_heads > 0 && heads.is_multiple_of(kv_heads) && heads > 0,
        "{heads} heads are not a multiple of {kv_heads} KV heads"
    );
    assert!(
        dtype.supports(head_dim),
        "a {dtype} KV cache cannot hold heads of {head_dim} values"
    );
    assert!(block_tokens > 0, "blocks must hold at least one token");
    let q_stride = heads * head_dim;
    assert_eq!(
        q.len(),
        rows.len() * q_stride,
        "q must hold heads·head_dim values per query row"
    );
    assert_eq!(out.len(), q.len(), "out must be shaped like q");
    let block_bytes = kv.block_bytes();
    let blocks = k.len().min(v.len()) / block_bytes;
    for (i, row) in rows.iter().enumerate() {
        assert!(row.keys > row.first, "query row {i} sees no keys");
        let used = row.keys.div_ceil(block_tokens);
        assert!(
            row.table.len() >= used,
            "query row {i}: {} keys need {used} blocks, its table has {}",
            row.keys,
            row.table.len()
        );
        let skipped = row.first / block_tokens;
        if let Some(bad) = row.table[skipped..used]
            .iter()
            .find(|&&b| b as usize >= blocks)
        {
            panic!("query row {i}: block {bad} is outside the cache's {blocks} blocks");
        }
    }
    let captured = capture.map(|c| {
        assert_eq!(c.slots.len(), rows.len(), "one capture slot per query row");
        let slots = c
            .slots
            .iter()
            .filter(|&&s| s != NOT_CAPTURED)
            .map(|&s| s as usize + 1)
            .max()
            .unwrap_or(0);
        assert!(
            c.out.len() >= slots * heads * c.top_k,
            "the capture's output holds {} entries, {slots} slots need {}",
            c.out.len(),
            slots * heads * c.top_k
        );
        // Items write disjoint slots' heads (a slot is one row's, asserted here).
        let mut seen = vec![false; slots];
        for &s in c.slots.iter().filter(|&&s| s != NOT_CAPTURED) {
            assert!(!seen[s as usize], "capture slot {s} is given to two rows");
            seen[s as usize] = true;
        }
        (c.slots, c.top_k, SharedAttended(c.out.as_mut_ptr()))
    });
    let group = heads / kv_heads;
    let group_len = group * head_dim;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let out_ptr = SharedOut::new(out.as_mut_ptr());
    pool.for_each(rows.len() * kv_heads, &|item| {
        let (i, kv_head) = (item / kv_heads, item % kv_heads);
        let start = i * q_stride + kv_head * group_len;
        // SAFETY: item (i, kv_head) alone writes out[start..start + group_len], the query heads
        // of row i grouped on this KV head; in bounds as out.len() == q.len() == rows·q_stride
        // (asserted above), and `out` outlives `for_each`.
        let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(start), group_len) };
        let export = captured.as_ref().and_then(|(slots, top_k, ptr)| {
            let slot = slots[i];
            (slot != NOT_CAPTURED && *top_k > 0).then(|| {
                let at = (slot as usize * heads + kv_head * group) * top_k;
                // SAFETY: item (i, kv_head) alone writes the entries of row i's slot for the
                // query heads grouped on this KV head: slots are distinct per row (asserted),
                // the range is in bounds (out holds slots·heads·top_k, asserted), and the
                // capture's buffer outlives `for_each`.
                unsafe { std::slice::from_raw_parts_mut(ptr.0.add(at), group * top_k) }
            })
        });
        GROUP_SCRATCH.with(|scratch| {
            attend_group(
                isa,
                kv,
                &rows[i],
                kv_head,
                &q[start..start + group_len],
                scale,
                &mut scratch.borrow_mut(),
                dst,
                export,
            );
        });
    });
}

/// The capture's output, written by the pool's items at disjoint ranges.
struct SharedAttended(*mut Attended);

// SAFETY: every item writes its own range of the buffer (see `paged_attention`).
unsafe impl Send for SharedAttended {}
// SAFETY: as above; no two items touch one entry.
unsafe impl Sync for SharedAttended {}

/// The `top.len()` largest of `numerators` (one head's softmax numerators of keys `from..`),
/// divided by `sum`, into `top` in descending weight (ties: the lower position first).
fn top_keys(numerators: &[f32], sum: f32, from: usize, top: &mut [Attended]) {
    let k = top.len().min(numerators.len());
    if k == 0 {
        top.fill(Attended::NONE);
        return;
    }
    let mut n = 0;
    for (j, &w) in numerators.iter().enumerate() {
        // Positions come in ascending order: an equal weight never displaces an earlier one.
        if n == k && w <= top[k - 1].weight {
            continue;
        }
        let mut at = n.min(k - 1);
        if n < k {
            n += 1;
        }
        while at > 0 && top[at - 1].weight < w {
            top[at] = top[at - 1];
            at -= 1;
        }
        top[at] = Attended {
            position: (from + j) as u32,
            weight: w,
        };
    }
    let inv = 1.0 / sum;
    for t in &mut top[..n] {
        t.weight *= inv;
    }
    top[n..].fill(Attended::NONE);
}

/// Per-thread buffers of one work item, grown to the largest item seen on the thread.
struct GroupScratch {
    /// `group × keys` scores, then softmax numerators, one query head after another.
    scores: Vec<f32>,
    /// The softmax denominator of each query head.
    sums: Vec<f32>,
    /// One decoded head row (scalar path).
    row: Vec<f32>,
}

thread_local! {
    static GROUP_SCRATCH: RefCell<GroupScratch> = const {
        RefCell::new(GroupScratch {
            scores: Vec::new(),
            sums: Vec::new(),
            row: Vec::new(),
        })
    };
}

fn grow(buf: &mut Vec<f32>, len: usize) {
    if buf.len() < len {
        buf.resize(len.next_power_of_two(), 0.0);
    }
}

/// The query heads `q` (`group × head_dim`) of one row, all grouped on `kv_head`: scores block
/// by block, softmax, then the weighted values block by block, written to `out` (like `q`).
#[allow(clippy::too_many_arguments)]
fn attend_group(
    isa: Isa,
    kv: &PagedKv<'_>,
    row: &QueryRow<'_>,
    kv_head: usize,
    q: &[f32],
    scale: f32,
    scratch: &mut GroupScratch,
    out: &mut [f32],
    export: Option<&mut [Attended]>,
) {
    let head_dim = kv.head_dim;
    let group = q.len() / head_dim;
    // Scores are indexed from the row's first visible position.
    let (from, keys) = (row.first, row.keys - row.first);
    let (row_bytes, block_bytes) = (kv.row_bytes(), kv.block_bytes());
    let head_bytes = kv.dtype.row_bytes(head_dim);
    let head_offset = kv_head * head_bytes;
    let GroupScratch {
        scores,
        sums,
        row: decoded,
    } = scratch;
    grow(scores, group * keys);
    grow(sums, group);
    grow(decoded, head_dim);
    let scores = &mut scores[..group * keys];
    let decoded = &mut decoded[..head_dim];
    // Each visible part of a block is a run of consecutive slots: (its first score, slots,
    // byte offset of this head in the run's first slot, byte length of the run).
    let bt = kv.block_tokens;
    let runs = (from / bt..row.keys.div_ceil(bt)).map(|b| {
        let start = (b * bt).max(from);
        let slots = ((b + 1) * bt).min(row.keys) - start;
        let at = row.table[b] as usize * block_bytes + (start - b * bt) * row_bytes + head_offset;
        (
            start - from,
            slots,
            at,
            (slots - 1) * row_bytes + head_bytes,
        )
    });
    // A sequence's blocks lie anywhere in the pool, so the hardware prefetcher cannot see the
    // next one coming: each block's keys are asked for while the one before is scored, its
    // values into L2 for the second loop, and there the next block's values into L1.
    let mut ahead = runs.clone().skip(1);
    for (first, slots, at, len) in runs.clone() {
        if let Some((_, next_slots, next_at, _)) = ahead.next() {
            prefetch_rows(kv.k, next_at, next_slots, row_bytes, head_bytes, true);
        }
        prefetch_rows(kv.v, at, slots, row_bytes, head_bytes, false);
        key_scores(
            isa,
            kv.dtype,
            &kv.k[at..at + len],
            row_bytes,
            slots,
            q,
            scale,
            &mut scores[first..],
            keys,
            decoded,
        );
    }
    for (sum, head_scores) in sums.iter_mut().zip(scores.chunks_exact_mut(keys)) {
        *sum = softmax_numerators(isa, head_scores);
    }
    if let Some(export) = export {
        let top_k = export.len() / group;
        for ((top, head_scores), &sum) in export
            .chunks_exact_mut(top_k)
            .zip(scores.chunks_exact(keys))
            .zip(sums.iter())
        {
            top_keys(head_scores, sum, from, top);
        }
    }
    out.fill(0.0);
    let mut ahead = runs.clone().skip(1);
    for (first, slots, at, len) in runs {
        if let Some((_, next_slots, next_at, _)) = ahead.next() {
            prefetch_rows(kv.v, next_at, next_slots, row_bytes, head_bytes, true);
        }
        value_sums(
            isa,
            kv.dtype,
            &kv.v[at..at + len],
            row_bytes,
            slots,
            &scores[first..],
            keys,
            out,
            decoded,
        );
    }
    for (head_out, &sum) in out.chunks_exact_mut(head_dim).zip(sums.iter()) {
        let inv = 1.0 / sum;
        head_out.iter_mut().for_each(|o| *o *= inv);
    }
}

/// Asks the caches for `slots` rows of `head_bytes` bytes, `stride` apart from byte `at` of
/// `data` (into L1 when `near`, else into L2). A prefetch is a hint: it never faults and
/// changes no result. Nothing on other architectures.
#[inline]
fn prefetch_rows(
    data: &[u8],
    at: usize,
    slots: usize,
    stride: usize,
    head_bytes: usize,
    near: bool,
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        const LINE: usize = 64;
        for s in 0..slots {
            let start = at + s * stride;
            let end = (start + head_bytes).min(data.len());
            let mut line = start - start % LINE;
            while line < end {
                let p = data[line.max(start)..].as_ptr().cast::<i8>();
                // SAFETY: prefetching reads nothing and cannot fault; the address is inside
                // `data` anyway.
                unsafe {
                    if near {
                        _mm_prefetch::<_MM_HINT_T0>(p);
                    } else {
                        _mm_prefetch::<_MM_HINT_T1>(p);
                    }
                }
                line += LINE;
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, at, slots, stride, head_bytes, near);
}

/// Whether the SIMD kernels handle heads of `head_dim` values (whole 8-lane vectors).
#[cfg(target_arch = "x86_64")]
fn simd_head(isa: Isa, head_dim: usize) -> bool {
    isa.runs(Isa::Avx2) && head_dim.is_multiple_of(8)
}

/// `scores[g·score_stride + s] = q_g · K_s · scale` for the query heads `q` (`group ×
/// head_dim`, head_dim = `decoded.len()`) and `slots` key rows of `dtype`, row `s` starting at
/// byte `s·stride` of `k`.
#[allow(clippy::too_many_arguments)]
fn key_scores(
    isa: Isa,
    dtype: KvDType,
    k: &[u8],
    stride: usize,
    slots: usize,
    q: &[f32],
    scale: f32,
    scores: &mut [f32],
    score_stride: usize,
    decoded: &mut [f32],
) {
    let head_dim = decoded.len();
    #[cfg(target_arch = "x86_64")]
    if simd_head(isa, head_dim) {
        // SAFETY: Isa::Avx2 is only chosen when the CPU has AVX2, FMA and F16C; the kernel
        // checks that every row and score it touches is inside the slices.
        unsafe {
            crate::x86::kv_scores(
                dtype,
                k,
                stride,
                slots,
                q,
                head_dim,
                scale,
                scores,
                score_stride,
            )
        };
        return;
    }
    let _ = isa;
    let head_bytes = dtype.row_bytes(head_dim);
    for s in 0..slots {
        dtype.load_row(&k[s * stride..s * stride + head_bytes], decoded);
        for (g, qh) in q.chunks_exact(head_dim).enumerate() {
            let dot: f32 = qh.iter().zip(decoded.iter()).map(|(a, b)| a * b).sum();
            scores[g * score_stride + s] = dot * scale;
        }
    }
}

/// Replaces `scores` by `exp(score - max)` and returns their sum.
fn softmax_numerators(isa: Isa, scores: &mut [f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: Isa::Avx2 is only chosen when the CPU has AVX2 and FMA.
        return unsafe { crate::x86::softmax_numerators(scores) };
    }
    let _ = isa;
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    sum
}

/// `acc[g·head_dim..][..head_dim] += Σ_s probs[g·prob_stride + s] · V_s` over `slots` value
/// rows of `dtype`, row `s` starting at byte `s·stride` of `v` (head_dim = `decoded.len()`).
#[allow(clippy::too_many_arguments)]
fn value_sums(
    isa: Isa,
    dtype: KvDType,
    v: &[u8],
    stride: usize,
    slots: usize,
    probs: &[f32],
    prob_stride: usize,
    acc: &mut [f32],
    decoded: &mut [f32],
) {
    let head_dim = decoded.len();
    #[cfg(target_arch = "x86_64")]
    if simd_head(isa, head_dim) {
        // SAFETY: Isa::Avx2 is only chosen when the CPU has AVX2, FMA and F16C; the kernel
        // checks that every row, probability and output it touches is inside the slices.
        unsafe {
            crate::x86::kv_values(dtype, v, stride, slots, probs, prob_stride, acc, head_dim)
        };
        return;
    }
    let _ = isa;
    let head_bytes = dtype.row_bytes(head_dim);
    for s in 0..slots {
        dtype.load_row(&v[s * stride..s * stride + head_bytes], decoded);
        for (g, head_acc) in acc.chunks_exact_mut(head_dim).enumerate() {
            let p = probs[g * prob_stride + s];
            for (a, &x) in head_acc.iter_mut().zip(decoded.iter()) {
                *a += p * x;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::ops::{attention, AttentionShape};
    use crate::testing::{random_f32, Rng};

    /// One sequence's keys and values, contiguous (`keys × kv_heads·head_dim`), and where its
    /// positions live in the paged storage.
    struct Sequence {
        k: Vec<f32>,
        v: Vec<f32>,
        table: Vec<u32>,
    }

    /// A paged cache holding several sequences in shuffled, interleaved blocks (plus unused
    /// blocks), and the query rows that read it.
    struct Scenario {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        block_tokens: usize,
        sequences: Vec<Sequence>,
        /// (sequence, keys) of each query row.
        rows: Vec<(usize, usize)>,
        /// Sliding-window attention: each row sees its last `window` keys.
        window: Option<usize>,
        q: Vec<f32>,
        k_store: Vec<u8>,
        v_store: Vec<u8>,
    }

    impl Scenario {
        #[allow(clippy::too_many_arguments)]
        fn new(
            dtype: KvDType,
            heads: usize,
            kv_heads: usize,
            head_dim: usize,
            block_tokens: usize,
            sequence_lengths: &[usize],
            rows: &[(usize, usize)],
            seed: u64,
        ) -> Self {
            let mut rng = Rng::new(seed);
            let kv_width = kv_heads * head_dim;
            let needed: usize = sequence_lengths
                .iter()
                .map(|n| n.div_ceil(block_tokens))
                .sum();
            let total_blocks = needed + 3;
            let mut ids: Vec<u32> = (0..total_blocks as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.next_u64() as usize % (i + 1));
            }
            let row_bytes = dtype.row_bytes(kv_width);
            let block_bytes = row_bytes * block_tokens;
            // Unused blocks hold garbage-ish (but finite) rows, so reading one shows up.
            let filler = random_f32(total_blocks * block_tokens * kv_width, seed ^ 0xf111);
            let mut k_store = vec![0u8; total_blocks * block_bytes];
            let mut v_store = vec![0u8; total_blocks * block_bytes];
            for (slot, values) in filler.chunks_exact(kv_width).enumerate() {
                let big: Vec<f32> = values.iter().map(|x| x * 50.0).collect();
                dtype.store_row(&big, &mut k_store[slot * row_bytes..][..row_bytes]);
                dtype.store_row(&big, &mut v_store[slot * row_bytes..][..row_bytes]);
            }
            let mut next_id = ids.into_iter();
            let mut sequences: Vec<Sequence> = sequence_lengths
                .iter()
                .enumerate()
                .map(|(n, &len)| Sequence {
                    k: random_f32(len * kv_width, seed + 10 * n as u64 + 1),
                    v: random_f32(len * kv_width, seed + 10 * n as u64 + 2),
                    table: Vec::new(),
                })
                .collect();
            // Hand out blocks round-robin so sequences interleave in the storage.
            let max_blocks = sequence_lengths
                .iter()
                .map(|n| n.div_ceil(block_tokens))
                .max()
                .unwrap_or(0);
            for b in 0..max_blocks {
                for (seq, &len) in sequences.iter_mut().zip(sequence_lengths) {
                    if b < len.div_ceil(block_tokens) {
                        seq.table
                            .push(next_id.next().expect("enough blocks were counted"));
                    }
                }
            }
            for (seq, &len) in sequences.iter().zip(sequence_lengths) {
                for p in 0..len {
                    let at = seq.table[p / block_tokens] as usize * block_bytes
                        + p % block_tokens * row_bytes;
                    let src = p * kv_width..(p + 1) * kv_width;
                    dtype.store_row(&seq.k[src.clone()], &mut k_store[at..at + row_bytes]);
                    dtype.store_row(&seq.v[src], &mut v_store[at..at + row_bytes]);
                }
            }
            for &(seq, keys) in rows {
                assert!(keys <= sequence_lengths[seq]);
            }
            let q = random_f32(rows.len() * heads * head_dim, seed ^ 0x9);
            Self {
                heads,
                kv_heads,
                head_dim,
                block_tokens,
                sequences,
                rows: rows.to_vec(),
                window: None,
                q,
                k_store,
                v_store,
            }
        }

        /// The first key a row with `keys` keys sees.
        fn first(&self, keys: usize) -> usize {
            self.window.map_or(0, |w| keys.saturating_sub(w))
        }

        fn paged(&self, dtype: KvDType, isa: Isa, threads: usize) -> Vec<f32> {
            self.paged_with(dtype, isa, threads, None)
        }

        fn paged_captured(
            &self,
            isa: Isa,
            threads: usize,
            capture: Option<&mut Capture<'_>>,
        ) -> Vec<f32> {
            self.paged_with(KvDType::F32, isa, threads, capture)
        }

        fn paged_with(
            &self,
            dtype: KvDType,
            isa: Isa,
            threads: usize,
            capture: Option<&mut Capture<'_>>,
        ) -> Vec<f32> {
            let rows: Vec<QueryRow<'_>> = self
                .rows
                .iter()
                .map(|&(seq, keys)| QueryRow {
                    table: &self.sequences[seq].table,
                    first: self.first(keys),
                    keys,
                })
                .collect();
            let kv = PagedKv {
                dtype,
                k: &self.k_store,
                v: &self.v_store,
                block_tokens: self.block_tokens,
                kv_heads: self.kv_heads,
                head_dim: self.head_dim,
            };
            let mut out = vec![f32::NAN; self.q.len()];
            let pool = ThreadPool::new(threads);
            paged_attention(
                &pool, isa, self.heads, &self.q, &rows, &kv, &mut out, capture,
            );
            out
        }

        /// The contiguous reference attention, each row alone, over the sequences' values
        /// passed through `dtype` (stored and loaded back) when `through` is given.
        fn contiguous(&self, through: Option<KvDType>) -> Vec<f32> {
            let pool = ThreadPool::new(1);
            let q_stride = self.heads * self.head_dim;
            let kv_width = self.kv_heads * self.head_dim;
            let round_trip = |x: &[f32]| -> Vec<f32> {
                let Some(dtype) = through else {
                    return x.to_vec();
                };
                let mut bytes = vec![0u8; dtype.row_bytes(kv_width)];
                let mut out = vec![0f32; x.len()];
                for (src, dst) in x.chunks_exact(kv_width).zip(out.chunks_exact_mut(kv_width)) {
                    dtype.store_row(src, &mut bytes);
                    dtype.load_row(&bytes, dst);
                }
                out
            };
            let mut out = vec![0f32; self.q.len()];
            for (i, &(seq, keys)) in self.rows.iter().enumerate() {
                let s = &self.sequences[seq];
                let first = self.first(keys);
                let shape = AttentionShape {
                    heads: self.heads,
                    kv_heads: self.kv_heads,
                    head_dim: self.head_dim,
                    first_pos: keys - first - 1,
                };
                attention(
                    &pool,
                    Isa::Scalar,
                    shape,
                    &self.q[i * q_stride..(i + 1) * q_stride],
                    &round_trip(&s.k[first * kv_width..keys * kv_width]),
                    &round_trip(&s.v[first * kv_width..keys * kv_width]),
                    &mut out[i * q_stride..(i + 1) * q_stride],
                );
            }
            out
        }
    }

    /// Three sequences (one of a single token) and query rows over them: decode rows, a
    /// prefill-like run of rows of one sequence, key counts on and off block boundaries.
    fn layouts(block_tokens: usize) -> (Vec<usize>, Vec<(usize, usize)>) {
        let lengths = vec![3 * block_tokens + 2, 1, 2 * block_tokens];
        let rows = vec![
            (0, 3 * block_tokens + 2),
            (1, 1),
            (2, 2 * block_tokens),
            (0, 1),
            (2, block_tokens + 1),
            (2, block_tokens),
            (0, block_tokens - 1),
            (0, 2 * block_tokens + 3),
        ];
        (lengths, rows)
    }

    /// (heads, kv_heads, head_dim): groups of 1 to 8 query heads, head sizes the SIMD kernels
    /// take in 2 to 16 vectors (odd counts included), and one (12) they leave to the scalar path.
    const SHAPES: [(usize, usize, usize); 11] = [
        (3, 1, 40),
        (4, 2, 24),
        (6, 2, 16),
        (8, 2, 64),
        (9, 3, 64),
        (4, 4, 32),
        (4, 2, 80),
        (2, 2, 128),
        (10, 2, 32),
        (16, 2, 64),
        (4, 2, 12),
    ];

    fn assert_close(got: &[f32], expected: &[f32], tolerance: f32, what: &str) {
        assert_eq!(got.len(), expected.len());
        for (j, (a, b)) in got.iter().zip(expected).enumerate() {
            assert!(
                (a - b).abs() <= tolerance,
                "{what}: element {j}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn f32_paged_attention_matches_contiguous_attention() {
        for (heads, kv_heads, head_dim) in SHAPES {
            for block_tokens in [16, 5] {
                let (lengths, rows) = layouts(block_tokens);
                let scenario = Scenario::new(
                    KvDType::F32,
                    heads,
                    kv_heads,
                    head_dim,
                    block_tokens,
                    &lengths,
                    &rows,
                    (heads * 1000 + head_dim * 10 + block_tokens) as u64,
                );
                let expected = scenario.contiguous(None);
                for isa in Isa::available() {
                    for threads in [1, 3] {
                        let got = scenario.paged(KvDType::F32, isa, threads);
                        assert_close(
                            &got,
                            &expected,
                            1e-5,
                            &format!(
                                "{isa:?} ×{threads} heads {heads}/{kv_heads}×{head_dim} \
                                 blocks of {block_tokens}"
                            ),
                        );
                    }
                }
            }
        }
    }

    /// The exported top-k of every query head of the captured rows equals a scalar softmax over
    /// the same keys (f64, from the sequences' own keys), in order; the attention output is
    /// the same bits with and without a capture; rows not captured write nothing.
    #[test]
    fn captured_weights_match_a_scalar_softmax() {
        for (heads, kv_heads, head_dim) in [(4, 1, 64), (9, 3, 64), (4, 2, 12)] {
            for (block_tokens, window) in [(16, None), (5, None), (5, Some(7))] {
                let (lengths, rows) = layouts(block_tokens);
                let mut scenario = Scenario::new(
                    KvDType::F32,
                    heads,
                    kv_heads,
                    head_dim,
                    block_tokens,
                    &lengths,
                    &rows,
                    (heads * 100 + head_dim + block_tokens) as u64,
                );
                scenario.window = window;
                let top_k = 5;
                // Every other row captured, in reverse slot order.
                let captured: Vec<usize> = (0..rows.len()).step_by(2).collect();
                let mut slots = vec![NOT_CAPTURED; rows.len()];
                for (n, &r) in captured.iter().rev().enumerate() {
                    slots[r] = n as u32;
                }
                for isa in Isa::available() {
                    let plain = scenario.paged(KvDType::F32, isa, 3);
                    let mut exported = vec![Attended::NONE; captured.len() * heads * top_k];
                    let got = scenario.paged_captured(
                        isa,
                        3,
                        Some(&mut Capture {
                            slots: &slots,
                            top_k,
                            out: &mut exported,
                        }),
                    );
                    assert_eq!(
                        got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        plain.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        "a capture changes no output"
                    );
                    for (r, &(seq, keys)) in rows.iter().enumerate() {
                        if slots[r] == NOT_CAPTURED {
                            continue;
                        }
                        let first = scenario.first(keys);
                        let s = &scenario.sequences[seq];
                        for h in 0..heads {
                            let kvh = h / (heads / kv_heads);
                            let q = &scenario.q[(r * heads + h) * head_dim..][..head_dim];
                            let scores: Vec<f64> = (first..keys)
                                .map(|p| {
                                    let k = &s.k[(p * kv_heads + kvh) * head_dim..][..head_dim];
                                    q.iter()
                                        .zip(k)
                                        .map(|(&a, &b)| a as f64 * b as f64)
                                        .sum::<f64>()
                                        / (head_dim as f64).sqrt()
                                })
                                .collect();
                            let max = scores.iter().cloned().fold(f64::MIN, f64::max);
                            let sum: f64 = scores.iter().map(|x| (x - max).exp()).sum();
                            let mut want: Vec<(usize, f64)> = scores
                                .iter()
                                .enumerate()
                                .map(|(j, x)| (first + j, (x - max).exp() / sum))
                                .collect();
                            want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                            let at = (slots[r] as usize * heads + h) * top_k;
                            let got = &exported[at..at + top_k];
                            let what = format!(
                                "{isa:?} heads {heads}/{kv_heads}×{head_dim}, blocks of \
                                 {block_tokens}, window {window:?}, row {r} head {h}"
                            );
                            for (n, g) in got.iter().enumerate() {
                                let Some(&(pos, w)) = want.get(n) else {
                                    assert_eq!(*g, Attended::NONE, "{what}: entry {n}");
                                    continue;
                                };
                                assert!(
                                    (g.weight as f64 - w).abs() <= 1e-5,
                                    "{what}: entry {n}: {} vs {w}",
                                    g.weight
                                );
                                // Positions agree unless the reference's neighbours tie.
                                let tied =
                                    want.iter().any(|&(p, v)| p != pos && (v - w).abs() <= 1e-6);
                                assert!(
                                    g.position as usize == pos || tied,
                                    "{what}: entry {n}: position {} vs {pos}",
                                    g.position
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn top_keys_keeps_the_largest_in_order_and_the_earlier_of_a_tie() {
        let mut top = [Attended::NONE; 3];
        top_keys(&[1.0, 4.0, 2.0, 4.0, 3.0], 10.0, 7, &mut top);
        let got: Vec<(u32, f32)> = top.iter().map(|a| (a.position, a.weight)).collect();
        assert_eq!(got, vec![(8, 0.4), (10, 0.4), (11, 0.3)]);
        let mut top = [Attended::NONE; 4];
        top_keys(&[1.0, 1.0], 2.0, 0, &mut top);
        assert_eq!(
            top[0],
            Attended {
                position: 0,
                weight: 0.5
            }
        );
        assert_eq!(
            top[1],
            Attended {
                position: 1,
                weight: 0.5
            }
        );
        assert_eq!(&top[2..], &[Attended::NONE; 2]);
    }

    /// Sliding-window rows (the last `window` keys only, windows inside a block, on a block's
    /// edge and across blocks) match the contiguous attention over the same keys, on every ISA,
    /// with the blocks before the window made unreadable (out of the storage).
    #[test]
    fn windowed_paged_attention_reads_only_the_window() {
        for (heads, kv_heads, head_dim) in [(4, 1, 64), (9, 3, 64), (4, 2, 12), (3, 1, 40)] {
            for block_tokens in [16, 5] {
                for window in [1, 3, block_tokens, block_tokens + 2, 2 * block_tokens + 1] {
                    let (lengths, rows) = layouts(block_tokens);
                    for dtype in [KvDType::F32, KvDType::F16] {
                        let mut scenario = Scenario::new(
                            dtype,
                            heads,
                            kv_heads,
                            head_dim,
                            block_tokens,
                            &lengths,
                            &rows,
                            (heads * 1000 + head_dim * 10 + block_tokens + window) as u64,
                        );
                        scenario.window = Some(window);
                        // Blocks wholly before a row's window are never read: point them
                        // outside the storage (a read would panic on the slice bounds).
                        let first_needed = scenario.rows.iter().fold(
                            vec![usize::MAX; lengths.len()],
                            |mut f, &(seq, keys)| {
                                f[seq] = f[seq].min(keys.saturating_sub(window) / block_tokens);
                                f
                            },
                        );
                        for (seq, first) in scenario.sequences.iter_mut().zip(first_needed) {
                            for b in seq.table.iter_mut().take(first) {
                                *b = u32::MAX;
                            }
                        }
                        let expected = scenario.contiguous(Some(dtype));
                        for isa in Isa::available() {
                            let got = scenario.paged(dtype, isa, 2);
                            assert_close(
                                &got,
                                &expected,
                                1e-4,
                                &format!(
                                    "{dtype} {isa:?} heads {heads}/{kv_heads}×{head_dim} \
                                     blocks of {block_tokens}, window {window}"
                                ),
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn f16_and_q8_0_simd_match_scalar_and_dequantized_attention() {
        for dtype in [KvDType::F16, KvDType::Q8_0] {
            for (heads, kv_heads, head_dim) in SHAPES {
                if !dtype.supports(head_dim) {
                    continue;
                }
                for block_tokens in [16, 5] {
                    let (lengths, rows) = layouts(block_tokens);
                    let scenario = Scenario::new(
                        dtype,
                        heads,
                        kv_heads,
                        head_dim,
                        block_tokens,
                        &lengths,
                        &rows,
                        (heads * 1000 + head_dim * 10 + block_tokens + 7) as u64,
                    );
                    let what = format!(
                        "{dtype} heads {heads}/{kv_heads}×{head_dim} blocks of {block_tokens}"
                    );
                    let scalar = scenario.paged(dtype, Isa::Scalar, 2);
                    for isa in Isa::available() {
                        let got = scenario.paged(dtype, isa, 2);
                        // Relative to the largest output of each query head.
                        for (h, (a, b)) in got
                            .chunks_exact(head_dim)
                            .zip(scalar.chunks_exact(head_dim))
                            .enumerate()
                        {
                            let size = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                            assert_close(a, b, 1e-4 * size, &format!("{isa:?} {what} head {h}"));
                        }
                    }
                    let dequantized = scenario.contiguous(Some(dtype));
                    assert_close(&scalar, &dequantized, 1e-5, &format!("dequantized {what}"));
                    let exact = scenario.contiguous(None);
                    let tolerance = match dtype {
                        KvDType::F16 => 2e-3,
                        _ => 2e-2,
                    };
                    assert_close(&scalar, &exact, tolerance, &format!("unquantized {what}"));
                }
            }
        }
    }

    #[test]
    fn attention_over_large_scores_stays_accurate() {
        // Scores spread over a wide range exercise the vectorized exp and the max subtraction.
        let (heads, kv_heads, head_dim, block_tokens) = (4, 2, 32, 7);
        let mut scenario = Scenario::new(
            KvDType::F32,
            heads,
            kv_heads,
            head_dim,
            block_tokens,
            &[40],
            &[(0, 40), (0, 9)],
            77,
        );
        scenario.q.iter_mut().for_each(|x| *x *= 12.0);
        let expected = scenario.contiguous(None);
        for isa in Isa::available() {
            assert_close(
                &scenario.paged(KvDType::F32, isa, 2),
                &expected,
                1e-5,
                &format!("{isa:?}"),
            );
        }
    }

    #[test]
    fn rows_round_trip_through_every_kv_type() {
        for n in [32, 64, 96, 256] {
            let x: Vec<f32> = random_f32(n, n as u64)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1.0 + (i / 32) as f32 * 3.0))
                .collect();
            for dtype in KvDType::ALL {
                let mut bytes = vec![0u8; dtype.row_bytes(n)];
                dtype.store_row(&x, &mut bytes);
                let mut y = vec![0f32; n];
                dtype.load_row(&bytes, &mut y);
                for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
                    let tolerance = match dtype {
                        KvDType::F32 => 0.0,
                        // Half precision: 11 significant bits, subnormals below 2^-14.
                        KvDType::F16 => a.abs() * 2f32.powi(-11) + 2f32.powi(-25),
                        KvDType::Q8_0 => {
                            let block = &x[i / 32 * 32..][..32];
                            let d = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                            let stored = f16::from_f32(d).to_f32();
                            // q = round(x/d) is within d/2; the stored scale is d rounded to
                            // f16, off by |d - stored| for each of up to 127 steps.
                            d / 2.0 + 127.0 * (d - stored).abs() + 1e-6
                        }
                    };
                    assert!(
                        (a - b).abs() <= tolerance,
                        "{dtype} n {n} element {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn q8_0_rows_use_the_gguf_block_layout() {
        assert_eq!(Q8_0_BLOCK, DType::Q8_0.block_size());
        assert_eq!(Q8_0_BLOCK_BYTES, DType::Q8_0.block_bytes());
        assert_eq!(
            KvDType::Q8_0.row_bytes(128),
            DType::Q8_0.row_bytes(128).expect("128 is whole blocks")
        );
        let x: Vec<f32> = random_f32(96, 5).iter().map(|v| v * 3.0).collect();
        let mut bytes = vec![0u8; KvDType::Q8_0.row_bytes(96)];
        KvDType::Q8_0.store_row(&x, &mut bytes);
        // The GGUF dequantizer reads the same values as load_row.
        let mut ours = vec![0f32; 96];
        let mut gguf = vec![0f32; 96];
        KvDType::Q8_0.load_row(&bytes, &mut ours);
        crate::quant::dequantize_row(DType::Q8_0, &bytes, &mut gguf);
        assert_eq!(ours, gguf);
        // Byte by byte: f16 scale amax/127, then round(x/d) with ties away from zero.
        for (b, xs) in x.chunks_exact(32).enumerate() {
            let block = &bytes[b * 34..(b + 1) * 34];
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            assert_eq!(block[..2], f16::from_f32(d).to_le_bytes());
            for (j, &v) in xs.iter().enumerate() {
                assert_eq!(block[2 + j] as i8, (v / d).round() as i8, "block {b} #{j}");
            }
            // The largest magnitude maps to ±127.
            assert!(block[2..].iter().any(|&q| (q as i8).abs() == 127));
        }
        // Exact halves round away from zero, as C's roundf: with amax 127, d = 1.
        let mut halves = [0f32; 32];
        halves[0] = 127.0;
        halves[1] = 2.5;
        halves[2] = -2.5;
        halves[3] = 0.5;
        let mut block = [0u8; 34];
        KvDType::Q8_0.store_row(&halves, &mut block);
        assert_eq!(
            [
                block[2] as i8,
                block[3] as i8,
                block[4] as i8,
                block[5] as i8
            ],
            [127, 3, -3, 1]
        );
        // An all-zero block stores scale 0 and zero quants, and loads back as zeros.
        let zeros = [0f32; 32];
        KvDType::Q8_0.store_row(&zeros, &mut block);
        assert!(block.iter().all(|&b| b == 0));
    }

    #[test]
    fn kv_types_parse_print_and_size() {
        for dtype in KvDType::ALL {
            assert_eq!(KvDType::parse(dtype.name()), Some(dtype));
            assert_eq!(dtype.to_string().parse::<KvDType>(), Ok(dtype));
            assert_eq!(KvDType::parse(&dtype.name().to_uppercase()), Some(dtype));
        }
        assert_eq!(KvDType::parse("Q8"), Some(KvDType::Q8_0));
        assert_eq!(KvDType::parse("bf16"), None);
        let err = "int4"
            .parse::<KvDType>()
            .expect_err("int4 is not a KV type")
            .to_string();
        assert!(err.contains("int4") && err.contains("q8_0"), "{err}");
        assert_eq!(KvDType::F32.row_bytes(64), 256);
        assert_eq!(KvDType::F16.row_bytes(64), 128);
        assert_eq!(KvDType::Q8_0.row_bytes(64), 68);
        assert!(KvDType::F16.supports(80) && KvDType::F32.supports(12));
        assert!(KvDType::Q8_0.supports(64) && !KvDType::Q8_0.supports(80));
        assert!(!KvDType::F32.supports(0));
        let kv = PagedKv {
            dtype: KvDType::Q8_0,
            k: &[],
            v: &[],
            block_tokens: 16,
            kv_heads: 3,
            head_dim: 64,
        };
        assert_eq!(kv.row_bytes(), 3 * 68);
        assert_eq!(kv.block_bytes(), 16 * 3 * 68);
    }

    fn one_row_call(table: &[u32], keys: usize) {
        let kv = PagedKv {
            dtype: KvDType::F32,
            // Four blocks of four f32 rows of 16 values.
            k: &[0u8; 4 * 4 * 64],
            v: &[0u8; 4 * 4 * 64],
            block_tokens: 4,
            kv_heads: 1,
            head_dim: 16,
        };
        let q = vec![0f32; 2 * 16];
        let mut out = vec![0f32; q.len()];
        let pool = ThreadPool::new(2);
        paged_attention(
            &pool,
            Isa::detect(),
            2,
            &q,
            &[QueryRow {
                table,
                first: 0,
                keys,
            }],
            &kv,
            &mut out,
            None,
        );
    }

    #[test]
    fn a_valid_call_at_the_storage_limits_runs() {
        one_row_call(&[3, 0], 8);
    }

    #[test]
    #[should_panic(expected = "need 3 blocks")]
    fn a_table_too_short_for_its_keys_panics() {
        one_row_call(&[0, 1], 9);
    }

    #[test]
    #[should_panic(expected = "outside the cache")]
    fn a_block_outside_the_storage_panics() {
        one_row_call(&[1, 4], 5);
    }

    #[test]
    #[should_panic(expected = "sees no keys")]
    fn a_row_without_keys_panics() {
        one_row_call(&[0], 0);
    }
}
