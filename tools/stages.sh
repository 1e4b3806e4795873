#!/usr/bin/env bash
# Run `make <stage>` for each stage given, keep going after a failure (except set-up, which the
# others need), and end with what failed and one summary line per stage with its wall time (and
# one per Molecule scenario). Stages joined by "+" (lint+unit) run at once: on two cores the
# unit tests' waits leave room for the linters; each one's output is printed whole when it ends,
# so the log reads as if they had run in turn, and the summary gives each its own wall time and
# the group's.
#
# Each stage's output goes to the terminal and to $STAGES_LOG_DIR/<stage>.log (default
# .cache/stages). A failed stage's last lines (pytest's short summary, Molecule's failing task)
# are repeated just above the summary, so the end of a long CI log says what went wrong.
# Exit status: non-zero if any stage failed.
# Usage: tools/stages.sh STAGE[+STAGE...] ...
set -u
log_dir=${STAGES_LOG_DIR:-.cache/stages}
tail_lines=${STAGES_TAIL_LINES:-25}
mkdir -p "$log_dir"
results=()
failed=()
status=0
total_start=$(date +%s)
# line NAME OUTCOME SECS [NOTE]: a line of the summary.
line() {
  results+=("$(printf '%-10s %-7s %4dm%02ds%s' "$1" "$2" $(($3 / 60)) $(($3 % 60)) "${4:+  $4}")")
}
# record STAGE RC SECS: the stage's outcome and its line in the summary.
record() {
  local outcome=ok
  if [ "$2" != 0 ]; then outcome=FAILED; status=1; failed+=("$1"); fi
  line "$1" "$outcome" "$3"
}
for group in "$@"; do
  IFS=+ read -r -a stages <<<"$group"
  start=$(date +%s)
  if [ ${#stages[@]} = 1 ]; then
    stage=${stages[0]}
    echo
    echo "=== stage: $stage ==="
    make --no-print-directory "$stage" 2>&1 | tee "$log_dir/$stage.log"
    rc=${PIPESTATUS[0]}
    record "$stage" "$rc" $(( $(date +%s) - start ))
    if [ "$stage" = setup ] && [ "$rc" != 0 ]; then
      results+=("(later stages not run: set-up failed)")
      break
    fi
    continue
  fi
  echo
  echo "=== stages at once: ${stages[*]} (each printed whole when it ends) ==="
  failed_before=${#failed[@]}
  for stage in "${stages[@]}"; do
    # As tools/molecule.sh prints its scenarios: each stage's log whole when it ends, one at a
    # time under a lock; its exit status and wall time beside the log, for the summary.
    ( s0=$(date +%s)
      make --no-print-directory "$stage" >"$log_dir/$stage.log" 2>&1
      echo "$? $(( $(date +%s) - s0 ))" >"$log_dir/$stage.rc"
      { flock 9; echo; echo "=== stage: $stage ==="; cat "$log_dir/$stage.log"; } 9>"$log_dir/.print.lock" ) &
  done
  wait
  for stage in "${stages[@]}"; do
    read -r rc secs <"$log_dir/$stage.rc" || rc=1 secs=0
    rm -f "$log_dir/$stage.rc"
    record "$stage" "$rc" "$secs"
  done
  line "$group" "$([ ${#failed[@]} = "$failed_before" ] && echo ok || echo FAILED)" $(( $(date +%s) - start )) "(at once)"
done
total=$(( $(date +%s) - total_start ))
for stage in "${failed[@]+"${failed[@]}"}"; do
  log="$log_dir/$stage.log"
  echo
  echo "=== stage $stage failed; its last lines (whole log: $log) ==="
  if [ "$stage" = unit ] && grep -qE '^(FAILED|ERROR) ' "$log"; then
    # pytest's short summary: one line per failed test, with its assertion message (of the
    # serial rerun of the failed tests when there was one: tools/unit.sh).
    last=$(awk '/^=== .* running them again/ {buf = ""} {buf = buf $0 "\n"} END {printf "%s", buf}' "$log")
    grep -E '^(FAILED|ERROR) ' <<<"$last" | cut -c1-400 | head -n "$tail_lines"
    grep -E '(passed|failed|errors?)( in |, )' <<<"$last" | tail -n 1
  elif [ "$stage" = molecule ] && plain=$(sed 's/\x1b\[[0-9;]*m//g' "$log") && grep -qE '(fatal|failed): \[' <<<"$plain"; then
    # The scenario that failed (tools/molecule.sh prints each whole, and marks the failed), the
    # last failure Ansible printed in it and Molecule's verdict.
    bad=$(sed -n 's/^--- molecule scenario \([a-z_]*\): [0-9]*s FAILED$/\1/p' <<<"$plain" | head -n 1)
    if [ -n "$bad" ]; then
      plain=$(awk -v s="$bad" '$0 == "--- molecule scenario: " s {on = 1} on {print} on && index($0, "--- molecule scenario " s ": ") == 1 {exit}' <<<"$plain")
    fi
    grep -E '^--- molecule scenario: ' <<<"$plain" | tail -n 1
    awk -v n="$tail_lines" '/(fatal|failed): \[/ {buf = ""; left = n} left > 0 {buf = buf $0 "\n"; left--} END {printf "%s", buf}' <<<"$plain" | cut -c1-400
    grep -E '^ERROR ' <<<"$plain" | tail -n 2 | cut -c1-400
  else
    tail -n "$tail_lines" "$log" | cut -c1-400
  fi
done
flaky=$(cat "$log_dir"/*.log 2>/dev/null | grep -E '^FLAKY ' | cut -c1-400 || true)
if [ -n "$flaky" ]; then
  echo
  echo "=== flaky tests (failed in the parallel run, passed alone; to be fixed) ==="
  echo "$flaky"
fi
echo
echo "=== summary ==="
for r in "${results[@]}"; do
  echo "stage $r"
  # Each Molecule scenario's wall time (make molecule prints one line per scenario).
  if [[ "$r" == molecule* ]]; then
    sed -n 's/^--- molecule scenario \([a-z_]*\): \([0-9]*\)s\( FAILED\)\{0,1\}$/\1 \2\3/p' "$log_dir/molecule.log" \
      | while read -r name secs failed; do
          printf '  scenario %-12s %4dm%02ds %s\n' "$name" $((secs / 60)) $((secs % 60)) "$failed"
        done
  fi
done
printf 'stage %-10s %-7s %4dm%02ds\n' total "$([ $status = 0 ] && echo ok || echo FAILED)" $((total / 60)) $((total % 60))
exit $status
