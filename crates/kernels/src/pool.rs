//! A fixed pool of compute threads for the kernels' parallel loops.
//!
//! Decode runs hundreds of small parallel loops per token (one per matmul, per attention), so
//! handing out work must cost microseconds: workers spin briefly on a generation counter before
//! sleeping, the caller works too, and a loop allocates nothing.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps. Short enough not to burn a core between
/// requests, long enough to span the gaps between kernels within a token.
const SPIN: Duration = Duration::from_micros(200);

type Task = dyn Fn(usize) + Sync;

struct Shared {
    /// Incremented for each loop; workers start when it changes.
    generation: AtomicU64,
    /// The current loop body (a pointer to a `&Task` that lives on the caller's stack).
    task: AtomicUsize,
    /// Number of items of the current loop and the next unclaimed one.
    items: AtomicUsize,
    next: AtomicUsize,
    /// Workers that have finished the current loop.
    finished: AtomicUsize,
    shutdown: AtomicBool,
    /// Workers parked on `wake`; a loop notifies only when some are (a futex call per kernel
    /// would cost more than many small kernels).
    sleeping: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

/// A pool of `threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serializes loops: one `for_each` at a time per pool.
    running: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads())
            .finish()
    }
}

fn run_items(shared: &Shared, task: &(dyn Fn(usize) + Sync + '_)) {
    let items = shared.items.load(Ordering::Acquire);
    loop {
        let i = shared.next.fetch_add(1, Ordering::AcqRel);
        if i >= items {
            break;
        }
        task(i);
    }
}

fn worker(shared: Arc<Shared>) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            let g = shared.generation.load(Ordering::Acquire);
            if g != seen || shared.shutdown.load(Ordering::Acquire) {
                break g;
            }
            spins += 1;
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                let guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                // Announce the sleep before the last look at the generation (SeqCst on both
                // sides): a loop started after this look sees `sleeping > 0` and notifies.
                shared.sleeping.fetch_add(1, Ordering::SeqCst);
                let g = shared.generation.load(Ordering::SeqCst);
                if g == seen && !shared.shutdown.load(Ordering::Acquire) {
                    let _unused = shared
                        .wake
                        .wait_timeout(guard, Duration::from_millis(50))
                        .unwrap_or_else(|e| e.into_inner());
                }
                shared.sleeping.fetch_sub(1, Ordering::SeqCst);
            } else {
                std::hint::spin_loop();
            }
        };
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = generation;
        let ptr = shared.task.load(Ordering::Acquire) as *const &Task;
        // SAFETY: `for_each` published this pointer before bumping the generation and does not
        // return (so the task stays alive) until every worker has counted itself finished.
        let task: &Task = unsafe { *ptr };
        run_items(&shared, task);
        shared.finished.fetch_add(1, Ordering::AcqRel);
    }
}

impl ThreadPool {
    /// A pool that runs loops on `threads` threads in all (the caller included).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            task: AtomicUsize::new(0),
            items: AtomicUsize::new(0),
            next: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..threads)
            .map(|i| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("rampart-compute-{i}"))
                    .spawn(move || worker(shared))
                    .expect("spawning a compute thread must succeed at start-up")
            })
            .collect();
        Self {
            shared,
            workers,
            running: Mutex::new(()),
        }
    }

    /// Threads that run each loop, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `task(i)` for every `i` in `0..items`, spread over the pool; returns when all are
    /// done. Items are claimed dynamically, so uneven items balance themselves.
    pub fn for_each(&self, items: usize, task: &(dyn Fn(usize) + Sync)) {
        if items == 0 {
            return;
        }
        if self.workers.is_empty() || items == 1 {
            (0..items).for_each(task);
            return;
        }
        let _one_at_a_time = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let shared = &*self.shared;
        let task_ref: &(dyn Fn(usize) + Sync) = task;
        // The pointer's lifetime is erased here and restored by the workers (see `worker`).
        shared.task.store(
            &task_ref as *const &(dyn Fn(usize) + Sync) as usize,
            Ordering::Release,
        );
        shared.items.store(items, Ordering::Release);
        shared.next.store(0, Ordering::Release);
        shared.finished.store(0, Ordering::Release);
        shared.generation.fetch_add(1, Ordering::SeqCst);
        if shared.sleeping.load(Ordering::SeqCst) > 0 {
            let _guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }
        run_items(shared, task_ref);
        while shared.finished.load(Ordering::Acquire) < self.workers.len() {
            std::hint::spin_loop();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _guard = self
                .shared
                .sleep_lock
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_runs_exactly_once() {
        for threads in [1, 2, 3, 8] {
            let pool = ThreadPool::new(threads);
            for items in [0, 1, 2, 7, 100, 1000] {
                let counts: Vec<AtomicUsize> = (0..items).map(|_| AtomicUsize::new(0)).collect();
                pool.for_each(items, &|i| {
                    counts[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    counts.iter().all(|c| c.load(Ordering::Relaxed) == 1),
                    "threads {threads}, items {items}"
                );
            }
        }
    }

    #[test]
    fn survives_sleeping_workers_and_many_loops() {
        let pool = ThreadPool::new(3);
        let total = AtomicUsize::new(0);
        for round in 0..2000 {
            if round % 500 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
            pool.for_each(5, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 2000 * 10);
    }
}
