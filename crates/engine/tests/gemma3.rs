//! Gemma 3 270M (Q4_K_M GGUF: Q5_0, Q4_K, Q6_K and Q8_0 weights; five sliding-window layers to
//! one global layer) against the greedy continuation llama.cpp and transformers agree on
//! (shared/MODELS.md). Skipped when the model is not fetched (`scripts/fetch-models.sh gemma3`).

use engine::{ChatMessage, Engine, EngineOptions, Event, GenerateRequest, Prompt, SamplingParams};
use testkit::cached_model;
use testkit::models::GEMMA3_GGUF;

fn engine() -> Option<Engine> {
    let path = cached_model(GEMMA3_GGUF)?;
    let options = EngineOptions {
        threads: 2,
        context: Some(2048),
        ..EngineOptions::default()
    };
    Some(Engine::load(&path, &options).unwrap())
}

fn greedy(engine: &Engine, prompt: Prompt, max_tokens: usize) -> (Vec<u32>, String) {
    let mut request = GenerateRequest::new(prompt, max_tokens);
    request.sampling = SamplingParams::greedy();
    let prepared = engine.prepare(request).unwrap();
    let mut ids = Vec::new();
    let mut text = String::new();
    engine
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
    (ids, text)
}

#[test]
fn loads_the_gemma3_shape() {
    let Some(engine) = engine() else { return };
    let c = &engine.model().config;
    assert_eq!(engine.model().family.name, "gemma3");
    assert_eq!(
        (c.block_count, c.hidden, c.heads, c.kv_heads, c.head_dim),
        (18, 640, 4, 1, 256)
    );
    assert_eq!(c.sliding_window, Some(512));
    assert_eq!(c.vocab_size, 262_144);
}

#[test]
fn continues_greedily_like_llama_cpp_and_transformers() {
    let Some(engine) = engine() else { return };
    let prompt = [2u32, 818, 5279, 529, 7001, 563];
    let (ids, text) = greedy(&engine, Prompt::Tokens(prompt.to_vec()), 12);
    assert_eq!(
        ids,
        [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488],
        "{text:?}"
    );
    // The tokenizer: BOS first, then the SentencePiece pieces of the text.
    let text_ids = engine
        .tokenizer()
        .encode(&engine.tokenizer().decode(&prompt[1..]), true)
        .unwrap();
    assert_eq!(text_ids, prompt, "re-encoding the prompt's text");
}

/// The file carries no chat template: Gemma's turn format, with one BOS, and `<end_of_turn>`
/// stops a reply. (This 270M file is the base model, not the instruction-tuned one: its replies
/// to chats are not meaningful, so only the format is checked.)
#[test]
fn renders_chats_in_gemmas_turn_format() {
    let Some(engine) = engine() else { return };
    let messages = [
        ChatMessage::new("system", "Answer briefly."),
        ChatMessage::new("user", "Hi"),
    ];
    let rendered = engine.render_chat(&messages).unwrap();
    assert_eq!(
        rendered,
        "<bos><start_of_turn>user\nAnswer briefly.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    );
    let ids = engine.encode_chat(&messages).unwrap();
    assert_eq!(ids[..2], [2, 105], "{ids:?}");
    let end_of_turn = engine.tokenizer().encode("<end_of_turn>", false).unwrap();
    assert_eq!(end_of_turn, [106]);
    assert!(engine.tokenizer().stop_tokens.contains(&106));
}

/// Gemma's vocabulary spells newlines, runs of spaces and tabs with user-defined tokens: they are
/// text, so a client's newlines and indentation become those tokens (as llama.cpp tokenizes, not
/// byte tokens the model rarely saw), in chat content too, and generated ones show in the output.
#[test]
fn newlines_and_indentation_are_text() {
    let Some(engine) = engine() else { return };
    let t = engine.tokenizer();
    let ids = t.encode_plain("a\nb\n\nc    d", false).unwrap();
    assert_eq!(
        ids,
        [236746, 107, 236763, 108, 236755, 140, 236753],
        "{ids:?}"
    );
    assert!(!ids.iter().any(|&id| t.is_special(id)));
    let chat = engine
        .encode_chat(&[ChatMessage::new("user", "a\nb")])
        .unwrap();
    assert!(
        chat.windows(3).any(|w| w == [236746, 107, 236763]),
        "{chat:?}"
    );
    // A client cannot write a control token.
    let ids = t.encode_plain("<start_of_turn>", false).unwrap();
    assert!(!ids.contains(&105), "{ids:?}");
    let (ids, text) = greedy(&engine, Prompt::Text("def fibonacci(n):".into()), 6);
    assert_eq!(ids[..2], [107, 140], "a newline, then four spaces: {ids:?}");
    assert!(text.starts_with("\n    if"), "{text:?}");
}

/// Text completion beyond the golden's few positions: a few-shot prompt, and a count longer
/// than the 512-token window of the sliding-window layers (the global layers see it all).
#[test]
fn completes_few_shot_prompts_and_counts_past_the_window() {
    let Some(engine) = engine() else { return };
    let prompt =
        "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is";
    let (_, text) = greedy(&engine, Prompt::Text(prompt.into()), 3);
    assert!(text.starts_with(" Rome"), "{text:?}");
    let count: Vec<String> = (1..=150).map(|i| i.to_string()).collect();
    let prompt = format!("{},", count.join(", "));
    let tokens = engine.tokenizer().encode(&prompt, true).unwrap();
    assert!(tokens.len() > 600, "{} tokens", tokens.len());
    let (_, text) = greedy(&engine, Prompt::Text(prompt), 9);
    assert!(text.starts_with(" 151, 152"), "{text:?}");
}

#[test]
fn perplexity_matches_llama_cpp() {
    let Some(engine) = engine() else { return };
    let text = include_str!("data/declaration.txt");
    let report = engine::bench::perplexity(&engine, text, 256, 0).unwrap();
    // `llama-perplexity -c 256 -t 2` on the same file and GGUF (llama.cpp of llama-cpp-python
    // 0.3.36): PPL = 9.1679 over 7 chunks.
    assert_eq!(report.chunks, 7);
    eprintln!(
        "perplexity {:.4} over {} chunks",
        report.perplexity, report.chunks
    );
    let reference = 9.1679;
    assert!(
        (report.perplexity - reference).abs() / reference < 0.01,
        "perplexity {} vs llama.cpp {reference}",
        report.perplexity
    );
}
