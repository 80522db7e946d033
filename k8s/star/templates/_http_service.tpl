{{/*
A CPU HTTP service: Deployment + Service + HPA on CPU.
args: root, component, v (its values: replicas, port, resources, autoscaling), command (list),
      waitForWorld (bool)
*/}}
{{- define "star.httpService" -}}
{{- $root := .root -}}
{{- $v := .v -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "star.name" $ctx }}
  labels: {{- include "star.labels" $ctx | nindent 4 }}
spec:
  {{- if not $v.autoscaling.enabled }}
  replicas: {{ $v.replicas }}
  {{- end }}
  selector:
    matchLabels: {{- include "star.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels: {{- include "star.labels" $ctx | nindent 8 }}
      annotations: {{- include "star.podAnnotations" (dict "root" $root "port" $v.port) | nindent 8 }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets: {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext: {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- if .waitForWorld }}
      initContainers: {{- include "star.waitForWorld" $root | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          {{- include "star.image" (dict "root" $root "gpu" false) | nindent 10 }}
          command: {{- toJson .command | nindent 12 }}
          {{- include "star.envFrom" $root | nindent 10 }}
          {{- with .env }}
          env: {{- toYaml . | nindent 12 }}
          {{- end }}
          ports:
            - {name: http, containerPort: {{ $v.port }}, protocol: TCP}
          {{- include "star.httpProbes" (dict) | nindent 10 }}
          resources: {{- toYaml $v.resources | nindent 12 }}
          securityContext: {{- toYaml $root.Values.securityContext | nindent 12 }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ include "star.name" $ctx }}
  labels: {{- include "star.labels" $ctx | nindent 4 }}
spec:
  selector: {{- include "star.selectorLabels" $ctx | nindent 4 }}
  ports:
    - {name: http, port: 80, targetPort: http, protocol: TCP}
{{- if $v.autoscaling.enabled }}
---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "star.name" $ctx }}
  labels: {{- include "star.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "star.name" $ctx }}
  minReplicas: {{ $v.autoscaling.minReplicas }}
  maxReplicas: {{ $v.autoscaling.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target: {type: Utilization, averageUtilization: {{ $v.autoscaling.targetCPUUtilizationPercentage }}}
{{- end }}
{{- end -}}
