//! What a benchmark found: one [`LevelReport`] per level (a concurrency or an arrival profile),
//! built from the outcomes of its requests, as a JSON document ([`BenchmarkReport`]) or table
//! rows: the server's view (each admitted attempt timed from its own sending) and the users' view
//! (attempts, retries, give-ups, times counted from a request's first sending).

use std::collections::HashMap;
use std::time::Duration;

use serde::Serialize;

use crate::arrivals::Arrivals;
use crate::openai::Endpoint;
use crate::percentile::Summary;
use crate::request::{RequestOutcome, RequestRecord};
use crate::workload::WorkloadConfig;

/// One distinct failure and how many requests it ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ErrorCount {
    pub message: String,
    pub count: usize,
}

/// The results at one level. Throughputs count completed requests only, over the level's wall
/// time (first request sent → last one finished). Latencies are in milliseconds; a summary is
/// `None` when no request produced that measurement. A request is a logical request: its retries
/// are attempts of it, not requests.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LevelReport {
    /// Closed loop: the clients; open loop: the most requests outstanding at once (as
    /// `peak_outstanding`).
    pub concurrency: usize,
    /// Requests sent (in an open loop, arrivals less `dropped`).
    pub requests: usize,
    /// Requests that streamed an answer in the end (ok).
    pub completed: usize,
    /// Requests that did not, `gave_up` among them.
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
    /// The admitted attempt's time to first token, from its own sending (the server's view).
    pub ttft_ms: Option<Summary>,
    pub tpot_ms: Option<Summary>,
    pub itl_ms: Option<Summary>,
    /// The admitted attempt's end-to-end latency, from its own sending.
    pub e2e_ms: Option<Summary>,
    /// Distinct failures, most frequent first.
    pub errors: Vec<ErrorCount>,
    /// How requests arrived.
    pub arrivals: Arrivals,
    /// Failed requests whose last failure the client retries (429, 5xx, no connection, no
    /// answer in time) but that had no retries left.
    pub gave_up: usize,
    /// Attempts after the first, over all requests.
    pub retries: usize,
    /// Attempts the server answered 429.
    pub responses_429: usize,
    /// Open loop: arrivals not sent because `max_outstanding` requests were outstanding.
    pub dropped: usize,
    /// The most requests outstanding at once (sending, streaming or waiting to retry).
    pub peak_outstanding: usize,
    /// The time to first token the user waited: from the request's first attempt, retries and
    /// their waits included (equal to `ttft_ms` when nothing was retried).
    pub user_ttft_ms: Option<Summary>,
    /// The end-to-end latency the user waited, from the request's first attempt.
    pub user_e2e_ms: Option<Summary>,
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
    /// The report of a level that ran for `duration`, whose requests ended as `outcomes`, and
    /// that dropped `dropped` arrivals and had at most `peak_outstanding` requests outstanding.
    pub fn from_outcomes(
        arrivals: Arrivals,
        duration: Duration,
        outcomes: &[RequestOutcome],
        dropped: usize,
        peak_outstanding: usize,
    ) -> Self {
        let records: Vec<&RequestRecord> = outcomes
            .iter()
            .filter_map(|o| o.result.as_ref().ok())
            .collect();
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
        let user_ttft: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| o.user_time_to_first_token().map(milliseconds))
            .collect();
        let user_e2e: Vec<f64> = outcomes
            .iter()
            .filter_map(|o| o.user_latency().map(milliseconds))
            .collect();

        let mut counts: HashMap<String, usize> = HashMap::new();
        for error in outcomes.iter().filter_map(|o| o.result.as_ref().err()) {
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
            concurrency: match arrivals {
                Arrivals::Closed { concurrency } => concurrency,
                Arrivals::Poisson { .. } | Arrivals::Burst { .. } => peak_outstanding,
            },
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
            arrivals,
            gave_up: outcomes.iter().filter(|o| o.gave_up).count(),
            retries: outcomes.iter().map(|o| o.retries() as usize).sum(),
            responses_429: outcomes.iter().map(|o| o.responses_429 as usize).sum(),
            dropped,
            peak_outstanding,
            user_ttft_ms: Summary::of(&user_ttft),
            user_e2e_ms: Summary::of(&user_e2e),
        }
    }

    /// One line of the human table, aligned with [`TABLE_HEADER`].
    pub fn table_row(&self) -> String {
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

    /// One line of the users' table, aligned with [`USER_TABLE_HEADER`].
    pub fn user_table_row(&self) -> String {
        let (user_ttft, admitted_ttft, user_e2e) =
            (self.user_ttft_ms, self.ttft_ms, self.user_e2e_ms);
        format!(
            "{:>5} {:>5} {:>7} {:>7} {:>7} {:>7} |{}{}{} |{}{} |{}{}",
            self.concurrency,
            self.completed,
            self.gave_up,
            self.dropped,
            self.retries,
            self.responses_429,
            cell(user_ttft.map(|s| s.p50)),
            cell(user_ttft.map(|s| s.p90)),
            cell(user_ttft.map(|s| s.p99)),
            cell(admitted_ttft.map(|s| s.p50)),
            cell(admitted_ttft.map(|s| s.p99)),
            cell(user_e2e.map(|s| s.p50)),
            cell(user_e2e.map(|s| s.p99)),
        )
    }
}

/// A latency cell of the tables: eight wide, one decimal, `-` when there is none.
fn cell(value: Option<f64>) -> String {
    match value {
        Some(value) => format!("{value:>8.1}"),
        None => format!("{:>8}", "-"),
    }
}

/// The two header lines of the human table.
pub const TABLE_HEADER: &str = concat!(
    "                                     tokens/s      |             TTFT ms             |     TPOT ms     |     ITL ms      |     E2E ms\n",
    " conc    ok  fail   dur s  req/s      out       in |    mean     p50     p90     p99 |     p50     p99 |     p50     p99 |     p50     p99",
);

/// The two header lines of the users' table: requests ok and given up, arrivals dropped, retries
/// and 429s, then the time to first token counted from the first attempt (user) and from the
/// admitted attempt's own sending (admitted), and the end-to-end latency from the first attempt.
pub const USER_TABLE_HEADER: &str = concat!(
    "                                            |  user TTFT ms (1st try) |  admitted TTFT  |   user E2E ms\n",
    " conc    ok gave up dropped retries     429 |     p50     p90     p99 |     p50     p99 |     p50     p99",
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
    /// Requests of a closed-loop level; arrivals of an open-loop level without a duration.
    pub requests_per_level: usize,
    /// Prompt lengths are words, about one token each; `input_tokens_from_server` in each level
    /// says how many requests had their real prompt length reported.
    pub prompt_tokens_approximate: bool,
    pub warmup: WarmupReport,
    pub levels: Vec<LevelReport>,
    /// Retries per request, as the official OpenAI clients make them (they default to 2).
    pub max_retries: u32,
    /// Each request carried an `X-Request-Id`, the same on all its attempts.
    pub request_id: bool,
    /// Open loop: the cap on outstanding requests.
    pub max_outstanding: usize,
    /// Open loop: arrivals for this many seconds rather than `requests_per_level` of them.
    pub open_loop_duration_s: Option<f64>,
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

    use crate::error::RequestError;

    fn closed(concurrency: usize) -> Arrivals {
        Arrivals::Closed { concurrency }
    }

    fn sent_once(results: Vec<Result<RequestRecord, RequestError>>) -> Vec<RequestOutcome> {
        results.into_iter().map(RequestOutcome::from).collect()
    }

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
        let outcomes = sent_once(vec![
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
        ]);
        let report = LevelReport::from_outcomes(closed(2), Duration::from_secs(2), &outcomes, 0, 2);
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
        let outcomes = sent_once(vec![Err(RequestError::Timeout(Duration::from_secs(1)))]);
        let report = LevelReport::from_outcomes(closed(1), Duration::from_secs(1), &outcomes, 0, 1);
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

        let user_row = report.user_table_row();
        let user_header: Vec<&str> = USER_TABLE_HEADER.lines().collect();
        assert_eq!(user_header.len(), 2);
        assert_eq!(bars(&user_row).len(), 3);
        assert_eq!(bars(user_header[0]), bars(&user_row));
        assert_eq!(bars(user_header[1]), bars(&user_row));
        assert_eq!(user_row.len(), user_header[1].len());
    }

    #[test]
    fn without_retries_the_user_sees_what_the_server_measured() {
        let outcomes = sent_once(vec![
            Ok(record(100, &[10], 2)),
            Ok(record(300, &[10], 2)),
            Err(RequestError::Status {
                status: 429,
                body: "busy".to_string(),
            }),
        ]);
        let report = LevelReport::from_outcomes(closed(1), Duration::from_secs(1), &outcomes, 0, 1);
        assert_eq!(report.user_ttft_ms, report.ttft_ms);
        assert_eq!(report.user_e2e_ms, report.e2e_ms);
        assert_eq!((report.retries, report.responses_429), (0, 1));
        // A single attempt has not given up: nothing said how many retries it had.
        assert_eq!(report.gave_up, 0);
    }

    #[test]
    fn retries_count_in_the_users_time_and_not_the_servers() {
        let retried = RequestOutcome {
            result: Ok(record(40, &[10, 10], 3)),
            attempts: 3,
            gave_up: false,
            responses_429: 2,
            retrying_time: Duration::from_millis(1000),
        };
        let given_up = RequestOutcome {
            result: Err(RequestError::Status {
                status: 429,
                body: "busy".to_string(),
            }),
            attempts: 31,
            gave_up: true,
            responses_429: 31,
            retrying_time: Duration::from_secs(200),
        };
        let straight = RequestOutcome::from(Ok(record(60, &[10, 10], 3)));
        let outcomes = vec![retried, given_up, straight];
        let poisson = Arrivals::Poisson { rate_per_s: 2.0 };
        let report = LevelReport::from_outcomes(poisson, Duration::from_secs(10), &outcomes, 5, 7);
        assert_eq!(
            (report.requests, report.completed, report.failed),
            (3, 2, 1)
        );
        assert_eq!((report.gave_up, report.dropped), (1, 5));
        assert_eq!((report.retries, report.responses_429), (32, 33));
        assert_eq!((report.concurrency, report.peak_outstanding), (7, 7));
        // The server's view: 40 and 60 ms; the users': 1,040 and 60 ms.
        let admitted = report.ttft_ms.expect("admitted TTFT");
        assert!((admitted.p50 - 50.0).abs() < 1e-6);
        let user = report.user_ttft_ms.expect("user TTFT");
        assert!((user.p50 - 550.0).abs() < 1e-6 && (user.p99 - 1030.2).abs() < 1e-6);
        let user_e2e = report.user_e2e_ms.expect("user E2E");
        assert!((user_e2e.mean - (1060.0 + 80.0) / 2.0).abs() < 1e-6);
        assert_eq!(report.errors[0].message, "HTTP 429: busy");

        let json = serde_json::to_value(&report).expect("serializes");
        for field in [
            "concurrency",
            "completed",
            "failed",
            "ttft_ms",
            "e2e_ms",
            "errors",
        ] {
            assert!(json.get(field).is_some(), "{field} kept");
        }
        assert_eq!(json["arrivals"]["kind"], "poisson");
        assert_eq!(json["gave_up"], 1);
        assert_eq!(json["retries"], 32);
        assert_eq!(json["responses_429"], 33);
        assert_eq!(json["dropped"], 5);
        assert!(json["user_ttft_ms"]["p99"].as_f64().expect("a number") > 1000.0);
    }
}
