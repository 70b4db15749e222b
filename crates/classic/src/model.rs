//! A served tensor model: its graph on a backend, its declared pipeline, its batcher, and the
//! checks every request passes before it reaches the backend.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use formats::onnx::Dim;
use repo::manifest::{Manifest, TensorSpec};
use repo::pipeline::{Batching, Pipeline, Postprocess};
use serde::Serialize;

use crate::backend::{Backend, TractBackend};
use crate::batcher::{BatchConfig, Batcher};
use crate::error::ClassicError;
use crate::imageops::{self, Transform};
use crate::post::{self, Class, Detection};
use crate::tensor::{DType, Data, Tensor};

/// Which backend runs the graph.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// ONNX Runtime when its library can be loaded, tract otherwise.
    #[default]
    Auto,
    Tract,
    Onnxruntime,
}

/// How to load tensor models.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    pub backend: BackendChoice,
    /// The ONNX Runtime shared library (`libonnxruntime.so`); `ORT_DYLIB_PATH` otherwise, then a
    /// Python `onnxruntime` package in the model cache's venv (see [`crate::ort_backend`]).
    pub onnxruntime_library: Option<PathBuf>,
    /// Intra-op threads of each ONNX Runtime session (0: one; the batcher's instances already
    /// run in parallel).
    pub threads: usize,
    /// Largest number of elements one input may hold.
    pub max_input_elements: usize,
}

/// What post-processing concluded about one input.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Judgement {
    Classes(Vec<Class>),
    Detections(Vec<Detection>),
}

impl Judgement {
    /// The confidence recorded for the request: top probability or best detection score.
    pub fn confidence(&self) -> Option<f32> {
        match self {
            Judgement::Classes(c) => c.first().map(|c| c.score),
            Judgement::Detections(d) => d.iter().map(|d| d.score).reduce(f32::max),
        }
    }
}

/// A pre-processed image batch: the tensor, each image's transform and observation.
/// The batch tensor, each image's transform and observation, and the seconds spent decoding.
type ImageBatch = (Tensor, Vec<Transform>, Vec<record::Observation>, f64);

/// A loaded tensor model.
pub struct TensorModel {
    pub name: String,
    pub version: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    pub pipeline: Pipeline,
    pub labels: Option<Vec<String>>,
    backend: &'static str,
    engine: Arc<dyn Backend>,
    batcher: Batcher,
    max_input_elements: usize,
    /// Measures each decoded image for the monitors when set (the server gives
    /// `monitor::features::image`, a sampled pass over the pixels).
    pub observe_images: Option<ImageFeatures>,
}

/// Statistics of a decoded 8-bit RGB image (pixels, width, height, original size) for the
/// monitors.
pub type ImageFeatures = fn(&[u8], usize, usize, (usize, usize)) -> record::Observation;

/// Request inputs checked and ordered as the graph wants them, with what pre-processing learnt.
pub struct PreparedInputs {
    pub tensors: Vec<Tensor>,
    /// Maps detections back to each original image (empty for tensor inputs).
    pub transforms: Vec<Transform>,
    /// Each image's statistics for the monitors (empty unless `observe_images`).
    pub observations: Vec<record::Observation>,
    /// Seconds spent decoding images (the rest of `prepare` was pre-processing).
    pub decode_seconds: f64,
}

fn spec_dims(spec: &TensorSpec) -> Vec<i64> {
    spec.shape
        .as_ref()
        .map(|s| {
            s.iter()
                .map(|d| match d {
                    Dim::Fixed(v) if *v > 0 => *v,
                    _ => -1,
                })
                .collect()
        })
        .unwrap_or_default()
}

impl TensorModel {
    /// Loads version folder `dir` described by `manifest`.
    pub fn load(
        dir: &Path,
        manifest: &Manifest,
        options: &LoadOptions,
    ) -> Result<Self, ClassicError> {
        let onnx = manifest.onnx.as_ref().ok_or_else(|| {
            ClassicError::Load(format!(
                "{}@{} is a {} model, not an ONNX graph",
                manifest.model.name, manifest.model.version, manifest.model.kind
            ))
        })?;
        let weights = manifest
            .model
            .weights
            .first()
            .ok_or_else(|| ClassicError::Load("the manifest names no weights file".into()))?;
        let path = dir.join(weights);
        let pipeline = manifest.pipeline.clone().unwrap_or_default();
        let labels = match &pipeline.postprocess {
            Some(post) => post
                .labels()
                .resolve(&onnx.metadata, |file| {
                    std::fs::read_to_string(dir.join(file))
                })
                .map_err(|e| ClassicError::Load(e.to_string()))?,
            None => None,
        };
        let backend = load_backend(&path, &onnx.inputs, &onnx.outputs, options)?;
        let mut batching: Batching = pipeline.batching.clone().unwrap_or_default();
        // A graph with a fixed batch dimension cannot batch requests.
        let fixed_batch = onnx.inputs.iter().any(|i| {
            matches!(
                i.shape.as_ref().and_then(|s| s.first()),
                Some(Dim::Fixed(_))
            )
        });
        if fixed_batch
            || onnx
                .inputs
                .iter()
                .any(|i| i.shape.as_ref().is_some_and(|s| s.is_empty()))
        {
            batching.max_batch_size = 1;
        }
        let name = manifest.model.name.clone();
        let batcher = Batcher::start(&name, Arc::clone(&backend), BatchConfig::from(&batching))?;
        Ok(TensorModel {
            name,
            version: manifest.model.version.clone(),
            inputs: onnx.inputs.clone(),
            outputs: onnx.outputs.clone(),
            pipeline,
            labels,
            backend: backend.name(),
            engine: backend,
            batcher,
            observe_images: None,
            max_input_elements: if options.max_input_elements == 0 {
                64 << 20
            } else {
                options.max_input_elements
            },
        })
    }

    /// `tract` or `onnxruntime`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// A session of the backend outside the batcher (benchmarks measure the raw call with it).
    pub fn open_session(&self) -> Result<Box<dyn crate::backend::Session>, ClassicError> {
        self.engine.session()
    }

    /// Backend instances running batches in parallel.
    pub fn instances(&self) -> usize {
        self.batcher.config().instances
    }

    pub fn max_batch_size(&self) -> usize {
        self.batcher.config().max_batch_size
    }

    pub fn queue_depth(&self) -> usize {
        self.batcher.queue_depth()
    }

    /// The graph input images feed, when pre-processing is declared.
    pub fn image_input(&self) -> Option<&str> {
        self.pipeline.preprocess.as_ref().map(|p| p.input.as_str())
    }

    /// Checks request tensors against the graph and orders them as the graph wants. A `BYTES`
    /// tensor for the image input holds encoded images: they are pre-processed here, and their
    /// transforms returned.
    pub fn prepare(&self, mut given: Vec<Tensor>) -> Result<PreparedInputs, ClassicError> {
        let bad = |m: String| Err(ClassicError::BadInput(m));
        for t in &given {
            if !self.inputs.iter().any(|i| i.name == t.name) {
                return bad(format!(
                    "model {:?} has no input {:?} (inputs: {})",
                    self.name,
                    t.name,
                    self.inputs
                        .iter()
                        .map(|i| i.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
            if given.iter().filter(|g| g.name == t.name).count() > 1 {
                return bad(format!("input {:?} is given more than once", t.name));
            }
        }
        let mut transforms = Vec::new();
        let mut observations = Vec::new();
        let mut decode_seconds = 0.0;
        let mut ordered = Vec::with_capacity(self.inputs.len());
        for spec in &self.inputs {
            let Some(pos) = given.iter().position(|t| t.name == spec.name) else {
                return bad(format!("input {:?} is missing", spec.name));
            };
            let mut t = given.swap_remove(pos);
            if t.dtype() == DType::Bytes && self.image_input() == Some(spec.name.as_str()) {
                let (tensor, tf, obs, decoding) = self.prepare_image_tensor(&t)?;
                t = tensor;
                transforms = tf;
                observations = obs;
                decode_seconds += decoding;
            }
            self.check(spec, &t)?;
            ordered.push(t);
        }
        let batch = ordered.first().map_or(1, Tensor::batch);
        if let Some(other) = ordered.iter().find(|t| t.batch() != batch) {
            return bad(format!(
                "inputs disagree on the batch size: {:?} has {batch}, {:?} has {}",
                ordered[0].name,
                other.name,
                other.batch()
            ));
        }
        if batch > self.max_batch_size() && self.max_batch_size() > 1 {
            return bad(format!(
                "a batch of {batch} exceeds max_batch_size {} of model {:?}",
                self.max_batch_size(),
                self.name
            ));
        }
        Ok(PreparedInputs {
            tensors: ordered,
            transforms,
            observations,
            decode_seconds,
        })
    }

    fn check(&self, spec: &TensorSpec, t: &Tensor) -> Result<(), ClassicError> {
        let bad = |m: String| Err(ClassicError::BadInput(m));
        let want = DType::from_onnx(&spec.dtype);
        if want != Some(t.dtype()) {
            return bad(format!(
                "input {:?} must be {} (the graph's {}), got {}",
                spec.name,
                want.map_or(spec.dtype.clone(), |d| d.to_string()),
                spec.dtype,
                t.dtype()
            ));
        }
        let dims = spec_dims(spec);
        if !dims.is_empty() {
            let ok = dims.len() == t.shape.len()
                && dims
                    .iter()
                    .zip(&t.shape)
                    .all(|(d, s)| *d < 0 || *d as usize == *s);
            if !ok {
                return bad(format!(
                    "input {:?} has shape {:?}; the model takes {:?} (-1: any size)",
                    spec.name, t.shape, dims
                ));
            }
        }
        if t.shape.contains(&0) {
            return bad(format!(
                "input {:?} is empty (shape {:?})",
                spec.name, t.shape
            ));
        }
        if t.data.len() > self.max_input_elements {
            return bad(format!(
                "input {:?} holds {} elements, more than the limit of {}",
                spec.name,
                t.data.len(),
                self.max_input_elements
            ));
        }
        Ok(())
    }

    /// Decodes and pre-processes every image of a `BYTES` tensor into one f32 batch.
    pub fn prepare_images(&self, t: &Tensor) -> Result<(Tensor, Vec<Transform>), ClassicError> {
        self.prepare_image_tensor(t).map(|(t, tf, _, _)| (t, tf))
    }

    fn prepare_image_tensor(&self, t: &Tensor) -> Result<ImageBatch, ClassicError> {
        let Data::Bytes(images) = &t.data else {
            return Err(ClassicError::BadInput(format!(
                "input {:?}: images are BYTES",
                t.name
            )));
        };
        if images.is_empty() {
            return Err(ClassicError::BadInput(format!(
                "input {:?} holds no image",
                t.name
            )));
        }
        self.prepare_image_list(&t.name, images)
    }

    fn prepare_image_list(
        &self,
        name: &str,
        images: &[Vec<u8>],
    ) -> Result<ImageBatch, ClassicError> {
        let spec = self.pipeline.preprocess.as_ref().ok_or_else(|| {
            ClassicError::BadInput(format!(
                "model {:?} declares no image pre-processing",
                self.name
            ))
        })?;
        let mut data = Vec::new();
        let mut transforms = Vec::with_capacity(images.len());
        let mut observations = Vec::new();
        let mut shape = None;
        let mut decode_seconds = 0.0;
        for (i, bytes) in images.iter().enumerate() {
            let p = imageops::prepare(bytes, spec, self.observe_images)
                .map_err(|e| ClassicError::BadInput(format!("input {name:?}, image {i}: {e}")))?;
            if shape.is_some_and(|s: [usize; 4]| s != p.shape) {
                return Err(ClassicError::BadInput(format!(
                    "input {name:?}: images of one request must come out the same size; declare a crop or an exact/letterbox resize"
                )));
            }
            shape = Some(p.shape);
            data.extend_from_slice(&p.data);
            transforms.push(p.transform);
            observations.extend(p.observation);
            decode_seconds += p.decode_seconds;
        }
        let mut shape = shape.expect("at least one image").to_vec();
        shape[0] = images.len();
        Ok((
            Tensor::new(name, shape, Data::F32(data))?,
            transforms,
            observations,
            decode_seconds,
        ))
    }

    /// Runs prepared inputs through the batcher (one image of a fixed-batch graph at a time).
    pub async fn run(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, ClassicError> {
        self.run_timed(inputs).await.map(|(outputs, _)| outputs)
    }

    /// [`TensorModel::run`], also saying how long the request waited in the batcher's queue
    /// and how long its batches computed (summed over the rows run one by one).
    pub async fn run_timed(
        &self,
        inputs: Vec<Tensor>,
    ) -> Result<(Vec<Tensor>, crate::batcher::BatchTimes), ClassicError> {
        let batch = inputs.first().map_or(1, Tensor::batch);
        if batch <= self.max_batch_size() {
            return self.batcher.infer_timed(inputs).await;
        }
        // The graph takes fewer rows than the request has: run row by row and stack.
        let mut parts: Vec<Vec<Tensor>> = Vec::with_capacity(batch);
        let mut times = crate::batcher::BatchTimes::default();
        for row in 0..batch {
            let one: Vec<Tensor> = inputs.iter().map(|t| t.rows(row, row + 1)).collect();
            let (outputs, t) = self.batcher.infer_timed(one).await?;
            times.waited += t.waited;
            times.computed += t.computed;
            parts.push(outputs);
        }
        let stacked = (0..parts[0].len())
            .map(|o| Tensor::concat(&parts.iter().map(|p| &p[o]).collect::<Vec<_>>()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((stacked, times))
    }

    /// Encoded images → pre-processing → graph → post-processing.
    pub async fn judge_images(
        &self,
        images: &[Vec<u8>],
    ) -> Result<(Vec<Tensor>, Vec<Judgement>), ClassicError> {
        let input = self.image_input().ok_or_else(|| {
            ClassicError::BadInput(format!(
                "model {:?} declares no image pre-processing",
                self.name
            ))
        })?;
        if self.inputs.len() != 1 {
            return Err(ClassicError::BadInput(format!(
                "model {:?} has {} inputs; raw images feed single-input models",
                self.name,
                self.inputs.len()
            )));
        }
        let (tensor, transforms, _, _) = self.prepare_image_list(input, images)?;
        self.check(&self.inputs[0], &tensor)?;
        let outputs = self.run(vec![tensor]).await?;
        let judgements = self.postprocess(&outputs, &transforms)?;
        Ok((outputs, judgements))
    }

    /// Applies the declared post-processing to a batch of outputs; `transforms` map detections
    /// back to the original images (empty for tensor inputs: boxes stay in input coordinates).
    pub fn postprocess(
        &self,
        outputs: &[Tensor],
        transforms: &[Transform],
    ) -> Result<Vec<Judgement>, ClassicError> {
        let Some(post) = &self.pipeline.postprocess else {
            return Ok(Vec::new());
        };
        let labels = self.labels.as_deref();
        match post {
            Postprocess::Classify(c) => {
                let out = match &c.output {
                    Some(name) => outputs.iter().find(|o| &o.name == name),
                    None => outputs.first(),
                }
                .ok_or_else(|| ClassicError::Backend("the classifier output is missing".into()))?;
                let mut scores = out.to_f32().ok_or_else(|| {
                    ClassicError::Backend(format!("output {:?} is not numeric", out.name))
                })?;
                let classes = *out.shape.last().unwrap_or(&1);
                if classes == 0 {
                    return Ok(Vec::new());
                }
                if c.softmax {
                    post::softmax_rows(&mut scores, classes);
                }
                Ok(scores
                    .chunks(classes)
                    .map(|row| Judgement::Classes(post::top_k(row, c.top_k as usize, labels)))
                    .collect())
            }
            Postprocess::Detect(d) => {
                let hw = self.input_hw();
                let batch = outputs.first().map_or(0, Tensor::batch);
                (0..batch)
                    .map(|item| {
                        let identity = Transform {
                            scale_x: 1.0,
                            scale_y: 1.0,
                            offset_x: 0.0,
                            offset_y: 0.0,
                            width: hw.1,
                            height: hw.0,
                        };
                        let tf = transforms.get(item).copied().unwrap_or(identity);
                        post::detect(d, outputs, item, hw, &tf, labels).map(Judgement::Detections)
                    })
                    .collect()
            }
        }
    }

    /// Height and width of the image input (from the pre-processing, else the graph).
    fn input_hw(&self) -> (usize, usize) {
        if let Some(size) = self
            .pipeline
            .preprocess
            .as_ref()
            .and_then(|p| p.output_size())
        {
            return (size.height as usize, size.width as usize);
        }
        let dims = self.inputs.first().map(spec_dims).unwrap_or_default();
        match (dims.get(2), dims.get(3)) {
            (Some(h), Some(w)) if *h > 0 && *w > 0 => (*h as usize, *w as usize),
            _ => (0, 0),
        }
    }
}

fn load_backend(
    path: &Path,
    inputs: &[TensorSpec],
    outputs: &[TensorSpec],
    options: &LoadOptions,
) -> Result<Arc<dyn Backend>, ClassicError> {
    match options.backend {
        BackendChoice::Tract => Ok(Arc::new(TractBackend::load(path, inputs, outputs)?)),
        BackendChoice::Onnxruntime => crate::ort_backend::load(path, inputs, outputs, options),
        BackendChoice::Auto => match crate::ort_backend::load(path, inputs, outputs, options) {
            Ok(b) => Ok(b),
            Err(e) => {
                tracing::info!(model = %path.display(), reason = %e, "ONNX Runtime is not available; using tract");
                Ok(Arc::new(TractBackend::load(path, inputs, outputs)?))
            }
        },
    }
}
