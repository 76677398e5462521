#!/usr/bin/env bash
# Stop exactly the daemons scripts/slurm_up.sh STATE_DIR started: the PIDs it recorded in
# STATE_DIR/pids, newest first, each only if it is still the program that was started.
set -u
STATE="${1:?usage: slurm_down.sh STATE_DIR}"
PIDS="$STATE/pids"
[ -f "$PIDS" ] || exit 0
tac "$PIDS" | while read -r name pid; do
  [ -n "${pid:-}" ] || continue
  comm="$(cat "/proc/$pid/comm" 2>/dev/null || true)"
  if [ "$comm" != "$name" ]; then
    continue # gone, or the PID now belongs to another program
  fi
  kill "$pid"
  for _ in $(seq 100); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid"
  fi
  echo "stopped $name ($pid)"
done
: >"$PIDS"
rundir="$(cat "$STATE/rundir" 2>/dev/null || true)"
case "$rundir" in
/run/draftsmith-slurm-*) rm -rf "$rundir" ;;
esac
if [ "$(readlink /etc/slurm/slurm.conf 2>/dev/null)" = "$(cd "$STATE" && pwd)/slurm.conf" ]; then
  rm -f /etc/slurm/slurm.conf
fi
