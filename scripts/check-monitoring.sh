#!/usr/bin/env bash
# Checks the shipped monitoring (deploy/monitoring/) with the real tools, installing what is
# missing: Debian's prometheus (promtool) and prometheus-alertmanager (amtool) with apt, and
# the npm packages of the dashboard validator into $RAMPART_NPM_CACHE (~/.cache/rampart/npm).
#
#   promtool check rules / test rules   alert and recording rules, a unit test for every alert
#   promtool check config               the example Prometheus configuration
#   amtool check-config                 the example Alertmanager route
#   scripts/check-dashboards.mjs        every dashboard against Grafana's schema
#   promtool check rules                every dashboard query (written as recording rules)
#   scripts/check-monitoring.py         runbook links, test coverage, and every metric name in
#                                       rules and dashboards against `rampart metrics list`
#
# usage: scripts/check-monitoring.sh [--install]   (--install: install the tools, check nothing)
# RAMPART_BIN: a built rampart binary (default: cargo run -p rampart, which builds the workspace
# again with the features of that one crate; scripts/test.sh passes the binary its tests built).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
mon=deploy/monitoring
npm_dir="${RAMPART_NPM_CACHE:-$HOME/.cache/rampart/npm}"

apt_install() {
  local sudo=""
  [[ $(id -u) -eq 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

need_apt=()
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
command -v amtool >/dev/null 2>&1 || need_apt+=(prometheus-alertmanager)
command -v node >/dev/null 2>&1 || need_apt+=(nodejs)
command -v npm >/dev/null 2>&1 || need_apt+=(npm)
python3 -c "import yaml" >/dev/null 2>&1 || need_apt+=(python3-yaml)
if [[ ${#need_apt[@]} -gt 0 ]]; then
  echo "installing ${need_apt[*]}"
  apt_install "${need_apt[@]}"
fi
# The validator's packages, pinned; outside the repository so no node_modules is committed.
npm_packages=(@grafana/schema@13.2.3 ts-json-schema-generator@2.4.0 typescript@7.0.2 ajv@8.20.0)
if ! (cd "$npm_dir" 2>/dev/null && node -e 'for (const p of ["@grafana/schema","ts-json-schema-generator","ajv"]) require.resolve(p + "/package.json")') >/dev/null 2>&1; then
  echo "installing ${npm_packages[*]} into $npm_dir"
  mkdir -p "$npm_dir"
  [[ -f "$npm_dir/package.json" ]] || echo '{"name":"rampart-monitoring-check","private":true}' >"$npm_dir/package.json"
  (cd "$npm_dir" && npm install --no-audit --no-fund --silent "${npm_packages[@]}")
fi
[[ "${1:-}" == "--install" ]] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "== promtool check rules"
promtool check rules $mon/rules/*.yml
echo "== promtool test rules"
promtool test rules $mon/tests/*.yml
echo "== promtool check config"
promtool check config $mon/prometheus.yml
echo "== amtool check-config"
amtool check-config $mon/alertmanager.yml

echo "== dashboards against Grafana's schema"
node scripts/check-dashboards.mjs "$npm_dir" "$work/queries.jsonl" $mon/dashboards/*.json
# The validator must reject what Grafana's schema rejects (else a passing run proves nothing).
python3 - "$mon/dashboards/rampart-overview.json" "$work/broken.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d["panels"][1]["gridPos"]["w"] = "wide"; d["not_a_field"] = 1
json.dump(d, open(sys.argv[2], "w"))
PY
if node scripts/check-dashboards.mjs "$npm_dir" "$work/broken.jsonl" "$work/broken.json" >/dev/null 2>&1; then
  echo "error: the dashboard validator accepted a broken dashboard" >&2
  exit 1
fi
# The committed JSON is what generate.py writes.
cp -r $mon/dashboards "$work/generated"
python3 "$work/generated/generate.py"
for f in $mon/dashboards/*.json; do
  cmp -s "$f" "$work/generated/$(basename "$f")" || { echo "error: $f differs from what generate.py writes" >&2; exit 1; }
done

echo "== metric names, runbooks, test coverage"
if [[ -n "${RAMPART_BIN:-}" ]]; then
  "$RAMPART_BIN" metrics list --json >"$work/metrics.json"
else
  cargo run --locked -q -p rampart -- metrics list --json >"$work/metrics.json"
fi
python3 scripts/check-monitoring.py "$work/metrics.json" "$work/queries.jsonl" "$work/dashboard-queries.yml"
echo "== promtool parses every dashboard query"
promtool check rules "$work/dashboard-queries.yml"

echo "monitoring checks passed in $(($(date +%s) - started)) s"
