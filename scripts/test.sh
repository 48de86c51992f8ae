#!/usr/bin/env bash
# Command two: every test tier, in order. Exit status is non-zero when any tier fails.
#   scripts/test.sh                 lint unit integration postgres browser e2e
#   scripts/test.sh unit postgres   just those tiers
# SANDBOX_SKIP_TIERS=e2e,browser opts tiers out explicitly (they are reported as skipped, loudly).
# Extra pytest arguments: PYTEST_ARGS="-x -k name".
# The e2e tier runs in two lanes at once (SANDBOX_TEST_LANES=1: one after the other), see
# run_lanes.
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
# One pytest process: in two lanes the tests' servers raced each other for the free ports they
# pick (bind to port 0, close, hand the number on), and a tunnel test failed under the load.
tier_integration() { run_pytest tests/integration; }
tier_browser() { run_pytest tests/browser; }
# Two pytest processes side by side (lane a in the background, with Ctrl-C as in the foreground),
# each in its own log, printed when both are done; non-zero when either fails.
# SANDBOX_TEST_LANES=1 runs them one after the other instead.
run_lanes() {
  local name=$1 a=$2 b=$3 pa rc=0 log
  local -a logs=("tests/artifacts/lane-$name-a.log" "tests/artifacts/lane-$name-b.log")
  if [ "${SANDBOX_TEST_LANES:-2}" = 1 ]; then
    run_pytest $a || rc=1
    run_pytest $b || rc=1
    return $rc
  fi
  echo "-- $name, lane a:" $a
  echo "-- $name, lane b:" $b
  (trap - INT QUIT; run_pytest $a) >"${logs[0]}" 2>&1 &
  pa=$!
  run_pytest $b >"${logs[1]}" 2>&1 || rc=1
  wait $pa || rc=1
  for log in "${logs[@]}"; do echo "-- ${log}:"; cat "$log"; done
  return $rc
}
# A TCG guest (1 vCPU) keeps one core busy: on 2 cores two lanes of guests take about the time
# of one. First the fleet tier (it restarts the main libvirtd: nothing else may use it then)
# beside the images tier (its build and its QEMU boot need no libvirtd; later lanes find the
# image in the cache); then everything else in two lanes. A new e2e file joins the last lane.
tier_e2e() {
  local rc=0
  run_lanes e2e-first tests/e2e/fleet tests/e2e/images || rc=1
  run_lanes e2e-then "tests/e2e/provision/test_provision_e2e.py tests/e2e/exec" \
    "tests/e2e --ignore=tests/e2e/fleet --ignore=tests/e2e/images
     --ignore=tests/e2e/provision/test_provision_e2e.py --ignore=tests/e2e/exec" || rc=1
  return $rc
}
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
