#!/usr/bin/env python3
"""The checks of scripts/check-kubernetes.sh that no off-the-shelf tool makes.

  schemas   every rendered object has a schema: kubernetes-validate's for the Kubernetes version
            (the shell script runs kubernetes-validate itself) or a vendored CRD's
            openAPIV3Schema (deploy/helm/schemas), which this validates strictly (unknown fields
            refused, as the API server's strict field validation does) with metadata against
            Kubernetes' ObjectMeta; an object with neither fails.
  render    what a render must hold beyond its schema: the grace period covers the drain, the
            probes' echoes (RAMPART_PROBE_*) equal the probes, the ports and the environment the
            image sets equal rampart.toml's, the doctor init container sees the server's
            environment, volumes and resources, every Secret reference names a key the render's
            Secret has, no replicas beside an autoscaler; every `config` value of the values file is in rampart.toml as
            given (the chart's own TOML writer). Writes its rampart.toml, the server's environment
            with stand-ins for Secrets (FILE.env), for `rampart serve --check`, and the argument
            lists the pod runs the Rampart image with (FILE.args, one a line, tab-separated).
  base      writes the kustomize base from a render of the chart's defaults.
  signals   the autoscaling signals are the same in the adapter rules, the values schema and the
            chart's KEDA queries.
  values-doc  every value of values.yaml is in the chart's README.

Run by scripts/check-kubernetes.sh inside its virtual environment (PyYAML, jsonschema,
kubernetes-validate).
"""
import argparse
import copy
import json
import os
import re
import sys
import tomllib

import jsonschema
import yaml

# rampart.toml keys the chart sets itself from other values; `config` cannot set them.
CHART_OWNED = {
    ("listen",), ("grpc", "listen"), ("repo",), ("api_keys_file",), ("insecure_no_auth",),
    ("audit", "dir"), ("audit", "s3"), ("feedback", "dir"), ("fleet", "enabled"), ("tls",),
}
PROBE_ECHOES = {
    "RAMPART_PROBE_LIVENESS_PERIOD_S": ("livenessProbe", "periodSeconds"),
    "RAMPART_PROBE_LIVENESS_TIMEOUT_S": ("livenessProbe", "timeoutSeconds"),
    "RAMPART_PROBE_READINESS_PERIOD_S": ("readinessProbe", "periodSeconds"),
    "RAMPART_PROBE_READINESS_TIMEOUT_S": ("readinessProbe", "timeoutSeconds"),
}


def load_docs(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def name_of(doc):
    return "%s/%s" % (doc.get("kind"), doc.get("metadata", {}).get("name"))


# ---------------------------------------------------------------------------------------- schemas

def kubernetes_validate_has(doc, kube_version):
    """Does kubernetes-validate bundle a schema for this object at this version? (its own lookup)"""
    from kubernetes_validate import utils

    mm = utils.major_minor(kube_version)
    versions = [v for v in utils.all_versions() if utils.major_minor(v) <= mm]
    if not versions:
        return False
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", doc["apiVersion"])
    folder = os.path.join(os.path.dirname(utils.__file__), "kubernetes-json-schema",
                          "v%s-local-strict" % versions[-1])
    return os.path.exists(os.path.join(folder, "%s-%s.json" % (doc["kind"].lower(), api)))


def strict(schema):
    """The API server's strict field validation: an object schema with properties refuses others,
    unless it keeps unknown fields on purpose."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (out.get("type") == "object" and "properties" in out
                and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def vendored_crds(folder):
    """(group/version, kind) -> the version's strict openAPIV3Schema, from every CRD file."""
    crds = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith((".yaml", ".yml")):
            continue
        for crd in load_docs(os.path.join(folder, name)):
            if crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                if not version.get("served", True):
                    continue
                key = ("%s/%s" % (spec["group"], version["name"]), spec["names"]["kind"])
                crds[key] = (name, strict(version["schema"]["openAPIV3Schema"]))
    return crds


def object_meta_validator(kube_version):
    from kubernetes_validate import utils

    mm = utils.major_minor(kube_version)
    version = [v for v in utils.all_versions() if utils.major_minor(v) <= mm][-1]
    path = os.path.join(os.path.dirname(utils.__file__), "kubernetes-json-schema",
                        "v%s-local-strict" % version, "_definitions.json")
    with open(path, encoding="utf-8") as f:
        defs = json.load(f)
    schema = {"$schema": defs["$schema"], "$defs": defs["$defs"],
              "$ref": "#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    return jsonschema.Draft202012Validator(schema)


def cmd_schemas(args):
    crds = vendored_crds(args.crds)
    failures = 0
    counts = {"kubernetes-validate": 0, "vendored CRD": 0}
    for kube_version in args.kube_version:
        meta = object_meta_validator(kube_version)
        for path in args.files:
            for doc in load_docs(path):
                where = "%s: %s (Kubernetes %s)" % (path, name_of(doc), kube_version)
                if kubernetes_validate_has(doc, kube_version):
                    counts["kubernetes-validate"] += 1
                    continue
                key = (doc.get("apiVersion"), doc.get("kind"))
                if key not in crds:
                    print("error: %s: no schema: kubernetes-validate has none for %s %s and no CRD "
                          "under %s serves it" % (where, key[0], key[1], args.crds))
                    failures += 1
                    continue
                crd_file, schema = crds[key]
                body = {k: v for k, v in doc.items() if k != "metadata"}
                errors = [((), e) for e in jsonschema.Draft7Validator(schema).iter_errors(body)]
                errors += [(("metadata",), e) for e in meta.iter_errors(doc.get("metadata", {}))]
                for prefix, e in errors:
                    print("error: %s against %s: %s: %s" % (
                        where, crd_file, ".".join(str(p) for p in prefix + tuple(e.absolute_path)) or "(root)",
                        e.message))
                failures += len(errors)
                counts["vendored CRD"] += 1
    print("schemas: %d objects by kubernetes-validate, %d by vendored CRDs, %d errors" % (
        counts["kubernetes-validate"], counts["vendored CRD"], failures))
    return 1 if failures else 0


# ----------------------------------------------------------------------------------------- render

def env_of(container):
    return {e["name"]: e.get("value") for e in container.get("env", []) if "value" in e}


# Stand-ins for what the kubelet gives the server container, for `rampart serve --check`.
SECRET_STAND_INS = {
    "RAMPART_FLEET_POSTGRES_URL": "postgresql://rampart:check@127.0.0.1:5432/rampart",
    "RAMPART_FEEDBACK_POSTGRES_URL": "postgresql://rampart:check@127.0.0.1:5432/rampart",
    "RAMPART_FEEDBACK_SECRET": "check-feedback-link-secret-0123456789",
    "RAMPART_API_KEYS": "check:sk-check-0123456789",
    "AWS_ACCESS_KEY_ID": "AKIACHECK0123456789",
    "AWS_SECRET_ACCESS_KEY": "check-secret-access-key",
}
FIELD_STAND_INS = {"metadata.name": "rampart-5d8f7c9b6-x2x7k", "metadata.namespace": "rampart"}


def pod_env(container):
    """NAME=VALUE lines of the container's environment as the kubelet would set it, with
    stand-ins for Secrets and the downward API."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                           e["value"] or "")
        elif "secretKeyRef" in e.get("valueFrom", {}):
            value = SECRET_STAND_INS.get(e["name"], "check")
        elif "fieldRef" in e.get("valueFrom", {}):
            value = FIELD_STAND_INS.get(e["valueFrom"]["fieldRef"]["fieldPath"], "check")
        else:
            value = "check"
        env[e["name"]] = value
    return ["%s=%s" % kv for kv in env.items()]


def numbers_equal(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(numbers_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(numbers_equal(x, y) for x, y in zip(a, b))
    return a == b


def config_mismatches(given, written, path=()):
    """Every value of `config` (the values file) as rampart.toml holds it."""
    out = []
    if path in CHART_OWNED:
        return out
    if isinstance(given, dict):
        if not isinstance(written, dict):
            return ["%s: a table in config, %r in rampart.toml" % (".".join(path), written)]
        for key, value in given.items():
            if value is None:
                if key in written:
                    out.append("%s: null in config (removed) but in rampart.toml" % ".".join(path + (key,)))
                continue
            if key not in written and path + (key,) not in CHART_OWNED:
                out.append("%s: in config, not in rampart.toml" % ".".join(path + (key,)))
                continue
            out += config_mismatches(value, written.get(key), path + (key,))
        return out
    if not numbers_equal(given, written):
        out.append("%s: %r in config, %r in rampart.toml" % (".".join(path), given, written))
    return out


def cmd_render(args):
    docs = load_docs(args.render)
    problems = []
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    autoscaled = any(d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject") for d in docs)
    deployments = [d for d in docs if d["kind"] == "Deployment"]
    if not deployments:
        problems.append("no Deployment rendered")
    tomls = []
    for dep in deployments:
        pod = dep["spec"]["template"]["spec"]
        server = next((c for c in pod["containers"] if c["name"] == "rampart"), None)
        if server is None:
            problems.append("%s: no container named rampart" % name_of(dep))
            continue
        sources = [s["configMap"]["name"] for v in pod.get("volumes", []) if "projected" in v
                   for s in v["projected"]["sources"] if "configMap" in s]
        if len(sources) != 1 or sources[0] not in configmaps:
            problems.append("%s: its rampart.toml ConfigMap %s is not in the render" % (name_of(dep), sources))
            continue
        text = configmaps[sources[0]]["data"]["rampart.toml"]
        try:
            toml = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            problems.append("%s: rampart.toml does not parse: %s" % (name_of(dep), e))
            continue
        # The argument lists the Rampart image runs (server, doctor, fetch-model), for the CLI to parse.
        commands = [c["args"] for c in [server] + pod.get("initContainers", [])
                    if c.get("image") == server.get("image") and "command" not in c and c.get("args")]
        tomls.append((text, pod_env(server), commands))
        drain = toml.get("drain_delay_s", 0) + toml.get("shutdown_timeout_s", 30)
        grace = pod.get("terminationGracePeriodSeconds", 30)
        env = env_of(server)
        if grace < drain:
            problems.append("%s: terminationGracePeriodSeconds %d < drain_delay_s + shutdown_timeout_s = %d"
                            % (name_of(dep), grace, drain))
        if env.get("RAMPART_TERMINATION_GRACE_S") != str(grace):
            problems.append("%s: RAMPART_TERMINATION_GRACE_S %r, grace period %d"
                            % (name_of(dep), env.get("RAMPART_TERMINATION_GRACE_S"), grace))
        for var, (probe, field) in PROBE_ECHOES.items():
            if env.get(var) != str(server[probe][field]):
                problems.append("%s: %s %r, %s.%s %r" % (name_of(dep), var, env.get(var), probe, field,
                                                         server[probe][field]))
        startup = server["startupProbe"]
        budget = startup["failureThreshold"] * startup["periodSeconds"]
        if env.get("RAMPART_PROBE_STARTUP_BUDGET_S") != str(budget):
            problems.append("%s: RAMPART_PROBE_STARTUP_BUDGET_S %r, startup budget %d"
                            % (name_of(dep), env.get("RAMPART_PROBE_STARTUP_BUDGET_S"), budget))
        for probe, path in (("startupProbe", "/health/ready"), ("livenessProbe", "/health/live"),
                            ("readinessProbe", "/health/ready")):
            if server[probe]["httpGet"]["path"] != path:
                problems.append("%s: %s on %s, not %s" % (name_of(dep), probe, server[probe]["httpGet"]["path"], path))
        ports = {p["name"]: p["containerPort"] for p in server.get("ports", [])}
        listens = {"http": toml.get("listen", "")}
        if toml.get("grpc", {}).get("enabled", True):
            listens["grpc"] = toml.get("grpc", {}).get("listen", "")
        for port_name, listen in listens.items():
            if not listen.startswith("0.0.0.0:") or ports.get(port_name) != int(listen.rsplit(":", 1)[1]):
                problems.append("%s: container port %s %r, rampart.toml listens on %r"
                                % (name_of(dep), port_name, ports.get(port_name), listen))
        defined = set()
        for e in server.get("env", []):
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value") or ""):
                if ref not in defined:
                    problems.append("%s: %s refers to $(%s) before it is defined (Kubernetes leaves it as text)"
                                    % (name_of(dep), e["name"], ref))
            defined.add(e["name"])
        # The image sets these, and the environment wins over rampart.toml: they must agree.
        for var, key in (("RAMPART_LISTEN", ("listen",)), ("RAMPART_GRPC_LISTEN", ("grpc", "listen")),
                         ("RAMPART_REPO", ("repo",))):
            in_file = toml
            for k in key:
                in_file = in_file.get(k, {}) if isinstance(in_file, dict) else {}
            if var not in env:
                problems.append("%s: %s is not set (the image's own value would win over rampart.toml)"
                                % (name_of(dep), var))
            elif in_file and in_file != env[var]:
                problems.append("%s: %s=%s, rampart.toml says %s" % (name_of(dep), var, env[var], in_file))
        if server["args"][:3] != ["serve", "--config", "/etc/rampart/rampart.toml"]:
            problems.append("%s: server args %r" % (name_of(dep), server["args"]))
        doctor = next((c for c in pod.get("initContainers", []) if c["name"] == "doctor"), None)
        if doctor is not None:
            if doctor.get("env") != server.get("env"):
                problems.append("%s: the doctor init container's environment differs from the server's" % name_of(dep))
            if doctor.get("volumeMounts") != server.get("volumeMounts"):
                problems.append("%s: the doctor init container's volumes differ from the server's" % name_of(dep))
            if doctor.get("resources") != server.get("resources"):
                problems.append("%s: the doctor init container's resources differ from the server's" % name_of(dep))
            if doctor["args"][:4] != ["doctor", "--config", "/etc/rampart/rampart.toml", "--fail-on"]:
                problems.append("%s: doctor args %r" % (name_of(dep), doctor["args"]))
        # References to a Secret of the same render name one of its keys.
        secrets = {d["metadata"]["name"]: set(d.get("stringData", {})) | set(d.get("data", {}))
                   for d in docs if d["kind"] == "Secret"}
        refs = [(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for c in pod["containers"] + pod.get("initContainers", []) for e in c.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})]
        refs += [(src["secret"]["name"], item["key"]) for v in pod.get("volumes", []) if "projected" in v
                 for src in v["projected"]["sources"] if "secret" in src for item in src["secret"].get("items", [])]
        for secret, key in sorted(set(refs)):
            if secret in secrets and key not in secrets[secret]:
                problems.append("%s: Secret %s has no key %s" % (name_of(dep), secret, key))
        if pod.get("automountServiceAccountToken") is not False:
            problems.append("%s: automountServiceAccountToken is not false" % name_of(dep))
        if autoscaled and "replicas" in dep["spec"]:
            problems.append("%s: sets replicas beside an autoscaler (each upgrade would reset them)" % name_of(dep))
        if args.values:
            with open(args.values, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
            if not values.get("configToml"):
                for m in config_mismatches(values.get("config") or {}, toml):
                    problems.append("%s: %s" % (args.values, m))
    for p in problems:
        print("error: %s: %s" % (args.render, p))
    if args.toml_out and tomls:
        with open(args.toml_out, "w", encoding="utf-8") as f:
            f.write(tomls[0][0])
        with open(args.toml_out + ".env", "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in tomls[0][1]))
        with open(args.toml_out + ".args", "w", encoding="utf-8") as f:
            f.write("".join("\t".join(c) + "\n" for c in tomls[0][2]))
    return 1 if problems else 0


# ------------------------------------------------------------------------------------------- base

HELM_ONLY_LABELS = ("helm.sh/chart", "app.kubernetes.io/managed-by")
HEADER = ("# Generated from the Helm chart's defaults (deploy/helm/rampart) by\n"
          "# scripts/check-kubernetes.sh --write-base; CI fails when it differs. Change the chart,\n"
          "# not this file, or patch it in an overlay (overlays/fleet).\n")


class Dumper(yaml.SafeDumper):
    pass


def _str(dumper, data):
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


Dumper.add_representer(str, _str)


def dump(doc):
    return yaml.dump(doc, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=1000,
                     allow_unicode=True)


def strip_helm(meta):
    meta.pop("namespace", None)
    labels = meta.get("labels", {})
    for key in HELM_ONLY_LABELS:
        labels.pop(key, None)


def cmd_base(args):
    docs = load_docs(args.render)
    os.makedirs(args.out, exist_ok=True)
    resources = []
    toml = None
    for doc in docs:
        doc = copy.deepcopy(doc)
        strip_helm(doc["metadata"])
        if doc["kind"] == "ConfigMap" and "rampart.toml" in doc.get("data", {}):
            toml = doc["data"]["rampart.toml"]
            continue
        if doc["kind"] == "Deployment":
            template = doc["spec"]["template"]["metadata"]
            strip_helm(template)
            # kustomize's configMapGenerator names the ConfigMap by its content instead.
            template.get("annotations", {}).pop("checksum/config", None)
            if not template.get("annotations"):
                template.pop("annotations", None)
        filename = "%s.yaml" % doc["kind"].lower()
        with open(os.path.join(args.out, filename), "w", encoding="utf-8") as f:
            f.write(HEADER + dump(doc))
        resources.append(filename)
    if toml is None:
        print("error: %s: no ConfigMap with rampart.toml" % args.render)
        return 1
    with open(os.path.join(args.out, "rampart.toml"), "w", encoding="utf-8") as f:
        f.write(toml)
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "namespace": "rampart",
        "resources": resources,
        "configMapGenerator": [{"name": args.name, "files": ["rampart.toml"]}],
    }
    with open(os.path.join(args.out, "kustomization.yaml"), "w", encoding="utf-8") as f:
        f.write(HEADER + "# The namespace is a default: set your own in an overlay.\n" + dump(kustomization))
    return 0


# ---------------------------------------------------------------------------------------- signals

def cmd_signals(args):
    with open(args.adapter_rules, encoding="utf-8") as f:
        adapter = {r["name"]["as"] for r in yaml.safe_load(f)["rules"]}
    with open(args.values_schema, encoding="utf-8") as f:
        schema = json.load(f)
    jsonschema.Draft7Validator.check_schema(schema)
    enum = set(schema["properties"]["autoscaling"]["properties"]["metrics"]["items"]["properties"]["name"]["enum"])
    with open(args.helpers, encoding="utf-8") as f:
        keda = set(re.findall(r'eq \$metric\.name "([a-z0-9_]+)"', f.read()))
    if adapter == enum == keda:
        print("signals: %s" % ", ".join(sorted(adapter)))
        return 0
    print("error: the autoscaling signals differ: adapter rules %s, values schema %s, KEDA queries %s"
          % (sorted(adapter), sorted(enum), sorted(keda)))
    return 1


# ------------------------------------------------------------------------------------- values doc

# Values passed to Kubernetes or rampart.toml as they are: one row each in the README.
OPAQUE_VALUES = {
    "commonLabels", "podLabels", "podAnnotations", "config", "nodeSelector", "affinity",
    "podSecurityContext", "securityContext", "resources", "strategy", "gpu.nodeSelector",
    "serviceAccount.annotations", "service.annotations", "monitoring.serviceMonitor.labels",
    "monitoring.prometheusRule.labels", "networkPolicy.egress.dns.namespaceSelector",
    "networkPolicy.egress.dns.podSelector", "autoscaling.behavior",
}


def value_paths(values, prefix=""):
    for key, value in values.items():
        path = prefix + key
        if isinstance(value, dict) and value and path not in OPAQUE_VALUES:
            yield from value_paths(value, path + ".")
        else:
            yield path


def cmd_values_doc(args):
    with open(args.values, encoding="utf-8") as f:
        values = yaml.safe_load(f)
    with open(args.readme, encoding="utf-8") as f:
        readme = f.read()
    missing = [p for p in value_paths(values) if "`%s`" % p not in readme]
    for p in missing:
        print("error: %s: value %s is not in %s" % (args.values, p, args.readme))
    return 1 if missing else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("schemas")
    p.add_argument("--crds", required=True)
    p.add_argument("--kube-version", action="append", required=True)
    p.add_argument("files", nargs="+")
    p.set_defaults(run=cmd_schemas)
    p = sub.add_parser("render")
    p.add_argument("--values")
    p.add_argument("--toml-out")
    p.add_argument("render")
    p.set_defaults(run=cmd_render)
    p = sub.add_parser("base")
    p.add_argument("--name", default="rampart")
    p.add_argument("render")
    p.add_argument("out")
    p.set_defaults(run=cmd_base)
    p = sub.add_parser("signals")
    p.add_argument("adapter_rules")
    p.add_argument("values_schema")
    p.add_argument("helpers")
    p.set_defaults(run=cmd_signals)
    p = sub.add_parser("values-doc")
    p.add_argument("values")
    p.add_argument("readme")
    p.set_defaults(run=cmd_values_doc)
    args = parser.parse_args()
    sys.exit(args.run(args))


if __name__ == "__main__":
    main()
