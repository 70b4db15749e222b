//! Tensor models (ONNX graphs with their declared pipeline and batcher) and the
//! protocol-neutral tensor request and response that KServe REST and gRPC decode into.

use std::sync::Arc;
use std::time::{Duration, Instant};

use classic::{DType, Data, Judgement, Tensor};
use record::{sha256_hex, RecordBuilder};

use super::{
    Answer, BackendError, Description, InferenceBackend, Kind, StartFuture, TensorSpec, Work,
    WorkKind,
};

/// The name of the synthetic outputs of detectors.
pub const DETECTIONS: &str = "detections";
pub const DETECTION_LABELS: &str = "detection_labels";

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
    /// 0: asked of the model itself; 1: a step of its fallback chain (a rules model then
    /// answers only when a rule matched every input).
    pub fallback_level: u8,
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

fn record_confidence(record: &mut RecordBuilder, judgements: &[Judgement]) {
    let scores: Vec<f32> = judgements
        .iter()
        .filter_map(Judgement::confidence)
        .collect();
    record_confidences(record, &scores);
}

/// The monitors' observations of a request: one per image (its statistics with the output
/// features of its judgement), or one for tensor inputs (each input's statistics, with the
/// first row's judgement).
fn observe(
    record: &mut RecordBuilder,
    images: Vec<monitor::Observation>,
    tensors: Option<monitor::Observation>,
    judgements: &[Judgement],
) {
    let output = |j: Option<&Judgement>| match j {
        Some(Judgement::Classes(c)) => monitor::features::classification(
            &c.iter()
                .map(|c| {
                    let label = c.label.clone().unwrap_or_else(|| c.index.to_string());
                    (label, c.score)
                })
                .collect::<Vec<_>>(),
        ),
        Some(Judgement::Detections(d)) => {
            monitor::features::detection(&d.iter().map(|d| d.score).collect::<Vec<_>>())
        }
        None => monitor::Observation::default(),
    };
    if images.is_empty() {
        let mut o = tensors.unwrap_or_default();
        o.extend(output(judgements.first()));
        if !o.is_empty() {
            record.observe(o);
        }
        return;
    }
    for (i, mut o) in images.into_iter().enumerate() {
        o.extend(output(judgements.get(i)));
        record.observe(o);
    }
}

/// Each numeric input's mean, std, min and max (at most the first 1M elements of each).
fn tensor_observation(inputs: &[Tensor]) -> Option<monitor::Observation> {
    let mut o = monitor::Observation::default();
    for t in inputs {
        let cap = 1 << 20;
        let part = match &t.data {
            Data::F32(v) => monitor::features::tensor(&t.name, &v[..v.len().min(cap)], f64::from),
            Data::F64(v) => monitor::features::tensor(&t.name, &v[..v.len().min(cap)], |x| x),
            Data::I64(v) => {
                monitor::features::tensor(&t.name, &v[..v.len().min(cap)], |x| x as f64)
            }
            Data::I32(v) => monitor::features::tensor(&t.name, &v[..v.len().min(cap)], f64::from),
            _ => continue,
        };
        o.extend(part);
    }
    (!o.is_empty()).then_some(o)
}

/// The record's confidence: the mean and the lowest of the inputs' confidences.
pub fn record_confidences(record: &mut RecordBuilder, scores: &[f32]) {
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
) -> Result<Vec<OutputTensor>, BackendError> {
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
            BackendError::invalid_param(
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
fn classification(t: &Tensor, k: usize, labels: Option<&[String]>) -> Result<Tensor, BackendError> {
    let scores = t.to_f32().ok_or_else(|| {
        BackendError::invalid(format!(
            "output {:?} is not numeric; it cannot be classified",
            t.name
        ))
    })?;
    let classes = *t.shape.last().unwrap_or(&1);
    if k == 0 || classes == 0 {
        return Err(BackendError::invalid(
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

impl InferRequest {
    /// sha256 over the inputs' names, types, shapes and bytes (the record's input hash).
    pub fn input_sha256(&self) -> String {
        hash_inputs(&self.inputs)
    }

    /// What the audit log keeps of the input: each tensor's name, type, shape and sha256, and
    /// its bytes (base64) when `with_bytes` (`[audit] store_tensor_inputs`).
    pub fn audit_input(&self, with_bytes: bool) -> serde_json::Value {
        serde_json::json!({ "tensors": audit_tensors(self.inputs.iter(), with_bytes) })
    }
}

impl InferResponse {
    /// What the audit log keeps of the output: each tensor's digest, and what post-processing
    /// concluded (classes, boxes, scores).
    pub fn audit_output(&self) -> serde_json::Value {
        serde_json::json!({
            "tensors": audit_tensors(self.outputs.iter().map(|o| &o.tensor), false),
            "judgements": self.judgements,
        })
    }
}

fn audit_tensors<'a>(
    tensors: impl Iterator<Item = &'a Tensor>,
    with_bytes: bool,
) -> Vec<serde_json::Value> {
    tensors
        .map(|t| {
            let raw = t.to_raw();
            let mut v = serde_json::json!({
                "name": t.name,
                "datatype": t.dtype().to_string(),
                "shape": t.shape,
                "sha256": hex_digest(&raw),
            });
            if with_bytes {
                v["bytes_base64"] = base64_bytes(&raw).into();
            }
            v
        })
        .collect()
}

/// One served tensor model version.
pub struct TensorBackend {
    name: String,
    model: Arc<classic::TensorModel>,
}

impl TensorBackend {
    pub fn new(name: String, model: classic::TensorModel) -> Self {
        Self {
            name,
            model: Arc::new(model),
        }
    }

    /// Pre-processing, the batcher, post-processing, output selection.
    async fn infer(
        &self,
        request: InferRequest,
        record: &mut RecordBuilder,
    ) -> Result<InferResponse, BackendError> {
        let model = &self.model;
        let started = Instant::now();
        let prepared = model.prepare(request.inputs)?;
        let prepared_at = Instant::now();
        // Decoding and pre-processing run interleaved per image; the trace shows their sums
        // one after the other.
        let decoded_at = started
            + Duration::from_secs_f64(prepared.decode_seconds.max(0.0))
                .min(prepared_at.duration_since(started));
        if prepared.decode_seconds > 0.0 {
            record.stage("decode_image", started, decoded_at);
        }
        record.stage("preprocess", decoded_at, prepared_at);
        let (inputs, transforms) = (prepared.tensors, prepared.transforms);
        let input_features = if model.observe_images.is_some() && prepared.observations.is_empty() {
            tensor_observation(&inputs)
        } else {
            None
        };
        record.record.items = inputs.first().map_or(0, Tensor::batch);
        let queued_at = Instant::now();
        let (outputs, times) = model.run_timed(inputs).await?;
        let ran_at = Instant::now();
        record.record.compute_ms = started.elapsed().as_secs_f64() * 1e3;
        let computing = ran_at
            .checked_sub(times.computed)
            .unwrap_or(queued_at)
            .max(queued_at);
        record.stage("batch_wait", queued_at, computing);
        record.stage("compute", computing, ran_at);
        let judgements = model.postprocess(&outputs, &transforms)?;
        record_confidence(record, &judgements);
        if model.observe_images.is_some() {
            observe(record, prepared.observations, input_features, &judgements);
        }
        let mut available = outputs;
        if let Some(repo::pipeline::Postprocess::Detect(_)) = &model.pipeline.postprocess {
            available.extend(detection_tensors(&judgements));
        }
        let selected = select_outputs(
            &self.name,
            &available,
            &request.outputs,
            request.binary_output,
            model,
        );
        record.stage_since("postprocess", ran_at);
        let selected = selected?;
        Ok(InferResponse {
            model_name: String::new(),
            model_version: String::new(),
            id: request.id,
            outputs: selected,
            judgements,
        })
    }
}

impl InferenceBackend for TensorBackend {
    fn kind(&self) -> Kind {
        Kind::Tensor
    }

    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Tensors
    }

    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a> {
        Box::pin(async move {
            match work {
                Work::Tensors(request) => Ok(Answer::Tensors(self.infer(request, record).await?)),
                other => Err(BackendError::invalid(format!(
                    "a tensor model does not take {} work",
                    other.kind().as_str()
                ))),
            }
        })
    }

    fn describe(&self) -> Description {
        let m = &self.model;
        let inputs = m
            .inputs
            .iter()
            .map(|i| TensorSpec {
                name: i.name.clone(),
                datatype: datatype(&i.dtype),
                shape: dims(i),
            })
            .collect();
        // The image input (declared pre-processing) also takes encoded JPEG/PNG images as
        // BYTES, one per batch row; the metadata keeps the graph's datatype.
        let mut outputs: Vec<TensorSpec> = m
            .outputs
            .iter()
            .map(|o| TensorSpec {
                name: o.name.clone(),
                datatype: datatype(&o.dtype),
                shape: dims(o),
            })
            .collect();
        if matches!(
            m.pipeline.postprocess,
            Some(repo::pipeline::Postprocess::Detect(_))
        ) {
            outputs.push(TensorSpec {
                name: DETECTIONS.into(),
                datatype: "FP32".into(),
                shape: vec![-1, 7],
            });
            outputs.push(TensorSpec {
                name: DETECTION_LABELS.into(),
                datatype: "BYTES".into(),
                shape: vec![-1],
            });
        }
        Description {
            max_context: 0,
            platform: format!("onnx_{}", m.backend()),
            inputs,
            outputs,
            image_input: m.image_input().map(str::to_string),
        }
    }
}

/// The KServe input of models that take text (embedding and rules models).
pub const TEXT_INPUT: &str = "text";

/// The texts of a request whose one input is a `text` BYTES tensor (embedding and rules models
/// over KServe); `what` names the model in errors ("embedding model \"m\"").
pub fn text_input(what: &str, request: &InferRequest) -> Result<Vec<String>, BackendError> {
    const TEXT: &str = TEXT_INPUT;
    let [input] = request.inputs.as_slice() else {
        return Err(BackendError::invalid(format!(
            "{what} takes one input, {TEXT:?} (BYTES)"
        )));
    };
    let Data::Bytes(items) = &input.data else {
        return Err(BackendError::invalid(format!(
            "input {:?} must be BYTES (UTF-8 text), got {}",
            input.name,
            input.dtype()
        )));
    };
    if input.name != TEXT {
        return Err(BackendError::invalid(format!(
            "{what} has no input {:?} (inputs: {TEXT})",
            input.name
        )));
    }
    if items.is_empty() {
        return Err(BackendError::invalid(format!("input {TEXT:?} is empty")));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, b)| {
            String::from_utf8(b.clone()).map_err(|_| {
                BackendError::invalid(format!("input {TEXT:?}, element {i}: not UTF-8 text"))
            })
        })
        .collect()
}

/// A shape as the wire gives it (signed dimensions), refused when a dimension is negative.
pub fn wire_shape(name: &str, shape: &[i64]) -> Result<Vec<usize>, BackendError> {
    shape
        .iter()
        .map(|d| {
            usize::try_from(*d).map_err(|_| {
                BackendError::invalid(format!(
                    "input {name:?}: shape {shape:?} has a negative dimension"
                ))
            })
        })
        .collect()
}

/// Standard base64 (with padding) of `bytes`.
pub fn base64_bytes(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for (k, shift) in [18, 12, 6, 0].into_iter().enumerate() {
            if k <= chunk.len() {
                out.push(ALPHABET[(n >> shift) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn negative_dimensions_are_refused() {
        assert_eq!(wire_shape("x", &[2, 3]).unwrap(), vec![2, 3]);
        let e = wire_shape("x", &[2, -1]).unwrap_err();
        assert!(e.to_string().contains("negative dimension"), "{e}");
    }
}
