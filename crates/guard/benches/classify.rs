//! Rules-engine classifications per second on one core, on ticket-sized inputs (English and
//! Chinese, 60 to 400 bytes) with `examples/rules/support-tickets.toml`.
//!
//! `cargo bench -p rampart-guard --bench classify`

use std::time::Instant;

use guard::RulesEngine;

const TICKETS: [&str; 8] = [
    "Hello, my package was supposed to arrive last Tuesday but the tracking number shows nothing since it left the warehouse. Where is my order? I need it for a birthday this weekend.",
    "The blender arrived broken, the jar is cracked and the motor stopped working after two uses. Poor quality for the price.",
    "I was charged twice for order 55123 and I want my money back for the second payment as soon as possible, thanks.",
    "Could you send me an invoice with our company tax id for the purchase in March? The receipt in the box has no VAT number.",
    "The support agent on the phone was rude and no one answered my emails for a week. This is my third complaint.",
    "我的快递已经一个星期了还没收到，物流信息也不更新，请帮我查一下运单。",
    "收到的杯子破损了，质量太差，我要退货退款。",
    "请帮我开票，公司税号已经发给客服了，但是一直没人回复。",
];

fn main() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/rules/support-tickets.toml"
    );
    let text = std::fs::read_to_string(path).expect("the example rules file");
    let engine = RulesEngine::from_toml(&text).expect("the example rules compile");
    for t in TICKETS {
        let c = engine.classify(t);
        println!(
            "{:<10} {:.3}  {}",
            c.label.as_deref().unwrap_or("-"),
            c.confidence,
            c.reasons
                .iter()
                .map(|r| r.matched.as_str())
                .collect::<Vec<_>>()
                .join(" | ")
        );
    }
    let rounds = 50_000;
    let started = Instant::now();
    let mut labelled = 0usize;
    for _ in 0..rounds {
        for t in TICKETS {
            labelled += usize::from(std::hint::black_box(engine.classify(t)).matched);
        }
    }
    let n = rounds * TICKETS.len();
    let seconds = started.elapsed().as_secs_f64();
    let bytes: usize = TICKETS.iter().map(|t| t.len()).sum();
    println!(
        "{n} classifications in {seconds:.2} s: {:.0}/s on one core ({:.0} µs each, mean input {} bytes, {labelled} labelled)",
        n as f64 / seconds,
        seconds * 1e6 / n as f64,
        bytes / TICKETS.len()
    );
}
