"""Tensor parallelism as the trainer sees it: `--tp-size N` runs N processes per engine.

A real SGLang engine of TP size N is N scheduler processes, one per GPU. The trainer observes
that layout in two places, and a stand-in engine must reproduce both or it hides the bugs a
first real job hits:
- every TP process joins the weight-update group, as rank `rank_offset + tp_rank`, so the
  group has 1 + sum(engine TP sizes) members;
- every TP process reads its own entry of `/update_weights_from_tensor`'s
  `serialized_named_tensors` (entry `tp_rank`), handles to tensors on its own GPU.

So rank 0 (the HTTP server's process) starts ranks 1..N-1 as processes of their own (on GPU
`cuda:<tp_rank>`, or the CPU), each holding the model and a `weights.Receiver`, and forwards
every weight operation to all of them while doing its own part. What is not reproduced: the
ranks hold full copies of the model rather than shards, and only rank 0 generates (SGLang's
ranks compute every forward pass together). Neither is visible through the HTTP API except as
memory.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

LOG = logging.getLogger("kuberl.reference")
READY_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankArgs:
    """What every rank's model needs (the server's own flags)."""

    model_path: str
    tokenizer_path: str | None
    device: str
    dtype: str
    seed: int
    weight_version: str
    weight_sync_timeout_s: float
    torch_threads: int = 0
    mem_fraction_static: float | None = None


def rank_device(device: str, tp_rank: int) -> str:
    """Rank r uses GPU r of those the engine was given (SGLang: base GPU id + tp_rank)."""
    return f"cuda:{tp_rank}" if device == "cuda" else device


class PeerError(ValueError):
    """A peer rank refused or failed an operation (HTTP 400, as SGLang answers)."""


class Peers:
    """Ranks 1..tp_size-1 of one engine; empty for tp_size 1."""

    def __init__(self, args: RankArgs, tp_size: int) -> None:
        if tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {tp_size}")
        ctx = mp.get_context("spawn")  # CUDA can't be used in a forked child
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for rank in range(1, tp_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_peer_main, args=(child, args, rank), daemon=True,
                               name=f"tp-rank-{rank}")
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)

    def wait_ready(self) -> None:
        """Block until every peer has loaded its model (they load while rank 0 loads)."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(READY_TIMEOUT_S):
                raise RuntimeError(f"tensor parallel rank {rank} did not load the model within "
                                   f"{READY_TIMEOUT_S:.0f}s")
            status, detail = conn.recv()
            if status != "ready":
                raise RuntimeError(f"tensor parallel rank {rank} failed to start: {detail}")

    @property
    def size(self) -> int:
        return len(self.conns) + 1

    def run(self, op: str, body: Any, local: Callable[[Any], Any]) -> list[Any]:
        """`op` on every rank: the peers' parts start first (a group rendezvous needs all
        ranks at once), then rank 0's `local(body)`; returns each rank's result in rank order
        once all have answered. One rank's failure fails the operation, naming the rank."""
        for conn in self.conns:
            conn.send((op, body))
        results: list[Any] = []
        errors: list[str] = []
        try:
            results.append(local(body))
        except Exception as exc:
            if not self.conns:
                raise
            results.append(None)
            errors.append(f"tp rank 0: {exc}")
        for rank, conn in enumerate(self.conns, start=1):
            try:
                status, detail = conn.recv()
            except (EOFError, OSError):
                code = self.procs[rank - 1].exitcode
                status, detail = "error", f"the process exited (code {code})"
            if status == "ok":
                results.append(detail)
            else:
                results.append(None)
                errors.append(f"tp rank {rank}: {detail}")
        if errors:
            raise PeerError("; ".join(errors))
        return results

    def stop(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):  # already gone
                conn.send(("stop", None))
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _peer_main(conn: Connection, args: RankArgs, tp_rank: int) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s[tp{tp_rank}]: %(message)s")
    try:
        import torch

        from kuberl_rollout.reference.engine import ReferenceEngine
        from kuberl_rollout.reference.weights import Receiver

        if args.torch_threads > 0:
            torch.set_num_threads(args.torch_threads)
        device = rank_device(args.device, tp_rank)
        if device.startswith("cuda"):
            # NCCL groups and the receive buffers use the current device.
            torch.cuda.set_device(tp_rank)
        engine = ReferenceEngine(args.model_path, tokenizer_path=args.tokenizer_path,
                                 device=device, dtype=args.dtype, seed=args.seed,
                                 weight_version=args.weight_version,
                                 mem_fraction_static=args.mem_fraction_static)
        receiver = Receiver(engine, tp_rank=tp_rank, timeout_s=args.weight_sync_timeout_s)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    ops: Mapping[str, Callable[[Any], Any]] = {
        "init_group": receiver.init_group,
        "destroy_group": receiver.destroy_group,
        "update_from_distributed": receiver.update_from_distributed,
        "update_from_tensor": receiver.update_from_tensor,
        "checksums": lambda _: engine.checksums(),
        "release": engine.release,
        "resume": engine.resume,
    }
    conn.send(("ready", None))
    LOG.info("tensor parallel rank %d ready on %s", tp_rank, device)
    while True:
        try:
            op, body = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone: so is this engine
            return
        if op == "stop":
            return
        try:
            conn.send(("ok", ops[op](body)))
        except Exception as exc:
            conn.send(("error", str(exc) if isinstance(exc, ValueError)
                       else f"{type(exc).__name__}: {exc}"))
