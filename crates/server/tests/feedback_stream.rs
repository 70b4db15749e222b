//! The correction stream against a real NATS server with JetStream (testkit::nats): every line
//! of the correction log arrives once, in order, through an outage of NATS and a restart of the
//! streamer that lost its cursor.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream;
use server::config::NatsConfig;
use server::feedback_stream;
use testkit::nats::Nats;

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
    while feedback_stream::load_cursor(&dir.join(feedback_stream::CURSOR)) != len {
        assert!(
            Instant::now() < deadline,
            "the cursor did not reach the log's end"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_correction_reaches_the_stream_once_in_order_through_an_outage_and_a_lost_cursor() {
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
        feedback_stream::spawn(config.clone(), nats.url(), log.clone(), Arc::clone(&wake));

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
    std::fs::remove_file(dir.path().join(feedback_stream::CURSOR)).unwrap();
    append(&log, &["not json".to_string(), line(5, "tickets")]);
    expected.push(line(5, "tickets"));
    let streamer = feedback_stream::spawn(config, nats.url(), log.clone(), wake);
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
    let streamer = feedback_stream::spawn(config, nats.url(), log.clone(), wake);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        feedback_stream::load_cursor(&dir.path().join(feedback_stream::CURSOR)),
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
