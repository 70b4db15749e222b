//! Read bandwidth from main memory, measured the way decode reads weights: every thread of the
//! compute pool streams its own contiguous share of a buffer much larger than the caches, once
//! per pass, with vector loads (STREAM's idea, reading only: decode writes almost nothing).
//!
//! Decode of one sequence reads every weight once per token, so `bytes per token × tokens/s`
//! cannot exceed this; the ratio of the two is how close decode runs to the memory roofline.

use std::time::Instant;

use crate::dispatch::Isa;
use crate::pool::ThreadPool;

/// The result of [`read_bandwidth`].
#[derive(Debug, Clone, PartialEq)]
pub struct BandwidthReport {
    /// Bytes of the buffer read per pass.
    pub bytes: usize,
    pub threads: usize,
    /// Bytes per second of each timed pass.
    pub passes_bytes_per_second: Vec<f64>,
}

impl BandwidthReport {
    /// The fastest pass: what the memory system can deliver (as STREAM reports its best).
    pub fn best_bytes_per_second(&self) -> f64 {
        self.passes_bytes_per_second
            .iter()
            .copied()
            .fold(0.0, f64::max)
    }
}

/// Default buffer: 1 GiB, far beyond any last-level cache, about one 1.5B Q4_K_M model.
pub const DEFAULT_BYTES: usize = 1 << 30;

/// Reads a `bytes`-long buffer `passes` times (after one untimed pass that also faults its pages
/// in) on every thread of `pool`, each thread a contiguous share, at the vector width of `isa`.
pub fn read_bandwidth(pool: &ThreadPool, isa: Isa, bytes: usize, passes: usize) -> BandwidthReport {
    // u64 words, each a different value so that no page is shared zero page.
    let words = (bytes / 8).max(pool.threads() * 64);
    let buffer: Vec<u64> = (0..words as u64).collect();
    let threads = pool.threads();
    let share = words.div_ceil(threads).next_multiple_of(8);
    let sink = std::sync::atomic::AtomicU64::new(0);
    let mut report = BandwidthReport {
        bytes: words * 8,
        threads,
        passes_bytes_per_second: Vec::new(),
    };
    for pass in 0..=passes {
        let started = Instant::now();
        pool.for_each(threads, &|t| {
            let (from, to) = ((t * share).min(words), ((t + 1) * share).min(words));
            let sum = sum_words(isa, &buffer[from..to]);
            sink.fetch_xor(sum, std::sync::atomic::Ordering::Relaxed);
        });
        let seconds = started.elapsed().as_secs_f64();
        if pass > 0 {
            report
                .passes_bytes_per_second
                .push((words * 8) as f64 / seconds);
        }
    }
    // The sums are used, so the reads cannot be optimised away.
    std::hint::black_box(sink.into_inner());
    report
}

/// The wrapping sum of `words`, read with the widest loads `isa` allows.
pub fn sum_words(isa: Isa, words: &[u64]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx512) {
        // SAFETY: AVX-512 F is present (Isa::Avx512); the kernel reads within the slice.
        return unsafe { crate::x86::avx512::sum_words(words) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: AVX2 is present; the kernel reads within the slice.
        return unsafe { crate::x86::sum_words(words) };
    }
    let _ = isa;
    words.iter().fold(0u64, |a, &w| a.wrapping_add(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_sums_alike() {
        for len in [0, 1, 7, 8, 33, 64, 1000, 4099] {
            let words: Vec<u64> = (0..len as u64)
                .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .collect();
            let want = sum_words(Isa::Scalar, &words);
            for isa in Isa::available() {
                assert_eq!(sum_words(isa, &words), want, "{isa:?} len {len}");
            }
        }
    }

    #[test]
    fn a_small_buffer_reports_every_pass() {
        let pool = ThreadPool::new(2);
        let report = read_bandwidth(&pool, Isa::detect(), 1 << 20, 3);
        assert_eq!(report.passes_bytes_per_second.len(), 3);
        assert!(report.best_bytes_per_second() > 0.0);
        assert_eq!(report.bytes, 1 << 20);
    }
}
