"""The sender's bucket pipeline (`sender.prefetched`, `prepare_bucket`): bucket k+1 is made
ready on its own thread while bucket k goes out, in order, with the last bucket marked, errors
raised where the bucket would have come, and nothing left running when the sender stops early.
Pure asyncio and threads, no processes or network."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kuberl_trainer.weight_sync.sender import made_inline, prefetched, prepare_bucket


def collect(items: list[int], way=prefetched) -> list[tuple[int, bool]]:  # type: ignore[no-untyped-def]
    async def run() -> list[tuple[int, bool]]:
        got = []
        async with contextlib.aclosing(way(items, lambda x: x * 10)) as ready:
            async for item in ready:
                got.append(item)
        return got

    return asyncio.run(run())


@pytest.mark.parametrize("way", [prefetched, made_inline])
def test_every_item_in_order_and_only_the_last_marked(way) -> None:  # type: ignore[no-untyped-def]
    assert collect([1, 2, 3, 4], way) == [(10, False), (20, False), (30, False), (40, True)]
    assert collect([7], way) == [(70, True)]
    assert collect([], way) == []


def test_the_next_item_is_made_while_the_caller_sends_one() -> None:
    """While the caller holds item k (a slow send), item k+2 is being made on another thread,
    so a send of k and the making of k+2 overlap: at most three items exist at once."""
    log: list[str] = []
    lock = threading.Lock()
    main = threading.get_ident()
    threads: set[int] = set()

    def make(x: int) -> int:
        threads.add(threading.get_ident())
        with lock:
            log.append(f"make {x} start")
        time.sleep(0.05)
        with lock:
            log.append(f"make {x} end")
        return x

    async def run() -> None:
        async with contextlib.aclosing(prefetched(range(4), make)) as ready:
            async for x, _ in ready:
                with lock:
                    log.append(f"send {x} start")
                await asyncio.sleep(0.2)  # the engines' time for it; the event loop stays free
                with lock:
                    log.append(f"send {x} end")

    asyncio.run(run())
    assert main not in threads
    # Item 2 is made during send 0 and item 3 during send 1; nothing is made two ahead.
    assert log.index("send 0 start") < log.index("make 2 end") < log.index("send 0 end")
    assert log.index("send 1 start") < log.index("make 3 end") < log.index("send 1 end")
    assert log.index("make 3 start") > log.index("send 0 end")
    assert [e for e in log if e.startswith("make") and e.endswith("start")] == [
        f"make {i} start" for i in range(4)]


def test_an_error_making_an_item_reaches_the_caller_after_the_items_before_it() -> None:
    def make(x: int) -> int:
        if x == 2:
            raise ValueError("export failed at 2")
        return x

    got: list[int] = []

    async def run() -> None:
        async with contextlib.aclosing(prefetched(range(5), make)) as ready:
            async for x, _ in ready:
                got.append(x)

    with pytest.raises(ValueError, match="export failed at 2"):
        asyncio.run(run())
    assert got == [0]  # item 1 would be sent only once item 2 was known to exist


def test_a_caller_that_stops_early_waits_for_the_item_being_made() -> None:
    """An engine failing mid-sync: the sender leaves the loop; the thread making the next
    bucket (possibly inside collectives) must be done before the sender returns."""
    made: list[int] = []
    consumed: list[int] = []

    def source() -> Iterator[int]:
        yield from range(10)

    def make(x: int) -> int:
        time.sleep(0.1)
        made.append(x)
        return x

    async def run() -> None:
        async with contextlib.aclosing(prefetched(source(), make)) as ready:
            async for x, _ in ready:
                consumed.append(x)
                raise RuntimeError("engine 1 answered 500")

    with pytest.raises(RuntimeError, match="engine 1"):
        asyncio.run(run())
    assert consumed == [0]
    assert made == [0, 1, 2]  # item 2 was being made when the send failed: it finished


def test_prepare_bucket_flattens_one_dtype_and_keeps_mixed_ones_apart() -> None:
    a = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    b = torch.arange(4, dtype=torch.bfloat16).view(2, 2).t()  # not contiguous
    one = prepare_bucket([("a", a), ("b", b)], torch.device("cpu"), flatten=True)
    assert one.flattened and len(one.wire) == 1
    assert torch.equal(one.wire[0], torch.cat([a.reshape(-1), b.reshape(-1)]))
    assert [m.name for m in one.metas] == ["a", "b"] and one.nbytes == 20
    c = torch.ones(3)
    mixed = prepare_bucket([("a", a), ("c", c)], torch.device("cpu"), flatten=True)
    assert not mixed.flattened and [t.dtype for t in mixed.wire] == [torch.bfloat16, torch.float32]
    unflat = prepare_bucket([("b", b)], torch.device("cpu"), flatten=False)
    assert not unflat.flattened and unflat.wire[0].is_contiguous()
    assert torch.equal(unflat.wire[0], b)
