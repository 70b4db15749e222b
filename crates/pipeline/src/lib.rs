//! Rampart's request pipeline, protocol-neutral: what every request meets between its
//! protocol's decode and its encode.
//!
//! [`front`] (drain, rate limit, route by the release plans, the input guard, hand-off) →
//! [`chain`] (each step: readiness, [`breaker`], injected [`faults`], [`admission`], the
//! [`backend`]) → [`finish`] (the record's end, the output guard, the structured-output check,
//! the key's token charge). The [`registry`] holds every served model version; [`shadow`]
//! mirrors a share of a release's traffic to its candidate; [`guard_service`] runs the input
//! guard's tiers on lanes of their own ([`lane`]). Controllers publish their decisions on the
//! record bus ([`decisions`]).
//!
//! No HTTP, gRPC or OpenTelemetry crate is in its dependency tree: the wire formats, the
//! sinks, the governance tasks and the wiring live in the server crate above it.

pub mod admission;
pub mod backend;
pub mod breaker;
pub mod chain;
pub mod decisions;
pub mod error;
pub mod faults;
pub mod finish;
pub mod front;
pub mod guard_service;
pub mod handoff;
pub mod lane;
pub mod origin;
pub mod policy;
pub mod rate_limit;
pub mod registry;
pub mod shadow;
pub mod tool_metrics;
pub mod watch;

pub use front::Front;
