//! A version's model card: `MODEL_CARD.md` in the version folder, imported with it (from
//! `model import --card FILE`, or a `MODEL_CARD.md` or a Hugging Face `README.md` in the source
//! folder) and covered by its `DIGESTS` like every other file.
//!
//! The card is Markdown, as Hugging Face and Mitchell et al.'s "Model Cards for Model Reporting"
//! (2019) write them. What the maturity report reads from it are four parts, found by their
//! headings (any level, case-insensitive) or, for the licence, the YAML front matter's
//! `license:`:
//!
//! | part | headings that hold it |
//! |---|---|
//! | intended use | "Intended use", "Uses", "Direct use" |
//! | limits | "Limitations", "Limits", "Out-of-scope use", "Bias, risks and limitations" |
//! | evaluation data | "Evaluation", "Evaluation data", "Testing data" |
//! | licence | "Licence", "License", or `license:` in the front matter |
//!
//! A part whose text is empty or only the Hugging Face template's "[More Information Needed]"
//! is missing: a card copied from the template says nothing.

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::RepoError;

/// File name of the card in a version folder.
pub const CARD_FILE: &str = "MODEL_CARD.md";
/// A Hugging Face checkpoint's card, read when there is no `MODEL_CARD.md`.
pub const HF_CARD_FILE: &str = "README.md";

/// The largest card read (a card is prose, not data).
const MAX_CARD_BYTES: u64 = 1 << 20;

/// What a card says, part by part (the text of each part, trimmed; `None` when missing).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ModelCard {
    /// The file it was read from, relative to the version folder.
    pub file: String,
    pub intended_use: Option<String>,
    pub limits: Option<String>,
    pub evaluation_data: Option<String>,
    pub licence: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    IntendedUse,
    Limits,
    Evaluation,
    Licence,
}

fn part_of(heading: &str) -> Option<Part> {
    let h = heading.to_lowercase();
    let h = h.trim();
    if h.contains("licen") {
        Some(Part::Licence)
    } else if h.contains("limitation")
        || h == "limits"
        || h.contains("out-of-scope")
        || h.contains("out of scope")
    {
        Some(Part::Limits)
    } else if h.contains("intended use") || h == "uses" || h == "direct use" {
        Some(Part::IntendedUse)
    } else if h.starts_with("evaluation") || h.contains("testing data") {
        Some(Part::Evaluation)
    } else {
        None
    }
}

/// Text that says nothing: empty, or the template's placeholder.
fn says_something(text: &str) -> Option<String> {
    let t = text.trim();
    let stripped = t
        .replace("[More Information Needed]", "")
        .replace("More Information Needed", "");
    (!stripped.trim().is_empty()).then(|| t.to_string())
}

impl ModelCard {
    /// Reads the card of a version folder, if it has one.
    pub fn read(version_dir: &Path) -> Result<Option<Self>, RepoError> {
        for file in [CARD_FILE, HF_CARD_FILE] {
            let path = version_dir.join(file);
            if path.is_file() {
                return Self::read_file(&path, file).map(Some);
            }
        }
        Ok(None)
    }

    /// Reads a card file (refused over 1 MiB or when it is not UTF-8).
    pub fn read_file(path: &Path, name: &str) -> Result<Self, RepoError> {
        let bad = |reason: String| RepoError::BadManifest {
            path: PathBuf::from(path),
            reason,
        };
        let len = std::fs::metadata(path).map_err(RepoError::io(path))?.len();
        if len > MAX_CARD_BYTES {
            return Err(bad(format!(
                "a model card of {len} bytes; at most {MAX_CARD_BYTES}"
            )));
        }
        let bytes = std::fs::read(path).map_err(RepoError::io(path))?;
        let text = String::from_utf8(bytes).map_err(|_| bad("not UTF-8 text".into()))?;
        Ok(Self::parse(&text, name))
    }

    /// Parses a card's Markdown.
    pub fn parse(text: &str, file: &str) -> Self {
        let mut card = ModelCard {
            file: file.to_string(),
            ..Self::default()
        };
        let mut body = text;
        // YAML front matter: only `license:` is read.
        if let Some(rest) = text.strip_prefix("---\n") {
            if let Some(end) = rest.find("\n---") {
                for line in rest[..end].lines() {
                    if let Some(v) = line.strip_prefix("license:") {
                        let v = v.trim().trim_matches(['"', '\'']);
                        if !v.is_empty() {
                            card.licence = Some(v.to_string());
                        }
                    }
                }
                body = rest[end + 4..].trim_start_matches(['-', '\n']);
            }
        }
        let mut current: Option<Part> = None;
        let mut text_of: Vec<(Part, String)> = Vec::new();
        let mut in_code = false;
        for line in body.lines() {
            if line.trim_start().starts_with("```") {
                in_code = !in_code;
            }
            let heading = (!in_code)
                .then(|| line.strip_prefix('#'))
                .flatten()
                .map(|h| h.trim_start_matches('#'))
                .filter(|h| h.starts_with(' '));
            if let Some(h) = heading {
                current = part_of(h);
                if let Some(p) = current {
                    text_of.push((p, String::new()));
                }
                continue;
            }
            if let (Some(p), Some(last)) = (current, text_of.last_mut()) {
                if last.0 == p {
                    last.1.push_str(line);
                    last.1.push('\n');
                }
            }
        }
        for (part, text) in text_of {
            let Some(said) = says_something(&text) else {
                continue;
            };
            let slot = match part {
                Part::IntendedUse => &mut card.intended_use,
                Part::Limits => &mut card.limits,
                Part::Evaluation => &mut card.evaluation_data,
                Part::Licence => &mut card.licence,
            };
            match slot {
                Some(existing) if part != Part::Licence => {
                    existing.push_str("\n\n");
                    existing.push_str(&said);
                }
                Some(_) => {}
                None => *slot = Some(said),
            }
        }
        card
    }

    /// The parts the card lacks, by name.
    pub fn missing(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.intended_use.is_none() {
            out.push("intended use");
        }
        if self.limits.is_none() {
            out.push("limits");
        }
        if self.evaluation_data.is_none() {
            out.push("evaluation data");
        }
        if self.licence.is_none() {
            out.push("licence");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_card_has_every_part() {
        let card = ModelCard::parse(
            "# Support triage 1.1\n\n## Intended use\nRoutes support tickets.\n\n## Limitations\nEnglish only.\n\n## Evaluation data\nTickets of 2026-Q3, 1,200 cases.\n\n## Licence\nApache-2.0\n",
            CARD_FILE,
        );
        assert!(card.missing().is_empty(), "{card:?}");
        assert_eq!(card.limits.as_deref(), Some("English only."));
        assert_eq!(card.licence.as_deref(), Some("Apache-2.0"));
    }

    #[test]
    fn a_hugging_face_card_reads_its_front_matter_and_skips_the_template_placeholders() {
        let card = ModelCard::parse(
            "---\nlicense: apache-2.0\nlanguage:\n- en\n---\n\n# Model Card\n\n## Uses\n\n### Direct Use\n\n[More Information Needed]\n\n## Bias, Risks, and Limitations\n\nIt makes things up.\n```\n# not a heading\n```\n\n## Evaluation\n\n[More Information Needed]\n",
            HF_CARD_FILE,
        );
        assert_eq!(card.licence.as_deref(), Some("apache-2.0"));
        assert_eq!(
            card.limits.as_deref(),
            Some("It makes things up.\n```\n# not a heading\n```")
        );
        assert_eq!(card.missing(), vec!["intended use", "evaluation data"]);
    }

    #[test]
    fn no_card_reads_as_none_and_a_huge_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(ModelCard::read(dir.path()).unwrap(), None);
        std::fs::write(
            dir.path().join(CARD_FILE),
            vec![b'a'; MAX_CARD_BYTES as usize + 1],
        )
        .unwrap();
        assert!(ModelCard::read(dir.path()).is_err());
    }
}
