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
fail() { echo "docker/up.sh: error: $*" >&2; exit 2; }

# The user the trainer runs as (compose.yaml's user:), never root: TRAINER_UID/TRAINER_GID if set,
# else you; as root, the user who ran sudo, else the run dir's owner, else none: refused. No file
# changes owner; only the folders of RUN_DIR made here, as root, are given to that user.
if [ -n "${TRAINER_UID:-}" ]; then
    TRAINER_GID=${TRAINER_GID:-$TRAINER_UID}
elif [ "$(id -u)" != 0 ]; then
    TRAINER_UID=$(id -u) TRAINER_GID=$(id -g)
elif [ "${SUDO_UID:-0}" != 0 ]; then
    TRAINER_UID=$SUDO_UID TRAINER_GID=${SUDO_GID:-$SUDO_UID}
elif [ -d "$RUN_DIR" ] && [ "$(stat -L -c %u "$RUN_DIR")" != 0 ]; then
    TRAINER_UID=$(stat -L -c %u "$RUN_DIR") TRAINER_GID=$(stat -L -c %g "$RUN_DIR")
else
    state="owned by root"; [ -e "$RUN_DIR" ] || state="does not exist yet"
    fail "as root, the trainer needs a user to run as (never root): run \`make up\` as your user or with sudo," \
         "or set TRAINER_UID= and TRAINER_GID=, or give a RUN_DIR that user owns (RUN_DIR=$RUN_DIR $state)"
fi
[[ $TRAINER_UID =~ ^[0-9]+$ && $TRAINER_GID =~ ^[0-9]+$ ]] \
    || fail "TRAINER_UID=$TRAINER_UID TRAINER_GID=$TRAINER_GID: give numeric ids (id -u, id -g)"
[ "$TRAINER_UID" != 0 ] || fail "TRAINER_UID=0: the trainer never runs as root; give a user's uid"
export TRAINER_UID TRAINER_GID

made=()   # the folders of RUN_DIR that do not exist yet, outermost first
dir=$RUN_DIR
while [ ! -e "$dir" ] && [ ! -L "$dir" ]; do made=("$dir" "${made[@]}"); dir=$(dirname "$dir"); done
mkdir -p "$RUN_DIR" "$DATA_DIR"
if [ "$(id -u)" = 0 ] && [ ${#made[@]} -gt 0 ]; then
    chown -h "$TRAINER_UID:$TRAINER_GID" "${made[@]}"
fi

if [ "${1:-}" = cpu ]; then
    exec "${compose[@]}" --profile cpu up --exit-code-from train-cpu train-cpu
else
    exec "${compose[@]}" up --exit-code-from train train
fi
