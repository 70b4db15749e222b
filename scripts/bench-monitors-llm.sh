#!/usr/bin/env bash
# The output-entropy monitor on a real LLM: SmolLM2-135M (Q4_1) served by `rampart serve`, varied
# ordinary chat prompts through the official `openai` client (false alarms), then an entropy
# collapse forced by a strong logit bias (the delay to the alarm).
#
#   scripts/bench-monitors-llm.sh [STATIONARY_REQUESTS]
set -euo pipefail
cd "$(dirname "$0")/.."
stationary="${1:-5000}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
bin="$(realpath "${RAMPART_BIN:-target/release/rampart}")"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --repo "$repo" \
  --name smollm2-135m --version 1.0.0 >/dev/null
printf 'tester:bench-key\nops:bench-admin admin infer\n' >"$work/keys.txt"
port=18495
cat >"$work/rampart.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
api_keys_file = "$work/keys.txt"
[admission]
max_in_flight = 32
[log]
file = "$work/server.log"
[monitor.drift]
baseline_requests = 500
[[models]]
name = "smollm2-135m"
max_num_seqs = 16
TOML
(cd "$work" && exec "$bin" serve --config "$work/rampart.toml" --no-grpc >/dev/null 2>&1) &
pid=$!
for _ in $(seq 1 600); do
  curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
"$python" scripts/bench_monitors_llm.py "$port" bench-key bench-admin "$stationary"
grep -h '"output monitor alarm raised"' "$work/server.log" | head -2 >&2 || true
