//! The controller on synthetic traces: latency spikes, memory ramps, oscillating load.

use super::*;

fn ceilings() -> Limits {
    Limits {
        max_num_seqs: 32,
        max_num_batched_tokens: 512,
        max_prefill_tokens: 512,
        max_in_flight: 64,
        admit_prefills: true,
        first_token_gate_ms: 0,
    }
}

/// A deterministic jitter of ±2 % so percentiles see a spread.
fn jitter(value: f64, n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| value * (0.98 + 0.04 * ((i * 37 % 100) as f64 / 100.0)))
        .collect()
}

/// A plant whose inter-token latency grows with the prompt tokens each step carries.
fn itl_plant(limits: &Limits, demand: usize, base: f64) -> Observation {
    let prefill = demand.min(limits.max_prefill_tokens);
    Observation {
        itl_ms: jitter(base + 0.5 * prefill as f64, 100),
        running: 16,
        in_flight_peak: 16,
        prefill_held: demand > limits.max_prefill_tokens,
        ..Observation::default()
    }
}

fn itl_settings() -> Settings {
    let mut s = Settings::new(ceilings());
    s.itl_p99_ms = Some(150.0);
    s
}

#[test]
fn an_itl_spike_shrinks_the_prefill_budget_within_ten_windows_and_holds_there() {
    let mut c = Controller::new(itl_settings());
    let mut trace = Vec::new();
    for _ in 0..60 {
        let obs = itl_plant(&c.limits(), 512, 40.0);
        let itl = obs.itl_ms.iter().cloned().fold(0.0, f64::max);
        let d = c.observe(&obs);
        trace.push((itl, d.limits.max_prefill_tokens, d.changes.len()));
        for change in &d.changes {
            assert!(!change.detail.is_empty());
        }
    }
    // Converged: from window 10 on, latency is within the objective.
    for (w, (itl, _, _)) in trace.iter().enumerate().skip(10) {
        assert!(*itl <= 150.0 * 1.03, "window {w}: ITL {itl}");
    }
    // No oscillation beyond one growth step around the objective.
    let after: Vec<usize> = trace.iter().skip(10).map(|t| t.1).collect();
    let (lo, hi) = (after.iter().min().unwrap(), after.iter().max().unwrap());
    assert!(hi - lo <= 32, "prefill budget moved between {lo} and {hi}");
    // It did degrade, and says the level.
    assert!(c.limits().max_prefill_tokens < 512);
    assert_eq!(c.level(), 1);
    // The streams are not starved: the budget stays above the floor.
    assert!(c.limits().max_prefill_tokens >= 16);
}

/// The 28-page case's overshoot: every normal stream waiting for its first token behind two
/// documents, so a window or two without a single inter-token gap. Growing the budget then (no
/// p99 measured reads as healthy) made the steps the streams next decoded in stall them.
#[test]
fn under_traffic_windows_without_inter_token_gaps_do_not_grow_the_prefill_budget() {
    let mut c = Controller::new(itl_settings());
    for _ in 0..20 {
        let obs = itl_plant(&c.limits(), 512, 40.0);
        c.observe(&obs);
    }
    let trimmed = c.limits().max_prefill_tokens;
    assert!(trimmed < 512);
    // Held at the margin: the window's p99 below the share of the objective that cuts.
    let obs = itl_plant(&c.limits(), 512, 40.0);
    let p99 = p99_of(obs.itl_ms.clone(), 1).unwrap();
    assert!(p99 <= 150.0 * ITL_ACT_SHARE, "{p99}");
    for w in 0..10 {
        let obs = Observation {
            running: 16,
            waiting: 4,
            in_flight_peak: 20,
            prefill_held: true,
            ..Observation::default()
        };
        let d = c.observe(&obs);
        assert!(d.changes.is_empty(), "window {w}: {:?}", d.changes);
    }
    assert_eq!(c.limits().max_prefill_tokens, trimmed);
    // Idle, it grows back.
    for _ in 0..40 {
        c.observe(&Observation::default());
    }
    assert_eq!(c.limits().max_prefill_tokens, 512);
}

#[test]
fn the_prefill_budget_grows_back_when_the_spike_ends() {
    let mut c = Controller::new(itl_settings());
    for _ in 0..14 {
        let obs = itl_plant(&c.limits(), 512, 160.0);
        c.observe(&obs);
    }
    assert_eq!(
        c.limits().max_prefill_tokens,
        16,
        "at the floor during the spike"
    );
    // The spike is over: the same demand now costs little.
    let mut windows = 0;
    while c.limits().max_prefill_tokens < 512 {
        let mut obs = itl_plant(&c.limits(), 512, 10.0);
        obs.itl_ms = jitter(10.0 + 0.1 * c.limits().max_prefill_tokens as f64, 100);
        let d = c.observe(&obs);
        assert!(d.changes.iter().all(|ch| ch.cause == Cause::Recovery));
        windows += 1;
        assert!(windows < 50, "grows back additively (16 tokens a window)");
    }
    assert_eq!(c.level(), 0);
}

#[test]
fn with_the_prefill_budget_at_its_floor_slow_decode_steps_shrink_the_batch() {
    let mut c = Controller::new(itl_settings());
    for _ in 0..40 {
        let l = c.limits();
        // Decode alone costs 8 ms per running stream.
        let running = l.max_num_seqs.min(32);
        let obs = Observation {
            itl_ms: jitter(
                8.0 * running as f64 + 0.2 * l.max_prefill_tokens as f64,
                100,
            ),
            running,
            waiting: 10,
            in_flight_peak: 42,
            prefill_held: true,
            ..Observation::default()
        };
        c.observe(&obs);
    }
    let l = c.limits();
    assert_eq!(l.max_prefill_tokens, 16);
    assert!(8.0 * l.max_num_seqs as f64 + 3.2 <= 150.0 * 1.03, "{l:?}");
    assert!(l.max_num_seqs >= 14, "not more than needed: {l:?}");
}

/// Memory grows with running sequences and answers one window late.
#[test]
fn a_memory_ramp_halves_the_batch_and_settles_below_the_watermark() {
    let mut c = Controller::new(Settings::new(ceilings()));
    let mut running_before = 0usize;
    let mut trace = Vec::new();
    for w in 0..60 {
        // Demand rises from 8 to 40 sequences over 20 windows, then stays.
        let demand = (8 + w * 32 / 20).min(40);
        let running = demand.min(c.limits().max_num_seqs);
        let memory = 0.5 + 0.012 * running_before as f64;
        running_before = running;
        let d = c.observe(&Observation {
            memory_ratio: Some(memory),
            running,
            waiting: demand - running,
            in_flight_peak: demand,
            ..Observation::default()
        });
        assert!(memory < 0.95, "window {w}: memory reached {memory}");
        trace.push((memory, d.limits.max_num_seqs));
    }
    let settled: Vec<usize> = trace.iter().skip(40).map(|t| t.1).collect();
    let (lo, hi) = (settled.iter().min().unwrap(), settled.iter().max().unwrap());
    assert!(hi - lo <= 1, "settled between {lo} and {hi}: {trace:?}");
    assert!(*lo >= 15, "not collapsed to the floor: {trace:?}");
    for (memory, _) in trace.iter().skip(40) {
        assert!(*memory < 0.80, "{trace:?}");
    }
    assert_eq!(c.level(), 2);
}

#[test]
fn memory_held_by_free_kv_pages_goes_back_and_admission_recovers() {
    // Mapped KV pages stay mapped after their sequences end: the pool touched 450 blocks at a
    // peak, 200 are in use now. Without giving pages back, memory would stay at saturation
    // and nobody new would ever start.
    let mut c = Controller::new(Settings::new(ceilings()));
    let (mut resident, held) = (450usize, 200usize);
    let mut windows_saturated = 0;
    for w in 0..12 {
        let memory = 0.5 + 0.001 * resident as f64;
        let d = c.observe(&Observation {
            memory_ratio: Some(memory),
            running: 20,
            in_flight_peak: 20,
            kv_resident_blocks: resident,
            kv_held_blocks: held,
            ..Observation::default()
        });
        if let Some(release) = d
            .changes
            .iter()
            .find(|ch| ch.lever == Lever::KvResidentBlocks)
        {
            assert_eq!(w, 0, "released once, when memory was high");
            assert_eq!((release.from, release.to), (450, 200));
            assert_eq!(release.cause, Cause::MemorySaturated);
            // The engine gives the free pages back before the next window.
            resident = held;
        }
        windows_saturated += usize::from(!d.limits.admit_prefills);
    }
    assert_eq!(windows_saturated, 1, "{c:?}");
    assert!(c.limits().admit_prefills);
    // The release came first: the batch was not halved for memory the release gave back.
    assert_eq!(c.limits().max_num_seqs, ceilings().max_num_seqs);
    // A small gap is not worth a release.
    let d = c.observe(&Observation {
        memory_ratio: Some(0.85),
        kv_resident_blocks: held + MIN_RELEASE_BLOCKS - 1,
        kv_held_blocks: held,
        ..Observation::default()
    });
    assert!(d
        .changes
        .iter()
        .all(|ch| ch.lever != Lever::KvResidentBlocks));
}

/// After a load, idle, memory below the scaling watermark but above the recovery band (the
/// prefix cache's pages): the cache goes back, then the limits grow back to their ceilings.
#[test]
fn idle_memory_in_the_hysteresis_band_is_given_back_so_limits_recover() {
    let settings = itl_settings();
    let mut c = Controller::new(settings.clone());
    // Load cut the prefill budget (level 1).
    c.observe(&Observation {
        itl_ms: vec![900.0; 100],
        running: 8,
        in_flight_peak: 8,
        ..Observation::default()
    });
    assert!(c.level() > 0, "{c:?}");
    let mut resident = 800usize;
    let mut released = 0;
    for _ in 0..(settings.horizon_windows as usize + 40) {
        let memory = 0.45 + 0.0004 * resident as f64; // 0.77 with 800 blocks resident
        let d = c.observe(&Observation {
            memory_ratio: Some(memory),
            kv_resident_blocks: resident,
            kv_held_blocks: 0,
            ..Observation::default()
        });
        for ch in d
            .changes
            .iter()
            .filter(|ch| ch.lever == Lever::KvResidentBlocks)
        {
            assert_eq!(ch.cause, Cause::Recovery);
            assert!(ch.detail.starts_with("idle"), "{}", ch.detail);
            released += 1;
            resident = 0;
        }
    }
    assert_eq!(released, 1);
    assert_eq!(c.level(), 0, "{c:?}");
    // Idle at level 0, or below the band: nothing to do.
    let d = c.observe(&Observation {
        memory_ratio: Some(0.77),
        kv_resident_blocks: 800,
        ..Observation::default()
    });
    assert!(d.changes.is_empty(), "{:?}", d.changes);
}

#[test]
fn memory_pressure_from_psi_alone_counts_as_the_scaling_watermark() {
    let mut c = Controller::new(Settings::new(ceilings()));
    let d = c.observe(&Observation {
        memory_psi_some_avg10: Some(25.0),
        running: 32,
        ..Observation::default()
    });
    assert_eq!(d.limits.max_num_seqs, 16);
    assert_eq!(d.changes[0].cause, Cause::Memory);
}

#[test]
fn saturation_stops_new_prefills_and_admission_then_recovers() {
    let mut c = Controller::new(Settings::new(ceilings()));
    let d = c.observe(&Observation {
        kv_ratio: Some(0.97),
        running: 20,
        in_flight_peak: 24,
        ..Observation::default()
    });
    assert!(!d.limits.admit_prefills);
    assert_eq!(d.limits.max_in_flight, 24);
    assert_eq!(d.level, 3);
    assert!(d.changes.iter().all(|ch| ch.cause == Cause::KvSaturated));
    // Between the watermarks: still held.
    let d = c.observe(&Observation {
        kv_ratio: Some(0.85),
        running: 20,
        in_flight_peak: 24,
        ..Observation::default()
    });
    assert!(!d.limits.admit_prefills);
    // Below the scaling watermark: prefills start again, admission grows back.
    let d = c.observe(&Observation {
        kv_ratio: Some(0.5),
        running: 20,
        in_flight_peak: 24,
        shed: 3,
        ..Observation::default()
    });
    assert!(d.limits.admit_prefills);
    let mut windows = 0;
    while c.limits().max_in_flight < 64 {
        c.observe(&Observation {
            kv_ratio: Some(0.5),
            running: 20,
            in_flight_peak: c.limits().max_in_flight,
            shed: 3,
            ..Observation::default()
        });
        windows += 1;
        assert!(windows <= 40);
    }
    assert_eq!(c.level(), 0);
}

#[test]
fn memory_saturation_also_halves_the_batch() {
    let mut c = Controller::new(Settings::new(ceilings()));
    let d = c.observe(&Observation {
        memory_ratio: Some(0.96),
        running: 32,
        in_flight_peak: 40,
        ..Observation::default()
    });
    assert!(!d.limits.admit_prefills);
    assert_eq!(d.limits.max_num_seqs, 16);
    assert_eq!(d.limits.max_num_batched_tokens, 256);
    assert!(d
        .changes
        .iter()
        .all(|ch| ch.cause == Cause::MemorySaturated));
}

/// Three times the sustainable concurrency against a TTFT objective: TTFT grows with the
/// requests in flight (100 ms each).
#[test]
fn a_ttft_objective_sheds_the_excess_at_admission_and_holds() {
    let mut s = Settings::new(ceilings());
    s.ttft_p99_ms = Some(800.0);
    let mut c = Controller::new(s);
    let demand = 48usize;
    let mut trace = Vec::new();
    for _ in 0..60 {
        let limit = c.limits().max_in_flight;
        let in_flight = demand.min(limit);
        let d = c.observe(&Observation {
            ttft_ms: jitter(100.0 * in_flight as f64, 10),
            running: in_flight.min(32),
            waiting: in_flight.saturating_sub(32),
            in_flight_peak: in_flight,
            shed: (demand - in_flight) as u64 * 5,
            ..Observation::default()
        });
        trace.push((100.0 * in_flight as f64, d.limits.max_in_flight));
    }
    for (w, (ttft, _)) in trace.iter().enumerate().skip(10) {
        assert!(*ttft <= 800.0 * 1.03, "window {w}: {trace:?}");
    }
    let settled: Vec<usize> = trace.iter().skip(10).map(|t| t.1).collect();
    let (lo, hi) = (settled.iter().min().unwrap(), settled.iter().max().unwrap());
    assert!(hi - lo <= 1, "{trace:?}");
    // Not shedding more than needed: 8 in flight meet the objective exactly.
    assert!(*lo >= 6, "{trace:?}");
}

fn gate_settings() -> Settings {
    let mut s = Settings::new(Limits {
        first_token_gate_ms: 720,
        ..ceilings()
    });
    s.ttft_p99_ms = Some(800.0);
    s
}

/// First tokens under a gate whose prediction is `bias` times too optimistic, with `outside`
/// ms spent outside the engine's queue (HTTP, tokenization): p99 = outside + bias × gate.
fn gate_plant(limits: &Limits, bias: f64, outside: f64) -> Observation {
    Observation {
        ttft_ms: jitter(outside + bias * limits.first_token_gate_ms as f64, 10),
        running: 24,
        in_flight_peak: 30,
        gate_refused: 20,
        ..Observation::default()
    }
}

#[test]
fn a_first_token_gate_that_predicts_too_little_tightens_until_the_objective_holds() {
    let mut c = Controller::new(gate_settings());
    let mut trace = Vec::new();
    for _ in 0..40 {
        let obs = gate_plant(&c.limits(), 1.6, 150.0);
        let ttft = obs.ttft_ms.iter().cloned().fold(0.0, f64::max);
        let d = c.observe(&obs);
        trace.push((ttft, d.limits.first_token_gate_ms, d.limits.max_in_flight));
    }
    for (w, (ttft, _, in_flight)) in trace.iter().enumerate() {
        // The gate does the work; admission is never cut.
        assert_eq!(*in_flight, 64, "window {w}: {trace:?}");
        if w >= 10 {
            assert!(*ttft <= 800.0 * 1.03, "window {w}: {trace:?}");
        }
    }
    let settled: Vec<usize> = trace.iter().skip(10).map(|t| t.1).collect();
    let (lo, hi) = (settled.iter().min().unwrap(), settled.iter().max().unwrap());
    assert!(hi - lo <= 720 / GATE_GROWTH_DIVISOR, "{trace:?}");
    // Not tighter than needed: (800 - 150) / 1.6 = 406 ms meets it exactly.
    assert!(*lo >= 300, "{trace:?}");
    assert_eq!(c.level(), 1);
    // The prediction comes right (less traffic ahead): the gate grows back to its ceiling,
    // a step per 30 first tokens of prompts let in after the last step (three windows here).
    for _ in 0..40 {
        let obs = gate_plant(&c.limits(), 0.6, 100.0);
        c.observe(&obs);
    }
    assert_eq!(c.limits().first_token_gate_ms, 720);
    assert_eq!(c.level(), 0);
}

#[test]
fn the_gate_grows_back_only_on_enough_first_tokens() {
    let mut c = Controller::new(gate_settings());
    // Cut the gate once: first tokens at 1.2 s.
    let mut obs = gate_plant(&c.limits(), 0.0, 1200.0);
    c.observe(&obs);
    let cut = c.limits().first_token_gate_ms;
    assert!(cut < 720);
    // Then fast first tokens, but three a window: a "healthy" p99 on three, six, ... samples.
    let mut grown_at = None;
    for w in 1..=20 {
        obs = gate_plant(&c.limits(), 0.0, 300.0);
        obs.ttft_ms.truncate(3);
        c.observe(&obs);
        if grown_at.is_none() && c.limits().first_token_gate_ms > cut {
            grown_at = Some(w);
        }
    }
    // The tenth window brings the 30th sample of prompts let in after the cut.
    assert_eq!(grown_at, Some(10));
}

#[test]
fn a_gate_cut_that_does_not_help_is_undone_and_admission_is_left_alone() {
    let mut c = Controller::new(gate_settings());
    let mut gates = Vec::new();
    let mut undone = 0;
    for _ in 0..40 {
        // First tokens take 1 s whatever is refused: the prompts' own prefill.
        let mut obs = gate_plant(&c.limits(), 0.0, 1000.0);
        obs.ttft_ms = jitter(1000.0, 10);
        let d = c.observe(&obs);
        undone += d
            .changes
            .iter()
            .filter(|ch| ch.detail.contains("did not lower"))
            .count();
        gates.push(d.limits.first_token_gate_ms);
        assert_eq!(d.limits.max_in_flight, 64);
    }
    assert!(undone >= 1, "{gates:?}");
    // Cut once per hold at most: mostly at the ceiling, never below one cut.
    assert!(gates.iter().all(|g| *g >= 540), "{gates:?}");
    assert!(
        gates.iter().filter(|g| **g == 720).count() >= 30,
        "{gates:?}"
    );
}

#[test]
fn an_oscillating_load_does_not_make_the_limits_flap() {
    let mut c = Controller::new(itl_settings());
    let mut values = Vec::new();
    for w in 0..80 {
        // Heavy and light phases of three windows each.
        let demand = if (w / 3) % 2 == 0 { 512 } else { 48 };
        let obs = itl_plant(&c.limits(), demand, 40.0);
        let d = c.observe(&obs);
        if w >= 10 {
            values.push(d.limits.max_prefill_tokens);
            let itl = obs.itl_ms.iter().cloned().fold(0.0, f64::max);
            assert!(itl <= 150.0 * 1.03, "window {w}: ITL {itl}");
        }
    }
    let (lo, hi) = (values.iter().min().unwrap(), values.iter().max().unwrap());
    assert!(hi - lo <= 32, "between {lo} and {hi}");
}

#[test]
fn the_explicit_rule_drops_the_batch_to_its_size_and_lets_it_grow_back() {
    let mut s = Settings::new(Limits {
        max_num_seqs: 64,
        ..ceilings()
    });
    s.rule = Some(Rule {
        p99_latency_ms: 1200.0,
        batch_size: 32,
    });
    let mut c = Controller::new(s);
    let d = c.observe(&Observation {
        e2e_ms: jitter(1500.0, 10),
        running: 48,
        in_flight_peak: 48,
        ..Observation::default()
    });
    assert_eq!(d.limits.max_num_seqs, 32);
    assert_eq!(d.changes[0].cause, Cause::Rule);
    assert!(d.changes[0].detail.contains("1200"), "{}", d.changes[0]);
    // Still slow but at the rule's size: held, not pushed lower.
    let d = c.observe(&Observation {
        e2e_ms: jitter(1300.0, 10),
        running: 32,
        waiting: 16,
        in_flight_peak: 48,
        ..Observation::default()
    });
    assert_eq!(d.limits.max_num_seqs, 32);
    // Fast again: once the slow samples have left the horizon, grows back one sequence per
    // window.
    let mut seen = Vec::new();
    for _ in 0..14 {
        let d = c.observe(&Observation {
            e2e_ms: jitter(500.0, 10),
            running: 32,
            waiting: 16,
            in_flight_peak: 48,
            ..Observation::default()
        });
        seen.push(d.limits.max_num_seqs);
    }
    assert_eq!(seen[..9], [32; 9], "{seen:?}");
    assert_eq!(seen[9..], [33, 34, 35, 36, 37], "{seen:?}");
}

#[test]
fn too_few_samples_are_not_judged_and_an_idle_model_grows_back() {
    let mut s = itl_settings();
    s.ttft_p99_ms = Some(100.0);
    let mut c = Controller::new(s);
    let d = c.observe(&Observation {
        ttft_ms: vec![5000.0; 4],
        itl_ms: vec![900.0; 19],
        running: 4,
        in_flight_peak: 4,
        ..Observation::default()
    });
    assert!(d.changes.is_empty(), "{:?}", d.changes);
    assert_eq!(d.signals.ttft_p99_ms, None);
    // Force a degraded state, then idle windows grow it back.
    for _ in 0..3 {
        c.observe(&Observation {
            itl_ms: vec![900.0; 50],
            running: 4,
            in_flight_peak: 4,
            ..Observation::default()
        });
    }
    assert!(c.limits().max_prefill_tokens < 512);
    for _ in 0..30 {
        c.observe(&Observation::default());
    }
    assert_eq!(
        c.limits(),
        ceilings(),
        "idle windows older than the horizon grow back"
    );
}

#[test]
fn a_burst_that_ended_does_not_slam_admission_to_its_floor() {
    let mut s = Settings::new(ceilings());
    s.ttft_p99_ms = Some(800.0);
    let mut c = Controller::new(s);
    // A burst of 20 in flight, slow first tokens reported in the window after it ended.
    c.observe(&Observation {
        in_flight_peak: 20,
        running: 20,
        ..Observation::default()
    });
    let d = c.observe(&Observation {
        ttft_ms: vec![1200.0; 10],
        in_flight_peak: 0,
        ..Observation::default()
    });
    assert_eq!(d.limits.max_in_flight, 14, "{:?}", d.changes);
}

/// The prompts' own prefill takes longer than the objective whatever the load: cutting
/// admission below the knee helps nobody, so the cut that did not help is undone.
#[test]
fn an_objective_the_queue_cannot_explain_does_not_collapse_admission() {
    let mut s = Settings::new(ceilings());
    s.ttft_p99_ms = Some(800.0);
    let mut c = Controller::new(s);
    let demand = 48usize;
    let mut limits = Vec::new();
    for _ in 0..60 {
        let in_flight = demand.min(c.limits().max_in_flight);
        let ttft = (100.0 * in_flight as f64).max(1000.0);
        let d = c.observe(&Observation {
            ttft_ms: jitter(ttft, 10),
            running: in_flight,
            in_flight_peak: in_flight,
            shed: 10,
            ..Observation::default()
        });
        limits.push(d.limits.max_in_flight);
    }
    let settled = &limits[10..];
    let (lo, hi) = (settled.iter().min().unwrap(), settled.iter().max().unwrap());
    assert!(*lo >= 7 && *hi <= 10, "{limits:?}");
    assert!(hi - lo <= 1, "{limits:?}");
}

#[test]
fn first_tokens_of_requests_admitted_before_a_cut_do_not_judge_it() {
    let mut s = Settings::new(ceilings());
    s.ttft_p99_ms = Some(800.0);
    let mut c = Controller::new(s);
    let d = c.observe(&Observation {
        ttft_ms: jitter(4800.0, 10),
        in_flight_peak: 48,
        running: 32,
        ..Observation::default()
    });
    assert_eq!(d.limits.max_in_flight, 24);
    // The queue admitted before the cut drains: slow first tokens of old requests.
    for _ in 0..3 {
        let d = c.observe(&Observation {
            ttft_ms: jitter(5200.0, 10),
            ttft_arrived_windows_ago: vec![3; 10],
            in_flight_peak: 40,
            running: 32,
            shed: 20,
            ..Observation::default()
        });
        assert!(d.changes.is_empty(), "{:?}", d.changes);
        assert_eq!(d.signals.ttft_p99_ms, None);
    }
    // Requests admitted after the cut: faster, but not yet within the objective: cut further.
    let d = c.observe(&Observation {
        ttft_ms: jitter(2400.0, 10),
        in_flight_peak: 24,
        running: 24,
        shed: 20,
        ..Observation::default()
    });
    assert!(d.limits.max_in_flight < 24, "{:?}", d.changes);
}

#[test]
fn the_p99_of_a_window_is_the_sample_at_the_99th_percentile() {
    let mut q = VecDeque::new();
    for i in 1..=200 {
        q.push_back((1, i as f64));
    }
    assert_eq!(p99(&q, 0, 5), Some(198.0));
    assert_eq!(p99(&q, 1, 5), None);
}
