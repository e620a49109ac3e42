#!/usr/bin/env bash
# Build kubelet, kube-scheduler and kube-proxy (Kubernetes 1.20.2) from the same Debian `kubernetes` source
# package as scripts/k8s-testenv.sh (which it runs first, for the API server, the controller
# manager and the downloaded source), for the real-cluster tier (`make test-cluster`).
#
# Contract:
#   - Result: ${BEAMSERVE_CACHE:-$HOME/.cache/beamserve}/k8s-1.20.2/bin/{kubelet,kube-scheduler,kube-proxy}.
#   - Idempotent: nothing is built when both are cached and answer --version.
#   - The build runs under `nice -n 19` with GOFLAGS=-p=1 (the machine's cores are shared); the
#     source tree and Go's build cache are deleted afterwards (KEEP_BUILD=1 keeps them).
#   - Exits non-zero with a message saying what failed.
set -euo pipefail

K8S_VERSION=1.20.2
CACHE_ROOT="${BEAMSERVE_CACHE:-$HOME/.cache/beamserve}"
PREFIX="$CACHE_ROOT/k8s-$K8S_VERSION"
BIN="$PREFIX/bin"
WORK="$PREFIX/build-node"
BINARIES=(kubelet kube-scheduler kube-proxy)
REFLECT2_DEBIAN=/usr/share/gocode/src/github.com/modern-go/reflect2
HERE="$(cd "$(dirname "$0")" && pwd)"

say() { printf '[k8s-cluster-build %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() {
    printf '[k8s-cluster-build] ERROR: %s\n' "$*" >&2
    exit 1
}
trap 'die "command failed (line $LINENO): $BASH_COMMAND"' ERR

binaries_ok() {
    local b
    for b in "${BINARIES[@]}"; do
        [[ -x "$BIN/$b" ]] || return 1
        "$BIN/$b" --version >/dev/null 2>&1 || return 1
    done
}

# The API server, the controller manager, the build packages and the downloaded source.
"$HERE/k8s-testenv.sh"

if binaries_ok; then
    say "cached: ${BINARIES[*]} in $BIN — nothing to do"
    exit 0
fi
exec 9>"$PREFIX/.lock-node"
flock -n 9 || {
    say "another build holds $PREFIX/.lock-node; waiting for it"
    flock 9
}
binaries_ok && exit 0

START=$SECONDS
ORIG=$(find "$PREFIX/source" -maxdepth 1 -name 'kubernetes_*.orig.tar.*' -print -quit 2>/dev/null || true)
if [[ -z "$ORIG" ]]; then
    # k8s-testenv.sh downloads the source only when it builds; a cache from elsewhere may lack it.
    APT_DIR="$PREFIX/apt"
    mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$PREFIX/source"
    echo "deb-src http://deb.debian.org/debian bookworm main" >"$APT_DIR/sources.list"
    APT_OPTS=(-o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
        -o "Dir::State::Lists=$APT_DIR/lists" -o "Dir::Cache=$APT_DIR/cache" -o "APT::Sandbox::User=root")
    apt-get "${APT_OPTS[@]}" update -qq || die "apt-get update (deb-src bookworm) failed"
    (cd "$PREFIX/source" && apt-get "${APT_OPTS[@]}" source --download-only kubernetes) ||
        die "apt-get source --download-only kubernetes failed"
    ORIG=$(find "$PREFIX/source" -maxdepth 1 -name 'kubernetes_*.orig.tar.*' -print -quit)
fi
[[ -n "$ORIG" ]] || die "no kubernetes_*.orig.tar.* under $PREFIX/source"

SRC="$WORK/src"
rm -rf "$WORK"
mkdir -p "$SRC"
say "unpacking $(basename "$ORIG")"
tar -xf "$ORIG" -C "$SRC" --strip-components=1
# The vendored reflect2 v1.0.1 crashes on first use with Go >= 1.18 (k8s-testenv.md).
rm -rf "$SRC/vendor/github.com/modern-go/reflect2"
cp -r "$REFLECT2_DEBIAN" "$SRC/vendor/github.com/modern-go/reflect2"
rm -f "$SRC/vendor/github.com/modern-go/reflect2/go.mod"
sed -i 's|reflect2 v1\.0\.1$|reflect2 v1.0.2|' "$SRC/vendor/modules.txt"

say "building ${BINARIES[*]} with $(go version | cut -d' ' -f3) under nice -n 19, GOFLAGS=-p=1"
export GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath"
(
    cd "$SRC" &&
        nice -n 19 env CGO_ENABLED=0 GOPROXY=off GOFLAGS=-p=1 KUBE_GIT_VERSION="v$K8S_VERSION" \
            KUBE_GIT_TREE_STATE=clean make WHAT="cmd/kubelet cmd/kube-scheduler cmd/kube-proxy"
) || die "make failed; see the output above (tree kept in $SRC)"

mkdir -p "$BIN"
for b in "${BINARIES[@]}"; do
    [[ -x "$SRC/_output/bin/$b" ]] || die "the build produced no _output/bin/$b"
    install -m 0755 "$SRC/_output/bin/$b" "$BIN/.$b.tmp"
    mv -f "$BIN/.$b.tmp" "$BIN/$b"
done
binaries_ok || die "the built binaries do not run (--version failed)"
if [[ "${KEEP_BUILD:-0}" != 1 ]]; then
    chmod -R u+w "$WORK" 2>/dev/null || true
    rm -rf "$WORK"
fi
say "built in $((SECONDS - START)) s → $BIN"
