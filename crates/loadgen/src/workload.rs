//! What the benchmark sends: reproducible prompts and output lengths drawn from a seeded
//! generator. Prompts are common English words separated by spaces; each such word (with its
//! leading space) is one token in the BPE vocabularies of the usual open models, so a prompt of
//! N words is approximately N tokens — approximately, because the first word, the BOS token and
//! a chat template add or split a few.

use serde::Serialize;

use crate::error::LoadgenError;

/// SplitMix64 (Steele, Lea and Flood; Vigna's reference constants): tiny, fast, and the same
/// sequence on every platform, so a seed names a workload.
#[derive(Debug, Clone)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform integer in `0..bound` (`bound` > 0), by multiply-shift (Lemire; the bias is
    /// below 2^-50 for the bounds used here).
    pub fn below(&mut self, bound: usize) -> usize {
        ((u128::from(self.next_u64()) * bound as u128) >> 64) as usize
    }

    /// A uniform float in `[0, 1)`: the top 53 bits, as Python's `random()` has them.
    pub fn unit_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

/// Common English words, each a single token (with a leading space) in GPT-2, Llama and SmolLM
/// style BPE vocabularies.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "was", "for", "that", "on", "with", "as", "by", "at",
    "from", "his", "her", "it", "he", "she", "they", "we", "you", "this", "an", "be", "are", "or",
    "have", "has", "had", "not", "but", "what", "all", "were", "when", "there", "can", "more",
    "if", "no", "out", "so", "said", "up", "its", "about", "into", "than", "them", "only", "other",
    "new", "some", "could", "time", "these", "two", "may", "then", "do", "first", "any", "my",
    "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also",
    "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way",
    "well", "down", "should", "because", "each", "just", "those", "people", "how", "too", "little",
    "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get",
    "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know",
    "while", "last", "might", "us", "great", "old", "year", "off", "come", "since", "against",
    "go", "came", "right", "used", "take", "three", "house", "water", "light", "city", "river",
    "music", "family", "small", "large", "open", "early", "game", "story", "green", "black",
    "white", "red", "blue", "road", "table", "window", "paper", "school", "garden", "morning",
    "night", "summer", "winter", "friend", "mother", "father", "child", "book", "letter", "market",
    "field", "island", "forest", "animal", "bird", "fish", "horse", "stone", "fire", "sun", "moon",
    "star", "ship", "train", "car", "door", "wall", "street", "town", "country", "language",
    "history", "number", "question", "answer", "idea", "problem", "system", "power", "money",
    "company", "group", "service", "place", "point", "home", "hand", "part", "head", "side",
    "face", "name", "word", "line", "order", "kind", "area", "case", "fact", "week", "month",
    "level", "office", "health", "court", "body", "report",
];

/// The shape of the requests: mean lengths, how far each request may stray from them, and the
/// seed that makes the draw reproducible.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkloadConfig {
    /// Mean prompt length in tokens (approximately: one word per token).
    pub prompt_tokens: usize,
    /// Each prompt length is uniform in `prompt_tokens × (1 ± prompt_spread)`.
    pub prompt_spread: f64,
    /// Mean `max_tokens` of a request.
    pub output_tokens: usize,
    /// Each `max_tokens` is uniform in `output_tokens × (1 ± output_spread)`.
    pub output_spread: f64,
    pub seed: u64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            prompt_tokens: 256,
            prompt_spread: 0.0,
            output_tokens: 128,
            output_spread: 0.0,
            seed: 0,
        }
    }
}

/// One request of the workload, before it is sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedRequest {
    pub prompt: String,
    /// Words in `prompt`: the approximate prompt length in tokens.
    pub prompt_words: usize,
    pub max_tokens: usize,
}

impl WorkloadConfig {
    pub fn validate(&self) -> Result<(), LoadgenError> {
        for (name, mean) in [
            ("prompt_tokens", self.prompt_tokens),
            ("output_tokens", self.output_tokens),
        ] {
            if mean == 0 {
                return Err(LoadgenError::InvalidSetting {
                    name,
                    reason: "must be at least 1".to_string(),
                });
            }
        }
        for (name, spread) in [
            ("prompt_spread", self.prompt_spread),
            ("output_spread", self.output_spread),
        ] {
            if !(0.0..=1.0).contains(&spread) {
                return Err(LoadgenError::InvalidSetting {
                    name,
                    reason: format!("{spread} is not a fraction between 0 and 1"),
                });
            }
        }
        Ok(())
    }

    /// `count` requests of stream `stream`. The same seed, stream and count always give the same
    /// requests; distinct streams (the warm-up, each concurrency level) give distinct prompts, so
    /// that one level does not find its prompts in a server's prefix cache left by another.
    pub fn plan(&self, stream: u64, count: usize) -> Vec<PlannedRequest> {
        self.requests(stream).take(count).collect()
    }

    /// The endless requests of stream `stream`, drawn one at a time: [`plan`](Self::plan) for a
    /// run whose length is a duration, not a count.
    pub fn requests(&self, stream: u64) -> PlannedRequests {
        PlannedRequests {
            workload: self.clone(),
            rng: SplitMix64::new(self.seed ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03)),
        }
    }
}

/// The requests of one stream in order (see [`WorkloadConfig::requests`]); never ends.
#[derive(Debug, Clone)]
pub struct PlannedRequests {
    workload: WorkloadConfig,
    rng: SplitMix64,
}

impl Iterator for PlannedRequests {
    type Item = PlannedRequest;

    fn next(&mut self) -> Option<PlannedRequest> {
        let (workload, rng) = (&self.workload, &mut self.rng);
        let prompt_words = sample_length(rng, workload.prompt_tokens, workload.prompt_spread);
        let max_tokens = sample_length(rng, workload.output_tokens, workload.output_spread);
        let words: Vec<&str> = (0..prompt_words)
            .map(|_| WORDS[rng.below(WORDS.len())])
            .collect();
        Some(PlannedRequest {
            prompt: words.join(" "),
            prompt_words,
            max_tokens,
        })
    }
}

/// A length uniform over the integers in `mean × (1 ± spread)`, at least 1.
fn sample_length(rng: &mut SplitMix64, mean: usize, spread: f64) -> usize {
    let low = ((mean as f64 * (1.0 - spread)).round() as usize).max(1);
    let high = ((mean as f64 * (1.0 + spread)).round() as usize).max(low);
    low + rng.below(high - low + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        let mut rng = SplitMix64::new(1_234_567);
        assert_eq!(rng.next_u64(), 6_457_827_717_110_365_317);
        assert_eq!(rng.next_u64(), 3_203_168_211_198_807_973);
        assert_eq!(rng.next_u64(), 9_817_491_932_198_370_423);
    }

    #[test]
    fn below_stays_in_range_and_reaches_both_ends() {
        let mut rng = SplitMix64::new(3);
        let draws: Vec<usize> = (0..2000).map(|_| rng.below(5)).collect();
        assert!(draws.iter().all(|&d| d < 5));
        assert!(draws.contains(&0) && draws.contains(&4));
    }

    #[test]
    fn unit_floats_are_in_range_and_uniform() {
        let mut rng = SplitMix64::new(5);
        let draws: Vec<f64> = (0..10_000).map(|_| rng.unit_f64()).collect();
        assert!(draws.iter().all(|&u| (0.0..1.0).contains(&u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        let below_tenth = draws.iter().filter(|&&u| u < 0.1).count();
        assert!(
            (900..1100).contains(&below_tenth),
            "{below_tenth} below 0.1"
        );
    }

    #[test]
    fn words_are_distinct_single_words() {
        let mut sorted = WORDS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), WORDS.len());
        assert!(WORDS
            .iter()
            .all(|word| !word.is_empty() && word.chars().all(|c| c.is_ascii_lowercase())));
    }

    #[test]
    fn same_seed_and_stream_give_the_same_requests() {
        let config = WorkloadConfig {
            prompt_tokens: 40,
            prompt_spread: 0.5,
            output_tokens: 20,
            output_spread: 0.25,
            seed: 42,
        };
        assert_eq!(config.plan(1, 10), config.plan(1, 10));
        assert_ne!(config.plan(1, 10), config.plan(2, 10));
        let other_seed = WorkloadConfig {
            seed: 43,
            ..config.clone()
        };
        assert_ne!(config.plan(1, 10), other_seed.plan(1, 10));
        // A longer plan starts with the shorter one, and the endless stream with both.
        assert_eq!(config.plan(1, 20)[..10], config.plan(1, 10)[..]);
        let drawn: Vec<PlannedRequest> = config.requests(1).take(20).collect();
        assert_eq!(drawn, config.plan(1, 20));
    }

    #[test]
    fn no_spread_gives_exact_lengths() {
        let config = WorkloadConfig {
            prompt_tokens: 64,
            output_tokens: 32,
            ..WorkloadConfig::default()
        };
        for request in config.plan(0, 20) {
            assert_eq!(request.prompt_words, 64);
            assert_eq!(request.prompt.split(' ').count(), 64);
            assert_eq!(request.max_tokens, 32);
        }
    }

    #[test]
    fn spread_stays_within_bounds_and_varies() {
        let config = WorkloadConfig {
            prompt_tokens: 100,
            prompt_spread: 0.5,
            output_tokens: 10,
            output_spread: 1.0,
            seed: 9,
        };
        let plan = config.plan(5, 400);
        let prompt_lengths: Vec<usize> = plan.iter().map(|r| r.prompt_words).collect();
        assert!(prompt_lengths.iter().all(|&n| (50..=150).contains(&n)));
        let mean = prompt_lengths.iter().sum::<usize>() as f64 / plan.len() as f64;
        assert!((90.0..110.0).contains(&mean), "mean prompt length {mean}");
        assert!(plan.iter().all(|r| (1..=20).contains(&r.max_tokens)));
        assert!(plan.iter().any(|r| r.max_tokens == 1) && plan.iter().any(|r| r.max_tokens == 20));
        for request in &plan {
            assert_eq!(request.prompt.split(' ').count(), request.prompt_words);
        }
    }

    #[test]
    fn invalid_settings_are_rejected() {
        let zero = WorkloadConfig {
            output_tokens: 0,
            ..WorkloadConfig::default()
        };
        assert!(zero.validate().is_err());
        let wide = WorkloadConfig {
            prompt_spread: 1.5,
            ..WorkloadConfig::default()
        };
        assert!(wide.validate().is_err());
        assert!(WorkloadConfig::default().validate().is_ok());
    }
}
