#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12 with torch, transformers, peft and
# accelerate but no package index: the rest of what the trainer, the GPU tests and
# `make bench-gpu` import, and this project, into .whl/ (git-ignored, ~60 MB).
#
#   bash scripts/gpu-wheels.sh            # here, with PyPI
#   bash scripts/gpu-session.sh tests      # there: installs them into /tmp (nothing
#                                          # system-wide), then one step of the GPU checks
#
# Versions are the ones the CPU test venv resolved (`make venv`), so both machines run
# the same libraries; deepspeed has no wheel on PyPI and is built here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=.whl
rm -rf "$OUT" && mkdir -p "$OUT"

# What the GPU machine lacks: the trainer's imports and what they import in turn, beyond
# torch, transformers, peft and accelerate (and what those require). At this venv's
# versions; tests/code/test_gpu_wheels.py checks the list against the trainer's imports
# and the requirements of every wheel here (pip installs them there with --no-deps).
PINNED=(pydantic pydantic-core annotated-types typing-inspection prometheus-client
        nvidia-ml-py datasets dill multiprocess hjson einops msgpack ninja py-cpuinfo
        math-verify latex2sympy2-extended antlr4-python3-runtime
        requests certifi charset-normalizer urllib3)
PEERS=("trl>=1.16" "bitsandbytes>=0.45" "liger-kernel>=0.8")  # the benchmarks' peers, QLoRA

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pinned=()
for name in "${PINNED[@]}"; do
  pinned+=("$name==$(version "$name")")
done
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$OUT" \
  "${pinned[@]}" "${PEERS[@]}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" \
  "deepspeed==$(version deepspeed)"
"$PY" -m pip wheel -q --no-deps -w "$OUT" .
# setuptools leaves its build metadata in the checkout: an egg-info at the repository root is
# found before the installed package's and hides its entry points (the objectives, the
# backends) from any Python started here
rm -rf build ./*.egg-info
ls -1 "$OUT"
du -sh "$OUT"
