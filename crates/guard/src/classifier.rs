//! The guard's classifier tier: a small MLP head over a sentence embedding (the all-MiniLM-L6-v2
//! embedding Rampart already serves), scored on segments of the input, the score the maximum.
//!
//! The head is a safetensors file of six f32 tensors, `w_h1 [256, 384]`, `b_h1 [256]`,
//! `w_h2 [128, 256]`, `b_h2 [128]`, `w_out [1, 128]`, `b_out [1]`: ReLU, ReLU, sigmoid, on the
//! mean-pooled, L2-normalised embedding. `scripts/fetch-models.sh` ports the jailguard head
//! (MIT or Apache-2.0) to that file; any head of those shapes (or other widths) works.
//!
//! The embedder is the caller's ([`Embed`]): this crate holds no model runtime.

use std::path::Path;
use std::sync::Arc;

/// What the classifier needs of an embedding model.
pub trait Embed: Send + Sync {
    /// One embedding per text, in order (mean-pooled and L2-normalised, as the head expects).
    fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError>;
    /// Tokens of `text` in the embedder's vocabulary (with its special tokens).
    fn count_tokens(&self, text: &str) -> usize;
}

/// Why the embedder could not embed: the caller's own error.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct EmbedError(pub Box<dyn std::error::Error + Send + Sync>);

impl EmbedError {
    pub fn new(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Self(error.into())
    }
}

/// Why bytes are not a head (see the module's documentation for the layout).
#[derive(Debug, thiserror::Error)]
pub enum HeadFormatError {
    #[error("not safetensors: {0}")]
    NotSafetensors(#[source] safetensors::SafeTensorError),
    #[error("tensor {name} is missing")]
    MissingTensor { name: String },
    #[error("tensor {name} is {dtype:?}, not F32")]
    NotF32 {
        name: String,
        dtype: safetensors::Dtype,
    },
    #[error("tensor {name} has shape {shape:?}, not [out, in]")]
    WeightShape { name: String, shape: Vec<usize> },
    #[error("tensor {name} has shape {shape:?}, not [{outputs}]")]
    BiasShape {
        name: String,
        shape: Vec<usize>,
        outputs: usize,
    },
    #[error("tensor {name} takes {inputs} inputs, the layer before gives {before:?}")]
    Width {
        name: String,
        inputs: usize,
        before: Option<usize>,
    },
    #[error("tensor {weight} or {bias} holds a non-finite value")]
    NonFinite { weight: String, bias: String },
    #[error("the last layer gives {outputs:?} outputs, not 1")]
    Outputs { outputs: Option<usize> },
}

/// Why texts could not be scored.
#[derive(Debug, thiserror::Error)]
pub enum ClassifyError {
    #[error(transparent)]
    Embed(#[from] EmbedError),
    #[error("the embedder returned {embeddings} embeddings for {segments} segments")]
    EmbeddingCount { embeddings: usize, segments: usize },
    #[error("the embedding has {dimensions} dimensions, the head takes {inputs}")]
    EmbeddingWidth { dimensions: usize, inputs: usize },
}

/// Why a head cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("classifier head {path}: {message}")]
pub struct HeadError {
    pub path: String,
    pub message: String,
}

#[derive(Debug, Clone)]
struct Dense {
    /// `out × in`, row-major.
    weight: Vec<f32>,
    bias: Vec<f32>,
    inputs: usize,
}

impl Dense {
    fn apply(&self, x: &[f32], relu: bool) -> Vec<f32> {
        self.bias
            .iter()
            .enumerate()
            .map(|(o, b)| {
                let row = &self.weight[o * self.inputs..(o + 1) * self.inputs];
                let v = b + dot(row, x);
                if relu {
                    v.max(0.0)
                } else {
                    v
                }
            })
            .collect()
    }
}

/// Four-lane dot product (the compiler vectorises it; the head is 131k multiply-adds, so this
/// is never the cost: the embedding is).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for k in 0..8 {
            acc[k] += a[i * 8 + k] * b[i * 8 + k];
        }
    }
    let mut sum: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

/// The MLP head.
#[derive(Debug, Clone)]
pub struct Head {
    layers: Vec<Dense>,
}

impl Head {
    /// Reads a head from its safetensors file.
    pub fn load(path: &Path) -> Result<Self, HeadError> {
        let bad = |message: String| HeadError {
            path: path.display().to_string(),
            message,
        };
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        Self::from_safetensors(&bytes).map_err(|e| bad(e.to_string()))
    }

    /// Parses a head from safetensors bytes.
    pub fn from_safetensors(bytes: &[u8]) -> Result<Self, HeadFormatError> {
        let tensors = safetensors::SafeTensors::deserialize(bytes)
            .map_err(HeadFormatError::NotSafetensors)?;
        let read = |name: &str| -> Result<(Vec<usize>, Vec<f32>), HeadFormatError> {
            let t = tensors
                .tensor(name)
                .map_err(|_| HeadFormatError::MissingTensor {
                    name: name.to_string(),
                })?;
            if t.dtype() != safetensors::Dtype::F32 {
                return Err(HeadFormatError::NotF32 {
                    name: name.to_string(),
                    dtype: t.dtype(),
                });
            }
            let values = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Ok((t.shape().to_vec(), values))
        };
        let mut layers = Vec::new();
        let mut width = None;
        for (w, b) in [("w_h1", "b_h1"), ("w_h2", "b_h2"), ("w_out", "b_out")] {
            let (shape, weight) = read(w)?;
            let (bias_shape, bias) = read(b)?;
            let [outputs, inputs] = shape[..] else {
                return Err(HeadFormatError::WeightShape {
                    name: w.to_string(),
                    shape,
                });
            };
            if bias_shape != [outputs] {
                return Err(HeadFormatError::BiasShape {
                    name: b.to_string(),
                    shape: bias_shape,
                    outputs,
                });
            }
            if width.is_some_and(|w| w != inputs) {
                return Err(HeadFormatError::Width {
                    name: w.to_string(),
                    inputs,
                    before: width,
                });
            }
            if weight.iter().chain(&bias).any(|v| !v.is_finite()) {
                return Err(HeadFormatError::NonFinite {
                    weight: w.to_string(),
                    bias: b.to_string(),
                });
            }
            width = Some(outputs);
            layers.push(Dense {
                weight,
                bias,
                inputs,
            });
        }
        if width != Some(1) {
            return Err(HeadFormatError::Outputs { outputs: width });
        }
        Ok(Self { layers })
    }

    /// The embedding width the head takes.
    pub fn inputs(&self) -> usize {
        self.layers[0].inputs
    }

    /// The injection probability of one embedding.
    pub fn score(&self, embedding: &[f32]) -> Result<f32, ClassifyError> {
        if embedding.len() != self.inputs() {
            return Err(ClassifyError::EmbeddingWidth {
                dimensions: embedding.len(),
                inputs: self.inputs(),
            });
        }
        let mut x = embedding.to_vec();
        let last = self.layers.len() - 1;
        for (i, layer) in self.layers.iter().enumerate() {
            x = layer.apply(&x, i < last);
        }
        let logit = x[0];
        Ok(1.0 / (1.0 + (-logit).exp()))
    }
}

/// Splits `text` into segments of at most `max_tokens` tokens: sentences packed together, a
/// sentence longer than that cut into overlapping word windows. A text that fits is one segment.
pub fn segments<'a>(
    text: &'a str,
    max_tokens: usize,
    count: &dyn Fn(&str) -> usize,
) -> Vec<&'a str> {
    let text = text.trim();
    if text.is_empty() {
        return Vec::new();
    }
    if count(text) <= max_tokens {
        return vec![text];
    }
    let mut sentences: Vec<&str> = Vec::new();
    let mut start = 0;
    for (i, c) in text.char_indices() {
        if matches!(c, '.' | '!' | '?' | '\n' | '。' | '！' | '？' | ';' | '；') {
            let end = i + c.len_utf8();
            if text[start..end].trim().len() > 1 {
                sentences.push(&text[start..end]);
                start = end;
            }
        }
    }
    if start < text.len() && !text[start..].trim().is_empty() {
        sentences.push(&text[start..]);
    }
    let mut out: Vec<&str> = Vec::new();
    let mut current: Option<(usize, usize, usize)> = None; // (start, end, tokens)
    let offset = |s: &str| s.as_ptr() as usize - text.as_ptr() as usize;
    for s in sentences {
        let n = count(s);
        let (s_start, s_end) = (offset(s), offset(s) + s.len());
        if n > max_tokens {
            if let Some((a, b, _)) = current.take() {
                out.push(text[a..b].trim());
            }
            out.extend(windows(s, max_tokens, count));
            continue;
        }
        current = match current {
            Some((a, _, t)) if t + n <= max_tokens => Some((a, s_end, t + n)),
            Some((a, b, _)) => {
                out.push(text[a..b].trim());
                Some((s_start, s_end, n))
            }
            None => Some((s_start, s_end, n)),
        };
    }
    if let Some((a, b, _)) = current {
        out.push(text[a..b].trim());
    }
    out.retain(|s| !s.is_empty());
    out
}

/// Word windows of about `max_tokens` tokens with a quarter of overlap (a sentence with no
/// sentence breaks: code, a list, a run-on instruction).
fn windows<'a>(s: &'a str, max_tokens: usize, count: &dyn Fn(&str) -> usize) -> Vec<&'a str> {
    let words: Vec<(usize, usize)> = s
        .split_whitespace()
        .map(|w| {
            let start = w.as_ptr() as usize - s.as_ptr() as usize;
            (start, start + w.len())
        })
        .collect();
    if words.is_empty() {
        return Vec::new();
    }
    // Tokens per word on this sentence, so windows need one count each.
    let per_word = (count(s) as f64 / words.len() as f64).max(1.0);
    let size = ((max_tokens as f64 / per_word) as usize).max(1);
    let step = (size * 3 / 4).max(1);
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        let end = (i + size).min(words.len());
        out.push(&s[words[i].0..words[end - 1].1]);
        if end == words.len() {
            break;
        }
        i += step;
    }
    out
}

/// Segment scores already computed, by the segment's text: a conversation's earlier turns come
/// back with every request, and each is embedded once. The key is the whole text (compared,
/// not only hashed, and hashed with the process's random keys), so no tenant can plant a score
/// for another's text by finding a colliding hash.
#[derive(Debug, Default)]
struct ScoreCache {
    scores: std::collections::HashMap<Arc<str>, f32>,
    order: std::collections::VecDeque<Arc<str>>,
}

/// Segments whose scores are kept (each at most `segment_tokens` tokens of text: about 2.5 MB
/// at 128 tokens).
const CACHED_SEGMENTS: usize = 4096;

impl ScoreCache {
    fn get(&self, segment: &str) -> Option<f32> {
        self.scores.get(segment).copied()
    }

    fn put(&mut self, segment: &str, score: f32) {
        if self.scores.contains_key(segment) {
            return;
        }
        let key: Arc<str> = Arc::from(segment);
        self.scores.insert(Arc::clone(&key), score);
        self.order.push_back(key);
        if self.order.len() > CACHED_SEGMENTS {
            if let Some(old) = self.order.pop_front() {
                self.scores.remove(&old);
            }
        }
    }
}

/// The head on an embedder: scores texts by their most suspicious segment.
pub struct Classifier {
    head: Head,
    embedder: Box<dyn Embed>,
    cache: std::sync::Mutex<ScoreCache>,
    /// Tokens per segment (the head was trained on the first 128 tokens of its inputs).
    pub segment_tokens: usize,
    /// Most segments scored per text; a longer text is scored on its first and last ones and
    /// an even spread between (the rules tier still reads all of it).
    pub max_segments: usize,
}

impl std::fmt::Debug for Classifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Classifier")
            .field("segment_tokens", &self.segment_tokens)
            .field("max_segments", &self.max_segments)
            .finish_non_exhaustive()
    }
}

/// A classifier score with the segment that gave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub score: f32,
    /// The most suspicious segment (at most 160 characters of it).
    pub segment: String,
    pub segments: usize,
}

impl Classifier {
    pub fn new(head: Head, embedder: Box<dyn Embed>) -> Self {
        Self {
            head,
            embedder,
            cache: std::sync::Mutex::new(ScoreCache::default()),
            segment_tokens: 128,
            max_segments: 8,
        }
    }

    /// Scores several texts in one embedding call: per text, its most suspicious segment.
    pub fn score(&self, texts: &[&str]) -> Result<Vec<Scored>, ClassifyError> {
        Ok(self
            .score_within(texts, usize::MAX)?
            .into_iter()
            .map(|s| {
                s.unwrap_or(Scored {
                    score: 0.0,
                    segment: String::new(),
                    segments: 0,
                })
            })
            .collect())
    }

    /// [`Classifier::score`] with a budget of segments to embed (those found in the cache cost
    /// nothing): texts are taken in the order given, and once the next text's new segments
    /// would go past the budget, it and every text after it are left unscored (`None`). The
    /// caller orders the texts by how much they matter. The tokenizer still reads each text
    /// taken, so a caller bounds the bytes too.
    pub fn score_within(
        &self,
        texts: &[&str],
        budget: usize,
    ) -> Result<Vec<Option<Scored>>, ClassifyError> {
        let count = |t: &str| self.embedder.count_tokens(t);
        let mut all: Vec<&str> = Vec::new();
        let mut owners: Vec<usize> = Vec::new();
        let mut scores: Vec<Option<f32>> = Vec::new();
        let mut to_embed = 0usize;
        let mut taken = 0usize;
        for (i, text) in texts.iter().enumerate() {
            let mut segs = segments(text, self.segment_tokens, &count);
            if segs.len() > self.max_segments {
                let n = segs.len();
                let keep = self.max_segments.max(2);
                segs = (0..keep).map(|k| segs[k * (n - 1) / (keep - 1)]).collect();
            }
            // Only the segments not scored before are embedded.
            let cached: Vec<Option<f32>> = {
                let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                segs.iter().map(|s| cache.get(s)).collect()
            };
            let new = cached.iter().filter(|c| c.is_none()).count();
            if to_embed.saturating_add(new) > budget {
                break;
            }
            to_embed += new;
            taken = i + 1;
            owners.extend(std::iter::repeat_n(i, segs.len()));
            all.extend(segs);
            scores.extend(cached);
        }
        let missing: Vec<usize> = (0..all.len()).filter(|&i| scores[i].is_none()).collect();
        if !missing.is_empty() {
            let texts: Vec<&str> = missing.iter().map(|&i| all[i]).collect();
            let embeddings = self.embedder.embed(&texts)?;
            if embeddings.len() != texts.len() {
                return Err(ClassifyError::EmbeddingCount {
                    embeddings: embeddings.len(),
                    segments: texts.len(),
                });
            }
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            for (&i, embedding) in missing.iter().zip(&embeddings) {
                let score = self.head.score(embedding)?;
                cache.put(all[i], score);
                scores[i] = Some(score);
            }
        }
        let mut out: Vec<Scored> = (0..taken)
            .map(|_| Scored {
                score: 0.0,
                segment: String::new(),
                segments: 0,
            })
            .collect();
        for ((segment, score), &owner) in all.iter().zip(&scores).zip(&owners) {
            let score = score.unwrap_or(0.0);
            let best = &mut out[owner];
            best.segments += 1;
            if score > best.score || best.segment.is_empty() {
                best.score = score;
                best.segment = segment.chars().take(160).collect();
            }
        }
        let mut out: Vec<Option<Scored>> = out.into_iter().map(Some).collect();
        out.resize(texts.len(), None);
        Ok(out)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A head whose output is `sigmoid(4·x[0] − 2)` on a 4-wide embedding.
    pub(crate) fn tiny_head() -> Vec<u8> {
        let tensors: Vec<(&str, Vec<usize>, Vec<f32>)> = vec![
            (
                "w_h1",
                vec![2, 4],
                vec![1.0, 0.0, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0],
            ),
            ("b_h1", vec![2], vec![0.0, 0.0]),
            ("w_h2", vec![1, 2], vec![1.0, -1.0]),
            ("b_h2", vec![1], vec![0.0]),
            ("w_out", vec![1, 1], vec![4.0]),
            ("b_out", vec![1], vec![-2.0]),
        ];
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
            .into_iter()
            .map(|(n, s, v)| {
                (
                    n.to_string(),
                    s,
                    v.iter().flat_map(|f| f.to_le_bytes()).collect(),
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, s, b)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap(),
                )
            })
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    pub(crate) struct Letters;

    impl Embed for Letters {
        /// x[0] = share of the letter 'x' among letters.
        fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
            Ok(texts
                .iter()
                .map(|t| {
                    let letters = t.chars().filter(|c| c.is_alphabetic()).count().max(1);
                    let x = t.chars().filter(|&c| c == 'x').count();
                    vec![x as f32 / letters as f32, 0.0, 0.0, 0.0]
                })
                .collect())
        }

        fn count_tokens(&self, text: &str) -> usize {
            text.split_whitespace().count() + 2
        }
    }

    #[test]
    fn head_scores_like_its_formula() {
        let head = Head::from_safetensors(&tiny_head()).unwrap();
        assert_eq!(head.inputs(), 4);
        let s = head.score(&[1.0, 0.0, 0.0, 0.0]).unwrap();
        assert!((s - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6);
        assert!(head.score(&[1.0]).is_err());
        assert!(Head::from_safetensors(b"junk").is_err());
    }

    #[test]
    fn the_most_suspicious_segment_decides() {
        let c = Classifier {
            segment_tokens: 8,
            ..Classifier::new(
                Head::from_safetensors(&tiny_head()).unwrap(),
                Box::new(Letters),
            )
        };
        let long =
            "A calm sentence about the weather. Another calm one here. xxxx xxxx xx. Calm again.";
        let scored = c.score(&[long, "calm"]).unwrap();
        assert!(scored[0].segments >= 3, "{scored:?}");
        assert!(scored[0].segment.contains("xxxx"), "{scored:?}");
        assert!(scored[0].score > 0.8);
        assert!(scored[1].score < 0.2);
    }

    struct Counting(std::sync::Arc<std::sync::atomic::AtomicUsize>);

    impl Embed for Counting {
        fn embed(&self, texts: &[&str]) -> Result<Vec<Vec<f32>>, EmbedError> {
            self.0
                .fetch_add(texts.len(), std::sync::atomic::Ordering::Relaxed);
            Letters.embed(texts)
        }

        fn count_tokens(&self, text: &str) -> usize {
            Letters.count_tokens(text)
        }
    }

    #[test]
    fn earlier_turns_are_embedded_once() {
        let embedded = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = Classifier::new(
            Head::from_safetensors(&tiny_head()).unwrap(),
            Box::new(Counting(embedded.clone())),
        );
        let first = c.score(&["turn one", "turn two"]).unwrap();
        let again = c.score(&["turn one", "turn two", "turn three xx"]).unwrap();
        assert_eq!(first[0], again[0]);
        assert_eq!(embedded.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    #[test]
    fn the_budget_bounds_what_one_call_embeds() {
        let embedded = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = Classifier::new(
            Head::from_safetensors(&tiny_head()).unwrap(),
            Box::new(Counting(embedded.clone())),
        );
        let texts: Vec<String> = (0..1000).map(|i| format!("message number {i}")).collect();
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let scored = c.score_within(&refs, 16).unwrap();
        assert_eq!(scored.len(), 1000);
        assert_eq!(scored.iter().filter(|s| s.is_some()).count(), 16);
        assert!(scored[..16].iter().all(Option::is_some), "taken in order");
        assert_eq!(embedded.load(std::sync::atomic::Ordering::Relaxed), 16);
        // Cached segments cost nothing: the same 16 and 16 more fit a budget of 16.
        let again = c.score_within(&refs[..32], 16).unwrap();
        assert!(again.iter().all(Option::is_some));
        assert_eq!(embedded.load(std::sync::atomic::Ordering::Relaxed), 32);
    }

    #[test]
    fn the_cache_compares_the_text() {
        let c = Classifier::new(
            Head::from_safetensors(&tiny_head()).unwrap(),
            Box::new(Letters),
        );
        let mut cache = c.cache.lock().unwrap();
        cache.put("benign words", 0.01);
        assert_eq!(cache.get("benign words"), Some(0.01));
        assert_eq!(cache.get("benign words "), None);
        assert_eq!(cache.get("xxxx"), None);
    }

    #[test]
    fn segments_cover_the_text() {
        let count = |t: &str| t.split_whitespace().count();
        let text = "one two three. four five six seven eight nine ten eleven twelve. thirteen.";
        let s = segments(text, 4, &count);
        assert!(s.len() >= 3, "{s:?}");
        assert!(s.iter().any(|x| x.contains("twelve")));
        assert!(s.iter().any(|x| x.contains("thirteen")));
        assert_eq!(segments("short text", 4, &count), ["short text"]);
        assert!(segments("   ", 4, &count).is_empty());
    }
}
