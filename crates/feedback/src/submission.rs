//! The body of `POST /v1/feedback`, checked field by field: a malformed body is refused with the
//! field that is wrong.

use serde::Serialize;
use serde_json::Value;

/// The longest label, rater id or response reference accepted.
pub const MAX_NAME: usize = 256;
/// The longest comment, in bytes.
pub const MAX_COMMENT: usize = 4096;
/// The largest text correction (or corrected messages as JSON), in bytes.
pub const MAX_CORRECTION: usize = 64 * 1024;
/// The most items a batch response can have feedback on (its inputs' index).
pub const MAX_ITEM: usize = 1 << 20;

/// What a rating says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rating {
    Helpful,
    NotHelpful,
    /// 1 (worst) to 5 (best).
    Stars(u8),
}

impl Rating {
    /// The `rating` label of `rampart_feedback_total`, and what the store keeps.
    pub fn as_str(self) -> &'static str {
        match self {
            Rating::Helpful => "helpful",
            Rating::NotHelpful => "not_helpful",
            Rating::Stars(1) => "1",
            Rating::Stars(2) => "2",
            Rating::Stars(3) => "3",
            Rating::Stars(4) => "4",
            Rating::Stars(_) => "5",
        }
    }

    pub fn parse(s: &str) -> Option<Rating> {
        match s {
            "helpful" => Some(Rating::Helpful),
            "not_helpful" => Some(Rating::NotHelpful),
            _ => match s.parse::<u8>() {
                Ok(n @ 1..=5) => Some(Rating::Stars(n)),
                _ => None,
            },
        }
    }

    /// Whether the rater found the answer helpful: `helpful` and 4–5 stars yes, `not_helpful`
    /// and 1–2 no, 3 stars says neither.
    pub fn helpful(self) -> Option<bool> {
        match self {
            Rating::Helpful => Some(true),
            Rating::NotHelpful => Some(false),
            Rating::Stars(n) if n >= 4 => Some(true),
            Rating::Stars(n) if n <= 2 => Some(false),
            Rating::Stars(_) => None,
        }
    }
}

impl Serialize for Rating {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Rating::Stars(n) => s.serialize_u8(*n),
            other => s.serialize_str(other.as_str()),
        }
    }
}

/// The response the feedback is about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// The response's `id` (`chatcmpl-…`, `cmpl-…`, the KServe response's `id`).
    Response(String),
    /// The `X-Request-Id` it was served under.
    Request(String),
    /// Its `X-Rampart-Audit-Id`.
    Audit(String),
}

/// What the right answer was.
#[derive(Debug, Clone, PartialEq)]
pub enum Correction {
    /// The right answer's text.
    Text(String),
    /// The conversation as it should have gone (OpenAI chat messages, ending with the right
    /// assistant message).
    Messages(Vec<Value>),
}

impl Correction {
    pub fn to_json(&self) -> Value {
        match self {
            Correction::Text(t) => Value::String(t.clone()),
            Correction::Messages(m) => serde_json::json!({ "messages": m }),
        }
    }

    pub fn from_json(v: &Value) -> Option<Correction> {
        match v {
            Value::String(s) => Some(Correction::Text(s.clone())),
            Value::Object(o) => o
                .get("messages")
                .and_then(Value::as_array)
                .map(|m| Correction::Messages(m.clone())),
            _ => None,
        }
    }

    /// The corrected answer alone: the text, or the last assistant message's content.
    pub fn answer(&self) -> Option<&str> {
        match self {
            Correction::Text(t) => Some(t),
            Correction::Messages(m) => m
                .iter()
                .rev()
                .find(|m| m.get("role").and_then(Value::as_str) == Some("assistant"))
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str),
        }
    }
}

/// A checked feedback body.
#[derive(Debug, Clone, PartialEq)]
pub struct Submission {
    /// None when a signed link names the response.
    pub target: Option<Target>,
    /// Which input of a batch response (0 for single answers).
    pub item: usize,
    pub rating: Option<Rating>,
    /// The right class.
    pub label: Option<String>,
    pub correction: Option<Correction>,
    pub comment: Option<String>,
    /// Who rated (`rater`, else `X-Operator-Id`, else the key's id or `link`).
    pub rater: Option<String>,
}

/// A field of the body that is wrong, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: &'static str,
    pub message: String,
}

fn wrong(field: &'static str, message: impl Into<String>) -> FieldError {
    FieldError {
        field,
        message: message.into(),
    }
}

const FIELDS: [&str; 10] = [
    "response_id",
    "request_id",
    "audit_id",
    "item",
    "rating",
    "label",
    "correction",
    "comment",
    "rater",
    "metadata",
];

fn name(
    body: &serde_json::Map<String, Value>,
    field: &'static str,
) -> Result<Option<String>, FieldError> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => {
            let s = s.trim();
            if s.is_empty() {
                Err(wrong(field, "is empty"))
            } else if s.len() > MAX_NAME {
                Err(wrong(field, format!("is longer than {MAX_NAME} bytes")))
            } else if s.chars().any(char::is_control) {
                Err(wrong(field, "holds control characters"))
            } else {
                Ok(Some(s.to_string()))
            }
        }
        Some(_) => Err(wrong(field, "must be a string")),
    }
}

impl Submission {
    /// Checks a body. `linked`: a signed link names the response, so the body need not.
    pub fn parse(body: &Value, linked: bool) -> Result<Submission, FieldError> {
        let Value::Object(body) = body else {
            return Err(wrong("body", "must be a JSON object"));
        };
        if let Some(unknown) = body.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(wrong(
                "body",
                format!("unknown field {unknown:?} (fields: {})", FIELDS.join(", ")),
            ));
        }
        let mut targets = Vec::new();
        if let Some(id) = name(body, "response_id")? {
            targets.push(Target::Response(id));
        }
        if let Some(id) = name(body, "request_id")? {
            targets.push(Target::Request(id));
        }
        if let Some(id) = name(body, "audit_id")? {
            targets.push(Target::Audit(id));
        }
        if targets.len() > 1 {
            return Err(wrong(
                "response_id",
                "name the response once: one of response_id, request_id, audit_id",
            ));
        }
        let target = targets.pop();
        if target.is_none() && !linked {
            return Err(wrong(
                "response_id",
                "name the response: response_id, request_id or audit_id (or send its signed \
                 feedback token)",
            ));
        }
        let item = match body.get("item") {
            None | Some(Value::Null) => 0,
            Some(v) => match v.as_u64() {
                Some(n) if (n as usize) < MAX_ITEM => n as usize,
                _ => {
                    return Err(wrong(
                        "item",
                        "must be the input's index in the batch (0, 1, …)",
                    ))
                }
            },
        };
        let rating = match body.get("rating") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(Rating::parse(s).ok_or_else(|| {
                wrong("rating", "must be \"helpful\", \"not_helpful\" or 1 to 5")
            })?),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(s @ 1..=5) => Some(Rating::Stars(s as u8)),
                _ => return Err(wrong("rating", "stars must be a whole number from 1 to 5")),
            },
            Some(_) => {
                return Err(wrong(
                    "rating",
                    "must be \"helpful\", \"not_helpful\" or 1 to 5",
                ))
            }
        };
        let label = name(body, "label")?;
        let correction = match body.get("correction") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => {
                if s.trim().is_empty() {
                    return Err(wrong("correction", "is empty"));
                }
                if s.len() > MAX_CORRECTION {
                    return Err(wrong(
                        "correction",
                        format!("is longer than {MAX_CORRECTION} bytes"),
                    ));
                }
                Some(Correction::Text(s.clone()))
            }
            Some(Value::Object(o)) => {
                let Some(Value::Array(messages)) = o.get("messages") else {
                    return Err(wrong(
                        "correction",
                        "must be the right answer's text or {\"messages\": [...]}",
                    ));
                };
                check_messages(messages)?;
                if Value::Array(messages.clone()).to_string().len() > MAX_CORRECTION {
                    return Err(wrong(
                        "correction",
                        format!("is larger than {MAX_CORRECTION} bytes"),
                    ));
                }
                Some(Correction::Messages(messages.clone()))
            }
            Some(_) => {
                return Err(wrong(
                    "correction",
                    "must be the right answer's text or {\"messages\": [...]}",
                ))
            }
        };
        let comment = match body.get("comment") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.trim().is_empty() => {
                return Err(wrong("comment", "is empty"))
            }
            Some(Value::String(s)) if s.len() <= MAX_COMMENT => Some(s.clone()),
            Some(Value::String(_)) => {
                return Err(wrong(
                    "comment",
                    format!("is longer than {MAX_COMMENT} bytes"),
                ))
            }
            Some(_) => return Err(wrong("comment", "must be a string")),
        };
        if let Some(m) = body.get("metadata") {
            if !m.is_object() && !m.is_null() {
                return Err(wrong("metadata", "must be an object"));
            }
        }
        let rater = name(body, "rater")?;
        if rating.is_none() && label.is_none() && correction.is_none() && comment.is_none() {
            return Err(wrong(
                "rating",
                "say something: a rating, a label, a correction or a comment",
            ));
        }
        Ok(Submission {
            target,
            item,
            rating,
            label,
            correction,
            comment,
            rater,
        })
    }
}

/// Corrected messages follow the chat format: roles system/user/assistant/tool, string
/// contents, the last one the assistant's.
fn check_messages(messages: &[Value]) -> Result<(), FieldError> {
    if messages.is_empty() {
        return Err(wrong("correction", "messages is empty"));
    }
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        if !matches!(
            role,
            Some("system" | "user" | "assistant" | "tool" | "developer")
        ) {
            return Err(wrong(
                "correction",
                format!("messages[{i}].role must be system, user, assistant, tool or developer"),
            ));
        }
        if !m.get("content").is_some_and(Value::is_string) {
            return Err(wrong(
                "correction",
                format!("messages[{i}].content must be a string"),
            ));
        }
    }
    if messages
        .last()
        .and_then(|m| m.get("role"))
        .and_then(Value::as_str)
        != Some("assistant")
    {
        return Err(wrong(
            "correction",
            "the last message must be the assistant's right answer",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_full_body_parses() {
        let s = Submission::parse(
            &json!({"response_id": "chatcmpl-1", "rating": "not_helpful", "label": "customs",
                    "correction": "It is a customs dispute.", "comment": "wrong team", "rater": "agent-7"}),
            false,
        )
        .unwrap();
        assert_eq!(s.target, Some(Target::Response("chatcmpl-1".into())));
        assert_eq!(s.rating, Some(Rating::NotHelpful));
        assert_eq!(s.label.as_deref(), Some("customs"));
        assert_eq!(s.rater.as_deref(), Some("agent-7"));
        let stars = Submission::parse(&json!({"audit_id": "a", "rating": 4}), false).unwrap();
        assert_eq!(stars.rating, Some(Rating::Stars(4)));
        assert_eq!(Rating::Stars(4).helpful(), Some(true));
        assert_eq!(Rating::Stars(3).helpful(), None);
    }

    #[test]
    fn each_wrong_field_is_named() {
        let field = |v: Value| Submission::parse(&v, false).unwrap_err().field;
        assert_eq!(field(json!([])), "body");
        assert_eq!(field(json!({"rating": "helpful"})), "response_id");
        assert_eq!(
            field(json!({"audit_id": "a", "request_id": "b", "rating": 1})),
            "response_id"
        );
        assert_eq!(field(json!({"audit_id": "a", "rating": 6})), "rating");
        assert_eq!(field(json!({"audit_id": "a", "rating": "great"})), "rating");
        assert_eq!(field(json!({"audit_id": "a", "rating": 2.5})), "rating");
        assert_eq!(field(json!({"audit_id": "a", "label": 3})), "label");
        assert_eq!(field(json!({"audit_id": "a", "label": ""})), "label");
        assert_eq!(
            field(json!({"audit_id": "a", "item": -1, "rating": 1})),
            "item"
        );
        assert_eq!(field(json!({"audit_id": "a"})), "rating");
        assert_eq!(field(json!({"audit_id": "a", "stars": 1})), "body");
        assert_eq!(
            field(
                json!({"audit_id": "a", "correction": {"messages": [{"role": "user", "content": "x"}]}})
            ),
            "correction"
        );
        assert_eq!(
            field(json!({"audit_id": "a", "comment": "x".repeat(5000)})),
            "comment"
        );
        assert_eq!(
            field(json!({"audit_id": "a\u{0}", "rating": 1})),
            "audit_id"
        );
    }

    #[test]
    fn a_link_needs_no_reference_and_messages_give_their_last_answer() {
        let s = Submission::parse(
            &json!({"rating": 5, "correction": {"messages": [
                {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}}),
            true,
        )
        .unwrap();
        assert_eq!(s.target, None);
        assert_eq!(s.correction.unwrap().answer(), Some("a"));
    }
}
