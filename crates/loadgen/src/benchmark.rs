//! The benchmark driver: owns the async runtime and HTTP client, resolves the model, and runs
//! each level. A closed loop is exactly `concurrency` worker tasks pulling request indices from a
//! shared counter (a worker sends its next request when its last one finishes, retries
//! included). An open loop sleeps until each arrival of its schedule and starts the request in a
//! task of its own, unless `max_outstanding` requests are outstanding: then the arrival is
//! dropped and counted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Deserialize;
use tokio::task::JoinSet;

use crate::arrivals::{ArrivalSchedule, Arrivals};
use crate::error::{error_chain, truncate_chars, LoadgenError, ERROR_TEXT_CHARS};
use crate::openai::Endpoint;
use crate::report::{BenchmarkReport, LevelReport, WarmupReport};
use crate::request::{execute, RequestOutcome, SendPolicy, Target};
use crate::workload::{PlannedRequest, SplitMix64, WorkloadConfig};

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
    /// Requests measured at each closed-loop level; arrivals at each open-loop level unless
    /// `open_loop_duration` is set.
    pub requests_per_level: usize,
    /// Requests sent one at a time before the first level, not measured.
    pub warmup_requests: usize,
    /// Limit on one attempt of a request, first byte to last.
    pub request_timeout: Duration,
    /// Retries of a request that failed as the official OpenAI clients retry (429, 408, 409,
    /// 5xx, no connection, no answer in time), waiting as they wait ([`crate::retry`]). 0 sends
    /// each request once; the official clients default to [`crate::retry::OFFICIAL_MAX_RETRIES`].
    pub max_retries: u32,
    /// Send an `X-Request-Id` with each request, the same on all its attempts.
    pub send_request_id: bool,
    /// Open loop: the most requests outstanding at once; an arrival beyond it is dropped
    /// (counted, never sent).
    pub max_outstanding: usize,
    /// Open loop: arrivals for this long instead of `requests_per_level` of them.
    pub open_loop_duration: Option<Duration>,
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
            max_retries: 0,
            send_request_id: false,
            max_outstanding: 1024,
            open_loop_duration: None,
        }
    }
}

/// The prompt stream of the warm-up; level `k` (counting from 0) uses stream `k + 1`.
const WARMUP_STREAM: u64 = 0;

/// Mixes a stream number into the seed of its arrival schedule, apart from its prompts'.
const SCHEDULE_SEED_MIX: u64 = 0xA076_1D64_78BD_642F;
/// Mixes a request's index into the seed of its retry jitter.
const JITTER_SEED_MIX: u64 = 0xE703_7ED1_A0B4_28DB;

pub struct Benchmark {
    runtime: tokio::runtime::Runtime,
    client: reqwest::Client,
    target: Arc<Target>,
    config: BenchmarkConfig,
    levels_run: u64,
    /// Starts every request id of this run, so that two runs against one server do not collide.
    run_id: String,
}

/// Sends the requests of one level (or of the warm-up): shared by its tasks.
struct Sender {
    client: reqwest::Client,
    target: Arc<Target>,
    policy: SendPolicy,
    /// `Some(prefix)`: request `i` is named `prefix-i`.
    request_id_prefix: Option<String>,
    jitter_seed: u64,
}

impl Sender {
    async fn send(&self, index: usize, planned: &PlannedRequest) -> RequestOutcome {
        let request_id = self
            .request_id_prefix
            .as_ref()
            .map(|prefix| format!("{prefix}-{index}"));
        let mut jitter =
            SplitMix64::new(self.jitter_seed ^ (index as u64).wrapping_mul(JITTER_SEED_MIX));
        execute(
            &self.client,
            &self.target,
            planned,
            self.policy,
            request_id.as_deref(),
            &mut jitter,
        )
        .await
    }
}

/// Requests outstanding now and at most, over one level.
#[derive(Default)]
struct Outstanding {
    now: AtomicUsize,
    peak: AtomicUsize,
}

/// One outstanding request; it stops counting when dropped.
struct OutstandingRequest(Arc<Outstanding>);

impl Outstanding {
    fn enter(self: &Arc<Self>) -> OutstandingRequest {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        OutstandingRequest(Arc::clone(self))
    }

    fn now(&self) -> usize {
        self.now.load(Ordering::SeqCst)
    }

    fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

impl Drop for OutstandingRequest {
    fn drop(&mut self) {
        self.0.now.fetch_sub(1, Ordering::SeqCst);
    }
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
        if config.max_outstanding == 0 {
            return Err(LoadgenError::InvalidSetting {
                name: "max_outstanding",
                reason: "must be at least 1".to_string(),
            });
        }
        if config
            .open_loop_duration
            .is_some_and(|duration| duration.is_zero())
        {
            return Err(LoadgenError::InvalidSetting {
                name: "duration",
                reason: "must be more than 0 s".to_string(),
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
        let started_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis());
        Ok(Self {
            runtime,
            client,
            target,
            config,
            levels_run: 0,
            run_id: format!("loadgen-{}-{started_ms}", std::process::id()),
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
    /// connection), retrying as the levels do; failures are counted, not fatal.
    pub fn warm_up(&mut self) -> WarmupReport {
        let plan = self
            .config
            .workload
            .plan(WARMUP_STREAM, self.config.warmup_requests);
        let sender = self.sender(WARMUP_STREAM);
        let outcomes = self.runtime.block_on(async {
            let mut outcomes = Vec::with_capacity(plan.len());
            for (index, planned) in plan.iter().enumerate() {
                outcomes.push(sender.send(index, planned).await);
            }
            outcomes
        });
        let failures: Vec<_> = outcomes
            .iter()
            .filter_map(|outcome| outcome.result.as_ref().err())
            .collect();
        WarmupReport {
            requests: outcomes.len(),
            completed: outcomes.len() - failures.len(),
            failed: failures.len(),
            first_error: failures.first().map(|error| error.to_string()),
        }
    }

    /// Runs `requests_per_level` requests with `concurrency` in flight at a time (a closed
    /// loop): [`run`](Self::run) with [`Arrivals::Closed`].
    pub fn run_level(&mut self, concurrency: usize) -> Result<LevelReport, LoadgenError> {
        self.run(Arrivals::Closed { concurrency })
    }

    /// Runs one level with `arrivals`: a closed loop sends `requests_per_level` requests; an open
    /// loop sends its arrivals until `open_loop_duration` has passed (or `requests_per_level`
    /// arrived, without a duration), then waits for the requests outstanding. Each call draws
    /// fresh prompts (the k-th call uses prompt stream k + 1 of the seed).
    pub fn run(&mut self, arrivals: Arrivals) -> Result<LevelReport, LoadgenError> {
        arrivals.validate()?;
        self.levels_run += 1;
        let stream = WARMUP_STREAM + self.levels_run;
        let sender = Arc::new(self.sender(stream));
        let outstanding = Arc::new(Outstanding::default());
        let (outcomes, dropped, duration) = match arrivals {
            Arrivals::Closed { concurrency } => {
                let plan = Arc::new(
                    self.config
                        .workload
                        .plan(stream, self.config.requests_per_level),
                );
                let started = Instant::now();
                let outcomes = self.runtime.block_on(closed_loop(
                    concurrency,
                    sender,
                    plan,
                    Arc::clone(&outstanding),
                ))?;
                (outcomes, 0, started.elapsed())
            }
            Arrivals::Poisson { .. } | Arrivals::Burst { .. } => {
                let schedule = ArrivalSchedule::new(
                    arrivals,
                    self.config.workload.seed ^ stream.wrapping_mul(SCHEDULE_SEED_MIX),
                );
                let end = match self.config.open_loop_duration {
                    Some(duration) => OpenLoopEnd::After(duration),
                    None => OpenLoopEnd::Arrivals(self.config.requests_per_level),
                };
                let requests = self.config.workload.requests(stream);
                let started = Instant::now();
                let (outcomes, dropped) = self.runtime.block_on(open_loop(
                    schedule,
                    end,
                    requests,
                    self.config.max_outstanding,
                    sender,
                    Arc::clone(&outstanding),
                ))?;
                (outcomes, dropped, started.elapsed())
            }
        };
        Ok(LevelReport::from_outcomes(
            arrivals,
            duration,
            &outcomes,
            dropped,
            outstanding.peak(),
        ))
    }

    fn sender(&self, stream: u64) -> Sender {
        Sender {
            client: self.client.clone(),
            target: Arc::clone(&self.target),
            policy: SendPolicy {
                attempt_timeout: self.config.request_timeout,
                max_retries: self.config.max_retries,
            },
            request_id_prefix: self
                .config
                .send_request_id
                .then(|| format!("{}-{stream}", self.run_id)),
            jitter_seed: self.config.workload.seed ^ stream.wrapping_mul(JITTER_SEED_MIX),
        }
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
            max_retries: self.config.max_retries,
            request_id: self.config.send_request_id,
            max_outstanding: self.config.max_outstanding,
            open_loop_duration_s: self
                .config
                .open_loop_duration
                .map(|duration| duration.as_secs_f64()),
        }
    }
}

/// `concurrency` workers, each sending the next request of `plan` when its last one finished.
async fn closed_loop(
    concurrency: usize,
    sender: Arc<Sender>,
    plan: Arc<Vec<PlannedRequest>>,
    outstanding: Arc<Outstanding>,
) -> Result<Vec<RequestOutcome>, LoadgenError> {
    let next_index = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (sender, plan) = (Arc::clone(&sender), Arc::clone(&plan));
            let (next_index, outstanding) = (Arc::clone(&next_index), Arc::clone(&outstanding));
            tokio::spawn(async move {
                let mut outcomes = Vec::new();
                loop {
                    let index = next_index.fetch_add(1, Ordering::Relaxed);
                    let Some(planned) = plan.get(index) else {
                        break outcomes;
                    };
                    let _outstanding = outstanding.enter();
                    outcomes.push(sender.send(index, planned).await);
                }
            })
        })
        .collect();
    let mut outcomes = Vec::with_capacity(plan.len());
    for worker in workers {
        outcomes.extend(worker.await?);
    }
    Ok(outcomes)
}

/// When an open loop stops sending.
#[derive(Debug, Clone, Copy)]
enum OpenLoopEnd {
    /// No arrival at or after this offset from the start.
    After(Duration),
    /// After this many arrivals.
    Arrivals(usize),
}

/// Sends each arrival of `schedule` at its time in a task of its own, the next request of
/// `requests` each (a dropped arrival uses up its request too, so that request `i` is always
/// the `i`-th arrival's), then waits for them all. Returns the outcomes and the arrivals dropped.
async fn open_loop(
    schedule: ArrivalSchedule,
    end: OpenLoopEnd,
    requests: impl Iterator<Item = PlannedRequest>,
    max_outstanding: usize,
    sender: Arc<Sender>,
    outstanding: Arc<Outstanding>,
) -> Result<(Vec<RequestOutcome>, usize), LoadgenError> {
    let start = tokio::time::Instant::now();
    let mut tasks = JoinSet::new();
    let mut outcomes = Vec::new();
    let mut dropped = 0;
    for (index, (offset, planned)) in schedule.zip(requests).enumerate() {
        let ended = match end {
            OpenLoopEnd::After(duration) => offset >= duration,
            OpenLoopEnd::Arrivals(count) => index >= count,
        };
        if ended {
            break;
        }
        tokio::time::sleep_until(start + offset).await;
        // Finished tasks are collected as the loop goes, so that a long run holds only the
        // outstanding ones.
        while let Some(joined) = tasks.try_join_next() {
            outcomes.push(joined?);
        }
        if outstanding.now() >= max_outstanding {
            dropped += 1;
            continue;
        }
        let entered = outstanding.enter();
        let sender = Arc::clone(&sender);
        tasks.spawn(async move {
            let _outstanding = entered;
            sender.send(index, &planned).await
        });
    }
    while let Some(joined) = tasks.join_next().await {
        outcomes.push(joined?);
    }
    Ok((outcomes, dropped))
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
