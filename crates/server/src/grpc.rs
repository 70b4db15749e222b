//! KServe v2 / Open Inference Protocol over gRPC: `inference.GRPCInferenceService` from the
//! Triton protocol files (proto/, as `tritonclient.grpc` speaks it), bound to the same core as
//! the REST binding ([`crate::kserve`]: find, metadata, infer). This module only translates:
//! protobuf tensors to [`Tensor`]s and back, API keys from the `authorization` metadata (checked
//! by the same code as over HTTP), and [`ApiError`] to [`Status`] (its one map, in `error`).
//!
//! Requests take tensors either in `contents` (typed fields) or in `raw_input_contents`
//! (little-endian, `BYTES` as a 4-byte length before each element); responses always use
//! `raw_output_contents`, which is what `tritonclient` reads. `ModelStreamInfer` answers each
//! request of the stream with one response; a request that fails puts its error in
//! `error_message` and the stream goes on.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use classic::tensor_json::DecodeBudget;
use classic::{DType, Data, Tensor};
use futures_util::{Stream, StreamExt};
use tokio::net::TcpListener;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Request, Response, Status, Streaming};

use record::RecordBuilder;

use crate::backend::tensor::wire_shape;
use crate::backend::{InferRequest, InferResponse, RequestedOutput, WorkKind};
use crate::config::GrpcConfig;
use crate::error::ApiError;
use crate::error::WireError;
use crate::front;
use crate::identity::{self, Transport};
use crate::kserve;
use crate::registry::ModelName;
use crate::state::AppState;

/// The generated protocol types and service trait (package `inference`).
#[allow(clippy::all, clippy::pedantic, missing_docs)]
pub mod proto {
    tonic::include_proto!("inference");
}

use proto::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use proto::infer_parameter::ParameterChoice;
use proto::model_infer_request::InferInputTensor;
use proto::model_infer_response::InferOutputTensor;
use proto::model_metadata_response::TensorMetadata;
use proto::*;

/// The record's `endpoint` for gRPC inference, and for everything else over gRPC.
const INFER_ENDPOINT: &str = "kserve_grpc_infer";
const ENDPOINT: &str = "kserve_grpc";

/// The service: the application state, shared with the HTTP server.
#[derive(Debug, Clone)]
pub struct Inference {
    state: Arc<AppState>,
}

impl Inference {
    pub fn new(state: Arc<AppState>) -> Self {
        Self { state }
    }

    /// The principal of the `authorization: Bearer KEY` metadata (as over HTTP).
    async fn authenticate(
        &self,
        metadata: &MetadataMap,
        endpoint: &'static str,
        request_id: &str,
    ) -> Result<String, Status> {
        let authorization = metadata.get("authorization").and_then(|v| v.to_str().ok());
        match identity::authenticate(
            &self.state,
            authorization,
            Transport::Grpc,
            request_id,
            endpoint,
            Some(crate::auth::Scope::Infer),
        ) {
            Ok((principal, _)) => Ok(principal),
            Err(e) => {
                identity::pause_refusal(&self.state, &e).await;
                Err(e.grpc_status())
            }
        }
    }

    /// One inference: decode → front → encode, its record settled when it ends.
    #[tracing::instrument(name = "grpc", skip_all, fields(request_id = %request_id, model = %request.model_name))]
    async fn infer_one(
        &self,
        principal: &str,
        origin: identity::Origin,
        request_id: String,
        request: ModelInferRequest,
    ) -> Result<ModelInferResponse, ApiError> {
        identity::with_origin(origin, async {
            let mut record =
                self.state
                    .front
                    .record(request_id, principal.to_string(), INFER_ENDPOINT);
            let result = self.infer(principal, request, &mut record).await;
            front::conclude(&mut record, result).await
        })
        .await
    }

    async fn infer(
        &self,
        principal: &str,
        request: ModelInferRequest,
        record: &mut RecordBuilder,
    ) -> Result<ModelInferResponse, ApiError> {
        let model = ModelName::versioned(&request.model_name, Some(&request.model_version));
        let front = &self.state.front;
        let entry = front::locate(front, &model, WorkKind::Tensors, record).await?;
        // The message is already decoded (bounded by `grpc.max_message_bytes`); its tensors are
        // converted in the model's slot, as over REST.
        let reserved = front::reserve(front, principal, entry, record).await?;
        let limits = &self.state.config.limits;
        let decoded = decode(
            request,
            limits.max_tensor_elements,
            limits.max_tensor_decoded_bytes,
        )?;
        let with_bytes = self.state.config.audit.store_tensor_inputs;
        let (response, fallback) =
            front::serve_tensors(front, principal, reserved, decoded, with_bytes, record).await?;
        let mut encoded = encode(response);
        // A degraded answer says so in its parameters (and, unary, in the metadata).
        if let Some(f) = &fallback {
            encoded.parameters.insert(
                FALLBACK_PARAMETER.to_string(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::StringParam(f.header())),
                },
            );
        }
        Ok(encoded)
    }
}

/// The response parameter that marks a degraded answer (the value of `x-rampart-fallback`).
pub const FALLBACK_PARAMETER: &str = "rampart_fallback";

/// The client's `x-request-id` when it is sane, else a fresh UUIDv4 (as over HTTP).
/// The operator and trace of a call (`x-operator-id`, `traceparent`, `tracestate` metadata).
fn origin(metadata: &MetadataMap, releases: &crate::config::ReleasesConfig) -> identity::Origin {
    let get = |k: &str| metadata.get(k).and_then(|v| v.to_str().ok());
    identity::origin_from_headers(get("x-operator-id"), get("traceparent"), get("tracestate"))
        .with_routing(get(&releases.user_header), get(&releases.group_header))
}

fn request_id(metadata: &MetadataMap) -> String {
    identity::request_id(metadata.get("x-request-id").and_then(|v| v.to_str().ok()))
}

fn with_request_id<T>(mut response: Response<T>, id: &str) -> Response<T> {
    if let Ok(v) = MetadataValue::try_from(id) {
        response.metadata_mut().insert("x-request-id", v);
    }
    response
}

/// The typed field of `InferTensorContents` each datatype travels in.
fn contents_field(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::Bool => "bool_contents",
        DType::I8 | DType::I16 | DType::I32 => "int_contents",
        DType::I64 => "int64_contents",
        DType::U8 | DType::U16 | DType::U32 => "uint_contents",
        DType::U64 => "uint64_contents",
        DType::F32 => "fp32_contents",
        DType::F64 => "fp64_contents",
        DType::Bytes => "bytes_contents",
        DType::F16 => return None,
    })
}

/// Narrows the 32-bit typed fields to INT8/INT16/UINT8/UINT16, refusing values out of range.
fn narrow<S, T>(name: &str, dtype: DType, values: &[S]) -> Result<Vec<T>, ApiError>
where
    S: Copy + std::fmt::Display,
    T: TryFrom<S>,
{
    values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            T::try_from(*v).map_err(|_| {
                ApiError::invalid(format!(
                    "input {name:?}: element {i} ({v}) is out of range for {dtype}"
                ))
            })
        })
        .collect()
}

/// A tensor from the typed `contents` fields, which it takes (no copy for the types that
/// travel in their own width). The field's length is checked against the declared shape before
/// anything is converted.
fn from_contents(
    name: &str,
    dtype: DType,
    shape: Vec<usize>,
    n: usize,
    c: &mut InferTensorContents,
    budget: &mut DecodeBudget,
) -> Result<Tensor, ApiError> {
    let Some(field) = contents_field(dtype) else {
        return Err(ApiError::invalid(format!(
            "input {name:?}: {dtype} has no typed contents field; send it in raw_input_contents"
        )));
    };
    let filled = [
        ("bool_contents", c.bool_contents.len()),
        ("int_contents", c.int_contents.len()),
        ("int64_contents", c.int64_contents.len()),
        ("uint_contents", c.uint_contents.len()),
        ("uint64_contents", c.uint64_contents.len()),
        ("fp32_contents", c.fp32_contents.len()),
        ("fp64_contents", c.fp64_contents.len()),
        ("bytes_contents", c.bytes_contents.len()),
    ];
    if let Some((other, _)) = filled.iter().find(|(f, n)| *n > 0 && *f != field) {
        return Err(ApiError::invalid(format!(
            "input {name:?}: {dtype} data goes in contents.{field}, not contents.{other}"
        )));
    }
    let held = filled
        .iter()
        .find(|(f, _)| *f == field)
        .map_or(0, |(_, len)| *len);
    if held != n {
        return Err(ApiError::invalid(format!(
            "input {name:?}: shape {shape:?} needs {n} elements, got {held} in contents.{field}"
        )));
    }
    budget.take_elements(name, dtype, n)?;
    if dtype == DType::Bytes {
        budget.take(name, c.bytes_contents.iter().map(Vec::len).sum())?;
    }
    use std::mem::take;
    let data = match dtype {
        DType::Bool => Data::Bool(take(&mut c.bool_contents)),
        DType::I8 => Data::I8(narrow(name, dtype, &c.int_contents)?),
        DType::I16 => Data::I16(narrow(name, dtype, &c.int_contents)?),
        DType::I32 => Data::I32(take(&mut c.int_contents)),
        DType::I64 => Data::I64(take(&mut c.int64_contents)),
        DType::U8 => Data::U8(narrow(name, dtype, &c.uint_contents)?),
        DType::U16 => Data::U16(narrow(name, dtype, &c.uint_contents)?),
        DType::U32 => Data::U32(take(&mut c.uint_contents)),
        DType::U64 => Data::U64(take(&mut c.uint64_contents)),
        DType::F32 => Data::F32(take(&mut c.fp32_contents)),
        DType::F64 => Data::F64(take(&mut c.fp64_contents)),
        DType::Bytes => Data::Bytes(take(&mut c.bytes_contents)),
        DType::F16 => unreachable!("FP16 has no contents field (refused above)"),
    };
    Ok(Tensor::new(name, shape, data)?)
}

fn has_contents(input: &InferInputTensor) -> bool {
    input.contents.as_ref().is_some_and(|c| {
        !(c.bool_contents.is_empty()
            && c.int_contents.is_empty()
            && c.int64_contents.is_empty()
            && c.uint_contents.is_empty()
            && c.uint64_contents.is_empty()
            && c.fp32_contents.is_empty()
            && c.fp64_contents.is_empty()
            && c.bytes_contents.is_empty())
    })
}

/// A non-negative integer parameter (`int64_param` or `uint64_param`).
fn param_count(
    params: &std::collections::HashMap<String, InferParameter>,
    key: &str,
) -> Result<Option<usize>, ApiError> {
    match params.get(key).and_then(|p| p.parameter_choice.as_ref()) {
        None => Ok(None),
        Some(ParameterChoice::Int64Param(n)) if *n >= 0 => Ok(Some(*n as usize)),
        Some(ParameterChoice::Uint64Param(n)) => Ok(Some(*n as usize)),
        Some(other) => Err(ApiError::invalid(format!(
            "parameter {key:?} must be a non-negative int64_param, got {other:?}"
        ))),
    }
}

/// Decodes a gRPC request into the core's request, taking its tensors out of the message:
/// typed contents are moved, each raw entry is converted and then dropped, so the message's
/// data is not held twice. Each input's declared shape is checked (overflow, the element
/// limit, the decoded-bytes budget) and its data's length against it before it is converted.
fn decode(
    mut request: ModelInferRequest,
    max_elements: usize,
    max_decoded_bytes: usize,
) -> Result<InferRequest, ApiError> {
    if request.inputs.is_empty() {
        return Err(ApiError::invalid("the request has no inputs"));
    }
    let raw_count = request.raw_input_contents.len();
    if raw_count != 0 && raw_count != request.inputs.len() {
        return Err(ApiError::invalid(format!(
            "raw_input_contents holds {} entries for {} inputs; when it is used, it holds one per input, in order",
            raw_count,
            request.inputs.len()
        )));
    }
    let mut raw = std::mem::take(&mut request.raw_input_contents).into_iter();
    let mut budget = DecodeBudget::new(max_decoded_bytes);
    let mut inputs = Vec::with_capacity(request.inputs.len());
    for input in &mut request.inputs {
        let name = &input.name;
        let dtype = DType::from_kserve(&input.datatype).ok_or_else(|| {
            ApiError::invalid(format!(
                "input {name:?}: unknown datatype {:?} (BOOL, UINT8..UINT64, INT8..INT64, FP16, FP32, FP64, BYTES)",
                input.datatype
            ))
        })?;
        let shape = wire_shape(name, &input.shape)?;
        let n = classic::tensor::element_count(name, &shape, max_elements)?;
        let tensor = match raw.next() {
            Some(bytes) => {
                if has_contents(input) {
                    return Err(ApiError::invalid(format!(
                        "input {name:?} has both contents and raw_input_contents"
                    )));
                }
                Tensor::from_raw_within(name, dtype, shape, &bytes, &mut budget)?
            }
            None => {
                let mut contents = input.contents.take().unwrap_or_default();
                from_contents(name, dtype, shape, n, &mut contents, &mut budget)?
            }
        };
        inputs.push(tensor);
    }
    let mut outputs = Vec::with_capacity(request.outputs.len());
    for o in &request.outputs {
        outputs.push(RequestedOutput {
            name: o.name.clone(),
            binary: true,
            classification: param_count(&o.parameters, "classification")?,
        });
    }
    Ok(InferRequest {
        id: (!request.id.is_empty()).then_some(request.id),
        inputs,
        outputs,
        binary_output: true,
        fallback_level: 0,
    })
}

fn dims(shape: &[usize]) -> Vec<i64> {
    shape.iter().map(|d| *d as i64).collect()
}

/// Encodes the core's response: every output in `raw_output_contents`.
fn encode(response: InferResponse) -> ModelInferResponse {
    let mut outputs = Vec::with_capacity(response.outputs.len());
    let mut raw = Vec::with_capacity(response.outputs.len());
    for o in &response.outputs {
        let t = &o.tensor;
        outputs.push(InferOutputTensor {
            name: t.name.clone(),
            datatype: t.dtype().kserve().to_string(),
            shape: dims(&t.shape),
            parameters: Default::default(),
            contents: None,
        });
        raw.push(t.to_raw());
    }
    ModelInferResponse {
        model_name: response.model_name,
        model_version: response.model_version,
        id: response.id.unwrap_or_default(),
        parameters: Default::default(),
        outputs,
        raw_output_contents: raw,
    }
}

fn unimplemented(rpc: &str) -> Status {
    Status::unimplemented(format!(
        "{rpc} is not implemented by rampart; the KServe v2 RPCs are ServerLive, ServerReady, \
         ModelReady, ServerMetadata, ModelMetadata, ModelInfer and ModelStreamInfer"
    ))
}

type ResponseStream =
    Pin<Box<dyn Stream<Item = Result<ModelStreamInferResponse, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl GrpcInferenceService for Inference {
    /// Anonymous, like `/v2/health/live`.
    async fn server_live(
        &self,
        _request: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    /// Anonymous, like `/v2/health/ready`.
    async fn server_ready(
        &self,
        _request: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.state.not_ready_reason().is_none(),
        }))
    }

    /// Not ready while draining; a model not served here is not ready either (as Triton says,
    /// and as `tritonclient`'s HTTP `is_model_ready` reads a 404).
    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let id = request_id(request.metadata());
        self.authenticate(request.metadata(), ENDPOINT, &id).await?;
        let r = request.get_ref();
        let ready = match kserve::find(&self.state, &r.name, Some(&r.version)) {
            Ok(_) => !self.state.front.is_draining(),
            Err(ApiError::ModelNotFound(_)) => false,
            Err(e) => return Err(e.grpc_status()),
        };
        Ok(with_request_id(
            Response::new(ModelReadyResponse { ready }),
            &id,
        ))
    }

    async fn server_metadata(
        &self,
        request: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        let id = request_id(request.metadata());
        self.authenticate(request.metadata(), ENDPOINT, &id).await?;
        Ok(with_request_id(
            Response::new(ServerMetadataResponse {
                name: "rampart".into(),
                version: env!("CARGO_PKG_VERSION").into(),
                extensions: kserve::EXTENSIONS.iter().map(|e| e.to_string()).collect(),
            }),
            &id,
        ))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let id = request_id(request.metadata());
        self.authenticate(request.metadata(), ENDPOINT, &id).await?;
        let r = request.get_ref();
        let served =
            kserve::find(&self.state, &r.name, Some(&r.version)).map_err(|e| e.grpc_status())?;
        let m = kserve::metadata(&self.state, &served);
        let tensors = |list: Vec<crate::backend::TensorSpec>| {
            list.into_iter()
                .map(|t| TensorMetadata {
                    name: t.name,
                    datatype: t.datatype,
                    shape: t.shape,
                })
                .collect()
        };
        Ok(with_request_id(
            Response::new(ModelMetadataResponse {
                name: m.name,
                versions: m.versions,
                platform: m.platform,
                inputs: tensors(m.inputs),
                outputs: tensors(m.outputs),
            }),
            &id,
        ))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let id = request_id(request.metadata());
        let principal = self
            .authenticate(request.metadata(), INFER_ENDPOINT, &id)
            .await?;
        let origin = origin(request.metadata(), &self.state.config.releases);
        match self
            .infer_one(&principal, origin, id.clone(), request.into_inner())
            .await
        {
            Ok(response) => {
                let fallback = response.parameters.get(FALLBACK_PARAMETER).and_then(|p| {
                    match &p.parameter_choice {
                        Some(ParameterChoice::StringParam(s)) => {
                            MetadataValue::try_from(s.as_str()).ok()
                        }
                        _ => None,
                    }
                });
                let mut response = with_request_id(Response::new(response), &id);
                if let Some(v) = fallback {
                    response
                        .metadata_mut()
                        .insert(crate::chain::FALLBACK_HEADER, v);
                }
                Ok(response)
            }
            Err(e) => {
                let mut status = e.grpc_status();
                if let Ok(v) = MetadataValue::try_from(id.as_str()) {
                    status.metadata_mut().insert("x-request-id", v);
                }
                Err(status)
            }
        }
    }

    type ModelStreamInferStream = ResponseStream;

    /// Each request of the stream gets one response, in the order they finish (up to
    /// `admission.max_in_flight` of one stream run at once, so they can batch). The key is checked
    /// once, when the stream opens; each request gets its own record (`<stream id>/<n>`).
    async fn model_stream_infer(
        &self,
        request: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let stream_id = request_id(request.metadata());
        let principal = self
            .authenticate(request.metadata(), INFER_ENDPOINT, &stream_id)
            .await?;
        let stream_origin = origin(request.metadata(), &self.state.config.releases);
        let service = self.clone();
        let concurrency = self.state.config.admission.max_in_flight.max(1);
        let responses = request
            .into_inner()
            .enumerate()
            .map(move |(n, item)| {
                let service = service.clone();
                let principal = principal.clone();
                let origin = stream_origin.clone();
                let id = format!("{stream_id}/{n}");
                async move {
                    let request = item?;
                    let (model_name, model_version, request_id) = (
                        request.model_name.clone(),
                        request.model_version.clone(),
                        request.id.clone(),
                    );
                    Ok(
                        match service.infer_one(&principal, origin, id, request).await {
                            Ok(response) => ModelStreamInferResponse {
                                error_message: String::new(),
                                infer_response: Some(response),
                            },
                            // The id and model say which request failed; the stream goes on.
                            Err(e) => ModelStreamInferResponse {
                                error_message: e.to_string(),
                                infer_response: Some(ModelInferResponse {
                                    model_name,
                                    model_version,
                                    id: request_id,
                                    ..Default::default()
                                }),
                            },
                        },
                    )
                }
            })
            .buffer_unordered(concurrency);
        Ok(Response::new(Box::pin(responses) as ResponseStream))
    }

    async fn model_config(
        &self,
        _request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        Err(unimplemented("ModelConfig"))
    }

    async fn model_statistics(
        &self,
        _request: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        Err(unimplemented("ModelStatistics (metrics are on /metrics)"))
    }

    async fn repository_index(
        &self,
        _request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        Err(unimplemented("RepositoryIndex"))
    }

    async fn repository_model_load(
        &self,
        _request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        Err(unimplemented("RepositoryModelLoad (models load at start)"))
    }

    async fn repository_model_unload(
        &self,
        _request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        Err(unimplemented("RepositoryModelUnload"))
    }

    async fn system_shared_memory_status(
        &self,
        _request: Request<SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<SystemSharedMemoryStatusResponse>, Status> {
        Err(unimplemented(
            "SystemSharedMemoryStatus (no shared-memory extension)",
        ))
    }

    async fn system_shared_memory_register(
        &self,
        _request: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<SystemSharedMemoryRegisterResponse>, Status> {
        Err(unimplemented(
            "SystemSharedMemoryRegister (no shared-memory extension)",
        ))
    }

    async fn system_shared_memory_unregister(
        &self,
        _request: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<SystemSharedMemoryUnregisterResponse>, Status> {
        Err(unimplemented(
            "SystemSharedMemoryUnregister (no shared-memory extension)",
        ))
    }

    async fn cuda_shared_memory_status(
        &self,
        _request: Request<CudaSharedMemoryStatusRequest>,
    ) -> Result<Response<CudaSharedMemoryStatusResponse>, Status> {
        Err(unimplemented(
            "CudaSharedMemoryStatus (no shared-memory extension)",
        ))
    }

    async fn cuda_shared_memory_register(
        &self,
        _request: Request<CudaSharedMemoryRegisterRequest>,
    ) -> Result<Response<CudaSharedMemoryRegisterResponse>, Status> {
        Err(unimplemented(
            "CudaSharedMemoryRegister (no shared-memory extension)",
        ))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        _request: Request<CudaSharedMemoryUnregisterRequest>,
    ) -> Result<Response<CudaSharedMemoryUnregisterResponse>, Status> {
        Err(unimplemented(
            "CudaSharedMemoryUnregister (no shared-memory extension)",
        ))
    }

    async fn trace_setting(
        &self,
        _request: Request<TraceSettingRequest>,
    ) -> Result<Response<TraceSettingResponse>, Status> {
        Err(unimplemented("TraceSetting"))
    }

    async fn log_settings(
        &self,
        _request: Request<LogSettingsRequest>,
    ) -> Result<Response<LogSettingsResponse>, Status> {
        Err(unimplemented("LogSettings"))
    }
}

/// Binds the gRPC listener.
pub async fn bind(config: &GrpcConfig) -> std::io::Result<TcpListener> {
    TcpListener::bind(config.listen).await
}

/// Serves the protocol on `listener` (over TLS with `certificates`) until `shutdown` resolves;
/// then finishes the calls in progress (graceful shutdown), as the HTTP server does.
pub async fn serve(
    state: Arc<AppState>,
    listener: TcpListener,
    certificates: Option<Arc<crate::tls::Certificates>>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let config = state.config.grpc.clone();
    let seconds = |s: u64| (s > 0).then(|| Duration::from_secs(s));
    let service = GrpcInferenceServiceServer::new(Inference::new(state))
        .max_decoding_message_size(config.max_message_bytes)
        .max_encoding_message_size(config.max_message_bytes);
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(seconds(config.keepalive_interval_s))
        .http2_keepalive_timeout(seconds(config.keepalive_timeout_s))
        .max_concurrent_streams(config.max_concurrent_streams)
        .add_service(service);
    match certificates {
        None => {
            let incoming = tonic::transport::server::TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .with_keepalive(seconds(config.tcp_keepalive_s));
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        Some(certificates) => {
            let how = crate::tls::Accepting {
                door: crate::tls::Door::Grpc,
                tcp_keepalive: seconds(config.tcp_keepalive_s),
            };
            let tls = crate::tls::listen(listener, certificates, how);
            router
                .serve_with_incoming_shutdown(tls.into_incoming(), shutdown)
                .await
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use tonic::Code;

    use super::*;
    use crate::auth::KeyStore;
    use crate::backend::OutputTensor;
    use crate::config::ServerConfig;

    fn input(
        name: &str,
        datatype: &str,
        shape: &[i64],
        contents: InferTensorContents,
    ) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
            parameters: HashMap::new(),
            contents: Some(contents),
        }
    }

    fn raw_input(name: &str, datatype: &str, shape: &[i64]) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: datatype.into(),
            shape: shape.to_vec(),
            parameters: HashMap::new(),
            contents: None,
        }
    }

    fn request(inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>) -> ModelInferRequest {
        ModelInferRequest {
            model_name: "m".into(),
            inputs,
            raw_input_contents: raw,
            ..Default::default()
        }
    }

    /// Decoding fails with INVALID_ARGUMENT and a message holding `want`.
    fn refused(r: ModelInferRequest, want: &str) {
        let e = decode(r, 1 << 20, 100 << 20).unwrap_err();
        let status = e.grpc_status();
        assert_eq!(status.code(), Code::InvalidArgument, "{e}");
        assert!(
            status.message().contains(want),
            "{:?} (wanted {want:?})",
            status.message()
        );
    }

    #[test]
    fn typed_contents_decode_per_datatype() {
        let mut r = request(
            vec![
                input(
                    "f",
                    "FP32",
                    &[1, 2],
                    InferTensorContents {
                        fp32_contents: vec![1.5, -2.0],
                        ..Default::default()
                    },
                ),
                input(
                    "i",
                    "INT64",
                    &[3],
                    InferTensorContents {
                        int64_contents: vec![1, -2, 3],
                        ..Default::default()
                    },
                ),
                input(
                    "s",
                    "INT8",
                    &[2],
                    InferTensorContents {
                        int_contents: vec![-128, 127],
                        ..Default::default()
                    },
                ),
                input(
                    "u",
                    "UINT16",
                    &[1],
                    InferTensorContents {
                        uint_contents: vec![65535],
                        ..Default::default()
                    },
                ),
                input(
                    "b",
                    "BOOL",
                    &[2],
                    InferTensorContents {
                        bool_contents: vec![true, false],
                        ..Default::default()
                    },
                ),
                input(
                    "t",
                    "BYTES",
                    &[2],
                    InferTensorContents {
                        bytes_contents: vec![b"ab".to_vec(), vec![]],
                        ..Default::default()
                    },
                ),
            ],
            Vec::new(),
        );
        r.id = "req-7".into();
        r.outputs = vec![model_infer_request::InferRequestedOutputTensor {
            name: "probs".into(),
            parameters: HashMap::from([(
                "classification".to_string(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::Int64Param(3)),
                },
            )]),
        }];
        let d = decode(r, 1 << 20, 100 << 20).unwrap();
        assert_eq!(d.id.as_deref(), Some("req-7"));
        assert_eq!(d.inputs[0].shape, vec![1, 2]);
        assert_eq!(d.inputs[0].data, Data::F32(vec![1.5, -2.0]));
        assert_eq!(d.inputs[1].data, Data::I64(vec![1, -2, 3]));
        assert_eq!(d.inputs[2].data, Data::I8(vec![-128, 127]));
        assert_eq!(d.inputs[3].data, Data::U16(vec![65535]));
        assert_eq!(d.inputs[4].data, Data::Bool(vec![true, false]));
        assert_eq!(d.inputs[5].data, Data::Bytes(vec![b"ab".to_vec(), vec![]]));
        assert_eq!(d.outputs[0].name, "probs");
        assert_eq!(d.outputs[0].classification, Some(3));
    }

    #[test]
    fn raw_contents_decode_little_endian_and_length_prefixed_bytes() {
        let mut f = Vec::new();
        for v in [1.0f32, -0.5, 3.25] {
            f.extend_from_slice(&v.to_le_bytes());
        }
        let mut bytes = Vec::new();
        for item in [&b"\x89PNG"[..], b"", b"hello"] {
            bytes.extend_from_slice(&(item.len() as u32).to_le_bytes());
            bytes.extend_from_slice(item);
        }
        let h = 0x3800u16.to_le_bytes().to_vec(); // 0.5 as IEEE binary16
        let r = request(
            vec![
                raw_input("x", "FP32", &[3]),
                raw_input("img", "BYTES", &[3]),
                raw_input("h", "FP16", &[1]),
            ],
            vec![f, bytes, h],
        );
        let d = decode(r, 1 << 20, 100 << 20).unwrap();
        assert_eq!(d.inputs[0].data, Data::F32(vec![1.0, -0.5, 3.25]));
        assert_eq!(
            d.inputs[1].data,
            Data::Bytes(vec![b"\x89PNG".to_vec(), Vec::new(), b"hello".to_vec()])
        );
        assert_eq!(
            (d.inputs[2].dtype(), d.inputs[2].to_f32()),
            (DType::F16, Some(vec![0.5]))
        );
        assert_eq!(d.id, None, "an empty id is no id");
    }

    #[test]
    fn malformed_tensors_are_precise_invalid_arguments() {
        let fp32 = |v: Vec<f32>| InferTensorContents {
            fp32_contents: v,
            ..Default::default()
        };
        refused(
            request(
                vec![input("x", "FP32", &[2], fp32(vec![1.0, 2.0, 3.0]))],
                vec![],
            ),
            "needs 2 elements, got 3",
        );
        refused(
            request(vec![input("x", "FP32", &[4], fp32(vec![]))], vec![]),
            "needs 4 elements, got 0",
        );
        refused(
            request(vec![raw_input("x", "FP32", &[2])], vec![vec![0; 7]]),
            "needs 8 bytes, got 7",
        );
        refused(
            request(
                vec![raw_input("x", "FP32", &[1]), raw_input("y", "FP32", &[1])],
                vec![vec![0; 4]],
            ),
            "raw_input_contents holds 1 entries for 2 inputs",
        );
        refused(
            request(
                vec![input("x", "FP32", &[1], fp32(vec![1.0]))],
                vec![vec![0; 4]],
            ),
            "both contents and raw_input_contents",
        );
        refused(
            request(
                vec![input(
                    "x",
                    "INT64",
                    &[1],
                    InferTensorContents {
                        int_contents: vec![1],
                        ..Default::default()
                    },
                )],
                vec![],
            ),
            "INT64 data goes in contents.int64_contents, not contents.int_contents",
        );
        refused(
            request(vec![input("x", "FP16", &[1], fp32(vec![1.0]))], vec![]),
            "send it in raw_input_contents",
        );
        refused(
            request(
                vec![input(
                    "x",
                    "UINT8",
                    &[1],
                    InferTensorContents {
                        uint_contents: vec![256],
                        ..Default::default()
                    },
                )],
                vec![],
            ),
            "element 0 (256) is out of range for UINT8",
        );
        refused(
            request(vec![input("x", "FP32", &[-1], fp32(vec![1.0]))], vec![]),
            "negative dimension",
        );
        refused(
            request(vec![input("x", "FP33", &[1], fp32(vec![1.0]))], vec![]),
            "unknown datatype",
        );
        refused(
            request(
                vec![raw_input("x", "BYTES", &[1])],
                vec![vec![5, 0, 0, 0, b'a']],
            ),
            "claims 5 bytes, 1 remain",
        );
        refused(
            request(
                vec![raw_input("x", "BYTES", &[2])],
                vec![vec![1, 0, 0, 0, b'a']],
            ),
            "needs 2 BYTES elements, got 1",
        );
        refused(
            request(vec![raw_input("x", "BYTES", &[1])], vec![vec![1, 0]]),
            "truncated length prefix",
        );
        refused(
            request(vec![raw_input("x", "BOOL", &[1])], vec![vec![2]]),
            "BOOL elements are 0 or 1",
        );
        refused(
            request(
                vec![raw_input("x", "FP32", &[1 << 40, 1 << 40])],
                vec![vec![]],
            ),
            "more than 1048576 elements",
        );
        refused(request(vec![], vec![]), "no inputs");
        let mut r = request(vec![input("x", "FP32", &[1], fp32(vec![1.0]))], vec![]);
        r.outputs = vec![model_infer_request::InferRequestedOutputTensor {
            name: "y".into(),
            parameters: HashMap::from([(
                "classification".to_string(),
                InferParameter {
                    parameter_choice: Some(ParameterChoice::StringParam("3".into())),
                },
            )]),
        }];
        refused(r, "\"classification\" must be a non-negative int64_param");
    }

    #[test]
    fn responses_use_raw_output_contents() {
        let response = InferResponse {
            model_name: "m".into(),
            model_version: "1.0.0".into(),
            id: Some("abc".into()),
            outputs: vec![
                OutputTensor {
                    tensor: Tensor::new("p", vec![1, 2], Data::F32(vec![0.25, 0.75])).unwrap(),
                    binary: false,
                },
                OutputTensor {
                    tensor: Tensor::new("c", vec![1, 1], Data::Bytes(vec![b"0.75:1:b".to_vec()]))
                        .unwrap(),
                    binary: false,
                },
            ],
            judgements: Vec::new(),
        };
        let r = encode(response);
        assert_eq!(
            (
                r.model_name.as_str(),
                r.model_version.as_str(),
                r.id.as_str()
            ),
            ("m", "1.0.0", "abc")
        );
        assert_eq!(r.outputs[0].datatype, "FP32");
        assert_eq!(r.outputs[0].shape, vec![1, 2]);
        assert!(r.outputs[0].contents.is_none());
        let back =
            Tensor::from_raw("p", DType::F32, vec![1, 2], &r.raw_output_contents[0]).unwrap();
        assert_eq!(back.data, Data::F32(vec![0.25, 0.75]));
        assert_eq!(r.outputs[1].datatype, "BYTES");
        assert_eq!(r.raw_output_contents[1], b"\x08\x00\x00\x000.75:1:b");
    }

    #[test]
    fn api_errors_map_to_grpc_codes_keeping_the_message() {
        let cases = [
            (ApiError::invalid("bad shape"), Code::InvalidArgument),
            (
                ApiError::ModelNotFound("no such model".into()),
                Code::NotFound,
            ),
            (
                ApiError::Unauthorized("invalid API key".into()),
                Code::Unauthenticated,
            ),
            (
                ApiError::BodyTooLarge("too big".into()),
                Code::ResourceExhausted,
            ),
            (
                ApiError::Overloaded {
                    message: "queue full".into(),
                    retry_after_s: 3,
                    code: "queue_full",
                    booking: None,
                },
                Code::ResourceExhausted,
            ),
            (
                ApiError::Unavailable {
                    message: "draining".into(),
                    retry_after_s: 5,
                },
                Code::Unavailable,
            ),
            (ApiError::Internal("backend failed".into()), Code::Internal),
        ];
        for (e, code) in cases {
            let s = e.grpc_status();
            assert_eq!(s.code(), code, "{e}");
            assert_eq!(s.message(), e.to_string());
        }
        let s = ApiError::Overloaded {
            message: "x".into(),
            retry_after_s: 3,
            code: "rate_limited",
            booking: None,
        }
        .grpc_status();
        assert_eq!(s.metadata().get("retry-after").unwrap(), "3");
    }

    fn service(keys: Option<&str>) -> Inference {
        let keys = keys.map(|k| KeyStore::parse(k, '\n').unwrap());
        Inference::new(AppState::new(
            ServerConfig::default(),
            keys,
            None,
            record::Bus::disconnected(),
        ))
    }

    fn with_key<T>(message: T, key: Option<&str>) -> Request<T> {
        let mut r = Request::new(message);
        if let Some(key) = key {
            r.metadata_mut()
                .insert("authorization", format!("Bearer {key}").parse().unwrap());
        }
        r
    }

    #[tokio::test]
    async fn keys_guard_everything_but_health() {
        let s = service(Some("tester:sk-test-key-0001"));
        assert!(
            s.server_live(Request::new(ServerLiveRequest {}))
                .await
                .unwrap()
                .get_ref()
                .live
        );
        // Models are still loading: not ready, and anonymous callers may ask.
        assert!(
            !s.server_ready(Request::new(ServerReadyRequest {}))
                .await
                .unwrap()
                .get_ref()
                .ready
        );
        let meta = || ModelMetadataRequest {
            name: "nope".into(),
            version: String::new(),
        };
        let e = s.model_metadata(with_key(meta(), None)).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated);
        assert!(e.message().contains("missing API key"), "{}", e.message());
        let e = s
            .model_metadata(with_key(meta(), Some("sk-wrong-key-0000")))
            .await
            .unwrap_err();
        assert_eq!(
            (e.code(), e.message()),
            (Code::Unauthenticated, "invalid API key")
        );
        let e = s
            .model_metadata(with_key(meta(), Some("sk-test-key-0001")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{}", e.message());
        assert!(
            e.message().contains("\"nope\" is not served here"),
            "{}",
            e.message()
        );
        let e = s
            .model_infer(with_key(request(vec![], vec![]), None))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated);
        let e = s
            .model_infer(with_key(request(vec![], vec![]), Some("sk-test-key-0001")))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{}", e.message());
        let server = s
            .server_metadata(with_key(ServerMetadataRequest {}, Some("sk-test-key-0001")))
            .await
            .unwrap();
        assert_eq!(server.get_ref().name, "rampart");
        assert!(server
            .get_ref()
            .extensions
            .contains(&"classification".to_string()));
    }

    #[tokio::test]
    async fn unknown_models_are_not_ready_and_other_rpcs_are_unimplemented() {
        let s = service(None);
        let ready = s
            .model_ready(Request::new(ModelReadyRequest {
                name: "nope".into(),
                version: String::new(),
            }))
            .await
            .unwrap();
        assert!(!ready.get_ref().ready);
        let e = s
            .repository_index(Request::new(RepositoryIndexRequest::default()))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::Unimplemented);
        assert!(
            e.message().contains("RepositoryIndex is not implemented"),
            "{}",
            e.message()
        );
    }
}
