//! The golden set: the evaluation cases a candidate must pass before it gets any traffic.
//!
//! A golden set lives in the model repository as `models/<name>/golden/*.jsonl`, versioned like
//! the rest. Every `.jsonl` file in that folder is read, in file-name order; each non-blank line is
//! one case (a line whose first non-blank character is `#` is a comment). Ids must be unique
//! across all files. The set's digest (SHA-256 over the file names and contents) goes into every
//! gate result, so a result says which golden set it was measured on.
//!
//! A case has an `id`, exactly one input (`prompt`, `messages` or `input`) and an `expected`
//! object. The input is kept as written: the server interprets it and runs it through the stable
//! and the candidate variant; this module only reads the expectation and scores the outputs.
//!
//! ```text
//! # An LLM that answers in JSON: the label is read from the output's field `category`
//! # (a dotted path such as `result.category` also works).
//! {"id": "t1", "prompt": "My parcel never came, I want my money back", "label_field": "category", "expected": {"label": "refund"}}
//! # Chat messages; the label is the first capture group of `label_regex` in the output text.
//! {"id": "t2", "messages": [{"role": "user", "content": "Where is my order?"}], "label_regex": "Category: (\\w+)", "expected": {"label": "logistics"}}
//! # Exact text (compared after trimming white space) or a regex that must match somewhere;
//! # `label` next to them is optional and only names the class for per-class statistics.
//! {"id": "t3", "prompt": "2+2=", "expected": {"exact": "4"}}
//! {"id": "t4", "prompt": "Say hello", "expected": {"regex": "(?i)^hello\\b", "label": "greeting"}}
//! # A classifier: the input is whatever the model's pre-processing takes.
//! {"id": "img-1", "input": {"image": "images/cat.png"}, "expected": {"label": "cat"}}
//! # A detector: ground-truth boxes as [x1, y1, x2, y2] in pixels (x2 >= x1, y2 >= y1).
//! {"id": "det-1", "input": {"image": "images/street.png"}, "expected": {"boxes": [{"label": "person", "box": [10, 20, 50, 120]}]}}
//! ```
//!
//! How a text output becomes an answer: with `label_field`, the output is parsed as JSON (or the
//! outermost `{…}` inside it, for models that wrap JSON in prose) and the field is read; with
//! `label_regex`, the first capture group (or the whole match) is taken; otherwise the answer is
//! the trimmed text. `label` and `exact` compare the answer for equality, `regex` searches it.
//! A case may also carry `meta` (any JSON) for the author's notes; other keys are refused, so a
//! typo in `expected` cannot silently make a case vacuous.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use regex::Regex;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Predicted class of a case whose model call failed.
pub const FAILED_CLASS: &str = "(failed)";
/// Predicted class when no label could be read from the output (no JSON, no field, no match).
pub const NO_LABEL_CLASS: &str = "(no label)";
/// Predicted class of an `exact`/`regex` case whose answer did not match.
pub const MISMATCH_CLASS: &str = "(mismatch)";
/// Predicted class when the prediction's kind does not fit the case (boxes for a label case…).
pub const WRONG_KIND_CLASS: &str = "(wrong kind)";

/// Why a golden set could not be read. Parse errors name the file and the 1-based line.
#[derive(Debug, thiserror::Error)]
pub enum GoldenError {
    #[error("reading golden set {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `case` is not the `source`: the message already says it, and a chain printer (anyhow's
    /// `{:#}`, as `rampart release` prints) would say it twice.
    #[error("{file}:{line}: {case}")]
    Parse {
        file: String,
        line: usize,
        case: CaseError,
    },
    #[error("{second}: duplicate case id `{id}` (first defined at {first})")]
    DuplicateId {
        id: String,
        first: CaseSource,
        second: CaseSource,
    },
    #[error("golden set {0} has no cases")]
    Empty(String),
}

/// Where a case was written: file name (relative to the golden folder) and 1-based line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CaseSource {
    pub file: String,
    pub line: usize,
}

impl fmt::Display for CaseSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.file, self.line)
    }
}

/// The input of a case, as written; the server interprets it.
#[derive(Debug, Clone, PartialEq)]
pub enum CaseInput {
    Prompt(String),
    Messages(serde_json::Value),
    Input(serde_json::Value),
}

/// A ground-truth box: `[x1, y1, x2, y2]` in pixels.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroundTruthBox {
    pub label: String,
    #[serde(rename = "box")]
    pub bbox: [f32; 4],
}

/// How the answer of a case is judged.
#[derive(Debug, Clone)]
pub enum Expected {
    /// The answer must equal this label; the label is also the case's class.
    Label(String),
    /// The answer must equal this text; `class` (optional) names it for per-class statistics.
    Exact { text: String, class: Option<String> },
    /// The regex must match somewhere in the answer.
    Regex { regex: Regex, class: Option<String> },
    /// A detector's ground truth.
    Boxes(Vec<GroundTruthBox>),
}

/// How a label is read from a text output.
#[derive(Debug, Clone)]
pub enum LabelExtraction {
    /// The trimmed text is the answer.
    WholeText,
    /// A field (dotted path) of the JSON output.
    JsonField(String),
    /// The first capture group (or the whole match) of a regex.
    Regex(Regex),
}

/// One golden case.
#[derive(Debug, Clone)]
pub struct GoldenCase {
    pub id: String,
    pub input: CaseInput,
    pub expected: Expected,
    pub extraction: LabelExtraction,
    pub meta: Option<serde_json::Value>,
    pub source: CaseSource,
}

/// A box a detector found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DetectedBox {
    pub label: String,
    pub score: f32,
    #[serde(rename = "box")]
    pub bbox: [f32; 4],
}

/// What a variant answered for one case; the server computes it, in the order of
/// [`GoldenSet::cases`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prediction {
    /// An LLM's output text.
    Text(String),
    /// A classifier's label.
    Label {
        label: String,
        confidence: Option<f32>,
    },
    /// A detector's boxes.
    Boxes(Vec<DetectedBox>),
    /// The model errored on this case: it counts as wrong.
    Failed(String),
}

/// How one non-detector case was scored.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// The case's class, when it has one.
    pub expected_class: Option<String>,
    /// What the variant answered, as a class (or one of the `(…)` sentinels).
    pub predicted_class: String,
    pub correct: bool,
}

impl GoldenCase {
    /// Whether this is a detector case (judged by boxes, not by one answer).
    pub fn is_detection(&self) -> bool {
        matches!(self.expected, Expected::Boxes(_))
    }

    /// The class this case belongs to, if any.
    pub fn class(&self) -> Option<&str> {
        match &self.expected {
            Expected::Label(label) => Some(label),
            Expected::Exact { class, .. } | Expected::Regex { class, .. } => class.as_deref(),
            Expected::Boxes(_) => None,
        }
    }

    /// Scores a non-detector case. For a detector case, the gate matches boxes instead; this
    /// returns a wrong-kind outcome.
    pub fn score(&self, prediction: &Prediction) -> Scored {
        let expected_class = self.class().map(str::to_owned);
        let wrong = |predicted: &str| Scored {
            expected_class: expected_class.clone(),
            predicted_class: predicted.to_owned(),
            correct: false,
        };
        let answer = match prediction {
            Prediction::Failed(_) => return wrong(FAILED_CLASS),
            Prediction::Boxes(_) => return wrong(WRONG_KIND_CLASS),
            Prediction::Label { label, .. } => Some(label.trim().to_owned()),
            Prediction::Text(text) => self.extract(text),
        };
        if self.is_detection() {
            return wrong(WRONG_KIND_CLASS);
        }
        let Some(answer) = answer else {
            return wrong(NO_LABEL_CLASS);
        };
        let correct = match &self.expected {
            Expected::Label(label) => answer == *label,
            Expected::Exact { text, .. } => answer == text.trim(),
            Expected::Regex { regex, .. } => regex.is_match(&answer),
            Expected::Boxes(_) => false,
        };
        let predicted_class = match (&self.expected, correct) {
            (Expected::Label(_), _) => answer,
            (_, true) => expected_class.clone().unwrap_or_else(|| answer.clone()),
            (_, false) => MISMATCH_CLASS.to_owned(),
        };
        Scored {
            expected_class,
            predicted_class,
            correct,
        }
    }

    /// The answer read from a text output, per the case's extraction.
    pub fn extract(&self, text: &str) -> Option<String> {
        match &self.extraction {
            LabelExtraction::WholeText => Some(text.trim().to_owned()),
            LabelExtraction::Regex(regex) => {
                let captures = regex.captures(text)?;
                let found = captures.get(1).or_else(|| captures.get(0))?;
                Some(found.as_str().trim().to_owned())
            }
            LabelExtraction::JsonField(path) => {
                let value = parse_json_output(text)?;
                let mut node = &value;
                for key in path.split('.') {
                    node = node.get(key)?;
                }
                match node {
                    serde_json::Value::String(s) => Some(s.trim().to_owned()),
                    serde_json::Value::Number(n) => Some(n.to_string()),
                    serde_json::Value::Bool(b) => Some(b.to_string()),
                    _ => None,
                }
            }
        }
    }
}

/// The output as JSON, or the outermost `{…}` inside it (models like to wrap JSON in prose or
/// code fences).
fn parse_json_output(text: &str) -> Option<serde_json::Value> {
    if let Ok(value) = serde_json::from_str(text.trim()) {
        return Some(value);
    }
    let start = text.find('{')?;
    let end = text.rfind('}')?;
    if end <= start {
        return None;
    }
    serde_json::from_str(&text[start..=end]).ok()
}

/// A golden set: its cases in file then line order, the files it came from, its digest.
#[derive(Debug, Clone)]
pub struct GoldenSet {
    cases: Vec<GoldenCase>,
    files: Vec<String>,
    digest: String,
}

impl GoldenSet {
    /// Reads every `*.jsonl` in `dir` (not recursive), sorted by file name.
    pub fn load_dir(dir: &Path) -> Result<GoldenSet, GoldenError> {
        let io = |source| GoldenError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let mut paths = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(io)? {
            let path = entry.map_err(io)?.path();
            if path.extension().is_some_and(|ext| ext == "jsonl") && path.is_file() {
                paths.push(path);
            }
        }
        paths.sort();
        let mut sources = Vec::with_capacity(paths.len());
        for path in paths {
            let text = std::fs::read_to_string(&path).map_err(|source| GoldenError::Io {
                path: path.clone(),
                source,
            })?;
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            sources.push((name, text));
        }
        if sources.is_empty() {
            return Err(GoldenError::Empty(dir.display().to_string()));
        }
        Self::from_sources(&sources)
    }

    /// Builds a set from `(file name, contents)` pairs, in the order given.
    pub fn from_sources(sources: &[(String, String)]) -> Result<GoldenSet, GoldenError> {
        let mut hasher = Sha256::new();
        let mut cases = Vec::new();
        let mut seen: HashMap<String, CaseSource> = HashMap::new();
        for (file, text) in sources {
            // Length-prefixed so that moving bytes between names and contents changes the digest.
            hasher.update((file.len() as u64).to_le_bytes());
            hasher.update(file.as_bytes());
            hasher.update((text.len() as u64).to_le_bytes());
            hasher.update(text.as_bytes());
            for (index, line) in text.lines().enumerate() {
                let trimmed = line.trim();
                if trimmed.is_empty() || trimmed.starts_with('#') {
                    continue;
                }
                let source = CaseSource {
                    file: file.clone(),
                    line: index + 1,
                };
                let case =
                    parse_case(trimmed, source.clone()).map_err(|case| GoldenError::Parse {
                        file: file.clone(),
                        line: index + 1,
                        case,
                    })?;
                if let Some(first) = seen.get(&case.id) {
                    return Err(GoldenError::DuplicateId {
                        id: case.id,
                        first: first.clone(),
                        second: source,
                    });
                }
                seen.insert(case.id.clone(), source);
                cases.push(case);
            }
        }
        if cases.is_empty() {
            let names: Vec<&str> = sources.iter().map(|(name, _)| name.as_str()).collect();
            return Err(GoldenError::Empty(names.join(", ")));
        }
        Ok(GoldenSet {
            cases,
            files: sources.iter().map(|(name, _)| name.clone()).collect(),
            digest: hex::encode(hasher.finalize()),
        })
    }

    pub fn cases(&self) -> &[GoldenCase] {
        &self.cases
    }

    pub fn len(&self) -> usize {
        self.cases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cases.is_empty()
    }

    /// The file names read, in order.
    pub fn files(&self) -> &[String] {
        &self.files
    }

    /// `sha256:<hex>` over the file names and contents.
    pub fn digest(&self) -> String {
        format!("sha256:{}", self.digest)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCase {
    id: String,
    prompt: Option<String>,
    messages: Option<serde_json::Value>,
    input: Option<serde_json::Value>,
    expected: RawExpected,
    label_field: Option<String>,
    label_regex: Option<String>,
    meta: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawExpected {
    label: Option<String>,
    exact: Option<String>,
    regex: Option<String>,
    boxes: Option<Vec<GroundTruthBox>>,
}

/// Why one line of a golden set is not a case.
#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    #[error("`id` is empty")]
    EmptyId,
    #[error("case `{id}`: `messages` must be an array")]
    MessagesNotArray { id: String },
    #[error("case `{id}`: give exactly one of `prompt`, `messages`, `input`")]
    InputCount { id: String },
    #[error("case `{id}`: `{key}` is not a regex: {source}")]
    BadRegex {
        id: String,
        key: &'static str,
        #[source]
        source: regex::Error,
    },
    #[error("case `{id}`: `label_field` `{field}` is empty")]
    EmptyLabelField { id: String, field: String },
    #[error("case `{id}`: give `label_field` or `label_regex`, not both")]
    LabelFieldAndRegex { id: String },
    #[error(
        "case `{id}`: box {bbox:?} of `{label}` is not [x1, y1, x2, y2] with x2 >= x1, y2 >= y1"
    )]
    BadBox {
        id: String,
        bbox: [f32; 4],
        label: String,
    },
    #[error("case `{id}`: `expected.boxes` stands alone (no label, exact or regex)")]
    BoxesNotAlone { id: String },
    #[error("case `{id}`: give `expected.exact` or `expected.regex`, not both")]
    ExactAndRegex { id: String },
    #[error("case `{id}`: `expected` needs one of `label`, `exact`, `regex`, `boxes`")]
    NoExpected { id: String },
}

fn parse_case(line: &str, source: CaseSource) -> Result<GoldenCase, CaseError> {
    let raw: RawCase = serde_json::from_str(line)?;
    if raw.id.trim().is_empty() {
        return Err(CaseError::EmptyId);
    }
    let input = match (raw.prompt, raw.messages, raw.input) {
        (Some(prompt), None, None) => CaseInput::Prompt(prompt),
        (None, Some(messages), None) => {
            if !messages.is_array() {
                return Err(CaseError::MessagesNotArray { id: raw.id.clone() });
            }
            CaseInput::Messages(messages)
        }
        (None, None, Some(input)) => CaseInput::Input(input),
        _ => return Err(CaseError::InputCount { id: raw.id.clone() }),
    };
    let compile = |pattern: &str, key: &'static str| {
        Regex::new(pattern).map_err(|source| CaseError::BadRegex {
            id: raw.id.clone(),
            key,
            source,
        })
    };
    let extraction = match (raw.label_field, raw.label_regex) {
        (None, None) => LabelExtraction::WholeText,
        (Some(field), None) => {
            if field.split('.').any(str::is_empty) {
                return Err(CaseError::EmptyLabelField {
                    id: raw.id.clone(),
                    field,
                });
            }
            LabelExtraction::JsonField(field)
        }
        (None, Some(pattern)) => LabelExtraction::Regex(compile(&pattern, "label_regex")?),
        (Some(_), Some(_)) => return Err(CaseError::LabelFieldAndRegex { id: raw.id.clone() }),
    };
    let e = raw.expected;
    let expected = match (e.label, e.exact, e.regex, e.boxes) {
        (None, None, None, Some(boxes)) => {
            for gt in &boxes {
                let [x1, y1, x2, y2] = gt.bbox;
                if !gt.bbox.iter().all(|v| v.is_finite()) || x2 < x1 || y2 < y1 {
                    return Err(CaseError::BadBox {
                        id: raw.id.clone(),
                        bbox: gt.bbox,
                        label: gt.label.clone(),
                    });
                }
            }
            Expected::Boxes(boxes)
        }
        (_, _, _, Some(_)) => return Err(CaseError::BoxesNotAlone { id: raw.id.clone() }),
        (Some(label), None, None, None) => Expected::Label(label.trim().to_owned()),
        (class, Some(text), None, None) => Expected::Exact { text, class },
        (class, None, Some(pattern), None) => Expected::Regex {
            regex: compile(&pattern, "expected.regex")?,
            class,
        },
        (_, Some(_), Some(_), None) => return Err(CaseError::ExactAndRegex { id: raw.id.clone() }),
        (None, None, None, None) => return Err(CaseError::NoExpected { id: raw.id.clone() }),
    };
    Ok(GoldenCase {
        id: raw.id,
        input,
        expected,
        extraction,
        meta: raw.meta,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(files: &[(&str, &str)]) -> Result<GoldenSet, GoldenError> {
        let sources: Vec<(String, String)> = files
            .iter()
            .map(|(n, t)| (n.to_string(), t.to_string()))
            .collect();
        GoldenSet::from_sources(&sources)
    }

    #[test]
    fn parse_errors_name_file_and_line() {
        let text = "{\"id\": \"a\", \"prompt\": \"x\", \"expected\": {\"label\": \"refund\"}}\n\n# note\n{\"id\": \"b\", \"prompt\": \"x\", \"expected\": {\"lable\": \"refund\"}}\n";
        let err = set(&[("cases.jsonl", text)]).unwrap_err();
        let shown = err.to_string();
        assert!(shown.starts_with("cases.jsonl:4: "), "{shown}");
        assert!(shown.contains("lable"), "{shown}");

        let err = set(&[(
            "x.jsonl",
            "{\"id\": \"a\", \"prompt\": \"x\", \"input\": {}, \"expected\": {\"label\": \"a\"}}",
        )])
        .unwrap_err();
        assert!(err.to_string().starts_with("x.jsonl:1: "), "{err}");

        let err = set(&[(
            "r.jsonl",
            "{\"id\": \"a\", \"prompt\": \"x\", \"expected\": {\"regex\": \"(\"}}",
        )])
        .unwrap_err();
        assert!(err.to_string().starts_with("r.jsonl:1: "), "{err}");

        let err = set(&[("d.jsonl", "{\"id\": \"a\", \"input\": {}, \"expected\": {\"boxes\": [{\"label\": \"p\", \"box\": [5, 0, 1, 1]}]}}")])
            .unwrap_err();
        assert!(err.to_string().starts_with("d.jsonl:1: "), "{err}");
    }

    #[test]
    fn duplicate_ids_are_refused_across_files() {
        let a = "{\"id\": \"same\", \"prompt\": \"x\", \"expected\": {\"label\": \"a\"}}";
        let b = "{\"id\": \"other\", \"prompt\": \"x\", \"expected\": {\"label\": \"a\"}}\n{\"id\": \"same\", \"prompt\": \"y\", \"expected\": {\"label\": \"b\"}}";
        let err = set(&[("a.jsonl", a), ("b.jsonl", b)]).unwrap_err();
        match &err {
            GoldenError::DuplicateId { id, first, second } => {
                assert_eq!(id, "same");
                assert_eq!(first.to_string(), "a.jsonl:1");
                assert_eq!(second.to_string(), "b.jsonl:2");
            }
            other => panic!("expected a duplicate id, got {other}"),
        }
    }

    #[test]
    fn load_dir_reads_sorted_jsonl_and_digests() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("b.jsonl"),
            "{\"id\": \"b1\", \"input\": {\"image\": \"b.png\"}, \"expected\": {\"label\": \"dog\"}}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("a.jsonl"),
            "{\"id\": \"a1\", \"input\": {\"image\": \"a.png\"}, \"expected\": {\"label\": \"cat\"}}\n",
        )
        .unwrap();
        std::fs::write(dir.path().join("notes.txt"), "not a case").unwrap();
        let golden = GoldenSet::load_dir(dir.path()).unwrap();
        let ids: Vec<&str> = golden.cases().iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["a1", "b1"]);
        assert_eq!(golden.files(), ["a.jsonl", "b.jsonl"]);
        let digest = golden.digest();
        assert!(digest.starts_with("sha256:") && digest.len() == 7 + 64);

        std::fs::write(
            dir.path().join("b.jsonl"),
            "{\"id\": \"b1\", \"input\": {\"image\": \"b.png\"}, \"expected\": {\"label\": \"cat\"}}\n",
        )
        .unwrap();
        assert_ne!(GoldenSet::load_dir(dir.path()).unwrap().digest(), digest);

        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(
            GoldenSet::load_dir(empty.path()),
            Err(GoldenError::Empty(_))
        ));
    }

    #[test]
    fn text_outputs_are_scored_by_field_regex_exact() {
        let golden = set(&[(
            "llm.jsonl",
            r#"{"id": "f", "prompt": "p", "label_field": "result.category", "expected": {"label": "refund"}}
{"id": "r", "messages": [{"role": "user", "content": "p"}], "label_regex": "Category: (\\w+)", "expected": {"label": "logistics"}}
{"id": "e", "prompt": "2+2=", "expected": {"exact": "4"}}
{"id": "x", "prompt": "hi", "expected": {"regex": "(?i)^hello", "label": "greeting"}}"#,
        )])
        .unwrap();
        let c = golden.cases();
        let text = |s: &str| Prediction::Text(s.to_owned());

        let ok = c[0].score(&text(
            "Sure! ```json\n{\"result\": {\"category\": \"refund\"}}\n```",
        ));
        assert!(ok.correct);
        let bad = c[0].score(&text("{\"result\": {\"category\": \"logistics\"}}"));
        assert_eq!(
            (bad.correct, bad.predicted_class.as_str()),
            (false, "logistics")
        );
        assert_eq!(c[0].score(&text("no json")).predicted_class, NO_LABEL_CLASS);

        assert!(c[1].score(&text("Category: logistics.")).correct);
        assert!(!c[1].score(&text("Category: refund")).correct);

        assert!(c[2].score(&text(" 4\n")).correct);
        assert!(!c[2].score(&text("44")).correct);

        let hello = c[3].score(&text("Hello there"));
        assert!(hello.correct);
        assert_eq!(hello.predicted_class, "greeting");
        let other = c[3].score(&text("Good day"));
        assert_eq!(
            (other.correct, other.predicted_class.as_str()),
            (false, MISMATCH_CLASS)
        );

        let failed = c[0].score(&Prediction::Failed("timeout".into()));
        assert_eq!(
            (failed.correct, failed.predicted_class.as_str()),
            (false, FAILED_CLASS)
        );
        let label = c[0].score(&Prediction::Label {
            label: "refund".into(),
            confidence: Some(0.9),
        });
        assert!(label.correct);
    }
}
