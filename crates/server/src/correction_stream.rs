//! The correction stream: each line of the correction log (`corrections.jsonl`) published to a
//! NATS JetStream stream (`[feedback.nats]`, docs/feedback.md#the-correction-stream).
//!
//! The log is the outbox. The streamer reads the complete lines after its cursor
//! (`corrections.nats-cursor` beside the log: the byte offset up to which every line was
//! acknowledged), publishes up to `max_in_flight` of them to `SUBJECT.MODEL` with a
//! `Nats-Msg-Id` (the line's sha256), awaits the stream's acknowledgements in order and moves the
//! cursor past the last acknowledged line. A NATS outage, a missing stream or a restart of the
//! server loses nothing: the streamer retries with a backoff (0.5 s doubling to 30 s) from the
//! cursor, and a line published again after a crash between its acknowledgement and the cursor's
//! save is dropped by the stream's duplicate window (one hour on a stream the server creates).
//! Delivery is at least once, in the log's order.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, context::PublishAckFuture, message::PublishMessage};
use sha2::{Digest, Sha256};
use tokio::sync::Notify;

use crate::config::NatsConfig;

/// The cursor file's name, beside the log.
pub const CURSOR: &str = "corrections.nats-cursor";
/// The most bytes one pass reads.
const READ_BYTES: usize = 4 << 20;
const BACKOFF_MIN: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// The acknowledged offset in `path`; 0 when there is none (or it is unreadable: said).
pub fn load_cursor(path: &Path) -> u64 {
    match std::fs::read_to_string(path) {
        Ok(text) => text.trim().parse().unwrap_or_else(|_| {
            tracing::warn!(
                target: "rampart::feedback",
                cursor = %path.display(),
                "the correction stream's cursor is unreadable: streaming the log from its start \
                 (the stream's duplicate window drops what it already has)"
            );
            0
        }),
        Err(_) => 0,
    }
}

/// Writes the cursor atomically (a temporary file renamed over it).
pub fn save_cursor(path: &Path, offset: u64) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, format!("{offset}\n"))?;
    std::fs::rename(&tmp, path)
}

/// Lines of the log, each with the offset just after it.
pub type Lines = Vec<(Vec<u8>, u64)>;

/// The complete lines of `log` from `offset` (at most `max` lines and about 4 MiB), each with
/// the offset just after it, and the log's length.
pub fn read_lines(log: &Path, offset: u64, max: usize) -> std::io::Result<(Lines, u64)> {
    let mut file = match std::fs::File::open(log) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), 0)),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    if offset >= len {
        return Ok((Vec::new(), len));
    }
    file.seek(SeekFrom::Start(offset))?;
    let want = usize::try_from(len - offset)
        .unwrap_or(usize::MAX)
        .min(READ_BYTES);
    let mut buf = vec![0u8; want];
    file.read_exact(&mut buf)?;
    let mut lines = Vec::new();
    let mut start = 0usize;
    while lines.len() < max {
        let Some(nl) = buf[start..].iter().position(|&b| b == b'\n') else {
            break;
        };
        let end = start + nl;
        lines.push((buf[start..end].to_vec(), offset + end as u64 + 1));
        start = end + 1;
    }
    if lines.is_empty() && start == 0 && want == READ_BYTES {
        // One line longer than a pass: read it whole.
        let mut rest = Vec::new();
        file.read_to_end(&mut rest)?;
        buf.extend_from_slice(&rest);
        if let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            lines.push((buf[..nl].to_vec(), offset + nl as u64 + 1));
        }
    }
    Ok((lines, len))
}

/// A model's name as one subject token: `.`, `*`, `>` and white space become `_`.
pub fn subject_token(model: &str) -> String {
    let t: String = model
        .chars()
        .map(|c| {
            if c == '.' || c == '*' || c == '>' || c.is_whitespace() || c.is_control() {
                '_'
            } else {
                c
            }
        })
        .collect();
    if t.is_empty() {
        "_".into()
    } else {
        t
    }
}

/// The subject and message id of one line, or `None` when it is not a JSON object.
pub fn address(subject: &str, line: &[u8]) -> Option<(String, String)> {
    let value: serde_json::Value = serde_json::from_slice(line).ok()?;
    let model = value
        .as_object()?
        .get("model")
        .and_then(|m| m.as_str())
        .unwrap_or("");
    let id = hex::encode(&Sha256::digest(line)[..16]);
    Some((format!("{subject}.{}", subject_token(model)), id))
}

/// Why a session ended: the stage and the error.
type Failure = (&'static str, String);

/// Streams the log at `log` to NATS at `url` until the task is aborted; `wake` is notified on
/// each appended line (a 1 s tick catches the rest).
pub fn spawn(
    config: NatsConfig,
    url: String,
    log: PathBuf,
    wake: Arc<Notify>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let cursor = log.with_file_name(CURSOR);
        let mut backoff = BACKOFF_MIN;
        loop {
            let (stage, error) = session(&config, &url, &log, &cursor, &wake, &mut backoff).await;
            metrics::gauge!("rampart_feedback_stream_up").set(0.0);
            metrics::counter!("rampart_feedback_stream_errors_total", "stage" => stage)
                .increment(1);
            tracing::warn!(
                target: "rampart::feedback",
                stage,
                error = %error,
                stream = %config.stream,
                retry_in_ms = backoff.as_millis() as u64,
                "the correction stream to NATS failed; it retries from the last acknowledged line"
            );
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(BACKOFF_MAX);
        }
    })
}

async fn session(
    config: &NatsConfig,
    url: &str,
    log: &Path,
    cursor: &Path,
    wake: &Notify,
    backoff: &mut Duration,
) -> Failure {
    let mut options = async_nats::ConnectOptions::new()
        .name("rampart-feedback")
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(Some(3));
    if let Some(file) = &config.credentials_file {
        options = match options.credentials_file(file).await {
            Ok(o) => o,
            Err(e) => return ("credentials", format!("{}: {e}", file.display())),
        };
    }
    let client = match options.connect(url).await {
        Ok(c) => c,
        Err(e) => return ("connect", e.to_string()),
    };
    let js = jetstream::new(client);
    let stream = if config.create_stream {
        js.get_or_create_stream(jetstream::stream::Config {
            name: config.stream.clone(),
            subjects: vec![format!("{}.>", config.subject)],
            storage: jetstream::stream::StorageType::File,
            duplicate_window: Duration::from_secs(3600),
            ..Default::default()
        })
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
    } else {
        js.get_stream(&config.stream)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    if let Err(e) = stream {
        return ("stream", format!("{}: {e}", config.stream));
    }
    metrics::gauge!("rampart_feedback_stream_up").set(1.0);
    tracing::info!(
        target: "rampart::feedback",
        stream = %config.stream,
        subject = %config.subject,
        "the correction stream is connected to NATS"
    );
    let mut offset = load_cursor(cursor);
    loop {
        let (log_c, max) = (log.to_path_buf(), config.max_in_flight);
        let read = tokio::task::spawn_blocking(move || read_lines(&log_c, offset, max)).await;
        let (lines, len) = match read {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => return ("read", format!("{}: {e}", log.display())),
            Err(e) => return ("read", e.to_string()),
        };
        if len < offset {
            tracing::warn!(
                target: "rampart::feedback",
                log = %log.display(),
                cursor = offset,
                length = len,
                "the correction log is shorter than the stream's cursor (it was replaced): \
                 streaming it from its start"
            );
            offset = 0;
            if let Err(e) = save_cursor(cursor, 0) {
                return ("cursor", format!("{}: {e}", cursor.display()));
            }
            continue;
        }
        metrics::gauge!("rampart_feedback_stream_lag_bytes").set((len - offset) as f64);
        if lines.is_empty() {
            tokio::select! {
                _ = wake.notified() => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            continue;
        }
        // Publish the batch, then take the acknowledgements in order.
        let mut pending: Vec<(Option<PublishAckFuture>, u64)> = Vec::with_capacity(lines.len());
        let mut failed: Option<Failure> = None;
        for (line, end) in lines {
            let Some((subject, id)) = address(&config.subject, &line) else {
                tracing::warn!(
                    target: "rampart::feedback",
                    offset = end - line.len() as u64 - 1,
                    "a line of the correction log is not a JSON object: not streamed"
                );
                pending.push((None, end));
                continue;
            };
            let message = PublishMessage::build().payload(line.into()).message_id(id);
            match js.send_publish(subject, message).await {
                Ok(ack) => pending.push((Some(ack), end)),
                Err(e) => {
                    failed = Some(("publish", e.to_string()));
                    break;
                }
            }
        }
        let mut done = offset;
        for (ack, end) in pending {
            match ack {
                None => {
                    metrics::counter!("rampart_feedback_streamed_total", "outcome" => "skipped")
                        .increment(1);
                    done = end;
                }
                Some(ack) => match ack.await {
                    Ok(a) => {
                        let outcome = if a.duplicate {
                            "duplicate"
                        } else {
                            "published"
                        };
                        metrics::counter!("rampart_feedback_streamed_total", "outcome" => outcome)
                            .increment(1);
                        done = end;
                    }
                    Err(e) => {
                        failed.get_or_insert(("ack", e.to_string()));
                        break;
                    }
                },
            }
        }
        if done > offset {
            offset = done;
            if let Err(e) = save_cursor(cursor, offset) {
                return ("cursor", format!("{}: {e}", cursor.display()));
            }
            *backoff = BACKOFF_MIN;
        }
        if let Some(f) = failed {
            return f;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn complete_lines_only_and_their_ends() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("corrections.jsonl");
        assert_eq!(read_lines(&log, 0, 10).unwrap(), (vec![], 0));
        std::fs::write(&log, b"{\"a\":1}\n{\"b\":2}\n{\"c\"").unwrap();
        let (lines, len) = read_lines(&log, 0, 10).unwrap();
        assert_eq!(len, 20);
        assert_eq!(
            lines,
            vec![(b"{\"a\":1}".to_vec(), 8), (b"{\"b\":2}".to_vec(), 16)]
        );
        let (lines, _) = read_lines(&log, 8, 1).unwrap();
        assert_eq!(lines, vec![(b"{\"b\":2}".to_vec(), 16)]);
        assert!(read_lines(&log, 16, 10).unwrap().0.is_empty());
    }

    #[test]
    fn a_line_longer_than_one_pass_is_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("corrections.jsonl");
        let long = format!("{{\"x\":\"{}\"}}\n", "y".repeat(READ_BYTES + 10));
        std::fs::write(&log, &long).unwrap();
        let (lines, _) = read_lines(&log, 0, 10).unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].1, long.len() as u64);
    }

    #[test]
    fn subjects_and_ids() {
        assert_eq!(subject_token("smollm2"), "smollm2");
        assert_eq!(subject_token("org.model v1*>"), "org_model_v1__");
        assert_eq!(subject_token(""), "_");
        let (subject, id) = address("rampart.feedback", br#"{"model":"a.b","x":1}"#).unwrap();
        assert_eq!(subject, "rampart.feedback.a_b");
        assert_eq!(id.len(), 32);
        assert_ne!(address("s", br#"{"model":"a","x":2}"#).unwrap().1, id);
        assert!(address("s", b"not json").is_none());
        assert!(address("s", b"[1]").is_none());
    }

    #[test]
    fn cursor_round_trip_and_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(CURSOR);
        assert_eq!(load_cursor(&path), 0);
        save_cursor(&path, 1234).unwrap();
        assert_eq!(load_cursor(&path), 1234);
        std::fs::write(&path, "x").unwrap();
        assert_eq!(load_cursor(&path), 0);
    }
}

/// Against a real NATS server with JetStream (testkit::nats): every line of the correction log
/// arrives once, in order, through an outage of NATS and a restart of the streamer that lost
/// its cursor. (Here rather than in `tests/`: one test binary fewer to link.)
#[cfg(test)]
mod nats_tests {
    use std::io::Write;
    use std::path::Path;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use async_nats::jetstream;
    use testkit::nats::Nats;

    use crate::config::NatsConfig;
    use crate::correction_stream;

    fn line(n: usize, model: &str) -> String {
        format!(
            r#"{{"feedback_id":"fb-{n}","model":"{model}","rating":"not_helpful","label":"billing","n":{n}}}"#
        )
    }

    fn append(log: &Path, lines: &[String]) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        for l in lines {
            writeln!(f, "{l}").unwrap();
        }
    }

    async fn stored(js: &jetstream::Context, stream: &str) -> Vec<(String, String)> {
        let Ok(s) = js.get_stream(stream).await else {
            return Vec::new();
        };
        let Ok(info) = s.get_info().await else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for seq in info.state.first_sequence..=info.state.last_sequence {
            if info.state.messages == 0 {
                break;
            }
            let m = s.get_raw_message(seq).await.unwrap();
            out.push((
                m.subject.to_string(),
                String::from_utf8(m.payload.to_vec()).unwrap(),
            ));
        }
        out
    }

    async fn wait_for(js: &jetstream::Context, stream: &str, n: usize) -> Vec<(String, String)> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let got = stored(js, stream).await;
            if got.len() >= n || Instant::now() > deadline {
                return got;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn wait_cursor(dir: &Path, log: &Path) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let len = std::fs::metadata(log).unwrap().len();
        while correction_stream::load_cursor(&dir.join(correction_stream::CURSOR)) != len {
            assert!(
                Instant::now() < deadline,
                "the cursor did not reach the log's end"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_correction_reaches_the_stream_once_in_order_through_an_outage_and_a_lost_cursor()
    {
        let Some(mut nats) = Nats::start() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("corrections.jsonl");
        let config = NatsConfig {
            url: Some(nats.url()),
            ..NatsConfig::default()
        };
        let wake = Arc::new(tokio::sync::Notify::new());
        let mut expected: Vec<String> = (0..3).map(|n| line(n, "tickets")).collect();
        append(&log, &expected);
        let streamer =
            correction_stream::spawn(config.clone(), nats.url(), log.clone(), Arc::clone(&wake));

        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = jetstream::new(client);
        let got = wait_for(&js, "RAMPART_FEEDBACK", 3).await;
        assert_eq!(
            got.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
            expected
        );
        assert!(got.iter().all(|(s, _)| s == "rampart.feedback.tickets"));
        wait_cursor(dir.path(), &log).await;
        drop(js);

        // NATS goes down; corrections keep coming (one model's name needs a safe subject).
        nats.stop();
        let more = vec![line(3, "tickets"), line(4, "org.triage v2")];
        append(&log, &more);
        wake.notify_one();
        expected.extend(more);
        tokio::time::sleep(Duration::from_secs(2)).await;
        nats.start_again();
        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = jetstream::new(client);
        let got = wait_for(&js, "RAMPART_FEEDBACK", 5).await;
        assert_eq!(
            got.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
            expected,
            "nothing lost or doubled through the outage"
        );
        assert_eq!(got[4].0, "rampart.feedback.org_triage_v2");
        wait_cursor(dir.path(), &log).await;

        // The server restarts and its cursor is gone: the log is sent again from its start, and the
        // stream's duplicate window drops what it has. A line that is not JSON is passed over.
        streamer.abort();
        let _ = streamer.await;
        std::fs::remove_file(dir.path().join(correction_stream::CURSOR)).unwrap();
        append(&log, &["not json".to_string(), line(5, "tickets")]);
        expected.push(line(5, "tickets"));
        let streamer = correction_stream::spawn(config, nats.url(), log.clone(), wake);
        wait_cursor(dir.path(), &log).await;
        let got = wait_for(&js, "RAMPART_FEEDBACK", 6).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let got_after = stored(&js, "RAMPART_FEEDBACK").await;
        assert_eq!(got, got_after);
        assert_eq!(
            got.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
            expected,
            "a replay adds nothing the stream has"
        );
        streamer.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stream_the_operator_must_create_is_waited_for() {
        let Some(nats) = Nats::start() else {
            return;
        };
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("corrections.jsonl");
        append(&log, &[line(0, "tickets")]);
        let config = NatsConfig {
            url: Some(nats.url()),
            stream: "OPS_FEEDBACK".into(),
            subject: "ops.feedback".into(),
            create_stream: false,
            ..NatsConfig::default()
        };
        let wake = Arc::new(tokio::sync::Notify::new());
        let streamer = correction_stream::spawn(config, nats.url(), log.clone(), wake);
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            correction_stream::load_cursor(&dir.path().join(correction_stream::CURSOR)),
            0,
            "nothing is sent before the stream exists"
        );
        let client = async_nats::connect(nats.url()).await.unwrap();
        let js = jetstream::new(client);
        js.create_stream(jetstream::stream::Config {
            name: "OPS_FEEDBACK".into(),
            subjects: vec!["ops.feedback.>".into()],
            ..Default::default()
        })
        .await
        .unwrap();
        let got = wait_for(&js, "OPS_FEEDBACK", 1).await;
        assert_eq!(
            got,
            vec![("ops.feedback.tickets".into(), line(0, "tickets"))]
        );
        wait_cursor(dir.path(), &log).await;
        streamer.abort();
    }
}
