#!/usr/bin/env bash
# Batched decode beside llama.cpp's llama-batched-bench on the same GGUF, in the same run.
#
# Usage: scripts/bench-batched-vs-llama-cpp.sh PATH/TO/llama-batched-bench MODEL.gguf [ROUNDS] [THREADS] [PARALLEL]
#
# Alternates the two tools ROUNDS times (default 3). Each round measures, for each sequence
# count in PARALLEL (default 1,4,8,16,32), N distinct prompts of 128 tokens prefilled together
# and then 128 decode steps of N tokens. Prints the median aggregate decode tokens/s of both,
# their ratio, and Rampart's KV waste (allocated token slots not holding a token).
set -euo pipefail
cd "$(dirname "$0")/.."
llama_batched="${1:?path to llama-batched-bench}"
model="${2:?path to a .gguf model}"
rounds="${3:-3}"
threads="${4:-2}"
parallel="${5:-1,4,8,16,32}"

# RAMPART_BIN: an already built binary (default: the release build, built here).
if [[ -z "${RAMPART_BIN:-}" ]]; then
  cargo build --release --locked -p rampart >/dev/null 2>&1
fi
rampart="${RAMPART_BIN:-target/release/rampart}"
out=$(mktemp -d)
most=$(echo "$parallel" | tr ',' '\n' | sort -n | tail -1)
for round in $(seq 1 "$rounds"); do
  "$rampart" bench batched -m "$model" -t "$threads" --prompt-tokens 128 --gen-tokens 128 \
    --parallel "$parallel" --json >"$out/rampart-$round.json"
  "$llama_batched" -m "$model" -t "$threads" -c $((most * 256 + 256)) -b 4096 -ub 512 \
    -npp 128 -ntg 128 -npl "$parallel" --output-format jsonl >"$out/llama-$round.jsonl" 2>/dev/null
  echo "round $round of $rounds done" >&2
done
python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
ours, peer, waste = {}, {}, {}
for r in range(1, rounds + 1):
    for run in json.load(open(f"{out}/rampart-{r}.json"))["runs"]:
        ours.setdefault(run["parallel"], []).append(run["decode_tokens_per_second"])
        waste.setdefault(run["parallel"], []).append(run["kv_waste"])
    for line in open(f"{out}/llama-{r}.jsonl"):
        line = line.strip()
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        if "pl" in row:
            peer.setdefault(row["pl"], []).append(row["speed_tg"])
print(f"{'N':>3}  {'rampart tok/s':>22}  {'llama.cpp tok/s':>22}  {'ratio':>5}  {'KV waste':>8}")
for n in sorted(ours):
    a, b = statistics.median(ours[n]), statistics.median(peer.get(n, [float('nan')]))
    print(f"{n:>3}  {a:8.1f} ({min(ours[n]):.0f}-{max(ours[n]):.0f}){'':>6}  "
          f"{b:8.1f} ({min(peer.get(n,[0])):.0f}-{max(peer.get(n,[0])):.0f}){'':>6}  {a / b:5.2f}  "
          f"{100 * statistics.median(waste[n]):7.1f}%")
PY
