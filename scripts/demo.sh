#!/usr/bin/env bash
# `make demo`: what the project does today, end to end, on this machine.
# The FineTuneJob API: validate the examples, render the objects the operator creates
# for one, and watch a broken manifest be refused with fixes. Local training
# (`finetune run`) joins this demo with the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-.venv/bin}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "finetune validate examples/*.yaml"
"$BIN/finetune" validate examples/*.yaml

say "finetune render examples/02-aks-fsdp-full-8b.yaml   (the trainer config every worker reads)"
"$BIN/finetune" render examples/02-aks-fsdp-full-8b.yaml

say "a manifest with mistakes: every problem, with its field and fix (exit code 2)"
set +e
"$BIN/finetune" validate - <<'YAML'
apiVersion: finetune.dev/v1alpha1
kind: FineTuneJob
metadata: {name: broken-job}
spec:
  model: {uri: hf://mistralai/Mistral-7B-v0.3}
  dataset: {uri: pvc://datasets/train.jsonl}
  method: {type: qlora}
  strategy: {type: ddp, offload: cpu, precision: fp32}
  hyperparameters: {epochs: 1, maxSteps: 500}
  resources: {gpusPerNode: 0}
  output: {uri: pvc://checkpoints/broken}
  kubernetes:
    env: [{name: MASTER_ADDR, value: 10.0.0.1}]
YAML
code=$?
set -e
echo "exit code: $code"
[ "$code" -eq 2 ]

say "the CRD is generated from the same models: make crds; kubectl apply -f crds/"
"$BIN/python" -m finetune_operator.crd --check && echo "crds/ is up to date with the API models"
