"""OpenAI request JSON -> routing key (docs/routing.md).

Token-id prompts (what TRL sends) are hashed exactly. Text prompts and chat messages, without a
tokenizer, are cut into 4-byte pseudo-tokens of their UTF-8 bytes (about one BPE token per 4
bytes of English): stable and prefix-preserving, which is all routing needs, but not vLLM's own
block hashes (``RoutingKey.tokens`` is None for them). A batch is routed on its first prompt:
vLLM answers a batch as one response, so it goes to one replica.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.errors import InvalidRequest

# vLLM never accepts more than this many prompts in one call through the proxy; a bound keeps a
# hostile body from making us walk millions of list items before the replica rejects it.
MAX_BATCH_PROMPTS = 4096


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer the router uses (the edge adapts the real one)."""

    def encode_text(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...


# Built for every request: slotted, not frozen, for the reason policy.py's Candidate gives.
# Nothing changes a key after extraction.
@dataclass(slots=True)
class RoutingKey:
    """Everything routing needs from one request.

    ``model`` names the namespace (base model or adapter). Exactly one of ``tokens`` and
    ``text`` is set: real token ids, or the UTF-8 bytes of a text approximation.
    """

    model: str
    tokens: Sequence[int] | None
    text: bytes | None
    cache_salt: str | None
    stream: bool
    num_prompts: int

    @property
    def length(self) -> int:
        """Prompt length in tokens (or pseudo-tokens for text)."""
        if self.tokens is not None:
            return len(self.tokens)
        assert self.text is not None
        return (len(self.text) + 3) // 4


def _namespace_part(value: str, param: str) -> None:
    """Model names and cache salts key the prefix namespace: they are joined with NUL (fast
    mode) and encoded as strict UTF-8 (exact mode's CBOR algorithms), so neither a NUL nor a
    lone surrogate (valid JSON: "\\ud800") may occur in them."""
    if "\0" in value:
        raise InvalidRequest(f"'{param}' must not contain NUL characters", param=param)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(f"'{param}' must be valid Unicode", param=param) from None


def _common(body: Any) -> tuple[str, str | None, bool]:
    """``model``, ``cache_salt`` and ``stream`` of any routed body, checked in that order."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    model = body.get("model")
    if model is None:
        model = ""  # vLLM serves its first model; the empty namespace stands for the base model
    elif not isinstance(model, str):
        raise InvalidRequest("'model' must be a string", param="model")
    else:
        _namespace_part(model, "model")
    salt = body.get("cache_salt")
    if salt is not None:
        if not isinstance(salt, str) or not salt:
            raise InvalidRequest("'cache_salt' must be a non-empty string", param="cache_salt")
        _namespace_part(salt, "cache_salt")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    return model, salt, stream is True


# Vocabularies are far below 2**32 ids (the largest today ~262k), and the fast hasher packs ids
# as uint32: a wider id anywhere in a prompt would change the packing, hence the hashes, of every
# block before it, and one beyond 2**64 would overflow it (a 500 instead of a 400).
MAX_TOKEN_ID = 2**32 - 1


# Packed little-endian uint32 ids 0 and 1: where a JSON true/false would pack too.
_PACKED_ZERO_ONE = (b"\x00\x00\x00\x00", b"\x01\x00\x00\x00")


def _has_bool(value: list[Any], packed: array[int]) -> bool:
    """Whether a JSON true/false hides among token ids ``packed`` accepted as 1/0 (bool is an
    int subclass). Only positions holding 0 or 1 need a look; they are found with bytes.find on
    the packed ids (C speed; ``in`` on an array compares Python objects one by one)."""
    data = packed.tobytes()  # "I" is 4 bytes wide on every platform CPython supports
    for needle in _PACKED_ZERO_ONE:
        at = data.find(needle)
        while at >= 0:
            if at % 4 == 0 and type(value[at // 4]) is bool:
                return True
            at = data.find(needle, at + 1)
    return False


def _check_token_list(value: list[Any]) -> array[int]:
    """Token ids validated and packed as uint32 in one C pass, cheaper than Python-level type and
    range checks over every id; the array is what the router hashes. A float, string, negative
    or too-large id is refused, and so is a JSON boolean (a client bug rather than token 1/0)."""
    try:
        packed = array("I", value)
    except (TypeError, OverflowError):
        packed = None
    if packed is None or _has_bool(value, packed):
        raise InvalidRequest(
            f"'prompt' token ids must be non-negative integers (at most {MAX_TOKEN_ID})",
            param="prompt",
        )
    return packed


def extract_completion(body: Any, tokenizer: Tokenizer | None = None) -> RoutingKey:
    """Routing key of a ``/v1/completions`` body. Raises InvalidRequest with a precise message."""
    model, salt, stream = _common(body)
    if "prompt" not in body:
        raise InvalidRequest("'prompt' is required", param="prompt")
    prompt = body["prompt"]
    tokens: Sequence[int] | None = None
    text: str | None = None
    count = 1
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list):
        if not prompt:
            raise InvalidRequest("'prompt' must not be empty", param="prompt")
        first = prompt[0]
        if isinstance(first, int) and not isinstance(first, bool):
            tokens = _check_token_list(prompt)
        elif isinstance(first, str):
            if not all(isinstance(p, str) for p in prompt):
                raise InvalidRequest("a batch of prompts must all be strings", param="prompt")
            text, count = first, len(prompt)
        elif isinstance(first, list):
            for p in prompt:
                if not isinstance(p, list) or not p:
                    raise InvalidRequest(
                        "a batch of token prompts must be non-empty lists of token ids",
                        param="prompt",
                    )
            tokens, count = _check_token_list(first), len(prompt)
            for p in prompt[1:]:
                _check_token_list(p)
    if tokens is None and text is None:
        raise InvalidRequest(
            "'prompt' must be a string, a list of strings, a list of token ids, "
            "or a list of lists of token ids",
            param="prompt",
        )
    if count > MAX_BATCH_PROMPTS:
        raise InvalidRequest(
            f"at most {MAX_BATCH_PROMPTS} prompts per request, got {count}", param="prompt"
        )
    if text is not None and tokenizer is not None:
        tokens, text = tokenizer.encode_text(text), None
    encoded = text.encode("utf-8", "surrogatepass") if text is not None else None
    return RoutingKey(model, tokens, encoded, salt, stream, count)


def extract_packed_completion(body: Any, tokens: array[int]) -> RoutingKey:
    """Routing key of a ``/v1/completions`` body whose token-id prompt was scanned and packed
    from the request bytes already (proxy/core/_native.c's ``split_prompt``; ``body`` is the
    rest of the request, its prompt replaced by 0). Exactly what ``extract_completion`` returns
    and raises for the same body: the same checks of the other fields, in the same order."""
    model, salt, stream = _common(body)
    return RoutingKey(model, tokens, None, salt, stream, 1)


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict):
                raise InvalidRequest(
                    f"messages[{index}].content parts must be objects", param="messages"
                )
            kind = part.get("type")
            if kind == "text":
                parts.append(str(part.get("text", "")))
            else:
                # Images/audio: their identity (URL or data) is what distinguishes prefixes.
                parts.append(f"<{kind}:{part.get(str(kind), '')!s}>")
        return "".join(parts)
    raise InvalidRequest(
        f"messages[{index}].content must be a string, a list of parts, or null",
        param="messages",
    )


def extract_chat(body: Any, tokenizer: Tokenizer | None = None) -> RoutingKey:
    """Routing key of a ``/v1/chat/completions`` body."""
    model, salt, stream = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequest(
                f"messages[{i}] must be an object with a string 'role'", param="messages"
            )
    # The approximate mode's text, which validates every content (even with a tokenizer). The
    # separators are ASCII control characters that do not occur in normal text, so two
    # conversations cannot render alike by moving text across a role boundary.
    rendered = "".join(
        f"\x1e{m['role']}\x1f{_content_text(m.get('content'), i)}" for i, m in enumerate(messages)
    )
    if tokenizer is not None:
        return RoutingKey(model, tokenizer.encode_chat(messages), None, salt, stream, 1)
    return RoutingKey(model, None, rendered.encode("utf-8", "surrogatepass"), salt, stream, 1)
