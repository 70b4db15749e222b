//! Weight element types and their block layouts (the GGUF/ggml formats).

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Elements per block of the 32-element formats (Q4_0 … Q8_0).
pub const QK: usize = 32;

/// A weight element type. The block layouts are those of GGUF files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum DType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
}

impl DType {
    pub const ALL: [DType; 14] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::Q8_K,
    ];

    /// Elements per block.
    pub fn block_size(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => QK,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::Q8_K => {
                QK_K
            }
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::Q8_K => 292,
        }
    }

    /// Bytes of a row of `n` elements; `None` when `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        n.is_multiple_of(self.block_size())
            .then(|| n / self.block_size() * self.block_bytes())
    }

    /// The activation format this weight type is multiplied with.
    pub fn activation_format(self) -> ActFormat {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => ActFormat::F32,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => ActFormat::Q8x32,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::Q8_K => {
                ActFormat::Q8xK
            }
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q8_0 => "Q8_0",
            DType::Q2_K => "Q2_K",
            DType::Q3_K => "Q3_K",
            DType::Q4_K => "Q4_K",
            DType::Q5_K => "Q5_K",
            DType::Q6_K => "Q6_K",
            DType::Q8_K => "Q8_K",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(name))
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// How activations are stored for a dot product with a weight row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActFormat {
    /// Plain f32.
    F32,
    /// Blocks of 32: `d: f32, s: f32 (= d·Σq), qs: [i8; 32]` (40 bytes). Our own layout: the
    /// precomputed `s` serves the offset of Q4_0/Q5_0 and the minimum of Q4_1/Q5_1 alike.
    Q8x32,
    /// Blocks of 256: `d: f32, qs: [i8; 256], bsums: [i16; 16]` (292 bytes, ggml's Q8_K).
    Q8xK,
}

/// Bytes of one activation block of 32.
pub const Q8X32_BLOCK_BYTES: usize = 40;
/// Bytes of one activation block of 256.
pub const Q8XK_BLOCK_BYTES: usize = 292;

impl ActFormat {
    /// Bytes of a quantized activation row of `n` elements (`n` a multiple of the block size).
    pub fn row_bytes(self, n: usize) -> usize {
        match self {
            ActFormat::F32 => n * 4,
            ActFormat::Q8x32 => n / QK * Q8X32_BLOCK_BYTES,
            ActFormat::Q8xK => n / QK_K * Q8XK_BLOCK_BYTES,
        }
    }

    pub fn block_size(self) -> usize {
        match self {
            ActFormat::F32 => 1,
            ActFormat::Q8x32 => QK,
            ActFormat::Q8xK => QK_K,
        }
    }
}
