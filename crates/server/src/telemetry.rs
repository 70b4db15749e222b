//! The host telemetry on `/metrics`: at each scrape one [`host::Telemetry`] reading (process,
//! cgroup, PSI, memory, GPUs) is written as Prometheus text after the recorder's metrics.
//! Written directly rather than through the `metrics` recorder because several are float
//! counters (CPU seconds, stall seconds), which the recorder's integer counters cannot hold,
//! and because a value that could not be read must be absent, not stale.
//!
//! Names, types and help are in [`HOST_METRICS`]; docs/metrics.md documents them.

use std::fmt::Write as _;
use std::time::Instant;

use host::telemetry::TelemetrySample;

use crate::config::TelemetryConfig;
use crate::log_metrics::{MetricInfo, MetricKind, MetricSource};

const fn host(
    name: &'static str,
    kind: MetricKind,
    labels: &'static [&'static str],
    help: &'static str,
) -> MetricInfo {
    MetricInfo {
        name,
        kind,
        labels,
        help,
        source: MetricSource::Host,
    }
}

use MetricKind::{Counter, Gauge};

/// The host telemetry's metrics.
pub static HOST_METRICS: &[MetricInfo] = &[
    host("rampart_process_cpu_seconds_total", Counter, &[], "User and system CPU time of the server process."),
    host("rampart_process_resident_memory_bytes", Gauge, &[], "Resident memory of the server process (VmRSS)."),
    host("rampart_process_virtual_memory_bytes", Gauge, &[], "Virtual memory of the server process (VmSize)."),
    host("rampart_process_open_fds", Gauge, &[], "File descriptors the server process holds open."),
    host("rampart_process_max_fds", Gauge, &[], "The process's soft limit on open file descriptors."),
    host("rampart_process_threads", Gauge, &[], "Threads of the server process."),
    host("rampart_cgroup_memory_usage_bytes", Gauge, &[], "Memory the process's cgroup uses (v2 memory.current, v1 memory.usage_in_bytes)."),
    host("rampart_cgroup_memory_limit_bytes", Gauge, &[], "Memory limit of the process's cgroup; absent when there is none."),
    host("rampart_cgroup_oom_kills_total", Counter, &[], "Processes the kernel's OOM killer killed in the cgroup (v2 memory.events)."),
    host("rampart_cgroup_cpu_quota_cores", Gauge, &[], "CPU quota of the process's cgroup in CPUs; absent when there is none."),
    host("rampart_cgroup_cpu_usage_seconds_total", Counter, &[], "CPU time the cgroup used."),
    host("rampart_cgroup_cpu_periods_total", Counter, &[], "CFS enforcement periods of the cgroup that had runnable tasks."),
    host("rampart_cgroup_cpu_throttled_periods_total", Counter, &[], "Enforcement periods in which the cgroup was throttled (ran out of quota)."),
    host("rampart_cgroup_cpu_throttled_seconds_total", Counter, &[], "Time the cgroup's tasks spent throttled."),
    host("rampart_pressure_stall_seconds_total", Counter, &["resource", "kind"], "Pressure stall time: some (or all, kind=full) tasks waited for the resource (cgroup PSI when available, else the host's)."),
    host("rampart_pressure_avg10_ratio", Gauge, &["resource", "kind"], "Share of the last 10 s tasks stalled on the resource, as the kernel averages it (0-1)."),
    host("rampart_host_memory_total_bytes", Gauge, &[], "The host's memory (MemTotal)."),
    host("rampart_host_memory_available_bytes", Gauge, &[], "Memory the host can give without swapping (MemAvailable)."),
    host("rampart_host_telemetry_duration_seconds", Gauge, &[], "Time the last host telemetry reading took."),
    host("rampart_gpu_info", Gauge, &["gpu", "name", "uuid"], "1 for each GPU NVML reports, with its name and UUID."),
    host("rampart_gpu_utilization_ratio", Gauge, &["gpu"], "Share of the last sample period a kernel ran on the GPU (0-1)."),
    host("rampart_gpu_memory_utilization_ratio", Gauge, &["gpu"], "Share of the last sample period device memory was read or written (0-1)."),
    host("rampart_gpu_memory_used_bytes", Gauge, &["gpu"], "Device memory in use."),
    host("rampart_gpu_memory_total_bytes", Gauge, &["gpu"], "Device memory in all."),
    host("rampart_gpu_temperature_celsius", Gauge, &["gpu"], "GPU core temperature."),
    host("rampart_gpu_power_watts", Gauge, &["gpu"], "GPU board power draw."),
    host("rampart_gpu_power_limit_watts", Gauge, &["gpu"], "GPU power limit the driver enforces."),
    host("rampart_gpu_sm_clock_hertz", Gauge, &["gpu"], "Current SM clock."),
    host("rampart_gpu_sm_clock_max_hertz", Gauge, &["gpu"], "Maximum SM clock."),
    host("rampart_gpu_memory_clock_hertz", Gauge, &["gpu"], "Current memory clock."),
    host("rampart_gpu_memory_clock_max_hertz", Gauge, &["gpu"], "Maximum memory clock."),
    host("rampart_gpu_throttle_reasons", Gauge, &["gpu"], "NVML clock event (throttle) reasons as a bit mask (1 idle, 4 sw power cap, 8 hw slowdown, 32 sw thermal, 64 hw thermal, 128 power brake)."),
    host("rampart_gpu_throttle_reason_active", Gauge, &["gpu", "reason"], "1 while the named clock event (throttle) reason holds, else 0."),
    host("rampart_gpu_pcie_link_gen", Gauge, &["gpu"], "Current PCIe link generation (drops at idle to save power)."),
    host("rampart_gpu_pcie_link_gen_max", Gauge, &["gpu"], "Fastest PCIe generation the GPU and its slot support."),
    host("rampart_gpu_pcie_link_width", Gauge, &["gpu"], "Current PCIe link width (lanes)."),
    host("rampart_gpu_pcie_link_width_max", Gauge, &["gpu"], "Widest PCIe link the GPU and its slot support."),
    host("rampart_gpu_ecc_errors_total", Counter, &["gpu", "type"], "ECC memory errors since the driver loaded, by type (corrected, uncorrected)."),
    host("rampart_gpu_xid_errors_total", Counter, &["gpu"], "Critical XID events NVML delivered since the server opened it."),
];

/// Opens the host telemetry as `[telemetry]` says (`None` when it is off).
pub fn open(config: &TelemetryConfig) -> Option<host::Telemetry> {
    if !config.enabled {
        return None;
    }
    let telemetry = if config.gpu {
        host::Telemetry::open(&config.root)
    } else {
        host::Telemetry::with_gpu(&config.root, None)
    };
    match telemetry.gpu_absent() {
        Some(why) => tracing::info!(reason = %why, "no GPU telemetry"),
        None => tracing::info!(gpus = telemetry.gpus().len(), "GPU telemetry through NVML"),
    }
    Some(telemetry)
}

/// Takes one reading and appends it to a scrape's body. Returns the GPUs' mean utilization
/// (0–1), for the records; `None` without GPU readings.
pub fn render(telemetry: &host::Telemetry, out: &mut String) -> Option<f64> {
    let start = Instant::now();
    let sample = telemetry.sample();
    write_sample(telemetry, &sample, out);
    let readings: Vec<f64> = sample
        .gpus
        .iter()
        .filter_map(|g| g.utilization_gpu_percent.as_ref().ok())
        .map(|p| f64::from(*p) / 100.0)
        .collect();
    family(
        out,
        "rampart_host_telemetry_duration_seconds",
        [(Labels::none(), Some(start.elapsed().as_secs_f64()))],
    );
    (!readings.is_empty()).then(|| readings.iter().sum::<f64>() / readings.len() as f64)
}

/// A sample's label pairs.
struct Labels(Vec<(&'static str, String)>);

impl Labels {
    fn none() -> Labels {
        Labels(Vec::new())
    }

    fn gpu(index: u32) -> Labels {
        Labels(vec![("gpu", index.to_string())])
    }

    fn with(mut self, key: &'static str, value: impl Into<String>) -> Labels {
        self.0.push((key, value.into()));
        self
    }
}

fn write_sample(telemetry: &host::Telemetry, s: &TelemetrySample, out: &mut String) {
    let one = |out: &mut String, name: &'static str, value: Option<f64>| {
        family(out, name, [(Labels::none(), value)]);
    };
    let p = &s.process;
    one(out, "rampart_process_cpu_seconds_total", p.cpu_seconds);
    one(
        out,
        "rampart_process_resident_memory_bytes",
        p.resident_bytes.map(|v| v as f64),
    );
    one(
        out,
        "rampart_process_virtual_memory_bytes",
        p.virtual_bytes.map(|v| v as f64),
    );
    one(
        out,
        "rampart_process_open_fds",
        p.open_fds.map(|v| v as f64),
    );
    one(out, "rampart_process_max_fds", p.max_fds.map(|v| v as f64));
    one(out, "rampart_process_threads", p.threads.map(|v| v as f64));
    let c = &s.cgroup;
    one(
        out,
        "rampart_cgroup_memory_usage_bytes",
        c.memory_usage_bytes.map(|v| v as f64),
    );
    one(
        out,
        "rampart_cgroup_memory_limit_bytes",
        c.memory_limit_bytes.map(|v| v as f64),
    );
    one(
        out,
        "rampart_cgroup_oom_kills_total",
        c.oom_kills.map(|v| v as f64),
    );
    one(out, "rampart_cgroup_cpu_quota_cores", c.cpu_quota_cores);
    one(
        out,
        "rampart_cgroup_cpu_usage_seconds_total",
        c.cpu_usage_seconds,
    );
    one(
        out,
        "rampart_cgroup_cpu_periods_total",
        c.cpu_periods.map(|v| v as f64),
    );
    one(
        out,
        "rampart_cgroup_cpu_throttled_periods_total",
        c.cpu_throttled_periods.map(|v| v as f64),
    );
    one(
        out,
        "rampart_cgroup_cpu_throttled_seconds_total",
        c.cpu_throttled_seconds,
    );
    let psi = |value: fn(&host::telemetry::Pressure) -> f64| {
        s.pressure
            .iter()
            .map(move |line| {
                let labels = Labels::none()
                    .with("resource", line.resource)
                    .with("kind", line.kind);
                (labels, Some(value(line)))
            })
            .collect::<Vec<_>>()
    };
    family(
        out,
        "rampart_pressure_stall_seconds_total",
        psi(|l| l.total_seconds),
    );
    family(
        out,
        "rampart_pressure_avg10_ratio",
        psi(|l| l.avg10_percent / 100.0),
    );
    one(
        out,
        "rampart_host_memory_total_bytes",
        s.memory.total_bytes.map(|v| v as f64),
    );
    one(
        out,
        "rampart_host_memory_available_bytes",
        s.memory.available_bytes.map(|v| v as f64),
    );

    family(
        out,
        "rampart_gpu_info",
        telemetry.gpus().iter().map(|g| {
            let labels = Labels::gpu(g.index)
                .with("name", g.name.clone().unwrap_or_default())
                .with("uuid", g.uuid.clone().unwrap_or_default());
            (labels, Some(1.0))
        }),
    );
    type Read = fn(&host::GpuTelemetry) -> Option<f64>;
    let per_gpu: [(&'static str, Read); 17] = [
        ("rampart_gpu_utilization_ratio", |g| {
            g.utilization_gpu_percent
                .as_ref()
                .ok()
                .map(|v| f64::from(*v) / 100.0)
        }),
        ("rampart_gpu_memory_utilization_ratio", |g| {
            g.utilization_memory_percent
                .as_ref()
                .ok()
                .map(|v| f64::from(*v) / 100.0)
        }),
        ("rampart_gpu_memory_used_bytes", |g| {
            g.memory_used_bytes.as_ref().ok().map(|v| *v as f64)
        }),
        ("rampart_gpu_memory_total_bytes", |g| {
            g.memory_total_bytes.as_ref().ok().map(|v| *v as f64)
        }),
        ("rampart_gpu_temperature_celsius", |g| {
            g.temperature_c.as_ref().ok().map(|v| f64::from(*v))
        }),
        ("rampart_gpu_power_watts", |g| {
            g.power_usage_mw.as_ref().ok().map(|v| f64::from(*v) / 1e3)
        }),
        ("rampart_gpu_power_limit_watts", |g| {
            g.power_limit_mw.as_ref().ok().map(|v| f64::from(*v) / 1e3)
        }),
        ("rampart_gpu_sm_clock_hertz", |g| {
            g.sm_clock_mhz.as_ref().ok().map(|v| f64::from(*v) * 1e6)
        }),
        ("rampart_gpu_sm_clock_max_hertz", |g| {
            g.sm_clock_max_mhz
                .as_ref()
                .ok()
                .map(|v| f64::from(*v) * 1e6)
        }),
        ("rampart_gpu_memory_clock_hertz", |g| {
            g.memory_clock_mhz
                .as_ref()
                .ok()
                .map(|v| f64::from(*v) * 1e6)
        }),
        ("rampart_gpu_memory_clock_max_hertz", |g| {
            g.memory_clock_max_mhz
                .as_ref()
                .ok()
                .map(|v| f64::from(*v) * 1e6)
        }),
        ("rampart_gpu_throttle_reasons", |g| {
            g.clock_event_reasons.as_ref().ok().map(|v| *v as f64)
        }),
        ("rampart_gpu_pcie_link_gen", |g| {
            g.pcie_current.as_ref().ok().map(|l| f64::from(l.gen))
        }),
        ("rampart_gpu_pcie_link_gen_max", |g| {
            g.pcie_max.as_ref().ok().map(|l| f64::from(l.gen))
        }),
        ("rampart_gpu_pcie_link_width", |g| {
            g.pcie_current.as_ref().ok().map(|l| f64::from(l.width))
        }),
        ("rampart_gpu_pcie_link_width_max", |g| {
            g.pcie_max.as_ref().ok().map(|l| f64::from(l.width))
        }),
        ("rampart_gpu_xid_errors_total", |g| {
            g.xid_errors.as_ref().ok().map(|v| *v as f64)
        }),
    ];
    for (name, read) in per_gpu {
        family(
            out,
            name,
            s.gpus.iter().map(|g| (Labels::gpu(g.index), read(g))),
        );
    }
    family(
        out,
        "rampart_gpu_throttle_reason_active",
        s.gpus.iter().flat_map(|g| {
            let mask = g.clock_event_reasons.as_ref().ok().copied();
            host::gpu::clock_reasons::NAMES
                .iter()
                .map(move |(bit, reason)| {
                    let labels = Labels::gpu(g.index).with("reason", *reason);
                    (labels, mask.map(|m| f64::from(u8::from(m & bit != 0))))
                })
        }),
    );
    family(
        out,
        "rampart_gpu_ecc_errors_total",
        s.gpus.iter().flat_map(|g| {
            [
                ("corrected", g.ecc_corrected_volatile.as_ref().ok()),
                ("uncorrected", g.ecc_uncorrected_volatile.as_ref().ok()),
            ]
            .map(|(kind, v)| {
                (
                    Labels::gpu(g.index).with("type", kind),
                    v.map(|v| *v as f64),
                )
            })
        }),
    );
}

/// Writes one metric family: HELP and TYPE from [`HOST_METRICS`], then each sample that has
/// a value. No sample with a value: nothing at all.
fn family(
    out: &mut String,
    name: &'static str,
    samples: impl IntoIterator<Item = (Labels, Option<f64>)>,
) {
    let mut header = false;
    for (labels, value) in samples {
        let Some(value) = value else { continue };
        if !header {
            header = true;
            if let Some(info) = HOST_METRICS.iter().find(|m| m.name == name) {
                let kind = match info.kind {
                    MetricKind::Counter => "counter",
                    MetricKind::Gauge => "gauge",
                    MetricKind::Histogram => "histogram",
                };
                let _ = writeln!(out, "# HELP {name} {}", escape_help(info.help));
                let _ = writeln!(out, "# TYPE {name} {kind}");
            }
        }
        out.push_str(name);
        if !labels.0.is_empty() {
            out.push('{');
            for (i, (key, value)) in labels.0.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{key}=\"{}\"", escape_label(value));
            }
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }
    if header {
        out.push('\n');
    }
}

fn escape_help(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_label(text: &str) -> String {
    text.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn fixture(name: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../host/tests/fixtures")
            .join(name)
    }

    #[test]
    fn a_fixture_host_renders_every_family_once() {
        let t = host::Telemetry::open(&fixture("telemetry-v2"));
        let mut out = String::new();
        // GPU 1 has no utilization reading: the mean is GPU 0's.
        assert_eq!(render(&t, &mut out), Some(0.93));
        for line in [
            "rampart_process_cpu_seconds_total 4",
            "rampart_cgroup_memory_limit_bytes 8589934592",
            "rampart_cgroup_cpu_throttled_seconds_total 1.25",
            "rampart_cgroup_cpu_throttled_periods_total 40",
            "rampart_pressure_stall_seconds_total{resource=\"memory\",kind=\"full\"} 1.5",
            "rampart_pressure_avg10_ratio{resource=\"memory\",kind=\"some\"} 0.12",
            "rampart_gpu_info{gpu=\"0\",name=\"NVIDIA H100 80GB HBM3\",uuid=\"GPU-0000-fixture\"} 1",
            "rampart_gpu_utilization_ratio{gpu=\"0\"} 0.93",
            "rampart_gpu_temperature_celsius{gpu=\"1\"} 40",
            "rampart_gpu_power_watts{gpu=\"0\"} 650",
            "rampart_gpu_sm_clock_max_hertz{gpu=\"0\"} 1980000000",
            "rampart_gpu_throttle_reason_active{gpu=\"0\",reason=\"sw_power_cap\"} 1",
            "rampart_gpu_throttle_reason_active{gpu=\"0\",reason=\"hw_slowdown\"} 0",
            "rampart_gpu_pcie_link_width{gpu=\"0\"} 8",
            "rampart_gpu_ecc_errors_total{gpu=\"0\",type=\"corrected\"} 12",
            "rampart_gpu_xid_errors_total{gpu=\"0\"} 2",
        ] {
            assert!(out.lines().any(|l| l == line), "missing {line:?} in\n{out}");
        }
        // GPU 1 has no utilization in its fixture: its sample is absent, not zero.
        assert!(!out.contains("rampart_gpu_utilization_ratio{gpu=\"1\"}"));
        for info in HOST_METRICS {
            let headers = out.matches(&format!("# TYPE {} ", info.name)).count();
            assert!(headers <= 1, "{} has {headers} TYPE lines", info.name);
        }
        // Every sample line names a metric of the table.
        for line in out.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            assert!(
                HOST_METRICS.iter().any(|m| m.name == name),
                "{name} not in HOST_METRICS"
            );
        }
    }

    #[test]
    fn no_gpu_means_no_gpu_metrics() {
        let t = host::Telemetry::open(&fixture("telemetry-v1"));
        let mut out = String::new();
        render(&t, &mut out);
        assert!(!out.contains("rampart_gpu_"), "{out}");
        assert!(out.contains("rampart_cgroup_cpu_throttled_periods_total 25"));
        // No cgroup memory limit in the v1 tree: absent.
        assert!(!out.contains("rampart_cgroup_memory_limit_bytes"));
    }
}

#[cfg(test)]
mod record_tests {
    use crate::config::ServerConfig;
    use crate::state::AppState;

    #[test]
    fn records_carry_the_last_gpu_utilization_only_when_there_is_one() {
        let state = AppState::new(
            ServerConfig::default(),
            None,
            None,
            record::Bus::disconnected(),
        );
        assert_eq!(state.front.gpu_utilization(), None);
        let builder = state.front.record("r1".into(), "p".into(), "chat");
        let json = serde_json::to_value(&builder.record).expect("a record serializes");
        assert!(json.get("gpu_utilization").is_none(), "no GPU: no field");
        state.front.set_gpu_utilization(Some(0.25));
        assert_eq!(state.front.gpu_utilization(), Some(0.25));
        state.front.set_gpu_utilization(None);
        assert_eq!(state.front.gpu_utilization(), None);
    }
}
