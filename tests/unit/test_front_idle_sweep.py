"""proxy/front.py's IdleSweep: one timer per server closes keep-alive connections idle past their
deadline (instead of uvicorn's timer per request), on a fake loop, so time is explicit."""

from __future__ import annotations

from typing import Any

from proxy.front import IdleSweep, idle_sweep_for


class FakeLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, Any]] = []

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Any) -> Any:
        self.timers.append((self.now + delay, callback))
        return object()

    def advance(self, to: float) -> None:
        """Run every timer due by ``to``, in order, each at its own time."""
        while True:
            due = sorted((t for t in self.timers if t[0] <= to), key=lambda t: t[0])
            if not due:
                self.now = to
                return
            self.timers.remove(due[0])
            self.now = due[0][0]
            due[0][1]()


class FakeConnection:
    def __init__(self, deadline: float | None) -> None:
        self.idle_deadline = deadline
        self.closed = 0

    def timeout_keep_alive_handler(self) -> None:
        self.closed += 1


def _sweep(*connections: Any) -> tuple[FakeLoop, IdleSweep]:
    loop = FakeLoop()
    sweep = IdleSweep(loop, set(connections))  # type: ignore[arg-type]
    sweep.every = 1.0
    return loop, sweep


def test_only_connections_idle_past_their_deadline_are_closed() -> None:
    late, early, busy = FakeConnection(2.0), FakeConnection(5.0), FakeConnection(None)
    loop, sweep = _sweep(late, early, busy, object())  # object(): not a FrontProtocol
    sweep.arm()
    sweep.arm()  # armed once, however many connections fall idle
    assert len(loop.timers) == 1
    loop.advance(2.0)
    assert (late.closed, early.closed, busy.closed) == (1, 0, 0)
    assert late.idle_deadline is None
    loop.advance(4.9)
    assert early.closed == 0
    loop.advance(5.0)
    assert (late.closed, early.closed, busy.closed) == (1, 1, 0)


def test_the_sweep_stops_when_nothing_is_idle_and_rearms_on_demand() -> None:
    conn = FakeConnection(1.0)
    loop, sweep = _sweep(conn)
    sweep.arm()
    loop.advance(1.0)
    assert conn.closed == 1
    assert not loop.timers and sweep.handle is None  # nothing idle: no timer left running
    conn.idle_deadline = 3.5  # fell idle again (the connection is reused in this fake)
    sweep.arm()
    loop.advance(3.0)
    assert conn.closed == 1
    loop.advance(4.0)
    assert conn.closed == 2


def test_a_connection_that_became_busy_is_left_open() -> None:
    conn = FakeConnection(1.0)
    loop, sweep = _sweep(conn)
    sweep.arm()
    conn.idle_deadline = None  # a request's bytes arrived before the sweep
    loop.advance(10.0)
    assert conn.closed == 0 and not loop.timers


def test_one_sweep_per_server_state() -> None:
    class State:
        def __init__(self) -> None:
            self.connections: set[Any] = set()

    state, loop = State(), FakeLoop()
    first = idle_sweep_for(state, loop)  # type: ignore[arg-type]
    assert idle_sweep_for(state, loop) is first  # type: ignore[arg-type]
    assert idle_sweep_for(State(), loop) is not first  # type: ignore[arg-type]
