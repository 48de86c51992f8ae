#!/usr/bin/env bash
# Regenerate the dependency locks: exact versions with hashes, the only way an upstream release
# enters the build. pyproject.toml keeps the ranges (for people who install the package as a
# library); scripts/install.sh, the test tiers and the guest image install from these files.
#   tools/lock.sh                  add what pyproject.toml gained, keep every other pin
#   tools/lock.sh --upgrade        bump everything to the newest versions the ranges allow
#   tools/lock.sh --upgrade-package grpcio   bump one
# Then run scripts/test.sh: the suite is the gate. A bump of grpcio/protobuf also needs
# `python tools/generate_proto.py` and the new pins copied into the image recipe's
# runtime.requirements (its test says so when they differ).
set -euo pipefail
cd "$(dirname "$0")/.."
UV_VERSION=0.13.9
tools=.venv/tools
if [ ! -x "$tools/bin/uv" ]; then
  python3 -m venv "$tools"
  "$tools/bin/pip" install -q "uv==$UV_VERSION"
fi
compile() {  # OUTPUT [--extra X ...]
  local out=$1; shift
  "$tools/bin/uv" pip compile pyproject.toml "$@" --generate-hashes --no-header --no-annotate -q \
    --python-version 3.11 --python-platform x86_64-unknown-linux-gnu -o "$out"
}
# The test lock is the superset; the others are resolved within its versions so that the
# server, the CLI, the tests and the guest all run the same grpcio, protobuf, aiohttp, …
compile requirements/test.txt requirements/build.in --extra server --extra cli --extra test "$@"
pins=$(mktemp)
trap 'rm -f "$pins"' EXIT
grep -oE '^[A-Za-z0-9_.-]+==[^ ]+' requirements/test.txt > "$pins"
compile requirements/server.txt requirements/build.in --extra server --extra cli -c "$pins"
compile requirements/cli.txt --extra cli -c "$pins"
compile agentic_sandbox/images/recipes/agent-runtime.txt -c "$pins"
echo "locks written: requirements/{test,server,cli}.txt, agentic_sandbox/images/recipes/agent-runtime.txt"
