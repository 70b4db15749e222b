//! Tokenizers built from GGUF metadata: byte-level BPE (`tokenizer.ggml.model = gpt2`) with the
//! pre-tokenizer variant named by `tokenizer.ggml.pre`, SentencePiece vocabularies
//! (`tokenizer.ggml.model = llama`), special tokens, BOS/EOS rules, and an incremental
//! detokenizer that never emits broken UTF-8 while streaming. Hugging Face folders bring their
//! own `tokenizer.json` ([`Tokenizer::from_hf_folder`]), with the same rules for special and stop
//! tokens.
//!
//! Byte-level BPE encoding runs on the `tokenizers` crate, SentencePiece on ours
//! ([`crate::sentencepiece`]) for GGUF files and on the `tokenizers` crate for `tokenizer.json`;
//! decoding is ours for all (a byte table per token), because streaming needs bytes, not strings.

use std::path::Path;

use formats::byte_level::char_to_byte;
use formats::gguf::Gguf;
use serde_json::Value as Json;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::chat::{ChatMessage, ChatTemplate};
use crate::error::EngineError;
use crate::sentencepiece::SentencePiece;

/// GGUF token types (`tokenizer.ggml.token_type`).
const TOKEN_CONTROL: i64 = 3;
const TOKEN_USER_DEFINED: i64 = 4;

const LLAMA3_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_PATTERN: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Texts of end-of-turn tokens that stop generation when a vocabulary has them as special
/// tokens (chat models end their reply with them rather than with EOS).
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_turn|>",
];

/// The encoding algorithm of a vocabulary.
enum Encoder {
    /// A `tokenizers` pipeline: byte-level BPE built from GGUF metadata, or a whole
    /// `tokenizer.json`; `plain` is the same pipeline with special-token matching off.
    Tokenizers {
        normal: Box<tokenizers::Tokenizer>,
        plain: Box<tokenizers::Tokenizer>,
    },
    SentencePiece(Box<SentencePiece>),
}

impl Encoder {
    fn tokenizers(normal: tokenizers::Tokenizer) -> Self {
        let mut plain = normal.clone();
        plain.set_encode_special_tokens(true);
        Self::Tokenizers {
            normal: Box::new(normal),
            plain: Box::new(plain),
        }
    }
}

/// The first of the Supplementary Private Use Area-A code points that stand in for protected
/// strings while a chat template renders ([`Tokenizer::protect`]).
const PLACEHOLDER_BASE: u32 = 0xF0000;
/// How many placeholders one conversation may use (U+F0000 to U+FFFFD).
const PLACEHOLDERS: usize = 0xFFFFE - 0xF0000;

fn placeholder_index(c: char) -> Option<usize> {
    let v = c as u32;
    (PLACEHOLDER_BASE..PLACEHOLDER_BASE + PLACEHOLDERS as u32)
        .contains(&v)
        .then(|| (v - PLACEHOLDER_BASE) as usize)
}

/// Strings of messages' content that must reach the model as plain text, each replaced by one
/// placeholder character while the chat template renders ([`Tokenizer::protect`]).
#[derive(Debug, Default, Clone)]
pub struct Protected {
    strings: Vec<String>,
}

impl Protected {
    /// How many strings were protected.
    pub fn len(&self) -> usize {
        self.strings.len()
    }

    pub fn is_empty(&self) -> bool {
        self.strings.is_empty()
    }
}

/// A model's tokenizer.
pub struct Tokenizer {
    inner: Encoder,
    /// Bytes of each token (control and user-defined tokens: their text).
    token_bytes: Vec<Vec<u8>>,
    /// Control tokens (the special tokens): matched whole in templates, never made from text a
    /// client wrote, not shown in output by default.
    special: Vec<bool>,
    /// User-defined tokens (Gemma's runs of newlines, spaces and tabs, MPT's runs of spaces):
    /// ordinary text, matched whole in any input before the vocabulary's own pieces, shown in
    /// output, as llama.cpp and `tokenizers` (added tokens that are not special) treat them.
    user_defined: Vec<bool>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Tokens that end generation: EOS, EOT and EOM.
    pub stop_tokens: Vec<u32>,
    pub add_bos: bool,
    /// The chat template, if the model ships one.
    pub chat_template: Option<String>,
    /// Per byte value, a non-special token of exactly that byte (the last resort for text that
    /// must not become a special token).
    byte_token: Vec<Option<u32>>,
    /// Finds special-token texts in input (leftmost, longest).
    special_matcher: Option<aho_corasick::AhoCorasick>,
    /// The texts `special_matcher` finds, in its pattern order.
    special_texts: Vec<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.token_bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn bad(reason: impl Into<String>) -> EngineError {
    EngineError::Tokenizer(reason.into())
}

fn split(pattern: &str) -> Result<PreTokenizerWrapper, EngineError> {
    let split = Split::new(
        SplitPattern::Regex(pattern.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| bad(format!("pre-tokenizer pattern: {e}")))?;
    Ok(split.into())
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` value.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper, EngineError> {
    let byte_level = |regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, regex));
    Ok(match pre {
        // GPT-2's own regex, applied by the byte-level step.
        "default" | "gpt-2" | "gpt2" | "phi-2" | "roberta-bpe" | "olmo" | "mpt" | "jina-es"
        | "jina-de" | "jina-v2-es" | "jina-v2-de" | "jina-v1-en" | "jina-v2-code" => byte_level(true),
        // Digits (every Unicode number, `½` too) one by one, then GPT-2's regex.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]))
        }
        // Runs of punctuation and symbols apart, then GPT-2's regex, then digits in threes.
        "falcon" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            split(r"[\p{P}\$\+<=>\^~\|`]+")?,
            byte_level(true),
            split("[0-9][0-9][0-9]")?,
        ])),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" | "smaug-bpe" | "dbrx" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]))
        }
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]))
        }
        other => {
            return Err(bad(format!(
                "pre-tokenizer {other:?} is not supported (supported: gpt-2, smollm, starcoder, falcon, llama3/llama-bpe, qwen2 and their aliases)"
            )))
        }
    })
}

impl Tokenizer {
    /// Builds the tokenizer stored in a GGUF file's metadata.
    pub fn from_gguf(g: &Gguf) -> Result<Self, EngineError> {
        let meta = |e: formats::gguf::GgufError| bad(e.to_string());
        let model = g
            .get_str("tokenizer.ggml.model")
            .map_err(meta)?
            .ok_or_else(|| bad("the GGUF has no tokenizer (tokenizer.ggml.model)"))?;
        if model != "gpt2" && model != "llama" {
            return Err(bad(format!(
                "tokenizer model {model:?} is not supported (supported: gpt2 byte-level BPE, llama SentencePiece)"
            )));
        }
        let tokens = g
            .get_array("tokenizer.ggml.tokens")
            .map_err(meta)?
            .and_then(|a| a.as_strings())
            .ok_or_else(|| bad("tokenizer.ggml.tokens is missing or not strings"))?;
        let no_merges: &[String] = &[];
        let merges = match g.get_array("tokenizer.ggml.merges").map_err(meta)? {
            Some(a) => a
                .as_strings()
                .ok_or_else(|| bad("tokenizer.ggml.merges is not strings"))?,
            None if model == "llama" => no_merges,
            None => return Err(bad("tokenizer.ggml.merges is missing")),
        };
        let types = match g.get_array("tokenizer.ggml.token_type").map_err(meta)? {
            Some(a) => a
                .to_i64s()
                .ok_or_else(|| bad("tokenizer.ggml.token_type is not integers"))?,
            None => vec![1; tokens.len()],
        };
        let of_type = |kind: i64| -> Vec<bool> {
            (0..tokens.len())
                .map(|i| types.get(i) == Some(&kind))
                .collect()
        };
        let special = of_type(TOKEN_CONTROL);
        let user_defined = of_type(TOKEN_USER_DEFINED);
        let pre = g
            .get_str("tokenizer.ggml.pre")
            .map_err(meta)?
            .unwrap_or("default");
        let id = |key: &str| -> Result<Option<u32>, EngineError> {
            Ok(g.get_u64(key)
                .map_err(meta)?
                .and_then(|v| u32::try_from(v).ok())
                .filter(|&v| (v as usize) < tokens.len()))
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let mut stop_tokens: Vec<u32> = [
            eos,
            id("tokenizer.ggml.eot_token_id")?,
            id("tokenizer.ggml.eom_token_id")?,
        ]
        .into_iter()
        .flatten()
        .collect();
        stop_tokens.dedup();
        // End-of-turn control tokens end a reply too when the file names only EOS (Gemma's
        // `<end_of_turn>`), as llama.cpp treats them.
        for (i, t) in tokens.iter().enumerate() {
            if special[i] && END_OF_TURN_TEXTS.contains(&t.as_str()) {
                let id = i as u32;
                if !stop_tokens.contains(&id) {
                    stop_tokens.push(id);
                }
            }
        }
        // SentencePiece models add BOS unless told otherwise; byte-level BPE models do not.
        let add_bos = g
            .get_bool("tokenizer.ggml.add_bos_token")
            .map_err(meta)?
            .unwrap_or(model == "llama");
        let chat_template = g
            .get_str("tokenizer.chat_template")
            .map_err(meta)?
            .map(str::to_string);
        if model == "llama" {
            let scores = match g.get_array("tokenizer.ggml.scores").map_err(meta)? {
                Some(a) => a
                    .to_f32s()
                    .ok_or_else(|| bad("tokenizer.ggml.scores is not floats"))?,
                None => vec![0.0; tokens.len()],
            };
            let add_space_prefix = g
                .get_bool("tokenizer.ggml.add_space_prefix")
                .map_err(meta)?
                .unwrap_or(true);
            let unk = id("tokenizer.ggml.unknown_token_id")?;
            let literal = either(&special, &user_defined);
            let token_bytes = byte_table(tokens, &literal, SentencePiece::piece_bytes);
            return Ok(Self {
                inner: Encoder::SentencePiece(Box::new(SentencePiece::new(
                    tokens,
                    scores,
                    &special,
                    &user_defined,
                    unk,
                    add_space_prefix,
                ))),
                token_bytes,
                special,
                user_defined,
                bos,
                eos,
                stop_tokens,
                add_bos,
                chat_template,
                byte_token: Vec::new(),
                special_matcher: None,
                special_texts: Vec::new(),
            }
            .finish());
        }
        Self::byte_level_bpe(
            tokens,
            merges,
            special,
            user_defined,
            pre,
            bos,
            eos,
            stop_tokens,
            add_bos,
            chat_template,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn byte_level_bpe(
        tokens: &[String],
        merges: &[String],
        special: Vec<bool>,
        user_defined: Vec<bool>,
        pre: &str,
        bos: Option<u32>,
        eos: Option<u32>,
        stop_tokens: Vec<u32>,
        add_bos: bool,
        chat_template: Option<String>,
    ) -> Result<Self, EngineError> {
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merge_pairs = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| bad(format!("merge {m:?} is not two tokens")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        // Llama 3's tokenizer takes a pre-tokenized word that is itself a token whole, without
        // merging (`ignore_merges`), as llama.cpp does for its family.
        let ignore_merges = matches!(
            pre,
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral"
        );
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merge_pairs)
            .ignore_merges(ignore_merges)
            .build()
            .map_err(|e| bad(format!("building the BPE model: {e}")))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        inner.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
        let added = |marks: &[bool], special: bool| -> Vec<AddedToken> {
            tokens
                .iter()
                .zip(marks)
                .filter(|(_, &s)| s)
                .map(|(t, _)| AddedToken::from(t.clone(), special))
                .collect()
        };
        inner.add_special_tokens(&added(&special, true));
        // Not special: the plain pipeline (special-token matching off) still matches them.
        inner.add_tokens(&added(&user_defined, false));

        let table = char_to_byte();
        let token_bytes = byte_table(tokens, &either(&special, &user_defined), |t| {
            // Characters outside the byte alphabet (never in a well-formed vocabulary) decode as
            // their UTF-8.
            let mut out = Vec::with_capacity(t.len());
            for c in t.chars() {
                match table.get(&c) {
                    Some(&b) => out.push(b),
                    None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                }
            }
            out
        });
        Ok(Self {
            inner: Encoder::tokenizers(inner),
            token_bytes,
            special,
            user_defined,
            bos,
            eos,
            stop_tokens,
            add_bos,
            chat_template,
            byte_token: Vec::new(),
            special_matcher: None,
            special_texts: Vec::new(),
        }
        .finish())
    }

    /// Builds the tokenizer of a Hugging Face model folder: `tokenizer.json` (run by the
    /// `tokenizers` crate, padding and truncation off), `tokenizer_config.json` (BOS/EOS tokens,
    /// `add_bos_token`, the chat template), `special_tokens_map.json`, `generation_config.json`
    /// (`eos_token_id`, one or a list) and `chat_template.jinja`/`chat_template.json` when
    /// present. Added tokens are matched whole in input; those marked `special` are control
    /// tokens (hidden in output by default, never made from a client's text), the others
    /// user-defined (ordinary text), as the GGUF conversion of such a folder marks them. Stop
    /// tokens: EOS, every `generation_config.json` EOS, and end-of-turn tokens such as
    /// `<|im_end|>`.
    pub fn from_hf_folder(dir: &Path) -> Result<Self, EngineError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(bad(format!("{} is missing", path.display())));
        }
        let text =
            std::fs::read_to_string(&path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        let json: Json =
            serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        let mut inner: tokenizers::Tokenizer = text
            .parse()
            .map_err(|e| bad(format!("{}: {e}", path.display())))?;
        inner
            .with_truncation(None)
            .map_err(|e| bad(format!("turning truncation off: {e}")))?;
        inner.with_padding(None);
        let read_json = |name: &str| -> Result<Json, EngineError> {
            let p = dir.join(name);
            if !p.is_file() {
                return Ok(Json::Null);
            }
            let text =
                std::fs::read_to_string(&p).map_err(|e| bad(format!("{}: {e}", p.display())))?;
            serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", p.display())))
        };
        let config = read_json("tokenizer_config.json")?;
        let special_map = read_json("special_tokens_map.json")?;
        let generation = read_json("generation_config.json")?;
        let model_config = read_json("config.json")?;

        // Token texts by id; ids the files skip decode to nothing.
        let vocab = inner.get_vocab(true);
        let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut tokens = vec![String::new(); size];
        let mut special = vec![true; size];
        let mut user_defined = vec![false; size];
        for (text, &id) in &vocab {
            tokens[id as usize] = text.clone();
            special[id as usize] = false;
        }
        for (id, added) in inner.get_added_tokens_decoder() {
            if let (Some(s), Some(u)) = (
                special.get_mut(id as usize),
                user_defined.get_mut(id as usize),
            ) {
                let control = added.special || looks_special(&added.content);
                *s = control;
                *u = !control;
            }
        }
        let literal = either(&special, &user_defined);
        let mentions = |part: &str, kind: &str| contains_type(&json[part], kind);
        let token_bytes =
            if mentions("pre_tokenizer", "ByteLevel") || mentions("decoder", "ByteLevel") {
                let table = char_to_byte();
                byte_table(&tokens, &literal, |t| {
                    let mut out = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match table.get(&c) {
                            Some(&b) => out.push(b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    out
                })
            } else if json["model"]["byte_fallback"] == Json::Bool(true)
                || mentions("decoder", "ByteFallback")
                || mentions("decoder", "Metaspace")
                || mentions("pre_tokenizer", "Metaspace")
            {
                byte_table(&tokens, &literal, SentencePiece::piece_bytes)
            } else {
                return Err(bad(format!(
                "{}: neither byte-level BPE nor a SentencePiece-style vocabulary (no ByteLevel, \
                 byte fallback or Metaspace step), so token bytes are unknown",
                path.display()
            )));
            };

        let token_text = |v: &Json| -> Option<String> {
            match v {
                Json::String(s) => Some(s.clone()),
                Json::Object(o) => o.get("content").and_then(Json::as_str).map(str::to_string),
                _ => None,
            }
        };
        let in_vocab = |id: u64| u32::try_from(id).ok().filter(|&i| (i as usize) < size);
        let named = |key: &str| -> Option<u32> {
            let text = token_text(&config[key]).or_else(|| token_text(&special_map[key]))?;
            vocab.get(&text).copied()
        };
        let ids = |v: &Json| -> Vec<u32> {
            match v {
                Json::Array(list) => list
                    .iter()
                    .filter_map(Json::as_u64)
                    .filter_map(in_vocab)
                    .collect(),
                other => other.as_u64().and_then(in_vocab).into_iter().collect(),
            }
        };
        let generation_eos = {
            let from_generation = ids(&generation["eos_token_id"]);
            if from_generation.is_empty() {
                ids(&model_config["eos_token_id"])
            } else {
                from_generation
            }
        };
        let bos = named("bos_token").or_else(|| {
            let mut candidates = ids(&generation["bos_token_id"]);
            candidates.extend(ids(&model_config["bos_token_id"]));
            candidates.first().copied()
        });
        let eos = named("eos_token").or_else(|| generation_eos.first().copied());
        let mut stop_tokens: Vec<u32> = Vec::new();
        let end_of_turn = END_OF_TURN_TEXTS
            .iter()
            .filter_map(|t| vocab.get(*t).copied())
            .filter(|&id| special[id as usize]);
        for id in eos.into_iter().chain(generation_eos).chain(end_of_turn) {
            if !stop_tokens.contains(&id) {
                stop_tokens.push(id);
            }
        }
        // Without `add_bos_token`, BOS is added when the file's post-processor adds it.
        let add_bos = match config["add_bos_token"].as_bool() {
            Some(add) => add,
            None => match bos {
                Some(bos) => {
                    let with = inner
                        .encode_fast("a", true)
                        .map_err(|e| bad(format!("encoding: {e}")))?;
                    let without = inner
                        .encode_fast("a", false)
                        .map_err(|e| bad(format!("encoding: {e}")))?;
                    with.get_ids().first() == Some(&bos) && without.get_ids().first() != Some(&bos)
                }
                None => false,
            },
        };
        let chat_template = match &config["chat_template"] {
            Json::String(s) => Some(s.clone()),
            Json::Array(named) => named
                .iter()
                .find(|t| t["name"] == "default")
                .or_else(|| named.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => None,
        };
        let chat_template = match chat_template {
            Some(t) => Some(t),
            None if dir.join("chat_template.jinja").is_file() => {
                let p = dir.join("chat_template.jinja");
                Some(
                    std::fs::read_to_string(&p)
                        .map_err(|e| bad(format!("{}: {e}", p.display())))?,
                )
            }
            None => read_json("chat_template.json")?["chat_template"]
                .as_str()
                .map(str::to_string),
        };
        Ok(Self {
            inner: Encoder::tokenizers(inner),
            token_bytes,
            special,
            user_defined,
            bos,
            eos,
            stop_tokens,
            add_bos,
            chat_template,
            byte_token: Vec::new(),
            special_matcher: None,
            special_texts: Vec::new(),
        }
        .finish())
    }

    /// Extends the vocabulary with empty special tokens up to `size` ids: Hugging Face models
    /// often pad their embedding beyond the tokenizer (to a multiple of 64 or 128); those ids
    /// are never produced by encoding and decode to nothing.
    pub fn pad_to(&mut self, size: usize) {
        if size > self.token_bytes.len() {
            self.token_bytes.resize(size, Vec::new());
            self.special.resize(size, true);
            self.user_defined.resize(size, false);
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// Token ids of `text`. Special-token texts in `text` become their ids (as in rendered chat
    /// templates). With `add_bos` and a model that wants it, BOS goes first.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            if let Some(bos) = self.bos {
                ids.push(bos);
            }
        }
        match &self.inner {
            Encoder::Tokenizers { normal, .. } => {
                let encoding = normal
                    .encode_fast(text, false)
                    .map_err(|e| bad(format!("encoding: {e}")))?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Encoder::SentencePiece(spm) => ids.extend(spm.encode(text)),
        }
        Ok(ids)
    }

    /// Token ids of `text` as plain text: special-token texts in it are split into ordinary
    /// tokens, so no special token can come out (the path for anything a client wrote).
    pub fn encode_plain(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, EngineError> {
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            if let Some(bos) = self.bos {
                ids.push(bos);
            }
        }
        self.encode_plain_into(text, true, &mut ids)?;
        Ok(ids)
    }

    /// `at_start`: the text starts a segment (SentencePiece's space prefix applies).
    fn encode_plain_into(
        &self,
        text: &str,
        at_start: bool,
        ids: &mut Vec<u32>,
    ) -> Result<(), EngineError> {
        if text.is_empty() {
            return Ok(());
        }
        let start = ids.len();
        match &self.inner {
            Encoder::Tokenizers { plain, .. } => {
                let encoding = plain
                    .encode_fast(text, false)
                    .map_err(|e| bad(format!("encoding: {e}")))?;
                ids.extend_from_slice(encoding.get_ids());
            }
            Encoder::SentencePiece(spm) => spm.encode_plain_text(text, at_start, ids),
        }
        // A vocabulary may still hold a special token's text as a plain word (a BPE that looks
        // whole words up): spell such a token with byte tokens instead.
        if ids[start..].iter().any(|&id| self.is_special(id)) {
            let produced: Vec<u32> = ids.drain(start..).collect();
            for id in produced {
                if !self.is_special(id) {
                    ids.push(id);
                    continue;
                }
                for &b in self.token_bytes(id) {
                    match self.byte_token.get(b as usize).copied().flatten() {
                        Some(t) => ids.push(t),
                        None => {
                            return Err(EngineError::InvalidRequest(format!(
                                "the text {:?} can only be spelled with a special token",
                                self.token_text(id)
                            )))
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The texts of the special tokens (those that input text could name).
    pub fn special_texts(&self) -> &[String] {
        &self.special_texts
    }

    /// Where special-token texts occur in `text`: (start, end) byte ranges, leftmost-longest.
    pub fn find_special(&self, text: &str) -> Vec<(usize, usize)> {
        match &self.special_matcher {
            Some(m) => m.find_iter(text).map(|m| (m.start(), m.end())).collect(),
            None => Vec::new(),
        }
    }

    /// Replaces every special-token text in `content` (and every placeholder character it
    /// already holds) by a placeholder, so that a chat template renders the content without its
    /// special-token texts being taken for the template's own. [`Self::encode_protected`] turns
    /// the placeholders back into plain text.
    pub fn protect(&self, content: &str, table: &mut Protected) -> Result<String, EngineError> {
        let mut marks: Vec<(usize, usize)> = self.find_special(content);
        marks.extend(
            content
                .char_indices()
                .filter(|(_, c)| placeholder_index(*c).is_some())
                .map(|(i, c)| (i, i + c.len_utf8())),
        );
        if marks.is_empty() {
            return Ok(content.to_string());
        }
        marks.sort_unstable();
        let mut out = String::with_capacity(content.len());
        let mut at = 0;
        for (start, end) in marks {
            if start < at {
                continue;
            }
            if table.strings.len() >= PLACEHOLDERS {
                return Err(EngineError::InvalidRequest(format!(
                    "the conversation holds more than {PLACEHOLDERS} special-token strings"
                )));
            }
            out.push_str(&content[at..start]);
            let index = table.strings.len() as u32;
            out.extend(char::from_u32(PLACEHOLDER_BASE + index));
            table.strings.push(content[start..end].to_string());
            at = end;
        }
        out.push_str(&content[at..]);
        Ok(out)
    }

    /// Token ids of a rendered chat whose content went through [`Self::protect`]: the
    /// template's text as [`Self::encode`] does it (its special tokens are the conversation's
    /// control tokens), each run of protected strings as plain text.
    pub fn encode_protected(
        &self,
        rendered: &str,
        table: &Protected,
        add_bos: bool,
    ) -> Result<Vec<u32>, EngineError> {
        if table.is_empty() {
            return self.encode(rendered, add_bos);
        }
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            if let Some(bos) = self.bos {
                ids.push(bos);
            }
        }
        let known = |c: char| placeholder_index(c).filter(|&k| k < table.strings.len());
        let mut template_from = 0;
        let mut chars = rendered.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            let Some(first) = known(c) else {
                continue;
            };
            ids.extend(self.encode(&rendered[template_from..i], false)?);
            let mut plain = table.strings[first].clone();
            let mut end = i + c.len_utf8();
            while let Some(&(j, d)) = chars.peek() {
                let Some(k) = known(d) else {
                    break;
                };
                plain.push_str(&table.strings[k]);
                end = j + d.len_utf8();
                chars.next();
            }
            // After template text, a SentencePiece vocabulary adds no space prefix; after a
            // control token (or at the start) it does, as for any segment.
            let before = &rendered[template_from..i];
            let after_control = (i == 0)
                || self
                    .find_special(before)
                    .last()
                    .is_some_and(|m| m.1 == before.len());
            self.encode_plain_into(&plain, after_control, &mut ids)?;
            template_from = end;
        }
        ids.extend(self.encode(&rendered[template_from..], false)?);
        Ok(ids)
    }

    /// Token ids of a chat rendered with `template`: the template's control tokens, and every
    /// message's content as plain text.
    pub fn encode_chat(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
    ) -> Result<Vec<u32>, EngineError> {
        self.encode_chat_with(template, messages, true)
    }

    /// [`Tokenizer::encode_chat`], with or without the template's generation prompt (the
    /// assistant turn's opening) at the end.
    pub fn encode_chat_with(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.encode_chat_tools(template, messages, &[], add_generation_prompt)
    }

    /// [`Tokenizer::encode_chat_with`] with the request's tools. Every client string (each
    /// message's content, a tool call's name and arguments, a tool's definition, keys
    /// included) is protected: a special-token text in it stays plain text.
    pub fn encode_chat_tools(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        tools: &[Json],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let mut table = Protected::default();
        let protected = messages
            .iter()
            .map(|m| {
                let mut calls = m.tool_calls.clone();
                for call in &mut calls {
                    call.id = self.protect(&call.id, &mut table)?;
                    call.function.name = self.protect(&call.function.name, &mut table)?;
                    self.protect_json(&mut call.function.arguments, &mut table)?;
                }
                Ok(ChatMessage {
                    role: m.role.clone(),
                    content: self.protect(&m.content, &mut table)?,
                    tool_calls: calls,
                    tool_call_id: m
                        .tool_call_id
                        .as_deref()
                        .map(|id| self.protect(id, &mut table))
                        .transpose()?,
                    name: m
                        .name
                        .as_deref()
                        .map(|n| self.protect(n, &mut table))
                        .transpose()?,
                    tools: m
                        .tools
                        .as_deref()
                        .map(|t| self.protect(t, &mut table))
                        .transpose()?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let mut tools = tools.to_vec();
        for tool in &mut tools {
            self.protect_json(tool, &mut table)?;
        }
        let rendered = template.render_with_tools(&protected, &tools, add_generation_prompt)?;
        self.encode_protected(&rendered, &table, false)
    }

    /// [`Self::protect`] on every string of a JSON value, object keys included.
    fn protect_json(&self, value: &mut Json, table: &mut Protected) -> Result<(), EngineError> {
        match value {
            Json::String(s) => *s = self.protect(s, table)?,
            Json::Array(items) => {
                for item in items {
                    self.protect_json(item, table)?;
                }
            }
            Json::Object(map) => {
                let old = std::mem::take(map);
                for (k, mut v) in old {
                    self.protect_json(&mut v, table)?;
                    map.insert(self.protect(&k, table)?, v);
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// What the constructors leave out: byte tokens and the special-token matcher.
    fn finish(mut self) -> Self {
        let mut byte_token = vec![None; 256];
        for (id, bytes) in self.token_bytes.iter().enumerate() {
            if let [b] = bytes.as_slice() {
                let plain = !self.special[id] && !self.user_defined[id];
                if plain && byte_token[*b as usize].is_none() {
                    byte_token[*b as usize] = Some(id as u32);
                }
            }
        }
        self.byte_token = byte_token;
        let mut texts: Vec<String> = self
            .token_bytes
            .iter()
            .zip(&self.special)
            .filter(|(b, &s)| s && !b.is_empty())
            .filter_map(|(b, _)| std::str::from_utf8(b).ok().map(str::to_string))
            .collect();
        texts.sort();
        texts.dedup();
        self.special_matcher = if texts.is_empty() {
            None
        } else {
            aho_corasick::AhoCorasick::builder()
                .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                .build(&texts)
                .ok()
        };
        self.special_texts = texts;
        self
    }

    /// The bytes of a token (empty for an unknown id).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// A token's text (invalid UTF-8 replaced), for reports such as top logprobs.
    pub fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(self.token_bytes(id)).into_owned()
    }

    /// A control token: hidden in output by default, never made from a client's text.
    /// User-defined tokens are not special: they are text.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The text of a token sequence (special tokens included; invalid UTF-8 replaced).
    pub fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| self.token_bytes(id).iter().copied())
            .collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// Turns a stream of tokens into a stream of text pieces, holding back bytes until they form
/// complete UTF-8 characters.
#[derive(Debug, Default)]
pub struct Detokenizer {
    pending: Vec<u8>,
}

impl Detokenizer {
    /// The text that `id` completes (possibly empty while a character is incomplete).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32, show_special: bool) -> String {
        if tokenizer.is_special(id) && !show_special {
            return String::new();
        }
        self.pending.extend_from_slice(tokenizer.token_bytes(id));
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // An invalid sequence (not merely incomplete): emit it replaced rather than stall.
            Err(_) => {
                let text = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                return text;
            }
        };
        let text = String::from_utf8(self.pending[..valid].to_vec()).unwrap_or_default();
        self.pending.drain(..valid);
        text
    }

    /// Whatever is still held back (at the end of generation), replaced where invalid.
    pub fn flush(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

/// Whether a `tokenizer.json` component (or a `Sequence` of them, at any depth) has a step of
/// type `kind`.
fn contains_type(component: &Json, kind: &str) -> bool {
    match component {
        Json::Object(fields) => {
            fields.get("type").and_then(Json::as_str) == Some(kind)
                || fields.values().any(|v| contains_type(v, kind))
        }
        Json::Array(items) => items.iter().any(|v| contains_type(v, kind)),
        _ => false,
    }
}

/// An added token that some tokenizers leave unmarked but that is a control token: `<|...|>`
/// and `<｜...｜>` (DeepSeek) turn markers, Gemma's `<unused...>`, `<pad>`, `<mask>`. Such a text
/// must not become a token when a client writes it (llama.cpp's converter marks them the same).
fn looks_special(text: &str) -> bool {
    matches!(text, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (text.starts_with("<|") && text.ends_with("|>"))
        || (text.starts_with("<｜") && text.ends_with("｜>"))
        || (text.starts_with("<unused") && text.ends_with('>'))
}

/// Tokens marked in `a` or in `b`.
fn either(a: &[bool], b: &[bool]) -> Vec<bool> {
    a.iter().zip(b).map(|(x, y)| *x || *y).collect()
}

/// The bytes of every token: `literal` tokens (control and user-defined) stand for their own
/// text, the others for what `decode` makes of their vocabulary entry.
fn byte_table(
    tokens: &[String],
    literal: &[bool],
    decode: impl Fn(&str) -> Vec<u8>,
) -> Vec<Vec<u8>> {
    tokens
        .iter()
        .zip(literal)
        .map(|(t, &s)| if s { t.as_bytes().to_vec() } else { decode(t) })
        .collect()
}

/// The GGUF tokenizer metadata (`tokenizer.ggml.*`, as llama.cpp's converter writes it) of a
/// Hugging Face folder's byte-level BPE `tokenizer.json`, padded with unused tokens to
/// `vocab_size` rows. `tokenizer` is the folder's tokenizer as loaded (for BOS/EOS and the chat
/// template).
pub fn gguf_metadata_from_hf(
    dir: &Path,
    tokenizer: &Tokenizer,
    vocab_size: usize,
) -> Result<Vec<(String, formats::gguf::Value)>, EngineError> {
    use formats::gguf::{Array, Value};
    let path = dir.join("tokenizer.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    let json: Json =
        serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    let model = &json["model"];
    if model["type"].as_str() != Some("BPE") {
        return Err(bad(format!(
            "{}: only BPE tokenizers convert to GGUF (this one is {})",
            path.display(),
            model["type"]
        )));
    }
    let pre = json["pre_tokenizer"].to_string();
    if !pre.contains("ByteLevel") && !json["decoder"].to_string().contains("ByteLevel") {
        return Err(bad(format!(
            "{}: only byte-level BPE tokenizers convert to GGUF",
            path.display()
        )));
    }
    // llama.cpp names pre-tokenizers; these are the ones this engine (and llama.cpp) know.
    let pre_name = if pre.contains("\"individual_digits\":true") {
        "smollm"
    } else if pre.contains("\\\\p{N}{1,3}") {
        "llama-bpe"
    } else if pre.contains("\\\\p{N}") && pre.contains("Split") {
        "qwen2"
    } else {
        "gpt2"
    };
    let n = vocab_size.max(tokenizer.vocab_size());
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![1i32; n];
    if let Some(vocab) = model["vocab"].as_object() {
        for (token, id) in vocab {
            if let Some(slot) = id.as_u64().and_then(|i| tokens.get_mut(i as usize)) {
                *slot = Some(token.clone());
            }
        }
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else {
            continue;
        };
        if let Some(slot) = tokens.get_mut(id as usize) {
            *slot = Some(content.to_string());
            types[id as usize] =
                if added["special"].as_bool().unwrap_or(false) || looks_special(content) {
                    3 // control
                } else {
                    4 // user-defined
                };
        }
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = 5; // unused
                format!("[PAD{i}]")
            })
        })
        .collect();
    let merges: Vec<String> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            Json::String(s) => Some(s.clone()),
            Json::Array(pair) if pair.len() == 2 => {
                Some(format!("{} {}", pair[0].as_str()?, pair[1].as_str()?))
            }
            _ => None,
        })
        .collect();
    let mut out = vec![
        (
            "tokenizer.ggml.model".to_string(),
            Value::String("gpt2".into()),
        ),
        ("tokenizer.ggml.pre".into(), Value::String(pre_name.into())),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::String(tokens)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(types)),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::String(merges)),
        ),
        (
            "tokenizer.ggml.add_bos_token".into(),
            Value::Bool(tokenizer.add_bos),
        ),
    ];
    if let Some(b) = tokenizer.bos {
        out.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(b)));
    }
    if let Some(e) = tokenizer.eos {
        out.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(e)));
    }
    if let Some(t) = &tokenizer.chat_template {
        out.push(("tokenizer.chat_template".into(), Value::String(t.clone())));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use formats::tiny::TinyLlama;

    fn tiny() -> Tokenizer {
        let bytes = TinyLlama::default().to_gguf().unwrap();
        Tokenizer::from_gguf(&Gguf::parse(&bytes).unwrap()).unwrap()
    }

    const QWEN2_TEMPLATE: &str = "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response><|im_end|>\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}";

    /// Qwen2's special tokens, as its `tokenizer.json` lists them.
    const QWEN2_SPECIAL: &[&str] = &[
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ];

    /// A Qwen2-style Hugging Face folder: byte-level BPE with Qwen2's special tokens and
    /// chat template.
    fn qwen2_folder(dir: &Path) -> Tokenizer {
        let mut tokens: Vec<String> = formats::byte_level::gpt2_byte_tokens();
        let merges: Vec<String> = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
            .map(String::from)
            .to_vec();
        tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
        let plain = tokens.len();
        tokens.extend(QWEN2_SPECIAL.iter().map(|t| t.to_string()));
        let special: Vec<bool> = (0..tokens.len()).map(|i| i >= plain).collect();
        let json = formats::tiny::byte_level_tokenizer_json(&tokens, &merges, &special, false);
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        let config = serde_json::json!({
            "eos_token": "<|im_end|>", "bos_token": null, "chat_template": QWEN2_TEMPLATE,
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        Tokenizer::from_hf_folder(dir).unwrap()
    }

    fn specials_in(t: &Tokenizer, ids: &[u32]) -> Vec<u32> {
        ids.iter().copied().filter(|&id| t.is_special(id)).collect()
    }

    /// Every special-token text placed in every role's content stays plain text: the chat's
    /// control tokens are exactly the template's, and the text round-trips.
    fn assert_content_is_plain(t: &Tokenizer, template: &str) {
        let template = ChatTemplate::new(template, "", "").unwrap();
        let chat = |content: &str| {
            vec![
                ChatMessage::new("system", &format!("Be brief. {content}")),
                ChatMessage::new("user", &format!("hi {content} there")),
                ChatMessage::new("assistant", content),
                ChatMessage::new("tool", &format!("{content}{content}")),
                ChatMessage::new("user", content),
            ]
        };
        let clean = t.encode_chat(&template, &chat("x")).unwrap();
        let control = specials_in(t, &clean);
        assert!(!control.is_empty(), "the template has control tokens");
        assert_eq!(
            clean,
            t.encode(&template.render(&chat("x"), true).unwrap(), false)
                .unwrap(),
            "content without special-token texts tokenizes as before"
        );
        assert!(!t.special_texts().is_empty());
        for text in t.special_texts() {
            let ids = t.encode_chat(&template, &chat(text)).unwrap();
            assert_eq!(
                specials_in(t, &ids),
                control,
                "{text:?} in content forged a token"
            );
            assert_eq!(
                t.decode(&ids),
                template.render(&chat(text), true).unwrap(),
                "{text:?}: the text is kept"
            );
            let plain = t.encode_plain(text, false).unwrap();
            assert!(
                specials_in(t, &plain).is_empty(),
                "{text:?} plain: {plain:?}"
            );
            assert_eq!(t.decode(&plain), *text);
        }
    }

    #[test]
    fn chatml_content_never_becomes_control_tokens() {
        let t = tiny();
        let template = TinyLlama::default().chat_template.unwrap();
        assert_content_is_plain(&t, &template);
        // The raw path still parses them (completions keep that by default).
        assert_eq!(t.encode("<|im_start|>", false).unwrap(), [1]);
    }

    #[test]
    fn qwen2_content_never_becomes_control_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let t = qwen2_folder(dir.path());
        assert_eq!(t.special_texts().len(), QWEN2_SPECIAL.len());
        assert_content_is_plain(&t, QWEN2_TEMPLATE);
    }

    #[test]
    fn placeholder_characters_in_content_survive() {
        let t = tiny();
        let template =
            ChatTemplate::new(&TinyLlama::default().chat_template.unwrap(), "", "").unwrap();
        let odd = "a \u{F0000}\u{F0001} b <|im_end|>\u{FFFFD}";
        let chat = [ChatMessage::new("user", odd)];
        let ids = t.encode_chat(&template, &chat).unwrap();
        assert_eq!(t.decode(&ids), template.render(&chat, true).unwrap());
        assert_eq!(
            specials_in(&t, &ids).len(),
            3,
            "<|im_start|> <|im_end|> <|im_start|>"
        );
    }

    #[test]
    fn encodes_with_merges_and_special_tokens() {
        let t = tiny();
        let ids = t.encode("<|im_start|>the cat", false).unwrap();
        assert_eq!(ids[0], 1, "special token text becomes its id");
        let text = t.decode(&ids);
        assert_eq!(text, "<|im_start|>the cat");
        // " the" merges to one token (Ġ t → Ġt, h e → he, Ġt he → Ġthe).
        let the = t.encode(" the", false).unwrap();
        assert_eq!(the.len(), 1, "{the:?}");
        assert_eq!(t.decode(&the), " the");
    }

    #[test]
    fn round_trips_arbitrary_utf8() {
        let t = tiny();
        for text in [
            "héllo wörld",
            "日本語のテキスト",
            "emoji 🙂 and 123 digits",
            "tabs\tand\nnewlines  ",
        ] {
            let ids = t.encode(text, false).unwrap();
            assert_eq!(t.decode(&ids), text);
        }
    }

    #[test]
    fn sentencepiece_vocabularies_from_gguf() {
        use formats::gguf::{Array, GgufWriter};
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        let pieces = ["▁", "t", "h", "e", "▁t", "he", "▁the", "▁c", "at", "▁cat"];
        let mut scores = vec![0f32; tokens.len()];
        for (i, p) in pieces.iter().enumerate() {
            tokens.push(p.to_string());
            scores.push(p.chars().count() as f32 - i as f32 * 0.01);
        }
        let types: Vec<i32> = (0..tokens.len())
            .map(|i| match i {
                0 => 2,
                1 | 2 => 3,
                3..=258 => 6,
                _ => 1,
            })
            .collect();
        let mut w = GgufWriter::new();
        w.metadata("tokenizer.ggml.model", "llama").unwrap();
        w.metadata("tokenizer.ggml.tokens", Array::String(tokens.clone()))
            .unwrap();
        w.metadata("tokenizer.ggml.scores", Array::F32(scores))
            .unwrap();
        w.metadata("tokenizer.ggml.token_type", Array::I32(types))
            .unwrap();
        w.metadata("tokenizer.ggml.bos_token_id", 1u32).unwrap();
        w.metadata("tokenizer.ggml.eos_token_id", 2u32).unwrap();
        w.metadata("tokenizer.ggml.unknown_token_id", 0u32).unwrap();
        let t = Tokenizer::from_gguf(&Gguf::parse(&w.to_bytes().unwrap()).unwrap()).unwrap();
        assert!(t.add_bos, "SentencePiece models add BOS by default");
        let ids = t.encode("the cat ü", true).unwrap();
        let id = |p: &str| tokens.iter().position(|t| t == p).unwrap() as u32;
        assert_eq!(
            ids,
            [
                1,
                id("▁the"),
                id("▁cat"),
                id("▁"),
                id("<0xC3>"),
                id("<0xBC>")
            ]
        );
        assert_eq!(t.decode(&ids[1..]), " the cat ü");
        let plain = t.encode_plain("</s>the", false).unwrap();
        assert!(specials_in(&t, &plain).is_empty(), "{plain:?}");
        assert_eq!(t.decode(&plain), " </s>the");
        assert_eq!(t.encode("</s>the", false).unwrap()[0], 2);
        let mut d = Detokenizer::default();
        let streamed: String = ids[1..].iter().map(|&i| d.push(&t, i, false)).collect();
        assert_eq!(
            streamed, " the cat ü",
            "byte pieces are joined before they are shown"
        );
    }

    #[test]
    fn sentencepiece_style_tokenizer_json_with_byte_fallback() {
        // Llama 2's layout: a BPE model with byte fallback behind a normalizer that writes
        // spaces as ▁, BOS added by the post-processor.
        let mut vocab = serde_json::Map::new();
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        for p in [
            "▁", "t", "h", "e", "▁t", "he", "▁the", "c", "a", "▁c", "at", "▁cat",
        ] {
            tokens.push(p.to_string());
        }
        for (i, t) in tokens.iter().enumerate() {
            vocab.insert(t.clone(), serde_json::json!(i));
        }
        let added: Vec<Json> = (0..3)
            .map(|i| {
                serde_json::json!({"id": i, "content": tokens[i], "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let file = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
            "pre_tokenizer": null,
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
                "byte_fallback": true, "ignore_merges": false, "vocab": vocab,
                "merges": ["▁ t", "h e", "▁t he", "▁ c", "a t", "▁c at"]}
        });
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), file.to_string()).unwrap();
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}}"#,
        )
        .unwrap();
        let t = Tokenizer::from_hf_folder(dir.path()).unwrap();
        assert!(t.add_bos, "the post-processor adds BOS");
        assert_eq!(
            (t.bos, t.eos, t.stop_tokens.as_slice()),
            (Some(1), Some(2), &[2][..])
        );
        let id = |p: &str| tokens.iter().position(|t| t == p).unwrap() as u32;
        let ids = t.encode("the cat ü", true).unwrap();
        assert_eq!(
            ids,
            [
                1,
                id("▁the"),
                id("▁cat"),
                id("▁"),
                id("<0xC3>"),
                id("<0xBC>")
            ]
        );
        assert_eq!(t.decode(&ids[1..]), " the cat ü");
        assert!(t.is_special(1) && !t.is_special(id("▁the")));
    }

    #[test]
    fn detokenizer_never_splits_characters() {
        let t = tiny();
        let text = "a🙂é日";
        let ids = t.encode(text, false).unwrap();
        let mut d = Detokenizer::default();
        let mut out = String::new();
        for &id in &ids {
            let piece = d.push(&t, id, false);
            assert!(!piece.contains('\u{FFFD}'));
            out.push_str(&piece);
        }
        out.push_str(&d.flush());
        assert_eq!(out, text);
        assert_eq!(
            d.push(&t, 2, false),
            "",
            "special tokens are hidden by default"
        );
    }
}
