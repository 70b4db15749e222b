//! A pool of compute threads for the kernels' parallel loops, shared by every engine of the
//! process that asks for the same number of threads.
//!
//! Decode runs hundreds of small parallel loops per token (one per matmul, per attention), so
//! handing out work must cost microseconds: workers spin briefly on a generation counter before
//! sleeping, the caller works too, and a loop allocates nothing.
//!
//! Two things keep several models on one machine (a release's stable, candidate and control, a
//! fallback chain, the guard's classifier beside the LLM) from slowing each other down more
//! than their share:
//! - One pool per thread count for the whole process ([`ThreadPool::shared`]): engines take
//!   turns on it ([`ThreadPool::turn`], first come first served, a forward pass per turn)
//!   instead of running a pool each, where three pools of two spinning threads on two cores
//!   made every loop wait for a descheduled worker and one engine 2–4× slower than its twin
//!   at random.
//! - A loop waits for its items, not for its workers: items are claimed with a tag of the loop
//!   they belong to, and the caller returns once every item ran. A worker the OS has not
//!   scheduled yet does not hold the loop up; the caller runs its share.

use std::cell::RefCell;
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it sleeps. Short enough not to burn a core between
/// requests, long enough to span the gaps between kernels within a token.
const SPIN: Duration = Duration::from_micros(200);

/// How long a caller waiting for its last items (or a thread waiting for its turn) spins
/// before it yields the core: the item may be running on a thread the OS preempted.
const WAIT_SPINS: u32 = 4096;

type Task = dyn Fn(usize) + Sync;

/// The claim word: the loop's generation in the high half, the next unclaimed item in the low.
fn tag(generation: u64, item: u64) -> u64 {
    (generation << 32) | item
}

struct Shared {
    /// The current loop's generation and its next unclaimed item (see [`tag`]).
    claim: AtomicU64,
    /// The current loop body (a pointer to a `&Task` that lives on the caller's stack).
    task: AtomicUsize,
    /// Number of items of the current loop.
    items: AtomicUsize,
    /// Items of the current loop that have run.
    done: AtomicUsize,
    shutdown: AtomicBool,
    /// Workers parked on `wake`; a loop notifies only when some are (a futex call per kernel
    /// would cost more than many small kernels).
    sleeping: AtomicUsize,
    sleep_lock: Mutex<()>,
    wake: Condvar,
    /// The first panic of an item of the current loop, raised on the caller's thread.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
}

/// Claims and runs items of loop `generation` until none is left (or another loop began).
fn run_items(shared: &Shared, generation: u64) {
    loop {
        let c = shared.claim.load(Ordering::Acquire);
        if c >> 32 != generation & 0xffff_ffff {
            return;
        }
        let item = c & 0xffff_ffff;
        // Read after the claim word of this generation: this loop's count (the next loop
        // closes this one's claims before it changes the count, so a later count fails the
        // exchange below).
        let items = shared.items.load(Ordering::Acquire) as u64;
        if item >= items {
            return;
        }
        if shared
            .claim
            .compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            continue;
        }
        let ptr = shared.task.load(Ordering::Acquire) as *const &Task;
        // SAFETY: item `item` of this loop was claimed and has not run, so the caller is still
        // inside `for_each` (it returns once every item ran) and the task it published before
        // the claim word stays alive until `done` counts this item.
        let task: &Task = unsafe { *ptr };
        // A panicking item still counts as run (the loop must not wait for it forever, and the
        // worker must survive it); the caller raises the panic once the loop is over.
        if let Err(payload) =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(item as usize)))
        {
            let mut first = shared.panic.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(payload);
        }
        shared.done.fetch_add(1, Ordering::AcqRel);
    }
}

fn worker(shared: Arc<Shared>) {
    let mut seen = 0u64;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        let generation = loop {
            let g = shared.claim.load(Ordering::Acquire) >> 32;
            if g != seen || shared.shutdown.load(Ordering::Acquire) {
                break g;
            }
            spins += 1;
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                let guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
                // Announce the sleep before the last look at the generation (SeqCst on both
                // sides): a loop started after this look sees `sleeping > 0` and notifies.
                shared.sleeping.fetch_add(1, Ordering::SeqCst);
                let g = shared.claim.load(Ordering::SeqCst) >> 32;
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
        run_items(&shared, generation);
    }
}

/// First come, first served turns on a pool: a ticket each, served in order.
struct Turns {
    next: AtomicU64,
    serving: AtomicU64,
    waiting: AtomicUsize,
    lock: Mutex<()>,
    served: Condvar,
}

impl Turns {
    fn new() -> Self {
        Self {
            next: AtomicU64::new(0),
            serving: AtomicU64::new(0),
            waiting: AtomicUsize::new(0),
            lock: Mutex::new(()),
            served: Condvar::new(),
        }
    }

    fn acquire(&self) {
        let ticket = self.next.fetch_add(1, Ordering::SeqCst);
        for _ in 0..WAIT_SPINS {
            if self.serving.load(Ordering::Acquire) == ticket {
                return;
            }
            std::hint::spin_loop();
        }
        let mut guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        // Announced before the last look (SeqCst on both sides, as for sleeping workers).
        self.waiting.fetch_add(1, Ordering::SeqCst);
        while self.serving.load(Ordering::SeqCst) != ticket {
            guard = self
                .served
                .wait_timeout(guard, Duration::from_millis(20))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }

    fn release(&self) {
        self.serving.fetch_add(1, Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.served.notify_all();
        }
    }
}

thread_local! {
    /// The pools whose turn this thread holds (their addresses), with how many turns deep.
    static HELD: RefCell<Vec<(usize, usize)>> = const { RefCell::new(Vec::new()) };
}

/// A pool of `threads - 1` workers plus the calling thread.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// One user at a time: a loop, or a [`Turn`] of several.
    turns: Turns,
    /// The last loop's generation (only the turn's holder writes it).
    generation: AtomicU64,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("threads", &self.threads())
            .finish()
    }
}

/// Exclusive use of a pool by this thread until dropped: its loops run one after the other
/// with no other user's in between. Turns nest on one thread.
pub struct Turn<'a> {
    pool: &'a ThreadPool,
    /// A turn belongs to the thread that took it.
    _thread: PhantomData<*const ()>,
}

impl std::fmt::Debug for Turn<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Turn").finish_non_exhaustive()
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let key = self.pool.key();
        let last = HELD.with(|held| {
            let mut held = held.borrow_mut();
            let at = held.iter().position(|(k, _)| *k == key);
            match at {
                Some(at) if held[at].1 > 1 => {
                    held[at].1 -= 1;
                    false
                }
                Some(at) => {
                    held.swap_remove(at);
                    true
                }
                None => false,
            }
        });
        if last {
            self.pool.turns.release();
        }
    }
}

impl ThreadPool {
    /// A pool of its own that runs loops on `threads` threads in all (the caller included).
    pub fn new(threads: usize) -> Self {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            claim: AtomicU64::new(0),
            task: AtomicUsize::new(0),
            items: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            sleeping: AtomicUsize::new(0),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
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
            turns: Turns::new(),
            generation: AtomicU64::new(0),
        }
    }

    /// The process's pool of `threads` threads, made on first use and kept while some user
    /// holds it: every engine that asks for the same count shares it, taking turns.
    pub fn shared(threads: usize) -> Arc<Self> {
        static POOLS: OnceLock<Mutex<HashMap<usize, Weak<ThreadPool>>>> = OnceLock::new();
        let threads = threads.max(1);
        let mut pools = POOLS
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = pools.get(&threads).and_then(Weak::upgrade) {
            return pool;
        }
        let pool = Arc::new(Self::new(threads));
        pools.insert(threads, Arc::downgrade(&pool));
        pool
    }

    /// Threads that run each loop, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    fn key(&self) -> usize {
        self as *const Self as usize
    }

    /// Waits for this thread's turn on the pool (at once when it holds one already); the pool
    /// runs only this thread's loops until the turn is dropped.
    pub fn turn(&self) -> Turn<'_> {
        let key = self.key();
        let nested = HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(entry) = held.iter_mut().find(|(k, _)| *k == key) {
                entry.1 += 1;
                true
            } else {
                false
            }
        });
        if !nested {
            self.turns.acquire();
            HELD.with(|held| held.borrow_mut().push((key, 1)));
        }
        Turn {
            pool: self,
            _thread: PhantomData,
        }
    }

    /// Runs `task(i)` for every `i` in `0..items`, spread over the pool; returns when all are
    /// done. Items are claimed dynamically, so uneven items balance themselves. Takes a turn on
    /// the pool for the loop unless this thread holds one.
    pub fn for_each(&self, items: usize, task: &(dyn Fn(usize) + Sync)) {
        if items == 0 {
            return;
        }
        if self.workers.is_empty() || items == 1 {
            (0..items).for_each(task);
            return;
        }
        assert!(
            items < 1 << 32,
            "a parallel loop of {items} items is past the claim word's range"
        );
        let _turn = self.turn();
        let shared = &*self.shared;
        let last = self.generation.load(Ordering::Relaxed);
        let generation = (last + 1) & 0xffff_ffff;
        self.generation.store(generation, Ordering::Relaxed);
        // Close the last loop's claims before its count and task change: a worker that read its
        // final claim word could otherwise pair it with this loop's larger count and claim an
        // item past the last loop's end (running this loop's item twice, or a task that is
        // gone). With the index at its maximum, no claim of the last loop succeeds, and its
        // workers keep waiting for this loop's generation.
        shared.claim.store(tag(last, 0xffff_ffff), Ordering::SeqCst);
        let task_ref: &(dyn Fn(usize) + Sync) = task;
        // The pointer's lifetime is erased here and restored by the workers (see `run_items`).
        shared.task.store(
            &task_ref as *const &(dyn Fn(usize) + Sync) as usize,
            Ordering::Release,
        );
        shared.items.store(items, Ordering::Release);
        shared.done.store(0, Ordering::Release);
        shared.claim.store(tag(generation, 0), Ordering::SeqCst);
        if shared.sleeping.load(Ordering::SeqCst) > 0 {
            let _guard = shared.sleep_lock.lock().unwrap_or_else(|e| e.into_inner());
            shared.wake.notify_all();
        }
        run_items(shared, generation);
        let mut spins = 0u32;
        while shared.done.load(Ordering::Acquire) < items {
            spins += 1;
            if spins < WAIT_SPINS {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        let panicked = shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(payload) = panicked {
            drop(_turn);
            std::panic::resume_unwind(payload);
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

    #[test]
    fn users_of_one_shared_pool_take_turns_and_lose_no_item() {
        let pool = ThreadPool::shared(3);
        assert!(Arc::ptr_eq(&pool, &ThreadPool::shared(3)));
        let inside = AtomicUsize::new(0);
        let overlaps = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for user in 0..4 {
                let (pool, inside, overlaps) = (Arc::clone(&pool), &inside, &overlaps);
                s.spawn(move || {
                    for round in 0..300 {
                        let counts: Vec<AtomicUsize> =
                            (0..17).map(|_| AtomicUsize::new(0)).collect();
                        // Every other round in a turn of three loops that must not interleave
                        // with another user's.
                        let turn = (round % 2 == 0).then(|| pool.turn());
                        if turn.is_some() && inside.fetch_add(1, Ordering::SeqCst) != 0 {
                            overlaps.fetch_add(1, Ordering::SeqCst);
                        }
                        for _ in 0..3 {
                            pool.for_each(17, &|i| {
                                counts[i].fetch_add(1, Ordering::Relaxed);
                            });
                        }
                        if turn.is_some() {
                            inside.fetch_sub(1, Ordering::SeqCst);
                        }
                        drop(turn);
                        assert!(
                            counts.iter().all(|c| c.load(Ordering::Relaxed) == 3),
                            "user {user} round {round}"
                        );
                    }
                });
            }
        });
        assert_eq!(overlaps.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn many_small_loops_and_nested_turns_of_one_thread() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for _ in 0..10_000 {
            pool.for_each(4, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 10_000 * 6);
        // Nested turns on one thread.
        let outer = pool.turn();
        let inner = pool.turn();
        pool.for_each(3, &|_| {});
        drop(inner);
        pool.for_each(3, &|_| {});
        drop(outer);
    }

    #[test]
    fn a_late_worker_never_claims_an_item_of_the_next_loop() {
        // Loops of alternating sizes: a worker that read the last claim of a short loop must not
        // claim past its end once the next, longer loop has published its count (it would run
        // an item of the next loop twice, or the finished loop's task).
        let pool = ThreadPool::new(3);
        for round in 0..200_000 {
            let items = if round % 2 == 0 { 2 } else { 9 };
            let counts: [AtomicUsize; 9] = std::array::from_fn(|_| AtomicUsize::new(0));
            pool.for_each(items, &|i| {
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
            for (i, c) in counts.iter().enumerate() {
                let want = usize::from(i < items);
                assert_eq!(c.load(Ordering::Relaxed), want, "round {round}, item {i}");
            }
        }
    }

    #[test]
    fn a_panicking_item_reaches_the_caller_and_the_pool_keeps_its_workers() {
        let pool = ThreadPool::new(3);
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.for_each(64, &|i| {
                if i == 40 {
                    panic!("item {i} failed");
                }
            });
        }));
        let message = caught.unwrap_err();
        assert_eq!(message.downcast_ref::<String>().unwrap(), "item 40 failed");
        // The pool still runs every item of the next loops, its turn released.
        let total = AtomicUsize::new(0);
        for _ in 0..100 {
            pool.for_each(10, &|i| {
                total.fetch_add(i, Ordering::Relaxed);
            });
        }
        assert_eq!(total.load(Ordering::Relaxed), 100 * 45);
    }
}
