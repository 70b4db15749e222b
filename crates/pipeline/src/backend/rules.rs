//! Rules models: the rules engine (crate `guard`) behind the seam. A chat or completion gets
//! one JSON answer, `{"category", "confidence", "reasons"}`, each reason a span of the input;
//! over KServe, a `text` BYTES tensor in, `label` and `confidence` out. Deterministic: one
//! "token" per answer, entropy 0.
//!
//! A structured-output request gets the answer rendered into what it asked for (its JSON
//! schema's label, confidence and reasons fields, one of its choices) and held to the same
//! final check as a model's output; what cannot be rendered is a failure, so a chain moves on
//! to its canned answer. As a step of a fallback chain, a rules model answers only when a rule
//! matched (the file's `default` answers direct requests only).

use std::sync::Arc;

use classic::{Data, Tensor};

use super::tensor::{record_confidences, text_input, TEXT_INPUT};
use engine::Prompt;
use futures_util::stream::{self, StreamExt};
use guard::{Classification, RulesEngine};
use record::{RecordBuilder, StructuredRecord};
use serde_json::{json, Map, Value};

use super::{
    Answer, BackendError, Description, GeneratePlan, Generated, Generation, InferRequest,
    InferResponse, InferenceBackend, Kind, OutputTensor, StartFuture, TensorSpec, Token, Work,
    WorkKind,
};

/// KServe names of a rules model's outputs (the input is [`TEXT_INPUT`]).
pub const LABEL_OUTPUT: &str = "label";
pub const CONFIDENCE_OUTPUT: &str = "confidence";

/// One served rules model version.
pub struct RulesBackend {
    name: String,
    engine: RulesEngine,
    /// Largest schema, regex or choice list a request may ask for.
    max_grammar_bytes: usize,
}

impl RulesBackend {
    pub fn new(name: String, engine: RulesEngine, max_grammar_bytes: usize) -> Self {
        Self {
            name,
            engine,
            max_grammar_bytes,
        }
    }

    fn generate(
        &self,
        plan: GeneratePlan,
        record: &mut RecordBuilder,
    ) -> Result<Generation, BackendError> {
        let check = match &plan.structured {
            Some(spec) => {
                let check =
                    grammar::OutputCheck::new(spec, self.max_grammar_bytes).map_err(|e| {
                        BackendError::Failed(format!("the rules engine cannot answer this: {e}"))
                    })?;
                record.record.structured = Some(StructuredRecord {
                    kind: spec.kind(),
                    grammar_sha256: spec.hash(),
                    compile_ms: 0.0,
                    cached: false,
                    outcome: None,
                    problem: None,
                });
                Some((spec, check))
            }
            None => None,
        };
        let mut events = Vec::new();
        let mut confidences = Vec::new();
        let mut index = 0;
        for prompt in &plan.prompts {
            let text = prompt_text(prompt)?;
            let c = self.engine.classify(&text);
            if plan.fallback_level > 0 && !c.matched {
                return Err(BackendError::NoMatch(format!(
                    "no rule of {} matched (score {:.2} below its threshold)",
                    self.name, c.score
                )));
            }
            confidences.push(c.confidence as f32);
            let answer = match &check {
                None => answer_json(&c),
                Some((spec, check)) => {
                    let answer = render(&c, spec).map_err(|problem| {
                        BackendError::Failed(format!(
                            "the rules answer cannot take the requested {}: {problem}",
                            spec.kind()
                        ))
                    })?;
                    if let grammar::Outcome::Invalid(problem) =
                        grammar::FinalCheck::check(check, &answer, false)
                    {
                        return Err(BackendError::Failed(format!(
                            "the rules answer fails the requested {}: {problem}",
                            spec.kind()
                        )));
                    }
                    answer
                }
            };
            for _ in 0..plan.n {
                events.push((
                    index,
                    Generated::Token(Token {
                        text: answer.clone(),
                        entropy: 0.0,
                        logprobs: None,
                        attention: Vec::new(),
                        id: 0,
                    }),
                ));
                events.push((index, Generated::Finished(super::finished_at_once(1))));
                index += 1;
            }
        }
        record_confidences(record, &confidences);
        Ok(Generation {
            events: stream::iter(events).boxed(),
            choices: index,
            prompt_tokens: 0,
            structured: check.map(|(_, c)| Arc::new(c) as Arc<dyn grammar::FinalCheck>),
            watch: None,
            tools: None,
            explain: None,
        })
    }

    fn classify_tensors(
        &self,
        request: InferRequest,
        record: &mut RecordBuilder,
    ) -> Result<InferResponse, BackendError> {
        let texts = text_input(&format!("rules model {:?}", self.name), &request)?;
        let mut labels = Vec::with_capacity(texts.len());
        let mut confidences = Vec::with_capacity(texts.len());
        for text in &texts {
            let c = self.engine.classify(text);
            if request.fallback_level > 0 && !c.matched {
                return Err(BackendError::NoMatch(format!(
                    "no rule of {} matched an input (score {:.2} below its threshold)",
                    self.name, c.score
                )));
            }
            labels.push(c.label.unwrap_or_default().into_bytes());
            confidences.push(c.confidence as f32);
        }
        record.record.items = texts.len();
        record_confidences(record, &confidences);
        let n = labels.len();
        let all = [
            Tensor {
                name: LABEL_OUTPUT.into(),
                shape: vec![n],
                data: Data::Bytes(labels),
            },
            Tensor {
                name: CONFIDENCE_OUTPUT.into(),
                shape: vec![n],
                data: Data::F32(confidences),
            },
        ];
        let mut outputs = Vec::new();
        if request.outputs.is_empty() {
            outputs.extend(all.into_iter().map(|tensor| OutputTensor {
                tensor,
                binary: request.binary_output,
            }));
        } else {
            for wanted in &request.outputs {
                let tensor = all
                    .iter()
                    .find(|t| t.name == wanted.name)
                    .ok_or_else(|| {
                        BackendError::invalid_param(
                            "outputs",
                            format!(
                                "model {:?} has no output {:?} (outputs: {LABEL_OUTPUT}, {CONFIDENCE_OUTPUT})",
                                self.name, wanted.name
                            ),
                        )
                    })?;
                outputs.push(OutputTensor {
                    tensor: tensor.clone(),
                    binary: wanted.binary,
                });
            }
        }
        Ok(InferResponse {
            model_name: String::new(),
            model_version: String::new(),
            id: request.id,
            outputs,
            judgements: Vec::new(),
        })
    }
}

/// The text a rules model classifies: the prompt, or the last user message of a chat.
fn prompt_text(prompt: &Prompt) -> Result<String, BackendError> {
    match prompt {
        Prompt::Text(text) | Prompt::PlainText(text) => Ok(text.clone()),
        Prompt::Chat(messages) => messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .ok_or_else(|| {
                BackendError::invalid_param("messages", "a rules model needs a user message")
            }),
        Prompt::Tokens(_) => Err(BackendError::invalid_param(
            "prompt",
            "a rules model classifies text, not token ids",
        )),
    }
}

/// `{"category", "confidence", "reasons": [{"text", "label", "rule", "weight", "start", "end"}]}`.
fn answer_json(c: &Classification) -> String {
    let reasons: Vec<Value> = c.reasons.iter().map(|r| reason_object(r, None)).collect();
    serde_json::json!({
        "category": c.label,
        "confidence": (c.confidence * 1000.0).round() / 1000.0,
        "reasons": reasons,
    })
    .to_string()
}

/// What a field of the requested schema holds, judged by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Label,
    Confidence,
    Reasons,
}

fn role(field: &str) -> Option<Role> {
    let f = field.to_ascii_lowercase();
    let has = |words: &[&str]| words.iter().any(|w| f.contains(w));
    if has(&["confiden", "score", "probab", "certain"]) {
        Some(Role::Confidence)
    } else if has(&["reason", "evidence", "explan", "match", "span", "why"]) {
        Some(Role::Reasons)
    } else if has(&[
        "categor", "label", "class", "intent", "topic", "type", "kind",
    ]) {
        Some(Role::Label)
    } else {
        None
    }
}

/// Why a classification cannot take the shape a request asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("the label {0:?} is none of the schema's values")]
    NotInSchema(String),
    #[error("the label {0:?} is none of the choices")]
    NotAChoice(String),
    #[error("a grammar cannot be rendered")]
    Grammar,
    #[error("nothing of a rules answer fills {0:?}")]
    Unfilled(String),
}

/// The label as the schema spells it (an `enum` value, compared without case).
fn label_for(label: &str, schema: &Value) -> Result<Value, RenderError> {
    match schema.get("enum").and_then(Value::as_array) {
        Some(values) => values
            .iter()
            .find(|v| v.as_str().is_some_and(|s| s.eq_ignore_ascii_case(label)))
            .cloned()
            .ok_or_else(|| RenderError::NotInSchema(label.to_string())),
        None => Ok(Value::String(label.to_string())),
    }
}

fn reason_object(r: &guard::Reason, fields: Option<&Map<String, Value>>) -> Value {
    let all = json!({
        "text": r.matched,
        "label": r.label,
        "rule": r.rule,
        "weight": r.weight,
        "start": r.start,
        "end": r.end,
    });
    match (all, fields) {
        (Value::Object(all), Some(fields)) => Value::Object(
            all.into_iter()
                .filter(|(k, _)| fields.contains_key(k))
                .collect(),
        ),
        (all, _) => all,
    }
}

/// The classification rendered into what the request asked for.
fn render(c: &Classification, spec: &grammar::GrammarSpec) -> Result<String, RenderError> {
    let label = c.label.as_deref().unwrap_or_default();
    match spec {
        grammar::GrammarSpec::Choice(choices) => choices
            .iter()
            .find(|choice| choice.eq_ignore_ascii_case(label))
            .cloned()
            .ok_or_else(|| RenderError::NotAChoice(label.to_string())),
        grammar::GrammarSpec::Regex(_) => Ok(label.to_string()),
        grammar::GrammarSpec::Lark(_) => Err(RenderError::Grammar),
        grammar::GrammarSpec::JsonObject | grammar::GrammarSpec::JsonSchema { .. } => {
            let schema = spec.effective_schema().unwrap_or(Value::Bool(true));
            let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
                return Ok(answer_json(c));
            };
            let required: Vec<&str> = schema
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let mut out = Map::new();
            for (field, field_schema) in properties {
                let value = match role(field) {
                    Some(Role::Label) => label_for(label, field_schema)?,
                    Some(Role::Confidence) => {
                        let rounded = (c.confidence * 1000.0).round() / 1000.0;
                        if field_schema.get("type").and_then(Value::as_str) == Some("integer") {
                            json!((c.confidence * 100.0).round() as i64)
                        } else {
                            json!(rounded)
                        }
                    }
                    Some(Role::Reasons) => match field_schema.get("type").and_then(Value::as_str) {
                        Some("string") => Value::String(
                            c.reasons
                                .iter()
                                .map(|r| r.matched.as_str())
                                .collect::<Vec<_>>()
                                .join("; "),
                        ),
                        _ => {
                            let items = field_schema.get("items");
                            let as_text = items.and_then(|i| i.get("type")).and_then(Value::as_str)
                                == Some("string");
                            let fields = items
                                .and_then(|i| i.get("properties"))
                                .and_then(Value::as_object);
                            Value::Array(
                                c.reasons
                                    .iter()
                                    .map(|r| {
                                        if as_text {
                                            Value::String(r.matched.clone())
                                        } else {
                                            reason_object(r, fields)
                                        }
                                    })
                                    .collect(),
                            )
                        }
                    },
                    None if required.contains(&field.as_str()) => {
                        return Err(RenderError::Unfilled(field.clone()))
                    }
                    None => continue,
                };
                out.insert(field.clone(), value);
            }
            Ok(Value::Object(out).to_string())
        }
    }
}

impl InferenceBackend for RulesBackend {
    fn kind(&self) -> Kind {
        Kind::Rules
    }

    fn accepts(&self, work: WorkKind) -> bool {
        matches!(work, WorkKind::Generate | WorkKind::Tensors)
    }

    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a> {
        // Microseconds of work: done on the caller's task.
        let result = match work {
            Work::Generate(plan) => self.generate(*plan, record).map(Answer::Generation),
            Work::Tensors(request) => self.classify_tensors(request, record).map(Answer::Tensors),
            Work::Embed(_) => Err(BackendError::invalid("a rules model does not embed")),
        };
        Box::pin(std::future::ready(result))
    }

    fn describe(&self) -> Description {
        Description {
            max_context: 0,
            platform: "rampart_rules".into(),
            inputs: vec![TensorSpec {
                name: TEXT_INPUT.into(),
                datatype: "BYTES".into(),
                shape: vec![-1],
            }],
            outputs: vec![
                TensorSpec {
                    name: LABEL_OUTPUT.into(),
                    datatype: "BYTES".into(),
                    shape: vec![-1],
                },
                TensorSpec {
                    name: CONFIDENCE_OUTPUT.into(),
                    datatype: "FP32".into(),
                    shape: vec![-1],
                },
            ],
            image_input: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use grammar::GrammarSpec;

    fn classification() -> Classification {
        let engine = RulesEngine::from_toml(include_str!(
            "../../../../examples/rules/support-tickets.toml"
        ))
        .unwrap();
        engine.classify("I was charged twice, I want a refund of my money")
    }

    fn schema(properties: Value, required: &[&str]) -> GrammarSpec {
        GrammarSpec::JsonSchema {
            schema: json!({"type": "object", "properties": properties, "required": required}),
            strict: true,
        }
    }

    fn checked(spec: &GrammarSpec) -> Result<Value, String> {
        let text = render(&classification(), spec).map_err(|e| e.to_string())?;
        let check = grammar::OutputCheck::new(spec, 65536).unwrap();
        match grammar::FinalCheck::check(&check, &text, false) {
            grammar::Outcome::Valid => Ok(serde_json::from_str(&text).unwrap()),
            other => Err(format!("{other:?}")),
        }
    }

    #[test]
    fn the_answer_takes_the_shape_of_the_schema() {
        let v = checked(&schema(
            json!({
                "ticket_type": {"type": "string", "enum": ["Refund", "Logistics"]},
                "score": {"type": "integer"},
                "evidence": {"type": "array", "items": {"type": "object",
                    "properties": {"text": {"type": "string"}, "start": {"type": "integer"}},
                    "required": ["text", "start"]}},
            }),
            &["ticket_type", "score", "evidence"],
        ))
        .unwrap();
        assert_eq!(v["ticket_type"], "Refund", "the enum's spelling: {v}");
        assert!(v["score"].as_i64().unwrap() > 50, "{v}");
        let evidence = v["evidence"].as_array().unwrap();
        assert!(!evidence.is_empty());
        assert_eq!(
            evidence[0].as_object().unwrap().len(),
            2,
            "only the named fields"
        );
    }

    #[test]
    fn what_cannot_be_rendered_or_checked_fails() {
        let no_such_label = schema(
            json!({"category": {"type": "string", "enum": ["billing", "other"]}}),
            &["category"],
        );
        assert!(render(&classification(), &no_such_label)
            .unwrap_err()
            .to_string()
            .contains("none of the schema's values"));
        let unfillable = schema(
            json!({"category": {"type": "string"}, "customer_id": {"type": "string"}}),
            &["category", "customer_id"],
        );
        assert!(render(&classification(), &unfillable)
            .unwrap_err()
            .to_string()
            .contains("customer_id"));
        // Renders, but the check refuses it (a confidence that must be a string).
        let wrong_type = schema(json!({"confidence": {"type": "string"}}), &["confidence"]);
        assert!(checked(&wrong_type).is_err());
        assert_eq!(
            render(
                &classification(),
                &GrammarSpec::Choice(vec!["REFUND".into(), "OTHER".into()])
            )
            .unwrap(),
            "REFUND"
        );
        assert!(render(&classification(), &GrammarSpec::Lark("start: \"x\"".into())).is_err());
    }
}
