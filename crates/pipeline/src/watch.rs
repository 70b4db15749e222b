//! The output side of the guard: the canary planted in a request's system message (and the
//! message's opening), watched for in what the model answers; an output that repeats them is
//! flagged, or was cut at them. The guard service plants it ([`crate::guard_service`]); every
//! generation's finish watches it ([`crate::finish`]).

use record::RecordBuilder;

use serde::Deserialize;

/// The output side of one request: strings that must not come back.
#[derive(Debug, Clone)]
pub struct OutputWatch {
    pub mode: Canary,
    /// The canary and the system message's opening.
    pub markers: Vec<String>,
}

impl OutputWatch {
    /// Whether an output holds a marker.
    pub fn leaked<'a>(&self, outputs: impl IntoIterator<Item = &'a str>) -> bool {
        outputs
            .into_iter()
            .any(|o| self.markers.iter().any(|m| o.contains(m.as_str())))
    }
}

/// How much of the system message's opening counts as a verbatim leak.
pub(crate) const LEAK_PREFIX_CHARS: usize = 40;

/// Checks the outputs against the watch: `cut` when a marker's stop string ended an output,
/// `flag` when an output still holds one. Marks the record, counts and logs it.
pub fn watch_outputs<'a>(
    watch: &OutputWatch,
    record: &mut RecordBuilder,
    model: &str,
    outputs: impl IntoIterator<Item = &'a str>,
    stops: &[Option<&str>],
) {
    let cut = stops
        .iter()
        .flatten()
        .any(|s| watch.markers.iter().any(|m| m == s));
    let verdict = if cut {
        Some("cut")
    } else if watch.leaked(outputs) {
        Some("flag")
    } else {
        None
    };
    if let Some(v) = verdict {
        record.record.guard_output = Some(v);
        metrics::counter!("rampart_guard_output_total", "model" => model.to_string(), "verdict" => v)
            .increment(1);
        tracing::warn!(
            model,
            verdict = v,
            "the output repeats the system message's canary or opening"
        );
    }
}

/// The output side: a canary planted in the system message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Canary {
    #[default]
    Off,
    /// An output that holds the canary (or the system message's opening) is marked.
    Flag,
    /// The output ends before the canary (or the system message's opening).
    Cut,
}
