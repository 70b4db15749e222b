//! Kernels against independent references:
//! - dequantization of every block format against the values the `gguf` Python package computes
//!   for the same bytes (`tests/data/quant_golden.json`, made by `scripts/gen-quant-golden.py`);
//! - every SIMD kernel against its scalar reference on random inputs of awkward sizes;
//! - the reference dot products against dequantized f32 arithmetic.

use kernels::dispatch::{dot_f32, quantize_activations, vec_dot, vec_dot_rows, Isa, DOT_ROWS};
use kernels::quant::{dequantize_row, quantize_activations_ref, unpack_k, vec_dot_ref};
use kernels::testing::{random_f32, random_row};
use kernels::{ActFormat, DType};

#[test]
fn dequantization_matches_the_gguf_reference() {
    let text = include_str!("data/quant_golden.json");
    let golden: serde_json::Value = serde_json::from_str(text).unwrap();
    let mut checked = 0;
    for (name, case) in golden.as_object().unwrap() {
        let dtype = DType::from_name(name).unwrap();
        let hex = case["bytes"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let expected: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let mut got = vec![0f32; expected.len()];
        dequantize_row(dtype, &bytes, &mut got);
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(
                (g - e).abs() <= 1e-6 * e.abs().max(1.0),
                "{name}[{i}]: {g} vs {e}"
            );
        }
        checked += 1;
    }
    assert_eq!(checked, 12, "every format but F32 and Q8_K has a golden");
}

#[test]
fn q8_k_unpacks_to_d_times_q() {
    let row = random_row(DType::Q8_K, 256, 3);
    let d = f32::from_le_bytes(row[0..4].try_into().unwrap());
    let u = unpack_k(DType::Q8_K, &row);
    let mut values = vec![0f32; 256];
    dequantize_row(DType::Q8_K, &row, &mut values);
    for i in 0..256 {
        assert_eq!(u.q[i], row[4 + i] as i8);
        assert_eq!(values[i], d * f32::from(row[4 + i] as i8));
    }
}

/// Sizes with odd numbers of blocks, to catch tail handling.
fn sizes(dtype: DType) -> Vec<usize> {
    let bs = dtype.block_size().max(32);
    [1, 2, 3, 5, 7, 9, 17, 33].iter().map(|k| k * bs).collect()
}

#[test]
fn simd_dot_products_match_the_scalar_reference() {
    for dtype in DType::ALL {
        for n in sizes(dtype) {
            for seed in 0..3 {
                let w = random_row(dtype, n, 1000 + seed);
                let x = random_f32(n, 2000 + seed);
                let format = dtype.activation_format();
                let mut a = vec![0u32; format.row_bytes(n).div_ceil(4)];
                let a_bytes = as_bytes_mut(&mut a, format.row_bytes(n));
                quantize_activations_ref(format, &x, a_bytes);
                let reference = vec_dot_ref(dtype, &w, a_bytes, n);
                for isa in Isa::available() {
                    let got = vec_dot(isa, dtype, &w, a_bytes, n);
                    let tol = 1e-4 * reference.abs().max(1.0);
                    assert!(
                        (got - reference).abs() <= tol,
                        "{dtype} n={n} {isa:?}: {got} vs {reference}"
                    );
                }
            }
        }
    }
}

#[test]
fn multi_row_dots_match_single_row_dots() {
    for dtype in DType::ALL {
        for n in sizes(dtype) {
            let w = random_row(dtype, n, 31);
            let format = dtype.activation_format();
            let mut storage: Vec<Vec<u32>> = (0..DOT_ROWS)
                .map(|_| vec![0u32; format.row_bytes(n).div_ceil(4)])
                .collect();
            for (k, words) in storage.iter_mut().enumerate() {
                let x = random_f32(n, 500 + k as u64);
                quantize_activations_ref(format, &x, as_bytes_mut(words, format.row_bytes(n)));
            }
            let acts: [&[u8]; DOT_ROWS] = std::array::from_fn(|k| {
                let words = &storage[k];
                // SAFETY: u32 storage viewed as bytes within its length.
                unsafe {
                    std::slice::from_raw_parts(words.as_ptr() as *const u8, format.row_bytes(n))
                }
            });
            for isa in Isa::available() {
                let many = vec_dot_rows(isa, dtype, &w, acts, n);
                for (k, got) in many.iter().enumerate() {
                    let one = vec_dot_ref(dtype, &w, acts[k], n);
                    assert!(
                        (got - one).abs() <= 1e-4 * one.abs().max(1.0),
                        "{dtype} n={n} {isa:?} row {k}: {got} vs {one}"
                    );
                    // Bit-identical to the same ISA's single-row kernel: a sequence's tokens do
                    // not depend on what it is batched with.
                    let single = vec_dot(isa, dtype, &w, acts[k], n);
                    assert_eq!(
                        got.to_bits(),
                        single.to_bits(),
                        "{dtype} n={n} {isa:?} row {k}: batched {got} vs alone {single}"
                    );
                }
            }
        }
    }
}

#[test]
fn reference_dots_agree_with_dequantized_arithmetic() {
    for dtype in DType::ALL {
        let n = 3 * dtype.block_size().max(32) * if dtype.block_size() == 256 { 1 } else { 8 };
        let w = random_row(dtype, n, 7);
        let x = random_f32(n, 8);
        let format = dtype.activation_format();
        let mut a = vec![0u32; format.row_bytes(n).div_ceil(4)];
        let a_bytes = as_bytes_mut(&mut a, format.row_bytes(n));
        quantize_activations_ref(format, &x, a_bytes);
        let mut wf = vec![0f32; n];
        dequantize_row(dtype, &w, &mut wf);
        // The activations as the dot product sees them.
        let xq: Vec<f32> = match format {
            ActFormat::F32 => x.clone(),
            ActFormat::Q8x32 => (0..n)
                .map(|i| {
                    let blk = &a_bytes[i / 32 * 40..];
                    f32::from_le_bytes(blk[0..4].try_into().unwrap())
                        * f32::from(blk[8 + i % 32] as i8)
                })
                .collect(),
            ActFormat::Q8xK => (0..n)
                .map(|i| {
                    let blk = &a_bytes[i / 256 * 292..];
                    f32::from_le_bytes(blk[0..4].try_into().unwrap())
                        * f32::from(blk[4 + i % 256] as i8)
                })
                .collect(),
        };
        let exact: f64 = wf
            .iter()
            .zip(&xq)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum();
        let got = vec_dot_ref(dtype, &w, a_bytes, n);
        assert!(
            (f64::from(got) - exact).abs() <= 1e-4 * exact.abs().max(1.0),
            "{dtype}: {got} vs {exact}"
        );
    }
}

#[test]
fn simd_activation_quantization_is_bit_exact() {
    for n in [32, 96, 224, 576, 1536] {
        let mut x = random_f32(n, n as u64);
        x[3] = 0.0;
        if n > 64 {
            x[40..72].iter_mut().for_each(|v| *v = 0.0); // an all-zero block
        }
        let mut reference = vec![0u8; ActFormat::Q8x32.row_bytes(n)];
        quantize_activations_ref(ActFormat::Q8x32, &x, &mut reference);
        for isa in Isa::available() {
            let mut got = vec![0u8; reference.len()];
            quantize_activations(isa, ActFormat::Q8x32, &x, &mut got);
            assert_eq!(got, reference, "{isa:?} n={n}");
        }
    }
}

#[test]
fn f32_dot_matches_scalar_at_every_length() {
    for n in 0..70 {
        let a = random_f32(n, 1);
        let b = random_f32(n, 2);
        let reference: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        for isa in Isa::available() {
            assert!(
                (dot_f32(isa, &a, &b) - reference).abs() < 1e-4,
                "n={n} {isa:?}"
            );
        }
    }
}

#[test]
fn float_weight_dots_match_scalar_at_every_length() {
    for dtype in [DType::F16, DType::BF16] {
        for n in 0..70 {
            let w = random_row(dtype, n, 3);
            let x = random_f32(n, 4);
            let mut wf = vec![0f32; n];
            dequantize_row(dtype, &w, &mut wf);
            let reference: f32 = wf.iter().zip(&x).map(|(a, b)| a * b).sum();
            let x_bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            let mut a = vec![0u32; n];
            as_bytes_mut(&mut a, 4 * n).copy_from_slice(&x_bytes);
            let a_bytes = as_bytes_mut(&mut a, 4 * n);
            for isa in Isa::available() {
                let got = vec_dot(isa, dtype, &w, a_bytes, n);
                assert!(
                    (got - reference).abs() < 1e-4,
                    "{dtype} n={n} {isa:?}: {got} vs {reference}"
                );
            }
        }
    }
}

fn as_bytes_mut(words: &mut [u32], len: usize) -> &mut [u8] {
    assert!(len <= words.len() * 4);
    // SAFETY: u32 storage viewed as bytes within its length.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr() as *mut u8, len) }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn vectorized_attention_exp_is_accurate() {
    // Through the public attention path: scores spanning a wide range exercise exp_ps.
    use kernels::ops::attend;
    let keys = 37;
    let hd = 16;
    let q: Vec<f32> = random_f32(hd, 1).iter().map(|v| v * 6.0).collect();
    let k: Vec<f32> = random_f32(keys * hd, 2).iter().map(|v| v * 6.0).collect();
    let v = random_f32(keys * hd, 3);
    let mut reference = vec![0f32; hd];
    let mut scores = vec![0f32; keys];
    attend(
        Isa::Scalar,
        &q,
        &k,
        &v,
        keys,
        hd,
        0,
        0.25,
        &mut scores,
        &mut reference,
    );
    for isa in Isa::available() {
        let mut out = vec![0f32; hd];
        attend(isa, &q, &k, &v, keys, hd, 0, 0.25, &mut scores, &mut out);
        for (a, b) in out.iter().zip(&reference) {
            assert!((a - b).abs() < 1e-5, "{isa:?}: {a} vs {b}");
        }
    }
}
