//! safetensors: an 8-byte little-endian header length, a JSON header mapping tensor names to
//! dtype, shape and data offsets (plus an optional `__metadata__` string map), then the data.
//!
//! Parsing and validation (offsets contiguous and in bounds, sizes matching dtype × shape, header
//! at most 100 MB and never longer than the file) come from the `safetensors` crate; this module
//! turns the result into Rampart's types and errors and adds sharded-checkpoint indexes and a
//! writer ([`SafetensorsWriter`], for generated test checkpoints and conversions).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use ::safetensors::tensor::{SafeTensorError, SafeTensors};

use crate::mapped::MappedFile;

/// Errors from reading safetensors files and shard indexes.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid safetensors file: {0}")]
    Invalid(String),
    #[error("invalid shard index {path}: {reason}")]
    BadIndex { path: PathBuf, reason: String },
}

impl From<SafeTensorError> for SafetensorsError {
    fn from(e: SafeTensorError) -> Self {
        let reason = match e {
            SafeTensorError::HeaderTooSmall => {
                "file is shorter than the 8-byte header length".into()
            }
            SafeTensorError::HeaderTooLarge => "header length exceeds 100 MB".into(),
            SafeTensorError::InvalidHeaderLength => {
                "header length runs past the end of the file".into()
            }
            SafeTensorError::MetadataIncompleteBuffer => {
                "tensor data does not match the file length (truncated or padded)".into()
            }
            SafeTensorError::InvalidHeader(e) => format!("header is not UTF-8: {e}"),
            SafeTensorError::InvalidHeaderDeserialization(e) => {
                format!("header is not valid JSON: {e}")
            }
            other => format!("{other:?}"),
        };
        SafetensorsError::Invalid(reason)
    }
}

/// One tensor's description. `shape` is row-major (PyTorch order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dtype name as the format spells it: `F32`, `F16`, `BF16`, `I64`, `F8_E4M3`, ...
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Byte range relative to the start of the data section.
    pub data_offsets: (u64, u64),
    pub n_elements: u64,
}

/// A parsed safetensors header.
#[derive(Debug, Clone)]
pub struct Safetensors {
    /// Tensors in data order.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map.
    pub metadata: BTreeMap<String, String>,
    /// Absolute offset of the data section (8 + header length).
    pub data_offset: u64,
}

impl Safetensors {
    /// Parses and validates the header of a whole safetensors file.
    pub fn parse(bytes: &[u8]) -> Result<Self, SafetensorsError> {
        let (header_len, meta) = SafeTensors::read_metadata(bytes)?;
        let by_name = meta.tensors();
        let mut tensors = Vec::with_capacity(by_name.len());
        for name in meta.offset_keys() {
            let info = by_name.get(&name).ok_or_else(|| {
                SafetensorsError::Invalid(format!("tensor {name:?} vanished from the index"))
            })?;
            let shape: Vec<u64> = info.shape.iter().map(|&d| d as u64).collect();
            tensors.push(TensorInfo {
                n_elements: shape.iter().product(),
                name,
                dtype: info.dtype.to_string(),
                shape,
                data_offsets: (info.data_offsets.0 as u64, info.data_offsets.1 as u64),
            });
        }
        let metadata = meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        Ok(Self {
            tensors,
            metadata,
            data_offset: 8 + header_len as u64,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Total number of elements over all tensors.
    pub fn parameter_count(&self) -> u64 {
        self.tensors.iter().map(|t| t.n_elements).sum()
    }

    /// Number of tensors of each dtype.
    pub fn dtype_counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for t in &self.tensors {
            *counts.entry(t.dtype.clone()).or_insert(0) += 1;
        }
        counts
    }
}

/// A memory-mapped safetensors file.
#[derive(Debug)]
pub struct SafetensorsFile {
    map: MappedFile,
    header: Safetensors,
}

impl SafetensorsFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self, SafetensorsError> {
        let path = path.as_ref();
        let map = MappedFile::open(path).map_err(|source| SafetensorsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let header = Safetensors::parse(map.bytes())?;
        Ok(Self { map, header })
    }

    pub fn header(&self) -> &Safetensors {
        &self.header
    }

    /// A tensor's raw little-endian bytes.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        &self.map.bytes()[self.tensor_range(tensor)]
    }

    /// Where a tensor's bytes lie in the whole file (see [`Self::bytes`]).
    pub fn tensor_range(&self, tensor: &TensorInfo) -> std::ops::Range<usize> {
        // Offsets were validated against the file length by `parse`.
        let start = (self.header.data_offset + tensor.data_offsets.0) as usize;
        let end = (self.header.data_offset + tensor.data_offsets.1) as usize;
        start..end
    }

    /// The whole mapped file.
    pub fn bytes(&self) -> &[u8] {
        self.map.bytes()
    }

    /// The path the file was mapped from.
    pub fn path(&self) -> &Path {
        self.map.path()
    }
}

impl std::ops::Deref for SafetensorsFile {
    type Target = Safetensors;
    fn deref(&self) -> &Safetensors {
        &self.header
    }
}

/// `model.safetensors.index.json` of a sharded checkpoint: which shard holds each tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardIndex {
    pub metadata: BTreeMap<String, serde_json::Value>,
    /// Tensor name → shard file name (relative to the index's folder).
    pub weight_map: BTreeMap<String, String>,
}

impl ShardIndex {
    /// Reads an index file. Shard names must be plain file names in the same folder.
    pub fn read(path: impl AsRef<Path>) -> Result<Self, SafetensorsError> {
        let path = path.as_ref();
        let bad = |reason: String| SafetensorsError::BadIndex {
            path: path.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|source| SafetensorsError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        #[derive(serde::Deserialize)]
        struct Raw {
            #[serde(default)]
            metadata: BTreeMap<String, serde_json::Value>,
            weight_map: BTreeMap<String, String>,
        }
        let raw: Raw = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        for shard in raw.weight_map.values() {
            if shard.is_empty()
                || shard.contains('/')
                || shard.contains('\\')
                || shard == ".."
                || shard == "."
            {
                return Err(bad(format!(
                    "shard name {shard:?} is not a plain file name"
                )));
            }
        }
        Ok(Self {
            metadata: raw.metadata,
            weight_map: raw.weight_map,
        })
    }

    /// The distinct shard file names, sorted.
    pub fn shards(&self) -> Vec<&str> {
        let mut shards: Vec<&str> = self.weight_map.values().map(String::as_str).collect();
        shards.sort_unstable();
        shards.dedup();
        shards
    }
}

/// Bytes per element of a safetensors dtype name; `None` for names this writer does not know.
pub fn dtype_bytes(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" => 1,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "F32" | "I32" | "U32" => 4,
        "F64" | "I64" | "U64" => 8,
        _ => return None,
    })
}

/// Errors from building a safetensors file.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsWriteError {
    #[error(
        "tensor {name:?}: data is {actual} bytes, {dtype} with shape {shape:?} needs {expected:?}"
    )]
    DataSize {
        name: String,
        dtype: String,
        shape: Vec<u64>,
        expected: Option<u64>,
        actual: usize,
    },
    #[error("tensor {0:?}: unknown dtype")]
    UnknownDtype(String),
    #[error("tensor {0:?} was added twice, or is named __metadata__")]
    DuplicateTensor(String),
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Builds a safetensors file: tensors laid out in insertion order, the JSON header padded with
/// spaces to a multiple of 8 bytes (as the reference implementation writes it, so 8-byte
/// alignment of the data section holds).
#[derive(Debug, Default)]
pub struct SafetensorsWriter<'a> {
    metadata: BTreeMap<String, String>,
    tensors: Vec<PendingTensor<'a>>,
}

#[derive(Debug)]
struct PendingTensor<'a> {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    data: Cow<'a, [u8]>,
}

impl<'a> SafetensorsWriter<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an entry to `__metadata__`.
    pub fn metadata(&mut self, key: &str, value: &str) -> &mut Self {
        self.metadata.insert(key.to_string(), value.to_string());
        self
    }

    /// Adds a tensor: `shape` row-major (PyTorch order), `data` little-endian, exactly the size
    /// dtype × shape implies.
    pub fn tensor(
        &mut self,
        name: &str,
        dtype: &str,
        shape: &[u64],
        data: impl Into<Cow<'a, [u8]>>,
    ) -> Result<&mut Self, SafetensorsWriteError> {
        let data = data.into();
        let elem = dtype_bytes(dtype)
            .ok_or_else(|| SafetensorsWriteError::UnknownDtype(name.to_string()))?;
        let expected = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .and_then(|n| n.checked_mul(elem as u64));
        if expected != Some(data.len() as u64) {
            return Err(SafetensorsWriteError::DataSize {
                name: name.to_string(),
                dtype: dtype.to_string(),
                shape: shape.to_vec(),
                expected,
                actual: data.len(),
            });
        }
        if name == "__metadata__" || self.tensors.iter().any(|t| t.name == name) {
            return Err(SafetensorsWriteError::DuplicateTensor(name.to_string()));
        }
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dtype: dtype.to_string(),
            shape: shape.to_vec(),
            data,
        });
        Ok(self)
    }

    /// Bytes of tensor data added so far.
    pub fn data_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.data.len() as u64).sum()
    }

    /// Writes the file.
    pub fn write_to(&self, mut out: impl Write) -> Result<(), SafetensorsWriteError> {
        let mut header = serde_json::Map::new();
        if !self.metadata.is_empty() {
            header.insert(
                "__metadata__".into(),
                serde_json::to_value(&self.metadata).expect("a string map is valid JSON"),
            );
        }
        let mut offset = 0u64;
        for PendingTensor {
            name,
            dtype,
            shape,
            data,
        } in &self.tensors
        {
            let end = offset + data.len() as u64;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let mut json = serde_json::to_vec(&header).expect("a JSON map serializes");
        json.resize(json.len().next_multiple_of(8), b' ');
        out.write_all(&(json.len() as u64).to_le_bytes())?;
        out.write_all(&json)?;
        for t in &self.tensors {
            out.write_all(&t.data)?;
        }
        out.flush()?;
        Ok(())
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, SafetensorsWriteError> {
        let mut out = Vec::new();
        self.write_to(&mut out)?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a safetensors file by hand (header JSON + data), as the format spec describes.
    pub(crate) fn build(tensors: &[(&str, &str, &[u64])]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut offset = 0u64;
        for (name, dtype, shape) in tensors {
            let elem = match *dtype {
                "F32" | "I32" => 4,
                "F16" | "BF16" => 2,
                _ => 8,
            };
            let len = shape.iter().product::<u64>() * elem;
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
            );
            offset += len;
        }
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let json = serde_json::to_vec(&header).unwrap();
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&json);
        out.resize(out.len() + offset as usize, 0x3c);
        out
    }

    #[test]
    fn parses_a_small_file() {
        let bytes = build(&[("w", "F16", &[4, 8]), ("b", "F32", &[8])]);
        let st = Safetensors::parse(&bytes).unwrap();
        assert_eq!(st.tensors.len(), 2);
        assert_eq!(st.tensors[0].name, "w", "tensors come in data order");
        assert_eq!(st.tensor("b").unwrap().data_offsets, (64, 96));
        assert_eq!(st.parameter_count(), 40);
        assert_eq!(st.metadata.get("format").map(String::as_str), Some("pt"));
        assert_eq!(st.dtype_counts().get("F16"), Some(&1));
    }

    #[test]
    fn the_writer_round_trips_through_the_reader() {
        let w16: Vec<u8> = (0..24u8).collect();
        let b32: Vec<u8> = (0..12u8).collect();
        let mut w = SafetensorsWriter::new();
        w.metadata("format", "pt");
        w.tensor("w", "BF16", &[3, 4], w16.as_slice())
            .unwrap()
            .tensor("b", "F32", &[3], b32.as_slice())
            .unwrap();
        assert!(w.tensor("w", "F32", &[3], b32.as_slice()).is_err());
        assert!(w.tensor("x", "F32", &[4], b32.as_slice()).is_err());
        assert!(w.tensor("x", "Q4", &[3], b32.as_slice()).is_err());
        let bytes = w.to_bytes().unwrap();
        let st = Safetensors::parse(&bytes).unwrap();
        assert_eq!(st.data_offset % 8, 0, "the header is padded to 8 bytes");
        assert_eq!(st.metadata["format"], "pt");
        let t = st.tensor("w").unwrap();
        assert_eq!(
            (t.dtype.as_str(), t.shape.as_slice()),
            ("BF16", &[3u64, 4][..])
        );
        let at = |t: &TensorInfo| {
            &bytes[(st.data_offset + t.data_offsets.0) as usize
                ..(st.data_offset + t.data_offsets.1) as usize]
        };
        assert_eq!(at(t), w16.as_slice());
        assert_eq!(at(st.tensor("b").unwrap()), b32.as_slice());
    }

    #[test]
    fn truncation_and_garbage_are_errors() {
        let bytes = build(&[("w", "F32", &[16])]);
        for len in 0..bytes.len() {
            assert!(
                Safetensors::parse(&bytes[..len]).is_err(),
                "prefix {len} parsed"
            );
        }
        let mut huge = u64::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(Safetensors::parse(&huge).is_err());
    }
}
