//! Tool calling for every family we serve, on tiny random-weight models that carry the family's
//! real chat template and control tokens (tests/data/templates, with their sources).
//!
//! - The conversation (tools, an earlier call, its result) renders byte for byte as Hugging
//!   Face's `apply_chat_template` renders it (the `.expected` files, written by `render.py`).
//! - 1,000 requests at temperature 1 over five families and every `tool_choice`: each output
//!   that ended by itself parses, names an offered function, and its arguments validate against
//!   that function's schema (checked here with a JSON-schema validator, apart from the crate's
//!   own check); the forced choices call; and reading the output piece by piece as it streams
//!   gives exactly what reading it whole gives.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use engine::{
    ChatMessage, Constraint, Engine, EngineOptions, Event, FinishReason, FunctionCall,
    GenerateRequest, Prompt, SamplingParams, ToolCall,
};
use formats::tiny::TinyLlama;
use grammar::tools::{
    prepare_history, ToolChoice, ToolEvent, ToolFormat, ToolRendering, ToolRequest, ToolSession,
};
use grammar::{Compiler, GrammarLimits};
use serde_json::{json, Value};

fn data() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/templates")
}

fn template(name: &str) -> String {
    std::fs::read_to_string(data().join(format!("{name}.jinja"))).unwrap()
}

fn tools() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data().join("tools.json")).unwrap()).unwrap()
}

/// The conversation of `messages.json` as the server builds it from a request.
fn conversation() -> Vec<ChatMessage> {
    let raw: Value =
        serde_json::from_str(&std::fs::read_to_string(data().join("messages.json")).unwrap())
            .unwrap();
    raw.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let mut message = ChatMessage::new(
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap_or_default(),
            );
            if let Some(calls) = m["tool_calls"].as_array() {
                message.tool_calls = calls
                    .iter()
                    .map(|c| ToolCall {
                        id: c["id"].as_str().unwrap().into(),
                        kind: "function".into(),
                        function: FunctionCall {
                            name: c["function"]["name"].as_str().unwrap().into(),
                            arguments: c["function"]["arguments"].clone(),
                        },
                    })
                    .collect();
            }
            message.tool_call_id = m["tool_call_id"].as_str().map(String::from);
            message.name = m["name"].as_str().map(String::from);
            message
        })
        .collect()
}

/// A family: its template, the control tokens its vocabulary adds, BOS and EOS.
struct Family {
    template: &'static str,
    controls: &'static [&'static str],
    bos: &'static str,
    eos: &'static str,
    /// The format the operator declares (the template has none).
    declared: Option<ToolFormat>,
    format: ToolFormat,
}

const FAMILIES: [Family; 5] = [
    Family {
        template: "qwen2.5",
        controls: &[],
        bos: "<|im_start|>",
        eos: "<|im_end|>",
        declared: None,
        format: ToolFormat::Hermes,
    },
    Family {
        template: "llama3.2",
        controls: &[
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ],
        bos: "<|begin_of_text|>",
        eos: "<|eot_id|>",
        declared: None,
        format: ToolFormat::Llama3,
    },
    Family {
        template: "mistral-v0.3",
        controls: &[
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ],
        bos: "<s>",
        eos: "</s>",
        declared: None,
        format: ToolFormat::Mistral,
    },
    Family {
        template: "phi4-mini",
        controls: &[
            "<|system|>",
            "<|user|>",
            "<|assistant|>",
            "<|end|>",
            "<|tool|>",
            "<|/tool|>",
            "<|tool_call|>",
            "<|/tool_call|>",
        ],
        bos: "<|endoftext|>",
        eos: "<|end|>",
        declared: None,
        format: ToolFormat::Phi4Mini,
    },
    Family {
        template: "smollm2",
        controls: &[],
        bos: "<|im_start|>",
        eos: "<|im_end|>",
        declared: Some(ToolFormat::SmolLm2),
        format: ToolFormat::SmolLm2,
    },
];

/// A tiny model with `family`'s control tokens and the template `name`.
fn model(family: &Family, name: &str, dir: &Path) -> Engine {
    let mut tiny = TinyLlama {
        context_length: 4096,
        chat_template: Some(template(name)),
        ..TinyLlama::default()
    };
    tiny.tokens
        .extend(family.controls.iter().map(|c| c.to_string()));
    let id = |t: &str| tiny.tokens.iter().position(|x| x == t).unwrap() as u32;
    tiny.bos_token_id = id(family.bos);
    tiny.eos_token_id = id(family.eos);
    let path = dir.join(format!("{name}.gguf"));
    std::fs::write(&path, tiny.to_gguf().unwrap()).unwrap();
    let options = EngineOptions {
        threads: 2,
        context: Some(4096),
        ..EngineOptions::default()
    };
    Engine::load(&path, &options).unwrap()
}

#[test]
fn templates_show_their_tool_format() {
    assert_eq!(
        ToolFormat::detect(&template("qwen2.5")),
        Some(ToolFormat::Hermes)
    );
    assert_eq!(
        ToolFormat::detect(&template("qwen3")),
        Some(ToolFormat::Hermes)
    );
    assert_eq!(
        ToolFormat::detect(&template("llama3.2")),
        Some(ToolFormat::Llama3)
    );
    assert_eq!(
        ToolFormat::detect(&template("mistral-v0.3")),
        Some(ToolFormat::Mistral)
    );
    assert_eq!(
        ToolFormat::detect(&template("phi4-mini")),
        Some(ToolFormat::Phi4Mini)
    );
    // No tool format: requests with tools are refused unless the operator declares one.
    assert_eq!(ToolFormat::detect(&template("phi3-mini")), None);
    assert_eq!(ToolFormat::detect(&template("gemma3")), None);
    assert_eq!(ToolFormat::detect(&template("smollm2")), None);
    assert_eq!(
        ToolRendering::of(&template("phi4-mini")),
        ToolRendering::SystemField
    );
    assert_eq!(
        ToolRendering::of(&template("qwen2.5")),
        ToolRendering::Template
    );
}

/// Rampart's rendering of the conversation and tools equals Hugging Face's, byte for byte.
#[test]
fn conversations_with_tools_render_as_the_reference_does() {
    let dir = tempfile::tempdir().unwrap();
    let request = ToolRequest::from_openai(Some(&tools()), None, None)
        .unwrap()
        .unwrap();
    let dated = regex::Regex::new("Today Date: [^\n]*").unwrap();
    for name in ["qwen2.5", "qwen3", "llama3.2", "mistral-v0.3"] {
        let family = match name {
            "llama3.2" => &FAMILIES[1],
            "mistral-v0.3" => &FAMILIES[2],
            _ => &FAMILIES[0],
        };
        let engine = model(family, name, dir.path());
        let template = engine.chat_template().unwrap();
        let format = ToolFormat::detect(template.source()).unwrap();
        let mut messages = conversation();
        let tools = prepare_history(
            &mut messages,
            format,
            ToolRendering::of(template.source()),
            &request.template_tools(),
        );
        let mut ours = template.render_with_tools(&messages, &tools, true).unwrap();
        let expected = std::fs::read_to_string(data().join(format!("{name}.expected"))).unwrap();
        // Llama prints today's date; the reference was rendered on a fixed one.
        ours = dated.replace(&ours, "Today Date: 26 Jul 2024").into_owned();
        if ours != expected {
            let at = ours
                .bytes()
                .zip(expected.bytes())
                .position(|(a, b)| a != b)
                .unwrap_or(ours.len().min(expected.len()));
            panic!(
                "{name}: differs at byte {at}:\nours:     {:?}\nexpected: {:?}",
                &ours[at.saturating_sub(40)..(at + 80).min(ours.len())],
                &expected[at.saturating_sub(40)..(at + 80).min(expected.len())]
            );
        }
    }
}

struct Run {
    pieces: Vec<String>,
    reason: Option<FinishReason>,
    failed: Option<String>,
}

fn collect(mut s: engine::Stream) -> Run {
    let mut run = Run {
        pieces: Vec::new(),
        reason: None,
        failed: None,
    };
    while let Some(e) = s.blocking_next() {
        match e {
            Event::Token(t) => run.pieces.push(t.text),
            Event::Finished(f) => {
                run.pieces.push(f.trailing_text);
                run.reason = Some(f.reason);
            }
            Event::Failed(e) => run.failed = Some(e),
            Event::Shed(_) => run.failed = Some("shed".into()),
        }
    }
    run
}

/// What the streamed events add up to: the text answer, and each call's name and arguments.
fn replay(session: &ToolSession, pieces: &[String]) -> (Option<String>, Vec<(String, String)>) {
    let mut parser = session.parser();
    let mut content: Option<String> = None;
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut apply = |events: Vec<ToolEvent>| {
        for e in events {
            match e {
                ToolEvent::Content(c) => content.get_or_insert_with(String::new).push_str(&c),
                ToolEvent::Call { index, name } => {
                    assert_eq!(index, calls.len(), "calls are announced in order");
                    calls.push((name, String::new()));
                }
                ToolEvent::Arguments { index, fragment } => calls[index].1.push_str(&fragment),
            }
        }
    };
    for p in pieces {
        apply(parser.push(p));
    }
    apply(parser.finish());
    (content, calls)
}

#[test]
fn every_call_parses_validates_and_streams_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let tools = tools();
    let schemas: std::collections::HashMap<String, Value> = tools
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let f = &t["function"];
            let mut schema = f["parameters"].clone();
            if f["strict"] == json!(true) {
                schema["additionalProperties"] = json!(false);
            }
            (f["name"].as_str().unwrap().to_string(), schema)
        })
        .collect();
    let choices = [
        (json!("required"), true),
        (json!("auto"), true),
        (
            json!({"type": "function", "function": {"name": "add"}}),
            true,
        ),
        (json!("required"), false),
    ];
    let per_choice = 50;
    let (mut total, mut ended, mut calls_checked) = (0, 0, 0);
    for family in &FAMILIES {
        let engine = model(family, family.template, dir.path());
        let compiler = Compiler::new(engine.shared_tokenizer(), GrammarLimits::default()).unwrap();
        let template = engine.chat_template().unwrap();
        let format = family
            .declared
            .or(ToolFormat::detect(template.source()))
            .unwrap();
        assert_eq!(format, family.format, "{}", family.template);
        let rendering = if family.declared.is_some() {
            ToolRendering::Prompt
        } else {
            ToolRendering::of(template.source())
        };
        for (choice, parallel) in &choices {
            let request = ToolRequest::from_openai(Some(&tools), Some(choice), Some(*parallel))
                .unwrap()
                .unwrap();
            let session = Arc::new(
                ToolSession::new(request.clone(), format, engine.tokenizer(), None).unwrap(),
            );
            let (compiled, _) = compiler.compile(session.grammar().unwrap()).unwrap();
            let mut messages = conversation();
            let template_tools =
                prepare_history(&mut messages, format, rendering, &request.template_tools());
            let streams: Vec<_> = (0..per_choice)
                .map(|k| {
                    let mut r = GenerateRequest::new(Prompt::Chat(messages.clone()), 80);
                    r.tools = template_tools.clone();
                    r.reveal = session.reveal().to_vec();
                    r.sampling = SamplingParams {
                        temperature: 1.0,
                        seed: Some(k as u64 + 1),
                        ..SamplingParams::default()
                    };
                    r.constraint = Some(Constraint(compiled.clone()));
                    engine.submit(engine.prepare(r).unwrap()).unwrap()
                })
                .collect();
            for s in streams {
                let run = collect(s);
                total += 1;
                let what = format!("{} {choice} parallel={parallel}", family.template);
                assert!(run.failed.is_none(), "{what}: {:?}", run.failed);
                let text: String = run.pieces.concat();
                let whole = session.read(&text);
                let (content, calls) = replay(&session, &run.pieces);
                assert_eq!(
                    content, whole.content,
                    "{what}: streamed text differs: {text:?}"
                );
                assert_eq!(
                    calls, whole.calls,
                    "{what}: streamed calls differ: {text:?}"
                );
                if run.reason != Some(FinishReason::Stop) {
                    continue;
                }
                ended += 1;
                assert_eq!(whole.problem, None, "{what}: {text:?}");
                let forced = choice != &json!("auto");
                if forced {
                    assert!(!whole.calls.is_empty(), "{what}: no call in {text:?}");
                }
                if !parallel || format == ToolFormat::Llama3 || choice.is_object() {
                    assert!(whole.calls.len() <= 1, "{what}: {text:?}");
                }
                for (name, arguments) in &whole.calls {
                    if choice.is_object() {
                        assert_eq!(name, "add", "{what}");
                    }
                    let value: Value = serde_json::from_str(arguments)
                        .unwrap_or_else(|e| panic!("{what}: {e}: {arguments}"));
                    assert!(
                        jsonschema::is_valid(&schemas[name], &value),
                        "{what}: {arguments} breaks the schema of {name}"
                    );
                    calls_checked += 1;
                }
            }
        }
    }
    eprintln!("{total} requests, {ended} ended by themselves, {calls_checked} calls validated");
    assert!(total >= 1000);
    assert!(ended >= total / 2, "{ended} of {total} ended by themselves");
    assert!(calls_checked >= 400, "{calls_checked} calls");
}

#[test]
fn tool_requests_are_checked() {
    let bad = |tools: Value, choice: Option<Value>| {
        ToolRequest::from_openai(Some(&tools), choice.as_ref(), None).unwrap_err()
    };
    let one =
        json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
    assert_eq!(bad(json!([]), None).0, "tools");
    assert_eq!(bad(json!([{"type": "retrieval"}]), None).0, "tools");
    assert_eq!(
        bad(
            json!([{"type": "function", "function": {"name": "a b"}}]),
            None
        )
        .0,
        "tools"
    );
    assert_eq!(
        bad(
            json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
            None
        )
        .0,
        "tools"
    );
    let twice = json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]);
    assert!(bad(twice, None).1.to_string().contains("used twice"));
    let unknown = bad(
        one.clone(),
        Some(json!({"type": "function", "function": {"name": "g"}})),
    );
    assert_eq!(unknown.0, "tool_choice");
    assert_eq!(bad(one.clone(), Some(json!("sometimes"))).0, "tool_choice");
    let many: Vec<Value> = (0..129)
        .map(|i| json!({"type": "function", "function": {"name": format!("f{i}")}}))
        .collect();
    assert!(bad(Value::Array(many), None)
        .1
        .to_string()
        .contains("at most 128"));
    // A tool_choice without tools: refused, unless it is none.
    assert!(ToolRequest::from_openai(None, Some(&json!("required")), None).is_err());
    assert!(ToolRequest::from_openai(None, Some(&json!("none")), None)
        .unwrap()
        .is_none());
    let ok = ToolRequest::from_openai(Some(&one), None, None)
        .unwrap()
        .unwrap();
    assert_eq!(ok.choice, ToolChoice::Auto);
    assert!(ok.parallel);
}
