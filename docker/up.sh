#!/usr/bin/env bash
# Train in the foreground with Docker Compose until training ends (`make up`, `make up CPU=1`).
# Takes RUN_DIR, DATA_DIR, CONFIG, ARGS, NPROC, IMAGE from the environment (see compose.yaml).
# Usage: docker/up.sh [cpu]
set -euo pipefail
cd "$(dirname "$0")/.."

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
else
    compose=(docker-compose)   # Debian's 1.29 (no Compose v2 package there)
fi

# vfs engines (as on the dev VMs) can be slower than compose's default 60 s API timeout.
export COMPOSE_HTTP_TIMEOUT=${COMPOSE_HTTP_TIMEOUT:-300}
export RUN_DIR=${RUN_DIR:-./runs/docker} DATA_DIR=${DATA_DIR:-./data}
mkdir -p "$RUN_DIR" "$DATA_DIR"

# The trainer runs as you, so the run dir stays yours. Root on the host: it runs as 1000:1000
# instead (never root in the container), and the run dir is handed to that user.
TRAINER_UID=$(id -u) TRAINER_GID=$(id -g)
if [ "$TRAINER_UID" = 0 ]; then
    TRAINER_UID=1000 TRAINER_GID=1000
    chown -R "$TRAINER_UID:$TRAINER_GID" "$RUN_DIR"
fi
export TRAINER_UID TRAINER_GID

if [ "${1:-}" = cpu ]; then
    exec "${compose[@]}" --profile cpu up --exit-code-from train-cpu train-cpu
else
    exec "${compose[@]}" up --exit-code-from train train
fi
