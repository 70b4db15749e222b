//! The release controller: the state machine that moves the candidate's weight step by step,
//! holds on no data, promotes and rolls back. Pure over (plan, samples, commands, `now_ms`): the
//! server feeds samples (`observe`), monitor alarms (`set_drift`) and commands, calls `tick` about
//! once a second, persists the plan (`ReleasePlan::save_atomic`) whenever decisions came out and
//! turns each `Decision` into a record. A rollback sets the weight to 0 in the plan the router
//! reads, so it takes effect on the next request after the tick that decided it.
//!
//! Phases: `idle` → (`start`) → `gating` (gates not yet reported) → `awaiting_approval` (when
//! `approval.start`) → `running` → step after step → (`approval.promote`: `awaiting_approval`) →
//! `promoted`; `rolled_back` on any failure or command; `paused` by command; `holding` by the
//! controller when a step cannot conclude (inconclusive), until data flows again. A failing test
//! rolls back even while paused or holding: a pause freezes the schedule, not the safety net.
//!
//! The last judged step is the one before 100 %: at 100 % no stable serves concurrently, and a
//! comparison with an earlier window compares two periods of traffic, not two versions (an
//! end-to-end run rolled an identical candidate back there, on the spread of entropy of prompts
//! that had changed since). Passing it promotes (or waits for the promotion's approval).

use serde::{Deserialize, Serialize};

use crate::judge::{Judge, Sample, StepWindow, Verdict};
use crate::plan::{Mode, Phase, ReleaseError, ReleasePlan, Variant};

/// What a decision did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Action {
    Start,
    Step,
    Promote,
    Rollback,
    /// The controller froze the release for lack of data (or to wait for a promotion approval).
    Hold,
    Resume,
    Pause,
    Approve,
    GateFailed,
}

/// One controller decision: kept in the plan's history and emitted as a record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Decision {
    pub time_ms: u64,
    pub action: Action,
    pub from_weight: f64,
    pub to_weight: f64,
    pub stable: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metric: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub statistic: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub e_value: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub p_value: Option<f64>,
    pub samples_stable: u64,
    pub samples_candidate: u64,
    pub reason: String,
    /// `controller`, or the principal of the admin who sent the command.
    pub actor: String,
}

impl Decision {
    #[cfg(test)]
    pub(crate) fn test_example() -> Self {
        Decision {
            time_ms: 1,
            action: Action::Rollback,
            from_weight: 0.05,
            to_weight: 0.0,
            stable: "v1".to_string(),
            candidate: Some("v2".to_string()),
            metric: Some("ttft_p95".to_string()),
            statistic: Some(1.5),
            threshold: Some(1.1),
            e_value: Some(900.0),
            p_value: Some(1.0 / 900.0),
            samples_stable: 300,
            samples_candidate: 12,
            reason: "slower".to_string(),
            actor: "controller".to_string(),
        }
    }
}

/// An operator's (or the server's) command.
#[derive(Debug, Clone, PartialEq)]
pub enum Command {
    /// Start releasing `candidate`. `tokenizer_change` says how the candidate's tokenizer differs
    /// from the stable's (`rampart model diff`), `None` when it does not; `gates_passed` is the gates' result when already known (`None`:
    /// the release waits in `gating` for `GateResult`).
    Start {
        candidate: String,
        mode: Option<Mode>,
        tokenizer_change: Option<String>,
        gates_passed: Option<bool>,
    },
    /// The gates' result for a release in `gating`.
    GateResult {
        passed: bool,
        detail: String,
    },
    Approve,
    /// Jump to 100% and make the candidate the stable.
    Promote,
    Pause,
    Resume,
    Rollback {
        reason: String,
    },
}

impl Command {
    fn name(&self) -> &'static str {
        match self {
            Command::Start { .. } => "start",
            Command::GateResult { .. } => "gate_result",
            Command::Approve => "approve",
            Command::Promote => "promote",
            Command::Pause => "pause",
            Command::Resume => "resume",
            Command::Rollback { .. } => "rollback",
        }
    }
}

/// What `GET /admin/releases/<model>` shows.
#[derive(Debug, Clone, Serialize)]
pub struct Status {
    pub stable: String,
    pub candidate: Option<String>,
    pub mode: Mode,
    pub phase: Phase,
    pub step: usize,
    /// The current step's weight (canary, A/B: the candidate's share of users; shadow: where
    /// the schedule stands, while the candidate serves no user).
    pub weight: f64,
    /// Shadow mode: the share of requests mirrored to the candidate (and the control).
    pub mirrored_share: Option<f64>,
    pub release_id: String,
    /// What the candidate's latency is compared with: `control` (a copy of the stable at the
    /// candidate's share, the default) or `stable`; the verdict's latency rows' `stable` column
    /// is the reference's. Errors, entropy and confidence are compared with every sample of the
    /// stable version (`samples_stable` counts the control's too).
    pub reference: Variant,
    pub samples_stable: u64,
    pub samples_control: u64,
    pub samples_candidate: u64,
    pub errors_stable: u64,
    pub errors_candidate: u64,
    /// Answers of each variant rated in this step (each counted once, with its latest
    /// rating), and how many of them helpful: the helpful-rate test's samples.
    pub ratings_stable: u64,
    pub ratings_candidate: u64,
    pub helpful_stable: u64,
    pub helpful_candidate: u64,
    pub time_in_step_ms: u64,
    pub reason: Option<String>,
    /// The judge's last verdict (with per-metric statistics), if a tick judged.
    pub last_verdict: Option<Verdict>,
}

/// The release controller of one model.
#[derive(Debug, Clone)]
pub struct Controller {
    plan: ReleasePlan,
    window: StepWindow,
    last_verdict: Option<Verdict>,
    last_tick_ms: u64,
}

impl Controller {
    /// A controller over a plan read from disk (it may be mid-release: the window restarts empty
    /// at the step's recorded start).
    pub fn new(plan: ReleasePlan) -> Self {
        let window = StepWindow::new(plan.state.step_started_ms);
        Self {
            plan,
            window,
            last_verdict: None,
            last_tick_ms: 0,
        }
    }

    /// A controller over a plan and a window of its current step seen elsewhere: a fleet's
    /// judge ticks one over the pooled window of every replica ([`StepWindow::pooled`]).
    pub fn with_window(plan: ReleasePlan, window: StepWindow) -> Self {
        Self {
            plan,
            window,
            last_verdict: None,
            last_tick_ms: 0,
        }
    }

    pub fn plan(&self) -> &ReleasePlan {
        &self.plan
    }

    pub fn window(&self) -> &StepWindow {
        &self.window
    }

    /// The plan file changed on disk (a human or a Git commit): adopt it. The window is kept when
    /// the release and step are the same, otherwise it restarts at the plan's step start.
    pub fn replace_plan(&mut self, plan: ReleasePlan) {
        let same = plan.state.release_id == self.plan.state.release_id
            && plan.state.step == self.plan.state.step;
        if !same {
            self.window = StepWindow::next(plan.state.step_started_ms, &self.window);
            self.last_verdict = None;
        }
        self.plan = plan;
    }

    /// One sample of a request served (or mirrored) during the release.
    pub fn observe(&mut self, sample: &Sample) {
        if matches!(
            self.plan.state.phase,
            Phase::Running | Phase::Holding | Phase::Paused
        ) {
            self.window.push(sample);
        }
    }

    /// Shadow mode: whether the candidate's answer to a mirrored request agreed with the
    /// control's.
    pub fn observe_agreement(&mut self, agreed: bool) {
        if matches!(
            self.plan.state.phase,
            Phase::Running | Phase::Holding | Phase::Paused
        ) {
            self.window.push_agreement(agreed);
        }
    }

    /// The rating of `answer` (its audit id), an answer of `version` given at `answered_ms`:
    /// helpful or not, or `None` when nothing rates it either way any more. Counts for the
    /// current step only (answers the step's variants gave), on the stable's or the candidate's
    /// side by version, once per answer: a new rating of the same answer replaces its old one.
    pub fn observe_feedback(
        &mut self,
        version: &str,
        answered_ms: u64,
        answer: &str,
        helpful: Option<bool>,
    ) {
        if !matches!(
            self.plan.state.phase,
            Phase::Running | Phase::Holding | Phase::Paused
        ) || answered_ms < self.window.started_ms()
        {
            return;
        }
        let variant = if self.plan.candidate.as_deref() == Some(version) {
            Variant::Candidate
        } else if self.plan.stable == version {
            Variant::Stable
        } else {
            return;
        };
        self.window.rate(variant, answer, helpful);
    }

    /// A monitor's drift alarm on a variant was raised or cleared.
    pub fn set_drift(&mut self, variant: Variant, active: bool, detail: &str) {
        self.window.set_drift(variant, active, detail);
    }

    pub fn status(&self) -> Status {
        let p = &self.plan;
        // An ended release's step ended with its last decision, not at this tick.
        let step_ended_ms = if p.state.phase.is_active() {
            self.last_tick_ms
        } else {
            p.history.last().map_or(self.last_tick_ms, |d| d.time_ms)
        };
        Status {
            stable: p.stable.clone(),
            candidate: p.candidate.clone(),
            mode: p.mode,
            phase: p.state.phase,
            step: p.state.step,
            weight: p.state.weight,
            mirrored_share: (p.mode == Mode::Shadow).then_some(p.routing.shadow_share),
            release_id: p.state.release_id.clone(),
            reference: p.routing.reference(),
            samples_stable: self.window.samples(Variant::Stable),
            samples_control: self.window.samples(Variant::Control),
            samples_candidate: self.window.samples(Variant::Candidate),
            errors_stable: self.window.errors(Variant::Stable),
            errors_candidate: self.window.errors(Variant::Candidate),
            ratings_stable: self.window.helpful(Variant::Stable).1,
            ratings_candidate: self.window.helpful(Variant::Candidate).1,
            helpful_stable: self.window.helpful(Variant::Stable).0,
            helpful_candidate: self.window.helpful(Variant::Candidate).0,
            time_in_step_ms: step_ended_ms.saturating_sub(p.state.step_started_ms),
            reason: p.state.reason.clone(),
            last_verdict: self.last_verdict.clone(),
        }
    }

    fn decision(
        &self,
        now_ms: u64,
        action: Action,
        to_weight: f64,
        reason: String,
        actor: &str,
    ) -> Decision {
        Decision {
            time_ms: now_ms,
            action,
            from_weight: self.plan.state.weight,
            to_weight,
            stable: self.plan.stable.clone(),
            candidate: self.plan.candidate.clone(),
            metric: None,
            statistic: None,
            threshold: None,
            e_value: None,
            p_value: None,
            samples_stable: self.window.samples(Variant::Stable),
            samples_candidate: self.window.samples(Variant::Candidate),
            reason,
            actor: actor.to_string(),
        }
    }

    /// Applies a decision to the state and the history.
    fn apply(&mut self, d: &Decision, phase: Phase) {
        self.plan.state.phase = phase;
        self.plan.state.weight = d.to_weight;
        self.plan.state.reason = Some(d.reason.clone());
        self.plan.push_history(d.clone());
    }

    fn begin_step(&mut self, step: usize, now_ms: u64) {
        self.plan.state.step = step;
        self.plan.state.step_started_ms = now_ms;
        self.window = StepWindow::next(now_ms, &self.window);
        self.last_verdict = None;
    }

    fn run_first_step(
        &mut self,
        now_ms: u64,
        action: Action,
        reason: String,
        actor: &str,
    ) -> Decision {
        let weight = self.plan.step_weight(0);
        self.begin_step(0, now_ms);
        let d = self.decision(now_ms, action, weight, reason, actor);
        self.apply(&d, Phase::Running);
        d
    }

    fn promote(&mut self, now_ms: u64, reason: String, actor: &str) -> Decision {
        let d = self.decision(now_ms, Action::Promote, 1.0, reason, actor);
        self.apply(&d, Phase::Promoted);
        if let Some(c) = self.plan.candidate.take() {
            self.plan.stable = c;
        }
        // The candidate is now the stable; no share is left to a candidate.
        self.plan.state.weight = 0.0;
        d
    }

    fn rollback(
        &mut self,
        now_ms: u64,
        reason: String,
        actor: &str,
        verdict: Option<&Verdict>,
    ) -> Decision {
        let mut d = self.decision(now_ms, Action::Rollback, 0.0, reason, actor);
        if let Some(Verdict::Fail {
            metric,
            statistic,
            threshold,
            e_value,
            p_value,
            samples_stable,
            samples_candidate,
            ..
        }) = verdict
        {
            d.metric = Some(metric.to_string());
            d.statistic = Some(*statistic);
            d.threshold = Some(*threshold);
            d.e_value = *e_value;
            d.p_value = *p_value;
            d.samples_stable = *samples_stable;
            d.samples_candidate = *samples_candidate;
        }
        self.apply(&d, Phase::RolledBack);
        d
    }

    /// Judges the current step without deciding anything: the status shows the verdict (a
    /// fleet's replica that does not hold the judge's lease looks at the pooled window so).
    pub fn look(&mut self, now_ms: u64) {
        self.last_tick_ms = now_ms;
        if matches!(
            self.plan.state.phase,
            Phase::Running | Phase::Holding | Phase::Paused
        ) {
            let judge = Judge::for_plan(&self.plan);
            self.last_verdict = Some(judge.evaluate(&self.plan.judge, &self.window, now_ms));
        }
    }

    /// Judges the current step and moves the release. The decisions are already applied to the
    /// plan; persist it when the vector is not empty.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Decision> {
        self.last_tick_ms = now_ms;
        let phase = self.plan.state.phase;
        if !matches!(phase, Phase::Running | Phase::Holding | Phase::Paused) {
            return Vec::new();
        }
        let judge = Judge::for_plan(&self.plan);
        let verdict = judge.evaluate(&self.plan.judge, &self.window, now_ms);
        self.last_verdict = Some(verdict.clone());
        let mut out = Vec::new();
        if let Verdict::Fail { reason, .. } = &verdict {
            out.push(self.rollback(now_ms, reason.clone(), "controller", Some(&verdict)));
            return out;
        }
        match (phase, &verdict) {
            (Phase::Paused, _) => {}
            (Phase::Running, Verdict::Inconclusive { reason, .. }) => {
                let d = self.decision(
                    now_ms,
                    Action::Hold,
                    self.plan.state.weight,
                    reason.clone(),
                    "controller",
                );
                self.apply(&d, Phase::Holding);
                out.push(d);
            }
            (Phase::Holding, Verdict::Inconclusive { .. }) => {}
            (Phase::Holding, Verdict::Pass { .. } | Verdict::Continue { .. }) => {
                let d = self.decision(
                    now_ms,
                    Action::Resume,
                    self.plan.state.weight,
                    "samples flow again: judging resumes".to_string(),
                    "controller",
                );
                self.apply(&d, Phase::Running);
                out.push(d);
                if matches!(verdict, Verdict::Pass { .. }) {
                    out.extend(self.advance(now_ms));
                }
            }
            (Phase::Running, Verdict::Pass { .. }) => out.extend(self.advance(now_ms)),
            _ => {}
        }
        out
    }

    /// The step passed: the next step, or promotion (or waiting for its approval).
    fn advance(&mut self, now_ms: u64) -> Vec<Decision> {
        let step = self.plan.state.step;
        let summary = self.last_verdict.as_ref().map(|v| v.summary().clone());
        let passed = format!(
            "step {} ({}%) passed: {} stable, {} candidate samples",
            step + 1,
            self.plan.step_weight(step) * 100.0,
            summary.as_ref().map_or(0, |s| s.samples_stable),
            summary.as_ref().map_or(0, |s| s.samples_candidate),
        );
        let next_is_judged = step + 1 < self.plan.schedule.steps.len()
            && (self.plan.step_weight(step + 1) < 1.0 || self.plan.mode == Mode::Shadow);
        if next_is_judged {
            let to = self.plan.step_weight(step + 1);
            let d = self.decision(now_ms, Action::Step, to, passed, "controller");
            self.begin_step(step + 1, now_ms);
            self.apply(&d, Phase::Running);
            return vec![d];
        }
        // A shadow release served no user with the candidate: its promotion is a person's call.
        let shadow = self.plan.mode == Mode::Shadow;
        if self.plan.approval.promote || shadow {
            let d = self.decision(
                now_ms,
                Action::Hold,
                self.plan.state.weight,
                if shadow {
                    format!("{passed}; a shadow release's promotion awaits approval")
                } else {
                    format!("{passed}; promotion awaits approval")
                },
                "controller",
            );
            self.apply(&d, Phase::AwaitingApproval);
            return vec![d];
        }
        vec![self.promote(now_ms, passed, "controller")]
    }

    fn refuse(cmd: &Command, reason: impl Into<String>) -> ReleaseError {
        ReleaseError::Refused {
            command: cmd.name(),
            reason: reason.into(),
        }
    }

    /// Applies an operator's command; the decision is already applied to the plan.
    pub fn command(
        &mut self,
        cmd: Command,
        now_ms: u64,
        actor: &str,
    ) -> Result<Decision, ReleaseError> {
        let phase = self.plan.state.phase;
        match &cmd {
            Command::Start {
                candidate,
                mode,
                tokenizer_change,
                gates_passed,
            } => {
                if phase.is_active() {
                    return Err(Self::refuse(
                        &cmd,
                        format!(
                            "a release of {} is under way (phase {phase:?}); roll it back or promote it first",
                            self.plan.candidate.as_deref().unwrap_or("?")
                        ),
                    ));
                }
                if *candidate == self.plan.stable || candidate.trim().is_empty() {
                    return Err(Self::refuse(
                        &cmd,
                        format!(
                            "candidate `{candidate}` is not a new version (stable is {})",
                            self.plan.stable
                        ),
                    ));
                }
                if let Some(why) = tokenizer_change {
                    if !self.plan.approval.tokenizer_change_approved {
                        return Err(Self::refuse(
                            &cmd,
                            format!(
                                "the candidate's tokenizer differs from the stable's ({why}); \
                                 set approval.tokenizer_change_approved = true in release.toml \
                                 to release it"
                            ),
                        ));
                    }
                }
                if let Some(m) = mode {
                    self.plan.mode = *m;
                }
                self.plan.candidate = Some(candidate.clone());
                self.plan.state.release_id = format!("{}→{}@{now_ms}", self.plan.stable, candidate);
                self.plan.state.started_ms = now_ms;
                self.plan.state.step = 0;
                self.plan.state.step_started_ms = now_ms;
                self.plan.state.weight = 0.0;
                self.window = StepWindow::new(now_ms);
                self.last_verdict = None;
                match gates_passed {
                    Some(false) => {
                        let d = self.decision(
                            now_ms,
                            Action::GateFailed,
                            0.0,
                            "gates failed before any traffic".to_string(),
                            actor,
                        );
                        self.apply(&d, Phase::RolledBack);
                        Ok(d)
                    }
                    None => {
                        let d = self.decision(
                            now_ms,
                            Action::Start,
                            0.0,
                            "started; gates running".to_string(),
                            actor,
                        );
                        self.apply(&d, Phase::Gating);
                        Ok(d)
                    }
                    Some(true) => Ok(self.after_gates(now_ms, actor)),
                }
            }
            Command::GateResult { passed, detail } => {
                if phase != Phase::Gating {
                    return Err(Self::refuse(
                        &cmd,
                        format!("no release is gating (phase {phase:?})"),
                    ));
                }
                if *passed {
                    Ok(self.after_gates(now_ms, actor))
                } else {
                    let d = self.decision(
                        now_ms,
                        Action::GateFailed,
                        0.0,
                        format!("gates failed: {detail}"),
                        actor,
                    );
                    self.apply(&d, Phase::RolledBack);
                    Ok(d)
                }
            }
            Command::Approve => {
                if phase != Phase::AwaitingApproval {
                    return Err(Self::refuse(
                        &cmd,
                        format!("nothing awaits approval (phase {phase:?})"),
                    ));
                }
                if self.plan.state.weight > 0.0 {
                    // The last step passed: approving promotes.
                    Ok(self.promote(now_ms, format!("promotion approved by {actor}"), actor))
                } else {
                    Ok(self.run_first_step(
                        now_ms,
                        Action::Approve,
                        format!("start approved by {actor}"),
                        actor,
                    ))
                }
            }
            Command::Promote => {
                if !matches!(
                    phase,
                    Phase::Running | Phase::Paused | Phase::Holding | Phase::AwaitingApproval
                ) {
                    return Err(Self::refuse(
                        &cmd,
                        format!("no candidate to promote (phase {phase:?})"),
                    ));
                }
                Ok(self.promote(now_ms, format!("promoted by {actor}"), actor))
            }
            Command::Pause => {
                if !matches!(phase, Phase::Running | Phase::Holding) {
                    return Err(Self::refuse(
                        &cmd,
                        format!("nothing to pause (phase {phase:?})"),
                    ));
                }
                let d = self.decision(
                    now_ms,
                    Action::Pause,
                    self.plan.state.weight,
                    format!("paused by {actor}"),
                    actor,
                );
                self.apply(&d, Phase::Paused);
                Ok(d)
            }
            Command::Resume => {
                if phase != Phase::Paused {
                    return Err(Self::refuse(&cmd, format!("not paused (phase {phase:?})")));
                }
                let d = self.decision(
                    now_ms,
                    Action::Resume,
                    self.plan.state.weight,
                    format!("resumed by {actor}"),
                    actor,
                );
                self.apply(&d, Phase::Running);
                Ok(d)
            }
            Command::Rollback { reason } => {
                if !phase.is_active() {
                    return Err(Self::refuse(
                        &cmd,
                        format!("no release under way (phase {phase:?})"),
                    ));
                }
                Ok(self.rollback(
                    now_ms,
                    format!("rolled back by {actor}: {reason}"),
                    actor,
                    None,
                ))
            }
        }
    }

    fn after_gates(&mut self, now_ms: u64, actor: &str) -> Decision {
        if self.plan.approval.start {
            let d = self.decision(
                now_ms,
                Action::Hold,
                0.0,
                "gates passed; the start awaits approval".to_string(),
                actor,
            );
            self.apply(&d, Phase::AwaitingApproval);
            d
        } else {
            self.run_first_step(
                now_ms,
                Action::Start,
                "gates passed; first step".to_string(),
                actor,
            )
        }
    }
}

#[cfg(test)]
mod tests;
