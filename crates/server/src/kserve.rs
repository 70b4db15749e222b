//! KServe v2 / Open Inference Protocol: what metadata and readiness mean for the models it
//! addresses (tensor and embedding models), and the REST binding, with the binary-tensor
//! extension, the classification extension and a raw-image input. The gRPC binding (`grpc`)
//! shares [`find`] and [`metadata`]; both decode into the backend seam's tensor request and call
//! the front.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use classic::tensor_json::{self, DecodeBudget};
use classic::{DType, Data, Tensor};
use record::RecordBuilder;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::backend::tensor::wire_shape;
use crate::backend::{InferRequest, InferResponse, Kind, RequestedOutput, TensorSpec, WorkKind};
use crate::error::ApiError;
use crate::error::WireError;
use crate::front;
use crate::identity::{self, Principal, RequestId};
use crate::model_path::ModelPath;
use crate::registry::{Entry, ModelName};
use crate::state::AppState;

/// Protocol extensions this server implements.
pub const EXTENSIONS: [&str; 3] = ["binary_tensor_data", "classification", "model_metadata"];

#[derive(Debug, Clone, Serialize)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<String>,
    pub platform: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

/// The tensor or embedding model `name` (at `version`, or its stable version).
pub fn find(state: &AppState, name: &str, version: Option<&str>) -> Result<Arc<Entry>, ApiError> {
    state
        .front
        .registry
        .resolve(&ModelName::versioned(name, version), WorkKind::Tensors)
}

pub fn metadata(state: &AppState, entry: &Entry) -> ModelMetadata {
    let d = entry.backend.describe();
    ModelMetadata {
        name: entry.name.clone(),
        versions: state.front.registry.versions(&entry.name),
        platform: d.platform,
        inputs: d.inputs,
        outputs: d.outputs,
    }
}

// ---------------------------------------------------------------------------------------------
// REST binding.

/// Most dimensions a tensor's shape may list.
pub const MAX_DIMS: usize = 32;
/// Most inputs (and most requested outputs) in one request.
pub const MAX_TENSORS: usize = 1024;

/// The JSON of one input of a REST request. Its `data` and every parameter stay as their
/// text in the body ([`RawValue`]): `data` is read into the typed buffer of the declared
/// datatype and shape once the whole input is known (a JSON object's keys come in any order),
/// and only the parameters this server knows are read at all.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonInput<'a> {
    name: String,
    datatype: String,
    #[serde(deserialize_with = "at_most::<_, i64, MAX_DIMS>")]
    shape: Vec<i64>,
    #[serde(default, borrow)]
    parameters: Parameters<'a>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonOutput<'a> {
    name: String,
    #[serde(default, borrow)]
    parameters: Parameters<'a>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonRequest<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default, borrow)]
    parameters: Parameters<'a>,
    #[serde(borrow, deserialize_with = "at_most::<_, JsonInput<'a>, MAX_TENSORS>")]
    inputs: Vec<JsonInput<'a>>,
    #[serde(
        default,
        borrow,
        deserialize_with = "at_most::<_, JsonOutput<'a>, MAX_TENSORS>"
    )]
    outputs: Vec<JsonOutput<'a>>,
}

/// Parameters as their JSON text: only the known keys are ever read.
type Parameters<'a> = BTreeMap<String, &'a RawValue>;

/// A JSON array of at most `MAX` elements (refused at the first beyond).
fn at_most<'de, D, T, const MAX: usize>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Capped<T, const MAX: usize>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>, const MAX: usize> serde::de::Visitor<'de> for Capped<T, MAX> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            write!(f, "an array of at most {MAX} elements")
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element()? {
                if items.len() == MAX {
                    return Err(serde::de::Error::custom(format!(
                        "more than {MAX} elements in an array limited to {MAX}"
                    )));
                }
                items.push(item);
            }
            Ok(items)
        }
    }
    deserializer.deserialize_seq(Capped::<T, MAX>(std::marker::PhantomData))
}

/// A parameter's text for an error message (cut: it is the client's).
fn shown(raw: &RawValue) -> String {
    let text = raw.get();
    match text.char_indices().nth(40) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}

fn param_bool(p: &Parameters, key: &str) -> Result<Option<bool>, ApiError> {
    match p.get(key) {
        None => Ok(None),
        Some(raw) => serde_json::from_str(raw.get()).map(Some).map_err(|_| {
            ApiError::invalid(format!(
                "parameter {key:?} must be a boolean, got {}",
                shown(raw)
            ))
        }),
    }
}

fn param_usize(p: &Parameters, key: &str) -> Result<Option<usize>, ApiError> {
    match p.get(key) {
        None => Ok(None),
        Some(raw) => serde_json::from_str::<u64>(raw.get())
            .ok()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                ApiError::invalid(format!(
                    "parameter {key:?} must be a non-negative integer, got {}",
                    shown(raw)
                ))
            }),
    }
}

/// What a REST body may decode to.
#[derive(Debug, Clone, Copy)]
struct DecodeLimits {
    /// Most elements in one input.
    max_elements: usize,
    /// Most bytes of typed buffers, all inputs together.
    max_decoded_bytes: usize,
}

impl DecodeLimits {
    fn of(limits: &crate::config::Limits) -> Self {
        Self {
            max_elements: limits.max_tensor_elements,
            max_decoded_bytes: limits.max_tensor_decoded_bytes,
        }
    }
}

/// Decodes a REST body: JSON, or JSON followed by binary tensor data when
/// `Inference-Header-Content-Length` is given. The body is never held as a `serde_json::Value`:
/// each input's data goes straight into the typed buffer of its declared datatype, its element
/// count checked against the declared shape as it is read, and every buffer is taken from one
/// budget before it is made (a shape that overflows or exceeds the limits is refused first).
fn decode_rest(
    headers: &HeaderMap,
    body: &[u8],
    limits: DecodeLimits,
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
    let mut budget = DecodeBudget::new(limits.max_decoded_bytes);
    let mut inputs = Vec::with_capacity(request.inputs.len());
    for input in request.inputs {
        let dtype = DType::from_kserve(&input.datatype).ok_or_else(|| {
            ApiError::invalid(format!(
                "input {:?}: unknown datatype {:?} (BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES)",
                input.name, input.datatype
            ))
        })?;
        let shape = wire_shape(&input.name, &input.shape)?;
        let n = classic::tensor::element_count(&input.name, &shape, limits.max_elements)?;
        let tensor = match param_usize(&input.parameters, "binary_data_size")? {
            Some(size) => {
                if input.data.is_some() {
                    return Err(ApiError::invalid(format!(
                        "input {:?} has both JSON data and binary_data_size",
                        input.name
                    )));
                }
                if let Some(want) = dtype.size().and_then(|s| s.checked_mul(n)) {
                    if size != want {
                        return Err(ApiError::invalid(format!(
                            "input {:?}: binary_data_size is {size} but {dtype} shape {shape:?} needs {want} bytes",
                            input.name
                        )));
                    }
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
                Tensor::from_raw_within(&input.name, dtype, shape, mine, &mut budget)?
            }
            None => {
                let data = input.data.ok_or_else(|| {
                    ApiError::invalid(format!(
                        "input {:?} has neither data nor binary_data_size",
                        input.name
                    ))
                })?;
                tensor_json::read_data(
                    &input.name,
                    dtype,
                    shape,
                    data.get(),
                    limits.max_elements,
                    &mut budget,
                )?
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
        fallback_level: 0,
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
    let mut body = json!({"error": e.to_string(), "type": e.kind(), "code": e.code()});
    if let ApiError::HumanHandoff { url: Some(url), .. } = e {
        body["handoff_url"] = json!(url);
    }
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

pub async fn model_metadata(State(state): State<Arc<AppState>>, model: ModelPath) -> Response {
    rest_result(
        find(&state, model.name(), None).map(|s| Json(metadata(&state, &s)).into_response()),
    )
}

pub async fn model_version_metadata(
    State(state): State<Arc<AppState>>,
    model: ModelPath,
) -> Response {
    rest_result(
        find(&state, model.name(), model.version().as_deref())
            .map(|s| Json(metadata(&state, &s)).into_response()),
    )
}

pub async fn model_ready(State(state): State<Arc<AppState>>, model: ModelPath) -> Response {
    rest_result(ready_of(&state, model.name(), None))
}

pub async fn model_version_ready(State(state): State<Arc<AppState>>, model: ModelPath) -> Response {
    rest_result(ready_of(&state, model.name(), model.version().as_deref()))
}

fn ready_of(state: &AppState, name: &str, version: Option<&str>) -> Result<Response, ApiError> {
    let served = find(state, name, version)?;
    let ready = !state.front.is_draining();
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    Ok((
        status,
        Json(json!({"name": served.name, "version": served.version, "ready": ready})),
    )
        .into_response())
}

pub async fn model_infer(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    model: ModelPath,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let name = model.name().to_string();
    rest_infer(state, id, principal, name, None, headers, body).await
}

pub async fn model_version_infer(
    State(state): State<Arc<AppState>>,
    Extension(id): Extension<RequestId>,
    Extension(principal): Extension<Principal>,
    model: ModelPath,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (name, version) = (model.name().to_string(), model.version());
    rest_infer(state, id, principal, name, version, headers, body).await
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

/// Decode → front → encode.
#[tracing::instrument(name = "kserve", skip_all, fields(request_id = %id.0, model = %name))]
async fn rest_infer(
    state: Arc<AppState>,
    id: RequestId,
    principal: Principal,
    name: String,
    version: Option<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut record = state
        .front
        .record(id.0, principal.0.clone(), "kserve_infer");
    let model = ModelName::versioned(&name, version.as_deref());
    let result = infer(&state, &principal.0, &model, &headers, body, &mut record).await;
    let mut response = front::conclude(&mut record, result)
        .await
        .unwrap_or_else(|e| rest_error(&e));
    crate::marks::mark_audit(&mut response, &record.record.audit_id);
    crate::feedback_routes::stamp(&state, &mut response, &record.record.audit_id);
    response
}

async fn infer(
    state: &Arc<AppState>,
    principal: &str,
    model: &ModelName,
    headers: &HeaderMap,
    body: Body,
    record: &mut RecordBuilder,
) -> Result<Response, ApiError> {
    // The model is named in the path: an unknown one is refused before its body is read.
    let entry = front::locate(&state.front, model, WorkKind::Tensors, record).await?;
    // The body is read outside the model's slot (a slow sender holds no place in flight);
    // its decode, the costly part (typed buffers up to `max_tensor_decoded_bytes`), runs in it.
    let content_length = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let limit = state.config.limits.max_tensor_body_bytes;
    let bytes = identity::read_sized_body(body, content_length, limit, record).await?;
    let reserved = front::reserve(&state.front, principal, Arc::clone(&entry), record).await?;
    let raw_image = is_image_body(headers);
    let request = decode_body(state, &entry, &model.name, headers, bytes, raw_image).await?;
    let with_bytes = state.config.audit.store_tensor_inputs;
    let (response, fallback) = front::serve_tensors(
        &state.front,
        principal,
        reserved,
        request,
        with_bytes,
        record,
    )
    .await?;
    let mut encoded = encode_rest(&response, raw_image);
    crate::marks::mark_fallback(&mut encoded, fallback.as_ref());
    Ok(encoded)
}

/// A request body as the model's tensors: a raw image through the model's image input, or a
/// KServe JSON body, a long one decoded on the prepare lane (off the async workers, below the
/// compute's priority: 100 MiB take a second to decode), a short one here. The typed tensors
/// hold the data afterwards: the body's bytes go before the model runs.
async fn decode_body(
    state: &AppState,
    entry: &Entry,
    model: &str,
    headers: &HeaderMap,
    bytes: axum::body::Bytes,
    raw_image: bool,
) -> Result<InferRequest, ApiError> {
    if raw_image {
        return image_request(entry, model, bytes);
    }
    let decode_limits = DecodeLimits::of(&state.config.limits);
    if bytes.len() <= INLINE_DECODE_BYTES {
        return decode_rest(headers, &bytes, decode_limits);
    }
    let headers = headers.clone();
    state
        .prepare_lane
        .run(move || decode_rest(&headers, &bytes, decode_limits))
        .await?
}

/// JSON bodies up to this size are decoded on the request's task (well under a millisecond);
/// longer ones on the decode lane.
const INLINE_DECODE_BYTES: usize = 64 * 1024;

/// A raw image body: one encoded image into the model's image input.
fn image_request(entry: &Entry, name: &str, bytes: Bytes) -> Result<InferRequest, ApiError> {
    if entry.kind() != Kind::Tensor {
        return Err(ApiError::invalid(format!(
            "model {name:?} takes text, not images"
        )));
    }
    let input = entry.backend.describe().image_input.ok_or_else(|| {
        ApiError::invalid(format!(
            "model {name:?} declares no image pre-processing; send tensors as JSON"
        ))
    })?;
    Ok(InferRequest {
        id: None,
        inputs: vec![Tensor {
            name: input,
            shape: vec![1],
            data: Data::Bytes(vec![Vec::from(bytes)]),
        }],
        outputs: Vec::new(),
        binary_output: false,
        fallback_level: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: DecodeLimits = DecodeLimits {
        max_elements: 1 << 20,
        max_decoded_bytes: 100 << 20,
    };

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
        let r = decode_rest(&headers(None), body, LIMITS).unwrap();
        assert_eq!(r.inputs[0].as_f32().unwrap(), &[1.0, 2.0]);
        assert_eq!(r.outputs[0].classification, Some(2));

        let header = br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[2],"parameters":{"binary_data_size":8}}],"parameters":{"binary_data_output":true}}"#;
        let mut body = header.to_vec();
        body.extend_from_slice(&1.5f32.to_le_bytes());
        body.extend_from_slice(&(-2f32).to_le_bytes());
        let r = decode_rest(&headers(Some(header.len())), &body, LIMITS).unwrap();
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
            let e = decode_rest(&headers(len), body, LIMITS).unwrap_err();
            assert_eq!(e.status(), StatusCode::BAD_REQUEST);
            assert!(e.to_string().contains(want), "{e} (wanted {want:?})");
        }
    }
}
