#!/usr/bin/env bash
# Validates deploy/ offline: renders base and overlay with kustomize, checks
# them against the Kubernetes schemas (strict) for the lowest supported
# version, lints the YAML, checks our own rules, and checks and unit-tests the
# Prometheus alerting rules with promtool.
# Usage: deploy/validate.sh [VENV_DIR]   (tools are installed into the venv)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:-${TMPDIR:-/tmp}/stateseal-deploy-venv}
MIN_K8S=1.27.0   # native gRPC probes are GA from 1.27

if ! command -v kubectl >/dev/null 2>&1; then
  echo "kubectl not found; installing Debian's package"
  apt-get update -qq && apt-get install -y -qq kubectl
fi
if [ ! -x "$venv/bin/kubernetes-validate" ] || [ ! -x "$venv/bin/yamllint" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q 'kubernetes-validate==1.37.0' 'yamllint==1.38.0' 'PyYAML==6.0.4'
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
kubectl kustomize "$here/base" > "$out/base.yaml"
kubectl kustomize "$here/overlays/single-node" > "$out/single-node.yaml"
"$venv/bin/kubernetes-validate" --strict --quiet -k "$MIN_K8S" "$out/base.yaml" "$out/single-node.yaml"
echo "kubernetes-validate --strict -k $MIN_K8S: ok"
"$venv/bin/yamllint" -c "$here/.yamllint.yaml" "$here" "$out/base.yaml" "$out/single-node.yaml"
echo "yamllint: ok"
"$venv/bin/python" "$here/check_rules.py" "$out/base.yaml" "$out/single-node.yaml"

# Alerting rules: syntax, and unit tests that fire and do not fire each alert.
if ! command -v promtool >/dev/null 2>&1; then
  echo "promtool not found; installing Debian's prometheus package"
  apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus
fi
(cd "$here/alerts" && promtool check rules stateseal-rules.yaml && promtool test rules stateseal-rules.test.yaml)
