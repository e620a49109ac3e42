#!/usr/bin/env bash
# Build a beamserve container image offline and reproducibly: a Debian bookworm rootfs from
# Debian's mirror (mmdebstrap), the project's wheel and its pinned dependencies in a venv at
# /opt/beamserve, user 65532, packed as a one-layer OCI archive by images/oci.py.
#
#   scripts/build-image.sh IMAGE [--rev REV] [--out DIR] [--import SOCKET] [--context DIR] [--no-cache]
#
# IMAGE: beamserve (operator, router, sim worker), beamserve-ref (ref worker: torch CPU, NIXL,
# Mooncake) or pause (the pod sandbox image of the cluster tier). See docs/images.md.
#
# Contract:
#   - Inputs: the committed tree at REV (default HEAD; `git archive`, so uncommitted edits stay
#     out), images/IMAGE/{packages.txt,extras.txt,requirements.txt}, constraints.txt, Debian's mirror and pip's
#     configured index. SOURCE_DATE_EPOCH defaults to REV's commit time.
#   - Result: DIR/IMAGE.oci.tar (default DIR: ${BEAMSERVE_CACHE:-~/.cache/beamserve}/images) and
#     DIR/IMAGE.digest (the manifest digest), DIR/IMAGE.rev (the commit built); the last line
#     printed is `REF@DIGEST`.
#   - Cached: when the inputs' key (HEAD's tree, the image folder, constraints.txt, the epoch,
#     this script and oci.py) matches DIR/IMAGE.key, nothing is built. --no-cache rebuilds.
#   - The same inputs give the same digest (tests/cluster/test_images.py builds twice).
#   - --import SOCKET: `ctr --address SOCKET -n k8s.io image import` the archive afterwards.
#   - --context DIR: also write a build context for images/IMAGE/Containerfile (podman/buildah).
#   - Needs root (mmdebstrap --mode=root, chroot). Long steps run under nice -n 19.
set -euo pipefail

say() { printf '[build-image %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() {
    printf '[build-image] ERROR: %s\n' "$*" >&2
    exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

REPO="$(cd "$(dirname "$0")/.." && pwd)"
IMAGE="${1:-}"
shift || true
[[ -d "$REPO/images/$IMAGE" && -n "$IMAGE" ]] ||
    die "usage: $0 IMAGE [--out DIR] [--import SOCKET] [--context DIR] [--no-cache]; IMAGE is one of: $(cd "$REPO/images" && ls -d */ | tr -d / | tr '\n' ' ')"
CACHE_ROOT="${BEAMSERVE_CACHE:-$HOME/.cache/beamserve}"
OUT="$CACHE_ROOT/images"
IMPORT_SOCK=""
CONTEXT=""
NO_CACHE=0
REV=HEAD
while (($#)); do
    case "$1" in
    --out) OUT="$2"; shift 2 ;;
    --rev) REV="$2"; shift 2 ;;
    --import) IMPORT_SOCK="$2"; shift 2 ;;
    --context) CONTEXT="$2"; shift 2 ;;
    --no-cache) NO_CACHE=1; shift ;;
    *) die "unknown argument $1" ;;
    esac
done
((EUID == 0)) || die "run as root: mmdebstrap --mode=root and chroot need it"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"

VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' "$REPO/pyproject.toml" | head -1)
REGISTRY="${BEAMSERVE_REGISTRY:-ghcr.io/beamserve}"
REF="$REGISTRY/$IMAGE:$VERSION"
[[ "$IMAGE" == pause ]] && REF="$REGISTRY/pause:3.2-beamserve"
COMMIT=$(git -C "$REPO" rev-parse --verify "$REV^{commit}") || die "$REV is not a commit"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git -C "$REPO" log -1 --format=%ct "$COMMIT")}"
TREE=$(git -C "$REPO" rev-parse "$COMMIT^{tree}")
DIR="$REPO/images/$IMAGE"
KEY=$({
    echo "$TREE $SOURCE_DATE_EPOCH $REF"
    cat "$DIR"/* "$REPO/constraints.txt" "$0" "$REPO/images/oci.py"
} | sha256sum | cut -c1-64)
ARCHIVE="$OUT/$IMAGE.oci.tar"

import_image() {
    [[ -n "$IMPORT_SOCK" ]] || return 0
    say "importing $REF into containerd at $IMPORT_SOCK (namespace k8s.io)"
    ctr --address "$IMPORT_SOCK" -n k8s.io image import "$ARCHIVE" >&2
}

if ((NO_CACHE == 0)) && [[ -f "$ARCHIVE" && -f "$OUT/$IMAGE.key" && "$(cat "$OUT/$IMAGE.key")" == "$KEY" && -z "$CONTEXT" ]]; then
    say "cached: $ARCHIVE (inputs unchanged)"
    import_image
    echo "$REF@$(cat "$OUT/$IMAGE.digest")"
    exit 0
fi

START=$SECONDS
WORK=$(mktemp -d "$OUT/.build-$IMAGE.XXXXXX")
ROOT="$WORK/rootfs"
cleanup() {
    for m in proc tmp/wheels; do mountpoint -q "$ROOT/$m" 2>/dev/null && umount -l "$ROOT/$m"; done
    rm -rf "$WORK"
}
trap cleanup EXIT

pack() { # pack USER [oci.py args...]
    python3 "$REPO/images/oci.py" "$ROOT" "$ARCHIVE" --ref "$REF" --user "$@" \
        --label "org.opencontainers.image.source=https://github.com/beamserve/beamserve" \
        --label "org.opencontainers.image.version=$VERSION" \
        --label "org.opencontainers.image.revision=$COMMIT" \
        >"$OUT/$IMAGE.digest.tmp"
    mv "$OUT/$IMAGE.digest.tmp" "$OUT/$IMAGE.digest"
}

if [[ "$IMAGE" == pause ]]; then
    command -v go >/dev/null || die "go missing: apt-get install golang-go"
    mkdir -p "$ROOT"
    say "building the static pause binary (images/pause/pause.go)"
    (cd "$DIR" && CGO_ENABLED=0 GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath" GO111MODULE=off \
        go build -trimpath -ldflags="-s -w -buildid=" -o "$ROOT/pause" pause.go)
    rm -rf "$WORK/gocache" "$WORK/gopath"
    pack 65535:65535 --entrypoint /pause
    echo "$KEY" >"$OUT/$IMAGE.key"
echo "$COMMIT" >"$OUT/$IMAGE.rev"
    say "built $REF in $((SECONDS - START)) s: $(cat "$OUT/$IMAGE.digest")"
    import_image
    echo "$REF@$(cat "$OUT/$IMAGE.digest")"
    exit 0
fi

command -v mmdebstrap >/dev/null || die "mmdebstrap missing: make debs-cluster (apt-get install mmdebstrap)"
PIP="$REPO/.venv/bin/pip"
[[ -x "$PIP" ]] || die "$PIP missing: make install"

# 1. The project's wheel, from the committed tree.
say "wheel of ${COMMIT:0:12} (git archive)"
mkdir -p "$WORK/src" "$WORK/wheels"
git -C "$REPO" archive "$COMMIT" | tar -x -C "$WORK/src"
(cd "$WORK" && nice -n 19 "$PIP" wheel -q --no-deps --no-build-isolation -w "$WORK/wheels" "$WORK/src") >&2

# 2. Its dependencies as wheels, pinned by constraints.txt (pip's cache keeps them between builds).
# A wheelhouse kept in the cache: a second build resolves every pin from it.
EXTRAS=$(tr -d ' \n' <"$DIR/extras.txt")
WHEEL=$(ls "$WORK"/wheels/beamserve-*.whl)
WHEELS="$CACHE_ROOT/images/wheels"
mkdir -p "$WHEELS"
say "dependencies${EXTRAS:+ [$EXTRAS]} as wheels (pip, constraints.txt) in $WHEELS"
EXTRA_REQS=$(grep -v '^\s*#' "$DIR/requirements.txt" | grep -v '^\s*$' | tr '\n' ' ' || true)
# shellcheck disable=SC2086 # one word per requirement
nice -n 19 "$PIP" wheel -q -w "$WHEELS" --find-links "$WHEELS" -c "$REPO/constraints.txt" \
    "$WHEEL${EXTRAS:+[$EXTRAS]}" $EXTRA_REQS >&2
rm -f "$WHEELS"/beamserve-*.whl

# 3. The Debian rootfs (downloaded .debs kept in the cache between builds).
APT_CACHE="$CACHE_ROOT/images/apt-archives"
mkdir -p "$APT_CACHE"
PKGS=$(grep -v '^\s*#' "$DIR/packages.txt" | grep -v '^\s*$' | paste -sd, -)
say "Debian bookworm rootfs (mmdebstrap --variant=essential, +$PKGS)"
nice -n 19 mmdebstrap --mode=root --variant=essential --include="$PKGS" \
    --aptopt='Acquire::Retries "3"' \
    --setup-hook="mkdir -p \"\$1\"/var/cache/apt/archives && cp -a $APT_CACHE/. \"\$1\"/var/cache/apt/archives/" \
    --customize-hook="cp -a \"\$1\"/var/cache/apt/archives/*.deb $APT_CACHE/ 2>/dev/null || true" \
    --customize-hook='rm -rf "$1"/var/cache/apt/archives "$1"/var/lib/apt/lists' \
    bookworm "$ROOT" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main" >&2

# 4. The venv, in the image's own Python.
say "venv /opt/beamserve with beamserve${EXTRAS:+[$EXTRAS]}"
mkdir -p "$ROOT/tmp/build" "$ROOT/tmp/wheels"
cp "$WORK"/wheels/*.whl "$REPO/constraints.txt" "$ROOT/tmp/build/"
mount --bind "$WHEELS" "$ROOT/tmp/wheels"
mount -o remount,bind,ro "$ROOT/tmp/wheels"
mount -t proc proc "$ROOT/proc"
in_root() { chroot "$ROOT" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" PYTHONHASHSEED=0 "$@"; }
in_root python3 -m venv /opt/beamserve
nice -n 19 chroot "$ROOT" env -i PATH=/usr/bin:/bin HOME=/root SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" \
    PYTHONHASHSEED=0 /opt/beamserve/bin/pip install -q --no-cache-dir --no-index \
    --disable-pip-version-check --find-links /tmp/build --find-links /tmp/wheels -c /tmp/build/constraints.txt \
    "beamserve${EXTRAS:+[$EXTRAS]}" $EXTRA_REQS >&2
in_root /opt/beamserve/bin/beamserve --help >/dev/null || die "beamserve does not start in the image"
umount "$ROOT/proc" "$ROOT/tmp/wheels"

# 5. The user, and what would differ between two builds of the same inputs.
echo 'beamserve:x:65532:65532:beamserve:/home/beamserve:/usr/sbin/nologin' >>"$ROOT/etc/passwd"
echo 'beamserve:x:65532:' >>"$ROOT/etc/group"
echo 'beamserve:!:::::::' >>"$ROOT/etc/shadow"
install -d -o 65532 -g 65532 -m 0755 "$ROOT/home/beamserve"
rm -rf "$ROOT"/tmp/* "$ROOT"/var/log/* "$ROOT"/var/cache/ldconfig/aux-cache \
    "$ROOT"/var/lib/dpkg/*-old "$ROOT"/var/cache/debconf/*-old "$ROOT"/root/.cache
: >"$ROOT/etc/machine-id"
# pip records the installing tool; its RECORD files hash the content, so they are stable.
find "$ROOT/opt/beamserve" -name direct_url.json -delete

# 6. Pack.
say "packing $REF (images/oci.py, SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)"
pack 65532:65532 --entrypoint beamserve --workdir /home/beamserve \
    --env PATH=/opt/beamserve/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env HOME=/home/beamserve --env PYTHONUNBUFFERED=1
echo "$KEY" >"$OUT/$IMAGE.key"
echo "$COMMIT" >"$OUT/$IMAGE.rev"
if [[ -n "$CONTEXT" ]]; then
    mkdir -p "$CONTEXT/wheels"
    cp "$DIR"/* "$REPO/constraints.txt" "$CONTEXT/"
    cp "$WORK"/wheels/*.whl "$CONTEXT/wheels/"
    # only the wheels this image installs (the venv's metadata names them)
    for d in "$ROOT"/opt/beamserve/lib/python3*/site-packages/*.dist-info; do
        n=$(basename "$d" .dist-info); n=${n%-*}
        cp "$WHEELS/${n}"-*.whl "$CONTEXT/wheels/" 2>/dev/null || true
    done
    say "build context for images/$IMAGE/Containerfile: $CONTEXT"
fi
say "built $REF in $((SECONDS - START)) s: $(cat "$OUT/$IMAGE.digest"), $(du -h "$ARCHIVE" | cut -f1)"
import_image
echo "$REF@$(cat "$OUT/$IMAGE.digest")"
