#!/usr/bin/env bash
# `make kind-e2e`: a real cluster end to end. Creates a kind cluster, builds and loads the
# operator and CPU trainer images, installs the chart, applies examples/06-kind-e2e.yaml
# (2 worker pods), waits for Succeeded, checks the exported adapter and the events,
# runs the operator scenarios against the cluster, deletes the job and removes the cluster.
# Needs Docker, kind, kubectl and helm.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-.venv/bin}
CLUSTER=finetune-e2e
for tool in docker kind kubectl helm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "kind-e2e skipped: '$tool' is not installed (this needs a machine with a Docker engine)"
    exit 0
  fi
done
if ! docker info >/dev/null 2>&1; then
  echo "kind-e2e skipped: no Docker engine is reachable"
  exit 0
fi
cleanup() { kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true; }
trap cleanup EXIT

kind create cluster --name "$CLUSTER" --wait 120s
docker build -f operator/Dockerfile -t finetune-operator:e2e .
docker build -f trainer/Dockerfile --build-arg BASE=python:3.11-slim \
  --build-arg TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" \
  --build-arg DEMO=1 -t finetune-trainer:e2e .
kind load docker-image --name "$CLUSTER" finetune-operator:e2e finetune-trainer:e2e

helm install finetune charts/finetune-operator -n finetune-system --create-namespace \
  --set image.repository=finetune-operator --set image.tag=e2e --set image.pullPolicy=Never \
  --set trainer.image.repository=finetune-trainer --set trainer.image.tag=e2e \
  --set gpu.taint=null --wait --timeout 5m

# Example 06 is a 2-node job: the operator launches it on a ReadWriteMany claim only. kind's
# storage class makes ReadWriteOnce volumes, so the claim is bound to a hostPath volume of the
# (one) kind node, writable by the workers' uid 1000. (`make e2e` does the same on this
# machine's real node.)
docker exec "$CLUSTER-control-plane" mkdir -m 0777 -p /var/finetune-e2e
kubectl apply -f - <<'YAML'
apiVersion: v1
kind: PersistentVolume
metadata: {name: finetune-e2e}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteMany]
  storageClassName: ""
  hostPath: {path: /var/finetune-e2e}
  claimRef: {namespace: default, name: finetune-e2e}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: finetune-e2e}
spec:
  accessModes: [ReadWriteMany]
  storageClassName: ""
  volumeName: finetune-e2e
  resources: {requests: {storage: 1Gi}}
YAML
kubectl apply -f examples/06-kind-e2e.yaml
kubectl wait ftj/kind-e2e --for=jsonpath='{.status.phase}'=Succeeded --timeout=20m
kubectl get ftj kind-e2e -o wide
kubectl get events --field-selector involvedObject.name=kind-e2e | grep -q Succeeded

# the exported adapter, read back from the PVC
kubectl run e2e-reader --image=finetune-trainer:e2e --image-pull-policy=Never --restart=Never \
  --overrides='{"spec":{"volumes":[{"name":"out","persistentVolumeClaim":{"claimName":"finetune-e2e"}}],
  "containers":[{"name":"e2e-reader","image":"finetune-trainer:e2e","imagePullPolicy":"Never",
  "command":["ls","/out/kind-e2e/final/adapter_model.safetensors"],
  "volumeMounts":[{"name":"out","mountPath":"/out"}]}]}}'
kubectl wait pod/e2e-reader --for=jsonpath='{.status.phase}'=Succeeded --timeout=5m

# the operator scenarios of tests/operator, now on this real cluster: real worker pods,
# faults made through the exec and eviction APIs, the operator's pod deleted mid-job
KUBECONFIG=${KUBECONFIG:-$HOME/.kube/config} FINETUNE_E2E_NAMESPACE=default \
  "$BIN/pytest" tests/operator/test_scenarios.py -k kubeconfig -q -p no:cacheprovider

kubectl delete ftj kind-e2e --wait --timeout=5m
if kubectl get job kind-e2e >/dev/null 2>&1; then echo "the worker Job outlived its FineTuneJob"; exit 1; fi
echo "kind-e2e passed"
