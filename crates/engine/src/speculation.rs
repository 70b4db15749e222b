//! Speculative decoding without a draft model: prompt lookup.
//!
//! Answers that copy from their prompt (a summary with quotes, an edited file, extracted fields)
//! repeat runs of tokens the sequence already holds. When the last few tokens of a sequence
//! occurred earlier in it, the tokens that followed them then are a cheap guess of what comes
//! next ([`propose`]). The scheduler computes the guess together with the sequence's next
//! token in one step (one chunk of `1 + k` positions, a logit row for each) and then samples
//! the rows in order with the sequence's own sampler: a row's sample that equals the guess's
//! next token is kept and the next row is sampled; the first that differs is kept too and ends
//! the step. The sample of each row is drawn from exactly the distribution a step without the
//! guess would have drawn it from (the rows before it hold the tokens actually kept), so the
//! output is the same process: greedy outputs are identical, sampled ones are distributed
//! alike (the guess is a point mass: accepting it when the sample equals it accepts with
//! probability p(guess), and a sample that differs is distributed as p without the guess,
//! which is the rejection rule of speculative sampling for a one-token draft distribution).
//!
//! A guess costs: its positions are computed whether they are kept or not, and on a CPU a
//! step with more rows is slower once the matrix products stop being bound by reading the
//! weights. So it is adaptive per sequence ([`Acceptance`]): a sequence whose guesses are
//! mostly wrong stops guessing for a while, longer each time; and no sequence guesses while
//! more than [`Speculation::max_batch`] sequences decode together (their rows already keep
//! the cores busy). Sequences under a structured-output constraint do not guess (the mask of
//! each row would depend on the guess before it).

/// Prompt lookup's settings (per model).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Speculation {
    /// Most tokens guessed per step for one sequence (0: off).
    pub max_draft: usize,
    /// The longest and shortest n-grams looked up (the longest that matches is taken).
    pub ngram_max: usize,
    pub ngram_min: usize,
    /// No sequence guesses while more than this many decode together.
    pub max_batch: usize,
}

impl Default for Speculation {
    fn default() -> Self {
        Self {
            max_draft: 0,
            ngram_max: 4,
            ngram_min: 2,
            max_batch: 4,
        }
    }
}

impl Speculation {
    pub fn enabled(&self) -> bool {
        self.max_draft > 0 && self.ngram_min >= 1 && self.ngram_max >= self.ngram_min
    }
}

/// Up to `max` tokens continuing `tokens`: those that followed the latest earlier occurrence of
/// its last `n` tokens, for the largest `n` in `ngram_min..=ngram_max` that occurs (empty when
/// none does).
pub fn propose(tokens: &[u32], ngram_min: usize, ngram_max: usize, max: usize) -> &[u32] {
    let len = tokens.len();
    if max == 0 || ngram_min == 0 {
        return &[];
    }
    for n in (ngram_min..=ngram_max).rev() {
        if len <= n {
            continue;
        }
        let tail = &tokens[len - n..];
        // The latest start `p < len - n`: the occurrence is not the tail itself and at least
        // one token follows it.
        if let Some(p) = (0..len - n).rev().find(|&p| tokens[p..p + n] == *tail) {
            let start = p + n;
            return &tokens[start..(start + max).min(len)];
        }
    }
    &[]
}

/// Acceptance below this share of the tokens guessed (a moving average) pauses a sequence's
/// guessing.
const MIN_ACCEPTANCE: f64 = 0.35;
/// The first pause (generated tokens without guessing); each later one doubles, up to the last.
const FIRST_PAUSE: usize = 16;
const LONGEST_PAUSE: usize = 256;

/// One sequence's guesses: how many were made and kept, and whether it guesses now.
#[derive(Debug, Clone)]
pub struct Acceptance {
    /// Tokens guessed and tokens kept, over the sequence's life.
    pub proposed: u64,
    pub accepted: u64,
    /// Moving average of the share kept per step.
    average: f64,
    /// Tokens still to generate before guessing again, and the next pause's length.
    paused: usize,
    next_pause: usize,
    /// How many tokens to guess next (before the settings' cap): doubles after a guess kept
    /// whole, falls to one more than what was kept after a miss.
    length: usize,
}

impl Default for Acceptance {
    fn default() -> Self {
        Self {
            proposed: 0,
            accepted: 0,
            average: 1.0,
            paused: 0,
            next_pause: FIRST_PAUSE,
            length: usize::MAX,
        }
    }
}

impl Acceptance {
    /// Whether the sequence may guess this step.
    pub fn guessing(&self) -> bool {
        self.paused == 0
    }

    /// How many tokens to guess now, at most `cap`.
    pub fn length(&self, cap: usize) -> usize {
        self.length.min(cap)
    }

    /// A step that generated `tokens` without a guess (counts down a pause).
    pub fn plain(&mut self, tokens: usize) {
        self.paused = self.paused.saturating_sub(tokens);
    }

    /// A step that verified `proposed` guessed tokens and kept `accepted` of them.
    pub fn verified(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.proposed += proposed as u64;
        self.accepted += accepted as u64;
        self.average = 0.7 * self.average + 0.3 * (accepted as f64 / proposed as f64);
        // A copied run goes on until it does not: guess further while whole guesses are kept,
        // and just past what was kept after one was not.
        self.length = if accepted == proposed {
            proposed.saturating_mul(2)
        } else {
            accepted + 1
        };
        if self.average < MIN_ACCEPTANCE {
            self.paused = self.next_pause;
            self.next_pause = (self.next_pause * 2).min(LONGEST_PAUSE);
            // Starts again with the benefit of the doubt.
            self.average = 1.0;
        } else if accepted == proposed {
            self.next_pause = FIRST_PAUSE;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_occurrence_of_the_longest_ngram_is_proposed() {
        // "a b c d | x a b c e | a b c" : the 3-gram "a b c" last occurred before "e".
        let t = [1, 2, 3, 4, 9, 1, 2, 3, 5, 1, 2, 3];
        assert_eq!(propose(&t, 1, 3, 4), &[5, 1, 2, 3]);
        assert_eq!(propose(&t, 1, 3, 2), &[5, 1]);
        // The longest match wins over a later shorter one: "2 3" after "9 2 3" would say 7.
        let t = [1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3];
        assert_eq!(propose(&t, 2, 3, 1), &[4]);
        assert_eq!(propose(&t, 2, 2, 1), &[7]);
        // Nothing matches, or nothing follows.
        assert!(propose(&[1, 2, 3, 4], 1, 3, 4).is_empty());
        assert!(propose(&[5, 5], 2, 2, 4).is_empty());
        // A run overlapping its tail (a repeated token).
        assert_eq!(propose(&[7, 7, 7], 2, 2, 4), &[7]);
        assert!(propose(&[1, 2], 1, 3, 0).is_empty());
    }

    #[test]
    fn low_acceptance_pauses_guessing_longer_each_time() {
        let mut a = Acceptance::default();
        assert!(a.guessing());
        for _ in 0..3 {
            a.verified(4, 0);
        }
        assert!(!a.guessing());
        a.plain(FIRST_PAUSE - 1);
        assert!(!a.guessing());
        a.plain(1);
        assert!(a.guessing());
        for _ in 0..3 {
            a.verified(4, 0);
        }
        a.plain(FIRST_PAUSE);
        assert!(!a.guessing(), "the second pause is twice as long");
        a.plain(FIRST_PAUSE);
        assert!(a.guessing());
        // Good guesses keep it on.
        for _ in 0..20 {
            a.verified(4, 4);
        }
        assert!(a.guessing());
        assert_eq!((a.proposed, a.accepted), (24 + 80, 80));
        // The length follows what is kept.
        assert_eq!(a.length(16), 8);
        a.verified(8, 2);
        assert_eq!(a.length(16), 3);
        a.verified(3, 3);
        assert_eq!(a.length(16), 6);
    }
}
