//! Canned answers: the last step of a chain (level 2). A configured text, per language when the
//! request says one (`Accept-Language`), answered as a generation that finishes at once. The
//! response says what it is: the `x-rampart-fallback` header (`level=2; backend=canned:…`), the
//! record's `fallback_level` 2, and `rampart_canned_responses_total{model}`. A canned text is
//! sent as configured, not checked against a request's JSON schema: write it as JSON when your
//! clients ask for one.

use std::collections::BTreeMap;

use futures_util::stream::{self, StreamExt};
use record::RecordBuilder;

use super::{
    Answer, BackendError, Description, Generated, Generation, InferenceBackend, Kind, StartFuture,
    Token, Work, WorkKind,
};

/// The canned answers of one model's chain.
#[derive(Debug, Clone)]
pub struct CannedBackend {
    text: String,
    /// Lower-case language tag (`zh`, `zh-cn`) → text.
    languages: BTreeMap<String, String>,
}

impl CannedBackend {
    pub fn new(text: String, languages: BTreeMap<String, String>) -> Self {
        Self {
            text,
            languages: languages
                .into_iter()
                .map(|(k, v)| (k.to_ascii_lowercase(), v))
                .collect(),
        }
    }

    /// The text for an `Accept-Language` value: the first language (by preference) that has
    /// one, by full tag then by primary subtag; the default text otherwise.
    pub fn text_for(&self, accept_language: Option<&str>) -> &str {
        let Some(header) = accept_language else {
            return &self.text;
        };
        let mut wanted: Vec<(f32, String)> = header
            .split(',')
            .filter_map(|part| {
                let mut pieces = part.split(';');
                let tag = pieces.next()?.trim().to_ascii_lowercase();
                if tag.is_empty() || tag == "*" {
                    return None;
                }
                let q = pieces
                    .find_map(|p| p.trim().strip_prefix("q=").and_then(|q| q.parse().ok()))
                    .unwrap_or(1.0);
                Some((q, tag))
            })
            .collect();
        // Stable: equal preferences keep the client's order.
        wanted.sort_by(|a, b| b.0.total_cmp(&a.0));
        for (_, tag) in &wanted {
            if let Some(text) = self.languages.get(tag) {
                return text;
            }
            let primary = tag.split('-').next().unwrap_or(tag);
            if let Some(text) = self.languages.get(primary) {
                return text;
            }
        }
        &self.text
    }
}

impl InferenceBackend for CannedBackend {
    fn kind(&self) -> Kind {
        Kind::Canned
    }

    fn accepts(&self, work: WorkKind) -> bool {
        work == WorkKind::Generate
    }

    fn start<'a>(&'a self, work: Work, _record: &'a mut RecordBuilder) -> StartFuture<'a> {
        let result = match work {
            Work::Generate(plan) => {
                let text = self.text_for(plan.language.as_deref()).to_string();
                let choices = plan.prompts.len() * plan.n;
                let mut events = Vec::with_capacity(choices * 2);
                for index in 0..choices {
                    events.push((
                        index,
                        Generated::Token(Token {
                            text: text.clone(),
                            entropy: 0.0,
                            logprobs: None,
                            attention: Vec::new(),
                            id: 0,
                        }),
                    ));
                    events.push((index, Generated::Finished(super::finished_at_once(1))));
                }
                Ok(Answer::Generation(Generation {
                    events: stream::iter(events).boxed(),
                    choices,
                    prompt_tokens: 0,
                    structured: None,
                    watch: None,
                    tools: None,
                    explain: None,
                }))
            }
            other => Err(BackendError::invalid(format!(
                "a canned answer does not take {} work",
                other.kind().as_str()
            ))),
        };
        Box::pin(std::future::ready(result))
    }

    fn describe(&self) -> Description {
        Description {
            platform: "rampart_canned".into(),
            ..Description::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_preferred_language_with_a_text_answers() {
        let canned = CannedBackend::new(
            "Please try again shortly.".into(),
            BTreeMap::from([
                ("zh".to_string(), "请稍后再试。".to_string()),
                ("de-CH".to_string(), "Bitte später nochmals.".to_string()),
            ]),
        );
        assert_eq!(canned.text_for(None), "Please try again shortly.");
        assert_eq!(
            canned.text_for(Some("zh-CN,zh;q=0.9,en;q=0.8")),
            "请稍后再试。"
        );
        assert_eq!(canned.text_for(Some("de-ch")), "Bitte später nochmals.");
        assert_eq!(
            canned.text_for(Some("fr;q=0.9, en")),
            "Please try again shortly.",
            "no text for any wanted language: the default"
        );
        assert_eq!(canned.text_for(Some("en;q=0.5, zh;q=0.8")), "请稍后再试。");
        assert_eq!(canned.text_for(Some("*")), "Please try again shortly.");
    }
}
