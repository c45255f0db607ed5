{{/* The name of the release's objects: the release name, with the chart's name in it. */}}
{{- define "kvcached-broker.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvcached-broker.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvcached-broker.labels" -}}
{{ include "kvcached-broker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The endpoint template every broker binds and every serving pod sets as KVCACHED_BROKER. */}}
{{- define "kvcached-broker.endpoint" -}}
{{- if eq .Values.socketNaming "uuid" -}}
ipc://{{ .Values.hostPaths.runtimeDir }}/{uuid}.sock
{{- else -}}
ipc://{{ .Values.hostPaths.runtimeDir }}/gpu{device}.sock
{{- end -}}
{{- end -}}
