//! The end of a generation, the same for every protocol.

use engine::{FinishReason, Finished};
use record::RecordBuilder;

/// Fills the record's timings from the engine's account of each choice.
pub fn record_finished(record: &mut RecordBuilder, finished: &[Finished]) {
    let r = &mut record.record;
    r.completion_tokens = finished.iter().map(|f| f.completion_tokens).sum();
    r.cached_prompt_tokens = finished
        .iter()
        .map(|f| f.cached_prompt_tokens)
        .max()
        .unwrap_or(0);
    r.prefill_ms = finished
        .iter()
        .map(|f| f.prefill_seconds * 1e3)
        .fold(0.0, f64::max);
    r.decode_ms = finished
        .iter()
        .map(|f| f.decode_seconds * 1e3)
        .fold(0.0, f64::max);
    let length = finished.iter().any(|f| f.reason == FinishReason::Length);
    r.finish_reason = Some(if length { "length" } else { "stop" }.into());
}
