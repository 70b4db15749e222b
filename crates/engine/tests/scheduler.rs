//! The scheduler, block pool, prefix cache and KV tier under random workloads.
//!
//! A fake model stands in for the network: each token's key row records its position and token,
//! each value row a running hash of the whole sequence up to it (computed from the previous
//! position's value as read back through the block table), and the "logits" pick the next token
//! from that hash. Every forward pass also re-reads every visible position of every row and
//! checks the chain. So any block handed to the wrong sequence, shared when it should not be,
//! lost in a preemption or restored wrong from the tier, changes the output or fails the check,
//! and each sequence's expected output is known in advance.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use engine::block_pool::BlockPool;
use engine::kv_store::{KvLayout, KvStore};
use engine::kv_tier::{KvTier, TierConfig};
use engine::model::Batch;
use engine::sampler::Sampler;
use engine::scheduler::{
    Executor, Forwarded, LatencySamples, NewSequence, Scheduler, SchedulerConfig, SchedulerHandles,
    SchedulerLimits, SchedulerSnapshot,
};
use engine::tokenizer::Tokenizer;
use engine::{
    ConstraintError, EngineError, Event, FinishReason, KvDType, SamplingParams, TokenConstraint,
    TokenMask,
};
use proptest::prelude::*;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

const VOCAB: usize = 259 + 5;
const MODULUS: u32 = 8_388_593;

fn chain(prev: u32, token: u32) -> u32 {
    ((prev as u64 * 31 + token as u64 + 7) % MODULUS as u64) as u32
}

fn next_token(hash: u32) -> u32 {
    3 + hash % (VOCAB as u32 - 3)
}

/// What the fake model generates after `prompt`.
fn expected(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut h = 0;
    for &t in prompt {
        h = chain(h, t);
    }
    let mut out = Vec::new();
    for _ in 0..max_tokens {
        let t = next_token(h);
        out.push(t);
        h = chain(h, t);
    }
    out
}

struct ChainModel {
    logits: Vec<f32>,
    checked_rows: usize,
}

impl ChainModel {
    fn read(store: &KvStore, table: &[u32], pos: usize) -> (f32, f32, f32) {
        let bt = store.layout().block_tokens;
        let (mut k, mut v) = (vec![0f32; 8], vec![0f32; 8]);
        store.read(0, table[pos / bt], pos % bt, &mut k, &mut v);
        (k[0], k[1], v[0])
    }
}

impl Executor for ChainModel {
    fn forward(
        &mut self,
        batch: &Batch,
        store: &mut KvStore,
    ) -> Result<Forwarded<'_>, EngineError> {
        let bt = store.layout().block_tokens;
        for i in 0..batch.len() {
            let (pos, token) = (batch.positions[i], batch.tokens[i]);
            let table = batch.table(batch.row_seq[i]);
            let mut h = 0u32;
            for p in 0..pos {
                let (kp, kt, v) = Self::read(store, table, p);
                assert_eq!(kp as usize, p, "slot of position {p} holds position {kp}");
                h = chain(h, kt as u32);
                assert_eq!(v as u32, h, "value chain broken at position {p} of {pos}");
            }
            h = chain(h, token);
            let mut k = vec![0f32; 8];
            let mut v = vec![0f32; 8];
            k[0] = pos as f32;
            k[1] = token as f32;
            v[0] = h as f32;
            store.write(0, table[pos / bt], pos % bt, &k, &v);
            self.checked_rows += 1;
        }
        self.logits.clear();
        for &row in &batch.logit_rows {
            let (pos, seq) = (batch.positions[row], batch.row_seq[row]);
            let (_, _, h) = Self::read(store, batch.table(seq), pos);
            let target = next_token(h as u32) as usize;
            self.logits
                .extend((0..VOCAB).map(|j| if j == target { 10.0 } else { 0.0 }));
        }
        Ok(Forwarded {
            logits: &mut self.logits,
            attention: &[],
        })
    }
}

fn tokenizer() -> Arc<Tokenizer> {
    let bytes = formats::tiny::TinyLlama::default().to_gguf().unwrap();
    let gguf = formats::gguf::Gguf::parse(&bytes).unwrap();
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
    assert_eq!(tokenizer.vocab_size(), VOCAB);
    Arc::new(tokenizer)
}

struct Harness {
    scheduler: Scheduler,
    model: ChainModel,
    queued: Arc<AtomicUsize>,
    snapshot: Arc<Mutex<SchedulerSnapshot>>,
    limits: Arc<SchedulerLimits>,
    latency: Arc<Mutex<LatencySamples>>,
    requests: Vec<Request>,
}

struct Request {
    prompt: Vec<u32>,
    max_tokens: usize,
    events: Option<UnboundedReceiver<Event>>,
    cancel: Arc<AtomicBool>,
    got: Vec<u32>,
    finished: Option<FinishReason>,
    cancelled: bool,
}

#[derive(Debug, Clone, Copy)]
struct Setup {
    blocks: usize,
    block_tokens: usize,
    prefix_caching: bool,
    tier_host_blocks: usize,
    tier_disk_blocks: usize,
    max_num_seqs: usize,
    budget: usize,
}

impl Harness {
    fn new(setup: Setup) -> Self {
        let layout = KvLayout {
            layers: 1,
            kv_heads: 1,
            head_dim: 8,
            block_tokens: setup.block_tokens,
            dtype: KvDType::F32,
        };
        let tier_config = TierConfig {
            host_bytes: setup.tier_host_blocks * layout.block_bytes(),
            disk_bytes: setup.tier_disk_blocks * layout.block_bytes(),
            disk_dir: None,
        };
        let tier = tier_config
            .enabled()
            .then(|| KvTier::new(&tier_config, layout.block_bytes()).unwrap());
        let handles = SchedulerHandles::new(setup.max_num_seqs, setup.budget);
        let (queued, snapshot, limits, latency) = (
            Arc::clone(&handles.queued),
            Arc::clone(&handles.snapshot),
            Arc::clone(&handles.limits),
            Arc::clone(&handles.latency),
        );
        let scheduler = Scheduler::new(
            SchedulerConfig {
                watermark: 0.01,
                context: 10_000,
                speculation: Default::default(),
            },
            handles,
            tokenizer(),
            BlockPool::new(setup.blocks, setup.block_tokens, setup.prefix_caching),
            KvStore::new(layout, setup.blocks),
            tier,
        );
        Self {
            scheduler,
            model: ChainModel {
                logits: Vec::new(),
                checked_rows: 0,
            },
            queued,
            snapshot,
            limits,
            latency,
            requests: Vec::new(),
        }
    }

    fn submit(&mut self, prompt: Vec<u32>, max_tokens: usize) {
        let (events, receiver) = unbounded_channel();
        let cancel = Arc::new(AtomicBool::new(false));
        self.queued.fetch_add(1, Ordering::Relaxed);
        self.scheduler.add(NewSequence {
            reveal: Vec::new(),
            sampler: Sampler::new(SamplingParams::greedy(), &prompt),
            constraint: None,
            tokens: prompt.clone(),
            max_tokens,
            ignore_eos: true,
            stop: Vec::new(),
            events,
            cancel: Arc::clone(&cancel),
            arrived: Instant::now(),
            predicted_read_ms: None,
            attention: None,
        });
        self.requests.push(Request {
            prompt,
            max_tokens,
            events: Some(receiver),
            cancel,
            got: Vec::new(),
            finished: None,
            cancelled: false,
        });
    }

    fn cancel(&mut self, which: usize, drop_stream: bool) {
        let Some(r) = self.requests.get_mut(which) else {
            return;
        };
        if r.finished.is_some() {
            return;
        }
        r.cancelled = true;
        r.cancel.store(true, Ordering::Relaxed);
        if drop_stream {
            r.events = None;
        }
    }

    fn step(&mut self) {
        self.scheduler.step(&mut self.model);
        self.drain_events();
        self.check();
    }

    fn drain_events(&mut self) {
        for r in &mut self.requests {
            let Some(events) = r.events.as_mut() else {
                continue;
            };
            while let Ok(event) = events.try_recv() {
                match event {
                    Event::Token(t) => r.got.push(t.id),
                    Event::Finished(f) => {
                        assert_eq!(f.completion_tokens, r.got.len());
                        assert_eq!(f.prompt_tokens, r.prompt.len());
                        r.finished = Some(f.reason);
                    }
                    Event::Failed(e) => panic!("failed: {e}"),
                    Event::Shed(_) => panic!("shed"),
                }
            }
        }
    }

    /// The pool's invariants against the live block tables.
    fn check(&self) {
        let pool = self.scheduler.pool();
        pool.check().unwrap();
        let mut refs = vec![0u32; pool.total()];
        for table in self.scheduler.running_tables() {
            let mut seen = std::collections::HashSet::new();
            for &b in table {
                assert!(seen.insert(b), "block {b} twice in one table");
                refs[b as usize] += 1;
            }
        }
        for (b, &count) in refs.iter().enumerate() {
            assert_eq!(
                pool.refcount(b as u32),
                count,
                "block {b}: refcount vs tables that list it"
            );
            if count > 1 {
                assert!(
                    pool.hash_of(b as u32).is_some(),
                    "block {b} shared by {count} tables but not a cached prefix"
                );
            }
        }
        let s = self.snapshot.lock().unwrap().clone();
        assert_eq!(
            s.blocks_used + s.blocks_free + s.blocks_cached,
            s.blocks_total
        );
        assert!(s.kv_slots_used <= s.kv_slots_allocated);
    }

    /// Steps until request `i` has its first token; returns how many.
    fn steps_to_first_token(&mut self, i: usize) -> usize {
        let mut steps = 0;
        while self.requests[i].got.is_empty() {
            self.step();
            steps += 1;
            assert!(steps <= 10_000, "request {i} never got a token");
        }
        steps
    }

    fn run_to_end(&mut self) {
        let mut steps = 0;
        while self.scheduler.has_work() {
            self.step();
            steps += 1;
            assert!(steps < 100_000, "no progress");
        }
        assert_eq!(self.scheduler.pool().held(), 0, "blocks leaked");
        assert_eq!(self.queued.load(Ordering::Relaxed), 0, "queue slots leaked");
        for r in &self.requests {
            if r.cancelled {
                continue;
            }
            assert_eq!(r.finished, Some(FinishReason::Length));
            assert_eq!(
                r.got,
                expected(&r.prompt, r.max_tokens),
                "prompt {:?}",
                r.prompt
            );
        }
    }
}

/// Prompts drawn from a few shared prefixes so the prefix cache has something to find.
fn prompt_strategy() -> impl Strategy<Value = (usize, Vec<u32>, usize)> {
    (
        0..4usize,
        prop::collection::vec(3u32..200, 0..12),
        1..14usize,
    )
}

fn prefix(kind: usize) -> Vec<u32> {
    match kind {
        0 => Vec::new(),
        1 => (10..23).collect(),
        2 => (10..31).collect(),
        _ => vec![7; 9],
    }
}

#[derive(Debug, Clone)]
enum Op {
    Submit((usize, Vec<u32>, usize)),
    Step,
    Cancel(usize, bool),
    Limits(usize, usize, usize),
    Admit(bool),
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => prompt_strategy().prop_map(Op::Submit),
        6 => Just(Op::Step),
        1 => (0..40usize, any::<bool>()).prop_map(|(i, d)| Op::Cancel(i, d)),
        1 => (1..6usize, 1..40usize, 1..40usize).prop_map(|(s, b, p)| Op::Limits(s, b, p)),
        1 => any::<bool>().prop_map(Op::Admit),
    ]
}

fn setup_strategy() -> impl Strategy<Value = Setup> {
    (
        12..40usize,
        prop_oneof![Just(1usize), Just(4), Just(5), Just(16)],
        any::<bool>(),
        prop_oneof![
            Just((0usize, 0usize)),
            Just((4, 0)),
            Just((0, 6)),
            Just((3, 5))
        ],
        1..6usize,
        1..40usize,
    )
        .prop_map(
            |(blocks, block_tokens, prefix_caching, tier, seqs, budget)| {
                // The pool holds at least one longest sequence (prompt ≤ 43, output ≤ 13).
                let blocks = blocks.max(56usize.div_ceil(block_tokens));
                Setup {
                    blocks,
                    block_tokens,
                    prefix_caching,
                    tier_host_blocks: tier.0,
                    tier_disk_blocks: tier.1,
                    max_num_seqs: seqs,
                    budget,
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    #[test]
    fn random_workloads_keep_the_pool_consistent_and_outputs_exact(
        setup in setup_strategy(),
        ops in prop::collection::vec(op_strategy(), 1..80),
    ) {
        let mut h = Harness::new(setup);
        for op in ops {
            match op {
                Op::Submit((kind, suffix, max_tokens)) => {
                    let mut prompt = prefix(kind);
                    prompt.extend(suffix);
                    if prompt.is_empty() {
                        prompt.push(5);
                    }
                    h.submit(prompt, max_tokens);
                }
                Op::Step => h.step(),
                Op::Cancel(i, drop_stream) => h.cancel(i, drop_stream),
                Op::Limits(seqs, budget, prefill) => {
                    h.limits.set_max_num_seqs(seqs);
                    h.limits.set_max_num_batched_tokens(budget);
                    h.limits.set_max_prefill_tokens(prefill);
                }
                Op::Admit(admit) => h.limits.set_admit_prefills(admit),
            }
        }
        h.limits.set_admit_prefills(true);
        h.run_to_end();
    }
}

fn busy_setup(blocks: usize, tier: (usize, usize), prefix_caching: bool) -> Setup {
    Setup {
        blocks,
        block_tokens: 4,
        prefix_caching,
        tier_host_blocks: tier.0,
        tier_disk_blocks: tier.1,
        max_num_seqs: 8,
        budget: 64,
    }
}

fn busy_workload(h: &mut Harness) {
    for i in 0..8u32 {
        let prompt: Vec<u32> = (0..10).map(|j| 3 + (i * 17 + j) % 200).collect();
        h.submit(prompt, 30);
    }
    h.run_to_end();
}

#[test]
fn preemption_recomputes_without_a_tier() {
    // 8 sequences of 40 positions need 80 blocks of 4; 24 force preemptions.
    let mut h = Harness::new(busy_setup(24, (0, 0), false));
    busy_workload(&mut h);
    let s = h.snapshot.lock().unwrap().clone();
    assert!(s.preemptions > 0, "{s:?}");
    assert_eq!(s.tier.stored, 0);
}

#[test]
fn preemption_swaps_to_host_memory_and_disk_and_back() {
    let mut h = Harness::new(busy_setup(24, (6, 200), false));
    busy_workload(&mut h);
    let s = h.snapshot.lock().unwrap().clone();
    assert!(s.preemptions > 0, "{s:?}");
    assert!(s.tier.stored > 0 && s.tier.restored > 0, "{:?}", s.tier);
    assert!(
        s.tier.spilled > 0,
        "the small host tier spills to disk: {:?}",
        s.tier
    );
    // Swapped blocks came back instead of being recomputed: fewer rows ran than without a tier.
    let mut recompute = Harness::new(busy_setup(24, (0, 0), false));
    busy_workload(&mut recompute);
    assert!(
        h.model.checked_rows < recompute.model.checked_rows,
        "swap {} rows vs recompute {} rows",
        h.model.checked_rows,
        recompute.model.checked_rows
    );
}

#[test]
fn a_shared_prefix_is_computed_once() {
    let mut h = Harness::new(Setup {
        blocks: 64,
        block_tokens: 4,
        prefix_caching: true,
        tier_host_blocks: 0,
        tier_disk_blocks: 0,
        max_num_seqs: 8,
        budget: 256,
    });
    let shared: Vec<u32> = (3..43).collect();
    let mut first = shared.clone();
    first.push(100);
    h.submit(first, 3);
    h.run_to_end();
    let rows_first = h.model.checked_rows;
    let mut second = shared.clone();
    second.extend([101, 102]);
    h.submit(second, 3);
    h.run_to_end();
    // 40 shared tokens = 10 full blocks reused: only 2 prompt tokens + 2 decode steps ran.
    assert_eq!(h.model.checked_rows - rows_first, 2 + 2);
    let s = h.snapshot.lock().unwrap().clone();
    assert_eq!(s.prefix.hits, 10);
    assert_eq!(s.prefix_cached_tokens, 40);
}

#[test]
fn evicted_prefix_blocks_come_back_from_the_tier() {
    let mut h = Harness::new(Setup {
        blocks: 14,
        block_tokens: 4,
        prefix_caching: true,
        tier_host_blocks: 2,
        tier_disk_blocks: 30,
        max_num_seqs: 4,
        budget: 256,
    });
    let shared: Vec<u32> = (3..43).collect();
    let mut first = shared.clone();
    first.push(100);
    h.submit(first, 2);
    h.run_to_end();
    // Another long sequence evicts the cached prefix blocks into the tier.
    h.submit((100..140).collect(), 10);
    h.run_to_end();
    let before = h.snapshot.lock().unwrap().clone();
    assert!(before.tier.stored >= 9, "{:?}", before.tier);
    let rows = h.model.checked_rows;
    let mut again = shared.clone();
    again.push(101);
    h.submit(again, 2);
    h.run_to_end();
    let after = h.snapshot.lock().unwrap().clone();
    assert!(after.tier.restored >= 9, "{:?}", after.tier);
    assert_eq!(
        h.model.checked_rows - rows,
        1 + 1,
        "only the new token and one decode ran"
    );
}

#[test]
fn cancelled_sequences_free_their_blocks_at_the_next_step() {
    let mut h = Harness::new(busy_setup(80, (0, 0), false));
    for i in 0..4u32 {
        h.submit(vec![3 + i; 20], 50);
    }
    for _ in 0..5 {
        h.step();
    }
    let used = h.snapshot.lock().unwrap().blocks_used;
    assert!(used > 0);
    h.cancel(0, true);
    h.cancel(1, false);
    h.step();
    let s = h.snapshot.lock().unwrap().clone();
    assert_eq!(s.running, 2);
    assert!(s.blocks_used < used, "{} → {}", used, s.blocks_used);
    h.run_to_end();
}

#[test]
fn long_prompts_are_chunked_and_do_not_stall_decoding() {
    let mut h = Harness::new(Setup {
        blocks: 200,
        block_tokens: 16,
        prefix_caching: false,
        tier_host_blocks: 0,
        tier_disk_blocks: 0,
        max_num_seqs: 8,
        budget: 32,
    });
    h.submit(vec![5; 4], 100);
    for _ in 0..3 {
        h.step();
    }
    let before = h.requests[0].got.len();
    h.submit((3..300).collect(), 4);
    // The 297-token prompt takes ~10 steps of 31 tokens; the first sequence decodes every step.
    for _ in 0..10 {
        h.step();
        let s = h.snapshot.lock().unwrap().clone();
        assert!(s.last_step_tokens <= 32);
    }
    assert_eq!(h.requests[0].got.len(), before + 10);
    h.run_to_end();
}

/// A pool with room for everything, blocks of 16 tokens, no prefix cache and no tier.
fn roomy(blocks: usize, max_num_seqs: usize, budget: usize) -> Setup {
    Setup {
        blocks,
        block_tokens: 16,
        prefix_caching: false,
        tier_host_blocks: 0,
        tier_disk_blocks: 0,
        max_num_seqs,
        budget,
    }
}

#[test]
fn decode_tokens_come_first_and_prompts_share_the_prefill_budget() {
    let mut h = Harness::new(roomy(400, 16, 512));
    // Eight streams decoding.
    for i in 0..8 {
        h.submit(vec![5 + i; 4], 200);
    }
    for _ in 0..3 {
        h.step();
    }
    h.limits.set_max_prefill_tokens(24);
    // Two long prompts arrive: every step carries the eight decode tokens and at most 24
    // prompt tokens, so the streams keep their pace and the prompts still progress.
    h.submit((3..300).collect(), 4);
    h.submit((3..250).rev().collect(), 4);
    let before: Vec<usize> = h.requests.iter().take(8).map(|r| r.got.len()).collect();
    let mut held = 0;
    for _ in 0..10 {
        h.step();
        let s = h.snapshot.lock().unwrap().clone();
        assert!(s.last_step_tokens <= 8 + 24, "{}", s.last_step_tokens);
        assert_eq!(s.max_prefill_tokens, 24);
        held = s.prefill_held_steps;
    }
    for (i, r) in h.requests.iter().take(8).enumerate() {
        assert_eq!(r.got.len(), before[i] + 10, "stream {i} skipped a step");
    }
    assert!(held >= 10, "the budget held prompts back: {held}");
    h.run_to_end();
}

#[test]
fn a_short_prompt_is_not_held_behind_a_long_document_being_read() {
    let mut h = Harness::new(roomy(400, 8, 64));
    h.limits.set_max_prefill_tokens(32);
    h.submit((3..600).collect(), 2);
    for _ in 0..3 {
        h.step();
    }
    h.submit(vec![9; 20], 2);
    let steps = h.steps_to_first_token(1);
    // The short prompt's tag (96 prompt tokens read + 20) is before the document's (597): it
    // takes the budget and has its first token after one step, while the document still has
    // hundreds of tokens to read.
    assert_eq!(steps, 1);
    assert!(h.requests[0].got.is_empty());
    h.run_to_end();
}

#[test]
fn with_a_ttft_objective_a_long_prompt_is_not_overtaken_by_later_short_ones() {
    let mut h = Harness::new(roomy(400, 8, 64));
    h.limits.set_max_prefill_tokens(32);
    // The reading rate is measured on steps that read a whole budget.
    h.submit((3..100).collect(), 1);
    h.run_to_end();
    assert!(h.limits.prefill_rate() > 0.0);
    // An objective the fake model reads any of these prompts within: arrival order.
    h.limits.set_ttft_objective_ms(60_000);
    h.submit((3..200).rev().collect(), 2);
    h.step();
    h.submit(vec![9; 20], 2);
    h.step();
    // In the fair order the short prompt's tag (32 read + 20) is before the long one's (197)
    // and it would have its first token now; by arrival it waits.
    assert!(h.requests[2].got.is_empty());
    // The long prompt's 197 tokens, 32 a step: its first token after 7 steps (2 before this
    // loop); the short one's in the same step (the budget's rest) or the next.
    assert_eq!(h.steps_to_first_token(1), 5);
    assert!(h.steps_to_first_token(2) <= 1);
    h.run_to_end();
}

/// The prefill budget counts depth-0 tokens: a token at depth d costs 1 + d / D (here D = 100
/// positions, fixed; the engine fits it to its steps). A document's chunks shrink as it gets
/// deeper, so a step carrying one costs what a step carrying a short prompt's chunk does; the
/// first in line still gets a token when one costs more than the whole budget.
#[test]
fn the_prefill_budget_prices_a_prompt_token_by_its_depth() {
    let mut h = Harness::new(roomy(400, 8, 64));
    h.scheduler
        .set_step_cost(engine::step_cost::StepCost::fixed(100.0));
    h.limits.set_max_prefill_tokens(32);
    h.submit((3..600).collect(), 2);
    let mut read = Vec::new();
    while h.requests[0].got.is_empty() {
        h.step();
        read.push(h.snapshot.lock().unwrap().last_step_tokens);
    }
    // 27 tokens from depth 0 cost 27 + ceil(378 / 100) = 31; 28 would cost 33.
    assert_eq!(read[0], 27, "{read:?}");
    // Deeper, fewer: at depth 500 and beyond a chunk is at most 5 tokens (5 + 26 = 31).
    let mut depth = 0;
    for &n in &read {
        if depth >= 500 {
            assert!(
                (1..=5).contains(&n),
                "at depth {depth}: {n} tokens; {read:?}"
            );
        }
        depth += n;
    }
    assert!(read.windows(2).all(|w| w[1] <= w[0]), "{read:?}");
    // A budget below one deep token's cost still reads one token a step.
    h.limits.set_max_prefill_tokens(1);
    h.submit((3..300).rev().collect(), 2);
    for _ in 0..3 {
        h.step();
    }
    let s = h.snapshot.lock().unwrap().clone();
    // The second prompt's first step read one token; the first one decodes.
    assert!(s.last_step_tokens <= 2, "{s:?}");
    h.run_to_end();
}

#[test]
fn a_burst_of_equal_prompts_is_read_first_come_first_served() {
    let mut h = Harness::new(roomy(400, 16, 64));
    h.limits.set_max_prefill_tokens(32);
    // Eight 64-token prompts at once: two steps of budget each. Shared evenly, every one would
    // get its first token after 16 steps; in order, the first after 2 and the last after 16.
    for i in 0..8 {
        h.submit(vec![3 + i; 64], 2);
    }
    let mut first = vec![0; 8];
    for step in 1..=16 {
        h.step();
        for (i, r) in h.requests.iter().enumerate() {
            if first[i] == 0 && !r.got.is_empty() {
                first[i] = step;
            }
        }
    }
    assert_eq!(first, vec![2, 4, 6, 8, 10, 12, 14, 16]);
    h.run_to_end();
}

#[test]
fn a_document_is_not_starved_by_a_stream_of_short_prompts() {
    let mut h = Harness::new(roomy(400, 64, 64));
    h.limits.set_max_prefill_tokens(32);
    h.submit((3..515).collect(), 1);
    // A new 16-token prompt every step, as many tokens as half the budget: alone they would
    // leave the document half of each step, but their tags come before its (512) only until
    // 496 prompt tokens were read after it arrived. Then the document takes the whole budget.
    let mut steps = 0;
    while h.requests[0].got.is_empty() {
        h.submit(vec![5 + (steps % 7) as u32; 16], 1);
        h.step();
        steps += 1;
        assert!(steps <= 40, "the document waited {steps} steps");
    }
    // 512 of its own tokens and about as many of the others', 32 a step.
    assert!(steps >= 16, "{steps}");
    h.run_to_end();
}

#[test]
fn free_blocks_are_reused_last_freed_first_and_their_pages_given_back() {
    // One request after the other: each takes the blocks the previous one freed, so the mapped
    // blocks follow the peak use (8 blocks), not the pool (400).
    let mut h = Harness::new(roomy(400, 8, 256));
    for i in 0..20 {
        h.submit((3 + i..3 + i + 120).collect(), 8);
        h.run_to_end();
    }
    let s = h.snapshot.lock().unwrap().clone();
    assert!(
        s.blocks_resident <= 16,
        "{} blocks mapped",
        s.blocks_resident
    );
    // With the prefix cache, freed prompts stay cached and the cache grows into the free
    // blocks: what a release gives back first.
    let mut setup = roomy(400, 8, 256);
    setup.prefix_caching = true;
    let mut h = Harness::new(setup);
    for i in 0..20 {
        h.submit((3 + i..3 + i + 120).collect(), 8);
        h.run_to_end();
    }
    let s = h.snapshot.lock().unwrap().clone();
    assert!(s.blocks_cached > 100, "{}", s.blocks_cached);
    let released = h.scheduler.release_memory();
    let s = h.snapshot.lock().unwrap().clone();
    assert!(released > 0);
    assert_eq!(s.kv_released_bytes, released as u64);
    assert_eq!(
        (s.blocks_resident, s.blocks_cached, s.kv_releases),
        (0, 0, 1)
    );
    // The pages read as zeros now; new requests write them again and come out exact.
    for i in 0..3 {
        h.submit((50 + i..50 + i + 100).collect(), 12);
    }
    h.run_to_end();
}

#[test]
fn before_any_whole_budget_step_a_step_that_read_half_a_budget_gives_the_rate() {
    let mut h = Harness::new(roomy(400, 8, 64));
    h.limits.set_max_prefill_tokens(32);
    // 15 tokens read alone: less than half the budget, nothing measured.
    h.submit(vec![9; 15], 1);
    h.step();
    assert_eq!(h.limits.prefill_rate(), 0.0);
    h.run_to_end();
    // 20 tokens read alone (the whole queue, not the budget): a first measure.
    h.submit((3..23).collect(), 1);
    h.step();
    let first = h.limits.prefill_rate();
    assert!(first > 0.0);
    h.run_to_end();
    // Once measured, only steps that read a whole budget move it.
    h.submit((30..50).collect(), 1);
    h.step();
    assert_eq!(h.limits.prefill_rate(), first);
    h.run_to_end();
}

#[test]
fn the_backlog_and_the_reading_rate_follow_the_steps() {
    let mut h = Harness::new(roomy(400, 8, 64));
    // A prompt shorter than the budget: read in one step, which says nothing of how fast a
    // longer queue would be read.
    h.submit(vec![9; 20], 1);
    h.step();
    assert_eq!(h.limits.prefill_rate(), 0.0);
    h.run_to_end();
    h.limits.set_max_prefill_tokens(32);
    h.submit((3..203).collect(), 2);
    h.submit(vec![7; 100], 2);
    h.step();
    // 32 of 300 prompt tokens read.
    assert_eq!(h.limits.prefill_backlog(), 268);
    assert!(h.limits.prefill_rate() > 0.0);
    // A prompt admitted while a step runs is on its way through the engine's inbox when the
    // step ends and recounts the backlog: it stays counted, then and once it is queued.
    h.limits.admit_prompt(50, None).unwrap();
    assert_eq!(h.limits.prefill_backlog(), 318);
    h.step();
    assert_eq!(h.limits.prefill_backlog(), 286);
    h.submit(vec![8; 50], 2);
    assert_eq!(h.limits.prefill_backlog(), 286);
    h.step();
    assert_eq!(h.limits.prefill_backlog(), 254);
    // Admitted and then failed before it was handed over: out of the backlog.
    h.limits.admit_prompt(40, None).unwrap();
    h.limits.withdraw_prompt(40);
    assert_eq!(h.limits.prefill_backlog(), 254);
    h.run_to_end();
    assert_eq!(h.limits.prefill_backlog(), 0);
}

#[test]
fn at_saturation_nobody_new_starts_and_running_streams_go_on() {
    let mut h = Harness::new(roomy(200, 8, 64));
    h.submit(vec![5; 4], 30);
    h.step();
    h.limits.set_admit_prefills(false);
    h.submit(vec![6; 4], 5);
    for _ in 0..5 {
        h.step();
    }
    let s = h.snapshot.lock().unwrap().clone();
    assert_eq!((s.running, s.waiting), (1, 1));
    assert!(!s.admit_prefills);
    assert!(h.requests[1].got.is_empty());
    assert_eq!(h.requests[0].got.len(), 6);
    h.limits.set_admit_prefills(true);
    h.run_to_end();
}

#[test]
fn latency_samples_hold_each_first_token_and_every_gap() {
    let mut h = Harness::new(roomy(200, 8, 64));
    let latency = Arc::clone(&h.latency);
    h.submit(vec![5; 4], 10);
    h.submit(vec![6; 4], 5);
    h.run_to_end();
    let samples = latency.lock().unwrap().drain();
    assert_eq!(samples.ttft_ms.len(), 2);
    assert_eq!(samples.ttft_arrived.len(), 2);
    assert_eq!(samples.itl_ms.len(), 9 + 4);
    assert_eq!(samples.e2e_ms.len(), 2);
    assert!(samples.itl_ms.iter().all(|&g| g >= 0.0));
    assert!(latency.lock().unwrap().drain().itl_ms.is_empty());
}

/// Allows only multiples of `step`; complete after `length` tokens; fails at token `fail_at`.
struct Multiples {
    step: u32,
    length: usize,
    fail_at: Option<usize>,
    committed: Arc<Mutex<Vec<u32>>>,
    mask_threads: Arc<Mutex<Vec<std::thread::ThreadId>>>,
}

impl TokenConstraint for Multiples {
    fn compute_mask(&mut self, mask: &mut TokenMask) -> Result<(), ConstraintError> {
        self.mask_threads
            .lock()
            .unwrap()
            .push(std::thread::current().id());
        if self.fail_at == Some(self.committed.lock().unwrap().len()) {
            return Err(ConstraintError::Refused("no way on".into()));
        }
        mask.clear();
        for t in (0..VOCAB as u32).filter(|t| t % self.step == 0) {
            mask.allow(t);
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), ConstraintError> {
        if !token.is_multiple_of(self.step) {
            return Err(ConstraintError::Refused(
                format!("token {token} was not allowed").into(),
            ));
        }
        self.committed.lock().unwrap().push(token);
        Ok(())
    }

    fn is_complete(&self) -> bool {
        self.committed.lock().unwrap().len() >= self.length
    }
}

#[test]
fn constraints_mask_every_sampled_token_off_the_engine_thread() {
    let mut h = Harness::new(Setup {
        blocks: 64,
        block_tokens: 4,
        prefix_caching: true,
        tier_host_blocks: 0,
        tier_disk_blocks: 0,
        max_num_seqs: 8,
        budget: 16,
    });
    let mut runs = Vec::new();
    for (k, (step, fail_at)) in [(3, None), (7, Some(2)), (5, None)].into_iter().enumerate() {
        let committed = Arc::new(Mutex::new(Vec::new()));
        let mask_threads = Arc::new(Mutex::new(Vec::new()));
        let constraint = Multiples {
            step,
            length: 6,
            fail_at,
            committed: Arc::clone(&committed),
            mask_threads: Arc::clone(&mask_threads),
        };
        let (events, receiver) = unbounded_channel();
        h.queued.fetch_add(1, Ordering::Relaxed);
        let prompt: Vec<u32> = (0..9).map(|i| 3 + (i * 11 + k as u32) % 200).collect();
        h.scheduler.add(NewSequence {
            reveal: Vec::new(),
            sampler: Sampler::new(SamplingParams::greedy(), &prompt),
            constraint: Some(Box::new(constraint)),
            tokens: prompt,
            max_tokens: 20,
            ignore_eos: true,
            stop: Vec::new(),
            events,
            cancel: Arc::new(AtomicBool::new(false)),
            arrived: Instant::now(),
            predicted_read_ms: None,
            attention: None,
        });
        runs.push((step, fail_at, committed, mask_threads, receiver));
    }
    // An unconstrained neighbour runs as if alone.
    h.submit(vec![5, 6, 7, 8, 9], 8);
    for _ in 0..200 {
        if !h.scheduler.has_work() {
            break;
        }
        h.step();
    }
    assert_eq!(h.requests[0].got, expected(&[5, 6, 7, 8, 9], 8));
    let engine_thread = std::thread::current().id();
    for (step, fail_at, committed, mask_threads, mut receiver) in runs {
        let (mut got, mut end) = (Vec::new(), None);
        while let Ok(event) = receiver.try_recv() {
            match event {
                Event::Token(t) => got.push(t.id),
                Event::Finished(f) => end = Some(Ok(f.reason)),
                Event::Failed(e) => end = Some(Err(e)),
                Event::Shed(_) => end = Some(Err("shed".to_string())),
            }
        }
        assert!(
            got.iter().all(|t| t % step == 0),
            "{got:?} (multiples of {step})"
        );
        assert_eq!(*committed.lock().unwrap(), got);
        let threads = mask_threads.lock().unwrap();
        assert!(threads.iter().all(|&t| t != engine_thread));
        match fail_at {
            None => {
                assert_eq!(got.len(), 6);
                assert_eq!(end, Some(Ok(FinishReason::Stop)));
                assert_eq!(threads.len(), 6);
            }
            Some(n) => {
                assert_eq!(got.len(), n);
                let e = end.unwrap().unwrap_err();
                assert!(e.contains("no way on"), "{e}");
            }
        }
    }
    let snap = h.snapshot.lock().unwrap().clone();
    assert_eq!(snap.blocks_used, 0, "every block came back");
}
