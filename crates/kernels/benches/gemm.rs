//! GFLOP/s of the packed f32 GEMM on the shapes of a MiniLM-sized encoder layer.
//!
//! ```text
//! cargo bench -p rampart-kernels --bench gemm [-- THREADS [ROWS]]
//! ```

use std::time::Instant;

use kernels::gemm::{gemm, Activation, Epilogue, PackedMatrix};
use kernels::testing::random_f32;
use kernels::{Isa, ThreadPool};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = args.first().copied().unwrap_or(2);
    let m = args.get(1).copied().unwrap_or(864);
    let pool = ThreadPool::new(threads);
    let isa = Isa::detect();
    println!("{} ×{threads} threads, {m} rows", isa.name());
    for (rows, cols, activation) in [
        (1152, 384, Activation::None),
        (384, 384, Activation::None),
        (1536, 384, Activation::GeluErf),
        (384, 1536, Activation::None),
    ] {
        let w = PackedMatrix::pack(&random_f32(rows * cols, 1), rows, cols);
        let x = random_f32(m * cols, 2);
        let bias = random_f32(rows, 3);
        let mut out = vec![0f32; m * rows];
        let epilogue = Epilogue {
            bias: Some(&bias),
            residual: None,
            activation,
        };
        gemm(&pool, isa, &x, m, &w, epilogue, &mut out);
        let mut best = f64::MAX;
        for _ in 0..5 {
            let started = Instant::now();
            let reps = 10;
            for _ in 0..reps {
                gemm(&pool, isa, &x, m, &w, epilogue, &mut out);
            }
            best = best.min(started.elapsed().as_secs_f64() / reps as f64);
        }
        let flops = 2.0 * (m * rows * cols) as f64;
        println!(
            "{rows:>5} × {cols:<5} {activation:?}: {:>7.1} µs  {:>6.1} GFLOP/s",
            best * 1e6,
            flops / best / 1e9
        );
    }
}
