# shellcheck shell=bash
#
# Shared settings and helpers of the HF Jobs scripts (sourced, never run). Every setting is an
# environment variable with a default; the scripts' --help and deploy/README.md list them.
#
# Verified against the `hf` CLI of huggingface_hub 2.4 (`hf jobs run --help`): --detach, --quiet
# (prints only the Job id), --name, --label, --flavor, --timeout, --env, --secrets, --volume
# hf://buckets/<org>/<bucket>:<path>, --expose <port>, `hf jobs inspect --json`
# (status.stage, status.expose_urls), `hf jobs ps --label k=v -q`, `hf jobs cancel`.
# An exposed port is served at https://<job-id>--<port>.hf.jobs and, unless exposed with
# --expose-public, answers only requests carrying `Authorization: Bearer <HF token>` with read
# access to the Job's namespace: that is why the proxy adds the token to every upstream call.

# ---- settings ---------------------------------------------------------------------------------

# One name tags every Job of a deployment (label rollout-proxy-run=<RUN_NAME>): down.sh cancels
# by that label, so two deployments with different names never touch each other's Jobs.
RUN_NAME="${RUN_NAME:-rollout-proxy}"
# The recipe serves with two replicas; any number works, the proxy routes over all it is given.
NUM_REPLICAS="${NUM_REPLICAS:-2}"
MODEL="${MODEL:-Qwen/Qwen2.5-Math-1.5B}"
# The reference behaviour (REFERENCE.md §2) was read from vLLM 0.33.0; the published demo used
# v0.27.1. Any version with runtime LoRA loading and the dev-mode /pause works.
VLLM_IMAGE="${VLLM_IMAGE:-vllm/vllm-openai:v0.33.0}"
# One GPU per replica and two for the FSDP2 trainer, as in the recipe. The recipe does not name
# a GPU type: a 1.5B model in bf16 with a 4k context fits any of these; `hf jobs hardware` lists
# the flavors and their prices.
REPLICA_FLAVOR="${REPLICA_FLAVOR:-a100-large}"
TRAINER_FLAVOR="${TRAINER_FLAVOR:-h200x2}"
# Hard stop of every Job, so a forgotten deployment cannot bill forever. The recipe's 500 steps
# took 53 min (3 h 27 min before the proxy); 6h leaves room for the slow path and a resume.
JOB_TIMEOUT="${JOB_TIMEOUT:-6h}"
# The storage bucket mounted at the same path in every Job: the trainer publishes adapters under
# it and the replicas load them by that same absolute path. Required: <org-or-user>/<bucket>.
BUCKET="${BUCKET:-}"
MOUNT_PATH="${MOUNT_PATH:-/bucket}"
# Read-write like the recipe's mounts. The replicas only read; `ro` is the least-privilege choice,
# but whether a read-only bucket mount sees new files as promptly has not been verified here.
REPLICA_MOUNT_MODE="${REPLICA_MOUNT_MODE:-rw}"
OUTPUT_DIR="${OUTPUT_DIR:-${MOUNT_PATH}/${RUN_NAME}}"
# vLLM's own default port, also used by the proxy inside the trainer Job.
VLLM_PORT="${VLLM_PORT:-8000}"
# The recipe's serving flags (REFERENCE.md §2 and §4): rank-1 adapters; 6 slots =
# max_staleness (4) + 2, which TRL checks at start-up; 4,096-token context; 16-token blocks,
# spelled out because the proxy's prefix hashing must use the same block size (PROXY_BLOCK_SIZE).
MAX_LORA_RANK="${MAX_LORA_RANK:-1}"
MAX_LORAS="${MAX_LORAS:-6}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4096}"
BLOCK_SIZE="${BLOCK_SIZE:-16}"
# Extra `vllm serve` flags, split on whitespace (e.g. "--gpu-memory-utilization 0.85").
VLLM_EXTRA_ARGS="${VLLM_EXTRA_ARGS:-}"
# Cold start of a replica = waiting for a GPU + pulling the image + downloading the model +
# loading it + CUDA graph capture. The last four take a few minutes for a 1.5B model; the wait for
# hardware has no bound, so this is generous. A Job that fails is reported at once, not at the end.
HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-1800}"
# A health probe every 10 s costs nothing and adds at most 10 s to a start that takes minutes.
POLL_S="${POLL_S:-10}"
# Optional: run the Jobs in an organisation's namespace instead of the token owner's.
HF_NAMESPACE="${HF_NAMESPACE:-}"
# DRY_RUN=1 prints every command instead of running it; nothing is submitted or probed.
DRY_RUN="${DRY_RUN:-0}"
# KEEP_ON_FAILURE=1 leaves already started Jobs running when up.sh fails (to read their logs);
# by default they are cancelled, since an idle GPU Job bills by the minute.
KEEP_ON_FAILURE="${KEEP_ON_FAILURE:-0}"

# The trainer image (deploy/trainer.Dockerfile, pushed to a registry HF Jobs can pull from).
TRAINER_IMAGE="${TRAINER_IMAGE:-}"
# Arguments for the trainer (`python -m trainer`), split on whitespace; the output directory on
# the bucket comes first so adapters land where the replicas can read them.
TRAINER_ARGS="${TRAINER_ARGS:---output-dir ${OUTPUT_DIR}}"
# EXPOSE_PROXY=1 also exposes the proxy inside the trainer Job (port 8000, behind the HF Jobs
# proxy's token check) so a Prometheus outside can scrape /metrics; see deploy/prometheus.yml.
EXPOSE_PROXY="${EXPOSE_PROXY:-0}"

# ---- helpers ----------------------------------------------------------------------------------

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
    printf 'these scripts need bash >= 4.4 (found %s); on macOS: brew install bash\n' "${BASH_VERSION}" >&2
    exit 1
fi

log() { printf '[%s] %s\n' "${0##*/}" "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

is_dry_run() { [[ "${DRY_RUN}" == "1" ]]; }

# --help: print the calling script's header comment (after the shebang and directives).
print_usage() {
    awk 'NR == 1 || /^# shellcheck/ { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}

# Print a command the way a shell would read it back, prefixed with "+ ", on stdout.
print_cmd() {
    local quoted
    printf -v quoted '%q ' "$@"
    printf '+ %s\n' "${quoted% }"
}

require_positive_int() {
    local name="$1" value="$2"
    [[ "${value}" =~ ^[1-9][0-9]*$ ]] || die "${name} must be a positive integer, got '${value}'"
}

require_flag() {
    local name="$1" value="$2"
    [[ "${value}" == "0" || "${value}" == "1" ]] || die "${name} must be 0 or 1, got '${value}'"
}

# Arguments every `hf jobs` subcommand gets (the namespace, when one is set).
NS_ARGS=()

validate_common() {
    [[ "${RUN_NAME}" =~ ^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$ ]] \
        || die "RUN_NAME must be 1-40 lowercase letters, digits or dashes (it names Jobs and labels), got '${RUN_NAME}'"
    require_flag DRY_RUN "${DRY_RUN}"
    require_flag KEEP_ON_FAILURE "${KEEP_ON_FAILURE}"
    require_flag EXPOSE_PROXY "${EXPOSE_PROXY}"
    require_positive_int NUM_REPLICAS "${NUM_REPLICAS}"
    require_positive_int HEALTH_TIMEOUT_S "${HEALTH_TIMEOUT_S}"
    require_positive_int POLL_S "${POLL_S}"
    require_positive_int VLLM_PORT "${VLLM_PORT}"
    if [[ -n "${HF_NAMESPACE}" ]]; then
        NS_ARGS=(--namespace "${HF_NAMESPACE}")
    fi
    if ! is_dry_run; then
        command -v hf >/dev/null || die "the 'hf' CLI is not installed: pip install -U 'huggingface_hub>=1.20'"
        command -v curl >/dev/null || die "curl is needed for the health probes"
        command -v python3 >/dev/null || die "python3 is needed to read 'hf jobs inspect --json'"
    fi
}

validate_bucket() {
    [[ -n "${BUCKET}" ]] || die "BUCKET is required: the storage bucket <org-or-user>/<name> that every Job mounts"
    [[ "${BUCKET}" =~ ^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$ ]] \
        || die "BUCKET must look like <org-or-user>/<name>, got '${BUCKET}'"
    [[ "${MOUNT_PATH}" =~ ^/[A-Za-z0-9._/-]*$ && "${MOUNT_PATH}" != "/" ]] \
        || die "MOUNT_PATH must be an absolute path other than /, got '${MOUNT_PATH}'"
    [[ "${OUTPUT_DIR}" == "${MOUNT_PATH%/}"/* ]] \
        || die "OUTPUT_DIR (${OUTPUT_DIR}) must be under MOUNT_PATH (${MOUNT_PATH}): the replicas load adapters from there"
    [[ "${REPLICA_MOUNT_MODE}" == "rw" || "${REPLICA_MOUNT_MODE}" == "ro" ]] \
        || die "REPLICA_MOUNT_MODE must be rw or ro, got '${REPLICA_MOUNT_MODE}'"
}

# The HF token: the Jobs get it as a secret (model download; the proxy's upstream auth) and the
# health probes here send it. Exported so that `hf jobs run --secrets HF_TOKEN` can read it.
ensure_hf_token() {
    if is_dry_run; then
        HF_TOKEN="${HF_TOKEN:-<HF_TOKEN>}"
    elif [[ -z "${HF_TOKEN:-}" ]]; then
        HF_TOKEN="$(hf auth token 2>/dev/null || true)"
        [[ -n "${HF_TOKEN}" ]] || die "no HF token: export HF_TOKEN=... or run 'hf auth login'"
    fi
    export HF_TOKEN
}

# Submit a Job in the background and set SUBMITTED_JOB_ID. Arguments: a placeholder id for dry
# runs, then what follows `hf jobs run`. Dry run: print the command (stdout) and use the placeholder.
SUBMITTED_JOB_ID=""
submit_job() {
    local placeholder="$1"
    shift
    local -a cmd=(hf jobs run --detach --quiet "${NS_ARGS[@]}" "$@")
    if is_dry_run; then
        print_cmd "${cmd[@]}"
        SUBMITTED_JOB_ID="${placeholder}"
        return 0
    fi
    local out
    out="$("${cmd[@]}")" || die "hf jobs run failed: $(print_cmd "${cmd[@]}")"
    out="${out//[[:space:]]/}"
    [[ "${out}" =~ ^[A-Za-z0-9_-]+$ ]] || die "unexpected output from 'hf jobs run --quiet': '${out}'"
    SUBMITTED_JOB_ID="${out}"
}

# Print "<stage>\x1f<first exposed url>\x1f<message>" for a Job, read from `hf jobs inspect --json`.
# \x1f (unit separator), not a tab: `read` merges adjacent whitespace separators, so an empty URL
# between two tabs would shift the message into the URL field.
job_status() {
    local job_id="$1" json
    json="$(hf jobs inspect --json "${NS_ARGS[@]}" "${job_id}")" || return 1
    python3 -c '
import json, sys
jobs = json.loads(sys.argv[1])
job = jobs[0] if isinstance(jobs, list) else jobs
status = job.get("status") or {}
urls = status.get("expose_urls") or []
message = " ".join(str(status.get("message") or "").split())
print(status.get("stage", "UNKNOWN"), urls[0] if urls else "", message, sep="\x1f")
' "${json}"
}

# GET <url>/health with the HF token as Bearer; print the HTTP status (000: no answer).
# The header reaches curl through a config read from stdin, so the token never shows in `ps`.
probe_health() {
    local url="$1"
    printf 'header = "Authorization: Bearer %s"\n' "${HF_TOKEN}" \
        | curl --config - --silent --output /dev/null --write-out '%{http_code}' \
            --max-time 10 "${url%/}/health" || true
}

# Cancel Jobs by id; best effort (a Job that already ended cannot be cancelled, which is fine).
cancel_jobs() {
    local job_id
    for job_id in "$@"; do
        if is_dry_run; then
            print_cmd hf jobs cancel "${NS_ARGS[@]}" "${job_id}"
        elif hf jobs cancel "${NS_ARGS[@]}" "${job_id}" >/dev/null; then
            log "cancelled ${job_id}"
        else
            log "could not cancel ${job_id} (already finished?)"
        fi
    done
}

bucket_volume() {
    local mode="$1"
    printf 'hf://buckets/%s:%s:%s' "${BUCKET}" "${MOUNT_PATH}" "${mode}"
}

# ---- the deployment steps ---------------------------------------------------------------------

REPLICA_JOB_IDS=()
REPLICA_URLS=()
TRAINER_JOB_ID=""

# Start NUM_REPLICAS vLLM Jobs (they schedule in parallel); fill REPLICA_JOB_IDS.
start_replica_jobs() {
    local -a serve_args extra=()
    if [[ -n "${VLLM_EXTRA_ARGS}" ]]; then
        read -r -a extra <<<"${VLLM_EXTRA_ARGS}"
    fi
    serve_args=(
        vllm serve "${MODEL}"
        --host 0.0.0.0 --port "${VLLM_PORT}"
        --enable-lora --max-lora-rank "${MAX_LORA_RANK}" --max-loras "${MAX_LORAS}"
        --max-model-len "${MAX_MODEL_LEN}" --block-size "${BLOCK_SIZE}"
        "${extra[@]}"
    )
    local i
    for ((i = 0; i < NUM_REPLICAS; i++)); do
        submit_job "DRYRUN-vllm-${i}" \
            --name "${RUN_NAME}-vllm-${i}" \
            --label "rollout-proxy-run=${RUN_NAME}" --label "rollout-proxy-role=vllm" \
            --flavor "${REPLICA_FLAVOR}" --timeout "${JOB_TIMEOUT}" \
            --secrets HF_TOKEN \
            --env VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 \
            --env VLLM_SERVER_DEV_MODE=1 \
            --volume "$(bucket_volume "${REPLICA_MOUNT_MODE}")" \
            --expose "${VLLM_PORT}" \
            "${VLLM_IMAGE}" "${serve_args[@]}"
        REPLICA_JOB_IDS+=("${SUBMITTED_JOB_ID}")
        log "replica ${i}: job ${SUBMITTED_JOB_ID}"
    done
}

# Wait until every replica Job answers 200 on /health through its exposed URL; fill REPLICA_URLS
# in replica order. A Job that ends (error, cancel) fails the wait at once with its message.
wait_replicas_healthy() {
    local n="${#REPLICA_JOB_IDS[@]}" i
    REPLICA_URLS=()
    if is_dry_run; then
        for ((i = 0; i < n; i++)); do
            REPLICA_URLS[i]="https://${REPLICA_JOB_IDS[i]}--${VLLM_PORT}.hf.jobs"
            print_cmd curl -H "Authorization: Bearer <HF_TOKEN>" "${REPLICA_URLS[i]}/health"
        done
        return 0
    fi
    local -a is_healthy=()
    local deadline=$((SECONDS + HEALTH_TIMEOUT_S)) ready=0 line stage url message code
    while ((ready < n)); do
        for ((i = 0; i < n; i++)); do
            [[ "${is_healthy[i]:-0}" == "1" ]] && continue
            if ! line="$(job_status "${REPLICA_JOB_IDS[i]}")"; then
                log "replica ${i}: could not inspect job ${REPLICA_JOB_IDS[i]}; retrying"
                continue
            fi
            IFS=$'\x1f' read -r stage url message <<<"${line}"
            case "${stage}" in
                ERROR | CANCELED | COMPLETED | DELETED)
                    die "replica ${i} (job ${REPLICA_JOB_IDS[i]}) ended with stage ${stage}${message:+: ${message}}; see: hf jobs logs ${REPLICA_JOB_IDS[i]}"
                    ;;
                RUNNING)
                    [[ -n "${url}" ]] || continue
                    code="$(probe_health "${url}")"
                    if [[ "${code}" == "200" ]]; then
                        is_healthy[i]=1
                        REPLICA_URLS[i]="${url}"
                        ready=$((ready + 1))
                        log "replica ${i} healthy at ${url}"
                    elif [[ "${code}" == "401" || "${code}" == "403" ]]; then
                        die "replica ${i} answered ${code} to the health probe: HF_TOKEN lacks read access to the Job's namespace"
                    fi
                    ;;
                *) ;; # SCHEDULING, or a stage this script does not know yet: keep waiting
            esac
        done
        ((ready < n)) || break
        ((SECONDS < deadline)) || die "replicas not all healthy after ${HEALTH_TIMEOUT_S}s (${ready}/${n}); raise HEALTH_TIMEOUT_S or see: hf jobs logs <job id>"
        sleep "${POLL_S}"
    done
}

# Start the trainer Job, with the proxy inside it pointed at the replicas' URLs.
start_trainer_job() {
    [[ -n "${TRAINER_IMAGE}" ]] \
        || die "TRAINER_IMAGE is required: build deploy/trainer.Dockerfile and push it where HF Jobs can pull it"
    ((${#REPLICA_URLS[@]} > 0)) || die "no replica URLs to put behind the proxy"
    local urls trainer_args=()
    urls="$(
        IFS=,
        printf '%s' "${REPLICA_URLS[*]}"
    )"
    if [[ -n "${TRAINER_ARGS}" ]]; then
        read -r -a trainer_args <<<"${TRAINER_ARGS}"
    fi
    local -a expose=()
    if [[ "${EXPOSE_PROXY}" == "1" ]]; then
        # Listening beyond loopback is what makes the port reachable through --expose; the HF Jobs
        # gateway in front still demands a token with read access to the namespace, which is
        # the authentication this opt-in relies on (set PROXY_ADMIN_KEYS too for defence in depth).
        expose=(--expose 8000 --env PROXY_HOST=0.0.0.0 --env PROXY_ALLOW_UNAUTHENTICATED=true)
    fi
    submit_job "DRYRUN-trainer" \
        --name "${RUN_NAME}-trainer" \
        --label "rollout-proxy-run=${RUN_NAME}" --label "rollout-proxy-role=trainer" \
        --flavor "${TRAINER_FLAVOR}" --timeout "${JOB_TIMEOUT}" \
        --secrets HF_TOKEN \
        --env "PROXY_REPLICAS=${urls}" \
        --env "PROXY_BLOCK_SIZE=${BLOCK_SIZE}" \
        --env "PROXY_ADAPTER_ROOTS=${MOUNT_PATH}" \
        "${expose[@]}" \
        --volume "$(bucket_volume rw)" \
        "${TRAINER_IMAGE}" train-with-proxy "${trainer_args[@]}"
    TRAINER_JOB_ID="${SUBMITTED_JOB_ID}"
    log "trainer: job ${TRAINER_JOB_ID}"
}
