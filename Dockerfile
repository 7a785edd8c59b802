# syntax=docker/dockerfile:1
# The trainer's image: one image for GPUs and CPUs, built from public parts.
#
#   make image                         docker/build-image.sh: a Debian base + the CUDA builds of torch
#                                      and torchvision from PyPI (their wheels carry the CUDA runtime,
#                                      cuDNN and NCCL; only the NVIDIA driver comes from the host)
#   docker build --network host -t fsdp-trainer:latest .      the same, by hand
#
# The CUDA build of torch also runs on the CPU (gloo), so `make up CPU=1` and the tests use this image.
#
# Versions, in this one place:
#   torch 2.15.0 from PyPI is built for CUDA 13: it needs an NVIDIA driver >= 580 on the host
#   (`nvidia-smi` prints the driver's CUDA version: it must be 13.0 or higher). For an older driver,
#   build with a torch built for an older CUDA, e.g.
#     make image IMAGE_ARGS="--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
#                            --build-arg TORCH_VERSION=2.10.0 --build-arg TORCHVISION_VERSION=0.25.0"
#   (CUDA 12.6 runs on drivers >= 525). The other Python dependencies come from pyproject.toml.
ARG BASE_IMAGE=debian:bookworm-slim

FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# python3 + venv: the interpreter (Debian bookworm: 3.11). tini: PID 1, forwards SIGTERM/SIGINT to
# the launcher (which forwards them to the ranks) and reaps zombies. libibverbs1, ibverbs-providers,
# librdmacm1: the RDMA user-space libraries NCCL loads to use InfiniBand/RoCE (without them it falls
# back to TCP sockets). ca-certificates: HTTPS for pip below.
# (Versions: those of the base's distribution release.)
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
       python3 python3-venv tini libibverbs1 ibverbs-providers librdmacm1 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --shell /bin/bash trainer \
    && install -d -o trainer -g trainer /app /src

# All metadata before the heavy layer: the classic builder runs a container for each instruction,
# which under storage drivers that copy whole layers (vfs) copies everything below it.
# PYTHONNOUSERSITE: a home directory bind-mounted from the host (Pyxis, Apptainer) must not shadow
# the image's packages with ~/.local ones.
ENV PATH=/app/venv/bin:$PATH \
    PYTHONNOUSERSITE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /app
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["python3", "-m", "trainer.launch", "--nproc-per-node=auto", "--config", "configs/default.yaml"]
# The venv is installed by, and runs as, this non-root user.
USER trainer

ARG TORCH_VERSION=2.15.0
ARG TORCHVISION_VERSION=0.29.2
# Empty: PyPI (CUDA builds on Linux x86_64). Else an index of other builds (see the top).
ARG TORCH_INDEX_URL=""
# A site's own index or mirror for the other packages ("--index-url https://pypi.example.org/simple").
ARG PIP_OPTS=""
# The s3 extra (s3fs): a run dir in a bucket, run_dir: s3://BUCKET/PREFIX (make submit-k8s RUN_DIR=s3://...).
# Everything heavy is one last layer: under vfs and in `enroot import`, every further layer over
# 6 GB of CUDA libraries would cost a full copy. The sources and docker/ca-bundle.crt (there when
# docker/build-image.sh found that this host's pip trusts its own certificates, as behind a
# TLS-inspecting proxy) are removed in the same layer.
COPY --chown=trainer:trainer . /src
# hadolint ignore=DL3013,SC2086
RUN python3 -m venv /app/venv \
    && export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    && if [ -f /src/docker/ca-bundle.crt ]; then export PIP_CERT=/src/docker/ca-bundle.crt; fi \
    && pip install $PIP_OPTS ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
       "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
    && pip install $PIP_OPTS '/src[s3]' \
    && cp -r /src/configs /app/configs \
    && rm -rf /src/* /src/.[!.]* \
    && python -c 'import torch, torchvision, trainer, s3fs'
