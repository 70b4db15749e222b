//! Rampart's CPU compute kernels: no I/O, no async, no knowledge of models.
//!
//! - [`dtype`]: the GGUF block formats (F32, F16, BF16, Q4_0 … Q8_0, Q2_K … Q8_K) and the
//!   activation formats they multiply with.
//! - [`quant`]: unpacking, dequantization, activation quantization and the scalar reference dot
//!   products.
//! - [`quantize`]: f32 weights into the block formats, bit-compatible with ggml's reference
//!   quantizers (for converting models).
//! - [`dispatch`]: runtime CPU dispatch of the hot kernels: AVX-512 with VNNI on 512-bit
//!   registers, AVX2 with a 256-bit VNNI, AVX2+FMA, scalar (`RAMPART_ISA` lowers the level).
//! - [`gemm`]: dense f32 matrix multiply against weights packed once into column panels
//!   (register-tiled micro-kernels, bias/residual/GELU applied on the way out), for encoders.
//! - [`matmul`]: M activation rows × a quantized weight matrix, reading each weight row once.
//! - [`packed`]: Q4_0/Q4_1/Q8_0 weights interleaved eight rows at a time for the batched kernel
//!   (four quants of eight rows times four activations per instruction).
//! - [`ops`]: RMSNorm, LayerNorm, RoPE (normal/NeoX, linear/llama3 scaling), softmax, SiLU/GELU,
//!   causal grouped-query attention over a contiguous cache.
//! - [`paged`]: grouped-query attention over a paged KV cache (blocks found through per-sequence
//!   block tables) stored as f32, f16 or Q8_0.
//! - [`pool`]: the fixed compute thread pool the parallel loops run on.
//! - [`memory_bandwidth`]: the read bandwidth decode is measured against (a STREAM-like read).
//! - [`backend`]: the compute-backend interface the engine calls, and its CPU implementation.
//! - [`rng`]: the seedable generator sampling and test data use.
//!
//! Every SIMD kernel has a scalar reference and is tested against it on random inputs of awkward
//! sizes; `RAMPART_ISA=scalar` forces the reference kernels at run time.

pub mod backend;
pub mod dispatch;
pub mod dtype;
pub mod gemm;
pub mod matmul;
pub mod memory_bandwidth;
pub mod ops;
pub mod packed;
pub mod paged;
pub mod pool;
pub mod quant;
pub mod quantize;
pub mod rng;
pub mod testing;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use backend::{Backend, CpuBackend};
pub use dispatch::Isa;
pub use dtype::{ActFormat, DType};
pub use matmul::{Matrix, MatrixError, Scratch};
pub use paged::{KvDType, PagedKv, QueryRow, UnknownKvDType};
pub use pool::ThreadPool;
