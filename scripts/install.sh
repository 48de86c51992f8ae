#!/usr/bin/env bash
# Installs what agentic-sandbox needs on Debian 12, idempotently.
#   scripts/install.sh            runtime: apt packages, .venv with the server, dashboard assets
#   scripts/install.sh --test     also what the test tiers need (PostgreSQL, Prometheus, Chromium…)
set -euo pipefail
cd "$(dirname "$0")/.."

want_test=0
[ "${1:-}" = "--test" ] && want_test=1

RUNTIME_APT=(
  python3 python3-venv python3-dev gcc pkg-config
  qemu-system-x86 qemu-utils libvirt-daemon-system libvirt-clients libvirt-dev
  debootstrap genisoimage e2fsprogs openssh-client nodejs npm ca-certificates openssl
)
TEST_APT=(
  postgresql prometheus chromium busybox-static cpio linux-image-cloud-amd64 iproute2 util-linux
)

say() { printf '==> %s\n' "$*"; }

missing=()
pkgs=("${RUNTIME_APT[@]}")
[ "$want_test" = 1 ] && pkgs+=("${TEST_APT[@]}")
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js may come from elsewhere (nodesource); then the Debian packages are not needed.
if command -v node >/dev/null && command -v npm >/dev/null; then
  missing=("${missing[@]/nodejs}"); missing=("${missing[@]/npm}")
fi
read -r -a missing <<<"${missing[*]:-}"
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages: ${missing[*]} — run this as root or install them first" >&2
    exit 1
  fi
  say "apt-get install ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
extras="server,cli"
[ "$want_test" = 1 ] && extras="server,cli,test"
hash=$(sha256sum pyproject.toml | cut -c1-16)
stamp=".venv/.installed-$extras-$hash"
# A test install is a superset of the runtime one.
if [ ! -f "$stamp" ] && [ ! -f ".venv/.installed-server,cli,test-$hash" ]; then
  say "pip install -e .[$extras] (log: .venv/pip-install.log)"
  if ! { .venv/bin/python -m pip install --upgrade pip \
         && .venv/bin/python -m pip install -e ".[$extras]"; } >.venv/pip-install.log 2>&1; then
    tail -n 30 .venv/pip-install.log >&2
    echo "pip install failed (full log: .venv/pip-install.log)" >&2
    exit 1
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi

lock=broker/dashboard/package-lock.json
dstamp="broker/dashboard/node_modules/.installed-$(sha256sum $lock | cut -c1-16)"
if [ ! -f "$dstamp" ]; then
  say "npm ci (dashboard: xterm.js)"
  (cd broker/dashboard && npm ci --no-audit --no-fund --loglevel=error >/dev/null) \
    || { echo "npm ci failed in broker/dashboard" >&2; exit 1; }
  touch "$dstamp"
fi
