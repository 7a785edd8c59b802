#!/usr/bin/env bash
# Build the CPU image (for machines without GPUs, and for the tests) fully offline from a wheelhouse:
#   1. a local Debian bookworm base image (docker/base-image.sh; no registry needed),
#   2. docker/wheels/: a CPU torch + every other dependency, downloaded by this host's pip,
#   3. docker build with `pip install --no-index --find-links docker/wheels`.
# torch: the wheel named by TORCH_WHEEL, else a local CPU wheel in /opt/wheels (the dev machines;
# torch only, no torchvision can match it), else torch + torchvision from the PyTorch CPU index.
# Usage: docker/build-cpu-image.sh [IMAGE_NAME]   (default: fsdp-trainer:cpu)
# (setuptools is in the wheelhouse because `pip install /src` builds the package offline.)
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${1:-fsdp-trainer:cpu}
BASE=${CPU_BASE_IMAGE:-fsdp-trainer-base:bookworm}
WHEELS=docker/wheels

docker/base-image.sh "$BASE"

TORCH_WHEEL=${TORCH_WHEEL:-$(ls /opt/wheels/torch-*+cpu-cp311-*.whl 2>/dev/null | tail -n 1 || true)}
mkdir -p "$WHEELS"
# The trainer's requirements other than torch/torchvision, read from pyproject.toml.
python3 - >"$WHEELS/requirements.txt" <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[^A-Za-z0-9_.-]", d)[0].lower() not in ("torch", "torchvision")))
PY
# The image's Python is Debian bookworm's 3.11 on x86_64: ask pip for wheels of exactly that.
pip_dl=(pip download --quiet --dest "$WHEELS" --only-binary=:all: --python-version 3.11
        --implementation cp --platform manylinux_2_36_x86_64 --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
if [ -n "$TORCH_WHEEL" ]; then
    "${pip_dl[@]}" "$TORCH_WHEEL" -r "$WHEELS/requirements.txt" "setuptools>=64"
    TORCH="torch"
else
    "${pip_dl[@]}" torch torchvision --index-url https://download.pytorch.org/whl/cpu
    "${pip_dl[@]}" -r "$WHEELS/requirements.txt" "setuptools>=64"
    TORCH="torch torchvision"
fi

docker build --network host -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE" \
    --build-arg TORCH="$TORCH" \
    --build-arg PIP_OPTS="--no-index --find-links /src/docker/wheels" \
    .
