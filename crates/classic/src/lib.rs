//! Classic tensor models: ONNX graphs served as carefully as LLMs.
//!
//! - [`backend`]: the graph runs on tract (pure Rust, always present) or ONNX Runtime (loaded at
//!   run time when its library is installed, [`ort_backend`]).
//! - [`imageops`]: the one implementation of image decoding, EXIF orientation, resizing, cropping,
//!   letterboxing and normalization that the declared pre-processing runs.
//! - [`post`]: softmax, top-k with labels, detector decoding (PicoDet, YOLOv5, YOLOv8) and
//!   class-aware NMS, boxes mapped back to the original image.
//! - [`batcher`]: the per-model dynamic batcher.
//! - [`model`]: a loaded model with its request checks.
//! - [`tensor`] and [`tensor_json`]: typed tensors, their binary encoding, and their JSON data
//!   read straight into typed buffers within a per-request [`tensor_json::DecodeBudget`].
//!
//! The pipeline declaration itself lives in `repo::pipeline`, as part of the immutable version.

pub mod backend;
pub mod batcher;
pub mod error;
pub mod imageops;
pub mod model;
pub mod ort_backend;
pub mod post;
pub mod tensor;
pub mod tensor_json;

pub use error::ClassicError;
pub use model::{BackendChoice, ImageFeatures, Judgement, LoadOptions, TensorModel};
pub use tensor::{DType, Data, Tensor};
