//! GGUF v2/v3: the single-file format of llama.cpp.
//!
//! Layout (little-endian): magic `GGUF`, `u32` version, `u64` tensor count, `u64` metadata count,
//! the metadata key/value pairs, the tensor infos (name, dims, ggml type, offset relative to the
//! data section), padding to `general.alignment` (default 32), then the tensor data.
//!
//! [`Gguf::parse`] reads and validates everything but the tensor data: every count and length is
//! checked against the bytes that remain before anything is allocated, so a hostile header cannot
//! make the reader allocate more than a small multiple of the file's size. [`GgufFile`] maps the
//! file and hands out tensor data zero-copy. [`GgufWriter`] writes files that llama.cpp reads.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::mapped::MappedFile;

/// The four magic bytes at the start of every GGUF file.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and of every tensor when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The largest tensor rank ggml supports.
pub const MAX_DIMS: usize = 4;
/// Arrays of arrays deeper than this are refused (the spec allows nesting; no real file uses it).
pub const MAX_ARRAY_NESTING: usize = 4;

/// Errors from reading a GGUF file. Every malformed input maps to one of these; none panics.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a GGUF file: the first bytes are {found:?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("big-endian GGUF files are not supported")]
    BigEndian,
    #[error("GGUF version {0} is not supported (supported: 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("file is truncated: {what} at byte {offset} needs {needed} bytes, {available} remain")]
    Truncated {
        what: &'static str,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{what} at byte {offset} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str, offset: u64 },
    #[error("unknown metadata value type {type_id} at byte {offset}")]
    UnknownValueType { type_id: u32, offset: u64 },
    #[error("metadata arrays are nested deeper than {MAX_ARRAY_NESTING} levels")]
    NestingTooDeep,
    #[error("metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("tensor {name:?} has unknown ggml type {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    #[error("tensor {name:?}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("general.alignment must be a non-zero power of two, found {0}")]
    BadAlignment(u64),
    #[error("metadata key {key:?} should be {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
}

/// The tensor element types of ggml, with their block layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[allow(non_camel_case_types)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
}

/// (type, ggml id, name, elements per block, bytes per block)
const GGML_TYPES: &[(GgmlType, u32, &str, u64, u64)] = &[
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 36),
    (GgmlType::Q2_K, 10, "Q2_K", 256, 84),
    (GgmlType::Q3_K, 11, "Q3_K", 256, 110),
    (GgmlType::Q4_K, 12, "Q4_K", 256, 144),
    (GgmlType::Q5_K, 13, "Q5_K", 256, 176),
    (GgmlType::Q6_K, 14, "Q6_K", 256, 210),
    (GgmlType::Q8_K, 15, "Q8_K", 256, 292),
    (GgmlType::IQ2_XXS, 16, "IQ2_XXS", 256, 66),
    (GgmlType::IQ2_XS, 17, "IQ2_XS", 256, 74),
    (GgmlType::IQ3_XXS, 18, "IQ3_XXS", 256, 98),
    (GgmlType::IQ1_S, 19, "IQ1_S", 256, 50),
    (GgmlType::IQ4_NL, 20, "IQ4_NL", 32, 18),
    (GgmlType::IQ3_S, 21, "IQ3_S", 256, 110),
    (GgmlType::IQ2_S, 22, "IQ2_S", 256, 82),
    (GgmlType::IQ4_XS, 23, "IQ4_XS", 256, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::IQ1_M, 29, "IQ1_M", 256, 56),
    (GgmlType::BF16, 30, "BF16", 1, 2),
    (GgmlType::TQ1_0, 34, "TQ1_0", 256, 54),
    (GgmlType::TQ2_0, 35, "TQ2_0", 256, 66),
    (GgmlType::MXFP4, 39, "MXFP4", 32, 17),
];

impl GgmlType {
    fn entry(self) -> &'static (GgmlType, u32, &'static str, u64, u64) {
        GGML_TYPES
            .iter()
            .find(|entry| entry.0 == self)
            .expect("every GgmlType variant has a row in GGML_TYPES")
    }

    /// The type for a ggml type id, if it is one we know.
    pub fn from_id(id: u32) -> Option<Self> {
        GGML_TYPES.iter().find(|e| e.1 == id).map(|e| e.0)
    }

    /// The type for its canonical name (`"Q4_K"`, `"F16"`, ...), case-insensitive.
    pub fn from_name(name: &str) -> Option<Self> {
        GGML_TYPES
            .iter()
            .find(|e| e.2.eq_ignore_ascii_case(name))
            .map(|e| e.0)
    }

    /// The ggml type id stored in the file.
    pub fn id(self) -> u32 {
        self.entry().1
    }

    /// The canonical name, as llama.cpp prints it.
    pub fn name(self) -> &'static str {
        self.entry().2
    }

    /// Elements per quantization block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.entry().3
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> u64 {
        self.entry().4
    }

    /// Bytes needed for `n_elements` elements, or `None` when `n_elements` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        if !n_elements.is_multiple_of(self.block_size()) {
            return None;
        }
        (n_elements / self.block_size()).checked_mul(self.block_bytes())
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

/// A typed metadata array.
#[derive(Debug, Clone, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
}

// Value type ids of the GGUF spec.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// The smallest encoding of one element of each type, used to bound counts before allocating.
fn min_encoded_size(type_id: u32) -> Option<u64> {
    Some(match type_id {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STRING => 8,
        T_ARRAY => 12,
        _ => return None,
    })
}

impl Value {
    /// The spec's name of this value's type.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F32(_) => "f32",
            Value::F64(_) => "f64",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }

    fn type_id(&self) -> u32 {
        match self {
            Value::U8(_) => T_U8,
            Value::I8(_) => T_I8,
            Value::U16(_) => T_U16,
            Value::I16(_) => T_I16,
            Value::U32(_) => T_U32,
            Value::I32(_) => T_I32,
            Value::U64(_) => T_U64,
            Value::I64(_) => T_I64,
            Value::F32(_) => T_F32,
            Value::F64(_) => T_F64,
            Value::Bool(_) => T_BOOL,
            Value::String(_) => T_STRING,
            Value::Array(_) => T_ARRAY,
        }
    }

    /// Any non-negative integer value, whatever its width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Any integer value that fits an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            Value::I8(v) => Some(v.into()),
            Value::I16(v) => Some(v.into()),
            Value::I32(v) => Some(v.into()),
            Value::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// Any numeric value as `f64`. An `f32` converts through its shortest decimal form, so a
    /// stored `1e-5f32` reads as `1e-5`, not `9.999999747378752e-6`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => v.to_string().parse().ok(),
            Value::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $variant:ident),* $(,)?) => {
        $(impl From<$t> for Value {
            fn from(v: $t) -> Self {
                Value::$variant(v.into())
            }
        })*
    };
}
value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64,
    i64 => I64, f32 => F32, f64 => F64, bool => Bool, String => String, &str => String,
    Array => Array);

impl Array {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The spec's name of the element type.
    pub fn element_type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "u8",
            Array::I8(_) => "i8",
            Array::U16(_) => "u16",
            Array::I16(_) => "i16",
            Array::U32(_) => "u32",
            Array::I32(_) => "i32",
            Array::U64(_) => "u64",
            Array::I64(_) => "i64",
            Array::F32(_) => "f32",
            Array::F64(_) => "f64",
            Array::Bool(_) => "bool",
            Array::String(_) => "string",
            Array::Array(_) => "array",
        }
    }

    fn element_type_id(&self) -> u32 {
        match self {
            Array::U8(_) => T_U8,
            Array::I8(_) => T_I8,
            Array::U16(_) => T_U16,
            Array::I16(_) => T_I16,
            Array::U32(_) => T_U32,
            Array::I32(_) => T_I32,
            Array::U64(_) => T_U64,
            Array::I64(_) => T_I64,
            Array::F32(_) => T_F32,
            Array::F64(_) => T_F64,
            Array::Bool(_) => T_BOOL,
            Array::String(_) => T_STRING,
            Array::Array(_) => T_ARRAY,
        }
    }

    pub fn as_strings(&self) -> Option<&[String]> {
        match self {
            Array::String(v) => Some(v),
            _ => None,
        }
    }

    /// Integer elements widened to `i64` (token types, ids), whatever their stored width.
    pub fn to_i64s(&self) -> Option<Vec<i64>> {
        Some(match self {
            Array::U8(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I8(v) => v.iter().map(|&x| x.into()).collect(),
            Array::U16(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I16(v) => v.iter().map(|&x| x.into()).collect(),
            Array::U32(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I32(v) => v.iter().map(|&x| x.into()).collect(),
            Array::I64(v) => v.clone(),
            Array::U64(v) => v
                .iter()
                .map(|&x| i64::try_from(x).ok())
                .collect::<Option<_>>()?,
            _ => return None,
        })
    }

    /// Float elements widened to `f32` (token scores).
    pub fn to_f32s(&self) -> Option<Vec<f32>> {
        match self {
            Array::F32(v) => Some(v.clone()),
            Array::F64(v) => Some(v.iter().map(|&x| x as f32).collect()),
            _ => None,
        }
    }
}

/// One tensor's description. `dims` are in ggml order: `dims[0]` is the contiguous (fastest)
/// dimension, i.e. a `[rows, cols]` matrix of PyTorch is stored as `dims = [cols, rows]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    pub n_elements: u64,
    pub size_bytes: u64,
}

/// A parsed GGUF header: metadata and tensor infos, validated against the file length.
#[derive(Debug, Clone)]
pub struct Gguf {
    pub version: u32,
    metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    pub tensors: Vec<TensorInfo>,
    /// Alignment of the data section and tensors, from `general.alignment`.
    pub alignment: u64,
    /// Absolute offset of the data section in the file.
    pub data_offset: u64,
    /// Length of the bytes the header was validated against.
    pub file_len: u64,
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what,
                offset: self.pos as u64,
                needed: n,
                available: self.remaining(),
            });
        }
        let n = n as usize; // n <= remaining, which is a usize
        let slice = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Checks that `count` elements of at least `min_size` bytes each can still be present.
    fn check_count(&self, count: u64, min_size: u64, what: &'static str) -> Result<(), GgufError> {
        let needed = count.saturating_mul(min_size);
        if needed > self.remaining() {
            return Err(GgufError::Truncated {
                what,
                offset: self.pos as u64,
                needed,
                available: self.remaining(),
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let start = self.pos as u64;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| GgufError::InvalidUtf8 {
            what,
            offset: start,
        })
    }

    fn value(&mut self, type_id: u32, depth: usize) -> Result<Value, GgufError> {
        let at = self.pos as u64;
        Ok(match type_id {
            T_U8 => Value::U8(self.array::<1>("u8 value")?[0]),
            T_I8 => Value::I8(i8::from_le_bytes(self.array("i8 value")?)),
            T_U16 => Value::U16(u16::from_le_bytes(self.array("u16 value")?)),
            T_I16 => Value::I16(i16::from_le_bytes(self.array("i16 value")?)),
            T_U32 => Value::U32(self.u32("u32 value")?),
            T_I32 => Value::I32(i32::from_le_bytes(self.array("i32 value")?)),
            T_U64 => Value::U64(self.u64("u64 value")?),
            T_I64 => Value::I64(i64::from_le_bytes(self.array("i64 value")?)),
            T_F32 => Value::F32(f32::from_le_bytes(self.array("f32 value")?)),
            T_F64 => Value::F64(f64::from_le_bytes(self.array("f64 value")?)),
            T_BOOL => Value::Bool(self.array::<1>("bool value")?[0] != 0),
            T_STRING => Value::String(self.string("string value")?),
            T_ARRAY => Value::Array(self.array_value(depth + 1)?),
            other => {
                return Err(GgufError::UnknownValueType {
                    type_id: other,
                    offset: at,
                })
            }
        })
    }

    fn array_value(&mut self, depth: usize) -> Result<Array, GgufError> {
        if depth > MAX_ARRAY_NESTING {
            return Err(GgufError::NestingTooDeep);
        }
        let type_at = self.pos as u64;
        let element_type = self.u32("array element type")?;
        let count = self.u64("array length")?;
        let min = min_encoded_size(element_type).ok_or(GgufError::UnknownValueType {
            type_id: element_type,
            offset: type_at,
        })?;
        self.check_count(count, min, "array elements")?;
        // `count * min <= remaining`, so this capacity is bounded by the file's size.
        let n = count as usize;
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let raw = self.take(count * min, "array elements")?;
                Array::$variant(
                    raw.chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| {
                            <$t>::from_le_bytes(c.try_into().expect("chunk has the element size"))
                        })
                        .collect(),
                )
            }};
        }
        Ok(match element_type {
            T_U8 => Array::U8(self.take(count, "array elements")?.to_vec()),
            T_I8 => fixed!(I8, i8),
            T_U16 => fixed!(U16, u16),
            T_I16 => fixed!(I16, i16),
            T_U32 => fixed!(U32, u32),
            T_I32 => fixed!(I32, i32),
            T_U64 => fixed!(U64, u64),
            T_I64 => fixed!(I64, i64),
            T_F32 => fixed!(F32, f32),
            T_F64 => fixed!(F64, f64),
            T_BOOL => Array::Bool(
                self.take(count, "array elements")?
                    .iter()
                    .map(|&b| b != 0)
                    .collect(),
            ),
            T_STRING => {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(self.string("array string")?);
                }
                Array::String(out)
            }
            T_ARRAY => {
                let mut out = Vec::with_capacity(n);
                for _ in 0..n {
                    out.push(self.array_value(depth + 1)?);
                }
                Array::Array(out)
            }
            _ => unreachable!("min_encoded_size accepted only known types"),
        })
    }
}

fn align_up(offset: u64, alignment: u64) -> Option<u64> {
    offset
        .checked_add(alignment - 1)
        .map(|v| v / alignment * alignment)
}

impl Gguf {
    /// Parses and validates a GGUF header from the whole file's bytes. Tensor data ranges are
    /// checked against `bytes.len()`.
    pub fn parse(bytes: &[u8]) -> Result<Self, GgufError> {
        let mut cur = Cursor { bytes, pos: 0 };
        let magic: [u8; 4] = cur.array("magic")?;
        if magic != MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = cur.u32("version")?;
        if version.swap_bytes() <= 3 && version > 3 {
            return Err(GgufError::BigEndian);
        }
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let tensor_count = cur.u64("tensor count")?;
        let metadata_count = cur.u64("metadata count")?;
        // A metadata entry is at least a key length, a type and a 1-byte value; a tensor info at
        // least a name length, a rank, a type and an offset.
        cur.check_count(metadata_count, 13, "metadata entries")?;

        let mut metadata = Vec::with_capacity(metadata_count as usize);
        let mut index = HashMap::with_capacity(metadata_count as usize);
        for _ in 0..metadata_count {
            let key = cur.string("metadata key")?;
            let type_id = cur.u32("metadata value type")?;
            let value = cur.value(type_id, 0)?;
            if index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
            metadata.push((key, value));
        }

        let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some((_, v)) => {
                let a = v.as_u64().ok_or(GgufError::WrongType {
                    key: "general.alignment".into(),
                    expected: "an unsigned integer",
                    found: v.type_name(),
                })?;
                if a == 0 || !a.is_power_of_two() {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
        };

        cur.check_count(tensor_count, 24, "tensor infos")?;
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        let mut names = HashMap::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = cur.string("tensor name")?;
            let n_dims = cur.u32("tensor rank")?;
            if n_dims as usize > MAX_DIMS {
                return Err(GgufError::BadTensor {
                    name,
                    reason: format!("rank {n_dims} exceeds the maximum of {MAX_DIMS}"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(cur.u64("tensor dimension")?);
            }
            let type_id = cur.u32("tensor type")?;
            let offset = cur.u64("tensor offset")?;
            let ggml_type =
                GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
                    name: name.clone(),
                    type_id,
                })?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| GgufError::BadTensor {
                    name: name.clone(),
                    reason: format!("element count of dims {dims:?} overflows"),
                })?;
            if dims
                .first()
                .is_some_and(|&d| d % ggml_type.block_size() != 0)
            {
                return Err(GgufError::BadTensor {
                    name,
                    reason: format!(
                        "first dimension {} is not a multiple of the {} block size {}",
                        dims[0],
                        ggml_type,
                        ggml_type.block_size()
                    ),
                });
            }
            let size_bytes =
                ggml_type
                    .bytes_for(n_elements)
                    .ok_or_else(|| GgufError::BadTensor {
                        name: name.clone(),
                        reason: format!(
                            "size of {n_elements} {ggml_type} elements is not representable"
                        ),
                    })?;
            if offset % alignment != 0 {
                return Err(GgufError::BadTensor {
                    name,
                    reason: format!("offset {offset} is not aligned to {alignment}"),
                });
            }
            if names.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(name));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ggml_type,
                offset,
                n_elements,
                size_bytes,
            });
        }

        let file_len = bytes.len() as u64;
        let data_offset =
            align_up(cur.pos as u64, alignment).ok_or(GgufError::BadAlignment(alignment))?;
        for t in &tensors {
            let end = data_offset
                .checked_add(t.offset)
                .and_then(|start| start.checked_add(t.size_bytes));
            match end {
                Some(end) if end <= file_len => {}
                _ => {
                    return Err(GgufError::Truncated {
                        what: "tensor data",
                        offset: data_offset.saturating_add(t.offset),
                        needed: t.size_bytes,
                        available: file_len.saturating_sub(data_offset.saturating_add(t.offset)),
                    })
                }
            }
        }
        Ok(Self {
            version,
            metadata,
            index,
            tensors,
            alignment,
            data_offset,
            file_len,
        })
    }

    /// All metadata entries in file order.
    pub fn metadata(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.metadata.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A string value; `Ok(None)` when absent, an error when present with another type.
    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.typed(key, "a string", Value::as_str)
    }

    /// A non-negative integer of any width.
    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.typed(key, "an unsigned integer", Value::as_u64)
    }

    /// Any numeric value as `f64`.
    pub fn get_f64(&self, key: &str) -> Result<Option<f64>, GgufError> {
        self.typed(key, "a number", Value::as_f64)
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.typed(key, "a bool", Value::as_bool)
    }

    pub fn get_array(&self, key: &str) -> Result<Option<&Array>, GgufError> {
        self.typed(key, "an array", Value::as_array)
    }

    fn typed<'s, T>(
        &'s self,
        key: &str,
        expected: &'static str,
        convert: impl Fn(&'s Value) -> Option<T>,
    ) -> Result<Option<T>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => convert(v).map(Some).ok_or(GgufError::WrongType {
                key: key.to_string(),
                expected,
                found: v.type_name(),
            }),
        }
    }

    /// `general.architecture`, e.g. `"llama"`.
    pub fn architecture(&self) -> Result<Option<&str>, GgufError> {
        self.get_str("general.architecture")
    }

    /// An architecture-scoped integer such as `{arch}.context_length`.
    pub fn arch_u64(&self, suffix: &str) -> Result<Option<u64>, GgufError> {
        match self.architecture()? {
            Some(arch) => self.get_u64(&format!("{arch}.{suffix}")),
            None => Ok(None),
        }
    }

    /// An architecture-scoped number such as `{arch}.rope.freq_base`.
    pub fn arch_f64(&self, suffix: &str) -> Result<Option<f64>, GgufError> {
        match self.architecture()? {
            Some(arch) => self.get_f64(&format!("{arch}.{suffix}")),
            None => Ok(None),
        }
    }

    /// The tensor with this name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Total number of weights over all tensors.
    pub fn parameter_count(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_elements).sum()
    }

    /// The byte range of a tensor's data in the file.
    pub fn tensor_range(&self, tensor: &TensorInfo) -> std::ops::Range<usize> {
        // Validated in `parse`: data_offset + offset + size <= file_len, which fits in usize.
        let start = (self.data_offset + tensor.offset) as usize;
        start..start + tensor.size_bytes as usize
    }
}

/// A memory-mapped GGUF file: the parsed header plus zero-copy access to tensor data.
#[derive(Debug)]
pub struct GgufFile {
    map: MappedFile,
    header: Gguf,
}

impl GgufFile {
    /// Maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let map = MappedFile::open(path).map_err(|source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let header = Gguf::parse(map.bytes())?;
        Ok(Self { map, header })
    }

    pub fn header(&self) -> &Gguf {
        &self.header
    }

    pub fn path(&self) -> &Path {
        self.map.path()
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        self.map.bytes()
    }

    /// The raw bytes of a tensor, in its ggml block layout.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        &self.map.bytes()[self.header.tensor_range(tensor)]
    }
}

impl std::ops::Deref for GgufFile {
    type Target = Gguf;
    fn deref(&self) -> &Gguf {
        &self.header
    }
}

/// Builds a GGUF v3 file: metadata in insertion order, tensors laid out in insertion order, each
/// aligned to `general.alignment` (default 32).
#[derive(Debug, Default)]
pub struct GgufWriter<'a> {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor<'a>>,
}

#[derive(Debug)]
struct PendingTensor<'a> {
    name: String,
    dims: Vec<u64>,
    ggml_type: GgmlType,
    data: Cow<'a, [u8]>,
}

/// Errors from building a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufWriteError {
    #[error("tensor {name:?}: data is {actual} bytes, {ggml_type} with dims {dims:?} needs {expected:?}")]
    DataSize {
        name: String,
        dims: Vec<u64>,
        ggml_type: GgmlType,
        expected: Option<u64>,
        actual: usize,
    },
    #[error("tensor {0:?} was added twice")]
    DuplicateTensor(String),
    #[error("metadata key {0:?} was added twice")]
    DuplicateKey(String),
    #[error("general.alignment must be a non-zero power of two")]
    BadAlignment,
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

impl<'a> GgufWriter<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry.
    pub fn metadata(
        &mut self,
        key: &str,
        value: impl Into<Value>,
    ) -> Result<&mut Self, GgufWriteError> {
        if self.metadata.iter().any(|(k, _)| k == key) {
            return Err(GgufWriteError::DuplicateKey(key.to_string()));
        }
        self.metadata.push((key.to_string(), value.into()));
        Ok(self)
    }

    /// Adds a tensor; `dims` in ggml order (contiguous dimension first). The data must be exactly
    /// the size the type and dims imply.
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ggml_type: GgmlType,
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<&mut Self, GgufWriteError> {
        let data = data.into();
        let n: Option<u64> = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
        let expected = n.and_then(|n| ggml_type.bytes_for(n));
        if expected != Some(data.len() as u64) || dims.len() > MAX_DIMS {
            return Err(GgufWriteError::DataSize {
                name: name.to_string(),
                dims: dims.to_vec(),
                ggml_type,
                expected,
                actual: data.len(),
            });
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufWriteError::DuplicateTensor(name.to_string()));
        }
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ggml_type,
            data,
        });
        Ok(self)
    }

    fn alignment(&self) -> Result<u64, GgufWriteError> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, v)) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() => Ok(a),
                _ => Err(GgufWriteError::BadAlignment),
            },
        }
    }

    /// Writes the file.
    pub fn write_to(&self, mut out: impl Write) -> Result<(), GgufWriteError> {
        let alignment = self.alignment()?;
        let mut header = Vec::new();
        header.extend_from_slice(&MAGIC);
        header.extend_from_slice(&3u32.to_le_bytes());
        header.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        header.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            write_string(&mut header, key);
            header.extend_from_slice(&value.type_id().to_le_bytes());
            write_value(&mut header, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for PendingTensor {
            name,
            dims,
            ggml_type,
            data,
        } in &self.tensors
        {
            write_string(&mut header, name);
            header.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&ggml_type.id().to_le_bytes());
            header.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = align_up(offset + data.len() as u64, alignment)
                .ok_or(GgufWriteError::BadAlignment)?;
        }
        let data_start =
            align_up(header.len() as u64, alignment).ok_or(GgufWriteError::BadAlignment)?;
        header.resize(data_start as usize, 0);
        out.write_all(&header)?;
        let mut written = 0u64;
        let zeros = vec![0u8; alignment as usize];
        for (tensor, &tensor_offset) in self.tensors.iter().zip(&offsets) {
            let pad = tensor_offset - written;
            out.write_all(&zeros[..pad as usize])?;
            out.write_all(&tensor.data)?;
            written = tensor_offset + tensor.data.len() as u64;
        }
        out.flush()?;
        Ok(())
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufWriteError> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }
}

fn write_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => write_string(out, s),
        Value::Array(a) => write_array(out, a),
    }
}

fn write_array(out: &mut Vec<u8>, array: &Array) {
    out.extend_from_slice(&array.element_type_id().to_le_bytes());
    out.extend_from_slice(&(array.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match array {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => {
            for s in v {
                write_string(out, s);
            }
        }
        Array::Array(v) => {
            for a in v {
                write_array(out, a);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = GgufWriter::new();
        w.metadata("general.architecture", "llama").unwrap();
        w.metadata("llama.context_length", 128u32).unwrap();
        w.metadata("llama.rope.freq_base", 10000.0f32).unwrap();
        w.metadata(
            "tokenizer.ggml.tokens",
            Array::String(vec!["a".into(), "b".into()]),
        )
        .unwrap();
        w.metadata("tokenizer.ggml.token_type", Array::I32(vec![1, 3]))
            .unwrap();
        w.metadata(
            "nested",
            Array::Array(vec![Array::U8(vec![1, 2]), Array::Bool(vec![true])]),
        )
        .unwrap();
        w.tensor("a", &[64, 2], GgmlType::Q8_0, vec![7u8; 2 * 2 * 34])
            .unwrap();
        w.tensor("b", &[3], GgmlType::F32, vec![1u8; 12]).unwrap();
        w.to_bytes().unwrap()
    }

    #[test]
    fn round_trip_through_writer() {
        let bytes = sample();
        let g = Gguf::parse(&bytes).unwrap();
        assert_eq!(g.version, 3);
        assert_eq!(g.architecture().unwrap(), Some("llama"));
        assert_eq!(g.arch_u64("context_length").unwrap(), Some(128));
        assert_eq!(g.arch_f64("rope.freq_base").unwrap(), Some(10000.0));
        let tokens = g.get_array("tokenizer.ggml.tokens").unwrap().unwrap();
        assert_eq!(tokens.as_strings().unwrap(), ["a", "b"]);
        assert_eq!(
            g.get_array("tokenizer.ggml.token_type")
                .unwrap()
                .unwrap()
                .to_i64s()
                .unwrap(),
            [1, 3]
        );
        assert_eq!(g.tensors.len(), 2);
        let a = g.tensor("a").unwrap();
        assert_eq!((a.n_elements, a.size_bytes, a.offset), (128, 136, 0));
        let b = g.tensor("b").unwrap();
        assert_eq!(
            b.offset, 160,
            "second tensor starts at the next 32-byte boundary"
        );
        assert_eq!(g.data_offset % 32, 0);
        assert_eq!(&bytes[g.tensor_range(b)], &[1u8; 12]);
        assert_eq!(g.parameter_count(), 131);
    }

    #[test]
    fn wrong_types_are_reported() {
        let g = Gguf::parse(&sample()).unwrap();
        let err = g.get_u64("general.architecture").unwrap_err();
        assert!(
            err.to_string()
                .contains("should be an unsigned integer, found string"),
            "{err}"
        );
        assert_eq!(g.get_str("missing").unwrap(), None);
    }

    #[test]
    fn writer_checks_data_size() {
        let mut w = GgufWriter::new();
        let err = w
            .tensor("x", &[33], GgmlType::Q4_0, vec![0u8; 18])
            .unwrap_err();
        assert!(matches!(
            err,
            GgufWriteError::DataSize { expected: None, .. }
        ));
        let err = w
            .tensor("x", &[32], GgmlType::Q4_0, vec![0u8; 17])
            .unwrap_err();
        assert!(matches!(
            err,
            GgufWriteError::DataSize {
                expected: Some(18),
                ..
            }
        ));
    }

    #[test]
    fn type_table_is_consistent() {
        for &(t, id, name, block, bytes) in GGML_TYPES {
            assert_eq!(GgmlType::from_id(id), Some(t));
            assert_eq!(GgmlType::from_name(name), Some(t));
            assert_eq!((t.block_size(), t.block_bytes()), (block, bytes));
        }
        assert_eq!(GgmlType::Q4_K.bytes_for(512), Some(288));
        assert_eq!(
            GgmlType::from_id(4),
            None,
            "id 4 (Q4_2) was removed from ggml"
        );
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample();
        for len in 0..bytes.len() {
            assert!(
                Gguf::parse(&bytes[..len]).is_err(),
                "prefix of {len} bytes parsed"
            );
        }
    }

    #[test]
    fn custom_alignment_is_honoured() {
        let mut w = GgufWriter::new();
        w.metadata("general.alignment", 64u32).unwrap();
        w.tensor("a", &[5], GgmlType::F32, vec![0u8; 20]).unwrap();
        w.tensor("b", &[5], GgmlType::F32, vec![0u8; 20]).unwrap();
        let g = Gguf::parse(&w.to_bytes().unwrap()).unwrap();
        assert_eq!(g.alignment, 64);
        assert_eq!(g.data_offset % 64, 0);
        assert_eq!(g.tensor("b").unwrap().offset, 64);
    }
}
