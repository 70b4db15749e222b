//! The KV block pool: which block is free, who holds it, and which full blocks are cached by
//! content for reuse across sequences (prefix caching).
//!
//! The pool is bookkeeping only; the bytes live in [`crate::kv_store::KvStore`]. A block is in
//! exactly one of three states:
//!
//! - **held**: reference count ≥ 1 (one per sequence block table that lists it);
//! - **cached**: reference count 0 but its content is known by hash, kept for a later sequence
//!   with the same prefix and evicted least-recently-used first when the pool needs room;
//! - **free**: reference count 0, content worthless.
//!
//! A full block is named by the hash of its parent's hash and its own token ids, so equal hashes
//! mean equal prefixes. The token ids are kept beside the hash and compared on every hit, so a
//! hash collision can never hand out the wrong keys and values.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{Hash, Hasher};

/// Index of a block in the pool.
pub type BlockId = u32;

/// Content name of a full block: hash of the parent block's hash and the block's token ids.
pub type BlockHash = u64;

/// The hash of the first block of a sequence has this parent.
pub const ROOT_HASH: BlockHash = 0x9e37_79b9_7f4a_7c15;

/// Names a full block by its parent and its tokens.
pub fn block_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    // SipHash with fixed keys: stable within and across processes of the same build.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// The hashes of the full blocks of `tokens`, in order.
pub fn chain_hashes(tokens: &[u32], block_tokens: usize) -> Vec<BlockHash> {
    let mut parent = ROOT_HASH;
    tokens
        .chunks_exact(block_tokens)
        .map(|block| {
            parent = block_hash(parent, block);
            parent
        })
        .collect()
}

/// What a cached block holds, checked on every hit.
#[derive(Debug, Clone)]
struct Content {
    hash: BlockHash,
    parent: BlockHash,
    tokens: Box<[u32]>,
}

/// Counters of the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Blocks found in the cache at lookup.
    pub hits: u64,
    /// Full blocks looked up and not found.
    pub misses: u64,
    /// Cached blocks reclaimed for new content.
    pub evictions: u64,
}

/// A block taken from the pool, and the cached content it replaced (which the caller may move to
/// a slower tier before overwriting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocated {
    pub block: BlockId,
    pub evicted: Option<(BlockHash, BlockHash, Box<[u32]>)>,
}

/// Reference counts, the free list and the prefix cache of a fixed number of blocks.
#[derive(Debug)]
pub struct BlockPool {
    block_tokens: usize,
    refcount: Vec<u32>,
    content: Vec<Option<Content>>,
    free: VecDeque<BlockId>,
    /// Hash → block, for blocks whose content is registered (held or cached).
    by_hash: HashMap<BlockHash, BlockId>,
    /// Cached (unreferenced, registered) blocks by the tick they were released at: LRU first.
    evictable: BTreeMap<u64, BlockId>,
    released_at: Vec<u64>,
    tick: u64,
    prefix_caching: bool,
    stats: PrefixStats,
}

impl BlockPool {
    /// A pool of `blocks` blocks of `block_tokens` token slots each.
    pub fn new(blocks: usize, block_tokens: usize, prefix_caching: bool) -> Self {
        assert!(block_tokens > 0, "blocks hold at least one token");
        assert!(blocks <= u32::MAX as usize, "block ids are u32");
        Self {
            block_tokens,
            refcount: vec![0; blocks],
            content: vec![None; blocks],
            free: (0..blocks as BlockId).collect(),
            by_hash: HashMap::new(),
            evictable: BTreeMap::new(),
            released_at: vec![0; blocks],
            tick: 0,
            prefix_caching,
            stats: PrefixStats::default(),
        }
    }

    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks that can be handed out now (free + cached).
    pub fn available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Blocks referenced by at least one sequence.
    pub fn held(&self) -> usize {
        self.total() - self.available()
    }

    /// Unreferenced blocks kept for their content.
    pub fn cached(&self) -> usize {
        self.evictable.len()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    pub fn refcount(&self, block: BlockId) -> u32 {
        self.refcount[block as usize]
    }

    /// The registered hash of a block, if any.
    pub fn hash_of(&self, block: BlockId) -> Option<BlockHash> {
        self.content[block as usize].as_ref().map(|c| c.hash)
    }

    /// Takes a block (reference count 1): the most recently freed one first, else the least
    /// recently released cached one. `None` when every block is held.
    pub fn allocate(&mut self) -> Option<Allocated> {
        if let Some(block) = self.free.pop_front() {
            self.refcount[block as usize] = 1;
            return Some(Allocated {
                block,
                evicted: None,
            });
        }
        let (_, block) = self.evictable.pop_first()?;
        let content = self.content[block as usize]
            .take()
            .expect("an evictable block has registered content");
        self.by_hash.remove(&content.hash);
        self.stats.evictions += 1;
        self.refcount[block as usize] = 1;
        Some(Allocated {
            block,
            evicted: Some((content.hash, content.parent, content.tokens)),
        })
    }

    /// Adds a reference to a held block (a sequence sharing it).
    pub fn retain(&mut self, block: BlockId) {
        let rc = &mut self.refcount[block as usize];
        assert!(*rc > 0, "retain of an unreferenced block {block}");
        *rc += 1;
    }

    /// Drops one reference; at zero the block becomes cached (if registered and caching is on)
    /// or free.
    pub fn release(&mut self, block: BlockId) {
        let rc = &mut self.refcount[block as usize];
        assert!(*rc > 0, "release of an unreferenced block {block}");
        *rc -= 1;
        if *rc > 0 {
            return;
        }
        if self.prefix_caching && self.content[block as usize].is_some() {
            self.tick += 1;
            self.released_at[block as usize] = self.tick;
            self.evictable.insert(self.tick, block);
        } else {
            if let Some(c) = self.content[block as usize].take() {
                self.by_hash.remove(&c.hash);
            }
            // Last freed, first reused: the pages of a recently used block are still mapped
            // (and warm in cache), so the pool's resident memory follows its peak use, not its
            // size.
            self.free.push_front(block);
        }
    }

    /// Forgets the content of every cached block (they become free). Returns how many.
    pub fn drop_cached(&mut self) -> usize {
        let dropped = self.evictable.len();
        while let Some((_, block)) = self.evictable.pop_first() {
            if let Some(c) = self.content[block as usize].take() {
                self.by_hash.remove(&c.hash);
            }
            self.free.push_back(block);
        }
        dropped
    }

    /// The free blocks (unreferenced, no content worth keeping).
    pub fn free_blocks(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.free.iter().copied()
    }

    /// Registers the content of a held, full block. Returns false (and leaves the block
    /// unregistered) when another block already holds the same content or caching is off.
    pub fn register(
        &mut self,
        block: BlockId,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[u32],
    ) -> bool {
        assert_eq!(
            tokens.len(),
            self.block_tokens,
            "only full blocks are named"
        );
        assert!(
            self.refcount[block as usize] > 0,
            "register of a free block"
        );
        if !self.prefix_caching || self.by_hash.contains_key(&hash) {
            return false;
        }
        if let Some(old) = self.content[block as usize].take() {
            self.by_hash.remove(&old.hash);
        }
        self.by_hash.insert(hash, block);
        self.content[block as usize] = Some(Content {
            hash,
            parent,
            tokens: tokens.into(),
        });
        true
    }

    /// Finds a block with this content and takes a reference to it (a hit), or counts a miss.
    pub fn lookup(
        &mut self,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[u32],
    ) -> Option<BlockId> {
        if !self.prefix_caching {
            return None;
        }
        let found = self.by_hash.get(&hash).copied().filter(|&b| {
            let c = self.content[b as usize]
                .as_ref()
                .expect("a hashed block has content");
            c.parent == parent && *c.tokens == *tokens
        });
        let Some(block) = found else {
            self.stats.misses += 1;
            return None;
        };
        self.stats.hits += 1;
        let i = block as usize;
        if self.refcount[i] == 0 {
            self.evictable.remove(&self.released_at[i]);
        }
        self.refcount[i] += 1;
        Some(block)
    }

    /// Whether a block with this content is registered (without taking it or counting).
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.prefix_caching && self.by_hash.contains_key(&hash)
    }

    /// Forgets every cached block (keeps held ones).
    pub fn clear_cache(&mut self) {
        while let Some((_, block)) = self.evictable.pop_first() {
            if let Some(c) = self.content[block as usize].take() {
                self.by_hash.remove(&c.hash);
            }
            self.free.push_back(block);
        }
    }

    /// Checks the pool's invariants; the first broken one.
    pub fn check(&self) -> Result<(), PoolInvariantError> {
        let n = self.total();
        let mut seen = vec![0u8; n];
        for &b in &self.free {
            let i = b as usize;
            if self.refcount[i] != 0 || self.content[i].is_some() {
                return Err(PoolInvariantError::FreeBlockInUse { block: b });
            }
            seen[i] += 1;
        }
        for &b in self.evictable.values() {
            let i = b as usize;
            if self.refcount[i] != 0 || self.content[i].is_none() {
                return Err(PoolInvariantError::CachedBlockInUse { block: b });
            }
            seen[i] += 1;
        }
        for (i, &count) in seen.iter().enumerate() {
            let expected = u8::from(self.refcount[i] == 0);
            if count != expected {
                return Err(PoolInvariantError::MiscountedBlock {
                    block: i,
                    refcount: self.refcount[i],
                    count,
                });
            }
        }
        for (&hash, &b) in &self.by_hash {
            if self.content[b as usize].as_ref().map(|c| c.hash) != Some(hash) {
                return Err(PoolInvariantError::StaleHashEntry { block: b });
            }
        }
        let named = self.content.iter().filter(|c| c.is_some()).count();
        if named != self.by_hash.len() {
            return Err(PoolInvariantError::HashIndexSize {
                named,
                entries: self.by_hash.len(),
            });
        }
        Ok(())
    }
}

/// A broken invariant of the [`BlockPool`] (a bug, found by [`BlockPool::check`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolInvariantError {
    #[error("free block {block} is referenced or named")]
    FreeBlockInUse { block: BlockId },
    #[error("cached block {block} is referenced or unnamed")]
    CachedBlockInUse { block: BlockId },
    #[error("block {block} (refcount {refcount}) is listed {count} times among free and cached")]
    MiscountedBlock {
        block: usize,
        refcount: u32,
        count: u8,
    },
    #[error("hash index points at block {block} with other content")]
    StaleHashEntry { block: BlockId },
    #[error("{named} named blocks but {entries} hash entries")]
    HashIndexSize { named: usize, entries: usize },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn released_named_blocks_are_cached_then_evicted_lru() {
        let mut pool = BlockPool::new(3, 2, true);
        let a = pool.allocate().unwrap().block;
        let b = pool.allocate().unwrap().block;
        let ha = block_hash(ROOT_HASH, &[1, 2]);
        let hb = block_hash(ha, &[3, 4]);
        assert!(pool.register(a, ha, ROOT_HASH, &[1, 2]));
        assert!(pool.register(b, hb, ha, &[3, 4]));
        pool.release(a);
        pool.release(b);
        assert_eq!((pool.available(), pool.cached(), pool.held()), (3, 2, 0));
        // A hit revives a cached block; the wrong tokens under the same hash do not.
        assert_eq!(pool.lookup(ha, ROOT_HASH, &[1, 2]), Some(a));
        assert_eq!(pool.lookup(hb, ha, &[3, 5]), None);
        assert_eq!(pool.stats().hits, 1);
        assert_eq!(pool.stats().misses, 1);
        // The free block goes first, then the least recently released cached one (b).
        let c = pool.allocate().unwrap();
        assert_eq!(c.evicted, None);
        let d = pool.allocate().unwrap();
        assert_eq!(d.block, b);
        assert_eq!(d.evicted.as_ref().map(|e| e.0), Some(hb));
        assert!(pool.allocate().is_none());
        assert!(!pool.contains(hb));
        pool.check().unwrap();
    }

    #[test]
    fn without_prefix_caching_released_blocks_are_free() {
        let mut pool = BlockPool::new(2, 4, false);
        let a = pool.allocate().unwrap().block;
        assert!(!pool.register(a, 7, ROOT_HASH, &[1, 2, 3, 4]));
        pool.release(a);
        assert_eq!(pool.cached(), 0);
        assert_eq!(pool.lookup(7, ROOT_HASH, &[1, 2, 3, 4]), None);
        pool.check().unwrap();
    }

    #[test]
    fn chain_hashes_depend_on_the_whole_prefix() {
        let x = chain_hashes(&[1, 2, 3, 4, 5], 2);
        let y = chain_hashes(&[9, 2, 3, 4], 2);
        assert_eq!(x.len(), 2);
        assert_eq!(y.len(), 2);
        assert_ne!(x[1], y[1], "same block tokens, different parents");
        assert_eq!(x, chain_hashes(&[1, 2, 3, 4], 2));
    }
}
