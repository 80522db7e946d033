{{/*
The pod template of an engine pod (rollout server, rollout worker, learner): the CPU or CUDA image,
GPU scheduling, /dev/shm, the model and weights volumes.
args: root, component, v (component values with gpu, shmSize, resources, nodeSelector, tolerations,
      affinity), gpus (GPUs the pod asks for when v.gpu.enabled), command (list), port (int or nil: no HTTP),
      weightsReadOnly (bool), extraMounts, extraEnv, extraPorts, extraVolumes
*/}}
{{- define "star.enginePod" -}}
{{- $root := .root -}}
{{- $v := .v -}}
{{- $ctx := dict "root" $root "component" .component -}}
metadata:
  labels: {{- include "star.labels" $ctx | nindent 4 }}
  annotations: {{- include "star.podAnnotations" (dict "root" $root "port" .port) | nindent 4 }}
spec:
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets: {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- with (include "star.scheduling" $v | trim) }}
  {{- . | nindent 2 }}
  {{- end }}
  {{- $init := include "star.modelInit" (dict "root" $root "gpu" $v.gpu.enabled) | trim }}
  {{- if $init }}
  initContainers: {{- $init | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .component }}
      {{- include "star.image" (dict "root" $root "gpu" $v.gpu.enabled) | nindent 6 }}
      command: {{- toJson .command | nindent 8 }}
      {{- include "star.envFrom" $root | nindent 6 }}
      env:
        - {name: DS_ACCELERATOR, value: {{ ternary "cuda" "cpu" $v.gpu.enabled }}}
        {{- with .extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if .port }}
      ports:
        - {name: http, containerPort: {{ .port }}, protocol: TCP}
        {{- with .extraPorts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- include "star.httpProbes" (dict "startupFailures" 180) | nindent 6 }}
      {{- else }}
      {{- include "star.workerProbes" (dict "stream" "tasks" "group" "rollout") | nindent 6 }}
      {{- end }}
      resources: {{- include "star.engineResources" (dict "resources" $v.resources "gpus" (ternary .gpus 0 $v.gpu.enabled)) | nindent 8 }}
      securityContext: {{- toYaml $root.Values.securityContext | nindent 8 }}
      volumeMounts:
        - {name: weights, mountPath: /var/star/weights, readOnly: {{ .weightsReadOnly }}}
        - {name: models, mountPath: /var/star/models, readOnly: {{ not (not $root.Values.model.existingClaim) }}}
        - {name: dshm, mountPath: /dev/shm}
        - {name: scratch, mountPath: /tmp}
        {{- include "star.runsMount" (dict "readOnly" .weightsReadOnly) | nindent 8 }}
        {{- with .extraMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: weights
      persistentVolumeClaim: {claimName: {{ include "star.claimName" (dict "root" $root "component" "weights") }}}
    {{- include "star.modelVolume" $root | nindent 4 }}
    - name: dshm
      emptyDir: {medium: Memory, sizeLimit: {{ $v.shmSize }}}
    - name: scratch
      emptyDir: {}
    {{- include "star.runsVolume" $root | nindent 4 }}
    {{- with .extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end -}}
