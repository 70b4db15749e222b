//! The two kinds of failure: a benchmark that cannot run at all ([`LoadgenError`]) and one request
//! that failed while the benchmark goes on ([`RequestError`], counted in the report).

use std::time::Duration;

use thiserror::Error;

/// Error bodies and error events are cut to this many characters in reports.
pub const ERROR_TEXT_CHARS: usize = 200;

/// Why a benchmark could not start or continue.
#[derive(Debug, Error)]
pub enum LoadgenError {
    #[error("invalid setting {name}: {reason}")]
    InvalidSetting { name: &'static str, reason: String },
    #[error("starting the async runtime")]
    Runtime(#[source] std::io::Error),
    #[error("building the HTTP client")]
    Client(#[source] reqwest::Error),
    #[error("listing models at {url}: {reason}")]
    ModelList { url: String, reason: String },
    #[error("{url} lists no models; pass the model id explicitly")]
    NoModels { url: String },
    #[error("a request worker stopped unexpectedly")]
    Worker(#[from] tokio::task::JoinError),
}

/// Why one request failed. Its `Display` text is what the report groups and counts.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RequestError {
    /// The server answered with a status other than 200; `body` is its first
    /// [`ERROR_TEXT_CHARS`] characters.
    #[error("HTTP {status}: {body}")]
    Status { status: u16, body: String },
    /// The request could not be sent (refused, reset, DNS).
    #[error("connection error: {0}")]
    Connection(String),
    /// The whole request (sending, first token, streaming) took longer than the per-request limit.
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// Reading the response body failed part-way.
    #[error("stream broken: {0}")]
    Stream(String),
    /// The server reported an error inside the stream (an `error` event or an `error` object).
    #[error("server error in stream: {0}")]
    Server(String),
    /// A `data:` event that is neither JSON nor `[DONE]`.
    #[error("malformed stream chunk: {0}")]
    MalformedChunk(String),
    /// The stream ended without a single chunk of generated text.
    #[error("stream ended without any generated text")]
    NoContent,
}

/// The first `limit` characters of `text`, on a character boundary.
pub(crate) fn truncate_chars(text: &str, limit: usize) -> String {
    match text.char_indices().nth(limit) {
        Some((end, _)) => text[..end].to_string(),
        None => text.to_string(),
    }
}

/// An error and its chain of causes on one line: reqwest's own message ("error sending request")
/// hides the useful part ("Connection refused") in its sources.
pub(crate) fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_counts_characters_not_bytes() {
        assert_eq!(truncate_chars("héllo", 2), "hé");
        assert_eq!(truncate_chars("abc", 10), "abc");
        assert_eq!(truncate_chars("", 3), "");
    }
}
