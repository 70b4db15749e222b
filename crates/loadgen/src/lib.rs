//! An OpenAI-compatible streaming load generator: drives any `/v1/completions` or
//! `/v1/chat/completions` endpoint with concurrent streaming requests and reports throughput and
//! latency percentiles (`rampart bench serve`), in the manner of vLLM's `benchmark_serving.py`.
//!
//! It works against any server that speaks the OpenAI streaming wire format (Rampart's own,
//! llama.cpp's `llama-server`, vLLM): it needs no tokenizer, counts output tokens as
//! content-bearing stream chunks unless the server reports usage, and builds prompts from common
//! English words so that prompt lengths in tokens are approximate.
//!
//! Load comes as a closed loop (N clients, each sending when its last request finished) or an
//! open loop ([`Arrivals`]: Poisson arrivals or bursts, each arrival a new request whatever is in
//! flight). A refused request can be sent again as the official OpenAI clients do it ([`retry`]:
//! 429, 408, 409, 5xx and connection failures, honouring `retry-after-ms` and `Retry-After`),
//! and the report gives both views: the server's (each admitted attempt timed from its own
//! sending) and the users' (attempts, give-ups, and times from a request's first attempt).
//!
//! It is not a correctness checker (it never looks at the generated text) and not a server.
//! [`abuse`] is its other job: `rampart bench abuse`, the hostile traffic a server must refuse
//! while an honest client keeps being served.
//!
//! ```no_run
//! use loadgen::{Benchmark, BenchmarkConfig};
//!
//! let mut benchmark = Benchmark::new(BenchmarkConfig::default())?;
//! let warmup = benchmark.warm_up();
//! for concurrency in [1, 4] {
//!     let level = benchmark.run_level(concurrency)?;
//!     println!("{}", level.table_row());
//! }
//! # Ok::<(), loadgen::LoadgenError>(())
//! ```
//!
//! An open loop of Poisson arrivals for a minute, with the retries of a patient user:
//!
//! ```no_run
//! use std::time::Duration;
//! use loadgen::{Arrivals, Benchmark, BenchmarkConfig};
//!
//! let mut benchmark = Benchmark::new(BenchmarkConfig {
//!     max_retries: 30,
//!     open_loop_duration: Some(Duration::from_secs(60)),
//!     ..BenchmarkConfig::default()
//! })?;
//! let level = benchmark.run(Arrivals::Poisson { rate_per_s: 4.0 })?;
//! let user_ttft_p99_ms = level.user_ttft_ms.map(|ttft| ttft.p99);
//! println!("user TTFT p99 {user_ttft_p99_ms:?} ms, {} gave up", level.gave_up);
//! # Ok::<(), loadgen::LoadgenError>(())
//! ```

pub mod abuse;
pub mod arrivals;
mod benchmark;
mod error;
mod http_date;
pub mod openai;
pub mod percentile;
pub mod report;
mod request;
pub mod retry;
pub mod sse;
pub mod workload;

pub use arrivals::{ArrivalSchedule, Arrivals};
pub use benchmark::{Benchmark, BenchmarkConfig};
pub use error::{LoadgenError, RequestError};
pub use openai::Endpoint;
pub use percentile::Summary;
pub use report::{BenchmarkReport, ErrorCount, LevelReport, WarmupReport};
pub use request::{RequestOutcome, RequestRecord, REQUEST_ID_HEADER};
pub use workload::{PlannedRequest, PlannedRequests, SplitMix64, WorkloadConfig};
