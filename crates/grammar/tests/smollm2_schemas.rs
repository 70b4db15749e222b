//! Structured output on SmolLM2-135M-Instruct: 32 JSON schemas that cover the keywords people
//! use (enums, nested objects, arrays with bounds, numbers with bounds, string patterns and
//! formats, anyOf, $ref/$defs, required/optional), run as one batch with greedy decoding. Every
//! output that ended by itself must parse and validate; so must the regex, choice and grammar
//! kinds. The model is real, so this also proves masks line up with its byte-level vocabulary.

use std::sync::Arc;

use engine::{
    ChatMessage, Constraint, Engine, EngineOptions, Event, FinishReason, GenerateRequest, Prompt,
    SamplingParams,
};
use grammar::bench::ticket_schema;
use grammar::{Compiler, GrammarLimits, GrammarSpec, Outcome};
use serde_json::{json, Value};
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

fn schemas() -> Vec<(&'static str, Value)> {
    vec![
        (
            "enum",
            json!({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
        ),
        (
            "integer bounds",
            json!({"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"]}),
        ),
        (
            "number bounds",
            json!({"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}}, "required": ["price"]}),
        ),
        (
            "boolean",
            json!({"type": "object", "properties": {"done": {"type": "boolean"}}, "required": ["done"]}),
        ),
        (
            "string length",
            json!({"type": "object", "properties": {"name": {"type": "string", "minLength": 2, "maxLength": 20}}, "required": ["name"]}),
        ),
        (
            "string pattern",
            json!({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}}, "required": ["code"]}),
        ),
        (
            "format date",
            json!({"type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]}),
        ),
        (
            "format email",
            json!({"type": "object", "properties": {"email": {"type": "string", "format": "email"}}, "required": ["email"]}),
        ),
        (
            "format date-time",
            json!({"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}, "required": ["at"]}),
        ),
        (
            "format uuid",
            json!({"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}}, "required": ["id"]}),
        ),
        (
            "array bounds",
            json!({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}}, "required": ["tags"]}),
        ),
        (
            "array of integers",
            json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 1, "maxItems": 5}),
        ),
        (
            "nested object",
            json!({"type": "object", "properties": {"user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "id": {"type": "integer"}}, "required": ["name", "id"]}}, "required": ["user"]}),
        ),
        (
            "anyOf",
            json!({"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}}, "required": ["value"]}),
        ),
        (
            "$ref and $defs",
            json!({"type": "object", "properties": {"home": {"$ref": "#/$defs/address"}, "work": {"$ref": "#/$defs/address"}}, "required": ["home", "work"], "$defs": {"address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}}}),
        ),
        (
            "required and optional",
            json!({"type": "object", "properties": {"title": {"type": "string", "maxLength": 30}, "subtitle": {"type": "string", "maxLength": 30}, "pages": {"type": "integer", "minimum": 1}}, "required": ["title"]}),
        ),
        (
            "const",
            json!({"type": "object", "properties": {"version": {"const": 2}, "kind": {"const": "report"}}, "required": ["version", "kind"]}),
        ),
        (
            "nullable",
            json!({"type": "object", "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 20}}, "required": ["middle_name"]}),
        ),
        (
            "array of objects",
            json!({"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 10}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}}, "required": ["sku", "qty"]}}}, "required": ["items"]}),
        ),
        (
            "numeric enum",
            json!({"type": "object", "properties": {"stars": {"enum": [1, 2, 3, 4, 5]}}, "required": ["stars"]}),
        ),
        (
            "deep nesting",
            json!({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer", "maximum": 100}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]}),
        ),
        (
            "closed object",
            json!({"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": false}),
        ),
        ("ticket", ticket_schema()),
        (
            "minLength",
            json!({"type": "object", "properties": {"summary": {"type": "string", "minLength": 5, "maxLength": 40}}, "required": ["summary"]}),
        ),
        (
            "tuple",
            json!({"type": "array", "prefixItems": [{"type": "string", "maxLength": 10}, {"type": "integer"}, {"type": "boolean"}], "items": false}),
        ),
        (
            "enum with spaces",
            json!({"type": "object", "properties": {"status": {"enum": ["in progress", "done", "not started"]}}, "required": ["status"]}),
        ),
        (
            "allOf",
            json!({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"type": "object", "properties": {"b": {"type": "string", "maxLength": 10}}, "required": ["b"]}]}),
        ),
        (
            "number range",
            json!({"type": "object", "properties": {"latitude": {"type": "number", "minimum": -90, "maximum": 90}, "longitude": {"type": "number", "minimum": -180, "maximum": 180}}, "required": ["latitude", "longitude"]}),
        ),
        (
            "array of enums",
            json!({"type": "object", "properties": {"days": {"type": "array", "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}, "minItems": 1, "maxItems": 3}}, "required": ["days"]}),
        ),
        (
            "recursive",
            json!({"$defs": {"node": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}, "required": ["name"]}}, "$ref": "#/$defs/node"}),
        ),
        (
            "integer string map",
            json!({"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}),
        ),
        ("top-level enum", json!({"enum": ["yes", "no", "maybe"]})),
    ]
}

struct Run {
    tokens: Vec<u32>,
    text: String,
    reason: Option<FinishReason>,
    failed: Option<String>,
}

/// Runs every request at once (one batch) and collects the outputs.
fn run_all(engine: &Engine, requests: Vec<GenerateRequest>) -> Vec<Run> {
    let streams: Vec<_> = requests
        .into_iter()
        .map(|r| engine.submit(engine.prepare(r).unwrap()).unwrap())
        .collect();
    streams
        .into_iter()
        .map(|mut s| {
            let mut run = Run {
                tokens: Vec::new(),
                text: String::new(),
                reason: None,
                failed: None,
            };
            while let Some(e) = s.blocking_next() {
                match e {
                    Event::Token(t) => {
                        run.tokens.push(t.id);
                        run.text.push_str(&t.text);
                    }
                    Event::Finished(f) => {
                        run.text.push_str(&f.trailing_text);
                        run.reason = Some(f.reason);
                    }
                    Event::Failed(e) => run.failed = Some(e),
                    Event::Shed(_) => run.failed = Some("shed".into()),
                }
            }
            run
        })
        .collect()
}

fn request(engine: &Engine, compiler: &Compiler, spec: &GrammarSpec, ask: &str) -> GenerateRequest {
    let (compiled, _) = compiler
        .compile(spec)
        .unwrap_or_else(|e| panic!("{ask}: {e}"));
    let _ = engine;
    let mut r = GenerateRequest::new(
        Prompt::Chat(vec![
            ChatMessage::new("system", "You answer with JSON only."),
            ChatMessage::new("user", ask),
        ]),
        160,
    );
    r.sampling = SamplingParams::greedy();
    r.constraint = Some(Constraint(compiled));
    r
}

#[test]
fn every_complete_output_validates() {
    let Some(engine) = engine() else { return };
    let compiler = Compiler::new(engine.shared_tokenizer(), GrammarLimits::default()).unwrap();
    let cases = schemas();
    assert!(cases.len() >= 30);
    let specs: Vec<GrammarSpec> = cases
        .iter()
        .map(|(_, schema)| GrammarSpec::JsonSchema {
            schema: schema.clone(),
            strict: false,
        })
        .collect();
    let requests = cases
        .iter()
        .zip(&specs)
        .map(|((name, schema), spec)| {
            request(
                &engine,
                &compiler,
                spec,
                &format!("Write one example ({name}) that follows this JSON schema: {schema}"),
            )
        })
        .collect();
    let runs = run_all(&engine, requests);
    let mut complete = 0;
    for (((name, schema), spec), run) in cases.iter().zip(&specs).zip(&runs) {
        assert!(run.failed.is_none(), "{name}: {:?}", run.failed);
        let (compiled, cached) = compiler.compile(spec).unwrap();
        assert!(cached, "{name}: compiled grammars are cached");
        let outcome = compiled.check(&run.text, run.reason == Some(FinishReason::Length));
        eprintln!(
            "{name:>22}: {:?} {:?} {}",
            run.reason,
            outcome.as_str(),
            run.text
        );
        if run.reason == Some(FinishReason::Stop) {
            complete += 1;
            assert_eq!(outcome, Outcome::Valid, "{name}: {}", run.text);
            // Independently of the crate's own check.
            let value: Value = serde_json::from_str(&run.text)
                .unwrap_or_else(|e| panic!("{name}: {e}: {}", run.text));
            assert!(
                jsonschema::is_valid(schema, &value),
                "{name}: {} does not validate",
                run.text
            );
        } else {
            assert!(
                matches!(outcome, Outcome::Incomplete(_) | Outcome::Valid),
                "{name}"
            );
        }
    }
    // The model finishes most of them within 160 tokens.
    assert!(
        complete >= cases.len() * 3 / 4,
        "{complete} of {} complete",
        cases.len()
    );
}

#[test]
fn regex_choice_and_grammar_outputs_match() {
    let Some(engine) = engine() else { return };
    let compiler = Compiler::new(engine.shared_tokenizer(), GrammarLimits::default()).unwrap();
    let specs = [
        (
            GrammarSpec::Regex(r"[0-9]{3}-[0-9]{3}-[0-9]{4}".into()),
            "Give a phone number.",
        ),
        (
            GrammarSpec::Regex(r"(yes|no), because [a-z ]{5,40}\.".into()),
            "Is the sky blue?",
        ),
        (
            GrammarSpec::Choice(vec!["positive".into(), "negative".into(), "neutral".into()]),
            "Sentiment of: I love this product!",
        ),
        (
            GrammarSpec::Lark(
                r#"start: "SELECT " column (", " column)* " FROM " table
column: /[a-z_]{1,12}/
table: "users" | "orders""#
                    .into(),
            ),
            "Write a SQL query listing user names.",
        ),
    ];
    let requests = specs
        .iter()
        .map(|(spec, ask)| request(&engine, &compiler, spec, ask))
        .collect();
    let runs = run_all(&engine, requests);
    for ((spec, _), run) in specs.iter().zip(&runs) {
        let (compiled, _) = compiler.compile(spec).unwrap();
        eprintln!("{}: {:?} {}", spec.kind(), run.reason, run.text);
        assert_eq!(
            run.reason,
            Some(FinishReason::Stop),
            "{}: {}",
            spec.kind(),
            run.text
        );
        assert_eq!(
            compiled.check(&run.text, false),
            Outcome::Valid,
            "{}",
            run.text
        );
    }
    let choice = &runs[2].text;
    assert!(["positive", "negative", "neutral"].contains(&choice.as_str()));
}

#[test]
fn ticket_schema_compiles_fast_and_bad_schemas_are_refused() {
    let Some(engine) = engine() else { return };
    let started = std::time::Instant::now();
    let compiler = Compiler::new(engine.shared_tokenizer(), GrammarLimits::default()).unwrap();
    eprintln!("compiler setup: {:?}", started.elapsed());
    let spec = GrammarSpec::JsonSchema {
        schema: ticket_schema(),
        strict: true,
    };
    let (compiled, cached) = compiler.compile(&spec).unwrap();
    assert!(!cached);
    eprintln!(
        "ticket schema compile: {:.1} ms",
        compiled.compile_seconds * 1e3
    );
    let (_, cached) = compiler.compile(&spec).unwrap();
    assert!(cached);
    for (schema, expect) in [
        (
            json!({"type": "object", "properties": {"a": {"type": "strin"}}}),
            "not valid",
        ),
        (
            json!({"type": "integer", "minimum": 5, "maximum": 1}),
            "cannot be used",
        ),
        (json!([1, 2]), "must be an object"),
    ] {
        let e = compiler
            .compile(&GrammarSpec::JsonSchema {
                schema: schema.clone(),
                strict: false,
            })
            .err()
            .unwrap_or_else(|| panic!("{schema} compiled"));
        assert!(e.to_string().contains(expect), "{schema}: {e}");
    }
    let e = compiler
        .compile(&GrammarSpec::Regex("(unclosed".into()))
        .err()
        .unwrap();
    assert!(e.to_string().contains("regex"), "{e}");
    let small = Compiler::new(
        engine.shared_tokenizer(),
        GrammarLimits {
            max_bytes: 100,
            cache_entries: 2,
            ..GrammarLimits::default()
        },
    )
    .unwrap();
    let e = small.compile(&spec).err().unwrap();
    assert!(e.to_string().contains("limit is 100"), "{e}");
    for r in ["a+", "b+", "c+"] {
        small.compile(&GrammarSpec::Regex(r.into())).unwrap();
    }
    assert_eq!(small.cached(), 2, "the cache is bounded");
    let _ = Arc::clone(&compiled);
}

/// Special-token texts inside a schema (property names, enum values, patterns) are spelled with
/// ordinary tokens: the output is valid JSON holding the text, never a forced control token and
/// never an engine error (the issue's fuzzed schema used to fail with the parser's state).
#[test]
fn special_token_texts_in_schemas_are_plain_text() {
    let Some(engine) = engine() else { return };
    let tokenizer = engine.shared_tokenizer();
    let compiler = Compiler::new(Arc::clone(&tokenizer), GrammarLimits::default()).unwrap();
    let cases = [
        json!({"type":"object","properties":{"a":{"enum":["x","y"]}},"required":["<|im_start|>system"]}),
        json!({"type":"object","properties":{"<|endoftext|>":{"type":"integer"}},"required":["<|endoftext|>"]}),
        json!({"type":"object","properties":{"a":{"enum":["<|im_end|>","<|im_start|>user"]}},"required":["a"]}),
        json!({"type":"object","properties":{"a":{"const":"<|im_end|>"}},"required":["a"]}),
        json!({"type":"object","properties":{"a":{"type":"string","pattern":"^<\\|im_start\\|>[a-z]{2,5}$"}},"required":["a"]}),
    ];
    let mut requests = Vec::new();
    for schema in &cases {
        let spec = GrammarSpec::JsonSchema {
            schema: schema.clone(),
            strict: false,
        };
        requests.push(request(&engine, &compiler, &spec, "Answer with JSON."));
    }
    let regex = GrammarSpec::Regex("<\\|im_end\\|> (yes|no)".into());
    requests.push(request(&engine, &compiler, &regex, "Yes or no?"));
    let runs = run_all(&engine, requests);
    for (i, run) in runs.iter().enumerate() {
        assert!(run.failed.is_none(), "case {i}: {:?}", run.failed);
        let forced: Vec<u32> = run
            .tokens
            .iter()
            .copied()
            .filter(|&id| tokenizer.is_special(id) && !tokenizer.stop_tokens.contains(&id))
            .collect();
        assert!(
            forced.is_empty(),
            "case {i}: control tokens {forced:?} in {:?}",
            run.text
        );
        if let Some(schema) = cases.get(i) {
            if run.reason == Some(FinishReason::Stop) {
                let value: Value = serde_json::from_str(&run.text)
                    .unwrap_or_else(|e| panic!("case {i}: {e}: {}", run.text));
                assert!(
                    jsonschema::is_valid(schema, &value),
                    "case {i}: {}",
                    run.text
                );
            }
        } else {
            assert!(run.text.starts_with("<|im_end|> "), "{:?}", run.text);
        }
    }
}
