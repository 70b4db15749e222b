//! Runtime CPU dispatch: the best instruction set this CPU has, detected once.
//!
//! The kernels' safe functions take an [`Isa`] chosen by the caller (a benchmark may ask for
//! the scalar reference). Every dispatch goes through [`Isa::runs`], which also asks the CPU
//! (detected once, then one relaxed load): a caller that passes a level the CPU lacks gets the
//! best level it has, never an illegal instruction, so no safe call can reach undefined
//! behaviour through its `isa` argument.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::dtype::{ActFormat, DType};
use crate::quant;

/// An instruction-set level the kernels are written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Isa {
    /// Portable Rust, the reference for every other level.
    Scalar = 0,
    /// x86_64 with AVX2, FMA and F16C.
    Avx2 = 1,
    /// AVX2 and a 256-bit VNNI (`vpdpbusd`: AVX-VNNI, or AVX512-VNNI with AVX512-VL): the
    /// packed quantized matmul multiplies and accumulates bytes in one instruction.
    Vnni = 2,
    /// AVX-512 F, BW, VL and VNNI on top of the above: the packed quantized matmul runs two
    /// groups of eight weight rows per 512-bit register (`vpdpbusd` on zmm), and the float dot
    /// products 16 lanes at a time.
    Avx512 = 3,
}

/// [`Isa::best_supported`], cached (`u8::MAX`: not read yet).
static SUPPORTED: AtomicU8 = AtomicU8::new(u8::MAX);

impl Isa {
    /// Whether the kernels of `level` run for a caller that asked for `self`: at most what the
    /// caller asked, and at most what this CPU has. Every dispatch to SIMD code asks this.
    #[inline]
    pub fn runs(self, level: Isa) -> bool {
        self >= level && Self::supported() >= level
    }

    /// The best level this CPU has (detected once).
    #[inline]
    fn supported() -> Isa {
        match SUPPORTED.load(Ordering::Relaxed) {
            0 => Isa::Scalar,
            1 => Isa::Avx2,
            2 => Isa::Vnni,
            3 => Isa::Avx512,
            _ => {
                let best = Self::best_supported();
                SUPPORTED.store(best as u8, Ordering::Relaxed);
                best
            }
        }
    }

    /// The best level this CPU supports, or a lower one named by `RAMPART_ISA` (for
    /// comparisons and benchmarks; a level above what the CPU has is ignored):
    /// `scalar` forces the reference kernels, `avx2` the AVX2 ones without VNNI, `vnni` (or
    /// `avx2+vnni`) the 256-bit VNNI ones without AVX-512, `avx512` the widest.
    pub fn detect() -> Isa {
        static DETECTED: OnceLock<Isa> = OnceLock::new();
        *DETECTED.get_or_init(|| {
            let best = Self::best_supported();
            let asked = std::env::var("RAMPART_ISA").ok();
            asked
                .as_deref()
                .and_then(Isa::from_name)
                .map_or(best, |level| best.min(level))
        })
    }

    /// The level called `name` (as [`Isa::name`] writes it, or `vnni` for `avx2+vnni`), any case.
    pub fn from_name(name: &str) -> Option<Isa> {
        match name.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "vnni" | "avx2+vnni" => Some(Isa::Vnni),
            "avx512" | "avx512+vnni" => Some(Isa::Avx512),
            _ => None,
        }
    }

    /// The best level the CPU supports, ignoring overrides.
    pub fn best_supported() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                if crate::x86::vnni_flavour().is_some() {
                    if is_x86_feature_detected!("avx512f")
                        && is_x86_feature_detected!("avx512bw")
                        && is_x86_feature_detected!("avx512vl")
                        && is_x86_feature_detected!("avx512vnni")
                    {
                        return Isa::Avx512;
                    }
                    return Isa::Vnni;
                }
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    }

    /// Every level this CPU can run, for tests that compare them.
    pub fn available() -> Vec<Isa> {
        let best = Self::best_supported();
        [Isa::Scalar, Isa::Avx2, Isa::Vnni, Isa::Avx512]
            .into_iter()
            .filter(|i| *i <= best)
            .collect()
    }

    /// The CPU extensions the kernels of this level use (Rust feature names, as `rampart doctor`
    /// compares them with the CPU's flags).
    pub fn cpu_features(self) -> Vec<&'static str> {
        let mut features = Vec::new();
        if self >= Isa::Avx2 {
            features.extend(["avx2", "fma", "f16c"]);
        }
        #[cfg(target_arch = "x86_64")]
        if self >= Isa::Vnni {
            match crate::x86::vnni_flavour() {
                Some(crate::x86::Vnni::Avx) if self == Isa::Vnni => features.push("avxvnni"),
                Some(_) => features.extend(["avx512vnni", "avx512vl"]),
                None => {}
            }
        }
        if self >= Isa::Avx512 {
            features.extend(["avx512f", "avx512bw"]);
        }
        features
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Vnni => "avx2+vnni",
            Isa::Avx512 => "avx512+vnni",
        }
    }
}

/// `Σ a[i]·b[i]` (RMSNorm's sum of squares). The AVX2 kernel at every SIMD level: with the
/// 16-lane kernel's summation order Gemma 3 270M's perplexity on `tests/data/declaration.txt`
/// moved from 9.17 (llama.cpp: 9.1679) to 9.06, a sensitivity not understood yet.
pub fn dot_f32(isa: Isa, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: Isa::Avx2 is only chosen when the CPU has AVX2 and FMA.
        return unsafe { crate::x86::dot_f32(a, b) };
    }
    let _ = isa;
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `gate[i] = silu(gate[i]) · up[i]` (the SwiGLU of llama-family feed-forward blocks), or with
/// `gelu` GELU's tanh approximation (Gemma's GeGLU). The AVX2 kernel's exponential is within
/// 2e-7 of the scalar one.
pub fn gated_activation(isa: Isa, gelu: bool, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "gate and up have one length");
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: Isa::Avx2 is only chosen when the CPU has AVX2 and FMA.
        unsafe { crate::x86::gated_activation(gelu, gate, up) };
        return;
    }
    let _ = isa;
    if gelu {
        crate::ops::geglu(gate, up);
    } else {
        crate::ops::swiglu(gate, up);
    }
}

/// Quantizes an activation row for dot products with weights of type `dtype`.
pub fn quantize_activations(isa: Isa, format: ActFormat, x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) && format == ActFormat::Q8x32 {
        assert_eq!(out.len(), format.row_bytes(x.len()), "output buffer size");
        // SAFETY: AVX2 and FMA are present (see Isa::detect).
        unsafe { crate::x86::quantize_q8x32(x, out) };
        return;
    }
    let _ = isa;
    quant::quantize_activations_ref(format, x, out);
}

/// Dot product of a weight row (`n` elements of `dtype`) with an activation row quantized by
/// [`quantize_activations`] into `dtype.activation_format()` (f32 bytes for float weights).
pub fn vec_dot(isa: Isa, dtype: DType, w: &[u8], a: &[u8], n: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx512) && matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        use crate::x86::avx512;
        // SAFETY: AVX512-F/BW/VL/VNNI, AVX2, FMA and F16C are present (see Isa::detect); the
        // kernels read within the slices.
        unsafe {
            return match dtype {
                DType::F32 => avx512::dot_f32(as_f32(w, n), as_f32(a, n)),
                DType::F16 => avx512::dot_f16_f32(w, as_f32(a, n)),
                _ => avx512::dot_bf16_f32(w, as_f32(a, n)),
            };
        }
    }
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2) {
        // SAFETY: AVX2, FMA and F16C are present (see Isa::detect); the kernels check lengths.
        unsafe {
            match dtype {
                DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => {
                    return crate::x86::vec_dot_q32(dtype, w, a, n)
                }
                DType::Q2_K | DType::Q3_K => return crate::x86::vec_dot_q23k(dtype, w, a, n),
                DType::Q4_K | DType::Q5_K => return crate::x86::vec_dot_q45k(dtype, w, a, n),
                DType::Q6_K => return crate::x86::vec_dot_q6k(w, a, n),
                DType::F32 => return crate::x86::dot_f32(as_f32(w, n), as_f32(a, n)),
                DType::F16 => return crate::x86::dot_f16_f32(w, as_f32(a, n)),
                DType::BF16 => return crate::x86::dot_bf16_f32(w, as_f32(a, n)),
                _ => {}
            }
        }
    }
    let _ = isa;
    match dtype {
        DType::F32 => as_f32(w, n)
            .iter()
            .zip(as_f32(a, n))
            .map(|(x, y)| x * y)
            .sum(),
        _ => quant::vec_dot_ref(dtype, w, a, n),
    }
}

/// Activation rows that [`vec_dot_rows`] multiplies with one weight row at once.
pub const DOT_ROWS: usize = 4;

/// [`vec_dot`] of one weight row against [`DOT_ROWS`] activation rows: the weight row is read and
/// unpacked once for all of them where a kernel for that exists (prefill, batched decode).
pub fn vec_dot_rows(
    isa: Isa,
    dtype: DType,
    w: &[u8],
    acts: [&[u8]; DOT_ROWS],
    n: usize,
) -> [f32; DOT_ROWS] {
    #[cfg(target_arch = "x86_64")]
    if isa.runs(Isa::Avx2)
        && matches!(
            dtype,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0
        )
    {
        // SAFETY: AVX2, FMA and F16C are present (see Isa::detect); the kernel checks lengths.
        return unsafe { crate::x86::vec_dot_q32_rows(dtype, w, acts, n) };
    }
    acts.map(|a| vec_dot(isa, dtype, w, a, n))
}

/// Asks the CPU to start loading `bytes` into cache (weights the next iterations will read:
/// decode streams every weight once per token, and hiding that latency is most of its speed).
#[inline]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut offset = 0;
        while offset < bytes.len() {
            // SAFETY: prefetching is a hint; the address is inside the slice.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(offset) as *const i8) };
            offset += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Views little-endian f32 bytes as floats.
pub fn as_f32(bytes: &[u8], n: usize) -> &[f32] {
    assert!(bytes.len() >= n * 4, "row too short for {n} floats");
    assert_eq!(
        bytes.as_ptr() as usize % std::mem::align_of::<f32>(),
        0,
        "f32 data must be 4-byte aligned"
    );
    // SAFETY: length and alignment checked above; every bit pattern is a valid f32; x86_64 and
    // aarch64 are little-endian, as the files are.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, n) }
}

/// Views floats as bytes (for f32 activation rows).
pub fn f32_bytes(x: &[f32]) -> &[u8] {
    // SAFETY: any f32 slice is a valid byte slice of 4× its length.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller may name any level: the dispatch runs at most what this CPU has, so the safe
    /// functions never execute an instruction the CPU lacks (on a CPU without AVX2, naming
    /// `Isa::Vnni` once ran AVX2 code).
    #[test]
    fn any_level_a_caller_names_runs_what_this_cpu_has() {
        let a: Vec<f32> = (0..37).map(|i| i as f32 * 0.5 - 3.0).collect();
        let reference = dot_f32(Isa::Scalar, &a, &a);
        let best = Isa::best_supported();
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Vnni, Isa::Avx512] {
            let got = dot_f32(isa, &a, &a);
            assert!((got - reference).abs() <= 1e-3 * reference.abs(), "{isa:?}");
            for level in [Isa::Avx2, Isa::Vnni, Isa::Avx512] {
                assert_eq!(
                    isa.runs(level),
                    isa >= level && best >= level,
                    "{isa:?} {level:?}"
                );
            }
            assert!(isa.runs(Isa::Scalar));
        }
    }

    /// `RAMPART_ISA` takes the names the logs and `rampart doctor` print.
    #[test]
    fn every_level_is_found_by_its_name() {
        for isa in [Isa::Scalar, Isa::Avx2, Isa::Vnni, Isa::Avx512] {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
            assert_eq!(Isa::from_name(&isa.name().to_uppercase()), Some(isa));
        }
        assert_eq!(Isa::from_name("vnni"), Some(Isa::Vnni));
        assert_eq!(Isa::from_name("avx512"), Some(Isa::Avx512));
        assert_eq!(Isa::from_name("sse4"), None);
        assert!(Isa::available().contains(&Isa::best_supported()));
    }
}
