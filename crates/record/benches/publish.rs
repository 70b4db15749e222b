//! What publishing a record costs the request that publishes it: a lane whose sink keeps up, a
//! lane whose sink is stuck (records dropped and counted), and a bus with no sinks.
//!
//! `cargo bench -p rampart-record --bench publish`

use std::time::{Duration, Instant};

use record::testing::{sample_envelope, CollectingSink, Gate, GatedSink};
use record::{Bus, Delivery, Sink};

const N: usize = 200_000;

fn measure(name: &str, sinks: Vec<Box<dyn Sink>>, runtime: &tokio::runtime::Runtime) {
    let bus = runtime.block_on(async { Bus::start(sinks).expect("runtime") });
    let envelopes: Vec<_> = (0..N).map(sample_envelope).collect();
    let started = Instant::now();
    for e in envelopes {
        let _ = bus.publish(e);
    }
    let elapsed = started.elapsed();
    let dropped: u64 = bus.counters().iter().map(|c| c.dropped_total()).sum();
    println!(
        "{name:<32} {:>8.0} ns/publish  ({N} records, {dropped} dropped)",
        elapsed.as_nanos() as f64 / N as f64
    );
    runtime.block_on(bus.shutdown(Duration::from_millis(500)));
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    measure("no sinks", Vec::new(), &runtime);
    let fast = || CollectingSink::new("fast", Delivery::Lossy { capacity: 8192 }).0;
    measure(
        "one lossy sink keeping up",
        vec![Box::new(fast())],
        &runtime,
    );
    let gate = Gate::closed();
    let stuck = GatedSink::new(
        CollectingSink::new("stuck", Delivery::Lossy { capacity: 8192 }).0,
        &gate,
    );
    measure("one lossy sink stuck", vec![Box::new(stuck)], &runtime);
    let stuck = GatedSink::new(
        CollectingSink::new("stuck", Delivery::Lossy { capacity: 8192 }).0,
        &gate,
    );
    measure(
        "a keeping-up and a stuck sink",
        vec![Box::new(fast()), Box::new(stuck)],
        &runtime,
    );
    gate.open();
}
