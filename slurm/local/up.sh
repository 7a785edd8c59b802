#!/bin/bash
# Start a local Slurm cluster for development and tests: munged, slurmctld and N emulated nodes
# n1..nN (one slurmd each, N=4 unless given: `up.sh 8`, `make slurm-up NODES=8`) on this host.
# Idempotent: what already runs is left as it is. A different node count than the running cluster's
# restarts slurmctld and the slurmds (a reconfigure does not change the node list), so going from 8
# nodes back to 4 (`up.sh`) and up again works; other helpers and the tests expect the 4 of main.
# Like a real GPU cluster: each node declares 2 GPUs through gres (dummy devices /dev/fakegpu0-1),
# and each node has a node-local disk at /nodelocal (its own tmpfs, in a mount namespace of its
# slurmd), so a run dir there is seen by one node only, as on a real node-local scratch disk.
# Needs root and the Debian packages slurmctld, slurmd, slurm-client, munge (installed if missing).
# `up.sh --render DIR [N]` only writes the rendered slurm.conf and gres.conf into DIR (no root).
# Stop everything with slurm/local/down.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

render_to=
if [ "${1:-}" = --render ]; then
    render_to="${2:?up.sh --render DIR [NODES]: give the folder to write into}"
    shift 2
fi
count="${1:-4}"
if ! [[ "$count" =~ ^[1-9][0-9]?$ ]]; then
    echo "slurm/local/up.sh: NODES='$count' is not a node count from 1 to 99; e.g. make slurm-up NODES=8" >&2
    exit 2
fi
nodes=()
for i in $(seq "$count"); do nodes+=("n$i"); done

# Template $1 with this cluster's values: @HOST@ this host's name, @NODES@ the node list (n[1-4]),
# @PORTS@ their slurmd ports (17001-17004: one per node, all on this host).
render() {
    local list="n[1-$count]" ports="17001-$((17000 + count))"
    if [ "$count" = 1 ]; then list=n1 ports=17001; fi
    sed -e "s/@HOST@/$(hostname)/g" -e "s/@NODES@/$list/g" -e "s/@PORTS@/$ports/g" "$1"
}

if [ -n "$render_to" ]; then
    for f in slurm.conf gres.conf; do render "$here/$f.in" > "$render_to/$f"; done
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    echo "slurm/local/up.sh: needs root (it installs packages and writes /etc/slurm)" >&2
    exit 1
fi

# Packages.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    echo "slurm-up: installing slurmctld slurmd slurm-client munge"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

# Munge key and daemon.
if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 400 /etc/munge/munge.key
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge -n </dev/null >/dev/null 2>&1; then
    munged --force </dev/null >/dev/null 2>&1
fi

# Config, state and log directories.
mkdir -p /etc/slurm /run/slurm-local /var/log/slurm-local /var/spool/slurm-local/ctld
for n in "${nodes[@]}"; do mkdir -p "/var/spool/slurm-local/$n"; done
changed=0
# The node list the running controller was started with: a change needs a restart, not a reconfigure.
old_nodes="$(grep -s '^NodeName=' /etc/slurm/slurm.conf | cut -d' ' -f1 || true)"
for f in slurm.conf gres.conf; do
    render "$here/$f.in" > "/etc/slurm/$f.new"
    if ! cmp -s "/etc/slurm/$f.new" "/etc/slurm/$f"; then
        mv "/etc/slurm/$f.new" "/etc/slurm/$f"
        changed=1
    else
        rm "/etc/slurm/$f.new"
    fi
done
# The GPUs gres.conf names: character devices that are not GPUs (like /dev/null).
for i in 0 1; do
    [ -e "/dev/fakegpu$i" ] || mknod "/dev/fakegpu$i" c 1 3
done
mkdir -p /nodelocal

# Node names resolve like on a real cluster (the rendezvous endpoint is the first node's name): the
# names /etc/hosts lacks are added on one line.
missing=()
for n in "${nodes[@]}"; do
    grep -qE "^127\.0\.0\.1([[:space:]]+[^[:space:]]+)*[[:space:]]+$n([[:space:]]|$)" /etc/hosts || missing+=("$n")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "127.0.0.1 ${missing[*]}" >> /etc/hosts
fi

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# Another node count: stop the controller and every slurmd (those of nodes no longer listed too),
# so that all start again below from the new slurm.conf.
new_nodes="$(grep '^NodeName=' /etc/slurm/slurm.conf | cut -d' ' -f1)"
if [ -n "$old_nodes" ] && [ "$old_nodes" != "$new_nodes" ]; then
    echo "slurm-up: the node list changes (${old_nodes#NodeName=} -> ${new_nodes#NodeName=}): restarting slurmctld and the slurmds"
    bash "$here/down.sh" --keep-munge
fi

# Controller and nodes.
if alive /run/slurm-local/slurmctld.pid; then
    if [ "$changed" = 1 ]; then scontrol reconfigure; fi
else
    slurmctld </dev/null >/dev/null 2>&1
fi
for n in "${nodes[@]}"; do
    if ! alive "/run/slurm-local/slurmd-$n.pid"; then
        # Its own /nodelocal: a tmpfs only this node's jobs see.
        unshare --mount --propagation private sh -c \
            "mount -t tmpfs -o size=256m nodelocal-$n /nodelocal && exec slurmd -N $n" </dev/null >/dev/null 2>&1
    fi
done

# Wait until all nodes are idle (or busy with jobs); nodes left DOWN by an earlier run are resumed.
pidfiles=(/run/slurm-local/slurmctld.pid)
for n in "${nodes[@]}"; do pidfiles+=("/run/slurm-local/slurmd-$n.pid"); done
for _ in $(seq 60); do
    for pidfile in "${pidfiles[@]}"; do
        if [ -e "$pidfile" ] && ! alive "$pidfile"; then
            echo "slurm-up: $(basename "$pidfile" .pid) died; see /var/log/slurm-local/" >&2
            tail -n 5 /var/log/slurm-local/*.log >&2
            exit 1
        fi
    done
    states="$(sinfo -h -N -p main -o '%N %t' 2>/dev/null || true)"
    if echo "$states" | grep -qE ' (down|drain)'; then
        scontrol update nodename="n[1-$count]" state=resume 2>/dev/null || true
    fi
    if [ "$(echo "$states" | grep -cE ' (idle|mix|alloc)$')" = "$count" ]; then
        echo "slurm-up: nodes n1..n$count are up (sinfo below)"
        sinfo
        exit 0
    fi
    sleep 1
done
echo "slurm-up: nodes did not come up within 60 s; see /var/log/slurm-local/*.log" >&2
sinfo -N >&2 || true
exit 1
