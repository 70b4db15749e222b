#!/usr/bin/env bash
# The test suite: fetch the real models the integration tests use (cached, checked by sha256),
# then run every test of the workspace. With RAMPART_REQUIRE_MODELS=1 a missing model fails the
# tests instead of skipping them.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/fetch-models.sh
RAMPART_REQUIRE_MODELS=1 cargo test --workspace --locked "$@"
