"""EventMailbox: engine-thread events reach the event loop's queues in order, and a burst
posted while the loop is busy costs one wake-up (one drain), not one per event."""

from __future__ import annotations

import asyncio
import threading

import pytest

from eaas.runtime.client.api.streaming import EventMailbox

pytestmark = pytest.mark.engine


def test_a_burst_is_one_drain_and_every_queue_keeps_its_order():
    async def main() -> tuple[list, list, int]:
        loop = asyncio.get_running_loop()
        box = EventMailbox(loop)
        drains = 0
        real_drain = box._drain

        def counted() -> None:
            nonlocal drains
            drains += 1
            real_drain()

        box._drain = counted  # type: ignore[method-assign]
        qa: asyncio.Queue = asyncio.Queue()
        qb: asyncio.Queue = asyncio.Queue()
        posted = threading.Event()

        def engine() -> None:  # another thread, as the engine's
            for i in range(100):
                box.post(qa if i % 2 == 0 else qb, i)
            posted.set()

        def busy_loop() -> None:  # the loop thread is busy until the whole burst is posted
            threading.Thread(target=engine).start()
            assert posted.wait(60)

        loop.call_soon(busy_loop)
        got_a = [await asyncio.wait_for(qa.get(), 60) for _ in range(50)]
        got_b = [await asyncio.wait_for(qb.get(), 60) for _ in range(50)]
        # a later event after the drain schedules a new one
        threading.Thread(target=box.post, args=(qa, "late")).start()
        assert await asyncio.wait_for(qa.get(), 60) == "late"
        return got_a, got_b, drains

    got_a, got_b, drains = asyncio.run(main())
    assert got_a == list(range(0, 100, 2))
    assert got_b == list(range(1, 100, 2))
    assert drains == 2  # the burst of 100, then "late"


def test_posting_to_a_closed_loop_raises_every_time():
    """After the loop closed, ``post`` raises as ``call_soon_threadsafe`` does, each time: a
    failed first post must not leave a "drain pending" that silences the later ones."""
    loop = asyncio.new_event_loop()
    box = EventMailbox(loop)
    loop.close()
    q: asyncio.Queue = asyncio.Queue()
    for i in range(3):
        with pytest.raises(RuntimeError):
            box.post(q, i)
