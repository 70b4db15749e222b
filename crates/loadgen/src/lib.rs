//! An OpenAI-compatible streaming load generator: drives any `/v1/completions` or
//! `/v1/chat/completions` endpoint with concurrent streaming requests and reports throughput and
//! latency percentiles (`rampart bench serve`), in the manner of vLLM's `benchmark_serving.py`.
//!
//! It works against any server that speaks the OpenAI streaming wire format (Rampart's own,
//! llama.cpp's `llama-server`, vLLM): it needs no tokenizer, counts output tokens as
//! content-bearing stream chunks unless the server reports usage, and builds prompts from common
//! English words so that prompt lengths in tokens are approximate.
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

pub mod abuse;
mod benchmark;
mod error;
pub mod openai;
pub mod percentile;
pub mod report;
mod request;
pub mod sse;
pub mod workload;

pub use benchmark::{Benchmark, BenchmarkConfig};
pub use error::{LoadgenError, RequestError};
pub use openai::Endpoint;
pub use percentile::Summary;
pub use report::{BenchmarkReport, ErrorCount, LevelReport, WarmupReport};
pub use request::RequestRecord;
pub use workload::{PlannedRequest, SplitMix64, WorkloadConfig};
