{{/* The job's name: every object's prefix and the NATS subjects' job. */}}
{{- define "persia.job" -}}
{{- .Values.jobName | default .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end }}

{{/* Labels of every object; "persia.selector" is the part selectors use (the job included, so
     two jobs in one namespace never select each other's pods). */}}
{{- define "persia.selector" -}}
app.kubernetes.io/name: persia
app.kubernetes.io/instance: {{ include "persia.job" . }}
{{- end }}

{{- define "persia.labels" -}}
{{ include "persia.selector" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{- define "persia.secret" -}}
{{- .Values.credentials.secretName | default (printf "%s-nats-credentials" (include "persia.job" .)) -}}
{{- end }}

{{/* Every NATS node by its stable name: a role fails over to another when its node goes. */}}
{{- define "persia.natsUrl" -}}
{{- $job := include "persia.job" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.nats.replicas) -}}
{{- $urls = append $urls (printf "nats://%s-nats-%d.%s-nats-headless:4222" $job $i $job) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end }}

{{/* The environment of every PERSIA container; "user" and "var" name its NATS user and the
     Secret's key holding that user's password. */}}
{{- define "persia.env" -}}
- name: PERSIA_NATS_URL
  value: {{ include "persia.natsUrl" .root | quote }}
- name: PERSIA_NATS_USER
  value: {{ .user }}
- name: PERSIA_NATS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "persia.secret" .root }}
      key: {{ .var }}
- name: PERSIA_JOB_NAME
  value: {{ include "persia.job" .root | quote }}
- name: PERSIA_GLOBAL_CONFIG
  value: /etc/persia/global_config.yml
- name: PERSIA_EMBEDDING_CONFIG
  value: /etc/persia/embedding_config.yml
- name: PERSIA_CHECKPOINT_DIR
  value: /checkpoints
- name: LOG_LEVEL
  value: {{ .root.Values.logLevel | quote }}
- name: PERSIA_LOG_FORMAT
  value: json
{{- end }}

{{/* Prometheus scrape annotations of a pod that serves metrics. */}}
{{- define "persia.scrape" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .Values.metrics.port | quote }}
prometheus.io/path: /metrics
{{- end }}

{{- define "persia.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "persia.containerSecurity" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end }}

{{- define "persia.volumes" -}}
- name: persia-config
  configMap:
    name: {{ include "persia.job" . }}-persia-config
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "persia.job" . }}-checkpoints
{{- end }}

{{- define "persia.volumeMounts" -}}
- name: persia-config
  mountPath: /etc/persia
  readOnly: true
- name: checkpoints
  mountPath: /checkpoints
{{- end }}
