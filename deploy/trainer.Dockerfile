# syntax=docker/dockerfile:1
#
# GPU trainer image: the project with its [trainer] extra (torch, trl, peft, accelerate, ...), the
# FSDP2 accelerate config, and deploy/train_with_proxy.sh, which starts rollout-proxy next to the
# trainer when the replicas are remote (HF Jobs) and then runs `accelerate launch`.
#
#   docker build -f deploy/trainer.Dockerfile -t <registry>/rollout-trainer .
#
# The build context is the repository root; deploy/trainer.Dockerfile.dockerignore keeps it to
# what this image needs. HF Jobs pulls images from a registry, so push the result somewhere the
# Job can pull from and pass it to deploy/hf_jobs/up.sh as TRAINER_IMAGE.

# The CUDA base only has to provide a userspace that the host driver accepts: the torch wheel
# installed below (PyPI's default linux x86_64 build) brings its own CUDA runtime libraries.
# Pick a tag no newer than what your GPU driver supports (`nvidia-smi` prints the ceiling). Note
# that the driver must also take the wheel's own runtime: PyPI's torch 2.13.0 pulls the CUDA 13
# libraries (nvidia-cuda-runtime 13.0, cudnn-cu13; seen in a build of this file), whatever the
# base image's CUDA version.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

FROM ${CUDA_IMAGE} AS build

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Ubuntu 24.04's python3 is 3.12 (the project needs >= 3.11).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY trainer ./trainer
# The [trainer] extra pins torch==2.13.0 (the version the trainer was verified with). The proxy
# comes along in the same wheel: on HF Jobs it runs inside this image, next to the trainer.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install ".[trainer]"

FROM ${CUDA_IMAGE} AS runtime

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:${PATH}

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*

COPY --from=build /opt/venv /opt/venv

WORKDIR /app
# Written by the trainer engineer: the FSDP2 launch configuration for the recipe's two GPUs.
COPY deploy/accelerate/fsdp2.yaml /app/deploy/accelerate/fsdp2.yaml
COPY --chmod=0755 deploy/train_with_proxy.sh /usr/local/bin/train-with-proxy

ENV ACCELERATE_CONFIG=/app/deploy/accelerate/fsdp2.yaml

# Runs as root on purpose: the adapters are written to shared storage (an HF Jobs bucket volume,
# an NFS/RWX claim) whose ownership this image cannot know. Derive an image with `USER <uid>`
# when your storage grants that uid write access.
# CMD, not ENTRYPOINT: HF Jobs and Kubernetes replace the command with their own
# (`train-with-proxy --output-dir ...`), and that must not be appended to an entrypoint.
CMD ["train-with-proxy"]
