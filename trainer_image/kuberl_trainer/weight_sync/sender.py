"""Trainer side of weight sync: push HF-named tensors to every engine.

Disaggregated (`DistributedWeightSender`), per the contract in docs/engine-contract.md:
  connect: POST /init_weights_update_group to every engine concurrently with building the group
           locally as rank 0 - it is a rendezvous, neither side returns alone. The group holds
           the trainer and every TP process of every engine: 1 + sum(TP sizes) ranks, engine
           i's TP rank r at `rank_offset_i + r` (protocol.rank_offsets);
  send:    inside `paused` (below): per bucket, POST /update_weights_from_distributed {names,
           dtypes, shapes} to every engine concurrently, broadcast the bucket's tensors from
           rank 0 in the announced order, then wait for every POST to answer; the last bucket
           carries weight_version, so an engine reports the new version only once fully updated.
           Buckets are made ready (exported, flattened) on a thread of their own ahead of the
           wire (`prefetched`): bucket k+2 is made while bucket k is announced, broadcast and
           loaded (k+1 must exist before k goes, to know whether k is the last). Announces
           are not overlapped: two POSTs in flight may reach an engine in either order, and
           an engine that took bucket k+1's announce first would receive bucket k's bytes as
           k+1's tensors;
  close:   POST /destroy_weights_update_group, then drop the local group.
Colocated (`send_tensors`): inside `paused`, POST /update_weights_from_tensor with one entry per
TP rank of each engine, the tensors by reference (CUDA IPC handles, `codec.encode_shared`) or by
value.

`paused`: SGLang asserts that the cache flush accompanying an update succeeds, and a flush fails
while requests run; so every update is wrapped as slime wraps it: /pause_generation (retract),
/flush_cache until it succeeds, the buckets with flush_cache false, /continue_generation.

An engine's error answer to a bucket (a wrong name, say: it has received the tensors) is raised
once every engine has answered that bucket, so all of them took part in the same broadcasts and
the group stays usable. A bucket that fails without an answer (an engine's connection dropped:
it died; or it missed its deadline; or the broadcast failed here) breaks the group: the other
members may sit in that broadcast until the group's timeout. The sender aborts it then
(`_abort_broken`): its own end at once (kuberl_wire.group: NCCL's ncclCommAbort; gloo's
broadcast thread let go), and, with `abortable` engines (the reference engine), theirs through
/abort_weights_update_group (kuberl's own endpoint; SGLang 0.5.6 has none, see
docs/engine-contract.md). Every engine then has ABORT_GRACE_S to show it is out of the update:
an abortable one by answering the abort; another by answering its bucket, and over NCCL not
even that (its broadcast's answer does not wait for the bytes: its GPU stream may still be
stuck behind the aborted kernel). The error raised, GroupBroken, names the engine that failed
and, as `stuck`, the ones not shown out of it; the fleet replaces them all at once rather than
after the group's timeout. The sender is then without a group: a new one (a new group name on
the same rendezvous server, `store`) is formed for the engines that follow.

Deadlines: no call waits for the group's (NCCL's) own timeout. Pause, flush, continue and the
group's set-up answer within CONTROL_TIMEOUT_S; a bucket within `bucket_deadline_s` of its
size. An engine past its deadline fails without an answer, which the fleet
(fleet.Fleet.sync) takes for a hung engine: replaced, and the sync made again.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch._utils import _flatten_dense_tensors

from kuberl_trainer.engines.client import EngineClient, EngineError, GroupBroken, first_error
from kuberl_wire import codec, protocol
from kuberl_wire.dtypes import dtype_to_str
from kuberl_wire.group import WeightSyncGroup, new_group
from kuberl_wire.plan import TensorMeta, iter_buckets

NamedTensors = Sequence[tuple[str, torch.Tensor]]
R = TypeVar("R")
B = TypeVar("B")


def in_daemon_thread(fn: Callable[..., R], *args: Any) -> asyncio.Future[R]:
    """Run a blocking collective in its own daemon thread. Not asyncio.to_thread: when an
    engine fails, the collective stays blocked until the group timeout, and a default-executor
    thread would then hold up asyncio.run()'s exit (and the error) for that long."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[R] = loop.create_future()

    def settle(result: R | None, exc: BaseException | None) -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def deliver(result: R | None, exc: BaseException | None) -> None:
        # RuntimeError: the loop is closed, the caller gave up long ago.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, result, exc)

    def body() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            deliver(None, exc)
        else:
            deliver(result, None)

    threading.Thread(target=body, daemon=True, name=f"weight-sync-{fn.__name__}").start()
    return fut


@dataclass(frozen=True)
class SyncStats:
    """One weight update's sizes and time. ``bytes``: the tensors' bytes sent (each tensor's
    ``numel * element_size`` as it went out, in the dtype it went out in), once however many
    engines received them. ``seconds`` is the whole update; of it, ``pause_s`` went to
    pausing generation and flushing caches, ``resume_s`` to continuing it, and the rest to
    the buckets (export, announce, transfer, the engines' loading)."""

    weight_version: str
    buckets: int
    tensors: int
    bytes: int
    seconds: float
    pause_s: float = 0.0
    resume_s: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


def tensor_meta(name: str, tensor: torch.Tensor) -> TensorMeta:
    return TensorMeta(name=name, dtype=dtype_to_str(tensor.dtype), shape=tuple(tensor.shape),
                      nbytes=tensor.numel() * tensor.element_size())


def bucketize(named: Iterable[tuple[str, torch.Tensor]],
              bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream (name, tensor) pairs into buckets of at most bucket_bytes (see plan.iter_buckets)."""
    return iter_buckets(named, lambda nt: nt[1].numel() * nt[1].element_size(), bucket_bytes)


def flatten_bucket(bucket: NamedTensors, device: torch.device) -> list[torch.Tensor]:
    """The bucket's tensors (one dtype) as a single flat tensor on ``device``, in order: what
    a ``flattened_bucket`` update broadcasts. torch's own flatten (DDP's) does it in one call
    from Python: a bucket holds hundreds of tensors, and three Python-level ops on each cost
    the trainer more host time than the copy costs the GPU. A bucket of one contiguous
    tensor comes back as a view of it (nothing copied; the broadcast only reads it)."""
    with torch.no_grad():
        flat = _flatten_dense_tensors([t for _, t in bucket])  # type: ignore[no-untyped-call]
        return [flat.to(device)]


FLUSH_TIMEOUT_S = 60.0
CONTROL_TIMEOUT_S = 60.0  # pause, continue, joining the group: no data moves
# A bucket's deadline: a fixed allowance (the engine loads it into its model) plus its bytes
# at a floor bandwidth far below any GPU fabric's (or gloo's on a busy CPU).
BUCKET_BASE_S, BUCKET_FLOOR_BYTES_PER_S = 30.0, 50e6


# After a broken bucket, how long each engine has to show it is out of the aborted update (an
# abortable engine answers at once; a receive it releases ends within group.ABORT_POLL).
ABORT_GRACE_S = 10.0


def bucket_deadline_s(nbytes: int) -> float:
    return BUCKET_BASE_S + nbytes / BUCKET_FLOOR_BYTES_PER_S


async def flush_when_idle(client: EngineClient, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
    """POST /flush_cache to every engine until each succeeds (SGLang answers 400 while
    requests are still running or queued: retracting them takes a scheduler iteration)."""
    async def one(url: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await client.request(url, "POST", "/flush_cache", timeout_s=timeout_s)
                return
            except EngineError as exc:
                if exc.status != 400 or time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.05)

    await first_error(one(u) for u in client.urls)


async def pause_and_flush(client: EngineClient) -> None:
    """Pause generation (retract) on every engine, then flush their caches."""
    await client.post_all("/pause_generation", protocol.pause_generation(),
                          timeout_s=CONTROL_TIMEOUT_S)
    await flush_when_idle(client)


async def continue_generation(client: EngineClient) -> None:
    await client.post_all("/continue_generation", protocol.continue_generation(),
                          timeout_s=CONTROL_TIMEOUT_S)


@contextlib.asynccontextmanager
async def paused(client: EngineClient) -> AsyncIterator[None]:
    """Generation paused and caches flushed for the body (a weight update); generation
    continues only if the body succeeded: engines with half-updated weights stay paused until
    the next complete update (a restarted trainer's first)."""
    await pause_and_flush(client)
    yield
    await continue_generation(client)


@dataclass
class Prepared:
    """A bucket ready to send: its announce and the tensors to broadcast, in order."""

    metas: list[TensorMeta]
    wire: list[torch.Tensor]
    flattened: bool

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.metas)

    @property
    def wire_bytes(self) -> int:
        """The bytes the bucket's broadcasts carry (what ``wire`` holds)."""
        return sum(t.numel() * t.element_size() for t in self.wire)


def prepare_bucket(bucket: NamedTensors, device: torch.device, flatten: bool) -> Prepared:
    """Announce and broadcast payload of one bucket: one flat tensor when its tensors share a
    dtype (and ``flatten``), else each tensor, contiguous, on ``device``."""
    metas = [tensor_meta(name, t) for name, t in bucket]
    flat = flatten and len({t.dtype for _, t in bucket}) == 1
    wire = flatten_bucket(bucket, device) if flat else [
        t.detach().to(device).contiguous() for _, t in bucket]
    return Prepared(metas, wire, flat)


async def prefetched(items: Iterable[B], make: Callable[[B], R]
                     ) -> AsyncGenerator[tuple[R, bool], None]:
    """``make(item)`` for each item, as (result, is_last), each made on a daemon thread while
    the caller works on the one before: the caller gets item k once item k+1 is made (to know
    whether k is the last), while k+2 is being made, so at most three are alive at a time.

    The thread makes them in order, one at a time, so collectives inside ``items`` (FSDP
    gathers, Megatron's TP all-gathers) keep their order. It runs on the caller's CUDA device
    (a new thread would start on device 0). An error in making an item is raised where the
    caller would have got it. Use under ``contextlib.aclosing``: a caller stopping early
    waits there for the item being made."""
    it = iter(items)
    device = (torch.cuda.current_device()
              if torch.cuda.is_initialized() else None)  # type: ignore[no-untyped-call]

    def make_next() -> tuple[R] | None:
        with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
            for item in it:
                return (make(item),)
            return None

    current = await in_daemon_thread(make_next)
    if current is None:
        return
    ahead: asyncio.Future[tuple[R] | None] = in_daemon_thread(make_next)
    try:
        while True:
            following = await ahead
            if following is None:
                yield current[0], True
                return
            ahead = in_daemon_thread(make_next)  # item k+2, while item k goes out
            yield current[0], False
            current = following
    finally:
        # Stopped early (an engine failed): let the item being made finish, so no thread of
        # ours is still inside the caller's collectives when it moves on.
        if not ahead.done():
            with contextlib.suppress(BaseException):
                await ahead


async def made_inline(items: Iterable[B], make: Callable[[B], R]
                      ) -> AsyncGenerator[tuple[R, bool], None]:
    """`prefetched`'s items made on the caller's thread, one at a time: nothing overlaps
    (the sender before the pipeline; benchmarks compare the two)."""
    for item, last in _with_last(items):
        yield make(item), last


def _with_last(items: Iterable[B]) -> Iterator[tuple[B, bool]]:
    """Yield (bucket, is_last) with one bucket of lookahead, keeping the input a stream."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current, False
        current = nxt
    yield current, True


class DistributedWeightSender:
    """Rank 0 of the weight-update group; one instance per trainer (only rank 0 sends)."""

    def __init__(self, client: EngineClient, *, master_address: str, master_port: int,
                 backend: str = "gloo", group_name: str = "kuberl_weight_sync",
                 timeout_s: float = 300.0, weight_version: int = 0,
                 flatten: bool = True, tp_sizes: Sequence[int] | None = None,
                 prefetch: bool = True, store: Any = None, abortable: bool = False) -> None:
        self.client = client
        # Each engine's tensor parallel size: how many ranks it brings to the group.
        self.tp_sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(client.urls)
        if len(self.tp_sizes) != len(client.urls):
            raise ValueError(f"{len(self.tp_sizes)} TP sizes for {len(client.urls)} engines")
        self.world_size, self.rank_offsets = protocol.rank_offsets(self.tp_sizes)
        # One broadcast per bucket instead of one per tensor: a model has hundreds of small
        # tensors (norms, biases), and each broadcast costs tens of microseconds to launch on
        # both sides whatever its size.
        self.flatten = flatten
        # Make bucket k+2 ready while bucket k goes out (`prefetched`); False: one at a time.
        self.prefetch = prefetch
        self.master_address = master_address
        self.master_port = master_port
        # Rank 0's rendezvous server (group.host_store on master_port), kept by the caller
        # across senders; None: the group makes its own.
        self.store = store
        # The engines take /abort_weights_update_group (the reference engine; SGLang does not)
        self.abortable = abortable
        self.backend = backend
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.weight_version = weight_version
        self.group: WeightSyncGroup | None = None
        self._fresh = False  # connected, no bucket sent over the group yet
        # NCCL broadcasts need the tensors on this process's GPU.
        self.device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")

    async def connect(self) -> None:
        if self.group is not None:
            raise RuntimeError("already connected")
        bodies = [protocol.init_weights_update_group(
            master_address=self.master_address, master_port=self.master_port,
            rank_offset=offset, world_size=self.world_size, group_name=self.group_name,
            backend=self.backend) for offset in self.rank_offsets]
        local = in_daemon_thread(new_group, self.backend, self.master_address,
                                 self.master_port, 0, self.world_size, self.group_name,
                                 self.timeout_s, self.store)
        posts = self.client.post_all("/init_weights_update_group", bodies, per_engine=True,
                                     timeout_s=min(CONTROL_TIMEOUT_S, self.timeout_s + 30))
        try:
            results = await first_error([local, posts])
        except BaseException:
            # A member is missing (dead, or past its deadline): the others wait in the
            # rendezvous until its timeout; the engines that can are told to give up (the
            # local join is left to fail then, on its daemon thread).
            _retrieved(local)
            if self.abortable:
                await self._engines_abort(self.group_name)
            raise
        group = results[0]
        assert isinstance(group, WeightSyncGroup)
        self.group = group
        self._fresh = True  # (see _send_bucket)

    async def send(self, buckets: Iterable[NamedTensors], *, weight_version: str | None = None
                   ) -> SyncStats:
        """Push every bucket; the engines' weight_version becomes `weight_version`, default
        the next integer. Returns sizes and time for throughput metrics."""
        group = self.group
        if group is None:
            raise RuntimeError("connect() first")
        version = weight_version if weight_version is not None else str(self.weight_version + 1)
        start = time.perf_counter()
        n_buckets = n_tensors = n_bytes = 0
        await pause_and_flush(self.client)
        paused_at = time.perf_counter()
        ready = (prefetched if self.prefetch else made_inline)(
            buckets, lambda b: prepare_bucket(b, self.device, self.flatten))
        async with contextlib.aclosing(ready):
            async for bucket, last in ready:
                await self._send_bucket(group, bucket, version if last else None)
                n_buckets += 1
                n_tensors += len(bucket.metas)
                n_bytes += bucket.wire_bytes
        sent_at = time.perf_counter()
        await continue_generation(self.client)  # (not after a failure: see `paused`)
        end = time.perf_counter()
        if weight_version is None:
            self.weight_version += 1
        return SyncStats(weight_version=version, buckets=n_buckets, tensors=n_tensors,
                         bytes=n_bytes, seconds=end - start, pause_s=paused_at - start,
                         resume_s=end - sent_at)

    async def _send_bucket(self, group: WeightSyncGroup, bucket: Prepared,
                           version: str | None) -> None:
        """Announce and broadcast one bucket. No cache flush per bucket: `paused` flushed
        once before the first."""
        body = protocol.update_weights_from_distributed(
            bucket.metas, group_name=self.group_name, weight_version=version,
            flush_cache=False, flattened=bucket.flattened)
        # A new group's first collective also sets up its communicator (NCCL's is lazy): that
        # bucket has the set-up's allowance on top.
        deadline = bucket_deadline_s(bucket.nbytes) + (CONTROL_TIMEOUT_S if self._fresh else 0.0)
        self._fresh = False
        timeout = min(deadline, self.timeout_s + 30)
        posts = {url: asyncio.ensure_future(self.client.post(
            url, "/update_weights_from_distributed", body, timeout_s=timeout))
            for url in self.client.urls}
        cast = in_daemon_thread(group.broadcast, bucket.wire, 0)
        try:
            in_step = await _in_step([*posts.values(), cast])
        except BaseException:
            for task in posts.values():  # (cancelled itself: no request left behind)
                task.cancel()
            raise
        if not in_step:
            raise await self._abort_broken(group, posts, cast)

    async def _abort_broken(self, group: WeightSyncGroup,
                            posts: Mapping[str, asyncio.Future[Any]],
                            cast: asyncio.Future[None]) -> BaseException:
        """The bucket's group broke (see the module's docstring): abort it here and on the
        engines that can, give every engine ABORT_GRACE_S to show it is out of the update,
        and return the error to raise: GroupBroken naming the first engine that failed and,
        as `stuck`, the others not shown out; the local failure when no engine is to blame."""
        self.group = None
        _retrieved(cast)
        aborting = in_daemon_thread(group.abort)  # (NCCL's abort may take a moment)
        released = await self._engines_abort(self.group_name) if self.abortable else set()
        await asyncio.wait([aborting], timeout=ABORT_GRACE_S)
        _retrieved(aborting)
        # The bucket's answers: at once from an engine released by its abort; within the
        # grace, if at all, from one that cannot abort (not awaited from one that is gone)
        waiting = [t for url, t in posts.items()
                   if not t.done() and (not self.abortable or url in released)]
        if waiting:
            await asyncio.wait(waiting, timeout=ABORT_GRACE_S)
        failed = [url for url, t in posts.items() if _unanswered(t)]

        def out(url: str) -> bool:
            if self.abortable:
                return url in released
            return posts[url].done() and url not in failed and self.backend != "nccl"

        broken = [url for url in self.client.urls if not out(url)]
        for task in posts.values():
            if task.done():
                _retrieved(task)
            else:
                task.cancel()
        if not broken:  # (no engine to blame: the broadcast failed here)
            local = cast.exception() if cast.done() and not cast.cancelled() else None
            return local or RuntimeError("the weight-update group broke")
        url = next((u for u in failed if u in broken), broken[0])
        first = posts[url]
        why = (first.exception().message  # type: ignore[union-attr]
               if _unanswered(first) and isinstance(first.exception(), EngineError)
               else f"still in the update {ABORT_GRACE_S:g}s after it was aborted")
        return GroupBroken(url, f"{why}; the weight-update group {self.group_name!r} was "
                           "aborted", stuck=[u for u in broken if u != url])

    async def _engines_abort(self, group_name: str) -> set[str]:
        """POST /abort_weights_update_group to every engine; the URLs that answered."""
        body = protocol.abort_weights_update_group(group_name)

        async def one(url: str) -> str | None:
            try:
                await self.client.post(url, "/abort_weights_update_group", body,
                                       timeout_s=ABORT_GRACE_S)
                return url
            except EngineError:
                return None

        return {u for u in await asyncio.gather(*(one(u) for u in self.client.urls)) if u}

    async def abandon(self) -> None:
        """Leave the group without a collective teardown (an engine of it is gone): this end
        aborted, the engines that can told to abort theirs (those still there), the HTTP
        client closed."""
        group, self.group = self.group, None
        try:
            if group is not None:
                aborting = in_daemon_thread(group.abort)
                if self.abortable:
                    await self._engines_abort(self.group_name)
                await asyncio.wait([aborting], timeout=ABORT_GRACE_S)
                _retrieved(aborting)
        finally:
            await self.client.close()

    async def close(self) -> None:
        """Ask engines to leave the group, then drop ours (engine errors still raise)."""
        group, self.group = self.group, None
        if group is None:
            return
        leave = self.client.post_all("/destroy_weights_update_group",
                                     protocol.destroy_weights_update_group(self.group_name),
                                     timeout_s=60)
        if self.backend == "nccl":
            # An NCCL communicator's destroy may wait for its peers: both ends tear down at
            # once, or waiting for the engines' answer first would deadlock (seen on H200).
            await first_error([leave, in_daemon_thread(group.destroy)])
            return
        # Gloo closes its sockets on destroy, which a peer still in the group can take as a
        # failure: let the engines leave first.
        try:
            await leave
        finally:
            group.destroy()


def _unanswered(task: asyncio.Future[Any]) -> bool:
    """The request failed without the engine's answer (dead connection, timeout)."""
    if not task.done() or task.cancelled() or task.exception() is None:
        return False
    exc = task.exception()
    return not (isinstance(exc, EngineError) and exc.answered)


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark `fut`'s exception, now or when it comes, as seen (asyncio logs those never seen)."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())


async def _in_step(tasks: Sequence[asyncio.Future[Any]]) -> bool:
    """Wait as client.every_answer does, without cancelling: True once all are done (raising
    the first error in order: engines' answers, after which the group is still in step);
    False at the first failure that is no answer (see _unanswered), the others left running."""
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
        if any(_unanswered(t) for t in done):
            return False
    errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        raise errors[0]
    return True


async def post_tensor_bucket(client: EngineClient, entries: Sequence[Sequence[str]], *,
                             weight_version: str | None, load_format: str | None = None
                             ) -> None:
    """One bucket of a colocated update: engine i gets ``entries[i]``, its serialized tensors
    for each of its TP ranks (entry r read by TP rank r, handles to tensors on that rank's
    GPU). ``weight_version`` on the last bucket only; ``load_format``: the entries' format
    (None: named tensors; ``flattened_bucket``). Call inside `paused`."""
    bodies = [protocol.update_weights_from_tensor(list(per_rank), weight_version=weight_version,
                                                  flush_cache=False, load_format=load_format)
              for per_rank in entries]
    # in_step: engines may still be reading the bucket by reference when another answers an
    # error, so it must stay alive (not be raised past) until every engine answered.
    await client.post_all("/update_weights_from_tensor", bodies, per_engine=True, in_step=True)


async def send_tensors(client: EngineClient, buckets: Iterable[NamedTensors], *,
                       weight_version: str, shared: bool = False,
                       tp_sizes: Sequence[int] | None = None) -> SyncStats:
    """Colocated path from one process: every TP entry of every engine refers to this
    process's tensors (one GPU, or shared CPU memory). ``shared``: by reference (the bucket
    stays alive until every engine has answered), else by value. A trainer with a GPU per
    engine TP rank routes per rank instead (actors.TrainWorker)."""
    encode = codec.encode_shared if shared else codec.encode_named_tensors
    sizes = list(tp_sizes) if tp_sizes is not None else [1] * len(client.urls)
    start = time.perf_counter()
    n_buckets = n_tensors = n_bytes = 0
    async with paused(client):
        for bucket, last in _with_last(buckets):
            entry = encode(bucket)
            await post_tensor_bucket(client, [[entry] * tp for tp in sizes],
                                     weight_version=weight_version if last else None)
            n_buckets += 1
            n_tensors += len(bucket)
            n_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
    return SyncStats(weight_version=weight_version, buckets=n_buckets, tensors=n_tensors,
                     bytes=n_bytes, seconds=time.perf_counter() - start)
