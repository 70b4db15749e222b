#!/usr/bin/env bash
# The fleet's numbers (docs/perf.md): the judge's decision time with three replicas behind HAProxy
# against one on the same client traffic, the judge's failover time after a SIGKILL
# (scripts/bench_fleet.py), and the cost of fleet mode on one replica's serving: a paired A/B of
# the same binary alone and as a one-replica fleet, a release under way on both sides
# (scripts/bench-ab.sh).
#
#   scripts/bench-fleet.sh [BINARY] [ROUNDS] [judge|overhead|all]     (default: all)
#
# Needs PostgreSQL (initdb, pg_ctl), HAProxy and the test environment's Python with the `openai`
# client (scripts/test.sh makes it); the models from scripts/fetch-models.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${1:-target/release/rampart}" rounds="${2:-3}" part="${3:-all}"
cache="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
python="${RAMPART_TEST_PYTHON:-$cache/venv/bin/python}"
pg_bin="$(dirname "$(command -v initdb 2>/dev/null || ls /usr/lib/postgresql/*/bin/initdb | tail -1)")"
haproxy="$(command -v haproxy 2>/dev/null || echo /usr/sbin/haproxy)"
bin="$(realpath "$bin")"
if [[ "$part" != overhead ]]; then
  "$python" scripts/bench_fleet.py "$bin" "$python" "$pg_bin" "$haproxy" "$rounds"
fi
if [[ "$part" != judge ]]; then
  # One PostgreSQL for the fleet side of the A/B.
  work="$(mktemp -d)"
  [[ $(id -u) -eq 0 ]] && chown postgres "$work"
  as_pg() { if [[ $(id -u) -eq 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi; }
  as_pg "$pg_bin/initdb" -D "$work/d" -A trust -U postgres >/dev/null
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  as_pg "$pg_bin/pg_ctl" -D "$work/d" -l "$work/log" -o "-c listen_addresses=127.0.0.1 -p $port -k $work -c fsync=off" start >/dev/null
  trap 'as_pg "$pg_bin/pg_ctl" -D "$work/d" stop -m immediate >/dev/null; rm -rf "$work"' EXIT
  # A release that stays in its first step for the whole run (an A/A: 1.1.0 is SmolLM2 again),
  # ticking every 250 ms on both sides; the new side is a fleet of one.
  RAMPART_AB_PLAN=$'stable = "1.0.0"\n\n[routing]\ncontrol = false\n\n[schedule]\nsteps = [50.0, 100.0]\nmin_step_secs = 86400\nmax_step_secs = 86400' \
  RAMPART_AB_OLD_TOML=$'[releases]\ntick_ms = 250' \
  RAMPART_AB_NEW_TOML=$'[releases]\ntick_ms = 250\n[fleet]\npostgres_url = "postgresql://postgres@127.0.0.1:'"$port"$'/postgres"\nreplica = "bench"' \
    scripts/bench-ab.sh "$bin" "$bin" "$rounds"
fi
