//! Rampart's releases: shipping a new model version as a measured, reversible step.
//!
//! - `plan`: the release plan file (`models/<name>/release.toml`): stable, candidate, mode,
//!   schedule, judge thresholds, gates, approvals, the controller's state and the history of its
//!   decisions; read, validated and rewritten atomically.
//! - `router`: the sticky assignment of a request to stable or candidate (a hash of the user),
//!   explicit A/B groups, and the shadow mirror.
//! - `judge`: each step, the candidate against the concurrent stable on the same window, with
//!   sequential tests whose false-rollback rate stays bounded however often it looks.
//! - `controller`: the state machine that moves the weight step by step, holds on no data,
//!   promotes and rolls back; every transition is a `Decision` with its cause.
//! - `gates`, `golden`: the checks before any traffic (eval on a golden set, latency, data quality,
//!   feature consistency) as pure functions over results the server computes.
//! - `maturity`: the maturity report's shape, levels and verdict (the server gathers the
//!   evidence).
//!
//! Not here: HTTP, tasks, clocks, files other than the plan. The server feeds samples, calls
//! `tick` with the time, persists the plan and turns each decision into a record.

pub mod controller;
pub mod gates;
pub mod golden;
pub mod judge;
pub mod maturity;
pub mod plan;
pub mod router;
