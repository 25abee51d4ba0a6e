"""OpenAPI request bodies (documentation and fuzzing; handlers read raw bodies)."""

from __future__ import annotations

from typing import Any


def _json_body(required: list[str], **properties: Any) -> dict[str, Any]:
    schema = {"type": "object", "required": required, "properties": properties}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


_NAME = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_CONTENT_PART = {
    "type": "object",
    "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
}
COMPLETION_BODY = _json_body(
    ["prompt"],
    model={"type": "string"},
    prompt={
        "anyOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}, "minItems": 1},
            _TOKEN_IDS,
            {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
        ]
    },
    max_tokens={"type": "integer", "minimum": 1},
    temperature={"type": "number"},
    n={"type": "integer", "minimum": 1},
    seed={"type": "integer"},
    stream={"type": "boolean"},
    cache_salt=_NAME,
    return_token_ids={"type": "boolean"},
    logprobs={"type": "integer", "minimum": 0},
)
CHAT_BODY = _json_body(
    ["messages"],
    model={"type": "string"},
    messages={
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "required": ["role"],
            "properties": {
                "role": {"type": "string"},
                "content": {
                    "anyOf": [
                        {"type": "string"},
                        {"type": "null"},
                        {"type": "array", "items": _CONTENT_PART},
                    ]
                },
            },
        },
    },
    stream={"type": "boolean"},
    cache_salt=_NAME,
)
LOAD_BODY = _json_body(
    ["lora_name", "lora_path"], lora_name=_NAME, lora_path=_NAME, load_inplace={"type": "boolean"}
)
UNLOAD_BODY = _json_body(["lora_name"], lora_name=_NAME)
