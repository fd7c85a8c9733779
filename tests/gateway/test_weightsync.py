"""The weight gate: a swap waits for the calls in flight (which keep the weights they started with), calls
arriving meanwhile wait and get the new weights, and a call tagged with a policy version gets only those
weights: 409 once a newer version serves, 503 if its version is not loaded in time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from lightning_dagster.gateway.errors import GatewayError
from lightning_dagster.gateway.weightsync import ServedWeights, WeightGate

V1, V2 = ServedWeights(1, "res-1", "h1"), ServedWeights(2, "res-2", "h2")


def test_a_swap_drains_calls_in_flight_and_later_calls_get_the_new_weights():
    async def main() -> None:
        gate = WeightGate(V1, wait_s=5)
        gate.bind()
        started = await gate.enter()
        loaded = threading.Event()

        def load() -> ServedWeights:
            loaded.set()
            return V2

        swap = asyncio.create_task(gate.swap(load))
        await asyncio.sleep(0.05)
        assert gate.paused == {"weights"} and not loaded.is_set()  # the call in flight holds the swap
        late = asyncio.create_task(gate.enter())
        await asyncio.sleep(0.05)
        assert not late.done()  # a new call waits while paused
        gate.leave()
        assert await swap == V2 and loaded.is_set()
        assert started == V1 and await late == V2
        assert gate.state() == {"paused": [], "in_flight": 1, "weights": V2.attributes()}

    asyncio.run(main())


def test_a_tagged_call_gets_its_version_or_a_named_error():
    async def main() -> None:
        gate = WeightGate(V1, wait_s=0.2)
        gate.bind()
        with pytest.raises(GatewayError) as behind:
            await gate.enter(required=2)
        assert behind.value.status == 503 and behind.value.code == "weights_loading"
        waiting = asyncio.create_task(gate.enter(required=2))
        await asyncio.sleep(0.05)
        await gate.swap(lambda: V2)
        assert await waiting == V2  # loaded within the wait: served, not refused
        with pytest.raises(GatewayError) as ahead:
            await gate.enter(required=1)
        assert ahead.value.status == 409 and ahead.value.code == "weights_superseded"

    asyncio.run(main())


def test_a_failed_load_keeps_the_old_weights_and_resumes():
    async def main() -> None:
        gate = WeightGate(V1)
        gate.bind()

        def broken() -> ServedWeights:
            raise GatewayError(400, "bad weights")

        with pytest.raises(GatewayError, match="bad weights"):
            await gate.swap(broken)
        assert gate.current == V1 and not gate.paused
        assert await gate.enter() == V1

    asyncio.run(main())
