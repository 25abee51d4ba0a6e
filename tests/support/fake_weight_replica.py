"""A fake vLLM server that speaks vLLM 0.33's weight-transfer HTTP protocol and joins a real
torch.distributed group (gloo, CPU) the way vLLM's workers join the trainer's NCCL group.

Run one per replica, as its own process::

    python -m tests.support.fake_weight_replica --port P --world-size W

It has ``W`` workers (threads), worker ``k`` at rank ``rank_offset + k`` (vLLM 0.33
``nccl_common._worker_group_rank``: ``rank_offset + dp_rank * world_size + rank``, dp_rank 0).

Endpoints as vLLM answers them (vllm/entrypoints/rl/online/api_router.py):
``GET /get_world_size`` -> ``{"world_size": W}``; ``POST /init_weight_transfer_engine``
``{"init_info": {master_address, master_port, rank_offset, world_size, ...}}``;
``POST /start_weight_update``; ``POST /update_weights {"update_info": {names, dtype_names,
shapes}}`` (blocks until every tensor arrived: one gloo broadcast from rank 0 per tensor, in
order, on every worker; TRL's packing is a GPU transport detail); ``POST /finish_weight_update``
``{"weight_version": str | null}``. Plus /health, /v1/models, /server_info (``lora_config``
null: TRL takes the merged path), /pause, /resume, /is_paused, /v1/completions (its body names
the weights that served it), and for tests ``GET /test/weights`` (every worker's committed
tensors) and ``POST /test/fault {"step": "update", "mode": "fail" | "hang"}``: the fault applies
AFTER the tensors arrived, so the group's collective completes and only the HTTP answer fails.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from fakes.vllm import error_body, models_payload

BASE_MODEL = "tiny/merged-base"
GROUP_TIMEOUT = datetime.timedelta(seconds=60)


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, "Error", status), status)


@dataclass
class WeightReplica:
    world_size: int = 1
    groups: list[Any] = field(default_factory=list)  # one gloo process group per worker
    ranks: list[int] = field(default_factory=list)
    received: list[dict[str, torch.Tensor]] = field(default_factory=list)
    committed: list[dict[str, torch.Tensor]] = field(default_factory=list)
    version: str = "default"  # vLLM's own initial weight_version
    updating: bool = False
    paused: bool = False
    faults: dict[str, str] = field(default_factory=dict)  # step -> fail | hang
    lock: threading.Lock = field(default_factory=threading.Lock)

    # -- the group ---------------------------------------------------------------------------

    def _join(self, info: dict[str, Any]) -> None:
        offset, total = int(info["rank_offset"]), int(info["world_size"])
        ranks = [offset + k for k in range(self.world_size)]
        groups: list[Any] = [None] * self.world_size
        errors: list[BaseException] = []

        def worker(k: int) -> None:
            try:
                store = dist.TCPStore(
                    info["master_address"],
                    int(info["master_port"]),
                    total,
                    False,
                    timeout=GROUP_TIMEOUT,
                )
                groups[k] = dist.ProcessGroupGloo(store, ranks[k], total, GROUP_TIMEOUT)
            except BaseException as exc:
                errors.append(exc)

        self._per_rank(worker, errors)
        self.groups, self.ranks = groups, ranks
        self.received = [{} for _ in ranks]
        self.committed = [{} for _ in ranks]

    def _per_rank(self, worker: Callable[[int], None], errors: list[BaseException]) -> None:
        """Run ``worker(k)`` for every local rank at once (a collective needs all of them), then
        raise the first error any of them recorded."""
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(self.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _receive(self, info: dict[str, Any]) -> None:
        names, dtypes, shapes = info["names"], info["dtype_names"], info["shapes"]
        errors: list[BaseException] = []

        def worker(k: int) -> None:
            try:
                got: dict[str, torch.Tensor] = {}
                for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
                    tensor = torch.empty(shape, dtype=getattr(torch, dtype))
                    self.groups[k].broadcast(tensor, 0).wait()
                    got[name] = tensor
                self.received[k] = got
            except BaseException as exc:
                errors.append(exc)

        self._per_rank(worker, errors)

    async def _fault(self, step: str) -> JSONResponse | None:
        mode = self.faults.get(step)
        if mode == "fail":
            return _error(f"simulated failure in {step}", 500)
        if mode == "hang":
            await asyncio.sleep(3600)
        return None

    # -- HTTP ----------------------------------------------------------------------------------

    def app(self) -> Starlette:
        async def health(request: Request) -> JSONResponse:
            return JSONResponse({})

        async def models(request: Request) -> JSONResponse:
            return JSONResponse(models_payload(BASE_MODEL, 4096, {}))

        async def server_info(request: Request) -> JSONResponse:
            config = {
                "model_config": {"model": BASE_MODEL, "dtype": "torch.float32"},
                "parallel_config": {
                    "data_parallel_size": 1,
                    "tensor_parallel_size": self.world_size,
                    "pipeline_parallel_size": 1,
                },
                "lora_config": None,
            }
            return JSONResponse({"vllm_config": config})

        async def is_paused(request: Request) -> JSONResponse:
            return JSONResponse({"is_paused": self.paused})

        async def pause(request: Request) -> JSONResponse:
            self.paused = True
            return JSONResponse({"status": "paused"})

        async def resume(request: Request) -> JSONResponse:
            self.paused = False
            return JSONResponse({"status": "resumed"})

        async def get_world_size(request: Request) -> JSONResponse:
            return JSONResponse({"world_size": self.world_size})

        async def init(request: Request) -> JSONResponse:
            body = await request.json()
            info = body.get("init_info")
            if not isinstance(info, dict):
                return _error("Missing 'init_info' in request body", 400)
            await asyncio.to_thread(self._join, info)
            return JSONResponse({"message": "Weight transfer initialized"})

        async def start(request: Request) -> JSONResponse:
            if not self.groups:
                return _error("weight transfer engine is not initialized", 500)
            self.updating = True
            return JSONResponse({"message": "Weight update started"})

        async def update(request: Request) -> JSONResponse:
            body = await request.json()
            if not self.groups or not self.updating:
                return _error("no weight update started on an initialized engine", 500)
            await asyncio.to_thread(self._receive, body["update_info"])
            return await self._fault("update") or JSONResponse({"message": "Weights updated"})

        async def finish(request: Request) -> JSONResponse:
            raw = await request.body()
            body = await request.json() if raw.strip() else {}
            fault = await self._fault("finish")
            if fault is not None:
                return fault
            if not self.groups:
                return _error("weight transfer engine is not initialized", 500)
            self.committed = [dict(r) for r in self.received]
            self.updating = False
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
            return JSONResponse({"message": "Weight update finished"})

        async def completions(request: Request) -> JSONResponse:
            body = await request.json()
            return JSONResponse(
                {
                    "id": "cmpl-fake",
                    "object": "text_completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "text": "", "token_ids": [1], "logprobs": None}],
                    "served_weight_version": self.version,
                }
            )

        async def weights(request: Request) -> JSONResponse:
            return JSONResponse(
                {
                    "version": self.version,
                    "ranks": self.ranks,
                    "workers": [
                        {name: t.flatten().tolist() for name, t in c.items()}
                        for c in self.committed
                    ],
                }
            )

        async def fault(request: Request) -> JSONResponse:
            body = await request.json()
            if body.get("mode"):
                self.faults[body["step"]] = body["mode"]
            else:
                self.faults.pop(body["step"], None)
            return JSONResponse({"faults": self.faults})

        return Starlette(
            routes=[
                Route("/health", health),
                Route("/v1/models", models),
                Route("/server_info", server_info),
                Route("/is_paused", is_paused),
                Route("/pause", pause, methods=["POST"]),
                Route("/resume", resume, methods=["POST"]),
                Route("/get_world_size", get_world_size),
                Route("/init_weight_transfer_engine", init, methods=["POST"]),
                Route("/start_weight_update", start, methods=["POST"]),
                Route("/update_weights", update, methods=["POST"]),
                Route("/finish_weight_update", finish, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/test/weights", weights),
                Route("/test/fault", fault, methods=["POST"]),
            ]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--world-size", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    app = WeightReplica(world_size=args.world_size).app()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
