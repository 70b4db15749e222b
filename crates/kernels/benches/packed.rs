//! Multiply-accumulates per second of the packed quantized matmul, per weight type and per
//! instruction-set level this CPU has (alternated, so noise from a shared machine hits each level
//! alike), on the shapes of Qwen2-1.5B Q4_K_M (1,536 wide, an 8,960-wide feed-forward: Q4_K
//! gate/up, Q6_K down, Q4_K attention) and of Gemma 3 270M (640 wide: a 2,048-row Q8_0 and Q5_0
//! feed-forward), for 1 activation row (decode), 4 (batched decode) and 64 (a prefill chunk).
//!
//! ```text
//! cargo bench -p rampart-kernels --bench packed [-- THREADS [ROUNDS]]
//! ```
//!
//! Per shape, level and batch: the best time of its rounds, the MACs per second and the packed
//! weights read per second.

use std::time::Instant;

use kernels::testing::{random_f32, random_row};
use kernels::{DType, Isa, Matrix, Scratch, ThreadPool};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = args.first().copied().unwrap_or(2);
    let rounds = args.get(1).copied().unwrap_or(3);
    let pool = ThreadPool::new(threads);
    let levels: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|i| *i >= Isa::Avx2)
        .collect();
    let names: Vec<&str> = levels.iter().map(|i| i.name()).collect();
    println!("levels {} ×{threads} threads", names.join(", "));
    for (dtype, rows, cols) in [
        (DType::Q4_K, 8960, 1536),
        (DType::Q6_K, 1536, 8960),
        (DType::Q4_K, 1536, 1536),
        (DType::Q8_0, 2048, 640),
        (DType::Q5_0, 2048, 640),
        (DType::Q4_1, 2048, 640),
    ] {
        // One random row repeated: the values do not matter to the speed.
        let row = random_row(dtype, cols, 7);
        let data: Vec<u8> = (0..rows).flat_map(|_| row.iter().copied()).collect();
        let packed = kernels::packed::pack(dtype, &data, rows, cols).expect("packable");
        let w = Matrix::new(dtype, &data, rows, cols)
            .unwrap()
            .with_packed(&packed)
            .unwrap();
        for m in [1usize, 4, 64] {
            let x = random_f32(m * cols, 3);
            let mut out = vec![0f32; m * rows];
            let mut scratch = Scratch::default();
            let mut best = vec![f64::MAX; levels.len()];
            let reps = (4e8 / (m.min(8) * rows * cols) as f64).ceil() as usize;
            for _ in 0..rounds {
                for (l, &isa) in levels.iter().enumerate() {
                    kernels::matmul::matmul(&pool, isa, &w, &x, m, &mut out, &mut scratch);
                    for _ in 0..reps {
                        let started = Instant::now();
                        kernels::matmul::matmul(&pool, isa, &w, &x, m, &mut out, &mut scratch);
                        best[l] = best[l].min(started.elapsed().as_secs_f64());
                    }
                }
            }
            let mut line = format!(
                "{:<5} {rows:>5}×{cols:<5} ({:>5.1} MB) m={m:<3}",
                dtype.name(),
                packed.len() as f64 / 1e6
            );
            let macs = (m * rows * cols) as f64;
            for (l, isa) in levels.iter().enumerate() {
                line += &format!(
                    "  {}: {:>7.3} ms {:>6.1} GMAC/s {:>5.1} GB/s",
                    isa.name(),
                    best[l] * 1e3,
                    macs / best[l] / 1e9,
                    packed.len() as f64 / best[l] / 1e9
                );
            }
            println!("{line}");
        }
    }
}
