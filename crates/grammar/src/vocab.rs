//! The model's vocabulary as the grammar engine sees it: every token's bytes in a trie, special
//! tokens marked so that no grammar text can produce them, and the model's stop tokens as the
//! end of the output.

use std::sync::Arc;

use engine::tokenizer::Tokenizer;
use toktrie::{TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// A tokenizer with its token trie.
pub struct Vocab {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl Vocab {
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        let n = tokenizer.vocab_size();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| {
                let bytes = tokenizer.token_bytes(id);
                if tokenizer.is_special(id) || bytes.is_empty() {
                    // The trie's convention: a leading 0xFF marks a special token, which only a
                    // grammar that names it can produce.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    if bytes.is_empty() {
                        w.extend_from_slice(format!("<[{id}]>").as_bytes());
                    } else {
                        w.extend_from_slice(bytes);
                    }
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let eos = tokenizer
            .stop_tokens
            .first()
            .copied()
            .or(tokenizer.eos)
            .unwrap_or(0);
        let mut info = TokRxInfo::new(n as u32, eos);
        info.tok_bos = tokenizer.bos;
        let mut trie = TokTrie::from(&info, &words);
        if tokenizer.stop_tokens.len() > 1 {
            trie = trie.with_eos_tokens(&tokenizer.stop_tokens);
        }
        Self { trie, tokenizer }
    }
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            // Grammar text is plain text: a special-token text in a schema (a property name, an
            // enum value) is spelled with ordinary tokens, never forced as a control token.
            Ok(text) => self
                .tokenizer
                .encode_plain(text, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}
