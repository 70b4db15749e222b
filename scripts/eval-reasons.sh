#!/usr/bin/env bash
# The reasons' deletion check on examples/rules/tickets.jsonl (105 support tickets, five labels):
# a fresh `rampart serve` on SmolLM2-135M Q4_1 (2 threads), each ticket classified with
# guided_choice and `explain: {"reasons": {}}` by scripts/eval_reasons.py; prints its summary.
#
#   scripts/eval-reasons.sh RAMPART_BIN [TICKETS]
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(realpath "$1")" tickets="${2:-examples/rules/tickets.jsonl}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
gguf="$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$gguf" --repo "$repo" --name smollm2-135m --version 1.0.0 >/dev/null
port=18517
cat >"$work/config.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
threads = 2
[log]
file = "$work/server.log"
[[models]]
name = "smollm2-135m"
context = 2048
TOML
(cd "$work" && exec "$bin" serve --config "$work/config.toml" --no-grpc >/dev/null 2>&1) &
pid=$!
for _ in $(seq 1 600); do
  curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
python3 scripts/eval_reasons.py --url "http://127.0.0.1:$port" --model smollm2-135m \
  --tickets "$tickets" --out "${RAMPART_REASONS_OUT:-$work/reasons.jsonl}"
