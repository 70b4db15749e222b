{{/*
Names, labels, the rendered rampart.toml, the drain and grace period, the Secrets each setting
reads, and the checks that fail a render. Every object template includes from here.
*/}}

{{- define "rampart.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rampart.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rampart.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "rampart.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rampart.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "rampart.labels" -}}
helm.sh/chart: {{ include "rampart.chart" . }}
{{ include "rampart.selectorLabels" . }}
app.kubernetes.io/version: {{ (.Values.image.tag | default .Chart.AppVersion) | trunc 63 | quote }}
app.kubernetes.io/component: server
app.kubernetes.io/part-of: rampart
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "rampart.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "rampart.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* An image reference from {repository, tag, digest}; the tag defaults to the second argument. */}}
{{- define "rampart.imageRef" -}}
{{- $img := index . 0 -}}
{{- $defaultTag := index . 1 -}}
{{- if $img.digest -}}
{{- printf "%s@%s" $img.repository $img.digest -}}
{{- else -}}
{{- printf "%s:%s" $img.repository (toString ($img.tag | default $defaultTag)) -}}
{{- end -}}
{{- end -}}

{{- define "rampart.image" -}}
{{- include "rampart.imageRef" (list .Values.image .Chart.AppVersion) -}}
{{- end -}}

{{/* Fixed paths inside the container (the image and the docs name them too). */}}
{{- define "rampart.paths.config" -}}/etc/rampart{{- end -}}
{{- define "rampart.paths.models" -}}/models{{- end -}}
{{- define "rampart.paths.home" -}}/var/lib/rampart{{- end -}}
{{- define "rampart.paths.audit" -}}/var/lib/rampart/audit{{- end -}}
{{- define "rampart.paths.feedback" -}}/var/lib/rampart/feedback{{- end -}}

{{/*
TOML. Helm reads every number in values as a float (30 becomes 30.0), and Rampart's integer
settings refuse floats, so the chart writes TOML itself: whole floats as integers (a float setting
takes an integer too), strings as JSON strings (valid TOML basic strings), maps as tables, lists
of maps as arrays of tables.
*/}}
{{- define "rampart.toml.key" -}}
{{- if has . (list "true" "false") -}}
{{- fail (printf "config: a key read as the boolean %s: YAML takes an unquoted on, off, yes or no as true or false; quote it (\"on\": [error] in a fallback step)." .) -}}
{{- end -}}
{{- if regexMatch "^[A-Za-z0-9_-]+$" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{- define "rampart.toml.value" -}}
{{- $k := kindOf . -}}
{{- if eq $k "string" -}}{{ toJson . }}
{{- else if eq $k "bool" -}}{{ . }}
{{- else if has $k (list "int" "int8" "int16" "int32" "int64" "uint" "uint8" "uint16" "uint32" "uint64") -}}{{ . }}
{{- else if or (eq $k "float64") (eq $k "float32") -}}
{{- if eq (float64 (int64 .)) (float64 .) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if eq $k "slice" -}}
[{{- range $i, $e := . -}}{{- if $i -}}, {{ end -}}{{- include "rampart.toml.value" $e -}}{{- end -}}]
{{- else if eq $k "map" -}}
{ {{- $first := true -}}{{- range $key := keys . | sortAlpha -}}{{- $val := get $ $key -}}{{- if ne (kindOf $val) "invalid" -}}{{- if not $first -}}, {{ end -}}{{- $first = false -}}{{- include "rampart.toml.key" $key }} = {{ include "rampart.toml.value" $val -}}{{- end -}}{{- end -}} }
{{- else -}}
{{- fail (printf "config: a value of kind %s cannot be written to TOML" $k) -}}
{{- end -}}
{{- end -}}

{{/* A list whose every element is a map: written as an array of tables. */}}
{{- define "rampart.toml.isTableArray" -}}
{{- if and (eq (kindOf .) "slice") (gt (len .) 0) -}}
{{- $all := true -}}
{{- range . -}}{{- if ne (kindOf .) "map" -}}{{- $all = false -}}{{- end -}}{{- end -}}
{{- if $all -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* dict "path" (list of keys) "table" (map): the table's keys, then its tables and arrays of tables. */}}
{{- define "rampart.toml.table" -}}
{{- $path := .path -}}
{{- $table := .table -}}
{{- $names := keys $table | sortAlpha -}}
{{- range $key := $names -}}
{{- $val := get $table $key -}}
{{- $k := kindOf $val -}}
{{- if and (ne $k "invalid") (ne $k "map") (not (include "rampart.toml.isTableArray" $val)) }}
{{ include "rampart.toml.key" $key }} = {{ include "rampart.toml.value" $val }}
{{- end -}}
{{- end -}}
{{- range $key := $names -}}
{{- $val := get $table $key -}}
{{- $sub := append $path (include "rampart.toml.key" $key) -}}
{{- if eq (kindOf $val) "map" }}

[{{ join "." $sub }}]
{{- include "rampart.toml.table" (dict "path" $sub "table" $val) -}}
{{- else if include "rampart.toml.isTableArray" $val -}}
{{- range $elem := $val }}

[[{{ join "." $sub }}]]
{{- include "rampart.toml.table" (dict "path" $sub "table" $elem) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Is gRPC served? (config.grpc.enabled, default true) */}}
{{- define "rampart.grpcEnabled" -}}
{{- if ne (toString (dig "grpc" "enabled" true (default dict .Values.config))) "false" -}}true{{- end -}}
{{- end -}}

{{/*
The configuration as a map (YAML): `config` with the keys the chart owns set over it.
*/}}
{{- define "rampart.configMap" -}}
{{- $v := .Values -}}
{{- $cfg := deepCopy (default dict $v.config) -}}
{{- $_ := set $cfg "listen" (printf "0.0.0.0:%d" (int $v.ports.http)) -}}
{{- $grpc := get $cfg "grpc" | default dict -}}
{{- $_ := set $grpc "listen" (printf "0.0.0.0:%d" (int $v.ports.grpc)) -}}
{{- $_ := set $cfg "grpc" $grpc -}}
{{- $_ := set $cfg "repo" (include "rampart.paths.models" .) -}}
{{- if $v.apiKeys.insecureNoAuth -}}
{{- $_ := set $cfg "insecure_no_auth" true -}}
{{- else if eq $v.apiKeys.mountAs "file" -}}
{{- $_ := set $cfg "api_keys_file" (printf "%s/keys/keys.txt" (include "rampart.paths.config" .)) -}}
{{- end -}}
{{- $audit := get $cfg "audit" | default dict -}}
{{- $_ := set $audit "dir" (include "rampart.paths.audit" .) -}}
{{- if $v.audit.s3.enabled -}}
{{- $s3 := get $audit "s3" | default dict -}}
{{- $url := printf "s3://%s" $v.audit.s3.bucket -}}
{{- if $v.audit.s3.prefix -}}{{- $url = printf "%s/%s" $url (trimAll "/" $v.audit.s3.prefix) -}}{{- end -}}
{{- $_ := set $s3 "url" $url -}}
{{- $_ := set $s3 "endpoint" (include "rampart.s3Endpoint" $v.audit.s3) -}}
{{- $_ := set $s3 "region" $v.audit.s3.region -}}
{{- $_ := set $s3 "path_style" $v.audit.s3.pathStyle -}}
{{- $_ := set $s3 "lock_mode" $v.audit.s3.lockMode -}}
{{- $_ := set $s3 "retention_days" $v.audit.s3.retentionDays -}}
{{- $_ := set $s3 "legal_hold" $v.audit.s3.legalHold -}}
{{- $_ := set $s3 "delete_local_after_verify" $v.audit.s3.deleteLocalAfterVerify -}}
{{- $_ := set $s3 "access_key_env" "AWS_ACCESS_KEY_ID" -}}
{{- $_ := set $s3 "secret_key_env" "AWS_SECRET_ACCESS_KEY" -}}
{{- $_ := set $audit "s3" $s3 -}}
{{- end -}}
{{- $_ := set $cfg "audit" $audit -}}
{{- $feedback := get $cfg "feedback" | default dict -}}
{{- $_ := set $feedback "dir" (include "rampart.paths.feedback" .) -}}
{{- $_ := set $cfg "feedback" $feedback -}}
{{- if $v.fleet.enabled -}}
{{- $fleet := get $cfg "fleet" | default dict -}}
{{- $_ := set $fleet "enabled" true -}}
{{- $_ := set $cfg "fleet" $fleet -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- $tls := get $cfg "tls" | default dict -}}
{{- $dir := printf "%s/tls" (include "rampart.paths.config" .) -}}
{{- $_ := set $tls "cert_file" (printf "%s/tls.crt" $dir) -}}
{{- $_ := set $tls "key_file" (printf "%s/tls.key" $dir) -}}
{{- $_ := set $tls "client_auth" $v.tls.clientAuth -}}
{{- if ne $v.tls.clientAuth "off" -}}{{- $_ := set $tls "client_ca_file" (printf "%s/ca.crt" $dir) -}}{{- end -}}
{{- $_ := set $cfg "tls" $tls -}}
{{- end -}}
{{- $memory := get $cfg "memory" | default dict -}}
{{- if and $v.memory.modelsBudgetFraction (not (hasKey $memory "models_budget")) -}}
{{- $_ := set $memory "models_budget" (toString $v.memory.modelsBudgetFraction) -}}
{{- end -}}
{{- if $memory -}}{{- $_ := set $cfg "memory" $memory -}}{{- end -}}
{{- $cpu := toString (dig "limits" "cpu" "" (default dict $v.resources)) -}}
{{- if and (not (hasKey $cfg "threads")) (regexMatch "^[1-9][0-9]*$" $cpu) -}}
{{- $_ := set $cfg "threads" (int $cpu) -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* An S3 endpoint: the one given, else AWS's for the region. */}}
{{- define "rampart.s3Endpoint" -}}
{{- .endpoint | default (printf "https://s3.%s.amazonaws.com" .region) -}}
{{- end -}}

{{/* rampart.toml as the pod reads it. */}}
{{- define "rampart.configToml" -}}
{{- if .Values.configToml -}}
{{- .Values.configToml -}}
{{- else -}}
# rampart.toml rendered by the Helm chart from its values (`config` and the keys the chart owns).
# Every setting: docs/configuration.md.
{{- include "rampart.toml.table" (dict "path" (list) "table" (include "rampart.configMap" . | fromYaml)) }}
{{ end -}}
{{- end -}}

{{/* A top-level integer setting of the rendered configuration, or the server's default. */}}
{{- define "rampart.topLevelInt" -}}
{{- $root := index . 0 -}}
{{- $key := index . 1 -}}
{{- $default := index . 2 -}}
{{- if $root.Values.configToml -}}
{{- $head := regexSplit "(?m)^\\s*\\[" $root.Values.configToml 2 | first -}}
{{- $line := regexFind (printf "(?m)^\\s*%s\\s*=\\s*[0-9]+" $key) $head -}}
{{- if $line -}}{{- regexFind "[0-9]+$" $line -}}{{- else -}}{{- $default -}}{{- end -}}
{{- else -}}
{{- $cfg := default dict $root.Values.config -}}
{{- if hasKey $cfg $key -}}{{- int (get $cfg $key) -}}{{- else -}}{{- $default -}}{{- end -}}
{{- end -}}
{{- end -}}

{{- define "rampart.drainDelaySeconds" -}}{{ include "rampart.topLevelInt" (list . "drain_delay_s" 0) }}{{- end -}}
{{- define "rampart.shutdownTimeoutSeconds" -}}{{ include "rampart.topLevelInt" (list . "shutdown_timeout_s" 30) }}{{- end -}}

{{/* terminationGracePeriodSeconds: the drain (drain_delay_s + shutdown_timeout_s) plus a margin. */}}
{{- define "rampart.terminationGraceSeconds" -}}
{{- $drain := add (int (include "rampart.drainDelaySeconds" .)) (int (include "rampart.shutdownTimeoutSeconds" .)) -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- add $drain (int .Values.terminationGraceMarginSeconds) -}}
{{- else -}}
{{- $grace := int .Values.terminationGracePeriodSeconds -}}
{{- if lt $grace $drain -}}
{{- fail (printf "terminationGracePeriodSeconds (%d) is shorter than the drain: drain_delay_s (%s) + shutdown_timeout_s (%s) = %d s; Kubernetes would kill streams still draining. Raise it or leave it empty (computed)." $grace (include "rampart.drainDelaySeconds" .) (include "rampart.shutdownTimeoutSeconds" .) $drain) -}}
{{- end -}}
{{- $grace -}}
{{- end -}}
{{- end -}}

{{- define "rampart.probeScheme" -}}
{{- if .Values.tls.enabled -}}HTTPS{{- else -}}HTTP{{- end -}}
{{- end -}}

{{/* The chart's own Secret (quickstartSecret). */}}
{{- define "rampart.quickstartSecretName" -}}{{ include "rampart.fullname" . }}-quickstart{{- end -}}

{{/*
Where each secret value comes from: dict name, key; empty when nowhere. The existingSecret wins,
then quickstartSecret when it carries that value.
*/}}
{{- define "rampart.secretRef" -}}
{{- $root := index . 0 -}}
{{- $existing := index . 1 -}}
{{- $key := index . 2 -}}
{{- $quickValue := index . 3 -}}
{{- $quickKey := index . 4 -}}
{{- if $existing -}}
{{- toYaml (dict "name" $existing "key" $key) -}}
{{- else if and $root.Values.quickstartSecret.enabled $quickValue -}}
{{- toYaml (dict "name" (include "rampart.quickstartSecretName" $root) "key" $quickKey) -}}
{{- end -}}
{{- end -}}

{{- define "rampart.apiKeysRef" -}}
{{- $ref := include "rampart.secretRef" (list . .Values.apiKeys.existingSecret .Values.apiKeys.key .Values.quickstartSecret.apiKeys "keys.txt") -}}
{{- if $ref -}}{{ $ref }}{{- else -}}{{ toYaml (dict "name" (printf "%s-api-keys" (include "rampart.fullname" .)) "key" .Values.apiKeys.key) }}{{- end -}}
{{- end -}}

{{- define "rampart.feedbackSecretRef" -}}
{{- include "rampart.secretRef" (list . .Values.feedback.linkSecret.existingSecret .Values.feedback.linkSecret.key .Values.quickstartSecret.feedbackSecret "feedback-secret") -}}
{{- end -}}

{{- define "rampart.postgresRef" -}}
{{- include "rampart.secretRef" (list . .Values.fleet.postgres.existingSecret .Values.fleet.postgres.key .Values.quickstartSecret.postgresUrl "postgres-url") -}}
{{- end -}}

{{/* dict accessKeyId (ref), secretAccessKey (ref) of a credentials block, or empty. */}}
{{- define "rampart.awsRefs" -}}
{{- $root := index . 0 -}}
{{- $creds := index . 1 -}}
{{- if $creds.existingSecret -}}
{{- toYaml (dict "accessKeyId" (dict "name" $creds.existingSecret "key" $creds.accessKeyIdKey) "secretAccessKey" (dict "name" $creds.existingSecret "key" $creds.secretAccessKeyKey)) -}}
{{- else if and $root.Values.quickstartSecret.enabled $root.Values.quickstartSecret.awsAccessKeyId -}}
{{- $name := include "rampart.quickstartSecretName" $root -}}
{{- toYaml (dict "accessKeyId" (dict "name" $name "key" "AWS_ACCESS_KEY_ID") "secretAccessKey" (dict "name" $name "key" "AWS_SECRET_ACCESS_KEY")) -}}
{{- end -}}
{{- end -}}

{{- define "rampart.auditAwsRefs" -}}
{{- include "rampart.awsRefs" (list . .Values.audit.s3.credentials) -}}
{{- end -}}

{{- define "rampart.modelsAwsRefs" -}}
{{- $refs := include "rampart.awsRefs" (list . .Values.models.s3.credentials) -}}
{{- if $refs -}}{{ $refs }}{{- else -}}{{ include "rampart.auditAwsRefs" . }}{{- end -}}
{{- end -}}

{{- define "rampart.secretEnv" -}}
{{- $name := index . 0 -}}
{{- $ref := index . 1 | fromYaml -}}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $ref.name }}
      key: {{ $ref.key | quote }}
{{- end -}}

{{/* The environment of the server and of the doctor init container. */}}
{{- define "rampart.env" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
# The replica id: the fleet's heartbeats and decisions, log lines, traces, the audit origin.
- name: RAMPART_REPLICA
  value: "$(POD_NAME)"
# The image sets these (the environment wins over rampart.toml): the same values as the file's.
- name: RAMPART_LISTEN
  value: {{ printf "0.0.0.0:%d" (int .Values.ports.http) | quote }}
- name: RAMPART_GRPC_LISTEN
  value: {{ printf "0.0.0.0:%d" (int .Values.ports.grpc) | quote }}
- name: RAMPART_REPO
  value: {{ include "rampart.paths.models" . | quote }}
# The probes as the Deployment sets them, for `rampart doctor` (rampart.probe_timings).
- name: RAMPART_PROBE_LIVENESS_PERIOD_S
  value: {{ .Values.probes.liveness.periodSeconds | int | quote }}
- name: RAMPART_PROBE_LIVENESS_TIMEOUT_S
  value: {{ .Values.probes.liveness.timeoutSeconds | int | quote }}
- name: RAMPART_PROBE_READINESS_PERIOD_S
  value: {{ .Values.probes.readiness.periodSeconds | int | quote }}
- name: RAMPART_PROBE_READINESS_TIMEOUT_S
  value: {{ .Values.probes.readiness.timeoutSeconds | int | quote }}
- name: RAMPART_PROBE_STARTUP_BUDGET_S
  value: {{ mul (int .Values.probes.startup.failureThreshold) (int .Values.probes.startup.periodSeconds) | quote }}
- name: RAMPART_TERMINATION_GRACE_S
  value: {{ include "rampart.terminationGraceSeconds" . | quote }}
{{- if and (not .Values.apiKeys.insecureNoAuth) (eq .Values.apiKeys.mountAs "env") }}
{{ include "rampart.secretEnv" (list "RAMPART_API_KEYS" (include "rampart.apiKeysRef" .)) }}
{{- end }}
{{- with include "rampart.feedbackSecretRef" . }}
{{ include "rampart.secretEnv" (list "RAMPART_FEEDBACK_SECRET" .) }}
{{- end }}
{{- if .Values.fleet.enabled }}
{{ include "rampart.secretEnv" (list "RAMPART_FLEET_POSTGRES_URL" (include "rampart.postgresRef" .)) }}
{{- if .Values.fleet.feedbackStore }}
{{ include "rampart.secretEnv" (list "RAMPART_FEEDBACK_POSTGRES_URL" (include "rampart.postgresRef" .)) }}
{{- end }}
{{- end }}
{{- if .Values.audit.s3.enabled }}
{{- $aws := include "rampart.auditAwsRefs" . | fromYaml }}
{{ include "rampart.secretEnv" (list "AWS_ACCESS_KEY_ID" (toYaml $aws.accessKeyId)) }}
{{ include "rampart.secretEnv" (list "AWS_SECRET_ACCESS_KEY" (toYaml $aws.secretAccessKey)) }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The mounts of the server and of the doctor init container. */}}
{{- define "rampart.volumeMounts" -}}
- name: config
  mountPath: {{ include "rampart.paths.config" . }}
  readOnly: true
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ include "rampart.paths.home" . }}
- name: models
  mountPath: {{ include "rampart.paths.models" . }}
  {{- if eq .Values.models.source "persistentVolumeClaim" }}
  readOnly: {{ .Values.models.persistentVolumeClaim.readOnly }}
  {{- with .Values.models.persistentVolumeClaim.subPath }}
  subPath: {{ . }}
  {{- end }}
  {{- end }}
- name: audit
  mountPath: {{ include "rampart.paths.audit" . }}
- name: feedback
  mountPath: {{ include "rampart.paths.feedback" . }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Resources with the GPUs added (server and doctor). */}}
{{- define "rampart.resources" -}}
{{- $res := deepCopy (default dict .Values.resources) -}}
{{- if .Values.gpu.enabled -}}
{{- $limits := get $res "limits" | default dict -}}
{{- $requests := get $res "requests" | default dict -}}
{{- $_ := set $limits .Values.gpu.resourceName (int .Values.gpu.count) -}}
{{- $_ := set $requests .Values.gpu.resourceName (int .Values.gpu.count) -}}
{{- $_ := set $res "limits" $limits -}}
{{- $_ := set $res "requests" $requests -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/*
Autoscaling signals: the name prometheus-adapter serves per pod (files/prometheus-adapter-rules.yaml)
and the same signal over the release's pods for KEDA, with KEDA's metric type.
*/}}
{{- define "rampart.kedaTrigger" -}}
{{- $root := index . 0 -}}
{{- $metric := index . 1 -}}
{{- $sel := printf "namespace=%q,pod=~%q" $root.Release.Namespace (printf "%s-[a-z0-9]+-[a-z0-9]+" (include "rampart.fullname" $root)) -}}
{{- if eq $metric.name "rampart_concurrency" -}}
{{- toYaml (dict "query" (printf "sum(avg_over_time(rampart_requests_in_flight{%s}[1m]))\n+ sum(avg_over_time(rampart_queue_depth{%s}[1m]))" $sel $sel) "metricType" "AverageValue") -}}
{{- else if eq $metric.name "rampart_queue_depth" -}}
{{- toYaml (dict "query" (printf "sum(rampart_queue_depth{%s})" $sel) "metricType" "AverageValue") -}}
{{- else if eq $metric.name "rampart_tensor_queue_depth" -}}
{{- toYaml (dict "query" (printf "sum(rampart_tensor_queue_depth{%s})" $sel) "metricType" "AverageValue") -}}
{{- else if eq $metric.name "rampart_shed_per_second" -}}
{{- toYaml (dict "query" (printf "sum(rate(rampart_rejected_requests_total{%s,reason=~\"queue_full|shedding|queue_timeout\"}[2m]))" $sel) "metricType" "AverageValue") -}}
{{- else if eq $metric.name "rampart_predicted_wait_seconds" -}}
{{- toYaml (dict "query" (printf "max(rampart_capacity_predicted_wait_seconds{%s})" $sel) "metricType" "Value") -}}
{{- else if eq $metric.name "rampart_ttft_p99_seconds" -}}
{{- toYaml (dict "query" (printf "histogram_quantile(0.99, sum by (le) (rate(rampart_time_to_first_token_seconds_bucket{%s}[2m])))" $sel) "metricType" "Value") -}}
{{- else -}}
{{- fail (printf "autoscaling.metrics: unknown signal %s" $metric.name) -}}
{{- end -}}
{{- end -}}

{{/* Settings that cannot work together fail the render here, with what to change. */}}
{{- define "rampart.validate" -}}
{{- $v := .Values -}}
{{- if and $v.autoscaling.enabled $v.keda.enabled -}}
{{- fail "autoscaling.enabled and keda.enabled are both on: a ScaledObject makes its own HPA, and two autoscalers would fight over the replicas. Turn one off." -}}
{{- end -}}
{{- $_ := include "rampart.terminationGraceSeconds" . -}}
{{- if $v.podDisruptionBudget.enabled -}}
{{- if eq (kindIs "invalid" $v.podDisruptionBudget.maxUnavailable) (kindIs "invalid" $v.podDisruptionBudget.minAvailable) -}}
{{- fail "podDisruptionBudget: set one of maxUnavailable or minAvailable (the other null)." -}}
{{- end -}}
{{- end -}}
{{- if and (not $v.configToml) $v.memory.modelsBudgetFraction (not (dig "memory" "models_budget" "" (default dict $v.config))) (not (dig "limits" "memory" "" (default dict $v.resources))) -}}
{{- fail "memory.modelsBudgetFraction is a share of the container's memory limit, and resources.limits.memory is not set: set the limit, or set memory.modelsBudgetFraction to \"\"." -}}
{{- end -}}
{{- if and $v.fleet.enabled (not (include "rampart.postgresRef" .)) -}}
{{- fail "fleet.enabled needs PostgreSQL's URL: fleet.postgres.existingSecret (a Secret with the key fleet.postgres.key), or quickstartSecret.postgresUrl." -}}
{{- end -}}
{{- if $v.audit.s3.enabled -}}
{{- if not $v.audit.s3.bucket -}}{{- fail "audit.s3.enabled needs audit.s3.bucket." -}}{{- end -}}
{{- if not (include "rampart.auditAwsRefs" .) -}}
{{- fail "audit.s3.enabled needs credentials: audit.s3.credentials.existingSecret, or quickstartSecret.awsAccessKeyId and awsSecretAccessKey." -}}
{{- end -}}
{{- end -}}
{{- if eq $v.models.source "persistentVolumeClaim" -}}
{{- if not $v.models.persistentVolumeClaim.claimName -}}{{- fail "models.source persistentVolumeClaim needs models.persistentVolumeClaim.claimName." -}}{{- end -}}
{{- else if eq $v.models.source "image" -}}
{{- if or (not $v.models.image.repository) (not (or $v.models.image.tag $v.models.image.digest)) -}}
{{- fail "models.source image needs models.image.repository and models.image.tag (the model version) or digest." -}}
{{- end -}}
{{- else if eq $v.models.source "s3" -}}
{{- if and (not $v.models.s3.args) (or (not $v.models.s3.url) (not $v.models.s3.models)) -}}
{{- fail "models.source s3 needs models.s3.url and models.s3.models (NAME@VERSION), or models.s3.args." -}}
{{- end -}}
{{- if not (include "rampart.modelsAwsRefs" .) -}}
{{- fail "models.source s3 needs credentials: models.s3.credentials.existingSecret (or audit.s3's, or quickstartSecret)." -}}
{{- end -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- if not $v.tls.existingSecret -}}{{- fail "tls.enabled needs tls.existingSecret (a kubernetes.io/tls Secret; with clientAuth, its ca.crt too)." -}}{{- end -}}
{{- if eq $v.tls.clientAuth "required" -}}
{{- fail "tls.clientAuth required refuses the kubelet's probes (they present no certificate): use optional, and require certificates at the ingress." -}}
{{- end -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled (not $v.configToml) -}}
{{- if and $v.fleet.enabled (not $v.networkPolicy.egress.postgres.to) -}}
{{- fail "networkPolicy.enabled with fleet.enabled: list PostgreSQL in networkPolicy.egress.postgres.to, or the policy denies the fleet its database." -}}
{{- end -}}
{{- if and (or $v.audit.s3.enabled (eq $v.models.source "s3")) (not $v.networkPolicy.egress.s3.to) -}}
{{- fail "networkPolicy.enabled with S3 (audit.s3 or models.source s3): list the S3 endpoint in networkPolicy.egress.s3.to." -}}
{{- end -}}
{{- if and (dig "tracing" "enabled" false (default dict $v.config)) (not $v.networkPolicy.egress.otlp.to) -}}
{{- fail "networkPolicy.enabled with config.tracing.enabled: list the OTLP collector in networkPolicy.egress.otlp.to." -}}
{{- end -}}
{{- end -}}
{{- if and $v.monitoring.serviceMonitor.enabled (not $v.monitoring.serviceMonitor.job) -}}
{{- fail "monitoring.serviceMonitor.job is empty: the shipped rules and dashboards select job=\"rampart\"." -}}
{{- end -}}
{{- end -}}
