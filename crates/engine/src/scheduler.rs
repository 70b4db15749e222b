//! Continuous batching: the waiting and running queues of one model, and the step that turns them
//! into one forward pass.
//!
//! Every step builds a batch under a token budget (`max_num_batched_tokens`) and a sequence cap
//! (`max_num_seqs`). Running sequences come first, oldest first: one decode token each, or the
//! next chunk of a prompt still being read (chunked prefill), so a long prompt never stalls the
//! others for more than its chunk. Decode tokens are counted first: prompt chunks share what is
//! left, up to the prefill budget (`max_prefill_tokens`), which the degradation controller
//! shrinks when streams slow down (a step's time grows with its tokens, and every stream waits
//! for the step). The prefill budget goes to prompts (being read, or waiting to start) in a
//! weighted-fair-queueing order: by the moment each prompt would be read if it had the engine
//! alone, on a clock of prompt tokens read. So prompts of one length are served first come
//! first served (a burst's first arrivals get their first token first, instead of everybody
//! waiting for the whole burst), a short prompt goes ahead of a long document that arrived
//! shortly before it, and the document is never starved. Under a time-to-first-token objective,
//! prompts short enough to be read within it go in arrival order instead (earliest deadline
//! first: the fair order lets later short prompts push the long ones past the objective), and
//! longer ones keep their fair place. Waiting sequences start in that order
//! while the budgets, the cap and the pool (keeping a watermark of free blocks for the running
//! ones) allow, and while new prefills are admitted at all (not at saturation).
//!
//! KV blocks are taken as sequences grow, never reserved for `max_tokens` up front. When a
//! running sequence needs a block and none is left, the newest running sequence is preempted:
//! its blocks move to the second tier when one is configured (and come back when it resumes),
//! otherwise they are released and its tokens recomputed later (the prefix cache often still
//! holds them). Preempted sequences rejoin the waiting queue in arrival order, so nobody starves.
//!
//! Full blocks are registered in the prefix cache as they fill; an admitted sequence first takes
//! the longest cached prefix of its tokens (from the pool, or back from the tier).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::block_pool::{block_hash, BlockHash, BlockId, BlockPool, PrefixStats, ROOT_HASH};
use crate::constraint::{ConstraintError, TokenConstraint, TokenMask};
use crate::error::EngineError;
use crate::explain::AttentionRequest;
use crate::generate::{Event, FinishReason, Finished, Shed, StopMatcher, TokenEvent};
use crate::kv_store::KvStore;
use crate::kv_tier::{KvTier, TierStats};
use crate::model::Batch;
use crate::reservations::{Booked, Claim, Gate, Ledger, ReservationStats, Verdict};
use crate::sampler::{Sampler, TokenChoice};
use crate::speculation::{propose, Acceptance, Speculation};
use crate::step_cost::StepCost;
use crate::tokenizer::{Detokenizer, Tokenizer};
use kernels::paged::{Attended, NOT_CAPTURED};

/// The limits a step works under; adjustable while running (the degradation controller's
/// levers).
#[derive(Debug)]
pub struct SchedulerLimits {
    max_num_seqs: AtomicUsize,
    max_num_batched_tokens: AtomicUsize,
    max_prefill_tokens: AtomicUsize,
    admit_prefills: AtomicBool,
    /// The first-token gate: most predicted wait (ms) for a new prompt to be read; 0 = off.
    max_prefill_wait_ms: AtomicU64,
    /// Prompt tokens still to read by the scheduler's sequences (waiting and running),
    /// refreshed every step and raised as each new sequence joins in between.
    prefill_backlog: AtomicUsize,
    /// Prompt tokens of prompts admitted but not yet taken in by the scheduler (on their way
    /// through the engine's inbox, which it reads between steps): without them, a prompt
    /// submitted during a step would be missing from the backlog from that step's end until
    /// the next one's, and the gate would let in whoever came meanwhile as if nothing were
    /// ahead.
    inbox_tokens: AtomicUsize,
    /// Prompt tokens read per second by steps that read their whole prefill budget (a moving
    /// average over such steps: what the engine can read, not what a short queue asked of it),
    /// as f64 bits; 0 before the first.
    prefill_rate: AtomicU64,
    /// Prompt tokens the latest of those steps read: the rate is scaled down when the budget
    /// has since shrunk below it (the degradation controller's cut takes effect at once).
    prefill_rate_read: AtomicUsize,
    /// Prompts the gate refused so far.
    gate_refusals: AtomicU64,
    /// The prefill budget as configured: below it (trimmed for the streams' pace) prompt
    /// tokens are priced by their depth.
    prefill_ceiling: AtomicUsize,
    /// While new prefills are stopped: how long (ms) a sequence that never started may wait
    /// before it is refused ([`Event::Shed`]); 0 = it waits for the saturation to end.
    saturation_wait_ms: AtomicU64,
    /// Sequences refused that way so far.
    saturation_refusals: AtomicU64,
    /// How much later first tokens came than predicted at submission (ms): the latest
    /// [`MARGIN_SAMPLES`] of them.
    first_token_misses: Mutex<VecDeque<f32>>,
    /// Their 99th percentile (f64 bits; 0 until [`MIN_MARGIN_SAMPLES`] were seen): the gate
    /// adds it to every prediction.
    first_token_margin: AtomicU64,
    /// The model's time-to-first-token objective (ms; 0: none): prompts that can be read
    /// within it are read in arrival order (see [`SchedulerLimits::ttft_objective_ms`]).
    ttft_objective_ms: AtomicU64,
    /// The gate's bookings and weighted fair order ([`crate::reservations`]).
    ledger: Mutex<Ledger>,
}

/// Bookings an engine keeps by default.
pub const DEFAULT_RESERVATIONS: usize = 1_024;

/// First tokens the gate's margin is measured on.
pub const MARGIN_SAMPLES: usize = 256;
/// First tokens seen before the margin applies.
pub const MIN_MARGIN_SAMPLES: usize = 20;

/// Why the first-token gate refused a prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateRefusal {
    /// Predicted time to read the prompts ahead and this one.
    pub predicted_ms: f64,
    /// The measured margin added to it (see [`SchedulerLimits::first_token_margin_ms`]).
    pub margin_ms: f64,
    pub max_wait_ms: u64,
    pub backlog_tokens: usize,
    pub tokens_per_second: f64,
    /// Before the reading rate is measured (the engine just started, nothing to predict
    /// from): the most prompt tokens let in ahead of a step that measures it, two prefill
    /// budgets; the prediction's fields are 0 then.
    pub unmeasured_limit_tokens: Option<usize>,
    /// The prompt's booking, when it named itself ([`Claim`]) and the ledger had room.
    pub booked: Option<Booked>,
}

impl SchedulerLimits {
    /// Limits with no separate prefill budget (a step's prompt tokens are bounded by
    /// `max_num_batched_tokens` alone) and new prefills admitted.
    pub fn new(max_num_seqs: usize, max_num_batched_tokens: usize) -> Self {
        Self {
            max_num_seqs: AtomicUsize::new(max_num_seqs.max(1)),
            max_num_batched_tokens: AtomicUsize::new(max_num_batched_tokens.max(1)),
            max_prefill_tokens: AtomicUsize::new(max_num_batched_tokens.max(1)),
            admit_prefills: AtomicBool::new(true),
            max_prefill_wait_ms: AtomicU64::new(0),
            prefill_backlog: AtomicUsize::new(0),
            inbox_tokens: AtomicUsize::new(0),
            prefill_rate: AtomicU64::new(0),
            prefill_rate_read: AtomicUsize::new(0),
            gate_refusals: AtomicU64::new(0),
            prefill_ceiling: AtomicUsize::new(max_num_batched_tokens.max(1)),
            saturation_wait_ms: AtomicU64::new(0),
            saturation_refusals: AtomicU64::new(0),
            first_token_misses: Mutex::new(VecDeque::with_capacity(MARGIN_SAMPLES)),
            first_token_margin: AtomicU64::new(0),
            ttft_objective_ms: AtomicU64::new(0),
            ledger: Mutex::new(Ledger::new(DEFAULT_RESERVATIONS)),
        }
    }

    /// The most bookings the gate keeps (0: none are made; the fair order still holds).
    pub fn set_max_reservations(&self, value: usize) {
        self.ledger().set_capacity(value);
    }

    /// The gate's bookings and counters now.
    pub fn reservations(&self) -> ReservationStats {
        self.ledger().stats(Instant::now())
    }

    /// How long a new prompt of `tokens` would be predicted to wait to be read now: the
    /// backlog, every booking and its own over the measured rate, plus the margin (ms; none
    /// before the rate is measured). The autoscaler's signal: it grows with the demand the
    /// gate turned away, where TTFT of what was let in does not.
    pub fn predicted_wait_ms(&self, tokens: usize) -> Option<f64> {
        let rate = self.prefill_rate();
        (rate > 0.0).then(|| {
            let booked = self.reservations().tokens;
            (self.prefill_backlog() + booked + tokens) as f64 / rate * 1e3
                + self.first_token_margin_ms()
        })
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The time-to-first-token objective the prefill order serves (ms; 0: none). With one,
    /// a prompt that the engine can read within it (its length over the measured reading
    /// rate) takes the budget in arrival order, earliest deadline first: among prompts under
    /// one objective that order keeps the latest first token earliest, where the fair order
    /// lets every shorter prompt that arrives while a long one waits go first and pushes the
    /// long ones (the tail of the p99) past it. A prompt too long to be read within the
    /// objective keeps its fair-queueing place (arrival plus length), so a document still
    /// goes after the prompts that arrive while it is read and is never starved.
    pub fn ttft_objective_ms(&self) -> u64 {
        self.ttft_objective_ms.load(Ordering::Relaxed)
    }

    pub fn set_ttft_objective_ms(&self, value: u64) {
        self.ttft_objective_ms.store(value, Ordering::Relaxed);
    }

    /// The most prompt tokens read within the objective at the measured rate (none without
    /// an objective or before the rate is measured): shorter prompts go in arrival order.
    fn deadline_tokens(&self) -> Option<u64> {
        let objective = self.ttft_objective_ms();
        let rate = self.prefill_rate();
        (objective > 0 && rate > 0.0).then(|| (rate * objective as f64 / 1e3) as u64)
    }

    /// The first-token gate (0: off): a new prompt whose predicted wait to be read, the
    /// prompt tokens ahead of it plus its own over the measured reading rate, is above this
    /// many milliseconds is refused at submission, before it queues into a late first token.
    pub fn max_prefill_wait_ms(&self) -> u64 {
        self.max_prefill_wait_ms.load(Ordering::Relaxed)
    }

    pub fn set_max_prefill_wait_ms(&self, value: u64) {
        self.max_prefill_wait_ms.store(value, Ordering::Relaxed);
    }

    /// Prompt tokens still to read: the scheduler's sequences' and those of prompts admitted
    /// on their way to it.
    pub fn prefill_backlog(&self) -> usize {
        self.prefill_backlog.load(Ordering::Relaxed) + self.inbox_tokens.load(Ordering::Relaxed)
    }

    /// A prompt admitted by [`Self::admit_prompt`] that will not reach the scheduler after
    /// all (its request failed before it was handed over): its tokens leave the backlog.
    pub fn withdraw_prompt(&self, tokens: usize) {
        let _ = self
            .inbox_tokens
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| {
                Some(t.saturating_sub(tokens))
            });
    }

    /// Prompt tokens a step may read: the prefill budget within the batch's token budget.
    fn prefill_budget(&self) -> usize {
        self.max_prefill_tokens().min(self.max_num_batched_tokens())
    }

    /// Prompt tokens the engine reads per second beside its running streams under today's
    /// prefill budget (0 before the first step that read a whole budget, or at least half of
    /// one).
    pub fn prefill_rate(&self) -> f64 {
        let rate = f64::from_bits(self.prefill_rate.load(Ordering::Relaxed));
        let measured_at = self.prefill_rate_read.load(Ordering::Relaxed);
        let budget = self.prefill_budget();
        if measured_at > budget && budget > 0 {
            // Fewer prompt tokens per step now than when it was measured: at most that much
            // slower (steps get shorter too, so this errs on the side of refusing).
            rate * budget as f64 / measured_at as f64
        } else {
            rate
        }
    }

    /// Prompts the gate has refused since the engine started.
    pub fn gate_refusals(&self) -> u64 {
        self.gate_refusals.load(Ordering::Relaxed)
    }

    /// While new prefills are stopped (saturation), how long (ms) a sequence that never
    /// started may wait, counted from its arrival or from the saturation's onset, whichever
    /// is later, before it is refused with a retry hint; 0 = it waits for the saturation to
    /// end (and may meet its caller's first-token timeout instead).
    pub fn saturation_wait_ms(&self) -> u64 {
        self.saturation_wait_ms.load(Ordering::Relaxed)
    }

    pub fn set_saturation_wait_ms(&self, value: u64) {
        self.saturation_wait_ms.store(value, Ordering::Relaxed);
    }

    /// Sequences refused after waiting [`Self::saturation_wait_ms`] at saturation.
    pub fn saturation_refusals(&self) -> u64 {
        self.saturation_refusals.load(Ordering::Relaxed)
    }

    /// The gate's margin (ms): the 99th percentile of how much later than predicted the
    /// latest [`MARGIN_SAMPLES`] first tokens came (0 before [`MIN_MARGIN_SAMPLES`]). The
    /// prediction counts prompt tokens; it misses the step in progress when a prompt arrives,
    /// a last chunk read beside other prompts, prompts that overtake in the fair order, and
    /// the rate's own error. Measured, not modelled: the gate adds it to every prediction.
    pub fn first_token_margin_ms(&self) -> f64 {
        f64::from_bits(self.first_token_margin.load(Ordering::Relaxed))
    }

    /// A first token came `ttft_ms` after its prompt arrived, against `predicted_ms` at
    /// submission.
    pub fn record_first_token(&self, predicted_ms: f32, ttft_ms: f32) {
        let mut misses = self
            .first_token_misses
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if misses.len() == MARGIN_SAMPLES {
            misses.pop_front();
        }
        misses.push_back(ttft_ms - predicted_ms);
        if misses.len() >= MIN_MARGIN_SAMPLES {
            let mut values: Vec<f32> = misses.iter().copied().collect();
            let rank = ((values.len() as f64) * 0.99).ceil() as usize;
            let nth = rank.clamp(1, values.len()) - 1;
            let (_, p99, _) = values.select_nth_unstable_by(nth, f32::total_cmp);
            let margin = f64::from(*p99).max(0.0);
            self.first_token_margin
                .store(margin.to_bits(), Ordering::Relaxed);
        }
    }

    /// Checks a new prompt of `tokens` against the gate and, when it passes, counts it in
    /// the backlog. With the gate on, returns the predicted time to read it (the prompt tokens
    /// ahead and its own over the measured rate; none before the rate is measured), so that
    /// the first token can tell how far off it was; with the gate off nothing is learned.
    ///
    /// With nothing ahead a prompt always passes: refusing it would not make it faster, and
    /// it would be refused again on every retry.
    pub fn admit_prompt(
        &self,
        tokens: usize,
        claim: Option<&Claim>,
    ) -> Result<Option<f32>, GateRefusal> {
        let max_wait_ms = self.max_prefill_wait_ms();
        let rate = self.prefill_rate();
        let backlog = self.prefill_backlog();
        let predicted_ms =
            (max_wait_ms > 0 && rate > 0.0).then(|| (backlog + tokens) as f64 / rate * 1e3);
        if max_wait_ms > 0 && rate <= 0.0 && backlog > 0 {
            // Nothing measured yet: a burst on an engine that just started would queue
            // unjudged (seconds to a first token). Two prefill budgets are let in, so that a
            // step reads a whole one (or half of one) and measures the rate; the rest retry
            // after it.
            let limit = 2 * self.prefill_budget();
            if backlog + tokens > limit {
                self.gate_refusals.fetch_add(1, Ordering::Relaxed);
                return Err(GateRefusal {
                    predicted_ms: 0.0,
                    margin_ms: 0.0,
                    max_wait_ms,
                    backlog_tokens: backlog,
                    tokens_per_second: 0.0,
                    unmeasured_limit_tokens: Some(limit),
                    booked: None,
                });
            }
        }
        if max_wait_ms > 0 && rate > 0.0 {
            // The prediction with the bookings ahead of it, in the weighted fair order.
            let margin_ms = self.first_token_margin_ms();
            let gate = Gate {
                backlog,
                rate,
                allowance_ms: max_wait_ms as f64 - margin_ms,
            };
            let verdict = self.ledger().judge(Instant::now(), claim, tokens, gate);
            match verdict {
                Verdict::Admit { ahead_tokens, .. } => {
                    self.inbox_tokens.fetch_add(tokens, Ordering::Relaxed);
                    return Ok(Some(((ahead_tokens + tokens) as f64 / rate * 1e3) as f32));
                }
                Verdict::Refuse {
                    ahead_tokens,
                    booked,
                } => {
                    self.gate_refusals.fetch_add(1, Ordering::Relaxed);
                    return Err(GateRefusal {
                        predicted_ms: (ahead_tokens + tokens) as f64 / rate * 1e3,
                        margin_ms,
                        max_wait_ms,
                        backlog_tokens: ahead_tokens,
                        tokens_per_second: rate,
                        unmeasured_limit_tokens: None,
                        booked,
                    });
                }
            }
        }
        self.inbox_tokens.fetch_add(tokens, Ordering::Relaxed);
        Ok(predicted_ms.map(|p| p as f32))
    }

    /// Most prompt tokens in one step, after every running stream's decode token: a smaller
    /// budget keeps the streams' pace while prompts are read (decode-first budgeting).
    pub fn max_prefill_tokens(&self) -> usize {
        self.max_prefill_tokens.load(Ordering::Relaxed)
    }

    pub fn set_max_prefill_tokens(&self, value: usize) {
        self.max_prefill_tokens
            .store(value.max(1), Ordering::Relaxed);
    }

    /// The prefill budget as configured (the engine's start): while the budget is below it,
    /// trimmed so that steps keep the streams' pace, a prompt token costs `1 + depth / D`
    /// depth-0 tokens (see [`crate::step_cost`]); at it, one each, so that a prompt that fits
    /// the configured budget is read in one step as configured.
    pub fn prefill_ceiling(&self) -> usize {
        self.prefill_ceiling.load(Ordering::Relaxed)
    }

    pub fn set_prefill_ceiling(&self, value: usize) {
        self.prefill_ceiling.store(value.max(1), Ordering::Relaxed);
    }

    /// Whether prompt tokens are priced by their depth now (the budget is trimmed).
    pub fn prefill_priced(&self) -> bool {
        self.max_prefill_tokens() < self.prefill_ceiling()
    }

    /// Whether new sequences may start (false at saturation: running ones go on, sequences
    /// already started and preempted may resume, nobody new begins a prefill).
    pub fn admit_prefills(&self) -> bool {
        self.admit_prefills.load(Ordering::Relaxed)
    }

    pub fn set_admit_prefills(&self, value: bool) {
        self.admit_prefills.store(value, Ordering::Relaxed);
    }

    /// Most sequences running at once.
    pub fn max_num_seqs(&self) -> usize {
        self.max_num_seqs.load(Ordering::Relaxed)
    }

    /// Most tokens (decode + prefill) in one step.
    pub fn max_num_batched_tokens(&self) -> usize {
        self.max_num_batched_tokens.load(Ordering::Relaxed)
    }

    /// Takes effect at the next step. Running sequences beyond a lowered cap finish normally;
    /// no new ones start until the count is under it.
    pub fn set_max_num_seqs(&self, value: usize) {
        self.max_num_seqs.store(value.max(1), Ordering::Relaxed);
    }

    pub fn set_max_num_batched_tokens(&self, value: usize) {
        self.max_num_batched_tokens
            .store(value.max(1), Ordering::Relaxed);
    }
}

/// What the scheduler is doing, refreshed after every step (for metrics, health and the
/// degradation controller).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SchedulerSnapshot {
    pub waiting: usize,
    pub running: usize,
    /// Waiting sequences whose blocks sit in the second tier.
    pub swapped: usize,
    pub blocks_total: usize,
    pub blocks_used: usize,
    pub blocks_free: usize,
    /// Unreferenced blocks kept for the prefix cache (also available for new content).
    pub blocks_cached: usize,
    pub block_tokens: usize,
    /// Token slots in the blocks of running sequences, and how many of them hold a token.
    pub kv_slots_allocated: usize,
    pub kv_slots_used: usize,
    pub preemptions: u64,
    pub prefix: PrefixStats,
    /// Prompt tokens served from the prefix cache.
    pub prefix_cached_tokens: u64,
    pub tier: TierStats,
    pub steps: u64,
    pub prefill_tokens: u64,
    pub decode_tokens: u64,
    /// Tokens guessed by prompt lookup and verified, and how many of them were kept.
    pub speculated_tokens: u64,
    pub speculated_accepted: u64,
    /// Tokens generated so far (a counter that moves while the engine makes progress).
    pub generated_tokens: u64,
    pub last_step_tokens: usize,
    pub last_step_seconds: f64,
    /// Attended positions that cost as much as one token's matrix products, fitted to the
    /// steps run: a prompt token at depth `d` counts `1 + d / this` against the prefill
    /// budget (none before the fit is trusted: one each).
    pub prefill_depth_equivalent: Option<f64>,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_prefill_tokens: usize,
    pub admit_prefills: bool,
    /// Steps that left prompt tokens for later because of the prefill budget.
    pub prefill_held_steps: u64,
    /// Blocks whose pages are mapped: written since the pool started or since they were last
    /// given back (free blocks are reused last-freed first, so this follows the peak use).
    pub blocks_resident: usize,
    /// Bytes of free KV pages given back to the system so far, and how many times.
    pub kv_released_bytes: u64,
    pub kv_releases: u64,
}

impl SchedulerSnapshot {
    /// Share of allocated token slots not holding a token (0 when nothing is allocated).
    pub fn kv_waste(&self) -> f64 {
        if self.kv_slots_allocated == 0 {
            0.0
        } else {
            1.0 - self.kv_slots_used as f64 / self.kv_slots_allocated as f64
        }
    }
}

/// A prompt's place in the prefill order: its tag (arrival on the prompt clock plus its
/// length, the fair order), or, when a TTFT objective lets prompts of up to `deadline_tokens`
/// be read within it and this one is such, its arrival alone (earliest deadline first).
fn prefill_key(tag: u64, prompt_len: usize, deadline_tokens: Option<u64>) -> u64 {
    match deadline_tokens {
        Some(fits) if prompt_len as u64 <= fits => tag.saturating_sub(prompt_len as u64),
        _ => tag,
    }
}

/// Runs one forward pass over a batch, writing keys and values into the store; returns the
/// logits of the batch's `logit_rows` (`rows × vocab`).
pub trait Executor: Send {
    fn forward(&mut self, batch: &Batch, store: &mut KvStore)
        -> Result<Forwarded<'_>, EngineError>;

    /// Runs tasks over the executor's threads (the sampling of a step's sequences), usable
    /// while the logits of a forward pass are borrowed. By default one after the other.
    fn threads(&self) -> ForEach {
        Arc::new(|items, task| (0..items).for_each(task))
    }
}

/// What a forward pass leaves: the logits of the batch's `logit_rows` (`rows × vocab`) and its
/// attention export (see [`Batch::capture_slots`]; empty when nothing was captured).
pub struct Forwarded<'a> {
    pub logits: &'a mut [f32],
    pub attention: &'a [Attended],
}

/// Runs `task(i)` for every `i < items` (see [`Executor::threads`]).
pub type ForEach = Arc<dyn Fn(usize, &(dyn Fn(usize) + Sync)) + Send + Sync>;

/// A request handed to the scheduler.
pub struct NewSequence {
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub stop: Vec<String>,
    /// Control tokens whose text the output shows.
    pub reveal: Vec<u32>,
    pub sampler: Sampler,
    /// Limits which tokens may come next (structured output).
    pub constraint: Option<Box<dyn TokenConstraint>>,
    pub events: UnboundedSender<Event>,
    pub cancel: Arc<AtomicBool>,
    pub arrived: Instant,
    /// The first-token gate's prediction at submission (ms), to learn its margin from.
    pub predicted_read_ms: Option<f32>,
    /// The attention export asked for (checked against the model).
    pub attention: Option<AttentionRequest>,
}

struct Sequence {
    id: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose keys and values are in the blocks of `table`.
    computed: usize,
    table: Vec<BlockId>,
    /// Names of the full blocks of `tokens` known so far.
    hashes: Vec<BlockHash>,
    /// Blocks of `table` registered in the prefix cache (or found there).
    registered: usize,
    /// After a preemption to the tier: how many blocks wait there and how many tokens they hold.
    swapped: Option<(usize, usize)>,
    max_tokens: usize,
    ignore_eos: bool,
    sampler: Sampler,
    constraint: Option<Box<dyn TokenConstraint>>,
    /// The constraint's mask for the token about to be sampled, or why it could not be made.
    mask: Result<TokenMask, ConstraintError>,
    detok: Detokenizer,
    reveal: Vec<u32>,
    stops: StopMatcher,
    events: UnboundedSender<Event>,
    cancel: Arc<AtomicBool>,
    arrived: Instant,
    predicted_read_ms: Option<f32>,
    /// Its place in the prefill order: the prompt clock when it arrived plus its prompt's
    /// length, the moment its prompt would be read if it had the engine alone (weighted fair
    /// queueing, with prompt tokens read as the clock). Prompts of one length go first come
    /// first served; a short prompt goes ahead of a long document that arrived shortly before
    /// it; and a document goes ahead of every prompt that arrives once as many prompt tokens
    /// as its own were read after it, so it is never starved.
    tag: u64,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    /// When its latest token came out (the inter-token gaps' start).
    last_token: Option<Instant>,
    cached_tokens: usize,
    /// A stop string ended the text: nothing held back is shown.
    text_done: bool,
    /// Whether this sequence was ever admitted (its queue slot is given back then).
    admitted: bool,
    /// Tokens guessed for this step (prompt lookup), verified with its next token.
    draft: Vec<u32>,
    acceptance: Acceptance,
    attention: Option<AttentionRequest>,
    /// The export of the token about to be sampled (layers × heads × top_k), sent with it.
    attended: Vec<Attended>,
}

impl Sequence {
    fn completion_tokens(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }
}

/// Latency samples the degradation controller drains once per window: time to first token
/// (from arrival) and the gaps between consecutive tokens of a stream, in milliseconds.
/// Bounded: beyond [`LatencySamples::CAPACITY`] samples per kind between two drains, later
/// ones are counted as dropped.
#[derive(Debug, Default)]
pub struct LatencySamples {
    pub ttft_ms: Vec<f32>,
    /// When each of `ttft_ms`'s requests arrived.
    pub ttft_arrived: Vec<Instant>,
    pub itl_ms: Vec<f32>,
    /// The same gaps where the server hands the tokens to its clients (pushed by the server,
    /// [`crate::Engine::record_delivered_gap`]): the step's time plus the way out of the
    /// process, as the clients and the server's own latency metrics see it.
    pub delivered_itl_ms: Vec<f32>,
    /// Whole sequences, arrival to the last token.
    pub e2e_ms: Vec<f32>,
    pub dropped: u64,
}

impl LatencySamples {
    pub const CAPACITY: usize = 16_384;

    pub(crate) fn push(list: &mut Vec<f32>, dropped: &mut u64, value: f32) {
        if list.len() < Self::CAPACITY {
            list.push(value);
        } else {
            *dropped += 1;
        }
    }

    /// Takes the samples gathered since the last call.
    pub fn drain(&mut self) -> LatencySamples {
        std::mem::take(self)
    }
}

/// What the scheduler shares with the engine's callers.
#[derive(Debug, Clone)]
pub struct SchedulerHandles {
    pub limits: Arc<SchedulerLimits>,
    /// New requests not yet admitted: submitters take a slot, the scheduler gives it back.
    pub queued: Arc<AtomicUsize>,
    pub snapshot: Arc<Mutex<SchedulerSnapshot>>,
    pub latency: Arc<Mutex<LatencySamples>>,
}

impl SchedulerHandles {
    pub fn new(max_num_seqs: usize, max_num_batched_tokens: usize) -> Self {
        Self {
            limits: Arc::new(SchedulerLimits::new(max_num_seqs, max_num_batched_tokens)),
            queued: Arc::new(AtomicUsize::new(0)),
            snapshot: Arc::new(Mutex::new(SchedulerSnapshot::default())),
            latency: Arc::new(Mutex::new(LatencySamples::default())),
        }
    }
}

/// Parameters fixed at start.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Share of the pool kept free when admitting a new sequence, for running ones to grow.
    pub watermark: f64,
    /// Most positions of a sequence.
    pub context: usize,
    /// Prompt lookup (speculative decoding without a draft model; off by default).
    pub speculation: Speculation,
}

/// The queues, the pool and the tier of one model; stepped by the engine thread.
pub struct Scheduler {
    config: SchedulerConfig,
    limits: Arc<SchedulerLimits>,
    tokenizer: Arc<Tokenizer>,
    pool: BlockPool,
    store: KvStore,
    tier: Option<KvTier>,
    /// Content of prefix blocks moved to the tier: parent hash and tokens, checked on return.
    tier_prefixes: HashMap<BlockHash, (BlockHash, Box<[u32]>)>,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    /// New requests not yet admitted (the bounded queue's occupancy, shared with submitters).
    queued: Arc<AtomicUsize>,
    next_id: u64,
    batch: Batch,
    block_buffer: Vec<u8>,
    snapshot: Arc<Mutex<SchedulerSnapshot>>,
    latency: Arc<Mutex<LatencySamples>>,
    stats: SchedulerSnapshot,
    /// Prompt tokens read so far (recomputed ones included): the clock of the prefill order.
    prompt_clock: u64,
    /// Whether the latest step's prompt tokens were bounded by its budgets (more prompt was
    /// waiting than it could read).
    budget_bound: bool,
    /// Per block: whether its pages are mapped (written since last given back).
    resident: Vec<bool>,
    /// Since when new prefills have been stopped (none while they are admitted).
    saturated_since: Option<Instant>,
    /// What a prompt token costs deep in its context (the prefill budget counts depth-0
    /// tokens), fitted to the steps run.
    step_cost: StepCost,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("waiting", &self.waiting.len())
            .field("running", &self.running.len())
            .finish()
    }
}

/// Key of block `index` of preempted sequence `id` in the tier.
fn swap_key(id: u64, index: usize) -> u64 {
    block_hash(id ^ 0x5f5f_7377_6170_5f5f, &[index as u32])
}

impl Scheduler {
    pub fn new(
        config: SchedulerConfig,
        handles: SchedulerHandles,
        tokenizer: Arc<Tokenizer>,
        pool: BlockPool,
        store: KvStore,
        tier: Option<KvTier>,
    ) -> Self {
        let SchedulerHandles {
            limits,
            queued,
            snapshot,
            latency,
        } = handles;
        assert_eq!(pool.total(), store.blocks(), "pool and store agree");
        assert_eq!(pool.block_tokens(), store.layout().block_tokens);
        let block_bytes = store.layout().block_bytes();
        let blocks = pool.total();
        let mut scheduler = Self {
            config,
            limits,
            tokenizer,
            pool,
            store,
            tier,
            tier_prefixes: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            queued,
            next_id: 0,
            batch: Batch::default(),
            block_buffer: vec![0u8; block_bytes],
            snapshot,
            latency,
            stats: SchedulerSnapshot::default(),
            prompt_clock: 0,
            budget_bound: false,
            resident: vec![false; blocks],
            saturated_since: None,
            step_cost: StepCost::default(),
        };
        scheduler.publish();
        scheduler
    }

    /// Whether any sequence is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn store(&self) -> &KvStore {
        &self.store
    }

    /// Block tables of the running sequences (for invariant checks).
    pub fn running_tables(&self) -> Vec<&[BlockId]> {
        self.running.iter().map(|s| s.table.as_slice()).collect()
    }

    /// Blocks a sequence of `tokens` positions needs.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.pool.block_tokens())
    }

    /// Queues a request (the submitter already took its queue slot).
    pub fn add(&mut self, new: NewSequence) {
        let block_tokens = self.pool.block_tokens();
        let sampler = new.sampler;
        let prompt_len = new.tokens.len();
        // From the inbox to the queue: still in the backlog until the step's end recounts it.
        self.limits.withdraw_prompt(prompt_len);
        self.limits
            .prefill_backlog
            .fetch_add(prompt_len, Ordering::Relaxed);
        let seq = Sequence {
            id: self.next_id,
            prompt_len,
            hashes: Vec::with_capacity(new.tokens.len() / block_tokens + 1),
            tokens: new.tokens,
            computed: 0,
            table: Vec::new(),
            registered: 0,
            swapped: None,
            max_tokens: new.max_tokens,
            ignore_eos: new.ignore_eos,
            sampler,
            constraint: new.constraint,
            mask: Ok(TokenMask::default()),
            detok: Detokenizer::default(),
            reveal: new.reveal,
            stops: StopMatcher::new(&new.stop),
            events: new.events,
            cancel: new.cancel,
            arrived: new.arrived,
            predicted_read_ms: new.predicted_read_ms,
            tag: self.prompt_clock + prompt_len as u64,
            first_scheduled: None,
            first_token: None,
            last_token: None,
            cached_tokens: 0,
            text_done: false,
            admitted: false,
            draft: Vec::new(),
            acceptance: Acceptance::default(),
            attention: new.attention,
            attended: Vec::new(),
        };
        self.next_id += 1;
        self.waiting.push_back(seq);
    }

    /// Ends every sequence (engine shutdown): each stream gets `Failed(reason)`.
    pub fn abort_all(&mut self, reason: &str) {
        let all: Vec<Sequence> = self
            .running
            .drain(..)
            .chain(self.waiting.drain(..))
            .collect();
        for mut seq in all {
            let _ = seq.events.send(Event::Failed(reason.to_string()));
            self.free_sequence(&mut seq);
        }
        self.publish();
    }

    /// One scheduling step and its forward pass. Returns the tokens processed.
    pub fn step(&mut self, executor: &mut dyn Executor) -> usize {
        let started = Instant::now();
        self.drop_cancelled();
        self.shed_unstarted(started);
        let scheduled = self.schedule();
        if scheduled.is_empty() {
            self.publish();
            return 0;
        }
        self.batch.clear();
        let mut samplers = Vec::new();
        // Sampled rows whose attention is exported: (sequence, row); a row's slot is its rank.
        let mut explained: Vec<(usize, usize)> = Vec::new();
        // Sequences that verify a guess: (index, first row, rows), their logit rows last.
        let mut guessed: Vec<(usize, usize, usize)> = Vec::new();
        let mut positions = 0u64;
        for &(i, n) in &scheduled {
            let seq = &mut self.running[i];
            seq.first_scheduled.get_or_insert(started);
            let from = seq.computed;
            positions += (n * from + n * (n + 1) / 2) as u64;
            if seq.draft.is_empty() {
                self.batch
                    .push_sequence(&seq.table, &seq.tokens[from..from + n], from, false);
                if from + n == seq.tokens.len() {
                    self.batch.logit_rows.push(self.batch.len() - 1);
                    samplers.push(i);
                    if seq
                        .attention
                        .as_ref()
                        .is_some_and(|a| a.wants(seq.completion_tokens()))
                    {
                        explained.push((i, self.batch.len() - 1));
                    }
                }
            } else {
                let mut chunk = Vec::with_capacity(n);
                chunk.push(seq.tokens[from]);
                chunk.extend_from_slice(&seq.draft);
                self.batch.push_sequence(&seq.table, &chunk, from, false);
                guessed.push((i, self.batch.len() - n, n));
            }
        }
        for &(_, first, n) in &guessed {
            self.batch.logit_rows.extend(first..first + n);
        }
        if !explained.is_empty() {
            self.batch
                .capture_slots
                .resize(self.batch.len(), NOT_CAPTURED);
            for (slot, &(i, row)) in explained.iter().enumerate() {
                self.batch.capture_slots[row] = slot as u32;
                if let Some(asked) = &self.running[i].attention {
                    self.batch.capture_layers.extend_from_slice(&asked.layers);
                    self.batch.capture_top_k = self.batch.capture_top_k.max(asked.top_k);
                }
            }
            self.batch.capture_layers.sort_unstable();
            self.batch.capture_layers.dedup();
        }
        let tokens = self.batch.len();
        // The batch boundary, for traces: what this step computes.
        let _batch = tracing::debug_span!(
            "engine.batch",
            sequences = scheduled.len(),
            tokens,
            samples = samplers.len()
        )
        .entered();
        // The constraints' masks for this step's samples are computed while the forward pass runs.
        let constrained: Vec<usize> = samplers
            .iter()
            .copied()
            .filter(|&i| self.running[i].constraint.is_some())
            .collect();
        let mut masks: Vec<(usize, Box<dyn TokenConstraint>, TokenMask)> = samplers
            .iter()
            .filter_map(|&i| {
                let seq = &mut self.running[i];
                let mask = std::mem::replace(&mut seq.mask, Ok(TokenMask::default()));
                let mask = mask.unwrap_or_default();
                seq.constraint.take().map(|c| (i, c, mask))
            })
            .collect();
        let threads = executor.threads();
        let (result, computed) = if masks.is_empty() {
            (executor.forward(&self.batch, &mut self.store), Vec::new())
        } else {
            let vocab = self.tokenizer.vocab_size();
            let (batch, store) = (&self.batch, &mut self.store);
            std::thread::scope(|scope| {
                let helper = scope.spawn(move || {
                    masks
                        .iter_mut()
                        .map(|(_, constraint, mask)| {
                            if mask.words().len() != vocab.div_ceil(32) {
                                *mask = TokenMask::new(vocab);
                            }
                            constraint.compute_mask(mask)
                        })
                        .collect::<Vec<_>>()
                        .into_iter()
                        .zip(masks)
                        .collect::<Vec<_>>()
                });
                let result = executor.forward(batch, store);
                let computed = helper.join().unwrap_or_default();
                (result, computed)
            })
        };
        for (outcome, (i, constraint, mask)) in computed {
            let seq = &mut self.running[i];
            seq.constraint = Some(constraint);
            seq.mask = match outcome {
                Ok(()) if mask.count() == 0 => Err(ConstraintError::NoTokenAllowed),
                Ok(()) => Ok(mask),
                Err(e) => Err(e),
            };
        }
        for &i in &constrained {
            let seq = &mut self.running[i];
            if seq.constraint.is_none() {
                seq.mask = Err(ConstraintError::MaskPanicked);
            }
        }
        let logits = match result {
            Ok(Forwarded { logits, attention }) => {
                take_attention(
                    &mut self.running,
                    &explained,
                    attention,
                    &self.batch.capture_layers,
                    self.batch.capture_top_k,
                );
                logits
            }
            Err(e) => {
                let message = format!("forward pass failed: {e}");
                let mut failed: Vec<usize> = scheduled.iter().map(|&(i, _)| i).collect();
                failed.sort_unstable_by_key(|&i| std::cmp::Reverse(i));
                for i in failed {
                    let mut seq = self.running.remove(i);
                    let _ = seq.events.send(Event::Failed(message.clone()));
                    self.free_sequence(&mut seq);
                }
                self.publish();
                return 0;
            }
        };
        let rows = samplers.len() + guessed.iter().map(|g| g.2).sum::<usize>();
        let vocab = logits.len().checked_div(rows).unwrap_or(0);
        let (logits, guessed_logits) = logits.split_at_mut(samplers.len() * vocab);
        let mut read = 0;
        for &(i, n) in &scheduled {
            let seq = &mut self.running[i];
            let prefill = n.min(seq.prompt_len.saturating_sub(seq.computed));
            if seq.tokens.len() - seq.computed > 1 {
                self.prompt_clock += n as u64;
                read += n;
            }
            self.stats.prefill_tokens += prefill as u64;
            self.stats.decode_tokens += (n - prefill) as u64;
            // A guess's positions count once kept (below); its sequence's own token now.
            seq.computed += if seq.draft.is_empty() { n } else { 1 };
        }
        // Register the blocks that filled up.
        for &(i, _) in &scheduled {
            register_full_blocks(&mut self.pool, &mut self.running[i]);
        }
        let choices = sample_rows(&threads, &mut self.running, &samplers, logits, vocab);
        let mut finished = Vec::new();
        // (arrival for a first token, milliseconds)
        let mut gaps: Vec<(Option<Instant>, f32)> = Vec::with_capacity(samplers.len());
        for (&i, choice) in samplers.iter().zip(choices) {
            let seq = &mut self.running[i];
            if let Some(reason) = emit_token(seq, choice, &self.tokenizer, self.config.context) {
                finished.push((i, reason));
            }
            if let Some(first) = seq.first_token {
                let now = Instant::now();
                gaps.push(match seq.last_token.replace(now) {
                    None => {
                        let ttft = first.saturating_duration_since(seq.arrived).as_secs_f32() * 1e3;
                        if let Some(predicted) = seq.predicted_read_ms {
                            self.limits.record_first_token(predicted, ttft);
                        }
                        (Some(seq.arrived), ttft)
                    }
                    Some(before) => (
                        None,
                        now.saturating_duration_since(before).as_secs_f32() * 1e3,
                    ),
                });
            }
            self.stats.generated_tokens += 1;
            if self.config.speculation.enabled() {
                seq.acceptance.plain(1);
            }
        }
        // Guesses: each row sampled in order with the sequence's own sampler; a sample equal
        // to the guess keeps it and the next row is sampled, the first that differs ends it.
        let mut offset = 0;
        for &(i, _, n) in &guessed {
            let seq = &mut self.running[i];
            let draft = std::mem::take(&mut seq.draft);
            let mut kept = 0;
            let mut emitted = 0;
            for j in 0..n {
                let row = &mut guessed_logits[(offset + j) * vocab..(offset + j + 1) * vocab];
                let choice = seq.sampler.sample(row);
                let id = choice.id;
                emitted += 1;
                if let Some(reason) =
                    emit_token(seq, Some(choice), &self.tokenizer, self.config.context)
                {
                    finished.push((i, reason));
                    break;
                }
                if draft.get(j) != Some(&id) {
                    break;
                }
                kept += 1;
            }
            offset += n;
            seq.computed += kept;
            seq.acceptance.verified(draft.len(), kept);
            self.stats.speculated_tokens += draft.len() as u64;
            self.stats.speculated_accepted += kept as u64;
            self.stats.generated_tokens += emitted as u64;
            register_full_blocks(&mut self.pool, seq);
            // The first token's gap is the step's; the ones kept with it came at once.
            let now = Instant::now();
            if let Some(before) = seq.last_token.replace(now) {
                gaps.push((
                    None,
                    now.saturating_duration_since(before).as_secs_f32() * 1e3,
                ));
                gaps.extend(std::iter::repeat_n((None, 0.0), emitted - 1));
            }
        }
        if !gaps.is_empty() {
            let mut samples = self.latency.lock().unwrap_or_else(|e| e.into_inner());
            for (arrived, ms) in gaps {
                match arrived {
                    Some(at) if samples.ttft_ms.len() < LatencySamples::CAPACITY => {
                        samples.ttft_ms.push(ms);
                        samples.ttft_arrived.push(at);
                    }
                    Some(_) => samples.dropped += 1,
                    None => {
                        let LatencySamples {
                            itl_ms, dropped, ..
                        } = &mut *samples;
                        LatencySamples::push(itl_ms, dropped, ms);
                    }
                }
            }
        }
        finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
        if !finished.is_empty() {
            let now = Instant::now();
            let mut samples = self.latency.lock().unwrap_or_else(|e| e.into_inner());
            let LatencySamples {
                e2e_ms, dropped, ..
            } = &mut *samples;
            for &(i, _) in &finished {
                let ms = now.saturating_duration_since(self.running[i].arrived);
                LatencySamples::push(e2e_ms, dropped, ms.as_secs_f32() * 1e3);
            }
        }
        for (i, reason) in finished {
            let mut seq = self.running.remove(i);
            finish(&mut seq, reason);
            self.free_sequence(&mut seq);
        }
        self.stats.steps += 1;
        self.stats.last_step_tokens = tokens;
        self.stats.last_step_seconds = started.elapsed().as_secs_f64();
        self.step_cost
            .observe(tokens, positions, self.stats.last_step_seconds);
        self.stats.prefill_depth_equivalent = self.step_cost.depth();
        // Before any step read a whole budget, one that read at least half of one gives a
        // first rate (its fixed cost spread over fewer tokens: somewhat low, which errs on
        // the side of refusing). Without it, a start-up burst of less than two budgets, read
        // in smaller steps, left the rate unmeasured and the gate at its start-up limit.
        let first_measure =
            self.limits.prefill_rate() <= 0.0 && 2 * read >= self.limits.prefill_budget();
        if read > 0 && (self.budget_bound || first_measure) && self.stats.last_step_seconds > 0.0 {
            // How fast prompts are read beside this step's streams (what a new prompt's wait
            // is predicted from): a moving average over the steps that read as many prompt
            // tokens as the budget allowed (a step that read a short queue says nothing of
            // how fast a longer one would go).
            let sample = read as f64 / self.stats.last_step_seconds;
            // The average so far, already scaled to today's budget (as this sample is), so a
            // budget cut does not mix rates measured at two budgets.
            let before = self.limits.prefill_rate();
            let rate = if before > 0.0 {
                0.9 * before + 0.1 * sample
            } else {
                sample
            };
            self.limits
                .prefill_rate
                .store(rate.to_bits(), Ordering::Relaxed);
            self.limits.prefill_rate_read.store(read, Ordering::Relaxed);
        }
        self.publish();
        tokens
    }

    /// Removes cancelled sequences from both queues, freeing their blocks.
    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled() {
                let mut seq = self.running.remove(i);
                self.free_sequence(&mut seq);
            } else {
                i += 1;
            }
        }
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].cancelled() {
                let mut seq = self.waiting.remove(i).expect("index in range");
                self.free_sequence(&mut seq);
            } else {
                i += 1;
            }
        }
    }

    /// Replaces the learned cost of a prompt token deep in its context (see
    /// [`crate::step_cost`]) with a given one.
    pub fn set_step_cost(&mut self, cost: StepCost) {
        self.step_cost = cost;
    }

    /// While new prefills are stopped (memory saturated), refuses every sequence that never
    /// started and has waited [`SchedulerLimits::saturation_wait_ms`] since it arrived or
    /// since the saturation began, whichever is later: [`Event::Shed`], with a retry hint.
    /// It has lost nothing (no token was computed for it), and its caller can answer at once
    /// (429 + Retry-After) instead of holding it until a first-token timeout. Sequences that
    /// started and were preempted keep their place: they resume before anyone new.
    fn shed_unstarted(&mut self, now: Instant) {
        if self.limits.admit_prefills() {
            self.saturated_since = None;
            return;
        }
        let since = *self.saturated_since.get_or_insert(now);
        let wait_ms = self.limits.saturation_wait_ms();
        if wait_ms == 0 {
            return;
        }
        let wait = Duration::from_millis(wait_ms);
        let retry_after_s = wait_ms.div_ceil(1000).max(1);
        let mut i = 0;
        while i < self.waiting.len() {
            let seq = &self.waiting[i];
            let from = seq.arrived.max(since);
            if seq.first_scheduled.is_some() || now.saturating_duration_since(from) < wait {
                i += 1;
                continue;
            }
            let mut seq = self.waiting.remove(i).expect("index in range");
            let waited_ms = now.saturating_duration_since(seq.arrived).as_millis() as u64;
            let _ = seq.events.send(Event::Shed(Shed {
                waited_ms,
                retry_after_s,
            }));
            self.free_sequence(&mut seq);
            self.limits
                .saturation_refusals
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Picks this step's work: `(index in running, tokens)` pairs.
    fn schedule(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.limits.max_num_batched_tokens();
        let max_seqs = self.limits.max_num_seqs();
        let admit_new = self.limits.admit_prefills();
        // Decode first: every running stream's next token is counted before any prompt chunk,
        // and prompt tokens take what is left up to the prefill budget.
        let decoding = self
            .running
            .iter()
            .filter(|s| s.tokens.len() - s.computed <= 1)
            .count();
        let mut prefill = self
            .limits
            .max_prefill_tokens()
            .min(budget.saturating_sub(decoding));
        // The prefill budget goes to prompts in the order of their tags (see `Sequence::tag`):
        // first come first served among prompts of one length, a short prompt ahead of a long
        // document that arrived shortly before it.
        // Trimmed, the budget counts depth-0 tokens; at its configured size, plain tokens.
        let pricing = if self.limits.prefill_priced() {
            self.step_cost.clone()
        } else {
            StepCost::default()
        };
        let (running_share, waiting_order) =
            self.prefill_shares(&pricing, prefill, max_seqs, admit_new);
        let mut held = false;
        let mut scheduled = Vec::new();
        let mut preempted = false;
        // Prompt lookup while few sequences decode (see `crate::speculation`).
        let speculation = self.config.speculation;
        let guessing = speculation.enabled() && decoding <= speculation.max_batch;
        let context = self.config.context;
        for seq in &mut self.running {
            seq.draft.clear();
        }
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let pending = self.running[i].tokens.len() - self.running[i].computed;
            let mut n = if pending <= 1 {
                pending.min(budget)
            } else {
                running_share[i].min(budget)
            };
            let seq = &mut self.running[i];
            if guessing
                && n == 1
                && pending == 1
                && seq.constraint.is_none()
                && seq.attention.is_none()
                && seq.completion_tokens() >= 1
                && seq.acceptance.guessing()
            {
                // Room: the step's budget, the tokens it may still generate (every guess
                // kept and one more), and the context (the guesses' positions).
                let room = seq
                    .acceptance
                    .length(speculation.max_draft)
                    .min(budget - 1)
                    .min(seq.max_tokens.saturating_sub(seq.completion_tokens() + 1))
                    .min(context.saturating_sub(seq.tokens.len()));
                let draft = propose(
                    &seq.tokens,
                    speculation.ngram_min,
                    speculation.ngram_max,
                    room,
                );
                seq.draft.extend_from_slice(draft);
                n += seq.draft.len();
            }
            if n == 0 {
                held = true;
                i += 1;
                continue;
            }
            let need = self
                .blocks_for(self.running[i].computed + n)
                .saturating_sub(self.running[i].table.len());
            let mut self_preempted = false;
            while self.pool.available() < need {
                let victim = self.running.len() - 1;
                self.preempt(victim);
                preempted = true;
                if victim == i {
                    self_preempted = true;
                    break;
                }
            }
            if self_preempted {
                break;
            }
            for _ in 0..need {
                let block = self.allocate().expect("availability checked above");
                self.running[i].table.push(block);
            }
            scheduled.push((i, n));
            budget -= n;
            if pending > 1 {
                let from = self.running[i].computed;
                prefill = prefill.saturating_sub(pricing.chunk(from, n));
                held |= n < pending;
            }
            i += 1;
        }
        if preempted {
            self.stats.prefill_held_steps += held as u64;
            self.budget_bound = false;
            return scheduled;
        }
        let watermark = (self.config.watermark * self.pool.total() as f64).ceil() as usize;
        for (id, share) in waiting_order {
            if self.running.len() >= max_seqs {
                break;
            }
            if budget == 0 || prefill == 0 {
                held = true;
                break;
            }
            let Some(at) = self.waiting.iter().position(|w| w.id == id) else {
                continue;
            };
            let mut seq = self.waiting.remove(at).expect("index in range");
            if let Some((blocks, _)) = seq.swapped {
                let reserve = if self.running.is_empty() {
                    0
                } else {
                    watermark
                };
                if self.pool.available() < blocks + reserve {
                    self.waiting.insert(at, seq);
                    held = true;
                    break;
                }
            }
            if seq.table.is_empty() {
                if seq.swapped.is_some() {
                    self.swap_in(&mut seq);
                } else {
                    self.match_prefix(&mut seq);
                }
            }
            let pending = seq.tokens.len() - seq.computed;
            // Its share was priced at its depth before the prefix cache was looked up: a hit
            // makes its tokens dearer.
            let affordable = pricing.affordable(seq.computed, pending, prefill).max(1);
            let n = pending.min(budget).min(share.max(1)).min(affordable);
            let need = self
                .blocks_for(seq.computed + n)
                .saturating_sub(seq.table.len());
            if self.pool.available() < need + watermark && !self.running.is_empty()
                || self.pool.available() < need
            {
                // Not now: give back what it holds (cached blocks stay cached) and keep its
                // place; nobody behind it jumps the pool's queue.
                self.release_blocks(&mut seq);
                self.waiting.insert(at, seq);
                held = true;
                break;
            }
            for _ in 0..need {
                let block = self.allocate().expect("availability checked above");
                seq.table.push(block);
            }
            if !seq.admitted {
                seq.admitted = true;
                self.queued.fetch_sub(1, Ordering::Relaxed);
                self.stats.prefix_cached_tokens += seq.cached_tokens as u64;
            }
            let cost = pricing.chunk(seq.computed, n);
            self.running.push(seq);
            scheduled.push((self.running.len() - 1, n));
            budget -= n;
            prefill = prefill.saturating_sub(cost);
            held |= n < pending;
        }
        held |= prefill == 0
            && budget > 0
            && self.running.len() < max_seqs
            && self.waiting.iter().any(|w| w.admitted || admit_new);
        self.stats.prefill_held_steps += held as u64;
        self.budget_bound = held && (prefill == 0 || budget == 0);
        scheduled
    }

    /// Shares the prefill budget out in tag order, among the running sequences still reading
    /// their prompt and the waiting ones that could start now (room under the sequence cap, and
    /// not saturated unless already started once). Returns each running sequence's share and the
    /// waiting ones to start, as `(id, share)` in tag order.
    fn prefill_shares(
        &self,
        pricing: &StepCost,
        prefill: usize,
        max_seqs: usize,
        admit_new: bool,
    ) -> (Vec<usize>, Vec<(u64, usize)>) {
        let mut running_share = vec![0; self.running.len()];
        // With a TTFT objective, a prompt that can be read within it is ordered by its
        // arrival on the prompt clock (earliest deadline first), a longer one by its tag.
        let deadline_tokens = self.limits.deadline_tokens();
        let key = |s: &Sequence| prefill_key(s.tag, s.prompt_len, deadline_tokens);
        // (key, id, running, index, (computed, pending)): ties go in arrival order.
        type Contender = (u64, u64, bool, usize, (usize, usize));
        let mut contenders: Vec<Contender> = self
            .running
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let pending = s.tokens.len() - s.computed;
                (pending > 1).then_some((key(s), s.id, true, i, (s.computed, pending)))
            })
            .collect();
        let mut waiting: Vec<Contender> = self
            .waiting
            .iter()
            .enumerate()
            .filter(|(_, s)| s.admitted || admit_new)
            .map(|(i, s)| {
                (
                    key(s),
                    s.id,
                    false,
                    i,
                    (s.computed, s.tokens.len() - s.computed),
                )
            })
            .collect();
        // At most as many new ones as the cap has room for: the earliest tags.
        let room = max_seqs.saturating_sub(self.running.len());
        if waiting.len() > room {
            waiting.select_nth_unstable_by_key(room, |c| (c.0, c.1));
            waiting.truncate(room);
        }
        contenders.append(&mut waiting);
        contenders.sort_unstable_by_key(|c| (c.0, c.1));
        // The budget counts depth-0 tokens: a chunk deep in a document pays for the positions
        // its tokens attend to (see `step_cost`). The first in line always gets a token, so a
        // document deeper than the whole budget still progresses.
        let mut left = prefill;
        let mut order = Vec::new();
        for (_, id, running, i, (computed, pending)) in contenders {
            if left == 0 {
                break;
            }
            let mut n = pricing.affordable(computed, pending, left);
            if n == 0 {
                if left < prefill {
                    break;
                }
                n = 1;
            }
            left = left.saturating_sub(pricing.chunk(computed, n));
            if running {
                running_share[i] = n;
            } else {
                order.push((id, n));
            }
        }
        (running_share, order)
    }

    /// Gives memory back under pressure: drops the prefix cache's unreferenced blocks and hands
    /// the pages of every free block back to the system. Returns the bytes given back.
    pub fn release_memory(&mut self) -> usize {
        self.pool.drop_cached();
        let mut free = vec![false; self.resident.len()];
        for b in self.pool.free_blocks() {
            free[b as usize] = true;
        }
        let release = release_runs(&free, &self.resident);
        let newly = release
            .iter()
            .filter(|&&b| self.resident[b as usize])
            .count();
        let bytes = self.store.release(&release);
        for &b in &release {
            self.resident[b as usize] = false;
        }
        self.stats.blocks_resident -= newly;
        self.stats.kv_released_bytes += bytes as u64;
        self.stats.kv_releases += 1;
        self.publish();
        bytes
    }

    /// Takes a block, moving cached content it replaces to the tier.
    fn allocate(&mut self) -> Option<BlockId> {
        let allocated = self.pool.allocate()?;
        if !std::mem::replace(&mut self.resident[allocated.block as usize], true) {
            self.stats.blocks_resident += 1;
        }
        if let (Some((hash, parent, tokens)), Some(tier)) = (allocated.evicted, self.tier.as_mut())
        {
            self.store.copy_out(allocated.block, &mut self.block_buffer);
            match tier.put(hash, &self.block_buffer) {
                Ok(dropped) => {
                    for key in dropped {
                        self.tier_prefixes.remove(&key);
                    }
                    if tier.contains(hash) {
                        self.tier_prefixes.insert(hash, (parent, tokens));
                    }
                }
                Err(_) => {
                    tier.remove(hash);
                }
            }
        }
        Some(allocated.block)
    }

    /// Takes the longest cached prefix of a new (or recomputing) sequence's tokens, always
    /// leaving at least one token to compute (its logits start the generation).
    fn match_prefix(&mut self, seq: &mut Sequence) {
        let block_tokens = self.pool.block_tokens();
        extend_hashes(seq, block_tokens);
        let limit = (seq.tokens.len() - 1) / block_tokens;
        let mut parent = ROOT_HASH;
        for j in 0..limit {
            let hash = seq.hashes[j];
            let tokens = &seq.tokens[j * block_tokens..(j + 1) * block_tokens];
            let block = match self.pool.lookup(hash, parent, tokens) {
                Some(block) => block,
                None => match self.restore_prefix(hash, parent, tokens) {
                    Some(block) => block,
                    None => break,
                },
            };
            seq.table.push(block);
            parent = hash;
        }
        seq.registered = seq.table.len();
        seq.computed = seq.table.len() * block_tokens;
        if !seq.admitted {
            seq.cached_tokens = seq.computed;
        }
    }

    /// Brings a prefix block back from the tier into a fresh block.
    fn restore_prefix(
        &mut self,
        hash: BlockHash,
        parent: BlockHash,
        tokens: &[u32],
    ) -> Option<BlockId> {
        let (stored_parent, stored_tokens) = self.tier_prefixes.get(&hash)?;
        if *stored_parent != parent || **stored_tokens != *tokens {
            return None;
        }
        if self.pool.available() == 0 {
            return None;
        }
        let block = self.allocate()?;
        let tier = self.tier.as_mut().expect("tier prefixes imply a tier");
        match tier.take(hash, &mut self.block_buffer) {
            Ok(true) => {
                self.tier_prefixes.remove(&hash);
                self.store.copy_in(block, &self.block_buffer);
                self.pool.register(block, hash, parent, tokens);
                Some(block)
            }
            _ => {
                self.tier_prefixes.remove(&hash);
                self.pool.release(block);
                None
            }
        }
    }

    /// Preempts running sequence `i`: to the tier when there is one, else for recomputation.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        seq.draft.clear();
        self.stats.preemptions += 1;
        if let Some(tier) = self.tier.as_mut() {
            let blocks = seq.table.len();
            let mut stored = 0;
            for (j, &block) in seq.table.iter().enumerate() {
                self.store.copy_out(block, &mut self.block_buffer);
                let key = swap_key(seq.id, j);
                match tier.put(key, &self.block_buffer) {
                    Ok(dropped) => {
                        for key in dropped {
                            self.tier_prefixes.remove(&key);
                        }
                        stored += 1;
                    }
                    Err(_) => break,
                }
            }
            if stored == blocks && blocks > 0 {
                seq.swapped = Some((blocks, seq.computed));
            }
        }
        self.release_blocks(&mut seq);
        // Back in arrival order.
        let at = self
            .waiting
            .iter()
            .position(|w| w.id > seq.id)
            .unwrap_or(self.waiting.len());
        self.waiting.insert(at, seq);
    }

    /// Brings a swapped sequence's blocks back, as far as the tier still has them.
    fn swap_in(&mut self, seq: &mut Sequence) {
        let Some((blocks, computed)) = seq.swapped.take() else {
            return;
        };
        let block_tokens = self.pool.block_tokens();
        let mut restored = 0;
        if self.pool.available() >= blocks {
            for j in 0..blocks {
                let key = swap_key(seq.id, j);
                let Some(block) = self.allocate() else {
                    break;
                };
                let tier = self.tier.as_mut().expect("swapped sequences imply a tier");
                match tier.take(key, &mut self.block_buffer) {
                    Ok(true) => {
                        self.store.copy_in(block, &self.block_buffer);
                        seq.table.push(block);
                        restored += 1;
                    }
                    _ => {
                        self.pool.release(block);
                        break;
                    }
                }
            }
        }
        if let Some(tier) = self.tier.as_mut() {
            for j in restored..blocks {
                tier.remove(swap_key(seq.id, j));
            }
        }
        if restored == blocks {
            seq.computed = computed;
        } else {
            // Part of it is gone: keep the whole blocks that came back, recompute the rest.
            let keep = restored.min(computed / block_tokens);
            for block in seq.table.drain(keep..) {
                self.pool.release(block);
            }
            seq.computed = keep * block_tokens;
        }
        // Blocks registered before the swap were re-created as private copies.
        seq.registered = 0;
        register_full_blocks(&mut self.pool, seq);
        if seq.table.is_empty() {
            self.match_prefix(seq);
        }
    }

    /// Gives back a sequence's blocks (it keeps its tokens and its place).
    fn release_blocks(&mut self, seq: &mut Sequence) {
        for block in seq.table.drain(..) {
            self.pool.release(block);
        }
        seq.registered = 0;
        seq.computed = seq.swapped.map_or(0, |(_, computed)| computed);
    }

    /// Everything a sequence held goes back: blocks, tier entries, its queue slot.
    fn free_sequence(&mut self, seq: &mut Sequence) {
        if let (Some((blocks, _)), Some(tier)) = (seq.swapped.take(), self.tier.as_mut()) {
            for j in 0..blocks {
                tier.remove(swap_key(seq.id, j));
            }
        }
        self.release_blocks(seq);
        if !seq.admitted {
            seq.admitted = true;
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn publish(&mut self) {
        let backlog: usize = self
            .waiting
            .iter()
            .chain(self.running.iter())
            .map(|seq| seq.prompt_len.saturating_sub(seq.computed))
            .sum();
        self.limits
            .prefill_backlog
            .store(backlog, Ordering::Relaxed);
        let s = &mut self.stats;
        s.waiting = self.waiting.len();
        s.running = self.running.len();
        s.swapped = self.waiting.iter().filter(|w| w.swapped.is_some()).count();
        s.blocks_total = self.pool.total();
        s.blocks_used = self.pool.held();
        s.blocks_free = self.pool.available() - self.pool.cached();
        s.blocks_cached = self.pool.cached();
        s.block_tokens = self.pool.block_tokens();
        s.kv_slots_allocated = self
            .running
            .iter()
            .map(|r| r.table.len() * self.pool.block_tokens())
            .sum();
        s.kv_slots_used = self.running.iter().map(|r| r.computed).sum();
        s.prefix = self.pool.stats();
        s.tier = self.tier.as_ref().map(KvTier::stats).unwrap_or_default();
        s.max_num_seqs = self.limits.max_num_seqs();
        s.max_num_batched_tokens = self.limits.max_num_batched_tokens();
        s.max_prefill_tokens = self.limits.max_prefill_tokens();
        s.admit_prefills = self.limits.admit_prefills();
        let mut shared = self.snapshot.lock().unwrap_or_else(|e| e.into_inner());
        *shared = self.stats.clone();
    }
}

/// Computes the names of the sequence's full blocks not named yet.
fn extend_hashes(seq: &mut Sequence, block_tokens: usize) {
    let full = seq.tokens.len() / block_tokens;
    while seq.hashes.len() < full {
        let j = seq.hashes.len();
        let parent = if j == 0 { ROOT_HASH } else { seq.hashes[j - 1] };
        let hash = block_hash(
            parent,
            &seq.tokens[j * block_tokens..(j + 1) * block_tokens],
        );
        seq.hashes.push(hash);
    }
}

/// Registers the sequence's blocks that are full of computed tokens.
fn register_full_blocks(pool: &mut BlockPool, seq: &mut Sequence) {
    let block_tokens = pool.block_tokens();
    let full = (seq.computed / block_tokens).min(seq.table.len());
    if full <= seq.registered {
        return;
    }
    extend_hashes(seq, block_tokens);
    for j in seq.registered..full {
        let parent = if j == 0 { ROOT_HASH } else { seq.hashes[j - 1] };
        pool.register(
            seq.table[j],
            seq.hashes[j],
            parent,
            &seq.tokens[j * block_tokens..(j + 1) * block_tokens],
        );
    }
    seq.registered = full;
}

/// The next token of each sampled sequence (`samplers[row]` indexes `running`, its logits are
/// row `row`), chosen on the executor's threads: each choice is a log-softmax and entropy over
/// the whole vocabulary (262,144 logits for Gemma 3), so sixteen sequences sampled one after
/// the other would leave the other threads idle between forward passes. `None` for a sequence
/// whose structured-output mask failed.
fn sample_rows(
    threads: &ForEach,
    running: &mut [Sequence],
    samplers: &[usize],
    logits: &mut [f32],
    vocab: usize,
) -> Vec<Option<TokenChoice>> {
    // One job per row: the sequence's sampler and mask, its logits, and the choice.
    type Job<'a> = (&'a mut Sampler, Option<&'a TokenMask>, &'a mut [f32]);
    let mut row_of = vec![usize::MAX; running.len()];
    for (row, &i) in samplers.iter().enumerate() {
        row_of[i] = row;
    }
    let mut rows: Vec<Option<&mut [f32]>> = logits.chunks_mut(vocab.max(1)).map(Some).collect();
    let mut jobs: Vec<Option<Job<'_>>> = (0..samplers.len()).map(|_| None).collect();
    for (i, seq) in running.iter_mut().enumerate() {
        let row = row_of[i];
        if row == usize::MAX {
            continue;
        }
        let constrained = seq.constraint.is_some();
        let mask = match &seq.mask {
            Err(_) => continue,
            Ok(mask) => constrained.then_some(mask),
        };
        if let Some(logits) = rows.get_mut(row).and_then(Option::take) {
            jobs[row] = Some((&mut seq.sampler, mask, logits));
        }
    }
    let jobs: Vec<Mutex<(Option<Job<'_>>, Option<TokenChoice>)>> = jobs
        .into_iter()
        .map(|job| Mutex::new((job, None)))
        .collect();
    let choose = |row: usize| {
        // Each row is locked by the one task that takes it: the lock is never contended.
        let mut slot = jobs[row].lock().unwrap_or_else(|e| e.into_inner());
        let (job, choice) = &mut *slot;
        if let Some((sampler, mask, logits)) = job {
            if let Some(mask) = mask {
                mask.apply(logits);
            }
            *choice = Some(sampler.sample(logits));
        }
    };
    if jobs.len() > 1 {
        threads(jobs.len(), &choose);
    } else {
        (0..jobs.len()).for_each(choose);
    }
    jobs.into_iter()
        .map(|slot| slot.into_inner().unwrap_or_else(|e| e.into_inner()).1)
        .collect()
}

/// Hands each explained sequence its token's export from the pass's (`attention`: layer-major
/// over `layers`, slot `s` = rank in `explained`, then `heads × top_k`): its own layers and
/// heads, its own top_k (each head's list is sorted, so the first `top_k` are its top).
fn take_attention(
    running: &mut [Sequence],
    explained: &[(usize, usize)],
    attention: &[Attended],
    layers: &[usize],
    top_k: usize,
) {
    let per_layer = attention.len().checked_div(layers.len()).unwrap_or(0);
    let heads = per_layer.checked_div(explained.len() * top_k).unwrap_or(0);
    for (slot, &(i, _)) in explained.iter().enumerate() {
        let seq = &mut running[i];
        let Some(asked) = seq.attention.as_ref() else {
            continue;
        };
        let mut out = Vec::with_capacity(asked.entries_per_token());
        for l in &asked.layers {
            let Some(at) = layers.iter().position(|x| x == l) else {
                continue;
            };
            for &h in &asked.heads {
                let from = at * per_layer + (slot * heads + h) * top_k;
                if let Some(entries) = attention.get(from..from + asked.top_k) {
                    out.extend_from_slice(entries);
                }
            }
        }
        seq.attended = out;
    }
}

/// Sends the token chosen for a sequence (`None`: its structured-output mask failed); the
/// finish reason when the sequence ends with it.
fn emit_token(
    seq: &mut Sequence,
    choice: Option<TokenChoice>,
    tokenizer: &Tokenizer,
    context: usize,
) -> Option<FinishReason> {
    let choice = match (choice, &seq.mask) {
        (Some(choice), Ok(_)) => choice,
        (_, Err(e)) => {
            let _ = seq
                .events
                .send(Event::Failed(format!("structured output: {e}")));
            // The stream already has its final event.
            return Some(FinishReason::Cancelled);
        }
        (None, Ok(_)) => {
            let _ = seq
                .events
                .send(Event::Failed("no token was sampled".into()));
            return Some(FinishReason::Cancelled);
        }
    };
    seq.sampler.accept(choice.id);
    seq.tokens.push(choice.id);
    seq.first_token.get_or_insert_with(Instant::now);
    if !seq.ignore_eos && tokenizer.stop_tokens.contains(&choice.id) {
        return Some(FinishReason::Stop);
    }
    let mut complete = false;
    if let Some(constraint) = seq.constraint.as_mut() {
        if let Err(e) = constraint.commit(choice.id) {
            let _ = seq
                .events
                .send(Event::Failed(format!("structured output: {e}")));
            return Some(FinishReason::Cancelled);
        }
        complete = constraint.is_complete();
    }
    let reveal = seq.reveal.contains(&choice.id);
    let piece = seq.detok.push(tokenizer, choice.id, reveal);
    let (text, stopped) = seq.stops.push(&piece);
    let top_logprobs = choice
        .top
        .iter()
        .map(|&(id, lp)| (id, tokenizer.token_text(id), lp))
        .collect();
    let event = Event::Token(TokenEvent {
        id: choice.id,
        text,
        logprob: choice.logprob,
        entropy: choice.entropy,
        top_logprobs,
        attention: std::mem::take(&mut seq.attended),
    });
    if seq.events.send(event).is_err() {
        seq.cancel.store(true, Ordering::Relaxed);
        return Some(FinishReason::Cancelled);
    }
    if stopped {
        seq.text_done = true;
        return Some(FinishReason::Stop);
    }
    if complete {
        return Some(FinishReason::Stop);
    }
    if seq.completion_tokens() >= seq.max_tokens || seq.tokens.len() >= context {
        return Some(FinishReason::Length);
    }
    None
}

/// Sends the final event of a sequence.
fn finish(seq: &mut Sequence, reason: FinishReason) {
    if reason == FinishReason::Cancelled {
        return;
    }
    let now = Instant::now();
    let first_token = seq.first_token.unwrap_or(now);
    let first_scheduled = seq.first_scheduled.unwrap_or(first_token);
    let trailing_text = if seq.text_done {
        String::new()
    } else {
        seq.stops.flush(seq.detok.flush())
    };
    let done = Finished {
        reason,
        prompt_tokens: seq.prompt_len,
        completion_tokens: seq.completion_tokens(),
        cached_prompt_tokens: seq.cached_tokens,
        queue_seconds: first_scheduled
            .saturating_duration_since(seq.arrived)
            .as_secs_f64(),
        prefill_seconds: first_token
            .saturating_duration_since(first_scheduled)
            .as_secs_f64(),
        decode_seconds: now.saturating_duration_since(first_token).as_secs_f64(),
        trailing_text,
        stop: seq.stops.matched.clone(),
        speculated_tokens: seq.acceptance.proposed,
        speculated_accepted: seq.acceptance.accepted,
    };
    let _ = seq.events.send(Event::Finished(done));
}

/// The blocks [`Scheduler::release_memory`] hands back: every run of consecutive free blocks
/// that holds a block still resident, whole. A layer's slice of one block is rarely a whole
/// number of pages (SmolLM2's is 1.5 pages), so a block released alone keeps the pages it
/// shares with its neighbours; releasing the whole free run around it takes those too, and a
/// neighbour released earlier loses its remaining pages when this one goes.
fn release_runs(free: &[bool], resident: &[bool]) -> Vec<BlockId> {
    let mut out = Vec::new();
    let mut b = 0;
    while b < free.len() {
        if !free[b] {
            b += 1;
            continue;
        }
        let start = b;
        let mut any_resident = false;
        while b < free.len() && free[b] {
            any_resident |= resident[b];
            b += 1;
        }
        if any_resident {
            out.extend(start as BlockId..b as BlockId);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prompt tokens ahead, all of them already in the scheduler's queue.
    fn set_backlog(limits: &SchedulerLimits, tokens: usize) {
        limits.prefill_backlog.store(tokens, Ordering::Relaxed);
        limits.inbox_tokens.store(0, Ordering::Relaxed);
    }

    #[test]
    fn memory_goes_back_in_whole_free_runs() {
        //              0      1      2     3      4      5      6
        let free = [true, true, false, true, true, true, false];
        let resident = [false, true, true, false, false, false, true];
        // Blocks 0-1 hold a resident block: the run goes whole (block 0's pages shared with 1
        // too); 3-5 were all given back before: nothing to do there.
        assert_eq!(release_runs(&free, &resident), [0, 1]);
        let resident = [false, false, true, false, true, false, true];
        assert_eq!(release_runs(&free, &resident), [3, 4, 5]);
        assert!(release_runs(&free, &[false; 7]).is_empty());
    }

    #[test]
    fn the_first_token_gate_refuses_a_prompt_predicted_to_be_read_too_late() {
        let limits = SchedulerLimits::new(8, 512);
        // Off: everybody passes and is counted.
        limits.admit_prompt(400, None).unwrap();
        assert_eq!(limits.prefill_backlog(), 400);
        limits.set_max_prefill_wait_ms(800);
        limits.admit_prompt(400, None).unwrap();
        // Before the rate is measured, two budgets (1,024 tokens) are let in, no more.
        let refused = limits.admit_prompt(300, None).unwrap_err();
        assert_eq!(refused.unmeasured_limit_tokens, Some(1024));
        assert_eq!(refused.backlog_tokens, 800);
        limits.admit_prompt(224, None).unwrap();
        assert_eq!(limits.gate_refusals(), 1);
        limits.gate_refusals.store(0, Ordering::Relaxed);
        limits
            .prefill_rate
            .store(1000f64.to_bits(), Ordering::Relaxed);
        set_backlog(&limits, 0);
        limits.admit_prompt(2000, None).unwrap();
        // 2,000 tokens ahead at 1,000 a second: 2.1 s predicted for 100 more, above 800 ms.
        let refused = limits.admit_prompt(100, None).unwrap_err();
        assert_eq!(refused.backlog_tokens, 2000);
        assert!((refused.predicted_ms - 2100.0).abs() < 1e-6);
        assert_eq!(refused.margin_ms, 0.0);
        assert_eq!(limits.prefill_backlog(), 2000, "a refusal is not counted");
        set_backlog(&limits, 300);
        limits.admit_prompt(400, None).unwrap();
        assert!(limits.admit_prompt(200, None).is_err());
        assert_eq!(limits.gate_refusals(), 2);
        // Measured at 1,024 prompt tokens a step, the budget now 512: half the rate.
        limits.prefill_rate_read.store(1024, Ordering::Relaxed);
        assert!((limits.prefill_rate() - 500.0).abs() < 1e-9);
        limits.set_max_prefill_wait_ms(0);
        limits.admit_prompt(10_000, None).unwrap();
    }

    #[test]
    fn with_a_ttft_objective_prompts_read_within_it_go_in_arrival_order() {
        let limits = SchedulerLimits::new(8, 512);
        limits
            .prefill_rate
            .store(1000f64.to_bits(), Ordering::Relaxed);
        // No objective: the fair order.
        assert_eq!(limits.deadline_tokens(), None);
        limits.set_ttft_objective_ms(700);
        // 700 prompt tokens are read within 700 ms at 1,000 a second.
        let fits = limits.deadline_tokens();
        assert_eq!(fits, Some(700));
        // A 400-token prompt that arrived at clock 1,000 goes before a 60-token one that
        // arrived at 1,300: fair tags 1,400 against 1,360, arrival 1,000 against 1,300.
        assert!(prefill_key(1400, 400, None) > prefill_key(1360, 60, None));
        assert!(prefill_key(1400, 400, fits) < prefill_key(1360, 60, fits));
        // A 3,000-token document that arrived at clock 1,000 keeps its fair tag: prompts
        // arriving until 3,000 prompt tokens were read after it still go first, then it does.
        assert_eq!(prefill_key(4000, 3000, fits), 4000);
        assert!(prefill_key(4000, 3000, fits) > prefill_key(3999 + 60, 60, fits));
        assert!(prefill_key(4000, 3000, fits) < prefill_key(4001 + 60, 60, fits));
        // Unknown rate: nothing to judge by, the fair order.
        limits.prefill_rate.store(0, Ordering::Relaxed);
        assert_eq!(limits.deadline_tokens(), None);
    }

    #[test]
    fn the_gate_adds_the_measured_margin_to_its_prediction() {
        let limits = SchedulerLimits::new(8, 512);
        limits.set_max_prefill_wait_ms(800);
        limits
            .prefill_rate
            .store(1000f64.to_bits(), Ordering::Relaxed);
        set_backlog(&limits, 300);
        // The prediction is handed back: 300 ahead plus 200 at 1,000 a second.
        let predicted = limits.admit_prompt(200, None).unwrap().unwrap();
        assert!((predicted - 500.0).abs() < 1e-3);
        // First tokens 100-199 ms later than predicted: no margin before 20 of them.
        for i in 0..MIN_MARGIN_SAMPLES - 1 {
            limits.record_first_token(500.0, 600.0 + i as f32 * 5.0);
        }
        assert_eq!(limits.first_token_margin_ms(), 0.0);
        for i in 0..81 {
            limits.record_first_token(500.0, 600.0 + (i % 20) as f32 * 5.0);
        }
        // 100 misses of 100-195 ms: the 99th percentile is 195 ms.
        assert!((limits.first_token_margin_ms() - 195.0).abs() < 1e-3);
        // 500 ahead plus 100: 600 ms predicted, 795 with the margin: in; 110 more: out.
        set_backlog(&limits, 500);
        limits.admit_prompt(100, None).unwrap();
        set_backlog(&limits, 500);
        let refused = limits.admit_prompt(110, None).unwrap_err();
        assert!((refused.margin_ms - 195.0).abs() < 1e-3);
        // Nothing ahead: in, whatever the margin.
        set_backlog(&limits, 0);
        limits.admit_prompt(5000, None).unwrap();
        // Early first tokens make no negative margin; only the latest 256 count.
        for _ in 0..MARGIN_SAMPLES {
            limits.record_first_token(500.0, 300.0);
        }
        assert_eq!(limits.first_token_margin_ms(), 0.0);
    }
}
