//! The repository library end to end on tiny generated models in the real formats.

use std::path::{Path, PathBuf};

use formats::tiny::TinyLlama;
use repo::diff::diff;
use repo::manifest::{FileRole, Format, Kind};
use repo::{BuildInfo, ImportOptions, ModelRef, NoProgress, RepoError, Repository};
use testkit::flip_byte;

fn build() -> BuildInfo {
    BuildInfo {
        version: "0.0.0-test".into(),
        git_commit: Some("abc123".into()),
        rustc: None,
    }
}

fn options(name: &str, version: &str) -> ImportOptions<'static> {
    ImportOptions {
        name: name.into(),
        version: version.into(),
        kind: None,
        link: false,
        git_commit: None,
        dataset_version: None,
        derived_from: None,
        pipeline: None,
        build: build(),
        progress: &NoProgress,
        rules_check: Some(|text| Ok(guard::check_rules_file(text)?)),
        host_fingerprint: serde_json::to_value(host::fingerprint(&host::Context::default())).ok(),
        card: None,
        stable: false,
    }
}

fn write_tiny(dir: &Path, file: &str, model: &TinyLlama) -> PathBuf {
    let path = dir.join(file);
    std::fs::write(&path, model.to_gguf().unwrap()).unwrap();
    path
}

fn make_writable(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

#[test]
fn import_writes_manifest_digests_and_lineage() {
    let tmp = tempfile::tempdir().unwrap();
    let model = TinyLlama::default();
    let src = write_tiny(tmp.path(), "tiny.gguf", &model);
    let repo = Repository::open(tmp.path().join("models"));
    let mut opts = options("tiny", "1.0.0");
    opts.git_commit = Some("deadbeef".into());
    opts.dataset_version = Some("tickets-2026-11".into());
    let loaded = repo.import(&src, &opts).unwrap();

    let m = &loaded.manifest;
    assert_eq!((m.model.kind, m.model.format), (Kind::Llm, Format::Gguf));
    assert_eq!(m.model.parameter_count, model.parameter_count());
    assert_eq!(m.model.weights, ["tiny.gguf"]);
    assert_eq!(m.files[0].role, FileRole::Weights);
    let arch = m.architecture.as_ref().unwrap();
    assert_eq!(arch.name, "llama");
    assert_eq!(
        (arch.block_count, arch.head_count, arch.head_count_kv),
        (Some(2), Some(4), Some(2))
    );
    assert_eq!(arch.norm_eps, Some(1e-5));
    assert_eq!(arch.tied_embeddings, Some(true));
    assert_eq!(arch.tensor_types["F32"], 20);
    let tok = m.tokenizer.as_ref().unwrap();
    assert_eq!(
        (tok.kind.as_str(), tok.vocab_size, tok.merges),
        ("gpt2", 264, 5)
    );
    assert_eq!(tok.special["eos"].text, "<|im_end|>");
    assert!(tok.chat_template);

    let dir = tmp.path().join("models/tiny/1.0.0");
    assert_eq!(loaded.version.dir, dir);
    let on_disk = repo::Manifest::read(&dir).unwrap();
    assert_eq!(&on_disk, m, "manifest round-trips through TOML");
    let digests = repo::Digests::read(&dir).unwrap();
    let names: Vec<&str> = digests.files.keys().map(String::as_str).collect();
    assert_eq!(names, ["LINEAGE.json", "rampart.toml", "tiny.gguf"]);
    assert_eq!(digests.version_digest(), loaded.version_digest);

    let lineage = repo::Lineage::read(&dir).unwrap();
    assert_eq!(lineage.git_commit.as_deref(), Some("deadbeef"));
    assert_eq!(lineage.dataset_version.as_deref(), Some("tickets-2026-11"));
    assert_eq!(lineage.rampart.git_commit.as_deref(), Some("abc123"));
    assert_eq!(lineage.source.kind, "file");
    assert_eq!(lineage.source.sha256, digests.files["tiny.gguf"]);
    assert_eq!(lineage.import_mode, "copy");
    assert!(lineage.environment.logical_cpus >= 1);

    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.join("tiny.gguf"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o222, 0, "files are read-only");
    let staging: Vec<_> = std::fs::read_dir(tmp.path().join("models/tiny"))
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
        .collect();
    assert!(staging.is_empty(), "no staging folder is left behind");
}

#[test]
fn an_imported_versions_lineage_carries_the_hardware_fingerprint() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let repo = Repository::open(tmp.path().join("models"));
    repo.import(&src, &options("tiny", "1.0.0")).unwrap();
    let text = std::fs::read_to_string(tmp.path().join("models/tiny/1.0.0/LINEAGE.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let fingerprint = &json["environment"]["fingerprint"];
    assert_eq!(
        fingerprint["schema_version"],
        host::FINGERPRINT_VERSION,
        "{text}"
    );
    assert_eq!(fingerprint["arch"], std::env::consts::ARCH);
    assert!(fingerprint["cpu"]["flags"].is_array(), "{text}");
    assert!(fingerprint["gpus"].is_array() && fingerprint["pcie"].is_array());
    // It reads back typed, and says this host.
    let lineage = repo::Lineage::read(&tmp.path().join("models/tiny/1.0.0")).unwrap();
    let typed = lineage
        .environment
        .fingerprint
        .as_ref()
        .and_then(host::Fingerprint::from_json)
        .expect("typed fingerprint");
    assert_eq!(
        typed.kernel_release,
        host::fingerprint(&host::Context::default()).kernel_release
    );
}

#[test]
fn versions_are_immutable() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "a.gguf", &TinyLlama::default());
    let other = write_tiny(
        tmp.path(),
        "b.gguf",
        &TinyLlama {
            seed: 9,
            ..TinyLlama::default()
        },
    );
    let repo = Repository::open(tmp.path().join("models"));
    let first = repo.import(&src, &options("tiny", "1.0.0")).unwrap();
    let err = repo.import(&other, &options("tiny", "1.0.0")).unwrap_err();
    assert!(matches!(err, RepoError::VersionExists { .. }), "{err}");
    assert!(err.to_string().contains("versions are immutable"), "{err}");
    let again = repo
        .load(&"tiny@1.0.0".parse().unwrap(), &NoProgress)
        .unwrap();
    assert_eq!(
        again.version_digest, first.version_digest,
        "the original is untouched"
    );
}

#[test]
fn corrupt_sources_fail_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = TinyLlama::default().to_gguf().unwrap();
    let src = tmp.path().join("cut.gguf");
    std::fs::write(&src, &bytes[..bytes.len() - 100]).unwrap();
    let repo = Repository::open(tmp.path().join("models"));
    let err = repo.import(&src, &options("tiny", "1.0.0")).unwrap_err();
    assert!(matches!(err, RepoError::BadModelFile { .. }), "{err}");
    assert!(err.to_string().contains("truncated"), "{err}");
    assert!(!tmp.path().join("models/tiny/1.0.0").exists());

    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let err = repo.import(&empty, &options("tiny", "1.0.0")).unwrap_err();
    assert!(err.to_string().contains("no files"), "{err}");
    let missing = repo
        .import(&tmp.path().join("nope.gguf"), &options("tiny", "1.0.0"))
        .unwrap_err();
    assert!(matches!(missing, RepoError::Io { .. }), "{missing}");
    let bad_name = repo
        .import(&src, &options("Tiny Model", "1.0.0"))
        .unwrap_err();
    assert!(
        matches!(bad_name, RepoError::InvalidName { .. }),
        "{bad_name}"
    );
    let bad_version = repo.import(&src, &options("tiny", "v1")).unwrap_err();
    assert!(
        matches!(bad_version, RepoError::InvalidVersion { .. }),
        "{bad_version}"
    );
}

#[test]
fn verify_detects_changed_missing_and_extra_files() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let repo = Repository::open(tmp.path().join("models"));
    let loaded = repo.import(&src, &options("tiny", "1.0.0")).unwrap();
    let v = loaded.version;
    assert!(repo.verify(&v, &NoProgress).unwrap().ok());

    flip_byte(&v.dir.join("tiny.gguf"), 5000);
    let report = repo.verify(&v, &NoProgress).unwrap();
    assert_eq!(report.mismatched, ["tiny.gguf"]);
    let err = repo
        .load(&"tiny".parse().unwrap(), &NoProgress)
        .unwrap_err();
    assert!(matches!(err, RepoError::VerificationFailed { .. }));
    assert!(
        err.to_string().contains("content changed: tiny.gguf"),
        "{err}"
    );
    flip_byte(&v.dir.join("tiny.gguf"), 5000);
    assert!(
        repo.verify(&v, &NoProgress).unwrap().ok(),
        "flipping back restores it"
    );

    make_writable(&v.dir);
    std::fs::write(v.dir.join("extra.bin"), b"x").unwrap();
    std::fs::remove_file(v.dir.join("LINEAGE.json")).unwrap();
    let report = repo.verify(&v, &NoProgress).unwrap();
    assert_eq!(report.unexpected, ["extra.bin"]);
    assert_eq!(report.missing, ["LINEAGE.json"]);
    assert!(!report.ok());
}

#[test]
fn a_name_resolves_to_the_stable_version_never_to_the_newest() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let repo = Repository::open(tmp.path().join("models"));
    for v in ["1.2.0", "1.10.0", "1.9.3", "2.0.0-rc.1"] {
        repo.import(&src, &options("tiny", v)).unwrap();
    }
    // The first version to arrive became the stable one; later imports changed nothing.
    let served = repo.resolve(&"tiny".parse().unwrap()).unwrap();
    assert_eq!(served.version.to_string(), "1.2.0");
    let setting = repo.stable("tiny").unwrap().unwrap();
    assert_eq!(setting.cause, "first version");
    assert!(setting.digest.starts_with("sha256:"), "{setting:?}");
    let waiting: Vec<String> = repo
        .waiting("tiny")
        .unwrap()
        .iter()
        .map(|v| v.version.to_string())
        .collect();
    assert_eq!(waiting, ["1.9.3", "1.10.0", "2.0.0-rc.1"]);

    // Promoting moves it, and keeps the history.
    let v110 = repo.resolve(&"tiny@1.10.0".parse().unwrap()).unwrap();
    repo.set_stable(&v110, "alice", "promote: passed the gates")
        .unwrap();
    assert_eq!(
        repo.resolve(&"tiny".parse().unwrap())
            .unwrap()
            .version
            .to_string(),
        "1.10.0"
    );
    let aliases = repo.aliases("tiny").unwrap();
    assert_eq!(aliases.history.len(), 1);
    assert_eq!(aliases.stable.unwrap().set_by, "alice");

    let rc = repo.resolve(&"tiny@2.0.0-rc.1".parse().unwrap()).unwrap();
    assert_eq!(rc.version.to_string(), "2.0.0-rc.1");
    let listed: Vec<String> = repo
        .versions("tiny")
        .unwrap()
        .iter()
        .map(|v| v.version.to_string())
        .collect();
    assert_eq!(listed, ["1.2.0", "1.9.3", "1.10.0", "2.0.0-rc.1"]);
    let err = repo.resolve(&"tiny@3.0.0".parse().unwrap()).unwrap_err();
    assert!(
        err.to_string()
            .contains("versions: 1.2.0, 1.9.3, 1.10.0, 2.0.0-rc.1"),
        "{err}"
    );
    let err = repo.resolve(&"other".parse().unwrap()).unwrap_err();
    assert!(err.to_string().contains("models: tiny"), "{err}");

    // `--stable` makes an import what users get at once.
    let mut opts = options("tiny", "1.11.0");
    opts.stable = true;
    repo.import(&src, &opts).unwrap();
    assert_eq!(repo.stable("tiny").unwrap().unwrap().version, "1.11.0");
}

#[test]
fn several_versions_without_a_stable_one_are_an_error_not_a_guess() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let repo = Repository::open(tmp.path().join("models"));
    repo.import(&src, &options("tiny", "1.0.0")).unwrap();
    repo.import(&src, &options("tiny", "1.1.0")).unwrap();
    // A repository from before aliases: no ALIASES.json.
    std::fs::remove_file(tmp.path().join("models/tiny/ALIASES.json")).unwrap();
    let err = repo.resolve(&"tiny".parse().unwrap()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("1.0.0, 1.1.0") && text.contains("rampart model promote tiny@VERSION"),
        "{text}"
    );
    // One version and no alias: served, as simply as before.
    let other = repo
        .import(&src, &options("solo", "1.0.0"))
        .unwrap()
        .version;
    std::fs::remove_file(tmp.path().join("models/solo/ALIASES.json")).unwrap();
    assert_eq!(repo.resolve(&"solo".parse().unwrap()).unwrap(), other);
    assert_eq!(repo.chosen("solo").unwrap().1, repo::Choice::OnlyVersion);
}

#[test]
fn an_alias_whose_version_changed_under_it_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let other = write_tiny(
        tmp.path(),
        "other.gguf",
        &TinyLlama {
            seed: 99,
            ..TinyLlama::default()
        },
    );
    let repo = Repository::open(tmp.path().join("models"));
    let v1 = repo
        .import(&src, &options("tiny", "1.0.0"))
        .unwrap()
        .version;
    repo.import(&src, &options("tiny", "1.1.0")).unwrap();
    // 1.0.0 removed by hand (the alias stays) and imported again with other weights.
    make_writable(&v1.dir);
    std::fs::remove_dir_all(&v1.dir).unwrap();
    let err = repo.resolve(&"tiny".parse().unwrap()).unwrap_err();
    assert!(
        err.to_string().contains("is not in the repository"),
        "{err}"
    );
    repo.import(&other, &options("tiny", "1.0.0")).unwrap();
    let err = repo.resolve(&"tiny".parse().unwrap()).unwrap_err();
    assert!(err.to_string().contains("now has the digest"), "{err}");
}

#[test]
fn a_model_card_is_imported_digest_checked_and_read() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let card = tmp.path().join("card.md");
    std::fs::write(
        &card,
        "# tiny\n\n## Intended use\nTests.\n\n## Limitations\nNone known.\n",
    )
    .unwrap();
    let repo = Repository::open(tmp.path().join("models"));
    let mut opts = options("tiny", "1.0.0");
    opts.card = Some(card);
    let v = repo.import(&src, &opts).unwrap().version;
    let read = repo.card(&v).unwrap().unwrap();
    assert_eq!(read.file, "MODEL_CARD.md");
    assert_eq!(read.missing(), vec!["evaluation data", "licence"]);
    assert!(repo.verify(&v, &NoProgress).unwrap().ok());
    // Edited after the import, the card fails verification like any other file.
    make_writable(&v.dir);
    let path = v.dir.join("MODEL_CARD.md");
    let mut perms = std::fs::metadata(&path).unwrap().permissions();
    #[allow(clippy::permissions_set_readonly_false)]
    perms.set_readonly(false);
    std::fs::set_permissions(&path, perms).unwrap();
    std::fs::write(&path, "## Intended use\nAnything.\n").unwrap();
    assert!(!repo.verify(&v, &NoProgress).unwrap().ok());
}

#[test]
fn hard_link_import_shares_the_source_inode() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let repo = Repository::open(tmp.path().join("models"));
    let mut opts = options("tiny", "1.0.0");
    opts.link = true;
    let loaded = repo.import(&src, &opts).unwrap();
    let linked = loaded.version.dir.join("tiny.gguf");
    assert_eq!(
        std::fs::metadata(&src).unwrap().ino(),
        std::fs::metadata(&linked).unwrap().ino()
    );
    assert!(
        !std::fs::metadata(&src).unwrap().permissions().readonly(),
        "the source's permissions are left alone"
    );
    assert_eq!(
        repo.lineage(&loaded.version).unwrap().import_mode,
        "hardlink"
    );
    // An edit to the source shows up as a failed verification of the version.
    flip_byte(&src, 100);
    assert_eq!(
        repo.verify(&loaded.version, &NoProgress)
            .unwrap()
            .mismatched,
        ["tiny.gguf"]
    );
}

#[test]
fn diff_reports_tokenizer_changes_and_blocks_on_them() {
    let tmp = tempfile::tempdir().unwrap();
    let base = TinyLlama::default();
    let repo = Repository::open(tmp.path().join("models"));
    repo.import(
        &write_tiny(tmp.path(), "v1.gguf", &base),
        &options("tiny", "1.0.0"),
    )
    .unwrap();

    // New weights, same tokenizer: files change, nothing blocks.
    let reweighted = TinyLlama {
        seed: 1,
        ..base.clone()
    };
    repo.import(
        &write_tiny(tmp.path(), "v2.gguf", &reweighted),
        &options("tiny", "1.1.0"),
    )
    .unwrap();
    // Same weights, another EOS and one of five merges moved.
    let mut retokenized = base.clone();
    retokenized.eos_token_id = 0;
    let moved = retokenized.merges.remove(0);
    retokenized.merges.push(moved);
    repo.import(
        &write_tiny(tmp.path(), "v3.gguf", &retokenized),
        &options("tiny", "1.2.0"),
    )
    .unwrap();

    let v = |s: &str| repo.resolve(&s.parse::<ModelRef>().unwrap()).unwrap();
    let d = diff(&repo, &v("tiny@1.0.0"), &v("tiny@1.1.0"), 5.0, &NoProgress).unwrap();
    assert_eq!(d.files_added, ["v2.gguf"]);
    assert_eq!(d.files_removed, ["v1.gguf"]);
    assert!(d.tokenizer.as_ref().unwrap().is_unchanged());
    assert!(d.blocking.is_empty(), "{:?}", d.blocking);
    assert!(
        d.manifest_changes.iter().any(|c| c.key == "model.weights"),
        "{:?}",
        d.manifest_changes
    );

    let d = diff(&repo, &v("tiny@1.0.0"), &v("tiny@1.2.0"), 5.0, &NoProgress).unwrap();
    let t = d.tokenizer.as_ref().unwrap();
    assert_eq!(t.merges_reordered, 1);
    assert!((t.merges_changed_pct - 20.0).abs() < 1e-9);
    assert_eq!(
        t.special_changes.len(),
        2,
        "eos and pad (pad follows eos in the tiny model)"
    );
    assert!(
        d.blocking.iter().any(|r| r.contains("special token eos")),
        "{:?}",
        d.blocking
    );
    assert!(
        d.blocking.iter().any(|r| r.contains("20.00% of merges")),
        "{:?}",
        d.blocking
    );
    assert!(d
        .manifest_changes
        .iter()
        .any(|c| c.key == "tokenizer.special.eos.id" && c.after.as_deref() == Some("0")));

    // A tampered version is not compared: its recorded digests no longer describe its files.
    flip_byte(&v("tiny@1.1.0").dir.join("v2.gguf"), 4000);
    let err = diff(&repo, &v("tiny@1.0.0"), &v("tiny@1.1.0"), 5.0, &NoProgress).unwrap_err();
    assert!(matches!(err, RepoError::VerificationFailed { .. }), "{err}");
    assert!(
        err.to_string().contains("content changed: v2.gguf"),
        "{err}"
    );
}

#[test]
fn remove_deletes_the_version_and_the_empty_model_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let src = write_tiny(tmp.path(), "tiny.gguf", &TinyLlama::default());
    let repo = Repository::open(tmp.path().join("models"));
    let a = repo
        .import(&src, &options("tiny", "1.0.0"))
        .unwrap()
        .version;
    let b = repo
        .import(&src, &options("tiny", "1.1.0"))
        .unwrap()
        .version;
    // 1.0.0 is what users get: it goes only after another version is promoted.
    let err = repo.remove(&a).unwrap_err();
    assert!(
        err.to_string().contains("promote another version first"),
        "{err}"
    );
    assert!(a.dir.exists());
    repo.set_stable(&b, "test", "promote").unwrap();
    repo.remove(&a).unwrap();
    assert!(!a.dir.exists());
    assert_eq!(repo.models().unwrap(), ["tiny"]);
    // The last version goes with its alias, and the model's folder with them.
    repo.remove(&b).unwrap();
    assert!(!tmp.path().join("models/tiny").exists());
    assert!(repo.models().unwrap().is_empty());
}

/// A tiny Hugging Face llama checkpoint: config.json, model.safetensors, tokenizer files.
fn write_hf_llama(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":8,"num_hidden_layers":1,
            "intermediate_size":16,"num_attention_heads":2,"num_key_value_heads":1,"max_position_embeddings":64,
            "vocab_size":4,"rope_theta":10000.0,"rms_norm_eps":1e-6,"tie_word_embeddings":true,"_name_or_path":"tiny-hf"}"#,
    )
    .unwrap();
    let header = br#"{"model.embed_tokens.weight":{"dtype":"F32","shape":[4,8],"data_offsets":[0,128]},"model.norm.weight":{"dtype":"F32","shape":[8],"data_offsets":[128,160]}}"#;
    let mut st = (header.len() as u64).to_le_bytes().to_vec();
    st.extend_from_slice(header);
    st.extend_from_slice(&[0u8; 160]);
    std::fs::write(dir.join("model.safetensors"), st).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        r#"{"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":["a b"]},"added_tokens":[{"id":3,"content":"</s>","special":true}]}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token":"</s>","chat_template":"{{ x }}"}"#,
    )
    .unwrap();
    std::fs::write(dir.join(".gitattributes"), "*.safetensors filter=lfs").unwrap();
}

#[test]
fn imports_hugging_face_and_sentence_transformers_folders() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    write_hf_llama(&hf);
    let repo = Repository::open(tmp.path().join("models"));
    let m = repo
        .import(&hf, &options("tiny-hf", "1.0.0"))
        .unwrap()
        .manifest;
    assert_eq!(
        (m.model.kind, m.model.format),
        (Kind::Llm, Format::Safetensors)
    );
    assert_eq!(m.model.parameter_count, 40);
    assert_eq!(m.model.display_name.as_deref(), Some("tiny-hf"));
    let arch = m.architecture.unwrap();
    assert_eq!(
        (arch.head_count, arch.head_count_kv, arch.norm_eps),
        (Some(2), Some(1), Some(1e-6))
    );
    let tok = m.tokenizer.unwrap();
    assert_eq!(
        (tok.vocab_size, tok.merges, tok.special["eos"].id),
        (4, 1, 3)
    );
    let paths: Vec<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json"
        ],
        "hidden files are skipped"
    );
    assert_eq!(m.files[2].role, FileRole::Tokenizer);

    // The same weights as a sentence-transformers embedder.
    let st = tmp.path().join("st");
    write_hf_llama(&st);
    std::fs::write(
        st.join("config.json"),
        r#"{"architectures":["BertModel"],"model_type":"bert","hidden_size":8}"#,
    )
    .unwrap();
    std::fs::write(
        st.join("modules.json"),
        r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
            {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
            {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
    )
    .unwrap();
    std::fs::create_dir(st.join("1_Pooling")).unwrap();
    std::fs::write(
        st.join("1_Pooling/config.json"),
        r#"{"word_embedding_dimension":8,"pooling_mode_cls_token":false,"pooling_mode_mean_tokens":true}"#,
    )
    .unwrap();
    std::fs::write(
        st.join("sentence_bert_config.json"),
        r#"{"max_seq_length":128}"#,
    )
    .unwrap();
    let m = repo
        .import(&st, &options("tiny-st", "1.0.0"))
        .unwrap()
        .manifest;
    assert_eq!(m.model.kind, Kind::Embedding);
    let e = m.embedding.unwrap();
    assert_eq!(
        (
            e.dimension,
            e.pooling.as_deref(),
            e.normalize,
            e.max_seq_length
        ),
        (Some(8), Some("mean"), true, Some(128))
    );
}

#[test]
fn refuses_ambiguous_and_inconsistent_sources() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::open(tmp.path().join("models"));
    let two = tmp.path().join("two");
    std::fs::create_dir(&two).unwrap();
    write_tiny(&two, "a.gguf", &TinyLlama::default());
    write_tiny(&two, "b.gguf", &TinyLlama::default());
    let err = repo.import(&two, &options("x", "1.0.0")).unwrap_err();
    assert!(err.to_string().contains("several .gguf files"), "{err}");

    let sharded = tmp.path().join("sharded");
    write_hf_llama(&sharded);
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        r#"{"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = repo.import(&sharded, &options("x", "1.0.0")).unwrap_err();
    assert!(
        err.to_string()
            .contains("model-00001-of-00002.safetensors, which is missing"),
        "{err}"
    );

    let with_manifest = tmp.path().join("own");
    std::fs::create_dir(&with_manifest).unwrap();
    write_tiny(&with_manifest, "a.gguf", &TinyLlama::default());
    std::fs::write(with_manifest.join("DIGESTS"), "x").unwrap();
    let err = repo
        .import(&with_manifest, &options("x", "1.0.0"))
        .unwrap_err();
    assert!(
        err.to_string().contains("written by rampart itself"),
        "{err}"
    );

    let gguf = write_tiny(tmp.path(), "m.gguf", &TinyLlama::default());
    let mut opts = options("x", "1.0.0");
    opts.kind = Some(Kind::Onnx);
    let err = repo.import(&gguf, &opts).unwrap_err();
    assert!(
        err.to_string().contains("cannot be imported as kind onnx"),
        "{err}"
    );
    assert!(repo.models().unwrap().is_empty());
}

#[test]
fn rules_files_import_as_rules_models_and_bad_ones_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let repo = Repository::open(tmp.path().join("models"));
    let example =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/rules/support-tickets.toml");
    let loaded = repo.import(&example, &options("tickets", "1.0.0")).unwrap();
    let m = &loaded.manifest;
    assert_eq!((m.model.kind, m.model.format), (Kind::Rules, Format::Toml));
    assert_eq!(m.model.weights, ["support-tickets.toml"]);
    assert_eq!(m.model.parameter_count, 66, "60 keywords and 6 patterns");
    assert!(repo.verify(&loaded.version, &NoProgress).unwrap().ok());

    let bad = tmp.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[labels.a]\npatterns = [{ regex = \"(\", weight = 1.0 }]\n",
    )
    .unwrap();
    let err = repo.import(&bad, &options("bad", "1.0.0")).unwrap_err();
    assert!(err.to_string().contains("pattern \"(\""), "{err}");
    assert!(
        !tmp.path().join("models/bad").exists(),
        "nothing is written"
    );
    let mut as_llm = options("tickets", "2.0.0");
    as_llm.kind = Some(Kind::Llm);
    let err = repo.import(&example, &as_llm).unwrap_err();
    assert!(
        err.to_string().contains("cannot be imported as kind llm"),
        "{err}"
    );
}
