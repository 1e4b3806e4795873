#!/usr/bin/env bash
# Run `make <stage>` for each stage given, keep going after a failure (except set-up, which the
# others need), and end with one summary line per stage with its wall time.
# Exit status: non-zero if any stage failed.
set -u
results=()
status=0
total_start=$(date +%s)
for stage in "$@"; do
  echo
  echo "=== stage: $stage ==="
  start=$(date +%s)
  if make --no-print-directory "$stage"; then outcome=ok; else outcome=FAILED; status=1; fi
  secs=$(( $(date +%s) - start ))
  results+=("$(printf '%-10s %-7s %4dm%02ds' "$stage" "$outcome" $((secs / 60)) $((secs % 60)))")
  if [ "$stage" = setup ] && [ "$outcome" = FAILED ]; then
    results+=("(later stages not run: set-up failed)")
    break
  fi
done
total=$(( $(date +%s) - total_start ))
echo
echo "=== summary ==="
for r in "${results[@]}"; do echo "stage $r"; done
printf 'stage %-10s %-7s %4dm%02ds\n' total "$([ $status = 0 ] && echo ok || echo FAILED)" $((total / 60)) $((total % 60))
exit $status
