# One venv with everything the tests need. torch is installed first and pinned so pip
# never swaps in a multi-gigabyte CUDA build; deepspeed builds against that torch.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
PIP    := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: venv test lint crds demo clean kind-e2e

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install --no-build-isolation "deepspeed>=0.17" torch==$(TORCH_VERSION)
	$(PIP) install -e ".[trainer,azure,dev]" torch==$(TORCH_VERSION)
	touch $@

test: venv
	$(BIN)/ruff check operator trainer tests
	$(BIN)/lint-imports
	$(BIN)/python -m pytest

crds: venv
	$(BIN)/python -m finetune_operator.crd --write

demo: venv
	bash scripts/demo.sh $(BIN)

clean:
	rm -rf $(VENV) build *.egg-info

kind-e2e: venv
	bash scripts/kind-e2e.sh $(BIN)
