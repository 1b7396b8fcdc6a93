{{- define "finetune-operator.name" -}}finetune-operator{{- end -}}

{{- define "finetune-operator.fullname" -}}
{{- if contains "finetune-operator" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-finetune-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "finetune-operator.labels" -}}
app.kubernetes.io/name: finetune-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "finetune-operator.selector" -}}
app.kubernetes.io/name: finetune-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The images: required, as none is published (values.yaml says how to build them). */}}
{{- define "finetune-operator.operatorImage" -}}
{{- $repository := required "image.repository is not set: build the operator image from operator/Dockerfile, push it where your nodes pull from, and set image.repository and image.tag (on this machine, `make cluster-images` writes them to .cluster/images.yaml: helm install -f .cluster/images.yaml)" .Values.image.repository -}}
{{- printf "%s:%s" $repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{- define "finetune-operator.trainerImage" -}}
{{- $repository := required "trainer.image.repository is not set: build the trainer image from trainer/Dockerfile, push it where your nodes pull from, and set trainer.image.repository and trainer.image.tag (on this machine, `make cluster-images` writes them to .cluster/images.yaml: helm install -f .cluster/images.yaml)" .Values.trainer.image.repository -}}
{{- printf "%s:%s" $repository (.Values.trainer.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The names of the Secrets the worker pods pull with, as JSON (FINETUNE_TRAINER_PULL_SECRETS). */}}
{{- define "finetune-operator.trainerPullSecrets" -}}
{{- $names := list -}}
{{- range (.Values.trainer.imagePullSecrets | default .Values.imagePullSecrets) -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- toJson $names -}}
{{- end -}}

{{- define "finetune-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "finetune-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The rules the operator needs in a namespace it watches: nothing more (it writes with
     patch, never update; the chart README's RBAC table says why each is needed). */}}
{{- define "finetune-operator.namespacedRules" -}}
- apiGroups: ["finetune.dev"]
  resources: ["finetunejobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["finetune.dev"]
  resources: ["finetunejobs/status"]
  verbs: ["patch"]
- apiGroups: ["finetune.dev"]
  resources: ["finetunesweeps"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["finetune.dev"]
  resources: ["finetunesweeps/status"]
  verbs: ["patch"]
- apiGroups: ["finetune.dev"]
  resources: ["finetunejobs/finalizers"]
  verbs: ["update"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]   # patch: a relaunch's config
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get"]                       # a multi-node job's output claim must be ReadWriteMany
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]            # list: the Job controller's FailedCreate events
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "patch"]             # a queued job waits and suspends through its Workload
{{- if and (gt (int .Values.replicas) 1) .Values.watchNamespaces }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch"]          # kopf watches them all and reads only its own
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  resourceNames: [{{ include "finetune-operator.fullname" . | quote }}]
  verbs: ["get", "patch"]
{{- end }}
{{- end -}}
