#!/usr/bin/env bash
# Freeze a test host (podman pause: the calls open to it hang, new ones are refused) right after
# the retune relaunched one of its instances (the unit's main PID changed), as a host freezes
# under a kernel hang or a network partition. With a duration, it answers again after that many
# seconds. The last line printed is when it froze.
# Usage: freeze_after_relaunch.sh CONTAINER UNIT MAIN_PID_BEFORE [SECONDS]
set -euo pipefail
host=$1 unit=$2 before=$3 hold=${4:-}
for _ in $(seq 1200); do
  pid=$(podman exec "$host" systemctl show -p MainPID --value "$unit" 2>/dev/null || true)
  if [ -n "$pid" ] && [ "$pid" != 0 ] && [ "$pid" != "$before" ]; then
    # cgroup v1's freezer gives up on a process in vfork (the agent spawns systemctl and
    # nvidia-smi every poll): runc then leaves the container running; try again at once.
    for try in $(seq 50); do
      podman pause "$host" >/dev/null 2>&1 && break
      [ "$try" = 50 ] && { echo "podman pause $host failed 50 times" >&2; exit 1; }
      sleep 0.05
    done
    frozen=$(date '+%Y-%m-%d %H:%M:%S.%6N')
    echo "$unit main PID $before -> $pid: $host frozen"
    if [ -n "$hold" ]; then
      sleep "$hold"
      podman unpause "$host" >/dev/null
      echo "$host answers again after ${hold}s"
    fi
    echo "$frozen"
    exit 0
  fi
  sleep 0.1
done
echo "the main PID of $unit on $host never changed from $before" >&2
exit 1
