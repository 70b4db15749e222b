//! The seed rules on the labelled sets (examples/guard): the rules were tuned on `dev.jsonl`;
//! `test.jsonl` was written apart from them and is only measured. These floors catch a rule
//! change that loses recall or raises false alarms; docs/guard.md has the full numbers (with
//! the classifier tier, `rampart guard eval`).

use guard::{Channel, Guard, Input, Policy, Verdict};

fn rates(file: &str) -> (f64, f64) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/guard/");
    let text = std::fs::read_to_string(format!("{path}{file}")).unwrap();
    let guard = Guard::seed();
    let policy = Policy::default();
    let (mut attacks, mut caught, mut benign, mut alarms) = (0, 0, 0, 0);
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let row: serde_json::Value = serde_json::from_str(line).unwrap();
        let channel = Channel::parse(row["channel"].as_str().unwrap_or("user")).unwrap();
        let text = row["text"].as_str().unwrap();
        let d = guard.check(&[Input { channel, text }], &policy, &|_| Vec::new());
        let hit = d.verdict == Verdict::Block;
        if row["label"] == 1 {
            attacks += 1;
            caught += usize::from(hit);
        } else {
            benign += 1;
            alarms += usize::from(hit);
        }
    }
    (
        caught as f64 / attacks as f64,
        alarms as f64 / benign as f64,
    )
}

#[test]
fn seed_rules_hold_their_measured_rates() {
    let (tpr, fpr) = rates("dev.jsonl");
    assert!(
        tpr >= 0.90 && fpr <= 0.05,
        "dev: TPR {tpr:.3}, FPR {fpr:.3}"
    );
    let (tpr, fpr) = rates("test.jsonl");
    assert!(
        tpr >= 0.55 && fpr <= 0.05,
        "held-out test: TPR {tpr:.3}, FPR {fpr:.3}"
    );
}
