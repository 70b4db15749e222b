//! The rules engine: a classifier written by people, for the moments the model cannot answer.
//!
//! A rules file declares labels; each label has weighted keywords and weighted regular
//! expressions. Classifying a text adds, per label, the weight of every keyword occurrence and of
//! every matching pattern; the label with the highest score wins if it reaches the threshold,
//! else the default label (if any) answers with confidence 0. Keywords match as substrings
//! (ASCII letters case-insensitively), so languages written without spaces between words work:
//! no word boundaries are assumed. Patterns are Rust regular expressions (write `(?i)` for
//! case-insensitive ones). Every answer carries its top three reasons: the keyword or pattern,
//! its weight, and the span of the input it matched.
//!
//! ```toml
//! threshold = 1.0            # a label needs at least this score
//! default = "service"        # answer when no label reaches it (optional)
//!
//! [labels.refund]
//! keywords = { "refund" = 2.0, "money back" = 2.0, "退款" = 2.0 }
//! patterns = [{ regex = "(?i)\\b(charge|charged) twice\\b", weight = 2.5 }]
//! ```

use std::collections::BTreeMap;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use regex::Regex;
use serde::{Deserialize, Serialize};

/// Why a rules file cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RulesError {
    #[error("rules file: {0}")]
    Parse(String),
    #[error("label {label:?}: pattern {pattern:?}: {message}")]
    Pattern {
        label: String,
        pattern: String,
        message: String,
    },
    #[error("label {label:?}: {message}")]
    Label { label: String, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// A rules file as written.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RulesFile {
    /// Minimum score for a label to win (default 1.0).
    #[serde(default = "default_threshold")]
    pub threshold: f64,
    /// The label that answers when none reaches the threshold; without it, no label answers.
    #[serde(default)]
    pub default: Option<String>,
    pub labels: BTreeMap<String, LabelRules>,
}

fn default_threshold() -> f64 {
    1.0
}

/// One label's evidence.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LabelRules {
    /// Keyword → weight; each occurrence in the text adds the weight.
    #[serde(default)]
    pub keywords: BTreeMap<String, f64>,
    /// Regular expressions; each one that matches adds its weight once.
    #[serde(default)]
    pub patterns: Vec<PatternRule>,
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PatternRule {
    pub regex: String,
    pub weight: f64,
}

/// One label's score on a text.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LabelScore {
    pub label: String,
    pub score: f64,
    /// The heaviest keyword or pattern that matched.
    pub strongest: Option<Reason>,
}

/// One piece of evidence behind an answer.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Reason {
    pub label: String,
    /// `keyword` or `pattern`.
    pub kind: &'static str,
    /// The keyword, or the pattern's regular expression.
    pub rule: String,
    pub weight: f64,
    /// The text of the input it matched, and where (byte offsets into the input).
    pub matched: String,
    pub start: usize,
    pub end: usize,
}

/// What the rules engine concluded.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Classification {
    /// The winning label, the default when none reached the threshold, or none.
    pub label: Option<String>,
    /// 0 when the default answered (or nothing did); else the winner's share of all evidence
    /// times how far its score is past the threshold (`1 - exp(-score / threshold)`).
    pub confidence: f64,
    /// The winner's score (the sum of its evidence).
    pub score: f64,
    /// Whether a label reached the threshold (false: the default or nothing answered).
    pub matched: bool,
    /// Up to three reasons, heaviest first, for the winning label (for the runners-up when the
    /// default answered).
    pub reasons: Vec<Reason>,
}

struct Keyword {
    label: usize,
    text: String,
    weight: f64,
}

struct Pattern {
    label: usize,
    regex: Regex,
    weight: f64,
}

/// A compiled rules file.
pub struct RulesEngine {
    labels: Vec<String>,
    threshold: f64,
    default: Option<String>,
    keywords: Vec<Keyword>,
    keyword_matcher: Option<AhoCorasick>,
    patterns: Vec<Pattern>,
}

impl std::fmt::Debug for RulesEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RulesEngine")
            .field("labels", &self.labels)
            .field("keywords", &self.keywords.len())
            .field("patterns", &self.patterns.len())
            .finish()
    }
}

/// Largest compiled size of one pattern (bytes): a rules file is configuration, not a way to
/// exhaust memory.
const MAX_PATTERN_BYTES: usize = 1 << 20;

/// Why a rules file would not load (see [`check_rules_file`]).
#[derive(Debug, thiserror::Error)]
pub enum RulesFileError {
    /// Not TOML of a rules file's shape.
    #[error(transparent)]
    Parse(#[from] toml::de::Error),
    /// Parsed, but its rules do not compile.
    #[error(transparent)]
    Rules(#[from] RulesError),
}

/// Checks a rules file's text as the server will load it (parsed and compiled) and returns
/// how many rules it holds (keywords and patterns): what the model repository asks at import.
pub fn check_rules_file(text: &str) -> Result<u64, RulesFileError> {
    let file: RulesFile = toml::from_str(text)?;
    RulesEngine::new(&file)?;
    Ok(file
        .labels
        .values()
        .map(|l| (l.keywords.len() + l.patterns.len()) as u64)
        .sum())
}

impl RulesEngine {
    /// Parses and compiles a rules file's text.
    pub fn from_toml(text: &str) -> Result<Self, RulesError> {
        let file: RulesFile = toml::from_str(text).map_err(|e| RulesError::Parse(e.to_string()))?;
        Self::new(&file)
    }

    pub fn new(file: &RulesFile) -> Result<Self, RulesError> {
        if !(file.threshold.is_finite() && file.threshold > 0.0) {
            return Err(RulesError::Invalid(format!(
                "threshold must be a positive number, got {}",
                file.threshold
            )));
        }
        if file.labels.is_empty() {
            return Err(RulesError::Invalid(
                "a rules file needs at least one label".into(),
            ));
        }
        let labels: Vec<String> = file.labels.keys().cloned().collect();
        if let Some(default) = &file.default {
            if !labels.contains(default) {
                return Err(RulesError::Invalid(format!(
                    "default {default:?} is not one of the labels ({})",
                    labels.join(", ")
                )));
            }
        }
        let mut keywords = Vec::new();
        let mut patterns = Vec::new();
        for (index, (label, rules)) in file.labels.iter().enumerate() {
            if rules.keywords.is_empty() && rules.patterns.is_empty() {
                return Err(RulesError::Label {
                    label: label.clone(),
                    message: "has neither keywords nor patterns".into(),
                });
            }
            for (text, &weight) in &rules.keywords {
                if text.trim().is_empty() {
                    return Err(RulesError::Label {
                        label: label.clone(),
                        message: "an empty keyword".into(),
                    });
                }
                check_weight(label, text, weight)?;
                keywords.push(Keyword {
                    label: index,
                    text: text.clone(),
                    weight,
                });
            }
            for p in &rules.patterns {
                check_weight(label, &p.regex, p.weight)?;
                let regex = regex::RegexBuilder::new(&p.regex)
                    .size_limit(MAX_PATTERN_BYTES)
                    .build()
                    .map_err(|e| RulesError::Pattern {
                        label: label.clone(),
                        pattern: p.regex.clone(),
                        message: e.to_string(),
                    })?;
                patterns.push(Pattern {
                    label: index,
                    regex,
                    weight: p.weight,
                });
            }
        }
        let keyword_matcher = if keywords.is_empty() {
            None
        } else {
            Some(
                AhoCorasickBuilder::new()
                    .ascii_case_insensitive(true)
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(keywords.iter().map(|k| k.text.as_str()))
                    .map_err(|e| RulesError::Invalid(format!("keywords: {e}")))?,
            )
        };
        Ok(Self {
            labels,
            threshold: file.threshold,
            default: file.default.clone(),
            keywords,
            keyword_matcher,
            patterns,
        })
    }

    /// The labels, in order.
    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// The threshold a label's score must reach.
    pub fn threshold(&self) -> f64 {
        self.threshold
    }

    /// Every label's score on `text` with its strongest evidence (labels in order; a label
    /// with no evidence scores 0).
    pub fn scores(&self, text: &str) -> Vec<LabelScore> {
        let mut out: Vec<LabelScore> = self
            .labels
            .iter()
            .map(|l| LabelScore {
                label: l.clone(),
                score: 0.0,
                strongest: None,
            })
            .collect();
        let mut consider = |label: usize,
                            weight: f64,
                            kind: &'static str,
                            rule: String,
                            start: usize,
                            end: usize| {
            let entry = &mut out[label];
            entry.score += weight;
            if entry.strongest.as_ref().is_none_or(|r| r.weight < weight) {
                entry.strongest = Some(Reason {
                    label: self.labels[label].clone(),
                    kind,
                    rule,
                    weight,
                    matched: text[start..end].to_string(),
                    start,
                    end,
                });
            }
        };
        if let Some(matcher) = &self.keyword_matcher {
            for m in matcher.find_iter(text) {
                let k = &self.keywords[m.pattern().as_usize()];
                consider(
                    k.label,
                    k.weight,
                    "keyword",
                    k.text.clone(),
                    m.start(),
                    m.end(),
                );
            }
        }
        {
            for p in &self.patterns {
                if let Some(m) = p.regex.find(text) {
                    consider(
                        p.label,
                        p.weight,
                        "pattern",
                        p.regex.as_str().to_string(),
                        m.start(),
                        m.end(),
                    );
                }
            }
        }
        out
    }

    /// Classifies one text.
    pub fn classify(&self, text: &str) -> Classification {
        let mut scores = vec![0.0f64; self.labels.len()];
        // (label, weight, kind, rule index, start, end)
        let mut evidence: Vec<(usize, f64, &'static str, usize, usize, usize)> = Vec::new();
        if let Some(matcher) = &self.keyword_matcher {
            for m in matcher.find_iter(text) {
                let k = &self.keywords[m.pattern().as_usize()];
                scores[k.label] += k.weight;
                evidence.push((
                    k.label,
                    k.weight,
                    "keyword",
                    m.pattern().as_usize(),
                    m.start(),
                    m.end(),
                ));
            }
        }
        // Each pattern on its own: its literal prefilter skips most texts, and its own small
        // lazy DFA stays in cache (one set of every pattern falls back to slower engines on
        // non-ASCII text: ten times slower on the guard's rules).
        for (i, p) in self.patterns.iter().enumerate() {
            if let Some(m) = p.regex.find(text) {
                scores[p.label] += p.weight;
                evidence.push((p.label, p.weight, "pattern", i, m.start(), m.end()));
            }
        }
        let total: f64 = scores.iter().sum();
        let best = scores
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1).then_with(|| b.0.cmp(&a.0)))
            .map(|(i, s)| (i, *s));
        let reasons_for = |label: Option<usize>| -> Vec<Reason> {
            let mut chosen: Vec<_> = evidence
                .iter()
                .filter(|e| label.is_none_or(|l| e.0 == l))
                .collect();
            chosen.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.4.cmp(&b.4)));
            chosen
                .into_iter()
                .take(3)
                .map(|&(l, weight, kind, rule, start, end)| Reason {
                    label: self.labels[l].clone(),
                    kind,
                    rule: match kind {
                        "keyword" => self.keywords[rule].text.clone(),
                        _ => self.patterns[rule].regex.as_str().to_string(),
                    },
                    weight,
                    matched: text[start..end].to_string(),
                    start,
                    end,
                })
                .collect()
        };
        match best {
            Some((label, score)) if score >= self.threshold => Classification {
                label: Some(self.labels[label].clone()),
                confidence: (score / total) * (1.0 - (-score / self.threshold).exp()),
                score,
                matched: true,
                reasons: reasons_for(Some(label)),
            },
            _ => Classification {
                label: self.default.clone(),
                confidence: 0.0,
                score: best.map_or(0.0, |b| b.1),
                matched: false,
                reasons: reasons_for(None),
            },
        }
    }
}

fn check_weight(label: &str, rule: &str, weight: f64) -> Result<(), RulesError> {
    if weight.is_finite() && weight > 0.0 {
        Ok(())
    } else {
        Err(RulesError::Label {
            label: label.to_string(),
            message: format!("{rule:?} has weight {weight}; weights are positive numbers"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: &str = r#"
threshold = 1.0
default = "service"

[labels.refund]
keywords = { "refund" = 2.0, "money back" = 2.0, "退款" = 2.0 }
patterns = [{ regex = "(?i)charged twice", weight = 2.5 }]

[labels.logistics]
keywords = { "delivery" = 1.0, "package" = 1.0, "快递" = 1.5, "物流" = 1.5 }

[labels.service]
keywords = { "rude" = 1.0 }
"#;

    #[test]
    fn the_heaviest_label_wins_with_reasons_taken_from_the_input() {
        let rules = RulesEngine::from_toml(RULES).unwrap();
        let text = "I was CHARGED TWICE for my package, I want a Refund now";
        let c = rules.classify(text);
        assert_eq!(c.label.as_deref(), Some("refund"));
        assert!(c.matched);
        assert_eq!(c.score, 4.5);
        assert!(c.confidence > 0.7 && c.confidence < 1.0, "{c:?}");
        assert_eq!(c.reasons.len(), 2);
        assert_eq!(c.reasons[0].kind, "pattern");
        assert_eq!(c.reasons[0].matched, "CHARGED TWICE");
        assert_eq!(c.reasons[1].matched, "Refund");
        for r in &c.reasons {
            assert_eq!(&text[r.start..r.end], r.matched);
        }
    }

    #[test]
    fn chinese_text_matches_without_word_boundaries() {
        let rules = RulesEngine::from_toml(RULES).unwrap();
        let c = rules.classify("我的快递三天了还没到，物流信息也不更新");
        assert_eq!(c.label.as_deref(), Some("logistics"));
        assert_eq!(c.score, 3.0);
        let matched: Vec<&str> = c.reasons.iter().map(|r| r.matched.as_str()).collect();
        assert_eq!(matched, ["快递", "物流"]);
        let c = rules.classify("请给我退款");
        assert_eq!(c.label.as_deref(), Some("refund"));
    }

    #[test]
    fn below_the_threshold_the_default_answers_with_no_confidence() {
        let rules = RulesEngine::from_toml(RULES).unwrap();
        let c = rules.classify("hello there");
        assert_eq!(
            (c.label.as_deref(), c.confidence, c.matched),
            (Some("service"), 0.0, false)
        );
        assert!(c.reasons.is_empty());
        let no_default =
            RulesEngine::from_toml(&RULES.replace("default = \"service\"", "")).unwrap();
        assert_eq!(no_default.classify("hello there").label, None);
    }

    #[test]
    fn bad_rules_files_are_refused_with_what_is_wrong() {
        let cases = [
            (
                "threshold = 0\n[labels.a]\nkeywords = { x = 1.0 }",
                "threshold",
            ),
            (
                "[labels.a]\nkeywords = { x = -1.0 }",
                "weights are positive",
            ),
            (
                "[labels.a]\npatterns = [{ regex = \"(\", weight = 1.0 }]",
                "pattern \"(\"",
            ),
            (
                "default = \"b\"\n[labels.a]\nkeywords = { x = 1.0 }",
                "default \"b\"",
            ),
            ("[labels.a]", "neither keywords nor patterns"),
            ("labels = {}", "at least one label"),
            ("[labels.a]\nkeyword = { x = 1.0 }", "unknown field"),
        ];
        for (text, want) in cases {
            let e = RulesEngine::from_toml(text).unwrap_err();
            assert!(e.to_string().contains(want), "{e} (wanted {want:?})");
        }
    }
}
