//! NUMA: the nodes, where this process may run and allocate, zone reclaim, and which node
//! each GPU hangs off.

use super::{sysctl_fix, sysctl_number, CheckSpec, Env, GpuFacts};
use crate::report::{Area, Check};
use crate::tree::{format_cpu_list, human_bytes, parse_kv_sizes};

const NODES: CheckSpec = CheckSpec {
    id: "numa.nodes",
    area: Area::Numa,
    reads: "/sys/devices/system/node/node*/{cpulist,meminfo}",
    expected: "every node with CPUs also has memory",
    why: "A node with CPUs and no memory makes every allocation of its threads remote. The node \
          list is also what the placement advice below binds to. Kernel doc \
          admin-guide/mm/numa_memory_policy.rst.",
};

const PLACEMENT: CheckSpec = CheckSpec {
    id: "numa.placement",
    area: Area::Numa,
    reads: "Cpus_allowed_list and Mems_allowed_list in /proc/self/status; the node CPU lists",
    expected: "one NUMA node per server process on multi-node hosts (numactl binding)",
    why: "Decode is memory-bound: threads reading weights across the socket interconnect lose \
          a large share of bandwidth. Bind each server (or replica) to one node's CPUs and \
          memory; llama.cpp's --numa modes exist for the same reason.",
};

const ZONE_RECLAIM: CheckSpec = CheckSpec {
    id: "numa.zone_reclaim_mode",
    area: Area::Numa,
    reads: "/proc/sys/vm/zone_reclaim_mode",
    expected: "0",
    why: "With zone reclaim on, a node short of free memory reclaims its own page cache (the \
          model files) instead of allocating on another node: the weights are read from disk \
          again. Kernel doc admin-guide/sysctl/vm.rst (zone_reclaim_mode, off by default).",
};

const GPU_AFFINITY: CheckSpec = CheckSpec {
    id: "numa.gpu_affinity",
    area: Area::Numa,
    reads: "/sys/bus/pci/devices/<gpu>/numa_node, local_cpulist; this process's CPUs",
    expected: "the process may run on the CPUs of each GPU's node",
    why: "Host-to-device copies from the other socket cross the interconnect and run slower; \
          run the server on the GPU's node (NVIDIA's topology guidance; `nvidia-smi topo -m` \
          shows the same affinity).",
};

pub(crate) const SPECS: &[&CheckSpec] = &[&NODES, &PLACEMENT, &ZONE_RECLAIM, &GPU_AFFINITY];

pub(crate) fn checks(env: &Env) -> Vec<Check> {
    let mut out = vec![nodes(env), placement(env), zone_reclaim(env)];
    out.extend(gpu_affinity(env));
    out
}

fn node_memory(env: &Env, node: u32) -> Option<u64> {
    let text = env
        .tree
        .read(&format!("/sys/devices/system/node/node{node}/meminfo"))
        .ok()?;
    // "Node 0 MemTotal:  65843056 kB": drop the "Node N" prefix.
    let stripped: String = text
        .lines()
        .map(|l| {
            l.split_once(' ')
                .and_then(|(_, rest)| rest.split_once(' '))
                .map_or(l, |(_, r)| r)
        })
        .collect::<Vec<_>>()
        .join("\n");
    parse_kv_sizes(&stripped).get("MemTotal").copied()
}

fn nodes(env: &Env) -> Check {
    let nodes = match env.numa_nodes() {
        Ok(n) => n,
        Err(e) => return NODES.unknown(e),
    };
    let mut parts = Vec::new();
    let mut memoryless = Vec::new();
    for (id, cpus) in &nodes {
        let memory = node_memory(env, *id);
        parts.push(format!(
            "node{id}: CPUs {}, {}",
            if cpus.is_empty() {
                "none".to_string()
            } else {
                format_cpu_list(cpus)
            },
            memory.map_or("memory unknown".to_string(), human_bytes)
        ));
        if !cpus.is_empty() && memory == Some(0) {
            memoryless.push(format!("node{id}"));
        }
    }
    let observed = format!("{} node(s): {}", nodes.len(), parts.join("; "));
    if memoryless.is_empty() {
        NODES.ok(observed)
    } else {
        NODES.warn(
            format!("{observed}; {} without memory", memoryless.join(", ")),
            "# populate the DIMM slots of every socket, or keep the server off the memoryless node's CPUs",
        )
    }
}

fn placement(env: &Env) -> Check {
    let nodes = match env.numa_nodes() {
        Ok(n) => n,
        Err(e) => return PLACEMENT.unknown(e),
    };
    let with_cpus: Vec<&(u32, Vec<u32>)> = nodes.iter().filter(|(_, c)| !c.is_empty()).collect();
    if with_cpus.len() <= 1 {
        return PLACEMENT.ok("one NUMA node: nothing to bind");
    }
    let allowed = env.usable_cpus();
    let spanned: Vec<u32> = with_cpus
        .iter()
        .filter(|(_, cpus)| cpus.iter().any(|c| allowed.contains(c)))
        .map(|(id, _)| *id)
        .collect();
    let bindings = with_cpus
        .iter()
        .map(|(id, cpus)| {
            format!(
                "numactl --cpunodebind={id} --membind={id} rampart serve …   # CPUs {}",
                format_cpu_list(cpus)
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    let observed = format!(
        "{} nodes; this process may run on CPUs {} (nodes {})",
        with_cpus.len(),
        format_cpu_list(&allowed),
        spanned
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    );
    if spanned.len() > 1 {
        PLACEMENT.warn(
            observed,
            format!(
                "# one server (or replica) per node, bound to its CPUs and memory:\n{bindings}"
            ),
        )
    } else {
        PLACEMENT.ok(observed)
    }
}

fn zone_reclaim(env: &Env) -> Check {
    match sysctl_number(env, "vm.zone_reclaim_mode") {
        Err(e) => ZONE_RECLAIM.unknown(e),
        Ok(0) => ZONE_RECLAIM.ok("0"),
        Ok(v) => ZONE_RECLAIM.warn(v.to_string(), sysctl_fix("vm.zone_reclaim_mode", "0")),
    }
}

fn gpu_affinity(env: &Env) -> Vec<Check> {
    let gpus: &GpuFacts = env.gpus();
    let mut bus_ids: Vec<(String, String)> = gpus
        .devices
        .iter()
        .filter_map(|d| d.pci_bus_id.clone().ok().map(|b| (GpuFacts::label(d), b)))
        .collect();
    if bus_ids.is_empty() {
        bus_ids = gpus
            .pci_devices
            .iter()
            .enumerate()
            .map(|(i, b)| (format!("gpu{i}"), b.clone()))
            .collect();
    }
    if bus_ids.is_empty() {
        return vec![GPU_AFFINITY.unknown(gpus.absent_reason())];
    }
    let allowed = env.usable_cpus();
    bus_ids
        .into_iter()
        .map(|(label, bus)| {
            let dir = format!("/sys/bus/pci/devices/{bus}");
            let node = env.tree.number(&format!("{dir}/numa_node"));
            let local = env
                .tree
                .value(&format!("{dir}/local_cpulist"))
                .map(|t| crate::tree::parse_cpu_list(&t))
                .unwrap_or_default();
            let check = match node {
                Err(e) => GPU_AFFINITY.unknown(e),
                Ok(n) if n < 0 => {
                    GPU_AFFINITY.ok(format!("{bus}: no NUMA node reported (single-node host)"))
                }
                Ok(n) if local.is_empty() || local.iter().any(|c| allowed.contains(c)) => {
                    GPU_AFFINITY.ok(format!(
                        "{bus} on node {n} (CPUs {}); this process may run there",
                        format_cpu_list(&local)
                    ))
                }
                Ok(n) => GPU_AFFINITY.warn(
                    format!(
                        "{bus} on node {n} (CPUs {}), but this process may only run on CPUs {}",
                        format_cpu_list(&local),
                        format_cpu_list(&allowed)
                    ),
                    format!("numactl --cpunodebind={n} --membind={n} rampart serve …"),
                ),
            };
            check.on(label)
        })
        .collect()
}
