//! A model version's monitor baseline from a reference set, made offline (`rampart monitor
//! baseline MODEL --inputs DIR|FILE`).
//!
//! The reference inputs go through the very pipeline a served request takes — the HTTP router
//! in process, no port: decoding, the guard, admission, the backend, the record — and a record
//! sink collects the same observations the monitor sink takes from live traffic (images
//! measured as they are decoded, texts as they are read, the generation's entropy and the
//! classifier's confidence from the record). A baseline made here and the windows the server
//! later fills are therefore measured alike. Inputs the pipeline refuses or fails are reported
//! and left out, as they are left out of live monitoring.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{header, Request};
use futures_util::stream::{self, StreamExt};
use monitor::{Baseline, BaselineBuilder};
use record::{Bus, Delivery, Envelope, Sink, SinkFuture};
use serde::Serialize;
use tower::ServiceExt;

use crate::config::{ModelConfig, ServerConfig};
use crate::state::AppState;

/// Observations a baseline needs at least (the same floor as `baseline_requests`).
pub const MIN_OBSERVATIONS: u64 = 50;

/// Image files a reference folder may hold (tensor models with image pre-processing).
const IMAGE_EXTENSIONS: &[&str] = &[
    "png", "jpg", "jpeg", "bmp", "gif", "webp", "tif", "tiff", "pnm", "ppm", "pgm",
];

/// Text files whose whole content is one input when they sit in a reference folder.
const TEXT_EXTENSIONS: &[&str] = &["txt", "md", "text"];

/// The largest answer body read back (answers are only checked, not kept).
const MAX_ANSWER_BYTES: usize = 64 << 20;

/// Why a reference run could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReferenceError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The inputs do not fit the model, or too few of them were observed.
    #[error("{0}")]
    Input(String),
    /// The model could not be served.
    #[error("{0}")]
    Serve(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ReferenceError + '_ {
    move |source| ReferenceError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// How an LLM is asked each reference text.
#[derive(Debug, Clone)]
pub struct AskOptions {
    /// Tokens generated per input (the output monitors read the generation's entropy).
    pub max_tokens: u32,
    /// Sampling temperature; `None`: the server's default (as clients that send none get).
    pub temperature: Option<f32>,
}

impl Default for AskOptions {
    fn default() -> Self {
        Self {
            max_tokens: 64,
            temperature: None,
        }
    }
}

/// One reference input as the request a client would send.
#[derive(Debug, Clone)]
pub struct ReferenceRequest {
    /// Where it came from: a file, or `file:line`.
    pub origin: String,
    /// The route, e.g. `/v1/chat/completions` or `/v2/models/NAME/infer`.
    pub path: String,
    pub content_type: String,
    pub body: Vec<u8>,
}

/// The requests of a reference set for a model of `kind`:
/// - a folder: each image one input (tensor models); each `.txt`/`.md` file one text; each
///   `.jsonl` file one input per line; each `.json` file one request body; other files are
///   skipped (counted in the second value);
/// - a file: an image; a `.jsonl` file, one input per line; a `.json` request body; any other
///   text file, one input per non-empty line.
///
/// A JSONL line is a JSON string (a text) or a request body: chat (`messages`) or completion
/// (`prompt`) for LLMs, `input` for embedders, a KServe v2 JSON body for tensor models; the
/// model's name is filled in.
pub fn reference_requests(
    kind: repo::Kind,
    model: &str,
    inputs: &Path,
    ask: &AskOptions,
) -> Result<(Vec<ReferenceRequest>, usize), ReferenceError> {
    let maker = Maker { kind, model, ask };
    let mut requests = Vec::new();
    let mut skipped = 0;
    if inputs.is_dir() {
        let mut files = Vec::new();
        walk(inputs, &mut files)?;
        files.sort();
        for file in files {
            let ext = extension(&file);
            if IMAGE_EXTENSIONS.contains(&ext.as_str()) {
                requests.push(maker.image(&file)?);
            } else if ext == "jsonl" {
                requests.extend(maker.lines(&file, true)?);
            } else if ext == "json" {
                requests.push(maker.json_file(&file)?);
            } else if TEXT_EXTENSIONS.contains(&ext.as_str()) {
                let text = std::fs::read_to_string(&file).map_err(io(&file))?;
                let text = text.trim();
                if !text.is_empty() {
                    requests.push(maker.text(&file.display().to_string(), text)?);
                }
            } else {
                skipped += 1;
            }
        }
    } else if inputs.is_file() {
        let ext = extension(inputs);
        if IMAGE_EXTENSIONS.contains(&ext.as_str()) {
            requests.push(maker.image(inputs)?);
        } else if ext == "json" {
            requests.push(maker.json_file(inputs)?);
        } else {
            requests.extend(maker.lines(inputs, ext == "jsonl")?);
        }
    } else {
        return Err(ReferenceError::Input(format!(
            "{}: no such file or folder",
            inputs.display()
        )));
    }
    if requests.is_empty() {
        return Err(ReferenceError::Input(format!(
            "{}: no reference input found (images, .txt/.md texts, .jsonl lines or .json bodies)",
            inputs.display()
        )));
    }
    Ok((requests, skipped))
}

fn extension(path: &Path) -> String {
    path.extension()
        .and_then(|e| e.to_str())
        .unwrap_or("")
        .to_ascii_lowercase()
}

/// Every file under `dir` (hidden ones left out).
fn walk(dir: &Path, files: &mut Vec<PathBuf>) -> Result<(), ReferenceError> {
    for entry in std::fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            walk(&path, files)?;
        } else if path.is_file() {
            files.push(path);
        }
    }
    Ok(())
}

/// Turns inputs into requests for one model.
struct Maker<'a> {
    kind: repo::Kind,
    model: &'a str,
    ask: &'a AskOptions,
}

impl Maker<'_> {
    fn json(&self, origin: &str, path: &str, body: serde_json::Value) -> ReferenceRequest {
        ReferenceRequest {
            origin: origin.to_string(),
            path: path.to_string(),
            content_type: "application/json".into(),
            body: body.to_string().into_bytes(),
        }
    }

    /// KServe's path for the model, or for one version of it (`NAME@VERSION`).
    fn infer_path(&self) -> String {
        match self.model.split_once('@') {
            Some((name, version)) => format!("/v2/models/{name}/versions/{version}/infer"),
            None => format!("/v2/models/{}/infer", self.model),
        }
    }

    fn image(&self, file: &Path) -> Result<ReferenceRequest, ReferenceError> {
        if self.kind != repo::Kind::Onnx {
            return Err(ReferenceError::Input(format!(
                "{}: an image, but {} is a {} model (images feed tensor models with image \
                 pre-processing)",
                file.display(),
                self.model,
                self.kind
            )));
        }
        let body = std::fs::read(file).map_err(io(file))?;
        let ext = extension(file);
        let subtype = match ext.as_str() {
            "jpg" => "jpeg",
            "tif" => "tiff",
            other => other,
        };
        Ok(ReferenceRequest {
            origin: file.display().to_string(),
            path: self.infer_path(),
            content_type: format!("image/{subtype}"),
            body,
        })
    }

    /// A plain text: a user message (LLMs, rules), an embedding input.
    fn text(&self, origin: &str, text: &str) -> Result<ReferenceRequest, ReferenceError> {
        match self.kind {
            repo::Kind::Llm | repo::Kind::Rules => {
                let mut body = serde_json::json!({
                    "model": self.model,
                    "messages": [{"role": "user", "content": text}],
                });
                self.ask_into(&mut body);
                Ok(self.json(origin, "/v1/chat/completions", body))
            }
            repo::Kind::Embedding => Ok(self.json(
                origin,
                "/v1/embeddings",
                serde_json::json!({"model": self.model, "input": text}),
            )),
            repo::Kind::Onnx => Err(ReferenceError::Input(format!(
                "{origin}: a text, but {} is a tensor model (give images, or KServe v2 JSON \
                 bodies in .json/.jsonl files)",
                self.model
            ))),
        }
    }

    /// The generation settings a body leaves out (LLMs only).
    fn ask_into(&self, body: &mut serde_json::Value) {
        if self.kind != repo::Kind::Llm {
            return;
        }
        if let Some(map) = body.as_object_mut() {
            map.entry("max_tokens")
                .or_insert_with(|| self.ask.max_tokens.into());
            if let Some(t) = self.ask.temperature {
                map.entry("temperature").or_insert_with(|| t.into());
            }
            map.insert("stream".into(), false.into());
        }
    }

    /// A request body as the client would send it; its route from its shape.
    fn body(
        &self,
        origin: &str,
        mut body: serde_json::Value,
    ) -> Result<ReferenceRequest, ReferenceError> {
        if let serde_json::Value::String(text) = &body {
            return self.text(origin, text);
        }
        let Some(map) = body.as_object_mut() else {
            return Err(ReferenceError::Input(format!(
                "{origin}: a JSON string (a text) or object (a request body) is expected"
            )));
        };
        let path = match self.kind {
            repo::Kind::Onnx if map.contains_key("inputs") => self.infer_path(),
            repo::Kind::Embedding if map.contains_key("input") => "/v1/embeddings".into(),
            repo::Kind::Llm | repo::Kind::Rules if map.contains_key("messages") => {
                "/v1/chat/completions".into()
            }
            repo::Kind::Llm | repo::Kind::Rules if map.contains_key("prompt") => {
                "/v1/completions".into()
            }
            _ => {
                let wanted = match self.kind {
                    repo::Kind::Onnx => "inputs (a KServe v2 JSON body)",
                    repo::Kind::Embedding => "input",
                    repo::Kind::Llm | repo::Kind::Rules => "messages or prompt",
                };
                return Err(ReferenceError::Input(format!(
                    "{origin}: a request body for {} needs {wanted}",
                    self.model
                )));
            }
        };
        if self.kind != repo::Kind::Onnx {
            map.insert("model".into(), self.model.into());
        }
        self.ask_into(&mut body);
        Ok(self.json(origin, &path, body))
    }

    fn json_file(&self, file: &Path) -> Result<ReferenceRequest, ReferenceError> {
        let text = std::fs::read_to_string(file).map_err(io(file))?;
        let origin = file.display().to_string();
        let body = serde_json::from_str(&text)
            .map_err(|e| ReferenceError::Input(format!("{origin}: {e}")))?;
        self.body(&origin, body)
    }

    /// One input per non-empty line: JSON values (`.jsonl`) or plain texts.
    fn lines(&self, file: &Path, json: bool) -> Result<Vec<ReferenceRequest>, ReferenceError> {
        let text = std::fs::read_to_string(file).map_err(io(file))?;
        let mut out = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let origin = format!("{}:{}", file.display(), i + 1);
            if json {
                let value = serde_json::from_str(line)
                    .map_err(|e| ReferenceError::Input(format!("{origin}: {e}")))?;
                out.push(self.body(&origin, value)?);
            } else {
                out.push(self.text(&origin, line)?);
            }
        }
        Ok(out)
    }
}

/// A reference input the pipeline did not answer with a 2xx.
#[derive(Debug, Clone, Serialize)]
pub struct Failure {
    pub origin: String,
    pub status: u16,
    /// The start of the error body.
    pub error: String,
}

/// What a reference run made.
#[derive(Debug, Clone, Serialize)]
pub struct ReferenceRun {
    pub model: String,
    pub version: String,
    pub inputs: usize,
    pub answered: usize,
    /// Observations in the baseline (a batch of images gives several).
    pub observations: u64,
    pub failures: Vec<Failure>,
    pub seconds: f64,
    pub baseline: Baseline,
}

/// What the collecting sink has seen.
#[derive(Debug, Default)]
struct Collected {
    builder: BaselineBuilder,
    versions: BTreeSet<String>,
    features: Option<Option<repo::pipeline::MonitorFeatures>>,
}

/// The record sink of a reference run: the observations the monitor sink would take.
struct Collector {
    model: String,
    repo: PathBuf,
    collected: Arc<Mutex<Collected>>,
}

impl Sink for Collector {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn delivery(&self) -> Delivery {
        // Nothing may be lost: the run waits for its records.
        Delivery::Lossless {
            capacity: 1024,
            timeout: Duration::from_secs(600),
            acknowledge: false,
        }
    }

    fn write<'a>(&'a mut self, envelope: &'a Envelope) -> SinkFuture<'a> {
        let r = &envelope.record;
        if r.model == self.model {
            let mut observations = crate::monitors::observations(envelope);
            let mut c = self.collected.lock().unwrap_or_else(|e| e.into_inner());
            if !observations.is_empty() {
                c.versions.insert(r.version.clone());
                let features = c.features.get_or_insert_with(|| {
                    crate::monitors::declared_features(&self.repo, &r.model, &r.version)
                });
                if let Some(f) = features {
                    for o in &mut observations {
                        o.values.retain(|(name, _)| f.watches(name));
                    }
                }
                for o in &observations {
                    c.builder.add(o);
                }
            }
        }
        Box::pin(std::future::ready(Ok(())))
    }
}

/// Serves `model` in process with `config`'s settings (its `[[models]]` entry if it has one;
/// no fallback steps, no audit, no gRPC), sends every request `concurrency` at a time, and
/// freezes the observations into a baseline whose source is `source`.
pub async fn run(
    mut config: ServerConfig,
    model: &str,
    requests: Vec<ReferenceRequest>,
    concurrency: usize,
    source: String,
) -> Result<ReferenceRun, ReferenceError> {
    let started = Instant::now();
    let mut entry = config
        .models
        .iter()
        .find(|m| m.name == model)
        .cloned()
        .unwrap_or_else(|| ModelConfig::named(model));
    // A failing primary is a failure here, not a fallback's answer.
    entry.fallback.clear();
    config.models = vec![entry];
    config.grpc.enabled = false;
    // The reference run is not served to anyone: no audit log, whatever the deployment
    // requires of its serving (a production configuration has `required = true`).
    config.audit.enabled = false;
    config.audit.required = false;
    config.audit.mode = None;
    // The request path measures inputs only when the monitors are on.
    config.monitor.enabled = true;
    config
        .validate()
        .map_err(|e| ReferenceError::Serve(e.to_string()))?;
    let collected = Arc::new(Mutex::new(Collected::default()));
    let collector = Collector {
        model: model.to_string(),
        repo: config.repo.clone(),
        collected: Arc::clone(&collected),
    };
    let bus =
        Bus::start(vec![Box::new(collector)]).map_err(|e| ReferenceError::Serve(e.to_string()))?;
    let state = AppState::new(config, None, None, Arc::clone(&bus));
    crate::residency::install(&state);
    {
        let state = Arc::clone(&state);
        tokio::task::spawn_blocking(move || crate::load_models(&state))
            .await
            .map_err(|e| ReferenceError::Serve(format!("loading the model: {e}")))?;
    }
    if let Some(reason) = state.not_ready_reason() {
        return Err(ReferenceError::Serve(reason));
    }
    let router = crate::http::router(Arc::clone(&state));
    let inputs = requests.len();
    let outcomes: Vec<Option<Failure>> = stream::iter(requests)
        .map(|r| {
            let router = router.clone();
            async move { send(router, r).await }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    state.front.registry.clear();
    bus.shutdown(Duration::from_secs(60)).await;
    let failures: Vec<Failure> = outcomes.into_iter().flatten().collect();
    let c = std::mem::take(&mut *collected.lock().unwrap_or_else(|e| e.into_inner()));
    let observations = c.builder.observations();
    if observations < MIN_OBSERVATIONS {
        let first = failures.first().map_or(String::new(), |f| {
            format!(
                "; {} of {inputs} inputs failed, the first ({}) with {}: {}",
                failures.len(),
                f.origin,
                f.status,
                f.error
            )
        });
        return Err(ReferenceError::Input(format!(
            "{observations} observations of {model}, fewer than the {MIN_OBSERVATIONS} a \
             baseline needs{first}"
        )));
    }
    let version = c.versions.into_iter().collect::<Vec<_>>().join(",");
    Ok(ReferenceRun {
        model: model.to_string(),
        version,
        inputs,
        answered: inputs - failures.len(),
        observations,
        failures,
        seconds: started.elapsed().as_secs_f64(),
        baseline: c.builder.finish(source),
    })
}

/// Sends one request through the router and reads its whole answer.
async fn send(router: axum::Router, r: ReferenceRequest) -> Option<Failure> {
    let request = Request::post(&r.path)
        .header(header::CONTENT_TYPE, &r.content_type)
        .body(Body::from(r.body));
    let request = match request {
        Ok(request) => request,
        Err(e) => {
            return Some(Failure {
                origin: r.origin,
                status: 0,
                error: e.to_string(),
            })
        }
    };
    let response = match router.oneshot(request).await {
        Ok(response) => response,
        Err(never) => match never {},
    };
    let status = response.status();
    // The record is made when the answer ends: read it whole.
    let body = axum::body::to_bytes(response.into_body(), MAX_ANSWER_BYTES).await;
    if status.is_success() {
        return None;
    }
    let text = body
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    Some(Failure {
        origin: r.origin,
        status: status.as_u16(),
        error: text.chars().take(300).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, body: &[u8]) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p
    }

    #[test]
    fn folders_and_files_become_the_requests_a_client_would_send() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        write(d, "a.txt", b"  What is the capital of France?\n");
        write(
            d,
            "b.jsonl",
            b"\"plain text\"\n\n{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"max_tokens\":3}\n{\"prompt\":\"Once\"}\n",
        );
        write(d, "notes.bin", b"\x00\x01");
        write(d, ".hidden.txt", b"never");
        let ask = AskOptions {
            max_tokens: 16,
            temperature: Some(0.7),
        };
        let (reqs, skipped) = reference_requests(repo::Kind::Llm, "m", d, &ask).unwrap();
        assert_eq!(skipped, 1);
        assert_eq!(reqs.len(), 4);
        let body =
            |i: usize| -> serde_json::Value { serde_json::from_slice(&reqs[i].body).unwrap() };
        assert_eq!(reqs[0].path, "/v1/chat/completions");
        assert_eq!(
            body(0)["messages"][0]["content"],
            "What is the capital of France?"
        );
        assert_eq!(body(0)["max_tokens"], 16);
        assert_eq!(body(1)["messages"][0]["content"], "plain text");
        // A body's own settings stay; the model is filled in.
        assert_eq!(body(2)["max_tokens"], 3);
        assert_eq!(body(2)["model"], "m");
        assert_eq!(reqs[3].path, "/v1/completions");
        assert!(reqs[3].origin.ends_with("b.jsonl:4"), "{}", reqs[3].origin);

        // A text file given alone: one input per line.
        let lines = write(d, "lines.md", b"one\n\ntwo\n");
        let (reqs, _) =
            reference_requests(repo::Kind::Embedding, "e", &lines, &AskOptions::default()).unwrap();
        assert_eq!(reqs.len(), 2);
        assert_eq!(reqs[1].path, "/v1/embeddings");

        // Images feed tensor models only, as raw bodies.
        let img = tempfile::tempdir().unwrap();
        write(img.path(), "x.JPG", b"\xff\xd8");
        let (reqs, _) =
            reference_requests(repo::Kind::Onnx, "t", img.path(), &AskOptions::default()).unwrap();
        assert_eq!(reqs[0].content_type, "image/jpeg");
        assert_eq!(reqs[0].path, "/v2/models/t/infer");
        let err = reference_requests(repo::Kind::Llm, "m", img.path(), &AskOptions::default())
            .unwrap_err();
        assert!(err.to_string().contains("tensor models"), "{err}");
        let err = reference_requests(repo::Kind::Onnx, "t", d, &AskOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("a text, but t is a tensor model"), "{err}");
        let bad = write(d, "bad.jsonl", b"{\"input\":\"x\"}\n");
        let err = reference_requests(repo::Kind::Llm, "m", &bad, &AskOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("needs messages or prompt"), "{err}");
        let empty = tempfile::tempdir().unwrap();
        assert!(reference_requests(repo::Kind::Llm, "m", empty.path(), &ask).is_err());
    }
}
