"""A torch-backed stand-in for one vLLM 0.33 OpenAI server, for the trainer's CPU end-to-end test.

It really samples: every ``/v1/completions`` request runs the model token by token (KV cache,
seeded sampling) with the requested LoRA adapter applied, and returns the sampled tokens'
log-probabilities the way vLLM does (``choices[0].token_ids``,
``choices[0].logprobs.token_logprobs``). The adapter math is implemented here from the
``adapter_model.safetensors`` + ``adapter_config.json`` TRL publishes (``delta = scaling * B @ A``
on each targeted linear layer), independently of PEFT, as vLLM does - so a wrongly saved,
half-written or wrongly named adapter shows up as a load error or as an importance ratio away
from 1, not as a silent pass.

Speaks the endpoints TRL and the proxy use, with vLLM's status codes and error bodies
(REFERENCE.md section 2):

- ``GET /health``, ``GET /server_info?config_format=json``, ``GET /v1/models`` (base model first,
  then one entry per adapter with ``root`` = its path), ``GET /is_paused``;
- ``POST /v1/load_lora_adapter``: 200 text; 400 if the name is loaded (unless ``load_inplace``);
  404 ``NotFoundError`` "No adapter found for ..." when the path is not readable; 500 for other
  failures (rank above ``--max-lora-rank``, unknown module);
- ``POST /v1/unload_lora_adapter``: 200 text, 404 for an unknown name;
- ``POST /pause?mode=keep|wait|abort``: keep freezes in-flight requests between tokens and queues
  new ones; ``POST /resume``; ``POST /reset_prefix_cache``;
- ``POST /v1/completions``: 404 OpenAI-shaped error for an unknown model; 400 when prompt +
  ``max_tokens`` exceeds ``--max-model-len``; ``prompt_logprobs`` (the prompt tokens' own
  log-probabilities, vLLM's format) when asked.

More adapters than ``--max-loras``: like vLLM, no refusal - the least recently used is evicted
from the resident set and re-read from ``lora_path`` on next use (an ``evict`` / ``reload`` event
is recorded), so deleted adapter files fail the request that needs them.

Every request is appended to ``--record`` as one JSON line (control calls with their body and
status, completions with model, status and token count), which the test reads afterwards.

Run: ``python fake_vllm.py --model DIR --port-file F --record F [--max-loras 6] ...``; it binds
127.0.0.1 on a free port, writes the port to ``--port-file`` once the model is loaded and the
socket listens, then serves.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterError(Exception):
    """A load failure with the HTTP status vLLM would answer."""

    def __init__(self, status: int, err_type: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type


def error_response(
    status: int, err_type: str, message: str, param: str | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": param, "code": status}},
        status_code=status,
    )


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    sha256: str
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None  # None while evicted


class Engine:
    """The model, the adapter registry and the generation loop. Generation runs on one worker
    thread (``generate``), control calls on the event loop; ``lock`` guards the registry."""

    def __init__(
        self,
        model_dir: str,
        served_name: str,
        max_loras: int,
        max_lora_rank: int,
        max_model_len: int,
    ) -> None:
        self.model_dir = model_dir
        self.served_name = served_name
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_model_len = max_model_len
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()  # type: ignore[no-untyped-call]
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        self.eos_ids.add(self.tokenizer.eos_token_id)
        self.linear_names = {
            n for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self.adapters: dict[str, Adapter] = {}
        self.resident: OrderedDict[str, None] = (
            OrderedDict()
        )  # LRU of adapters with weights in memory
        self.lock = threading.Lock()
        self.running = threading.Event()  # cleared while paused: requests freeze between tokens
        self.running.set()
        self.admit = threading.Event()  # cleared during /pause?mode=wait: new requests held back
        self.admit.set()
        self.abort_generation = 0  # bumped by /pause?mode=abort: in-flight requests stop
        self.generating = 0  # requests past admission, in the token loop (generation thread only)
        self.idle = threading.Event()  # set while `generating` is 0
        self.idle.set()
        self.events: list[dict[str, Any]] = []  # evictions / reloads, flushed into the record
        self._active: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._scaling = 0.0
        for name, module in self.model.named_modules():
            if name in self.linear_names:
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def add_delta(
            _module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor
        ) -> torch.Tensor:
            pair = self._active.get(name)
            if pair is None:
                return output
            lora_a, lora_b = pair
            return output + self._scaling * (inputs[0] @ lora_a.T) @ lora_b.T

        return add_delta

    # --- adapters ------------------------------------------------------------------------------
    def _read_adapter(self, name: str, path: str) -> Adapter:
        folder = Path(path)
        config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
        if not config_file.is_file() or not weights_file.is_file():
            raise AdapterError(404, "NotFoundError", f"No adapter found for {path}")
        config = json.loads(config_file.read_text())
        rank = int(config.get("r", 0))
        if rank > self.max_lora_rank:
            raise AdapterError(
                500,
                "InternalServerError",
                f"LoRA rank {rank} is greater than max_lora_rank {self.max_lora_rank}.",
            )
        if config.get("use_dora") or config.get("modules_to_save"):
            raise AdapterError(
                500, "InternalServerError", "DoRA / modules_to_save are not supported"
            )
        alpha = float(config.get("lora_alpha", rank))
        scaling = alpha / (rank**0.5) if config.get("use_rslora") else alpha / rank
        raw = weights_file.read_bytes()
        tensors = load_file(str(weights_file))
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, value in tensors.items():
            if not key.endswith(".lora_A.weight"):
                if not key.endswith(".lora_B.weight"):
                    raise AdapterError(
                        500, "InternalServerError", f"unexpected tensor {key} in {path}"
                    )
                continue
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b_key = key.removesuffix(".lora_A.weight") + ".lora_B.weight"
            if module not in self.linear_names or b_key not in tensors:
                raise AdapterError(
                    500, "InternalServerError", f"adapter {path} targets unknown module {module}"
                )
            weights[module] = (value.float(), tensors[b_key].float())
        if not weights:
            raise AdapterError(500, "InternalServerError", f"adapter {path} holds no LoRA weights")
        return Adapter(name, path, rank, scaling, hashlib.sha256(raw).hexdigest(), weights)

    def _make_resident(self, adapter: Adapter) -> None:
        """LRU bookkeeping of the `--max-loras` slots (caller holds the lock)."""
        self.resident[adapter.name] = None
        self.resident.move_to_end(adapter.name)
        while len(self.resident) > self.max_loras:
            evicted, _ = self.resident.popitem(last=False)
            if evicted in self.adapters:
                self.adapters[evicted].weights = None
            self.events.append({"event": "evict", "name": evicted})

    def load(self, name: str, path: str, inplace: bool) -> Adapter:
        with self.lock:
            if name in self.adapters and not inplace:
                raise AdapterError(
                    400, "BadRequestError", f"The lora adapter '{name}' has already been loaded."
                )
        adapter = self._read_adapter(name, path)
        with self.lock:
            self.adapters[name] = adapter
            self._make_resident(adapter)
        return adapter

    def unload(self, name: str) -> None:
        with self.lock:
            if name not in self.adapters:
                raise AdapterError(
                    404, "NotFoundError", f"The lora adapter '{name}' cannot be found."
                )
            del self.adapters[name]
            self.resident.pop(name, None)

    def resolve(self, model: str) -> Adapter | None:
        """The adapter a request names (None = base model); KeyError for an unknown model."""
        if model in (self.model_dir, self.served_name):
            return None
        with self.lock:
            adapter = self.adapters.get(model)
            if adapter is None:
                raise KeyError(model)
            if adapter.weights is None:
                # Evicted: re-read from lora_path like vLLM's engine does (fails if files are gone).
                self.events.append({"event": "reload", "name": model})
                try:
                    adapter.weights = self._read_adapter(model, adapter.path).weights
                except AdapterError as exc:
                    raise RuntimeError(f"reloading evicted adapter {model} failed: {exc}") from exc
            self._make_resident(adapter)
            return adapter

    # --- generation ----------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self, adapter: Adapter | None, prompt: list[int], params: dict[str, Any]
    ) -> dict[str, Any]:
        """Sample up to ``max_tokens`` tokens; runs on the single generation thread."""
        max_tokens = int(params["max_tokens"])
        seed = params.get("seed")
        generator = torch.Generator().manual_seed(
            int(seed) if seed is not None else random.getrandbits(63)
        )
        # Captured once: an eviction during the request does not pull the weights from under it.
        weights = adapter.weights if adapter is not None else None
        scaling = adapter.scaling if adapter is not None else 0.0
        abort_at_start = self.abort_generation
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        cache: Any = None
        step_input = torch.tensor([prompt])
        while not self.admit.wait(0.05):
            pass
        self.generating += 1
        self.idle.clear()
        prompt_logprobs: list[dict[str, Any] | None] | None = None
        try:
            if params.get("prompt_logprobs") is not None:
                self._active, self._scaling = (weights or {}), scaling
                full = torch.log_softmax(self.model(input_ids=step_input).logits[0].float(), -1)
                prompt_logprobs = [None]
                for position, token in enumerate(prompt[1:]):
                    lp = full[position]
                    rank = int((lp > lp[token]).sum()) + 1
                    prompt_logprobs.append(
                        {
                            str(token): {
                                "logprob": float(lp[token]),
                                "rank": rank,
                                "decoded_token": "",
                            }
                        }
                    )
            for _ in range(max_tokens):
                # /pause freezes requests here, between tokens; an abort releases them.
                while not self.running.wait(0.05) and self.abort_generation == abort_at_start:
                    pass
                if self.abort_generation != abort_at_start:
                    finish = "abort"
                    break
                # One request at a time on this thread, so the hooks' active adapter is this one's.
                self._active, self._scaling = (weights or {}), scaling
                out = self.model(input_ids=step_input, cache=cache, use_cache=True)
                cache = out.cache
                log_probs = self._processed_logprobs(out.logits[0, -1].float(), params)
                token = int(torch.multinomial(log_probs.exp(), 1, generator=generator))
                tokens.append(token)
                logprobs.append(float(log_probs[token]))
                if token in self.eos_ids:
                    finish = "stop"
                    break
                step_input = torch.tensor([[token]])
        finally:
            self.generating -= 1
            if not self.generating:
                self.idle.set()
            self._active = {}
        return {
            "token_ids": tokens,
            "logprobs": logprobs,
            "finish_reason": finish,
            "prompt_logprobs": prompt_logprobs,
        }

    @staticmethod
    def _processed_logprobs(logits: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
        """Log-probabilities of the distribution actually sampled from (vLLM's processed logprobs):
        temperature, then top-k, then top-p."""
        temperature = float(params.get("temperature", 1.0))
        top_p = float(params.get("top_p", 1.0))
        top_k = int(params.get("top_k", 0) or 0)
        if temperature > 0:
            logits = logits / temperature
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, -1)
            drop_sorted = probs.cumsum(-1) - probs > top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.log_softmax(logits, -1)


def create_app(engine: Engine, record_path: Path | None) -> FastAPI:
    app = FastAPI()
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-vllm-gen")
    record_lock = threading.Lock()

    def record(entry: dict[str, Any]) -> None:
        if record_path is None:
            return
        entry = {"t": time.time(), **entry}
        with engine.lock:
            events, engine.events = engine.events, []
        with record_lock, record_path.open("a") as f:
            for event in events:
                f.write(json.dumps({"t": entry["t"], **event}) + "\n")
            f.write(json.dumps(entry) + "\n")

    async def body_of(request: Request) -> dict[str, Any]:
        try:
            data = await request.json()
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/server_info")
    async def server_info(config_format: str = "text") -> JSONResponse:
        record({"method": "GET", "path": "/server_info", "status": 200})
        return JSONResponse(
            {
                "vllm_config": {
                    "model_config": {
                        "model": engine.model_dir,
                        "served_model_name": engine.served_name,
                        "max_model_len": engine.max_model_len,
                        "dtype": "torch.float32",
                    },
                    "lora_config": {
                        "max_lora_rank": engine.max_lora_rank,
                        "max_loras": engine.max_loras,
                        "max_cpu_loras": engine.max_loras,
                    },
                    "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1},
                    "cache_config": {"block_size": 16, "enable_prefix_caching": True},
                }
            }
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        created = int(time.time())
        data = [
            {
                "id": engine.served_name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": engine.model_dir,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
        ]
        with engine.lock:
            adapters = list(engine.adapters.values())
        data += [
            {
                "id": a.name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": a.path,
                "parent": engine.served_name,
                "max_model_len": None,
            }
            for a in adapters
        ]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        entry: dict[str, Any] = {"method": "POST", "path": "/v1/load_lora_adapter", "body": body}
        if not name or not path:
            response: Response = error_response(
                400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."
            )
        else:
            try:
                adapter = await asyncio.to_thread(
                    engine.load, name, path, bool(body.get("load_inplace"))
                )
                entry["sha256"] = adapter.sha256
                entry["files"] = await asyncio.to_thread(lambda: sorted(os.listdir(path)))
                response = PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
            except AdapterError as exc:
                response = error_response(exc.status, exc.err_type, str(exc))
        record({**entry, "status": response.status_code})
        return response

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await body_of(request)
        name = body.get("lora_name")
        try:
            if not name:
                raise AdapterError(400, "InvalidUserInput", "'lora_name' must be provided.")
            engine.unload(name)
            response: Response = PlainTextResponse(
                f"Success: LoRA adapter '{name}' removed successfully."
            )
        except AdapterError as exc:
            response = error_response(exc.status, exc.err_type, str(exc))
        record(
            {
                "method": "POST",
                "path": "/v1/unload_lora_adapter",
                "body": body,
                "status": response.status_code,
            }
        )
        return response

    @app.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True) -> Response:
        response: Response
        if mode not in ("abort", "wait", "keep"):
            response = error_response(400, "BadRequestError", f"invalid pause mode {mode!r}")
        else:
            if mode == "abort":
                engine.abort_generation += 1
            elif mode == "wait":
                engine.admit.clear()  # hold new requests, let the running ones finish
                await asyncio.to_thread(engine.idle.wait)
            engine.running.clear()
            engine.admit.set()  # queued requests now wait on `running` instead
            response = JSONResponse({"status": "paused"})
        record(
            {
                "method": "POST",
                "path": "/pause",
                "query": {"mode": mode, "clear_cache": clear_cache},
                "status": response.status_code,
            }
        )
        return response

    @app.post("/resume")
    async def resume() -> JSONResponse:
        engine.running.set()
        record({"method": "POST", "path": "/resume", "status": 200})
        return JSONResponse({"status": "resumed"})

    @app.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": not engine.running.is_set()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        record({"method": "POST", "path": "/reset_prefix_cache", "status": 200})
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await body_of(request)
        model = str(body.get("model", ""))
        entry: dict[str, Any] = {"method": "POST", "path": "/v1/completions", "model": model}
        response: Response
        try:
            adapter = engine.resolve(model)
        except KeyError:
            response = error_response(
                404, "NotFoundError", f"The model `{model}` does not exist.", param="model"
            )
            record({**entry, "status": 404})
            return response
        except RuntimeError as exc:
            response = error_response(500, "InternalServerError", str(exc))
            record({**entry, "status": 500, "error": str(exc)})
            return response
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompt = engine.tokenizer.encode(prompt)
        if (
            not isinstance(prompt, list)
            or not prompt
            or not all(isinstance(t, int) for t in prompt)
        ):
            response = error_response(
                400, "BadRequestError", "prompt must be a string or a list of token ids"
            )
            record({**entry, "status": 400})
            return response
        max_tokens = int(body.get("max_tokens") or 16)
        if len(prompt) + max_tokens > engine.max_model_len:
            response = error_response(
                400,
                "BadRequestError",
                f"This model's maximum context length is {engine.max_model_len} tokens. "
                "However, you "
                f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, "
                f"{max_tokens} in the completion).",
            )
            record({**entry, "status": 400})
            return response
        if int(body.get("n", 1)) != 1 or float(body.get("repetition_penalty", 1.0)) != 1.0:
            response = error_response(
                400, "BadRequestError", "the fake replica supports n=1 and no repetition penalty"
            )
            record({**entry, "status": 400})
            return response
        result = await asyncio.get_running_loop().run_in_executor(
            executor, engine.generate, adapter, prompt, {**body, "max_tokens": max_tokens}
        )
        text = engine.tokenizer.decode(result["token_ids"], skip_special_tokens=True)
        record(
            {
                **entry,
                "status": 200,
                "prompt_tokens": len(prompt),
                "tokens": len(result["token_ids"]),
            }
        )
        return JSONResponse(
            {
                "id": f"cmpl-{random.getrandbits(64):016x}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": {
                            "text_offset": [],
                            "token_logprobs": result["logprobs"],
                            "tokens": [f"token_id:{t}" for t in result["token_ids"]],
                            "top_logprobs": [],
                        },
                        "finish_reason": result["finish_reason"],
                        "stop_reason": None,
                        "prompt_logprobs": result["prompt_logprobs"],
                        "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                        "token_ids": result["token_ids"] if body.get("return_token_ids") else None,
                    }
                ],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(result["token_ids"]),
                    "total_tokens": len(prompt) + len(result["token_ids"]),
                },
            }
        )

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def unknown(path: str, request: Request) -> JSONResponse:
        # e.g. TRL's merged-weight endpoints (/init_weight_transfer_engine): recorded, then 404.
        record({"method": request.method, "path": "/" + path, "status": 404})
        return JSONResponse({"detail": "Not Found"}, status_code=404)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-loras", type=int, default=6)
    parser.add_argument("--max-lora-rank", type=int, default=1)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--record", default=None)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(
        args.model,
        args.served_model_name or args.model,
        args.max_loras,
        args.max_lora_rank,
        args.max_model_len,
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections queue from now on, before uvicorn accepts them
    port_file = Path(args.port_file)
    tmp = port_file.with_suffix(".tmp")
    tmp.write_text(str(sock.getsockname()[1]))
    tmp.rename(port_file)
    record = Path(args.record) if args.record else None
    config = uvicorn.Config(create_app(engine, record), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
