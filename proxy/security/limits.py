"""Request limits: prompt count and length (after parsing), body and header size errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from proxy.core.extract import RoutingKey
from proxy.errors import InvalidRequest, PayloadTooLarge

# Without PROXY_MAX_PROMPT_TOKENS and before any replica reported its max_model_len: 2**20
# tokens, above the longest context any served model offers today (1M), so the proxy never
# refuses what a replica would accept; the body-size limit bounds the work long before that.
FALLBACK_MAX_PROMPT_TOKENS = 1 << 20


class PromptLimits:
    """Prompt count and prompt length, checked after parsing and before routing; length on
    token ids only, against the replicas' smallest max_model_len unless set (docs/security.md)."""

    def __init__(
        self,
        max_prompt_tokens: int | None,
        max_batch_prompts: int,
        fleet_max_len: Callable[[], int | None],
    ) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        self.max_batch_prompts = max_batch_prompts
        self.fleet_max_len = fleet_max_len

    def token_limit(self) -> tuple[int, str]:
        if self.max_prompt_tokens is not None:
            return self.max_prompt_tokens, "PROXY_MAX_PROMPT_TOKENS"
        known = self.fleet_max_len()
        if known:
            return known, "the replicas' max_model_len"
        return FALLBACK_MAX_PROMPT_TOKENS, "the proxy's default bound"

    def check(self, body: Any, key: RoutingKey) -> None:
        if key.num_prompts > self.max_batch_prompts:
            raise InvalidRequest(
                f"at most {self.max_batch_prompts} prompts per request "
                f"(PROXY_MAX_BATCH_PROMPTS), got {key.num_prompts}",
                param="prompt",
            )
        if key.tokens is None:
            return
        longest = len(key.tokens)
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            longest = max(len(p) for p in prompt)
        limit, source = self.token_limit()
        if longest > limit:
            raise InvalidRequest(
                f"the prompt has {longest} tokens; at most {limit} are accepted ({source})",
                param="prompt",
            )


class BodyTooLarge(PayloadTooLarge):
    """Raised from inside ``receive`` once the streamed body passes the limit."""


class HeadersTooLarge(PayloadTooLarge):
    status_code = 431


def too_large(limit: int) -> str:
    return f"request body is larger than {limit} bytes (PROXY_MAX_BODY_BYTES)"
