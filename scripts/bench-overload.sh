#!/usr/bin/env bash
# Overload where the user sits: closed-loop clients on the official `openai` client that retries
# a 429 by itself (the same request again after `retry-after-ms` / `Retry-After`, up to 30
# times), the user's time to first token counted from the first attempt
# (scripts/bench_slo.py --official-retries 30). SmolLM2-135M Q4_1, 2 threads, prompts of 50-400
# words, 64 output tokens, at each concurrency, on fresh servers:
#   default    rampart with its defaults (no objective: a plain queue)
#   nobooking  rampart with `ttft_p99_ms` and `[admission] reservations = 0` (the first-token
#              gate refuses; nobody is booked: the retry is a lottery)
#   objective  rampart with `ttft_p99_ms` (refusals booked, let in at their time, in order)
#   llama      llama-server (`-np` = the concurrency), when LLAMA_SERVER is given
# Prints one JSON line per server and concurrency.
#
#   scripts/bench-overload.sh RAMPART_BIN [LLAMA_SERVER] [CONCURRENCIES] [SECONDS] [ROUNDS]
#
# RAMPART_TTFT_MS sets the objective (default 800); RAMPART_TEST_PYTHON a Python with `openai`;
# RAMPART_OVERLOAD_SIDES picks the servers (default "default nobooking objective llama");
# RAMPART_OVERLOAD_TRACE a folder for each run's per-request attempts (bench_slo.py --trace);
# RAMPART_OVERLOAD_ARGS more bench_slo.py arguments (--drain-warmup: the counted window opens
# with all clients arriving at once).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(realpath "$1")" llama="${2:-}" levels="${3:-16,48}" seconds="${4:-90}" rounds="${5:-1}"
ttft="${RAMPART_TTFT_MS:-800}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
gguf="$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$gguf" --repo "$repo" --name smollm2-135m --version 1.0.0 >/dev/null
port=18507
sides="${RAMPART_OVERLOAD_SIDES:-default nobooking objective llama}"
for side in default nobooking objective; do
  case $side in
    default) slo="" admission="" ;;
    nobooking) slo=$'[models.slo]\n'"ttft_p99_ms = $ttft" admission="reservations = 0" ;;
    objective) slo=$'[models.slo]\n'"ttft_p99_ms = $ttft" admission="" ;;
  esac
  cat >"$work/$side.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
threads = 2
[admission]
max_in_flight = 64
max_waiting = 256
$admission
[log]
file = "$work/server-$side.log"
[[models]]
name = "smollm2-135m"
context = 4096
max_num_seqs = 64
$slo
TOML
done
wait_ready() {
  for _ in $(seq 1 600); do
    curl -fs "http://127.0.0.1:$port/health${1-/ready}" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}
for round in $(seq 1 "$rounds"); do
  for clients in ${levels//,/ }; do
    for side in $sides; do
      if [[ $side == llama ]]; then
        [[ -n $llama ]] || continue
        "$llama" -m "$gguf" -t 2 -c $((clients * 1024)) -np "$clients" --port "$port" \
          >"$work/server-llama.log" 2>&1 &
        pid=$!
        wait_ready ""
      else
        (cd "$work" && exec "$bin" serve --config "$work/$side.toml" --no-grpc >/dev/null 2>&1) &
        pid=$!
        wait_ready
      fi
      result=$("$python" scripts/bench_slo.py --url "http://127.0.0.1:$port/v1" \
        --model smollm2-135m --clients "$clients" --duration "$seconds" --warmup 10 \
        --seed "$round" --official-retries 30 --grace 60 \
        ${RAMPART_OVERLOAD_TRACE:+--trace "$RAMPART_OVERLOAD_TRACE/$side-$clients-$round.jsonl"} \
        ${RAMPART_OVERLOAD_ARGS:-})
      gate="null"
      if [[ $side != llama ]]; then
        gate=$(curl -fs "http://127.0.0.1:$port/admin/degradation" |
          python3 -c 'import json,sys; m=json.load(sys.stdin)["models"]; print(json.dumps(m[0].get("first_token_gate") if m else None))' 2>/dev/null || echo null)
      fi
      echo "{\"round\": $round, \"side\": \"$side\", \"clients\": $clients, \"gate\": $gate, \"result\": $result}"
      kill "$pid" 2>/dev/null || true
      wait "$pid" 2>/dev/null || true
    done
  done
done
