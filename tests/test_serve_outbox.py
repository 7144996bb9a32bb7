"""The hand-over of the model thread's events to the event loop (edgellm.serve.app._Outbox)."""

import asyncio
import threading

from edgellm.serve.app import _Outbox


def _deliver(interval: float, batches: list[int]):
    """Events 0.. put from another thread into two queues, `batches` of them while the loop is held
    up (it cannot drain in between); what each queue received, and how many times the loop woke."""
    got = {0: [], 1: []}

    async def run():
        loop = asyncio.get_running_loop()
        box = _Outbox(loop, interval)
        wakes = 0
        wake = box._wake

        def counted():
            nonlocal wakes
            wakes += 1
            wake()

        box._wake = counted
        queues = [asyncio.Queue(), asyncio.Queue()]
        n = 0
        for size in batches:
            def producer(start=n, size=size):
                for i in range(start, start + size):
                    box.put(queues[i % 2], i)

            t = threading.Thread(target=producer)
            t.start()
            t.join()  # the loop has not run meanwhile: this batch waits in the outbox
            n += size
            await asyncio.sleep(interval + 0.01)  # the loop runs: the batch is handed over
        for k, q in enumerate(queues):
            while not q.empty():
                got[k].append(q.get_nowait())
        return wakes

    wakes = asyncio.run(run())
    return got, wakes


def test_events_arrive_in_order_with_one_wake_per_batch():
    got, wakes = _deliver(0.0, [50, 1, 30])
    assert got[0] == list(range(0, 81, 2)) and got[1] == list(range(1, 81, 2))
    assert wakes == 3  # one loop wake-up per batch, not one per event


def test_an_interval_still_delivers_everything_in_order():
    got, wakes = _deliver(0.02, [5, 5, 5])  # a hand-over may wait for the interval (a timer on the loop)
    assert got[0] == list(range(0, 15, 2)) and got[1] == list(range(1, 15, 2))
    assert wakes == 3
