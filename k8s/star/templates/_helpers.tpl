{{/* Names: every object is "<release>-<component>". */}}
{{- define "star.name" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "star.selectorLabels" -}}
app.kubernetes.io/name: {{ .component }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "star.labels" -}}
{{ include "star.selectorLabels" . }}
app.kubernetes.io/part-of: star
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The CPU or the CUDA image. args: root, gpu (bool) */}}
{{- define "star.image" -}}
{{- $img := ternary .root.Values.gpuImage .root.Values.image .gpu -}}
image: "{{ $img.repository }}:{{ $img.tag }}"
imagePullPolicy: {{ $img.pullPolicy }}
{{- end -}}

{{/* Where the services reach Redis and the database. */}}
{{- define "star.redisUrl" -}}
{{- if .Values.redis.enabled -}}
redis://{{ .Release.Name }}-redis:6379/0
{{- else -}}
{{- required "externalRedis.url is required when redis.enabled is false" .Values.externalRedis.url -}}
{{- end -}}
{{- end -}}

{{- define "star.secretName" -}}
{{- printf "%s-secrets" .Release.Name -}}
{{- end -}}

{{/* Comma-separated URLs of the rollout server pods (stable StatefulSet names). */}}
{{- define "star.rolloutUrls" -}}
{{- $urls := list -}}
{{- if .Values.rollout.server.enabled -}}
{{- range $i := until (int .Values.rollout.server.replicas) -}}
{{- $urls = append $urls (printf "http://%s-rollout-%d.%s-rollout-headless:%d" $.Release.Name $i $.Release.Name (int $.Values.rollout.server.port)) -}}
{{- end -}}
{{- end -}}
{{- if eq .Values.rollout.weightTransfer "nccl" -}}
{{- range $i := until (int .Values.rollout.worker.replicas) -}}
{{- $urls = append $urls (printf "http://%s-rollout-worker-%d.%s-rollout-worker:%d" $.Release.Name $i $.Release.Name (int $.Values.rollout.server.port)) -}}
{{- end -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}

{{/* The shared STAR_* environment: one ConfigMap and one Secret. */}}
{{- define "star.envFrom" -}}
envFrom:
  - configMapRef: {name: {{ .Release.Name }}-env}
  - secretRef: {name: {{ include "star.secretName" . }}}
{{- if .Values.auth.existingSecret }}
  - secretRef: {name: {{ .Values.auth.existingSecret }}}
{{- end }}
{{- if .Values.redis.auth.existingSecret }}
  - secretRef: {name: {{ .Values.redis.auth.existingSecret }}}
{{- end }}
{{- end -}}

{{/* The Secret (and key) holding the Redis password. */}}
{{- define "star.redisSecret" -}}
{{- .Values.redis.auth.existingSecret | default (include "star.secretName" .) -}}
{{- end -}}

{{/* Pod annotations: Prometheus scraping, and a restart when the shared settings change. args: root, port */}}
{{- define "star.podAnnotations" -}}
checksum/env: {{ include (print .root.Template.BasePath "/config.yaml") .root | sha256sum }}
{{- if and .port .root.Values.monitoring.scrapeAnnotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* Liveness on /healthz (the process answers), readiness on /readyz (its dependencies are usable). */}}
{{- define "star.httpProbes" -}}
startupProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: 5
  failureThreshold: {{ .startupFailures | default 60 }}
livenessProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
{{- end -}}

{{/* A stream worker has no HTTP port: it is alive while it reaches Redis. */}}
{{- define "star.workerProbes" -}}
{{- /* A stream worker serves no port. Live while it reaches Redis; ready while one of its consumers reads
its stream (the heartbeat of services/common/heartbeat.py), which stops while it cannot work (a dependency
down, weights it cannot load): such a pod shows NotReady rather than being restarted. */ -}}
livenessProbe:
  exec:
    command: ["python", "-c", "import os, redis; redis.Redis.from_url(os.environ['STAR_REDIS_URL'], password=os.environ.get('STAR_REDIS_PASSWORD'), socket_timeout=5).ping()"]
  initialDelaySeconds: 30
  periodSeconds: 30
  timeoutSeconds: 10
  failureThreshold: 3
readinessProbe:
  exec:
    command: ["python", "-m", "services.common.heartbeat", {{ .stream | quote }}, {{ .group | quote }}]
  initialDelaySeconds: 30
  periodSeconds: 15
  timeoutSeconds: 10
  failureThreshold: 4
{{- end -}}

{{/* Init container: wait until the world job has built the world (sandbox and reward load it at start). */}}
{{- define "star.waitForWorld" -}}
- name: wait-for-world
  {{- include "star.image" (dict "root" . "gpu" false) | nindent 2 }}
  command: ["sh", "-c", "until star world info > /dev/null 2>&1; do echo 'waiting for the world (the world build job)'; sleep 5; done"]
  {{- include "star.envFrom" . | nindent 2 }}
  securityContext: {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 50m, memory: 256Mi}
    limits: {cpu: 500m, memory: 512Mi}
{{- end -}}

{{/* Model volume (a PVC, or an emptyDir filled by an init container) and the init container. */}}
{{- define "star.modelVolume" -}}
- name: models
{{- if .Values.model.existingClaim }}
  persistentVolumeClaim: {claimName: {{ .Values.model.existingClaim }}, readOnly: true}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end -}}

{{- define "star.modelInit" -}}
{{- if not .root.Values.model.existingClaim }}
- name: build-tiny-model
  {{- include "star.image" (dict "root" .root "gpu" .gpu) | nindent 2 }}
  command: ["python", "-c", "import sys; from services.models import tiny_qwen2; print(tiny_qwen2(sys.argv[1], tokenizer='travel'))", {{ .root.Values.model.path | quote }}]
  {{- include "star.envFrom" .root | nindent 2 }}
  volumeMounts:
    - {name: models, mountPath: /var/star/models}
  securityContext: {{- toYaml .root.Values.securityContext | nindent 4 }}
  resources:
    requests: {cpu: 500m, memory: 2Gi}
    limits: {cpu: "2", memory: 4Gi}
{{- end }}
{{- end -}}

{{/* The shared ReadWriteMany volumes: `weights` (published versions) and `runs` (run folders).
     args: root, component ("weights" | "runs") */}}
{{- define "star.claimName" -}}
{{- (get .root.Values .component).existingClaim | default (printf "%s-%s" .root.Release.Name .component) -}}
{{- end -}}

{{/* The PVC of one shared volume, unless an existing claim is named. args: root, component, what (comment) */}}
{{- define "star.sharedClaim" -}}
{{- $v := get .root.Values .component -}}
{{- if not $v.existingClaim }}
# {{ .what }}
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {{ include "star.claimName" . }}
  labels: {{- include "star.labels" . | nindent 4 }}
  annotations:
    # Deleting the release keeps the volume.
    helm.sh/resource-policy: keep
spec:
  accessModes: {{- toYaml $v.accessModes | nindent 4 }}
  {{- with $v.storageClassName }}
  storageClassName: {{ . }}
  {{- end }}
  resources:
    requests: {storage: {{ $v.size }}}
{{- end }}
{{- end -}}

{{/* The runs volume, mounted at /var/star/runs (the default run folders, STAR_HOME/runs). args: root, readOnly */}}
{{- define "star.runsMount" -}}
- {name: runs, mountPath: /var/star/runs, readOnly: {{ .readOnly }}}
{{- end -}}

{{- define "star.runsVolume" -}}
- name: runs
  persistentVolumeClaim: {claimName: {{ include "star.claimName" (dict "root" . "component" "runs") }}}
{{- end -}}

{{/* GPU scheduling: node selector, tolerations, affinity. args: values of the component */}}
{{- define "star.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* Resources, with nvidia.com/gpu added to requests and limits when the pod runs on GPUs.
     args: resources, gpus (int; 0 off GPUs) */}}
{{- define "star.engineResources" -}}
{{- $r := deepCopy .resources -}}
{{- $gpus := int .gpus -}}
{{- if $gpus -}}
{{- $limits := (get $r "limits") | default dict -}}
{{- $requests := (get $r "requests") | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" $gpus -}}
{{- $_ := set $requests "nvidia.com/gpu" $gpus -}}
{{- $_ := set $r "limits" $limits -}}
{{- $_ := set $r "requests" $requests -}}
{{- end -}}
{{- toYaml $r -}}
{{- end -}}
