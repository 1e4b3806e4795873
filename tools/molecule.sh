#!/usr/bin/env bash
# Run Molecule scenarios, JOBS at a time (default 1: one after another). Each scenario's whole
# output is printed in one piece when it ends, between "--- molecule scenario: NAME" and
# "--- molecule scenario NAME: Ns" (its wall time), so the log reads as if they had run in turn;
# while several run, each is also written to $MOLECULE_LOG_DIR/NAME.log as it goes.
# Scenarios start in the order given: put the longest first. Exit status: the number of failed
# scenarios (0: all passed); with JOBS=1 the first failure stops the run, as `make` would.
# Usage: tools/molecule.sh JOBS SCENARIO...   (MOLECULE: the molecule to run, default molecule)
set -u
jobs=$1; shift
molecule=${MOLECULE:-molecule}
log_dir=${MOLECULE_LOG_DIR:-.cache/stages/molecule}
mkdir -p "$log_dir"
lock="$log_dir/.print.lock"

# run_one runs in the shells xargs starts (exported below), hence SC2317 and the single quotes of SC2016.
# shellcheck disable=SC2317
run_one() {
  local name=$1 log="$log_dir/$1.log" t0 rc user sys TIMEFORMAT="%U %S"
  t0=$(date +%s)
  { time "$molecule" test -s "$name" >"$log" 2>&1; } 2>"$log.cpu"
  rc=$?
  read -r user sys <"$log.cpu" || true
  {
    flock 9
    echo "--- molecule scenario: $name"
    cat "$log"
    # The CPU the scenario's controller side used (Ansible, Molecule, the tools it runs); its
    # test hosts' own is not counted. On two cores the scenarios' sum bounds make molecule.
    echo "--- molecule scenario $name: controller CPU ${user:-?}s user, ${sys:-?}s system"
    echo "--- molecule scenario $name: $(( $(date +%s) - t0 ))s$([ "$rc" = 0 ] || echo " FAILED")"
  } 9>"$lock"
  return "$rc"
}

if [ "$jobs" -le 1 ]; then
  for name in "$@"; do
    echo "--- molecule scenario: $name"
    t0=$(date +%s)
    "$molecule" test -s "$name" || { echo "--- molecule scenario $name: $(( $(date +%s) - t0 ))s FAILED"; exit 1; }
    echo "--- molecule scenario $name: $(( $(date +%s) - t0 ))s"
  done
  exit 0
fi

export -f run_one
export molecule log_dir lock
failed=0
# shellcheck disable=SC2016
printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'run_one "$1"' _ {} || failed=1
exit "$failed"
