#!/usr/bin/env python3
"""Writes Rampart's Grafana dashboards (overview, LLM engine, tensor models, defence lines and
governance, host and GPU) as JSON beside this file. The JSON is committed; run this after
changing a panel. scripts/check-monitoring.sh validates the JSON against Grafana's schema,
parses every query with promtool and checks every metric name against `rampart metrics list`.

Variables: $datasource (a Prometheus), $job (default rampart), $instance and $model (multi,
all by default).
"""

import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job="$job", instance=~"$instance"'
MSEL = SEL + ', model=~"$model"'


def q(expr, legend="", ref="A"):
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


class Board:
    def __init__(self, uid, title, description, tags, model_var=True):
        self.uid, self.title, self.description, self.tags = uid, title, description, tags
        self.model_var = model_var
        self.panels = []
        self.x = self.y = 0
        self.row_h = 0
        self.next_id = 1

    def row(self, title):
        if self.x:
            self.y += self.row_h
        self.x, self.row_h = 0, 0
        self.panels.append({"type": "row", "title": title, "id": self.next_id, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}})
        self.next_id += 1
        self.y += 1

    def panel(self, kind, title, targets, unit="short", w=8, h=8, description="", **extra):
        if self.x + w > 24:
            self.y += self.row_h
            self.x, self.row_h = 0, 0
        targets = [targets] if isinstance(targets, dict) else targets
        for i, t in enumerate(targets):
            t["refId"] = chr(ord("A") + i)
        defaults = {"unit": unit}
        defaults.update(extra.pop("defaults", {}))
        p = {
            "type": kind,
            "title": title,
            "description": description,
            "id": self.next_id,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "targets": targets,
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": extra.pop("options", {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                                             "tooltip": {"mode": "multi", "sort": "desc"}} if kind == "timeseries" else {}),
        }
        p.update(extra)
        self.panels.append(p)
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)

    def ts(self, title, targets, unit="short", **kw):
        self.panel("timeseries", title, targets, unit, **kw)

    def stat(self, title, targets, unit="short", **kw):
        kw.setdefault("w", 4)
        kw.setdefault("h", 4)
        kw.setdefault("options", {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                                  "colorMode": "value", "graphMode": "area", "textMode": "auto"})
        self.panel("stat", title, targets, unit, **kw)

    def json(self):
        variables = [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {"selected": False, "text": "default", "value": "default"}, "hide": 0, "refresh": 1, "options": []},
            {"name": "job", "label": "Job", "type": "query", "datasource": DS,
             "query": {"query": "label_values(up, job)", "refId": "job"}, "definition": "label_values(up, job)",
             "current": {"selected": True, "text": "rampart", "value": "rampart"}, "refresh": 1, "hide": 0,
             "includeAll": False, "multi": False, "options": [], "sort": 1},
            {"name": "instance", "label": "Instance", "type": "query", "datasource": DS,
             "query": {"query": 'label_values(up{job="$job"}, instance)', "refId": "instance"},
             "current": {"selected": True, "text": "All", "value": "$__all"}, "refresh": 2, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True,
             "options": [], "sort": 1},
        ]
        if self.model_var:
            variables.append(
                {"name": "model", "label": "Model", "type": "query", "datasource": DS,
                 "query": {"query": 'label_values(rampart_requests_total{job="$job"}, model)', "refId": "model"},
                 "current": {"selected": True, "text": "All", "value": "$__all"}, "refresh": 2, "hide": 0, "includeAll": True, "allValue": ".*", "multi": True,
                 "options": [], "sort": 1})
        for v in variables:
            v.pop("definition", None)
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": ["rampart"] + self.tags,
            "editable": True,
            "graphTooltip": 1,
            "schemaVersion": 39,
            "version": 1,
            "refresh": "30s",
            "time": {"from": "now-6h", "to": "now"},
            "timezone": "browser",
            # Grafana's schema has no Prometheus annotation query; the built-in one shows
            # Grafana's own annotations and alerts.
            "annotations": {"list": [{
                "builtIn": 1, "name": "Annotations & Alerts", "type": "dashboard", "enable": True, "hide": True,
                "iconColor": "rgba(0, 211, 255, 1)", "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            }]},
            "links": [{"title": "Rampart dashboards", "type": "dashboards", "tags": ["rampart"], "asDropdown": True,
                       "icon": "external link", "includeVars": True, "keepTime": True, "targetBlank": False,
                       "tooltip": ""}],
            "templating": {"list": variables},
            "panels": self.panels,
        }


def rate(metric, sel=MSEL, by="model", window="$__rate_interval"):
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{window}]))"


def quantile(qv, metric, sel=MSEL, by="model"):
    return f"histogram_quantile({qv}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}[$__rate_interval])))"


def overview():
    b = Board("rampart-overview", "Rampart / Overview", "Traffic, errors, latency and saturation of every model, and the SLO burn rates.", ["overview"])
    b.row("Service level")
    b.stat("Requests / s", q(f"sum(rate(rampart_requests_total{{{MSEL}}}[$__rate_interval]))"), "reqps")
    b.stat("5xx share (5m)", q('sum(rampart:request_errors:ratio_rate5m{job="$job", model=~"$model"})'), "percentunit")
    b.stat("TTFT p95", q(f"histogram_quantile(0.95, sum by (le) (rate(rampart_time_to_first_token_seconds_bucket{{{MSEL}}}[$__rate_interval])))"), "s")
    b.stat("Models ready", q(f"sum(rampart_model_ready{{{MSEL}}})"))
    b.stat("Requests in flight", q(f"sum(rampart_requests_in_flight{{{MSEL}}})"))
    b.stat("Alerts firing", q('count(ALERTS{alertstate="firing", job="$job", severity!="none"}) or vector(0)'))
    b.ts("Availability burn rate (× budget)", [
        q('rampart:request_errors:ratio_rate5m{job="$job", model=~"$model"} / 0.005', "{{model}} 5m"),
        q('rampart:request_errors:ratio_rate1h{job="$job", model=~"$model"} / 0.005', "{{model}} 1h"),
        q('rampart:request_errors:ratio_rate6h{job="$job", model=~"$model"} / 0.005', "{{model}} 6h"),
    ], description="1 spends the 30-day 0.5% error budget in exactly 30 days; the fast-burn page fires above 14.4 (1h and 5m).", w=12)
    b.ts("TTFT objective burn rate (× budget)", [
        q('rampart:ttft_slow:ratio_rate5m{job="$job", model=~"$model"} / 0.01', "{{model}} 5m"),
        q('rampart:ttft_slow:ratio_rate1h{job="$job", model=~"$model"} / 0.01', "{{model}} 1h"),
        q('rampart:ttft_slow:ratio_rate6h{job="$job", model=~"$model"} / 0.01', "{{model}} 6h"),
    ], description="Share of requests whose first token took over 2.5 s, against the 1% the objective allows.", w=12)
    b.row("Traffic")
    b.ts("Requests by status", q(rate("rampart_requests_total", by="model, status"), "{{model}} {{status}}"), "reqps", w=12)
    b.ts("Refused before the engine, by reason", q(rate("rampart_rejected_requests_total", by="reason"), "{{reason}}"), "reqps", w=12)
    b.row("Latency")
    b.ts("Request duration", [q(quantile(0.5, "rampart_request_duration_seconds"), "{{model}} p50"),
                               q(quantile(0.95, "rampart_request_duration_seconds"), "{{model}} p95")], "s")
    b.ts("Time to first token", [q(quantile(0.5, "rampart_time_to_first_token_seconds"), "{{model}} p50"),
                                  q(quantile(0.95, "rampart_time_to_first_token_seconds"), "{{model}} p95")], "s")
    b.ts("Queue time p95", q(quantile(0.95, "rampart_queue_time_seconds"), "{{model}}"), "s")
    b.row("Saturation")
    b.ts("Queue depth", [q(f"sum by (model) (rampart_queue_depth{{{MSEL}}})", "{{model}}"),
                         q(f"sum by (model) (rampart_tensor_queue_depth{{{MSEL}}})", "{{model}} (tensor)")])
    b.ts("Shed with 429", q('rampart:shed:ratio_rate5m{job="$job", model=~"$model"}', "{{model}}"), "percentunit")
    b.ts("KV cache utilization", q('rampart:kv_cache:utilization{job="$job", instance=~"$instance", model=~"$model"}', "{{model}} {{instance}}"), "percentunit",
         defaults={"max": 1, "min": 0})
    return b


def llm_engine():
    b = Board("rampart-llm-engine", "Rampart / LLM engine", "The LLM engine: latency per token, throughput, batch, KV cache, prefix cache, preemptions, structured output.", ["llm"])
    b.row("Latency")
    b.ts("Time to first token", [q(quantile(qv, "rampart_time_to_first_token_seconds"), f"{{{{model}}}} p{int(qv * 100)}") for qv in (0.5, 0.95, 0.99)], "s")
    b.ts("Time per output token", [q(quantile(qv, "rampart_time_per_output_token_seconds"), f"{{{{model}}}} p{int(qv * 100)}") for qv in (0.5, 0.95)], "s")
    b.ts("Inter-token latency p95", q(quantile(0.95, "rampart_inter_token_latency_seconds"), "{{model}}"), "s")
    b.row("Throughput")
    b.ts("Generated tokens / s", q(rate("rampart_generated_tokens_total"), "{{model}}"), "short", w=12)
    b.ts("Prompt tokens / s", q(rate("rampart_prompt_tokens_total"), "{{model}}"), "short", w=12)
    b.row("Batch and KV cache")
    b.ts("Sequences", [q(f"sum by (model) (rampart_engine_running_sequences{{{MSEL}}})", "{{model}} running"),
                       q(f"sum by (model) (rampart_engine_waiting_sequences{{{MSEL}}})", "{{model}} waiting")])
    b.ts("KV blocks", [q(f"sum by (model) (rampart_kv_blocks_used{{{MSEL}}})", "{{model}} used"),
                       q(f"sum by (model) (rampart_kv_blocks_cached{{{MSEL}}})", "{{model}} cached"),
                       q(f"sum by (model) (rampart_kv_blocks_resident{{{MSEL}}})", "{{model}} mapped"),
                       q(f"sum by (model) (rampart_kv_blocks_total{{{MSEL}}})", "{{model}} total")])
    b.ts("Prefix cache hit ratio", q(f"{rate('rampart_prefix_cache_hits_total')} / {rate('rampart_prefix_cache_lookups_total')}", "{{model}}"), "percentunit")
    b.ts("Preemptions / s", q(rate("rampart_preemptions_total"), "{{model}}"), "short")
    b.ts("Token entropy p50 / p95", [q(quantile(0.5, "rampart_token_entropy_nats"), "{{model}} p50"),
                                      q(quantile(0.95, "rampart_token_entropy_nats"), "{{model}} p95")], "short")
    b.ts("Abnormal-entropy requests / s", q(rate("rampart_abnormal_requests_total"), "{{model}}"), "reqps")
    b.row("Structured output")
    b.ts("Structured requests by outcome", q(rate("rampart_structured_requests_total", by="model, kind, outcome"), "{{model}} {{kind}} {{outcome}}"), "reqps")
    b.ts("Grammar mask p99 / compile p95", [
        q(f"histogram_quantile(0.99, sum by (kind, le) (rate(rampart_grammar_mask_seconds_bucket{{{SEL}}}[$__rate_interval])))", "mask {{kind}}"),
        q(f"histogram_quantile(0.95, sum by (kind, le) (rate(rampart_grammar_compile_seconds_bucket{{{SEL}}}[$__rate_interval])))", "compile {{kind}}")], "s")
    b.ts("Grammar cache hit ratio", q(f'sum(rate(rampart_grammar_cache_total{{{SEL}, result="hit"}}[$__rate_interval])) / sum(rate(rampart_grammar_cache_total{{{SEL}}}[$__rate_interval]))', "hit ratio"), "percentunit")
    return b


def tensor_models():
    b = Board("rampart-tensor-models", "Rampart / Tensor models", "Tensor (ONNX) and embedding models: inputs, the dynamic batcher, compute, confidence.", ["tensor"])
    b.row("Traffic")
    b.ts("Inputs / s", q(rate("rampart_inputs_total"), "{{model}}"), "short", w=12)
    b.ts("Requests by status", q(rate("rampart_requests_total", by="model, status"), "{{model}} {{status}}"), "reqps", w=12)
    b.row("Batcher")
    b.ts("Batch size p50 / p95", [q(quantile(0.5, "rampart_tensor_batch_size"), "{{model}} p50"),
                                   q(quantile(0.95, "rampart_tensor_batch_size"), "{{model}} p95")])
    b.ts("Queue delay p95", q(quantile(0.95, "rampart_tensor_queue_delay_seconds"), "{{model}}"), "s")
    b.ts("Queue depth", q(f"sum by (model) (rampart_tensor_queue_depth{{{MSEL}}})", "{{model}}"))
    b.ts("Compute per batch p50 / p95", [q(quantile(0.5, "rampart_tensor_compute_seconds"), "{{model}} p50"),
                                          q(quantile(0.95, "rampart_tensor_compute_seconds"), "{{model}} p95")], "s")
    b.ts("Request duration p95", q(quantile(0.95, "rampart_request_duration_seconds"), "{{model}}"), "s")
    b.row("Confidence")
    b.ts("Request confidence p10 / p50", [q(quantile(0.1, "rampart_output_confidence"), "{{model}} p10"),
                                           q(quantile(0.5, "rampart_output_confidence"), "{{model}} p50")], "percentunit")
    b.ts("Confidence window mean", q(f"rampart_output_confidence_window_mean{{{MSEL}}}", "{{model}} {{version}}"), "percentunit")
    return b


def governance():
    b = Board("rampart-governance", "Rampart / Defence lines and governance", "Guard, fallback chain, breakers, hand-off, monitors (drift, entropy), audit log and record sinks.", ["governance"])
    b.row("Input guard")
    b.ts("Guard decisions by verdict", q(rate("rampart_guard_decisions_total", by="model, verdict"), "{{model}} {{verdict}}"), "reqps")
    b.ts("Guard time p95", q(quantile(0.95, "rampart_guard_seconds"), "{{model}}"), "s")
    b.ts("Output guard", q(rate("rampart_guard_output_total", by="model, verdict"), "{{model}} {{verdict}}"), "reqps")
    b.row("Fallback chain, breakers, hand-off")
    b.ts("Answered by fallback, by step and reason", q(rate("rampart_fallback_total", by="model, to, reason"), "{{model}} → {{to}} ({{reason}})"), "reqps")
    b.ts("Fallback share", q('rampart:fallback:ratio_rate5m{job="$job", model=~"$model"}', "{{model}}"), "percentunit")
    b.ts("Canned answers / s", q(rate("rampart_canned_responses_total"), "{{model}}"), "reqps")
    b.ts("Breaker state (0 closed, 1 half-open, 2 open)", q(f"max by (backend) (rampart_breaker_state{{{SEL}}})", "{{backend}}"), w=12)
    b.ts("Breaker transitions", q(f"sum by (backend, to) (increase(rampart_breaker_transitions_total{{{SEL}}}[$__rate_interval]))", "{{backend}} → {{to}}"), w=12)
    b.stat("Handed off", q(f"sum(rampart_handoff_active{{{MSEL}}})"))
    b.stat("Faults struck (1h)", q(f"sum(increase(rampart_faults_struck_total{{{SEL}}}[1h]))"))
    b.stat("Admin actions (1h)", q(f"sum(increase(rampart_admin_actions_total{{{SEL}}}[1h]))"))
    b.ts("Hand-offs and resumptions", q(f"sum by (model, to) (increase(rampart_handoff_transitions_total{{{MSEL}}}[$__rate_interval]))", "{{model}} {{to}}"), w=12, h=4)
    b.row("Monitors")
    b.ts("Feature drift score", q(f"rampart_feature_drift_score{{{MSEL}}}", "{{model}} {{version}} {{feature}}"))
    b.ts("Feature drift p-value", q(f"rampart_feature_drift_pvalue{{{MSEL}}}", "{{model}} {{version}} {{feature}}"))
    b.ts("Drift alarms", [q(f"max by (model, version) (rampart_drift_active{{{MSEL}}})", "{{model}} {{version}} active"),
                          q(f"sum by (model, version) (increase(rampart_drift_alarms_total{{{MSEL}}}[$__rate_interval]))", "{{model}} {{version}} raised")])
    b.ts("Output entropy window (mean ± std)", [
        q(f"rampart_output_entropy_window_mean{{{MSEL}}}", "{{model}} {{version}} mean"),
        q(f"rampart_output_entropy_window_mean{{{MSEL}}} + rampart_output_entropy_window_std{{{MSEL}}}", "{{model}} {{version}} +1σ"),
        q(f"rampart_output_entropy_window_mean{{{MSEL}}} - rampart_output_entropy_window_std{{{MSEL}}}", "{{model}} {{version}} −1σ")], w=12)
    b.ts("Requests in monitor window", q(f"rampart_monitor_window_requests{{{MSEL}}}", "{{model}} {{version}}"), w=12)
    b.row("Releases")
    b.ts("Release weight", q(f"max by (model, version) (rampart_release_weight{{{MSEL}}})", "{{model}} {{version}}"), w=8)
    b.ts("Release phase", q(f"max by (model) (rampart_release_phase{{{MSEL}}})", "{{model}}"), w=8)
    b.ts("Release decisions", q(f"sum by (model, result, reason) (increase(rampart_release_decisions_total{{{MSEL}}}[$__rate_interval]))", "{{model}} {{result}} {{reason}}"), w=8)
    b.row("Audit log and record sinks")
    b.stat("Audit healthy", q(f"min(rampart_audit_healthy{{{SEL}}})"))
    b.stat("Audit ship lag", q(f"max(rampart_audit_ship_lag_seconds{{{SEL}}})"), "s")
    b.stat("Checkpoint age", q(f"max(rampart_audit_checkpoint_age_seconds{{{SEL}}})"), "s")
    b.stat("Audit queue", q(f"sum(rampart_audit_queue_depth{{{SEL}}})"))
    b.stat("Audit dropped (1h)", q(f"sum(increase(rampart_audit_dropped_total{{{SEL}}}[1h]))"))
    b.stat("S3 retries (1h)", q(f"sum(increase(rampart_audit_s3_retries_total{{{SEL}}}[1h])) + sum(increase(rampart_audit_ship_failures_total{{{SEL}}}[1h]))"))
    b.ts("Audit appends / s", q(f"sum(rate(rampart_audit_appended_total{{{SEL}}}[$__rate_interval]))", "appended"), "short")
    b.ts("Audit group commit p99", q(f"histogram_quantile(0.99, sum by (le) (rate(rampart_audit_fsync_seconds_bucket{{{SEL}}}[$__rate_interval])))", "fsync p99"), "s")
    b.ts("Record sinks: written and dropped / s", [
        q(f"sum by (sink) (rate(rampart_record_written_total{{{SEL}}}[$__rate_interval]))", "{{sink}} written"),
        q(f"sum by (sink, reason) (rate(rampart_record_dropped_total{{{SEL}}}[$__rate_interval]))", "{{sink}} dropped {{reason}}")])
    return b


def host_gpu():
    b = Board("rampart-host-gpu", "Rampart / Host and GPU", "The process, its cgroup, pressure stall information, host memory and each GPU (when NVML loads).", ["host", "gpu"], model_var=False)
    b.row("Process and cgroup")
    b.ts("CPU used (cores) and quota", [
        q(f"rate(rampart_process_cpu_seconds_total{{{SEL}}}[$__rate_interval])", "{{instance}} process"),
        q(f"rate(rampart_cgroup_cpu_usage_seconds_total{{{SEL}}}[$__rate_interval])", "{{instance}} cgroup"),
        q(f"rampart_cgroup_cpu_quota_cores{{{SEL}}}", "{{instance}} quota")])
    b.ts("CPU throttled share of periods", q(f'rampart:cgroup_cpu_throttled:ratio_rate5m{{{SEL}}}', "{{instance}}"), "percentunit")
    b.ts("Memory", [
        q(f"rampart_process_resident_memory_bytes{{{SEL}}}", "{{instance}} RSS"),
        q(f"rampart_cgroup_memory_usage_bytes{{{SEL}}}", "{{instance}} cgroup"),
        q(f"rampart_cgroup_memory_limit_bytes{{{SEL}}}", "{{instance}} limit"),
        q(f"rampart_host_memory_available_bytes{{{SEL}}}", "{{instance}} host available")], "bytes")
    b.ts("Pressure stall (avg10)", q(f"rampart_pressure_avg10_ratio{{{SEL}}}", "{{instance}} {{resource}} {{kind}}"), "percentunit")
    b.ts("Stalled time / s", q(f"rate(rampart_pressure_stall_seconds_total{{{SEL}}}[$__rate_interval])", "{{instance}} {{resource}} {{kind}}"), "percentunit")
    b.ts("Files and threads", [
        q(f"rampart_process_open_fds{{{SEL}}}", "{{instance}} open fds"),
        q(f"rampart_process_max_fds{{{SEL}}}", "{{instance}} max fds"),
        q(f"rampart_process_threads{{{SEL}}}", "{{instance}} threads")])
    b.stat("OOM kills (cgroup)", q(f"sum(rampart_cgroup_oom_kills_total{{{SEL}}})"))
    b.stat("Telemetry read time", q(f"max(rampart_host_telemetry_duration_seconds{{{SEL}}})"), "s")
    b.stat("Host memory total", q(f"max(rampart_host_memory_total_bytes{{{SEL}}})"), "bytes")
    b.row("GPU")
    b.ts("Utilization", [q(f"rampart_gpu_utilization_ratio{{{SEL}}}", "{{instance}} gpu{{gpu}} SM"),
                         q(f"rampart_gpu_memory_utilization_ratio{{{SEL}}}", "{{instance}} gpu{{gpu}} memory")], "percentunit")
    b.ts("Device memory", [q(f"rampart_gpu_memory_used_bytes{{{SEL}}}", "{{instance}} gpu{{gpu}} used"),
                           q(f"rampart_gpu_memory_total_bytes{{{SEL}}}", "{{instance}} gpu{{gpu}} total")], "bytes")
    b.ts("Temperature", q(f"rampart_gpu_temperature_celsius{{{SEL}}}", "{{instance}} gpu{{gpu}}"), "celsius")
    b.ts("Power and limit", [q(f"rampart_gpu_power_watts{{{SEL}}}", "{{instance}} gpu{{gpu}} draw"),
                             q(f"rampart_gpu_power_limit_watts{{{SEL}}}", "{{instance}} gpu{{gpu}} limit")], "watt")
    b.ts("Clocks (share of max)", [q(f'rampart:gpu_sm_clock:ratio{{{SEL}}}', "{{instance}} gpu{{gpu}} SM"),
                                    q(f"rampart_gpu_memory_clock_hertz{{{SEL}}} / rampart_gpu_memory_clock_max_hertz{{{SEL}}}", "{{instance}} gpu{{gpu}} memory")], "percentunit")
    b.ts("Throttle reasons active", q(f"rampart_gpu_throttle_reason_active{{{SEL}}} == 1", "{{instance}} gpu{{gpu}} {{reason}}"))
    b.ts("PCIe link (current / max)", [
        q(f"rampart_gpu_pcie_link_gen{{{SEL}}}", "{{instance}} gpu{{gpu}} gen"),
        q(f"rampart_gpu_pcie_link_gen_max{{{SEL}}}", "{{instance}} gpu{{gpu}} gen max"),
        q(f"rampart_gpu_pcie_link_width{{{SEL}}}", "{{instance}} gpu{{gpu}} width"),
        q(f"rampart_gpu_pcie_link_width_max{{{SEL}}}", "{{instance}} gpu{{gpu}} width max")])
    b.ts("ECC and XID errors (increase)", [
        q(f"increase(rampart_gpu_ecc_errors_total{{{SEL}}}[$__rate_interval])", "{{instance}} gpu{{gpu}} ECC {{type}}"),
        q(f"increase(rampart_gpu_xid_errors_total{{{SEL}}}[$__rate_interval])", "{{instance}} gpu{{gpu}} XID")])
    b.ts("GPUs", q(f"rampart_gpu_info{{{SEL}}}", "{{instance}} gpu{{gpu}} {{name}} {{uuid}}"), w=8)
    return b


if __name__ == "__main__":
    for name, build in [("overview", overview), ("llm-engine", llm_engine), ("tensor-models", tensor_models),
                        ("governance", governance), ("host-gpu", host_gpu)]:
        with open(os.path.join(HERE, f"rampart-{name}.json"), "w") as f:
            json.dump(build().json(), f, indent=2, ensure_ascii=False)
            f.write("\n")
