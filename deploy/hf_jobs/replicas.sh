#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
#
# Start only the vLLM replica Jobs and wait until all are healthy, for a trainer that runs
# elsewhere (your own GPU box, or deploy/hf_jobs/trainer.sh later). Prints PROXY_REPLICAS=<urls>:
# give that to rollout-proxy together with HF_TOKEN, which it sends upstream as a Bearer token.
# If a replica fails, the Jobs already started are cancelled (KEEP_ON_FAILURE=1 keeps them).
#
# Usage: BUCKET=<org>/<bucket> deploy/hf_jobs/replicas.sh
#        DRY_RUN=1 BUCKET=<org>/<bucket> deploy/hf_jobs/replicas.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${here}/lib.sh"

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    print_usage
    exit 0
fi
(($# == 0)) || die "unexpected arguments: $* (settings are environment variables, see --help)"

validate_common
validate_bucket
ensure_hf_token

replicas_ready=0
on_exit() {
    local rc=$?
    if ((rc != 0 && replicas_ready == 0 && ${#REPLICA_JOB_IDS[@]} > 0)); then
        if [[ "${KEEP_ON_FAILURE}" == "1" ]]; then
            log "failed; KEEP_ON_FAILURE=1 leaves running: ${REPLICA_JOB_IDS[*]}"
        else
            log "failed; cancelling the ${#REPLICA_JOB_IDS[@]} replica Job(s) this run started"
            cancel_jobs "${REPLICA_JOB_IDS[@]}"
        fi
    fi
}
trap on_exit EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

start_replica_jobs
wait_replicas_healthy
replicas_ready=1

printf 'RUN_NAME=%s\n' "${RUN_NAME}"
printf 'REPLICA_JOB_IDS=%s\n' "$(IFS=,; printf '%s' "${REPLICA_JOB_IDS[*]}")"
printf 'PROXY_REPLICAS=%s\n' "$(IFS=,; printf '%s' "${REPLICA_URLS[*]}")"
