//! Tokenizer facts and tokenizer comparison.
//!
//! A new tokenizer silently invalidates cached prompts, stop sequences, logit biases and every
//! measurement made with the old one, so the repository reads the tokenizer of each version (from
//! GGUF metadata or from `tokenizer.json` + `tokenizer_config.json`) and `rampart model diff` reports
//! what changed: vocabulary, merges, special tokens, BOS/EOS rules, chat template.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use formats::gguf::Gguf;
use serde::Serialize;
use serde_json::Value as Json;
use sha2::{Digest, Sha256};

use crate::manifest::{SpecialToken, TokenizerSection};

/// Why a model's tokenizer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Gguf(#[from] formats::gguf::GgufError),
    #[error("{file}: {source}")]
    Read {
        file: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{file}: {source}")]
    Json {
        file: &'static str,
        #[source]
        source: serde_json::Error,
    },
    /// The tokenizer's data is not the shape it should have; says which part.
    #[error("{0}")]
    Malformed(String),
}

fn malformed(what: impl Into<String>) -> TokenizerError {
    TokenizerError::Malformed(what.into())
}

/// Everything we compare about a tokenizer.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenizerFacts {
    /// `gguf` or the tokenizer file name.
    pub source: String,
    pub kind: String,
    pub pre: Option<String>,
    /// Token text → id.
    pub vocab: HashMap<String, u32>,
    /// Number of ids (highest id + 1).
    pub vocab_size: u64,
    /// Merges in rank order, as `"left right"`.
    pub merges: Vec<String>,
    pub special: BTreeMap<String, SpecialToken>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub chat_template: Option<String>,
}

/// GGUF special-token keys (`tokenizer.ggml.<key>`) and the role names we report them under.
const GGUF_SPECIAL: &[(&str, &str)] = &[
    ("bos_token_id", "bos"),
    ("eos_token_id", "eos"),
    ("unknown_token_id", "unk"),
    ("padding_token_id", "pad"),
    ("separator_token_id", "sep"),
    ("cls_token_id", "cls"),
    ("mask_token_id", "mask"),
    ("eot_token_id", "eot"),
    ("eom_token_id", "eom"),
];

/// `tokenizer_config.json` keys and roles.
const HF_SPECIAL: &[(&str, &str)] = &[
    ("bos_token", "bos"),
    ("eos_token", "eos"),
    ("unk_token", "unk"),
    ("pad_token", "pad"),
    ("sep_token", "sep"),
    ("cls_token", "cls"),
    ("mask_token", "mask"),
];

impl TokenizerFacts {
    /// Reads the tokenizer embedded in GGUF metadata; `None` when the file carries none.
    pub fn from_gguf(g: &Gguf) -> Result<Option<Self>, TokenizerError> {
        let Some(kind) = g.get_str("tokenizer.ggml.model")? else {
            return Ok(None);
        };
        let tokens = match g.get_array("tokenizer.ggml.tokens")? {
            Some(a) => a
                .as_strings()
                .ok_or_else(|| malformed("tokenizer.ggml.tokens is not an array of strings"))?
                .to_vec(),
            None => Vec::new(),
        };
        let merges = match g.get_array("tokenizer.ggml.merges")? {
            Some(a) => a
                .as_strings()
                .ok_or_else(|| malformed("tokenizer.ggml.merges is not an array of strings"))?
                .to_vec(),
            None => Vec::new(),
        };
        let mut special = BTreeMap::new();
        for (key, role) in GGUF_SPECIAL {
            if let Some(id) = g.get_u64(&format!("tokenizer.ggml.{key}"))? {
                let text = tokens.get(id as usize).cloned().unwrap_or_default();
                let id = u32::try_from(id)
                    .map_err(|_| malformed(format!("{key} {id} is out of range")))?;
                special.insert(role.to_string(), SpecialToken { id, text });
            }
        }
        let vocab_size = tokens.len() as u64;
        let mut vocab = HashMap::with_capacity(tokens.len());
        for (id, token) in tokens.into_iter().enumerate() {
            // Duplicate token texts exist in some vocabularies; the first id wins, as in lookups.
            vocab.entry(token).or_insert(id as u32);
        }
        Ok(Some(Self {
            source: "gguf".into(),
            kind: kind.to_string(),
            pre: g.get_str("tokenizer.ggml.pre")?.map(str::to_string),
            vocab,
            vocab_size,
            merges,
            special,
            add_bos: g.get_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: g.get_bool("tokenizer.ggml.add_eos_token")?,
            chat_template: g.get_str("tokenizer.chat_template")?.map(str::to_string),
        }))
    }

    /// Reads a Hugging Face tokenizer folder: `tokenizer.json`, plus `tokenizer_config.json`,
    /// `special_tokens_map.json` and `chat_template.jinja` when present. `None` without
    /// `tokenizer.json`.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>, TokenizerError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Ok(None);
        }
        let read_json = |name: &'static str| -> Result<Option<Json>, TokenizerError> {
            let p = dir.join(name);
            if !p.is_file() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&p)
                .map_err(|source| TokenizerError::Read { file: name, source })?;
            serde_json::from_str(&text)
                .map(Some)
                .map_err(|source| TokenizerError::Json { file: name, source })
        };
        let tokenizer =
            read_json("tokenizer.json")?.ok_or_else(|| malformed("tokenizer.json vanished"))?;
        let config = read_json("tokenizer_config.json")?.unwrap_or(Json::Null);
        let special_map = read_json("special_tokens_map.json")?.unwrap_or(Json::Null);

        let model = tokenizer
            .get("model")
            .ok_or_else(|| malformed("tokenizer.json has no \"model\""))?;
        let kind = model
            .get("type")
            .and_then(Json::as_str)
            .map(str::to_ascii_lowercase)
            .or_else(|| {
                // Old files omit the type; the fields tell.
                if model.get("merges").is_some() {
                    Some("bpe".into())
                } else if model.get("continuing_subword_prefix").is_some() {
                    Some("wordpiece".into())
                } else {
                    None
                }
            })
            .ok_or_else(|| malformed("tokenizer.json model has no \"type\""))?;

        let mut vocab: HashMap<String, u32> = HashMap::new();
        match model.get("vocab") {
            Some(Json::Object(map)) => {
                for (token, id) in map {
                    let id = id
                        .as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .ok_or_else(|| malformed(format!("vocab entry {token:?} has id {id}")))?;
                    vocab.insert(token.clone(), id);
                }
            }
            // Unigram: a list of [token, score]; the id is the position.
            Some(Json::Array(list)) => {
                for (id, entry) in list.iter().enumerate() {
                    let token = entry.get(0).and_then(Json::as_str).ok_or_else(|| {
                        malformed(format!("vocab entry {id} is not [token, score]"))
                    })?;
                    vocab.entry(token.to_string()).or_insert(id as u32);
                }
            }
            _ => return Err(malformed("tokenizer.json model has no vocab")),
        }
        let mut added = Vec::new();
        if let Some(list) = tokenizer.get("added_tokens").and_then(Json::as_array) {
            for t in list {
                let (Some(content), Some(id)) = (
                    t.get("content").and_then(Json::as_str),
                    t.get("id").and_then(Json::as_u64),
                ) else {
                    return Err(malformed("added_tokens entry without content or id"));
                };
                let id = u32::try_from(id)
                    .map_err(|_| malformed(format!("added token {content:?} has id {id}")))?;
                vocab.insert(content.to_string(), id);
                added.push((content.to_string(), id));
            }
        }
        let merges = match model.get("merges") {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::Array(list)) => list
                .iter()
                .map(|m| match m {
                    Json::String(s) => Ok(s.clone()),
                    Json::Array(pair) if pair.len() == 2 => {
                        match (pair[0].as_str(), pair[1].as_str()) {
                            (Some(a), Some(b)) => Ok(format!("{a} {b}")),
                            _ => Err(malformed("merge pair is not two strings")),
                        }
                    }
                    _ => Err(malformed("merge is neither \"a b\" nor [a, b]")),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(malformed("tokenizer.json merges is not a list")),
        };

        let token_text = |v: &Json| -> Option<String> {
            match v {
                Json::String(s) => Some(s.clone()),
                Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
                _ => None,
            }
        };
        let mut special = BTreeMap::new();
        for (key, role) in HF_SPECIAL {
            let text = config
                .get(key)
                .and_then(token_text)
                .or_else(|| special_map.get(key).and_then(token_text));
            if let Some(text) = text {
                if let Some(&id) = vocab.get(&text) {
                    special.insert(role.to_string(), SpecialToken { id, text });
                }
            }
        }
        let vocab_size = vocab
            .values()
            .map(|&id| u64::from(id) + 1)
            .max()
            .unwrap_or(0);

        let chat_template = match config.get("chat_template") {
            Some(Json::String(s)) => Some(s.clone()),
            Some(Json::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                .or_else(|| named.first())
                .and_then(|t| t.get("template"))
                .and_then(Json::as_str)
                .map(str::to_string),
            _ => None,
        };
        let chat_template = match chat_template {
            Some(t) => Some(t),
            None => {
                let jinja = dir.join("chat_template.jinja");
                if jinja.is_file() {
                    Some(std::fs::read_to_string(&jinja).map_err(|source| {
                        TokenizerError::Read {
                            file: "chat_template.jinja",
                            source,
                        }
                    })?)
                } else {
                    None
                }
            }
        };
        let pre = tokenizer
            .get("pre_tokenizer")
            .and_then(|p| p.get("type"))
            .and_then(Json::as_str)
            .map(str::to_string);
        Ok(Some(Self {
            source: "tokenizer.json".into(),
            kind,
            pre,
            vocab,
            vocab_size,
            merges,
            special,
            add_bos: config.get("add_bos_token").and_then(Json::as_bool),
            add_eos: config.get("add_eos_token").and_then(Json::as_bool),
            chat_template,
        }))
    }

    /// The summary stored in the manifest.
    pub fn section(&self) -> TokenizerSection {
        TokenizerSection {
            source: self.source.clone(),
            kind: self.kind.clone(),
            pre: self.pre.clone(),
            vocab_size: self.vocab_size,
            merges: self.merges.len() as u64,
            add_bos: self.add_bos,
            add_eos: self.add_eos,
            chat_template: self.chat_template.is_some(),
            chat_template_sha256: self
                .chat_template
                .as_ref()
                .map(|t| hex::encode(Sha256::digest(t.as_bytes()))),
            special: self.special.clone(),
        }
    }
}

/// A special token that differs between two versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SpecialChange {
    pub role: String,
    pub before: Option<SpecialToken>,
    pub after: Option<SpecialToken>,
}

/// How far two tokenizers differ.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenizerDiff {
    pub kind: (String, String),
    pub pre: (Option<String>, Option<String>),
    pub vocab_size: (u64, u64),
    /// Token texts only in the new vocabulary.
    pub tokens_added: usize,
    /// Token texts only in the old vocabulary.
    pub tokens_removed: usize,
    /// Token texts in both, under different ids.
    pub tokens_renumbered: usize,
    /// A few examples of each, for people.
    pub examples_added: Vec<String>,
    pub examples_removed: Vec<String>,
    pub examples_renumbered: Vec<String>,
    /// Share of all token texts (old ∪ new) added, removed or renumbered, in percent.
    pub vocab_changed_pct: f64,
    pub merges: (usize, usize),
    pub merges_added: usize,
    pub merges_removed: usize,
    /// Merges in both whose relative rank order changed (the fewest moves that restore the order).
    pub merges_reordered: usize,
    /// Share of all merges (old ∪ new) added, removed or reordered, in percent.
    pub merges_changed_pct: f64,
    pub special_changes: Vec<SpecialChange>,
    pub add_bos: (Option<bool>, Option<bool>),
    pub add_eos: (Option<bool>, Option<bool>),
    pub chat_template_changed: bool,
}

const EXAMPLES: usize = 8;

fn pct(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// Length of the longest strictly increasing subsequence (patience sorting, O(n log n)).
fn longest_increasing(seq: &[usize]) -> usize {
    let mut tails: Vec<usize> = Vec::new();
    for &x in seq {
        match tails.binary_search(&x) {
            Ok(_) => {}
            Err(i) if i == tails.len() => tails.push(x),
            Err(i) => tails[i] = x,
        }
    }
    tails.len()
}

impl TokenizerDiff {
    pub fn between(old: &TokenizerFacts, new: &TokenizerFacts) -> Self {
        let mut added = Vec::new();
        let mut renumbered = Vec::new();
        for (token, &id) in &new.vocab {
            match old.vocab.get(token) {
                None => added.push(token.clone()),
                Some(&old_id) if old_id != id => renumbered.push(token.clone()),
                Some(_) => {}
            }
        }
        let mut removed: Vec<String> = old
            .vocab
            .keys()
            .filter(|t| !new.vocab.contains_key(*t))
            .cloned()
            .collect();
        let union = old.vocab.len() + added.len();
        added.sort_by_key(|t| new.vocab[t]);
        removed.sort_by_key(|t| old.vocab[t]);
        renumbered.sort_by_key(|t| new.vocab[t]);

        let old_rank: HashMap<&str, usize> = old
            .merges
            .iter()
            .enumerate()
            .map(|(i, m)| (m.as_str(), i))
            .collect();
        let new_set: HashSet<&str> = new.merges.iter().map(String::as_str).collect();
        let merges_added = new
            .merges
            .iter()
            .filter(|m| !old_rank.contains_key(m.as_str()))
            .count();
        let merges_removed = old
            .merges
            .iter()
            .filter(|m| !new_set.contains(m.as_str()))
            .count();
        let common_in_new_order: Vec<usize> = new
            .merges
            .iter()
            .filter_map(|m| old_rank.get(m.as_str()).copied())
            .collect();
        let merges_reordered = common_in_new_order.len() - longest_increasing(&common_in_new_order);
        let merges_union = old.merges.len() + merges_added;

        let roles: std::collections::BTreeSet<&String> =
            old.special.keys().chain(new.special.keys()).collect();
        let special_changes = roles
            .into_iter()
            .filter_map(|role| {
                let before = old.special.get(role).cloned();
                let after = new.special.get(role).cloned();
                (before != after).then(|| SpecialChange {
                    role: role.clone(),
                    before,
                    after,
                })
            })
            .collect();

        let take = |v: &[String]| v.iter().take(EXAMPLES).cloned().collect();
        Self {
            kind: (old.kind.clone(), new.kind.clone()),
            pre: (old.pre.clone(), new.pre.clone()),
            vocab_size: (old.vocab_size, new.vocab_size),
            tokens_added: added.len(),
            tokens_removed: removed.len(),
            tokens_renumbered: renumbered.len(),
            examples_added: take(&added),
            examples_removed: take(&removed),
            examples_renumbered: take(&renumbered),
            vocab_changed_pct: pct(added.len() + removed.len() + renumbered.len(), union),
            merges: (old.merges.len(), new.merges.len()),
            merges_added,
            merges_removed,
            merges_reordered,
            merges_changed_pct: pct(
                merges_added + merges_removed + merges_reordered,
                merges_union,
            ),
            special_changes,
            add_bos: (old.add_bos, new.add_bos),
            add_eos: (old.add_eos, new.add_eos),
            chat_template_changed: old.chat_template != new.chat_template,
        }
    }

    /// True when nothing about the tokenizer differs.
    pub fn is_unchanged(&self) -> bool {
        self.kind.0 == self.kind.1
            && self.pre.0 == self.pre.1
            && self.vocab_size.0 == self.vocab_size.1
            && self.tokens_added + self.tokens_removed + self.tokens_renumbered == 0
            && self.merges_added + self.merges_removed + self.merges_reordered == 0
            && self.special_changes.is_empty()
            && self.add_bos.0 == self.add_bos.1
            && self.add_eos.0 == self.add_eos.1
            && !self.chat_template_changed
    }

    /// Reasons this change should stop a release: a different tokenizer model or pre-tokenizer,
    /// any special-token or BOS/EOS-rule change, or more than `threshold_pct` percent of merges
    /// (or of vocabulary entries) changed. Empty when the change is within bounds.
    pub fn blocking_reasons(&self, threshold_pct: f64) -> Vec<String> {
        let mut reasons = Vec::new();
        if self.kind.0 != self.kind.1 {
            reasons.push(format!(
                "tokenizer model changed: {} → {}",
                self.kind.0, self.kind.1
            ));
        }
        if self.pre.0 != self.pre.1 {
            reasons.push(format!(
                "pre-tokenizer changed: {:?} → {:?}",
                self.pre.0, self.pre.1
            ));
        }
        for c in &self.special_changes {
            reasons.push(format!("special token {} changed", c.role));
        }
        if self.add_bos.0 != self.add_bos.1 {
            reasons.push("add_bos rule changed".into());
        }
        if self.add_eos.0 != self.add_eos.1 {
            reasons.push("add_eos rule changed".into());
        }
        if self.merges_changed_pct > threshold_pct {
            reasons.push(format!(
                "{:.2}% of merges changed (threshold {threshold_pct}%)",
                self.merges_changed_pct
            ));
        }
        if self.vocab_changed_pct > threshold_pct {
            reasons.push(format!(
                "{:.2}% of vocabulary entries changed (threshold {threshold_pct}%)",
                self.vocab_changed_pct
            ));
        }
        reasons
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(tokens: &[&str], merges: &[&str]) -> TokenizerFacts {
        TokenizerFacts {
            source: "gguf".into(),
            kind: "gpt2".into(),
            vocab: tokens
                .iter()
                .enumerate()
                .map(|(i, t)| (t.to_string(), i as u32))
                .collect(),
            vocab_size: tokens.len() as u64,
            merges: merges.iter().map(|m| m.to_string()).collect(),
            special: BTreeMap::from([(
                "eos".to_string(),
                SpecialToken {
                    id: 0,
                    text: tokens[0].to_string(),
                },
            )]),
            ..TokenizerFacts::default()
        }
    }

    #[test]
    fn identical_tokenizers_do_not_differ() {
        let a = facts(&["<eos>", "a", "b", "ab"], &["a b"]);
        let d = TokenizerDiff::between(&a, &a);
        assert!(d.is_unchanged());
        assert!(d.blocking_reasons(5.0).is_empty());
    }

    #[test]
    fn counts_added_removed_and_renumbered_tokens() {
        let a = facts(&["<eos>", "a", "b", "ab"], &[]);
        let b = facts(&["<eos>", "b", "a", "c"], &[]);
        let d = TokenizerDiff::between(&a, &b);
        assert_eq!(
            (d.tokens_added, d.tokens_removed, d.tokens_renumbered),
            (1, 1, 2)
        );
        assert_eq!(d.examples_added, ["c"]);
        assert_eq!(d.examples_removed, ["ab"]);
        // 4 of the 5 texts in the union changed.
        assert!((d.vocab_changed_pct - 80.0).abs() < 1e-9);
    }

    #[test]
    fn merge_reordering_counts_minimal_moves() {
        let old: Vec<String> = (0..100).map(|i| format!("m{i} x")).collect();
        let mut new = old.clone();
        let moved = new.remove(10);
        new.insert(90, moved);
        let a = TokenizerFacts {
            merges: old,
            ..facts(&["e"], &[])
        };
        let b = TokenizerFacts {
            merges: new,
            ..facts(&["e"], &[])
        };
        let d = TokenizerDiff::between(&a, &b);
        assert_eq!(
            (d.merges_added, d.merges_removed, d.merges_reordered),
            (0, 0, 1)
        );
        assert!((d.merges_changed_pct - 1.0).abs() < 1e-9);
        assert!(
            d.blocking_reasons(5.0).is_empty(),
            "1% is under the 5% default"
        );
        assert_eq!(d.blocking_reasons(0.5).len(), 1);
    }

    #[test]
    fn special_token_change_blocks() {
        let a = facts(&["<eos>", "a"], &[]);
        let mut b = a.clone();
        b.special.insert(
            "eos".into(),
            SpecialToken {
                id: 1,
                text: "a".into(),
            },
        );
        let d = TokenizerDiff::between(&a, &b);
        assert_eq!(d.special_changes.len(), 1);
        assert_eq!(d.blocking_reasons(5.0), ["special token eos changed"]);
    }

    #[test]
    fn longest_increasing_subsequence() {
        assert_eq!(longest_increasing(&[]), 0);
        assert_eq!(longest_increasing(&[3, 1, 2, 5, 4]), 3);
        assert_eq!(longest_increasing(&[5, 4, 3]), 1);
    }

    #[test]
    fn reads_hf_tokenizer_folder() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer.json"),
            r#"{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":[["a","b"]]},
               "added_tokens":[{"id":3,"content":"<|end|>","special":true}],
               "pre_tokenizer":{"type":"ByteLevel"}}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token":{"content":"<|end|>"},"add_bos_token":false,"chat_template":"{{ messages }}"}"#,
        )
        .unwrap();
        let t = TokenizerFacts::from_folder(dir.path()).unwrap().unwrap();
        assert_eq!(t.kind, "bpe");
        assert_eq!(t.vocab_size, 4);
        assert_eq!(t.merges, ["a b"]);
        assert_eq!(
            t.special["eos"],
            SpecialToken {
                id: 3,
                text: "<|end|>".into()
            }
        );
        assert_eq!(t.add_bos, Some(false));
        assert_eq!(t.pre.as_deref(), Some("ByteLevel"));
        let section = t.section();
        assert!(section.chat_template);
        assert_eq!(section.merges, 1);
    }
}
