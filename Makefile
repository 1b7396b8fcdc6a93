# One venv with everything the tests need. torch is installed first and pinned so pip
# never swaps in a multi-gigabyte CUDA build; deepspeed builds against that torch.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: venv tools test lint crds demo clean kind-e2e bench bench-gpu bench-metrics

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install --no-build-isolation "deepspeed>=0.17" torch==$(TORCH_VERSION)
	$(PIP) install -e ".[trainer,azure,dev]" torch==$(TORCH_VERSION)
	touch $@

# Debian's prometheus + promtool: the alert rule tests and the real-Prometheus dashboard
# test use them (skipped, saying so, where they cannot be installed).
tools:
	@command -v promtool >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's prometheus (prometheus, promtool) for the metrics tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends prometheus >/dev/null; \
	  else \
	    echo "promtool missing and apt-get unavailable: Prometheus tests will be skipped"; \
	  fi; }

test: venv tools
	$(BIN)/ruff check operator trainer tests
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

# Our trainer against transformers.Trainer and TRL's SFTTrainer on the same model and
# data, side by side (CPU configurations, ~15 minutes; bench-gpu for the 1B/3B/QLoRA ones
# on a GPU), then the instrumentation's cost. Tables on stdout, JSON under benchmarks/.
bench: $(VENV)/.bench
	$(BIN)/python benchmarks/throughput.py --suite cpu
	$(BIN)/python benchmarks/metrics_overhead.py

bench-gpu: $(VENV)/.bench
	$(BIN)/python benchmarks/throughput.py --suite gpu --out benchmarks/throughput-gpu.json

$(VENV)/.bench: $(VENV)/.installed
	$(PIP) install -e ".[bench]" torch==$(TORCH_VERSION)
	touch $@

# The trainer's instrumentation on vs off, side by side (prints the ratio; CPU, minutes).
bench-metrics: venv
	$(BIN)/python benchmarks/metrics_overhead.py

crds: venv
	$(BIN)/python -m finetune_operator.crd --write

demo: venv
	bash scripts/demo.sh $(BIN)

clean:
	rm -rf $(VENV) build *.egg-info

kind-e2e: venv
	bash scripts/kind-e2e.sh $(BIN)
