#!/usr/bin/env bash
# Benchmarks (not tests): each prints a table and writes bench-results/<name>.json.
#   scripts/bench.sh                 every benchmark in tests/bench
#   scripts/bench.sh sessions fleet  just those
set -uo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --test || exit 1
scripts/services.sh || exit 1
export SANDBOX_TEST_CACHE=${SANDBOX_TEST_CACHE:-/var/tmp/agentic-sandbox-test-cache}
mkdir -p bench-results
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in tests/bench/bench_*.py; do n=$(basename "$f" .py); names+=("${n#bench_}"); done
fi
failed=0
for n in "${names[@]}"; do
  f="tests/bench/bench_$n.py"
  [ -f "$f" ] || { echo "no benchmark $f" >&2; failed=1; continue; }
  echo "######## bench $n"
  .venv/bin/python "$f" || failed=1
done
exit $failed
