#!/usr/bin/env bash
# A time-to-first-token objective under three times the sustainable load, measured by a load
# generator that is not ours (scripts/bench_slo.py on the official `openai` client: closed-loop
# clients, seeded prompts of 50-400 words, 64 output tokens, 429s retried after Retry-After).
# Runs rampart twice per round on SmolLM2-135M Q4_1 (2 threads): without the degradation
# controller (the unconstrained maximum) and with `ttft_p99_ms` as its objective. Prints each
# run's JSON line.
#
#   scripts/bench-slo.sh RAMPART_BIN [CLIENTS] [SECONDS] [ROUNDS]
#
# RAMPART_TTFT_MS sets the objective (default 800); RAMPART_TEST_PYTHON a Python with `openai`;
# RAMPART_BENCH_LOGS a folder to keep the servers' logs in; RAMPART_SLO_EXTRA more lines for
# the objective's [models.slo] (e.g. `itl_p99_ms = 1000`); RAMPART_SEED_OFFSET shifts the
# rounds' prompt seeds (round N uses seed N + offset); RAMPART_SLO_SIDES=objective runs only
# the server with the objective; RAMPART_SLO_OBJECTIVE replaces the objective's [models.slo]
# lines; RAMPART_SLO_MAX_NUM_SEQS sets max_num_seqs (default 64); RAMPART_SLO_CLIENT adds
# arguments to bench_slo.py (scripts/bench-long-documents.sh uses these).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$1" clients="${2:-48}" seconds="${3:-120}" rounds="${4:-1}"
ttft="${RAMPART_TTFT_MS:-800}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --repo "$repo" \
  --name smollm2-135m --version 1.0.0 >/dev/null
port=18505
for side in unconstrained objective; do
  if [[ $side == unconstrained ]]; then
    extra=$'[degradation]\nenabled = false'
    slo=""
  else
    extra=""
    slo=$'[models.slo]\n'"${RAMPART_SLO_OBJECTIVE:-ttft_p99_ms = $ttft}"$'\n'"${RAMPART_SLO_EXTRA:-}"
  fi
  cat >"$work/$side.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
threads = 2
[admission]
max_in_flight = 64
max_waiting = 256
[log]
file = "$work/server-$side.log"
$extra
[[models]]
name = "smollm2-135m"
context = 4096
max_num_seqs = ${RAMPART_SLO_MAX_NUM_SEQS:-64}
$slo
TOML
done
for round in $(seq 1 "$rounds"); do
  for side in ${RAMPART_SLO_SIDES:-unconstrained objective}; do
    (cd "$work" && exec "$bin" serve --config "$work/$side.toml" --no-grpc >/dev/null 2>&1) &
    pid=$!
    for _ in $(seq 1 600); do
      curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && break
      sleep 0.2
    done
    result=$("$python" scripts/bench_slo.py --url "http://127.0.0.1:$port/v1" --model smollm2-135m \
      --clients "$clients" --duration "$seconds" --seed "$((round + ${RAMPART_SEED_OFFSET:-0}))" ${RAMPART_SLO_CLIENT:-})
    changes=$(grep -c '"degradation: limit' "$work/server-$side.log" || true)
    limit=$(curl -fs "http://127.0.0.1:$port/admin/degradation" |
      python3 -c 'import json,sys; m=json.load(sys.stdin)["models"]; print(m[0]["limits"]["max_in_flight"] if m else "-")' 2>/dev/null || echo -)
    echo "{\"round\": $round, \"side\": \"$side\", \"limit_changes\": $changes, \"max_in_flight_at_end\": \"$limit\", \"result\": $result}"
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    if [[ -n "${RAMPART_BENCH_LOGS:-}" ]]; then
      mkdir -p "$RAMPART_BENCH_LOGS"
      cp "$work/server-$side.log" "$RAMPART_BENCH_LOGS/round$round-$side.log"
    fi
  done
done
