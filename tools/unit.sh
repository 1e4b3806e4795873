#!/usr/bin/env bash
# The unit tests (pytest, four workers on the two cores: many tests wait on real processes). Tests that fail are run once more, alone and serially:
# any that fails again fails the stage; any that passes then is reported on a line starting with
# "FLAKY" (a defect to fix: it depends on timing or on what runs beside it), and the stage passes.
# Usage: tools/unit.sh [pytest arguments]   (PYTEST: the pytest to run, default .venv/bin/pytest)
set -u
pytest=${PYTEST:-.venv/bin/pytest}
export COLUMNS=${COLUMNS:-160}   # room for the assertion message on pytest's FAILED lines
cache=.cache/pytest/v/cache/lastfailed
rm -f "$cache"
# pytest.ini's testpaths, unless an argument names a test file or directory. The 25 slowest
# tests are listed at the end, so a slow one is seen.
"$pytest" -q -n 4 --durations=25 "$@"
rc=$?
# 1: some tests failed. Anything else (0 passed, 2 interrupted, 3 internal error, 4 usage,
# 5 no tests collected) is final.
[ "$rc" = 1 ] && [ -s "$cache" ] || exit "$rc"
mapfile -t failed < <(python3 -c 'import json, sys; print("\n".join(sorted(json.load(open(sys.argv[1])))))' "$cache")
echo
echo "=== ${#failed[@]} test(s) failed; running them again, alone and serially ==="
"$pytest" -q -p no:xdist -rfE "$@" "${failed[@]}"
rerun=$?
if [ "$rerun" = 0 ]; then
  for id in "${failed[@]}"; do echo "FLAKY (failed beside the others, passed alone): $id"; done
fi
exit "$rerun"
