#!/usr/bin/env bash
# Build a model image: one model version as an image layer, tagged with the version, so that
# rolling a model back is changing a tag (docs/kubernetes.md#models).
#
# The image is the Rampart image (scripts/build-image.sh) plus one layer holding
# /models/NAME/VERSION (read-only files, the repository's own layout with its DIGESTS). Its
# command copies the version into a repository volume, verified file by file against its digests
# and the pinned version digest:
#   rampart model pull NAME@VERSION=sha256:DIGEST --from /models --repo /repository
# which is what the Helm chart's init container runs (models.source=image). Sharing the Rampart
# image's layers, it costs a node only the model's bytes.
#
# Usage: scripts/build-model-image.sh NAME@VERSION [--repo DIR] [--base DIR] [--out DIR]
#   --repo  the repository holding the version (default: $RAMPART_REPO or ./models)
#   --base  the Rampart image's OCI layout and tag, LAYOUT:TAG (default: target/image/oci:<crate
#           version>, as scripts/build-image.sh leaves it)
#   --out   where the layout and archives go (default: target/image)
# Writes OUT/oci (its tag rampart-model-NAME-VERSION), OUT/rampart-model-NAME-VERSION.
# {oci,docker}.tar, and prints the image digest. Needs (apt): umoci skopeo.
set -euo pipefail
cd "$(dirname "$0")/.."

model="" repo="${RAMPART_REPO:-models}" base="" out="target/image"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --repo) repo="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "build-model-image: unknown option $1" >&2; exit 2 ;;
    *) model="$1"; shift ;;
  esac
done
say() { echo "build-model-image: $*" >&2; }
[[ "$model" == *@* ]] || { say "give NAME@VERSION"; exit 2; }
name="${model%@*}" version="${model#*@}"
dir="$repo/$name/$version"
[[ -f "$dir/DIGESTS" ]] || { say "no version at $dir"; exit 1; }
crate_version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
base="${base:-target/image/oci:$crate_version}"
digest="sha256:$(sed -n 's/^version sha256:\([0-9a-f]*\)$/\1/p' "$dir/DIGESTS")"
[[ "$digest" != "sha256:" ]] || { say "$dir/DIGESTS has no version line"; exit 1; }
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}"
created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/layer/models/$name" "$out"
cp -r "$dir" "$work/layer/models/$name/$version"
chmod -R a-w,a+rX "$work/layer/models/$name/$version"
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=10001 --group=10001 --numeric-owner \
  --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
  -C "$work/layer" -cf "$work/model.tar" "./models/$name"

image="rampart-model-$name"
say "$image:$version on $base"
mkdir -p "$out/oci"
[[ -f "$out/oci/oci-layout" ]] || umoci init --layout "$out/oci"
skopeo copy --quiet "oci:$base" "oci:$out/oci:$image-$version"
umoci raw add-layer --image "$out/oci:$image-$version" --history.created "$created" \
  --history.created_by "model $name@$version ($digest)" "$work/model.tar"
umoci config --image "$out/oci:$image-$version" --created "$created" \
  --history.created "$created" --history.created_by "rampart model image configuration" \
  --config.cmd model --config.cmd pull --config.cmd "$name@$version=$digest" \
  --config.cmd --from --config.cmd /models --config.cmd --repo --config.cmd /repository \
  --config.label "io.rampart.model.name=$name" \
  --config.label "io.rampart.model.version=$version" \
  --config.label "io.rampart.model.digest=$digest"
umoci gc --layout "$out/oci"
archive="$out/$image-$version"
rm -f "$archive.oci.tar" "$archive.docker.tar"
skopeo copy --quiet "oci:$out/oci:$image-$version" "oci-archive:$archive.oci.tar:$image:$version"
skopeo copy --quiet "oci:$out/oci:$image-$version" "docker-archive:$archive.docker.tar:$image:$version"
image_digest="$(skopeo inspect --format '{{.Digest}}' "oci:$out/oci:$image-$version")"
say "$image:$version $image_digest (model digest $digest)"
echo "$image_digest"
