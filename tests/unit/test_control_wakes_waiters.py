"""A control call wakes the rollouts waiting for the fleet (proxy/reconciler.py ``FleetChanges``):
an adapter becomes routable only when the call that loads it ends, and a rollout of that adapter
held meanwhile must re-check then, not when its wait (PROXY_ADAPTER_WAIT_S) runs out."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from proxy.control import ControlPlane
from proxy.reconciler import FleetChanges


async def test_a_control_call_ending_wakes_a_waiting_rollout() -> None:
    changes = FleetChanges()
    control = ControlPlane(SimpleNamespace(fleet=None, router=None, changes=changes))  # type: ignore[arg-type]
    waiter = asyncio.create_task(changes.wait(3600))
    await asyncio.sleep(0)  # the rollout is waiting
    async with control.serialised():
        await asyncio.sleep(0)
        assert not waiter.done()  # nothing changed yet: the call is under way
    # Woken by the call's end; without it the rollout would sleep out its hour.
    await asyncio.wait_for(waiter, 5)


async def test_a_control_call_that_fails_wakes_waiters_too() -> None:
    changes = FleetChanges()
    control = ControlPlane(SimpleNamespace(fleet=None, router=None, changes=changes))  # type: ignore[arg-type]
    waiter = asyncio.create_task(changes.wait(3600))
    await asyncio.sleep(0)
    try:
        async with control.serialised():
            raise RuntimeError("a broadcast failed")
    except RuntimeError:
        pass
    await asyncio.wait_for(waiter, 5)
    assert control.in_flight == 0
