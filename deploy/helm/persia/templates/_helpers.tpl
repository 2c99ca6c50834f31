{{/* Every object's prefix: the release's name (fullnameOverride replaces it), so two releases in
     one namespace never collide whatever their jobName. No "-persia" suffix as `helm create` would
     add: `helm install adult` then names its objects as deploy/k8s does (adult-nats, ...), and
     moving from `kubectl apply` to Helm keeps the checkpoint volume. At most 38 characters: the
     longest StatefulSet, <prefix>-embedding-ps (51), plus the "-<hash>" Kubernetes appends in its
     controller-revision-hash label (up to 11) stays within a label's 63. A longer release name keeps
     its first 31 characters and a hash of the whole, so two long names sharing a start stay apart. */}}
{{- define "persia.fullname" -}}
{{- $name := .Values.fullnameOverride | default .Release.Name -}}
{{- if gt (len $name) 38 -}}
{{- printf "%s-%s" ($name | trunc 31 | trimSuffix "-") ($name | sha256sum | trunc 6) -}}
{{- else -}}
{{- $name -}}
{{- end -}}
{{- end }}

{{/* The PERSIA job (common_config.job_name): the NATS subjects' prefix and the persia_job label of
     every metric. Not truncated: a job name cut short would merge two jobs' series. */}}
{{- define "persia.job" -}}
{{- .Values.jobName | default .Release.Name -}}
{{- end }}

{{/* "persia.selector" is what selectors use: the release in it, so two releases never select each
     other's pods. */}}
{{- define "persia.selector" -}}
app.kubernetes.io/name: persia
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "persia.labels" -}}
{{ include "persia.selector" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{- define "persia.secret" -}}
{{- .Values.credentials.existingSecret | default (printf "%s-nats-credentials" (include "persia.fullname" .)) -}}
{{- end }}

{{/* The Secret's keys: every role's NATS password (deploy/nats-auth.conf) and the route port's;
     deploy/gen-credentials.sh writes the same (tests/unit/test_deploy_files.py compares them). */}}
{{- define "persia.secretKeys" -}}
{{- list "PERSIA_PS_PASSWORD" "PERSIA_EW_PASSWORD" "PERSIA_NN_PASSWORD" "PERSIA_LOADER_PASSWORD" "PERSIA_PUBLISHER_PASSWORD" "PERSIA_SERVING_PASSWORD" "PERSIA_PREDICT_PASSWORD" "PERSIA_ADMIN_PASSWORD" "PERSIA_ROUTE_PASSWORD" | toJson -}}
{{- end }}

{{- define "persia.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end }}

{{/* Every NATS node by its stable name: a role fails over to another when its node goes. */}}
{{- define "persia.natsUrl" -}}
{{- $name := include "persia.fullname" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.nats.replicas) -}}
{{- $urls = append $urls (printf "nats://%s-nats-%d.%s-nats-headless:4222" $name $i $name) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end }}

{{/* Where a pod runs and as whom, for the role whose values are .role: its own nodeSelector,
     tolerations and affinity, else the chart-wide ones, else .defaultAffinity (YAML; a role's
     built-in spread). No service-account token: no role calls the Kubernetes API. */}}
{{- define "persia.podScheduling" -}}
{{- $v := .root.Values -}}
{{- $sa := .role.serviceAccountName | default (ternary ($v.serviceAccount.name | default (include "persia.fullname" .root)) $v.serviceAccount.name $v.serviceAccount.create) -}}
{{- if $sa }}
serviceAccountName: {{ $sa }}
{{- end }}
automountServiceAccountToken: false
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.nodeSelector | default $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.tolerations | default $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $affinity := .role.affinity | default $v.affinity -}}
{{- if $affinity }}
affinity:
  {{- toYaml $affinity | nindent 2 }}
{{- else if .defaultAffinity }}
affinity:
  {{- .defaultAffinity | nindent 2 }}
{{- end }}
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
{{- if .checkpoints }}
- name: PERSIA_CHECKPOINT_DIR
  value: /checkpoints
{{- end }}
{{- if and .metrics .root.Values.metrics.enabled }}
- name: PERSIA_METRICS_PORT
  value: {{ .root.Values.metrics.port | quote }}
{{- end }}
- name: LOG_LEVEL
  value: {{ .root.Values.logLevel | quote }}
- name: PERSIA_LOG_FORMAT
  value: json
{{- end }}

{{/* The metrics port and the scrape annotations of a pod that serves metrics (none when off). */}}
{{- define "persia.metricsPort" -}}
{{- if .Values.metrics.enabled }}
ports:
  - name: metrics
    containerPort: {{ .Values.metrics.port }}
{{- end }}
{{- end }}

{{- define "persia.podAnnotations" -}}
{{- if .Values.metrics.enabled }}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .Values.metrics.port | quote }}
  prometheus.io/path: /metrics
{{- end }}
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
    name: {{ include "persia.fullname" . }}-persia-config
- name: checkpoints
  persistentVolumeClaim:
    claimName: {{ include "persia.fullname" . }}-persia-checkpoints
{{- end }}

{{- define "persia.volumeMounts" -}}
- name: persia-config
  mountPath: /etc/persia
  readOnly: true
- name: checkpoints
  mountPath: /checkpoints
{{- end }}

{{/* The PS replicas' default spread over nodes: their memory is the embedding table. */}}
{{- define "persia.psSpread" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "persia.selector" . | nindent 12 }}
            app.kubernetes.io/component: embedding-ps
{{- end }}
