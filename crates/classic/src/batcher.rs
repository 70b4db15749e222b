//! The dynamic batcher of one model: requests wait in a bounded queue; each backend instance (a
//! thread with its own session) takes the oldest request and as many compatible ones behind it
//! as fit in `max_batch_size`, waiting at most `max_queue_delay` for more (less when a preferred
//! batch size is reached), runs them as one batch along the first axis and splits the outputs.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use crate::backend::Backend;
use crate::error::ClassicError;
use crate::tensor::Tensor;

/// Batching settings (from `[pipeline.batching]`).
#[derive(Debug, Clone)]
pub struct BatchConfig {
    pub max_batch_size: usize,
    pub max_queue_delay: Duration,
    pub preferred_batch_sizes: Vec<usize>,
    pub max_queue_size: usize,
    pub queue_timeout: Duration,
    pub instances: usize,
}

impl From<&repo::pipeline::Batching> for BatchConfig {
    fn from(b: &repo::pipeline::Batching) -> Self {
        BatchConfig {
            max_batch_size: b.max_batch_size as usize,
            max_queue_delay: Duration::from_micros(b.max_queue_delay_us),
            preferred_batch_sizes: b
                .preferred_batch_sizes
                .iter()
                .map(|p| *p as usize)
                .collect(),
            max_queue_size: b.max_queue_size as usize,
            queue_timeout: Duration::from_millis(b.queue_timeout_ms),
            instances: b.instances as usize,
        }
    }
}

type Reply = oneshot::Sender<Result<(Vec<Tensor>, BatchTimes), ClassicError>>;

/// How one request's trip through the batcher went: the time it waited in the queue, and the
/// time its batch computed (shared with the batch's other requests).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchTimes {
    pub waited: Duration,
    pub computed: Duration,
}

struct Job {
    inputs: Vec<Tensor>,
    rows: usize,
    enqueued: Instant,
    reply: Reply,
}

impl Job {
    /// Jobs batch together when every input has the same type and trailing shape.
    fn compatible(&self, other: &Job) -> bool {
        self.inputs.len() == other.inputs.len()
            && self.inputs.iter().zip(&other.inputs).all(|(a, b)| {
                a.dtype() == b.dtype()
                    && a.shape.len() == b.shape.len()
                    && a.shape.get(1..) == b.shape.get(1..)
            })
    }
}

struct Shared {
    queue: Mutex<VecDeque<Job>>,
    ready: Condvar,
    stop: AtomicBool,
    model: String,
    config: BatchConfig,
}

/// A running batcher; dropping it stops the instances after the queue drains.
pub struct Batcher {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Batcher {
    /// Starts `config.instances` threads, each with a session of `backend`.
    pub fn start(
        model: &str,
        backend: Arc<dyn Backend>,
        config: BatchConfig,
    ) -> Result<Self, ClassicError> {
        let shared = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            stop: AtomicBool::new(false),
            model: model.to_string(),
            config,
        });
        let mut workers = Vec::new();
        for i in 0..shared.config.instances.max(1) {
            let mut session = backend.session()?;
            let shared = shared.clone();
            let handle = std::thread::Builder::new()
                .name(format!("infer-{model}-{i}"))
                .spawn(move || worker(&shared, session.as_mut()))
                .map_err(|e| ClassicError::Load(format!("cannot start an instance thread: {e}")))?;
            workers.push(handle);
        }
        Ok(Batcher { shared, workers })
    }

    pub fn config(&self) -> &BatchConfig {
        &self.shared.config
    }

    /// Requests waiting now.
    pub fn queue_depth(&self) -> usize {
        self.shared.queue.lock().map(|q| q.len()).unwrap_or(0)
    }

    /// Queues one request (its inputs in graph order, all with the same first dimension) and
    /// waits for its outputs.
    pub async fn infer(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, ClassicError> {
        self.infer_timed(inputs).await.map(|(outputs, _)| outputs)
    }

    /// [`Batcher::infer`], also saying how long the request waited and its batch computed.
    pub async fn infer_timed(
        &self,
        inputs: Vec<Tensor>,
    ) -> Result<(Vec<Tensor>, BatchTimes), ClassicError> {
        let rows = inputs.first().map_or(1, Tensor::batch);
        let (tx, rx) = oneshot::channel();
        {
            let mut queue = self
                .shared
                .queue
                .lock()
                .map_err(|_| ClassicError::Backend("the batcher's queue is poisoned".into()))?;
            if self.shared.stop.load(Ordering::Acquire) {
                return Err(ClassicError::ShuttingDown(self.shared.model.clone()));
            }
            if queue.len() >= self.shared.config.max_queue_size {
                return Err(ClassicError::QueueFull {
                    model: self.shared.model.clone(),
                    capacity: self.shared.config.max_queue_size,
                });
            }
            queue.push_back(Job {
                inputs,
                rows,
                enqueued: Instant::now(),
                reply: tx,
            });
            metrics::gauge!("rampart_tensor_queue_depth", "model" => self.shared.model.clone())
                .set(queue.len() as f64);
        }
        self.shared.ready.notify_one();
        rx.await
            .unwrap_or_else(|_| Err(ClassicError::ShuttingDown(self.shared.model.clone())))
    }
}

impl Drop for Batcher {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.ready.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Rows of the compatible jobs at the front of the queue that fit in one batch.
fn batchable(queue: &VecDeque<Job>, max: usize) -> (usize, usize) {
    let Some(first) = queue.front() else {
        return (0, 0);
    };
    let (mut jobs, mut rows) = (0, 0);
    for job in queue {
        if (jobs > 0 && !first.compatible(job)) || rows + job.rows > max.max(first.rows) {
            break;
        }
        jobs += 1;
        rows += job.rows;
    }
    (jobs, rows)
}

fn worker(shared: &Shared, session: &mut dyn crate::backend::Session) {
    let config = &shared.config;
    loop {
        let jobs: Vec<Job> = {
            let Ok(mut queue) = shared.queue.lock() else {
                return;
            };
            loop {
                // Requests that waited too long fail; the rest wait their turn.
                let now = Instant::now();
                while let Some(front) = queue.front() {
                    let waited = now.duration_since(front.enqueued);
                    if waited <= config.queue_timeout {
                        break;
                    }
                    let job = queue.pop_front().expect("front exists");
                    let _ = job.reply.send(Err(ClassicError::QueueTimeout {
                        model: shared.model.clone(),
                        waited_ms: waited.as_millis() as u64,
                        limit_ms: config.queue_timeout.as_millis() as u64,
                    }));
                }
                if queue.is_empty() {
                    if shared.stop.load(Ordering::Acquire) {
                        return;
                    }
                    queue = match shared.ready.wait(queue) {
                        Ok(q) => q,
                        Err(_) => return,
                    };
                    continue;
                }
                let (n, rows) = batchable(&queue, config.max_batch_size);
                let deadline = queue.front().expect("not empty").enqueued + config.max_queue_delay;
                let full = rows >= config.max_batch_size
                    || n < queue.len()
                    || config.preferred_batch_sizes.contains(&rows)
                    || shared.stop.load(Ordering::Acquire);
                let now = Instant::now();
                if full || now >= deadline {
                    break queue.drain(..n).collect();
                }
                queue = match shared.ready.wait_timeout(queue, deadline - now) {
                    Ok((q, _)) => q,
                    Err(_) => return,
                };
            }
        };
        run_batch(shared, session, jobs);
    }
}

fn run_batch(shared: &Shared, session: &mut dyn crate::backend::Session, jobs: Vec<Job>) {
    let model = shared.model.clone();
    let started = Instant::now();
    for job in &jobs {
        metrics::histogram!("rampart_tensor_queue_delay_seconds", "model" => model.clone())
            .record(started.duration_since(job.enqueued).as_secs_f64());
    }
    let rows: usize = jobs.iter().map(|j| j.rows).sum();
    metrics::histogram!("rampart_tensor_batch_size", "model" => model.clone()).record(rows as f64);
    let result = if jobs.len() == 1 {
        session.run(jobs[0].inputs.clone())
    } else {
        let inputs: Result<Vec<Tensor>, ClassicError> = (0..jobs[0].inputs.len())
            .map(|i| Tensor::concat(&jobs.iter().map(|j| &j.inputs[i]).collect::<Vec<_>>()))
            .collect();
        inputs.and_then(|inputs| session.run(inputs))
    };
    let computed = started.elapsed();
    metrics::histogram!("rampart_tensor_compute_seconds", "model" => model.clone())
        .record(computed.as_secs_f64());
    let times = |job: &Job| BatchTimes {
        waited: started.duration_since(job.enqueued),
        computed,
    };
    match result {
        Err(e) => {
            for job in jobs {
                let _ = job.reply.send(Err(e.clone()));
            }
        }
        Ok(outputs) if jobs.len() == 1 => {
            let job = jobs.into_iter().next().expect("one job");
            let t = times(&job);
            let _ = job.reply.send(Ok((outputs, t)));
        }
        Ok(outputs) => {
            let mut start = 0;
            for job in jobs {
                let end = start + job.rows;
                let mine: Result<Vec<Tensor>, ClassicError> = outputs
                    .iter()
                    .map(|o| {
                        if o.batch() == rows && !o.shape.is_empty() {
                            Ok(o.rows(start, end))
                        } else {
                            Err(ClassicError::Backend(format!(
                                "output {:?} of shape {:?} does not follow the batch of {rows}; set max_batch_size = 1 for this model",
                                o.name, o.shape
                            )))
                        }
                    })
                    .collect();
                let t = times(&job);
                let _ = job.reply.send(mine.map(|outputs| (outputs, t)));
                start = end;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Session;
    use crate::tensor::Data;
    use std::sync::atomic::AtomicUsize;

    /// Doubles its input and records batch sizes.
    struct Doubler {
        sizes: Arc<Mutex<Vec<usize>>>,
        delay: Duration,
    }
    struct DoublerSession {
        sizes: Arc<Mutex<Vec<usize>>>,
        delay: Duration,
    }
    impl Backend for Doubler {
        fn name(&self) -> &'static str {
            "test"
        }
        fn session(&self) -> Result<Box<dyn Session>, ClassicError> {
            Ok(Box::new(DoublerSession {
                sizes: self.sizes.clone(),
                delay: self.delay,
            }))
        }
    }
    impl Session for DoublerSession {
        fn run(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, ClassicError> {
            std::thread::sleep(self.delay);
            self.sizes.lock().unwrap().push(inputs[0].batch());
            let v: Vec<f32> = inputs[0]
                .as_f32()
                .unwrap()
                .iter()
                .map(|x| x * 2.0)
                .collect();
            Ok(vec![Tensor::new(
                "y",
                inputs[0].shape.clone(),
                Data::F32(v),
            )?])
        }
    }

    fn config(max: usize, delay_ms: u64) -> BatchConfig {
        BatchConfig {
            max_batch_size: max,
            max_queue_delay: Duration::from_millis(delay_ms),
            preferred_batch_sizes: vec![],
            max_queue_size: 64,
            queue_timeout: Duration::from_secs(10),
            instances: 1,
        }
    }

    fn input(rows: usize, value: f32) -> Vec<Tensor> {
        vec![Tensor::new("x", vec![rows, 2], Data::F32(vec![value; rows * 2])).unwrap()]
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_requests_share_batches_and_get_their_own_rows() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let backend = Arc::new(Doubler {
            sizes: sizes.clone(),
            delay: Duration::from_millis(20),
        });
        let batcher = Arc::new(Batcher::start("m", backend, config(8, 50)).unwrap());
        let mut tasks = Vec::new();
        for i in 0..16 {
            let b = batcher.clone();
            tasks.push(tokio::spawn(async move {
                let rows = 1 + i % 2;
                let out = b.infer(input(rows, i as f32)).await.unwrap();
                assert_eq!(out[0].shape, vec![rows, 2]);
                assert!(out[0]
                    .as_f32()
                    .unwrap()
                    .iter()
                    .all(|v| *v == 2.0 * i as f32));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        let sizes = sizes.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 24);
        assert!(sizes.iter().all(|s| *s <= 8), "{sizes:?}");
        assert!(sizes.len() < 16, "requests were not batched: {sizes:?}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_full_queue_refuses_and_old_requests_time_out() {
        let sizes = Arc::new(Mutex::new(Vec::new()));
        let backend = Arc::new(Doubler {
            sizes,
            delay: Duration::from_millis(200),
        });
        let mut cfg = config(1, 0);
        cfg.max_queue_size = 2;
        cfg.queue_timeout = Duration::from_millis(100);
        let batcher = Arc::new(Batcher::start("m", backend, cfg).unwrap());
        let refused = Arc::new(AtomicUsize::new(0));
        let timed_out = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for _ in 0..6 {
            let (b, r, t) = (batcher.clone(), refused.clone(), timed_out.clone());
            tasks.push(tokio::spawn(async move {
                match b.infer(input(1, 1.0)).await {
                    Err(ClassicError::QueueFull { .. }) => r.fetch_add(1, Ordering::SeqCst),
                    Err(ClassicError::QueueTimeout { .. }) => t.fetch_add(1, Ordering::SeqCst),
                    Ok(_) => 0,
                    Err(e) => panic!("{e}"),
                };
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert!(refused.load(Ordering::SeqCst) >= 1);
        assert!(timed_out.load(Ordering::SeqCst) >= 1);
    }
}
