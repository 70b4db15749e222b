#!/bin/bash
# The background CPU of fleet mode: one server with a release under way (250 ms ticks, 20 requests
# served, then 60 s without traffic), alone and as a fleet of one; the CPU of rampart and of
# PostgreSQL (as root: PostgreSQL runs as the postgres user). docs/perf.md, "The fleet".
#   scripts/bench-fleet-idle.sh [BINARY]
set -e
B="$(realpath "${1:-target/release/rampart}")"; C="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
W=$(mktemp -d); chown postgres $W
$B model import $C/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf --repo $W/models --name smollm2-135m --version 1.0.0 >/dev/null
$B model import $C/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf --repo $W/models --name smollm2-135m --version 1.1.0 >/dev/null
printf 'stable = "1.0.0"\n\n[routing]\ncontrol = false\n\n[schedule]\nsteps = [50.0, 100.0]\nmin_step_secs = 86400\nmax_step_secs = 86400\n' > $W/models/smollm2-135m/release.toml
$B release start smollm2-135m --candidate 1.1.0 --repo $W/models >/dev/null
runuser -u postgres -- initdb -D $W/pg -A trust -U postgres >/dev/null
runuser -u postgres -- pg_ctl -D $W/pg -l $W/pglog -o "-c listen_addresses=127.0.0.1 -p 55499 -k $W -c fsync=off" start >/dev/null
cpu() { awk '{print $14 + $15}' /proc/$1/stat; }
pgcpu() { local s=0; for p in $(pgrep -u postgres postgres); do s=$((s + $(awk '{print $14 + $15}' /proc/$p/stat 2>/dev/null || echo 0))); done; echo $s; }
for side in alone fleet; do
  extra=""; [[ $side == fleet ]] && extra=$'[fleet]\npostgres_url = "postgresql://postgres@127.0.0.1:55499/postgres"\nreplica = "r1"'
  printf 'listen = "127.0.0.1:18499"\nthreads = 2\n[grpc]\nenabled = false\n[releases]\ntick_ms = 250\n%s\n[[models]]\nname = "smollm2-135m"\n' "$extra" > $W/$side.toml
  (cd $W && exec $B serve --repo $W/models --config $W/$side.toml >/dev/null 2>&1) & pid=$!
  for i in $(seq 1 300); do curl -fs 127.0.0.1:18499/health/ready >/dev/null 2>&1 && break; sleep 0.2; done
  # requests so that the windows have samples to publish
  for i in $(seq 1 20); do curl -s -o /dev/null 127.0.0.1:18499/v1/chat/completions -H 'content-type: application/json' -d "{\"model\":\"smollm2-135m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi $i\"}],\"max_tokens\":4,\"user\":\"u$i\"}"; done
  sleep 5
  c0=$(cpu $pid); p0=$(pgcpu); sleep 60; c1=$(cpu $pid); p1=$(pgcpu)
  hz=$(getconf CLK_TCK)
  echo "$side: rampart $(( (c1-c0)*1000/hz )) ms CPU in 60 s, postgres $(( (p1-p0)*1000/hz )) ms"
  kill -TERM $pid; wait $pid || true
done
runuser -u postgres -- pg_ctl -D $W/pg stop -m immediate >/dev/null; rm -rf $W
