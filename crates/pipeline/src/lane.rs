//! The background lane: threads below the compute's CPU priority for the work any client can
//! make long before a model runs (tokenizing a whole document for `/tokenize`, the guard's
//! judging of a request's texts, a long prompt's template and tokenization, a long KServe JSON
//! body's decoding).
//!
//! Why: on a machine whose cores the engine uses, every millisecond a client's pre-work holds
//! a core is a millisecond taken from the generations already admitted: at equal priority a
//! flood of long `/tokenize` requests or guard-cost bombs halves everyone's token rate (measured
//! with `rampart bench abuse`: the honest client's p99 2.25x its idle one under a tokenize
//! flood, 0.7x with the lane). The admission limits bound how many such jobs run at once; the
//! lane bounds what they take from the compute while they run. Its threads lower their own
//! priority (`[limits] background_nice`, Linux `nice`): the scheduler then gives them the cores
//! the compute leaves, and a small share (about a quarter at nice 5, a tenth at nice 10) when
//! both want them, so they are slowed, never starved.
//!
//! Each lane has a fixed number of threads (the admission's places), made at start; a job that
//! panics is answered as an error and leaves its thread running. Metrics per lane:
//! `rampart_lane_jobs_total`, `rampart_lane_waiting` (jobs sent, not yet started) and
//! `rampart_lane_job_seconds` (how long each ran).

use std::panic::AssertUnwindSafe;
use std::sync::{mpsc, Arc, Mutex};

type Job = Box<dyn FnOnce() + Send + 'static>;

/// Why a job of the lane gave no answer.
#[derive(Debug, thiserror::Error)]
pub enum LaneError {
    #[error("the {0} work failed unexpectedly")]
    Panicked(&'static str),
    #[error("the {0} threads are gone")]
    Closed(&'static str),
}

/// A fixed set of low-priority threads taking jobs in order; clones share the threads.
#[derive(Clone)]
pub struct Lane {
    name: &'static str,
    jobs: mpsc::Sender<Job>,
}

impl Lane {
    /// Starts `threads` threads (at least one) named after the lane, each lowering its own
    /// priority by `nice` (0: left as the process's). A thread the system refuses is logged;
    /// with none at all every job is answered [`LaneError::Closed`].
    pub fn start(name: &'static str, threads: usize, nice: i32) -> Lane {
        let (jobs, queue) = mpsc::channel::<Job>();
        let queue = Arc::new(Mutex::new(queue));
        for i in 0..threads.max(1) {
            let queue = Arc::clone(&queue);
            let started = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || {
                    lower_priority(name, nice);
                    loop {
                        let job = queue.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        match job {
                            Ok(job) => job(),
                            // Every sender dropped: the lane is gone.
                            Err(_) => return,
                        }
                    }
                });
            if let Err(error) = started {
                tracing::error!(lane = name, %error, "background lane: a thread could not start");
            }
        }
        Lane { name, jobs }
    }

    /// Runs `f` on one of the lane's threads and waits for its answer without holding an async
    /// worker.
    pub async fn run<T, F>(&self, f: F) -> Result<T, LaneError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let (answer, answered) = tokio::sync::oneshot::channel();
        let lane = self.name;
        let job: Job = Box::new(move || {
            metrics::gauge!("rampart_lane_waiting", "lane" => lane).decrement(1.0);
            let began = std::time::Instant::now();
            let outcome = std::panic::catch_unwind(AssertUnwindSafe(f));
            metrics::histogram!("rampart_lane_job_seconds", "lane" => lane)
                .record(began.elapsed().as_secs_f64());
            let _ = answer.send(outcome);
        });
        metrics::counter!("rampart_lane_jobs_total", "lane" => lane).increment(1);
        metrics::gauge!("rampart_lane_waiting", "lane" => lane).increment(1.0);
        if self.jobs.send(job).is_err() {
            metrics::gauge!("rampart_lane_waiting", "lane" => lane).decrement(1.0);
            return Err(LaneError::Closed(lane));
        }
        match answered.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(_)) => Err(LaneError::Panicked(self.name)),
            Err(_) => Err(LaneError::Closed(self.name)),
        }
    }
}

/// The calling thread's niceness (Linux: per thread).
fn niceness() -> i32 {
    // SAFETY: getpriority takes plain integers; 0 is the calling thread on Linux.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) }
}

/// Lowers the calling thread's priority by `by`; says so in the log when it cannot (a
/// container that forbids it): the lane then runs at the process's priority.
fn lower_priority(lane: &'static str, by: i32) {
    if by <= 0 {
        return;
    }
    let before = niceness();
    // SAFETY: setpriority takes plain integers; 0 is the calling thread on Linux.
    let done = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, (before + by).min(19)) };
    if done != 0 || niceness() <= before {
        tracing::warn!(
            lane,
            nice = by,
            "background lane: could not lower the thread's CPU priority; it runs at the process's"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn jobs_run_below_the_callers_priority_and_a_panic_is_an_answer() {
        let lane = Lane::start("test-lane", 2, 5);
        let here = niceness();
        let there = lane.run(niceness).await.unwrap();
        assert_eq!(there, (here + 5).min(19));
        let panicked = lane.run(|| -> u32 { panic!("boom") }).await;
        assert!(matches!(panicked, Err(LaneError::Panicked("test-lane"))));
        // The thread survived; both threads still answer.
        let (a, b) = tokio::join!(lane.run(|| 1), lane.run(|| 2));
        assert_eq!((a.unwrap(), b.unwrap()), (1, 2));
    }

    #[tokio::test]
    async fn nice_zero_leaves_the_priority() {
        let lane = Lane::start("test-lane", 1, 0);
        assert_eq!(lane.run(niceness).await.unwrap(), niceness());
    }
}
