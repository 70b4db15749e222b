#!/usr/bin/env bash
# Streams beside new prompts: rampart with its degradation controller off, rampart with an
# inter-token latency objective, and llama-server, in the same run (SmolLM2-135M Q4_1, 2
# threads). Each round starts each server fresh and runs `rampart bench serve` at the given
# concurrencies (streaming /v1/completions, 128-token prompts, 128 output tokens, ignore_eos)
# after 32 requests of load at concurrency 16 that are not counted (the controller needs a few
# windows to find its limits; every server gets the same).
# Prints a line per round and server, then the medians: output tokens/s, TTFT p99, ITL p99.
#
#   scripts/bench-degradation.sh RAMPART_BIN LLAMA_SERVER [ROUNDS] [CONCURRENCY]
#
# RAMPART_ITL_MS sets the objective (default 120); RAMPART_DEGRADE_TOML adds settings to the
# controlled server's [[models]] table; RAMPART_DEGRADE_SIDES picks the servers (default
# "off on llama"; without llama, LLAMA_SERVER is not used).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="$1" llama="$2" rounds="${3:-3}" levels="${4:-16,32}"
itl="${RAMPART_ITL_MS:-120}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
gguf="$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
"$bin" model import "$gguf" --repo "$repo" --name smollm2-135m --version 1.0.0 >/dev/null
port=18500
url="http://127.0.0.1:$port"
for side in off on; do
  if [[ $side == off ]]; then
    extra=$'[degradation]\nenabled = false'
    model=""
  else
    extra=""
    model="${RAMPART_DEGRADE_TOML:-}"$'\n[models.slo]\n'"itl_p99_ms = $itl"
  fi
  cat >"$work/$side.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
threads = 2
[admission]
max_in_flight = 32
[log]
file = "$work/server-$side.log"
$extra
[[models]]
name = "smollm2-135m"
context = 4096
max_num_seqs = 32
$model
TOML
done
wait_ready() {
  for _ in $(seq 1 600); do
    curl -fs "$1" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  echo "server did not become ready" >&2
  return 1
}
results="$work/results.jsonl"
for round in $(seq 1 "$rounds"); do
  for side in ${RAMPART_DEGRADE_SIDES:-off on llama}; do
    if [[ $side == llama ]]; then
      "$llama" -m "$gguf" -t 2 -c 12288 -np 32 --port "$port" --host 127.0.0.1 >/dev/null 2>&1 &
      pid=$!
      wait_ready "$url/health"
    else
      (cd "$work" && exec "$bin" serve --config "$work/$side.toml" --no-grpc >/dev/null 2>&1) &
      pid=$!
      wait_ready "$url/health/ready"
    fi
    # Load before the measured levels (the same for every server): the controller starts
    # from the configured limits and needs a few windows to find its own.
    "$bin" bench serve --url "$url" --model smollm2-135m --concurrency 16 --requests 32 \
      --prompt-tokens 128 --output-tokens 128 --warmup 0 --seed "$((round * 10 + 1))" --json \
      >/dev/null
    "$bin" bench serve --url "$url" --model smollm2-135m --concurrency "$levels" --requests 32 \
      --prompt-tokens 128 --output-tokens 128 --warmup 2 --seed "$((round * 10))" --json \
      >"$work/serve.json"
    python3 - "$work/serve.json" "$side" "$round" >>"$results" <<'PY'
import json, sys
report, side, rnd = json.load(open(sys.argv[1])), sys.argv[2], int(sys.argv[3])
for level in report["levels"]:
    print(json.dumps({"side": side, "round": rnd, "c": level["concurrency"],
                      "tok_s": level["output_tokens_per_s"], "failed": level["failed"],
                      "ttft_p99": (level["ttft_ms"] or {}).get("p99"),
                      "itl_p50": (level["itl_ms"] or {}).get("p50"),
                      "itl_p99": (level["itl_ms"] or {}).get("p99"),
                      "tpot_p50": (level["tpot_ms"] or {}).get("p50")}))
PY
    if [[ $side == on ]]; then
      grep -c '"degradation: limit' "$work/server-on.log" | sed 's/^/  limit changes logged: /' >&2 || true
    fi
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    echo "round $round: $side done" >&2
  done
done
python3 - "$results" "$itl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"ITL objective of the controlled server: {sys.argv[2]} ms")
for r in rows:
    print(f"round {r['round']} {r['side']:>5} c={r['c']:>2}: {r['tok_s']:7.1f} tok/s  TTFT p99 {r['ttft_p99']:8.0f} ms  "
          f"ITL p50 {r['itl_p50']:6.1f} p99 {r['itl_p99']:6.1f} ms  failed {r['failed']}")
print()
print(f"{'c':>3} {'side':>5} {'tok/s':>8} {'TTFT p99':>9} {'ITL p99':>8}   (medians over rounds)")
med = {}
for c in sorted({r['c'] for r in rows}):
    for side in ("off", "on", "llama"):
        sel = [r for r in rows if r['c'] == c and r['side'] == side]
        if not sel:
            continue
        m = {k: statistics.median(r[k] for r in sel) for k in ("tok_s", "ttft_p99", "itl_p99")}
        med[(c, side)] = m
        print(f"{c:>3} {side:>5} {m['tok_s']:8.1f} {m['ttft_p99']:9.0f} {m['itl_p99']:8.1f}")
    if (c, "on") in med and (c, "llama") in med:
        on, ll = med[(c, "on")], med[(c, "llama")]
        print(f"    on/llama: throughput {on['tok_s'] / ll['tok_s']:.2f}x, ITL p99 {on['itl_p99'] / ll['itl_p99']:.2f}x")
PY
