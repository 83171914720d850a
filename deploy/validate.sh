#!/usr/bin/env bash
# Validates every manifest in deploy/ against the Kubernetes API schemas (strict: unknown fields
# fail), with the `kubernetes-validate` package from PyPI installed into a venv under target/.
#   bash deploy/validate.sh
set -euo pipefail
cd "$(dirname "$0")/.."

KUBERNETES_VALIDATE_VERSION=1.37.0
KUBERNETES_VERSION=${KUBERNETES_VERSION:-1.31.0}
venv=target/deploy-venv

if [ ! -x "$venv/bin/kubernetes-validate" ]; then
  if ! python3 -m venv "$venv" 2>/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv
    python3 -m venv "$venv"
  fi
  "$venv/bin/pip" install -q "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION"
fi
"$venv/bin/kubernetes-validate" --strict --kubernetes-version "$KUBERNETES_VERSION" deploy/*.yaml
