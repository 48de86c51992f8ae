#!/usr/bin/env bash
# A private, throw-away PostgreSQL cluster on loopback for the postgres test tier.
#   scripts/pg-test-cluster.sh start DIR   → prints the SQLAlchemy URL of a fresh database
#   scripts/pg-test-cluster.sh stop DIR
set -euo pipefail
cmd=${1:?usage: pg-test-cluster.sh start|stop DIR}
dir=${2:?usage: pg-test-cluster.sh start|stop DIR}
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$bindir" ] || { echo "PostgreSQL is not installed (apt-get install postgresql)" >&2; exit 1; }
as_pg() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

case "$cmd" in
start)
  mkdir -p "$dir"
  [ "$(id -u)" = 0 ] && chown postgres: "$dir"
  if [ ! -f "$dir/data/PG_VERSION" ]; then
    as_pg "$bindir/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-locale >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; exit 1; }
  fi
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  as_pg "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $dir -c fsync=off -c full_page_writes=off" start >/dev/null \
    || { cat "$dir/server.log" >&2; exit 1; }
  echo "$port" >"$dir/port"
  as_pg "$bindir/psql" -h 127.0.0.1 -p "$port" -U postgres -qc "CREATE DATABASE sandbox_test" >/dev/null
  echo "postgresql+asyncpg://postgres@127.0.0.1:$port/sandbox_test"
  ;;
stop)
  [ -d "$dir/data" ] && as_pg "$bindir/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null 2>&1 || true
  ;;
*) echo "usage: pg-test-cluster.sh start|stop DIR" >&2; exit 2 ;;
esac
