//! The second KV tier: block contents kept outside the hot pool, first in host memory, then in an
//! on-disk file, so a preempted sequence or an evicted shared prefix can come back without
//! recomputation.
//!
//! Entries are whole blocks (all layers, keys and values) under a caller-chosen key: a prefix
//! block's content hash, or a preempted sequence's own key per block. When host memory is full
//! the oldest host entry spills to disk; when the disk is full too the oldest entry is dropped
//! (its owner then recomputes). The file is unnamed (deleted when the process ends).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

/// Sizes of the tier.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TierConfig {
    /// Host memory for blocks moved out of the pool (0: no host tier).
    pub host_bytes: usize,
    /// Bytes of the on-disk file (0: no disk tier).
    pub disk_bytes: usize,
    /// Folder of the disk file (default: the system temporary folder).
    pub disk_dir: Option<PathBuf>,
}

impl TierConfig {
    pub fn enabled(&self) -> bool {
        self.host_bytes > 0 || self.disk_bytes > 0
    }
}

/// Counters and occupancy of the tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub host_blocks: usize,
    pub disk_blocks: usize,
    /// Blocks stored.
    pub stored: u64,
    /// Blocks brought back.
    pub restored: u64,
    /// Blocks moved from host memory to disk.
    pub spilled: u64,
    /// Blocks dropped for lack of room.
    pub dropped: u64,
}

#[derive(Debug)]
enum Place {
    Host(Vec<u8>),
    Disk(usize),
}

#[derive(Debug)]
struct Entry {
    place: Place,
    /// Insertion order (oldest spills/drops first).
    seq: u64,
}

/// Host-memory and disk storage of whole blocks by key.
#[derive(Debug)]
pub struct KvTier {
    block_bytes: usize,
    host_capacity: usize,
    entries: HashMap<u64, Entry>,
    /// Insertion order of host entries and of disk entries.
    host_order: BTreeMap<u64, u64>,
    disk_order: BTreeMap<u64, u64>,
    next_seq: u64,
    file: Option<File>,
    disk_slots: usize,
    free_slots: Vec<usize>,
    stats: TierStats,
}

impl KvTier {
    /// A tier for blocks of `block_bytes` bytes.
    pub fn new(config: &TierConfig, block_bytes: usize) -> io::Result<Self> {
        assert!(block_bytes > 0, "blocks have bytes");
        let disk_slots = config.disk_bytes / block_bytes;
        let file = if disk_slots > 0 {
            let dir = config.disk_dir.clone().unwrap_or_else(std::env::temp_dir);
            let file = tempfile::tempfile_in(&dir)?;
            file.set_len((disk_slots * block_bytes) as u64)?;
            Some(file)
        } else {
            None
        };
        Ok(Self {
            block_bytes,
            host_capacity: config.host_bytes / block_bytes,
            entries: HashMap::new(),
            host_order: BTreeMap::new(),
            disk_order: BTreeMap::new(),
            next_seq: 0,
            file,
            disk_slots,
            free_slots: (0..disk_slots).rev().collect(),
            stats: TierStats::default(),
        })
    }

    /// Blocks the tier can hold.
    pub fn capacity_blocks(&self) -> usize {
        self.host_capacity + self.disk_slots
    }

    pub fn stats(&self) -> TierStats {
        TierStats {
            host_blocks: self.host_order.len(),
            disk_blocks: self.disk_order.len(),
            ..self.stats
        }
    }

    pub fn contains(&self, key: u64) -> bool {
        self.entries.contains_key(&key)
    }

    /// Stores a block under `key` (replacing an entry of the same key). Returns the keys dropped
    /// to make room (possibly `key` itself when the tier holds nothing).
    pub fn put(&mut self, key: u64, data: &[u8]) -> io::Result<Vec<u64>> {
        assert_eq!(data.len(), self.block_bytes, "whole blocks only");
        self.remove(key);
        let mut dropped = Vec::new();
        if self.capacity_blocks() == 0 {
            self.stats.dropped += 1;
            dropped.push(key);
            return Ok(dropped);
        }
        if self.host_capacity > 0 {
            while self.host_order.len() >= self.host_capacity {
                self.spill_oldest_host(&mut dropped)?;
            }
            let seq = self.bump();
            self.host_order.insert(seq, key);
            self.entries.insert(
                key,
                Entry {
                    place: Place::Host(data.to_vec()),
                    seq,
                },
            );
        } else {
            let slot = self.disk_slot(&mut dropped)?;
            self.write_slot(slot, data)?;
            let seq = self.bump();
            self.disk_order.insert(seq, key);
            self.entries.insert(
                key,
                Entry {
                    place: Place::Disk(slot),
                    seq,
                },
            );
        }
        self.stats.stored += 1;
        Ok(dropped)
    }

    /// Takes a block out of the tier into `out`; false when the key is not held.
    pub fn take(&mut self, key: u64, out: &mut [u8]) -> io::Result<bool> {
        assert_eq!(out.len(), self.block_bytes, "whole blocks only");
        let Some(entry) = self.entries.remove(&key) else {
            return Ok(false);
        };
        match entry.place {
            Place::Host(data) => {
                self.host_order.remove(&entry.seq);
                out.copy_from_slice(&data);
            }
            Place::Disk(slot) => {
                self.disk_order.remove(&entry.seq);
                let file = self.file.as_ref().expect("disk entries imply a file");
                let read = file.read_exact_at(out, (slot * self.block_bytes) as u64);
                self.free_slots.push(slot);
                read?;
            }
        }
        self.stats.restored += 1;
        Ok(true)
    }

    /// Forgets an entry.
    pub fn remove(&mut self, key: u64) {
        if let Some(entry) = self.entries.remove(&key) {
            match entry.place {
                Place::Host(_) => {
                    self.host_order.remove(&entry.seq);
                }
                Place::Disk(slot) => {
                    self.disk_order.remove(&entry.seq);
                    self.free_slots.push(slot);
                }
            }
        }
    }

    fn bump(&mut self) -> u64 {
        self.next_seq += 1;
        self.next_seq
    }

    /// A free disk slot, dropping the oldest disk entry when none is free.
    fn disk_slot(&mut self, dropped: &mut Vec<u64>) -> io::Result<usize> {
        if let Some(slot) = self.free_slots.pop() {
            return Ok(slot);
        }
        let (_, oldest) = self
            .disk_order
            .pop_first()
            .expect("a full disk tier has entries");
        let entry = self.entries.remove(&oldest).expect("ordered entries exist");
        self.stats.dropped += 1;
        dropped.push(oldest);
        match entry.place {
            Place::Disk(slot) => Ok(slot),
            Place::Host(_) => unreachable!("disk order lists disk entries"),
        }
    }

    fn write_slot(&self, slot: usize, data: &[u8]) -> io::Result<()> {
        let file = self.file.as_ref().expect("disk slots imply a file");
        file.write_all_at(data, (slot * self.block_bytes) as u64)
    }

    /// Moves the oldest host entry to disk, or drops it when there is no disk tier.
    fn spill_oldest_host(&mut self, dropped: &mut Vec<u64>) -> io::Result<()> {
        let (seq, key) = self
            .host_order
            .pop_first()
            .expect("a full host tier has entries");
        let entry = self.entries.remove(&key).expect("ordered entries exist");
        let Place::Host(data) = entry.place else {
            unreachable!("host order lists host entries")
        };
        if self.disk_slots == 0 {
            self.stats.dropped += 1;
            dropped.push(key);
            return Ok(());
        }
        let slot = self.disk_slot(dropped)?;
        self.write_slot(slot, &data)?;
        self.disk_order.insert(seq, key);
        self.entries.insert(
            key,
            Entry {
                place: Place::Disk(slot),
                seq,
            },
        );
        self.stats.spilled += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(tag: u8) -> Vec<u8> {
        vec![tag; 64]
    }

    #[test]
    fn host_spills_to_disk_then_drops_oldest() {
        let config = TierConfig {
            host_bytes: 2 * 64,
            disk_bytes: 2 * 64,
            disk_dir: None,
        };
        let mut tier = KvTier::new(&config, 64).unwrap();
        for key in 1..=4 {
            assert!(tier.put(key, &block(key as u8)).unwrap().is_empty());
        }
        let s = tier.stats();
        assert_eq!((s.host_blocks, s.disk_blocks, s.spilled), (2, 2, 2));
        // A fifth block drops the oldest (key 1, on disk).
        assert_eq!(tier.put(5, &block(5)).unwrap(), vec![1]);
        let mut out = vec![0u8; 64];
        assert!(!tier.take(1, &mut out).unwrap());
        for key in 2..=5 {
            assert!(tier.take(key, &mut out).unwrap(), "key {key}");
            assert_eq!(out, block(key as u8));
        }
        let s = tier.stats();
        assert_eq!((s.host_blocks, s.disk_blocks, s.restored), (0, 0, 4));
    }

    #[test]
    fn disk_only_and_empty_tiers() {
        let config = TierConfig {
            host_bytes: 0,
            disk_bytes: 64,
            disk_dir: None,
        };
        let mut tier = KvTier::new(&config, 64).unwrap();
        tier.put(7, &block(7)).unwrap();
        assert_eq!(tier.put(8, &block(8)).unwrap(), vec![7]);
        let mut out = vec![0u8; 64];
        assert!(tier.take(8, &mut out).unwrap());
        assert_eq!(out, block(8));
        let mut none = KvTier::new(&TierConfig::default(), 64).unwrap();
        assert_eq!(none.put(1, &block(1)).unwrap(), vec![1]);
        assert!(!none.contains(1));
    }
}
