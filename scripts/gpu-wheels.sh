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

version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pinned=()
for name in pydantic pydantic-core annotated-types typing-inspection datasets dill \
            multiprocess hjson; do
  pinned+=("$name==$(version "$name")")
done
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
           manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$OUT" \
  "${pinned[@]}" "trl>=1.16" "bitsandbytes>=0.45" "liger-kernel>=0.8"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" \
  "deepspeed==$(version deepspeed)"
"$PY" -m pip wheel -q --no-deps -w "$OUT" .
ls -1 "$OUT"
du -sh "$OUT"
