#!/usr/bin/env bash
# The test suite: fetch the real models the integration tests use (cached, checked by sha256),
# make a Python environment with the official `openai` client for the server's end-to-end tests
# and `onnxruntime`, whose shared library the ONNX Runtime backend finds there, then run every
# test of the workspace. With RAMPART_REQUIRE_MODELS=1 a missing model (or client, or ONNX
# Runtime library) fails the tests instead of skipping them.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/fetch-models.sh
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
if ! "$cache/venv/bin/python" -c "import openai, onnxruntime" >/dev/null 2>&1; then
  echo "creating $cache/venv with the openai client and ONNX Runtime (pip install openai onnxruntime)"
  python3 -m venv "$cache/venv"
  "$cache/venv/bin/pip" install --quiet --disable-pip-version-check openai onnxruntime
fi
RAMPART_REQUIRE_MODELS=1 cargo test --workspace --locked "$@"
