#!/usr/bin/env bash
# The 28-page-document case: two clients send near-context documents (3,300 words) all the
# time while 16 others send normal prompts of 100-150 words, all streaming 64 tokens, through
# scripts/bench_slo.py (the official `openai` client; 15 s of load not counted). Runs rampart on
# SmolLM2-135M Q4_1 (2 threads, context 4096, max_num_seqs 32) twice per round with
# scripts/bench-slo.sh: with the degradation controller off ("unconstrained") and with an
# inter-token latency objective ("objective"). Each JSON line has the normal streams' ITL p99
# and max, their TTFT, and under "long" the documents done and their longest first token.
#
#   scripts/bench-long-documents.sh RAMPART_BIN [SECONDS] [ROUNDS]
#
# RAMPART_ITL_MS sets the objective (default 120); the rest as in scripts/bench-slo.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
RAMPART_SLO_OBJECTIVE="itl_p99_ms = ${RAMPART_ITL_MS:-120}" \
RAMPART_SLO_MAX_NUM_SEQS=32 \
RAMPART_SEED_OFFSET="${RAMPART_SEED_OFFSET:-6}" \
RAMPART_SLO_CLIENT="--long-clients 2 --long-words 3300 --min-words 100 --max-words 150 --warmup 15" \
  exec scripts/bench-slo.sh "$1" 16 "${2:-90}" "${3:-1}"
