#!/usr/bin/env bash
# Fetch the ONNX Runtime shared library for the tensor models' default backend.
#
# The library ships inside the `onnxruntime` wheel (pip); we `pip download --no-deps` the wheel
# for this machine's architecture, check it against a pinned sha256, and extract only
# `libonnxruntime.so.<version>` (nothing is installed, no Python module is used). The server's
# `[tensor] backend = "auto"` finds it in the model cache and runs ONNX graphs on it, with tract
# as the fallback twin (docs/tensor-models.md). Idempotent: a library already extracted and
# valid is kept.
#
# Usage: scripts/fetch-onnxruntime.sh [DEST]
#   DEST: the folder for the library (default: $RAMPART_MODEL_CACHE/onnxruntime/<version>)
# Prints the library's path on stdout.
set -euo pipefail

VERSION=1.32.0
CACHE="${RAMPART_MODEL_CACHE:-$HOME/.cache/rampart/models}"
DEST="${1:-$CACHE/onnxruntime/$VERSION}"

case "$(uname -m)" in
  x86_64) PLATFORM=manylinux_2_28_x86_64
    WHEEL_SHA256=5a34fc4dfeb5a7b4a74c95dcba1e773d722abda720b474edf1b0c419dc6d163d ;;
  aarch64) PLATFORM=manylinux_2_28_aarch64
    WHEEL_SHA256=2303372a85299b6757b0e11e1cbf13e410ddf7e10c37f4b37e99d1c90e7daf7c ;;
  *) echo "fetch-onnxruntime: no pinned onnxruntime wheel for $(uname -m); tensor models serve on tract" >&2
    exit 1 ;;
esac

LIB="libonnxruntime.so.$VERSION"
say() { echo "fetch-onnxruntime: $*" >&2; }

# The extracted library's own digest, written at extraction from the verified wheel.
if [[ -f "$DEST/$LIB" && -f "$DEST/$LIB.sha256" ]] \
  && [[ "$(sha256sum "$DEST/$LIB" | cut -d' ' -f1)" == "$(cat "$DEST/$LIB.sha256")" ]]; then
  echo "$DEST/$LIB"
  exit 0
fi

PIP=(python3 -m pip)
command -v pip3 >/dev/null 2>&1 && PIP=(pip3)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
say "downloading onnxruntime==$VERSION ($PLATFORM)"
"${PIP[@]}" download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --platform "$PLATFORM" --python-version 3.11 "onnxruntime==$VERSION" -d "$work" >&2
wheel="$(ls "$work"/onnxruntime-"$VERSION"-*.whl)"
actual="$(sha256sum "$wheel" | cut -d' ' -f1)"
[[ "$actual" == "$WHEEL_SHA256" ]] \
  || { say "error: $(basename "$wheel") has sha256 $actual, expected $WHEEL_SHA256"; exit 1; }
python3 - "$wheel" "$work" "onnxruntime/capi/$LIB" <<'EOF'
import sys, zipfile
wheel, out, member = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    z.extract(member, out)
EOF
mkdir -p "$DEST"
mv "$work/onnxruntime/capi/$LIB" "$DEST/$LIB.tmp"
sha256sum "$DEST/$LIB.tmp" | cut -d' ' -f1 > "$DEST/$LIB.sha256"
mv "$DEST/$LIB.tmp" "$DEST/$LIB"
ln -sf "$LIB" "$DEST/libonnxruntime.so"
say "ONNX Runtime $VERSION at $DEST/$LIB"
echo "$DEST/$LIB"
