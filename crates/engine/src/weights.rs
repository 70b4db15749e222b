//! The weights of a model as the forward pass reads them: tensors found by their GGUF names in
//! one or more memory-mapped files (a GGUF file, or the safetensors shards of a Hugging Face
//! checkpoint), checked against the shapes the network expects.
//!
//! Matrices stay in the maps (zero-copy) in every type the kernels multiply (F32, F16, BF16 and
//! the GGUF block formats); the one copy made is of f32 data the file does not align to 4 bytes,
//! which the f32 kernels need. Small 1-D tensors (norms, biases) are converted to f32 at load.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use formats::gguf::{GgmlType, GgufFile};
use formats::safetensors::SafetensorsFile;
use kernels::quant::dequantize_row;
use kernels::{DType, Matrix};

use crate::error::EngineError;

/// The kernels' type for a GGUF tensor type.
pub fn dtype_of(t: GgmlType) -> Option<DType> {
    Some(match t {
        GgmlType::F32 => DType::F32,
        GgmlType::F16 => DType::F16,
        GgmlType::BF16 => DType::BF16,
        GgmlType::Q4_0 => DType::Q4_0,
        GgmlType::Q4_1 => DType::Q4_1,
        GgmlType::Q5_0 => DType::Q5_0,
        GgmlType::Q5_1 => DType::Q5_1,
        GgmlType::Q8_0 => DType::Q8_0,
        GgmlType::Q2_K => DType::Q2_K,
        GgmlType::Q3_K => DType::Q3_K,
        GgmlType::Q4_K => DType::Q4_K,
        GgmlType::Q5_K => DType::Q5_K,
        GgmlType::Q6_K => DType::Q6_K,
        GgmlType::Q8_K => DType::Q8_K,
        _ => return None,
    })
}

/// The kernels' type for a safetensors dtype name (the float types the kernels multiply).
pub fn dtype_of_safetensors(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        _ => return None,
    })
}

pub(crate) fn tensor_error(name: &str, reason: impl Into<String>) -> EngineError {
    EngineError::Tensor {
        name: name.to_string(),
        reason: reason.into(),
    }
}

/// A file the weights are mapped from.
pub(crate) enum WeightFile {
    Gguf(GgufFile),
    Safetensors(SafetensorsFile),
}

impl WeightFile {
    fn bytes(&self) -> &[u8] {
        match self {
            WeightFile::Gguf(f) => f.bytes(),
            WeightFile::Safetensors(f) => f.bytes(),
        }
    }
}

/// How the files name and shape their tensors (for error messages in the file's own terms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Naming {
    /// GGUF names; dims listed contiguous-first (`[cols, rows]`).
    Gguf,
    /// Hugging Face names; shapes listed row-major (`[rows, cols]`).
    HuggingFace,
}

/// A tensor in one of the files.
#[derive(Debug, Clone)]
pub(crate) struct StoredTensor {
    /// The name in the file.
    pub file_name: String,
    /// The element type as the file names it.
    pub type_name: String,
    /// The kernels' type, when they support it.
    pub dtype: Option<DType>,
    /// Row-major shape, outermost dimension first.
    pub shape: Vec<usize>,
    pub file: usize,
    pub range: Range<usize>,
}

impl StoredTensor {
    fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where a matrix's bytes are.
#[derive(Debug, Clone)]
enum TensorBytes {
    /// In the memory map of weight file `file`.
    Mapped { file: usize, range: Range<usize> },
    /// A copy made at load (f32 data the file does not align to 4 bytes).
    Owned(Arc<Vec<f32>>),
}

/// A weight matrix the forward pass multiplies with.
#[derive(Debug, Clone)]
pub(crate) struct TensorRef {
    dtype: DType,
    bytes: TensorBytes,
    rows: usize,
    cols: usize,
    /// The weights interleaved for the batched kernel, when the type has one.
    packed: Option<Arc<Vec<u8>>>,
}

/// The tensors of a model's weight files, by GGUF name.
pub(crate) struct Weights {
    files: Vec<WeightFile>,
    tensors: HashMap<String, StoredTensor>,
    naming: Naming,
}

impl Weights {
    /// Every tensor of a GGUF file.
    pub fn from_gguf(file: GgufFile) -> Self {
        let tensors = file
            .tensors
            .iter()
            .map(|t| {
                let stored = StoredTensor {
                    file_name: t.name.clone(),
                    type_name: t.ggml_type.to_string(),
                    dtype: dtype_of(t.ggml_type),
                    shape: t.dims.iter().rev().map(|&d| d as usize).collect(),
                    file: 0,
                    range: file.tensor_range(t),
                };
                (t.name.clone(), stored)
            })
            .collect();
        Self {
            files: vec![WeightFile::Gguf(file)],
            tensors,
            naming: Naming::Gguf,
        }
    }

    /// Tensors of safetensors files, already named by GGUF name (`file` indexes `files`).
    pub fn from_safetensors(
        files: Vec<SafetensorsFile>,
        tensors: HashMap<String, StoredTensor>,
    ) -> Self {
        Self {
            files: files.into_iter().map(WeightFile::Safetensors).collect(),
            tensors,
            naming: Naming::HuggingFace,
        }
    }

    /// The GGUF file, when the weights come from one.
    pub fn gguf(&self) -> Option<&GgufFile> {
        match self.files.first() {
            Some(WeightFile::Gguf(f)) => Some(f),
            _ => None,
        }
    }

    pub fn get(&self, name: &str) -> Option<&StoredTensor> {
        self.tensors.get(name)
    }

    /// Every tensor by GGUF name, sorted by name.
    pub fn all(&self) -> Vec<(&str, &StoredTensor)> {
        let mut all: Vec<_> = self.tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
        all.sort_by(|a, b| a.0.cmp(b.0));
        all
    }

    /// A tensor's bytes as stored.
    pub fn raw(&self, t: &StoredTensor) -> &[u8] {
        &self.files[t.file].bytes()[t.range.clone()]
    }

    /// The name a tensor has in the files, for errors about a missing one.
    fn external_name(&self, name: &str) -> String {
        match self.naming {
            Naming::Gguf => name.to_string(),
            Naming::HuggingFace => {
                formats::hf::hf_tensor_name(name).unwrap_or_else(|| name.to_string())
            }
        }
    }

    fn require(&self, name: &str) -> Result<&StoredTensor, EngineError> {
        self.get(name)
            .ok_or_else(|| tensor_error(&self.external_name(name), "missing"))
    }

    /// A shape as the file lists it: GGUF dims contiguous-first, Hugging Face shapes row-major.
    fn file_order(&self, shape: &[usize]) -> Vec<usize> {
        match self.naming {
            Naming::Gguf => shape.iter().rev().copied().collect(),
            Naming::HuggingFace => shape.to_vec(),
        }
    }

    fn supported(&self, t: &StoredTensor) -> Result<DType, EngineError> {
        t.dtype.ok_or_else(|| {
            let supported = match self.naming {
                Naming::Gguf => "",
                Naming::HuggingFace => " (supported: F32, F16, BF16)",
            };
            tensor_error(
                &t.file_name,
                format!("type {} is not supported{supported}", t.type_name),
            )
        })
    }

    /// The `rows × cols` matrix `name`.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<TensorRef, EngineError> {
        let t = self.require(name)?;
        let dtype = self.supported(t)?;
        if t.shape != [rows, cols] {
            return Err(tensor_error(
                &t.file_name,
                format!(
                    "{} {:?}, expected {:?}",
                    match self.naming {
                        Naming::Gguf => "dims",
                        Naming::HuggingFace => "shape",
                    },
                    self.file_order(&t.shape),
                    self.file_order(&[rows, cols])
                ),
            ));
        }
        if dtype.row_bytes(cols).is_none() {
            return Err(tensor_error(
                &t.file_name,
                format!("{cols} columns is not a whole number of {dtype} blocks"),
            ));
        }
        let data = &self.files[t.file].bytes()[t.range.clone()];
        if dtype == DType::F32
            && !(data.as_ptr() as usize).is_multiple_of(std::mem::align_of::<f32>())
        {
            let mut values = vec![0f32; rows * cols];
            dequantize_row(dtype, data, &mut values);
            return Ok(TensorRef {
                dtype,
                bytes: TensorBytes::Owned(Arc::new(values)),
                rows,
                cols,
                packed: None,
            });
        }
        // Every multiplication with a packable matrix runs on its packed copy (one kernel for one
        // row and for many, so a sequence's results do not depend on its batch).
        // `RAMPART_PACKED_WEIGHTS=0` keeps the row-by-row kernels (half the weight memory when the
        // mapped file's pages are the only copy; for comparisons).
        let packed = std::env::var("RAMPART_PACKED_WEIGHTS")
            .map_or(true, |v| v != "0")
            .then(|| kernels::packed::pack(dtype, data, rows, cols))
            .flatten()
            .map(Arc::new);
        Ok(TensorRef {
            dtype,
            bytes: TensorBytes::Mapped {
                file: t.file,
                range: t.range.clone(),
            },
            rows,
            cols,
            packed,
        })
    }

    /// The vector `name` of `len` elements, as f32.
    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, EngineError> {
        let t = self.require(name)?;
        self.load_vector(t, len)
    }

    /// The vector `name` of `len` elements, as f32, if the files hold it.
    pub fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>, EngineError> {
        self.get(name).map(|t| self.load_vector(t, len)).transpose()
    }

    fn load_vector(&self, t: &StoredTensor, len: usize) -> Result<Vec<f32>, EngineError> {
        let dtype = self.supported(t)?;
        if t.elements() != len || !len.is_multiple_of(dtype.block_size()) {
            return Err(tensor_error(
                &t.file_name,
                format!("{} elements, expected {len}", t.elements()),
            ));
        }
        let mut out = vec![0f32; len];
        dequantize_row(
            dtype,
            &self.files[t.file].bytes()[t.range.clone()],
            &mut out,
        );
        Ok(out)
    }

    /// The matrix as the kernels take it.
    pub fn view<'a>(&'a self, t: &'a TensorRef) -> Matrix<'a> {
        let data = match &t.bytes {
            TensorBytes::Mapped { file, range } => &self.files[*file].bytes()[range.clone()],
            TensorBytes::Owned(values) => kernels::dispatch::f32_bytes(values),
        };
        Matrix {
            dtype: t.dtype,
            data,
            rows: t.rows,
            cols: t.cols,
            packed: t.packed.as_deref().map(Vec::as_slice),
        }
    }
}
