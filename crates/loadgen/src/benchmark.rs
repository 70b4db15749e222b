//! The benchmark driver: owns the async runtime and HTTP client, resolves the model, and runs
//! each concurrency level as exactly `concurrency` worker tasks pulling request indices from a
//! shared counter (a closed loop: a worker sends its next request when its last one finishes).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::error::{error_chain, truncate_chars, LoadgenError, RequestError, ERROR_TEXT_CHARS};
use crate::openai::Endpoint;
use crate::report::{BenchmarkReport, LevelReport, WarmupReport};
use crate::request::{execute, RequestRecord, Target};
use crate::workload::{PlannedRequest, WorkloadConfig};

/// Everything a run needs besides the concurrency levels.
#[derive(Debug, Clone)]
pub struct BenchmarkConfig {
    /// The server's base URL, with or without a trailing `/v1`.
    pub base_url: String,
    /// The model id sent in requests; `None` takes the first id of `GET /v1/models`.
    pub model: Option<String>,
    /// Sent as `Authorization: Bearer …`.
    pub api_key: Option<String>,
    pub endpoint: Endpoint,
    pub workload: WorkloadConfig,
    pub temperature: f64,
    /// Requests measured at each concurrency level.
    pub requests_per_level: usize,
    /// Requests sent one at a time before the first level, not measured.
    pub warmup_requests: usize,
    /// Limit on one whole request, first byte to last.
    pub request_timeout: Duration,
}

impl Default for BenchmarkConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8080".to_string(),
            model: None,
            api_key: None,
            endpoint: Endpoint::Completions,
            workload: WorkloadConfig::default(),
            temperature: 0.0,
            requests_per_level: 64,
            warmup_requests: 2,
            request_timeout: Duration::from_secs(600),
        }
    }
}

/// The prompt stream of the warm-up; level `k` (counting from 0) uses stream `k + 1`.
const WARMUP_STREAM: u64 = 0;

pub struct Benchmark {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
    target: Arc<Target>,
    config: BenchmarkConfig,
    levels_run: u64,
}

#[derive(Deserialize)]
struct ModelList {
    data: Vec<ModelEntry>,
}

#[derive(Deserialize)]
struct ModelEntry {
    id: String,
}

/// `http://host:port/v1/` → `http://host:port`: the endpoint paths carry the `/v1`.
fn normalize_base_url(url: &str) -> Result<String, LoadgenError> {
    let parsed = reqwest::Url::parse(url).map_err(|error| LoadgenError::InvalidSetting {
        name: "url",
        reason: format!("{url:?}: {error}"),
    })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(LoadgenError::InvalidSetting {
            name: "url",
            reason: format!("{url:?} is not an http:// URL"),
        });
    }
    let trimmed = url.trim_end_matches('/');
    Ok(trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_string())
}

impl Benchmark {
    /// Validates the settings, starts the runtime and, without an explicit model, asks the server
    /// for its first model id.
    pub fn new(config: BenchmarkConfig) -> Result<Self, LoadgenError> {
        config.workload.validate()?;
        if config.requests_per_level == 0 {
            return Err(LoadgenError::InvalidSetting {
                name: "requests",
                reason: "must be at least 1".to_string(),
            });
        }
        let base_url = normalize_base_url(&config.base_url)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(LoadgenError::Runtime)?;
        // A proxy between the generator and the server would be measured too; go direct.
        // Connections are not reused: llama-server closes its end after each stream without
        // saying so, and a pooled connection that dies under the next request would count as a
        // failure. A fresh connection per request is also what vLLM's benchmark_serving.py does.
        let client = reqwest::Client::builder()
            .no_proxy()
            .pool_max_idle_per_host(0)
            .build()
            .map_err(LoadgenError::Client)?;
        let model = match &config.model {
            Some(model) => model.clone(),
            None => runtime.block_on(first_model(
                &client,
                &base_url,
                config.api_key.as_deref(),
                config.request_timeout,
            ))?,
        };
        let target = Arc::new(Target {
            base_url,
            api_key: config.api_key.clone(),
            endpoint: config.endpoint,
            model,
            temperature: config.temperature,
        });
        Ok(Self {
            runtime,
            client,
            target,
            config,
            levels_run: 0,
        })
    }

    /// The model id the requests name.
    pub fn model(&self) -> &str {
        &self.target.model
    }

    pub fn config(&self) -> &BenchmarkConfig {
        &self.config
    }

    /// Sends the warm-up requests one at a time (loading weights, filling caches, opening a
    /// connection); failures are counted, not fatal.
    pub fn warm_up(&mut self) -> WarmupReport {
        let plan = self
            .config
            .workload
            .plan(WARMUP_STREAM, self.config.warmup_requests);
        let outcomes = self.runtime.block_on(async {
            let mut outcomes = Vec::with_capacity(plan.len());
            for planned in &plan {
                outcomes.push(
                    execute(
                        &self.client,
                        &self.target,
                        planned,
                        self.config.request_timeout,
                    )
                    .await,
                );
            }
            outcomes
        });
        let failures: Vec<&RequestError> =
            outcomes.iter().filter_map(|o| o.as_ref().err()).collect();
        WarmupReport {
            requests: outcomes.len(),
            completed: outcomes.len() - failures.len(),
            failed: failures.len(),
            first_error: failures.first().map(|error| error.to_string()),
        }
    }

    /// Runs `requests_per_level` requests with `concurrency` in flight at a time. Each call draws
    /// fresh prompts (the k-th call uses prompt stream k + 1 of the seed).
    pub fn run_level(&mut self, concurrency: usize) -> Result<LevelReport, LoadgenError> {
        if concurrency == 0 {
            return Err(LoadgenError::InvalidSetting {
                name: "concurrency",
                reason: "must be at least 1".to_string(),
            });
        }
        self.levels_run += 1;
        let plan = Arc::new(self.config.workload.plan(
            WARMUP_STREAM + self.levels_run,
            self.config.requests_per_level,
        ));
        let next_index = Arc::new(AtomicUsize::new(0));
        let timeout = self.config.request_timeout;
        let started = Instant::now();
        let outcomes = self.runtime.block_on(async {
            let workers: Vec<_> = (0..concurrency)
                .map(|_| {
                    let (client, target) = (self.client.clone(), Arc::clone(&self.target));
                    let (plan, next_index) = (Arc::clone(&plan), Arc::clone(&next_index));
                    tokio::spawn(async move {
                        worker(&client, &target, &plan, &next_index, timeout).await
                    })
                })
                .collect();
            let mut outcomes = Vec::with_capacity(plan.len());
            for worker in workers {
                outcomes.extend(worker.await?);
            }
            Ok::<_, LoadgenError>(outcomes)
        })?;
        Ok(LevelReport::from_outcomes(
            concurrency,
            started.elapsed(),
            &outcomes,
        ))
    }

    /// The JSON document of a run made of `warmup` and `levels`.
    pub fn report(&self, warmup: WarmupReport, levels: Vec<LevelReport>) -> BenchmarkReport {
        BenchmarkReport {
            url: self.target.base_url.clone(),
            endpoint: self.config.endpoint,
            model: self.target.model.clone(),
            workload: self.config.workload.clone(),
            temperature: self.config.temperature,
            requests_per_level: self.config.requests_per_level,
            prompt_tokens_approximate: true,
            warmup,
            levels,
        }
    }
}

async fn worker(
    client: &reqwest::Client,
    target: &Target,
    plan: &[PlannedRequest],
    next_index: &AtomicUsize,
    timeout: Duration,
) -> Vec<Result<RequestRecord, RequestError>> {
    let mut outcomes = Vec::new();
    while let Some(planned) = plan.get(next_index.fetch_add(1, Ordering::Relaxed)) {
        outcomes.push(execute(client, target, planned, timeout).await);
    }
    outcomes
}

async fn first_model(
    client: &reqwest::Client,
    base_url: &str,
    api_key: Option<&str>,
    timeout: Duration,
) -> Result<String, LoadgenError> {
    let url = format!("{base_url}/v1/models");
    let failed = |reason: String| LoadgenError::ModelList {
        url: url.clone(),
        reason,
    };
    let mut request = client.get(&url).timeout(timeout);
    if let Some(key) = api_key {
        request = request.bearer_auth(key);
    }
    let response = request
        .send()
        .await
        .map_err(|error| failed(error_chain(&error)))?;
    let status = response.status();
    let body = response
        .text()
        .await
        .map_err(|error| failed(error_chain(&error)))?;
    if !status.is_success() {
        return Err(failed(format!(
            "HTTP {}: {}",
            status.as_u16(),
            truncate_chars(body.trim(), ERROR_TEXT_CHARS)
        )));
    }
    let list: ModelList = serde_json::from_str(&body).map_err(|error| {
        failed(format!(
            "not an OpenAI model list ({error}): {}",
            truncate_chars(body.trim(), ERROR_TEXT_CHARS)
        ))
    })?;
    list.data
        .into_iter()
        .next()
        .map(|entry| entry.id)
        .ok_or(LoadgenError::NoModels { url })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls_lose_trailing_slash_and_v1() {
        for url in [
            "http://127.0.0.1:8080",
            "http://127.0.0.1:8080/",
            "http://127.0.0.1:8080/v1",
            "http://127.0.0.1:8080/v1/",
        ] {
            assert_eq!(normalize_base_url(url).unwrap(), "http://127.0.0.1:8080");
        }
        assert_eq!(
            normalize_base_url("http://host/proxy/v1").unwrap(),
            "http://host/proxy"
        );
        assert!(normalize_base_url("127.0.0.1:8080").is_err());
        assert!(normalize_base_url("ftp://host").is_err());
    }
}
