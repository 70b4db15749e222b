//! Tokenizer parity with llama.cpp on its own test vocabularies: `ggml-vocab-NAME.gguf`
//! (tokenizer metadata only) with the inputs `ggml-vocab-NAME.gguf.inp` (texts separated by
//! `\n__ggml_vocab_test__\n`) and llama.cpp's ids for them, `ggml-vocab-NAME.gguf.out` (one line
//! each), as its `test-tokenizer-0` reads them: no BOS, special-token texts as plain text.
//! Fetched by `scripts/fetch-models.sh vocabs`.
//!
//! Every vocabulary family the engine loads must give llama.cpp's ids for every input; the
//! families it does not support must be refused at load with an error that names what is
//! missing, never tokenized differently.

use std::collections::BTreeMap;
use std::path::Path;

use engine::tokenizer::Tokenizer;
use formats::gguf::Gguf;

/// The families the engine tokenizes like llama.cpp.
const SUPPORTED: &[&str] = &[
    "command-r",
    "falcon",
    "gpt-2",
    "llama-bpe",
    "llama-spm",
    "mpt",
    "phi-3",
    "qwen2",
    "refact",
    "starcoder",
];

/// The families it refuses, and a word the refusal must contain.
const REFUSED: &[(&str, &str)] = &[
    ("bert-bge", "tokenizer model \"bert\" is not supported"),
    (
        "deepseek-coder",
        "pre-tokenizer \"deepseek-coder\" is not supported",
    ),
    (
        "deepseek-llm",
        "pre-tokenizer \"deepseek-llm\" is not supported",
    ),
    ("gemma-4", "tokenizer model \"gemma4\" is not supported"),
    ("qwen35", "pre-tokenizer \"qwen35\" is not supported"),
];

/// The test cases of one vocabulary: text → llama.cpp's ids (a map, as llama.cpp keeps them:
/// a repeated text is one case).
fn cases(dir: &Path, name: &str) -> BTreeMap<String, Vec<u32>> {
    let base = dir.join(format!("ggml-vocab-{name}.gguf"));
    let raw = std::fs::read_to_string(base.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(base.with_extension("gguf.out")).unwrap();
    let inputs: Vec<&str> = raw.split("\n__ggml_vocab_test__\n").collect();
    // The file ends with one separator and a newline: the last piece is empty.
    let inputs = match inputs.split_last() {
        Some((last, rest)) if last.trim_end_matches('\n').is_empty() => rest.to_vec(),
        _ => inputs,
    };
    let outputs: Vec<&str> = out.lines().collect();
    assert_eq!(inputs.len(), outputs.len(), "{name}: inputs and outputs");
    inputs
        .iter()
        .zip(outputs)
        .map(|(text, ids)| {
            let ids = ids
                .split_whitespace()
                .map(|t| t.parse::<u32>().unwrap())
                .collect();
            (text.to_string(), ids)
        })
        .collect()
}

/// The fetched vocabularies' folder (`None`: not fetched, the test is skipped).
fn vocab_dir() -> Option<std::path::PathBuf> {
    testkit::cached_model("llama-vocabs/ggml-vocab-qwen2.gguf")
        .and_then(|p| p.parent().map(Path::to_path_buf))
}

fn load(dir: &Path, name: &str) -> Result<Tokenizer, String> {
    let bytes = std::fs::read(dir.join(format!("ggml-vocab-{name}.gguf"))).unwrap();
    let gguf = Gguf::parse(&bytes).map_err(|e| e.to_string())?;
    Tokenizer::from_gguf(&gguf).map_err(|e| e.to_string())
}

#[test]
fn every_supported_family_tokenizes_like_llama_cpp() {
    let Some(dir) = vocab_dir() else { return };
    let mut report = Vec::new();
    let mut failures = Vec::new();
    for name in SUPPORTED {
        let tokenizer = match load(&dir, name) {
            Ok(t) => t,
            Err(e) => {
                failures.push(format!("{name}: not loaded: {e}"));
                continue;
            }
        };
        let cases = cases(&dir, name);
        let mut wrong = 0;
        for (text, want) in &cases {
            // User-defined tokens (MPT's runs of spaces) are matched in plain text too, as
            // llama.cpp does; control tokens never are (no case here holds one's text).
            let got = tokenizer.encode_plain(text, false).unwrap();
            if &got != want {
                wrong += 1;
                if wrong <= 3 {
                    failures.push(format!("{name}: {text:?}: got {got:?}, llama.cpp {want:?}"));
                }
            }
        }
        report.push(format!("{name} {}/{}", cases.len() - wrong, cases.len()));
        if wrong > 3 {
            failures.push(format!("{name}: {wrong} of {} cases differ", cases.len()));
        }
    }
    eprintln!("cases equal to llama.cpp's: {}", report.join(", "));
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn unsupported_families_are_refused_clearly() {
    let Some(dir) = vocab_dir() else { return };
    for (name, word) in REFUSED {
        match load(&dir, name) {
            Ok(_) => panic!("{name} loaded; it should be refused"),
            Err(e) => {
                eprintln!("{name}: {e}");
                assert!(e.contains(word), "{name}: {e}")
            }
        }
    }
}
