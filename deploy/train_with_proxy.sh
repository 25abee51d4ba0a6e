#!/usr/bin/env bash
#
# train-with-proxy: the trainer image's start command. Runs the recipe's trainer with
# rollout-proxy in front of the vLLM replicas, in one of two modes:
#
#   PROXY_REPLICAS=<url0>,<url1>,...  (HF Jobs: the replicas are other Jobs, reachable only by
#       their exposed URLs) start rollout-proxy inside this container on PROXY_HOST:PROXY_PORT
#       (127.0.0.1:8000 unless set), wait until its /health is 200 (every replica healthy), then
#       start the trainer against it. The proxy reads its other PROXY_* settings and HF_TOKEN (its
#       upstream Bearer token) from the environment. If the proxy dies, the trainer is stopped:
#       without it every rollout would fail, slowly, through TRL's retries.
#   PROXY_URL=<url>  (compose, Kubernetes: the proxy is its own service) use that proxy.
#
# The trainer command is TRAIN_CMD (default: accelerate launch with the FSDP2 config at
# $ACCELERATE_CONFIG, module `trainer`) + TRAINER_URL_FLAG <proxy url> + this script's arguments.
# The proxy URL is also exported as ROLLOUT_PROXY_URL. Exits with the trainer's status.
#
# Usage: train-with-proxy [trainer args...]
set -euo pipefail

log() { printf '[train-with-proxy] %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 2
}

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
    exit 0
fi

# How long to wait for the local proxy's /health. The replicas were already healthy when the Job
# was submitted (deploy/hf_jobs/up.sh waits for that), so this covers the proxy's start and its
# first probe round, plus a replica that restarts meanwhile; 10 minutes is far beyond both.
PROXY_WAIT_S="${PROXY_WAIT_S:-600}"
ACCELERATE_CONFIG="${ACCELERATE_CONFIG:-/app/deploy/accelerate/fsdp2.yaml}"
TRAIN_CMD="${TRAIN_CMD:-accelerate launch --config_file ${ACCELERATE_CONFIG} -m trainer}"
# The trainer's flag for TRL's vllm_server_base_url; empty: pass the URL only as ROLLOUT_PROXY_URL.
TRAINER_URL_FLAG="${TRAINER_URL_FLAG---vllm-server-base-url}"

[[ "${PROXY_WAIT_S}" =~ ^[1-9][0-9]*$ ]] || die "PROXY_WAIT_S must be a positive integer, got '${PROXY_WAIT_S}'"
if [[ -n "${PROXY_REPLICAS:-}" && -n "${PROXY_URL:-}" ]]; then
    die "set PROXY_REPLICAS (start a proxy here) or PROXY_URL (use a running one), not both"
fi
if [[ -z "${PROXY_REPLICAS:-}" && -z "${PROXY_URL:-}" ]]; then
    die "set PROXY_REPLICAS (the replicas' URLs, comma-separated) or PROXY_URL (a running proxy)"
fi

proxy_pid=""
trainer_pid=""

stop_proxy() {
    if [[ -n "${proxy_pid}" ]] && kill -0 "${proxy_pid}" 2>/dev/null; then
        kill -TERM "${proxy_pid}" 2>/dev/null || true
        wait "${proxy_pid}" 2>/dev/null || true
    fi
}
trap stop_proxy EXIT

# A signal (HF Jobs cancel, docker stop, Kubernetes eviction) goes to the trainer first, so it can
# stop cleanly; the proxy is stopped when the trainer is gone (EXIT trap).
forward_signal() {
    local sig="$1"
    log "received SIG${sig}"
    if [[ -n "${trainer_pid}" ]]; then
        kill -"${sig}" "${trainer_pid}" 2>/dev/null || true
    else
        exit 143
    fi
}
trap 'forward_signal TERM' TERM
trap 'forward_signal INT' INT

# GET <url>/health once; succeed on 200. Python, not curl: the CUDA runtime image has no curl.
health_ok() {
    python3 - "$1" <<'PY'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1].rstrip("/") + "/health", timeout=5) as response:
        sys.exit(0 if response.status == 200 else 1)
except Exception:
    sys.exit(1)
PY
}

if [[ -n "${PROXY_REPLICAS:-}" ]]; then
    export PROXY_HOST="${PROXY_HOST:-127.0.0.1}"
    export PROXY_PORT="${PROXY_PORT:-8000}"
    [[ "${PROXY_PORT}" =~ ^[0-9]+$ ]] || die "PROXY_PORT must be a port number, got '${PROXY_PORT}'"
    # The trainer reaches the proxy over loopback even when it listens on all interfaces.
    proxy_url="http://127.0.0.1:${PROXY_PORT}"
    log "starting rollout-proxy on ${PROXY_HOST}:${PROXY_PORT} in front of ${PROXY_REPLICAS}"
    rollout-proxy &
    proxy_pid=$!
    deadline=$((SECONDS + PROXY_WAIT_S))
    until health_ok "${proxy_url}"; do
        kill -0 "${proxy_pid}" 2>/dev/null || {
            wait "${proxy_pid}" && rc=0 || rc=$?
            proxy_pid=""
            die "rollout-proxy exited (status ${rc}) before it became healthy; its log is above"
        }
        ((SECONDS < deadline)) \
            || die "rollout-proxy not healthy after ${PROXY_WAIT_S}s: some replica in PROXY_REPLICAS is unhealthy or unreachable (see the proxy's log above; is HF_TOKEN set?)"
        sleep 2
    done
    log "rollout-proxy healthy at ${proxy_url}"
else
    proxy_url="${PROXY_URL%/}"
fi
export ROLLOUT_PROXY_URL="${proxy_url}"

read -r -a train_cmd <<<"${TRAIN_CMD}"
((${#train_cmd[@]} > 0)) || die "TRAIN_CMD is empty"
if [[ -n "${TRAINER_URL_FLAG}" ]]; then
    train_cmd+=("${TRAINER_URL_FLAG}" "${proxy_url}")
fi
log "starting the trainer: ${train_cmd[*]} $*"
"${train_cmd[@]}" "$@" &
trainer_pid=$!

# Wait for whichever ends first. A trapped signal interrupts `wait -n`, which then leaves
# `finished` unset; the loop waits again, so the trainer's real exit status is what is returned.
watched=("${trainer_pid}")
[[ -n "${proxy_pid}" ]] && watched+=("${proxy_pid}")
while :; do
    finished=""
    wait -n -p finished "${watched[@]}" && rc=0 || rc=$?
    if [[ -z "${finished:-}" ]]; then
        continue
    fi
    if [[ "${finished}" == "${trainer_pid}" ]]; then
        log "trainer exited with status ${rc}"
        exit "${rc}"
    fi
    proxy_pid=""
    log "error: rollout-proxy exited (status ${rc}) while the trainer was running; stopping the trainer"
    kill -TERM "${trainer_pid}" 2>/dev/null || true
    wait "${trainer_pid}" || true
    exit 3
done
