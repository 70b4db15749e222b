//! The class of a response: what per-class quality is counted under.
//!
//! Classifiers (and the rules engine answering for one) give it themselves: the top class of
//! each input. A language model's answer has a class when the model declares how to read it:
//! a field of its JSON answer (a structured output's `category`) or a pattern's first group.

use serde_json::Value;

/// How a language model's class is read from its answer.
#[derive(Debug, Clone)]
pub enum ClassRule {
    /// A field of the JSON answer: a key (`category`) or a JSON pointer (`/ticket/category`).
    Field(String),
    /// A regular expression over the answer; its first group (or the whole match) is the class.
    Pattern(regex::Regex),
}

/// Why a class rule does not parse.
#[derive(Debug, thiserror::Error)]
pub enum ClassRuleError {
    #[error("class pattern {pattern:?}: {source}")]
    Pattern {
        pattern: String,
        #[source]
        source: regex::Error,
    },
    #[error("class field is empty")]
    EmptyField,
}

impl ClassRule {
    /// `field:NAME`, `pattern:REGEX`, or a bare field name.
    pub fn parse(s: &str) -> Result<ClassRule, ClassRuleError> {
        if let Some(p) = s.strip_prefix("pattern:") {
            regex::Regex::new(p)
                .map(ClassRule::Pattern)
                .map_err(|source| ClassRuleError::Pattern {
                    pattern: p.to_string(),
                    source,
                })
        } else {
            let f = s.strip_prefix("field:").unwrap_or(s).trim();
            if f.is_empty() {
                return Err(ClassRuleError::EmptyField);
            }
            Ok(ClassRule::Field(f.to_string()))
        }
    }

    fn read(&self, text: &str) -> Option<String> {
        match self {
            ClassRule::Field(f) => {
                let json = parse_answer(text)?;
                let v = if f.starts_with('/') {
                    json.pointer(f)?
                } else {
                    json.get(f)?
                };
                scalar(v)
            }
            ClassRule::Pattern(re) => {
                let c = re.captures(text)?;
                let m = c.get(1).or_else(|| c.get(0))?;
                let s = m.as_str().trim();
                (!s.is_empty()).then(|| s.to_string())
            }
        }
    }
}

/// A JSON answer, also inside a Markdown code fence.
fn parse_answer(text: &str) -> Option<Value> {
    let t = text.trim();
    if let Ok(v) = serde_json::from_str(t) {
        return Some(v);
    }
    let start = t.find('{')?;
    let end = t.rfind('}')?;
    serde_json::from_str(t.get(start..=end)?).ok()
}

fn scalar(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.trim().is_empty() => Some(s.trim().to_string()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// The class and confidence of each item of a response, from its output as the record bus
/// carries it (`{"judgements": …}` for tensor models, `{"choices": [texts]}` for generations).
pub fn classes(
    output: Option<&Value>,
    rule: Option<&ClassRule>,
) -> Vec<(Option<String>, Option<f32>)> {
    let Some(output) = output else {
        return Vec::new();
    };
    if let Some(judgements) = output.get("judgements").and_then(Value::as_array) {
        return judgements.iter().map(judged).collect();
    }
    if let Some(choices) = output.get("choices").and_then(Value::as_array) {
        return choices
            .iter()
            .map(|c| {
                let class = match (rule, c.as_str()) {
                    (Some(rule), Some(text)) => rule.read(text),
                    _ => None,
                };
                (class, None)
            })
            .collect();
    }
    Vec::new()
}

/// A classifier's top class (its label, else its index) and score; detections have no single
/// class.
fn judged(j: &Value) -> (Option<String>, Option<f32>) {
    let Some(top) = j.as_array().and_then(|c| c.first()) else {
        return (None, None);
    };
    if top.get("box").is_some() || top.get("bbox").is_some() {
        return (None, None);
    }
    let class = top
        .get("label")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| {
            top.get("index")
                .and_then(Value::as_u64)
                .map(|i| i.to_string())
        });
    let score = top.get("score").and_then(Value::as_f64).map(|s| s as f32);
    (class, score)
}

/// The Wilson score interval of `errors` in `n` at z (1.96: 95 %), as (lower, upper).
pub fn wilson(errors: u64, n: u64, z: f64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let n = n as f64;
    let p = errors as f64 / n;
    let z2 = z * z;
    let centre = p + z2 / (2.0 * n);
    let spread = z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt();
    let denom = 1.0 + z2 / n;
    (
        ((centre - spread) / denom).max(0.0),
        ((centre + spread) / denom).min(1.0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_classifier_gives_its_top_label_or_index() {
        let out = json!({"tensors": [], "judgements": [
            [{"index": 2, "label": "customs", "score": 0.8}, {"index": 0, "score": 0.1}],
            [{"index": 1, "score": 0.6}],
            [{"label": "car", "score": 0.9, "box": [0, 0, 1, 1]}]
        ]});
        let c = classes(Some(&out), None);
        assert_eq!(c[0], (Some("customs".into()), Some(0.8)));
        assert_eq!(c[1], (Some("1".into()), Some(0.6)));
        assert_eq!(c[2], (None, None));
    }

    #[test]
    fn a_language_model_class_comes_from_its_declared_field_or_pattern() {
        let out = json!({"choices": [
            "{\"category\": \"logistics\", \"reply\": \"…\"}",
            "```json\n{\"category\": \"refunds\"}\n```",
            "no json here"
        ]});
        let field = ClassRule::parse("category").unwrap();
        let c: Vec<_> = classes(Some(&out), Some(&field))
            .into_iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(c, [Some("logistics".into()), Some("refunds".into()), None]);
        let pointer = ClassRule::parse("field:/ticket/kind").unwrap();
        let nested = json!({"choices": ["{\"ticket\": {\"kind\": 3}}"]});
        assert_eq!(
            classes(Some(&nested), Some(&pointer))[0].0.as_deref(),
            Some("3")
        );
        let pattern = ClassRule::parse("pattern:(?i)category:\\s*(\\w+)").unwrap();
        let text = json!({"choices": ["Category: Billing. Thanks"]});
        assert_eq!(
            classes(Some(&text), Some(&pattern))[0].0.as_deref(),
            Some("Billing")
        );
        assert!(ClassRule::parse("pattern:(").is_err());
        assert!(classes(Some(&out), None).iter().all(|c| c.0.is_none()));
    }

    #[test]
    fn wilson_bounds_match_the_textbook() {
        // 10 errors in 100: the 95 % interval is [0.0552, 0.1744].
        let (lo, hi) = wilson(10, 100, 1.96);
        assert!(
            (lo - 0.0552).abs() < 5e-4 && (hi - 0.1744).abs() < 5e-4,
            "{lo} {hi}"
        );
        assert_eq!(wilson(0, 0, 1.96), (0.0, 1.0));
        let (lo, _) = wilson(0, 50, 1.96);
        assert_eq!(lo, 0.0);
    }
}
