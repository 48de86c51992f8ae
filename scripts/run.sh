#!/usr/bin/env bash
# Command one: install what is missing, start libvirtd/virtlogd, run the server (SQLite default).
# Prints the dashboard URL and the admin token. Ctrl-C stops the server.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
scripts/services.sh

# People read this console: plain log lines unless asked for JSON (SANDBOX_LOG_FORMAT=json).
export SANDBOX_LOG_FORMAT=${SANDBOX_LOG_FORMAT:-text}
data_dir=${SANDBOX_DATA_DIR:-$([ "$(id -u)" = 0 ] && echo /var/lib/agentic-sandbox || echo "$HOME/.local/share/agentic-sandbox")}
token_file="$data_dir/admin-token"
(
  for _ in $(seq 1 300); do
    if [ -s "$token_file" ] && curl -fsS -o /dev/null "http://${SANDBOX_HTTP_LISTEN:-127.0.0.1:8122}/readyz" 2>/dev/null; then
      printf '\n  admin token: %s\n  (from %s; sign in to the dashboard with it)\n\n' "$(cat "$token_file")" "$token_file"
      exit 0
    fi
    sleep 0.2
  done
) &
exec .venv/bin/sandbox-server "$@"
