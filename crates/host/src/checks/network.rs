//! Network: accept backlog, TIME_WAIT handling, the ephemeral port range, the receive
//! backlog, segmentation offloads.

use super::{sysctl_fix, sysctl_number, CheckSpec, Env};
use crate::report::{Area, Check};

const SOMAXCONN: CheckSpec = CheckSpec {
    id: "network.somaxconn",
    area: Area::Network,
    reads: "/proc/sys/net/core/somaxconn",
    expected: "≥ 4096",
    why: "The cap on every listening socket's accept queue: a burst of connections beyond it is \
          dropped or reset before the server sees it. The kernel default is 4096 since 5.4 \
          (128 before). Kernel doc admin-guide/sysctl/net.rst.",
};

const TW_REUSE: CheckSpec = CheckSpec {
    id: "network.tcp_tw_reuse",
    area: Area::Network,
    reads: "/proc/sys/net/ipv4/tcp_tw_reuse",
    expected: "1, or 2 (the default: loopback only)",
    why: "Lets outgoing connections (S3 shipping, a gateway in front, load generators) reuse \
          TIME_WAIT ports safely with timestamps; 0 exhausts the port range under churn. Kernel \
          doc networking/ip-sysctl.rst.",
};

const FIN_TIMEOUT: CheckSpec = CheckSpec {
    id: "network.tcp_fin_timeout",
    area: Area::Network,
    reads: "/proc/sys/net/ipv4/tcp_fin_timeout",
    expected: "≤ 60 s (the default; 15–30 for hosts with many short connections)",
    why: "How long an orphaned connection stays in FIN_WAIT_2, holding memory and a port. \
          Kernel doc networking/ip-sysctl.rst (default 60).",
};

const PORT_RANGE: CheckSpec = CheckSpec {
    id: "network.ip_local_port_range",
    area: Area::Network,
    reads: "/proc/sys/net/ipv4/ip_local_port_range; Context.ports",
    expected: "≥ 28232 ports (the default 32768–60999), not containing Rampart's ports",
    why: "The ports outgoing connections draw from: a narrow range runs out under load, and a \
          listening port inside it can be taken by an outgoing connection before the server \
          binds it. Kernel doc networking/ip-sysctl.rst.",
};

const NETDEV_BACKLOG: CheckSpec = CheckSpec {
    id: "network.netdev_max_backlog",
    area: Area::Network,
    reads: "/proc/sys/net/core/netdev_max_backlog",
    expected: "≥ 1000 (the default; more for 10 Gb/s and faster NICs)",
    why: "Packets queued per CPU when the interface receives faster than the kernel processes; \
          beyond it they are dropped. Kernel doc admin-guide/sysctl/net.rst.",
};

const OFFLOADS: CheckSpec = CheckSpec {
    id: "network.offloads",
    area: Area::Network,
    reads: "ethtool ETHTOOL_GTSO/ETHTOOL_GGSO (ioctl, no privilege) for each physical interface",
    expected: "TSO and GSO on",
    why: "Segmentation offloads let the stack hand large buffers to the NIC (or segment late in \
          software): without them every streamed token response costs more CPU per byte. Kernel \
          doc networking/segmentation-offloads.rst.",
};

pub(crate) const SPECS: &[&CheckSpec] = &[
    &SOMAXCONN,
    &TW_REUSE,
    &FIN_TIMEOUT,
    &PORT_RANGE,
    &NETDEV_BACKLOG,
    &OFFLOADS,
];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let mut out = vec![
        at_least(env, &SOMAXCONN, "net.core.somaxconn", 4096, "4096"),
        tw_reuse(env),
        fin_timeout(env),
        port_range(env),
        at_least(
            env,
            &NETDEV_BACKLOG,
            "net.core.netdev_max_backlog",
            1000,
            "5000",
        ),
    ];
    out.extend(offloads(env));
    out
}

fn at_least(env: &Env, spec: &CheckSpec, key: &str, minimum: i64, fix_value: &str) -> Check {
    match sysctl_number(env, key) {
        Err(e) => spec.unknown(e),
        Ok(v) if v >= minimum => spec.ok(v.to_string()),
        Ok(v) => spec.warn(v.to_string(), sysctl_fix(key, fix_value)),
    }
}

fn tw_reuse(env: &Env) -> Check {
    match sysctl_number(env, "net.ipv4.tcp_tw_reuse") {
        Err(e) => TW_REUSE.unknown(e),
        Ok(0) => TW_REUSE.warn("0", sysctl_fix("net.ipv4.tcp_tw_reuse", "1")),
        Ok(v) => TW_REUSE.ok(v.to_string()),
    }
}

fn fin_timeout(env: &Env) -> Check {
    match sysctl_number(env, "net.ipv4.tcp_fin_timeout") {
        Err(e) => FIN_TIMEOUT.unknown(e),
        Ok(v) if v <= 60 => FIN_TIMEOUT.ok(format!("{v} s")),
        Ok(v) => FIN_TIMEOUT.warn(
            format!("{v} s"),
            sysctl_fix("net.ipv4.tcp_fin_timeout", "30"),
        ),
    }
}

fn port_range(env: &Env) -> Check {
    let key = "net.ipv4.ip_local_port_range";
    let text = match env.tree.value(&super::sysctl_path(key)) {
        Ok(t) => t,
        Err(e) => return PORT_RANGE.unknown(e),
    };
    let numbers: Vec<u32> = text
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    let [low, high] = numbers[..] else {
        return PORT_RANGE.unknown(format!("unexpected value {text:?}"));
    };
    let width = high.saturating_sub(low) + 1;
    let inside: Vec<String> = env
        .ctx
        .ports
        .iter()
        .filter(|p| (low..=high).contains(&u32::from(p.addr.port())) && p.addr.port() != 0)
        .map(|p| format!("{} {}", p.name, p.addr.port()))
        .collect();
    let observed = format!("{low}–{high} ({width} ports)");
    if !inside.is_empty() {
        let reserved = env
            .ctx
            .ports
            .iter()
            .map(|p| p.addr.port().to_string())
            .collect::<Vec<_>>()
            .join(",");
        return PORT_RANGE.warn(
            format!("{observed} contains {}", inside.join(", ")),
            sysctl_fix("net.ipv4.ip_local_reserved_ports", &reserved),
        );
    }
    if width < 28_232 {
        PORT_RANGE.warn(observed, format!("sysctl -w {key}=\"32768 60999\"\necho '{key} = 32768 60999' >> /etc/sysctl.d/90-rampart.conf"))
    } else {
        PORT_RANGE.ok(observed)
    }
}

/// Interfaces backed by a device (physical NICs, virtio), up or unknown state.
fn physical_interfaces(env: &Env) -> Vec<String> {
    env.tree
        .list("/sys/class/net")
        .into_iter()
        .filter(|name| name != "lo")
        .filter(|name| env.tree.exists(&format!("/sys/class/net/{name}/device")))
        .filter(|name| {
            let state = env
                .tree
                .value(&format!("/sys/class/net/{name}/operstate"))
                .unwrap_or_default();
            state != "down" && state != "lowerlayerdown"
        })
        .collect()
}

fn offloads(env: &Env) -> Vec<Check> {
    let interfaces = physical_interfaces(env);
    if interfaces.is_empty() {
        return vec![OFFLOADS.unknown("no physical interface that is up in /sys/class/net")];
    }
    interfaces
        .into_iter()
        .map(|name| {
            let check = match crate::offloads::read(&env.tree, &name) {
                Err(e) => OFFLOADS.unknown(e),
                Ok(o) => {
                    let observed = format!(
                        "tso {}, gso {}",
                        if o.tso { "on" } else { "off" },
                        if o.gso { "on" } else { "off" }
                    );
                    if o.tso && o.gso {
                        OFFLOADS.ok(observed)
                    } else {
                        OFFLOADS.warn(observed, format!("ethtool -K {name} tso on gso on"))
                    }
                }
            };
            check.on(name)
        })
        .collect()
}
