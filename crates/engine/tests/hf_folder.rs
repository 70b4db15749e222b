//! Hugging Face checkpoint folders (config.json + safetensors + tokenizer.json) against GGUF twins
//! holding the same weights: tiny random llama and qwen2 models (F32, F16, BF16; single and
//! sharded files; tied and separate output), the errors a broken folder gives, the repository
//! round trip, and SmolLM2-135M converted both ways from its Q4_1 GGUF.
//!
//! A llama GGUF stores Q/K rows permuted for pairwise RoPE; the Hugging Face folder keeps the
//! original order and the engine rotates NeoX-style. Both compute the same function: only the
//! order of the terms in each query-key dot product differs, so logits agree to float rounding.

use std::path::{Path, PathBuf};

use engine::{Engine, EngineOptions, Event, GenerateRequest, KvDType, KvOptions, Prompt};
use engine::{EngineError, SamplingParams};
use formats::safetensors::{SafetensorsFile, SafetensorsWriter};
use formats::tiny::{TinyArchitecture, TinyFloat, TinyLlama};

fn options(context: usize) -> EngineOptions {
    EngineOptions {
        threads: 2,
        context: Some(context),
        kv: KvOptions {
            dtype: KvDType::F32,
            ..KvOptions::default()
        },
        ..EngineOptions::default()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

/// Greedy ids of `prompt` (token ids), generating exactly `n` tokens (EOS ignored).
fn greedy(engine: &Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut request = GenerateRequest::new(Prompt::Tokens(prompt.to_vec()), n);
    request.sampling = SamplingParams::greedy();
    request.ignore_eos = true;
    let prepared = engine.prepare(request).unwrap();
    let mut ids = Vec::new();
    engine
        .run(prepared, &mut |e| {
            match e {
                Event::Token(t) => ids.push(t.id),
                Event::Failed(e) => panic!("{e}"),
                Event::Shed(_) => panic!("shed"),
                Event::Finished(_) => {}
            }
            true
        })
        .unwrap();
    ids
}

/// The tiny model as a GGUF file and as a Hugging Face folder under `dir`.
fn write_twins(dir: &Path, model: &TinyLlama, shards: usize) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let gguf = dir.join("model.gguf");
    std::fs::write(&gguf, model.to_gguf().unwrap()).unwrap();
    let hf = dir.join("hf");
    model.write_hf_folder(&hf, shards).unwrap();
    (gguf, hf)
}

#[test]
fn tiny_hf_folders_match_their_gguf_twins() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens = [1u32, 40, 77, 200, 13, 150, 5, 260];
    let mut report = Vec::new();
    for (arch, weight_type, shards, tied) in [
        (TinyArchitecture::Llama, TinyFloat::F32, 1, true),
        (TinyArchitecture::Llama, TinyFloat::BF16, 3, false),
        (TinyArchitecture::Qwen2, TinyFloat::F16, 2, false),
        (TinyArchitecture::Qwen2, TinyFloat::BF16, 1, true),
        // Every layer attends over the last 3 positions: shorter than the prompt.
        (
            TinyArchitecture::Mistral { sliding_window: 3 },
            TinyFloat::BF16,
            2,
            true,
        ),
    ] {
        let model = TinyLlama {
            architecture: arch,
            weight_type,
            tied_embeddings: tied,
            ..TinyLlama::default()
        };
        let case = format!("{}-{weight_type:?}-{shards}-{tied}", arch.model_type());
        let (gguf, hf) = write_twins(&tmp.path().join(&case), &model, shards);
        let from_gguf = Engine::load(&gguf, &options(64)).unwrap();
        let from_hf = Engine::load(&hf, &options(64)).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(from_hf.model().family.name, arch.name());
        assert_eq!(
            from_hf.model().format,
            engine::model::WeightFormat::HuggingFace
        );
        assert_eq!(from_hf.config(), from_gguf.config(), "{case}");
        assert_eq!(
            from_hf.config().sliding_window,
            arch.sliding_window().map(|w| w as usize),
            "{case}"
        );
        let (a, b) = (
            from_gguf.logits(&tokens).unwrap(),
            from_hf.logits(&tokens).unwrap(),
        );
        let diff = max_abs_diff(&a, &b);
        let range = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        report.push(format!("{case}: {diff:.2e} (logits up to {range:.2})"));
        assert!(diff <= 1e-4, "{case}: logits differ by {diff}");
        if arch.sliding_window().is_some() {
            // The window is in force: the same weights attending over everything differ.
            let unwindowed = TinyLlama {
                architecture: TinyArchitecture::Llama,
                ..model.clone()
            };
            let (plain, _) = write_twins(&tmp.path().join(format!("{case}-plain")), &unwindowed, 1);
            let c = Engine::load(&plain, &options(64))
                .unwrap()
                .logits(&tokens)
                .unwrap();
            let moved = max_abs_diff(&a, &c);
            assert!(
                moved > 1e-2,
                "{case}: the window changed logits by only {moved}"
            );
        }
        assert_eq!(
            greedy(&from_gguf, &tokens, 16),
            greedy(&from_hf, &tokens, 16),
            "{case}"
        );
    }
    eprintln!(
        "max |logit difference| GGUF vs HF folder: {}",
        report.join("; ")
    );
}

#[test]
fn the_tokenizer_json_tokenizer_behaves_like_the_gguf_one() {
    let tmp = tempfile::tempdir().unwrap();
    let (gguf, hf) = write_twins(tmp.path(), &TinyLlama::default(), 1);
    let a = Engine::load(&gguf, &options(64)).unwrap();
    let b = Engine::load(&hf, &options(64)).unwrap();
    let (ta, tb) = (a.tokenizer(), b.tokenizer());
    for text in [
        "the cat in the hat",
        "<|im_start|>user\nhéllo 12345<|im_end|>\n",
        "emoji 🙂 日本語\ttabs  ",
    ] {
        let ids = ta.encode(text, true).unwrap();
        assert_eq!(ids, tb.encode(text, true).unwrap(), "{text:?}");
        assert_eq!(tb.decode(&ids), text);
    }
    assert_eq!((tb.bos, tb.eos, tb.add_bos), (ta.bos, ta.eos, ta.add_bos));
    assert_eq!(tb.stop_tokens, [2], "EOS <|im_end|> once");
    assert_eq!(tb.stop_tokens, ta.stop_tokens);
    assert_eq!(tb.vocab_size(), ta.vocab_size());
    for id in 0..ta.vocab_size() as u32 {
        assert_eq!(ta.token_bytes(id), tb.token_bytes(id), "token {id}");
        assert_eq!(ta.is_special(id), tb.is_special(id), "token {id}");
    }
    let chat = [engine::ChatMessage::new("user", "Hi")];
    assert_eq!(a.render_chat(&chat).unwrap(), b.render_chat(&chat).unwrap());
}

#[test]
fn generation_config_stop_tokens_and_a_padded_embedding() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    TinyLlama::default().write_hf_folder(&hf, 1).unwrap();
    // A base-model EOS in generation_config.json joins the chat EOS, and BOS comes from the
    // post-processor when tokenizer_config.json does not say.
    edit_json(&hf.join("generation_config.json"), |g| {
        g["eos_token_id"] = serde_json::json!([2, 0]);
    });
    edit_json(&hf.join("tokenizer_config.json"), |c| {
        c.as_object_mut().unwrap().remove("add_bos_token");
    });
    edit_json(&hf.join("tokenizer.json"), |t| {
        t["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}
        });
    });
    let t = engine::tokenizer::Tokenizer::from_hf_folder(&hf).unwrap();
    assert_eq!(t.stop_tokens, [2, 0]);
    assert!(t.add_bos, "the post-processor adds BOS");
    assert_eq!(t.encode("the", true).unwrap()[0], 1);

    // The embedding has more rows than the tokenizer has ids: the extra ids decode to nothing.
    let vocab = TinyLlama::default().tokens.len();
    rewrite_safetensors(&hf.join("model.safetensors"), |tensors| {
        let embed = tensors
            .iter_mut()
            .find(|t| t.0 == "model.embed_tokens.weight")
            .unwrap();
        embed.2[0] += 8;
        embed.3.resize(embed.3.len() + 8 * 64 * 4, 0);
    });
    edit_json(&hf.join("config.json"), |c| {
        c["vocab_size"] = serde_json::json!(vocab + 8)
    });
    let e = Engine::load(&hf, &options(64)).unwrap();
    assert_eq!(e.config().vocab_size, vocab + 8);
    assert_eq!(e.tokenizer().vocab_size(), vocab + 8);
    assert!(e.tokenizer().token_bytes(vocab as u32 + 3).is_empty());
    assert!(e.tokenizer().is_special(vocab as u32 + 3));
}

/// A tensor as `rewrite_safetensors` hands it over: name, dtype, shape, bytes.
type Tensor = (String, String, Vec<u64>, Vec<u8>);

fn rewrite_safetensors(path: &Path, edit: impl FnOnce(&mut Vec<Tensor>)) {
    let mut tensors: Vec<Tensor> = {
        let file = SafetensorsFile::open(path).unwrap();
        file.tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.clone(),
                    t.shape.clone(),
                    file.tensor_data(t).to_vec(),
                )
            })
            .collect()
    };
    edit(&mut tensors);
    let mut w = SafetensorsWriter::new();
    for (name, dtype, shape, data) in &tensors {
        w.tensor(name, dtype, shape, data.as_slice()).unwrap();
    }
    std::fs::write(path, w.to_bytes().unwrap()).unwrap();
}

fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut value: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(path, serde_json::to_string_pretty(&value).unwrap()).unwrap();
}

#[test]
fn unaligned_f32_tensors_are_copied_not_misread() {
    let tmp = tempfile::tempdir().unwrap();
    let (gguf, hf) = write_twins(tmp.path(), &TinyLlama::default(), 1);
    // One more header byte: every tensor's data starts at an odd offset.
    let path = hf.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut shifted = (header_len as u64 + 1).to_le_bytes().to_vec();
    shifted.extend_from_slice(&bytes[8..8 + header_len]);
    shifted.push(b' ');
    shifted.extend_from_slice(&bytes[8 + header_len..]);
    std::fs::write(&path, shifted).unwrap();
    let tokens = [1u32, 40, 77, 200];
    let a = Engine::load(&gguf, &options(64))
        .unwrap()
        .logits(&tokens)
        .unwrap();
    let b = Engine::load(&hf, &options(64))
        .unwrap()
        .logits(&tokens)
        .unwrap();
    assert!(max_abs_diff(&a, &b) <= 1e-4);
}

/// Loading `dir` fails with an error whose text contains `needle`.
fn assert_load_error(dir: &Path, needle: &str) {
    let err: EngineError = Engine::load(dir, &options(64)).expect_err(needle);
    let text = err.to_string();
    assert!(text.contains(needle), "expected {needle:?} in {text:?}");
}

#[test]
fn broken_folders_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let mut n = 0;
    let mut fresh = |shards: usize| {
        n += 1;
        let dir = tmp.path().join(format!("case{n}"));
        TinyLlama::default().write_hf_folder(&dir, shards).unwrap();
        dir
    };

    let dir = fresh(1);
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert_load_error(&dir, "config.json is missing");

    let dir = fresh(1);
    edit_json(&dir.join("config.json"), |c| {
        c["architectures"] = serde_json::json!(["MixtralForCausalLM"]);
    });
    assert_load_error(&dir, "\"MixtralForCausalLM\" is not supported");

    let dir = fresh(1);
    edit_json(&dir.join("config.json"), |c| {
        c.as_object_mut().unwrap().remove("hidden_size");
    });
    assert_load_error(&dir, "hidden_size is missing");

    let dir = fresh(1);
    rewrite_safetensors(&dir.join("model.safetensors"), |t| {
        t.retain(|t| t.0 != "model.layers.1.mlp.up_proj.weight")
    });
    assert_load_error(
        &dir,
        "tensor \"model.layers.1.mlp.up_proj.weight\": missing",
    );

    let dir = fresh(1);
    edit_json(&dir.join("config.json"), |c| {
        c["intermediate_size"] = serde_json::json!(96)
    });
    assert_load_error(
        &dir,
        "tensor \"model.layers.0.mlp.gate_proj.weight\": shape [128, 64], expected [96, 64]",
    );

    let dir = fresh(1);
    rewrite_safetensors(&dir.join("model.safetensors"), |t| {
        t.push((
            "model.layers.0.self_attn.o_proj.bias".into(),
            "F32".into(),
            vec![64],
            vec![0; 256],
        ))
    });
    assert_load_error(&dir, "does not use (model.layers.0.self_attn.o_proj.bias)");

    let dir = fresh(1);
    rewrite_safetensors(&dir.join("model.safetensors"), |t| {
        let norm = t.iter_mut().find(|t| t.0 == "model.norm.weight").unwrap();
        norm.1 = "I32".into();
    });
    assert_load_error(
        &dir,
        "tensor \"model.norm.weight\": type I32 is not supported (supported: F32, F16, BF16)",
    );

    let dir = fresh(1);
    edit_json(&dir.join("config.json"), |c| {
        c["tie_word_embeddings"] = serde_json::json!(false)
    });
    assert_load_error(&dir, "tensor \"lm_head.weight\": missing");

    let dir = fresh(1);
    edit_json(&dir.join("config.json"), |c| {
        c["vocab_size"] = serde_json::json!(300)
    });
    assert_load_error(&dir, "config.json has vocab_size 300");

    let dir = fresh(3);
    std::fs::remove_file(dir.join("model-00002-of-00003.safetensors")).unwrap();
    assert_load_error(&dir, "model-00002-of-00003.safetensors");

    let dir = fresh(2);
    edit_json(&dir.join("model.safetensors.index.json"), |i| {
        i["weight_map"]["model.norm.weight"] =
            serde_json::json!("model-00001-of-00002.safetensors");
    });
    assert_load_error(&dir, "places it in model-00001-of-00002.safetensors");

    let dir = fresh(1);
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert_load_error(&dir, "neither model.safetensors nor");

    let dir = fresh(1);
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert_load_error(&dir, "tokenizer.json is missing");

    let dir = fresh(1);
    std::fs::write(dir.join("tokenizer.json"), "{\"model\": 1}").unwrap();
    assert_load_error(&dir, "tokenizer.json");

    // A WordPiece vocabulary (an encoder's) says nothing about the bytes of its tokens.
    let dir = fresh(1);
    edit_json(&dir.join("tokenizer.json"), |t| {
        t["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"});
        t["post_processor"] = serde_json::Value::Null;
        t["decoder"] = serde_json::json!({"type": "WordPiece", "prefix": "##", "cleanup": true});
        t["model"] = serde_json::json!({"type": "WordPiece", "unk_token": "<|endoftext|>",
            "continuing_subword_prefix": "##", "max_input_chars_per_word": 100,
            "vocab": {"<|endoftext|>": 0, "a": 1}});
        t["added_tokens"] = serde_json::json!([]);
    });
    assert_load_error(
        &dir,
        "neither byte-level BPE nor a SentencePiece-style vocabulary",
    );
}

#[test]
fn repository_imports_and_serves_a_hugging_face_folder() {
    use repo::manifest::{Format, Kind};
    use repo::{BuildInfo, ImportOptions, ModelRef, NoProgress, Repository};
    let tmp = tempfile::tempdir().unwrap();
    let model = TinyLlama {
        architecture: TinyArchitecture::Qwen2,
        weight_type: TinyFloat::BF16,
        tied_embeddings: false,
        ..TinyLlama::default()
    };
    let (gguf, hf) = write_twins(tmp.path(), &model, 2);
    let repository = Repository::open(tmp.path().join("models"));
    let imported = repository
        .import(
            &hf,
            &ImportOptions {
                name: "tiny-qwen2".into(),
                version: "1.0.0".into(),
                kind: None,
                link: false,
                git_commit: None,
                dataset_version: None,
                derived_from: None,
                pipeline: None,
                build: BuildInfo {
                    version: "0.0.0-test".into(),
                    git_commit: None,
                    rustc: None,
                },
                progress: &NoProgress,
                rules_check: None,
                host_fingerprint: None,
                card: None,
                stable: false,
            },
        )
        .unwrap();
    let m = &imported.manifest;
    assert_eq!(
        (m.model.kind, m.model.format),
        (Kind::Llm, Format::Safetensors)
    );
    assert_eq!(
        m.model.weights,
        [
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    assert_eq!(m.model.parameter_count, model.parameter_count());
    let reference: ModelRef = "tiny-qwen2".parse().unwrap();
    let served = Engine::from_repository(&repository, &reference, &options(64)).unwrap();
    let direct = Engine::load(&gguf, &options(64)).unwrap();
    let tokens = [1u32, 40, 77, 200];
    let diff = max_abs_diff(
        &served.logits(&tokens).unwrap(),
        &direct.logits(&tokens).unwrap(),
    );
    assert!(diff <= 1e-4, "{diff}");
}

/// SmolLM2-135M from its Q4_1 GGUF, every tensor dequantized and rounded to f16 (norms kept in
/// f32): an F16 GGUF with the same metadata, and a Hugging Face folder with the same numbers
/// (Q/K rows un-permuted, `tokenizer.json` built from the GGUF's vocabulary, merges and token
/// types, `tokenizer_config.json` with its BOS/EOS and chat template).
fn smollm2_twins(dir: &Path) -> Option<(PathBuf, PathBuf)> {
    use formats::gguf::{GgmlType, GgufFile, GgufWriter};
    use formats::hf::{hf_tensor_name, unpermute_qk};
    use kernels::quant::dequantize_row;
    use serde_json::json;

    let source = testkit::cached_model(testkit::models::SMOLLM2_GGUF)?;
    let g = GgufFile::open(&source).unwrap();
    let arch = g.architecture().unwrap().unwrap().to_string();
    assert_eq!(arch, "llama");
    let get = |key: &str| g.arch_u64(key).unwrap().unwrap();
    let (heads, kv_heads) = (
        get("attention.head_count") as usize,
        get("attention.head_count_kv") as usize,
    );

    let mut gguf = GgufWriter::new();
    for (key, value) in g.metadata() {
        match key {
            // MOSTLY_F16.
            "general.file_type" => gguf.metadata(key, 1u32),
            _ => gguf.metadata(key, value.clone()),
        }
        .unwrap();
    }
    let mut hf_tensors = Vec::new();
    for t in &g.tensors {
        let dtype = engine::model::dtype_of(t.ggml_type).unwrap();
        let mut values = vec![0f32; t.n_elements as usize];
        dequantize_row(dtype, g.tensor_data(t), &mut values);
        let matrix = t.dims.len() == 2;
        let stored = if matrix {
            TinyFloat::F16
        } else {
            TinyFloat::F32
        };
        for v in &mut values {
            *v = stored.round(*v);
        }
        let ggml_type = if matrix { GgmlType::F16 } else { GgmlType::F32 };
        gguf.tensor(&t.name, &t.dims, ggml_type, stored.encode(&values))
            .unwrap();
        let cols = t.dims[0] as usize;
        let values = if t.name.ends_with("attn_q.weight") {
            unpermute_qk(&values, heads, cols)
        } else if t.name.ends_with("attn_k.weight") {
            unpermute_qk(&values, kv_heads, cols)
        } else {
            values
        };
        let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
        let name = hf_tensor_name(&t.name).unwrap_or_else(|| panic!("{}", t.name));
        hf_tensors.push((
            name,
            stored.safetensors_name(),
            shape,
            stored.encode(&values),
        ));
    }
    let gguf_path = dir.join("smollm2-f16.gguf");
    gguf.write_to(std::io::BufWriter::new(
        std::fs::File::create(&gguf_path).unwrap(),
    ))
    .unwrap();
    drop(gguf);

    let hf = dir.join("smollm2-hf");
    std::fs::create_dir_all(&hf).unwrap();
    let mut st = SafetensorsWriter::new();
    st.metadata("format", "pt");
    for (name, dtype, shape, data) in &hf_tensors {
        st.tensor(name, dtype, shape, data.as_slice()).unwrap();
    }
    st.write_to(std::io::BufWriter::new(
        std::fs::File::create(hf.join("model.safetensors")).unwrap(),
    ))
    .unwrap();

    let tokens = g
        .get_array("tokenizer.ggml.tokens")
        .unwrap()
        .unwrap()
        .as_strings()
        .unwrap()
        .to_vec();
    let merges = g
        .get_array("tokenizer.ggml.merges")
        .unwrap()
        .unwrap()
        .as_strings()
        .unwrap()
        .to_vec();
    let special: Vec<bool> = g
        .get_array("tokenizer.ggml.token_type")
        .unwrap()
        .unwrap()
        .to_i64s()
        .unwrap()
        .iter()
        .map(|&t| t == 3 || t == 4)
        .collect();
    let pre = g.get_str("tokenizer.ggml.pre").unwrap().unwrap();
    assert_eq!(pre, "smollm");
    let tokenizer = formats::tiny::byte_level_tokenizer_json(&tokens, &merges, &special, true);
    let write = |name: &str, value: serde_json::Value| {
        std::fs::write(hf.join(name), serde_json::to_string_pretty(&value).unwrap()).unwrap()
    };
    write("tokenizer.json", tokenizer);
    let id = |key: &str| g.get_u64(key).unwrap().unwrap();
    let (bos, eos) = (
        id("tokenizer.ggml.bos_token_id"),
        id("tokenizer.ggml.eos_token_id"),
    );
    write(
        "tokenizer_config.json",
        json!({
            "add_bos_token": g.get_bool("tokenizer.ggml.add_bos_token").unwrap().unwrap_or(false),
            "bos_token": tokens[bos as usize],
            "eos_token": tokens[eos as usize],
            "chat_template": g.get_str("tokenizer.chat_template").unwrap().unwrap(),
        }),
    );
    write(
        "generation_config.json",
        json!({"bos_token_id": bos, "eos_token_id": eos}),
    );
    write(
        "config.json",
        json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": get("embedding_length"),
            "intermediate_size": get("feed_forward_length"),
            "num_hidden_layers": get("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "max_position_embeddings": get("context_length"),
            "vocab_size": tokens.len(),
            "rms_norm_eps": g.arch_f64("attention.layer_norm_rms_epsilon").unwrap().unwrap(),
            "rope_theta": g.arch_f64("rope.freq_base").unwrap().unwrap(),
            "rope_scaling": null,
            "hidden_act": "silu",
            "tie_word_embeddings": g.tensor("output.weight").is_none(),
            "torch_dtype": "float16",
        }),
    );
    Some((gguf_path, hf))
}

/// Largest |logit difference| allowed between SmolLM2's F16 GGUF and F16 Hugging Face folder.
/// They hold the same numbers; only the order of terms in the query-key dot products differs
/// (pairwise RoPE over permuted rows against NeoX RoPE over the original ones). Measured: at most
/// 4.7e-5 over four prompts of 45-77 positions, on logits up to 43 in magnitude, with every one
/// of 4 × 40 greedy tokens the same.
const SMOLLM2_LOGIT_TOLERANCE: f32 = 1e-3;

#[test]
fn smollm2_hf_folder_matches_its_f16_gguf_twin() {
    let tmp = tempfile::tempdir().unwrap();
    let Some((gguf, hf)) = smollm2_twins(tmp.path()) else {
        return;
    };
    let from_gguf = Engine::load(&gguf, &options(512)).unwrap();
    let from_hf = Engine::load(&hf, &options(512)).unwrap();
    assert_eq!(from_hf.config(), from_gguf.config());
    let (ta, tb) = (from_gguf.tokenizer(), from_hf.tokenizer());
    assert_eq!(tb.stop_tokens, ta.stop_tokens);
    assert_eq!((tb.bos, tb.eos, tb.add_bos), (ta.bos, ta.eos, ta.add_bos));
    let chat = [engine::ChatMessage::new(
        "user",
        "What is the capital of France?",
    )];
    let rendered = from_gguf.render_chat(&chat).unwrap();
    assert_eq!(rendered, from_hf.render_chat(&chat).unwrap());
    let prompts = [
        "The capital of France is".to_string(),
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n".into(),
        "Once upon a time, in a village of 1234 people,".into(),
        rendered,
    ];
    let mut worst = 0f32;
    let mut largest = 0f32;
    let mut report = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let ids = ta.encode(prompt, true).unwrap();
        assert_eq!(ids, tb.encode(prompt, true).unwrap(), "{prompt:?}");
        let (a, b) = (greedy(&from_gguf, &ids, 40), greedy(&from_hf, &ids, 40));
        let agree = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        if i == 0 {
            assert_eq!(
                a[..5],
                [7042, 30, 198, 198, 504],
                "\" Paris.\\n\\nThe\" as the reference gives"
            );
        }
        let full: Vec<u32> = ids.iter().chain(&a).copied().collect();
        let (la, lb) = (
            from_gguf.logits(&full).unwrap(),
            from_hf.logits(&full).unwrap(),
        );
        let diff = max_abs_diff(&la, &lb);
        worst = worst.max(diff);
        largest = la.iter().fold(largest, |m, v| m.max(v.abs()));
        report.push(format!(
            "prompt {i}: {agree}/{} greedy tokens agree, max |logit diff| {diff:.2e} over {} positions",
            a.len(),
            full.len()
        ));
        assert_eq!(a, b, "prompt {i}: {}", ta.decode(&a));
    }
    eprintln!(
        "SmolLM2 F16 GGUF vs HF folder: {}; overall {worst:.2e} (logits up to {largest:.1})",
        report.join("; ")
    );
    assert!(
        worst <= SMOLLM2_LOGIT_TOLERANCE,
        "logits differ by {worst} (tolerance {SMOLLM2_LOGIT_TOLERANCE})"
    );

    // The folder converted back to GGUF (as `rampart model quantize` does for a folder) is the
    // twin again: same tokenizer, same greedy tokens. RAMPART_TEST_KEEP=DIR keeps the file, to
    // check it with llama.cpp.
    let back = tmp.path().join("from-hf.gguf");
    engine::convert::quantize_hf(
        &hf,
        &engine::convert::QuantPlan::uniform(kernels::DType::F16),
        &back,
        2,
        &mut |_, _, _| {},
    )
    .unwrap();
    if let Some(keep) = std::env::var_os("RAMPART_TEST_KEEP") {
        std::fs::copy(
            &back,
            std::path::Path::new(&keep).join("smollm2-from-hf.gguf"),
        )
        .unwrap();
    }
    let converted = Engine::load(&back, &options(512)).unwrap();
    let ids = ta.encode(&prompts[0], true).unwrap();
    assert_eq!(
        converted.tokenizer().encode(&prompts[2], true).unwrap(),
        ta.encode(&prompts[2], true).unwrap()
    );
    assert_eq!(greedy(&converted, &ids, 40), greedy(&from_gguf, &ids, 40));
}
