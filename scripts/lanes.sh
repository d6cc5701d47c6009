#!/usr/bin/env bash
# Run command lanes side by side: each argument is one lane, a shell command line whose
# commands run one after the other (join them with &&). Each lane's output goes to its
# own log; once every lane has ended, the logs are printed in lane order, and the exit
# status is the first failing lane's (0 if none failed).
#   scripts/lanes.sh LOGDIR 'cmd1 && cmd2' 'cmd3'
set -uo pipefail
logs=$1; shift
mkdir -p "$logs"
pids=()
i=0
for lane in "$@"; do
    i=$((i + 1))
    bash -c "set -o pipefail; $lane" > "$logs/lane$i.log" 2>&1 &
    pids+=($!)
done
status=0
i=0
for pid in "${pids[@]}"; do
    i=$((i + 1))
    wait "$pid"
    rc=$?
    echo "=== lane $i (exit $rc) ==="
    cat "$logs/lane$i.log"
    if [ "$rc" != 0 ] && [ "$status" = 0 ]; then status=$rc; fi
done
exit $status
