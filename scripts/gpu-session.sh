#!/usr/bin/env bash
# One step of the GPU checks (#22) on a lent GPU machine that has Python 3.12 with torch,
# transformers, peft and accelerate but no package index: the rest comes from the wheels
# `bash scripts/gpu-wheels.sh` put in .whl/ here (carry .whl to the machine). Each step
# fits in one device call (10 minutes at most); results go to $OUT (the folder that comes
# back), else ./gpu-out, and each benchmark writes its JSON after every configuration, so a
# call cut short keeps what finished.
#
#   bash scripts/gpu-session.sh tests [EXPR]          # pytest -m gpu (the GPU tests; -k EXPR)
#   bash scripts/gpu-session.sh bench NAMES [PEERS]   # throughput.py --only NAMES, beside
#                                                     # PEERS (default trl_sft,trl_liger)
#   bash scripts/gpu-session.sh changes NAMES         # changes.py --only NAMES (on vs off)
#   bash scripts/gpu-session.sh profile NAME          # the top kernels of our warm-up steps
#   bash scripts/gpu-session.sh generation            # generate's sides: dynamic, merged,
#                                                     # static (benchmarks/generation.py)
#
# NAMES: comma-separated, e.g. gpu-1b-full,gpu-1b-lora (throughput.py's) or
# gpu-packed-attention (changes.py's). On a machine that has a package index, `make
# bench-gpu` runs every configuration and change instead.
set -euo pipefail
cd "$(dirname "$0")/.."
step=${1:?"a step: tests, bench NAMES [PEERS], changes NAMES, profile NAME or generation"}
out=${OUT:-gpu-out}
mkdir -p "$out"
site=${FINETUNE_SITE:-/tmp/finetune-site}
PY=${PY:-python3}
if [ ! -d "$site" ]; then
  ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run scripts/gpu-wheels.sh where PyPI is" \
    "reachable, and carry .whl" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
export TOKENIZERS_PARALLELISM=false
# the disk is small: every temporary file goes under one folder, and what an earlier
# step left there (models, checkpoints, compile caches) goes first
export TMPDIR=${FINETUNE_SCRATCH:-/tmp/finetune-gpu-session}
rm -rf "$TMPDIR" && mkdir -p "$TMPDIR"
{ nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 || true
  "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
} > "$out/machine.txt"

case "$step" in
  tests)
    # the cluster tests' pytest plugins are absent there (no kopf, kmock or pytest-asyncio);
    # no log capture: DCP's DEBUG records had buried the failures' own lines (11-26)
    "$PY" -m pytest -p no:cacheprovider -p no:asyncio -p no:kmock -p no:logging -m gpu \
      -rA -q --durations=0 ${2:+-k "$2"} \
      tests/trainer/test_gpu_training.py tests/trainer/test_packed_attention_gpu.py \
      2>&1 | tee "$out/tests.txt"
    ;;
  bench)
    "$PY" benchmarks/throughput.py --only "${2:?bench NAMES}" --peers "${3-trl_sft,trl_liger}" \
      --out "$out/throughput-gpu.json" --keep "$out/logs" 2>&1 | tee "$out/bench.txt"
    ;;
  changes)
    "$PY" benchmarks/changes.py --suite gpu --only "${2:?changes NAMES}" \
      --out "$out/changes-gpu.json" 2>&1 | tee "$out/changes.txt"
    ;;
  profile)
    "$PY" benchmarks/throughput.py --only "${2:?profile NAME}" --peers "" \
      --profile "$out/profile" --out "$out/profiled.json" --keep "$out/logs" 2>&1 \
      | tee "$out/profile.txt"
    rm -f "$out"/profile/*/*trace.json.gz  # too large to bring back; the top tables stay
    ;;
  generation)
    "$PY" benchmarks/generation.py --suite gpu --out "$out/generation-gpu.json" 2>&1 \
      | tee "$out/generation.txt"
    ;;
  *)
    echo "unknown step $step: tests, bench, changes, profile or generation" >&2
    exit 2
    ;;
esac
