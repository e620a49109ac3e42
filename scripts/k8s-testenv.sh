#!/usr/bin/env bash
# Build a real Kubernetes 1.20.2 from Debian's `kubernetes` source package: kube-apiserver and
# kube-controller-manager for the tests marked `k8s` (`make test-k8s`), and kubelet,
# kube-scheduler and kube-proxy for the real-cluster tier (`make test-cluster`), in one Go build
# (the five share most of their packages: one build of all five costs ≈ 2 min more than two).
#
# Contract:
#   - Result: ${BEAMSERVE_CACHE:-$HOME/.cache/beamserve}/k8s-1.20.2/bin/{kube-apiserver,
#     kube-controller-manager,kubelet,kube-scheduler,kube-proxy}; tests/k8s_cluster.py and
#     tests/cluster/node.py look for them there.
#   - Idempotent: when all five binaries are cached (and answer --version) nothing is built; only the
#     runtime packages (etcd-server, openssl) are checked with dpkg, and installed if missing.
#   - /etc/apt is never touched: the deb-src line lives in a private apt configuration under the
#     cache folder.
#   - The build runs under `nice -n 19` (≈ 9 minutes on 2 cores otherwise idle); the source tree and the Go build
#     cache are deleted afterwards (set KEEP_BUILD=1 to keep them), the downloads are kept.
#   - Exits non-zero with a message saying what failed and what to do.
set -euo pipefail

K8S_VERSION=1.20.2
CACHE_ROOT="${BEAMSERVE_CACHE:-$HOME/.cache/beamserve}"
PREFIX="$CACHE_ROOT/k8s-$K8S_VERSION"
BIN="$PREFIX/bin"
WORK="$PREFIX/build"
BINARIES=(kube-apiserver kube-controller-manager kubelet kube-scheduler kube-proxy)
RUNTIME_DEBS=(etcd-server openssl)
BUILD_DEBS=(golang-go rsync jq make golang-github-modern-go-reflect2-dev)
REFLECT2_DEBIAN=/usr/share/gocode/src/github.com/modern-go/reflect2

say() { printf '[k8s-testenv %(%H:%M:%S)T] %s\n' -1 "$*"; }
die() {
    printf '[k8s-testenv] ERROR: %s\n' "$*" >&2
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

# Installs the Debian packages given that are not installed yet.
ensure_debs() {
    local missing=() p
    for p in "$@"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    ((${#missing[@]} == 0)) && return 0
    local sudo=()
    if ((EUID != 0)); then
        command -v sudo >/dev/null || die "need root to install Debian packages: ${missing[*]}
  run as root, or install them first: apt-get install -y ${missing[*]}"
        sudo=(sudo)
    fi
    say "installing Debian packages: ${missing[*]}"
    "${sudo[@]}" apt-get update -qq ||
        die "apt-get update failed; check the network and /etc/apt/sources.list"
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" ||
        die "apt-get install ${missing[*]} failed"
}

ensure_debs "${RUNTIME_DEBS[@]}"

if binaries_ok; then
    say "cached: ${BINARIES[*]} in $BIN — nothing to do"
    exit 0
fi

mkdir -p "$PREFIX"
exec 9>"$PREFIX/.lock"
flock -n 9 || {
    say "another k8s-testenv build holds $PREFIX/.lock; waiting for it"
    flock 9
}
if binaries_ok; then
    say "cached by a concurrent run: $BIN — nothing to do"
    exit 0
fi

START=$SECONDS
ensure_debs "${BUILD_DEBS[@]}"
[[ -d "$REFLECT2_DEBIAN" ]] ||
    die "$REFLECT2_DEBIAN missing; reinstall golang-github-modern-go-reflect2-dev"

# 1. The source package, through a private apt configuration (/etc/apt stays untouched).
APT_DIR="$PREFIX/apt"
SRC_DL="$PREFIX/source"
mkdir -p "$APT_DIR/lists/partial" "$APT_DIR/cache/archives/partial" "$SRC_DL"
echo "deb-src http://deb.debian.org/debian bookworm main" >"$APT_DIR/sources.list"
APT_OPTS=(
    -o "Dir::Etc::SourceList=$APT_DIR/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$APT_DIR/lists"
    -o "Dir::Cache=$APT_DIR/cache"
    # the downloads land in our own folders, so apt need not drop to its `_apt` user
    -o "APT::Sandbox::User=root"
)
ORIG=$(find "$SRC_DL" -maxdepth 1 -name 'kubernetes_*.orig.tar.*' -print -quit)
if [[ -z "$ORIG" ]]; then
    say "fetching the Debian source package index (private apt configuration in $APT_DIR)"
    apt-get "${APT_OPTS[@]}" update -qq ||
        die "apt-get update (deb-src bookworm) failed; check access to deb.debian.org"
    say "downloading the kubernetes source package (≈ 30 MB)"
    (cd "$SRC_DL" && apt-get "${APT_OPTS[@]}" source --download-only kubernetes) ||
        die "apt-get source --download-only kubernetes failed"
    ORIG=$(find "$SRC_DL" -maxdepth 1 -name 'kubernetes_*.orig.tar.*' -print -quit)
    [[ -n "$ORIG" ]] || die "no kubernetes_*.orig.tar.* in $SRC_DL after apt-get source"
else
    say "source already downloaded: $ORIG"
fi

# 2. Unpack afresh (a half-built tree from an interrupted run is not trusted).
SRC="$WORK/src"
rm -rf "$WORK"
mkdir -p "$SRC"
say "unpacking $(basename "$ORIG")"
tar -xf "$ORIG" -C "$SRC" --strip-components=1
[[ -f "$SRC/Makefile" && -d "$SRC/vendor" ]] ||
    die "$ORIG did not unpack to a vendored Kubernetes tree (no Makefile or vendor/)"

# 3. The vendored reflect2 v1.0.1 crashes on first use with Go >= 1.18: use Debian's v1.0.2.
say "replacing vendor/github.com/modern-go/reflect2 with Debian's copy (v1.0.2)"
rm -rf "$SRC/vendor/github.com/modern-go/reflect2"
cp -r "$REFLECT2_DEBIAN" "$SRC/vendor/github.com/modern-go/reflect2"
rm -f "$SRC/vendor/github.com/modern-go/reflect2/go.mod"
grep -q 'reflect2 v1.0.1' "$SRC/vendor/modules.txt" ||
    die "vendor/modules.txt has no 'reflect2 v1.0.1' line; the source package changed"
sed -i 's|reflect2 v1\.0\.1$|reflect2 v1.0.2|' "$SRC/vendor/modules.txt"

# 4. Build the way Debian's rules do.
say "building ${BINARIES[*]} with $(go version | cut -d' ' -f3) under nice -n 19 (≈ 9 minutes)"
export GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath"
(
    cd "$SRC" &&
        nice -n 19 env CGO_ENABLED=0 GOPROXY=off KUBE_GIT_VERSION="v$K8S_VERSION" \
            KUBE_GIT_TREE_STATE=clean \
            make WHAT="${BINARIES[*]/#/cmd/}"
) || die "make failed; see the output above (tree kept in $SRC)"

# 5. Cache the binaries (atomically: a reader never sees half a file).
mkdir -p "$BIN"
for b in "${BINARIES[@]}"; do
    [[ -x "$SRC/_output/bin/$b" ]] || die "the build produced no _output/bin/$b"
    install -m 0755 "$SRC/_output/bin/$b" "$BIN/.$b.tmp"
    mv -f "$BIN/.$b.tmp" "$BIN/$b"
done
binaries_ok || die "the built binaries do not run (--version failed)"
if [[ "${KEEP_BUILD:-0}" != 1 ]]; then
    chmod -R u+w "$WORK" 2>/dev/null || true # Go's module cache is read-only
    rm -rf "$WORK"
fi
say "built in $((SECONDS - START)) s: $("$BIN/kube-apiserver" --version) → $BIN"
