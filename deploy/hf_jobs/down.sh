#!/usr/bin/env bash
# shellcheck source-path=SCRIPTDIR
#
# Stop a deployment: cancel every running or scheduled Job labelled rollout-proxy-run=<RUN_NAME>
# (the replicas and the trainer started by up.sh, replicas.sh or trainer.sh under that name).
# The bucket and what the trainer wrote to it (checkpoints, adapters) are left alone.
#
# Usage: RUN_NAME=<name> deploy/hf_jobs/down.sh
#        DRY_RUN=1 RUN_NAME=<name> deploy/hf_jobs/down.sh
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${here}/lib.sh"

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    print_usage
    exit 0
fi
(($# == 0)) || die "unexpected arguments: $* (settings are environment variables, see --help)"

validate_common

# `hf jobs ps` lists running and scheduling Jobs by default: exactly the ones that can be cancelled.
list_cmd=(hf jobs ps --quiet "${NS_ARGS[@]}" --label "rollout-proxy-run=${RUN_NAME}")
if is_dry_run; then
    print_cmd "${list_cmd[@]}"
    log "dry run: each id listed would be cancelled with: hf jobs cancel <id>"
    exit 0
fi
job_ids=()
while IFS= read -r line; do
    line="${line//[[:space:]]/}"
    [[ -n "${line}" ]] && job_ids+=("${line}")
done < <("${list_cmd[@]}")
if ((${#job_ids[@]} == 0)); then
    log "no running or scheduled Job is labelled rollout-proxy-run=${RUN_NAME}"
    exit 0
fi
log "cancelling ${#job_ids[@]} Job(s) of run ${RUN_NAME}"
cancel_jobs "${job_ids[@]}"
