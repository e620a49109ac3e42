#!/usr/bin/env bash
# Build .devsite-kv/site.tar.xz here: the Python packages the device machine lacks, for cp312.
# fastapi (+opentelemetry-api), uvicorn, pydantic(+core), starlette, structlog and a trimmed nixl-cu12 1.5.1: only the UCX plugin
# and the libraries it and libnixl need (the full wheel is 69 MB; a call carries 64 MiB at most).
set -euo pipefail
cd "$(dirname "$0")/.."
W=$(mktemp -d)
PIP=".venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
$PIP -d "$W" fastapi==0.165.0 pydantic==2.14.4 pydantic_core==2.50.5 starlette==1.10.0 \
  uvicorn==0.54.0 annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 \
  structlog==26.1.0 nixl-cu12==1.5.1
S="$W/site-kv"; mkdir -p "$S"
for w in "$W"/*.whl; do case "$w" in *nixl*) ;; *) unzip -q -o "$w" -d "$S" ;; esac; done
X="$W/nixl"; mkdir -p "$X"; unzip -q "$W"/nixl_cu12-*.whl -d "$X"
.venv/bin/python - "$X" "$S" <<'PY'
import os, re, shutil, subprocess, sys
x, s = sys.argv[1:]
libs = os.path.join(x, "nixl_cu12.libs"); meson = os.path.join(x, ".nixl_cu12.mesonpy.libs")
def needed(p):
    out = subprocess.run(["readelf", "-d", p], capture_output=True, text=True).stdout
    return re.findall(r"Shared library: \[(.*?)\]", out)
ucx = [f for f in os.listdir(os.path.join(libs, "ucx"))
       if f.endswith(".so.0.0.0") and ("cma" in f or "cuda" in f) and "perftest" not in f]
todo = [os.path.join(x, "nixl_cu12", f) for f in os.listdir(os.path.join(x, "nixl_cu12")) if f.endswith(".so")]
todo += [os.path.join(meson, f) for f in os.listdir(meson) if ".so" in f]
todo += [os.path.join(libs, "nixl", "libplugin_UCX.so"), os.path.join(meson, "plugins", "libplugin_UCX.so")]
todo += [os.path.join(libs, "ucx", f) for f in ucx]
avail, keep = set(os.listdir(libs)), set()
while todo:
    for n in needed(todo.pop()):
        if n in avail and n not in keep:
            keep.add(n); todo.append(os.path.join(libs, n))
shutil.copytree(os.path.join(x, "nixl_cu12"), os.path.join(s, "nixl_cu12"))
shutil.copytree(os.path.join(x, "nixl_cu12-1.5.1.dist-info"), os.path.join(s, "nixl_cu12-1.5.1.dist-info"))
for d in ("nixl_cu12.libs/nixl", "nixl_cu12.libs/ucx", ".nixl_cu12.mesonpy.libs/plugins"):
    os.makedirs(os.path.join(s, d))
for f in os.listdir(meson):
    if os.path.isfile(os.path.join(meson, f)):
        shutil.copy2(os.path.join(meson, f), os.path.join(s, ".nixl_cu12.mesonpy.libs"))
shutil.copy2(os.path.join(meson, "plugins", "libplugin_UCX.so"), os.path.join(s, ".nixl_cu12.mesonpy.libs/plugins"))
shutil.copy2(os.path.join(libs, "nixl", "libplugin_UCX.so"), os.path.join(s, "nixl_cu12.libs/nixl"))
for k in keep:
    shutil.copy2(os.path.join(libs, k), os.path.join(s, "nixl_cu12.libs"))
for f in ucx:
    shutil.copy2(os.path.join(libs, "ucx", f), os.path.join(s, "nixl_cu12.libs/ucx"))
PY
mkdir -p .devsite-kv
tar -cf - -C "$W" site-kv | xz -T2 -3 > .devsite-kv/site.tar.xz
grep -qx '/.devsite-kv/' .git/info/exclude || echo '/.devsite-kv/' >> .git/info/exclude
ls -la .devsite-kv; rm -rf "$W"
