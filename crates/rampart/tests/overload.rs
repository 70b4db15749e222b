//! Overload on the real binary and a real model (SmolLM2): the first-token gate's bookings and
//! its weighted fair order. Two tenants of weights 3 and 1 overload one model with clients
//! that retry a 429 as the official OpenAI clients do (the same request again after
//! `retry-after-ms`); they are let in about 3 : 1, refused requests are booked and let in at
//! their time, and the capacity signals say so.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

mod common;

use common::*;
use testkit::cached_model;
use testkit::models::SMOLLM2_GGUF;

/// The tests here load two cores each: one at a time (the 3 : 1 share measured beside the
/// other test's load came out 2.3).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The infer key of the light tenant (`completer`, weight 1); `tester` ([`KEY`]) weighs 3.
const LIGHT_KEY: &str = "sk-test-completion-0001";

struct Tally {
    admitted: u32,
    refused: u32,
    booked: u32,
    bad: Vec<String>,
}

/// One client: sends a fresh request, and on a 429 the same request again after the wait it
/// was told (as openai-python does with `retry-after-ms`), until `stop`.
fn client(port: u16, key: &'static str, tag: String, stop: Arc<AtomicBool>) -> Tally {
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(30);
    let mut tally = Tally {
        admitted: 0,
        refused: 0,
        booked: 0,
        bad: Vec::new(),
    };
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        n += 1;
        let body = format!(
            r#"{{"model":"{MODEL}","prompt":"{tag} {n} {prompt}","max_tokens":2,"ignore_eos":true}}"#
        );
        loop {
            let (status, headers, text) =
                http(port, "POST", "/v1/completions", Some(&body), Some(key));
            match status {
                200 => {
                    tally.admitted += 1;
                    break;
                }
                429 => {
                    tally.refused += 1;
                    if header(&headers, "x-rampart-reservation").is_some() {
                        tally.booked += 1;
                    }
                    let wait: u64 = header(&headers, "retry-after-ms")
                        .and_then(|v| v.parse().ok())
                        .or_else(|| {
                            header(&headers, "retry-after")
                                .and_then(|v| v.parse::<u64>().ok())
                                .map(|s| s * 1000)
                        })
                        .unwrap_or(500);
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(wait.min(5_000)));
                }
                _ => {
                    tally.bad.push(format!("{status}: {text}"));
                    break;
                }
            }
        }
    }
    tally
}

fn start(model: PathBuf) -> Server {
    let config = format!(
        r#"
[degradation]
window_ms = 500
[admission]
max_in_flight = 64
[admission.weights]
tester = 3
completer = 1
[[models]]
name = "{MODEL}"
context = 1024
kv_cache_memory = "128MiB"
max_num_seqs = 16
max_num_batched_tokens = 256
[models.slo]
ttft_p99_ms = 1500
"#
    );
    start_repository(&[(MODEL, "1.0.0", model)], &config)
}

#[test]
fn two_tenants_weighted_3_to_1_overloading_one_model_are_let_in_3_to_1_in_booked_order() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let server = start(model);
    let port = server.port;
    wait_ready(port);
    // The gate predicts from the measured reading rate: a few prompts measure it.
    for i in 0..6 {
        let body = format!(
            r#"{{"model":"{MODEL}","prompt":"warm {i} {}","max_tokens":2}}"#,
            "the quick brown fox jumps over the lazy dog ".repeat(30)
        );
        let (status, _, text) = http(port, "POST", "/v1/completions", Some(&body), Some(KEY));
        assert_eq!(status, 200, "{text}");
    }
    // Twelve clients per tenant, each always with a request outstanding: far more than the
    // engine reads within the objective.
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for (key, name) in [(KEY, "heavy"), (LIGHT_KEY, "light")] {
        for c in 0..12 {
            let stop = Arc::clone(&stop);
            let tag = format!("{name}-{c}");
            clients.push((
                name,
                std::thread::spawn(move || client(port, key, tag, stop)),
            ));
        }
    }
    std::thread::sleep(Duration::from_secs(20));
    stop.store(true, Ordering::Relaxed);
    let mut heavy = (0u32, 0u32, 0u32);
    let mut light = (0u32, 0u32, 0u32);
    for (name, handle) in clients {
        let t = handle.join().unwrap();
        assert!(t.bad.is_empty(), "{name}: {:?}", t.bad);
        let sum = if name == "heavy" {
            &mut heavy
        } else {
            &mut light
        };
        sum.0 += t.admitted;
        sum.1 += t.refused;
        sum.2 += t.booked;
    }
    let ratio = f64::from(heavy.0) / f64::from(light.0.max(1));
    eprintln!(
        "overload: heavy (weight 3) {} admitted, {} refused ({} booked); light (weight 1) {} admitted, {} refused ({} booked); ratio {ratio:.2}",
        heavy.0, heavy.1, heavy.2, light.0, light.1, light.2
    );
    assert!(heavy.1 + light.1 > 0, "the model was not overloaded");
    assert!(
        (2.2..=4.0).contains(&ratio),
        "admissions {heavy:?} : {light:?}"
    );
    // Refusals carried bookings, and booked requests came back and were let in.
    assert!(heavy.2 + light.2 > 0);
    let (status, _, body) = http(port, "GET", "/admin/degradation", None, Some(ADMIN_KEY));
    assert_eq!(status, 200, "{body}");
    let view: serde_json::Value = serde_json::from_str(&body).unwrap();
    let gate = &view["models"][0]["first_token_gate"];
    let reservations = &gate["reservations"];
    eprintln!("overload: gate {gate}");
    assert!(reservations["issued"].as_u64().unwrap() > 0, "{gate}");
    assert!(reservations["honoured"].as_u64().unwrap() > 0, "{gate}");
    assert!(gate["predicted_wait_ms"].is_number(), "{gate}");
    assert!(
        metric_labelled(port, "rampart_reservations_total", "outcome=\"honoured\"") > 0.0,
        "the bookings' outcomes are metrics"
    );
}

/// Without an objective: one key fills the model's admission queue; another key's request
/// still gets in (it takes the place of the first key's latest waiter, which is told so).
#[test]
fn a_key_that_fills_the_admission_queue_does_not_shut_another_out() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let Some(model) = cached_model(SMOLLM2_GGUF) else {
        return;
    };
    let config = format!(
        "[admission]\nmax_in_flight = 1\nmax_waiting = 4\n[[models]]\nname = \"{MODEL}\"\ncontext = 1024\nkv_cache_memory = \"64MiB\"\n"
    );
    let server = start_repository(&[(MODEL, "1.0.0", model)], &config);
    let port = server.port;
    wait_ready(port);
    let body = |tag: &str| {
        format!(
            r#"{{"model":"{MODEL}","prompt":"{tag} Once upon a time","max_tokens":160,"ignore_eos":true}}"#
        )
    };
    // Five at once from one key: one in flight, four waiting, the queue full.
    let heavy: Vec<_> = (0..5)
        .map(|i| {
            let body = body(&format!("heavy {i}"));
            std::thread::spawn(move || {
                http(port, "POST", "/v1/completions", Some(&body), Some(KEY))
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (status, _, text) = http(
        port,
        "POST",
        "/v1/completions",
        Some(&body("light")),
        Some(LIGHT_KEY),
    );
    assert_eq!(status, 200, "the other key got in: {text}");
    let answers: Vec<_> = heavy.into_iter().map(|h| h.join().unwrap()).collect();
    let displaced: Vec<_> = answers.iter().filter(|a| a.0 == 429).collect();
    assert_eq!(displaced.len(), 1, "{answers:?}");
    assert!(
        displaced[0].2.contains("gave its place"),
        "{}",
        displaced[0].2
    );
    assert_eq!(answers.iter().filter(|a| a.0 == 200).count(), 4);
}
