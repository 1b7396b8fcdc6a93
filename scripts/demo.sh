#!/usr/bin/env bash
# `make demo`: the product end to end on this machine, no cluster, no downloads.
#   1. a tiny Llama-architecture model and tokenizer are built locally (save_pretrained)
#   2. the example manifests are validated; one is rendered into what the operator creates
#   3. examples/01-tiny-cpu-lora.yaml is fine-tuned for real: 2 CPU processes over gloo,
#      then `finetune status` shows it as it would a job on a cluster
#   4. the exported LoRA adapter is loaded back and answers a training question, beside
#      the base model's answer to it
#   5. a broken manifest is refused with every problem, its field and its fix
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-.venv/bin}
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
export TOKENIZERS_PARALLELISM=false

say "a tiny model, built here: build/demo/tiny-llama"
"$BIN/python" -m finetune_trainer.tiny build/demo/tiny-llama --corpus examples/data/tiny-chat.jsonl

say "finetune validate examples/*.yaml"
"$BIN/finetune" validate examples/*.yaml

say "finetune render examples/02-aks-fsdp-full-8b.yaml   (the trainer config every worker reads)"
"$BIN/finetune" render examples/02-aks-fsdp-full-8b.yaml | sed -n 1,30p
echo "..."

say "finetune run examples/01-tiny-cpu-lora.yaml   (a real fine-tune: 2 processes, DDP over gloo)"
rm -rf build/demo/output
"$BIN/finetune" run examples/01-tiny-cpu-lora.yaml

say "finetune status examples/01-tiny-cpu-lora.yaml   (the view a cluster job gets; --watch follows one)"
"$BIN/finetune" status examples/01-tiny-cpu-lora.yaml

say "what is FSDP? the base model (random weights) beside the exported adapter, loaded back"
printf 'base:    %s\n' "$("$BIN/python" -m finetune_trainer.generate build/demo/tiny-llama "What is FSDP?" 2>/dev/null)"
printf 'adapter: %s\n' "$("$BIN/python" -m finetune_trainer.generate build/demo/output/final "What is FSDP?" 2>/dev/null)"

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
