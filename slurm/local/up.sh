#!/bin/bash
# Start a local Slurm cluster for development and tests: munged, slurmctld and four emulated nodes
# n1..n4 (one slurmd each) on this host. Idempotent: what already runs is left as it is.
# Like a real GPU cluster: each node declares 2 GPUs through gres (dummy devices /dev/fakegpu0-1),
# and each node has a node-local disk at /nodelocal (its own tmpfs, in a mount namespace of its
# slurmd), so a run dir there is seen by one node only, as on a real node-local scratch disk.
# Needs root and the Debian packages slurmctld, slurmd, slurm-client, munge (installed if missing).
# Stop everything with slurm/local/down.sh.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
nodes=(n1 n2 n3 n4)

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
for f in slurm.conf gres.conf; do
    sed "s/@HOST@/$(hostname)/g" "$here/$f.in" > "/etc/slurm/$f.new"
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

# Node names resolve like on a real cluster (the rendezvous endpoint is the first node's name).
if ! grep -qE '^127\.0\.0\.1[[:space:]]+n1 n2 n3 n4$' /etc/hosts; then
    echo "127.0.0.1 n1 n2 n3 n4" >> /etc/hosts
fi

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

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
for _ in $(seq 60); do
    for pidfile in /run/slurm-local/slurmctld.pid /run/slurm-local/slurmd-n{1,2,3,4}.pid; do
        if [ -e "$pidfile" ] && ! alive "$pidfile"; then
            echo "slurm-up: $(basename "$pidfile" .pid) died; see /var/log/slurm-local/" >&2
            tail -n 5 /var/log/slurm-local/*.log >&2
            exit 1
        fi
    done
    states="$(sinfo -h -N -p main -o '%N %t' 2>/dev/null || true)"
    if echo "$states" | grep -qE ' (down|drain)'; then
        scontrol update nodename=n[1-4] state=resume 2>/dev/null || true
    fi
    if [ "$(echo "$states" | grep -cE ' (idle|mix|alloc)$')" = 4 ]; then
        echo "slurm-up: nodes n1..n4 are up (sinfo below)"
        sinfo
        exit 0
    fi
    sleep 1
done
echo "slurm-up: nodes did not come up within 60 s; see /var/log/slurm-local/*.log" >&2
sinfo -N >&2 || true
exit 1
