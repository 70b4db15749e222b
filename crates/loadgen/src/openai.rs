//! The OpenAI wire format, as far as a load generator needs it: the streaming request body and
//! what one stream chunk says (did it carry generated text, did it report usage, is it an error).
//! Decoding is lenient about fields it does not need, so that any compatible server works.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::{truncate_chars, RequestError, ERROR_TEXT_CHARS};
use crate::sse::SseEvent;

/// Which OpenAI endpoint the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `/v1/completions`: the prompt is sent as is.
    #[default]
    Completions,
    /// `/v1/chat/completions`: the prompt is one user message (the server's chat template adds
    /// tokens of its own).
    Chat,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::Chat => "chat",
        }
    }
}

/// The body of one streaming request. `ignore_eos` asks servers that honour it (llama-server,
/// vLLM) to generate exactly `max_tokens`; others stop early and the actual count is measured.
pub fn request_body(
    endpoint: Endpoint,
    model: &str,
    prompt: &str,
    max_tokens: usize,
    temperature: f64,
) -> Value {
    let mut body = json!({
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "stream": true,
        "ignore_eos": true,
        "stream_options": { "include_usage": true },
    });
    match endpoint {
        Endpoint::Completions => body["prompt"] = json!(prompt),
        Endpoint::Chat => body["messages"] = json!([{ "role": "user", "content": prompt }]),
    }
    body
}

/// Token counts as reported by the server (the final chunk when `include_usage` is honoured).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub struct Usage {
    pub prompt_tokens: Option<usize>,
    pub completion_tokens: Option<usize>,
}

/// What one `data:` event of the stream means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    /// `data: [DONE]`: the stream is complete.
    Done,
    Chunk {
        /// The chunk carries generated text (for llama-server and Rampart: one token).
        has_content: bool,
        usage: Option<Usage>,
    },
}

#[derive(Deserialize)]
struct StreamChunk {
    #[serde(default)]
    choices: Vec<Choice>,
    usage: Option<Usage>,
    error: Option<Value>,
}

#[derive(Deserialize)]
struct Choice {
    /// `/v1/completions`.
    text: Option<String>,
    /// `/v1/chat/completions`.
    delta: Option<Delta>,
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
    /// Reasoning models stream their thinking here; those are generated tokens too.
    reasoning_content: Option<String>,
}

fn non_empty(text: &Option<String>) -> bool {
    text.as_deref().is_some_and(|text| !text.is_empty())
}

impl Choice {
    fn has_content(&self) -> bool {
        non_empty(&self.text)
            || self.delta.as_ref().is_some_and(|delta| {
                non_empty(&delta.content) || non_empty(&delta.reasoning_content)
            })
    }
}

/// Interprets one server-sent event of a completion stream.
pub fn decode_event(event: &SseEvent) -> Result<StreamItem, RequestError> {
    let data = event.data.trim();
    if event.event.as_deref() == Some("error") {
        return Err(RequestError::Server(truncate_chars(data, ERROR_TEXT_CHARS)));
    }
    if data == "[DONE]" {
        return Ok(StreamItem::Done);
    }
    let chunk: StreamChunk = serde_json::from_str(data)
        .map_err(|_| RequestError::MalformedChunk(truncate_chars(data, ERROR_TEXT_CHARS)))?;
    if let Some(error) = chunk.error.filter(|error| !error.is_null()) {
        let message = error
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_string)
            .unwrap_or_else(|| error.to_string());
        return Err(RequestError::Server(truncate_chars(
            &message,
            ERROR_TEXT_CHARS,
        )));
    }
    Ok(StreamItem::Chunk {
        has_content: chunk.choices.iter().any(Choice::has_content),
        usage: chunk.usage,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(data: &str) -> Result<StreamItem, RequestError> {
        decode_event(&SseEvent {
            event: None,
            data: data.to_string(),
        })
    }

    fn chunk(has_content: bool, usage: Option<Usage>) -> StreamItem {
        StreamItem::Chunk { has_content, usage }
    }

    #[test]
    fn completion_text_counts_only_when_non_empty() {
        let text = r#"{"id":"x","object":"text_completion","choices":[{"index":0,"text":" the","finish_reason":null}]}"#;
        assert_eq!(decode(text), Ok(chunk(true, None)));
        let last = r#"{"choices":[{"index":0,"text":"","finish_reason":"length"}]}"#;
        assert_eq!(decode(last), Ok(chunk(false, None)));
    }

    #[test]
    fn chat_role_delta_is_not_content_but_text_and_reasoning_are() {
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#;
        assert_eq!(decode(role), Ok(chunk(false, None)));
        let content = r#"{"choices":[{"index":0,"delta":{"content":"Hi"}}],"usage":null}"#;
        assert_eq!(decode(content), Ok(chunk(true, None)));
        let reasoning = r#"{"choices":[{"delta":{"content":null,"reasoning_content":"hmm"}}]}"#;
        assert_eq!(decode(reasoning), Ok(chunk(true, None)));
    }

    #[test]
    fn usage_chunk_reports_counts() {
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":64,"total_tokens":76}}"#;
        assert_eq!(
            decode(usage),
            Ok(chunk(
                false,
                Some(Usage {
                    prompt_tokens: Some(12),
                    completion_tokens: Some(64),
                })
            ))
        );
    }

    #[test]
    fn done_marker_ends_the_stream() {
        assert_eq!(decode("[DONE]"), Ok(StreamItem::Done));
        assert_eq!(decode(" [DONE] "), Ok(StreamItem::Done));
    }

    #[test]
    fn errors_in_the_stream_are_failures() {
        let object = r#"{"error":{"message":"context overflow","type":"invalid_request_error"}}"#;
        assert_eq!(
            decode(object),
            Err(RequestError::Server("context overflow".to_string()))
        );
        let event = SseEvent {
            event: Some("error".to_string()),
            data: r#"{"code":500}"#.to_string(),
        };
        assert_eq!(
            decode_event(&event),
            Err(RequestError::Server(r#"{"code":500}"#.to_string()))
        );
        assert!(matches!(
            decode("not json"),
            Err(RequestError::MalformedChunk(_))
        ));
    }

    #[test]
    fn request_bodies_ask_for_a_stream_with_usage() {
        let completions = request_body(Endpoint::Completions, "m", "a b", 8, 0.0);
        assert_eq!(completions["prompt"], "a b");
        assert_eq!(completions["max_tokens"], 8);
        assert_eq!(completions["stream"], true);
        assert_eq!(completions["ignore_eos"], true);
        assert_eq!(completions["stream_options"]["include_usage"], true);
        assert!(completions.get("messages").is_none());
        let chat = request_body(Endpoint::Chat, "m", "a b", 8, 0.5);
        assert_eq!(chat["messages"][0]["content"], "a b");
        assert_eq!(chat["temperature"], 0.5);
        assert!(chat.get("prompt").is_none());
    }
}
