"""One buffered HTTP answer, written to the client in one piece.

uvicorn writes ``http.response.start`` (status line and headers) and ``http.response.body`` with
one ``transport.write`` each: two write syscalls, on loopback two rounds through the kernel's
TCP stack, for every completion. The write syscalls were the largest single item in the data
path's profile (bench/results/overhead_profile.md). When ``send`` is a uvicorn request cycle's,
its transport is swapped, for the two messages, for one that holds the header bytes until the
body comes, and the two leave in one write. Anything else (another server, a test transport)
gets the two messages as usual, so behaviour never depends on the trick.
"""

from __future__ import annotations

from typing import Any

from proxy.asgi import Send


class _HeldWrites:
    """Stands in for a transport: holds what is written until ``flush``."""

    __slots__ = ("held", "transport")

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.held: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        self.held.append(data)

    def flush(self) -> None:
        if self.held:
            data = b"".join(self.held)
            self.held = []
            self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def _uvicorn_cycle(send: Send) -> Any:
    cycle = getattr(send, "__self__", None)
    if cycle is None or not type(cycle).__module__.startswith("uvicorn.protocols.http."):
        return None
    return cycle if getattr(cycle, "transport", None) is not None else None


async def send_whole(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes | memoryview
) -> None:
    """Send a complete answer (``headers`` must include its content-length)."""
    start = {"type": "http.response.start", "status": status, "headers": headers}
    end = {"type": "http.response.body", "body": body}
    cycle = _uvicorn_cycle(send)
    if cycle is None:
        await send(start)
        await send(end)
        return
    transport = cycle.transport
    held = _HeldWrites(transport)
    cycle.transport = held
    try:
        await send(start)
        await send(end)
    finally:
        if cycle.transport is held:
            cycle.transport = transport
        held.flush()
