# syntax=docker/dockerfile:1
# The trainer in a container: the `trainer` package and its launcher, run as a non-root user.
#
#   make image          CUDA image on the pinned PyTorch base (torch, torchvision, CUDA, cuDNN, NCCL inside)
#   make image CPU=1    CPU image on a locally made Debian base (docker/base-image.sh), torch from TORCH
#
# Layers of the final image: the base's, one for system packages + user, one for the venv + configs.

# Official PyTorch runtime image (Ubuntu, conda Python, torch + torchvision, CUDA 12.6 runtime:
# runs on drivers >= 525). EDIT to move to another torch/CUDA; pin a digest (@sha256:...) for
# bit-for-bit rebuilds.
ARG BASE_IMAGE=pytorch/pytorch:2.14.1-cuda12.6-cudnn9-runtime

FROM ${BASE_IMAGE} AS base
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# tini forwards SIGTERM/SIGINT to the launcher (whose torchrun agent forwards them to the ranks) and
# reaps zombies.
# python3 + venv only where the base has no Python (the Debian base of the CPU image).
# (Versions: those of the base's distribution release.)
# hadolint ignore=DL3008
RUN pkgs=(tini); command -v python3 >/dev/null || pkgs+=(python3 python3-venv); \
    apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${pkgs[@]}" \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --shell /bin/bash trainer
# Metadata comes before the heavy layer: under the vfs storage driver every instruction copies the
# whole file system, so the final stage is one COPY.
ENV PATH=/app/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python3", "-m", "trainer.launch", "--nproc-per-node=auto", "--config", "configs/default.yaml"]
USER trainer

FROM base AS build
LABEL fsdp-trainer.stage=build
# Root only in this stage, which is thrown away; the final image runs as `trainer`.
# hadolint ignore=DL3002
USER root
# How torch gets into the image. Empty: the base image has it (the CUDA default). Otherwise pip
# arguments that install torch (and torchvision) first, e.g.
#   "torch torchvision --index-url https://download.pytorch.org/whl/cpu"   (CPU wheels, ~200 MB)
#   "torch" with PIP_OPTS pointing at a wheelhouse (docker/build-cpu-image.sh)
ARG TORCH=""
# Extra options for every pip call, e.g. "--no-index --find-links /src/docker/wheels" (offline build
# from the wheelhouse of docker/build-cpu-image.sh) or "--index-url https://my.mirror/simple".
ARG PIP_OPTS=""
COPY . /src
# The trainer's other dependencies come from pyproject.toml; torch and torchvision are never
# re-resolved here, so a base's or TORCH's build stays the one that runs. Versions: the base image,
# TORCH, and pyproject.toml pin them.
# hadolint ignore=DL3013,SC2086
RUN python3 -m venv --system-site-packages /app/venv \
    && export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    && if [ -n "$TORCH" ]; then pip install $PIP_OPTS $TORCH; fi \
    && python -c 'import torch' \
    && python -c 'import re, tomllib; deps = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]["dependencies"]; print("\n".join(d for d in deps if re.split(r"[^A-Za-z0-9_.-]", d)[0].lower() not in ("torch", "torchvision")))' > /tmp/requirements.txt \
    && pip install $PIP_OPTS -r /tmp/requirements.txt \
    && pip install $PIP_OPTS --no-deps /src \
    && cp -r /src/configs /app/configs \
    && python -c 'import trainer'

FROM base
COPY --from=build /app /app
