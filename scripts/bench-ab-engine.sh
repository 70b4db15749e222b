#!/usr/bin/env bash
# Before/after of the engine alone: `rampart bench batched` (128 prompt tokens, 256 decode
# steps, 2 threads) on SmolLM2-135M Q4_1 with two rampart binaries, alternated ABBA round by
# round, at each --parallel value. Prints each run's decode and prefill tokens/s, then the means
# and NEW/OLD ratios.
#
#   scripts/bench-ab-engine.sh OLD_BINARY NEW_BINARY [ROUNDS] [PARALLEL ...]
set -euo pipefail
old="$1" new="$2" rounds="${3:-3}"
shift $(($# < 3 ? $# : 3))
parallel=("${@:-1 16}")
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
model="$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
out="$(mktemp)"
trap 'rm -f "$out"' EXIT
for p in ${parallel[@]}; do
  for r in $(seq "$rounds"); do
    for side in old new new old; do
      bin="$old"
      [[ $side == new ]] && bin="$new"
      "$bin" bench batched -m "$model" -t 2 --parallel "$p" --prompt-tokens 128 \
        --gen-tokens 256 --json 2>/dev/null |
        python3 -c "import json,sys; r=json.load(sys.stdin)['runs'][0]; print('$p', '$r', '$side', round(r['decode_tokens_per_second'],1), round(r['prefill_tokens_per_second'],1))" |
        tee -a "$out"
    done
  done
done
python3 - "$out" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    p, _, side, decode, prefill = line.split()
    runs[(p, side)].append((float(decode), float(prefill)))
for p in sorted({k[0] for k in runs}, key=int):
    o, n = runs[(p, "old")], runs[(p, "new")]
    do, dn = statistics.mean(x[0] for x in o), statistics.mean(x[0] for x in n)
    po, pn = statistics.mean(x[1] for x in o), statistics.mean(x[1] for x in n)
    print(f"parallel {p}: decode {do:.1f} -> {dn:.1f} ({dn / do:.3f}), prefill {po:.1f} -> {pn:.1f} ({pn / po:.3f})")
PY
