#!/usr/bin/env bash
# KV transfer on the GPU device machine: GPU tests, then the VRAM benchmark matrix.
#
#   scripts/device-kv-bench.sh smoke|full|plan|kernel|local|local2|gate|tests   (run by the `run` tool, repo root)
#
# `local` (≈ 8 min): the host-local driver (one launch for every rank). First 8:4 at 80K bf16
# by every path, twice (driver auto: direct and auto take host_local, driven from decode rank
# 0's process), then direct and auto twice with the driver in the calling process
# (BEAMSERVE_KV_LOCAL_IN=caller); with KV_RANKS=1 also BEAMSERVE_KV_DRIVER=ranks (the driver
# before it, same machine); then the host-local GPU and CPU tests (KV_GPU_K: more of
# test_gpu.py), then 4:8 8:8 1:1 and fp8 8:4 by auto (driver in KV_PAIRS_IN); KV_QUICK=1 stops
# after the two 8:4 runs (≈ 2.5 min). A CPU dry run:
#   PY=.venv/bin/python KV_SITE=0 KV_MEMORY=dram KV_BACKEND=nixl KV_TOKENS=2048 \
#     OUT=/tmp/kv-dry bash scripts/device-kv-bench.sh local
#
# `local2` (≈ 8 min): the host-local kernels alone first (`python -m
# beamserve.kv_transfer.kernel_bench` with KV_KB_ARGS, e.g. "--quick --no-ipc": flat and loop
# launch shapes and piece orders against one torch copy, the launch path's CPU costs,
# in-process driver pulls, fp8 and 1:1, IPC-mapped regions; with KV_TUNED=1 its fastest shape
# goes to $OUT/kernel-best.env), then 8:4 at 80K bf16 `--path direct auto` twice with the defaults
# (driver auto: in the caller where it can run CUDA), the same with the fastest shape of this
# run (KV_TUNED=1, the default), with the driver in decode rank 0 (KV_RANK0=1, the default),
# then the host-local GPU and CPU tests; KV_PAIRS=1 adds 4:8 8:8 1:1 and fp8 8:4 by auto. On
# the CPU (KV_MEMORY=dram) the kernel bench is skipped. KV_REPEATS=N: every bench row the median
# of N pulls (`--repeats`). A CPU dry run:
#   PY=.venv/bin/python KV_SITE=0 KV_MEMORY=dram KV_BACKEND=cma KV_TOKENS=2048 \
#     OUT=/tmp/kv-dry bash scripts/device-kv-bench.sh local2
#
# `kernel` (≈ 3 min): 8:4 at 80K bf16 by every path with the one-launch Triton copy, then the
# same direct pull with BEAMSERVE_KV_COPY=torch (the copy engine before it, same machine), then
# the device-copy GPU tests.
#
# `plan` (≈ 6 min): bench kv-plan on the device's CPU, then the bf16 80K matrix (8:4 and 4:8
# first, then 8:8 and 1:1; three paths), then the GPU tests. A CPU dry run here:
#   PY=.venv/bin/python KV_SITE=0 KV_MEMORY=dram KV_BACKEND=nixl KV_TOKENS=2048 \
#     OUT=/tmp/kv-dry bash scripts/device-kv-bench.sh plan
#
# Nothing is installed there and nothing can be fetched: the image has torch (CUDA), numpy,
# pytest, hypothesis, rich and httpx; .devsite-kv/site.tar.xz (made here by
# scripts/device-kv-site.sh, carried with the call) adds fastapi, uvicorn, pydantic and a trimmed
# nixl-cu12 1.5.1 for cp312. beamserve runs from this tree through a symlinked package root
# (never `python -m` from the repo root: ./operator shadows the stdlib). JSON and logs go to $OUT.
set -uo pipefail
MODE=${1:-smoke}
REPO=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PY:-python3}
case "$PY" in /*) ;; */*) PY=$PWD/$PY ;; esac
MEM=${KV_MEMORY:-vram}
TOK=${KV_TOKENS:-81920}
BACK=${KV_BACKEND:-cuda_ipc}
if [ "${KV_SITE:-1}" = 1 ] && [ -f .devsite-kv/site.tar.xz ]; then
  tar -xJf .devsite-kv/site.tar.xz -C /tmp || exit 3
fi
rm -rf /tmp/bs && mkdir -p /tmp/bs/beamserve
for f in "$REPO"/src/beamserve/*; do ln -s "$f" /tmp/bs/beamserve/; done
for d in kv_transfer kvwire workers router operator; do ln -s "$REPO/$d" /tmp/bs/beamserve/$d; done
ln -s "$REPO/tests" /tmp/bs/tests  # tests import tests.kv_transfer.* (the root itself would shadow)
if [ "${KV_SITE:-1}" = 1 ]; then export PYTHONPATH=/tmp/site-kv:/tmp/bs; else export PYTHONPATH=/tmp/bs; fi
cd /tmp || exit 3
{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv;
  $PY -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'numpy', numpy.__version__)";
  $PY -c "import nixl_cu12._api as a; print('nixl ok')" 2>&1 | tail -2;
  nproc; } 2>&1 | tee "$OUT/env.txt"
BS="$PY $REPO/scripts/device-beamserve.py"
bench() { # name, extra args...
  local name=$1; shift
  $BS bench kv-transfer --memory "$MEM" --json "$OUT/$name.json" --plot "${PLOTS:-$OUT}/$name.png" "$@" 2>&1 \
    | grep -v -E '^(\[|W1|I1|E1)|NIXL INFO|CudaIPCTypes' | tee "$OUT/$name.log" | tail -40
}
case "$MODE" in
  tests)
    $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s \
      "$REPO/tests/kv_transfer/test_gpu.py" "$REPO/tests/kv_transfer/test_staging.py" 2>&1 \
      | tee "$OUT/gpu-tests.log" | tail -40 ;;
  smoke)
    $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s -x \
      "$REPO/tests/kv_transfer/test_gpu.py" 2>&1 | tee "$OUT/gpu-tests.log" | tail -30
    bench smoke --backend cuda_ipc nixl --tokens 8192 --pairs 8:4 --path direct staged auto ;;
  plan)  # the planner on this CPU, the bf16 80K matrix (most wanted pairs first), GPU tests
    PLOTS=/tmp  # 8 files come back at most: JSON and logs (plot from the JSON afterwards)
    $BS bench kv-plan --pairs 8:4 4:8 8:8 1:1 --kv-dtype bf16 fp8_e4m3 --repeats 30 \
      --json "$OUT/kv-plan.json" 2>&1 | tee "$OUT/kv-plan.log" | grep -E '│|goal'
    bench kv-transfer-a --backend "$BACK" --tokens "$TOK" --pairs 8:4 4:8 --path direct staged auto
    bench kv-transfer-b --backend "$BACK" --tokens "$TOK" --pairs 8:8 1:1 --path direct staged auto
    $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s -rs \
      "$REPO/tests/kv_transfer/test_gpu.py" 2>&1 | tee "$OUT/gpu-tests.log" | grep -v CudaIPCTypes | tail -8 ;;
  kernel)  # the Triton copy kernel against the torch copies it replaces, then its GPU tests
    PLOTS=/tmp
    bench kv-transfer-kernel --backend "$BACK" --tokens "$TOK" --pairs 8:4 --path direct staged auto
    BEAMSERVE_KV_COPY=torch bench kv-transfer-kernel-torch --backend "$BACK" --tokens "$TOK" \
      --pairs 8:4 --path direct
    $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s -rs \
      "$REPO/tests/kv_transfer/test_gpu.py" -k "copy_runs or (cuda_ipc and 8) or kernel or piece" \
      "$REPO/tests/kv_transfer/test_kernels.py" 2>&1 | tee "$OUT/gpu-tests.log" \
      | grep -v CudaIPCTypes | tail -8 ;;
  local)  # 7 files come back: env, one bench log, four JSONs, the test log
    PLOTS=/tmp; export COLUMNS=230
    lbench() { local name=$1; shift; echo "== $name $*" >> "$OUT/local-bench.log"
      $BS bench kv-transfer --memory "$MEM" --json "$OUT/$name.json" --plot "/tmp/$name.png" "$@" 2>&1 \
        | grep -v -E '^(\[|W1|I1|E1)|NIXL INFO|CudaIPCTypes' | tee -a "$OUT/local-bench.log" | grep -E 'goal|│' | tail -24; }
    lbench kv-transfer-local --backend "$BACK" --tokens "$TOK" "$TOK" --pairs 8:4 --path direct staged auto
    BEAMSERVE_KV_LOCAL_IN=caller lbench kv-transfer-local-caller --backend "$BACK" \
      --tokens "$TOK" "$TOK" --pairs 8:4 --path direct auto
    if [ "${KV_QUICK:-0}" = 1 ]; then ls -la "$OUT"; exit 0; fi  # the two 8:4 runs alone
    if [ "${KV_RANKS:-0}" = 1 ]; then BEAMSERVE_KV_DRIVER=ranks lbench kv-transfer-local-ranks \
      --backend "$BACK" --tokens "$TOK" --pairs 8:4 --path direct auto; fi
    $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s -rs \
      "$REPO/tests/kv_transfer/test_gpu.py" -k "host_local or compact or ${KV_GPU_K:-cuda_ipc_pulls}" \
      "$REPO/tests/kv_transfer/test_compact.py" "$REPO/tests/kv_transfer/test_host_local.py" 2>&1 \
      | tee "$OUT/gpu-tests.log" | grep -v CudaIPCTypes | grep -E 'host-local kernel|runs .* warps|passed|failed|error|Error|SKIP' | tail -14
    export BEAMSERVE_KV_LOCAL_IN=${KV_PAIRS_IN:-rank0}
    lbench kv-transfer-local-pairs --backend "$BACK" --tokens "$TOK" --pairs 4:8 8:8 1:1 --path auto
    lbench kv-transfer-local-fp8 --backend "$BACK" --tokens "$TOK" --pairs 8:4 --kv-dtype fp8_e4m3 \
      --path auto ;;
  local2)  # 8 files come back: env, kernel bench JSON + log, bench log, 3 JSONs, test log
    PLOTS=/tmp; export COLUMNS=230
    lbench() { local name=$1; shift; echo "== $name $* ($(env | grep -E '^BEAMSERVE_KV_' | tr '\n' ' '))" >> "$OUT/local-bench.log"
      $BS bench kv-transfer --memory "$MEM" --json "$OUT/$name.json" --plot "/tmp/$name.png" "$@" \
        ${KV_REPEATS:+--repeats $KV_REPEATS} 2>&1 \
        | grep -v -E '^(\[|W1|I1|E1)|NIXL INFO|CudaIPCTypes' | tee -a "$OUT/local-bench.log" | grep -E 'goal|│' | tail -24; }
    if [ "$MEM" = vram ] && [ "${KV_KB:-1}" = 1 ]; then  # (KV_KB=0: no kernel bench) its table goes to the bench log too
      KB_ENV=; [ "${KV_TUNED:-1}" = 1 ] && KB_ENV="--env $OUT/kernel-best.env"
      echo "== kernel_bench ${KV_KB_ARGS:-}" >> "$OUT/local-bench.log"
      $PY -m beamserve.kv_transfer.kernel_bench --json "$OUT/kernel-bench.json" $KB_ENV ${KV_KB_ARGS:-} 2>&1 \
        | grep -v CudaIPCTypes | tee -a "$OUT/local-bench.log" | tail -36
    fi
    TOKS="$TOK $TOK"; [ -n "${KV_REPEATS:-}" ] && TOKS=$TOK  # repeating: one row of N pulls a path
    lbench kv-transfer-local2 --backend "$BACK" --tokens $TOKS --pairs 8:4 --path direct auto
    if [ "${KV_TUNED:-1}" = 1 ] && [ -f "$OUT/kernel-best.env" ]; then
      ( . "$OUT/kernel-best.env"; lbench kv-transfer-local2-tuned --backend "$BACK" --tokens "$TOK" "$TOK" \
          --pairs 8:4 --path auto )
    fi
    if [ "${KV_RANK0:-1}" = 1 ]; then BEAMSERVE_KV_LOCAL_IN=rank0 lbench kv-transfer-local2-rank0 \
      --backend "$BACK" --tokens "$TOK" "$TOK" --pairs 8:4 --path auto; fi
    if [ "${KV_PAIRS:-0}" = 1 ]; then
      lbench kv-transfer-local2-pairs --backend "$BACK" --tokens "$TOK" --pairs 4:8 8:8 1:1 --path auto
      lbench kv-transfer-local2-fp8 --backend "$BACK" --tokens "$TOK" --pairs 8:4 --kv-dtype fp8_e4m3 --path auto
    fi
    if [ "${KV_TESTS:-1}" = 1 ]; then
      $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s -rs \
        "$REPO/tests/kv_transfer/test_gpu.py" -k "host_local or compact or ${KV_GPU_K:-cuda_ipc_pulls}" \
        "$REPO/tests/kv_transfer/test_compact.py" "$REPO/tests/kv_transfer/test_host_local.py" \
        "$REPO/tests/kv_transfer/test_kernels.py" 2>&1 | tee "$OUT/gpu-tests.log" | grep -v CudaIPCTypes \
        | grep -E 'host-local kernel|runs .* warps|loop|passed|failed|error|Error|SKIP' | tail -16
    fi ;;
  gate)  # 7 files come back: env, bench log, four JSONs, test log
    # The gate (kv_transfer/gate.py): 8:4 at 80K bf16 `--path direct auto` from the caller with
    # it (the default) and `--path auto` without it (BEAMSERVE_KV_LOCAL_GATE=0), medians of
    # KV_REPEATS (5) pulls each (KV_ABA=1: with it once more after); then its GPU tests and the
    # host-local CPU tests (KV_TESTS=0: not); then 4:8 8:8 1:1 and fp8 8:4 by auto with it
    # (KV_PAIRS=0: not).
    PLOTS=/tmp; export COLUMNS=230 BEAMSERVE_KV_LOCAL_IN=caller
    gbench() { local name=$1; shift; echo "== $name $* ($(env | grep -E '^BEAMSERVE_KV_' | tr '\n' ' '))" >> "$OUT/local-bench.log"
      $BS bench kv-transfer --memory "$MEM" --json "$OUT/$name.json" --plot "/tmp/$name.png" "$@" \
        --repeats "${KV_REPEATS:-5}" 2>&1 \
        | grep -v -E '^(\[|W1|I1|E1)|NIXL INFO|CudaIPCTypes' | tee -a "$OUT/local-bench.log" | grep -E 'goal|│' | tail -24; }
    gbench kv-transfer-gate --backend "$BACK" --tokens "$TOK" --pairs 8:4 --path direct auto
    BEAMSERVE_KV_LOCAL_GATE=0 gbench kv-transfer-nogate --backend "$BACK" --tokens "$TOK" --pairs 8:4 --path auto
    if [ "${KV_ABA:-0}" = 1 ]; then  # with it again: A B A, so a drift of the machine shows
      gbench kv-transfer-gate-again --backend "$BACK" --tokens "$TOK" --pairs 8:4 --path auto
    fi
    [ "${KV_TESTS:-1}" = 1 ] && timeout 200 $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s -rs \
      "$REPO/tests/kv_transfer/test_gpu.py" -k "gate or host_local or compact" \
      "$REPO/tests/kv_transfer/test_gate.py" "$REPO/tests/kv_transfer/test_host_local.py" 2>&1 \
      | tee "$OUT/gpu-tests.log" | grep -v CudaIPCTypes | grep -E 'host-local kernel|passed|failed|error|Error|SKIP' | tail -16
    if [ "${KV_PAIRS:-1}" = 1 ]; then
      KV_REPEATS=${KV_PAIR_REPEATS:-3} gbench kv-transfer-gate-pairs --backend "$BACK" --tokens "$TOK" --pairs 4:8 8:8 1:1 --path auto
      KV_REPEATS=${KV_PAIR_REPEATS:-3} gbench kv-transfer-gate-fp8 --backend "$BACK" --tokens "$TOK" --pairs 8:4 --kv-dtype fp8_e4m3 --path auto
    fi ;;
  full)  # the GPU tests, then the matrix: 80K tokens, 4 pairs, bf16 and fp8, 3 paths
    $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -s -rs \
      "$REPO/tests/kv_transfer/test_gpu.py" 2>&1 | tee "$OUT/gpu-tests.log" | grep -v CudaIPCTypes | tail -15
    for dtype in bf16 fp8_e4m3; do
      bench "kv-transfer-h200-$dtype" --backend cuda_ipc ${NIXL:+nixl} --kv-dtype "$dtype" \
        --tokens 81920 --pairs 8:4 4:8 8:8 1:1 --path direct staged auto
    done ;;
esac
ls -la "$OUT"
