//! What a request asks the output to be: a JSON schema, any JSON object, a regular expression,
//! one of a list of choices, or a Lark grammar; and how each becomes a grammar for the engine.

use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::GrammarError;

/// A structured-output request, as parsed from the API.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// OpenAI `response_format: {"type": "json_schema", ...}`. `strict` closes every object
    /// that does not say otherwise (`additionalProperties: false`), as OpenAI's strict mode does.
    JsonSchema { schema: Value, strict: bool },
    /// OpenAI `response_format: {"type": "json_object"}`: any JSON object.
    JsonObject,
    /// A regular expression the whole output must match.
    Regex(String),
    /// The output is exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect (`start: ...`).
    Lark(String),
}

impl GrammarSpec {
    /// The kind's stable name (`json_schema`, `json_object`, `regex`, `choice`, `grammar`), as
    /// the record and the metrics name it.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema { .. } => "json_schema",
            GrammarSpec::JsonObject => "json_object",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
            GrammarSpec::Lark(_) => "grammar",
        }
    }

    /// A canonical rendering: the same request always gives the same text (object keys sorted,
    /// as serde_json's map keeps them).
    fn canonical(&self) -> String {
        let value = match self {
            GrammarSpec::JsonSchema { schema, strict } => {
                json!({"json_schema": schema, "strict": strict})
            }
            GrammarSpec::JsonObject => json!({"json_object": true}),
            GrammarSpec::Regex(r) => json!({ "regex": r }),
            GrammarSpec::Choice(c) => json!({ "choice": c }),
            GrammarSpec::Lark(g) => json!({ "grammar": g }),
        };
        value.to_string()
    }

    /// sha256 of the canonical rendering (hex): the cache key and the record's grammar id.
    pub fn hash(&self) -> String {
        hex::encode(Sha256::digest(self.canonical().as_bytes()))
    }

    /// Size of the request's grammar text in bytes (checked against the limit).
    pub fn size(&self) -> usize {
        match self {
            GrammarSpec::JsonSchema { schema, .. } => schema.to_string().len(),
            GrammarSpec::JsonObject => 0,
            GrammarSpec::Regex(r) => r.len(),
            GrammarSpec::Choice(c) => c.iter().map(|s| s.len() + 1).sum(),
            GrammarSpec::Lark(g) => g.len(),
        }
    }

    /// Checks what can be checked without the tokenizer.
    pub fn validate(&self, max_bytes: usize) -> Result<(), GrammarError> {
        let size = self.size();
        if size > max_bytes {
            return Err(GrammarError::Invalid(format!(
                "the {} is {size} bytes; the limit is {max_bytes}",
                self.what()
            )));
        }
        match self {
            GrammarSpec::JsonSchema { schema, .. } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(GrammarError::Invalid(
                        "the JSON schema must be an object".into(),
                    ));
                }
                if schema == &Value::Bool(false) {
                    return Err(GrammarError::Invalid(
                        "the JSON schema `false` allows no output".into(),
                    ));
                }
                jsonschema::meta::validate(schema).map_err(|e| {
                    GrammarError::Invalid(format!(
                        "the JSON schema is not valid: {e} (at {})",
                        pointer_or_root(e.instance_path().as_str())
                    ))
                })?;
            }
            GrammarSpec::Regex(r) if r.is_empty() => {
                return Err(GrammarError::Invalid("the regex is empty".into()))
            }
            GrammarSpec::Choice(c) => {
                if c.is_empty() {
                    return Err(GrammarError::Invalid("the list of choices is empty".into()));
                }
                if c.iter().any(String::is_empty) {
                    return Err(GrammarError::Invalid("a choice is the empty string".into()));
                }
            }
            GrammarSpec::Lark(g) if g.trim().is_empty() => {
                return Err(GrammarError::Invalid("the grammar is empty".into()))
            }
            _ => {}
        }
        Ok(())
    }

    fn what(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema { .. } | GrammarSpec::JsonObject => "JSON schema",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "list of choices",
            GrammarSpec::Lark(_) => "grammar",
        }
    }

    /// The schema the output is checked against (JSON kinds only), after `strict` closed it.
    pub fn effective_schema(&self) -> Option<Value> {
        match self {
            GrammarSpec::JsonSchema { schema, strict } => {
                let mut schema = schema.clone();
                if *strict {
                    close_objects(&mut schema);
                }
                Some(schema)
            }
            GrammarSpec::JsonObject => Some(json!({"type": "object"})),
            _ => None,
        }
    }

    /// The grammar in llguidance's terms.
    pub(crate) fn to_llguidance(&self) -> llguidance::api::TopLevelGrammar {
        use llguidance::api::TopLevelGrammar;
        match self {
            GrammarSpec::JsonSchema { .. } | GrammarSpec::JsonObject => {
                let mut schema = self.effective_schema().unwrap_or(Value::Bool(true));
                if let Value::Bool(true) = schema {
                    schema = json!({});
                }
                if let Value::Object(map) = &mut schema {
                    if !map.contains_key("x-guidance") {
                        map.insert("x-guidance".into(), json_layout());
                    }
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::Regex(r) => TopLevelGrammar::from_regex(r),
            GrammarSpec::Choice(choices) => {
                let alternatives: Vec<String> = choices.iter().map(|c| regex::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            GrammarSpec::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// How generated JSON is laid out: one space after `:` and `,`, no other whitespace (what
/// `json.dumps` writes). Fixed separators keep a small model from wandering into whitespace
/// and make the output byte-for-byte predictable. A schema may override it with its own
/// `x-guidance` object (llguidance's options).
pub(crate) fn json_layout() -> Value {
    json!({
        "item_separator": ", ",
        "key_separator": ": ",
        "whitespace_flexible": false,
    })
}

fn pointer_or_root(p: &str) -> &str {
    if p.is_empty() {
        "the root"
    } else {
        p
    }
}

/// OpenAI strict mode: objects with declared properties accept no others unless they say so.
fn close_objects(schema: &mut Value) {
    let Value::Object(map) = schema else {
        return;
    };
    if (map.contains_key("properties") || map.get("type") == Some(&json!("object")))
        && !map.contains_key("additionalProperties")
        && !map.contains_key("patternProperties")
    {
        map.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ["properties", "patternProperties", "$defs", "definitions"] {
        if let Some(Value::Object(children)) = map.get_mut(key) {
            children.values_mut().for_each(close_objects);
        }
    }
    for key in [
        "items",
        "additionalProperties",
        "not",
        "if",
        "then",
        "else",
        "contains",
    ] {
        if let Some(child) = map.get_mut(key) {
            close_objects(child);
        }
    }
    for key in ["anyOf", "oneOf", "allOf", "prefixItems"] {
        if let Some(Value::Array(children)) = map.get_mut(key) {
            children.iter_mut().for_each(close_objects);
        }
    }
}

/// Reads the structured-output part of an OpenAI request: `response_format`
/// (`text`, `json_object`, `json_schema`, and the extensions `regex`, `choice`, `grammar`), and
/// the extension fields other servers accept (`guided_json`, `guided_regex`, `guided_choice`,
/// `guided_grammar`). At most one may be given.
pub fn from_request(
    response_format: Option<&Value>,
    guided: &Map<String, Value>,
) -> Result<Option<GrammarSpec>, GrammarError> {
    let mut found: Vec<(String, GrammarSpec)> = Vec::new();
    if let Some(rf) = response_format {
        if let Some(spec) = from_response_format(rf)? {
            found.push(("response_format".into(), spec));
        }
    }
    for (key, value) in guided {
        let spec = match key.as_str() {
            "guided_json" => {
                let schema = match value {
                    Value::String(s) => serde_json::from_str(s).map_err(|e| {
                        GrammarError::Invalid(format!("guided_json is not JSON: {e}"))
                    })?,
                    other => other.clone(),
                };
                GrammarSpec::JsonSchema {
                    schema,
                    strict: false,
                }
            }
            "guided_regex" => GrammarSpec::Regex(string_field(key, value)?),
            "guided_grammar" => GrammarSpec::Lark(string_field(key, value)?),
            "guided_choice" => GrammarSpec::Choice(string_list(key, value)?),
            _ => continue,
        };
        found.push((key.clone(), spec));
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(found.pop().map(|f| f.1)),
        _ => Err(GrammarError::Invalid(format!(
            "give one structured-output constraint, not {} ({})",
            found.len(),
            found
                .iter()
                .map(|f| f.0.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn from_response_format(rf: &Value) -> Result<Option<GrammarSpec>, GrammarError> {
    let Value::Object(map) = rf else {
        return Err(GrammarError::Invalid(
            "response_format must be an object such as {\"type\": \"json_object\"}".into(),
        ));
    };
    let kind = map.get("type").and_then(Value::as_str).ok_or_else(|| {
        GrammarError::Invalid("response_format.type is missing or not a string".into())
    })?;
    let spec = match kind {
        "text" => return Ok(None),
        "json_object" => GrammarSpec::JsonObject,
        "json_schema" => {
            let js = map.get("json_schema").ok_or_else(|| {
                GrammarError::Invalid(
                    "response_format.json_schema is required with type json_schema".into(),
                )
            })?;
            let Value::Object(js) = js else {
                return Err(GrammarError::Invalid(
                    "response_format.json_schema must be an object with a schema".into(),
                ));
            };
            if let Some(name) = js.get("name") {
                let ok = name.as_str().is_some_and(|n| {
                    !n.is_empty()
                        && n.len() <= 64
                        && n.chars()
                            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
                });
                if !ok {
                    return Err(GrammarError::Invalid(
                        "response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -"
                            .into(),
                    ));
                }
            }
            let schema = js.get("schema").cloned().unwrap_or_else(|| json!({}));
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(_) => {
                    return Err(GrammarError::Invalid(
                        "response_format.json_schema.strict must be a boolean".into(),
                    ))
                }
            };
            GrammarSpec::JsonSchema { schema, strict }
        }
        "regex" => GrammarSpec::Regex(string_field(
            "response_format.regex",
            map.get("regex").unwrap_or(&Value::Null),
        )?),
        "choice" => GrammarSpec::Choice(string_list(
            "response_format.choices",
            map.get("choices").unwrap_or(&Value::Null),
        )?),
        "grammar" => GrammarSpec::Lark(string_field(
            "response_format.grammar",
            map.get("grammar").unwrap_or(&Value::Null),
        )?),
        other => {
            return Err(GrammarError::Invalid(format!(
                "response_format.type {other:?} is not supported (text, json_object, json_schema, regex, choice, grammar)"
            )))
        }
    };
    Ok(Some(spec))
}

fn string_field(name: &str, value: &Value) -> Result<String, GrammarError> {
    value
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| GrammarError::Invalid(format!("{name} must be a string")))
}

fn string_list(name: &str, value: &Value) -> Result<Vec<String>, GrammarError> {
    let list = value
        .as_array()
        .ok_or_else(|| GrammarError::Invalid(format!("{name} must be a list of strings")))?;
    list.iter()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| GrammarError::Invalid(format!("{name} must be a list of strings")))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(rf: Value) -> Result<Option<GrammarSpec>, GrammarError> {
        from_request(Some(&rf), &Map::new())
    }

    #[test]
    fn response_formats_parse() {
        assert_eq!(parse(json!({"type": "text"})).unwrap(), None);
        assert_eq!(
            parse(json!({"type": "json_object"})).unwrap(),
            Some(GrammarSpec::JsonObject)
        );
        let s = parse(json!({"type": "json_schema", "json_schema": {"name": "t", "strict": true, "schema": {"type": "object"}}}))
            .unwrap()
            .unwrap();
        assert_eq!(s.kind(), "json_schema");
        assert_eq!(
            parse(json!({"type": "choice", "choices": ["a", "b"]})).unwrap(),
            Some(GrammarSpec::Choice(vec!["a".into(), "b".into()]))
        );
        for bad in [
            json!("json"),
            json!({"type": "yaml"}),
            json!({"type": "json_schema"}),
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            json!({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}),
            json!({"type": "regex"}),
            json!({"type": "choice", "choices": [1]}),
        ] {
            assert!(parse(bad.clone()).is_err(), "{bad}");
        }
        let mut guided = Map::new();
        guided.insert("guided_regex".into(), json!("[0-9]+"));
        assert_eq!(
            from_request(None, &guided).unwrap(),
            Some(GrammarSpec::Regex("[0-9]+".into()))
        );
        let both = from_request(Some(&json!({"type": "json_object"})), &guided).unwrap_err();
        assert!(both.to_string().contains("guided_regex"), "{both}");
    }

    #[test]
    fn validation_names_the_problem() {
        let too_big = GrammarSpec::Regex("a".repeat(100));
        assert!(too_big
            .validate(10)
            .unwrap_err()
            .to_string()
            .contains("limit is 10"));
        let bad_schema = GrammarSpec::JsonSchema {
            schema: json!({"type": "objekt"}),
            strict: false,
        };
        let e = bad_schema.validate(1 << 16).unwrap_err().to_string();
        assert!(e.contains("not valid"), "{e}");
        assert!(GrammarSpec::Choice(vec![]).validate(100).is_err());
        assert!(GrammarSpec::JsonSchema {
            schema: json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}),
            strict: true
        }
        .validate(1 << 16)
        .is_ok());
    }

    #[test]
    fn strict_closes_nested_objects_and_hashes_are_stable() {
        let spec = GrammarSpec::JsonSchema {
            schema: json!({
                "type": "object",
                "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                               "c": {"type": "array", "items": {"$ref": "#/$defs/d"}}},
                "$defs": {"d": {"type": "object", "properties": {"e": {"type": "integer"}}, "additionalProperties": true}}
            }),
            strict: true,
        };
        let s = spec.effective_schema().unwrap();
        assert_eq!(s["additionalProperties"], json!(false));
        assert_eq!(s["properties"]["a"]["additionalProperties"], json!(false));
        assert_eq!(s["$defs"]["d"]["additionalProperties"], json!(true));
        assert_eq!(spec.hash(), spec.clone().hash());
        let loose = GrammarSpec::JsonSchema {
            schema: spec.effective_schema().unwrap(),
            strict: false,
        };
        assert_ne!(spec.hash(), loose.hash());
    }
}
