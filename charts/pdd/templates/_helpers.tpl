{{/*
Names and labels shared by every template. Names are capped at 63 characters (the DNS label
limit) because Kubernetes rejects longer object names.
*/}}

{{- define "pdd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pdd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdd
{{- end -}}

{{/* Selector labels of one component; pass (dict "ctx" $ "component" "operator"). */}}
{{- define "pdd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdd.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "pdd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "pdd.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdd.redisName" -}}
{{- printf "%s-redis" (include "pdd.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The URL routers use for their shared state when the chart runs Redis. */}}
{{- define "pdd.redisUrl" -}}
{{- printf "redis://%s.%s.svc:%d/0" (include "pdd.redisName" .) .Release.Namespace (int .Values.redis.port) -}}
{{- end -}}

{{/*
An image reference from {repository, tag} values: the tag defaults to the chart's appVersion.
Pass (dict "image" .Values.operator.image "ctx" $).
*/}}
{{- define "pdd.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
