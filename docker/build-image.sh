#!/usr/bin/env bash
# Build the trainer's image (`make image`): the Dockerfile on a Debian base, torch from PyPI.
#   docker/build-image.sh [IMAGE_NAME] [docker build options...]     (default: fsdp-trainer:latest)
# The base is BASE_IMAGE (debian:bookworm-slim) when the engine has it or can pull it; where no image
# registry can be reached (air-gapped build hosts, the project's CI) the same Debian release is made
# locally with debootstrap (docker/base-image.sh). pip in the build trusts what this host's pip
# trusts: a site whose proxy inspects TLS has its certificates in pip's `cert` setting.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${1:-fsdp-trainer:latest}
shift || true
BASE=${BASE_IMAGE:-debian:bookworm-slim}

if ! docker image inspect "$BASE" >/dev/null 2>&1 && ! docker pull -q "$BASE" >/dev/null 2>&1; then
    echo "build-image: cannot pull $BASE; making the same Debian release locally (debootstrap)" >&2
    BASE=fsdp-trainer-base:bookworm
    docker/base-image.sh "$BASE"
fi

cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
rm -f docker/ca-bundle.crt
if [ -n "$cert" ] && [ -f "$cert" ]; then
    cp "$cert" docker/ca-bundle.crt
fi
trap 'rm -f docker/ca-bundle.crt' EXIT

started=$(date +%s)
previous=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
docker build --network host --build-arg BASE_IMAGE="$BASE" -t "$IMAGE" "$@" .
# The rebuild moves the tag and leaves the image it named before untagged: a full copy of torch
# (6 GB under Docker's vfs driver) per build. Remove it; docker keeps it if a container uses it.
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$IMAGE")" ]; then
    docker rmi "$previous" >/dev/null 2>&1 || true
fi
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
echo "build-image: $IMAGE on $BASE: $((size / 1000000)) MB, built in $(( $(date +%s) - started )) s"
