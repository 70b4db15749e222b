//! SentencePiece-style BPE as GGUF stores it for Llama 2, Mistral and their kin
//! (`tokenizer.ggml.model = llama`): a vocabulary with a score per piece, no merge list.
//!
//! Encoding: spaces become `▁` (and one is prepended when the model asks for it), the text is
//! split into characters, and the adjacent pair whose concatenation is the highest-scoring piece
//! of the vocabulary is merged until no pair forms a piece. Characters that are not pieces fall
//! back to their UTF-8 bytes as `<0xXX>` tokens. Control-token texts in the input become their ids
//! (in [`SentencePiece::encode`], the path for rendered templates); user-defined tokens (Gemma's
//! runs of newlines, spaces and tabs) are matched whole in any text, as llama.cpp tokenizes.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The word-boundary marker of SentencePiece vocabularies.
pub const SPACE: char = '\u{2581}';

/// A SentencePiece vocabulary.
#[derive(Debug, Clone)]
pub struct SentencePiece {
    pieces: HashMap<String, u32>,
    scores: Vec<f32>,
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
    /// Control and user-defined tokens, matched whole (leftmost, longest) by [`Self::encode`].
    specials: Matcher,
    /// User-defined tokens only, matched whole by [`Self::encode_plain_text`] too.
    user_defined: Matcher,
    add_space_prefix: bool,
}

/// Token texts matched whole in input, leftmost and longest first.
#[derive(Debug, Clone, Default)]
struct Matcher {
    automaton: Option<aho_corasick::AhoCorasick>,
    /// The token of each pattern, in pattern order.
    ids: Vec<u32>,
}

impl Matcher {
    fn new(tokens: Vec<(String, u32)>) -> Self {
        let automaton = if tokens.is_empty() {
            None
        } else {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(tokens.iter().map(|t| t.0.as_str()))
                .ok()
        };
        Self {
            automaton,
            ids: tokens.into_iter().map(|t| t.1).collect(),
        }
    }

    /// The first match in `text`: (start, end, token).
    fn find(&self, text: &str) -> Option<(usize, usize, u32)> {
        let m = self.automaton.as_ref()?.find(text)?;
        Some((m.start(), m.end(), self.ids[m.pattern().as_usize()]))
    }
}

#[derive(Debug, PartialEq)]
struct Candidate {
    score: f32,
    left: usize,
    /// Byte length of the merged text when the candidate was made (stale if it changed).
    len: usize,
}

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Highest score first; on ties the leftmost pair.
        self.score
            .total_cmp(&other.score)
            .then(other.left.cmp(&self.left))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Parses a byte-fallback piece `<0xAB>`.
pub fn byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl SentencePiece {
    /// `tokens` by id with their `scores`; `control[i]` and `user_defined[i]` mark the tokens
    /// matched whole rather than merged.
    pub fn new(
        tokens: &[String],
        scores: Vec<f32>,
        control: &[bool],
        user_defined: &[bool],
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Self {
        let mut pieces = HashMap::with_capacity(tokens.len());
        let mut byte_tokens = [None; 256];
        let (mut specials, mut users) = (Vec::new(), Vec::new());
        for (id, t) in tokens.iter().enumerate() {
            let id = id as u32;
            if let Some(b) = byte_piece(t) {
                byte_tokens[b as usize] = Some(id);
            }
            let is = |marks: &[bool]| marks.get(id as usize).copied().unwrap_or(false);
            if is(user_defined) {
                if !t.is_empty() {
                    specials.push((t.clone(), id));
                    users.push((t.clone(), id));
                }
            } else if is(control) {
                if !t.is_empty() {
                    specials.push((t.clone(), id));
                }
            } else {
                pieces.entry(t.clone()).or_insert(id);
            }
        }
        Self {
            pieces,
            scores,
            byte_tokens,
            unk,
            specials: Matcher::new(specials),
            user_defined: Matcher::new(users),
            add_space_prefix,
        }
    }

    /// Token ids of `text`, control-token texts in it included.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        self.encode_split(text, &self.specials, self.add_space_prefix, &mut out);
        out
    }

    /// Token ids of `text` with no control-token matching (their texts become ordinary pieces;
    /// user-defined tokens are still matched whole); the space prefix only when `space_prefix`
    /// and the vocabulary wants one.
    pub fn encode_plain_text(&self, text: &str, space_prefix: bool, out: &mut Vec<u32>) {
        self.encode_split(
            text,
            &self.user_defined,
            space_prefix && self.add_space_prefix,
            out,
        );
    }

    /// `text` split at the tokens `whole` matches (each becomes its id), the segments between
    /// them merged. The first segment gets the space prefix when `space_prefix`; every segment
    /// after a matched token gets it when the vocabulary wants one (as llama.cpp tokenizes).
    fn encode_split(&self, text: &str, whole: &Matcher, space_prefix: bool, out: &mut Vec<u32>) {
        let mut rest = text;
        let mut prefix = space_prefix;
        while !rest.is_empty() {
            let (plain, matched) = match whole.find(rest) {
                Some((start, end, id)) => (&rest[..start], Some((end, id))),
                None => (rest, None),
            };
            if !plain.is_empty() {
                self.encode_plain(plain, prefix, out);
            }
            match matched {
                Some((end, id)) => {
                    out.push(id);
                    rest = &rest[end..];
                    prefix = self.add_space_prefix;
                }
                None => break,
            }
        }
    }

    fn encode_plain(&self, text: &str, space_prefix: bool, out: &mut Vec<u32>) {
        let mut normalized = String::with_capacity(text.len() + 3);
        if space_prefix {
            normalized.push(SPACE);
        }
        normalized.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
        let s = normalized.as_str();
        let mut symbols: Vec<Symbol> = s
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            })
            .collect();
        let n = symbols.len();
        for (i, symbol) in symbols.iter_mut().enumerate() {
            symbol.next = (i + 1 < n).then_some(i + 1);
        }
        let mut heap = BinaryHeap::new();
        let candidate = |symbols: &[Symbol], left: usize| -> Option<Candidate> {
            let right = symbols[left].next?;
            let (a, b) = (symbols[left], symbols[right]);
            let text = &s[a.start..b.start + b.len];
            let id = *self.pieces.get(text)?;
            Some(Candidate {
                score: self.scores.get(id as usize).copied().unwrap_or(0.0),
                left,
                len: text.len(),
            })
        };
        for i in 0..n {
            if let Some(c) = candidate(&symbols, i) {
                heap.push(c);
            }
        }
        while let Some(c) = heap.pop() {
            let left = symbols[c.left];
            let Some(right_index) = left.next else {
                continue;
            };
            let right = symbols[right_index];
            if left.len == 0 || right.len == 0 || left.len + right.len != c.len {
                continue; // stale: one side was merged since
            }
            symbols[c.left].len += right.len;
            symbols[c.left].next = right.next;
            symbols[right_index].len = 0;
            if let Some(after) = right.next {
                symbols[after].prev = Some(c.left);
            }
            if let Some(prev) = left.prev {
                if let Some(c) = candidate(&symbols, prev) {
                    heap.push(c);
                }
            }
            if let Some(c) = candidate(&symbols, c.left) {
                heap.push(c);
            }
        }
        let mut i = if n > 0 { Some(0) } else { None };
        while let Some(index) = i {
            let sym = symbols[index];
            let text = &s[sym.start..sym.start + sym.len];
            match self.pieces.get(text) {
                Some(&id) => out.push(id),
                None => {
                    for b in text.bytes() {
                        if let Some(id) = self.byte_tokens[b as usize].or(self.unk) {
                            out.push(id);
                        }
                    }
                }
            }
            i = sym.next;
        }
    }

    /// The bytes a piece stands for: `▁` is a space, `<0xAB>` one byte.
    pub fn piece_bytes(piece: &str) -> Vec<u8> {
        if let Some(b) = byte_piece(piece) {
            return vec![b];
        }
        piece.replace(SPACE, " ").into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> (Vec<String>, Vec<f32>, Vec<bool>) {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        let pieces = [
            "▁", "t", "h", "e", "c", "a", "▁t", "he", "▁the", "▁c", "at", "▁cat", "s", "▁cats",
        ];
        let mut scores = vec![0.0; tokens.len()];
        for (i, p) in pieces.iter().enumerate() {
            tokens.push(p.to_string());
            // Longer pieces score higher, as in real vocabularies.
            scores.push(p.chars().count() as f32 * 10.0 - i as f32 * 0.01);
        }
        let special = (0..tokens.len()).map(|i| (1..3).contains(&i)).collect();
        (tokens, scores, special)
    }

    fn id(tokens: &[String], piece: &str) -> u32 {
        tokens.iter().position(|t| t == piece).unwrap() as u32
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let (tokens, scores, special) = vocab();
        let spm = SentencePiece::new(&tokens, scores, &special, &[], Some(0), true);
        assert_eq!(
            spm.encode("the cat"),
            [id(&tokens, "▁the"), id(&tokens, "▁cat")]
        );
        assert_eq!(
            spm.encode("the cats"),
            [id(&tokens, "▁the"), id(&tokens, "▁cats")]
        );
        // 'é' is not a piece: its two UTF-8 bytes.
        assert_eq!(
            spm.encode("cé"),
            [
                id(&tokens, "▁c"),
                id(&tokens, "<0xC3>"),
                id(&tokens, "<0xA9>")
            ]
        );
        assert_eq!(
            spm.encode("</s>the"),
            [2, id(&tokens, "▁the")],
            "special tokens match whole"
        );
    }

    /// User-defined tokens (Gemma's newline runs) are matched whole in plain text as in
    /// templates; control tokens only in templates.
    #[test]
    fn user_defined_tokens_match_in_plain_text_control_tokens_do_not() {
        let (mut tokens, mut scores, mut control) = vocab();
        tokens.push("\n\n".into());
        scores.push(0.0);
        control.push(false);
        let newlines = tokens.len() as u32 - 1;
        let user: Vec<bool> = (0..tokens.len()).map(|i| i as u32 == newlines).collect();
        let spm = SentencePiece::new(&tokens, scores, &control, &user, Some(0), true);
        let the = id(&tokens, "▁the");
        let mut plain = Vec::new();
        spm.encode_plain_text("the\n\nthe", true, &mut plain);
        assert_eq!(
            plain,
            [the, newlines, the],
            "the space prefix follows the token"
        );
        assert_eq!(spm.encode("the\n\nthe"), [the, newlines, the]);
        let mut plain = Vec::new();
        spm.encode_plain_text("</s>", false, &mut plain);
        assert!(!plain.contains(&2), "{plain:?}");
        // One newline is no token of its own here: its byte.
        let mut plain = Vec::new();
        spm.encode_plain_text("\n", false, &mut plain);
        assert_eq!(plain, [id(&tokens, "<0x0A>")]);
    }

    #[test]
    fn piece_bytes_decode_spaces_and_bytes() {
        assert_eq!(SentencePiece::piece_bytes("▁the"), b" the");
        assert_eq!(SentencePiece::piece_bytes("<0x0A>"), b"\n");
        assert_eq!(byte_piece("<0xZZ>"), None);
    }
}
