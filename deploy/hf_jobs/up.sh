#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
#
# Bring up the published recipe on Hugging Face Jobs:
#   1. NUM_REPLICAS vLLM replica Jobs (one GPU each, runtime LoRA loading on, the bucket mounted),
#   2. wait until every replica answers /health through its exposed URL (HF token as Bearer),
#   3. the trainer Job, whose container starts rollout-proxy on 127.0.0.1 in front of the
#      replicas' URLs and points TRL's AsyncGRPOTrainer at it (deploy/train_with_proxy.sh).
# If a step fails, the Jobs already started are cancelled (KEEP_ON_FAILURE=1 keeps them).
#
# Usage: BUCKET=<org>/<bucket> TRAINER_IMAGE=<image> deploy/hf_jobs/up.sh [trainer args...]
#        DRY_RUN=1 ... deploy/hf_jobs/up.sh     # print the commands, submit nothing
# Trainer args are appended to TRAINER_ARGS. Settings (environment) are listed in lib.sh and in
# deploy/README.md; stop everything with: RUN_NAME=<name> deploy/hf_jobs/down.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${here}/lib.sh"

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    print_usage
    exit 0
fi
if (($# > 0)); then
    TRAINER_ARGS="${TRAINER_ARGS} $*"
fi
# WAIT_AND_TEARDOWN=1: after starting the trainer, wait for it to end, then cancel the replicas
# (which otherwise bill until JOB_TIMEOUT). Off by default so the terminal is given back at once.
WAIT_AND_TEARDOWN="${WAIT_AND_TEARDOWN:-0}"

validate_common
validate_bucket
require_flag WAIT_AND_TEARDOWN "${WAIT_AND_TEARDOWN}"
[[ -n "${TRAINER_IMAGE}" ]] \
    || die "TRAINER_IMAGE is required: build deploy/trainer.Dockerfile and push it where HF Jobs can pull it"
ensure_hf_token

cleanup_on_failure=1
on_exit() {
    local rc=$?
    if ((rc != 0 && cleanup_on_failure == 1)); then
        local -a started=("${REPLICA_JOB_IDS[@]}")
        [[ -n "${TRAINER_JOB_ID}" ]] && started+=("${TRAINER_JOB_ID}")
        if ((${#started[@]} == 0)); then
            :
        elif [[ "${KEEP_ON_FAILURE}" == "1" ]]; then
            log "failed; KEEP_ON_FAILURE=1 leaves running: ${started[*]}"
        else
            log "failed; cancelling the ${#started[@]} Job(s) this run started"
            cancel_jobs "${started[@]}"
        fi
    fi
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

log "run ${RUN_NAME}: ${NUM_REPLICAS} x ${MODEL} on ${REPLICA_FLAVOR}, bucket ${BUCKET} at ${MOUNT_PATH}"
start_replica_jobs
wait_replicas_healthy
start_trainer_job
cleanup_on_failure=0

printf 'RUN_NAME=%s\n' "${RUN_NAME}"
printf 'REPLICA_JOB_IDS=%s\n' "$(IFS=,; printf '%s' "${REPLICA_JOB_IDS[*]}")"
printf 'PROXY_REPLICAS=%s\n' "$(IFS=,; printf '%s' "${REPLICA_URLS[*]}")"
printf 'TRAINER_JOB_ID=%s\n' "${TRAINER_JOB_ID}"

if [[ "${WAIT_AND_TEARDOWN}" == "1" ]]; then
    log "waiting for the trainer (Ctrl-C stops waiting and cancels nothing)"
    trainer_rc=0
    if is_dry_run; then
        print_cmd hf jobs wait "${NS_ARGS[@]}" "${TRAINER_JOB_ID}"
    else
        hf jobs wait "${NS_ARGS[@]}" "${TRAINER_JOB_ID}" || trainer_rc=$?
    fi
    log "trainer ended (exit ${trainer_rc}); cancelling the replicas"
    cancel_jobs "${REPLICA_JOB_IDS[@]}"
    exit "${trainer_rc}"
fi
log "follow the trainer: hf jobs logs -f ${TRAINER_JOB_ID}"
log "the replicas bill until they are stopped: RUN_NAME=${RUN_NAME} ${here}/down.sh"
