{{/* Names and labels shared by every template. */}}

{{- define "hybridllm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* release-chart, or the release name alone when it already holds the chart's name. */}}
{{- define "hybridllm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "hybridllm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "hybridllm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: hybridllm
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component (operator, fleet). Call with (list $ "operator"). */}}
{{- define "hybridllm.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "hybridllm.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "hybridllm.operator.fullname" -}}
{{- printf "%s-operator" (include "hybridllm.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hybridllm.fleet.fullname" -}}
{{- printf "%s-fleet" (include "hybridllm.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "hybridllm.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "hybridllm.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- required "operator.serviceAccount.name is required when operator.serviceAccount.create is false" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hybridllm.fleet.serviceAccountName" -}}
{{- if .Values.fleet.serviceAccount.create }}
{{- default (include "hybridllm.fleet.fullname" .) .Values.fleet.serviceAccount.name }}
{{- else }}
{{- required "fleet.serviceAccount.name is required when fleet.serviceAccount.create is false" .Values.fleet.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "hybridllm.fleet.namespace" -}}
{{- default .Release.Namespace .Values.fleet.namespace }}
{{- end }}

{{/* repository:tag, the tag defaulting to the chart's appVersion. Call with (list $ .Values.x.image). */}}
{{- define "hybridllm.image" -}}
{{- $root := index . 0 }}{{- $image := index . 1 }}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) }}
{{- end }}
