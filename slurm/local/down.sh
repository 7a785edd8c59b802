#!/bin/bash
# Stop the local Slurm cluster started by slurm/local/up.sh: every slurmd (whatever the node count),
# slurmctld and munged. Jobs still running are cancelled first. Safe to run when nothing is running.
# --keep-munge: leave munged running (up.sh, when it restarts the cluster with another node count).
set -euo pipefail

# Stop the daemon whose pid is in file $1 and wait until it is gone.
stop() {
    local pidfile="$1" pid
    [ -s "$pidfile" ] || return 0
    pid="$(cat "$pidfile")"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid"
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
    fi
    rm -f "$pidfile"
}

if [ -s /run/slurm-local/slurmctld.pid ] && command -v scancel >/dev/null; then
    scancel --user=root 2>/dev/null || true
    # Give job steps a moment to end before their slurmd goes away.
    for _ in $(seq 20); do
        [ -z "$(squeue -h -t running,completing 2>/dev/null)" ] && break
        sleep 1
    done
fi
for pidfile in /run/slurm-local/slurmd-*.pid; do
    if [ -e "$pidfile" ]; then stop "$pidfile"; fi
done
stop /run/slurm-local/slurmctld.pid
if [ "${1:-}" != --keep-munge ]; then
    stop /run/munge/munged.pid
fi
echo "slurm-down: stopped"
