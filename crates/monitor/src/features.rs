//! Features of one request: what its input looked like and what the model answered. Each
//! extractor is cheap (one pass, images on a sampled grid) and returns named values; the
//! monitors only see names and values.

pub use record::{Observation, Value};

/// Pixels read per image at most: larger images are read on a regular grid.
pub const IMAGE_SAMPLE_PIXELS: usize = 1 << 14;

/// Statistics of an 8-bit RGB image (row-major, 3 bytes per pixel): per-channel mean and
/// standard deviation, brightness (mean luma, 0–255), contrast (luma std), the share of
/// near-black (luma < 16) and saturated (a channel ≥ 250) pixels, and the original size.
pub fn image(pixels: &[u8], width: usize, height: usize, original: (usize, usize)) -> Observation {
    let mut o = Observation::default();
    let n = (width * height).min(pixels.len() / 3);
    if n > 0 {
        // An odd stride, so the grid does not alias with even row widths and patterns.
        let mut step = n.div_ceil(IMAGE_SAMPLE_PIXELS).max(1);
        if step > 1 {
            step |= 1;
        }
        let mut sum = [0u64; 3];
        let mut sq = [0u64; 3];
        let (mut luma_sum, mut luma_sq) = (0f64, 0f64);
        let (mut black, mut saturated, mut count) = (0u64, 0u64, 0u64);
        let mut i = 0;
        while i < n {
            let p = &pixels[i * 3..i * 3 + 3];
            let (r, g, b) = (u64::from(p[0]), u64::from(p[1]), u64::from(p[2]));
            sum[0] += r;
            sum[1] += g;
            sum[2] += b;
            sq[0] += r * r;
            sq[1] += g * g;
            sq[2] += b * b;
            let y = 0.299 * r as f64 + 0.587 * g as f64 + 0.114 * b as f64;
            luma_sum += y;
            luma_sq += y * y;
            black += u64::from(y < 16.0);
            saturated += u64::from(p[0] >= 250 || p[1] >= 250 || p[2] >= 250);
            count += 1;
            i += step;
        }
        let c = count as f64;
        for (k, name) in ["r", "g", "b"].iter().enumerate() {
            let mean = sum[k] as f64 / c;
            let var = (sq[k] as f64 / c - mean * mean).max(0.0);
            o.num(format!("image.mean_{name}"), mean);
            o.num(format!("image.std_{name}"), var.sqrt());
        }
        let mean = luma_sum / c;
        o.num("image.brightness", mean);
        o.num(
            "image.contrast",
            (luma_sq / c - mean * mean).max(0.0).sqrt(),
        );
        o.num("image.black_fraction", black as f64 / c);
        o.num("image.saturated_fraction", saturated as f64 / c);
    }
    let (w, h) = original;
    o.num("image.width", w as f64);
    o.num("image.height", h as f64);
    if h > 0 {
        o.num("image.aspect", w as f64 / h as f64);
    }
    o
}

/// Lanes of [`tensor`]'s running statistics.
const LANES: usize = 4;

/// [`tensor`]'s running count, sum, sum of squares, minimum and maximum, in [`LANES`]
/// independent lanes: one running sum would chain each addition on the one before (0.3 ms for
/// a 150,528-value image tensor, 2 % of a small classifier's request), lanes let the compiler
/// keep them in vector registers.
struct Lanes {
    n: [f64; LANES],
    sum: [f64; LANES],
    sq: [f64; LANES],
    lo: [f64; LANES],
    hi: [f64; LANES],
}

impl Default for Lanes {
    fn default() -> Self {
        Self {
            n: [0.0; LANES],
            sum: [0.0; LANES],
            sq: [0.0; LANES],
            lo: [f64::INFINITY; LANES],
            hi: [f64::NEG_INFINITY; LANES],
        }
    }
}

impl Lanes {
    /// Adds one value per lane, all of them: the loop without a test per value, which the
    /// compiler vectorizes. A NaN or an infinity makes the sum non-finite (see [`tensor`]).
    #[inline(always)]
    fn add_all(&mut self, v: [f64; LANES]) {
        for (k, x) in v.into_iter().enumerate() {
            self.n[k] += 1.0;
            self.sum[k] += x;
            self.sq[k] += x * x;
            self.lo[k] = if x < self.lo[k] { x } else { self.lo[k] };
            self.hi[k] = if x > self.hi[k] { x } else { self.hi[k] };
        }
    }

    fn add_one(&mut self, k: usize, x: f64) {
        self.n[k] += 1.0;
        self.sum[k] += x;
        self.sq[k] += x * x;
        self.lo[k] = self.lo[k].min(x);
        self.hi[k] = self.hi[k].max(x);
    }

    fn finite(&self) -> bool {
        self.sum.iter().chain(&self.sq).all(|s| s.is_finite())
    }
}

/// Mean, standard deviation, minimum and maximum of a numeric input tensor, as
/// `input.<name>.mean` and so on; non-finite values are left out. `to_f64` converts an element.
/// Every element is read (a tensor's extremes are its point), in [`Lanes`]: first all of them
/// without a test each; only when that sum is not finite (a NaN, an infinity, or squares beyond
/// f64) again, leaving out the non-finite ones.
pub fn tensor<T: Copy>(name: &str, values: &[T], to_f64: impl Fn(T) -> f64) -> Observation {
    let chunks = values.chunks_exact(LANES);
    let rest = chunks.remainder();
    let mut lanes = Lanes::default();
    for chunk in chunks {
        lanes.add_all(std::array::from_fn(|k| to_f64(chunk[k])));
    }
    for (k, &v) in rest.iter().enumerate() {
        lanes.add_one(k, to_f64(v));
    }
    if !lanes.finite() {
        // Value i went to lane i % LANES above too.
        lanes = Lanes::default();
        for (i, &v) in values.iter().enumerate() {
            let x = to_f64(v);
            if x.is_finite() {
                lanes.add_one(i % LANES, x);
            }
        }
    }
    let Lanes { n, sum, sq, lo, hi } = lanes;
    let n: f64 = n.iter().sum();
    let mut o = Observation::default();
    if n > 0.0 {
        let mean = sum.iter().sum::<f64>() / n;
        let sq = sq.iter().sum::<f64>();
        o.num(format!("input.{name}.mean"), mean);
        o.num(
            format!("input.{name}.std"),
            (sq / n - mean * mean).max(0.0).sqrt(),
        );
        o.num(
            format!("input.{name}.min"),
            lo.iter().copied().fold(f64::INFINITY, f64::min),
        );
        o.num(
            format!("input.{name}.max"),
            hi.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        );
    }
    o
}

/// The writing system of a character, coarsely.
fn script(c: char) -> Option<&'static str> {
    let u = c as u32;
    Some(match u {
        _ if c.is_ascii_alphabetic() => "latin",
        0x00C0..=0x024F | 0x1E00..=0x1EFF => "latin",
        0x0370..=0x03FF => "greek",
        0x0400..=0x052F => "cyrillic",
        0x0590..=0x05FF => "hebrew",
        0x0600..=0x06FF | 0x0750..=0x077F => "arabic",
        0x0900..=0x097F => "devanagari",
        0x3040..=0x30FF => "kana",
        0x4E00..=0x9FFF | 0x3400..=0x4DBF => "han",
        0xAC00..=0xD7AF | 0x1100..=0x11FF => "hangul",
        0x0E00..=0x0E7F => "thai",
        _ if c.is_alphabetic() => "other",
        _ => return None,
    })
}

/// Features of a text input (a prompt, the chat's messages, an embedding input): characters,
/// tokens, the share of non-ASCII characters, the dominant script (categorical) and the share of
/// letters outside it, and the share of characters inside the model's special-token texts.
pub fn text<S: AsRef<str>>(text: &str, tokens: usize, special_texts: &[S]) -> Observation {
    let mut o = Observation::default();
    let mut chars = 0usize;
    let mut non_ascii = 0usize;
    let mut letters = 0usize;
    let mut counts: Vec<(&'static str, usize)> = Vec::new();
    for c in text.chars() {
        chars += 1;
        non_ascii += usize::from(!c.is_ascii());
        if let Some(s) = script(c) {
            letters += 1;
            match counts.iter_mut().find(|(k, _)| *k == s) {
                Some(e) => e.1 += 1,
                None => counts.push((s, 1)),
            }
        }
    }
    let special: usize = special_texts
        .iter()
        .map(AsRef::as_ref)
        .filter(|s| !s.is_empty())
        .map(|s| text.matches(s).count() * s.chars().count())
        .sum();
    let dominant = counts.iter().max_by_key(|(_, n)| *n);
    o.num("text.chars", chars as f64);
    if tokens > 0 {
        o.num("text.tokens", tokens as f64);
    }
    let share = |k: usize| {
        if chars == 0 {
            0.0
        } else {
            k as f64 / chars as f64
        }
    };
    o.num("text.non_ascii_share", share(non_ascii));
    o.num("text.special_token_share", share(special));
    o.cat("text.script", dominant.map_or("none", |(s, _)| *s));
    o.num(
        "text.mixed_script_share",
        match dominant {
            Some((_, n)) if letters > 0 => (letters - n) as f64 / letters as f64,
            _ => 0.0,
        },
    );
    o
}

/// Output features of a generated text: the request's mean token entropy, its lowest token
/// entropy, and the share of near-certain tokens (entropy below 0.05 nats).
pub fn generation(token_entropies: &[f32], completion_tokens: usize) -> Observation {
    let mut o = Observation::default();
    if !token_entropies.is_empty() {
        let n = token_entropies.len() as f64;
        let mean = token_entropies.iter().map(|&e| f64::from(e)).sum::<f64>() / n;
        o.num("output.entropy_mean", mean);
        o.num(
            "output.entropy_min",
            token_entropies
                .iter()
                .copied()
                .fold(f32::INFINITY, f32::min)
                .into(),
        );
        o.num(
            "output.certain_share",
            token_entropies.iter().filter(|&&e| e < 0.05).count() as f64 / n,
        );
    }
    o.num("output.tokens", completion_tokens as f64);
    o
}

/// Output features of one classified input: the top class's probability, the margin to the
/// second, and the predicted label (categorical).
pub fn classification(top: &[(String, f32)]) -> Observation {
    let mut o = Observation::default();
    if let Some((label, p)) = top.first() {
        o.num("output.confidence", f64::from(*p));
        if let Some((_, q)) = top.get(1) {
            o.num("output.margin", f64::from(p - q));
        }
        o.cat("output.label", label.clone());
    }
    o
}

/// Output features of one detector input: the number of boxes and their mean score.
pub fn detection(scores: &[f32]) -> Observation {
    let mut o = Observation::default();
    o.num("output.boxes", scores.len() as f64);
    if !scores.is_empty() {
        o.num(
            "output.score_mean",
            scores.iter().map(|&s| f64::from(s)).sum::<f64>() / scores.len() as f64,
        );
        o.num(
            "output.confidence",
            scores.iter().copied().fold(0.0f32, f32::max).into(),
        );
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn num(o: &Observation, k: &str) -> f64 {
        match o.get(k) {
            Some(Value::Num(v)) => *v,
            other => panic!("{k}: {other:?}"),
        }
    }

    #[test]
    fn tensor_statistics_skip_non_finite_values_at_any_length() {
        for len in [0usize, 1, 7, 8, 9, 1001] {
            let mut v: Vec<f32> = (0..len).map(|i| (i % 13) as f32 - 6.0).collect();
            if len > 2 {
                v[1] = f32::NAN;
                v[len - 1] = f32::INFINITY;
            }
            let o = tensor("x", &v, f64::from);
            let kept: Vec<f64> = v
                .iter()
                .map(|&x| f64::from(x))
                .filter(|x| x.is_finite())
                .collect();
            if kept.is_empty() {
                assert!(o.is_empty());
                continue;
            }
            let c = kept.len() as f64;
            let mean = kept.iter().sum::<f64>() / c;
            let var = kept.iter().map(|x| x * x).sum::<f64>() / c - mean * mean;
            assert!((num(&o, "input.x.mean") - mean).abs() < 1e-9, "{len}");
            assert!((num(&o, "input.x.std") - var.max(0.0).sqrt()).abs() < 1e-9);
            let lo = kept.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = kept.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(num(&o, "input.x.min"), lo);
            assert_eq!(num(&o, "input.x.max"), hi);
        }
    }

    #[test]
    fn a_black_image_is_all_black_and_a_grey_one_has_no_contrast() {
        let black = vec![0u8; 64 * 64 * 3];
        let o = image(&black, 64, 64, (640, 480));
        assert_eq!(num(&o, "image.black_fraction"), 1.0);
        assert_eq!(num(&o, "image.brightness"), 0.0);
        assert!((num(&o, "image.aspect") - 640.0 / 480.0).abs() < 1e-9);
        let grey = vec![128u8; 64 * 64 * 3];
        let o = image(&grey, 64, 64, (64, 64));
        assert!(num(&o, "image.contrast") < 1e-3);
        assert!((num(&o, "image.mean_g") - 128.0).abs() < 1e-9);
    }

    #[test]
    fn a_large_image_is_read_on_a_grid_with_the_same_means() {
        let (w, h) = (1024usize, 1024usize);
        let mut px = vec![0u8; w * h * 3];
        for (i, p) in px.chunks_mut(3).enumerate() {
            p[0] = (i % 256) as u8;
            p[1] = 200;
            p[2] = 10;
        }
        let o = image(&px, w, h, (w, h));
        assert!((num(&o, "image.mean_r") - 127.5).abs() < 2.0);
        assert_eq!(num(&o, "image.mean_g"), 200.0);
    }

    #[test]
    fn text_features_see_scripts_and_special_tokens() {
        let o = text("Привет, как дела? ok <|im_start|>", 9, &["<|im_start|>"]);
        assert_eq!(o.get("text.script"), Some(&Value::Cat("cyrillic".into())));
        assert!(num(&o, "text.special_token_share") > 0.25);
        assert!(num(&o, "text.non_ascii_share") > 0.2);
        let o = text("", 0, &[] as &[&str]);
        assert_eq!(o.get("text.script"), Some(&Value::Cat("none".into())));
    }

    #[test]
    fn generation_and_classification_features() {
        let o = generation(&[0.0, 1.0, 2.0], 3);
        assert!((num(&o, "output.entropy_mean") - 1.0).abs() < 1e-9);
        assert!((num(&o, "output.certain_share") - 1.0 / 3.0).abs() < 1e-9);
        let o = classification(&[("cat".into(), 0.7), ("dog".into(), 0.2)]);
        assert!((num(&o, "output.margin") - 0.5).abs() < 1e-6);
        assert_eq!(o.get("output.label"), Some(&Value::Cat("cat".into())));
    }
}
