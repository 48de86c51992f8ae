#!/usr/bin/env bash
# Command two: every test tier, in order. Exit status is non-zero when any tier fails.
#   scripts/test.sh                 lint unit integration postgres browser e2e
#   scripts/test.sh unit postgres   just those tiers
# SANDBOX_SKIP_TIERS=e2e,browser opts tiers out explicitly (they are reported as skipped, loudly).
# Extra pytest arguments: PYTEST_ARGS="-x -k name".
set -uo pipefail
cd "$(dirname "$0")/.."

ALL=(lint unit integration postgres browser e2e)
tiers=("$@")
[ ${#tiers[@]} -eq 0 ] && tiers=("${ALL[@]}")

scripts/install.sh --test || exit 1
scripts/services.sh || exit 1

export SANDBOX_TEST_CACHE=${SANDBOX_TEST_CACHE:-/var/tmp/agentic-sandbox-test-cache}
mkdir -p "$SANDBOX_TEST_CACHE" tests/artifacts bench-results
PY=.venv/bin/python
declare -A result
failed=0

run_pytest() { $PY -m pytest -q -rfE --durations=10 ${PYTEST_ARGS:-} "$@"; }

tier_lint() {
  .venv/bin/ruff check . && .venv/bin/ruff format --check . \
    && .venv/bin/mypy agentic_sandbox \
    && .venv/bin/lint-imports
}
tier_unit() { run_pytest tests/unit; }
tier_integration() { run_pytest tests/integration; }
tier_browser() { run_pytest tests/browser; }
tier_e2e() { run_pytest tests/e2e; }
tier_postgres() {
  local dir rc
  dir=$(mktemp -d /tmp/sandbox-pg.XXXXXX)
  chmod 755 "$dir"
  if ! SANDBOX_TEST_POSTGRES_URL=$(scripts/pg-test-cluster.sh start "$dir"); then
    echo "could not start PostgreSQL for the postgres tier" >&2
    return 1
  fi
  export SANDBOX_TEST_POSTGRES_URL
  run_pytest tests/postgres; rc=$?
  scripts/pg-test-cluster.sh stop "$dir"
  rm -rf "$dir"
  return $rc
}

for tier in "${tiers[@]}"; do
  if [[ ",${SANDBOX_SKIP_TIERS:-}," == *",$tier,"* ]]; then
    echo "######## $tier: SKIPPED — opted out by SANDBOX_SKIP_TIERS=${SANDBOX_SKIP_TIERS}"
    result[$tier]="skipped (opted out)"
    continue
  fi
  if ! declare -F "tier_$tier" >/dev/null; then
    echo "unknown tier '$tier' (tiers: ${ALL[*]})" >&2
    exit 2
  fi
  echo "######## $tier"
  start=$(date +%s)
  if "tier_$tier"; then result[$tier]="passed"; else result[$tier]="FAILED"; failed=1; fi
  result[$tier]+=" ($(( $(date +%s) - start ))s)"
done

echo
echo "######## summary"
for tier in "${tiers[@]}"; do printf '  %-12s %s\n' "$tier" "${result[$tier]}"; done
exit $failed
