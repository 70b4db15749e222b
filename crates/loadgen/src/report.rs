//! What a benchmark found: one [`LevelReport`] per concurrency level, built from the outcomes of
//! its requests, as a JSON document ([`BenchmarkReport`]) or table rows.

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;

use crate::error::RequestError;
use crate::openai::Endpoint;
use crate::percentile::Summary;
use crate::request::RequestRecord;
use crate::workload::WorkloadConfig;

/// One distinct failure and how many requests it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: usize,
}

/// The results at one concurrency level. Throughputs count completed requests only, over the
/// level's wall time (first request sent → last one finished). Latencies are in milliseconds;
/// a summary is `None` when no request produced that measurement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelReport {
    pub concurrency: usize,
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    pub input_tokens_per_s: f64,
    pub total_output_tokens: usize,
    pub total_input_tokens: usize,
    /// Completed requests whose output count came from the server's `usage` (the rest count
    /// chunks with generated text).
    pub output_tokens_from_server: usize,
    /// Completed requests whose prompt count came from the server's `usage` (the rest count
    /// words, an approximation).
    pub input_tokens_from_server: usize,
    pub ttft_ms: Option<Summary>,
    pub tpot_ms: Option<Summary>,
    pub itl_ms: Option<Summary>,
    pub e2e_ms: Option<Summary>,
    /// Distinct failures, most frequent first.
    pub errors: Vec<ErrorCount>,
}

fn milliseconds(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

fn per_second(count: usize, duration_s: f64) -> f64 {
    if duration_s > 0.0 {
        count as f64 / duration_s
    } else {
        0.0
    }
}

impl LevelReport {
    pub fn from_outcomes(
        concurrency: usize,
        duration: Duration,
        outcomes: &[Result<RequestRecord, RequestError>],
    ) -> Self {
        let records: Vec<&RequestRecord> =
            outcomes.iter().filter_map(|o| o.as_ref().ok()).collect();
        let duration_s = duration.as_secs_f64();
        let total_output_tokens = records.iter().map(|r| r.output_tokens).sum();
        let total_input_tokens = records.iter().map(|r| r.prompt_tokens).sum();
        let ttft: Vec<f64> = records
            .iter()
            .map(|r| milliseconds(r.time_to_first_token))
            .collect();
        let tpot: Vec<f64> = records
            .iter()
            .filter_map(|r| r.time_per_output_token().map(milliseconds))
            .collect();
        let itl: Vec<f64> = records
            .iter()
            .flat_map(|r| r.inter_token_latencies.iter().copied().map(milliseconds))
            .collect();
        let e2e: Vec<f64> = records.iter().map(|r| milliseconds(r.latency)).collect();

        let mut counts: HashMap<String, usize> = HashMap::new();
        for error in outcomes.iter().filter_map(|o| o.as_ref().err()) {
            *counts.entry(error.to_string()).or_default() += 1;
        }
        let mut errors: Vec<ErrorCount> = counts
            .into_iter()
            .map(|(message, count)| ErrorCount { message, count })
            .collect();
        errors.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then_with(|| a.message.cmp(&b.message))
        });

        LevelReport {
            concurrency,
            requests: outcomes.len(),
            completed: records.len(),
            failed: outcomes.len() - records.len(),
            duration_s,
            requests_per_s: per_second(records.len(), duration_s),
            output_tokens_per_s: per_second(total_output_tokens, duration_s),
            input_tokens_per_s: per_second(total_input_tokens, duration_s),
            total_output_tokens,
            total_input_tokens,
            output_tokens_from_server: records
                .iter()
                .filter(|r| r.output_tokens_from_server)
                .count(),
            input_tokens_from_server: records
                .iter()
                .filter(|r| r.prompt_tokens_from_server)
                .count(),
            ttft_ms: Summary::of(&ttft),
            tpot_ms: Summary::of(&tpot),
            itl_ms: Summary::of(&itl),
            e2e_ms: Summary::of(&e2e),
            errors,
        }
    }

    /// One line of the human table, aligned with [`TABLE_HEADER`].
    pub fn table_row(&self) -> String {
        let cell = |value: Option<f64>| match value {
            Some(value) => format!("{value:>8.1}"),
            None => format!("{:>8}", "-"),
        };
        let ttft = self.ttft_ms;
        let (tpot, itl, e2e) = (self.tpot_ms, self.itl_ms, self.e2e_ms);
        format!(
            "{:>5} {:>5} {:>5} {:>7.2} {:>6.2} {:>8.1} {:>8.1} |{}{}{}{} |{}{} |{}{} |{}{}",
            self.concurrency,
            self.completed,
            self.failed,
            self.duration_s,
            self.requests_per_s,
            self.output_tokens_per_s,
            self.input_tokens_per_s,
            cell(ttft.map(|s| s.mean)),
            cell(ttft.map(|s| s.p50)),
            cell(ttft.map(|s| s.p90)),
            cell(ttft.map(|s| s.p99)),
            cell(tpot.map(|s| s.p50)),
            cell(tpot.map(|s| s.p99)),
            cell(itl.map(|s| s.p50)),
            cell(itl.map(|s| s.p99)),
            cell(e2e.map(|s| s.p50)),
            cell(e2e.map(|s| s.p99)),
        )
    }
}

/// The two header lines of the human table.
pub const TABLE_HEADER: &str = concat!(
    "                                     tokens/s      |             TTFT ms             |     TPOT ms     |     ITL ms      |     E2E ms\n",
    " conc    ok  fail   dur s  req/s      out       in |    mean     p50     p90     p99 |     p50     p99 |     p50     p99 |     p50     p99",
);

/// The warm-up requests sent before the first level (not measured).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WarmupReport {
    pub requests: usize,
    pub completed: usize,
    pub failed: usize,
    pub first_error: Option<String>,
}

/// The whole run: settings, warm-up and levels (`rampart bench serve --json`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BenchmarkReport {
    pub url: String,
    pub endpoint: Endpoint,
    pub model: String,
    pub workload: WorkloadConfig,
    pub temperature: f64,
    pub requests_per_level: usize,
    /// Prompt lengths are words, about one token each; `input_tokens_from_server` in each level
    /// says how many requests had their real prompt length reported.
    pub prompt_tokens_approximate: bool,
    pub warmup: WarmupReport,
    pub levels: Vec<LevelReport>,
}

impl BenchmarkReport {
    /// True when no request of any level completed (the command then exits with failure).
    pub fn every_request_failed(&self) -> bool {
        self.levels.iter().all(|level| level.completed == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(ttft_ms: u64, gaps_ms: &[u64], output_tokens: usize) -> RequestRecord {
        let gaps: Vec<Duration> = gaps_ms
            .iter()
            .map(|&ms| Duration::from_millis(ms))
            .collect();
        let ttft = Duration::from_millis(ttft_ms);
        RequestRecord {
            prompt_tokens: 10,
            prompt_tokens_from_server: true,
            output_tokens,
            output_tokens_from_server: false,
            content_chunks: gaps.len() + 1,
            time_to_first_token: ttft,
            latency: ttft + gaps.iter().sum::<Duration>(),
            inter_token_latencies: gaps,
        }
    }

    #[test]
    fn level_report_counts_and_rates() {
        let outcomes = vec![
            Ok(record(100, &[10, 20, 30], 4)),
            Ok(record(300, &[40], 2)),
            Err(RequestError::Status {
                status: 503,
                body: "busy".to_string(),
            }),
            Err(RequestError::Status {
                status: 503,
                body: "busy".to_string(),
            }),
            Err(RequestError::NoContent),
        ];
        let report = LevelReport::from_outcomes(2, Duration::from_secs(2), &outcomes);
        assert_eq!(
            (report.requests, report.completed, report.failed),
            (5, 2, 3)
        );
        assert_eq!(report.total_output_tokens, 6);
        assert_eq!(report.total_input_tokens, 20);
        assert_eq!(report.input_tokens_from_server, 2);
        assert_eq!(report.output_tokens_from_server, 0);
        assert!((report.requests_per_s - 1.0).abs() < 1e-9);
        assert!((report.output_tokens_per_s - 3.0).abs() < 1e-9);
        assert!((report.input_tokens_per_s - 10.0).abs() < 1e-9);
        let ttft = report.ttft_ms.unwrap();
        assert!((ttft.mean - 200.0).abs() < 1e-6 && (ttft.p50 - 200.0).abs() < 1e-6);
        // ITL pools every gap of every request: 10, 20, 30, 40.
        assert!((report.itl_ms.unwrap().p50 - 25.0).abs() < 1e-6);
        // TPOT: (160 − 100) / 3 = 20 and (340 − 300) / 1 = 40.
        assert!((report.tpot_ms.unwrap().mean - 30.0).abs() < 1e-6);
        assert_eq!(
            report.errors,
            vec![
                ErrorCount {
                    message: "HTTP 503: busy".to_string(),
                    count: 2,
                },
                ErrorCount {
                    message: RequestError::NoContent.to_string(),
                    count: 1,
                },
            ]
        );
    }

    #[test]
    fn all_failed_level_has_no_latencies_and_renders() {
        let outcomes = vec![Err(RequestError::Timeout(Duration::from_secs(1)))];
        let report = LevelReport::from_outcomes(1, Duration::from_secs(1), &outcomes);
        assert_eq!((report.completed, report.failed), (0, 1));
        assert_eq!(report.ttft_ms, None);
        assert_eq!(report.output_tokens_per_s, 0.0);
        let row = report.table_row();
        assert!(row.contains('-'));
        let bars =
            |line: &str| -> Vec<usize> { line.match_indices('|').map(|(at, _)| at).collect() };
        let header: Vec<&str> = TABLE_HEADER.lines().collect();
        assert_eq!(header.len(), 2);
        assert_eq!(bars(&row).len(), 4);
        assert_eq!(bars(header[0]), bars(&row));
        assert_eq!(bars(header[1]), bars(&row));
        assert_eq!(row.len(), header[1].len());
    }
}
