//! The router's cost per request: `cargo bench -p rampart-release --bench route`.
//! Prints nanoseconds per `route` call for a canary at 20% over 10,000 distinct users.

use std::hint::black_box;
use std::time::Instant;

use release::plan::{Phase, ReleasePlan};
use release::router::{bucket, route, RoutingKey};

fn main() {
    let mut plan = ReleasePlan::new("v1");
    plan.candidate = Some("v2".to_string());
    plan.state.phase = Phase::Running;
    plan.state.weight = 0.2;
    plan.state.release_id = "v1→v2@1700000000000".to_string();
    let users: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();

    let rounds = 100;
    let start = Instant::now();
    let mut candidates = 0usize;
    for _ in 0..rounds {
        for u in &users {
            let key = RoutingKey {
                user: Some(u),
                request_id: "req",
                ..Default::default()
            };
            let r = route(black_box(&plan), black_box(&key));
            candidates += (r.variant == release::plan::Variant::Candidate) as usize;
        }
    }
    let calls = (rounds * users.len()) as f64;
    let per_route = start.elapsed().as_nanos() as f64 / calls;

    let start = Instant::now();
    let mut sum = 0.0;
    for _ in 0..rounds {
        for u in &users {
            sum += bucket(black_box("v1→v2@1700000000000"), black_box(u));
        }
    }
    let per_bucket = start.elapsed().as_nanos() as f64 / calls;
    println!(
        "route: {per_route:.0} ns per request ({:.1}% to the candidate); bucket: {per_bucket:.0} ns (checksum {sum:.1})",
        100.0 * candidates as f64 / calls
    );
}
