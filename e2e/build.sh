#!/usr/bin/env bash
# Build the local e2e control plane's binaries from their Go modules (through the Go module
# proxy), once per version, into ${XDG_CACHE_HOME:-$HOME/.cache}/kuberl/e2e/<component>-<version>/.
#
#   e2e/build.sh              build whatever is missing (a no-op when everything is cached)
#   e2e/build.sh kwok etcd    only those components
#   e2e/build.sh --print-dir  print the cache root and exit
#
# Components: kubernetes (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl),
# etcd, kwok (+ its stage configs), kuberay (the ray-operator binary + its CRDs), kueue (its manager
# + CRDs, webhook configurations, ClusterRole), helm, and prometheus (Debian's package, unpacked: not built). Versions come from e2e/versions.env. Each component is built in a temporary Go module and a
# temporary output dir that is renamed into place only on success, so an interrupted build
# leaves nothing half-made and a rerun starts it again; a per-component lock lets two builds
# run at once safely. Compilation runs under `nice -n 19` (KUBERL_E2E_NICE=<level> or 0).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
. "$here/versions.env"
# Which supported KubeRay to build (e2e/controlplane/versions.py reads the same override).
case ${KUBERL_E2E_KUBERAY:-} in
  "") ;;
  newest) KUBERAY_VERSION=$KUBERAY_NEWEST_VERSION ;;
  *) KUBERAY_VERSION=$KUBERL_E2E_KUBERAY ;;
esac

CACHE_ROOT=${KUBERL_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kuberl/e2e}
NICE_LEVEL=${KUBERL_E2E_NICE:-19}  # 0: don't nice
NICE=""; [[ $NICE_LEVEL == 0 ]] || NICE="nice -n $NICE_LEVEL"
ALL=(etcd kubernetes kwok kuberay kueue helm prometheus)

if [[ ${1:-} == --print-dir ]]; then echo "$CACHE_ROOT"; exit 0; fi
if [[ ${1:-} == -h || ${1:-} == --help ]]; then sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0; fi

command -v go >/dev/null || { echo "build.sh: needs Go (1.26+) on PATH" >&2; exit 1; }
mkdir -p "$CACHE_ROOT"

# The user's own go env stays in force (GOPROXY, GOMODCACHE, GOCACHE: the module and build
# caches are shared with other Go work). Forced: no cgo (static binaries), no VCS stamping.
export CGO_ENABLED=0
export GOFLAGS="-buildvcs=false ${GOFLAGS:-}"
GOFLAGS=${GOFLAGS//-mod=vendor/}
LDFLAGS_BASE="-s -w"
BUILD=(go build -trimpath)

log() { printf '[build.sh %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

component_version() {
  case $1 in
    etcd) echo "$ETCD_VERSION" ;;
    kubernetes) echo "$KUBERNETES_VERSION" ;;
    kwok) echo "$KWOK_VERSION" ;;
    kuberay) echo "$KUBERAY_VERSION" ;;
    kueue) echo "$KUEUE_VERSION" ;;
    helm) echo "$HELM_VERSION" ;;
    prometheus) echo "$PROMETHEUS_DEB_VERSION" ;;
    *) echo "build.sh: unknown component '$1' (known: ${ALL[*]})" >&2; return 1 ;;
  esac
}

# A fresh main module in $1 that requires the main packages $3... at version $2 (go get
# resolves their dependencies and fills go.sum).
new_module() {
  local dir=$1 ver=$2; shift 2
  (cd "$dir" && go mod init kuberl.local/e2e-build >/dev/null 2>&1 \
     && $NICE go get "${@/%/@$ver}" >&2)
}

build_etcd() {  # $1 tmp module dir, $2 output dir
  local v=$ETCD_VERSION
  new_module "$1" "$v" go.etcd.io/etcd/server/v3
  # server/v3's main package is the etcd binary (its go.mod's ../ replaces apply only in-repo).
  (cd "$1" && $NICE "${BUILD[@]}" \
     -ldflags "$LDFLAGS_BASE" -o "$2/etcd" go.etcd.io/etcd/server/v3)
}

build_kubernetes() {
  local v=$KUBERNETES_VERSION mm minor patch
  mm=${v#v1.}; minor=${mm%%.*}; patch=${mm#*.}; patch=${patch%%[-+]*}
  local staging_ver="v0.$minor.${mm#*.}"
  (cd "$1" && go mod init kuberl.local/e2e-build >/dev/null 2>&1)
  # k8s.io/kubernetes requires its staging modules at v0.0.0 and replaces them with
  # ./staging/src/k8s.io/X, which only works inside its own repo. Derive the same list from its
  # go.mod and point each at the published k8s.io/X v0.<minor>.<patch> of this release.
  local gomod
  gomod=$(cd "$1" && go mod download -json "k8s.io/kubernetes@$v" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  [[ -f $gomod ]] || { log "kubernetes: no go.mod for k8s.io/kubernetes@$v"; return 1; }
  local repl=() m
  while read -r m; do repl+=("-replace=$m=$m@$staging_ver"); done < <(
    sed -n 's#^[[:space:]]*\(k8s\.io/[A-Za-z0-9._-]*\)[[:space:]]*=>[[:space:]]*\./staging/src/k8s\.io/.*#\1#p' "$gomod")
  (( ${#repl[@]} > 10 )) || { log "kubernetes: found only ${#repl[@]} staging replaces in $gomod"; return 1; }
  log "kubernetes: ${#repl[@]} staging modules -> $staging_ver"
  local cmds=(k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager
              k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl)
  (cd "$1" && go mod edit "${repl[@]}" && $NICE go get "${cmds[@]/%/@$v}" >&2)
  # Stamp the version the way the release build does (kubectl version, /version, discovery).
  local X="-X k8s.io/component-base/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=1"
  X+=" -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
  X+=" -X k8s.io/client-go/pkg/version.gitVersion=$v -X k8s.io/client-go/pkg/version.gitMajor=1"
  X+=" -X k8s.io/client-go/pkg/version.gitMinor=$minor -X k8s.io/client-go/pkg/version.gitTreeState=clean"
  (cd "$1" && $NICE "${BUILD[@]}" -ldflags "$LDFLAGS_BASE $X" -o "$2/" "${cmds[@]}")
}

build_kwok() {
  local v=$KWOK_VERSION dir
  new_module "$1" "$v" sigs.k8s.io/kwok/cmd/kwok
  (cd "$1" && $NICE "${BUILD[@]}" -ldflags "$LDFLAGS_BASE" \
     -o "$2/kwok" sigs.k8s.io/kwok/cmd/kwok)
  # The stage configs kwok ships (node-initialize, node-heartbeat, pod-ready, ...).
  dir=$(cd "$1" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)
  mkdir -p "$2/stages"
  cp -r "$dir/kustomize/stage/." "$2/stages/"
  find "$2/stages" -type d -name testdata -prune -exec rm -rf {} +
  find "$2/stages" -type f ! -name '*.yaml' -delete
  chmod -R u+w "$2/stages"
}

build_kuberay() {
  local v=$KUBERAY_VERSION dir
  new_module "$1" "$v" github.com/ray-project/kuberay/ray-operator
  (cd "$1" && $NICE "${BUILD[@]}" -ldflags "$LDFLAGS_BASE" \
     -o "$2/kuberay-operator" github.com/ray-project/kuberay/ray-operator)
  dir=$(cd "$1" && go list -m -f '{{.Dir}}' github.com/ray-project/kuberay/ray-operator)
  mkdir -p "$2/crds" "$2/rbac"
  cp "$dir"/config/crd/bases/*.yaml "$2/crds/"
  # The operator's ClusterRole (e2e/cluster.py runs the operator as a ServiceAccount bound to it).
  cp "$dir"/config/rbac/role.yaml "$2/rbac/"
  chmod -R u+w "$2/crds" "$2/rbac"
}

build_kueue() {
  local v=$KUEUE_VERSION dir
  new_module "$1" "$v" sigs.k8s.io/kueue/cmd/kueue
  # (its version, as Kueue's release build stamps it: else it reports v0.0.0-main)
  (cd "$1" && $NICE "${BUILD[@]}" \
     -ldflags "$LDFLAGS_BASE -X sigs.k8s.io/kueue/pkg/version.GitVersion=$v" \
     -o "$2/kueue" sigs.k8s.io/kueue/cmd/kueue)
  dir=$(cd "$1" && go list -m -f '{{.Dir}}' sigs.k8s.io/kueue)
  mkdir -p "$2/crds" "$2/rbac" "$2/webhook"
  cp "$dir"/config/components/crd/bases/*.yaml "$2/crds/"
  # The manager's ClusterRole, its Role on Secrets of its namespace, the ClusterRole its
  # metrics endpoint needs (token and access reviews), and the webhook configurations
  # e2e/cluster.py points at the manager's webhook server on 127.0.0.1 (kustomize would point
  # them at a Service).
  cp "$dir"/config/components/rbac/{role,manager_secrets_role,metrics_auth_role}.yaml "$2/rbac/"
  cp "$dir"/config/components/webhook/manifests.yaml "$2/webhook/"
  chmod -R u+w "$2/crds" "$2/rbac" "$2/webhook"
}

build_helm() {
  local v=$HELM_VERSION
  new_module "$1" "$v" helm.sh/helm/v3/cmd/helm
  (cd "$1" && $NICE "${BUILD[@]}" \
     -ldflags "$LDFLAGS_BASE -X helm.sh/helm/v3/internal/version.version=$v" \
     -o "$2/helm" helm.sh/helm/v3/cmd/helm)
}

# Debian's prometheus package at exactly PROMETHEUS_DEB_VERSION, unpacked (no dpkg install, no
# root needed when the apt lists are present): its binaries are static Go programs.
build_prometheus() {
  local v=$PROMETHEUS_DEB_VERSION
  command -v apt-get >/dev/null || { log "prometheus: needs apt-get (a Debian-based machine)"; return 1; }
  if ! (cd "$1" && apt-get download "prometheus=$v"); then
    # A machine whose package lists were never fetched: fetch them (root only) and retry.
    (( EUID == 0 )) || { log "prometheus: apt-get download failed; run 'apt-get update' as root"; return 1; }
    apt-get update -qq && (cd "$1" && apt-get download "prometheus=$v")
  fi
  dpkg-deb -x "$1"/prometheus_*.deb "$1/root"
  cp "$1/root/usr/bin/prometheus" "$1/root/usr/bin/promtool" "$2/"
  "$2/prometheus" --version
}

build_one() {
  local c=$1 v final
  v=$(component_version "$c")
  final="$CACHE_ROOT/$c-$v"
  [[ -d $final ]] && { log "$c $v: cached ($final)"; return 0; }
  exec 9>"$CACHE_ROOT/.$c-$v.lock"
  flock 9
  [[ -d $final ]] && { log "$c $v: cached (built meanwhile)"; exec 9>&-; return 0; }
  # What an interrupted or failed build of this component left (we hold its lock).
  rm -rf "$CACHE_ROOT/.tmp-$c-$v".*
  local tmp t0 rc=0
  tmp=$(mktemp -d "$CACHE_ROOT/.tmp-$c-$v.XXXXXX")
  mkdir -p "$tmp/mod" "$tmp/out"
  log "$c $v: building (log: $tmp/build.log)"
  t0=$(date +%s)
  # Not `build_$c || rc=$?`: errexit is off inside a function called from an || list, so a
  # failed step would go unnoticed and a half-made build would be cached as done.
  set +e
  (set -e; "build_$c" "$tmp/mod" "$tmp/out") >"$tmp/build.log" 2>&1
  rc=$?
  set -e
  if (( rc != 0 )); then
    tail -n 40 "$tmp/build.log" >&2
    log "$c $v: FAILED (exit $rc); kept $tmp for inspection"
    exec 9>&-
    return "$rc"
  fi
  local secs=$(( $(date +%s) - t0 ))
  [[ ! -f $tmp/mod/go.mod ]] || cp "$tmp/mod/go.mod" "$tmp/out/build.go.mod"
  printf '{"component": "%s", "version": "%s", "seconds": %d, "go": "%s", "built": "%s"}\n' \
    "$c" "$v" "$secs" "$(go env GOVERSION)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >"$tmp/out/build.json"
  mv -T "$tmp/out" "$final"
  rm -rf "$tmp"
  exec 9>&-
  log "$c $v: built in ${secs}s -> $final"
}

want=("$@")
(( ${#want[@]} )) || want=("${ALL[@]}")
for c in "${want[@]}"; do build_one "$c"; done
