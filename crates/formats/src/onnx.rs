//! ONNX model metadata: what a server must know before loading a model (IR version, opsets,
//! graph inputs and outputs with element types and shapes, `metadata_props`, initializer sizes).
//!
//! The protobuf messages below declare only the fields we read (field numbers from `onnx.proto`);
//! everything else, tensor payloads included, is skipped by the decoder without being copied.
//! Length prefixes are checked against the remaining bytes and nesting is bounded by the decoder's
//! recursion limit, so hostile files fail with an error instead of allocating or recursing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use prost::Message;
use serde::{Deserialize, Serialize};

use crate::mapped::MappedFile;

/// Errors from reading an ONNX file.
#[derive(Debug, thiserror::Error)]
pub enum OnnxError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a valid ONNX model: {0}")]
    Decode(#[from] prost::DecodeError),
    #[error("not a valid ONNX model: {0}")]
    Invalid(String),
}

mod proto {
    //! The subset of `onnx.proto` (IR version 10) that [`super::OnnxModel`] reads.

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ModelProto {
        #[prost(int64, tag = "1")]
        pub ir_version: i64,
        #[prost(string, tag = "2")]
        pub producer_name: String,
        #[prost(string, tag = "3")]
        pub producer_version: String,
        #[prost(string, tag = "4")]
        pub domain: String,
        #[prost(int64, tag = "5")]
        pub model_version: i64,
        #[prost(string, tag = "6")]
        pub doc_string: String,
        #[prost(message, optional, tag = "7")]
        pub graph: Option<GraphProto>,
        #[prost(message, repeated, tag = "8")]
        pub opset_import: Vec<OperatorSetIdProto>,
        #[prost(message, repeated, tag = "14")]
        pub metadata_props: Vec<StringStringEntryProto>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct OperatorSetIdProto {
        #[prost(string, tag = "1")]
        pub domain: String,
        #[prost(int64, tag = "2")]
        pub version: i64,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct StringStringEntryProto {
        #[prost(string, tag = "1")]
        pub key: String,
        #[prost(string, tag = "2")]
        pub value: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct GraphProto {
        #[prost(message, repeated, tag = "1")]
        pub node: Vec<NodeProto>,
        #[prost(string, tag = "2")]
        pub name: String,
        #[prost(message, repeated, tag = "5")]
        pub initializer: Vec<TensorProto>,
        #[prost(message, repeated, tag = "11")]
        pub input: Vec<ValueInfoProto>,
        #[prost(message, repeated, tag = "12")]
        pub output: Vec<ValueInfoProto>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct NodeProto {
        #[prost(string, tag = "4")]
        pub op_type: String,
        #[prost(message, repeated, tag = "5")]
        pub attribute: Vec<AttributeProto>,
        #[prost(string, tag = "7")]
        pub domain: String,
    }

    /// Only the tensor-valued part of an attribute (`Constant` nodes carry weights this way).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct AttributeProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, optional, tag = "5")]
        pub t: Option<TensorProto>,
    }

    /// Only the description of an initializer; its payload fields are skipped.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorProto {
        #[prost(int64, repeated, tag = "1")]
        pub dims: Vec<i64>,
        #[prost(int32, tag = "2")]
        pub data_type: i32,
        #[prost(string, tag = "8")]
        pub name: String,
        /// 1 = EXTERNAL: the payload lives in a separate file.
        #[prost(int32, tag = "14")]
        pub data_location: i32,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ValueInfoProto {
        #[prost(string, tag = "1")]
        pub name: String,
        #[prost(message, optional, tag = "2")]
        pub r#type: Option<TypeProto>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TypeProto {
        #[prost(message, optional, tag = "1")]
        pub tensor_type: Option<TensorTypeProto>,
        #[prost(message, optional, boxed, tag = "4")]
        pub sequence_type: Option<Box<SequenceTypeProto>>,
        #[prost(message, optional, boxed, tag = "5")]
        pub map_type: Option<Box<MapTypeProto>>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorTypeProto {
        #[prost(int32, tag = "1")]
        pub elem_type: i32,
        #[prost(message, optional, tag = "2")]
        pub shape: Option<TensorShapeProto>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct SequenceTypeProto {
        #[prost(message, optional, boxed, tag = "1")]
        pub elem_type: Option<Box<TypeProto>>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct MapTypeProto {
        #[prost(int32, tag = "1")]
        pub key_type: i32,
        #[prost(message, optional, boxed, tag = "2")]
        pub value_type: Option<Box<TypeProto>>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TensorShapeProto {
        #[prost(message, repeated, tag = "1")]
        pub dim: Vec<Dimension>,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Dimension {
        #[prost(int64, optional, tag = "1")]
        pub dim_value: Option<i64>,
        #[prost(string, optional, tag = "2")]
        pub dim_param: Option<String>,
    }
}

/// The name of an ONNX tensor element type (`TensorProto.DataType`).
pub fn elem_type_name(elem_type: i32) -> &'static str {
    match elem_type {
        1 => "float32",
        2 => "uint8",
        3 => "int8",
        4 => "uint16",
        5 => "int16",
        6 => "int32",
        7 => "int64",
        8 => "string",
        9 => "bool",
        10 => "float16",
        11 => "float64",
        12 => "uint32",
        13 => "uint64",
        14 => "complex64",
        15 => "complex128",
        16 => "bfloat16",
        17 => "float8e4m3fn",
        18 => "float8e4m3fnuz",
        19 => "float8e5m2",
        20 => "float8e5m2fnuz",
        21 => "uint4",
        22 => "int4",
        23 => "float4e2m1",
        _ => "undefined",
    }
}

/// One dimension of a declared shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Dim {
    /// A fixed size.
    Fixed(i64),
    /// A named dynamic size (`"batch"`, `"N"`), or `"?"` when the model leaves it unnamed.
    Symbolic(String),
}

impl std::fmt::Display for Dim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Dim::Fixed(v) => write!(f, "{v}"),
            Dim::Symbolic(s) => f.write_str(s),
        }
    }
}

/// The declared type of a graph input or output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ValueType {
    /// A dense tensor; `shape` is absent when the model declares no rank.
    Tensor {
        dtype: String,
        shape: Option<Vec<Dim>>,
    },
    Sequence {
        element: Box<ValueType>,
    },
    Map {
        key: String,
        value: Box<ValueType>,
    },
    /// A type this reader does not describe (optional, sparse tensor) or none at all.
    Other,
}

impl std::fmt::Display for ValueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ValueType::Tensor {
                dtype,
                shape: Some(shape),
            } => {
                let dims: Vec<String> = shape.iter().map(Dim::to_string).collect();
                write!(f, "{dtype}[{}]", dims.join(", "))
            }
            ValueType::Tensor { dtype, shape: None } => write!(f, "{dtype}[*]"),
            ValueType::Sequence { element } => write!(f, "sequence<{element}>"),
            ValueType::Map { key, value } => write!(f, "map<{key}, {value}>"),
            ValueType::Other => f.write_str("?"),
        }
    }
}

/// A graph input or output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueInfo {
    pub name: String,
    pub value_type: ValueType,
}

/// What a server needs to know about an ONNX model.
#[derive(Debug, Clone, PartialEq)]
pub struct OnnxModel {
    pub ir_version: i64,
    /// (domain, version); the default domain is reported as `"ai.onnx"`.
    pub opsets: Vec<(String, i64)>,
    pub producer_name: String,
    pub producer_version: String,
    pub domain: String,
    pub model_version: i64,
    pub doc_string: String,
    pub graph_name: String,
    /// Inputs the caller must feed (initializers listed as inputs by old exporters are excluded).
    pub inputs: Vec<ValueInfo>,
    pub outputs: Vec<ValueInfo>,
    pub metadata: BTreeMap<String, String>,
    pub initializer_count: usize,
    /// Total elements over all initializers and `Constant` node tensors (the model's weights;
    /// some exporters, PaddlePaddle's among them, store every weight as a `Constant`).
    pub parameter_count: u64,
    /// Element types of initializers and `Constant` tensors, and how many tensors have each.
    pub initializer_types: BTreeMap<String, usize>,
    /// Operator types and how often each occurs in the main graph.
    pub op_types: BTreeMap<String, usize>,
    /// True when some initializer's data lives in an external file.
    pub external_data: bool,
}

fn convert_type(t: &proto::TypeProto, depth: usize) -> ValueType {
    if depth > 16 {
        return ValueType::Other;
    }
    if let Some(tensor) = &t.tensor_type {
        let shape = tensor.shape.as_ref().map(|s| {
            s.dim
                .iter()
                .map(|d| match (&d.dim_value, &d.dim_param) {
                    (Some(v), _) => Dim::Fixed(*v),
                    (None, Some(p)) if !p.is_empty() => Dim::Symbolic(p.clone()),
                    _ => Dim::Symbolic("?".into()),
                })
                .collect()
        });
        return ValueType::Tensor {
            dtype: elem_type_name(tensor.elem_type).to_string(),
            shape,
        };
    }
    if let Some(seq) = &t.sequence_type {
        let element = seq
            .elem_type
            .as_deref()
            .map(|e| convert_type(e, depth + 1))
            .unwrap_or(ValueType::Other);
        return ValueType::Sequence {
            element: Box::new(element),
        };
    }
    if let Some(map) = &t.map_type {
        let value = map
            .value_type
            .as_deref()
            .map(|v| convert_type(v, depth + 1))
            .unwrap_or(ValueType::Other);
        return ValueType::Map {
            key: elem_type_name(map.key_type).to_string(),
            value: Box::new(value),
        };
    }
    ValueType::Other
}

impl OnnxModel {
    /// Decodes the model description from the bytes of an `.onnx` file.
    pub fn parse(bytes: &[u8]) -> Result<Self, OnnxError> {
        let model = proto::ModelProto::decode(bytes)?;
        if model.ir_version <= 0 {
            return Err(OnnxError::Invalid(format!(
                "IR version {} (an ONNX model has IR version >= 1)",
                model.ir_version
            )));
        }
        let graph = model
            .graph
            .ok_or_else(|| OnnxError::Invalid("the model has no graph".into()))?;
        let initializer_names: std::collections::HashSet<&str> =
            graph.initializer.iter().map(|t| t.name.as_str()).collect();
        let value_info = |v: &proto::ValueInfoProto| ValueInfo {
            name: v.name.clone(),
            value_type: v
                .r#type
                .as_ref()
                .map(|t| convert_type(t, 0))
                .unwrap_or(ValueType::Other),
        };
        let inputs = graph
            .input
            .iter()
            .filter(|v| !initializer_names.contains(v.name.as_str()))
            .map(value_info)
            .collect();
        let outputs = graph.output.iter().map(value_info).collect();
        let mut parameter_count = 0u64;
        let mut initializer_types = BTreeMap::new();
        let constants = graph
            .node
            .iter()
            .filter(|n| n.op_type == "Constant" && (n.domain.is_empty() || n.domain == "ai.onnx"))
            .flat_map(|n| n.attribute.iter().filter_map(|a| a.t.as_ref()));
        for t in graph.initializer.iter().chain(constants) {
            let n = t
                .dims
                .iter()
                .try_fold(1u64, |acc, &d| {
                    u64::try_from(d).ok().and_then(|d| acc.checked_mul(d))
                })
                .ok_or_else(|| {
                    OnnxError::Invalid(format!("initializer {:?} has dims {:?}", t.name, t.dims))
                })?;
            parameter_count = parameter_count.saturating_add(n);
            *initializer_types
                .entry(elem_type_name(t.data_type).to_string())
                .or_insert(0) += 1;
        }
        let mut op_types = BTreeMap::new();
        for node in &graph.node {
            let name = if node.domain.is_empty() || node.domain == "ai.onnx" {
                node.op_type.clone()
            } else {
                format!("{}.{}", node.domain, node.op_type)
            };
            *op_types.entry(name).or_insert(0) += 1;
        }
        Ok(Self {
            ir_version: model.ir_version,
            opsets: model
                .opset_import
                .iter()
                .map(|o| {
                    let domain = if o.domain.is_empty() {
                        "ai.onnx"
                    } else {
                        &o.domain
                    };
                    (domain.to_string(), o.version)
                })
                .collect(),
            producer_name: model.producer_name,
            producer_version: model.producer_version,
            domain: model.domain,
            model_version: model.model_version,
            doc_string: model.doc_string,
            graph_name: graph.name,
            inputs,
            outputs,
            metadata: model
                .metadata_props
                .into_iter()
                .map(|e| (e.key, e.value))
                .collect(),
            initializer_count: graph.initializer.len(),
            parameter_count,
            initializer_types,
            op_types,
            external_data: graph.initializer.iter().any(|t| t.data_location == 1),
        })
    }

    /// Reads the model description from a file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, OnnxError> {
        let path = path.as_ref();
        let map = MappedFile::open(path).map_err(|source| OnnxError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::parse(map.bytes())
    }

    /// The version of the default (`ai.onnx`) operator set.
    pub fn opset(&self) -> Option<i64> {
        self.opsets
            .iter()
            .find(|(domain, _)| domain == "ai.onnx")
            .map(|(_, v)| *v)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::proto::*;
    use super::*;

    pub(crate) fn tensor_input(
        name: &str,
        elem_type: i32,
        dims: &[Result<i64, &str>],
    ) -> ValueInfoProto {
        ValueInfoProto {
            name: name.into(),
            r#type: Some(TypeProto {
                tensor_type: Some(TensorTypeProto {
                    elem_type,
                    shape: Some(TensorShapeProto {
                        dim: dims
                            .iter()
                            .map(|d| match d {
                                Ok(v) => Dimension {
                                    dim_value: Some(*v),
                                    dim_param: None,
                                },
                                Err(p) => Dimension {
                                    dim_value: None,
                                    dim_param: Some(p.to_string()),
                                },
                            })
                            .collect(),
                    }),
                }),
                sequence_type: None,
                map_type: None,
            }),
        }
    }

    /// A small classifier-shaped model, encoded as a real ONNX protobuf.
    pub(crate) fn sample_model() -> Vec<u8> {
        ModelProto {
            ir_version: 8,
            producer_name: "rampart-test".into(),
            producer_version: "1".into(),
            domain: String::new(),
            model_version: 3,
            doc_string: String::new(),
            graph: Some(GraphProto {
                node: vec![
                    NodeProto {
                        op_type: "Constant".into(),
                        attribute: vec![AttributeProto {
                            name: "value".into(),
                            t: Some(TensorProto {
                                dims: vec![4],
                                data_type: 1,
                                name: String::new(),
                                data_location: 0,
                            }),
                        }],
                        domain: String::new(),
                    },
                    NodeProto {
                        op_type: "Gemm".into(),
                        attribute: vec![],
                        domain: String::new(),
                    },
                    NodeProto {
                        op_type: "Softmax".into(),
                        attribute: vec![],
                        domain: String::new(),
                    },
                ],
                name: "g".into(),
                initializer: vec![TensorProto {
                    dims: vec![4, 8],
                    data_type: 1,
                    name: "w".into(),
                    data_location: 0,
                }],
                input: vec![
                    tensor_input("x", 1, &[Err("N"), Ok(8)]),
                    tensor_input("w", 1, &[Ok(4), Ok(8)]),
                ],
                output: vec![tensor_input("probs", 1, &[Err("N"), Ok(4)])],
            }),
            opset_import: vec![OperatorSetIdProto {
                domain: String::new(),
                version: 15,
            }],
            metadata_props: vec![StringStringEntryProto {
                key: "character".into(),
                value: "0\n90\n180\n270".into(),
            }],
        }
        .encode_to_vec()
    }

    #[test]
    fn reads_the_description() {
        let m = OnnxModel::parse(&sample_model()).unwrap();
        assert_eq!(m.ir_version, 8);
        assert_eq!(m.opset(), Some(15));
        assert_eq!(
            m.inputs.len(),
            1,
            "initializer listed as input is not a real input"
        );
        assert_eq!(m.inputs[0].value_type.to_string(), "float32[N, 8]");
        assert_eq!(m.outputs[0].name, "probs");
        assert_eq!(
            m.parameter_count, 36,
            "32 initializer + 4 Constant elements"
        );
        assert_eq!(m.metadata["character"], "0\n90\n180\n270");
        assert_eq!(m.op_types["Softmax"], 1);
    }

    #[test]
    fn truncations_never_panic_and_mostly_fail() {
        let bytes = sample_model();
        let mut failures = 0;
        for len in 0..bytes.len() {
            if OnnxModel::parse(&bytes[..len]).is_err() {
                failures += 1;
            }
        }
        // Protobuf has no end marker: a cut exactly between top-level fields can still decode,
        // but then it lacks the graph (field 7 precedes opsets and metadata in our encoding) or
        // trailing fields; most cuts land inside a field.
        assert!(
            failures > bytes.len() * 9 / 10,
            "{failures} of {}",
            bytes.len()
        );
    }
}
