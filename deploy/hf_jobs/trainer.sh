#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
#
# Start only the trainer Job (with rollout-proxy inside it) in front of replicas that are already
# up, e.g. from deploy/hf_jobs/replicas.sh. PROXY_REPLICAS is the comma-separated list of the
# replicas' exposed URLs, in replica order.
#
# Usage: PROXY_REPLICAS=<url0>,<url1> BUCKET=<org>/<bucket> TRAINER_IMAGE=<image> \
#            deploy/hf_jobs/trainer.sh [trainer args...]
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

validate_common
validate_bucket
[[ -n "${PROXY_REPLICAS:-}" ]] || die "PROXY_REPLICAS is required: the replicas' URLs, comma-separated"
IFS=, read -r -a REPLICA_URLS <<<"${PROXY_REPLICAS}"
for url in "${REPLICA_URLS[@]}"; do
    [[ "${url}" =~ ^https?://[^[:space:],]+$ ]] || die "not a replica URL in PROXY_REPLICAS: '${url}'"
done
ensure_hf_token

start_trainer_job
printf 'TRAINER_JOB_ID=%s\n' "${TRAINER_JOB_ID}"
log "follow it: hf jobs logs -f ${TRAINER_JOB_ID}"
