//! Attention export: for the layers and query heads a request names, the `top_k` input positions
//! each head attends to most when it computes a generated token, with their softmax weights.
//!
//! The paged-attention kernel computes every score anyway; for the rows a request captures it
//! also selects the top keys per head ([`kernels::paged::Capture`]), so only exporting requests
//! pay, and they pay a selection per head, never a second pass or a whole attention matrix. A
//! generated token's row is the one whose logits drew it: the prompt's last row for the first
//! token, the previous token's row after it.
//!
//! What is exported can be checked later: [`AttentionDigest`] hashes it with the model version's
//! digest, the sampling seed and the kernel's identity, and the request's audit entry keeps that
//! hash.

use kernels::paged::Attended;
use sha2::{Digest, Sha256};

use crate::model::ModelConfig;

/// The most keys a head may export per token.
pub const MAX_TOP_K: usize = 64;

/// What the kernels' build, SIMD level, threads and KV element type contribute to a replay's
/// identity: the same weights through another SIMD level, or keys kept in another type, round
/// differently, so a replay compares digests only under the same identity.
pub fn kernel_identity(backend: &dyn kernels::Backend, kv: kernels::KvDType) -> String {
    format!(
        "rampart-kernels {} {}, kv {kv}",
        env!("CARGO_PKG_VERSION"),
        backend.describe()
    )
}

/// A request's attention export.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionRequest {
    /// Layers, ascending, each below the model's layer count.
    pub layers: Vec<usize>,
    /// Query heads, ascending, each below the model's head count.
    pub heads: Vec<usize>,
    /// Keys per head and token (1..=[`MAX_TOP_K`]).
    pub top_k: usize,
    /// Indices of the generated tokens to export (the first generated token is 0); none: every
    /// generated token.
    pub positions: Option<Vec<usize>>,
}

impl AttentionRequest {
    /// The defaults: the last two layers (where attention follows the output most closely in
    /// decoder models), every query head, the top 8 keys, every generated token.
    pub fn defaults(config: &ModelConfig) -> Self {
        Self {
            layers: (config.block_count.saturating_sub(2)..config.block_count).collect(),
            heads: (0..config.heads).collect(),
            top_k: 8,
            positions: None,
        }
    }

    /// Entries one exported token carries.
    pub fn entries_per_token(&self) -> usize {
        self.layers.len() * self.heads.len() * self.top_k
    }

    /// Tokens exported for a completion of at most `max_tokens`.
    pub fn tokens(&self, max_tokens: usize) -> usize {
        self.positions.as_ref().map_or(max_tokens, |p| {
            p.iter().filter(|&&i| i < max_tokens).count()
        })
    }

    /// Whether generated token `index` is exported.
    pub fn wants(&self, index: usize) -> bool {
        self.positions
            .as_ref()
            .is_none_or(|p| p.binary_search(&index).is_ok())
    }

    /// Sorts and deduplicates the lists, then checks them against the model and the bound on
    /// entries per request (layers × heads × top_k × exported tokens).
    pub fn normalize(
        &mut self,
        config: &ModelConfig,
        max_tokens: usize,
        max_entries: usize,
    ) -> Result<(), String> {
        for list in [&mut self.layers, &mut self.heads] {
            list.sort_unstable();
            list.dedup();
        }
        if let Some(p) = &mut self.positions {
            p.sort_unstable();
            p.dedup();
            if p.is_empty() {
                return Err("explain.attention.positions is empty".into());
            }
        }
        if self.layers.is_empty() || self.heads.is_empty() {
            return Err("explain.attention needs at least one layer and one head".into());
        }
        if let Some(&l) = self.layers.iter().find(|&&l| l >= config.block_count) {
            return Err(format!(
                "explain.attention.layers: layer {l} is outside the model's {} layers (0..{})",
                config.block_count,
                config.block_count - 1
            ));
        }
        if let Some(&h) = self.heads.iter().find(|&&h| h >= config.heads) {
            return Err(format!(
                "explain.attention.heads: head {h} is outside the model's {} query heads (0..{})",
                config.heads,
                config.heads - 1
            ));
        }
        if self.top_k == 0 || self.top_k > MAX_TOP_K {
            return Err(format!(
                "explain.attention.top_k must be between 1 and {MAX_TOP_K}, not {}",
                self.top_k
            ));
        }
        let entries = self.entries_per_token() * self.tokens(max_tokens);
        if entries > max_entries {
            return Err(format!(
                "explain.attention asks for up to {entries} weights ({} layers × {} heads × top {} × {} tokens); the limit is {max_entries}: ask for fewer layers, heads, keys or positions, or a lower max_tokens",
                self.layers.len(),
                self.heads.len(),
                self.top_k,
                self.tokens(max_tokens)
            ));
        }
        Ok(())
    }
}

/// What a replay needs of a request besides its input (which the audit entry keeps): the
/// sampling exactly as the engine ran it, the resolved `max_tokens`, the attention request and
/// the prompt's kind. `prompt` is `chat`, `text` (control-token texts parsed) or `plain_text`.
pub fn replay_settings(request: &crate::GenerateRequest) -> serde_json::Value {
    let s = &request.sampling;
    let a = request.attention.as_ref();
    serde_json::json!({
        "prompt": match request.prompt {
            crate::Prompt::Chat(_) => "chat",
            crate::Prompt::Text(_) => "text",
            crate::Prompt::PlainText(_) => "plain_text",
            crate::Prompt::Tokens(_) => "tokens",
        },
        "max_tokens": request.max_tokens,
        "ignore_eos": request.ignore_eos,
        "stop": request.stop,
        "temperature": s.temperature.to_bits(),
        "top_k": s.top_k,
        "top_p": s.top_p.to_bits(),
        "min_p": s.min_p.to_bits(),
        "repetition_penalty": s.repetition_penalty.to_bits(),
        "frequency_penalty": s.frequency_penalty.to_bits(),
        "presence_penalty": s.presence_penalty.to_bits(),
        "logit_bias": s.logit_bias.iter().map(|(id, b)| (id, b.to_bits())).collect::<Vec<_>>(),
        "seed": s.seed,
        "layers": a.map(|a| a.layers.clone()),
        "heads": a.map(|a| a.heads.clone()),
        "top_k_keys": a.map(|a| a.top_k),
        "positions": a.and_then(|a| a.positions.clone()),
    })
}

/// A request rebuilt from [`replay_settings`] and its prompt: what `rampart explain verify`
/// runs again.
pub fn replay_request(
    settings: &serde_json::Value,
    prompt: crate::Prompt,
) -> Result<crate::GenerateRequest, String> {
    let bits = |k: &str| -> Result<f32, String> {
        settings[k]
            .as_u64()
            .and_then(|b| u32::try_from(b).ok())
            .map(f32::from_bits)
            .ok_or_else(|| format!("the replay settings lack {k}"))
    };
    let count = |k: &str| -> Result<usize, String> {
        settings[k]
            .as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| format!("the replay settings lack {k}"))
    };
    let list = |k: &str| -> Result<Vec<usize>, String> {
        serde_json::from_value(settings[k].clone())
            .map_err(|e| format!("the replay settings' {k}: {e}"))
    };
    let mut request = crate::GenerateRequest::new(prompt, count("max_tokens")?);
    request.ignore_eos = settings["ignore_eos"].as_bool().unwrap_or(false);
    request.stop = serde_json::from_value(settings["stop"].clone()).unwrap_or_default();
    let s = &mut request.sampling;
    s.temperature = bits("temperature")?;
    s.top_k = count("top_k")?;
    s.top_p = bits("top_p")?;
    s.min_p = bits("min_p")?;
    s.repetition_penalty = bits("repetition_penalty")?;
    s.frequency_penalty = bits("frequency_penalty")?;
    s.presence_penalty = bits("presence_penalty")?;
    s.logit_bias = serde_json::from_value::<Vec<(u32, u32)>>(settings["logit_bias"].clone())
        .map_err(|e| format!("the replay settings' logit_bias: {e}"))?
        .into_iter()
        .map(|(id, b)| (id, f32::from_bits(b)))
        .collect();
    s.seed = settings["seed"].as_u64();
    request.attention = Some(AttentionRequest {
        layers: list("layers")?,
        heads: list("heads")?,
        top_k: count("top_k_keys")?,
        positions: serde_json::from_value(settings["positions"].clone()).unwrap_or(None),
    });
    Ok(request)
}

/// The spans of `text` an occlusion removes one at a time: its sentences and clauses (cut after
/// `. ! ? ; : ,`, their CJK forms and line breaks), trimmed of spaces, as byte ranges; when there
/// are more than `max`, neighbours are joined into `max` spans of about as many pieces each.
pub fn segments(text: &str, max: usize) -> Vec<std::ops::Range<usize>> {
    let mut pieces = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if matches!(
            c,
            '.' | '!' | '?' | ';' | ':' | ',' | '\n' | '。' | '！' | '？' | '；' | '，' | '、'
        ) {
            pieces.push(start..i + c.len_utf8());
            start = i + c.len_utf8();
        }
    }
    pieces.push(start..text.len());
    let trimmed: Vec<std::ops::Range<usize>> = pieces
        .into_iter()
        .filter_map(|r| {
            let s = &text[r.clone()];
            let lead = s.len() - s.trim_start().len();
            let trail = s.len() - s.trim_end().len();
            let (a, b) = (r.start + lead, r.end - trail);
            // A piece with no letter or digit (a lone comma) is no reason.
            text[a..b.max(a)]
                .chars()
                .any(char::is_alphanumeric)
                .then_some(a..b)
        })
        .collect();
    let max = max.max(1);
    if trimmed.len() <= max {
        return trimmed;
    }
    let per = trimmed.len().div_ceil(max);
    trimmed
        .chunks(per)
        .map(|g| g[0].start..g[g.len() - 1].end)
        .collect()
}

/// `text` without the byte ranges `removed` (sorted, not overlapping), each replaced by a
/// space where it separated two words.
pub fn without(text: &str, removed: &[std::ops::Range<usize>]) -> String {
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    for r in removed {
        out.push_str(&text[at..r.start]);
        if !out.is_empty() && !out.ends_with(char::is_whitespace) {
            out.push(' ');
        }
        at = r.end;
    }
    out.push_str(text[at..].trim_start());
    out.trim().to_string()
}

/// One reason: a verbatim span of the occluded message (byte offsets into its content) and how
/// much removing it lowers the answer's log-probability (nats; negative: the answer got likelier).
#[derive(Debug, Clone, PartialEq)]
pub struct Reason {
    pub start: usize,
    pub end: usize,
    pub text: String,
    pub drop: f64,
}

/// The faithful reasons of an answer, by occlusion.
#[derive(Debug, Clone, PartialEq)]
pub struct Occlusion {
    /// The message whose content was occluded (the last user message).
    pub message: usize,
    /// Up to three, the largest drop first.
    pub reasons: Vec<Reason>,
    /// Spans tried (each one prompt scored).
    pub segments: usize,
    /// The answer's log-probability with the whole input, without the reasons, and without
    /// as many random spans of the same lengths (the deletion check).
    pub logprob: f64,
    pub without_reasons: f64,
    pub without_random: f64,
    /// Prompts scored in all.
    pub scored: usize,
}

/// The three spans of the last user message whose removal lowers the answer's probability most
/// (one scoring pass per span, at most `max_segments`), and the deletion check: the answer's
/// probability without all three against without three random spans of the same lengths
/// (chosen with `seed`). With `labels` (the answer one of them: a classifier's), the answer's
/// probability is the one a decoder held to the labels gives it (each token among those that
/// continue a label; the labels' own tokenizations); without, the probability of its text.
pub fn occlusion(
    engine: &crate::Engine,
    messages: &[crate::ChatMessage],
    answer: &Answer<'_>,
    max_segments: usize,
    seed: u64,
) -> Result<Occlusion, crate::EngineError> {
    use crate::EngineError;
    let message = messages
        .iter()
        .rposition(|m| m.role == "user")
        .ok_or_else(|| EngineError::InvalidRequest("reasons need a user message".into()))?;
    let text = messages[message].content.clone();
    // The tokens scored, and what each was drawn among.
    let (path, allowed) = match answer.labels {
        Some(labels) => {
            if answer.ids.is_empty() {
                return Err(EngineError::InvalidRequest(
                    "reasons for a label need the answer's tokens".into(),
                ));
            }
            let allowed = label_steps(engine.tokenizer(), answer.ids, labels)?;
            (answer.ids.to_vec(), allowed)
        }
        None => {
            let ids = engine.tokenizer().encode_plain(answer.text, false)?;
            let all = vec![Vec::new(); ids.len()];
            (ids, all)
        }
    };
    if path.is_empty() {
        return Err(EngineError::InvalidRequest(
            "reasons need a non-empty answer".into(),
        ));
    }
    let mut scored = 0;
    let mut score = |content: &str| -> Result<f64, EngineError> {
        let mut variant = messages.to_vec();
        variant[message].content = content.to_string();
        scored += 1;
        engine.score_path(&engine.encode_chat(&variant)?, &path, &allowed)
    };
    let logprob = score(&text)?;
    let spans = segments(&text, max_segments);
    let mut tried = Vec::with_capacity(spans.len());
    for span in &spans {
        let drop = logprob - score(&without(&text, std::slice::from_ref(span)))?;
        tried.push(Reason {
            start: span.start,
            end: span.end,
            text: text[span.clone()].to_string(),
            drop,
        });
    }
    tried.sort_by(|a, b| b.drop.total_cmp(&a.drop).then(a.start.cmp(&b.start)));
    tried.truncate(3);
    let mut removed: Vec<std::ops::Range<usize>> = tried.iter().map(|r| r.start..r.end).collect();
    removed.sort_by_key(|r| r.start);
    let without_reasons = score(&without(&text, &removed))?;
    let random = random_spans(&text, &removed, seed);
    let without_random = score(&without(&text, &random))?;
    Ok(Occlusion {
        message,
        reasons: tried,
        segments: spans.len(),
        logprob,
        without_reasons,
        without_random,
        scored,
    })
}

/// The answer whose reasons are asked.
pub struct Answer<'a> {
    pub text: &'a str,
    /// The tokens the decoder drew (needed with `labels`).
    pub ids: &'a [u32],
    /// A label answer's labels (`guided_choice`): the answer's probability is then the one the
    /// decoder held to them gives the tokens it drew, each among the tokens that keep the
    /// output a prefix of some label; without, the probability of the text's own tokens.
    pub labels: Option<&'a [String]>,
}

/// Per token of `ids` (a decoded label), the tokens a decoder held to `labels` could draw there:
/// those whose text keeps the output so far a prefix of some label. Once one label alone fits
/// what was drawn, the rest is forced (the constraint writes it without a draw): the step's set
/// is the drawn token alone, probability 1.
fn label_steps(
    tokenizer: &crate::tokenizer::Tokenizer,
    ids: &[u32],
    labels: &[String],
) -> Result<Vec<Vec<u32>>, crate::EngineError> {
    let vocab = tokenizer.vocab_size() as u32;
    let mut so_far: Vec<u8> = Vec::new();
    let mut steps = Vec::with_capacity(ids.len());
    for &id in ids {
        let open = labels
            .iter()
            .filter(|l| l.as_bytes().starts_with(&so_far))
            .count();
        if open == 1 && !so_far.is_empty() {
            so_far.extend_from_slice(tokenizer.token_bytes(id));
            steps.push(vec![id]);
            continue;
        }
        let allowed: Vec<u32> = (0..vocab)
            .filter(|&t| {
                let piece = tokenizer.token_bytes(t);
                !piece.is_empty()
                    && labels.iter().any(|l| {
                        let l = l.as_bytes();
                        l.len() >= so_far.len() + piece.len()
                            && l.starts_with(&so_far)
                            && l[so_far.len()..].starts_with(piece)
                    })
            })
            .collect();
        if !allowed.contains(&id) {
            return Err(crate::EngineError::InvalidRequest(format!(
                "the answer's token {id} does not continue any label"
            )));
        }
        so_far.extend_from_slice(tokenizer.token_bytes(id));
        steps.push(allowed);
    }
    if !labels.iter().any(|l| l.as_bytes() == so_far.as_slice()) {
        return Err(crate::EngineError::InvalidRequest(
            "the answer is not one of the labels".into(),
        ));
    }
    Ok(steps)
}

/// Spans of `text` as long as `like`'s (bytes, moved to character boundaries), at random places
/// that do not overlap one another, sorted.
fn random_spans(
    text: &str,
    like: &[std::ops::Range<usize>],
    seed: u64,
) -> Vec<std::ops::Range<usize>> {
    let mut rng = kernels::rng::SplitMix64::new(seed);
    let mut out: Vec<std::ops::Range<usize>> = Vec::new();
    for r in like {
        let len = r.end - r.start;
        for _ in 0..64 {
            let room = text.len().saturating_sub(len);
            let mut start = (rng.next_u64() % (room as u64 + 1)) as usize;
            while !text.is_char_boundary(start) {
                start -= 1;
            }
            let mut end = (start + len).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            if out.iter().all(|o| end <= o.start || start >= o.end) {
                out.push(start..end);
                break;
            }
        }
    }
    out.sort_by_key(|r| r.start);
    out
}

/// The hash of one request's export, built token by token: what the audit entry keeps and a
/// replay recomputes.
pub struct AttentionDigest {
    hash: Sha256,
}

impl AttentionDigest {
    /// A digest over the export of `request` by the model version `version_digest` with
    /// sampling `seed` (none: unseeded) under `kernel` ([`kernel_identity`]).
    pub fn new(
        request: &AttentionRequest,
        version_digest: &str,
        seed: Option<u64>,
        kernel: &str,
    ) -> Self {
        let mut hash = Sha256::new();
        hash.update(b"rampart-attention-v1\0");
        for part in [version_digest, kernel] {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part.as_bytes());
        }
        hash.update(seed.map_or([0xff; 8], u64::to_le_bytes));
        for list in [&request.layers, &request.heads] {
            hash.update((list.len() as u64).to_le_bytes());
            for &x in list {
                hash.update((x as u64).to_le_bytes());
            }
        }
        hash.update((request.top_k as u64).to_le_bytes());
        Self { hash }
    }

    /// Adds generated token `index`'s entries (layers × heads × top_k, as exported).
    pub fn token(&mut self, index: usize, entries: &[Attended]) {
        self.hash.update((index as u64).to_le_bytes());
        self.hash.update((entries.len() as u64).to_le_bytes());
        for e in entries {
            self.hash.update(e.position.to_le_bytes());
            self.hash.update(e.weight.to_bits().to_le_bytes());
        }
    }

    /// The digest so far, shortened to 16 hex digits: one per token, so a replay that differs
    /// names the first token that does.
    pub fn step(&self) -> String {
        hex::encode(&self.hash.clone().finalize()[..8])
    }

    /// `sha256:` and the hex digest.
    pub fn finish(self) -> String {
        format!("sha256:{}", hex::encode(self.hash.finalize()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ModelConfig {
        ModelConfig {
            architecture: "llama".into(),
            block_count: 4,
            hidden: 48,
            ffn: 96,
            heads: 6,
            kv_heads: 2,
            head_dim: 8,
            context_length: 256,
            vocab_size: 300,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_dims: 8,
            rope_scaling: kernels::ops::RopeScaling::None,
            sliding_window: None,
            query_pre_attn_scalar: None,
        }
    }

    #[test]
    fn requests_are_normalized_and_bounded() {
        let c = config();
        let mut r = AttentionRequest::defaults(&c);
        assert_eq!(r.layers, vec![2, 3]);
        assert_eq!(r.heads.len(), 6);
        r.normalize(&c, 100, 2 * 6 * 8 * 100).unwrap();
        let err = r.normalize(&c, 100, 2 * 6 * 8 * 100 - 1).unwrap_err();
        assert!(err.contains("9600") && err.contains("limit"), "{err}");
        r.positions = Some(vec![5, 1, 5, 400]);
        r.normalize(&c, 100, 2 * 6 * 8 * 2).unwrap();
        assert_eq!(r.positions, Some(vec![1, 5, 400]));
        assert!(r.wants(5) && !r.wants(2));
        let mut bad = r.clone();
        bad.layers = vec![4];
        assert!(bad
            .normalize(&c, 10, usize::MAX)
            .unwrap_err()
            .contains("layer 4"));
        let mut bad = r.clone();
        bad.heads = vec![0, 6];
        assert!(bad
            .normalize(&c, 10, usize::MAX)
            .unwrap_err()
            .contains("head 6"));
        let mut bad = r.clone();
        bad.top_k = MAX_TOP_K + 1;
        assert!(bad
            .normalize(&c, 10, usize::MAX)
            .unwrap_err()
            .contains("top_k"));
        let mut bad = r;
        bad.positions = Some(Vec::new());
        assert!(bad.normalize(&c, 10, usize::MAX).is_err());
    }

    #[test]
    fn segments_are_clauses_trimmed_and_joined_to_the_limit() {
        let text = "My parcel is late. It was due Monday, and nobody answers!  Refund me?";
        let s = segments(text, 10);
        let parts: Vec<&str> = s.iter().map(|r| &text[r.clone()]).collect();
        assert_eq!(
            parts,
            vec![
                "My parcel is late.",
                "It was due Monday,",
                "and nobody answers!",
                "Refund me?"
            ]
        );
        let joined = segments(text, 2);
        assert_eq!(joined.len(), 2);
        assert_eq!(
            &text[joined[0].clone()],
            "My parcel is late. It was due Monday,"
        );
        let cjk = "包裹没到。我要退款！";
        let parts: Vec<&str> = segments(cjk, 8).iter().map(|r| &cjk[r.clone()]).collect();
        assert_eq!(parts, vec!["包裹没到。", "我要退款！"]);
        assert_eq!(
            without(text, &[s[1].clone()]),
            "My parcel is late. and nobody answers!  Refund me?"
        );
        assert_eq!(
            without(text, &[s[0].clone(), s[3].clone()]),
            "It was due Monday, and nobody answers!"
        );
    }

    #[test]
    fn replay_settings_rebuild_the_request() {
        let mut request = crate::GenerateRequest::new(crate::Prompt::Chat(Vec::new()), 17);
        request.sampling.temperature = 0.7;
        request.sampling.top_p = 0.9;
        request.sampling.seed = Some(u64::MAX - 3);
        request.sampling.logit_bias = vec![(5, -1.5)];
        request.stop = vec!["END".into()];
        request.attention = Some(AttentionRequest {
            layers: vec![1, 3],
            heads: vec![0],
            top_k: 4,
            positions: Some(vec![2]),
        });
        let settings = replay_settings(&request);
        let text = settings.to_string();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        let again = replay_request(&back, crate::Prompt::Chat(Vec::new())).unwrap();
        assert_eq!(again.sampling, request.sampling);
        assert_eq!(again.max_tokens, 17);
        assert_eq!(again.stop, request.stop);
        assert_eq!(again.attention, request.attention);
        assert_eq!(back["prompt"], "chat");
    }

    #[test]
    fn the_digest_changes_with_any_weight_bit() {
        let r = AttentionRequest::defaults(&config());
        let entries = vec![
            Attended {
                position: 3,
                weight: 0.5,
            },
            Attended {
                position: 1,
                weight: 0.25,
            },
        ];
        let digest = |e: &[Attended], seed| {
            let mut d = AttentionDigest::new(&r, "sha256:ab", seed, "k");
            d.token(0, e);
            d.finish()
        };
        let base = digest(&entries, Some(1));
        assert_eq!(base, digest(&entries, Some(1)));
        let mut changed = entries.clone();
        changed[1].weight = f32::from_bits(changed[1].weight.to_bits() + 1);
        assert_ne!(base, digest(&changed, Some(1)));
        assert_ne!(base, digest(&entries, None));
        assert!(base.starts_with("sha256:") && base.len() == 7 + 64);
    }
}
