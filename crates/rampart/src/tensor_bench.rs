//! `rampart bench tensor`: latency and throughput of a tensor model at three levels — the raw
//! backend call, the model behind its dynamic batcher (in process), and the server over HTTP
//! (KServe v2 binary tensors) — so the server's overhead over the backend is a measured ratio.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use classic::{BackendChoice, Data, Tensor, TensorModel};
use serde_json::json;

pub struct TensorBench {
    pub model: String,
    pub repo: PathBuf,
    pub image: PathBuf,
    pub backend: BackendChoice,
    pub seconds: f64,
    pub concurrency: usize,
    pub url: Option<String>,
    pub served_name: Option<String>,
    pub api_key: Option<String>,
    pub json: bool,
}

/// Latency percentiles (ms) and throughput of one level.
#[derive(Debug, Clone, serde::Serialize)]
struct Level {
    requests: usize,
    seconds: f64,
    per_s: f64,
    p50_ms: f64,
    p99_ms: f64,
}

fn level(mut lat: Vec<f64>, seconds: f64) -> Level {
    lat.sort_by(f64::total_cmp);
    let pick = |q: f64| {
        if lat.is_empty() {
            0.0
        } else {
            lat[((lat.len() - 1) as f64 * q).round() as usize] * 1e3
        }
    };
    Level {
        requests: lat.len(),
        seconds,
        per_s: lat.len() as f64 / seconds.max(1e-9),
        p50_ms: pick(0.5),
        p99_ms: pick(0.99),
    }
}

/// Sequential calls for `seconds` (at least 20).
fn sequential(seconds: f64, mut call: impl FnMut() -> Result<()>) -> Result<Level> {
    for _ in 0..3 {
        call()?;
    }
    let start = Instant::now();
    let mut lat = Vec::new();
    while start.elapsed().as_secs_f64() < seconds || lat.len() < 20 {
        let t = Instant::now();
        call()?;
        lat.push(t.elapsed().as_secs_f64());
    }
    Ok(level(lat, start.elapsed().as_secs_f64()))
}

fn load(b: &TensorBench) -> Result<TensorModel> {
    let repository = repo::Repository::open(&b.repo);
    let reference: repo::ModelRef = b.model.parse()?;
    let loaded = repository
        .load(&reference, &repo::NoProgress)
        .with_context(|| format!("loading {reference} from {}", b.repo.display()))?;
    let options = classic::LoadOptions {
        backend: b.backend,
        ..classic::LoadOptions::default()
    };
    Ok(TensorModel::load(
        &loaded.version.dir,
        &loaded.manifest,
        &options,
    )?)
}

pub fn run(b: TensorBench) -> Result<()> {
    let model = Arc::new(load(&b)?);
    let bytes =
        std::fs::read(&b.image).with_context(|| format!("reading {}", b.image.display()))?;
    let input = model
        .image_input()
        .context("the model declares no image pre-processing")?;
    let images = Tensor::new(input, vec![1], Data::Bytes(vec![bytes.clone()]))?;
    let (x, _) = model.prepare_images(&images)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()?;

    // 1. The raw backend call, batch 1, one thread.
    let mut session = model.open_session()?;
    let raw = sequential(b.seconds, || {
        session.run(vec![x.clone()])?;
        Ok(())
    })?;
    // 2. Raw backend throughput: one thread per instance, each calling in a loop.
    let instances = model.instances().max(1);
    let raw_parallel = {
        let start = Instant::now();
        let mut handles = Vec::new();
        for _ in 0..instances {
            let mut s = model.open_session()?;
            let x = x.clone();
            let secs = b.seconds;
            handles.push(std::thread::spawn(move || -> Result<Vec<f64>> {
                let mut lat = Vec::new();
                let start = Instant::now();
                while start.elapsed().as_secs_f64() < secs {
                    let t = Instant::now();
                    s.run(vec![x.clone()])?;
                    lat.push(t.elapsed().as_secs_f64());
                }
                Ok(lat)
            }));
        }
        let mut lat = Vec::new();
        for h in handles {
            lat.extend(
                h.join()
                    .map_err(|_| anyhow::anyhow!("bench thread panicked"))??,
            );
        }
        level(lat, start.elapsed().as_secs_f64())
    };
    // 3. In process through the dynamic batcher, `concurrency` callers.
    let batched = runtime.block_on(concurrent(b.concurrency, b.seconds, {
        let model = Arc::clone(&model);
        let x = x.clone();
        move || {
            let model = Arc::clone(&model);
            let x = x.clone();
            async move {
                model.run(vec![x]).await?;
                Ok(())
            }
        }
    }))?;
    // 4. The server over HTTP: the same tensor as a binary KServe request.
    let server = match &b.url {
        Some(url) => {
            let name = b.served_name.clone().unwrap_or_else(|| model.name.clone());
            let client = reqwest::Client::builder()
                .pool_max_idle_per_host(64)
                .build()?;
            let body = Arc::new(kserve_body(&x));
            let endpoint = format!("{}/v2/models/{name}/infer", url.trim_end_matches('/'));
            let call = {
                let key = b.api_key.clone();
                move || {
                    let (client, endpoint, body, key) = (
                        client.clone(),
                        endpoint.clone(),
                        Arc::clone(&body),
                        key.clone(),
                    );
                    async move {
                        let mut req = client
                            .post(&endpoint)
                            .header("Inference-Header-Content-Length", body.1)
                            .header("Content-Type", "application/octet-stream")
                            .body(body.0.clone());
                        if let Some(k) = key {
                            req = req.bearer_auth(k);
                        }
                        let resp = req.send().await?;
                        let status = resp.status();
                        let bytes = resp.bytes().await?;
                        if !status.is_success() {
                            bail!("{status}: {}", String::from_utf8_lossy(&bytes));
                        }
                        Ok(())
                    }
                }
            };
            let one = runtime.block_on(concurrent(1, b.seconds, call.clone()))?;
            let many = runtime.block_on(concurrent(b.concurrency, b.seconds, call))?;
            Some((one, many))
        }
        None => None,
    };

    let overhead = server
        .as_ref()
        .map(|(one, _)| one.p50_ms / raw.p50_ms - 1.0);
    if b.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "model": model.name,
                "backend": model.backend(),
                "input_shape": x.shape,
                "instances": instances,
                "max_batch_size": model.max_batch_size(),
                "raw_batch1": raw,
                "raw_parallel": raw_parallel,
                "batched_in_process": batched,
                "server_batch1": server.as_ref().map(|s| &s.0),
                "server_concurrent": server.as_ref().map(|s| &s.1),
                "concurrency": b.concurrency,
                "server_overhead_batch1": overhead,
            }))?
        );
        return Ok(());
    }
    println!(
        "{} on {} ({} instances, max batch {}), input {:?}",
        model.name,
        model.backend(),
        instances,
        model.max_batch_size(),
        x.shape
    );
    let row = |name: &str, l: &Level| {
        println!(
            "{name:<34} {:>9.1}/s  p50 {:>8.2} ms  p99 {:>8.2} ms  ({} requests)",
            l.per_s, l.p50_ms, l.p99_ms, l.requests
        )
    };
    row("raw backend, batch 1", &raw);
    row(&format!("raw backend, {instances} threads"), &raw_parallel);
    row(&format!("batcher, {} callers", b.concurrency), &batched);
    if let Some((one, many)) = &server {
        row("server HTTP, 1 client", one);
        row(&format!("server HTTP, {} clients", b.concurrency), many);
        println!(
            "server overhead at batch 1 (p50 over the raw call): {:+.1}%",
            overhead.unwrap_or(0.0) * 100.0
        );
    }
    Ok(())
}

/// The binary KServe request for one tensor: (body, JSON header length).
fn kserve_body(x: &Tensor) -> (Vec<u8>, usize) {
    let raw = x.to_raw();
    let header = json!({
        "inputs": [{
            "name": x.name, "datatype": x.dtype().kserve(), "shape": x.shape,
            "parameters": {"binary_data_size": raw.len()}
        }],
        "parameters": {"binary_data_output": true}
    });
    let mut body = serde_json::to_vec(&header).unwrap_or_default();
    let len = body.len();
    body.extend_from_slice(&raw);
    (body, len)
}

/// `callers` loops calling `call` for `seconds`; latency of every call.
async fn concurrent<F, Fut>(callers: usize, seconds: f64, call: F) -> Result<Level>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<()>> + Send,
{
    for _ in 0..2 {
        call().await?;
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(seconds);
    let mut tasks = Vec::new();
    for _ in 0..callers.max(1) {
        let call = call.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let t = Instant::now();
                call().await?;
                lat.push(t.elapsed().as_secs_f64());
            }
            Ok::<_, anyhow::Error>(lat)
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await??);
    }
    Ok(level(lat, start.elapsed().as_secs_f64()))
}
