//! Datasets from feedback: corrected examples with their original inputs, for a fine-tuning
//! job.
//!
//! - `openai-chat-jsonl`: one `{"messages": [...]}` per line, the conversation ending with the
//!   corrected answer (with `include_helpful`, answers rated helpful as they were);
//! - `preference-jsonl`: `{"input": {"messages"}, "preferred_output", "non_preferred_output"}`,
//!   the correction preferred over the original answer;
//! - `csv` and `parquet`: every feedback row with its input, the original and the corrected
//!   answer or label (classifiers' label corrections included).
//!
//! Rows are deduplicated (same input and same target: the latest wins), optionally scrubbed of
//! personal data, and each carries a provenance hash (the response's audit id, hashes and
//! version, and the feedback it came from). The export's sha256 names the dataset version.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::store::{Example, Filter, Store};
use crate::FeedbackError;

/// The export formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    OpenAiChatJsonl,
    PreferenceJsonl,
    Csv,
    Parquet,
}

impl Format {
    pub const NAMES: [&'static str; 4] =
        ["openai-chat-jsonl", "preference-jsonl", "csv", "parquet"];

    pub fn parse(s: &str) -> Option<Format> {
        match s {
            "openai-chat-jsonl" => Some(Format::OpenAiChatJsonl),
            "preference-jsonl" => Some(Format::PreferenceJsonl),
            "csv" => Some(Format::Csv),
            "parquet" => Some(Format::Parquet),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Format::OpenAiChatJsonl => "openai-chat-jsonl",
            Format::PreferenceJsonl => "preference-jsonl",
            Format::Csv => "csv",
            Format::Parquet => "parquet",
        }
    }
}

/// What to export.
#[derive(Debug, Clone)]
pub struct Options {
    pub filter: Filter,
    pub format: Format,
    /// Replace e-mail addresses, phone and card numbers, IBANs and IP addresses.
    pub scrub_pii: bool,
    /// Chat JSONL: also answers rated helpful (as they were), not only corrected ones.
    pub include_helpful: bool,
}

/// What an export wrote.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    /// `ds-` and the first 16 hex digits of the file's sha256: the dataset version a model
    /// trained on it names in its lineage.
    pub dataset_version: String,
    pub format: &'static str,
    pub rows: usize,
    /// Feedback rows read.
    pub read: usize,
    /// Left out: no input kept, nothing corrected for this format, or a duplicate.
    pub without_content: usize,
    pub not_applicable: usize,
    pub duplicates: usize,
    pub sha256: String,
    pub bytes: usize,
    pub scrubbed: bool,
    pub model: Option<String>,
    pub class: Option<String>,
    pub since_ms: Option<u64>,
    pub until_ms: Option<u64>,
    pub created_ms: u64,
}

/// One exported example, format-independent.
#[derive(Debug, Clone)]
struct Row {
    provenance: String,
    audit_id: String,
    time_ms: u64,
    model: String,
    version: String,
    endpoint: String,
    item: usize,
    class: Option<String>,
    confidence: Option<f32>,
    label: Option<String>,
    rating: Option<String>,
    error: bool,
    rater: String,
    comment: Option<String>,
    /// The conversation before the answer (chat messages; a completion's prompt as a user
    /// message); none for tensor inputs.
    messages: Option<Vec<Value>>,
    /// The input as kept (any endpoint).
    input: Value,
    /// The answer as it was (text), or a classifier's judgement (JSON).
    original: Option<String>,
    /// The corrected answer (text), when there is one.
    corrected: Option<String>,
    /// Corrected messages given whole (they replace the conversation).
    corrected_messages: Option<Vec<Value>>,
}

/// Writes a dataset; returns the file's bytes and the summary.
pub fn export(store: &Store, options: &Options) -> Result<(Vec<u8>, Summary), FeedbackError> {
    let examples = store.examples(&options.filter)?;
    let read = examples.len();
    let scrubber = options.scrub_pii.then(Scrubber::new);
    let mut without_content = 0;
    let mut not_applicable = 0;
    // The latest row per (input, target) wins.
    let mut kept: Vec<Row> = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut duplicates = 0;
    for e in &examples {
        let Some(mut row) = row_of(e) else {
            without_content += 1;
            continue;
        };
        if let Some(s) = &scrubber {
            s.row(&mut row);
        }
        if !applies(&row, options) {
            not_applicable += 1;
            continue;
        }
        let key = dedup_key(&row, options.format);
        match seen.get(&key) {
            Some(&i) => {
                duplicates += 1;
                kept[i] = row;
            }
            None => {
                seen.insert(key, kept.len());
                kept.push(row);
            }
        }
    }
    let bytes = match options.format {
        Format::OpenAiChatJsonl => jsonl(kept.iter().map(chat_line)),
        Format::PreferenceJsonl => jsonl(kept.iter().filter_map(preference_line)),
        Format::Csv => csv(&kept),
        Format::Parquet => parquet(&kept)?,
    };
    let sha = hex::encode(Sha256::digest(&bytes));
    let summary = Summary {
        dataset_version: format!("ds-{}", &sha[..16]),
        format: options.format.as_str(),
        rows: kept.len(),
        read,
        without_content,
        not_applicable,
        duplicates,
        sha256: sha,
        bytes: bytes.len(),
        scrubbed: options.scrub_pii,
        model: options.filter.model.clone(),
        class: options.filter.class.clone(),
        since_ms: options.filter.since_ms,
        until_ms: options.filter.until_ms,
        created_ms: crate::now_ms(),
    };
    Ok((bytes, summary))
}

fn text_of(v: &Value) -> Option<String> {
    v.as_str().map(str::to_string)
}

fn row_of(e: &Example) -> Option<Row> {
    let r = &e.response;
    let f = &e.feedback;
    let input = r.input.clone()?;
    let messages = match input.get("messages").and_then(Value::as_array) {
        Some(m) => Some(m.clone()),
        None => input
            .get("prompt")
            .and_then(Value::as_str)
            .map(|p| vec![json!({"role": "user", "content": p})]),
    };
    let output = r.output.as_ref();
    let original = output
        .and_then(|o| o.get("choices"))
        .and_then(|c| c.get(f.item))
        .and_then(text_of)
        .or_else(|| {
            output
                .and_then(|o| o.get("judgements"))
                .and_then(|j| j.get(f.item))
                .map(Value::to_string)
        });
    let (corrected, corrected_messages) = match &f.correction {
        Some(crate::Correction::Text(t)) => (Some(t.clone()), None),
        Some(c @ crate::Correction::Messages(m)) => {
            (c.answer().map(str::to_string), Some(m.clone()))
        }
        None => (None, None),
    };
    let provenance = {
        let p = json!({
            "audit_id": r.audit_id, "item": f.item, "feedback_id": f.id, "rater": f.rater,
            "version": r.version, "input_sha256": r.input_sha256,
            "output_sha256": r.output_sha256, "label": f.label, "corrected": corrected,
        });
        hex::encode(Sha256::digest(p.to_string().as_bytes()))
    };
    Some(Row {
        provenance,
        audit_id: r.audit_id.clone(),
        time_ms: f.time_ms,
        model: r.model.clone(),
        version: r.version.clone(),
        endpoint: r.endpoint.clone(),
        item: f.item,
        class: f.class.clone(),
        confidence: f.confidence,
        label: f.label.clone(),
        rating: f.rating.map(|r| r.as_str().to_string()),
        error: f.error,
        rater: f.rater.clone(),
        comment: f.comment.clone(),
        messages,
        input,
        original,
        corrected,
        corrected_messages,
    })
}

/// Whether a row has what the format needs.
fn applies(row: &Row, options: &Options) -> bool {
    match options.format {
        Format::OpenAiChatJsonl => {
            row.corrected_messages.is_some()
                || (row.messages.is_some()
                    && (row.corrected.is_some()
                        || (options.include_helpful
                            && row.original.is_some()
                            && row
                                .rating
                                .as_deref()
                                .and_then(crate::Rating::parse)
                                .and_then(crate::Rating::helpful)
                                == Some(true))))
        }
        Format::PreferenceJsonl => {
            row.messages.is_some()
                && row.original.is_some()
                && row.corrected.is_some()
                && row.corrected != row.original
        }
        Format::Csv | Format::Parquet => true,
    }
}

fn dedup_key(row: &Row, format: Format) -> String {
    let target = match format {
        Format::Csv | Format::Parquet => json!([row.audit_id, row.item, row.rater]),
        _ => json!([row.corrected, row.corrected_messages, row.original]),
    };
    let k = json!([row.input, target]);
    hex::encode(Sha256::digest(k.to_string().as_bytes()))
}

fn jsonl(lines: impl Iterator<Item = Value>) -> Vec<u8> {
    let mut out = Vec::new();
    for l in lines {
        out.extend_from_slice(l.to_string().as_bytes());
        out.push(b'\n');
    }
    out
}

fn chat_line(row: &Row) -> Value {
    let messages = match &row.corrected_messages {
        Some(m) => m.clone(),
        None => {
            let mut m = row.messages.clone().unwrap_or_default();
            let answer = row
                .corrected
                .clone()
                .or_else(|| row.original.clone())
                .unwrap_or_default();
            m.push(json!({"role": "assistant", "content": answer}));
            m
        }
    };
    json!({ "messages": messages, "metadata": {"provenance": row.provenance, "audit_id": row.audit_id, "model": row.model, "version": row.version} })
}

fn preference_line(row: &Row) -> Option<Value> {
    Some(json!({
        "input": { "messages": row.messages.clone()? },
        "preferred_output": [{"role": "assistant", "content": row.corrected.clone()?}],
        "non_preferred_output": [{"role": "assistant", "content": row.original.clone()?}],
        "metadata": {"provenance": row.provenance, "audit_id": row.audit_id, "model": row.model, "version": row.version},
    }))
}

/// The columns of the CSV and Parquet exports, in order.
pub const COLUMNS: [&str; 18] = [
    "provenance",
    "audit_id",
    "time_ms",
    "model",
    "version",
    "endpoint",
    "item",
    "class",
    "confidence",
    "label",
    "rating",
    "error",
    "rater",
    "comment",
    "input",
    "original",
    "corrected",
    "messages",
];

fn cells(row: &Row) -> [Option<String>; 18] {
    [
        Some(row.provenance.clone()),
        Some(row.audit_id.clone()),
        Some(row.time_ms.to_string()),
        Some(row.model.clone()),
        Some(row.version.clone()),
        Some(row.endpoint.clone()),
        Some(row.item.to_string()),
        row.class.clone(),
        row.confidence.map(|c| c.to_string()),
        row.label.clone(),
        row.rating.clone(),
        Some(row.error.to_string()),
        Some(row.rater.clone()),
        row.comment.clone(),
        Some(row.input.to_string()),
        row.original.clone(),
        row.corrected.clone(),
        row.corrected_messages
            .as_ref()
            .map(|m| Value::Array(m.clone()).to_string()),
    ]
}

/// RFC 4180: fields with commas, quotes or line breaks are quoted, quotes doubled; CRLF rows.
fn csv(rows: &[Row]) -> Vec<u8> {
    fn field(out: &mut String, s: &str) {
        if s.contains([',', '"', '\n', '\r']) {
            out.push('"');
            out.push_str(&s.replace('"', "\"\""));
            out.push('"');
        } else {
            out.push_str(s);
        }
    }
    let mut out = COLUMNS.join(",");
    out.push_str("\r\n");
    for row in rows {
        for (i, c) in cells(row).iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            field(&mut out, c.as_deref().unwrap_or(""));
        }
        out.push_str("\r\n");
    }
    out.into_bytes()
}

fn parquet(rows: &[Row]) -> Result<Vec<u8>, FeedbackError> {
    use parquet::basic::Compression;
    use parquet::data_type::{BoolType, ByteArray, ByteArrayType, FloatType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let p = |e: parquet::errors::ParquetError| FeedbackError::Export(format!("parquet: {e}"));
    let schema = "message feedback_example {
      required binary provenance (UTF8);
      required binary audit_id (UTF8);
      required int64 time_ms;
      required binary model (UTF8);
      required binary version (UTF8);
      required binary endpoint (UTF8);
      required int64 item;
      optional binary class (UTF8);
      optional float confidence;
      optional binary label (UTF8);
      optional binary rating (UTF8);
      required boolean error;
      required binary rater (UTF8);
      optional binary comment (UTF8);
      required binary input (UTF8);
      optional binary original (UTF8);
      optional binary corrected (UTF8);
      optional binary messages (UTF8);
    }";
    let schema = Arc::new(parse_message_type(schema).map_err(p)?);
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_created_by("rampart-feedback".into())
            .build(),
    );
    let mut out = Vec::new();
    let mut writer = SerializedFileWriter::new(&mut out, schema, props).map_err(p)?;
    let mut group = writer.next_row_group().map_err(p)?;
    let table: Vec<[Option<String>; 18]> = rows.iter().map(cells).collect();
    let mut column = 0;
    while let Some(mut col) = group.next_column().map_err(p)? {
        match column {
            2 => col.typed::<Int64Type>().write_batch(
                &rows.iter().map(|r| r.time_ms as i64).collect::<Vec<_>>(),
                None,
                None,
            ),
            6 => col.typed::<Int64Type>().write_batch(
                &rows.iter().map(|r| r.item as i64).collect::<Vec<_>>(),
                None,
                None,
            ),
            8 => {
                let values: Vec<f32> = rows.iter().filter_map(|r| r.confidence).collect();
                let defs: Vec<i16> = rows
                    .iter()
                    .map(|r| i16::from(r.confidence.is_some()))
                    .collect();
                col.typed::<FloatType>()
                    .write_batch(&values, Some(&defs), None)
            }
            11 => col.typed::<BoolType>().write_batch(
                &rows.iter().map(|r| r.error).collect::<Vec<_>>(),
                None,
                None,
            ),
            n => {
                let required = matches!(n, 0 | 1 | 3 | 4 | 5 | 12 | 14);
                let cells: Vec<Option<&String>> = table.iter().map(|c| c[n].as_ref()).collect();
                let values: Vec<ByteArray> = cells
                    .iter()
                    .flatten()
                    .map(|s| ByteArray::from(s.as_bytes().to_vec()))
                    .collect();
                if required {
                    col.typed::<ByteArrayType>()
                        .write_batch(&values, None, None)
                } else {
                    let defs: Vec<i16> = cells.iter().map(|c| i16::from(c.is_some())).collect();
                    col.typed::<ByteArrayType>()
                        .write_batch(&values, Some(&defs), None)
                }
            }
        }
        .map_err(p)?;
        col.close().map_err(p)?;
        column += 1;
    }
    group.close().map_err(p)?;
    writer.close().map_err(p)?;
    Ok(out)
}

/// Replaces personal data in texts: e-mail addresses, IBANs, card and phone numbers, IPv4
/// addresses. Patterns, not understanding: names and addresses in prose stay.
pub struct Scrubber {
    rules: Vec<(regex::Regex, &'static str)>,
}

impl Default for Scrubber {
    fn default() -> Self {
        Self::new()
    }
}

impl Scrubber {
    pub fn new() -> Self {
        let rule =
            |p: &str, with: &'static str| (regex::Regex::new(p).expect("a valid pattern"), with);
        Scrubber {
            rules: vec![
                rule(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}", "[EMAIL]"),
                rule(
                    r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,4})?\b",
                    "[IBAN]",
                ),
                rule(r"\b(?:\d[ -]?){12,18}\d\b", "[CARD]"),
                rule(r"\b(?:\d{1,3}\.){3}\d{1,3}\b", "[IP]"),
                rule(
                    r"(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d{2,4}(?:[ .-]\d{2,4}){2,4}\b",
                    "[PHONE]",
                ),
            ],
        }
    }

    pub fn text(&self, s: &str) -> String {
        let mut out = s.to_string();
        for (re, with) in &self.rules {
            if re.is_match(&out) {
                out = re.replace_all(&out, *with).into_owned();
            }
        }
        out
    }

    fn value(&self, v: &mut Value) {
        match v {
            Value::String(s) => *s = self.text(s),
            Value::Array(a) => a.iter_mut().for_each(|v| self.value(v)),
            Value::Object(o) => o.values_mut().for_each(|v| self.value(v)),
            _ => {}
        }
    }

    fn row(&self, row: &mut Row) {
        self.value(&mut row.input);
        if let Some(m) = &mut row.messages {
            m.iter_mut().for_each(|v| self.value(v));
        }
        if let Some(m) = &mut row.corrected_messages {
            m.iter_mut().for_each(|v| self.value(v));
        }
        for s in [&mut row.original, &mut row.corrected, &mut row.comment]
            .into_iter()
            .flatten()
        {
            *s = self.text(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::tests::response;
    use crate::{Rater, Submission};

    fn store() -> Store {
        let store = Store::in_memory().unwrap();
        let a = response("a", "logistics", 0.9, 1);
        let b = response("b", "refunds", 0.6, 2);
        let mut c = response("c", "refunds", 0.4, 3);
        c.input = None;
        store.index(&[a.clone(), b.clone(), c.clone()]).unwrap();
        let s = |v: Value| Submission::parse(&v, true).unwrap();
        store
            .submit(
                &a,
                &s(json!({"rating": "not_helpful", "label": "customs",
                "correction": "{\"category\": \"customs\"} mail me at jo@example.com"})),
                &Rater::key("agent", "ops"),
                10,
            )
            .unwrap();
        // The same correction by a second rater: one example.
        store
            .submit(
                &a,
                &s(json!({"correction": "{\"category\": \"customs\"} mail me at jo@example.com"})),
                &Rater::key("lead", "ops"),
                11,
            )
            .unwrap();
        store
            .submit(
                &b,
                &s(json!({"rating": "helpful"})),
                &Rater::key("agent", "ops"),
                12,
            )
            .unwrap();
        store
            .submit(
                &c,
                &s(json!({"rating": 1})),
                &Rater::key("agent", "ops"),
                13,
            )
            .unwrap();
        store
    }

    fn options(format: Format) -> Options {
        Options {
            filter: Filter {
                model: Some("tickets".into()),
                ..Filter::default()
            },
            format,
            scrub_pii: true,
            include_helpful: false,
        }
    }

    #[test]
    fn chat_jsonl_holds_corrected_conversations_deduplicated_and_scrubbed() {
        let store = store();
        let (bytes, s) = export(&store, &options(Format::OpenAiChatJsonl)).unwrap();
        let text = String::from_utf8(bytes).unwrap();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 1, "{text}");
        assert_eq!(
            (s.read, s.without_content, s.not_applicable, s.duplicates),
            (4, 1, 1, 1)
        );
        let m = lines[0]["messages"].as_array().unwrap();
        assert_eq!(m[0], json!({"role": "user", "content": "ticket a"}));
        assert_eq!(m[1]["role"], "assistant");
        assert_eq!(
            m[1]["content"],
            "{\"category\": \"customs\"} mail me at [EMAIL]"
        );
        assert!(s.dataset_version.starts_with("ds-") && s.dataset_version.len() == 19);
        let mut with_helpful = options(Format::OpenAiChatJsonl);
        with_helpful.include_helpful = true;
        let (_, s) = export(&store, &with_helpful).unwrap();
        assert_eq!(s.rows, 2, "the helpful answer as it was");
        let (again, _) = export(&store, &options(Format::OpenAiChatJsonl)).unwrap();
        assert_eq!(
            again,
            text.as_bytes(),
            "the same feedback gives the same dataset"
        );
    }

    #[test]
    fn preference_pairs_prefer_the_correction() {
        let (bytes, s) = export(&store(), &options(Format::PreferenceJsonl)).unwrap();
        assert_eq!(s.rows, 1);
        let v: Value = serde_json::from_slice(&bytes[..bytes.len() - 1]).unwrap();
        assert_eq!(
            v["non_preferred_output"][0]["content"],
            "{\"category\": \"logistics\"}"
        );
        assert!(v["preferred_output"][0]["content"]
            .as_str()
            .unwrap()
            .contains("customs"));
    }

    #[test]
    fn csv_and_parquet_hold_every_row_with_content() {
        let store = store();
        let (csv, s) = export(&store, &options(Format::Csv)).unwrap();
        assert_eq!(s.rows, 3);
        let text = String::from_utf8(csv).unwrap();
        assert!(text.starts_with("provenance,audit_id,time_ms,"));
        assert_eq!(text.matches("\r\n").count(), 4);
        let (pq, s) = export(&store, &options(Format::Parquet)).unwrap();
        assert_eq!(s.rows, 3);
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let reader = SerializedFileReader::new(bytes::Bytes::from(pq)).unwrap();
        assert_eq!(reader.metadata().file_metadata().num_rows(), 3);
        let rows: Vec<_> = reader
            .get_row_iter(None)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let labels: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
        assert!(labels[0].contains("customs"), "{labels:?}");
    }

    #[test]
    fn the_scrubber_replaces_personal_data() {
        let s = Scrubber::new();
        assert_eq!(
            s.text("Call +49 30 1234 5678 or mail a.b@c.de, card 4111 1111 1111 1111, IBAN DE89 3704 0044 0532 0130 00, ip 10.0.0.1"),
            "Call [PHONE] or mail [EMAIL], card [CARD], IBAN [IBAN], ip [IP]"
        );
        assert_eq!(s.text("order 12345 arrived"), "order 12345 arrived");
    }
}
