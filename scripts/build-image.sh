#!/usr/bin/env bash
# Build the Rampart container image from Debian packages and the release binary, with no base
# image pulled from any registry (docs/kubernetes.md#the-image).
#
#   layer 1: a minimal Debian root file system (mmdebstrap --variant=extract: libc6, libgcc-s1,
#            libstdc++6 for ONNX Runtime, ca-certificates with its bundle generated), the user
#            rampart (10001:10001), no shell;
#   layer 2: /usr/local/bin/rampart and /opt/onnxruntime/lib/libonnxruntime.so (extracted from
#            the pinned onnxruntime wheel, scripts/fetch-onnxruntime.sh).
#
# Reproducible: every timestamp is SOURCE_DATE_EPOCH (the commit's time by default), the tars are
# sorted with numeric owners, and the Debian package versions are written into the image
# (/usr/share/rampart/packages.txt): the same binary, packages and epoch give the same digest.
#
# Usage: scripts/build-image.sh [--binary PATH] [--tag TAG] [--out DIR] [--suite SUITE]
#   --binary  the rampart binary (default: target/release/rampart, built when missing)
#   --tag     the image tag (default: the crate version, e.g. 0.1.0)
#   --out     where the OCI layout and the archives go (default: target/image)
# Writes DIR/oci (OCI layout), DIR/rampart-TAG.oci.tar (oci-archive) and
# DIR/rampart-TAG.docker.tar (`docker load`), and prints the image digest.
# Needs (apt): mmdebstrap umoci skopeo.
set -euo pipefail
cd "$(dirname "$0")/.."

binary="" tag="" out="target/image" suite="bookworm"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --binary) binary="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --suite) suite="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build-image: unknown argument $1" >&2; exit 2 ;;
  esac
done
say() { echo "build-image: $*" >&2; }
for tool in mmdebstrap umoci skopeo; do
  command -v "$tool" >/dev/null || { say "needs $tool (apt-get install mmdebstrap umoci skopeo)"; exit 1; }
done

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
tag="${tag:-$version}"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}"
created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"

if [[ -z "$binary" ]]; then
  binary=target/release/rampart
  [[ -x "$binary" ]] || cargo build --release --locked -p rampart
fi
[[ -x "$binary" ]] || { say "no executable at $binary"; exit 1; }

# The commit the binary was built from (its --version says), for the revision label.
commit="$("$binary" --version | sed -n 's/.*(commit \([0-9a-f]*\).*/\1/p')"
commit="${commit:-unknown}"
head="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
[[ "$head" == "$commit"* ]] || say "note: the binary is of commit $commit, this tree is at ${head:0:12}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$out"

# Layer 1: Debian, extracted (no maintainer scripts run, so the few things they would do are
# done here: the CA bundle, the user). Documentation, man pages and locales are left out.
say "Debian $suite root file system"
mmdebstrap --quiet --variant=extract --include=ca-certificates,libc6,libgcc-s1,libstdc++6 \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='cat "$1"/usr/share/ca-certificates/mozilla/*.crt > "$1"/etc/ssl/certs/ca-certificates.crt' \
  --customize-hook='printf "root:x:0:0:root:/root:/usr/sbin/nologin\nrampart:x:10001:10001:rampart:/var/lib/rampart:/usr/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n" > "$1"/etc/passwd' \
  --customize-hook='printf "root:x:0:\nrampart:x:10001:\nnogroup:x:65534:\n" > "$1"/etc/group' \
  --customize-hook='printf "hosts: files dns\n" > "$1"/etc/nsswitch.conf' \
  --customize-hook='mkdir -p "$1"/usr/share/rampart && (cd "$1"/var/cache/apt/archives && ls *.deb | sed "s/\.deb$//" | sort) > "$1"/usr/share/rampart/packages.txt' \
  --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/* "$1"/etc/apt/sources.list.d/* "$1"/etc/machine-id' \
  "$suite" "$work/base.tar"

# Layer 2: the binary and ONNX Runtime, with the folders the server writes (volumes in a pod).
say "rampart $("$binary" --version | cut -d' ' -f2) ($binary) and ONNX Runtime"
app="$work/app"
mkdir -p "$app/usr/local/bin" "$app/opt/onnxruntime/lib" "$app/var/lib/rampart" "$app/models" \
  "$app/etc/rampart"
install -m 0755 "$binary" "$app/usr/local/bin/rampart"
ort="$(scripts/fetch-onnxruntime.sh)"
install -m 0644 "$ort" "$app/opt/onnxruntime/lib/$(basename "$ort")"
ln -s "$(basename "$ort")" "$app/opt/onnxruntime/lib/libonnxruntime.so"
# A reproducible tar of folders of $app: sorted, the epoch's time, numeric owners, no access or
# change times. The folders the server writes belong to its user.
app_tar() { # -c|-r OWNER PATH...
  local mode="$1" owner="$2"; shift 2
  tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --numeric-owner \
    --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime -C "$app" "${mode}f" "$work/app.tar" \
    --owner="$owner" --group="$owner" "$@"
}
app_tar -c 0 ./usr ./opt ./etc
app_tar -r 10001 ./var ./models

say "OCI image rampart:$tag"
rm -rf "$out/oci"
umoci init --layout "$out/oci"
umoci new --image "$out/oci:$tag"
umoci raw add-layer --image "$out/oci:$tag" --history.created "$created" \
  --history.created_by "mmdebstrap --variant=extract $suite (ca-certificates libc6 libgcc-s1 libstdc++6)" \
  "$work/base.tar"
umoci raw add-layer --image "$out/oci:$tag" --history.created "$created" \
  --history.created_by "rampart $version ($commit) and ONNX Runtime" "$work/app.tar"
umoci config --image "$out/oci:$tag" --created "$created" --author "Rampart" \
  --history.created "$created" --history.created_by "rampart image configuration" \
  --config.user 10001:10001 \
  --config.entrypoint /usr/local/bin/rampart --config.cmd serve \
  --config.workingdir /var/lib/rampart \
  --config.env PATH=/usr/local/bin:/usr/bin:/bin \
  --config.env HOME=/var/lib/rampart \
  --config.env RAMPART_LISTEN=0.0.0.0:8080 \
  --config.env RAMPART_GRPC_LISTEN=0.0.0.0:8001 \
  --config.env RAMPART_REPO=/models \
  --config.env ORT_DYLIB_PATH=/opt/onnxruntime/lib/libonnxruntime.so \
  --config.env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
  --config.exposedports 8080/tcp --config.exposedports 8001/tcp \
  --config.volume /var/lib/rampart --config.volume /models \
  --config.label "org.opencontainers.image.title=rampart" \
  --config.label "org.opencontainers.image.description=A self-hosted, governed AI model server" \
  --config.label "org.opencontainers.image.version=$version" \
  --config.label "org.opencontainers.image.revision=$commit" \
  --config.label "org.opencontainers.image.created=$created" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --config.label "org.opencontainers.image.base.name=debian:$suite (mmdebstrap, no registry)"
umoci gc --layout "$out/oci"

rm -f "$out/rampart-$tag.oci.tar" "$out/rampart-$tag.docker.tar"
skopeo copy --quiet "oci:$out/oci:$tag" "oci-archive:$out/rampart-$tag.oci.tar:rampart:$tag"
skopeo copy --quiet "oci:$out/oci:$tag" "docker-archive:$out/rampart-$tag.docker.tar:rampart:$tag"
digest="$(skopeo inspect --format '{{.Digest}}' "oci:$out/oci:$tag")"
size="$(du -b "$out/rampart-$tag.oci.tar" | cut -f1)"
say "rampart:$tag $digest ($((size / 1024 / 1024)) MiB) in $out"
echo "$digest"
