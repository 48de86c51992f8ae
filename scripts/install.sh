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
# Dependencies come from the committed locks (exact versions with hashes: nothing upstream enters
# until tools/lock.sh bumps it); the project itself is installed on top, without dependencies.
lockfile=requirements/server.txt
[ "$want_test" = 1 ] && lockfile=requirements/test.txt
hash=$(cat pyproject.toml "$lockfile" | sha256sum | cut -c1-16)
stamp=".venv/.installed-$(basename "$lockfile" .txt)-$hash"
# A test install is a superset of the runtime one.
test_stamp=".venv/.installed-test-$(cat pyproject.toml requirements/test.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] && [ ! -f "$test_stamp" ]; then
  say "pip install -r $lockfile, then the project (log: .venv/pip-install.log)"
  if ! { .venv/bin/python -m pip install --require-hashes --no-deps -r "$lockfile" \
         && .venv/bin/python -m pip install --no-deps --no-build-isolation -e .; } \
       >.venv/pip-install.log 2>&1; then
    tail -n 30 .venv/pip-install.log >&2
    echo "pip install failed (full log: .venv/pip-install.log)" >&2
    exit 1
  fi
  rm -f .venv/.installed-*
  touch "$stamp"
fi

dash=agentic_sandbox/broker/dashboard
dstamp="$dash/node_modules/.installed-$(sha256sum $dash/package-lock.json | cut -c1-16)"
if [ ! -f "$dstamp" ]; then
  say "npm ci (dashboard: xterm.js)"
  (cd $dash && npm ci --no-audit --no-fund --loglevel=error >/dev/null) \
    || { echo "npm ci failed in $dash" >&2; exit 1; }
  touch "$dstamp"
fi
# The files the page loads, copied where the package data (and so a wheel) has them.
vendor=$dash/vendor
if [ ! -f "$vendor/.from-$(basename "$dstamp")" ]; then
  rm -rf "$vendor.tmp" && mkdir -p "$vendor.tmp/xterm" "$vendor.tmp/xterm-addon-fit"
  cp -r $dash/node_modules/@xterm/xterm/{lib,css,LICENSE} "$vendor.tmp/xterm/"
  cp -r $dash/node_modules/@xterm/addon-fit/{lib,LICENSE} "$vendor.tmp/xterm-addon-fit/"
  touch "$vendor.tmp/.from-$(basename "$dstamp")"
  rm -rf "$vendor" && mv "$vendor.tmp" "$vendor"
fi
