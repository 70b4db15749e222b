//! SmolLM2-135M-Instruct (Q4_1 GGUF) against llama.cpp's golden outputs (shared/MODELS.md).

use engine::{
    ChatMessage, Engine, EngineOptions, Event, FinishReason, GenerateRequest, Prompt,
    SamplingParams,
};
use testkit::cached_model;
use testkit::models::SMOLLM2_GGUF;

fn engine() -> Option<Engine> {
    let path = cached_model(SMOLLM2_GGUF)?;
    let options = EngineOptions {
        threads: 2,
        context: Some(1024),
        ..EngineOptions::default()
    };
    Some(Engine::load(&path, &options).unwrap())
}

fn greedy(engine: &Engine, prompt: Prompt, max_tokens: usize) -> (Vec<u32>, String, FinishReason) {
    let mut request = GenerateRequest::new(prompt, max_tokens);
    request.sampling = SamplingParams::greedy();
    let prepared = engine.prepare(request).unwrap();
    let mut ids = Vec::new();
    let mut text = String::new();
    let finished = engine
        .run(prepared, &mut |e| {
            match e {
                Event::Token(t) => {
                    ids.push(t.id);
                    text.push_str(&t.text);
                }
                Event::Finished(f) => text.push_str(&f.trailing_text),
                Event::Failed(e) => panic!("{e}"),
                Event::Shed(_) => panic!("shed"),
            }
            true
        })
        .unwrap();
    (ids, text, finished.reason)
}

#[test]
fn tokenizes_and_generates_like_llama_cpp() {
    let Some(engine) = engine() else { return };
    let ids = engine
        .tokenizer()
        .encode("The capital of France is", true)
        .unwrap();
    assert_eq!(ids, [504, 3575, 282, 4649, 314]);
    let (out, text, _) = greedy(&engine, Prompt::Text("The capital of France is".into()), 12);
    assert_eq!(
        out[..5],
        [7042, 30, 198, 198, 504],
        "first five greedy tokens: {out:?} ({text:?})"
    );
    assert!(text.starts_with(" Paris.\n\nThe"), "{text:?}");
}

#[test]
fn chatml_answers_paris() {
    let Some(engine) = engine() else { return };
    // ChatML as llama.cpp's built-in template writes it (no default system message).
    let prompt =
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
    let (ids, text, reason) = greedy(&engine, Prompt::Text(prompt.into()), 20);
    assert_eq!(text, "The capital of France is Paris.");
    assert_eq!(
        reason,
        FinishReason::Stop,
        "ends with <|im_end|> after {} tokens",
        ids.len()
    );
}

#[test]
fn jinja_chat_template_tokenizes_like_llama_cpp() {
    let Some(engine) = engine() else { return };
    // The GGUF's own template adds SmolLM's default system message; llama-server (with its
    // Jinja engine) tokenizes the rendered chat to exactly these ids.
    let text = engine
        .render_chat(&[ChatMessage::new("user", "What is the capital of France?")])
        .unwrap();
    let ids = engine.tokenizer().encode(&text, false).unwrap();
    assert_eq!(
        ids,
        [
            1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411,
            407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1,
            520, 9531, 198
        ]
    );
}

#[test]
fn perplexity_matches_llama_cpp() {
    let Some(engine) = engine() else { return };
    let text = include_str!("data/declaration.txt");
    let report = engine::bench::perplexity(&engine, text, 256, 0).unwrap();
    // llama-perplexity -c 256 on the same file and GGUF: PPL = 19.6525 over 7 chunks.
    assert_eq!(report.chunks, 7);
    let reference = 19.6525;
    assert!(
        (report.perplexity - reference).abs() / reference < 0.01,
        "perplexity {} vs llama.cpp {reference}",
        report.perplexity
    );
}

/// The same model with every tensor dequantized to F32: the engine then runs exact f32
/// arithmetic (F32 weights take f32 activations, nothing is quantized), which is the "exact f32
/// dequantized forward" of shared/MODELS.md.
fn dequantized_twin(dir: &std::path::Path) -> Option<std::path::PathBuf> {
    use formats::gguf::{GgmlType, GgufFile, GgufWriter};
    let src = cached_model(SMOLLM2_GGUF)?;
    let g = GgufFile::open(&src).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in g.metadata() {
        let value = if key == "general.file_type" {
            formats::gguf::Value::U32(0)
        } else {
            value.clone()
        };
        w.metadata(key, value).unwrap();
    }
    for t in &g.tensors {
        let dtype = engine::model::dtype_of(t.ggml_type).unwrap();
        let mut values = vec![0f32; t.n_elements as usize];
        kernels::quant::dequantize_row(dtype, g.tensor_data(t), &mut values);
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.tensor(&t.name, &t.dims, GgmlType::F32, bytes).unwrap();
    }
    let path = dir.join("smollm2-f32.gguf");
    w.write_to(std::io::BufWriter::new(
        std::fs::File::create(&path).unwrap(),
    ))
    .unwrap();
    Some(path)
}

#[test]
fn quantized_logits_stay_close_to_the_exact_f32_forward() {
    let Some(engine) = engine() else { return };
    let dir = tempfile::tempdir().unwrap();
    let Some(twin) = dequantized_twin(dir.path()) else {
        return;
    };
    let exact = Engine::load(
        &twin,
        &EngineOptions {
            threads: 2,
            context: Some(64),
            ..EngineOptions::default()
        },
    )
    .unwrap();
    // The exact forward's greedy continuation, as shared/MODELS.md records it.
    let (ids, _, _) = greedy(&exact, Prompt::Text("The capital of France is".into()), 7);
    assert_eq!(ids, [7042, 30, 198, 198, 504, 2988, 314]);

    let prompt = [504u32, 3575, 282, 4649, 314, 7042, 30, 198];
    let vocab = engine.config().vocab_size;
    let (q, f) = (
        engine.logits(&prompt).unwrap(),
        exact.logits(&prompt).unwrap(),
    );
    let mut worst = 0f32;
    for pos in 0..prompt.len() {
        let (qr, fr) = (
            &q[pos * vocab..(pos + 1) * vocab],
            &f[pos * vocab..(pos + 1) * vocab],
        );
        let diff = qr
            .iter()
            .zip(fr)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(diff);
        let argmax = |r: &[f32]| engine::sampler::argmax(r);
        if pos < 5 {
            assert_eq!(
                argmax(qr),
                argmax(fr),
                "position {pos}: the top token differs"
            );
        }
    }
    // Stated tolerance: 8-bit activations move no logit by more than 1.5 (logits span ~30; the
    // measured worst case over these 8 positions × 49152 logits is 0.98).
    eprintln!("max |logit(Q8 activations) - logit(exact f32)| = {worst}");
    assert!(worst < 1.5, "max logit difference {worst}");
}

#[test]
fn special_token_texts_in_chat_content_stay_plain_text() {
    let Some(engine) = engine() else { return };
    let t = engine.tokenizer();
    let specials =
        |ids: &[u32]| -> Vec<u32> { ids.iter().copied().filter(|&id| t.is_special(id)).collect() };
    let chat = |content: &str| {
        vec![
            ChatMessage::new("user", &format!("Say hi. {content}")),
            ChatMessage::new("assistant", content),
            ChatMessage::new("user", content),
        ]
    };
    let control = specials(&engine.encode_chat(&chat("x")).unwrap());
    assert!(t.special_texts().len() >= 17, "{:?}", t.special_texts());
    for text in t.special_texts() {
        let ids = engine.encode_chat(&chat(text)).unwrap();
        assert_eq!(specials(&ids), control, "{text:?} forged a control token");
        assert_eq!(
            t.decode(&ids),
            engine.render_chat(&chat(text)).unwrap(),
            "{text:?}: the text is kept"
        );
    }
    // The forged-turn attack costs many tokens, not one.
    let one = engine
        .encode_chat(&[ChatMessage::new("user", "<|im_start|>")])
        .unwrap();
    let hello = engine
        .encode_chat(&[ChatMessage::new("user", "hello")])
        .unwrap();
    assert!(one.len() > hello.len(), "{one:?} vs {hello:?}");
    // Raw completions still parse them, unless asked not to.
    assert_eq!(t.encode("<|im_start|>", false).unwrap(), [1]);
    assert!(specials(&t.encode_plain("<|im_start|>", false).unwrap()).is_empty());
}
