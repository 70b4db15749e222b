#!/usr/bin/env bash
# Engine throughput beside llama.cpp's llama-bench on the same GGUF, in the same run.
#
# Usage: scripts/bench-vs-llama-cpp.sh PATH/TO/llama-bench MODEL.gguf [ROUNDS] [THREADS]
#
# Alternates the two tools ROUNDS times (default 5; each round: pp512 and tg128, 3 repetitions)
# so that noise from a shared machine hits both alike, then prints the medians and the ratios.
# Build llama-bench as shared/MODELS.md describes; it is not part of this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
llama_bench="${1:?path to llama-bench}"
model="${2:?path to a .gguf model}"
rounds="${3:-5}"
threads="${4:-2}"

# RAMPART_BIN: an already built binary (default: the release build, built here).
if [[ -z "${RAMPART_BIN:-}" ]]; then
  cargo build --release --locked -p rampart >/dev/null 2>&1
fi
rampart="${RAMPART_BIN:-target/release/rampart}"
out=$(mktemp -d)
for round in $(seq 1 "$rounds"); do
  "$rampart" bench engine -m "$model" -t "$threads" --prompt-tokens 512 --gen-tokens 128 -r 3 --json \
    >"$out/rampart-$round.json"
  "$llama_bench" -m "$model" -t "$threads" -p 512 -n 128 -r 3 -o json >"$out/llama-$round.json" 2>/dev/null
  echo "round $round of $rounds done" >&2
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ours = {"pp512": [], "tg128": []}
peer = {"pp512": [], "tg128": []}
for r in range(1, rounds + 1):
    o = json.load(open(f"{out}/rampart-{r}.json"))
    ours["pp512"].append(o["prefill_tokens_per_second"])
    ours["tg128"].append(o["decode_tokens_per_second"])
    for test in json.load(open(f"{out}/llama-{r}.json")):
        key = "pp512" if test["n_prompt"] == 512 else "tg128"
        peer[key].append(test["avg_ts"])
for key in ("pp512", "tg128"):
    a, b = statistics.median(ours[key]), statistics.median(peer[key])
    print(f"{key}: rampart {a:7.1f} tok/s  llama.cpp {b:7.1f} tok/s  ratio {a / b:.2f}  "
          f"(rampart {min(ours[key]):.0f}-{max(ours[key]):.0f}, llama.cpp {min(peer[key]):.0f}-{max(peer[key]):.0f}, {rounds} rounds)")
PY
