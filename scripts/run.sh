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
listen=${SANDBOX_HTTP_LISTEN:-127.0.0.1:8122}
# Command one again while its server runs: say where it is instead of starting a second one that
# the data dir's lock would refuse.
if [ -e "$data_dir/server.lock" ] && ! flock -n "$data_dir/server.lock" true 2>/dev/null; then
  printf 'agentic-sandbox server is already running for %s\n' "$data_dir"
  printf '  dashboard:   http://%s/\n' "$listen"
  [ -s "$token_file" ] && printf '  admin token: %s\n  (from %s)\n' "$(cat "$token_file")" "$token_file"
  printf 'Stop it (Ctrl-C where it runs) to start it again.\n'
  exit 0
fi
(
  for _ in $(seq 1 300); do
    if [ -s "$token_file" ] && curl -fsS -o /dev/null "http://$listen/readyz" 2>/dev/null; then
      printf '\n  admin token: %s\n  (from %s; sign in to the dashboard with it)\n\n' "$(cat "$token_file")" "$token_file"
      exit 0
    fi
    sleep 0.2
  done
) &
exec .venv/bin/sandbox-server "$@"
