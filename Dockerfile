# syntax=docker/dockerfile:1
#
# rollout-proxy: the slim proxy image (no torch, no trainer extra).
#
#   docker build -t rollout-proxy .
#   docker run --rm -p 127.0.0.1:8000:8000 \
#       -e PROXY_REPLICAS=http://vllm-0:8000,http://vllm-1:8000 rollout-proxy
#
# Two stages: the first builds wheels of the project and of its runtime dependencies only
# (pyproject's [project.dependencies]; the [trainer] and [dev] extras are never requested, so
# torch, trl and friends cannot end up in the image); the second installs those wheels into a
# fresh slim Python with no compiler and no build cache, and runs as an unprivileged user.
# The trainer's GPU image is deploy/trainer.Dockerfile.

# Same minor version as the development venv and CI (pyproject: requires-python >= 3.11).
# Pin by digest (python:3.11-slim-bookworm@sha256:...) in production for reproducible builds.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A C compiler for the one C extension (proxy/core/_native.c, the per-request parse and hashing;
# PROXY_NATIVE): the wheel is compiled here and the runtime stage only installs it, so no compiler
# reaches the final image. python3-dev: Python's headers where the base is Debian's own Python
# (scripts/image_test.sh's local base); the python:* images ship them already.
# DL3008 (pin apt versions): bookworm's gcc is what the stage needs, pinned by the base image's
# release; the packages never reach the runtime stage.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev python3-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src
# Only what the wheel needs: the package metadata and the proxy package. trainer/ is left out on
# purpose: it is useless without torch, and the proxy package does not import it.
COPY pyproject.toml setup.py README.md ./
COPY proxy ./proxy
# With the [kv-events] extra (pyzmq, msgpack, msgspec) for PROXY_KV_EVENTS, precise routing from
# vLLM's KV-cache events, which fails at start-up without it. It adds ~6 MB installed (measured in
# the dev venv: pyzmq 27.3 with its bundled libzmq 3.2 MB, msgpack 1.2 1.7 MB, msgspec 0.23
# 0.6 MB). Quoted: the brackets are a shell glob.
RUN pip wheel --wheel-dir /wheels '.[kv-events]'

FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="rollout-proxy" \
      org.opencontainers.image.description="One URL in front of N vLLM replicas for TRL's AsyncGRPOTrainer" \
      org.opencontainers.image.licenses="Apache-2.0"

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# Install from the build stage's wheels through a bind mount, so the wheels themselves never
# land in a layer of this image. The import check fails the build if the C extension did not
# compile in stage one (setup.py makes it optional so that a bare `pip install` never fails). --no-index: nothing is fetched from a registry at this point,
# the dependency set is exactly what stage one resolved.
# DL3013 (pin versions) does not apply: with --no-index the only candidates are the wheels stage
# one built from this checkout, so the versions are already fixed by that stage.
# The account is `rollout-proxy`, not `proxy`: Debian's base-passwd already has a `proxy` user and
# group (uid/gid 13) in every bookworm image, python:*-slim-bookworm included, and groupadd
# refuses the duplicate (found by the first real build, `make image-test`).
# hadolint ignore=DL3013
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels 'rollout-proxy[kv-events]' \
    && python -c "import proxy.core._native" \
    && groupadd --system --gid 10001 rollout-proxy \
    && useradd --system --uid 10001 --gid rollout-proxy --no-create-home \
       --shell /usr/sbin/nologin rollout-proxy

# Inside a container the proxy must listen on all interfaces, otherwise nothing outside the
# container's own loopback can reach it (the proxy's own default, 127.0.0.1, is the safe one for
# a bare-metal run). SECURITY: this makes every endpoint, including /v1/load_lora_adapter and
# /pause, reachable by whoever can reach the published port. Publish it on 127.0.0.1 only
# (`-p 127.0.0.1:8000:8000`), keep it on a private network (compose, a ClusterIP Service), or set
# PROXY_API_KEYS (the proxy's inbound-auth setting) before exposing it any wider.
# 8000 is vLLM's own default port, so TRL's vllm_server_base_url keeps its usual shape.
ENV PROXY_HOST=0.0.0.0 \
    PROXY_PORT=8000

USER 10001:10001
EXPOSE 8000

# /health answers 200 only while every replica is healthy (it is the signal TRL polls before it
# starts), so "unhealthy" here means "the fleet is degraded", not "the process is dead": Docker
# only reports it (and compose's depends_on can wait on it); it restarts nothing. Plain Python
# urllib, so the image needs no curl; a non-2xx answer or a refused connection exits non-zero.
# start-period: the proxy's own start-up is sub-second, but the fleet's first probe round must
# complete before /health can turn 200.
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('PROXY_PORT', '8000'), timeout=4)"]

CMD ["rollout-proxy"]
