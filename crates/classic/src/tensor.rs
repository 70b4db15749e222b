//! Named, typed tensors as requests carry them (KServe v2 datatypes) and their conversions:
//! JSON data arrays, the binary-tensor encoding (little-endian, `BYTES` as 4-byte length +
//! bytes), batching along the first axis.

use half::f16;
use serde_json::Value as Json;

use crate::error::ClassicError;

/// Element types of the Open Inference Protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    Bool,
    U8,
    U16,
    U32,
    U64,
    I8,
    I16,
    I32,
    I64,
    F16,
    F32,
    F64,
    Bytes,
}

impl DType {
    pub const ALL: [DType; 13] = [
        DType::Bool,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::Bytes,
    ];

    /// The protocol's name (`FP32`, `INT64`, `BYTES`, ...).
    pub fn kserve(self) -> &'static str {
        match self {
            DType::Bool => "BOOL",
            DType::U8 => "UINT8",
            DType::U16 => "UINT16",
            DType::U32 => "UINT32",
            DType::U64 => "UINT64",
            DType::I8 => "INT8",
            DType::I16 => "INT16",
            DType::I32 => "INT32",
            DType::I64 => "INT64",
            DType::F16 => "FP16",
            DType::F32 => "FP32",
            DType::F64 => "FP64",
            DType::Bytes => "BYTES",
        }
    }

    pub fn from_kserve(name: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.kserve() == name)
    }

    /// From the ONNX element type names the manifest records (`float32`, `int64`, `string`).
    pub fn from_onnx(name: &str) -> Option<DType> {
        Some(match name {
            "bool" => DType::Bool,
            "uint8" => DType::U8,
            "uint16" => DType::U16,
            "uint32" => DType::U32,
            "uint64" => DType::U64,
            "int8" => DType::I8,
            "int16" => DType::I16,
            "int32" => DType::I32,
            "int64" => DType::I64,
            "float16" => DType::F16,
            "float32" | "float" => DType::F32,
            "float64" | "double" => DType::F64,
            "string" => DType::Bytes,
            _ => return None,
        })
    }

    /// Bytes per element (`None` for `BYTES`).
    pub fn size(self) -> Option<usize> {
        Some(match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
            DType::Bytes => return None,
        })
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kserve())
    }
}

/// The elements of a tensor, row-major.
#[derive(Debug, Clone, PartialEq)]
pub enum Data {
    Bool(Vec<bool>),
    U8(Vec<u8>),
    U16(Vec<u16>),
    U32(Vec<u32>),
    U64(Vec<u64>),
    I8(Vec<i8>),
    I16(Vec<i16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    F16(Vec<f16>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bytes(Vec<Vec<u8>>),
}

macro_rules! each {
    ($data:expr, $v:ident => $body:expr) => {
        match $data {
            Data::Bool($v) => $body,
            Data::U8($v) => $body,
            Data::U16($v) => $body,
            Data::U32($v) => $body,
            Data::U64($v) => $body,
            Data::I8($v) => $body,
            Data::I16($v) => $body,
            Data::I32($v) => $body,
            Data::I64($v) => $body,
            Data::F16($v) => $body,
            Data::F32($v) => $body,
            Data::F64($v) => $body,
            Data::Bytes($v) => $body,
        }
    };
}

impl Data {
    pub fn dtype(&self) -> DType {
        match self {
            Data::Bool(_) => DType::Bool,
            Data::U8(_) => DType::U8,
            Data::U16(_) => DType::U16,
            Data::U32(_) => DType::U32,
            Data::U64(_) => DType::U64,
            Data::I8(_) => DType::I8,
            Data::I16(_) => DType::I16,
            Data::I32(_) => DType::I32,
            Data::I64(_) => DType::I64,
            Data::F16(_) => DType::F16,
            Data::F32(_) => DType::F32,
            Data::F64(_) => DType::F64,
            Data::Bytes(_) => DType::Bytes,
        }
    }

    pub fn len(&self) -> usize {
        each!(self, v => v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn empty(dtype: DType) -> Data {
        match dtype {
            DType::Bool => Data::Bool(Vec::new()),
            DType::U8 => Data::U8(Vec::new()),
            DType::U16 => Data::U16(Vec::new()),
            DType::U32 => Data::U32(Vec::new()),
            DType::U64 => Data::U64(Vec::new()),
            DType::I8 => Data::I8(Vec::new()),
            DType::I16 => Data::I16(Vec::new()),
            DType::I32 => Data::I32(Vec::new()),
            DType::I64 => Data::I64(Vec::new()),
            DType::F16 => Data::F16(Vec::new()),
            DType::F32 => Data::F32(Vec::new()),
            DType::F64 => Data::F64(Vec::new()),
            DType::Bytes => Data::Bytes(Vec::new()),
        }
    }

    /// Appends `other` (same type).
    fn extend(&mut self, other: &Data) -> bool {
        macro_rules! ext {
            ($($v:ident),*) => {
                match (self, other) {
                    $((Data::$v(a), Data::$v(b)) => { a.extend_from_slice(b); true })*
                    _ => false,
                }
            };
        }
        ext!(Bool, U8, U16, U32, U64, I8, I16, I32, I64, F16, F32, F64, Bytes)
    }

    /// Elements `start..end`.
    fn slice(&self, start: usize, end: usize) -> Data {
        macro_rules! sl {
            ($($v:ident),*) => {
                match self {
                    $(Data::$v(a) => Data::$v(a[start..end].to_vec()),)*
                }
            };
        }
        sl!(Bool, U8, U16, U32, U64, I8, I16, I32, I64, F16, F32, F64, Bytes)
    }
}

/// A named tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub data: Data,
}

fn bad(msg: String) -> ClassicError {
    ClassicError::BadInput(msg)
}

/// Number of elements a shape holds, refusing overflow and more than `limit` elements.
pub fn element_count(name: &str, shape: &[usize], limit: usize) -> Result<usize, ClassicError> {
    let mut n: usize = 1;
    for d in shape {
        n = n.checked_mul(*d).filter(|n| *n <= limit).ok_or_else(|| {
            bad(format!(
                "input {name:?}: shape {shape:?} holds more than {limit} elements"
            ))
        })?;
    }
    Ok(n)
}

impl Tensor {
    pub fn new(
        name: impl Into<String>,
        shape: Vec<usize>,
        data: Data,
    ) -> Result<Tensor, ClassicError> {
        let name = name.into();
        let want: usize = shape.iter().product();
        if data.len() != want {
            return Err(bad(format!(
                "input {name:?}: shape {shape:?} needs {want} elements, got {}",
                data.len()
            )));
        }
        Ok(Tensor { name, shape, data })
    }

    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// Size of the first axis (1 for scalars).
    pub fn batch(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }

    /// Decodes the binary-tensor encoding: little-endian elements, `BYTES` as a 4-byte
    /// little-endian length before each element.
    pub fn from_raw(
        name: &str,
        dtype: DType,
        shape: Vec<usize>,
        raw: &[u8],
    ) -> Result<Tensor, ClassicError> {
        Self::from_raw_within(
            name,
            dtype,
            shape,
            raw,
            &mut crate::tensor_json::DecodeBudget::unlimited(),
        )
    }

    /// [`Tensor::from_raw`], its elements taken from `budget` before the buffer is made (the
    /// bytes of `BYTES` elements as they are read). The byte count is checked against the
    /// shape before anything is converted; `BYTES` stop at the declared count.
    pub fn from_raw_within(
        name: &str,
        dtype: DType,
        shape: Vec<usize>,
        raw: &[u8],
        budget: &mut crate::tensor_json::DecodeBudget,
    ) -> Result<Tensor, ClassicError> {
        let n = element_count(name, &shape, usize::MAX / 16)?;
        if let Some(size) = dtype.size() {
            if raw.len() != n * size {
                return Err(bad(format!(
                    "input {name:?}: {dtype} shape {shape:?} needs {} bytes, got {}",
                    n * size,
                    raw.len()
                )));
            }
        }
        budget.take_elements(name, dtype, n)?;
        let data = match dtype.size() {
            Some(size) => {
                macro_rules! le {
                    ($t:ty, $v:ident) => {
                        Data::$v(
                            raw.chunks_exact(size)
                                .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                                .collect(),
                        )
                    };
                }
                match dtype {
                    DType::Bool => {
                        if let Some(b) = raw.iter().find(|b| **b > 1) {
                            return Err(bad(format!(
                                "input {name:?}: BOOL elements are 0 or 1, got {b}"
                            )));
                        }
                        Data::Bool(raw.iter().map(|b| *b == 1).collect())
                    }
                    DType::U8 => Data::U8(raw.to_vec()),
                    DType::I8 => Data::I8(raw.iter().map(|b| *b as i8).collect()),
                    DType::U16 => le!(u16, U16),
                    DType::U32 => le!(u32, U32),
                    DType::U64 => le!(u64, U64),
                    DType::I16 => le!(i16, I16),
                    DType::I32 => le!(i32, I32),
                    DType::I64 => le!(i64, I64),
                    DType::F16 => Data::F16(
                        raw.chunks_exact(2)
                            .map(|c| f16::from_le_bytes([c[0], c[1]]))
                            .collect(),
                    ),
                    DType::F32 => le!(f32, F32),
                    DType::F64 => le!(f64, F64),
                    DType::Bytes => unreachable!("BYTES has no fixed size"),
                }
            }
            None => {
                // Each element takes at least its 4-byte length.
                let mut items = Vec::with_capacity(n.min(raw.len() / 4));
                let mut rest = raw;
                while !rest.is_empty() {
                    if items.len() == n {
                        return Err(bad(format!(
                            "input {name:?}: shape {shape:?} needs {n} BYTES elements, the data holds more"
                        )));
                    }
                    if rest.len() < 4 {
                        return Err(bad(format!(
                            "input {name:?}: BYTES element {} has a truncated length prefix",
                            items.len()
                        )));
                    }
                    let len = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
                    rest = &rest[4..];
                    if len > rest.len() {
                        return Err(bad(format!(
                            "input {name:?}: BYTES element {} claims {len} bytes, {} remain",
                            items.len(),
                            rest.len()
                        )));
                    }
                    budget.take(name, len)?;
                    items.push(rest[..len].to_vec());
                    rest = &rest[len..];
                }
                if items.len() != n {
                    return Err(bad(format!(
                        "input {name:?}: shape {shape:?} needs {n} BYTES elements, got {}",
                        items.len()
                    )));
                }
                Data::Bytes(items)
            }
        };
        Ok(Tensor {
            name: name.to_string(),
            shape,
            data,
        })
    }

    /// The binary-tensor encoding of the elements.
    pub fn to_raw(&self) -> Vec<u8> {
        macro_rules! le {
            ($v:expr) => {
                $v.iter().flat_map(|x| x.to_le_bytes()).collect()
            };
        }
        match &self.data {
            Data::Bool(v) => v.iter().map(|b| u8::from(*b)).collect(),
            Data::U8(v) => v.clone(),
            Data::I8(v) => v.iter().map(|x| *x as u8).collect(),
            Data::U16(v) => le!(v),
            Data::U32(v) => le!(v),
            Data::U64(v) => le!(v),
            Data::I16(v) => le!(v),
            Data::I32(v) => le!(v),
            Data::I64(v) => le!(v),
            Data::F16(v) => le!(v),
            Data::F32(v) => le!(v),
            Data::F64(v) => le!(v),
            Data::Bytes(v) => {
                let mut out = Vec::with_capacity(v.iter().map(|b| b.len() + 4).sum());
                for b in v {
                    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
                    out.extend_from_slice(b);
                }
                out
            }
        }
    }

    /// Reads the JSON `data` field: a flat or nested array (nesting is flattened row-major).
    /// `BYTES` elements are strings (UTF-8 bytes).
    pub fn from_json(
        name: &str,
        dtype: DType,
        shape: Vec<usize>,
        data: &Json,
    ) -> Result<Tensor, ClassicError> {
        let n = element_count(name, &shape, usize::MAX / 16)?;
        let mut flat: Vec<&Json> = Vec::with_capacity(n.min(1 << 20));
        fn flatten<'a>(v: &'a Json, out: &mut Vec<&'a Json>, limit: usize) -> bool {
            match v {
                Json::Array(items) => items.iter().all(|i| flatten(i, out, limit)),
                other => {
                    out.push(other);
                    out.len() <= limit
                }
            }
        }
        if !flatten(data, &mut flat, n) || flat.len() != n {
            return Err(bad(format!(
                "input {name:?}: shape {shape:?} needs {n} elements, the data holds {}",
                if flat.len() > n {
                    format!("more than {n}")
                } else {
                    flat.len().to_string()
                }
            )));
        }
        let wrong = |i: usize, v: &Json| {
            bad(format!(
                "input {name:?}: element {i} is {v}, not a {dtype} value"
            ))
        };
        macro_rules! ints {
            ($t:ty, $v:ident, $get:ident) => {
                Data::$v(
                    flat.iter()
                        .enumerate()
                        .map(|(i, v)| {
                            v.$get()
                                .and_then(|x| <$t>::try_from(x).ok())
                                .ok_or_else(|| wrong(i, v))
                        })
                        .collect::<Result<_, _>>()?,
                )
            };
        }
        let float = |i: usize, v: &Json| v.as_f64().ok_or_else(|| wrong(i, v));
        let data = match dtype {
            DType::Bool => Data::Bool(
                flat.iter()
                    .enumerate()
                    .map(|(i, v)| v.as_bool().ok_or_else(|| wrong(i, v)))
                    .collect::<Result<_, _>>()?,
            ),
            DType::U8 => ints!(u8, U8, as_u64),
            DType::U16 => ints!(u16, U16, as_u64),
            DType::U32 => ints!(u32, U32, as_u64),
            DType::U64 => ints!(u64, U64, as_u64),
            DType::I8 => ints!(i8, I8, as_i64),
            DType::I16 => ints!(i16, I16, as_i64),
            DType::I32 => ints!(i32, I32, as_i64),
            DType::I64 => ints!(i64, I64, as_i64),
            DType::F16 => Data::F16(
                flat.iter()
                    .enumerate()
                    .map(|(i, v)| float(i, v).map(f16::from_f64))
                    .collect::<Result<_, _>>()?,
            ),
            DType::F32 => Data::F32(
                flat.iter()
                    .enumerate()
                    .map(|(i, v)| float(i, v).map(|x| x as f32))
                    .collect::<Result<_, _>>()?,
            ),
            DType::F64 => Data::F64(
                flat.iter()
                    .enumerate()
                    .map(|(i, v)| float(i, v))
                    .collect::<Result<_, _>>()?,
            ),
            DType::Bytes => Data::Bytes(
                flat.iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_str()
                            .map(|s| s.as_bytes().to_vec())
                            .ok_or_else(|| wrong(i, v))
                    })
                    .collect::<Result<_, _>>()?,
            ),
        };
        Ok(Tensor {
            name: name.to_string(),
            shape,
            data,
        })
    }

    /// The elements as a flat JSON array (`BYTES` as strings, lossy for non-UTF-8).
    pub fn to_json(&self) -> Json {
        macro_rules! arr {
            ($v:expr, $f:expr) => {
                Json::Array($v.iter().map($f).collect())
            };
        }
        match &self.data {
            Data::Bool(v) => arr!(v, |x| Json::from(*x)),
            Data::U8(v) => arr!(v, |x| Json::from(*x)),
            Data::U16(v) => arr!(v, |x| Json::from(*x)),
            Data::U32(v) => arr!(v, |x| Json::from(*x)),
            Data::U64(v) => arr!(v, |x| Json::from(*x)),
            Data::I8(v) => arr!(v, |x| Json::from(*x)),
            Data::I16(v) => arr!(v, |x| Json::from(*x)),
            Data::I32(v) => arr!(v, |x| Json::from(*x)),
            Data::I64(v) => arr!(v, |x| Json::from(*x)),
            Data::F16(v) => arr!(v, |x| json_float(x.to_f64())),
            Data::F32(v) => arr!(v, |x| json_float(f64::from(*x))),
            Data::F64(v) => arr!(v, |x| json_float(*x)),
            Data::Bytes(v) => arr!(v, |x| Json::from(String::from_utf8_lossy(x).into_owned())),
        }
    }

    /// Joins tensors of the same name, type and trailing shape along the first axis.
    pub fn concat(parts: &[&Tensor]) -> Result<Tensor, ClassicError> {
        let first = parts
            .first()
            .ok_or_else(|| bad("nothing to batch".into()))?;
        let mut data = Data::empty(first.dtype());
        let mut batch = 0;
        for p in parts {
            if p.shape.len() != first.shape.len()
                || p.shape.get(1..) != first.shape.get(1..)
                || p.shape.is_empty()
            {
                return Err(bad(format!(
                    "input {:?}: shapes {:?} and {:?} cannot be batched",
                    first.name, first.shape, p.shape
                )));
            }
            if !data.extend(&p.data) {
                return Err(bad(format!(
                    "input {:?}: types {} and {} cannot be batched",
                    first.name,
                    first.dtype(),
                    p.dtype()
                )));
            }
            batch += p.shape[0];
        }
        let mut shape = first.shape.clone();
        shape[0] = batch;
        Ok(Tensor {
            name: first.name.clone(),
            shape,
            data,
        })
    }

    /// Rows `start..end` of the first axis.
    pub fn rows(&self, start: usize, end: usize) -> Tensor {
        let row: usize = self.shape.iter().skip(1).product();
        let mut shape = self.shape.clone();
        if let Some(first) = shape.first_mut() {
            *first = end - start;
        }
        Tensor {
            name: self.name.clone(),
            shape,
            data: self.data.slice(start * row, end * row),
        }
    }

    pub fn as_f32(&self) -> Option<&[f32]> {
        match &self.data {
            Data::F32(v) => Some(v),
            _ => None,
        }
    }

    /// The elements converted to f32 (numeric types only).
    pub fn to_f32(&self) -> Option<Vec<f32>> {
        Some(match &self.data {
            Data::F32(v) => v.clone(),
            Data::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Data::F64(v) => v.iter().map(|x| *x as f32).collect(),
            Data::U8(v) => v.iter().map(|x| f32::from(*x)).collect(),
            Data::I8(v) => v.iter().map(|x| f32::from(*x)).collect(),
            Data::I32(v) => v.iter().map(|x| *x as f32).collect(),
            Data::I64(v) => v.iter().map(|x| *x as f32).collect(),
            _ => return None,
        })
    }
}

fn json_float(x: f64) -> Json {
    serde_json::Number::from_f64(x).map_or(Json::Null, Json::Number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_round_trips_every_type() {
        let cases = [
            Data::Bool(vec![true, false]),
            Data::U8(vec![1, 255]),
            Data::I16(vec![-3, 7]),
            Data::I64(vec![i64::MIN, 5]),
            Data::F16(vec![f16::from_f32(1.5), f16::from_f32(-2.0)]),
            Data::F32(vec![0.25, -1e9]),
            Data::F64(vec![1e-300, 2.0]),
            Data::Bytes(vec![b"ab".to_vec(), Vec::new()]),
        ];
        for data in cases {
            let t = Tensor::new("x", vec![2], data).unwrap();
            let back = Tensor::from_raw("x", t.dtype(), vec![2], &t.to_raw()).unwrap();
            assert_eq!(back, t);
        }
    }

    #[test]
    fn bad_raw_and_json_are_precise_errors() {
        let e = Tensor::from_raw("x", DType::F32, vec![2, 2], &[0; 12]).unwrap_err();
        assert!(e.to_string().contains("needs 16 bytes, got 12"), "{e}");
        let e = Tensor::from_raw("s", DType::Bytes, vec![1], &[9, 0, 0, 0, 1]).unwrap_err();
        assert!(e.to_string().contains("claims 9 bytes"), "{e}");
        let e =
            Tensor::from_json("x", DType::F32, vec![3], &serde_json::json!([1, 2])).unwrap_err();
        assert!(
            e.to_string().contains("needs 3 elements, the data holds 2"),
            "{e}"
        );
        let e =
            Tensor::from_json("x", DType::U8, vec![2], &serde_json::json!([1, 300])).unwrap_err();
        assert!(e.to_string().contains("element 1 is 300"), "{e}");
        let e = Tensor::from_json("x", DType::F32, vec![1], &serde_json::json!(["a"])).unwrap_err();
        assert!(e.to_string().contains("not a FP32 value"), "{e}");
        let e = element_count("x", &[usize::MAX, 2], 1 << 30).unwrap_err();
        assert!(e.to_string().contains("more than"), "{e}");
    }

    #[test]
    fn nested_json_flattens_and_batches_split_back() {
        let a =
            Tensor::from_json("x", DType::F32, vec![1, 2], &serde_json::json!([[1, 2]])).unwrap();
        let b = Tensor::from_json(
            "x",
            DType::F32,
            vec![2, 2],
            &serde_json::json!([3, 4, 5, 6]),
        )
        .unwrap();
        let both = Tensor::concat(&[&a, &b]).unwrap();
        assert_eq!(both.shape, vec![3, 2]);
        assert_eq!(both.rows(1, 3), b);
        assert_eq!(both.rows(0, 1), a);
        let c =
            Tensor::from_json("x", DType::F32, vec![1, 3], &serde_json::json!([1, 2, 3])).unwrap();
        assert!(Tensor::concat(&[&a, &c]).is_err());
    }
}
