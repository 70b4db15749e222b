//! One decode step's matrix multiplications on the shapes and types of a Qwen2-1.5B Q4_K_M
//! (28 layers of Q/K/V, output, gate/up and down; llama.cpp's recipe puts Q6_K on V and down
//! in 14 of them and on the 151,936-row output matrix), each layer its own packed copy so that
//! the weights stream from memory as in the engine, against the read bandwidth measured in the
//! same run: how close the kernels alone come to the roofline, matrix type by matrix type. What
//! the engine's decode loses beyond this is the rest of the step (attention, norms, the hand-offs
//! between threads).
//!
//! ```text
//! RAMPART_ISA=avx512 cargo bench -p rampart-kernels --bench decode [-- THREADS [STEPS [ROUNDS]]]
//! ```
//!
//! Packs as this process's level packs (`RAMPART_ISA` lowers it), runs that level's kernels.

use std::time::Instant;

use kernels::testing::{random_f32, random_row};
use kernels::{DType, Isa, Matrix, Scratch, ThreadPool};

const LAYERS: usize = 28;
const HIDDEN: usize = 1536;
const KV: usize = 256;
const FFN: usize = 8960;
const VOCAB: usize = 151_936;

/// Whether llama.cpp's Q4_K_M recipe gives layer `l`'s V and down matrices Q6_K.
fn more_bits(l: usize) -> bool {
    !(LAYERS / 8..7 * LAYERS / 8).contains(&l) || (l - LAYERS / 8) % 3 == 2
}

/// This thread's time on a CPU so far (Linux's schedstat; 0 elsewhere).
fn thread_cpu_seconds() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .map_or(0.0, |ns| ns as f64 / 1e9)
}

/// A packed matrix of its own, from one random row repeated (values do not change the speed).
struct Packed {
    dtype: DType,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    packed: Vec<u8>,
}

impl Packed {
    fn new(dtype: DType, rows: usize, cols: usize) -> Packed {
        let row = random_row(dtype, cols, rows as u64);
        let data: Vec<u8> = row.repeat(rows);
        let packed = kernels::packed::pack(dtype, &data, rows, cols).expect("packable");
        Packed {
            dtype,
            rows,
            cols,
            data,
            packed,
        }
    }

    fn matrix(&self) -> Matrix<'_> {
        Matrix::new(self.dtype, &self.data, self.rows, self.cols)
            .expect("a whole matrix")
            .with_packed(&self.packed)
            .expect("packed for this process")
    }
}

struct Layer {
    q: Packed,
    k: Packed,
    v: Packed,
    o: Packed,
    gate: Packed,
    up: Packed,
    down: Packed,
}

/// What a step's matmuls are grouped by in the report.
#[derive(Clone, Copy)]
enum Part {
    /// Q/K/V (one fused call), output projection, gate/up (one fused call): Q4_K, with a Q6_K V
    /// in some layers.
    Attention,
    GateUp,
    /// Q4_K or Q6_K.
    Down(DType),
    Output,
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = args.first().copied().unwrap_or(2);
    let steps = args.get(1).copied().unwrap_or(16);
    let rounds = args.get(2).copied().unwrap_or(3);
    let isa = Isa::detect();
    let pool = ThreadPool::new(threads);
    let packing = Instant::now();
    let layers: Vec<Layer> = (0..LAYERS)
        .map(|l| {
            let more = if more_bits(l) {
                DType::Q6_K
            } else {
                DType::Q4_K
            };
            Layer {
                q: Packed::new(DType::Q4_K, HIDDEN, HIDDEN),
                k: Packed::new(DType::Q4_K, KV, HIDDEN),
                v: Packed::new(more, KV, HIDDEN),
                o: Packed::new(DType::Q4_K, HIDDEN, HIDDEN),
                gate: Packed::new(DType::Q4_K, FFN, HIDDEN),
                up: Packed::new(DType::Q4_K, FFN, HIDDEN),
                down: Packed::new(more, HIDDEN, FFN),
            }
        })
        .collect();
    let output = Packed::new(DType::Q6_K, VOCAB, HIDDEN);
    let bytes = |p: &Packed| p.packed.len() as f64;
    let mut part_bytes = [0f64; 5];
    for layer in &layers {
        part_bytes[0] += bytes(&layer.q) + bytes(&layer.k) + bytes(&layer.v) + bytes(&layer.o);
        part_bytes[1] += bytes(&layer.gate) + bytes(&layer.up);
        let at = if layer.down.dtype == DType::Q6_K {
            3
        } else {
            2
        };
        part_bytes[at] += bytes(&layer.down);
    }
    part_bytes[4] = bytes(&output);
    let total_bytes: f64 = part_bytes.iter().sum();
    println!(
        "level {} ×{threads} threads; packed in {:.1} s; {:.3} GB of weights per step",
        isa.name(),
        packing.elapsed().as_secs_f64(),
        total_bytes / 1e9
    );

    let x = random_f32(FFN, 1);
    let (mut q, mut k, mut v) = (vec![0f32; HIDDEN], vec![0f32; KV], vec![0f32; KV]);
    let (mut o, mut gate, mut up) = (vec![0f32; HIDDEN], vec![0f32; FFN], vec![0f32; FFN]);
    let mut logits = vec![0f32; VOCAB];
    let mut scratch = Scratch::default();
    // Seconds per part over the timed steps of the best round.
    let mut best_step = f64::MAX;
    let mut best_parts = [0f64; 5];
    let mut bandwidths = Vec::new();
    for round in 0..rounds {
        let mut parts = [0f64; 5];
        let started = Instant::now();
        for _ in 0..steps {
            let mut timed = |part: Part, run: &mut dyn FnMut()| {
                let at = match part {
                    Part::Attention => 0,
                    Part::GateUp => 1,
                    Part::Down(DType::Q6_K) => 3,
                    Part::Down(_) => 2,
                    Part::Output => 4,
                };
                let t = Instant::now();
                run();
                parts[at] += t.elapsed().as_secs_f64();
            };
            for layer in &layers {
                let h = &x[..HIDDEN];
                timed(Part::Attention, &mut || {
                    kernels::matmul::matmul_many(
                        &pool,
                        isa,
                        &[layer.q.matrix(), layer.k.matrix(), layer.v.matrix()],
                        h,
                        1,
                        &mut [&mut q, &mut k, &mut v],
                        &mut scratch,
                    );
                    kernels::matmul::matmul(
                        &pool,
                        isa,
                        &layer.o.matrix(),
                        h,
                        1,
                        &mut o,
                        &mut scratch,
                    );
                });
                timed(Part::GateUp, &mut || {
                    kernels::matmul::matmul_many(
                        &pool,
                        isa,
                        &[layer.gate.matrix(), layer.up.matrix()],
                        h,
                        1,
                        &mut [&mut gate, &mut up],
                        &mut scratch,
                    )
                });
                timed(Part::Down(layer.down.dtype), &mut || {
                    kernels::matmul::matmul(
                        &pool,
                        isa,
                        &layer.down.matrix(),
                        &x,
                        1,
                        &mut o,
                        &mut scratch,
                    )
                });
            }
            timed(Part::Output, &mut || {
                kernels::matmul::matmul(
                    &pool,
                    isa,
                    &output.matrix(),
                    &x[..HIDDEN],
                    1,
                    &mut logits,
                    &mut scratch,
                )
            });
        }
        let step = started.elapsed().as_secs_f64() / steps as f64;
        // The bandwidth right after, on the same threads (the first round warms up).
        let bandwidth = kernels::memory_bandwidth::read_bandwidth(
            &pool,
            isa,
            kernels::memory_bandwidth::DEFAULT_BYTES,
            2,
        )
        .best_bytes_per_second();
        bandwidths.push(bandwidth);
        println!(
            "round {round}: {:.2} ms per step, {:.1} GB/s; read bandwidth {:.1} GB/s, fraction {:.2}",
            step * 1e3,
            total_bytes / step / 1e9,
            bandwidth / 1e9,
            total_bytes / step / bandwidth
        );
        if round > 0 && step < best_step {
            best_step = step;
            best_parts = parts.map(|p| p / steps as f64);
        }
    }
    // The kernels' own speed: a 1,536-square matrix (at most 1.9 MB packed, in L2) again and
    // again on one thread, so memory is out of the way, timed by the thread's CPU time (what the
    // scheduler charged it), so other processes on a shared machine do not count.
    let alone = ThreadPool::new(1);
    for dtype in [DType::Q4_K, DType::Q6_K] {
        let hot = Packed::new(dtype, HIDDEN, HIDDEN);
        let w = hot.matrix();
        let mut out = vec![0f32; HIDDEN];
        let calls = 1000;
        let mut best = f64::MAX;
        for _ in 0..rounds {
            let started = thread_cpu_seconds();
            for _ in 0..calls {
                kernels::matmul::matmul(&alone, isa, &w, &x[..HIDDEN], 1, &mut out, &mut scratch);
            }
            best = best.min((thread_cpu_seconds() - started) / calls as f64);
        }
        println!(
            "in L2, one thread: {} {HIDDEN}×{HIDDEN} ({:.2} MB) {:.1} µs CPU per call, {:.1} GB/s",
            dtype.name(),
            bytes(&hot) / 1e6,
            best * 1e6,
            bytes(&hot) / best / 1e9
        );
    }
    bandwidths.sort_by(f64::total_cmp);
    let bandwidth = bandwidths[bandwidths.len() / 2];
    println!(
        "best step {:.2} ms ({:.1} tok/s if nothing else ran), median bandwidth {:.1} GB/s",
        best_step * 1e3,
        1.0 / best_step,
        bandwidth / 1e9
    );
    for (name, at) in [
        ("Q/K/V + output projection", 0),
        ("gate/up (Q4_K)", 1),
        ("down Q4_K", 2),
        ("down Q6_K", 3),
        ("output Q6_K", 4),
    ] {
        let seconds = best_parts[at];
        println!(
            "  {name:<28} {:>7.3} GB {:>7.2} ms {:>6.1} GB/s fraction {:.2}",
            part_bytes[at] / 1e9,
            seconds * 1e3,
            part_bytes[at] / seconds / 1e9,
            part_bytes[at] / seconds / bandwidth
        );
    }
}
