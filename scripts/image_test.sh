#!/usr/bin/env bash
# make image-test: build the proxy image (./Dockerfile) with podman on a Debian bookworm base made
# here with debootstrap, then start it and check it from outside (tests/integration/
# test_deploy_image.py): /health, /metrics, a routed completion, the image's HEALTHCHECK, non-root
# with a read-only root filesystem, its size, and SIGTERM within the grace period.
#
# Why a local base: no registry but PyPI and the Debian mirror is reachable here, so
# python:3.11-slim-bookworm cannot be pulled. The base is what that image is for this Dockerfile:
# Debian bookworm (Python 3.11), `python` and `pip` first on PATH (a venv at /opt/python, because
# Debian's own python3 refuses `pip install` outside a venv, PEP 668), `groupadd`/`useradd`.
# Where a registry is reachable, IMAGE_TEST_BASE=docker.io/library/python:3.11-slim-bookworm
# skips the debootstrap.
#
# Needs (Debian): apt-get install -y podman debootstrap runc. Run as root (debootstrap and the
# chroot need it; rootless podman would also need subuid ranges).
#
# Cached between runs: the base image (podman's store, tag $IMAGE_TEST_BASE; debootstrap took
# 5.7 min on the shared 2-core machine, so it is built once; `podman rmi` it to rebuild). The
# proxy image itself is rebuilt every run, without layer cache (--layers=false): podman 4.3 /
# buildah 1.28 (bookworm's) mis-handle `RUN --mount=type=bind,from=<stage>` when the stage comes
# from the layer cache: the mount is empty (containers/buildah#4375) or a stale layer is reused
# (containers/podman#17119). Docker's BuildKit has neither problem.
#
# Environment:
#   IMAGE_TEST_IMAGE   tag of the proxy image built and tested (localhost/rollout-proxy:image-test)
#   IMAGE_TEST_BASE    base image (localhost/rollout-proxy-base:bookworm-py311, made if missing)
#   IMAGE_TEST_MIRROR  Debian mirror for debootstrap (default: the first one apt uses here)
#   IMAGE_TEST_CA      CA bundle the build's pip trusts (default: $PIP_CERT, else the system one),
#                      for networks that re-sign TLS; bind-mounted into RUN steps, never a layer
#   PYTEST             pytest to run the checks with (default: .venv/bin/python -m pytest)
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE_TEST_IMAGE:-localhost/rollout-proxy:image-test}
BASE=${IMAGE_TEST_BASE:-localhost/rollout-proxy-base:bookworm-py311}
CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/rollout-proxy-image
started=$(date +%s)

say() { echo "[image-test] $*"; }
need() {
    command -v "$1" >/dev/null || {
        echo "[image-test] $1 not found: apt-get install -y podman debootstrap runc" >&2
        exit 2
    }
}
need podman

mkdir -p "$CACHE"
# podman's defaults that an unprivileged sandbox (no CAP_SYS_RESOURCE, cgroup v1/v2 hybrid) cannot
# honour, found on this machine: the default RLIMIT_NOFILE (1048576) exceeds the host's hard
# limit, and crun 1.8 refuses hybrid cgroup hosts ("cgroups in hybrid mode not supported"). The
# container gets the host's own nofile limit and 4096 processes (the proxy runs one process); runc
# is used where installed. CONTAINERS_CONF applies it to every podman call here, the checks' too.
nofile=$(ulimit -Hn)
[[ $nofile == unlimited ]] && nofile=1048576
runtime_line=""
command -v runc >/dev/null && runtime_line='runtime = "runc"'
cat >"$CACHE/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=4096:4096"]
[engine]
$runtime_line
EOF
export CONTAINERS_CONF="$CACHE/containers.conf"

debian_mirror() {
    # The mirror apt already uses (deb822 .sources or one-line lists), else Debian's CDN.
    local uri
    uri=$(grep -hoE '^(URIs: *|deb +)(\[[^]]*\] +)?https?://[^ ]+/debian/?( |$)' \
        /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null |
        grep -oE 'https?://[^ ]+' | head -n1 || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

make_base() {
    need debootstrap
    local mirror=${IMAGE_TEST_MIRROR:-$(debian_mirror)}
    local rootfs="$CACHE/rootfs"
    rm -rf "$rootfs"
    say "making $BASE: debootstrap bookworm from $mirror (minutes, once)"
    # minbase: essential + apt only; python3-venv brings ensurepip (pip for the venv below).
    debootstrap --variant=minbase --include=python3,python3-venv bookworm "$rootfs" "$mirror" \
        >"$CACHE/debootstrap.log" 2>&1 || {
        tail -n 20 "$CACHE/debootstrap.log" >&2
        exit 1
    }
    chroot "$rootfs" /usr/bin/python3 -m venv /opt/python
    # What python:*-slim leaves out too: package caches and lists, docs, man pages, locales.
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
        "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* \
        "$rootfs"/usr/share/locale/*
    tar -C "$rootfs" -c . | podman import \
        --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        - "$BASE" >/dev/null
    rm -rf "$rootfs"
    say "base made in $(($(date +%s) - started))s"
}

if podman image exists "$BASE"; then
    say "base $BASE cached"
elif [[ $BASE == localhost/* ]]; then
    make_base
else
    podman pull "$BASE"
fi

# The build's pip reaches PyPI; on a network that re-signs TLS it must trust the host's CA. Only
# RUN steps see these two bind mounts; nothing of them is committed to a layer.
ca=${IMAGE_TEST_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
trust=()
if [[ -f $ca ]]; then
    printf '[global]\ncert = /etc/ssl/certs/build-host-ca.crt\n' >"$CACHE/pip.conf"
    trust=(-v "$CACHE/pip.conf:/etc/pip.conf:ro" -v "$ca:/etc/ssl/certs/build-host-ca.crt:ro")
fi

# The image this tag named before, removed once the new build has the tag (kept if still used).
previous=$(podman image inspect --format '{{.Id}}' "$IMAGE" 2>/dev/null || true)
build_started=$(date +%s)
say "building $IMAGE from $(pwd) on $BASE"
# --format docker: the OCI image format has no HEALTHCHECK; Docker's keeps it. --network host:
# the build's pip reaches PyPI the way the host does.
podman build --layers=false --format docker --network host "${trust[@]}" \
    --build-arg "PYTHON_IMAGE=$BASE" -t "$IMAGE" . >"$CACHE/build.log" 2>&1 || {
    tail -n 30 "$CACHE/build.log" >&2
    say "build failed; full log: $CACHE/build.log"
    exit 1
}
current=$(podman image inspect --format '{{.Id}}' "$IMAGE")
if [[ -n $previous && $previous != "$current" ]]; then
    podman rmi "$previous" >/dev/null 2>&1 || true
fi
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
base_size=$(podman image inspect --format '{{.Size}}' "$BASE")
say "built in $(($(date +%s) - build_started))s: $IMAGE $((size / 1000000)) MB" \
    "(base $((base_size / 1000000)) MB, proxy layers $(((size - base_size) / 1000000)) MB)"

PYTEST=${PYTEST:-.venv/bin/python -m pytest}
IMAGE_TEST_IMAGE=$IMAGE $PYTEST -p no:cacheprovider -v -s tests/integration/test_deploy_image.py
say "done in $(($(date +%s) - started))s"
