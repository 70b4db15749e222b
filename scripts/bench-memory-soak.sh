#!/usr/bin/env bash
# A memory soak: rampart on SmolLM2-135M Q4_1 (2 threads) inside a cgroup whose memory limit is
# far below what the KV pool may map (the pool is sized from the host's memory, and the prefix
# cache keeps every prompt it read until the pool is full), at three times the sustainable
# load, driven by scripts/bench_slo.py (the official `openai` client, closed-loop clients,
# seeded prompts of 50-400 words, 429s retried after Retry-After).
#
#   scripts/bench-memory-soak.sh RAMPART_BIN [SOAK_SECONDS] [CLIENTS] [LIMIT_MIB]
#
# Phases, each with a fresh server in a fresh cgroup:
#   unloaded  one client for 60 s: the TTFT p99 the objective is set from (2x it);
#   off       the controller off, CLIENTS clients for up to 180 s: does the cgroup's OOM
#             killer take the server?
#   soak      the controller on with that objective, CLIENTS clients for SOAK_SECONDS, then
#             up to 120 s idle until the controller is back at level 0: OOM kills, the
#             cgroup's peak usage against its limit, admitted TTFT, refusals, every
#             degradation step and the recovery from the server's log.
# Prints a JSON line per phase. Needs root and a writable memory cgroup (v1 or v2).
# RAMPART_SOAK_LOG=FILE keeps the soak server's log; RAMPART_SOAK_SKIP_OFF=1 skips the off phase.
# RAMPART_TEST_PYTHON: a Python with `openai`.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(realpath "$1")" soak="${2:-600}" clients="${3:-48}" limit_mib="${4:-1024}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
work="$(mktemp -d)"
port=18515
cg=""
cleanup() {
  kill "${pid:-0}" 2>/dev/null || true
  wait "${pid:-0}" 2>/dev/null || true
  [[ -n $cg && -d $cg ]] && rmdir "$cg" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

# A fresh cgroup with the limit; sets cg, and the files to read.
make_cgroup() {
  local name="rampart-soak-$$-$1"
  if [[ -d /sys/fs/cgroup/memory ]]; then
    cg="/sys/fs/cgroup/memory/$name"
    mkdir "$cg"
    echo $((limit_mib << 20)) >"$cg/memory.limit_in_bytes"
    usage_file="$cg/memory.usage_in_bytes"
    peak_file="$cg/memory.max_usage_in_bytes"
  else
    cg="/sys/fs/cgroup/$name"
    mkdir "$cg"
    echo $((limit_mib << 20)) >"$cg/memory.max"
    echo 0 >"$cg/memory.swap.max" 2>/dev/null || true
    usage_file="$cg/memory.current"
    peak_file="$cg/memory.peak"
  fi
}

oom_kills() {
  if [[ -f $cg/memory.oom_control ]]; then
    awk '$1 == "oom_kill" {print $2}' "$cg/memory.oom_control"
  else
    awk '$1 == "oom_kill" {print $2}' "$cg/memory.events"
  fi
}

"$bin" model import "$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --repo "$work/models" \
  --name smollm2-135m --version 1.0.0 >/dev/null

config() { # side, extra toml
  cat >"$work/$1.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$work/models"
threads = 2
[admission]
max_in_flight = 64
max_waiting = 256
[log]
file = "$work/server-$1.log"
$2
[[models]]
name = "smollm2-135m"
context = 4096
max_num_seqs = 64
$3
TOML
}

start() { # side
  make_cgroup "$1"
  (echo $BASHPID >"$cg/cgroup.procs" && cd "$work" &&
    exec "$bin" serve --config "$work/$1.toml" --no-grpc >"$work/stderr-$1.log" 2>&1) &
  pid=$!
  for _ in $(seq 1 600); do
    curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "the server did not become ready" >&2
  cat "$work/stderr-$1.log" >&2
  exit 1
}

# Samples the cgroup's usage every second while the server lives: prints the highest seen.
watch_usage() {
  local top=0 now
  while kill -0 "$pid" 2>/dev/null; do
    now=$(cat "$usage_file" 2>/dev/null || echo 0)
    ((now > top)) && top=$now && echo "$top" >"$work/usage-top"
    sleep 1
  done
}

stop() {
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  rmdir "$cg" 2>/dev/null || true
  cg=""
}

# Unloaded.
config unloaded "" ""
start unloaded
unloaded=$("$python" scripts/bench_slo.py --url "http://127.0.0.1:$port/v1" --model smollm2-135m \
  --clients 1 --duration 60 --warmup 5 --seed 7)
stop
p99=$(echo "$unloaded" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ttft_ms"]["p99"])')
objective=$(python3 -c "print(max(100, int(2 * $p99)))")
echo "{\"phase\": \"unloaded\", \"ttft_objective_ms\": $objective, \"result\": $unloaded}"

# Off: does the limit bite? (RAMPART_SOAK_SKIP_OFF=1 skips this phase.)
if [[ "${RAMPART_SOAK_SKIP_OFF:-0}" != 1 ]]; then
config off $'[degradation]\nenabled = false' ""
start off
echo 0 >"$work/usage-top"
watch_usage &
watcher=$!
off=$(timeout 200 "$python" scripts/bench_slo.py --url "http://127.0.0.1:$port/v1" --model smollm2-135m \
  --clients "$clients" --duration 180 --warmup 0 --seed 8 2>/dev/null || echo null)
alive=$(kill -0 "$pid" 2>/dev/null && echo true || echo false)
kills=$(oom_kills)
peak=$(cat "$peak_file" 2>/dev/null || cat "$work/usage-top")
stop
wait "$watcher" 2>/dev/null || true
echo "{\"phase\": \"off\", \"limit_mib\": $limit_mib, \"server_alive_at_end\": $alive, \"oom_kills\": $kills, \"peak_mib\": $((peak >> 20)), \"result\": $off}"
fi

# Soak with the controller and the objective.
config soak "" $'[models.slo]\n'"ttft_p99_ms = $objective"
start soak
echo 0 >"$work/usage-top"
watch_usage &
watcher=$!
result=$("$python" scripts/bench_slo.py --url "http://127.0.0.1:$port/v1" --model smollm2-135m \
  --clients "$clients" --duration "$soak" --warmup 10 --seed 9)
level=null recovered=null
for waited in $(seq 0 5 120); do
  level=$(curl -fs "http://127.0.0.1:$port/admin/degradation" |
    python3 -c 'import json,sys; m=json.load(sys.stdin)["models"]; print(m[0]["level"])' 2>/dev/null || echo null)
  if [[ $level == 0 ]]; then
    recovered=$waited
    break
  fi
  sleep 5
done
alive=$(kill -0 "$pid" 2>/dev/null && echo true || echo false)
kills=$(oom_kills)
peak=$(cat "$peak_file" 2>/dev/null || cat "$work/usage-top")
log="$work/server-soak.log"
lowered=$(grep -c '"degradation: limit lowered' "$log" || true)
raised=$(grep -c '"degradation: limit raised' "$log" || true)
releases=$(grep -c '"degradation: free KV pages given back' "$log" || true)
causes=$(grep '"degradation: ' "$log" | python3 -c '
import collections, json, sys
c = collections.Counter()
for line in sys.stdin:
    f = json.loads(line).get("fields", json.loads(line))
    c[(f.get("lever"), f.get("cause"))] += 1
print(json.dumps({f"{k[0]}/{k[1]}": v for k, v in sorted(c.items())}))' 2>/dev/null || echo null)
cp "$log" "${RAMPART_SOAK_LOG:-/dev/null}" 2>/dev/null || true
stop
wait "$watcher" 2>/dev/null || true
echo "{\"phase\": \"soak\", \"limit_mib\": $limit_mib, \"ttft_objective_ms\": $objective, \"server_alive_at_end\": $alive, \"oom_kills\": $kills, \"peak_mib\": $((peak >> 20)), \"limits_lowered\": $lowered, \"limits_raised\": $raised, \"kv_releases\": $releases, \"level_after_idle\": $level, \"idle_seconds_to_level_0\": $recovered, \"changes\": $causes, \"result\": $result}"
