//! The host under Rampart: what the machine is and whether it is set up to serve models.
//!
//! - [`run`]: the `rampart doctor` checks (memory, CPU, NUMA, storage, network, limits, kernel,
//!   GPU, Rampart's own settings), each with what was observed, what is expected, why (with
//!   the source) and the fix; a [`Report`] renders as text, JSON (serde) or a fix script;
//! - [`fingerprint`]: the hardware fingerprint recorded in LINEAGE.json and logged at start;
//! - [`GpuProbe`]: the seam to the GPUs, with NVML opened at run time ([`Nvml`]: no NVIDIA
//!   driver is needed to build or run) and a JSON fixture for tests ([`FixtureGpu`]);
//! - [`Telemetry`]: the readings the server exports at each scrape (process, cgroup, PSI,
//!   memory, GPUs), cheap enough for every scrape.
//!
//! Everything is read under [`Context::root`] (`<root>/proc/…`, `<root>/sys/…`,
//! `<root>/etc/…`), so a fixture tree stands in for a host; a file that cannot be read makes
//! its check `unknown`, never a panic. Nothing here needs root or the network, and nothing
//! changes the host: fixes are printed, never run.
//!
//! Not here: the CLI, the server's route and the lineage writer (they call this crate), and
//! anything async.

mod cgroup;
mod checks;
mod context;
mod cpuinfo;
mod fingerprint;
pub mod gpu;
mod kernel_log;
pub mod known_issues;
mod mounts;
mod offloads;
mod report;
pub mod telemetry;
mod tree;

pub use checks::{catalogue, CheckSpec};
pub use context::{default_kernel_isa, Context, PortToCheck, ProbeTimings};
pub use fingerprint::{
    CpuFingerprint, Fingerprint, GpuFingerprint, PcieDevice, FINGERPRINT_VERSION,
};
pub use gpu::{FixtureGpu, GpuProbe, GpuTelemetry, Nvml};
pub use report::{Area, Check, Counts, HostSummary, Report, Status, UnknownArea, SCHEMA_VERSION};
pub use telemetry::{CgroupStats, HostMemory, Pressure, ProcessStats, Telemetry, TelemetrySample};

use checks::Env;
use std::time::Instant;

/// Runs the checks of every area, or of `only`, and reports them. GPU answers come from NVML
/// on a real host and from `<root>/.rampart-fixture/nvml.json` in a fixture tree.
pub fn run(ctx: &Context, only: Option<Area>) -> Report {
    run_with_gpu(ctx, only, None)
}

/// [`run`] with the caller's GPU probe (a server that keeps NVML open, a test double).
pub fn run_with_gpu(ctx: &Context, only: Option<Area>, gpu: Option<&dyn GpuProbe>) -> Report {
    let start = Instant::now();
    let env = Env::new(ctx, gpu);
    let areas: Vec<Area> = match only {
        Some(area) => vec![area],
        None => Area::ALL.to_vec(),
    };
    let checks = areas
        .into_iter()
        .flat_map(|area| checks::run_area(&env, area))
        .collect();
    let mut report = Report::new(host_summary(&env), only, ctx.gpu_load_sample, checks);
    report.elapsed_ms = start.elapsed().as_millis() as u64;
    report
}

/// The hardware fingerprint of the host under `ctx.root`.
pub fn fingerprint(ctx: &Context) -> Fingerprint {
    fingerprint_with_gpu(ctx, None)
}

/// [`fingerprint`] with the caller's GPU probe.
pub fn fingerprint_with_gpu(ctx: &Context, gpu: Option<&dyn GpuProbe>) -> Fingerprint {
    fingerprint::build(&Env::new(ctx, gpu))
}

fn host_summary(env: &Env) -> HostSummary {
    let gpus = env.gpus_if_gathered();
    HostSummary {
        root: env.ctx.root.display().to_string(),
        hostname: env.tree.value("/proc/sys/kernel/hostname").ok(),
        os: fingerprint::os_name(&env.tree),
        kernel_release: env.tree.value("/proc/sys/kernel/osrelease").ok(),
        cpu_model: env.cpu.model.clone(),
        logical_cpus: env.cpu.logical_cpus(),
        memory_total_bytes: env.meminfo_value("MemTotal").ok(),
        gpus,
    }
}
