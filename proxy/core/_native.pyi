from array import array
from collections.abc import Sequence

from typing_extensions import Buffer

XXHASH_VERSION: str
SHA256_IN_C: int

def split_prompt(body: Buffer, /) -> tuple[array[int], bytes] | None: ...
def completion_ids(answer: Buffer, /) -> array[int] | None: ...
def chain(data: Buffer, step: int, seed: int, /) -> list[int]: ...
def extend_chain(
    prompt: Buffer, start: int, completion: Sequence[int], block_size: int, parent: int, /
) -> list[int] | None: ...
def vllm_chain(
    algo: int,
    parent: bytes,
    tokens: Sequence[int],
    start: int,
    stop: int,
    block_size: int,
    first_extra: bytes,
    extra: bytes,
    /,
) -> list[tuple[int, bytes]] | None: ...
def sha256_hook(data: bytes, /) -> bytes: ...
