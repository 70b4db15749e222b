//! The bytes of the KV cache: one pre-allocated region per layer for keys and one for values,
//! cut into blocks of `block_tokens` token slots, in the element type chosen for the model.
//!
//! Which block belongs to whom is [`crate::block_pool::BlockPool`]'s business; this module only
//! stores rows, hands the attention kernel a view of a layer, and copies whole blocks out and in
//! (for the second tier).

use kernels::{KvDType, PagedKv};

use crate::block_pool::BlockId;

use crate::model::ModelConfig;

/// The shape of the cache of one model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_tokens: usize,
    pub dtype: KvDType,
}

impl KvLayout {
    pub fn new(config: &ModelConfig, block_tokens: usize, dtype: KvDType) -> Self {
        Self {
            layers: config.block_count,
            kv_heads: config.kv_heads,
            head_dim: config.head_dim,
            block_tokens,
            dtype,
        }
    }

    /// Values in one token row of one layer's keys (or values).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Bytes of one token row of one layer's keys (or values).
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.kv_dim())
    }

    /// Bytes of one block of one layer's keys (or values).
    pub fn layer_block_bytes(&self) -> usize {
        self.row_bytes() * self.block_tokens
    }

    /// Bytes of one block across all layers, keys and values: what a block costs.
    pub fn block_bytes(&self) -> usize {
        2 * self.layers * self.layer_block_bytes()
    }

    /// Bytes one token costs in the cache.
    pub fn bytes_per_token(&self) -> usize {
        2 * self.layers * self.row_bytes()
    }
}

/// Keys and values of every layer for a fixed number of blocks.
#[derive(Debug)]
pub struct KvStore {
    layout: KvLayout,
    blocks: usize,
    keys: Vec<Vec<u8>>,
    values: Vec<Vec<u8>>,
}

impl KvStore {
    /// Allocates `blocks` blocks (zeroed memory: the OS maps pages as they are first written).
    pub fn new(layout: KvLayout, blocks: usize) -> Self {
        let bytes = blocks * layout.layer_block_bytes();
        Self {
            layout,
            blocks,
            keys: (0..layout.layers).map(|_| vec![0u8; bytes]).collect(),
            values: (0..layout.layers).map(|_| vec![0u8; bytes]).collect(),
        }
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn blocks(&self) -> usize {
        self.blocks
    }

    /// Bytes reserved for the blocks.
    pub fn bytes(&self) -> usize {
        self.blocks * self.layout.block_bytes()
    }

    /// Stores the key and value rows of one token in `block`, slot `slot`, of `layer`.
    pub fn write(&mut self, layer: usize, block: u32, slot: usize, key: &[f32], value: &[f32]) {
        let l = &self.layout;
        let at = block as usize * l.layer_block_bytes() + slot * l.row_bytes();
        let len = l.row_bytes();
        l.dtype.store_row(key, &mut self.keys[layer][at..at + len]);
        l.dtype
            .store_row(value, &mut self.values[layer][at..at + len]);
    }

    /// Reads back the key and value rows of one slot (tests and debugging).
    pub fn read(&self, layer: usize, block: u32, slot: usize, key: &mut [f32], value: &mut [f32]) {
        let l = &self.layout;
        let at = block as usize * l.layer_block_bytes() + slot * l.row_bytes();
        let len = l.row_bytes();
        l.dtype.load_row(&self.keys[layer][at..at + len], key);
        l.dtype.load_row(&self.values[layer][at..at + len], value);
    }

    /// Gives the memory pages of these blocks (in every layer) back to the operating system;
    /// their content reads as zeros afterwards, and a page is mapped again when next written.
    /// Only pages wholly inside runs of the given blocks go. Returns the bytes given back (0
    /// where the system has no such call).
    pub fn release(&mut self, blocks: &[BlockId]) -> usize {
        let mut sorted = blocks.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let n = self.layout.layer_block_bytes();
        let mut runs: Vec<(usize, usize)> = Vec::new();
        for &b in &sorted {
            let b = b as usize;
            assert!(b < self.blocks, "block {b} outside the store");
            match runs.last_mut() {
                Some((_, end)) if *end == b => *end = b + 1,
                _ => runs.push((b, b + 1)),
            }
        }
        let mut released = 0;
        for buffer in self.keys.iter_mut().chain(self.values.iter_mut()) {
            for &(start, end) in &runs {
                released += release_pages(&mut buffer[start * n..end * n]);
            }
        }
        released
    }

    /// The attention kernel's view of one layer.
    pub fn layer(&self, layer: usize) -> PagedKv<'_> {
        PagedKv {
            dtype: self.layout.dtype,
            k: &self.keys[layer],
            v: &self.values[layer],
            block_tokens: self.layout.block_tokens,
            kv_heads: self.layout.kv_heads,
            head_dim: self.layout.head_dim,
        }
    }

    /// Copies one block of every layer (keys then values, layer by layer) into `out`
    /// (`block_bytes` long).
    pub fn copy_out(&self, block: u32, out: &mut [u8]) {
        let n = self.layout.layer_block_bytes();
        let at = block as usize * n;
        for (l, chunk) in out.chunks_exact_mut(2 * n).enumerate() {
            chunk[..n].copy_from_slice(&self.keys[l][at..at + n]);
            chunk[n..].copy_from_slice(&self.values[l][at..at + n]);
        }
    }

    /// The inverse of [`KvStore::copy_out`].
    pub fn copy_in(&mut self, block: u32, data: &[u8]) {
        let n = self.layout.layer_block_bytes();
        let at = block as usize * n;
        for (l, chunk) in data.chunks_exact(2 * n).enumerate() {
            self.keys[l][at..at + n].copy_from_slice(&chunk[..n]);
            self.values[l][at..at + n].copy_from_slice(&chunk[n..]);
        }
    }
}

/// Hands the whole pages inside `bytes` back to the operating system (they read as zeros
/// afterwards). Returns how many bytes went.
#[cfg(target_os = "linux")]
fn release_pages(bytes: &mut [u8]) -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as usize } else { 4096 };
    let begin = bytes.as_mut_ptr() as usize;
    let start = begin.next_multiple_of(page);
    let end = (begin + bytes.len()) / page * page;
    if end <= start {
        return 0;
    }
    // SAFETY: [start, end) lies inside `bytes`, which we borrow mutably (no other reference to
    // it exists), and is private anonymous memory from the allocator: MADV_DONTNEED only makes
    // its pages read as zeros again, which is a valid value of `u8`. No other allocation's pages
    // are touched, since the range is rounded inwards to whole pages.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
    if rc == 0 {
        end - start
    } else {
        0
    }
}

#[cfg(not(target_os = "linux"))]
fn release_pages(_bytes: &mut [u8]) -> usize {
    0
}

/// The cache of a single sequence: a private store whose blocks are used in order. What the
/// one-sequence paths (scoring, perplexity, benchmarks of one stream) run on.
#[derive(Debug)]
pub struct SequenceCache {
    pub(crate) store: KvStore,
    pub(crate) table: Vec<u32>,
    pub(crate) len: usize,
    capacity: usize,
}

impl SequenceCache {
    /// A cache for `capacity` positions.
    pub fn new(config: &ModelConfig, capacity: usize, dtype: KvDType) -> Self {
        let block_tokens = 16;
        let blocks = capacity.div_ceil(block_tokens).max(1);
        Self {
            store: KvStore::new(KvLayout::new(config, block_tokens, dtype), blocks),
            table: (0..blocks as u32).collect(),
            len: 0,
            capacity,
        }
    }

    /// Positions filled.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets everything (the memory is kept for the next sequence).
    pub fn clear(&mut self) {
        self.len = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_blocks_read_as_zeros_and_the_others_keep_their_rows() {
        let layout = KvLayout {
            layers: 2,
            kv_heads: 2,
            head_dim: 64,
            block_tokens: 16,
            dtype: KvDType::F32,
        };
        // 8 KiB per layer block: whole pages on any 4 or 8 KiB page system.
        let mut store = KvStore::new(layout, 32);
        let row = |b: u32, s: usize| -> Vec<f32> {
            (0..128).map(|i| (b * 1000 + s as u32 + i) as f32).collect()
        };
        for b in 0..32u32 {
            for s in 0..16 {
                for l in 0..2 {
                    store.write(l, b, s, &row(b, s), &row(b + 1, s));
                }
            }
        }
        let released = store.release(&[4, 5, 6, 7, 20, 3]);
        let (mut k, mut v) = (vec![0.0; 128], vec![0.0; 128]);
        if cfg!(target_os = "linux") {
            assert!(released >= 2 * 2 * 4 * 8192, "{released}");
            store.read(1, 5, 3, &mut k, &mut v);
            assert!(k.iter().chain(&v).all(|&x| x == 0.0));
        }
        for b in [0u32, 2, 8, 19, 21, 31] {
            for l in 0..2 {
                store.read(l, b, 7, &mut k, &mut v);
                assert_eq!(
                    (k.clone(), v.clone()),
                    (row(b, 7), row(b + 1, 7)),
                    "block {b}"
                );
            }
        }
        // Written again, a released block holds its new rows.
        store.write(0, 5, 3, &row(9, 9), &row(9, 9));
        store.read(0, 5, 3, &mut k, &mut v);
        assert_eq!(k, row(9, 9));
    }

    /// A layer's block of 1.5 pages (SmolLM2's shape in f16): released alone it keeps the pages
    /// it shares with its neighbours; released in a run with its free neighbours, it goes whole.
    #[test]
    fn blocks_smaller_than_pages_go_back_with_their_free_neighbours() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let layout = KvLayout {
            layers: 1,
            kv_heads: 3,
            head_dim: 64,
            block_tokens: 16,
            dtype: KvDType::F16,
        };
        assert_eq!(layout.layer_block_bytes(), 6144);
        let mut store = KvStore::new(layout, 64);
        let ones = vec![1.0f32; 192];
        for b in 0..64u32 {
            for s in 0..16 {
                store.write(0, b, s, &ones, &ones);
            }
        }
        let (mut k, mut v) = (vec![0.0; 192], vec![0.0; 192]);
        let zeros = |store: &KvStore, b: u32, k: &mut Vec<f32>, v: &mut Vec<f32>| -> usize {
            (0..16)
                .filter(|&s| {
                    store.read(0, b, s, k, v);
                    k.iter().chain(v.iter()).all(|&x| x == 0.0)
                })
                .count()
        };
        // Released one by one, block 11 keeps a page it shares with 10 or 12 (block
        // boundaries are 1.5 pages apart, so one of its two is inside a page).
        for b in [10, 11, 12] {
            store.release(&[b]);
        }
        assert!(zeros(&store, 11, &mut k, &mut v) < 16);
        // The run of the three: the shared pages go too.
        assert!(store.release(&[10, 11, 12]) > 0);
        assert_eq!(zeros(&store, 11, &mut k, &mut v), 16);
        // Their used neighbours keep every row.
        assert_eq!(zeros(&store, 9, &mut k, &mut v), 0);
        assert_eq!(zeros(&store, 13, &mut k, &mut v), 0);
    }
}
