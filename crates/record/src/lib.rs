//! The record of every request and the bus that carries it to the sinks.
//!
//! - [`InferenceRecord`]: the fixed fields of one request (who, which model and version, how
//!   long, how sure, how it ended), and [`Envelope`], the record with the per-token series and the
//!   full payload that only the sinks asking for it receive;
//! - [`RecordBuilder`]: fills a record while the request runs and publishes it exactly once,
//!   also when the request is dropped (client gone);
//! - [`Bus`]: fans each record out to the [`Sink`]s, one task and one bounded lane each, lossy
//!   (drop newest, counted) or lossless (awaited off the request path, optionally acknowledged
//!   for fail-closed audit), and drains them on shutdown;
//! - [`Timeline`]: the stages' times and the caller's trace context, kept only when a sink
//!   asks for them (the trace sink);
//! - [`testing`]: the contract every sink passes, and sinks for tests.
//!
//! Not here: what the sinks do (log, metrics, audit, monitors live with their crates) and
//! anything about HTTP or models.

mod action;
mod builder;
mod bus;
mod features;
mod inference;
pub mod testing;
mod timeline;

pub use action::{Action, ActionRecord, Actor};
pub use builder::{sha256_bytes_hex, sha256_hex, RecordBuilder};
pub use bus::{
    AckError, Bus, BusError, Delivery, DropReason, LaneCounters, Receipt, ShutdownReport, Sink,
    SinkEnd, SinkError, SinkFuture,
};
pub use features::{Observation, Value};
pub use inference::{Attempt, Envelope, InferenceRecord, Payload, StructuredRecord};
pub use timeline::{Stage, Timeline, TokenNote};
