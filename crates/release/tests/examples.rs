//! The shipped example plans and golden sets (examples/releases/) read as the server reads them.

use std::path::Path;

#[test]
fn the_example_plans_and_golden_sets_parse() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/releases");
    let mut seen = 0;
    for model in std::fs::read_dir(&examples).unwrap().flatten() {
        let dir = model.path();
        let plan = release::plan::ReleasePlan::load(&dir.join("release.toml")).unwrap();
        let settings = release::gates::GateSettings::from_table(&plan.gates).unwrap();
        let golden = release::golden::GoldenSet::load_dir(&dir.join("golden")).unwrap();
        assert!(golden.len() >= 8, "{}", dir.display());
        // Image cases name files inside the golden folder.
        for case in golden.cases() {
            if let release::golden::CaseInput::Input(input) = &case.input {
                if let Some(image) = input["image"].as_str() {
                    let path = dir.join("golden").join(image);
                    assert!(path.is_file(), "{}: {}", case.id, path.display());
                }
            }
        }
        for class in settings.recall_floors.keys() {
            assert!(
                golden
                    .cases()
                    .iter()
                    .any(|c| c.class() == Some(class.as_str())),
                "the floor on {class} has cases"
            );
        }
        seen += 1;
    }
    assert!(seen >= 1);
}
