// The helm CLI (v3), with which `make e2e` and the tests install the chart as users do,
// built from the published module (helm.sh/helm/v3, cmd/helm).
module finetune-operator/cluster/helm

go 1.26.0

require helm.sh/helm/v3 v3.22.0 // indirect
