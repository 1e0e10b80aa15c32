"""Weight-sync checks that can fail: the trainer's weights differ from the engines' before the
checked sync, and equal them after it.

A benchmark on a random-weight model has reward ~0, so its gradients are ~0 and its weights
never move: "engine checksums == trainer checksums" after a sync then holds whether or not the
sync delivered anything (the engines loaded the same base model). So before the checked sync
the engines' checksums are read (``before``), and where the trainer holds what an engine holds
on any tensor, the trainer's weights are negated on every training rank (exact in any float
dtype; a zero becomes -0.0, other bytes too). The check (``SyncCheck``) then asks, for every
engine TP process, that each of the trainer's tensors differed before the sync and is equal
after it.

Negating runs inside each TrainWorker actor through Ray's built-in ``__ray_call__`` (no new
worker method). It negates the model's parameters (the tensors a sync exports); the megatron
backend's fp32 master copies are left alone, so its next optimizer step writes the un-negated
weights back: harmless, since the check negates again whenever trainer and engine agree.

``python bench/sync_check.py`` checks the verdict's logic on CPU; gpu_loop.py --cpu runs the
whole path (Ray actors, negation, sync, checksums) on CPU with the tiny shape.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import dataclass
from typing import Any

Sums = dict[str, str]  # tensor name -> sha256 of its bytes (kuberl_wire.codec.tensor_sha256)


def engine_sums(urls: list[str], timeout_s: float = 900) -> list[Sums]:
    """The checksums of every TP process of every engine, in order."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local engines
    ranks: list[Sums] = []
    for url in urls:
        with opener.open(f"{url.rstrip('/')}/get_weights_checksum?all_ranks=true",
                         timeout=timeout_s) as answer:
            ranks += json.loads(answer.read())["tp_ranks"]
    return ranks


def _negate_weights(worker: Any) -> int:
    """Runs in a TrainWorker actor: negate every parameter of its trainable model in place (a
    DTensor's local shard under FSDP2, a view of Megatron's parameter buffer); the count."""
    import torch

    worker.onload(("weights",))  # colocated: the weights may be in host memory
    model = worker.backend.model
    params = list(torch.nn.Module.parameters(model))  # (Megatron's DDP shadows some methods)
    with torch.no_grad():
        for p in params:
            p.neg_()
    if worker.device == "cuda":
        torch.cuda.synchronize()
    return len(params)


def negate_trainers(workers: list[Any]) -> int:
    """Negate the weights on every training rank (collective: each rank its own shard)."""
    import ray
    from ray import cloudpickle

    # By value: the actors cannot import this module (bench/ is not on their path).
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    counts = ray.get([w.__ray_call__.remote(_negate_weights) for w in workers])
    return int(counts[0])


def trainer_differs(trainers: Any, before: list[Sums], want: Sums | None = None) -> Sums:
    """The trainer's checksums (``want``, when the caller has them), made to differ from
    every engine process's in ``before`` on every tensor: if any tensor is the same, the
    trainer's weights are negated first. ``trainers``: a TrainGroup (``workers``,
    ``checksums()``)."""
    want = trainers.checksums() if want is None else want
    if any(rank.get(name) == sha for rank in before for name, sha in want.items()):
        negate_trainers(trainers.workers)
        want = trainers.checksums()
    return want


@dataclass
class SyncCheck:
    """One checked sync to ``expected`` engine TP processes."""

    expected: int
    ranks: int  # engine processes that answered after the sync
    tensors: int  # the trainer's tensors
    unchanged: int  # (process, tensor) pairs the engine already held before: nothing proven
    wrong: int  # (process, tensor) pairs unequal to the trainer's after the sync

    @property
    def ok(self) -> bool:
        return (self.ranks == self.expected and self.tensors > 0 and self.unchanged == 0
                and self.wrong == 0)

    def __str__(self) -> str:
        verdict = "delivered" if self.ok else "NOT SHOWN DELIVERED"
        return (f"weight sync {verdict}: {self.ranks}/{self.expected} engine processes, "
                f"{self.tensors} tensors; differing before the sync on every process: "
                f"{self.tensors * self.expected - self.unchanged}/{self.tensors * self.expected}"
                f", equal after: {self.tensors * self.expected - self.wrong}/"
                f"{self.tensors * self.expected}")


def judge(before: list[Sums], after: list[Sums], want: Sums, expected: int) -> SyncCheck:
    """``before``/``after``: every engine process's checksums around the sync; ``want``: the
    trainer's at the sync. A process missing from ``before`` counts all its tensors as
    unchanged (nothing shows the sync changed them)."""
    unchanged = sum(1 for i in range(expected) for name, sha in want.items()
                    if i >= len(before) or before[i].get(name) == sha)
    wrong = sum(1 for i in range(expected) for name, sha in want.items()
                if i >= len(after) or after[i].get(name) != sha)
    return SyncCheck(expected=expected, ranks=len(after), tensors=len(want),
                     unchanged=unchanged, wrong=wrong)


def verify_session_sync(session: Any, tp: int) -> SyncCheck:
    """After a Session's run: one more sync through its own path (the colocated memory moves
    around it, then TrainGroup.push_weights), with the trainer's weights made to differ from
    the engines' first. ``tp``: TP processes per engine."""
    trainers, urls = session.trainers, list(session.engines.urls)
    session.memory.trained()  # as the loop does before a sync (colocated; else no-ops)
    session.memory.before_sync()  # colocated: the engines get their weights' memory back
    before = engine_sums(urls)
    want = trainer_differs(trainers, before)
    session.weight_version += 1
    trainers.push_weights(urls, session.weight_version, 1 << 26)
    return judge(before, engine_sums(urls), want, len(urls) * tp)


def self_check() -> None:
    want = {"a": "1", "b": "2"}
    ok = judge([{"a": "x", "b": "y"}] * 2, [dict(want)] * 2, want, 2)
    assert ok.ok and ok.unchanged == 0 and ok.wrong == 0, ok
    # nothing delivered, and the engines already held the trainer's weights: must fail
    vacuous = judge([dict(want)] * 2, [dict(want)] * 2, want, 2)
    assert not vacuous.ok and vacuous.unchanged == 4, vacuous
    # delivered to one process of two
    half = judge([{"a": "x", "b": "y"}] * 2, [dict(want), {"a": "x", "b": "y"}], want, 2)
    assert not half.ok and half.wrong == 2, half
    # one tensor the engine already had (e.g. a zero bias on a fresh engine): not shown
    one = judge([{"a": "x", "b": "2"}], [dict(want)], want, 1)
    assert not one.ok and one.unchanged == 1, one
    # a process missing before or after
    assert not judge([], [dict(want)], want, 1).ok
    assert not judge([{"a": "x", "b": "y"}], [], want, 1).ok
    print(ok, vacuous, sep="\n")
    print("sync_check self-check passed")


if __name__ == "__main__":
    self_check()
    sys.exit(0)
