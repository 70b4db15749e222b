//! Multiply-accumulates per second of the packed quantized matmul, per weight type, on the
//! shapes of Gemma 3 270M (640 wide: its 262,144-row Q8_0 output and a 2,048-row feed-forward
//! matrix) for 1, 4 and 16 activation rows (decode of that many sequences).
//!
//! ```text
//! cargo bench -p rampart-kernels --bench packed [-- THREADS]
//! ```

use std::time::Instant;

use kernels::testing::{random_f32, random_row};
use kernels::{DType, Isa, Matrix, Scratch, ThreadPool};

fn main() {
    let threads = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(2);
    let pool = ThreadPool::new(threads);
    let isa = Isa::detect();
    println!("{} ×{threads} threads", isa.name());
    for (dtype, rows, cols) in [
        // Gemma 3 270M's output (the tied embedding) and feed-forward shapes.
        (DType::Q8_0, 262_144, 640),
        (DType::Q8_0, 2048, 640),
        (DType::Q5_0, 2048, 640),
        (DType::Q4_K, 2048, 1024),
        (DType::Q6_K, 640, 2048),
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
        let mut line = format!(
            "{:<5} {rows:>6}×{cols:<4} ({:>5.1} MB):",
            dtype.name(),
            packed.len() as f64 / 1e6
        );
        for m in [1usize, 4, 16] {
            let x = random_f32(m * cols, 3);
            let mut out = vec![0f32; m * rows];
            let mut scratch = Scratch::default();
            kernels::matmul::matmul(&pool, isa, &w, &x, m, &mut out, &mut scratch);
            let mut best = f64::MAX;
            let reps = (2e8 / (rows * cols) as f64).ceil() as usize;
            for _ in 0..5 * reps {
                let started = Instant::now();
                kernels::matmul::matmul(&pool, isa, &w, &x, m, &mut out, &mut scratch);
                best = best.min(started.elapsed().as_secs_f64());
            }
            let macs = (m * rows * cols) as f64;
            line += &format!(
                "  m={m:<2} {:>6.2} ms {:>6.1} GMAC/s {:>5.1} GB/s",
                best * 1e3,
                macs / best / 1e9,
                packed.len() as f64 / best / 1e9
            );
        }
        println!("{line}");
    }
}
