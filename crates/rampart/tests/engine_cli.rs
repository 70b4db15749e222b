//! `rampart generate` and `rampart bench` end to end: the real binary on a generated tiny model
//! and on SmolLM2 from the model cache.

use std::path::Path;

use assert_cmd::Command;
use formats::tiny::TinyLlama;
use predicates::prelude::*;
use serde_json::Value as Json;
use testkit::{cached_model, flip_byte, models};

fn rampart(repo: &Path) -> Command {
    let mut cmd = Command::cargo_bin("rampart").unwrap();
    cmd.env("RAMPART_REPO", repo);
    cmd
}

fn tiny_gguf(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tiny.gguf");
    std::fs::write(&path, TinyLlama::default().to_gguf().unwrap()).unwrap();
    path
}

#[test]
fn generate_streams_tokens_with_logprobs_and_entropy() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tiny_gguf(tmp.path());
    let out = rampart(tmp.path())
        .args([
            "generate",
            "-m",
            gguf.to_str().unwrap(),
            "-t",
            "2",
            "-p",
            "the cat",
            "-n",
            "6",
            "--logprobs",
        ])
        .assert()
        .success()
        .stderr(predicate::str::contains("prompt 6 tokens"))
        .stderr(predicate::str::contains("[finish: length]"))
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 6, "{text}");
    for line in lines {
        assert!(
            line.contains("logprob") && line.contains("entropy") && line.contains("top:"),
            "{line}"
        );
    }
}

#[test]
fn generate_from_the_repository_verifies_digests_first() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    let gguf = tiny_gguf(tmp.path());
    rampart(&repo)
        .args([
            "model",
            "import",
            gguf.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "1.0.0",
        ])
        .assert()
        .success();
    rampart(&repo)
        .args([
            "generate",
            "--model",
            "tiny",
            "-p",
            "hello",
            "-n",
            "3",
            "--seed",
            "7",
            "--temperature",
            "0.8",
        ])
        .assert()
        .success()
        .stderr(predicate::str::contains("generated 3 tokens"));
    flip_byte(&repo.join("tiny/1.0.0/tiny.gguf"), 4096);
    rampart(&repo)
        .args(["generate", "--model", "tiny", "-p", "hello", "-n", "3"])
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "failed verification: content changed: tiny.gguf",
        ));
}

#[test]
fn generate_from_a_hugging_face_folder_and_its_import() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    let gguf = tiny_gguf(tmp.path());
    let hf = tmp.path().join("tiny-hf");
    TinyLlama::default().write_hf_folder(&hf, 2).unwrap();
    rampart(&repo)
        .args(["model", "import", hf.to_str().unwrap()])
        .args(["--name", "tiny-hf", "--version", "1.0.0"])
        .assert()
        .success();
    let greedy = |model: &str| {
        let out = rampart(&repo)
            .args([
                "generate", "-m", model, "-t", "2", "-p", "the cat", "-n", "8",
            ])
            .assert()
            .success()
            .stderr(predicate::str::contains("generated 8 tokens"))
            .get_output()
            .stdout
            .clone();
        String::from_utf8(out).unwrap()
    };
    let from_gguf = greedy(gguf.to_str().unwrap());
    assert_eq!(greedy(hf.to_str().unwrap()), from_gguf, "the folder itself");
    assert_eq!(greedy("tiny-hf"), from_gguf, "the imported version");
}

#[test]
fn bad_requests_are_clear_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tiny_gguf(tmp.path());
    let g = gguf.to_str().unwrap();
    rampart(tmp.path())
        .args(["generate", "-m", g, "-p", "x", "--temperature", "5"])
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "temperature must be between 0 and 2, got 5",
        ));
    rampart(tmp.path())
        .args(["generate", "-m", g, "-p", "x", "-n", "1000"])
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "exceeds the context of 256 tokens",
        ));
    rampart(tmp.path())
        .args(["generate", "-m", "nope", "-p", "x"])
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "model \"nope\" is not in the repository",
        ));
}

#[test]
fn bench_engine_reports_both_phases() {
    let tmp = tempfile::tempdir().unwrap();
    let gguf = tiny_gguf(tmp.path());
    let out = rampart(tmp.path())
        .args([
            "bench",
            "engine",
            "-m",
            gguf.to_str().unwrap(),
            "-t",
            "2",
            "--prompt-tokens",
            "64",
            "--gen-tokens",
            "16",
            "-r",
            "2",
            "--json",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let j: Json = serde_json::from_slice(&out).unwrap();
    assert!(j["prefill_tokens_per_second"].as_f64().unwrap() > 0.0);
    assert!(j["decode_tokens_per_second"].as_f64().unwrap() > 0.0);
    assert_eq!(j["decode_runs"].as_array().unwrap().len(), 2);
}

#[test]
fn smollm2_answers_through_the_cli() {
    let Some(gguf) = cached_model(models::SMOLLM2_GGUF) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    rampart(&repo)
        .args([
            "model",
            "import",
            gguf.to_str().unwrap(),
            "--name",
            "smollm2-135m",
            "--version",
            "1.0.0",
            "--link",
        ])
        .assert()
        .success();
    rampart(&repo)
        .args([
            "generate",
            "--model",
            "smollm2-135m",
            "-t",
            "2",
            "--chat",
            "--system",
            "You are a helpful assistant.",
            "--prompt",
            "What is the capital of France?",
        ])
        .assert()
        .success()
        .stdout("The capital of France is Paris.\n")
        .stderr(predicate::str::contains("[finish: stop]"));
}

/// `rampart tokenize` on the real models: SmolLM2's ids as llama.cpp tokenizes them (no BOS),
/// Gemma 3's with its BOS; a chat message through the template; clear refusals.
#[test]
fn tokenize_prints_the_ids_llama_cpp_computes() {
    let tmp = tempfile::tempdir().unwrap();
    let tokenize = |model: &Path, args: &[&str]| -> Json {
        let out = rampart(tmp.path())
            .arg("tokenize")
            .arg(model)
            .args(args)
            .arg("--json")
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        serde_json::from_slice(&out).unwrap()
    };
    if let Some(smollm2) = cached_model(models::SMOLLM2_GGUF) {
        let j = tokenize(&smollm2, &["The capital of France is"]);
        assert_eq!(j["tokens"], serde_json::json!([504, 3575, 282, 4649, 314]));
        assert_eq!(j["token_strs"][1], " capital");
        let chat = tokenize(&smollm2, &["--chat", "Hi"]);
        let bare = tokenize(&smollm2, &["--chat", "--no-generation-prompt", "Hi"]);
        let (chat, bare) = (
            chat["count"].as_u64().unwrap(),
            bare["count"].as_u64().unwrap(),
        );
        assert!(chat > bare && bare > 3, "{chat} {bare}");
        rampart(tmp.path())
            .args(["tokenize", smollm2.to_str().unwrap(), "x", "--system", "s"])
            .assert()
            .failure()
            .stderr(predicate::str::contains("--system needs --chat"));
    }
    if let Some(gemma) = cached_model(models::GEMMA3_GGUF) {
        let j = tokenize(&gemma, &["The capital of France is"]);
        assert_eq!(j["tokens"][0], 2, "{j}");
        let plain = tokenize(&gemma, &["--plain", "<start_of_turn>"]);
        assert!(plain["count"].as_u64() > Some(2), "{plain}");
        let special = tokenize(&gemma, &["<start_of_turn>"]);
        assert_eq!(special["tokens"], serde_json::json!([2, 105]));
        let no_bos = tokenize(&gemma, &["--no-special-tokens", "<start_of_turn>"]);
        assert_eq!(no_bos["tokens"], serde_json::json!([105]));
    }
}
