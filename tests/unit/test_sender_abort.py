"""Which engines a broken weight update names stuck (DistributedWeightSender._abort_broken):
engine 0's bucket request fails without an answer (it died) while engine 1's is still in the
broadcast. The group here stands in for kuberl_wire.group's (its broadcast waits until it is
aborted, as a receive with a dead peer does; test_group_abort.py aborts real gloo groups) and
the engines are stand-ins answering in this process, so each rule is seen on its own:

- an engine that can abort its side (the reference engine) is out once it answers the abort;
- one that cannot (SGLang) is out if its bucket answers within the grace, over gloo; over NCCL
  never (its answer does not wait for the bytes), so it is named stuck for the fleet to replace.
The run-level test is tests/integration/test_local_run.py (dies-mid-broadcast)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch

from kuberl_trainer.engines.client import EngineError, GroupBroken
from kuberl_trainer.weight_sync import sender as sender_module
from kuberl_trainer.weight_sync.sender import DistributedWeightSender, Prepared
from kuberl_wire.group import GroupAborted
from kuberl_wire.plan import TensorMeta

DEAD, SURVIVOR = "http://127.0.0.1:1", "http://127.0.0.1:2"
GRACE_S = 0.5


class BlockedGroup:
    """A group whose broadcast cannot finish (a member is gone) until it is aborted."""

    def __init__(self) -> None:
        self.aborted = threading.Event()

    def broadcast(self, tensors: Any, src: int = 0) -> None:
        self.aborted.wait(30)
        raise GroupAborted("aborted")

    def abort(self) -> None:
        self.aborted.set()


class Engines:
    """The engine client: engine 0 died (its bucket request is dropped); the survivor is in
    the bucket's receive until its abort (when it takes one) or answers the bucket after
    `answers_after_s` (None: never)."""

    def __init__(self, answers_after_s: float | None) -> None:
        self.urls = [DEAD, SURVIVOR]
        self.answers_after_s = answers_after_s
        self.released = asyncio.Event()
        self.calls: list[tuple[str, str]] = []

    async def post(self, url: str, path: str, body: Any, *,
                   timeout_s: float | None = None) -> Any:
        self.calls.append((url, path))
        if url == DEAD:
            raise EngineError(url, f"{path}: ServerDisconnectedError")
        if path == "/abort_weights_update_group":
            self.released.set()
            return {"success": True, "message": "aborted"}
        if self.answers_after_s is None:
            await self.released.wait()  # (stuck: answers only once released)
        else:
            await asyncio.sleep(self.answers_after_s)
        raise EngineError(url, f"{path}: aborted", 400)


def broken(backend: str, abortable: bool, answers_after_s: float | None,
           monkeypatch: pytest.MonkeyPatch) -> tuple[GroupBroken, Engines, BlockedGroup]:
    monkeypatch.setattr(sender_module, "ABORT_GRACE_S", GRACE_S)
    engines = Engines(answers_after_s)
    sender = DistributedWeightSender(engines, master_address="127.0.0.1",  # type: ignore[arg-type]
                                     master_port=1, backend="gloo", abortable=abortable)
    sender.backend = backend  # (the rule reads it; no NCCL group is built here)
    group = BlockedGroup()
    sender.group = group  # type: ignore[assignment]
    bucket = Prepared([TensorMeta("w", "float32", (4,), 16)], [torch.zeros(4)], True)

    async def send() -> GroupBroken:
        with pytest.raises(GroupBroken) as err:
            await sender._send_bucket(group, bucket, "2")  # type: ignore[arg-type]
        return err.value

    exc = asyncio.run(send())
    assert sender.group is None and group.aborted.is_set()  # (its own end aborted)
    return exc, engines, group


def test_an_engine_that_aborts_its_side_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    exc, engines, _ = broken("nccl", abortable=True, answers_after_s=None,
                             monkeypatch=monkeypatch)
    assert (exc.url, exc.stuck) == (DEAD, ())
    assert "ServerDisconnectedError" in exc.message and not exc.answered
    assert (SURVIVOR, "/abort_weights_update_group") in engines.calls


def test_without_an_abort_an_engine_still_in_the_update_is_named_stuck(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exc, engines, _ = broken("gloo", abortable=False, answers_after_s=None,
                             monkeypatch=monkeypatch)
    assert (exc.url, exc.stuck) == (DEAD, (SURVIVOR,))
    assert all(path != "/abort_weights_update_group" for _, path in engines.calls)


def test_without_an_abort_an_engine_whose_bucket_answered_is_kept_over_gloo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exc, _, _ = broken("gloo", abortable=False, answers_after_s=0.05,
                       monkeypatch=monkeypatch)
    assert (exc.url, exc.stuck) == (DEAD, ())


def test_over_nccl_an_answer_does_not_show_an_engine_out_of_the_update(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exc, _, _ = broken("nccl", abortable=False, answers_after_s=0.05,
                       monkeypatch=monkeypatch)
    assert (exc.url, exc.stuck) == (DEAD, (SURVIVOR,))


class JoiningEngines:
    """The engine client while a group forms: engine 0 is gone (its join fails at once), the
    survivor's join sits in the rendezvous until it is told to abort."""

    urls = [DEAD, SURVIVOR]

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def post_all(self, path: str, body: Any, **_: Any) -> list[Any]:
        assert path == "/init_weights_update_group"
        raise EngineError(DEAD, f"{path}: cannot connect (refused)")

    async def post(self, url: str, path: str, body: Any, **_: Any) -> Any:
        self.calls.append((url, path))
        return {"success": True}


def test_a_group_that_cannot_form_is_aborted_on_the_engines_that_joined(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """connect(): one member is gone, so the others would wait in the rendezvous until its
    timeout, and the next group's join would queue behind theirs (the engines' worker is
    busy); the sender tells the engines that can to give their joins up."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    engines = JoiningEngines()
    sender = DistributedWeightSender(engines, master_address="127.0.0.1",  # type: ignore[arg-type]
                                     master_port=port, backend="gloo", timeout_s=5,
                                     abortable=True)
    with pytest.raises(EngineError, match="refused"):
        asyncio.run(sender.connect())
    assert sender.group is None
    assert (SURVIVOR, "/abort_weights_update_group") in engines.calls
