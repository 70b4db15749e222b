#!/usr/bin/env python3
"""The checks of deploy/monitoring/ that promtool does not do by itself (run by
scripts/check-monitoring.sh):

- every alert has severity, summary, description, a runbook_url whose anchor is a section of
  docs/runbooks.md, and a `for`;
- every alert is tested: some promtool test expects it to fire, and some expects it quiet (the
  Watchdog always fires);
- every query of the rules and dashboards names only metrics the server emits (the registry
  `rampart metrics list --json` prints; a histogram's _bucket/_sum/_count count as the
  histogram), recording rules of rampart-recording.yml, or Prometheus's own (up, ALERTS);
- writes the dashboards' queries, with Grafana's variables replaced, as a rule file for
  `promtool check rules` to parse.

usage: check-monitoring.py METRICS.json DASHBOARD_QUERIES.jsonl OUT_RULES.yml
"""

import glob
import json
import os
import re
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MON = os.path.join(ROOT, "deploy", "monitoring")
PROMETHEUS_OWN = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or", "unless",
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "inf", "nan", "Inf", "NaN", "atan2",
}
GRAFANA_VARS = [("$__rate_interval", "5m"), ("$__interval", "1m"), ("$__range", "1h"),
                ("$job", "rampart"), ("$instance", ".*"), ("$model", ".*")]

errors = []


def metric_names(expr):
    """The metric names a PromQL expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries
    text = re.sub(r"\b\d+(\.\d+)?([eE][+-]?\d+)?[smhdwy]?\b", " ", text)  # numbers, durations
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        name = m.group(0)
        following = text[m.end():].lstrip()
        if following.startswith("(") or name in KEYWORDS:
            continue
        names.add(name)
    return names


def main():
    metrics_json, queries_jsonl, out_rules = sys.argv[1:4]
    registry = {m["name"]: m["type"] for m in json.load(open(metrics_json))}
    known = set(registry)
    for name, kind in registry.items():
        if kind == "histogram":
            known |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}

    recording = yaml.safe_load(open(os.path.join(MON, "rules", "rampart-recording.yml")))
    alerting = yaml.safe_load(open(os.path.join(MON, "rules", "rampart-alerts.yml")))
    recorded = {r["record"] for g in recording["groups"] for r in g["rules"]}
    exprs = []  # (where, expr)
    for doc, file in [(recording, "rampart-recording.yml"), (alerting, "rampart-alerts.yml")]:
        for g in doc["groups"]:
            for r in g["rules"]:
                exprs.append((f"{file}: {r.get('alert') or r.get('record')}", r["expr"]))

    runbooks = open(os.path.join(ROOT, "docs", "runbooks.md")).read()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", runbooks, re.M)}
    alerts = []
    for g in alerting["groups"]:
        for r in g["rules"]:
            if "alert" not in r:
                continue
            name = r["alert"]
            alerts.append(name)
            ann = r.get("annotations", {})
            if "severity" not in r.get("labels", {}):
                errors.append(f"{name}: no severity label")
            for key in ("summary", "description", "runbook_url"):
                if not ann.get(key):
                    errors.append(f"{name}: no {key} annotation")
            if "for" not in r:
                errors.append(f"{name}: no `for`")
            url = ann.get("runbook_url", "")
            if not url.startswith("docs/runbooks.md#") or url.split("#", 1)[1] not in anchors:
                errors.append(f"{name}: runbook_url {url!r} is no section of docs/runbooks.md")

    fires, quiet = set(), set()
    for f in glob.glob(os.path.join(MON, "tests", "*.yml")):
        for t in yaml.safe_load(open(f))["tests"]:
            for a in t.get("alert_rule_test", []):
                (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
    for name in alerts:
        if name not in fires:
            errors.append(f"{name}: no promtool test expects it to fire")
        if name not in quiet and name != "Watchdog":
            errors.append(f"{name}: no promtool test expects it quiet")
    for name in (fires | quiet) - set(alerts):
        errors.append(f"tests name {name}, which is no alert")

    dashboard_rules = []
    for i, line in enumerate(open(queries_jsonl)):
        if not line.strip():
            continue
        q = json.loads(line)
        expr = q["expr"]
        for var, value in GRAFANA_VARS:
            expr = expr.replace(var, value)
        if "$" in expr:
            errors.append(f"{q['dashboard']} / {q['panel']}: unknown variable in {q['expr']!r}")
        exprs.append((f"{q['dashboard']} / {q['panel']}", expr))
        dashboard_rules.append({"record": f"dashboard:query_{i}", "expr": expr})
    with open(out_rules, "w") as f:
        yaml.safe_dump({"groups": [{"name": "dashboard-queries", "rules": dashboard_rules}]}, f, width=1000)

    used = set()
    for where, expr in exprs:
        for name in metric_names(expr):
            used.add(name)
            if ":" in name:
                if name not in recorded:
                    errors.append(f"{where}: {name} is no recording rule of rampart-recording.yml")
            elif name not in known and name not in PROMETHEUS_OWN:
                errors.append(f"{where}: {name} is not a metric the server emits (rampart metrics list)")

    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    print(f"{len(alerts)} alerts, {len(recorded)} recording rules, {len(dashboard_rules)} dashboard queries; "
          f"{len(used)} metric names checked against {len(registry)} registered metrics")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
