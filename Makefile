# One venv with everything the tests need. torch is installed first, and every later install
# names the same torch==$(TORCH_VERSION), so neither DeepSpeed (built against it) nor an extra
# swaps in another torch version. PyPI's torch is the CUDA build (with its nvidia-* wheels,
# most of the venv's size: docs/design/development.md). TORCH_INDEX_URL installs torch from
# another index instead; for a CPU-only box, into a new venv:
#   make venv TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# which gives 2.13.0+cpu; the later pins accept it (a local label is ignored by ==2.13.0).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: venv venv-base tools test test-quick lint crds demo clean kind-e2e e2e bench bench-gpu bench-metrics \
	cluster-bin node-images product-images cluster cluster-install cluster-images cluster-pull-secret cluster-down bench-operator bench-checkpoint bench-startup \
	bench-loading docs docs-serve

venv: $(VENV)/.installed

# The venv's first seconds: pip and PyYAML, all that cluster/controlplane.py needs to build the
# control plane and the images. .ci/run makes it first, then the rest of the venv (downloads)
# beside the Go build (CPU).
venv-base: $(VENV)/.base

$(VENV)/.base:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel pyyaml
	touch $@

$(VENV)/.installed: pyproject.toml | $(VENV)/.base
	$(PIP) install torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install --no-build-isolation "deepspeed>=0.17" torch==$(TORCH_VERSION)
	$(PIP) install -e ".[trainer,azure,dev]" torch==$(TORCH_VERSION)
	touch $@

# Debian's prometheus + promtool: the alert rule tests and the real-Prometheus dashboard
# test use them; tmux: `finetune status --watch` is driven in a terminal; containerd, runc,
# the CNI plugins, iptables, buildah and debootstrap: the real node of `make cluster` and its
# images (cluster/real_node.py, cluster/node_images.py). Each test that needs one is skipped, saying
# so, where it cannot be installed.
tools:
	@missing=""; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v tmux >/dev/null 2>&1 || missing="$$missing tmux"; \
	for tool in containerd runc iptables buildah debootstrap; do \
	  command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	[ -x /usr/lib/cni/bridge ] || missing="$$missing containernetworking-plugins"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's$$missing for the metrics, terminal and real-node tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "missing$$missing and apt-get unavailable: the tests that need them will be skipped"; \
	  fi; \
	fi

# Every level this machine can run, on 3 pytest-xdist workers (on 2 cores the third fills
# the waits of the other two: 19 min against 21 with 2, 11-27): the tests of the control
# plane on one of them (one control plane), the runs a module shares on one, the rest spread;
# longest first (tests/conftest.py). The 25 slowest are listed at the end.
PYTEST_WORKERS ?= 3
test: venv tools cluster-bin node-images lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
		--durations=25 $(PYTEST_ARGS)

# The inner loop: the unit tests only (no process of their own, no cluster; about a minute).
test-quick: venv
	$(BIN)/python -m pytest -m unit -n $(PYTEST_WORKERS) -q $(PYTEST_ARGS)

lint: venv
	$(BIN)/ruff check operator trainer tests cluster scripts benchmarks
	$(BIN)/lint-imports
	$(BIN)/python cluster/controlplane.py actionlint

# A real Kubernetes control plane (etcd, kube-apiserver with RBAC, controller-manager,
# scheduler, KWOK for the GPU pools, Kueue with its queues) and a real node (kubelet,
# containerd, CNI, CoreDNS, kube-proxy in a network namespace of its own: cluster/real_node.py),
# built from the Go modules in cluster/ into ~/.cache/finetune-operator (once per version; the
# cold build's time: docs/design/development.md). The tests start their own; `make cluster`
# starts one for you, with an admin kubeconfig in .cluster/admin.kubeconfig (`make cluster
# KUEUE=0`: without Kueue; NODE=0: KWOK's nodes only). Without Go, the tests that need it are
# skipped.
cluster-bin: venv-base
	@if command -v go >/dev/null 2>&1; then $(BIN)/python cluster/controlplane.py build; \
	else echo "Go not installed: the real control-plane tests will be skipped"; fi

# The real node's images (the pod sandbox, a Debian base, operator/Dockerfile and
# trainer/Dockerfile, built by buildah), cached by their inputs: ~6 minutes the first time.
# Skipped, saying why, where the machine cannot host the real node.
node-images: venv-base cluster-bin
	@if command -v go >/dev/null 2>&1; then $(BIN)/python cluster/controlplane.py build-images; \
	else echo "Go not installed: no real node, no images"; fi

# The same images but the pause image, which alone needs the Go build: the Debian base
# (debootstrap) and our two Dockerfiles (the trainer's pip layer), mostly downloads, which
# .ci/run builds beside the Go build. node-images then finds them cached.
product-images: venv-base tools
	@if command -v go >/dev/null 2>&1; then \
	  $(BIN)/python cluster/controlplane.py build-product-images; \
	else echo "Go not installed: no real node, no images"; fi

cluster: venv
	$(BIN)/python cluster/controlplane.py up $(if $(filter 0,$(KUEUE)),--no-kueue) \
		$(if $(filter 0,$(NODE)),--no-node)

# The CRD and the chart (all but the operator's Deployment), and .cluster/operator.kubeconfig
# with only the chart's ServiceAccount token: run `finetune operator` with it (printed).
cluster-install: venv
	$(BIN)/python cluster/controlplane.py install

# Our two images built from operator/Dockerfile and trainer/Dockerfile (buildah, from a Debian
# base) and pushed to the registry of `make cluster` (10.250.N.1:5000, TLS and basic auth),
# which the real node's kubelet pulls from with the pull Secret registry-pull (made in
# finetune-system, default and ml-team); writes .cluster/images.yaml, the chart's values that
# run them (`helm install -f`).
cluster-images: venv
	$(BIN)/python cluster/controlplane.py images

# The registry's pull Secret in another namespace: make cluster-pull-secret NAMESPACE=team-b
cluster-pull-secret: venv
	$(BIN)/python cluster/controlplane.py pull-secret --namespace $(NAMESPACE)

cluster-down: venv
	$(BIN)/python cluster/controlplane.py down

# 100 and 1,000 FineTuneJobs applied at once, each operator on a fresh control plane: ours
# (launches paced, and with --launch-rate 0) beside a do-nothing kopf operator (the floor)
# and one that only creates the children (the launcher); prints them and the ratios (~27 min).
bench-operator: venv cluster-bin
	$(BIN)/python benchmarks/operator_load.py

# Our trainer against transformers.Trainer and TRL's SFTTrainer on the same model and
# data, side by side (CPU configurations, ~15 minutes; bench-gpu for the 1B/3B/QLoRA ones
# on a GPU), then the instrumentation's cost. Tables on stdout, JSON under benchmarks/.
bench: $(VENV)/.bench
	$(BIN)/python benchmarks/throughput.py --suite cpu
	$(BIN)/python benchmarks/metrics_overhead.py

# On one GPU: the four configurations with their defaults against SFTTrainer with and
# without Liger kernels (one configuration: ~3 minutes on one H100; the whole target has
# not been timed), then each GPU speed-up on vs off.
bench-gpu: $(VENV)/.bench
	$(PIP) install "liger-kernel>=0.8"
	$(BIN)/python benchmarks/throughput.py --suite gpu --out benchmarks/throughput-gpu.json
	$(BIN)/python benchmarks/changes.py --suite gpu

$(VENV)/.bench: $(VENV)/.installed
	$(PIP) install -e ".[bench]" torch==$(TORCH_VERSION)
	touch $@

# The trainer's instrumentation on vs off, side by side (prints the ratio; CPU, minutes).
bench-metrics: venv
	$(BIN)/python benchmarks/metrics_overhead.py

# Seconds from `finetune run` to the first step and to the end, beside torchrun alone on the
# same trainer config (the tiny model on 2 CPU processes, 3 rounds: ~1.5 minutes).
bench-startup: venv
	$(BIN)/python benchmarks/startup.py --out benchmarks/startup.json

# How long a checkpoint holds the loop, written in the background vs synchronously, side
# by side (ddp, fsdp and zero3 on 2 CPU processes, ~8 minutes; prints the ratios).
bench-checkpoint: venv
	$(BIN)/python benchmarks/checkpoint_stall.py

# Host memory while 2 CPU ranks load a 123M model, summed over the ranks (FSDP, ZeRO-3,
# DDP for reference), beside one copy of the weights (~3 minutes).
bench-loading: venv
	$(BIN)/python benchmarks/loading_memory.py

crds: venv
	$(BIN)/python -m finetune_operator.crd --write
	$(BIN)/python -m finetune_operator.clidoc --write

demo: venv
	bash scripts/demo.sh $(BIN)

# The docs site (mkdocs, Material theme) into build/site, refusing a broken link or a page
# left out of the nav; docs-serve serves it on 127.0.0.1:8000 and rebuilds on each edit.
docs: venv
	$(BIN)/mkdocs build --strict

docs-serve: venv
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

clean:
	rm -rf $(VENV) build *.egg-info

kind-e2e: venv
	bash scripts/kind-e2e.sh $(BIN)

# Real pods on this machine (tests/e2e, also part of `make test`): the control plane with its
# real node, both images built from their Dockerfiles by buildah and loaded, the chart
# installed with the helm CLI; example 06 (DDP) and one short job per other strategy (FSDP
# LoRA, ZeRO-2 full weights, ZeRO-3 LoRA) trained on two worker pods to Succeeded, a worker
# that cannot set itself up failed after one restart, a helm upgrade mid-job. The first run
# builds the images (~10 minutes; cached after).
e2e: venv tools cluster-bin node-images
	$(BIN)/python -m pytest tests/e2e -p no:cacheprovider -v --durations=5
