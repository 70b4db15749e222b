//! The degradation controller of one model: every window (one second by default) it reads how
//! full memory is and how slow the last requests were, and moves the model's limits before
//! anything breaks.
//!
//! # Levers, in order of cost
//!
//! 0. **Memory nobody uses** (`kv_resident_blocks`): while memory is above the scaling
//!    watermark, the prefix cache's unreferenced blocks are dropped and the pages of free KV
//!    blocks go back to the system. Free blocks are reused last-freed first, so the pool's mapped
//!    memory follows its peak use; this lever brings it down to its present use.
//! 1. **The prefill budget** (`max_prefill_tokens`): prompt tokens per engine step. Each step
//!    carries one token of every running stream plus some prompt; a big prompt chunk makes the
//!    step slow and every stream waits for it. When inter-token latency (ITL) p99 is above its
//!    objective the budget shrinks, so running streams keep their pace while long prompts still
//!    progress by the floor's worth of tokens per step.
//! 2. **The batch** (`max_num_seqs`, `max_num_batched_tokens`): halved per window while memory
//!    is above the scaling watermark (and not already falling); `max_num_seqs` also shrinks
//!    when ITL stays above its objective with the prefill budget at its floor (the decode steps
//!    themselves are too slow).
//! 3. **The first-token gate** (`first_token_gate_ms`), then **admission** (`max_in_flight`):
//!    with a time-to-first-token (TTFT) objective the engine refuses at once (429 with
//!    Retry-After) a prompt it predicts to be read later than the gate allows (0.9 × the
//!    objective to start with, plus a margin it measures: how much later than predicted first
//!    tokens came). When TTFT p99 is still above the objective, the gate tightens (its
//!    prediction misses the time outside the engine); only with the gate at its floor are fewer
//!    requests let in at once. A cut that did not lower TTFT p99 is undone and held: the
//!    prompts' own prefill dominates, not the queue.
//! 4. **Saturation**: at the saturation watermark of memory or of the KV pool, no new prefill
//!    starts and admission takes nobody new, so running sequences are never preempted for
//!    newcomers.
//!
//! # Hysteresis
//!
//! Decreases are multiplicative: memory halves the batch (×0.5); latency scales a lever by
//! `objective / p99`, clamped to [0.5, 0.9], which lands near the objective in one or two
//! windows when latency is roughly proportional to the lever (the prefill budget is sized so the
//! whole step, every stream's token plus the prompt chunk, meets the objective). Growth is
//! additive (one sequence, 256 batched tokens, 16 prefill tokens, one admission slot, a
//! sixteenth of the gate's ceiling per window)
//! and happens only while every signal is inside its healthy band (latency below 0.8 ×
//! objective, or for the prefill budget: the bigger step predicted at or below 0.85 × the
//! inter-token objective, which it is cut towards once p99 passes 0.9 × it, and under traffic
//! only on a measured p99;
//! memory below the scaling watermark minus 0.05) and the engine is actually held back by the
//! cap it would raise
//! (or idle). Between the band and the objective the limits hold. Latency is judged only on
//! samples that finished after the lever last moved, so one slow burst is not punished twice.
//!
//! The controller is pure: the server reads memory, the engine's counters and the latency
//! samples, calls [`Controller::observe`] once per window, applies [`Decision::limits`] and
//! records every [`Change`] with its cause.

use std::collections::VecDeque;
use std::fmt;

use serde::Serialize;

/// The limits the controller moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Limits {
    /// Most sequences running at once in the engine.
    pub max_num_seqs: usize,
    /// Most tokens (decode + prompt) in one engine step.
    pub max_num_batched_tokens: usize,
    /// Most prompt tokens in one engine step.
    pub max_prefill_tokens: usize,
    /// Most requests admitted at once (beyond: 429 at once).
    pub max_in_flight: usize,
    /// Whether new sequences may start their prefill.
    pub admit_prefills: bool,
    /// The first-token gate: the most a new prompt may be predicted to wait to be read
    /// (milliseconds; beyond: 429 at once). 0: no gate (no TTFT objective).
    pub first_token_gate_ms: usize,
}

/// The explicit rule operators already use: when the batch is above `batch_size` and request
/// latency p99 is above `p99_latency_ms`, `max_num_seqs` drops to `batch_size`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rule {
    pub p99_latency_ms: f64,
    pub batch_size: usize,
}

/// Additive growth per healthy window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Growth {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_prefill_tokens: usize,
    pub max_in_flight: usize,
}

impl Default for Growth {
    fn default() -> Self {
        Self {
            max_num_seqs: 1,
            max_num_batched_tokens: 256,
            max_prefill_tokens: 16,
            max_in_flight: 1,
        }
    }
}

/// How the controller decides.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// TTFT p99 objective; none: admission is not steered by latency.
    pub ttft_p99_ms: Option<f64>,
    /// Inter-token latency p99 objective; none: the prefill budget is not steered.
    pub itl_p99_ms: Option<f64>,
    /// Memory share where degradation starts.
    pub scaling: f64,
    /// Memory (or KV pool) share where new prefills stop and admission sheds.
    pub saturation: f64,
    /// Memory PSI `some avg10` (percent) that counts as reaching the scaling watermark.
    pub psi_some_avg10: f64,
    pub rule: Option<Rule>,
    /// The configured limits: growth never goes beyond them.
    pub ceilings: Limits,
    /// Decreases never go below these.
    pub floors: Limits,
    pub growth: Growth,
    /// Windows of latency samples the p99s look at.
    pub horizon_windows: u64,
    /// Fewest samples a p99 is judged on.
    pub min_ttft_samples: usize,
    pub min_itl_samples: usize,
    /// Fewest first-token samples (of requests let in since the TTFT levers last moved) that
    /// let admission or the first-token gate grow. A cut may follow a few slow samples; growth
    /// needs more: the largest of five samples is below the true p99 95% of the time, so a
    /// "healthy" p99 on five samples is no evidence, and growing on it pushed p99 over the
    /// objective again and again.
    pub min_ttft_growth_samples: usize,
}

/// The healthy band: a latency below this share of its objective lets its lever grow.
pub const HEALTHY_SHARE: f64 = 0.8;
/// The inter-token objective is kept with a margin: a window's p99 above `ITL_ACT_SHARE` of
/// the objective cuts the prefill budget so the step is predicted at `ITL_TARGET_SHARE` of it,
/// and the budget grows only when the bigger step is predicted at or below that share. The
/// p99 of a whole run collects the worst windows' tails: with windows held right at the
/// objective the clients' p99 over a run was 1.1× it, and with cuts aimed at 0.9× still
/// 0.98–1.07× (docs/perf.md).
pub const ITL_ACT_SHARE: f64 = 0.9;
/// See [`ITL_ACT_SHARE`].
pub const ITL_TARGET_SHARE: f64 = 0.85;
/// Free mapped KV blocks worth a release (fewer are not worth a record every window).
pub const MIN_RELEASE_BLOCKS: usize = 16;

/// Memory must be this far below the scaling watermark before limits grow.
pub const MEMORY_HYSTERESIS: f64 = 0.05;
/// The first-token gate's floor is its ceiling over this; it grows back by its ceiling over
/// [`GATE_GROWTH_DIVISOR`] per healthy window.
pub const GATE_FLOOR_DIVISOR: usize = 8;
pub const GATE_GROWTH_DIVISOR: usize = 16;

impl Settings {
    /// Defaults around the configured limits: watermarks 0.80 and 0.95, floors of one
    /// sequence, 16 prefill tokens (one KV block; never above the configured budget) and one
    /// admission slot.
    pub fn new(ceilings: Limits) -> Self {
        let min_prefill = 16.min(ceilings.max_prefill_tokens).max(1);
        Self {
            ttft_p99_ms: None,
            itl_p99_ms: None,
            scaling: 0.80,
            saturation: 0.95,
            psi_some_avg10: 10.0,
            rule: None,
            ceilings,
            floors: Limits {
                max_num_seqs: 1,
                // Every running sequence's decode token fits in a step at the floor.
                max_num_batched_tokens: ceilings
                    .max_num_seqs
                    .max(min_prefill)
                    .min(ceilings.max_num_batched_tokens)
                    .max(1),
                max_prefill_tokens: min_prefill,
                max_in_flight: 1,
                admit_prefills: false,
                // Never 0 (no gate) when there is one.
                first_token_gate_ms: ceilings.first_token_gate_ms.div_ceil(GATE_FLOOR_DIVISOR),
            },
            growth: Growth::default(),
            horizon_windows: 10,
            min_ttft_samples: 5,
            min_itl_samples: 20,
            min_ttft_growth_samples: 30,
        }
    }
}

/// What one window saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observation {
    /// Memory used over its limit (the largest of the readings the server has: cgroup, RSS
    /// against the configured limit, the host).
    pub memory_ratio: Option<f64>,
    /// Memory PSI `some avg10`, percent.
    pub memory_psi_some_avg10: Option<f64>,
    /// KV blocks held by sequences over the pool.
    pub kv_ratio: Option<f64>,
    /// Time to first token of the requests whose first token came in this window.
    pub ttft_ms: Vec<f64>,
    /// For each of `ttft_ms` (when given): how many windows before this one its request
    /// arrived. A lever is judged only on requests that arrived after it moved (requests
    /// admitted before a cut still queue behind each other after it).
    pub ttft_arrived_windows_ago: Vec<u32>,
    /// Gaps between consecutive tokens of a stream, this window.
    pub itl_ms: Vec<f64>,
    /// Whole-request latency of the requests that ended this window (for the explicit rule).
    pub e2e_ms: Vec<f64>,
    /// Sequences running in the engine at the window's end.
    pub running: usize,
    /// Sequences waiting in the engine at the window's end.
    pub waiting: usize,
    /// Most requests admitted at once during the window.
    pub in_flight_peak: usize,
    /// Requests refused by the admission limit during the window.
    pub shed: u64,
    /// Prompts refused by the first-token gate during the window.
    pub gate_refused: u64,
    /// Whether a step left prompt tokens for later because of the prefill budget.
    pub prefill_held: bool,
    /// KV blocks whose pages are mapped, and those held by sequences (the rest is free or
    /// cached and can go back to the system).
    pub kv_resident_blocks: usize,
    pub kv_held_blocks: usize,
}

/// Which limit moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lever {
    MaxNumSeqs,
    MaxNumBatchedTokens,
    MaxPrefillTokens,
    MaxInFlight,
    AdmitPrefills,
    FirstTokenGate,
    /// Not a limit: the mapped KV blocks, brought down to those in use.
    KvResidentBlocks,
}

impl Lever {
    pub fn as_str(self) -> &'static str {
        match self {
            Lever::MaxNumSeqs => "max_num_seqs",
            Lever::MaxNumBatchedTokens => "max_num_batched_tokens",
            Lever::MaxPrefillTokens => "max_prefill_tokens",
            Lever::MaxInFlight => "max_in_flight",
            Lever::AdmitPrefills => "admit_prefills",
            Lever::FirstTokenGate => "first_token_gate_ms",
            Lever::KvResidentBlocks => "kv_resident_blocks",
        }
    }
}

/// Why it moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    /// Memory above the scaling watermark.
    Memory,
    /// Memory above the saturation watermark.
    MemorySaturated,
    /// The KV pool above the saturation watermark.
    KvSaturated,
    /// TTFT p99 above its objective.
    Ttft,
    /// Inter-token latency p99 above its objective.
    Itl,
    /// The explicit batch rule.
    Rule,
    /// Every signal healthy: growing back.
    Recovery,
}

impl Cause {
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Memory => "memory",
            Cause::MemorySaturated => "memory_saturated",
            Cause::KvSaturated => "kv_saturated",
            Cause::Ttft => "ttft",
            Cause::Itl => "itl",
            Cause::Rule => "rule",
            Cause::Recovery => "recovery",
        }
    }
}

/// One limit change and its cause, in words a person can read later.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Change {
    pub lever: Lever,
    pub from: usize,
    pub to: usize,
    pub cause: Cause,
    pub detail: String,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} -> {} ({}: {})",
            self.lever.as_str(),
            self.from,
            self.to,
            self.cause.as_str(),
            self.detail
        )
    }
}

/// How degraded the model is: 0 every limit at its ceiling; 1 only the prefill budget
/// trimmed; 2 the batch or admission reduced; 3 saturated (no new prefill).
pub type Level = u8;

/// The signals a window was judged on.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Signals {
    pub memory_ratio: Option<f64>,
    pub memory_psi_some_avg10: Option<f64>,
    pub kv_ratio: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub itl_p99_ms: Option<f64>,
    pub e2e_p99_ms: Option<f64>,
}

/// One window's outcome.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    pub window: u64,
    pub limits: Limits,
    pub level: Level,
    pub signals: Signals,
    pub changes: Vec<Change>,
}

/// The controller of one model.
#[derive(Debug, Clone)]
pub struct Controller {
    settings: Settings,
    limits: Limits,
    window: u64,
    /// Window of the first token, window of arrival, milliseconds.
    ttft: VecDeque<(u64, u64, f64)>,
    itl: VecDeque<(u64, f64)>,
    e2e: VecDeque<(u64, f64)>,
    /// Window of the last change of the levers each latency judges.
    itl_moved: u64,
    ttft_moved: u64,
    rule_moved: u64,
    /// The most requests in flight or waiting, per window (the base admission shrinks from).
    peaks: VecDeque<(u64, usize)>,
    /// The lever (the first-token gate or admission), its value and TTFT p99 before the last
    /// cut for TTFT.
    ttft_cut: Option<(Lever, usize, f64)>,
    /// No TTFT cut before this window (a cut that did not help was undone).
    ttft_hold_until: u64,
    last_memory: Option<f64>,
    /// The explicit rule holds `max_num_seqs` down.
    rule_active: bool,
}

fn p99(samples: &VecDeque<(u64, f64)>, after: u64, min: usize) -> Option<f64> {
    p99_of(
        samples
            .iter()
            .filter(|(w, _)| *w > after)
            .map(|(_, v)| *v)
            .collect(),
        min,
    )
}

/// The 99th percentile (nearest rank) of the finite values; none with fewer than `min`.
pub fn p99_of(values: Vec<f64>, min: usize) -> Option<f64> {
    let mut values: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
    if values.len() < min.max(1) {
        return None;
    }
    values.sort_by(|a, b| a.total_cmp(b));
    let rank = ((values.len() as f64) * 0.99).ceil() as usize;
    Some(values[rank.clamp(1, values.len()) - 1])
}

/// Scales `value` by `objective / observed` clamped to [0.5, 0.9], never below `floor` and
/// always at least one below `value` (when above the floor).
fn scaled_down(value: usize, objective: f64, observed: f64, floor: usize) -> usize {
    let factor = (objective / observed).clamp(0.5, 0.9);
    let next = ((value as f64) * factor).floor() as usize;
    next.min(value.saturating_sub(1)).max(floor)
}

impl Controller {
    pub fn new(settings: Settings) -> Self {
        let limits = settings.ceilings;
        Self {
            settings,
            limits,
            window: 0,
            ttft: VecDeque::new(),
            itl: VecDeque::new(),
            e2e: VecDeque::new(),
            itl_moved: 0,
            ttft_moved: 0,
            rule_moved: 0,
            peaks: VecDeque::new(),
            ttft_cut: None,
            ttft_hold_until: 0,
            last_memory: None,
            rule_active: false,
        }
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn level(&self) -> Level {
        let (l, c) = (&self.limits, &self.settings.ceilings);
        if !l.admit_prefills && c.admit_prefills {
            3
        } else if l.max_num_seqs < c.max_num_seqs
            || l.max_num_batched_tokens < c.max_num_batched_tokens
            || l.max_in_flight < c.max_in_flight
        {
            2
        } else if l.max_prefill_tokens < c.max_prefill_tokens
            || l.first_token_gate_ms < c.first_token_gate_ms
        {
            1
        } else {
            0
        }
    }

    fn set(
        &mut self,
        lever: Lever,
        to: usize,
        cause: Cause,
        detail: String,
        out: &mut Vec<Change>,
    ) {
        let slot = match lever {
            Lever::MaxNumSeqs => &mut self.limits.max_num_seqs,
            Lever::MaxNumBatchedTokens => &mut self.limits.max_num_batched_tokens,
            Lever::MaxPrefillTokens => &mut self.limits.max_prefill_tokens,
            Lever::MaxInFlight => &mut self.limits.max_in_flight,
            Lever::FirstTokenGate => &mut self.limits.first_token_gate_ms,
            Lever::AdmitPrefills => {
                let to = to != 0;
                if self.limits.admit_prefills != to {
                    out.push(Change {
                        lever,
                        from: self.limits.admit_prefills as usize,
                        to: to as usize,
                        cause,
                        detail,
                    });
                    self.limits.admit_prefills = to;
                }
                return;
            }
            Lever::KvResidentBlocks => {
                out.push(Change {
                    lever,
                    from: 0,
                    to,
                    cause,
                    detail,
                });
                return;
            }
        };
        if *slot != to {
            out.push(Change {
                lever,
                from: *slot,
                to,
                cause,
                detail,
            });
            *slot = to;
        }
    }

    /// Judges one window and moves the limits.
    pub fn observe(&mut self, obs: &Observation) -> Decision {
        self.window += 1;
        let w = self.window;
        let horizon = self.settings.horizon_windows.max(1);
        for (i, &v) in obs.ttft_ms.iter().enumerate() {
            let ago = obs.ttft_arrived_windows_ago.get(i).copied().unwrap_or(0);
            self.ttft
                .push_back((w, w.saturating_sub(u64::from(ago)), v));
        }
        while self
            .ttft
            .front()
            .is_some_and(|(at, _, _)| at + horizon <= w)
        {
            self.ttft.pop_front();
        }
        while self.ttft.len() > 65_536 {
            self.ttft.pop_front();
        }
        for (queue, samples) in [(&mut self.itl, &obs.itl_ms), (&mut self.e2e, &obs.e2e_ms)] {
            queue.extend(samples.iter().map(|&v| (w, v)));
            while queue.front().is_some_and(|(at, _)| at + horizon <= w) {
                queue.pop_front();
            }
            // Bounded memory whatever the traffic.
            while queue.len() > 65_536 {
                queue.pop_front();
            }
        }
        self.peaks.push_back((w, obs.in_flight_peak));
        while self.peaks.front().is_some_and(|(at, _)| at + horizon <= w) {
            self.peaks.pop_front();
        }
        let s = self.settings.clone();
        let c = s.ceilings;
        let f = s.floors;
        let mut changes = Vec::new();

        let memory = obs.memory_ratio;
        let psi_high = obs
            .memory_psi_some_avg10
            .is_some_and(|p| p >= s.psi_some_avg10);
        let mem = memory.map(|m| if psi_high { m.max(s.scaling) } else { m });
        let mem = mem.or(psi_high.then_some(s.scaling));
        let falling = match (mem, self.last_memory) {
            (Some(now), Some(before)) => now < before - 0.005,
            _ => false,
        };
        self.last_memory = mem;
        let kv = obs.kv_ratio;
        let mem_saturated = mem.is_some_and(|m| m >= s.saturation);
        let kv_saturated = kv.is_some_and(|k| k >= s.saturation);
        let mem_high = mem.is_some_and(|m| m >= s.scaling);
        let mem_healthy = mem.is_none_or(|m| m < s.scaling - MEMORY_HYSTERESIS);
        let kv_healthy = kv.is_none_or(|k| k < s.scaling);

        let signals = Signals {
            memory_ratio: memory,
            memory_psi_some_avg10: obs.memory_psi_some_avg10,
            kv_ratio: kv,
            ttft_p99_ms: p99_of(
                self.ttft
                    .iter()
                    .filter(|(_, arrived, _)| *arrived > self.ttft_moved)
                    .map(|(_, _, v)| *v)
                    .collect(),
                s.min_ttft_samples,
            ),
            itl_p99_ms: p99(&self.itl, self.itl_moved, s.min_itl_samples),
            e2e_p99_ms: p99(&self.e2e, self.rule_moved, s.min_ttft_samples),
        };

        // Saturation: nobody new starts a prefill or gets in; running sequences are kept.
        if mem_saturated || kv_saturated {
            let (cause, detail) = if mem_saturated {
                (
                    Cause::MemorySaturated,
                    format!(
                        "memory at {:.3} of its limit, saturation watermark {:.2}",
                        mem.unwrap_or(0.0),
                        s.saturation
                    ),
                )
            } else {
                (
                    Cause::KvSaturated,
                    format!(
                        "KV pool at {:.3}, saturation watermark {:.2}",
                        kv.unwrap_or(0.0),
                        s.saturation
                    ),
                )
            };
            self.set(Lever::AdmitPrefills, 0, cause, detail.clone(), &mut changes);
            let hold = obs
                .in_flight_peak
                .min(self.limits.max_in_flight)
                .max(f.max_in_flight);
            self.set(Lever::MaxInFlight, hold, cause, detail, &mut changes);
        } else if !self.limits.admit_prefills
            && mem.is_none_or(|m| m < s.scaling)
            && kv.is_none_or(|k| k < s.scaling)
        {
            let detail = format!(
                "memory {} and KV pool {} below the scaling watermark {:.2}",
                fmt_ratio(mem),
                fmt_ratio(kv),
                s.scaling
            );
            self.set(
                Lever::AdmitPrefills,
                1,
                Cause::Recovery,
                detail,
                &mut changes,
            );
        }

        // Memory above the scaling watermark: first give back what nobody uses, and judge the
        // batch only on the next window's reading, after the release. Idle with limits below
        // their ceilings and memory between the recovery band and the watermark, the limits
        // could never grow back (growth needs memory below the band, and the prefix cache keeps
        // its pages while nothing runs): the same release, as a recovery step.
        let idle = obs.running == 0 && obs.waiting == 0 && obs.in_flight_peak == 0;
        let worth = obs.kv_resident_blocks >= obs.kv_held_blocks + MIN_RELEASE_BLOCKS;
        let idle_release = idle && !mem_high && !mem_healthy && self.level() > 0;
        let releasing = (mem_high || idle_release) && worth;
        if releasing {
            let (cause, detail) = if mem_high {
                (
                    if mem_saturated {
                        Cause::MemorySaturated
                    } else {
                        Cause::Memory
                    },
                    format!(
                        "memory at {:.3} of its limit, scaling watermark {:.2}: free and cached KV pages go back",
                        mem.unwrap_or(0.0),
                        s.scaling
                    ),
                )
            } else {
                (
                    Cause::Recovery,
                    format!(
                        "idle, memory at {:.3} of its limit, limits grow back below {:.2}: free and cached KV pages go back",
                        mem.unwrap_or(0.0),
                        s.scaling - MEMORY_HYSTERESIS
                    ),
                )
            };
            changes.push(Change {
                lever: Lever::KvResidentBlocks,
                from: obs.kv_resident_blocks,
                to: obs.kv_held_blocks,
                cause,
                detail,
            });
        }

        // Memory above the scaling watermark and not already falling (nor about to fall by a
        // release): halve the batch.
        if mem_high && !falling && !releasing {
            let detail = format!(
                "memory at {:.3} of its limit, scaling watermark {:.2}",
                mem.unwrap_or(0.0),
                s.scaling
            );
            let cause = if mem_saturated {
                Cause::MemorySaturated
            } else {
                Cause::Memory
            };
            let seqs = (self.limits.max_num_seqs / 2).max(f.max_num_seqs);
            self.set(Lever::MaxNumSeqs, seqs, cause, detail.clone(), &mut changes);
            let tokens = (self.limits.max_num_batched_tokens / 2).max(f.max_num_batched_tokens);
            self.set(
                Lever::MaxNumBatchedTokens,
                tokens,
                cause,
                detail,
                &mut changes,
            );
            self.limits.max_prefill_tokens = self
                .limits
                .max_prefill_tokens
                .min(self.limits.max_num_batched_tokens);
        }

        // The explicit rule.
        if let (Some(rule), Some(e2e)) = (s.rule, signals.e2e_p99_ms) {
            let batch = obs
                .running
                .max(self.limits.max_num_seqs.min(obs.running + obs.waiting));
            if e2e > rule.p99_latency_ms && batch > rule.batch_size {
                let to = rule
                    .batch_size
                    .min(self.limits.max_num_seqs)
                    .max(f.max_num_seqs);
                let detail = format!(
                    "request latency p99 {e2e:.0} ms above {:.0} ms with {batch} sequences (rule batch size {})",
                    rule.p99_latency_ms, rule.batch_size
                );
                let before = changes.len();
                self.set(Lever::MaxNumSeqs, to, Cause::Rule, detail, &mut changes);
                self.rule_active = true;
                if changes.len() > before {
                    self.rule_moved = w;
                }
            } else if e2e < rule.p99_latency_ms * HEALTHY_SHARE {
                self.rule_active = false;
            }
        }

        // Inter-token latency: the prefill budget first, then the batch.
        let mut itl_healthy = true;
        if let (Some(objective), Some(observed)) = (s.itl_p99_ms, signals.itl_p99_ms) {
            if observed > objective * ITL_ACT_SHARE {
                itl_healthy = false;
                let detail = if observed > objective {
                    format!(
                        "inter-token latency p99 {observed:.0} ms above the objective {objective:.0} ms"
                    )
                } else {
                    format!(
                        "inter-token latency p99 {observed:.0} ms within {:.0}% of the objective {objective:.0} ms",
                        (1.0 - ITL_ACT_SHARE) * 100.0
                    )
                };
                let target = objective * ITL_TARGET_SHARE;
                let before = changes.len();
                if self.limits.max_prefill_tokens > f.max_prefill_tokens {
                    // A step's time grows with its tokens (every running stream's one plus the
                    // prompt budget): size the budget so the whole step meets the objective,
                    // cutting by half at most and by a tenth at least.
                    let p = self.limits.max_prefill_tokens;
                    let fitting =
                        step_tokens(obs.running, p) * target / observed - obs.running as f64;
                    let to = (fitting.floor().clamp((p / 2) as f64, (p * 9 / 10) as f64) as usize)
                        .min(p - 1)
                        .max(f.max_prefill_tokens);
                    self.set(
                        Lever::MaxPrefillTokens,
                        to,
                        Cause::Itl,
                        detail,
                        &mut changes,
                    );
                } else if self.limits.max_num_seqs > f.max_num_seqs
                    && obs.running >= self.limits.max_num_seqs.saturating_sub(1).max(1)
                {
                    let to =
                        scaled_down(self.limits.max_num_seqs, target, observed, f.max_num_seqs);
                    self.set(Lever::MaxNumSeqs, to, Cause::Itl, detail, &mut changes);
                }
                if changes.len() > before {
                    self.itl_moved = w;
                }
            } else if observed > objective * HEALTHY_SHARE {
                itl_healthy = false;
            }
        }

        // Time to first token: the first-token gate, then admission.
        let mut ttft_healthy = true;
        if let (Some(objective), Some(observed)) = (s.ttft_p99_ms, signals.ttft_p99_ms) {
            if observed > objective && w < self.ttft_hold_until {
                ttft_healthy = false;
            } else if let Some((lever, before, before_p99)) = self
                .ttft_cut
                .filter(|(_, _, p99)| observed > objective && observed >= 0.95 * p99)
            {
                // Refusing more did not make first tokens faster: the prompts' own prefill
                // dominates, not the queue. Undo the cut and hold.
                ttft_healthy = false;
                let what = match lever {
                    Lever::FirstTokenGate => format!(
                        "a first-token gate of {} ms",
                        self.limits.first_token_gate_ms
                    ),
                    _ => format!("admitting {}", self.limits.max_in_flight),
                };
                let detail = format!(
                    "{what} did not lower time to first token p99 ({before_p99:.0} ms before, {observed:.0} ms after; objective {objective:.0} ms): the prompts' own prefill dominates, not the queue; back to {before} and holding for {horizon} windows"
                );
                self.set(lever, before, Cause::Ttft, detail, &mut changes);
                self.ttft_cut = None;
                self.ttft_moved = w;
                self.ttft_hold_until = w + horizon;
            } else if observed > objective
                && self.limits.first_token_gate_ms > f.first_token_gate_ms
            {
                // The gate first: it refuses only the prompts predicted to be read late, where
                // admission refuses whoever comes and thins the batch. Its prediction misses
                // what happens outside the engine's queue and prompts that overtake; the
                // measured p99 corrects it.
                ttft_healthy = false;
                let gate = self.limits.first_token_gate_ms;
                let to = scaled_down(gate, objective, observed, f.first_token_gate_ms);
                let detail = format!(
                    "time to first token p99 {observed:.0} ms above the objective {objective:.0} ms: prompts predicted to wait more than {to} ms to be read are refused"
                );
                let before = changes.len();
                self.set(Lever::FirstTokenGate, to, Cause::Ttft, detail, &mut changes);
                if changes.len() > before {
                    self.ttft_moved = w;
                    self.ttft_cut = Some((Lever::FirstTokenGate, gate, observed));
                }
            } else if observed > objective {
                ttft_healthy = false;
                // The most that were in while the judged samples came in (not this window's
                // alone: a burst may have ended).
                let peak = self
                    .peaks
                    .iter()
                    .filter(|(at, _)| *at > self.ttft_moved)
                    .map(|(_, p)| *p)
                    .max()
                    .unwrap_or(obs.in_flight_peak);
                let base = self.limits.max_in_flight.min(peak.max(f.max_in_flight));
                let to = scaled_down(base + 1, objective, observed, f.max_in_flight)
                    .min(self.limits.max_in_flight);
                let detail = format!(
                    "time to first token p99 {observed:.0} ms above the objective {objective:.0} ms ({peak} in flight at most)"
                );
                let before = changes.len();
                let limit = self.limits.max_in_flight;
                self.set(Lever::MaxInFlight, to, Cause::Ttft, detail, &mut changes);
                if changes.len() > before {
                    self.ttft_moved = w;
                    self.ttft_cut = Some((Lever::MaxInFlight, limit, observed));
                }
            } else {
                self.ttft_cut = None;
                if observed > objective * HEALTHY_SHARE {
                    ttft_healthy = false;
                }
            }
        }

        // Growth: only when nothing moved down this window and every signal is healthy.
        if changes.is_empty() && mem_healthy && kv_healthy && self.limits.admit_prefills {
            let detail = |what: &str| {
                format!(
                    "memory {}, TTFT p99 {}, ITL p99 {}: healthy, {what}",
                    fmt_ratio(mem),
                    fmt_ms(signals.ttft_p99_ms),
                    fmt_ms(signals.itl_p99_ms)
                )
            };
            let seq_limited = obs.waiting > 0 || obs.running >= self.limits.max_num_seqs;
            if itl_healthy && !self.rule_active && (seq_limited || idle) {
                let to = (self.limits.max_num_seqs + s.growth.max_num_seqs).min(c.max_num_seqs);
                self.set(
                    Lever::MaxNumSeqs,
                    to,
                    Cause::Recovery,
                    detail(if idle {
                        "idle"
                    } else {
                        "the engine is at its sequence cap"
                    }),
                    &mut changes,
                );
                let to = (self.limits.max_num_batched_tokens + s.growth.max_num_batched_tokens)
                    .min(c.max_num_batched_tokens);
                self.set(
                    Lever::MaxNumBatchedTokens,
                    to,
                    Cause::Recovery,
                    detail(if idle {
                        "idle"
                    } else {
                        "the engine is at its sequence cap"
                    }),
                    &mut changes,
                );
            }
            let p = self.limits.max_prefill_tokens;
            let grown = (p + s.growth.max_prefill_tokens)
                .min(c.max_prefill_tokens)
                .min(self.limits.max_num_batched_tokens.max(f.max_prefill_tokens));
            // Grow only when the bigger steps would still meet the objective (predicted from
            // the step's tokens), not merely because the last window was fast. Under traffic,
            // no measured p99 (no stream decoding, or too few gaps since the last move) is no
            // evidence: the budget grown while every stream waited for its first token made
            // the steps they were then decoding in stall them.
            let fits = match (s.itl_p99_ms, signals.itl_p99_ms) {
                (Some(objective), Some(observed)) => {
                    observed * step_tokens(obs.running, grown) / step_tokens(obs.running, p)
                        <= objective * ITL_TARGET_SHARE
                }
                (Some(_), None) => idle,
                (None, _) => itl_healthy,
            };
            if fits && (obs.prefill_held || idle) {
                let to = grown;
                // The next growth waits for samples of the bigger steps.
                if !idle && to > p {
                    self.itl_moved = w;
                }
                self.set(
                    Lever::MaxPrefillTokens,
                    to,
                    Cause::Recovery,
                    detail(if idle {
                        "idle"
                    } else {
                        "prompts waited for the prefill budget"
                    }),
                    &mut changes,
                );
            }
            // Under traffic, an objective needs a measured p99 below its band to grow (no
            // samples yet after a cut is not a healthy sign).
            let ttft_measured = s.ttft_p99_ms.is_none()
                || (signals.ttft_p99_ms.is_some()
                    && self
                        .ttft
                        .iter()
                        .filter(|(_, arrived, _)| *arrived > self.ttft_moved)
                        .count()
                        >= s.min_ttft_growth_samples.max(s.min_ttft_samples));
            if ttft_healthy && ((obs.shed > 0 && ttft_measured) || idle) {
                let to = (self.limits.max_in_flight + s.growth.max_in_flight).min(c.max_in_flight);
                // The next growth waits for first tokens of requests let in after this one:
                // growing on the old requests' samples overshoots by the samples' lag.
                if !idle && to > self.limits.max_in_flight && s.ttft_p99_ms.is_some() {
                    self.ttft_moved = w;
                }
                let what = if idle {
                    "idle".to_string()
                } else {
                    format!("{} requests were refused", obs.shed)
                };
                self.set(
                    Lever::MaxInFlight,
                    to,
                    Cause::Recovery,
                    detail(&what),
                    &mut changes,
                );
            }
            // The gate grows back last (it was cut first), while it refused prompts and first
            // tokens are fast.
            let gate = self.limits.first_token_gate_ms;
            if ttft_healthy
                && gate < c.first_token_gate_ms
                && self.limits.max_in_flight >= c.max_in_flight
                && ((obs.gate_refused > 0 && ttft_measured) || idle)
            {
                let step = (c.first_token_gate_ms / GATE_GROWTH_DIVISOR).max(1);
                let to = (gate + step).min(c.first_token_gate_ms);
                if !idle {
                    self.ttft_moved = w;
                }
                let what = if idle {
                    "idle".to_string()
                } else {
                    format!("{} prompts were refused by the gate", obs.gate_refused)
                };
                self.set(
                    Lever::FirstTokenGate,
                    to,
                    Cause::Recovery,
                    detail(&what),
                    &mut changes,
                );
            }
        }
        Decision {
            window: w,
            limits: self.limits,
            level: self.level(),
            signals,
            changes,
        }
    }
}

/// Tokens of a step with `running` streams and a prompt budget of `prefill`.
fn step_tokens(running: usize, prefill: usize) -> f64 {
    (running + prefill).max(1) as f64
}

fn fmt_ratio(v: Option<f64>) -> String {
    v.map_or_else(|| "unknown".into(), |v| format!("{v:.3}"))
}

fn fmt_ms(v: Option<f64>) -> String {
    v.map_or_else(|| "unknown".into(), |v| format!("{v:.0} ms"))
}

#[cfg(test)]
mod tests;
