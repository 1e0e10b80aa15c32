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

An engine wider than a node (`--nnodes K`, as SGLang's) runs N/K ranks per node: node rank R
holds ranks R*N/K .. (R+1)*N/K-1 on its local GPUs 0..N/K-1. Node 0 serves HTTP and listens on
`--dist-init-addr`'s port; the other nodes' ranks connect to it there (authenticated with the
key in $KUBERL_ENGINE_SECRET) and take their work over that connection exactly as node 0's
own ranks do over pipes, so every rank still joins the weight-update group itself, from its
own node. Those nodes serve only /health on their own port, as SGLang's do.

Rank 0 sends each operation to the peers and waits for one answer per operation, in order;
an abort of the weight-update group (`Peers.abort`) is the one message that needs no answer
and may arrive while a peer is inside an operation (the group's receive it ends): each peer
reads its connection on a thread of its own and runs the operations on its main thread.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

LOG = logging.getLogger("kuberl.reference")
READY_TIMEOUT_S = 600.0
CONNECT_RETRY_S = 0.2  # a remote rank's retry interval while node 0 is not listening yet


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
    ranks_per_node: int = 0  # 0: every rank on one node
    weights_cpu_backup: bool = False
    tp_size: int = 1  # (with ep_size: the experts a rank holds, moe.py)
    ep_size: int = 1


def local_gpu(tp_rank: int, ranks_per_node: int) -> int:
    """The node-local GPU of rank r (SGLang: base GPU id + tp_rank % TP ranks per node)."""
    return tp_rank % ranks_per_node if ranks_per_node else tp_rank


def rank_device(device: str, tp_rank: int, ranks_per_node: int = 0) -> str:
    """Rank r's device: its node-local GPU (see local_gpu), or the CPU."""
    return f"cuda:{local_gpu(tp_rank, ranks_per_node)}" if device == "cuda" else device


@dataclass(frozen=True)
class Nodes:
    """How an engine spans nodes (SGLang's --nnodes, --node-rank, --dist-init-addr)."""

    count: int = 1
    rank: int = 0
    dist_init_addr: str = ""  # node 0's "host:port"
    secret: bytes = b""  # authenticates the nodes' connections

    def address(self) -> tuple[str, int]:
        host, _, port = self.dist_init_addr.rpartition(":")
        return host.strip("[]"), int(port)

    def ranks(self, tp_size: int) -> range:
        """The TP ranks on this node."""
        per_node = tp_size // self.count
        return range(self.rank * per_node, (self.rank + 1) * per_node)


ABORT = "abort_group"  # the message a peer takes at once, without answering (Peers.abort)


class PeerError(ValueError):
    """A peer rank refused or failed an operation (HTTP 400, as SGLang answers)."""


class Peers:
    """Ranks 1..tp_size-1 of one engine, seen from rank 0: those on its node as child
    processes over pipes, those on other nodes (`nodes.count` > 1) over connections they open
    to node 0's dist-init port. Empty for tp_size 1."""

    def __init__(self, args: RankArgs, tp_size: int, nodes: Nodes = Nodes()) -> None:
        if tp_size < 1:
            raise ValueError(f"--tp-size must be at least 1, got {tp_size}")
        local = nodes.ranks(tp_size)
        ctx = mp.get_context("spawn")  # CUDA can't be used in a forked child
        self.tp_size = tp_size
        self.by_rank: dict[int, Connection] = {}
        self.procs: dict[int, Any] = {}
        for rank in local[1:]:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_peer_main, args=(child, args, rank), daemon=True,
                               name=f"tp-rank-{rank}")
            proc.start()
            child.close()
            self.by_rank[rank] = parent
            self.procs[rank] = proc
        self._remote = [r for r in range(tp_size) if r not in local]
        self._accepting: threading.Thread | None = None
        if self._remote:
            _, port = nodes.address()
            self._listener = Listener(("0.0.0.0", port), authkey=nodes.secret)
            self._accepting = threading.Thread(target=self._accept, daemon=True,
                                               name="tp-accept")
            self._accepting.start()
        self.conns: list[Connection] = []
        self._sending = threading.Lock()  # the worker's operations and the loop's aborts

    def _accept(self) -> None:
        """Take one connection per remote rank; each names its rank first. Ends when all are
        in, or when stop() closes the listener."""
        try:
            while any(r not in self.by_rank for r in self._remote):
                try:
                    conn = self._listener.accept()
                except OSError:  # closed by stop()
                    return
                except (mp.AuthenticationError, EOFError) as exc:  # a wrong key: not ours
                    LOG.warning("refused a tensor parallel connection: %s", exc)
                    continue
                try:
                    kind, rank = conn.recv()
                except (EOFError, OSError, ValueError, TypeError):
                    kind, rank = "?", None
                if kind != "hello" or rank not in self._remote or rank in self.by_rank:
                    LOG.warning("refused a tensor parallel connection announcing %r",
                                (kind, rank))
                    conn.close()
                    continue
                self.by_rank[rank] = conn
        finally:
            self._listener.close()

    def wait_ready(self) -> None:
        """Block until every peer has loaded its model (they load while rank 0 loads) and,
        for an engine over several nodes, every remote rank has connected."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        if self._accepting is not None:
            self._accepting.join(READY_TIMEOUT_S)
            missing = [r for r in self._remote if r not in self.by_rank]
            if missing:
                raise RuntimeError(f"tensor parallel ranks {missing} (on the engine's other "
                                   f"nodes) did not connect within {READY_TIMEOUT_S:.0f}s")
        self.conns = [self.by_rank[r] for r in range(1, self.tp_size)]
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"tensor parallel rank {rank} did not load the model within "
                                   f"{READY_TIMEOUT_S:.0f}s")
            status, detail = conn.recv()
            if status != "ready":
                raise RuntimeError(f"tensor parallel rank {rank} failed to start: {detail}")

    @property
    def size(self) -> int:
        return self.tp_size

    def run(self, op: str, body: Any, local: Callable[[Any], Any]) -> list[Any]:
        """`op` on every rank: the peers' parts start first (a group rendezvous needs all
        ranks at once), then rank 0's `local(body)`; returns each rank's result in rank order
        once all have answered. One rank's failure fails the operation, naming the rank."""
        with self._sending:
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
                proc = self.procs.get(rank)
                status, detail = "error", (f"the process exited (code {proc.exitcode})"
                                           if proc is not None else
                                           "its connection from another node closed")
            if status == "ok":
                results.append(detail)
            else:
                results.append(None)
                errors.append(f"tp rank {rank}: {detail}")
        if errors:
            raise PeerError("; ".join(errors))
        return results

    def abort(self, body: Any) -> None:
        """Every peer leaves the weight-update group `body["group_name"]` at once, within an
        operation or not (Receiver.abort_group); no answer comes back."""
        with self._sending:
            for conn in self.conns:
                with contextlib.suppress(OSError, ValueError):  # a peer gone: nothing to do
                    conn.send((ABORT, body))

    def stop(self) -> None:
        if self._accepting is not None and self._accepting.is_alive():
            self._listener.close()
        with self._sending:
            for conn in self.by_rank.values():
                with contextlib.suppress(OSError, ValueError):  # already gone
                    conn.send(("stop", None))
        for proc in self.procs.values():
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
        device = rank_device(args.device, tp_rank, args.ranks_per_node)
        if device.startswith("cuda"):
            # NCCL groups and the receive buffers use the current device.
            torch.cuda.set_device(local_gpu(tp_rank, args.ranks_per_node))
        engine = ReferenceEngine(args.model_path, tokenizer_path=args.tokenizer_path,
                                 device=device, dtype=args.dtype, seed=args.seed,
                                 weight_version=args.weight_version,
                                 mem_fraction_static=args.mem_fraction_static,
                                 weights_cpu_backup=args.weights_cpu_backup,
                                 tp_rank=tp_rank, tp_size=args.tp_size,
                                 ep_size=args.ep_size)
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
        "tensor_sources": receiver.tensor_sources,
        "release": engine.release,
        "resume": engine.resume,
    }
    conn.send(("ready", None))
    LOG.info("tensor parallel rank %d ready on %s", tp_rank, device)
    _serve(conn, ops, receiver)
    # An aborted group may still hold an operation in gloo's thread: no interpreter shutdown
    # (it would wait for, or trip over, it), as rank 0's server ends too.
    logging.shutdown()
    os._exit(0)


def _serve(conn: Connection, ops: Mapping[str, Callable[[Any], Any]], receiver: Any) -> None:
    """Rank 0's operations, one at a time and each answered, until "stop" or rank 0 is gone."""
    inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
    threading.Thread(target=_read, args=(conn, inbox, receiver), daemon=True,
                     name="tp-read").start()
    while True:
        op, body = inbox.get()
        if op == "stop":
            return
        try:
            answer = ("ok", ops[op](body))
        except Exception as exc:
            answer = ("error", str(exc) if isinstance(exc, ValueError)
                      else f"{type(exc).__name__}: {exc}")
        try:
            conn.send(answer)
        except (OSError, ValueError):  # rank 0 is gone: so is this engine
            return


def _read(conn: Connection, inbox: queue.Queue[tuple[str, Any]], receiver: Any) -> None:
    """A peer's connection from rank 0: an abort is done here at once (the main thread may be
    in the group's receive), every other operation queued for the main thread. Rank 0 gone:
    every group left (a receive in flight would otherwise wait out its timeout) and stop."""
    while True:
        try:
            op, body = conn.recv()
        except (EOFError, OSError):
            receiver.abort_all()
            inbox.put(("stop", None))
            return
        if op == ABORT:
            receiver.abort_group(body)
            continue
        inbox.put((op, body))
        if op == "stop":
            return


def connect_to_node0(nodes: Nodes, tp_rank: int, timeout_s: float = READY_TIMEOUT_S
                     ) -> Connection:
    """A remote rank's connection to node 0 (retried while node 0 starts), announced."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(nodes.address(), authkey=nodes.secret)
            break
        except OSError as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallel rank {tp_rank} could not reach node 0 at "
                                   f"{nodes.dist_init_addr} within {timeout_s:.0f}s: {exc}"
                                   ) from exc
            time.sleep(CONNECT_RETRY_S)
    conn.send(("hello", tp_rank))
    return conn


def _remote_rank_main(nodes: Nodes, args: RankArgs, tp_rank: int) -> None:
    _peer_main(connect_to_node0(nodes, tp_rank), args, tp_rank)


def start_node_ranks(args: RankArgs, tp_size: int, nodes: Nodes) -> list[Any]:
    """On node rank >= 1: this node's ranks, as processes that connect to node 0 and then
    serve it as its own ranks do (see _peer_main)."""
    ctx = mp.get_context("spawn")
    procs = []
    for rank in nodes.ranks(tp_size):
        proc = ctx.Process(target=_remote_rank_main, args=(nodes, args, rank), daemon=True,
                           name=f"tp-rank-{rank}")
        proc.start()
        procs.append(proc)
    return procs
