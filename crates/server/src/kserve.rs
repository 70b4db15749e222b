//! KServe v2 / Open Inference Protocol: the transport-free core (what `infer`, metadata and
//! readiness mean for tensor and embedding models) and its REST binding, with the binary-tensor
//! extension, the classification extension and a raw-image input. The gRPC binding (`grpc`)
//! calls the same core.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use classic::{ClassicError, DType, Data, Judgement, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::observe;
use crate::record::{sha256_hex, RecordBuilder};
use crate::routes::{Principal, RequestId};
use crate::state::{AppState, EmbedderHandle, TensorHandle};

/// Protocol extensions this server implements.
pub const EXTENSIONS: [&str; 3] = ["binary_tensor_data", "classification", "model_metadata"];

/// The name of the synthetic outputs of detectors.
pub const DETECTIONS: &str = "detections";
pub const DETECTION_LABELS: &str = "detection_labels";
/// Embedding models: the text input and the vector output.
pub const TEXT_INPUT: &str = "text";
pub const EMBEDDING_OUTPUT: &str = "embedding";

/// An output the client asked for.
#[derive(Debug, Clone, Default)]
pub struct RequestedOutput {
    pub name: String,
    /// Send the data in the binary section (REST) instead of JSON.
    pub binary: bool,
    /// Classification extension: the top `k` classes as `score:index[:label]` strings.
    pub classification: Option<usize>,
}

/// A decoded inference request.
#[derive(Debug, Clone, Default)]
pub struct InferRequest {
    pub id: Option<String>,
    pub inputs: Vec<Tensor>,
    /// Empty: the model's default outputs.
    pub outputs: Vec<RequestedOutput>,
    /// Default for outputs not named (`binary_data_output`).
    pub binary_output: bool,
}

/// One output of a response.
#[derive(Debug, Clone)]
pub struct OutputTensor {
    pub tensor: Tensor,
    pub binary: bool,
}

/// The result of an inference.
#[derive(Debug, Clone)]
pub struct InferResponse {
    pub model_name: String,
    pub model_version: String,
    pub id: Option<String>,
    pub outputs: Vec<OutputTensor>,
    /// What post-processing concluded per input (raw-image requests show it).
    pub judgements: Vec<Judgement>,
}

/// Metadata of a tensor: name, datatype, shape (-1 for dynamic).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
}

/// A model KServe can address.
#[derive(Clone)]
pub enum Served {
    Tensor(Arc<TensorHandle>),
    Embedder(Arc<EmbedderHandle>),
}

impl Served {
    pub fn id(&self) -> &str {
        match self {
            Served::Tensor(t) => &t.id,
            Served::Embedder(e) => &e.id,
        }
    }
    pub fn version(&self) -> &str {
        match self {
            Served::Tensor(t) => &t.version,
            Served::Embedder(e) => &e.version,
        }
    }
    fn digest(&self) -> &str {
        match self {
            Served::Tensor(t) => &t.digest,
            Served::Embedder(e) => &e.digest,
        }
    }
    fn admission(&self) -> &Arc<crate::admission::Admission> {
        match self {
            Served::Tensor(t) => &t.admission,
            Served::Embedder(e) => &e.admission,
        }
    }
}

impl From<ClassicError> for ApiError {
    fn from(e: ClassicError) -> Self {
        match e {
            ClassicError::BadInput(m) => ApiError::invalid(m),
            e @ ClassicError::QueueFull { .. } => ApiError::Overloaded {
                message: e.to_string(),
                retry_after_s: 1,
                code: "queue_full",
            },
            e @ (ClassicError::QueueTimeout { .. } | ClassicError::ShuttingDown(_)) => {
                ApiError::Unavailable {
                    message: e.to_string(),
                    retry_after_s: 1,
                }
            }
            e @ (ClassicError::Load(_) | ClassicError::Backend(_)) => {
                ApiError::Internal(e.to_string())
            }
        }
    }
}

/// Finds a model by name and optional version, tensor models first.
pub fn find(state: &AppState, name: &str, version: Option<&str>) -> Result<Served, ApiError> {
    if let Some(t) = state.find_tensor(name, version) {
        return Ok(Served::Tensor(t));
    }
    let id = match version {
        Some(v) => format!("{name}@{v}"),
        None => name.to_string(),
    };
    if let Some(e) = state.find_embedder(&id) {
        return Ok(Served::Embedder(e));
    }
    if state.find(&id).is_some() {
        return Err(ApiError::invalid(format!(
            "{id:?} is a language model; it is served by /v1/chat/completions and /v1/completions"
        )));
    }
    let mut known: Vec<String> = state
        .tensors()
        .iter()
        .map(|t| t.id.clone())
        .chain(state.embedders().iter().map(|e| e.id.clone()))
        .collect();
    known.sort();
    known.dedup();
    Err(ApiError::ModelNotFound(format!(
        "model {id:?} is not served here (tensor and embedding models: {})",
        if known.is_empty() {
            "none".to_string()
        } else {
            known.join(", ")
        }
    )))
}

/// Every loaded version of `name`.
fn versions(state: &AppState, name: &str) -> Vec<String> {
    let mut v: Vec<String> = state
        .tensors()
        .iter()
        .filter(|t| t.id == name)
        .map(|t| t.version.clone())
        .chain(
            state
                .embedders()
                .iter()
                .filter(|e| e.id == name)
                .map(|e| e.version.clone()),
        )
        .collect();
    v.sort();
    v
}

fn dims(spec: &repo::manifest::TensorSpec) -> Vec<i64> {
    spec.shape
        .as_ref()
        .map(|s| {
            s.iter()
                .map(|d| match d {
                    formats::onnx::Dim::Fixed(v) if *v > 0 => *v,
                    _ => -1,
                })
                .collect()
        })
        .unwrap_or_default()
}

fn datatype(onnx: &str) -> String {
    DType::from_onnx(onnx).map_or_else(|| onnx.to_uppercase(), |d| d.kserve().to_string())
}

pub fn metadata(state: &AppState, served: &Served) -> ModelMetadata {
    let versions = versions(state, served.id());
    match served {
        Served::Tensor(t) => {
            let m = &t.model;
            let inputs: Vec<TensorMetadata> = m
                .inputs
                .iter()
                .map(|i| TensorMetadata {
                    name: i.name.clone(),
                    datatype: datatype(&i.dtype),
                    shape: dims(i),
                })
                .collect();
            // The image input (declared pre-processing) also takes encoded JPEG/PNG images as
            // BYTES, one per batch row; the metadata keeps the graph's datatype.
            let mut outputs: Vec<TensorMetadata> = m
                .outputs
                .iter()
                .map(|o| TensorMetadata {
                    name: o.name.clone(),
                    datatype: datatype(&o.dtype),
                    shape: dims(o),
                })
                .collect();
            if matches!(
                m.pipeline.postprocess,
                Some(repo::pipeline::Postprocess::Detect(_))
            ) {
                outputs.push(TensorMetadata {
                    name: DETECTIONS.into(),
                    datatype: "FP32".into(),
                    shape: vec![-1, 7],
                });
                outputs.push(TensorMetadata {
                    name: DETECTION_LABELS.into(),
                    datatype: "BYTES".into(),
                    shape: vec![-1],
                });
            }
            ModelMetadata {
                name: t.id.clone(),
                versions,
                platform: format!("onnx_{}", m.backend()),
                inputs,
                outputs,
            }
        }
        Served::Embedder(e) => ModelMetadata {
            name: e.id.clone(),
            versions,
            platform: "rampart_embedding".into(),
            inputs: vec![TensorMetadata {
                name: TEXT_INPUT.into(),
                datatype: "BYTES".into(),
                shape: vec![-1],
            }],
            outputs: vec![TensorMetadata {
                name: EMBEDDING_OUTPUT.into(),
                datatype: "FP32".into(),
                shape: vec![-1, e.embedder.dimensions() as i64],
            }],
        },
    }
}

/// Runs one request: admission, pre-processing, the batcher, post-processing, output selection.
pub async fn infer(
    state: &Arc<AppState>,
    principal: &str,
    served: &Served,
    request: InferRequest,
    record: &mut RecordBuilder,
) -> Result<InferResponse, ApiError> {
    if state.is_draining() {
        return Err(ApiError::Unavailable {
            message: "the server is shutting down".into(),
            retry_after_s: 5,
        });
    }
    record.record.model = served.id().to_string();
    record.record.version = served.version().to_string();
    record.record.version_digest = served.digest().to_string();
    record.record.input_sha256 = hash_inputs(&request.inputs);
    let slot =
        crate::routes::admit(state, principal, served.id(), served.admission(), record).await?;
    let result = match served {
        Served::Tensor(t) => infer_tensor(t, request, record).await,
        Served::Embedder(e) => infer_embedding(e, request, record).await,
    };
    drop(slot);
    result
}

fn hash_inputs(inputs: &[Tensor]) -> String {
    let mut text = String::new();
    for t in inputs {
        text.push_str(&format!("{}:{}:{:?};", t.name, t.dtype(), t.shape));
    }
    let mut h = sha256_hex(&text);
    for t in inputs {
        h = sha256_hex(&format!("{h}{}", hex_digest(&t.to_raw())));
    }
    h
}

fn hex_digest(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    hex::encode(Sha256::digest(bytes))
}

async fn infer_tensor(
    t: &Arc<TensorHandle>,
    request: InferRequest,
    record: &mut RecordBuilder,
) -> Result<InferResponse, ApiError> {
    let model = &t.model;
    let started = Instant::now();
    let (inputs, transforms) = model.prepare(request.inputs)?;
    record.record.items = inputs.first().map_or(0, Tensor::batch);
    let outputs = model.run(inputs).await?;
    record.record.compute_ms = started.elapsed().as_secs_f64() * 1e3;
    let judgements = model.postprocess(&outputs, &transforms)?;
    record_confidence(record, &judgements);
    let mut available = outputs;
    if let Some(repo::pipeline::Postprocess::Detect(_)) = &model.pipeline.postprocess {
        available.extend(detection_tensors(&judgements));
    }
    let selected = select_outputs(
        &t.id,
        &available,
        &request.outputs,
        request.binary_output,
        model,
    )?;
    Ok(InferResponse {
        model_name: t.id.clone(),
        model_version: t.version.clone(),
        id: request.id,
        outputs: selected,
        judgements,
    })
}

fn record_confidence(record: &mut RecordBuilder, judgements: &[Judgement]) {
    let scores: Vec<f32> = judgements
        .iter()
        .filter_map(Judgement::confidence)
        .collect();
    if !scores.is_empty() {
        record.record.confidence = Some(scores.iter().sum::<f32>() / scores.len() as f32);
        record.record.confidence_min = scores.iter().copied().reduce(f32::min);
    }
}

/// `detections` `[D, 7]` = (batch index, x1, y1, x2, y2, score, class) and `detection_labels`.
fn detection_tensors(judgements: &[Judgement]) -> Vec<Tensor> {
    let mut rows = Vec::new();
    let mut labels = Vec::new();
    for (i, j) in judgements.iter().enumerate() {
        if let Judgement::Detections(found) = j {
            for d in found {
                rows.extend_from_slice(&[
                    i as f32,
                    d.bbox[0],
                    d.bbox[1],
                    d.bbox[2],
                    d.bbox[3],
                    d.score,
                    d.class as f32,
                ]);
                labels.push(
                    d.label
                        .clone()
                        .unwrap_or_else(|| d.class.to_string())
                        .into_bytes(),
                );
            }
        }
    }
    let n = labels.len();
    vec![
        Tensor {
            name: DETECTIONS.into(),
            shape: vec![n, 7],
            data: Data::F32(rows),
        },
        Tensor {
            name: DETECTION_LABELS.into(),
            shape: vec![n],
            data: Data::Bytes(labels),
        },
    ]
}

/// Picks the outputs asked for (all graph outputs, or the detections of a detector, when none
/// is named) and applies the classification extension.
fn select_outputs(
    model_id: &str,
    available: &[Tensor],
    requested: &[RequestedOutput],
    binary_default: bool,
    model: &classic::TensorModel,
) -> Result<Vec<OutputTensor>, ApiError> {
    if requested.is_empty() {
        let detector = matches!(
            model.pipeline.postprocess,
            Some(repo::pipeline::Postprocess::Detect(_))
        );
        return Ok(available
            .iter()
            .filter(|t| !detector || t.name == DETECTIONS || t.name == DETECTION_LABELS)
            .map(|t| OutputTensor {
                tensor: t.clone(),
                binary: binary_default,
            })
            .collect());
    }
    let mut out = Vec::with_capacity(requested.len());
    for r in requested {
        let tensor = available.iter().find(|t| t.name == r.name).ok_or_else(|| {
            ApiError::invalid_param(
                "outputs",
                format!(
                    "model {model_id:?} has no output {:?} (outputs: {})",
                    r.name,
                    available
                        .iter()
                        .map(|t| t.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )
        })?;
        let tensor = match r.classification {
            Some(k) => classification(tensor, k, model.labels.as_deref())?,
            None => tensor.clone(),
        };
        out.push(OutputTensor {
            tensor,
            binary: r.binary,
        });
    }
    Ok(out)
}

/// The classification extension: `[N, k]` strings `score:index[:label]`, best first.
fn classification(t: &Tensor, k: usize, labels: Option<&[String]>) -> Result<Tensor, ApiError> {
    let scores = t.to_f32().ok_or_else(|| {
        ApiError::invalid(format!(
            "output {:?} is not numeric; it cannot be classified",
            t.name
        ))
    })?;
    let classes = *t.shape.last().unwrap_or(&1);
    if k == 0 || classes == 0 {
        return Err(ApiError::invalid(
            "classification needs a class count of at least 1",
        ));
    }
    let k = k.min(classes);
    let rows = scores.len() / classes;
    let mut strings = Vec::with_capacity(rows * k);
    for row in scores.chunks(classes) {
        for c in classic::post::top_k(row, k, labels) {
            strings.push(
                match &c.label {
                    Some(l) => format!("{}:{}:{l}", c.score, c.index),
                    None => format!("{}:{}", c.score, c.index),
                }
                .into_bytes(),
            );
        }
    }
    let mut shape = t.shape.clone();
    if let Some(last) = shape.last_mut() {
        *last = k;
    } else {
        shape = vec![k];
    }
    Ok(Tensor {
        name: t.name.clone(),
        shape,
        data: Data::Bytes(strings),
    })
}

async fn infer_embedding(
    e: &Arc<EmbedderHandle>,
    request: InferRequest,
    record: &mut RecordBuilder,
) -> Result<InferResponse, ApiError> {
    let [input] = request.inputs.as_slice() else {
        return Err(ApiError::invalid(format!(
            "embedding model {:?} takes one input, {TEXT_INPUT:?} (BYTES)",
            e.id
        )));
    };
    let Data::Bytes(items) = &input.data else {
        return Err(ApiError::invalid(format!(
            "input {:?} must be BYTES (UTF-8 text), got {}",
            input.name,
            input.dtype()
        )));
    };
    if input.name != TEXT_INPUT {
        return Err(ApiError::invalid(format!(
            "embedding model {:?} has no input {:?} (inputs: {TEXT_INPUT})",
            e.id, input.name
        )));
    }
    if items.is_empty() {
        return Err(ApiError::invalid(format!("input {TEXT_INPUT:?} is empty")));
    }
    let texts: Vec<String> = items
        .iter()
        .enumerate()
        .map(|(i, b)| {
            String::from_utf8(b.clone()).map_err(|_| {
                ApiError::invalid(format!("input {TEXT_INPUT:?}, element {i}: not UTF-8 text"))
            })
        })
        .collect::<Result<_, _>>()?;
    let n_texts = texts.len();
    let started = Instant::now();
    let (vectors, tokens) = e
        .embed(
            crate::openai::EmbeddingInputs::Texts(texts),
            engine::EmbedOptions {
                truncate: false,
                dimensions: None,
            },
        )
        .await?;
    record.record.prompt_tokens = tokens;
    record.record.items = n_texts;
    record.record.compute_ms = started.elapsed().as_secs_f64() * 1e3;
    let dim = vectors.first().map_or(0, Vec::len);
    let n = vectors.len();
    let tensor = Tensor {
        name: EMBEDDING_OUTPUT.into(),
        shape: vec![n, dim],
        data: Data::F32(vectors.into_iter().flatten().collect()),
    };
    if let Some(other) = request.outputs.iter().find(|o| o.name != EMBEDDING_OUTPUT) {
        return Err(ApiError::invalid_param(
            "outputs",
            format!(
                "model {:?} has no output {:?} (outputs: {EMBEDDING_OUTPUT})",
                e.id, other.name
            ),
        ));
    }
    let binary = request
        .outputs
        .first()
        .map_or(request.binary_output, |o| o.binary);
    Ok(InferResponse {
        model_name: e.id.clone(),
        model_version: e.version.clone(),
        id: request.id,
        outputs: vec![OutputTensor { tensor, binary }],
        judgements: Vec::new(),
    })
}

// ---------------------------------------------------------------------------------------------
// REST binding.

/// The JSON of one input of a REST request.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonInput {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    #[serde(default)]
    parameters: BTreeMap<String, Value>,
    #[serde(default)]
    data: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOutput {
    name: String,
    #[serde(default)]
    parameters: BTreeMap<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: BTreeMap<String, Value>,
    inputs: Vec<JsonInput>,
    #[serde(default)]
    outputs: Vec<JsonOutput>,
}

fn shape_of(name: &str, shape: &[i64]) -> Result<Vec<usize>, ApiError> {
    shape
        .iter()
        .map(|d| {
            usize::try_from(*d).map_err(|_| {
                ApiError::invalid(format!(
                    "input {name:?}: shape {shape:?} has a negative dimension"
                ))
            })
        })
        .collect()
}

fn param_bool(p: &BTreeMap<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    match p.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(other) => Err(ApiError::invalid(format!(
            "parameter {key:?} must be a boolean, got {other}"
        ))),
    }
}

fn param_usize(p: &BTreeMap<String, Value>, key: &str) -> Result<Option<usize>, ApiError> {
    match p.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
            ApiError::invalid(format!(
                "parameter {key:?} must be a non-negative integer, got {v}"
            ))
        }),
    }
}

/// Decodes a REST body: JSON, or JSON followed by binary tensor data when
/// `Inference-Header-Content-Length` is given.
fn decode_rest(
    headers: &HeaderMap,
    body: &[u8],
    max_elements: usize,
) -> Result<InferRequest, ApiError> {
    let header_len = match headers.get("inference-header-content-length") {
        Some(v) => {
            let n: usize = v
                .to_str()
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .ok_or_else(|| {
                    ApiError::invalid("Inference-Header-Content-Length is not a number")
                })?;
            if n > body.len() {
                return Err(ApiError::invalid(format!(
                    "Inference-Header-Content-Length is {n} but the body holds {} bytes",
                    body.len()
                )));
            }
            n
        }
        None => body.len(),
    };
    let (json_part, mut binary) = body.split_at(header_len);
    let request: JsonRequest = serde_json::from_slice(json_part)
        .map_err(|e| ApiError::invalid(format!("invalid inference request JSON: {e}")))?;
    if request.inputs.is_empty() {
        return Err(ApiError::invalid("the request has no inputs"));
    }
    let mut inputs = Vec::with_capacity(request.inputs.len());
    for input in request.inputs {
        let dtype = DType::from_kserve(&input.datatype).ok_or_else(|| {
            ApiError::invalid(format!(
                "input {:?}: unknown datatype {:?} (BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES)",
                input.name, input.datatype
            ))
        })?;
        let shape = shape_of(&input.name, &input.shape)?;
        classic::tensor::element_count(&input.name, &shape, max_elements)?;
        let tensor = match param_usize(&input.parameters, "binary_data_size")? {
            Some(size) => {
                if input.data.is_some() {
                    return Err(ApiError::invalid(format!(
                        "input {:?} has both JSON data and binary_data_size",
                        input.name
                    )));
                }
                if size > binary.len() {
                    return Err(ApiError::invalid(format!(
                        "input {:?}: binary_data_size {size} but only {} binary bytes remain",
                        input.name,
                        binary.len()
                    )));
                }
                let (mine, rest) = binary.split_at(size);
                binary = rest;
                Tensor::from_raw(&input.name, dtype, shape, mine)?
            }
            None => {
                let data = input.data.as_ref().ok_or_else(|| {
                    ApiError::invalid(format!(
                        "input {:?} has neither data nor binary_data_size",
                        input.name
                    ))
                })?;
                Tensor::from_json(&input.name, dtype, shape, data)?
            }
        };
        inputs.push(tensor);
    }
    if !binary.is_empty() {
        return Err(ApiError::invalid(format!(
            "{} bytes of binary data follow the inputs that no input claims",
            binary.len()
        )));
    }
    let binary_output = param_bool(&request.parameters, "binary_data_output")?.unwrap_or(false);
    let mut outputs = Vec::with_capacity(request.outputs.len());
    for o in request.outputs {
        outputs.push(RequestedOutput {
            binary: param_bool(&o.parameters, "binary_data")?.unwrap_or(binary_output),
            classification: param_usize(&o.parameters, "classification")?,
            name: o.name,
        });
    }
    Ok(InferRequest {
        id: request.id,
        inputs,
        outputs,
        binary_output,
    })
}

/// Encodes a response: JSON, plus the binary section for outputs that asked for it.
fn encode_rest(response: &InferResponse, with_results: bool) -> Response {
    let mut binary = Vec::new();
    let outputs: Vec<Value> = response
        .outputs
        .iter()
        .map(|o| {
            let t = &o.tensor;
            let mut v = json!({
                "name": t.name,
                "datatype": t.dtype().kserve(),
                "shape": t.shape,
            });
            if o.binary {
                let raw = t.to_raw();
                v["parameters"] = json!({"binary_data_size": raw.len()});
                binary.extend_from_slice(&raw);
            } else {
                v["data"] = t.to_json();
            }
            v
        })
        .collect();
    let mut body = json!({
        "model_name": response.model_name,
        "model_version": response.model_version,
        "outputs": outputs,
    });
    if let Some(id) = &response.id {
        body["id"] = json!(id);
    }
    if with_results && !response.judgements.is_empty() {
        body["results"] = json!(response.judgements);
    }
    let json_bytes = serde_json::to_vec(&body).unwrap_or_default();
    if binary.is_empty() {
        return (
            StatusCode::OK,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            json_bytes,
        )
            .into_response();
    }
    let header_len = json_bytes.len();
    let mut all = json_bytes;
    all.extend_from_slice(&binary);
    let mut r = (
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "application/octet-stream")],
        all,
    )
        .into_response();
    r.headers_mut().insert(
        "inference-header-content-length",
        HeaderValue::from(header_len as u64),
    );
    r
}

/// KServe error bodies: `{"error": "message"}`, with the stable type beside it.
pub fn rest_error(e: &ApiError) -> Response {
    let mut r = e.clone().into_response();
    let body = json!({"error": e.to_string(), "type": e.kind(), "code": e.code()});
    *r.body_mut() = Body::from(serde_json::to_vec(&body).unwrap_or_default());
    r
}

fn rest_result(r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| rest_error(&e))
}

pub async fn server_metadata() -> Json<Value> {
    Json(json!({
        "name": "rampart",
        "version": env!("CARGO_PKG_VERSION"),
        "extensions": EXTENSIONS,
    }))
}

pub async fn health_live() -> StatusCode {
    StatusCode::OK
}

pub async fn health_ready(State(state): State<Arc<AppState>>) -> StatusCode {
    if state.not_ready_reason().is_some() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

pub async fn model_metadata(
    State(state): State<Arc<AppState>>,
    Path(name): Path<String>,
) -> Response {
    rest_result(find(&state, &name, None).map(|s| Json(metadata(&state, &s)).into_response()))
}

pub async fn model_version_metadata(
    State(state): State<Arc<AppState>>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    rest_result(
        find(&state, &name, Some(&version)).map(|s| Json(metadata(&state, &s)).into_response()),
    )
}

pub async fn model_ready(State(state): State<Arc<AppState>>, Path(name): Path<String>) -> Response {
    rest_result(ready_of(&state, &name, None))
}

pub async fn model_version_ready(
    State(state): State<Arc<AppState>>,
    Path((name, version)): Path<(String, String)>,
) -> Response {
    rest_result(ready_of(&state, &name, Some(&version)))
}

fn ready_of(state: &AppState, name: &str, version: Option<&str>) -> Result<Response, ApiError> {
    let served = find(state, name, version)?;
    let ready = !state.is_draining();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Ok((
        status,
        Json(json!({"name": served.id(), "version": served.version(), "ready": ready})),
    )
        .into_response())
}

pub async fn model_infer(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    rest_infer(state, id, principal, name, None, headers, body).await
}

pub async fn model_version_infer(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    Path((name, version)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    rest_infer(state, id, principal, name, Some(version), headers, body).await
}

/// Content types of the raw-image input.
fn is_image_body(headers: &HeaderMap) -> bool {
    headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            let v = v
                .split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase();
            v.starts_with("image/") || v == "application/octet-stream"
        })
        .unwrap_or(false)
        && !headers.contains_key("inference-header-content-length")
}

async fn rest_infer(
    state: Arc<AppState>,
    id: RequestId,
    principal: Principal,
    name: String,
    version: Option<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut record = RecordBuilder::new(id.0, principal.0.clone(), "kserve_infer", observe::emit);
    let result = async {
        let limit = state.config.limits.max_tensor_body_bytes;
        let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|_| {
            observe::rejected("none", "body_too_large");
            ApiError::BodyTooLarge(format!(
                "the request body exceeds the limit of {limit} bytes"
            ))
        })?;
        let served = find(&state, &name, version.as_deref())?;
        let raw_image = is_image_body(&headers);
        let request = if raw_image {
            let Served::Tensor(t) = &served else {
                return Err(ApiError::invalid(format!(
                    "model {name:?} takes text, not images"
                )));
            };
            let input = t.model.image_input().ok_or_else(|| {
                ApiError::invalid(format!(
                    "model {name:?} declares no image pre-processing; send tensors as JSON"
                ))
            })?;
            InferRequest {
                id: None,
                inputs: vec![Tensor {
                    name: input.to_string(),
                    shape: vec![1],
                    data: Data::Bytes(vec![bytes.to_vec()]),
                }],
                outputs: Vec::new(),
                binary_output: false,
            }
        } else {
            decode_rest(&headers, &bytes, state.config.limits.max_tensor_elements)?
        };
        let response = infer(&state, &principal.0, &served, request, &mut record).await?;
        Ok(encode_rest(&response, raw_image))
    }
    .await;
    match result {
        Ok(r) => {
            record.record.finish_reason = Some("stop".into());
            record.finish();
            r
        }
        Err(e) => {
            record.fail(e.status().as_u16(), e.kind());
            record.finish();
            rest_error(&e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(json_len: Option<usize>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(n) = json_len {
            h.insert(
                "inference-header-content-length",
                HeaderValue::from(n as u64),
            );
        }
        h
    }

    #[test]
    fn json_and_binary_requests_decode() {
        let body = br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1,2],"data":[[1,2]]}],"outputs":[{"name":"y","parameters":{"classification":2}}]}"#;
        let r = decode_rest(&headers(None), body, 1 << 20).unwrap();
        assert_eq!(r.inputs[0].as_f32().unwrap(), &[1.0, 2.0]);
        assert_eq!(r.outputs[0].classification, Some(2));

        let header = br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}],"parameters":{"binary_data_output":true}}"#;
        let mut body = header.to_vec();
        body.extend_from_slice(&1.5f32.to_le_bytes());
        body.extend_from_slice(&(-2f32).to_le_bytes());
        let r = decode_rest(&headers(Some(header.len())), &body, 1 << 20).unwrap();
        assert_eq!(r.inputs[0].as_f32().unwrap(), &[1.5, -2.0]);
        assert!(r.binary_output);
    }

    #[test]
    fn malformed_requests_are_precise_400s() {
        let cases: [(&[u8], Option<usize>, &str); 7] = [
            (br#"{"inputs":[{"name":"x","datatype":"FP33","shape":[1],"data":[1]}]}"#, None, "unknown datatype"),
            (br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[-1],"data":[1]}]}"#, None, "negative dimension"),
            (br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[3],"data":[1]}]}"#, None, "needs 3 elements"),
            (br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}]}"#, Some(500), "Content-Length is 500"),
            (br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1]}]}"#, None, "neither data"),
            (br#"{"inputs":[]}"#, None, "no inputs"),
            (br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1000000,1000000,1000000],"data":[1]}]}"#, None, "more than"),
        ];
        for (body, len, want) in cases {
            let e = decode_rest(&headers(len), body, 1 << 20).unwrap_err();
            assert_eq!(e.status(), StatusCode::BAD_REQUEST);
            assert!(e.to_string().contains(want), "{e} (wanted {want:?})");
        }
    }

    #[test]
    fn classification_extension_formats_score_index_label() {
        let t = Tensor::new("p", vec![1, 3], Data::F32(vec![0.1, 0.7, 0.2])).unwrap();
        let labels = vec!["a".to_string(), "b".into(), "c".into()];
        let c = classification(&t, 2, Some(&labels)).unwrap();
        assert_eq!(c.shape, vec![1, 2]);
        let Data::Bytes(v) = &c.data else { panic!() };
        assert_eq!(String::from_utf8_lossy(&v[0]), "0.7:1:b");
        assert_eq!(String::from_utf8_lossy(&v[1]), "0.2:2:c");
    }
}
