//! An incremental parser for `text/event-stream` bodies (the WHATWG server-sent events format):
//! bytes go in as they arrive from the network, in pieces of any size, and complete events come
//! out. Lines may end in LF, CRLF or CR; a line is decoded only once complete, so a multi-byte
//! character split across two reads is intact.

/// One dispatched event: its `event:` type if any, and its `data:` lines joined by `\n`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

#[derive(Debug, Default)]
pub struct SseParser {
    /// Bytes after the last complete line.
    pending: Vec<u8>,
    data: String,
    has_data: bool,
    event: Option<String>,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes as read from the network, appending each event they complete to `events`.
    pub fn feed(&mut self, bytes: &[u8], events: &mut Vec<SseEvent>) {
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(offset) = self.pending[start..]
            .iter()
            .position(|&byte| byte == b'\n' || byte == b'\r')
        {
            let end = start + offset;
            let terminator_len = if self.pending[end] == b'\r' {
                match self.pending.get(end + 1) {
                    Some(b'\n') => 2,
                    Some(_) => 1,
                    // A CR that ends this read may be the first half of a CRLF.
                    None => break,
                }
            } else {
                1
            };
            let line = String::from_utf8_lossy(&self.pending[start..end]).into_owned();
            self.process_line(&line, events);
            start = end + terminator_len;
        }
        self.pending.drain(..start);
    }

    /// Ends the stream: a last line without a terminator and an event without its closing blank
    /// line are still delivered (servers that close the connection early send both).
    pub fn finish(&mut self, events: &mut Vec<SseEvent>) {
        if !self.pending.is_empty() {
            let mut line = std::mem::take(&mut self.pending);
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            let line = String::from_utf8_lossy(&line).into_owned();
            self.process_line(&line, events);
        }
        self.dispatch(events);
    }

    fn process_line(&mut self, line: &str, events: &mut Vec<SseEvent>) {
        if line.is_empty() {
            self.dispatch(events);
            return;
        }
        if line.starts_with(':') {
            return; // a comment (keep-alive)
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line, ""),
        };
        match field {
            "data" => self.append_data(value),
            "event" => self.event = Some(value.to_string()),
            // llama.cpp's server reports a failure inside a stream as a non-standard
            // `error: {...}` line; it is kept as an event of type "error" rather than dropped.
            "error" => {
                self.event = Some("error".to_string());
                self.append_data(value);
            }
            _ => {} // id, retry and unknown fields do not matter here
        }
    }

    fn append_data(&mut self, value: &str) {
        self.data.push_str(value);
        self.data.push('\n');
        self.has_data = true;
    }

    fn dispatch(&mut self, events: &mut Vec<SseEvent>) {
        let event = self.event.take();
        if !self.has_data {
            return;
        }
        self.has_data = false;
        let mut data = std::mem::take(&mut self.data);
        data.pop(); // the newline after the last data line
        events.push(SseEvent { event, data });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::SplitMix64;

    fn parse_in_pieces(pieces: &[&[u8]]) -> Vec<SseEvent> {
        let mut parser = SseParser::new();
        let mut events = Vec::new();
        for piece in pieces {
            parser.feed(piece, &mut events);
        }
        parser.finish(&mut events);
        events
    }

    fn data(text: &str) -> SseEvent {
        SseEvent {
            event: None,
            data: text.to_string(),
        }
    }

    const STREAM: &str = ": keep-alive\n\n\
        data: {\"choices\":[{\"text\":\"Hel\"}]}\n\n\
        data: {\"choices\":[{\"text\":\"lö ✓\"}]}\r\n\r\n\
        data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}\n\n\
        data: [DONE]\n\n";

    fn expected_stream_events() -> Vec<SseEvent> {
        vec![
            data("{\"choices\":[{\"text\":\"Hel\"}]}"),
            data("{\"choices\":[{\"text\":\"lö ✓\"}]}"),
            data("{\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2}}"),
            data("[DONE]"),
        ]
    }

    #[test]
    fn whole_stream_gives_events_without_comments() {
        assert_eq!(
            parse_in_pieces(&[STREAM.as_bytes()]),
            expected_stream_events()
        );
    }

    #[test]
    fn every_two_way_split_gives_the_same_events() {
        let bytes = STREAM.as_bytes();
        for cut in 0..=bytes.len() {
            let (head, tail) = bytes.split_at(cut);
            assert_eq!(
                parse_in_pieces(&[head, tail]),
                expected_stream_events(),
                "split at byte {cut}"
            );
        }
    }

    #[test]
    fn one_byte_at_a_time_gives_the_same_events() {
        let pieces: Vec<&[u8]> = STREAM.as_bytes().chunks(1).collect();
        assert_eq!(parse_in_pieces(&pieces), expected_stream_events());
    }

    #[test]
    fn random_splits_give_the_same_events() {
        let bytes = STREAM.as_bytes();
        let mut rng = SplitMix64::new(7);
        for _ in 0..500 {
            let mut pieces = Vec::new();
            let mut start = 0;
            while start < bytes.len() {
                let len = 1 + rng.below(12).min(bytes.len() - start - 1);
                pieces.push(&bytes[start..start + len]);
                start += len;
            }
            assert_eq!(parse_in_pieces(&pieces), expected_stream_events());
        }
    }

    #[test]
    fn cr_only_line_endings_split_between_reads() {
        let events = parse_in_pieces(&[b"data: a\r", b"\rdata: b\r\r"]);
        assert_eq!(events, vec![data("a"), data("b")]);
    }

    #[test]
    fn multi_line_data_is_joined_and_event_type_kept() {
        let events = parse_in_pieces(&[b"event: update\ndata: one\ndata:two\nid: 9\n\n"]);
        assert_eq!(
            events,
            vec![SseEvent {
                event: Some("update".to_string()),
                data: "one\ntwo".to_string(),
            }]
        );
    }

    #[test]
    fn event_type_without_data_is_not_dispatched_nor_carried_over() {
        let events = parse_in_pieces(&[b"event: ping\n\ndata: x\n\n"]);
        assert_eq!(events, vec![data("x")]);
    }

    #[test]
    fn empty_data_line_dispatches_an_empty_event() {
        assert_eq!(parse_in_pieces(&[b"data:\n\n"]), vec![data("")]);
    }

    #[test]
    fn unterminated_last_event_is_delivered_at_the_end() {
        assert_eq!(parse_in_pieces(&[b"data: [DONE]"]), vec![data("[DONE]")]);
    }

    #[test]
    fn llama_cpp_error_lines_become_error_events() {
        let events = parse_in_pieces(&[b"error: {\"code\":500,\"message\":\"boom\"}\n\n"]);
        assert_eq!(
            events,
            vec![SseEvent {
                event: Some("error".to_string()),
                data: "{\"code\":500,\"message\":\"boom\"}".to_string(),
            }]
        );
    }
}
