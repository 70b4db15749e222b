//! One request as its user sees it: sent, read chunk by chunk as the network delivers it, and
//! sent again as the official OpenAI clients would when it fails in a way they retry
//! ([`crate::retry`]). Each attempt is timed on its own ([`RequestRecord`], the admitted attempt
//! as the server saw it); the whole is a [`RequestOutcome`] (attempts, gave up, and the times
//! counted from the first attempt, as the user waited them).

use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use reqwest::header::{HeaderMap, CONTENT_TYPE};
use reqwest::StatusCode;

use crate::error::{error_chain, truncate_chars, RequestError, ERROR_TEXT_CHARS};
use crate::openai::{self, Endpoint, StreamItem, Usage};
use crate::retry::{retry_wait, server_wait_s, should_retry_status, RETRY_COUNT_HEADER};
use crate::sse::SseParser;
use crate::workload::{PlannedRequest, SplitMix64};

/// After `[DONE]` the rest of the body (normally just the chunked-encoding terminator) is read so
/// that the server completes its response instead of writing into a reset connection, but no
/// longer than this: a server that keeps the stream open must not turn a finished request into a
/// timeout.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// The header that names a logical request, the same on each of its attempts (`--request-id`).
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Where requests go and what they ask for.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// Scheme, host, port and any path prefix, without a trailing `/` or `/v1`.
    pub base_url: String,
    pub api_key: Option<String>,
    pub endpoint: Endpoint,
    pub model: String,
    pub temperature: f64,
}

impl Target {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base_url)
    }
}

/// How each logical request is sent.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendPolicy {
    /// Limit on one attempt, sending to last byte (the official clients' timeout is per attempt
    /// too).
    pub attempt_timeout: Duration,
    /// Retries after the first attempt; 0 sends each request once and no retry-count header.
    pub max_retries: u32,
}

/// The measurements of one successful attempt, timed from its own sending: what the server did
/// with the request it admitted.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// The server's `usage.prompt_tokens` if it reported one, else the prompt's word count.
    pub prompt_tokens: usize,
    pub prompt_tokens_from_server: bool,
    /// The server's `usage.completion_tokens` if it reported one, else `content_chunks`.
    pub output_tokens: usize,
    pub output_tokens_from_server: bool,
    /// Stream chunks that carried generated text.
    pub content_chunks: usize,
    /// Request sent → first chunk with generated text.
    pub time_to_first_token: Duration,
    /// Request sent → end of the stream.
    pub latency: Duration,
    /// Gaps between consecutive chunks with generated text.
    pub inter_token_latencies: Vec<Duration>,
}

impl RequestRecord {
    /// Time per output token after the first: `(latency − TTFT) / (output tokens − 1)`; `None`
    /// for a single-token answer.
    pub fn time_per_output_token(&self) -> Option<Duration> {
        let after_first = u32::try_from(self.output_tokens.checked_sub(1)?).ok()?;
        if after_first == 0 {
            return None;
        }
        Some(self.latency.saturating_sub(self.time_to_first_token) / after_first)
    }
}

/// One logical request from its user's side: every attempt, from the first sending to the end.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOutcome {
    /// The last attempt: its measurements if it streamed, else why it failed.
    pub result: Result<RequestRecord, RequestError>,
    /// Attempts sent: 1 + retries.
    pub attempts: u32,
    /// It failed in a way the client retries, with no retries left (with `max_retries` 0, every
    /// retried kind of failure: 429, 5xx, connection).
    pub gave_up: bool,
    /// Attempts the server answered 429.
    pub responses_429: u32,
    /// First attempt sent → last attempt sent: what the retries cost before the answer began.
    pub retrying_time: Duration,
}

impl RequestOutcome {
    /// Retries sent after the first attempt.
    pub fn retries(&self) -> u32 {
        self.attempts.saturating_sub(1)
    }

    /// First attempt sent → first token: the time to first token its user waited.
    pub fn user_time_to_first_token(&self) -> Option<Duration> {
        let record = self.result.as_ref().ok()?;
        Some(self.retrying_time + record.time_to_first_token)
    }

    /// First attempt sent → end of the stream.
    pub fn user_latency(&self) -> Option<Duration> {
        let record = self.result.as_ref().ok()?;
        Some(self.retrying_time + record.latency)
    }
}

/// A request sent once: the outcome of a single attempt (the retrying time is zero).
impl From<Result<RequestRecord, RequestError>> for RequestOutcome {
    fn from(result: Result<RequestRecord, RequestError>) -> Self {
        let responses_429 = u32::from(matches!(
            result,
            Err(RequestError::Status { status: 429, .. })
        ));
        Self {
            result,
            attempts: 1,
            gave_up: false,
            responses_429,
            retrying_time: Duration::ZERO,
        }
    }
}

/// Why an attempt failed, and whether the official clients would send it again.
#[derive(Debug)]
struct AttemptFailure {
    error: RequestError,
    retry: Retry,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Retry {
    No,
    /// Retried, after the wait the server asked for (seconds) if it asked.
    Yes {
        server_wait_s: Option<f64>,
    },
}

impl AttemptFailure {
    fn not_retried(error: RequestError) -> Self {
        Self {
            error,
            retry: Retry::No,
        }
    }

    fn retried(error: RequestError) -> Self {
        Self {
            error,
            retry: Retry::Yes {
                server_wait_s: None,
            },
        }
    }
}

/// Sends `planned` and reads its whole stream, each attempt within `policy.attempt_timeout`;
/// sends it again, identical but for the retry count, while the failure is one the official
/// clients retry and retries are left. `jitter` draws the backoff's jitter.
pub(crate) async fn execute(
    client: &reqwest::Client,
    target: &Target,
    planned: &PlannedRequest,
    policy: SendPolicy,
    request_id: Option<&str>,
    jitter: &mut SplitMix64,
) -> RequestOutcome {
    let body = openai::request_body(
        target.endpoint,
        &target.model,
        &planned.prompt,
        planned.max_tokens,
        target.temperature,
    );
    // Serialized once: every attempt sends the same bytes.
    let body = Bytes::from(body.to_string());
    let url = target.url(target.endpoint.path());
    let mut first_attempt_sent: Option<Instant> = None;
    let mut retries_taken = 0;
    let mut responses_429 = 0;
    loop {
        let mut request = client
            .post(&url)
            .header(CONTENT_TYPE, "application/json")
            .body(body.clone());
        if let Some(key) = &target.api_key {
            request = request.bearer_auth(key);
        }
        if let Some(id) = request_id {
            request = request.header(REQUEST_ID_HEADER, id);
        }
        if policy.max_retries > 0 {
            request = request.header(RETRY_COUNT_HEADER, retries_taken.to_string());
        }
        let sent = Instant::now();
        let first_sent = *first_attempt_sent.get_or_insert(sent);
        let (result, retry) = match attempt(request, planned, sent, policy.attempt_timeout).await {
            Ok(record) => (Ok(record), Retry::No),
            Err(failure) => (Err(failure.error), failure.retry),
        };
        if matches!(result, Err(RequestError::Status { status: 429, .. })) {
            responses_429 += 1;
        }
        let server_wait_s = match retry {
            Retry::Yes { server_wait_s } if retries_taken < policy.max_retries => server_wait_s,
            retry => {
                return RequestOutcome {
                    result,
                    attempts: retries_taken + 1,
                    gave_up: matches!(retry, Retry::Yes { .. }),
                    responses_429,
                    retrying_time: sent - first_sent,
                }
            }
        };
        tokio::time::sleep(retry_wait(retries_taken, server_wait_s, jitter.unit_f64())).await;
        retries_taken += 1;
    }
}

/// One attempt: a failure before the response's head (not sent, no answer in time) or a status
/// the clients retry may be retried; once a stream has begun, nothing is.
async fn attempt(
    request: reqwest::RequestBuilder,
    planned: &PlannedRequest,
    sent: Instant,
    timeout: Duration,
) -> Result<RequestRecord, AttemptFailure> {
    let deadline = tokio::time::Instant::from_std(sent + timeout);
    let response = match tokio::time::timeout_at(deadline, request.send()).await {
        Err(_) => return Err(AttemptFailure::retried(RequestError::Timeout(timeout))),
        Ok(Err(error)) => {
            return Err(AttemptFailure::retried(RequestError::Connection(
                error_chain(&error),
            )))
        }
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    if status != StatusCode::OK {
        let retry = retry_of(status, response.headers(), SystemTime::now());
        let body = match tokio::time::timeout_at(deadline, response.text()).await {
            Ok(Ok(body)) => body,
            _ => String::new(),
        };
        return Err(AttemptFailure {
            error: RequestError::Status {
                status: status.as_u16(),
                body: truncate_chars(body.trim(), ERROR_TEXT_CHARS),
            },
            retry,
        });
    }
    match tokio::time::timeout_at(deadline, stream(response, planned, sent)).await {
        Ok(outcome) => outcome.map_err(AttemptFailure::not_retried),
        Err(_) => Err(AttemptFailure::not_retried(RequestError::Timeout(timeout))),
    }
}

/// What a refusal's status and headers say about sending the request again.
fn retry_of(status: StatusCode, headers: &HeaderMap, now: SystemTime) -> Retry {
    let header = |name: &str| headers.get(name).and_then(|value| value.to_str().ok());
    if !should_retry_status(status.as_u16(), header("x-should-retry")) {
        return Retry::No;
    }
    Retry::Yes {
        server_wait_s: server_wait_s(header("retry-after-ms"), header("retry-after"), now),
    }
}

/// Reads a 200 response's stream to its end.
async fn stream(
    mut response: reqwest::Response,
    planned: &PlannedRequest,
    sent: Instant,
) -> Result<RequestRecord, RequestError> {
    let mut parser = SseParser::new();
    let mut events = Vec::new();
    let mut content_arrivals = Vec::new();
    let mut usage: Option<Usage> = None;
    let mut saw_done = false;
    let finished = loop {
        let read = response
            .chunk()
            .await
            .map_err(|error| RequestError::Stream(error_chain(&error)))?;
        // Every event completed by this read arrived now.
        let arrived = Instant::now();
        match &read {
            Some(bytes) => parser.feed(bytes, &mut events),
            None => parser.finish(&mut events),
        }
        for event in events.drain(..) {
            match openai::decode_event(&event)? {
                StreamItem::Done => saw_done = true,
                StreamItem::Chunk {
                    has_content,
                    usage: reported,
                } => {
                    if has_content && !saw_done {
                        content_arrivals.push(arrived);
                    }
                    if reported.is_some() {
                        usage = reported;
                    }
                }
            }
        }
        if saw_done || read.is_none() {
            break arrived;
        }
    };
    if saw_done {
        let drain = async { while let Ok(Some(_)) = response.chunk().await {} };
        // The request has succeeded either way; the outcome of the drain does not matter.
        let _ = tokio::time::timeout(DRAIN_LIMIT, drain).await;
    }

    let first = *content_arrivals.first().ok_or(RequestError::NoContent)?;
    let usage = usage.unwrap_or_default();
    Ok(RequestRecord {
        prompt_tokens: usage.prompt_tokens.unwrap_or(planned.prompt_words),
        prompt_tokens_from_server: usage.prompt_tokens.is_some(),
        output_tokens: usage.completion_tokens.unwrap_or(content_arrivals.len()),
        output_tokens_from_server: usage.completion_tokens.is_some(),
        content_chunks: content_arrivals.len(),
        time_to_first_token: first - sent,
        latency: finished - sent,
        inter_token_latencies: content_arrivals
            .windows(2)
            .map(|pair| pair[1] - pair[0])
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(output_tokens: usize, ttft_ms: u64, latency_ms: u64) -> RequestRecord {
        RequestRecord {
            prompt_tokens: 1,
            prompt_tokens_from_server: false,
            output_tokens,
            output_tokens_from_server: false,
            content_chunks: output_tokens,
            time_to_first_token: Duration::from_millis(ttft_ms),
            latency: Duration::from_millis(latency_ms),
            inter_token_latencies: Vec::new(),
        }
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|&(name, value)| {
                (
                    reqwest::header::HeaderName::from_static(name),
                    reqwest::header::HeaderValue::from_static(value),
                )
            })
            .collect()
    }

    #[test]
    fn refusals_say_whether_and_when_to_retry() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
        let retry = |status: u16, pairs: &[(&'static str, &'static str)]| {
            let status = StatusCode::from_u16(status).expect("a status code");
            retry_of(status, &headers(pairs), now)
        };
        assert_eq!(
            retry(429, &[("retry-after-ms", "50"), ("retry-after", "1")]),
            Retry::Yes {
                server_wait_s: Some(0.05)
            }
        );
        assert_eq!(
            retry(503, &[("retry-after", "Wed, 21 Oct 2015 07:28:02 GMT")]),
            Retry::Yes {
                server_wait_s: Some(2.0)
            }
        );
        assert_eq!(
            retry(500, &[]),
            Retry::Yes {
                server_wait_s: None
            }
        );
        assert_eq!(retry(429, &[("x-should-retry", "false")]), Retry::No);
        assert_eq!(retry(422, &[("retry-after", "1")]), Retry::No);
        assert_eq!(
            retry(400, &[("x-should-retry", "true")]),
            Retry::Yes {
                server_wait_s: None
            }
        );
    }

    #[test]
    fn users_wait_for_the_retries_too() {
        let outcome = RequestOutcome {
            result: Ok(record(5, 100, 300)),
            attempts: 3,
            gave_up: false,
            responses_429: 2,
            retrying_time: Duration::from_millis(150),
        };
        assert_eq!(outcome.retries(), 2);
        assert_eq!(
            outcome.user_time_to_first_token(),
            Some(Duration::from_millis(250))
        );
        assert_eq!(outcome.user_latency(), Some(Duration::from_millis(450)));
        let failed = RequestOutcome::from(Err(RequestError::Status {
            status: 429,
            body: String::new(),
        }));
        assert_eq!(
            (failed.attempts, failed.retries(), failed.responses_429),
            (1, 0, 1)
        );
        assert_eq!(failed.user_time_to_first_token(), None);
    }

    #[test]
    fn time_per_output_token_excludes_the_first_token() {
        assert_eq!(
            record(11, 100, 600).time_per_output_token(),
            Some(Duration::from_millis(50))
        );
        assert_eq!(record(1, 100, 100).time_per_output_token(), None);
        assert_eq!(record(0, 100, 100).time_per_output_token(), None);
    }
}
