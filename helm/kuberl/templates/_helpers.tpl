{{/* Chart name, possibly overridden. */}}
{{- define "kuberl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped name of the operator's objects. */}}
{{- define "kuberl.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "kuberl.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "kuberl.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "kuberl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kuberl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kuberl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kuberl.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kuberl
{{- end }}

{{- define "kuberl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kuberl.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Who outside an RLJob may reach its pods (KUBERL_NETWORK_POLICY_PEERS, a JSON list of
NetworkPolicyPeers): this release's operator pods, KubeRay's operator, the metrics scrapers,
the extra peers.
*/}}
{{- define "kuberl.networkPolicyPeers" -}}
{{- $np := .Values.networkPolicy -}}
{{- $operator := dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace)) "podSelector" (dict "matchLabels" (include "kuberl.selectorLabels" . | fromYaml)) -}}
{{- $peers := list $operator -}}
{{- with $np.kuberayOperator }}{{ $peers = append $peers . }}{{ end -}}
{{- range $np.metricsScrapers }}{{ $peers = append $peers . }}{{ end -}}
{{- range $np.extraPeers }}{{ $peers = append $peers . }}{{ end -}}
{{- toJson $peers -}}
{{- end }}

{{/*
The operator's permissions, shared by the cluster-wide ClusterRole and the per-namespace Roles.
- rljobs: watch them, write their status (conditions, phase), never their spec.
- RayJobs: create, replace (restart attempts) and delete; RayClusters: read (readiness).
- ConfigMaps, ServiceAccounts, Roles, RoleBindings: the children it renders per RLJob. The
  Role it creates grants get on rljobs and get/patch on rljobs/status, which the operator must
  hold itself (RBAC refuses to grant what the granter lacks), hence those verbs below.
- NetworkPolicies: one per RLJob (networkPolicy.enabled), with its other children.
- Events: explain decisions (Accepted=False, restarts) on the RLJob.
*/}}
{{- define "kuberl.rules" -}}
- apiGroups: ["kuberl.dev"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["kuberl.dev"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["ray.io"]
  resources: ["rayjobs"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["ray.io"]
  resources: ["rayclusters"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# Each attempt's engine API key (a Secret it owns, deleted with the RLJob by GC): created,
# never read, listed or changed by the operator.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# environment.image: the environment service (a Deployment and its headless Service).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "update", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "update", "patch", "delete"]
# networkPolicy.enabled: the job's NetworkPolicy (the verbs stay when it is off, so turning it
# off and on needs no RBAC change, and the operator can still delete what it made).
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "update", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
# Pods of an attempt whose cluster is not up: their own reasons (a missing PVC, an image that
# cannot be pulled) go into the RLJob's ClusterReady condition.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list"]
# Kueue (spec.scheduling.queueName): the Workload of a queued RayJob says why it waits or was
# preempted. Read only; the operator never writes Kueue's objects.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get", "list", "watch"]
{{- end }}
