//! Quantization plans and model conversion: a plan maps tensor-name patterns to block types
//! (fragile tensors such as attention `o_proj` stay in higher precision while the rest goes to
//! 4 bits), and [`quantize_gguf`] applies one to a model, writing a GGUF that llama.cpp loads too.
//!
//! A plan is small TOML:
//!
//! ```toml
//! default = "Q4_K"
//! rules = [
//!   { match = "*.self_attn.o_proj", type = "F16" },
//!   { match = "lm_head", type = "Q8_0" },
//!   { match = "*.mlp.*", type = "Q4_K" },
//! ]
//! ```
//!
//! Rules are tried in order and the first match wins; `*` matches any run of characters (dots
//! included), `?` one character. A pattern is tried against the tensor's GGUF name
//! (`blk.3.attn_output.weight`) and its Hugging Face name (`model.layers.3.self_attn.o_proj.weight`),
//! each with and without the `.weight`/`.bias` suffix. `lm_head` also names the token embedding
//! of a model whose output matrix is tied to it. One-dimensional tensors (norms, biases) always
//! stay F32. A type whose block does not divide a tensor's rows falls back as llama.cpp falls
//! back (Q4_K → Q5_0, Q5_K → Q5_1, Q6_K → Q8_0, then F16), and the summary says so.

use std::path::{Path, PathBuf};

use formats::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use kernels::DType;
use serde::{Deserialize, Serialize};

use crate::error::EngineError;
use crate::model::dtype_of;

/// Types a plan may ask for: the ones the engine's kernels multiply and llama.cpp reads.
pub const PLAN_TYPES: &[DType] = &[
    DType::F32,
    DType::F16,
    DType::Q8_0,
    DType::Q6_K,
    DType::Q5_K,
    DType::Q5_1,
    DType::Q5_0,
    DType::Q4_K,
    DType::Q4_1,
    DType::Q4_0,
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct PlanFile {
    default: String,
    #[serde(default)]
    rules: Vec<RuleFile>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RuleFile {
    #[serde(rename = "match")]
    pattern: String,
    #[serde(rename = "type")]
    dtype: String,
}

/// A parsed, checked quantization plan.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantPlan {
    pub default: DType,
    /// `(pattern, type)`, first match wins.
    pub rules: Vec<(String, DType)>,
}

/// The plan types, comma-separated (for messages).
fn plan_type_names() -> String {
    PLAN_TYPES
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

fn plan_type(name: &str) -> Result<DType, EngineError> {
    let upper = name.to_ascii_uppercase();
    PLAN_TYPES
        .iter()
        .copied()
        .find(|t| t.name().eq_ignore_ascii_case(&upper))
        .ok_or_else(|| {
            EngineError::InvalidRequest(format!(
                "unknown quantization type {name:?} (one of {})",
                plan_type_names()
            ))
        })
}

impl QuantPlan {
    /// One type for every matrix.
    pub fn uniform(dtype: DType) -> Self {
        Self {
            default: dtype,
            rules: Vec::new(),
        }
    }

    /// Parses a plan from TOML (see the module documentation).
    pub fn parse(text: &str) -> Result<Self, EngineError> {
        let file: PlanFile = toml::from_str(text)
            .map_err(|e| EngineError::InvalidRequest(format!("quantization plan: {e}")))?;
        let mut rules = Vec::new();
        for r in &file.rules {
            if r.pattern.is_empty() {
                return Err(EngineError::InvalidRequest(
                    "quantization plan: a rule has an empty match".into(),
                ));
            }
            rules.push((r.pattern.clone(), plan_type(&r.dtype)?));
        }
        Ok(Self {
            default: plan_type(&file.default)?,
            rules,
        })
    }

    /// The plan as TOML (recorded in the output file and the lineage).
    pub fn to_toml(&self) -> String {
        let file = PlanFile {
            default: self.default.name().to_string(),
            rules: self
                .rules
                .iter()
                .map(|(p, t)| RuleFile {
                    pattern: p.clone(),
                    dtype: t.name().to_string(),
                })
                .collect(),
        };
        toml::to_string(&file).unwrap_or_default()
    }

    /// The type the plan gives a tensor, and the index of the rule that decided (none: default).
    pub fn choose(&self, names: &[String]) -> (DType, Option<usize>) {
        for (i, (pattern, dtype)) in self.rules.iter().enumerate() {
            if names.iter().any(|n| glob(pattern, n)) {
                return (*dtype, Some(i));
            }
        }
        (self.default, None)
    }
}

/// `*` matches any run of characters, `?` any one.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ni));
            pi += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    while pi < p.len() && p[pi] == '*' {
        pi += 1;
    }
    pi == p.len()
}

/// Every name a plan's pattern is tried against.
fn names_of(gguf: &str, tied_output: bool) -> Vec<String> {
    let mut names = vec![gguf.to_string()];
    if let Some(hf) = formats::hf::hf_tensor_name(gguf) {
        names.push(hf);
    }
    if tied_output && gguf == "token_embd.weight" {
        names.push("lm_head.weight".into());
    }
    let bare: Vec<String> = names
        .iter()
        .filter_map(|n| {
            n.strip_suffix(".weight")
                .or_else(|| n.strip_suffix(".bias"))
                .map(str::to_string)
        })
        .collect();
    names.extend(bare);
    names
}

/// The type actually written when `wanted` does not divide rows of `row_len`.
fn fallback(wanted: DType, row_len: usize) -> DType {
    let mut t = wanted;
    loop {
        if row_len.is_multiple_of(t.block_size()) {
            return t;
        }
        t = match t {
            DType::Q4_K => DType::Q5_0,
            DType::Q5_K => DType::Q5_1,
            DType::Q6_K => DType::Q8_0,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0 => DType::F16,
            _ => return DType::F32,
        };
    }
}

/// What happened to one tensor.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TensorPlan {
    pub name: String,
    pub shape: Vec<u64>,
    pub from: String,
    /// What the plan asked for.
    pub wanted: String,
    /// What was written (differs when the rows do not fit the wanted type's blocks).
    pub written: String,
    /// The rule that decided (`None`: the default, or a one-dimensional tensor).
    pub rule: Option<usize>,
    pub bytes: u64,
}

/// The result of a conversion.
#[derive(Debug, Clone, Serialize)]
pub struct QuantizeSummary {
    pub tensors: Vec<TensorPlan>,
    /// Rules that matched no tensor (a typo, most likely).
    pub unused_rules: Vec<String>,
    pub source_bytes: u64,
    pub output_bytes: u64,
    pub parameters: u64,
}

/// llama.cpp's `general.file_type` for a plan's default type.
fn file_type(default: DType) -> u32 {
    match default {
        DType::F32 => 0,
        DType::F16 => 1,
        DType::Q4_0 => 2,
        DType::Q4_1 => 3,
        DType::Q8_0 => 7,
        DType::Q5_0 => 8,
        DType::Q5_1 => 9,
        DType::Q4_K => 15,
        DType::Q5_K => 17,
        DType::Q6_K => 18,
        _ => 0,
    }
}

fn ggml_type(d: DType) -> Result<GgmlType, EngineError> {
    GgmlType::from_name(d.name())
        .ok_or_else(|| EngineError::Load(format!("no GGUF type for {}", d.name())))
}

/// A tensor to convert: its GGUF name, dims in ggml order (contiguous first), type and bytes.
struct SourceTensor<'a> {
    name: String,
    dims: Vec<u64>,
    dtype: DType,
    data: std::borrow::Cow<'a, [u8]>,
}

/// Reads a GGUF model and writes it to `out` with every tensor re-quantized by `plan`
/// (dequantized to f32 first; rows are spread over `threads`). `progress` is told about each
/// tensor as it is done (index, count, tensor).
pub fn quantize_gguf(
    src: &Path,
    plan: &QuantPlan,
    out: &Path,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize, &TensorPlan),
) -> Result<QuantizeSummary, EngineError> {
    let file =
        GgufFile::open(src).map_err(|e| EngineError::Load(format!("{}: {e}", src.display())))?;
    let header = file.header();
    let metadata: Vec<(String, Value)> = header
        .metadata()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let mut sources = Vec::with_capacity(header.tensors.len());
    for t in &header.tensors {
        let dtype = dtype_of(t.ggml_type).ok_or_else(|| EngineError::Tensor {
            name: t.name.clone(),
            reason: format!("{:?} tensors cannot be converted", t.ggml_type),
        })?;
        sources.push(SourceTensor {
            name: t.name.clone(),
            dims: t.dims.clone(),
            dtype,
            data: std::borrow::Cow::Borrowed(file.tensor_data(t)),
        });
    }
    write_quantized(metadata, sources, plan, out, threads, progress)
}

/// Converts a Hugging Face checkpoint folder (llama or qwen2 family, byte-level BPE tokenizer)
/// into a GGUF by `plan`, as llama.cpp's converter lays it out: GGUF tensor names, llama Q/K rows
/// permuted for pairwise RoPE, the shape and the tokenizer in metadata.
pub fn quantize_hf(
    dir: &Path,
    plan: &QuantPlan,
    out: &Path,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize, &TensorPlan),
) -> Result<QuantizeSummary, EngineError> {
    let checkpoint = crate::hf::open(dir)?;
    let c = &checkpoint.config;
    let arch = checkpoint.family.name;
    let tokenizer = crate::tokenizer::Tokenizer::from_hf_folder(dir)?;
    let mut metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String(
                dir.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_else(|| "model".into()),
            ),
        ),
    ];
    let u = |v: usize| Value::U32(v as u32);
    for (key, value) in [
        ("context_length", u(c.context_length)),
        ("embedding_length", u(c.hidden)),
        ("feed_forward_length", u(c.ffn)),
        ("block_count", u(c.block_count)),
        ("attention.head_count", u(c.heads)),
        ("attention.head_count_kv", u(c.kv_heads)),
        ("attention.layer_norm_rms_epsilon", Value::F32(c.norm_eps)),
        ("rope.freq_base", Value::F32(c.rope_theta)),
        ("rope.dimension_count", u(c.rope_dims)),
        ("vocab_size", u(c.vocab_size)),
    ] {
        metadata.push((format!("{arch}.{key}"), value));
    }
    if let Some(window) = c.sliding_window {
        // Mistral 7B v0.1's window (llama.cpp's converter drops it; the engine reads it back).
        metadata.push((format!("{arch}.attention.sliding_window"), u(window)));
    }
    if c.head_dim * c.heads != c.hidden {
        metadata.push((format!("{arch}.attention.key_length"), u(c.head_dim)));
        metadata.push((format!("{arch}.attention.value_length"), u(c.head_dim)));
    }
    match c.rope_scaling {
        kernels::ops::RopeScaling::None => {}
        kernels::ops::RopeScaling::Linear { factor } => {
            metadata.push((
                format!("{arch}.rope.scaling.type"),
                Value::String("linear".into()),
            ));
            metadata.push((format!("{arch}.rope.scaling.factor"), Value::F32(factor)));
        }
        _ => {
            return Err(EngineError::Load(
                "converting a checkpoint with llama3 RoPE scaling to GGUF is not supported yet (it loads directly)".into(),
            ))
        }
    }
    metadata.extend(crate::tokenizer::gguf_metadata_from_hf(
        dir,
        &tokenizer,
        c.vocab_size,
    )?);

    let weights = &checkpoint.weights;
    let mut sources = Vec::new();
    for (name, t) in weights.all() {
        let dtype = t.dtype.ok_or_else(|| EngineError::Tensor {
            name: t.file_name.clone(),
            reason: format!("type {} cannot be converted", t.type_name),
        })?;
        let dims: Vec<u64> = t.shape.iter().rev().map(|&d| d as u64).collect();
        let raw = weights.raw(t);
        // llama GGUFs store Q/K rows permuted for pairwise RoPE; Qwen2 keeps the HF order.
        let heads = match name.rsplit('.').nth(1) {
            Some("attn_q") => Some(c.heads),
            Some("attn_k") => Some(c.kv_heads),
            _ => None,
        };
        let gemma_norm = checkpoint.family.hf_layout == crate::arch::HfLayout::Gemma
            && name.ends_with("norm.weight");
        let permute = heads.filter(|_| !checkpoint.family.rope_neox);
        if gemma_norm || permute.is_some() {
            // Rewritten as f32: Gemma's checkpoints store RMSNorm weights as offsets from 1
            // (its GGUFs hold 1 + w); llama's Q/K rows are permuted for pairwise RoPE.
            let mut values = vec![0f32; t.shape.iter().product()];
            kernels::quant::dequantize_row(dtype, raw, &mut values);
            if gemma_norm {
                values.iter_mut().for_each(|v| *v += 1.0);
            }
            if let Some(h) = permute {
                let cols = if t.shape.len() == 2 { t.shape[1] } else { 1 };
                values = formats::hf::permute_qk(&values, h, cols);
            }
            sources.push(SourceTensor {
                name: name.to_string(),
                dims,
                dtype: DType::F32,
                data: std::borrow::Cow::Owned(
                    values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                ),
            });
            continue;
        }
        let data = std::borrow::Cow::Borrowed(raw);
        sources.push(SourceTensor {
            name: name.to_string(),
            dims,
            dtype,
            data,
        });
    }
    // The order llama.cpp writes: embeddings, the blocks in order, the output.
    sources.sort_by_key(|s| tensor_order(&s.name));
    write_quantized(metadata, sources, plan, out, threads, progress)
}

fn tensor_order(name: &str) -> (usize, usize, String) {
    match name.strip_prefix("blk.") {
        Some(rest) => {
            let (layer, part) = rest.split_once('.').unwrap_or((rest, ""));
            (1, layer.parse().unwrap_or(usize::MAX), part.to_string())
        }
        None if name.starts_with("token_embd") => (0, 0, name.to_string()),
        None => (2, 0, name.to_string()),
    }
}

/// Writes `sources` re-quantized by `plan` with `metadata` (its file-type and plan keys
/// replaced) into `out`, atomically.
fn write_quantized(
    metadata: Vec<(String, Value)>,
    sources: Vec<SourceTensor<'_>>,
    plan: &QuantPlan,
    out: &Path,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize, &TensorPlan),
) -> Result<QuantizeSummary, EngineError> {
    let tied = !sources.iter().any(|t| t.name == "output.weight");
    let mut writer = GgufWriter::new();
    for (key, value) in metadata {
        if key == "general.file_type"
            || key == "general.quantization_version"
            || key.starts_with("rampart.quantization.")
        {
            continue;
        }
        writer
            .metadata(&key, value)
            .map_err(|e| EngineError::Load(e.to_string()))?;
    }
    writer
        .metadata("general.file_type", Value::U32(file_type(plan.default)))
        .and_then(|w| w.metadata("general.quantization_version", Value::U32(2)))
        .and_then(|w| w.metadata("rampart.quantization.plan", Value::String(plan.to_toml())))
        .map_err(|e| EngineError::Load(e.to_string()))?;

    let mut used = vec![false; plan.rules.len()];
    let mut tensors = Vec::with_capacity(sources.len());
    let mut datas: Vec<Vec<u8>> = Vec::with_capacity(sources.len());
    let count = sources.len();
    let mut source_bytes = 0;
    let mut parameters = 0;
    for (index, t) in sources.iter().enumerate() {
        let from = t.dtype;
        let elements: u64 = t.dims.iter().product();
        let row_len = t.dims.first().copied().unwrap_or(1) as usize;
        let rows = (elements as usize) / row_len.max(1);
        let matrix = t.dims.iter().filter(|&&d| d > 1).count() >= 2;
        let (wanted, rule) = if matrix && !t.name.starts_with("rope_freqs") {
            plan.choose(&names_of(&t.name, tied))
        } else {
            (DType::F32, None)
        };
        if let Some(r) = rule {
            used[r] = true;
        }
        let written = fallback(wanted, row_len);
        let src_row = from.row_bytes(row_len).ok_or_else(|| EngineError::Tensor {
            name: t.name.clone(),
            reason: format!("rows of {row_len} do not fit {} blocks", from.name()),
        })?;
        let dst_row = written
            .row_bytes(row_len)
            .ok_or_else(|| EngineError::Tensor {
                name: t.name.clone(),
                reason: format!("rows of {row_len} do not fit {} blocks", written.name()),
            })?;
        let mut out_bytes = vec![0u8; rows * dst_row];
        convert_rows(
            from,
            written,
            &t.data,
            &mut out_bytes,
            row_len,
            src_row,
            dst_row,
            threads,
        )
        .map_err(|e| EngineError::Tensor {
            name: t.name.clone(),
            reason: e.to_string(),
        })?;
        source_bytes += t.data.len() as u64;
        parameters += elements;
        let info = TensorPlan {
            name: t.name.clone(),
            shape: t.dims.clone(),
            from: from.name().to_string(),
            wanted: wanted.name().to_string(),
            written: written.name().to_string(),
            rule,
            bytes: out_bytes.len() as u64,
        };
        progress(index, count, &info);
        tensors.push(info);
        datas.push(out_bytes);
    }
    drop(sources);
    for (t, data) in tensors.iter().zip(datas) {
        let dtype = plan_type(&t.written)?;
        writer
            .tensor(&t.name, &t.shape, ggml_type(dtype)?, data)
            .map_err(|e| EngineError::Load(e.to_string()))?;
    }
    // A name of its own, so that two processes converting the same model do not collide.
    let tmp = out.with_extension(format!("partial-{}", std::process::id()));
    let f = std::fs::File::create(&tmp)
        .map_err(|e| EngineError::Load(format!("{}: {e}", tmp.display())))?;
    let mut w = std::io::BufWriter::new(f);
    writer
        .write_to(&mut w)
        .map_err(|e| EngineError::Load(format!("writing {}: {e}", out.display())))?;
    std::io::Write::flush(&mut w).map_err(|e| EngineError::Load(e.to_string()))?;
    drop(w);
    std::fs::rename(&tmp, out).map_err(|e| EngineError::Load(format!("{}: {e}", out.display())))?;
    let output_bytes = std::fs::metadata(out).map(|m| m.len()).unwrap_or(0);
    Ok(QuantizeSummary {
        unused_rules: plan
            .rules
            .iter()
            .zip(&used)
            .filter(|(_, u)| !**u)
            .map(|((p, _), _)| p.clone())
            .collect(),
        tensors,
        source_bytes,
        output_bytes,
        parameters,
    })
}

/// Converts a model (a GGUF file or a Hugging Face folder) by `plan` into the GGUF `out`.
pub fn quantize_model(
    src: &Path,
    plan: &QuantPlan,
    out: &Path,
    threads: usize,
    progress: &mut dyn FnMut(usize, usize, &TensorPlan),
) -> Result<QuantizeSummary, EngineError> {
    if src.is_dir() {
        quantize_hf(src, plan, out, threads, progress)
    } else {
        quantize_gguf(src, plan, out, threads, progress)
    }
}

/// Quantization at load time: the model's weights go through `plan` once, into a file in
/// `cache_dir` named by the source (path, size, modification time) and the plan; later loads
/// find it there.
#[derive(Debug, Clone, PartialEq)]
pub struct InSitu {
    pub plan: QuantPlan,
    pub cache_dir: PathBuf,
}

impl InSitu {
    /// The default cache folder: `$XDG_CACHE_HOME/rampart/quantized`, else
    /// `~/.cache/rampart/quantized`, else the temporary folder's `rampart-quantized`.
    pub fn default_cache_dir() -> PathBuf {
        if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
            return PathBuf::from(x).join("rampart/quantized");
        }
        if let Some(h) = std::env::var_os("HOME").filter(|v| !v.is_empty()) {
            return PathBuf::from(h).join(".cache/rampart/quantized");
        }
        std::env::temp_dir().join("rampart-quantized")
    }

    /// From a type name (`Q4_K`: one type for every matrix) or the path of a plan file.
    pub fn from_spec(spec: &str, cache_dir: Option<PathBuf>) -> Result<Self, EngineError> {
        let plan = if PLAN_TYPES
            .iter()
            .any(|t| t.name().eq_ignore_ascii_case(spec))
        {
            QuantPlan::uniform(plan_type(spec)?)
        } else {
            let text = std::fs::read_to_string(spec).map_err(|e| {
                EngineError::InvalidRequest(format!(
                    "quantization {spec:?} is neither a type ({}) nor a readable plan file: {e}",
                    plan_type_names()
                ))
            })?;
            QuantPlan::parse(&text)?
        };
        Ok(Self {
            plan,
            cache_dir: cache_dir.unwrap_or_else(Self::default_cache_dir),
        })
    }

    /// Where the quantized copy of `src` lives (made now if it is not there yet).
    pub fn prepare(&self, src: &Path) -> Result<PathBuf, EngineError> {
        use sha2::{Digest, Sha256};
        let stamp = |path: &Path, h: &mut Sha256| -> Result<(), EngineError> {
            let meta = std::fs::metadata(path)
                .map_err(|e| EngineError::Load(format!("{}: {e}", path.display())))?;
            let modified = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            h.update(path.to_string_lossy().as_bytes());
            h.update(meta.len().to_le_bytes());
            h.update(modified.to_le_bytes());
            Ok(())
        };
        let canonical = std::fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf());
        let mut h = Sha256::new();
        if canonical.is_dir() {
            // A folder: every file in it (a changed shard or tokenizer is a new source).
            let mut files: Vec<PathBuf> = std::fs::read_dir(&canonical)
                .map_err(|e| EngineError::Load(format!("{}: {e}", canonical.display())))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file())
                .collect();
            files.sort();
            for f in &files {
                stamp(f, &mut h)?;
            }
        } else {
            stamp(&canonical, &mut h)?;
        }
        h.update(self.plan.to_toml().as_bytes());
        let key = hex::encode(h.finalize());
        let out = self.cache_dir.join(format!("{}.gguf", &key[..32]));
        if out.is_file() {
            return Ok(out);
        }
        std::fs::create_dir_all(&self.cache_dir)
            .map_err(|e| EngineError::Load(format!("{}: {e}", self.cache_dir.display())))?;
        quantize_model(
            src,
            &self.plan,
            &out,
            kernels::backend::physical_cores(),
            &mut |_, _, _| {},
        )?;
        Ok(out)
    }
}

/// Why a tensor's rows could not be converted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ConvertRowsError {
    #[error("the tensor's data is shorter than its shape")]
    ShortData,
    #[error(transparent)]
    Quantize(#[from] kernels::quantize::QuantizeError),
    #[error("a quantizer thread panicked")]
    ThreadPanicked,
}

/// Dequantizes each row of `src` and quantizes it into `dst`, rows split over threads.
#[allow(clippy::too_many_arguments)]
fn convert_rows(
    from: DType,
    to: DType,
    src: &[u8],
    dst: &mut [u8],
    row_len: usize,
    src_row: usize,
    dst_row: usize,
    threads: usize,
) -> Result<(), ConvertRowsError> {
    let rows = dst.len() / dst_row.max(1);
    if src.len() < rows * src_row {
        return Err(ConvertRowsError::ShortData);
    }
    if from == to {
        dst.copy_from_slice(&src[..rows * src_row]);
        return Ok(());
    }
    let threads = threads.clamp(1, rows.max(1));
    let per = rows.div_ceil(threads);
    std::thread::scope(|scope| {
        let handles: Vec<_> = dst
            .chunks_mut(per * dst_row)
            .enumerate()
            .map(|(k, out)| {
                let first = k * per;
                scope.spawn(move || -> Result<(), ConvertRowsError> {
                    let mut row = vec![0f32; row_len];
                    for (j, o) in out.chunks_mut(dst_row).enumerate() {
                        let r = first + j;
                        kernels::quant::dequantize_row(
                            from,
                            &src[r * src_row..(r + 1) * src_row],
                            &mut row,
                        );
                        kernels::quantize::quantize_row(to, &row, o)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| ConvertRowsError::ThreadPanicked)?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_shells() {
        assert!(glob("*.mlp.*", "model.layers.3.mlp.up_proj"));
        assert!(glob(
            "*.self_attn.o_proj",
            "model.layers.12.self_attn.o_proj"
        ));
        assert!(!glob(
            "*.self_attn.o_proj",
            "model.layers.12.self_attn.o_proj.weight"
        ));
        assert!(glob("blk.?.attn_*", "blk.3.attn_q.weight"));
        assert!(!glob("blk.?.attn_*", "blk.13.attn_q.weight"));
        assert!(glob("*", ""));
        assert!(glob("lm_head", "lm_head"));
        assert!(!glob("lm_head", "lm_head2"));
    }

    #[test]
    fn plans_parse_choose_and_round_trip() {
        let plan = QuantPlan::parse(
            r#"default = "q4_k"
rules = [
  { match = "*.self_attn.o_proj", type = "F16" },
  { match = "lm_head", type = "Q8_0" },
  { match = "*.mlp.*", type = "Q4_K" },
]"#,
        )
        .unwrap();
        assert_eq!(plan.default, DType::Q4_K);
        let pick = |n: &str, tied: bool| plan.choose(&names_of(n, tied));
        assert_eq!(
            pick("blk.7.attn_output.weight", false),
            (DType::F16, Some(0))
        );
        assert_eq!(pick("output.weight", false), (DType::Q8_0, Some(1)));
        assert_eq!(pick("token_embd.weight", true), (DType::Q8_0, Some(1)));
        assert_eq!(pick("token_embd.weight", false), (DType::Q4_K, None));
        assert_eq!(pick("blk.0.ffn_up.weight", false), (DType::Q4_K, Some(2)));
        assert_eq!(QuantPlan::parse(&plan.to_toml()).unwrap(), plan);
        for bad in [
            "default = \"Q3_K\"",
            "default = \"Q4_K\"\nrules = [{ match = \"x\", type = \"Q9\" }]",
            "default = \"Q4_K\"\nextra = 1",
            "rules = []",
            "default = \"Q4_K\"\nrules = [{ match = \"\", type = \"F16\" }]",
        ] {
            assert!(QuantPlan::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn in_situ_quantization_converts_once_and_the_engine_runs_it() {
        use crate::{Engine, EngineOptions, GenerateRequest, Prompt};
        let dir = tempfile::tempdir().unwrap();
        let tiny = formats::tiny::TinyLlama {
            embedding_length: 256,
            feed_forward_length: 512,
            ..Default::default()
        };
        let src = dir.path().join("tiny.gguf");
        std::fs::write(&src, tiny.to_gguf().unwrap()).unwrap();
        let q8 = InSitu {
            plan: QuantPlan::uniform(DType::Q8_0),
            cache_dir: dir.path().join("cache"),
        };
        let first = q8.prepare(&src).unwrap();
        let stamp = std::fs::metadata(&first).unwrap().modified().unwrap();
        let again = q8.prepare(&src).unwrap();
        assert_eq!(first, again);
        assert_eq!(
            std::fs::metadata(&again).unwrap().modified().unwrap(),
            stamp
        );
        let file = GgufFile::open(&first).unwrap();
        let t = file.header().tensor("blk.0.ffn_up.weight").unwrap();
        assert_eq!(t.ggml_type, GgmlType::Q8_0);
        let q4 = InSitu {
            plan: QuantPlan::uniform(DType::Q4_K),
            ..q8.clone()
        };
        assert_ne!(
            q4.prepare(&src).unwrap(),
            first,
            "another plan, another file"
        );
        let options = EngineOptions {
            threads: 1,
            quantization: Some(q8),
            ..EngineOptions::default()
        };
        let engine = Engine::load(&src, &options).unwrap();
        // A random model may sample its end-of-text token early (seen once in a full run).
        let mut request = GenerateRequest::new(Prompt::Text("the".into()), 3);
        request.ignore_eos = true;
        let stream = engine.generate(request).unwrap();
        let tokens = stream
            .filter(|e| matches!(e, crate::Event::Token(_)))
            .count();
        assert_eq!(tokens, 3);
        assert!(InSitu::from_spec("Q9_Z", None).is_err());
        assert_eq!(
            InSitu::from_spec("q6_k", Some(dir.path().into()))
                .unwrap()
                .plan,
            QuantPlan::uniform(DType::Q6_K)
        );
    }

    #[test]
    fn hugging_face_folders_convert_to_the_gguf_llama_cpp_would_write() {
        use crate::{Engine, EngineOptions};
        use formats::tiny::{TinyArchitecture, TinyFloat, TinyLlama};
        let dir = tempfile::tempdir().unwrap();
        for (k, (architecture, weight_type, tied)) in [
            (TinyArchitecture::Llama, TinyFloat::F16, true),
            (TinyArchitecture::Llama, TinyFloat::BF16, false),
            (TinyArchitecture::Qwen2, TinyFloat::F32, false),
            (
                TinyArchitecture::Mistral { sliding_window: 3 },
                TinyFloat::BF16,
                true,
            ),
        ]
        .into_iter()
        .enumerate()
        {
            let tiny = TinyLlama {
                architecture,
                weight_type,
                tied_embeddings: tied,
                ..TinyLlama::default()
            };
            let hf = dir.path().join(format!("hf{k}"));
            tiny.write_hf_folder(&hf, 1 + k % 2).unwrap();
            let out = dir.path().join(format!("out{k}.gguf"));
            let summary = quantize_hf(
                &hf,
                &QuantPlan::uniform(DType::F32),
                &out,
                2,
                &mut |_, _, _| {},
            )
            .unwrap();
            assert!(summary.tensors.iter().all(|t| t.written == "F32"));
            // What llama.cpp's converter writes: GGUF names, permuted llama Q/K, the shape and
            // the tokenizer in metadata.
            let file = GgufFile::open(&out).unwrap();
            let h = file.header();
            assert_eq!(
                h.get_str("general.architecture").unwrap(),
                Some(architecture.name())
            );
            assert!(h.tensor("blk.1.attn_q.weight").is_some());
            assert_eq!(h.tensor("output.weight").is_some(), !tied);
            assert_eq!(
                h.get_u64("llama.attention.sliding_window").ok().flatten(),
                architecture.sliding_window().map(u64::from)
            );
            assert_eq!(h.get_str("tokenizer.ggml.model").unwrap(), Some("gpt2"));
            assert!(h.get_str("tokenizer.chat_template").unwrap().is_some());
            // The converted GGUF computes what the folder computes.
            let options = EngineOptions {
                threads: 1,
                ..EngineOptions::default()
            };
            let from_hf = Engine::load(&hf, &options).unwrap();
            let from_gguf = Engine::load(&out, &options).unwrap();
            let ids = from_hf
                .tokenizer()
                .encode("the cat in the hat", false)
                .unwrap();
            assert_eq!(
                from_gguf
                    .tokenizer()
                    .encode("the cat in the hat", false)
                    .unwrap(),
                ids
            );
            let (a, b) = (
                from_hf.logits(&ids).unwrap(),
                from_gguf.logits(&ids).unwrap(),
            );
            let diff = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-3,
                "{architecture:?} {weight_type:?}: logits differ by {diff}"
            );
        }
    }

    #[test]
    fn rows_that_do_not_fit_fall_back_as_llama_cpp_does() {
        assert_eq!(fallback(DType::Q4_K, 576), DType::Q5_0);
        assert_eq!(fallback(DType::Q4_K, 1536), DType::Q4_K);
        assert_eq!(fallback(DType::Q6_K, 576), DType::Q8_0);
        assert_eq!(fallback(DType::Q5_K, 576), DType::Q5_1);
        assert_eq!(fallback(DType::Q4_0, 40), DType::F16);
    }
}
