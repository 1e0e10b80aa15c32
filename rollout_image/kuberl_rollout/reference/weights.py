"""Engine side of weight sync for the reference engine (runs on the engine's worker thread).

One Receiver per tensor-parallel rank (see tp.py): each joins the group and takes its own part
of every update, as each of SGLang's TP workers does.

- /init_weights_update_group: join the trainer's group as rank `rank_offset + tp_rank` (SGLang:
  every TP process of an engine is a member) through the same helper the trainer uses
  (kuberl_wire.group), so both ends build identical stores and process groups.
- /update_weights_from_distributed: allocate empty tensors for the announced names, dtypes and
  shapes, receive them by broadcast from rank 0 in the announced order, then copy them into the
  model by HF name. Tensors are always received, even if a name is wrong, so the collective
  stays in step with the trainer; the error is reported after. With `load_format:
  "flattened_bucket"` (as SGLang takes it) the bucket comes as one broadcast of its tensors'
  flattened concatenation, received into one buffer and viewed as the tensors.
- /update_weights_from_tensor: decode entry `tp_rank` of `serialized_named_tensors` (one per TP
  rank, as SGLang's TP worker indexes it: CUDA IPC handles or shared memory as SGLang's
  MultiprocessingSerializer writes them, torch.save bytes, or with `load_format:
  "flattened_bucket"` slime's flattened buckets; see kuberl_wire.codec) and copy.
- /abort_weights_update_group (kuberl's own; SGLang 0.5.6 has none): leave the group at once,
  whatever its other members do (`abort_group`, from any thread): a receive of it in flight on
  the worker thread ends with an error, and the model keeps what earlier buckets gave it (the
  engine stays paused until a whole update has arrived: the trainer's rule); a join still in
  the group's rendezvous (a member missing) gives up too.
`weight_version`, when given, becomes the engine's version once the update has succeeded.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from kuberl_rollout.reference.engine import ReferenceEngine
from kuberl_wire import codec
from kuberl_wire.dtypes import str_to_dtype
from kuberl_wire.group import ABORT_POLL, GroupAborted, WeightSyncGroup, new_group
from kuberl_wire.protocol import FLATTENED

LOG = logging.getLogger("kuberl.reference")
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def _flat_buffer(sizes: list[list[int]], kinds: list[torch.dtype], device: str
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One buffer for a flattened bucket (every tensor's elements, in order) and the views of
    it shaped as the tensors, which hold the data once the buffer is received."""
    if len(set(kinds)) > 1:
        raise ValueError(f"a flattened bucket holds one dtype, got {sorted(map(str, set(kinds)))}")
    counts = [math.prod(size) for size in sizes]
    flat = torch.empty(sum(counts), dtype=kinds[0] if kinds else torch.float32, device=device)
    parts = torch.split(flat, counts)
    return flat, [part.view(size) for part, size in zip(parts, sizes, strict=True)]


def _field(body: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in body or body[key] is None:
        raise ValueError(f"missing field {key!r}")
    value = body[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _join(given_up: threading.Event, name: str, *args: Any) -> WeightSyncGroup:
    """new_group(*args) on a thread of its own, waited for in ABORT_POLL slices: GroupAborted
    once `given_up` is set (the rendezvous, which no abort reaches, is left to fail at its
    timeout, and a group it forms then is dropped)."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["group"] = new_group(*args)
        except BaseException as exc:
            done["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name=f"join-{name}")
    thread.start()
    while thread.is_alive():
        thread.join(ABORT_POLL.total_seconds())
        if given_up.is_set():
            raise GroupAborted(f"weight-sync group {name!r} was aborted as it was being formed")
    if "error" in done:
        raise done["error"]
    group: WeightSyncGroup = done["group"]
    return group


class Receiver:
    def __init__(self, engine: ReferenceEngine, *, tp_rank: int = 0,
                 timeout_s: float = 300.0) -> None:
        self.engine = engine
        self.tp_rank = tp_rank
        self.timeout_s = timeout_s
        self.groups: dict[str, WeightSyncGroup] = {}
        # Groups being joined (their rendezvous waits for every member), each with what tells
        # its join to give up (abort_group); the lock orders an abort against a join's end.
        self.joining: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        # The devices the last update_weights_from_tensor's tensors lived on: a colocated
        # sync must hand each TP rank the tensors of the trainer rank on its own GPU (SGLang
        # would copy another GPU's peer to peer, silently slower), so runs check this.
        self.sources: list[str] = []

    def tensor_sources(self, _: Any = None) -> dict[str, Any]:
        """This rank's device and where its last tensor update's tensors were."""
        return {"tp_rank": self.tp_rank, "device": str(self.engine.device),
                "from": self.sources}

    def init_group(self, body: Mapping[str, Any]) -> str:
        backend = str(body.get("backend") or "nccl")
        name = str(body.get("group_name") or DEFAULT_GROUP)
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise ValueError("backend nccl needs a CUDA engine; use gloo on CPU")
        old = self.groups.pop(name, None)
        if old is not None:  # a restarted trainer re-initialises under the same name
            old.destroy()
        args = (backend, _field(body, "master_address", str), _field(body, "master_port", int),
                _field(body, "rank_offset", int) + self.tp_rank, _field(body, "world_size", int),
                name, self.timeout_s)
        given_up = threading.Event()
        self.joining[name] = given_up
        try:
            group = _join(given_up, name, *args)
            with self._lock:
                if given_up.is_set():  # (aborted as the join ended)
                    group.abort()
                    raise GroupAborted(f"weight-sync group {name!r} was aborted")
                self.groups[name] = group
        finally:
            self.joining.pop(name, None)
        return f"joined {name!r} as rank {group.rank}/{group.world_size} ({backend})"

    def abort_group(self, body: Mapping[str, Any]) -> str:
        """Leave group `group_name` now, whatever its other members do (WeightSyncGroup.abort);
        safe from any thread while the worker thread receives, and for a group that is gone."""
        name = str(body.get("group_name") or DEFAULT_GROUP)
        with self._lock:
            joining = self.joining.get(name)
            if joining is not None:
                joining.set()  # (a join in its rendezvous gives up)
            group = self.groups.pop(name, None)
        if group is None:
            return (f"left {name!r} as it was being formed" if joining is not None else
                    f"no weight-update group {name!r} (nothing to abort)")
        group.abort()
        return f"aborted {name!r}"

    def abort_all(self) -> None:
        """Leave every group (this rank's server is gone)."""
        for name in list(self.groups):
            self.abort_group({"group_name": name})

    def destroy_group(self, body: Mapping[str, Any]) -> str:
        name = str(body.get("group_name") or DEFAULT_GROUP)
        group = self.groups.pop(name, None)
        if group is None:
            raise ValueError(f"no weight-update group {name!r}")
        group.destroy()
        return f"destroyed {name!r}"

    def update_from_distributed(self, body: Mapping[str, Any]) -> str:
        names, dtypes, shapes = (_field(body, k, list) for k in ("names", "dtypes", "shapes"))
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"names/dtypes/shapes lengths differ: "
                             f"{len(names)}/{len(dtypes)}/{len(shapes)}")
        load_format = body.get("load_format")
        if load_format not in (None, FLATTENED):
            raise ValueError(f"load_format {load_format!r} is not supported by the reference "
                             f"engine (null or {FLATTENED!r})")
        name = str(body.get("group_name") or DEFAULT_GROUP)
        group = self.groups.get(name)
        if group is None:
            raise ValueError(f"no weight-update group {name!r}: /init_weights_update_group first")
        device = "cuda" if group.backend == "nccl" else "cpu"
        started = time.perf_counter()
        sizes = [[int(d) for d in shape] for shape in shapes]
        kinds = [str_to_dtype(dtype) for dtype in dtypes]
        if load_format == FLATTENED:
            flat, buffers = _flat_buffer(sizes, kinds, device)
            wire = [flat]
        else:
            buffers = [torch.empty(size, dtype=kind, device=device)
                       for size, kind in zip(sizes, kinds, strict=True)]
            wire = buffers
        group.broadcast(wire, src=0)
        count = self.engine.load_weights(zip(names, buffers, strict=True))
        if body.get("weight_version") is not None:
            # The update's last bucket: answer once every copy has landed, so the new version
            # is only reported for weights in place. Earlier buckets answer without waiting
            # for the GPU: their copies are queued on the stream generation runs on, and the
            # caching allocator keeps the receive buffer until they have run.
            self.engine.synchronize()
        group.check()  # (NCCL: an abort ends the receive whether or not the bytes came)
        return self._done(body, count, sum(b.numel() * b.element_size() for b in buffers),
                          started)

    def update_from_tensor(self, body: Mapping[str, Any]) -> str:
        payloads = _field(body, "serialized_named_tensors", list)
        load_format = body.get("load_format")
        if load_format not in (None, FLATTENED):
            raise ValueError(f"load_format {load_format!r} is not supported by the reference "
                             f"engine (null or {FLATTENED!r})")
        if len(payloads) <= self.tp_rank:
            # SGLang's TP worker indexes the list by its rank (an IndexError there).
            raise ValueError(f"serialized_named_tensors has {len(payloads)} entries; tensor "
                             f"parallel rank {self.tp_rank} reads entry {self.tp_rank} (one "
                             "entry per TP rank, each from the trainer rank on that GPU)")
        started = time.perf_counter()
        named = codec.decode_named_tensors(payloads[self.tp_rank],
                                           flattened=load_format == FLATTENED)
        self.sources = sorted({str(t.device) for _, t in named})
        count = self.engine.load_weights(named)
        # The tensors may be the trainer's memory (IPC handles): it may reuse them as soon as
        # we answer, so the copies must be done by then.
        self.engine.synchronize()
        return self._done(body, count, sum(t.numel() * t.element_size() for _, t in named),
                          started)

    def _done(self, body: Mapping[str, Any], count: int, nbytes: int, started: float) -> str:
        seconds = time.perf_counter() - started
        version = body.get("weight_version")
        if version is not None:
            self.engine.weight_version = str(version)
        LOG.info("updated %d tensors, %.2f MB in %.3fs, weight_version %s", count, nbytes / 1e6,
                 seconds, self.engine.weight_version)
        message = f"updated {count} tensors"
        if version is not None:
            message += f"; weight version updated to {version}"
        return message
