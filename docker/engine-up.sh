#!/usr/bin/env bash
# Start a Docker engine on this machine if none answers; idempotent.
# For machines like the CI/dev VMs (Debian 12, root, no iptables): installs docker.io + docker-compose
# + debootstrap when missing and runs dockerd without a bridge. The storage driver is dockerd's own
# choice (overlay2 where the kernel mounts overlayfs on /var/lib/docker's filesystem, else vfs; the
# driver a data root already holds images of) unless DOCKER_STORAGE_DRIVER names one. vfs copies the
# whole image for every container (6 GB here, twice for its init layer), so the driver decides how
# much disk the container tests take: engine-up says which one runs.
# On a workstation with a working Docker, this script only checks `docker info` and exits.
set -euo pipefail

LOG=${DOCKERD_LOG:-/var/log/dockerd.log}

say_driver() {
    echo "engine-up: Docker answers, storage driver $(docker info --format '{{.Driver}}')" >&2
}

if docker info >/dev/null 2>&1; then
    say_driver
    exit 0
fi

if ! command -v dockerd >/dev/null 2>&1 || ! command -v docker-compose >/dev/null 2>&1 \
        || ! command -v debootstrap >/dev/null 2>&1; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "engine-up: no Docker engine answers and I can only install one as root on Debian/Ubuntu;" \
             "install Docker (https://docs.docker.com/engine/install/) and retry" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends docker.io docker-compose debootstrap >/dev/null
fi

if ! pgrep -x dockerd >/dev/null 2>&1; then
    # A dockerd killed without its shutdown (its session ended, the machine was stopped) leaves its
    # pid file behind, and a new dockerd refuses to start over it. No dockerd runs, so it is stale.
    PIDFILE=/var/run/docker.pid
    if [ -e "$PIDFILE" ]; then
        echo "engine-up: removing the stale $PIDFILE (pid $(cat "$PIDFILE" 2>/dev/null), no dockerd runs)" >&2
        rm -f "$PIDFILE"
    fi
    # No iptables/bridge: containers use --network host.
    nohup dockerd ${DOCKER_STORAGE_DRIVER:+--storage-driver="$DOCKER_STORAGE_DRIVER"} \
        --iptables=false --bridge=none >"$LOG" 2>&1 &
fi

for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then
        say_driver
        exit 0
    fi
    sleep 1
done
echo "engine-up: dockerd did not answer within 60 s; see $LOG" >&2
exit 1
