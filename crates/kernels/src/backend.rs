//! The compute-backend interface: the operations the engine's forward pass is made of.
//!
//! The engine holds a `Box<dyn Backend>` and never calls kernels directly, so another device can
//! implement the same operations. Tensors cross this interface as host slices today; a device
//! backend (CUDA through dynamically loaded libraries) will keep weights and the KV cache resident
//! and extend the interface with buffer handles, which the CPU backend maps to slices.

use std::sync::Arc;

use crate::dispatch::Isa;
use crate::matmul::{matmul, matmul_many, Matrix, Scratch};
use crate::ops::{attention, rms_norm, AttentionShape};
use crate::paged::{paged_attention, Capture, PagedKv, QueryRow};
use crate::pool::{ThreadPool, Turn};

/// The operations of a transformer forward pass.
pub trait Backend: Send + Sync {
    /// A short description (`cpu avx2 ×2 threads`).
    fn describe(&self) -> String;
    /// `out[i·rows + r] = W[r] · x[i]` for `m` activation rows.
    fn matmul(&self, w: &Matrix<'_>, x: &[f32], m: usize, out: &mut [f32], scratch: &mut Scratch);
    /// Several matrices applied to the same `m` activation rows (Q/K/V, gate/up), fused where
    /// the backend can.
    fn matmul_many(
        &self,
        ws: &[Matrix<'_>],
        x: &[f32],
        m: usize,
        outs: &mut [&mut [f32]],
        scratch: &mut Scratch,
    );
    /// Runs `task(i)` for every `i < items`, on the backend's threads where it has them (work
    /// beside the forward pass, such as sampling many sequences).
    fn for_each(&self, items: usize, task: &(dyn Fn(usize) + Sync)) {
        (0..items).for_each(task);
    }
    /// Exclusive use of the backend's threads until dropped (a forward pass takes one, so
    /// that engines sharing the threads take turns per pass, not per kernel); `None` where
    /// the backend has no shared threads.
    fn turn(&self) -> Option<Turn<'_>> {
        None
    }
    /// RMSNorm of each `weight.len()`-sized row of `x` into `out`.
    fn rms_norm_rows(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]);
    /// `gate[i] = act(gate[i]) · up[i]`: SiLU, or with `gelu` GELU's tanh form.
    fn gated_activation(&self, gelu: bool, gate: &mut [f32], up: &[f32]);
    /// Causal attention of `q` rows over the key/value cache (see [`crate::ops::attention`]).
    fn attention(&self, shape: AttentionShape, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]);
    /// Attention of `q` rows, each over its own sequence in a paged KV cache (see
    /// [`crate::paged::paged_attention`]).
    fn paged_attention(
        &self,
        heads: usize,
        q: &[f32],
        rows: &[QueryRow<'_>],
        kv: &PagedKv<'_>,
        out: &mut [f32],
        capture: Option<&mut Capture<'_>>,
    );
}

/// The CPU backend: the best SIMD level of this CPU and the process's pool of this many
/// threads (shared with every other backend of the same thread count; see
/// [`ThreadPool::shared`]).
#[derive(Debug)]
pub struct CpuBackend {
    pool: Arc<ThreadPool>,
    isa: Isa,
}

impl CpuBackend {
    /// `threads` compute threads (the caller's thread included) at the detected SIMD level.
    pub fn new(threads: usize) -> Self {
        Self::with_isa(threads, Isa::detect())
    }

    pub fn with_isa(threads: usize, isa: Isa) -> Self {
        Self {
            pool: ThreadPool::shared(threads),
            isa,
        }
    }

    pub fn isa(&self) -> Isa {
        self.isa
    }

    pub fn pool(&self) -> &ThreadPool {
        &self.pool
    }
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu {} ×{} threads", self.isa.name(), self.pool.threads())
    }

    fn matmul(&self, w: &Matrix<'_>, x: &[f32], m: usize, out: &mut [f32], scratch: &mut Scratch) {
        matmul(&self.pool, self.isa, w, x, m, out, scratch);
    }

    fn matmul_many(
        &self,
        ws: &[Matrix<'_>],
        x: &[f32],
        m: usize,
        outs: &mut [&mut [f32]],
        scratch: &mut Scratch,
    ) {
        matmul_many(&self.pool, self.isa, ws, x, m, outs, scratch);
    }

    fn for_each(&self, items: usize, task: &(dyn Fn(usize) + Sync)) {
        self.pool.for_each(items, task);
    }

    fn turn(&self) -> Option<Turn<'_>> {
        Some(self.pool.turn())
    }

    fn rms_norm_rows(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let n = weight.len();
        for (row, dst) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
            rms_norm(self.isa, row, weight, eps, dst);
        }
    }

    fn gated_activation(&self, gelu: bool, gate: &mut [f32], up: &[f32]) {
        crate::dispatch::gated_activation(self.isa, gelu, gate, up);
    }

    fn attention(&self, shape: AttentionShape, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
        attention(&self.pool, self.isa, shape, q, k, v, out);
    }

    fn paged_attention(
        &self,
        heads: usize,
        q: &[f32],
        rows: &[QueryRow<'_>],
        kv: &PagedKv<'_>,
        out: &mut [f32],
        capture: Option<&mut Capture<'_>>,
    ) {
        paged_attention(&self.pool, self.isa, heads, q, rows, kv, out, capture);
    }
}

/// Physical cores of this machine (logical CPUs when the topology is unknown): the default
/// number of compute threads, as hyper-threads add little to memory-bound decode.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let Ok(cpuinfo) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = std::collections::HashSet::new();
    let mut physical_id = "";
    for line in cpuinfo.lines() {
        if let Some((k, v)) = line.split_once(':') {
            match k.trim() {
                "physical id" => physical_id = v.trim(),
                "core id" => {
                    cores.insert((physical_id.to_string(), v.trim().to_string()));
                }
                _ => {}
            }
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}
