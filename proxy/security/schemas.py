"""OpenAPI request bodies (documentation and fuzzing; handlers read raw bodies)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _json_body(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": dict(schema)}},
        }
    }


_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
COMPLETION_BODY = _json_body(
    {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "model": {"type": "string"},
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    _TOKEN_IDS,
                    {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
                ]
            },
            "max_tokens": {"type": "integer", "minimum": 1},
            "temperature": {"type": "number"},
            "n": {"type": "integer", "minimum": 1},
            "seed": {"type": "integer"},
            "stream": {"type": "boolean"},
            "cache_salt": {"type": "string", "minLength": 1},
            "return_token_ids": {"type": "boolean"},
            "logprobs": {"type": "integer", "minimum": 0},
        },
    }
)
CHAT_BODY = _json_body(
    {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "model": {"type": "string"},
            "messages": {
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
                                {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {
                                            "type": {"type": "string"},
                                            "text": {"type": "string"},
                                        },
                                    },
                                },
                            ]
                        },
                    },
                },
            },
            "stream": {"type": "boolean"},
            "cache_salt": {"type": "string", "minLength": 1},
        },
    }
)
LOAD_BODY = _json_body(
    {
        "type": "object",
        "required": ["lora_name", "lora_path"],
        "properties": {
            "lora_name": {"type": "string", "minLength": 1},
            "lora_path": {"type": "string", "minLength": 1},
            "load_inplace": {"type": "boolean"},
        },
    }
)
UNLOAD_BODY = _json_body(
    {
        "type": "object",
        "required": ["lora_name"],
        "properties": {"lora_name": {"type": "string", "minLength": 1}},
    }
)
