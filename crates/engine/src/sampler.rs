//! Token selection: logit bias, repetition/frequency/presence penalties, temperature, top-k,
//! top-p, min-p, seeded sampling; and per token the log-probability of the choice, the top
//! alternatives and the entropy of the full distribution.
//!
//! Log-probabilities and entropy describe the model's distribution after bias and penalties and
//! before temperature and truncation: they measure the model's confidence, not the sampler's
//! settings.

use std::collections::HashMap;

use kernels::rng::SplitMix64;

use crate::error::EngineError;

/// Most alternatives a caller may ask for per token (as the OpenAI API allows).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How to choose tokens. Defaults are neutral: temperature 1, no truncation, no penalties.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 picks the most likely token (greedy).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` × the most likely one (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of every token seen in the prompt or the
    /// output so far (1: off).
    pub repetition_penalty: f32,
    /// Subtract `count × frequency_penalty` from the logits of generated tokens.
    pub frequency_penalty: f32,
    /// Subtract `presence_penalty` from the logits of tokens generated at least once.
    pub presence_penalty: f32,
    /// Added to the logits of the given tokens.
    pub logit_bias: Vec<(u32, f32)>,
    /// Same seed, same model, same prompt: same output.
    pub seed: Option<u64>,
    /// Alternatives to report per token (0..=20).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logit_bias: Vec::new(),
            seed: None,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Checks every value against its documented range.
    pub fn validate(&self, vocab_size: usize) -> Result<(), EngineError> {
        let bad = |m: String| Err(EngineError::InvalidRequest(m));
        if !(0.0..=2.0).contains(&self.temperature) {
            return bad(format!(
                "temperature must be between 0 and 2, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p must be between 0 and 1, got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty <= 10.0) {
            return bad(format!(
                "repetition_penalty must be in (0, 10], got {}",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                return bad(format!(
                    "logit_bias token {id} is outside the vocabulary of {vocab_size}"
                ));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return bad(format!(
                    "logit_bias for token {id} must be between -100 and 100, got {bias}"
                ));
            }
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return bad(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            ));
        }
        Ok(())
    }
}

/// The chosen token and what the distribution said about it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenChoice {
    pub id: u32,
    /// log p(id).
    pub logprob: f32,
    /// Entropy of the full next-token distribution, in nats.
    pub entropy: f32,
    /// The most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Chooses tokens for one sequence.
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// How often each token was generated.
    generated: HashMap<u32, u32>,
    /// Tokens of the prompt and output so far (repetition penalty).
    seen: std::collections::HashSet<u32>,
    candidates: Vec<(u32, f32)>,
    isa: kernels::Isa,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0x5eed)
        });
        Self {
            seen: if params.repetition_penalty != 1.0 {
                prompt.iter().copied().collect()
            } else {
                Default::default()
            },
            params,
            rng: SplitMix64::new(seed),
            generated: HashMap::new(),
            candidates: Vec::new(),
            isa: kernels::Isa::detect(),
        }
    }

    /// Records a token as part of the output (for penalties).
    pub fn accept(&mut self, id: u32) {
        *self.generated.entry(id).or_insert(0) += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(id);
        }
    }

    /// Chooses the next token from raw `logits` (modified in place by bias and penalties).
    pub fn sample(&mut self, logits: &mut [f32]) -> TokenChoice {
        let p = &self.params;
        for &(id, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += bias;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &id in &self.seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.frequency_penalty != 0.0 || p.presence_penalty != 0.0 {
            for (&id, &count) in &self.generated {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= count as f32 * p.frequency_penalty + p.presence_penalty;
                }
            }
        }

        // The partition function and entropy of the full distribution (one vectorized exp per
        // token); log-probabilities are computed for the tokens reported only.
        let stats = kernels::ops::softmax_stats(self.isa, logits);

        let (temperature, top_logprobs) = (p.temperature, p.top_logprobs);
        let id = if temperature == 0.0 {
            // The first maximum (index 0 when every logit is NaN).
            kernels::ops::position_of(self.isa, logits, stats.max).unwrap_or(0) as u32
        } else {
            self.sample_tempered(logits, stats.max)
        };
        let top = top_n(logits, top_logprobs)
            .into_iter()
            .map(|(i, logit)| (i, stats.logprob(logit)))
            .collect();
        TokenChoice {
            id,
            logprob: stats.logprob(logits[id as usize]),
            entropy: stats.entropy,
            top,
        }
    }

    /// Draws a token at the temperature from `logits`, whose largest value is `max`.
    fn sample_tempered(&mut self, logits: &[f32], max: f32) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        // Unnormalized probabilities at the temperature; min-p prunes relative to the maximum (1).
        self.candidates.clear();
        let floor = if p.min_p > 0.0 { p.min_p } else { 0.0 };
        for (i, &l) in logits.iter().enumerate() {
            let w = ((l - max) * inv_t).exp();
            if w >= floor && w > 0.0 {
                self.candidates.push((i as u32, w));
            }
        }
        if self.candidates.is_empty() {
            // Only NaN logits leave nothing to draw from; the first maximum is the honest answer.
            return argmax(logits);
        }
        let by_weight = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && self.candidates.len() > p.top_k {
            self.candidates
                .select_nth_unstable_by(p.top_k - 1, by_weight);
            self.candidates.truncate(p.top_k);
        }
        if p.top_p < 1.0 {
            let total: f64 = self.candidates.iter().map(|c| f64::from(c.1)).sum();
            let target = f64::from(p.top_p) * total;
            // Sort only as much of the head as top-p needs: 64, 512, 4096, … candidates.
            let mut sorted;
            let mut head = 64;
            loop {
                let n = head.min(self.candidates.len());
                if n < self.candidates.len() {
                    self.candidates.select_nth_unstable_by(n - 1, by_weight);
                }
                self.candidates[..n].sort_unstable_by(by_weight);
                sorted = n;
                let mass: f64 = self.candidates[..n].iter().map(|c| f64::from(c.1)).sum();
                if mass >= target || n == self.candidates.len() {
                    break;
                }
                head *= 8;
            }
            let mut mass = 0f64;
            let mut keep = sorted;
            for (i, c) in self.candidates[..sorted].iter().enumerate() {
                mass += f64::from(c.1);
                if mass >= target {
                    keep = i + 1;
                    break;
                }
            }
            self.candidates.truncate(keep.max(1));
        } else {
            // A fixed order makes the draw depend only on the seed.
            self.candidates.sort_unstable_by_key(|c| c.0);
        }
        let total: f64 = self.candidates.iter().map(|c| f64::from(c.1)).sum();
        let mut r = self.rng.unit_f64() * total;
        for &(id, w) in &self.candidates {
            r -= f64::from(w);
            if r < 0.0 {
                return id;
            }
        }
        self.candidates.last().map_or(0, |c| c.0)
    }
}

/// Index of the largest value (the first one on ties).
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// The `n` largest values with their indices, largest first.
fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<(u32, f32)> = values
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, v))
        .collect();
    let n = n.min(idx.len());
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, order);
        idx.truncate(n);
    }
    idx.sort_unstable_by(order);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, -1.0, 2.5, 0.0]
    }

    #[test]
    fn greedy_picks_the_maximum_and_reports_logprobs_and_entropy() {
        let mut s = Sampler::new(
            SamplingParams {
                top_logprobs: 3,
                ..SamplingParams::greedy()
            },
            &[],
        );
        let mut l = logits();
        let c = s.sample(&mut l);
        assert_eq!(c.id, 1);
        let z: f32 = logits().iter().map(|v| v.exp()).sum();
        assert!((c.logprob - (3.0 - z.ln())).abs() < 1e-5);
        let probs: Vec<f32> = logits().iter().map(|v| v.exp() / z).collect();
        let h: f32 = -probs.iter().map(|p| p * p.ln()).sum::<f32>();
        assert!((c.entropy - h).abs() < 1e-5);
        assert_eq!(c.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 4, 2]);
    }

    #[test]
    fn same_seed_same_tokens() {
        let params = SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            seed: Some(42),
            ..SamplingParams::default()
        };
        let draw = |params: &SamplingParams| {
            let mut s = Sampler::new(params.clone(), &[]);
            (0..50)
                .map(|_| s.sample(&mut logits()).id)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(&params), draw(&params));
        let other = SamplingParams {
            seed: Some(43),
            ..params.clone()
        };
        assert_ne!(draw(&params), draw(&other));
    }

    #[test]
    fn truncations_restrict_the_choices() {
        let mut counts = HashMap::new();
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 2,
            seed: Some(1),
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(params, &[]);
        for _ in 0..400 {
            *counts.entry(s.sample(&mut logits()).id).or_insert(0) += 1;
        }
        assert_eq!(
            counts
                .keys()
                .copied()
                .collect::<std::collections::BTreeSet<_>>(),
            [1, 4].into()
        );

        let mut s = Sampler::new(
            SamplingParams {
                min_p: 0.5,
                seed: Some(2),
                ..SamplingParams::default()
            },
            &[],
        );
        for _ in 0..200 {
            // e^(2.5-3) = 0.61 ≥ 0.5 stays, e^(2-3) = 0.37 goes.
            assert!([1, 4].contains(&s.sample(&mut logits()).id));
        }
        let mut s = Sampler::new(
            SamplingParams {
                top_p: 0.01,
                seed: Some(3),
                ..SamplingParams::default()
            },
            &[],
        );
        for _ in 0..50 {
            assert_eq!(
                s.sample(&mut logits()).id,
                1,
                "a tiny top_p keeps only the best"
            );
        }
    }

    #[test]
    fn bias_and_penalties_move_the_choice() {
        let mut s = Sampler::new(
            SamplingParams {
                logit_bias: vec![(3, 10.0)],
                ..SamplingParams::greedy()
            },
            &[],
        );
        assert_eq!(s.sample(&mut logits()).id, 3);
        let mut s = Sampler::new(
            SamplingParams {
                presence_penalty: 2.0,
                ..SamplingParams::greedy()
            },
            &[],
        );
        s.accept(1);
        assert_eq!(s.sample(&mut logits()).id, 4, "3 - 2 < 2.5");
        let mut s = Sampler::new(
            SamplingParams {
                repetition_penalty: 2.0,
                ..SamplingParams::greedy()
            },
            &[1, 4],
        );
        assert_eq!(s.sample(&mut logits()).id, 2, "3/2 and 2.5/2 fall below 2");
    }

    #[test]
    fn nan_logits_do_not_panic() {
        let mut s = Sampler::new(
            SamplingParams {
                top_p: 0.9,
                top_k: 5,
                seed: Some(1),
                ..SamplingParams::default()
            },
            &[],
        );
        let mut l = vec![f32::NAN; 8];
        let _ = s.sample(&mut l);
    }

    #[test]
    fn validation_names_the_bad_value() {
        let bad = SamplingParams {
            temperature: 3.0,
            ..SamplingParams::default()
        };
        assert!(bad
            .validate(10)
            .unwrap_err()
            .to_string()
            .contains("temperature"));
        let bad = SamplingParams {
            logit_bias: vec![(99, 1.0)],
            ..SamplingParams::default()
        };
        assert!(bad
            .validate(10)
            .unwrap_err()
            .to_string()
            .contains("outside the vocabulary"));
        assert!(SamplingParams::default().validate(10).is_ok());
    }
}
