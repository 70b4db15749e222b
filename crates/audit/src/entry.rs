//! One entry of the log: a request (its record, full input and output) or an action (an admin
//! call, a controller decision, the log's own events), after the redaction policy.
//!
//! The entry is stored as the exact bytes of its JSON encoding; the leaf hash is taken over
//! those bytes, so a verifier never re-encodes anything.

use record::Envelope;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What an entry is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    Request,
    Action,
}

impl EntryKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EntryKind::Request => "request",
            EntryKind::Action => "action",
        }
    }
}

/// An admin call or a controller decision (the record bus's type: actions ride the bus).
pub use record::Action;

/// One redaction applied before the entry was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Redaction {
    pub field: String,
    pub action: RedactAction,
}

/// What the policy does to a field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RedactAction {
    #[default]
    Keep,
    /// Every string inside replaced by `[masked]` (the structure stays).
    Mask,
    /// Every string inside replaced by `sha256:<hex>` of it (deterministic: still joinable).
    Hash,
    /// The field removed.
    Drop,
}

/// Per field, what to do before writing (fields not named are kept).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedactionPolicy {
    #[serde(default)]
    pub input: RedactAction,
    #[serde(default)]
    pub output: RedactAction,
    #[serde(default)]
    pub user: RedactAction,
    #[serde(default)]
    pub operator: RedactAction,
    #[serde(default)]
    pub principal: RedactAction,
}

/// The entry as written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// Position in the log, from 0 (also the Merkle leaf index).
    pub index: u64,
    pub kind: EntryKind,
    pub audit_id: String,
    /// Milliseconds since the Unix epoch.
    pub time_ms: u64,
    pub principal: Option<String>,
    pub user: Option<String>,
    pub operator: Option<String>,
    /// The model the entry is about (`_actions` for actions about no model).
    pub model: String,
    /// Requests: every field of the request's record (ids, version and digest, lineage, route
    /// and fallback, sampling parameters, confidence and entropy, guard verdict, finish
    /// reason, status, latencies, token counts).
    pub record: Option<Value>,
    /// Requests: the full input (messages or prompt; tensor models: the input digests).
    pub input: Option<Value>,
    /// Requests: the full output as the client received it.
    pub output: Option<Value>,
    pub action: Option<Action>,
    /// Each redaction applied to this entry.
    pub redactions: Vec<Redaction>,
}

/// The model name of entries about no model.
pub const NO_MODEL: &str = "_actions";

impl AuditEntry {
    /// The entry of a request (index assigned at append).
    pub fn request(envelope: &Envelope) -> Self {
        let r = &envelope.record;
        let payload = envelope.payload.as_ref();
        Self {
            index: 0,
            kind: EntryKind::Request,
            audit_id: r.audit_id.clone(),
            time_ms: r.time_ms,
            principal: Some(r.principal.clone()),
            user: r.user.clone(),
            operator: r.operator.clone().or_else(|| r.user.clone()),
            model: if r.model.is_empty() {
                NO_MODEL.to_string()
            } else {
                r.model.clone()
            },
            record: serde_json::to_value(r).ok(),
            input: payload.and_then(|p| p.input.clone()),
            output: payload.and_then(|p| p.output.clone()),
            action: None,
            redactions: Vec::new(),
        }
    }

    /// The entry of an action.
    pub fn action(
        principal: Option<String>,
        operator: Option<String>,
        model: Option<String>,
        action: Action,
    ) -> Self {
        Self {
            index: 0,
            kind: EntryKind::Action,
            audit_id: uuid::Uuid::new_v4().to_string(),
            time_ms: now_ms(),
            principal,
            user: None,
            operator,
            model: model.unwrap_or_else(|| NO_MODEL.to_string()),
            record: None,
            input: None,
            output: None,
            action: Some(action),
            redactions: Vec::new(),
        }
    }

    /// Applies the policy, noting each redaction in the entry. The record's copies of the
    /// redacted fields (`user`, `principal`, `operator`) are redacted alike.
    pub fn redact(&mut self, policy: &RedactionPolicy) {
        let mut note = |field: &str, action: RedactAction| {
            self.redactions.push(Redaction {
                field: field.to_string(),
                action,
            })
        };
        let mut apply = |field: &'static str, action: RedactAction, value: &mut Option<Value>| {
            if action != RedactAction::Keep && value.is_some() {
                *value = redact_value(value.take(), action);
                note(field, action);
            }
        };
        apply("input", policy.input, &mut self.input);
        apply("output", policy.output, &mut self.output);
        // An operator id taken from the request's user is the user: the stronger policy wins.
        let operator = if self.operator.is_some() && self.operator == self.user {
            stronger(policy.user, policy.operator)
        } else {
            policy.operator
        };
        let string_fields = [
            ("user", policy.user),
            ("operator", operator),
            ("principal", policy.principal),
        ];
        for (field, action) in string_fields {
            if action == RedactAction::Keep {
                continue;
            }
            let slot = match field {
                "user" => &mut self.user,
                "operator" => &mut self.operator,
                _ => &mut self.principal,
            };
            let present = slot.is_some();
            *slot = slot.take().and_then(|v| redact_string(&v, action));
            if let Some(Value::Object(record)) = &mut self.record {
                if let Some(v) = record.get_mut(field) {
                    let taken = std::mem::take(v);
                    *v = redact_value(Some(taken), action).unwrap_or(Value::Null);
                }
            }
            if present {
                self.redactions.push(Redaction {
                    field: field.to_string(),
                    action,
                });
            }
        }
    }

    /// The stored bytes: the entry's JSON (object keys of free-form values sorted).
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

/// The policy that hides more: keep < hash < mask < drop.
fn stronger(a: RedactAction, b: RedactAction) -> RedactAction {
    let rank = |r: RedactAction| match r {
        RedactAction::Keep => 0,
        RedactAction::Hash => 1,
        RedactAction::Mask => 2,
        RedactAction::Drop => 3,
    };
    if rank(a) >= rank(b) {
        a
    } else {
        b
    }
}

/// The user id as the log stores it under `action` (so a query can match a hashed user).
pub fn redact_string(value: &str, action: RedactAction) -> Option<String> {
    match action {
        RedactAction::Keep => Some(value.to_string()),
        RedactAction::Mask => Some("[masked]".to_string()),
        RedactAction::Hash => Some(format!("sha256:{}", record::sha256_hex(value))),
        RedactAction::Drop => None,
    }
}

fn redact_value(value: Option<Value>, action: RedactAction) -> Option<Value> {
    fn walk(v: Value, action: RedactAction) -> Value {
        match v {
            Value::String(s) => redact_string(&s, action).map_or(Value::Null, Value::String),
            Value::Array(items) => {
                Value::Array(items.into_iter().map(|v| walk(v, action)).collect())
            }
            Value::Object(map) => Value::Object(
                map.into_iter()
                    // Keys that name structure (role, type) stay readable; a message's `name`
                    // (a person) does not.
                    .map(|(k, v)| {
                        if matches!(k.as_str(), "role" | "type") {
                            (k, v)
                        } else {
                            (k, walk(v, action))
                        }
                    })
                    .collect(),
            ),
            other => other,
        }
    }
    match action {
        RedactAction::Keep => value,
        RedactAction::Drop => None,
        _ => value.map(|v| walk(v, action)),
    }
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// `YYYY/MM/DD` of a time in ms (UTC), for the sealed layout.
pub fn date_path(time_ms: u64) -> String {
    let (y, m, d) = civil_from_days((time_ms / 86_400_000) as i64);
    format!("{y:04}/{m:02}/{d:02}")
}

/// Days since 1970-01-01 to (year, month, day) (H. Hinnant's algorithm).
pub fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use record::InferenceRecord;

    fn envelope() -> Envelope {
        let mut r = InferenceRecord::new("req-1".into(), "alice-key".into(), "chat");
        r.user = Some("patient-42".into());
        r.model = "smollm2".into();
        Envelope {
            record: r,
            token_gaps_s: Vec::new(),
            token_entropies: Vec::new(),
            observations: Vec::new(),
            timeline: None,
            payload: Some(record::Payload {
                input: Some(
                    serde_json::json!({"messages": [{"role": "user", "content": "my id is 1234"}]}),
                ),
                output: Some(serde_json::json!({"choices": ["ok"]})),
            }),
        }
    }

    #[test]
    fn redaction_is_applied_everywhere_and_noted() {
        let mut e = AuditEntry::request(&envelope());
        e.redact(&RedactionPolicy {
            input: RedactAction::Mask,
            output: RedactAction::Drop,
            user: RedactAction::Hash,
            ..Default::default()
        });
        let text = String::from_utf8(e.encode()).unwrap();
        assert!(!text.contains("1234"), "{text}");
        assert!(!text.contains("patient-42"), "{text}");
        assert!(
            text.contains("\"role\":\"user\""),
            "structure stays: {text}"
        );
        assert_eq!(e.output, None);
        assert_eq!(e.user, redact_string("patient-42", RedactAction::Hash));
        let fields: Vec<_> = e.redactions.iter().map(|r| r.field.as_str()).collect();
        assert_eq!(fields, ["input", "output", "user", "operator"]);
        assert_eq!(AuditEntry::decode(&e.encode()).unwrap(), e);
    }

    #[test]
    fn dates_are_civil() {
        assert_eq!(date_path(0), "1970/01/01");
        assert_eq!(date_path(1_796_083_200_000), "2026/12/01");
        assert_eq!(date_path(951_782_400_000), "2000/02/29");
    }
}
