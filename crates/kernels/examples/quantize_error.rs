//! Quantizes an f32 tensor into several block formats and reports, per format, the round-trip
//! error (RMS of the error relative to the RMS of the input) and the time taken.
//!
//! ```text
//! cargo run --release -p rampart-kernels --example quantize_error -- \
//!     INPUT N_PER_ROW TYPES [OUT_DIR]
//! ```
//!
//! - `INPUT`: a file of little-endian f32, or `normal:N` for N standard-normal samples.
//! - `N_PER_ROW`: the row length; the input is split into rows of it (a multiple of each block
//!   size).
//! - `TYPES`: comma-separated type names (`Q4_K,Q6_K,Q8_0`).
//! - `OUT_DIR`: if given, each quantized tensor is written to `OUT_DIR/<TYPE>.q` (to compare
//!   byte for byte with another quantizer).

use std::error::Error;
use std::time::Instant;

use kernels::quant::dequantize_row;
use kernels::quantize::quantize_row;
use kernels::rng::SplitMix64;
use kernels::DType;

fn normal(n: usize) -> Vec<f32> {
    let mut rng = SplitMix64::new(1);
    (0..n)
        .map(|_| {
            let u1 = 1.0 - rng.unit_f64();
            let u2 = rng.unit_f64();
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

fn main() -> Result<(), Box<dyn Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, n_per_row, types, rest @ ..] = args.as_slice() else {
        return Err("usage: quantize_error INPUT N_PER_ROW TYPES [OUT_DIR]".into());
    };
    let out_dir = rest.first();
    let values = match input.strip_prefix("normal:") {
        Some(n) => normal(n.parse()?),
        None => std::fs::read(input)?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    };
    let n_per_row: usize = n_per_row.parse()?;
    if n_per_row == 0 || values.len() % n_per_row != 0 {
        return Err(format!(
            "{} values do not split into rows of {n_per_row}",
            values.len()
        )
        .into());
    }
    let norm: f64 = values.iter().map(|&v| f64::from(v).powi(2)).sum();
    println!(
        "{} values, rows of {n_per_row}, rms {:.6}",
        values.len(),
        (norm / values.len() as f64).sqrt()
    );
    for name in types.split(',') {
        let dtype = DType::from_name(name).ok_or_else(|| format!("unknown type {name}"))?;
        let row_bytes = dtype
            .row_bytes(n_per_row)
            .ok_or_else(|| format!("rows of {n_per_row} are not whole {dtype} blocks"))?;
        let mut quantized = vec![0u8; values.len() / n_per_row * row_bytes];
        let start = Instant::now();
        for (row, out) in values
            .chunks_exact(n_per_row)
            .zip(quantized.chunks_exact_mut(row_bytes))
        {
            quantize_row(dtype, row, out)?;
        }
        let seconds = start.elapsed().as_secs_f64();
        let mut restored = vec![0f32; n_per_row];
        let mut error = 0f64;
        for (row, q) in values
            .chunks_exact(n_per_row)
            .zip(quantized.chunks_exact(row_bytes))
        {
            dequantize_row(dtype, q, &mut restored);
            error += row
                .iter()
                .zip(&restored)
                .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
                .sum::<f64>();
        }
        let relative = if norm > 0.0 {
            (error / norm).sqrt()
        } else {
            0.0
        };
        println!(
            "{dtype:5} rel_rms {relative:.6}  {seconds:7.3} s  {:6.1} M values/s",
            values.len() as f64 / seconds / 1e6
        );
        if let Some(dir) = out_dir {
            std::fs::write(format!("{dir}/{dtype}.q"), &quantized)?;
        }
    }
    Ok(())
}
