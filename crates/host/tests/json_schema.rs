//! `--json` output against docs/doctor.schema.json, with a small validator for the keywords the
//! schema uses (type, enum, properties, required, additionalProperties, items, minimum,
//! minLength, $ref). A keyword it does not know fails the test, so the schema cannot grow a
//! rule this test silently skips.

use serde_json::Value;
use std::path::Path;

fn schema() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/doctor.schema.json");
    let text = std::fs::read_to_string(&path).expect("docs/doctor.schema.json exists");
    serde_json::from_str(&text).expect("the schema is JSON")
}

const ANNOTATIONS: &[&str] = &[
    "$schema",
    "$id",
    "title",
    "description",
    "$defs",
    "$comment",
];

fn resolve<'a>(root: &'a Value, reference: &str) -> &'a Value {
    let pointer = reference.strip_prefix('#').expect("local references only");
    root.pointer(pointer)
        .unwrap_or_else(|| panic!("unresolved $ref {reference}"))
}

fn type_matches(name: &str, value: &Value) -> bool {
    match name {
        "object" => value.is_object(),
        "array" => value.is_array(),
        "string" => value.is_string(),
        "boolean" => value.is_boolean(),
        "null" => value.is_null(),
        "integer" => value.is_i64() || value.is_u64(),
        "number" => value.is_number(),
        other => panic!("unknown type {other}"),
    }
}

fn validate(root: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    let rules = schema.as_object().expect("schemas are objects");
    for (keyword, rule) in rules {
        match keyword.as_str() {
            k if ANNOTATIONS.contains(&k) => {}
            "$ref" => validate(
                root,
                resolve(root, rule.as_str().expect("string $ref")),
                value,
                at,
                errors,
            ),
            "type" => {
                let names: Vec<&str> = match rule {
                    Value::String(s) => vec![s.as_str()],
                    Value::Array(a) => a.iter().map(|v| v.as_str().expect("type names")).collect(),
                    _ => panic!("bad type rule"),
                };
                if !names.iter().any(|n| type_matches(n, value)) {
                    errors.push(format!("{at}: {value} is not {names:?}"));
                }
            }
            "enum" => {
                if !rule.as_array().expect("enum is an array").contains(value) {
                    errors.push(format!("{at}: {value} not in {rule}"));
                }
            }
            "minimum" => {
                if let Some(n) = value.as_f64() {
                    if n < rule.as_f64().expect("numeric minimum") {
                        errors.push(format!("{at}: {n} < {rule}"));
                    }
                }
            }
            "minLength" => {
                if let Some(s) = value.as_str() {
                    if (s.chars().count() as u64) < rule.as_u64().expect("integer minLength") {
                        errors.push(format!("{at}: {s:?} shorter than {rule}"));
                    }
                }
            }
            "required" => {
                if let Some(object) = value.as_object() {
                    for name in rule.as_array().expect("required is an array") {
                        let name = name.as_str().expect("names");
                        if !object.contains_key(name) {
                            errors.push(format!("{at}: missing {name}"));
                        }
                    }
                }
            }
            "properties" => {
                if let Some(object) = value.as_object() {
                    let properties = rule.as_object().expect("properties is an object");
                    for (name, child) in object {
                        if let Some(child_schema) = properties.get(name) {
                            validate(root, child_schema, child, &format!("{at}/{name}"), errors);
                        }
                    }
                }
            }
            "additionalProperties" => {
                let allowed = rule.as_bool().expect("boolean additionalProperties");
                if let (false, Some(object)) = (allowed, value.as_object()) {
                    let properties = rules
                        .get("properties")
                        .and_then(Value::as_object)
                        .expect("additionalProperties false needs properties");
                    for name in object.keys() {
                        if !properties.contains_key(name) {
                            errors.push(format!("{at}: unexpected property {name}"));
                        }
                    }
                }
            }
            "items" => {
                if let Some(items) = value.as_array() {
                    for (i, item) in items.iter().enumerate() {
                        validate(root, rule, item, &format!("{at}/{i}"), errors);
                    }
                }
            }
            other => panic!("the test's validator does not know the keyword {other:?}"),
        }
    }
}

fn errors_of(schema_root: &Value, schema: &Value, value: &Value) -> Vec<String> {
    let mut errors = Vec::new();
    validate(schema_root, schema, value, "", &mut errors);
    errors
}

fn fixture_root(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

#[test]
fn reports_validate_against_the_schema() {
    let schema = schema();
    let dir = tempfile::tempdir().expect("temp dir");
    let contexts = [
        host::Context {
            audit_dir: Some(dir.path().to_path_buf()),
            threads: Some(1),
            ..host::Context::default()
        },
        // Only the GPU area of the bad tree: no audit write into the source tree.
        host::Context {
            gpu_load_sample: true,
            ..host::Context::at_root(fixture_root("bad"))
        },
        host::Context::at_root(fixture_root("bare")),
    ];
    for (i, ctx) in contexts.iter().enumerate() {
        let only = (i == 1).then_some(host::Area::Gpu);
        let report = host::run(ctx, only);
        let value = serde_json::to_value(&report).expect("serialises");
        let errors = errors_of(&schema, &schema, &value);
        assert!(errors.is_empty(), "report {i}: {errors:#?}");
    }
}

#[test]
fn fingerprints_validate_against_the_schema() {
    let schema = schema();
    let definition = resolve(&schema, "#/$defs/fingerprint");
    for ctx in [
        host::Context::default(),
        host::Context::at_root(fixture_root("healthy")),
    ] {
        let value = serde_json::to_value(host::fingerprint(&ctx)).expect("serialises");
        let errors = errors_of(&schema, definition, &value);
        assert!(errors.is_empty(), "{errors:#?}");
    }
}

/// The validator itself rejects what the schema forbids.
#[test]
fn the_validator_catches_violations() {
    let schema = schema();
    let report = host::run(
        &host::Context::at_root(fixture_root("bare")),
        Some(host::Area::Memory),
    );
    let mut value = serde_json::to_value(&report).expect("serialises");
    value["checks"][0]["status"] = Value::from("fine");
    value["checks"][0]["extra"] = Value::from(1);
    value["counts"]
        .as_object_mut()
        .expect("counts object")
        .remove("ok");
    let errors = errors_of(&schema, &schema, &value);
    assert_eq!(errors.len(), 3, "{errors:#?}");
}
