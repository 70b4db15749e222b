//! Readers for the model file formats Rampart serves, shared by the model repository and the engine.
//!
//! - [`byte_level`]: the byte-level alphabet of GPT-2-style BPE vocabularies.
//! - [`gguf`]: GGUF v2/v3 (header, typed metadata, tensor infos, alignment, data offset), plus a
//!   writer used for generated test models and for quantized exports.
//! - [`hf`]: Hugging Face checkpoint conventions of the llama family (tensor names, Q/K order).
//! - [`safetensors`]: safetensors headers (dtypes, shapes, offsets, metadata), shard indexes and
//!   a writer.
//! - [`tiny`]: tiny llama and qwen2 models in the real GGUF and Hugging Face layouts, for tests
//!   across the workspace.
//! - [`onnx`]: ONNX model metadata (IR version, opsets, inputs/outputs with dtypes and shapes,
//!   `metadata_props`, initializer statistics).
//!
//! Every reader treats the file as hostile: sizes and counts in the file are checked against the
//! bytes actually present before anything is allocated, and malformed input returns a typed error,
//! never a panic. This crate does no model computation and no network or async I/O.

pub mod byte_level;
pub mod gguf;
pub mod hf;
pub mod mapped;
pub mod onnx;
pub mod safetensors;
pub mod tiny;

pub use mapped::MappedFile;
