from array import array
from collections.abc import Sequence

from typing_extensions import Buffer

XXHASH_VERSION: str
SHA256_IN_C: int
# (HAS_CHILD, BRANCHING, REQUEST_END, FP_SHIFT, FP_MASK, HOLDERS_SHIFT): prefix_index.INDEX_LAYOUT
INDEX_LAYOUT: tuple[int, int, int, int, int, int]

def split_prompt(body: Buffer, /) -> tuple[array[int], bytes] | None: ...
def chain(data: Buffer, step: int, seed: int, /) -> list[int]: ...
def record_chain(
    young: dict[int, int], keys: Sequence[int], known: Sequence[int], holder: int, /
) -> None: ...
def prefix_walk(
    values: Sequence[int], count: int, replicas: Sequence[int], /
) -> tuple[dict[int, int], int] | None: ...
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
