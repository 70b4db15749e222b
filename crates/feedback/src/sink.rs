//! The record sink that indexes every served response, so that feedback can find it by any of
//! its ids. Off the request path: its lane waits (lossless) but never delays an answer, and it
//! writes a batch per transaction.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use record::{Delivery, Envelope, Sink, SinkError, SinkFuture};

use crate::class::{classes, ClassRule};
use crate::store::{Response, Store};

/// The endpoints whose answers take feedback.
pub const ENDPOINTS: [&str; 4] = [
    "chat.completions",
    "completions",
    "kserve_infer",
    "kserve_grpc_infer",
];

/// Indexes responses into the store.
pub struct IndexSink {
    store: Arc<Store>,
    rules: Arc<HashMap<String, ClassRule>>,
    keep_content: bool,
    capacity: usize,
}

impl IndexSink {
    /// `rules`: each language model's class rule, by model name; `keep_content`: keep each
    /// response's input and output (exports need them) rather than their hashes alone.
    pub fn new(
        store: Arc<Store>,
        rules: Arc<HashMap<String, ClassRule>>,
        keep_content: bool,
        capacity: usize,
    ) -> Self {
        IndexSink {
            store,
            rules,
            keep_content,
            capacity,
        }
    }
}

/// The index row of a record, when its response takes feedback (a model's answer, served).
pub fn response_of(
    e: &Envelope,
    rules: &HashMap<String, ClassRule>,
    keep_content: bool,
) -> Option<Response> {
    let r = &e.record;
    if r.status != 200 || !ENDPOINTS.contains(&r.endpoint) || r.variant == Some("shadow") {
        return None;
    }
    let output = e.payload.as_ref().and_then(|p| p.output.as_ref());
    let input = e.payload.as_ref().and_then(|p| p.input.as_ref());
    let (classes, mut confidences): (Vec<_>, Vec<_>) =
        classes(output, rules.get(&r.model)).into_iter().unzip();
    if confidences.iter().all(Option::is_none) && classes.len() <= 1 {
        // A single answer without its own score: the record's confidence, when it has one.
        confidences = vec![r.confidence];
    }
    Some(Response {
        audit_id: r.audit_id.clone(),
        request_id: r.request_id.clone(),
        response_id: r.response_id.clone(),
        time_ms: r.time_ms,
        principal: r.principal.clone(),
        user: r.user.clone(),
        model: r.model.clone(),
        version: r.version.clone(),
        endpoint: r.endpoint.to_string(),
        classes: if classes.is_empty() {
            vec![None]
        } else {
            classes
        },
        confidences,
        input_sha256: r.input_sha256.clone(),
        output_sha256: r.output_sha256.clone(),
        input: input.filter(|_| keep_content).cloned(),
        output: output.filter(|_| keep_content).cloned(),
    })
}

impl Sink for IndexSink {
    fn name(&self) -> &'static str {
        "feedback"
    }

    fn delivery(&self) -> Delivery {
        Delivery::Lossless {
            capacity: self.capacity,
            timeout: Duration::from_secs(1),
            acknowledge: false,
        }
    }

    fn wants_payload(&self) -> bool {
        true
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        let rows: Vec<Response> = response_of(envelope, &self.rules, self.keep_content)
            .into_iter()
            .collect();
        self.write_rows(rows)
    }

    fn max_batch(&self) -> usize {
        256
    }

    fn write_batch<'a>(&'a mut self, envelopes: &'a [Arc<Envelope>]) -> SinkFuture<'a> {
        let rows: Vec<Response> = envelopes
            .iter()
            .filter_map(|e| response_of(e, &self.rules, self.keep_content))
            .collect();
        self.write_rows(rows)
    }
}

impl IndexSink {
    fn write_rows(&self, rows: Vec<Response>) -> SinkFuture<'static> {
        let store = Arc::clone(&self.store);
        Box::pin(async move {
            if rows.is_empty() {
                return Ok(());
            }
            tokio::task::spawn_blocking(move || store.index(&rows))
                .await
                .map_err(|e| SinkError(format!("feedback index task: {e}")))?
                .map_err(|e| SinkError(e.to_string()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use record::{InferenceRecord, Payload};
    use serde_json::json;

    fn envelope(endpoint: &'static str, output: serde_json::Value) -> Envelope {
        let mut r = InferenceRecord::new("req".into(), "app".into(), endpoint);
        r.model = "tickets".into();
        r.version = "1.0.0".into();
        r.response_id = Some("chatcmpl-x".into());
        Envelope {
            record: r,
            token_gaps_s: Vec::new(),
            token_entropies: Vec::new(),
            observations: Vec::new(),
            payload: Some(Payload {
                input: Some(json!({"messages": []})),
                output: Some(output),
            }),
            timeline: None,
        }
    }

    #[test]
    fn answers_are_indexed_with_their_class_and_the_rest_is_not() {
        let mut rules = HashMap::new();
        rules.insert("tickets".to_string(), ClassRule::parse("category").unwrap());
        let e = envelope(
            "chat.completions",
            json!({"choices": ["{\"category\": \"refunds\"}"]}),
        );
        let r = response_of(&e, &rules, true).unwrap();
        assert_eq!(r.classes, [Some("refunds".to_string())]);
        assert_eq!(r.response_id.as_deref(), Some("chatcmpl-x"));
        assert!(r.input.is_some());
        assert!(response_of(&e, &rules, false).unwrap().output.is_none());
        let mut failed = envelope("chat.completions", json!({}));
        failed.record.status = 500;
        assert!(response_of(&failed, &rules, true).is_none());
        assert!(response_of(&envelope("embeddings", json!({})), &rules, true).is_none());
        let mut shadow = envelope("chat.completions", json!({}));
        shadow.record.variant = Some("shadow");
        assert!(response_of(&shadow, &rules, true).is_none());
        let image = envelope(
            "kserve_infer",
            json!({"judgements": [[{"index": 1, "label": "90", "score": 0.7}]]}),
        );
        let r = response_of(&image, &rules, true).unwrap();
        assert_eq!(r.classes, [Some("90".to_string())]);
        assert_eq!(r.confidences, [Some(0.7)]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_index_sink_passes_the_sink_contract() {
        let store = Arc::new(Store::in_memory().unwrap());
        let rules = Arc::new(HashMap::new());
        record::testing::check_sink(|| {
            IndexSink::new(Arc::clone(&store), Arc::clone(&rules), true, 64)
        })
        .await;
    }
}
