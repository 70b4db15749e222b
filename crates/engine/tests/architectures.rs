//! Tiny llama, mistral (a llama GGUF with a sliding window), qwen2, qwen3, phi3 and gemma3 GGUFs with every supported weight type, run by the engine
//! and by an independent, naive f32 reference forward pass over the dequantized weights.
//!
//! The engine quantizes the input of every quantized matmul to 8 bits per block (as llama.cpp
//! does); the reference applies the same rounding to its inputs (round to nearest, per-block
//! absolute maximum / 127), so both compute the same function and agree to float rounding. With
//! float weights nothing is quantized.

use formats::byte_level::gpt2_byte_tokens;
use formats::gguf::{Array, GgmlType, GgufWriter};
use kernels::quant::dequantize_row;
use kernels::testing::{random_f32, random_row};
use kernels::DType;

const HIDDEN: usize = 256;
const FFN: usize = 512;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
/// Gemma 3's sliding window in the tiny model: shorter than the test's prompt.
const WINDOW: usize = 3;
/// Gemma 3's global RoPE base (its sliding-window layers use 10,000).
const GEMMA_THETA: f32 = 1_000_000.0;

struct Spec {
    arch: &'static str,
    dtype: DType,
}

impl Spec {
    /// Qwen 3 and Gemma 3 declare a head size other than hidden / heads.
    fn head_dim(&self) -> usize {
        match self.arch {
            "qwen3" | "gemma3" => 128,
            _ => HIDDEN / HEADS,
        }
    }

    /// Gemma 3 needs six layers for one global layer after five sliding-window ones.
    fn layers(&self) -> usize {
        if self.arch == "gemma3" {
            6
        } else {
            2
        }
    }

    fn gemma(&self) -> bool {
        self.arch == "gemma3"
    }

    /// Per-head Q/K RMSNorms.
    fn qk_norm(&self) -> bool {
        matches!(self.arch, "qwen3" | "gemma3")
    }

    /// A separate output matrix (the others tie it to the embeddings).
    fn separate_output(&self) -> bool {
        matches!(self.arch, "qwen2" | "qwen3" | "phi3")
    }

    /// Phi-3: one QKV projection and one gate/up projection.
    fn fused(&self) -> bool {
        self.arch == "phi3"
    }

    /// Whether layer `l` attends over the last WINDOW positions only.
    fn sliding(&self, l: usize) -> bool {
        match self.arch {
            "gemma3" => l % 6 < 5,
            "phi3" | "mistral" => true,
            _ => false,
        }
    }

    fn neox(&self) -> bool {
        !matches!(self.arch, "llama" | "mistral")
    }

    /// `general.architecture`: Mistral's files are llama GGUFs with a window.
    fn gguf_arch(&self) -> &'static str {
        match self.arch {
            "mistral" => "llama",
            a => a,
        }
    }
}

/// A tensor as stored in the file (name, ggml dims, type, bytes) and as f32 (for the reference).
type TestTensor = (String, Vec<u64>, GgmlType, Vec<u8>, Vec<f32>);

/// Every tensor of the model.
struct Weights {
    tensors: Vec<TestTensor>,
    vocab: usize,
}

fn ggml_type(d: DType) -> GgmlType {
    GgmlType::from_name(d.name()).unwrap()
}

fn build(spec: &Spec) -> (Vec<u8>, Weights) {
    let mut tokens = vec![
        "<|endoftext|>".to_string(),
        "<|im_start|>".into(),
        "<|im_end|>".into(),
    ];
    tokens.extend(gpt2_byte_tokens());
    let vocab = tokens.len();
    let mut seed = 1u64;
    let mut tensors = Vec::new();
    let mut matrix =
        |name: String, rows: usize, cols: usize, dtype: DType, tensors: &mut Vec<_>| {
            let mut bytes = Vec::new();
            let mut values = vec![0f32; rows * cols];
            for r in 0..rows {
                seed += 1;
                let row = random_row(dtype, cols, seed);
                dequantize_row(dtype, &row, &mut values[r * cols..(r + 1) * cols]);
                bytes.extend_from_slice(&row);
            }
            tensors.push((
                name,
                vec![cols as u64, rows as u64],
                ggml_type(dtype),
                bytes,
                values,
            ));
        };
    let vector = |name: String, len: usize, around: f32, seed: u64, tensors: &mut Vec<_>| {
        let values: Vec<f32> = random_f32(len, seed)
            .iter()
            .map(|v| around + 0.1 * v)
            .collect();
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name, vec![len as u64], GgmlType::F32, bytes, values));
    };
    let d = spec.dtype;
    let head_dim = spec.head_dim();
    matrix("token_embd.weight".into(), vocab, HIDDEN, d, &mut tensors);
    for l in 0..spec.layers() {
        let n = |t: &str| format!("blk.{l}.{t}");
        vector(
            n("attn_norm.weight"),
            HIDDEN,
            1.0,
            100 + l as u64,
            &mut tensors,
        );
        if spec.fused() {
            matrix(
                n("attn_qkv.weight"),
                (HEADS + 2 * KV_HEADS) * head_dim,
                HIDDEN,
                d,
                &mut tensors,
            );
        } else {
            matrix(
                n("attn_q.weight"),
                HEADS * head_dim,
                HIDDEN,
                d,
                &mut tensors,
            );
            matrix(
                n("attn_k.weight"),
                KV_HEADS * head_dim,
                HIDDEN,
                d,
                &mut tensors,
            );
            matrix(
                n("attn_v.weight"),
                KV_HEADS * head_dim,
                HIDDEN,
                d,
                &mut tensors,
            );
        }
        if spec.qk_norm() {
            vector(
                n("attn_q_norm.weight"),
                head_dim,
                1.0,
                700 + l as u64,
                &mut tensors,
            );
            vector(
                n("attn_k_norm.weight"),
                head_dim,
                1.0,
                800 + l as u64,
                &mut tensors,
            );
        }
        if spec.gemma() {
            vector(
                n("post_attention_norm.weight"),
                HIDDEN,
                1.0,
                900 + l as u64,
                &mut tensors,
            );
            vector(
                n("post_ffw_norm.weight"),
                HIDDEN,
                1.0,
                1000 + l as u64,
                &mut tensors,
            );
        }
        if spec.arch == "qwen2" {
            vector(
                n("attn_q.bias"),
                HEADS * head_dim,
                0.0,
                200 + l as u64,
                &mut tensors,
            );
            vector(
                n("attn_k.bias"),
                KV_HEADS * head_dim,
                0.0,
                300 + l as u64,
                &mut tensors,
            );
            vector(
                n("attn_v.bias"),
                KV_HEADS * head_dim,
                0.0,
                400 + l as u64,
                &mut tensors,
            );
        }
        matrix(
            n("attn_output.weight"),
            HIDDEN,
            HEADS * head_dim,
            d,
            &mut tensors,
        );
        vector(
            n("ffn_norm.weight"),
            HIDDEN,
            1.0,
            500 + l as u64,
            &mut tensors,
        );
        if spec.fused() {
            matrix(n("ffn_up.weight"), 2 * FFN, HIDDEN, d, &mut tensors);
        } else {
            matrix(n("ffn_gate.weight"), FFN, HIDDEN, d, &mut tensors);
            matrix(n("ffn_up.weight"), FFN, HIDDEN, d, &mut tensors);
        }
        matrix(n("ffn_down.weight"), HIDDEN, FFN, d, &mut tensors);
    }
    vector("output_norm.weight".into(), HIDDEN, 1.0, 600, &mut tensors);
    if spec.separate_output() {
        matrix("output.weight".into(), vocab, HIDDEN, d, &mut tensors);
    }

    let arch = spec.gguf_arch();
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", arch).unwrap();
    for (key, value) in [
        ("block_count", spec.layers()),
        ("context_length", 128),
        ("embedding_length", HIDDEN),
        ("feed_forward_length", FFN),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
    ] {
        w.metadata(&format!("{arch}.{key}"), value as u32).unwrap();
    }
    let theta = if spec.gemma() { GEMMA_THETA } else { 10000.0 };
    w.metadata(&format!("{arch}.rope.freq_base"), theta)
        .unwrap();
    if spec.qk_norm() {
        for key in ["key_length", "value_length"] {
            w.metadata(&format!("{arch}.attention.{key}"), head_dim as u32)
                .unwrap();
        }
    }
    if spec.gemma() || spec.fused() || spec.arch == "mistral" {
        w.metadata(&format!("{arch}.attention.sliding_window"), WINDOW as u32)
            .unwrap();
    }
    w.metadata(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6f32)
        .unwrap();
    w.metadata("tokenizer.ggml.model", "gpt2").unwrap();
    w.metadata(
        "tokenizer.ggml.pre",
        if spec.neox() { "qwen2" } else { "llama-bpe" },
    )
    .unwrap();
    w.metadata("tokenizer.ggml.tokens", Array::String(tokens.clone()))
        .unwrap();
    let types: Vec<i32> = (0..vocab).map(|i| if i < 3 { 3 } else { 1 }).collect();
    w.metadata("tokenizer.ggml.token_type", Array::I32(types))
        .unwrap();
    w.metadata("tokenizer.ggml.merges", Array::String(vec![]))
        .unwrap();
    w.metadata("tokenizer.ggml.eos_token_id", 2u32).unwrap();
    for (name, dims, t, bytes, _) in &tensors {
        w.tensor(name, dims, *t, bytes.as_slice()).unwrap();
    }
    let file = w.to_bytes().unwrap();
    (file, Weights { tensors, vocab })
}

impl Weights {
    fn get(&self, name: &str) -> &[f32] {
        &self
            .tensors
            .iter()
            .find(|t| t.0 == name)
            .unwrap_or_else(|| panic!("{name}"))
            .4
    }
}

/// The input as the engine's kernels see it: 8-bit per block of `block` values (0: unchanged).
fn fake_quantize(x: &[f32], block: usize) -> Vec<f32> {
    if block == 0 {
        return x.to_vec();
    }
    x.chunks(block)
        .flat_map(|b| {
            let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            b.iter()
                .map(move |v| {
                    if d > 0.0 {
                        (v / d).round_ties_even() * d
                    } else {
                        0.0
                    }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

thread_local! {
    /// Activation block size of the model under test's row kernels (0 for float weights), and
    /// whether its type is packed (then every matrix with whole groups of eight rows takes its
    /// activations in blocks of 32, K-quants too).
    static ACT_BLOCK: std::cell::Cell<(usize, bool)> = const { std::cell::Cell::new((0, false)) };
}

/// `y[r] = Σ_c W[r][c] x[c]` for a rows × cols matrix, in f64.
fn matvec(w: &[f32], x: &[f32], rows: usize) -> Vec<f32> {
    let (block, packable) = ACT_BLOCK.with(|b| b.get());
    let packed = packable && rows.is_multiple_of(kernels::packed::PACK_ROWS);
    let x = fake_quantize(x, if packed { kernels::dtype::QK } else { block });
    let cols = x.len();
    (0..rows)
        .map(|r| {
            (0..cols)
                .map(|c| f64::from(w[r * cols + c]) * f64::from(x[c]))
                .sum::<f64>() as f32
        })
        .collect()
}

fn rms_norm(x: &[f32], w: &[f32]) -> Vec<f32> {
    let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + 1e-6).sqrt();
    x.iter().zip(w).map(|(v, g)| v / rms * g).collect()
}

fn rope(v: &mut [f32], head_dim: usize, pos: usize, neox: bool, theta: f32) {
    for h in 0..v.len() / head_dim {
        let head = &mut v[h * head_dim..(h + 1) * head_dim];
        for i in 0..head_dim / 2 {
            let angle = pos as f32 / theta.powf(2.0 * i as f32 / head_dim as f32);
            let (a, b) = if neox {
                (i, i + head_dim / 2)
            } else {
                (2 * i, 2 * i + 1)
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * angle.cos() - x1 * angle.sin();
            head[b] = x0 * angle.sin() + x1 * angle.cos();
        }
    }
}

/// RMSNorm of every `w.len()`-sized chunk of `x` (a per-head norm when `w` is one head long).
fn rms_norm_chunks(x: &[f32], w: &[f32]) -> Vec<f32> {
    x.chunks(w.len()).flat_map(|c| rms_norm(c, w)).collect()
}

fn gelu_tanh(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh()))
        as f32
}

/// Two threads, a context of 64 and f32 keys and values (the reference keeps them exact).
fn exact_options() -> engine::EngineOptions {
    engine::EngineOptions {
        threads: 2,
        context: Some(64),
        kv: engine::KvOptions {
            dtype: engine::KvDType::F32,
            ..engine::KvOptions::default()
        },
        ..engine::EngineOptions::default()
    }
}

/// The reference: every position's logits, computed the slow, obvious way.
fn reference_logits(w: &Weights, tokens: &[u32], spec: &Spec) -> Vec<Vec<f32>> {
    reference(w, tokens, spec).0
}

/// Attention probabilities of the reference: `[layer][position][head]` → (key position,
/// weight) for every key the query saw.
type Probabilities = Vec<Vec<Vec<Vec<(usize, f32)>>>>;

/// The reference's logits and its attention probabilities.
fn reference(w: &Weights, tokens: &[u32], spec: &Spec) -> (Vec<Vec<f32>>, Probabilities) {
    let mut probabilities: Probabilities = Vec::new();
    let qwen2 = spec.arch == "qwen2";
    let gemma = spec.gemma();
    let head_dim = spec.head_dim();
    let embd = w.get("token_embd.weight");
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| embd[t as usize * HIDDEN..(t as usize + 1) * HIDDEN].to_vec())
        .collect();
    if gemma {
        let scale = (HIDDEN as f32).sqrt();
        xs.iter_mut().flatten().for_each(|v| *v *= scale);
    }
    for l in 0..spec.layers() {
        // Gemma 3: layers 0-4 of every 6 see the last WINDOW positions with RoPE base 10,000.
        let sliding = spec.sliding(l);
        let theta = match (gemma, sliding) {
            (true, true) => 10000.0,
            (true, false) => GEMMA_THETA,
            _ => 10000.0,
        };
        let n = |t: &str| format!("blk.{l}.{t}");
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let mut qs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let h = rms_norm(x, w.get(&n("attn_norm.weight")));
            let (mut q, mut k, mut v) = if spec.fused() {
                let (qd, kvd) = (HEADS * head_dim, KV_HEADS * head_dim);
                let qkv = matvec(w.get(&n("attn_qkv.weight")), &h, qd + 2 * kvd);
                (
                    qkv[..qd].to_vec(),
                    qkv[qd..qd + kvd].to_vec(),
                    qkv[qd + kvd..].to_vec(),
                )
            } else {
                (
                    matvec(w.get(&n("attn_q.weight")), &h, HEADS * head_dim),
                    matvec(w.get(&n("attn_k.weight")), &h, KV_HEADS * head_dim),
                    matvec(w.get(&n("attn_v.weight")), &h, KV_HEADS * head_dim),
                )
            };
            if qwen2 {
                for (buf, b) in [
                    (&mut q, "attn_q.bias"),
                    (&mut k, "attn_k.bias"),
                    (&mut v, "attn_v.bias"),
                ] {
                    buf.iter_mut().zip(w.get(&n(b))).for_each(|(a, b)| *a += b);
                }
            }
            if spec.qk_norm() {
                q = rms_norm_chunks(&q, w.get(&n("attn_q_norm.weight")));
                k = rms_norm_chunks(&k, w.get(&n("attn_k_norm.weight")));
            }
            rope(&mut q, head_dim, pos, spec.neox(), theta);
            rope(&mut k, head_dim, pos, spec.neox(), theta);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let mut layer_probs = Vec::new();
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0f32; HEADS * head_dim];
            let mut row_probs = Vec::new();
            for h in 0..HEADS {
                let kvh = h / (HEADS / KV_HEADS);
                let q = &qs[pos][h * head_dim..(h + 1) * head_dim];
                let first = if sliding {
                    (pos + 1).saturating_sub(WINDOW)
                } else {
                    0
                };
                let scores: Vec<f32> = (first..=pos)
                    .map(|t| {
                        q.iter()
                            .zip(&ks[t][kvh * head_dim..])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            / (head_dim as f32).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f32::MIN, f32::max);
                let exps: Vec<f32> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f32 = exps.iter().sum();
                row_probs.push(
                    exps.iter()
                        .enumerate()
                        .map(|(j, e)| (first + j, e / sum))
                        .collect::<Vec<_>>(),
                );
                for (j, e) in exps.iter().enumerate() {
                    for d in 0..head_dim {
                        att[h * head_dim + d] += e / sum * vs[first + j][kvh * head_dim + d];
                    }
                }
            }
            layer_probs.push(row_probs);
            let mut o = matvec(w.get(&n("attn_output.weight")), &att, HIDDEN);
            if gemma {
                o = rms_norm(&o, w.get(&n("post_attention_norm.weight")));
            }
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rms_norm(x, w.get(&n("ffn_norm.weight")));
            let (g, u) = if spec.fused() {
                let gu = matvec(w.get(&n("ffn_up.weight")), &h, 2 * FFN);
                (gu[..FFN].to_vec(), gu[FFN..].to_vec())
            } else {
                (
                    matvec(w.get(&n("ffn_gate.weight")), &h, FFN),
                    matvec(w.get(&n("ffn_up.weight")), &h, FFN),
                )
            };
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(&g, u)| {
                    if gemma {
                        gelu_tanh(g) * u
                    } else {
                        g / (1.0 + (-g).exp()) * u
                    }
                })
                .collect();
            let mut down = matvec(w.get(&n("ffn_down.weight")), &act, HIDDEN);
            if gemma {
                down = rms_norm(&down, w.get(&n("post_ffw_norm.weight")));
            }
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        probabilities.push(layer_probs);
    }
    let _ = qwen2;
    let output = if spec.separate_output() {
        w.get("output.weight")
    } else {
        w.get("token_embd.weight")
    };
    let logits = xs
        .iter()
        .map(|x| matvec(output, &rms_norm(x, w.get("output_norm.weight")), w.vocab))
        .collect();
    (logits, probabilities)
}

#[test]
fn every_weight_type_matches_the_reference_forward() {
    let dir = std::env::temp_dir().join(format!("rampart-arch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tokens = [1u32, 40, 77, 200, 13, 150];
    let options = exact_options();
    let mut report = Vec::new();
    let mut failed = Vec::new();
    for arch in ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3"] {
        for dtype in DType::ALL {
            let spec = Spec { arch, dtype };
            let (file, weights) = build(&spec);
            let path = dir.join(format!("{arch}-{dtype}.gguf"));
            std::fs::write(&path, file).unwrap();
            let engine = engine::Engine::load(&path, &options)
                .unwrap_or_else(|e| panic!("{arch} {dtype}: {e}"));
            assert_eq!(engine.model().family.name, spec.gguf_arch());
            let got = engine.logits(&tokens).unwrap();
            ACT_BLOCK.with(|b| {
                b.set((
                    match dtype.activation_format() {
                        kernels::ActFormat::F32 => 0,
                        f => f.block_size(),
                    },
                    kernels::packed::packable(dtype),
                ))
            });
            let want = reference_logits(&weights, &tokens, &spec);
            let vocab = weights.vocab;
            let mut worst = 0f32;
            for (pos, row) in want.iter().enumerate() {
                let range = row.iter().fold(0f32, |m, v| m.max(v.abs()));
                let err = row
                    .iter()
                    .zip(&got[pos * vocab..(pos + 1) * vocab])
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                worst = worst.max(err / range);
            }
            report.push(format!("{arch} {dtype}: {:.4}", worst));
            // Quantized activations (8-bit): the reference rounds them too, but it computes in
            // f64 and the engine in f32, so an activation next to a rounding boundary can land
            // on the neighbouring level (qwen3 Q3_K: 0.8% at two positions). A wrong operation
            // (a norm, RoPE, the window) moves logits by tens of percent.
            if worst >= 1e-2 {
                failed.push(format!("{arch} {dtype}: relative logit error {worst}"));
            }
        }
    }
    eprintln!("max relative logit error per model: {}", report.join(", "));
    assert!(failed.is_empty(), "{failed:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The attention export of a generation (every layer, every head, top 4) equals the
/// reference's softmax at each generated token's row: the prompt's last row for the first token,
/// the previous token's after it; sliding-window layers (Gemma 3) export only their window.
#[test]
fn exported_attention_matches_the_reference_softmax() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = [1u32, 40, 77, 200, 13, 150, 9, 31, 64, 5, 120, 44];
    let options = exact_options();
    let top_k = 4;
    for arch in ["llama", "qwen2", "gemma3"] {
        let spec = Spec {
            arch,
            dtype: DType::F32,
        };
        let (file, weights) = build(&spec);
        let path = dir.path().join(format!("{arch}.gguf"));
        std::fs::write(&path, file).unwrap();
        let engine = engine::Engine::load(&path, &options).unwrap();
        let mut request = engine::GenerateRequest::new(engine::Prompt::Tokens(prompt.to_vec()), 6);
        request.ignore_eos = true;
        request.sampling.temperature = 0.0;
        let mut asked = engine::AttentionRequest {
            layers: (0..spec.layers()).collect(),
            heads: (0..HEADS).collect(),
            top_k,
            positions: None,
        };
        asked
            .normalize(engine.config(), request.max_tokens, usize::MAX)
            .unwrap();
        request.attention = Some(asked);
        let mut generated = Vec::new();
        let mut exports = Vec::new();
        for event in engine.generate(request).unwrap() {
            match event {
                engine::Event::Token(t) => {
                    generated.push(t.id);
                    exports.push(t.attention);
                }
                engine::Event::Finished(_) => break,
                other => panic!("{arch}: {other:?}"),
            }
        }
        assert_eq!(generated.len(), 6, "{arch}");
        let tokens: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        let (_, probs) = reference(&weights, &tokens, &spec);
        let mut worst = 0f32;
        for (i, export) in exports.iter().enumerate() {
            let row = prompt.len() - 1 + i;
            assert_eq!(
                export.len(),
                spec.layers() * HEADS * top_k,
                "{arch} token {i}"
            );
            for l in 0..spec.layers() {
                for h in 0..HEADS {
                    let mut want = probs[l][row][h].clone();
                    want.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                    let got = &export[(l * HEADS + h) * top_k..][..top_k];
                    for (n, g) in got.iter().enumerate() {
                        let what = format!("{arch} token {i} layer {l} head {h} entry {n}");
                        let Some(&(pos, w)) = want.get(n) else {
                            assert_eq!(*g, engine::Attended::NONE, "{what}");
                            continue;
                        };
                        worst = worst.max((g.weight - w).abs());
                        assert!((g.weight - w).abs() <= 1e-4, "{what}: {} vs {w}", g.weight);
                        let tied = want.iter().any(|&(p, v)| p != pos && (v - w).abs() <= 1e-4);
                        assert!(
                            g.position as usize == pos || tied,
                            "{what}: position {} vs {pos}",
                            g.position
                        );
                        if spec.sliding(l) {
                            assert!(
                                g.position as usize + WINDOW > row,
                                "{what}: outside the window"
                            );
                        }
                    }
                }
            }
        }
        eprintln!("{arch}: largest exported weight error {worst:e}");
    }
}

/// Scoring a continuation equals summing the log-softmax of the full forward's logits at its
/// rows; each token drawn among the choices' next tokens, the choices' probabilities sum to 1.
#[test]
fn scores_are_the_forward_pass_log_probabilities() {
    let dir = tempfile::tempdir().unwrap();
    let spec = Spec {
        arch: "llama",
        dtype: DType::F32,
    };
    let (file, _) = build(&spec);
    let path = dir.path().join("llama.gguf");
    std::fs::write(&path, file).unwrap();
    let engine = engine::Engine::load(&path, &exact_options()).unwrap();
    let prompt = [1u32, 40, 77, 200, 13];
    let choices = vec![vec![150u32, 9, 31], vec![150, 7], vec![64]];
    let vocab = engine.config().vocab_size;
    for c in &choices {
        let all: Vec<u32> = prompt.iter().chain(c).copied().collect();
        let logits = engine.logits(&all).unwrap();
        let mut want = 0f64;
        for (k, &t) in c.iter().enumerate() {
            let row = &logits[(prompt.len() - 1 + k) * vocab..][..vocab];
            let max = row.iter().cloned().fold(f32::MIN, f32::max);
            let norm: f64 = row
                .iter()
                .map(|&x| ((x - max) as f64).exp())
                .sum::<f64>()
                .ln();
            want += (row[t as usize] - max) as f64 - norm;
        }
        let got = engine.score(&prompt, c).unwrap();
        assert!((got - want).abs() < 1e-4, "{c:?}: {got} vs {want}");
    }
    // First {150, 64}; after 150, {9, 7}; after 150 9, 31 alone.
    let steps = [
        vec![vec![150, 64], vec![9, 7], vec![31]],
        vec![vec![150, 64], vec![9, 7]],
        vec![vec![150, 64]],
    ];
    let total: f64 = choices
        .iter()
        .zip(&steps)
        .map(|(c, s)| engine.score_path(&prompt, c, s).unwrap().exp())
        .sum();
    assert!((total - 1.0).abs() < 1e-6, "{total}");
    assert!(engine.score(&prompt, &[]).is_err());
}

#[test]
fn unsupported_architectures_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("rampart-arch-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", "mamba").unwrap();
    let path = dir.join("mamba.gguf");
    std::fs::write(&path, w.to_bytes().unwrap()).unwrap();
    let err = engine::Engine::load(&path, &engine::EngineOptions::default()).unwrap_err();
    assert!(
        err.to_string().contains("\"mamba\" is not supported"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
