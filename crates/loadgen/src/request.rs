//! One streaming request, timed: sent, read chunk by chunk as the network delivers it, and
//! turned into a [`RequestRecord`] or a [`RequestError`].

use std::time::{Duration, Instant};

use reqwest::StatusCode;

use crate::error::{error_chain, truncate_chars, RequestError, ERROR_TEXT_CHARS};
use crate::openai::{self, Endpoint, StreamItem, Usage};
use crate::sse::SseParser;
use crate::workload::PlannedRequest;

/// After `[DONE]` the rest of the body (normally just the chunked-encoding terminator) is read so
/// that the server completes its response instead of writing into a reset connection, but no
/// longer than this: a server that keeps the stream open must not turn a finished request into a
/// timeout.
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

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

/// The measurements of one successful request.
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

/// Sends `planned` and reads its whole stream, all within `timeout`.
pub(crate) async fn execute(
    client: &reqwest::Client,
    target: &Target,
    planned: &PlannedRequest,
    timeout: Duration,
) -> Result<RequestRecord, RequestError> {
    let body = openai::request_body(
        target.endpoint,
        &target.model,
        &planned.prompt,
        planned.max_tokens,
        target.temperature,
    );
    let mut request = client.post(target.url(target.endpoint.path())).json(&body);
    if let Some(key) = &target.api_key {
        request = request.bearer_auth(key);
    }
    let sent = Instant::now();
    match tokio::time::timeout(timeout, stream(request, planned, sent)).await {
        Ok(outcome) => outcome,
        Err(_) => Err(RequestError::Timeout(timeout)),
    }
}

async fn stream(
    request: reqwest::RequestBuilder,
    planned: &PlannedRequest,
    sent: Instant,
) -> Result<RequestRecord, RequestError> {
    let mut response = request
        .send()
        .await
        .map_err(|error| RequestError::Connection(error_chain(&error)))?;
    let status = response.status();
    if status != StatusCode::OK {
        let body = response.text().await.unwrap_or_default();
        return Err(RequestError::Status {
            status: status.as_u16(),
            body: truncate_chars(body.trim(), ERROR_TEXT_CHARS),
        });
    }

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
