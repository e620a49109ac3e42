{{- define "beamserve.name" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "beamserve.labels" -}}
app.kubernetes.io/name: beamserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "beamserve.selector" -}}
app.kubernetes.io/name: beamserve
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "beamserve.serviceAccount" -}}
{{- if .Values.serviceAccount.name -}}
{{ .Values.serviceAccount.name }}
{{- else -}}
{{ include "beamserve.name" . }}-operator
{{- end -}}
{{- end -}}

{{- define "beamserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "beamserve.webhookName" -}}
{{ include "beamserve.name" . }}-webhook.beamserve.io
{{- end -}}
