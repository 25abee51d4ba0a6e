#!/usr/bin/env bash
# Merged-weight sync on a GPU: two real vLLM servers on ONE GPU behind the proxy, TRL 1.16's own
# WeightTransferClient (NCCL) pushing a DoRA model's merged weights through it, result as JSON.
#
# Needs: a CUDA GPU, vLLM 0.33 and TRL 1.16 (+ peft, transformers) in $PYTHON's environment, the
# proxy's dependencies, and MODEL readable offline (a local path or a cached Hub id).
# Usage: MODEL=Qwen/Qwen2.5-0.5B-Instruct OUT=bench/results/gpu_merged_weights.json \
#        scripts/gpu_merged_weights.sh
#
# NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected"), and
# the trainer and every vLLM worker are ranks of one group: with 3 or more GPUs visible, the
# trainer keeps GPU 0 and server i gets GPU i+1; on a single GPU the servers share it with the
# trainer and the group's init is expected to fail with that error (the script still records it).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
MODEL=${MODEL:-Qwen/Qwen2.5-0.5B-Instruct}
OUT=${OUT:-bench/results/gpu_merged_weights.json}
LOGS=${LOGS:-$(mktemp -d)}
# Two servers share the GPU: each takes a third of its memory (weights, KV cache, and the
# transfer's receive buffers, which need headroom: TRL's own error text says so).
MEM=${MEM:-0.3}
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

PIDS=()
cleanup() { for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT

URLS=()
for i in 0 1; do
  port=$(free_port)
  # No --enable-lora: lora_config is null, so TRL takes the merged path (DoRA alone would too).
  # Dev mode serves /pause, /server_info and the weight-transfer routes.
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  gpu=$(( ngpu >= 3 ? i + 1 : 0 ))
  CUDA_VISIBLE_DEVICES=$gpu VLLM_SERVER_DEV_MODE=1 setsid "$PYTHON" -m vllm.entrypoints.cli.main serve "$MODEL" \
    --port "$port" --host 127.0.0.1 --gpu-memory-utilization "$MEM" \
    --max-model-len 2048 --enforce-eager \
    --weight-transfer-config '{"backend": "nccl"}' >"$LOGS/vllm$i.log" 2>&1 &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$port")
  # One server at a time: both profiling GPU memory at once misjudge what is free.
  for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
  curl -sf "http://127.0.0.1:$port/health" >/dev/null || { tail -50 "$LOGS/vllm$i.log"; exit 1; }
done

PROXY_PORT=$(free_port)
# Control timeout: a transfer of a small model takes seconds; 600 s leaves room for slow disks.
PROXY_REPLICAS="${URLS[0]},${URLS[1]}" PROXY_PORT=$PROXY_PORT PROXY_HOST=127.0.0.1 \
PROXY_CONTROL_TIMEOUT_S=600 setsid "$PYTHON" -m proxy >"$LOGS/proxy.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 60); do curl -sf "http://127.0.0.1:$PROXY_PORT/health" >/dev/null && break; sleep 1; done

mkdir -p "$(dirname "$OUT")"
"$PYTHON" scripts/gpu_merged_weights.py --proxy "http://127.0.0.1:$PROXY_PORT" \
  --replicas "${URLS[@]}" --model "$MODEL" --out "$OUT"
echo "logs in $LOGS"
