//! all-MiniLM-L6-v2 on our kernels against sentence-transformers' reference values (MODELS.md).

use engine::bert::cosine;
use engine::{EmbedOptions, Embedder};

fn minilm() -> Option<Embedder> {
    let dir = testkit::cached_model(testkit::models::MINILM_FOLDER)?;
    Some(Embedder::load(&dir).expect("load all-MiniLM-L6-v2"))
}

#[test]
fn matches_sentence_transformers() {
    let Some(embedder) = minilm() else { return };
    assert_eq!(embedder.dimensions(), 384);
    assert_eq!(embedder.max_seq_len(), 256);
    assert_eq!(
        embedder
            .tokenize("A man is eating food.")
            .expect("tokenize"),
        [101, 1037, 2158, 2003, 5983, 2833, 1012, 102]
    );
    let texts = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The new movie is awesome.",
        "The girl is carrying a baby.",
    ];
    let vectors = embedder.embed(&texts).expect("embed");
    let reference = [
        0.03324, 0.00441, -0.00628, 0.04838, -0.1387, -0.03362, 0.10113, -0.05438,
    ];
    for (i, (got, want)) in vectors[0].iter().zip(reference).enumerate() {
        assert!((got - want).abs() < 1e-3, "[{i}]: {got} vs {want}");
    }
    let norm = vectors[0].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((norm - 1.0).abs() < 1e-5, "normalized: {norm}");
    for (other, want) in [(1, 0.7553), (2, -0.0461), (3, -0.1050)] {
        let got = cosine(&vectors[0], &vectors[other]);
        eprintln!("cosine to {:?}: {got:.5} (reference {want})", texts[other]);
        assert!(
            (got - want).abs() < 1e-3,
            "{:?}: {got} vs {want}",
            texts[other]
        );
    }
}

#[test]
fn batched_equals_one_at_a_time_and_long_inputs_are_an_error() {
    let Some(embedder) = minilm() else { return };
    let long = "The quick brown fox jumps over the lazy dog near the river bank. ".repeat(10);
    let texts = ["Hi", long.as_str(), "A man is eating food.", "Short one."];
    let together = embedder.embed(&texts).expect("embed");
    for (text, batched) in texts.iter().zip(&together) {
        let alone = embedder.embed(&[text]).expect("embed");
        let worst = alone[0]
            .iter()
            .zip(batched)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{text:.20}: {worst}");
    }
    let too_long = "word ".repeat(300);
    let err = embedder
        .embed(&[too_long.as_str()])
        .expect_err("over 256 tokens");
    assert!(
        err.to_string()
            .contains("302 tokens, more than the model's limit of 256"),
        "{err}"
    );
    let ids = vec![embedder.tokenize(&too_long).expect("tokenize")];
    let truncated = embedder
        .embed_ids(
            &ids,
            EmbedOptions {
                truncate: true,
                dimensions: Some(64),
            },
        )
        .expect("truncate");
    assert_eq!(truncated[0].len(), 64);
}
