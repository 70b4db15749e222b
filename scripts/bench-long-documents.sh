#!/usr/bin/env bash
# The 28-page-document case: two clients send near-context documents (3,300 words) all the
# time while 16 others send normal prompts of 100-150 words, all streaming 64 tokens, through
# scripts/bench_slo.py (the official `openai` client). Runs rampart on SmolLM2-135M Q4_1 (2
# threads, context 4096, max_num_seqs 32) twice per round: with the degradation controller off,
# and with an inter-token latency objective. Prints each run's JSON line: the normal streams'
# ITL p99 and max, their TTFT, the documents done and their longest first token.
#
#   scripts/bench-long-documents.sh RAMPART_BIN [SECONDS] [ROUNDS]
#
# RAMPART_ITL_MS sets the objective (default 120); RAMPART_TEST_PYTHON a Python with `openai`;
# RAMPART_BENCH_LOGS a folder to keep the servers' logs in.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$1" seconds="${2:-90}" rounds="${3:-1}"
itl="${RAMPART_ITL_MS:-120}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --repo "$repo" \
  --name smollm2-135m --version 1.0.0 >/dev/null
port=18525
for side in off objective; do
  if [[ $side == off ]]; then
    extra=$'[degradation]\nenabled = false'
    slo=""
  else
    extra=""
    slo=$'[models.slo]\n'"itl_p99_ms = $itl"
  fi
  cat >"$work/$side.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
threads = 2
[admission]
max_in_flight = 64
[log]
file = "$work/server-$side.log"
$extra
[[models]]
name = "smollm2-135m"
context = 4096
max_num_seqs = 32
$slo
TOML
done
for round in $(seq 1 "$rounds"); do
  for side in off objective; do
    (cd "$work" && exec "$bin" serve --config "$work/$side.toml" --no-grpc >/dev/null 2>&1) &
    pid=$!
    for _ in $(seq 1 600); do
      curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && break
      sleep 0.2
    done
    result=$("$python" scripts/bench_slo.py --url "http://127.0.0.1:$port/v1" --model smollm2-135m \
      --clients 16 --long-clients 2 --long-words 3300 --min-words 100 --max-words 150 \
      --max-tokens 64 --duration "$seconds" --warmup 15 --seed "$((round + 6))")
    echo "{\"round\": $round, \"side\": \"$side\", \"result\": $result}"
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    if [[ -n "${RAMPART_BENCH_LOGS:-}" ]]; then
      mkdir -p "$RAMPART_BENCH_LOGS"
      cp "$work/server-$side.log" "$RAMPART_BENCH_LOGS/round$round-$side.log"
    fi
  done
done
