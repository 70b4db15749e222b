//! Constrained decoding: a request may carry a constraint that says, before each sampled token,
//! which tokens of the vocabulary may come next (a grammar, a JSON schema, a regex, a list of
//! choices). The engine asks for that set while the forward pass runs, sets the logits of every
//! other token to −∞ before sampling, and tells the constraint which token was chosen.
//!
//! The engine knows nothing of grammars: the `grammar` crate implements [`TokenConstraint`].

use std::fmt;
use std::sync::Arc;

/// The tokens allowed next: bit `i % 32` of word `i / 32` is set when token `i` may follow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
}

impl TokenMask {
    /// A mask for `vocab` tokens with none allowed.
    pub fn new(vocab: usize) -> Self {
        Self {
            words: vec![0; vocab.div_ceil(32)],
        }
    }

    /// The bit words, to be filled by a constraint (`vocab.div_ceil(32)` of them).
    pub fn words_mut(&mut self) -> &mut [u32] {
        &mut self.words
    }

    pub fn words(&self) -> &[u32] {
        &self.words
    }

    pub fn allow(&mut self, token: u32) {
        if let Some(w) = self.words.get_mut(token as usize / 32) {
            *w |= 1 << (token % 32);
        }
    }

    pub fn is_allowed(&self, token: u32) -> bool {
        self.words
            .get(token as usize / 32)
            .is_some_and(|w| w & (1 << (token % 32)) != 0)
    }

    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Sets every logit whose token is not allowed to −∞ (tokens past the mask included).
    pub fn apply(&self, logits: &mut [f32]) {
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = self.words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (b, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << b) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// Why a constraint could not start a sequence or go on with it. The message reaches the
/// client (after "structured output: "), so an implementation keeps internal state out of it.
#[derive(Debug, thiserror::Error)]
pub enum ConstraintError {
    /// The implementation refused: it could not start, compute a mask or take a token.
    #[error(transparent)]
    Refused(Box<dyn std::error::Error + Send + Sync>),
    /// The mask allowed no token at all.
    #[error("the constraint allows no next token")]
    NoTokenAllowed,
    /// The helper thread computing the masks panicked.
    #[error("the constraint failed while computing its mask")]
    MaskPanicked,
}

impl ConstraintError {
    /// An implementation's own error.
    pub fn refused(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::Refused(Box::new(error))
    }
}

/// The state of one sequence's constraint.
pub trait TokenConstraint: Send {
    /// Fills `mask` with the tokens allowed next. Runs on a helper thread while the forward pass
    /// runs, so it may take a while; an error ends the sequence (the message goes to the caller).
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError>;

    /// Advances past the token the sampler chose (one that the last mask allowed).
    fn commit(&mut self, token: u32) -> Result<(), ConstraintError>;

    /// Nothing may follow what was generated: the sequence ends (finish reason `stop`).
    fn is_complete(&self) -> bool;
}

/// Starts one constraint per sequence (a request with `n` choices starts `n`).
pub trait ConstraintFactory: Send + Sync {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, ConstraintError>;

    /// A short description for logs and debugging (kind and schema hash, say).
    fn describe(&self) -> String;
}

/// A request's constraint, shared by its choices.
#[derive(Clone)]
pub struct Constraint(pub Arc<dyn ConstraintFactory>);

impl fmt::Debug for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Constraint({})", self.0.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_allow_and_apply() {
        let mut m = TokenMask::new(70);
        assert_eq!(m.words().len(), 3);
        for t in [0, 31, 32, 69] {
            m.allow(t);
        }
        m.allow(500); // outside: ignored
        assert_eq!(m.count(), 4);
        assert!(m.is_allowed(31) && !m.is_allowed(30) && !m.is_allowed(500));
        let mut logits = vec![1.0f32; 72];
        m.apply(&mut logits);
        for (i, l) in logits.iter().enumerate() {
            let allowed = [0, 31, 32, 69].contains(&i);
            assert_eq!(l.is_finite(), allowed, "token {i}");
        }
        m.words_mut().fill(u32::MAX);
        let mut logits = vec![1.0f32; 70];
        m.apply(&mut logits);
        assert!(logits.iter().all(|l| l.is_finite()));
    }
}
