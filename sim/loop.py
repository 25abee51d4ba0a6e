"""An asyncio event loop on a virtual clock.

Nothing in a simulation touches a socket (replicas are in-process, behind an httpx transport), so
whenever the loop has nothing ready to run it would only sleep until its next timer: here it
jumps the clock there instead. ``loop.time()`` is the virtual time; ``asyncio.sleep``,
``asyncio.wait_for`` and every timeout built on them follow it. A minute of simulated training
takes milliseconds, and the same seed schedules the same callbacks in the same order.
"""

from __future__ import annotations

import asyncio
import selectors
from typing import Any


class _JumpingSelector(selectors.BaseSelector):
    """Delegates to a real selector (the loop's self-pipe still works) but never blocks: a
    positive timeout advances the virtual clock instead."""

    def __init__(self) -> None:
        self._real = selectors.DefaultSelector()
        self.now = 0.0

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self._real.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self._real.modify(fileobj, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None:
            raise RuntimeError(
                "simulation deadlock: every task waits and no timer is pending (something "
                "waits on a future nobody will complete)"
            )
        self.now += timeout
        return []

    def get_map(self) -> Any:
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run(main: Any) -> Any:
    """Run a coroutine to completion on a fresh virtual-time loop, then close the loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
