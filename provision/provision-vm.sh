#!/usr/bin/env bash
# Provision one agentic-sandbox VM from a shell, with or without a running server.
# Usage: provision/provision-vm.sh NAME [--loadout FILE|NAME] [--cpus N] [--memory MiB]
#        [--disk GiB] [--ssh-key FILE] [--network isolated|allowlist|nat] [--allow HOST:PORT …]
#        [--start] [--wait]
#        [--from-snapshot INSTANCE/SNAPSHOT] [--dry-run] [--json]      (--help for all)
# It runs the project's Python (the .venv made by scripts/install.sh, or $SANDBOX_PYTHON).
set -euo pipefail
here=$(cd "$(dirname "$(readlink -f "$0")")" && pwd)
root=$(dirname "$here")
py=${SANDBOX_PYTHON:-$root/.venv/bin/python}
if [ ! -x "$py" ]; then
  echo "provision-vm.sh: no Python environment at $py (run scripts/install.sh first)" >&2
  exit 2
fi
cd "$root"
exec "$py" -m agentic_sandbox.provision "$@"
