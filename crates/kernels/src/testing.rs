//! Deterministic random inputs for kernel tests and benchmarks: f32 vectors and valid rows of
//! every block format (random quants, scales in a realistic range).

use half::{bf16, f16};

use crate::dtype::DType;

pub use crate::rng::SplitMix64 as Rng;

/// `n` floats uniform in [-1, 1).
pub fn random_f32(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.signed_f32()).collect()
}

/// A valid row of `n` elements of `dtype`: random quants, positive f16 scales around 0.01 and
/// mins around 0.005, as in real weights.
pub fn random_row(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let bytes = dtype
        .row_bytes(n)
        .expect("n must be a whole number of blocks");
    let mut row: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
    let mut put_f16 = |row: &mut [u8], at: usize, scale: f32| {
        let v = f16::from_f32(scale * (0.5 + 0.5 * rng.signed_f32().abs()));
        row[at..at + 2].copy_from_slice(&v.to_le_bytes());
    };
    let bb = dtype.block_bytes();
    match dtype {
        DType::F32 => {
            let mut r = Rng::new(seed);
            for c in row.chunks_exact_mut(4) {
                c.copy_from_slice(&r.signed_f32().to_le_bytes());
            }
        }
        DType::F16 => {
            let mut r = Rng::new(seed);
            for c in row.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(r.signed_f32()).to_le_bytes());
            }
        }
        DType::BF16 => {
            let mut r = Rng::new(seed);
            for c in row.chunks_exact_mut(2) {
                c.copy_from_slice(&bf16::from_f32(r.signed_f32()).to_le_bytes());
            }
        }
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => {
            for b in 0..bytes / bb {
                put_f16(&mut row, b * bb, 0.01);
            }
        }
        DType::Q4_1 | DType::Q5_1 => {
            for b in 0..bytes / bb {
                put_f16(&mut row, b * bb, 0.01);
                put_f16(&mut row, b * bb + 2, -0.05);
            }
        }
        DType::Q2_K => {
            for b in 0..bytes / bb {
                put_f16(&mut row, b * bb + 80, 0.01);
                put_f16(&mut row, b * bb + 82, 0.005);
            }
        }
        DType::Q3_K => {
            for b in 0..bytes / bb {
                put_f16(&mut row, b * bb + 108, 0.01);
            }
        }
        DType::Q4_K | DType::Q5_K => {
            for b in 0..bytes / bb {
                put_f16(&mut row, b * bb, 0.01);
                put_f16(&mut row, b * bb + 2, 0.005);
            }
        }
        DType::Q6_K => {
            for b in 0..bytes / bb {
                put_f16(&mut row, b * bb + 208, 0.01);
            }
        }
        DType::Q8_K => {
            for b in 0..bytes / bb {
                let d = 0.01 * (0.5 + 0.5 * rng.signed_f32().abs());
                row[b * bb..b * bb + 4].copy_from_slice(&d.to_le_bytes());
            }
        }
    }
    row
}
