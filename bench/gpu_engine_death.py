"""An engine dead in the middle of an NCCL weight-sync broadcast, on GPUs: what kuberl's abort
of the group does where gloo on a CPU cannot show it (bench/engine_death.py measures a whole
run on CPU). One command runs every check the machine's GPUs allow:

    PYTHONPATH=operator:trainer_image:rollout_image:wire python3 bench/gpu_engine_death.py

- `one-gpu` (1+ GPUs). NCCL refuses two ranks on one GPU, so no broadcast can lose a live peer
  here; what one GPU shows: (a) the abort and the re-forming work on NCCL groups built as
  kuberl builds them (kuberl_wire.group): a one-rank group broadcasts, is aborted
  (ProcessGroupNCCL's abort, ncclCommAbort), and a group under a new name forms on the same
  rendezvous server and broadcasts; (b) a trainer whose peer joined the rendezvous but never
  the communicator (an engine dead after /init_weights_update_group and before the first
  bucket: NCCL sets its communicator up at the first collective) sits in NCCL's set-up:
  whether WeightSyncGroup.abort releases that broadcast's thread. If not, the thread stays
  there until NCCL gives up; the sync does not wait for it (the bucket's deadline fails it).
- `raw` (2+ GPUs): the trainer (GPU 0) and one engine rank (GPU 1, a process of its own) in
  a kuberl_wire NCCL group; after a broadcast that arrives, the engine process is SIGKILLed
  and the trainer broadcasts again: whether that broadcast's wait returns (NCCL's wait only
  orders the stream), whether the stream is stuck (a synchronize still waiting after 5 s),
  how long the release takes (`--release abort`: WeightSyncGroup.abort, what kuberl does;
  `shutdown`: the process group's shutdown, what destroy() did; `none`: nothing, until the
  group's `--timeout`, torch's watchdog), and whether the trainer's process is still alive
  `--timeout` + 10 s later (the watchdog takes a process down on a timed-out collective).
- `sender` (2+ GPUs): the real pieces. DistributedWeightSender (NCCL, abortable, one
  rendezvous server) on GPU 0 and reference engines on GPUs 1.. (`--device cuda`); engine 0,
  armed with the fault switch (kuberl_rollout/reference/fault.py), dies as the next sync's
  first bucket arrives: seconds until GroupBroken, the engines named stuck, whether the
  trainer's stream is free, then a replacement on engine 0's GPU, a new group, the sync again,
  and every engine's checksums against the trainer's. With 3+ GPUs engines 1.. survive the
  death: their receive must end with the abort the trainer sends them (ncclCommAbort on their
  side), and they must be kept, not named stuck.

Prints one row per check (yes/no and seconds). Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from gpu_common import build_model, card  # bench/ on path (and the packages, by gpu_common)
from gpu_tp_sync import HOST, free_port, start_engine
from sync_check import engine_sums

ROWS: list[tuple[str, str, str]] = []  # (check, result, detail)


def row(check: str, result: str, detail: str = "") -> None:
    ROWS.append((check, result, detail))
    print(f"  {check:<58} {result:<8} {detail}", flush=True)


def synchronized_within(seconds: float) -> float | None:
    """Seconds a torch.cuda.synchronize() took, or None if still waiting after `seconds`
    (it is left running on a daemon thread)."""
    done: dict[str, float] = {}
    start = time.monotonic()

    def sync() -> None:
        torch.cuda.synchronize()
        done["at"] = time.monotonic()

    thread = threading.Thread(target=sync, daemon=True)
    thread.start()
    thread.join(seconds)
    return done["at"] - start if "at" in done else None


def in_thread(fn: Any, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args)
        except BaseException as exc:
            out["error"] = exc
        out["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# ---- one GPU ---------------------------------------------------------------------------------

def _store_client(port: int, seconds: float) -> None:
    """A peer that joins the rendezvous and never the communicator (a CPU process)."""
    from datetime import timedelta

    from torch._C._distributed_c10d import TCPStore

    store = TCPStore(HOST, port, 2, False, timedelta(seconds=60))
    time.sleep(seconds)
    del store


def one_gpu(args: argparse.Namespace, q: Any) -> None:
    from kuberl_wire.group import host_store, new_group

    torch.cuda.set_device(0)
    port = free_port()
    store = host_store(HOST, port, args.timeout)
    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    g = new_group("nccl", HOST, port, 0, 1, "one", args.timeout, store)
    g.broadcast([t])
    torch.cuda.synchronize()
    started = time.monotonic()
    g.abort()
    aborted = time.monotonic() - started
    g2 = new_group("nccl", HOST, port, 0, 1, "one_2", args.timeout, store)
    g2.broadcast([t])
    ok = synchronized_within(30) is not None
    q.put(("(a) abort a one-rank NCCL group, form the next on the same server",
           "yes" if ok else "NO", f"abort {aborted:.2f} s; the next group broadcast: {ok}"))
    # (b) the peer joins the rendezvous only: rank 0's first broadcast sets up NCCL's
    # communicator and waits there for it
    peer = mp.get_context("spawn").Process(target=_store_client, args=(port, 120), daemon=True)
    peer.start()
    g3 = new_group("nccl", HOST, port, 0, 2, "setup", args.timeout, store)
    thread, out = in_thread(g3.broadcast, [t])
    thread.join(5)
    stuck = thread.is_alive()
    started = time.monotonic()
    aborting, _ = in_thread(g3.abort)
    aborting.join(30)
    thread.join(30)
    released = not thread.is_alive()
    detail = (f"stuck in set-up: {stuck}; abort returned: {not aborting.is_alive()}; "
              f"broadcast thread released: {released}"
              + (f" after {out['at'] - started:.1f} s ({type(out.get('error')).__name__})"
                 if released and "at" in out else ""))
    q.put(("(b) abort a trainer stuck in NCCL's set-up (peer never joined)",
           "yes" if released else "no", detail))
    peer.kill()


# ---- raw: two GPUs ---------------------------------------------------------------------------

def _raw_peer(port: int, timeout: float, q: Any) -> None:
    from kuberl_wire.group import new_group

    torch.cuda.set_device(1)
    g = new_group("nccl", HOST, port, 1, 2, "raw", timeout)
    t = torch.empty(1 << 20, device="cuda", dtype=torch.float32)
    g.broadcast([t])
    torch.cuda.synchronize()
    q.put(("peer", float(t.sum().item())))
    time.sleep(3600)  # (killed by the trainer)


def raw(args: argparse.Namespace, q: Any) -> None:
    from kuberl_wire.group import host_store, new_group

    torch.cuda.set_device(0)
    port = free_port()
    store = host_store(HOST, port, args.timeout)
    ctx = mp.get_context("spawn")
    peer_q = ctx.Queue()
    peer = ctx.Process(target=_raw_peer, args=(port, args.timeout, peer_q), daemon=True)
    peer.start()
    g = new_group("nccl", HOST, port, 0, 2, "raw", args.timeout, store)
    t = torch.ones(1 << 20, device="cuda", dtype=torch.float32)
    g.broadcast([t])
    _, got = peer_q.get(timeout=120)
    q.put(("raw: a broadcast arrives", "yes" if got == float(1 << 20) else "NO",
           f"sum {got:.0f}"))
    os.kill(peer.pid, signal.SIGKILL)
    peer.join(30)
    big = torch.ones(256 << 20, device="cuda", dtype=torch.bfloat16)  # 512 MB
    started = time.monotonic()
    g.broadcast([big])
    q.put(("raw: the broadcast to the killed peer returns on the host", "yes",
           f"{time.monotonic() - started:.2f} s (NCCL's wait orders the stream only)"))
    waited = synchronized_within(5)
    q.put(("raw: the trainer's stream is stuck behind it", "yes" if waited is None else "no",
           "synchronize still waiting after 5 s" if waited is None else f"{waited:.2f} s"))
    started = time.monotonic()
    if args.release == "abort":
        g.abort()
    elif args.release == "shutdown":
        in_thread(g.pg.shutdown)
    released = synchronized_within(args.timeout + 30)
    q.put((f"raw: --release {args.release} frees the stream",
           "yes" if released is not None else "no",
           f"{time.monotonic() - started:.1f} s" if released is not None
           else f"still stuck after {args.timeout + 30:.0f} s"))
    fresh = torch.ones(4, device="cuda")
    q.put(("raw: the trainer's GPU works after it", "yes" if float((fresh * 2).sum()) == 8
           else "NO", ""))
    time.sleep(args.timeout + 10)  # (past the collective's timeout: torch's watchdog)
    q.put(("raw: the trainer's process is alive past the group's timeout", "yes", ""))


# ---- sender: the real pieces -----------------------------------------------------------------

def sender(args: argparse.Namespace, q: Any) -> None:
    from kuberl_trainer.engines.client import EngineClient, GroupBroken
    from kuberl_trainer.weight_sync.sender import DistributedWeightSender, bucketize
    from kuberl_wire.codec import tensor_sha256
    from kuberl_wire.group import host_store

    torch.cuda.set_device(0)
    out = Path(args.out)
    model_dir = build_model(out, args.shape)
    n = args.gpus - 1
    extra = ("--weight-sync-timeout", str(args.timeout))
    engines = [start_engine(model_dir, str(i + 1), 1, out / f"engine{i}.log", *extra)
               for i in range(n)]
    procs, urls = [p for p, _ in engines], [u for _, u in engines]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    params = [(name, p.detach()) for name, p in model.named_parameters()]
    store = host_store(HOST, free_port(), args.timeout)
    loop = asyncio.new_event_loop()

    def shifted(by: float) -> list[tuple[str, torch.Tensor]]:
        return [(name, p + by) for name, p in params]

    def exact(named: list[tuple[str, torch.Tensor]], at: list[str]) -> bool:
        want = {name: tensor_sha256(t) for name, t in named}
        return all({k: s.get(k) for k in want} == want for s in engine_sums(at))

    def connected(at: list[str], name: str) -> DistributedWeightSender:
        snd = DistributedWeightSender(
            EngineClient(at, request_timeout_s=args.timeout + 30), master_address=HOST,
            master_port=store.port, store=store, backend="nccl", group_name=name,
            timeout_s=args.timeout, abortable=True)
        loop.run_until_complete(snd.connect())
        return snd

    first = connected(urls, "g1")
    one = shifted(1.0)
    loop.run_until_complete(first.send(bucketize(one, args.bucket_mb << 20)))
    q.put(("sender: a sync over NCCL, exact on every engine",
           "yes" if exact(one, urls) else "NO", f"{n} engine(s)"))
    os.kill(procs[0].pid, signal.SIGUSR1)  # (dies as the next sync's first bucket arrives)
    two = shifted(2.0)
    started = time.monotonic()
    try:
        loop.run_until_complete(first.send(bucketize(two, args.bucket_mb << 20)))
        q.put(("sender: the death breaks the sync", "NO", "it went through"))
        return
    except GroupBroken as exc:
        broken = time.monotonic() - started
        q.put(("sender: the death breaks the sync (GroupBroken)", "yes",
               f"{broken:.1f} s; failed {'engine 0' if exc.url == urls[0] else exc.url}; "
               f"stuck {list(exc.stuck)}"))
        if n > 1:
            q.put(("sender: the surviving engines are kept (not stuck)",
                   "yes" if not exc.stuck else "NO", ""))
    waited = synchronized_within(30)
    q.put(("sender: the trainer's stream is free after the abort",
           "yes" if waited is not None else "NO",
           f"{waited:.2f} s" if waited is not None else "synchronize stuck 30 s"))
    loop.run_until_complete(first.abandon())
    port = urls[0].rsplit(":", 1)[1]  # the fault switch's child, still holding engine 0's
    subprocess.run(["pkill", "-9", "-f", f"kuberl_rollout.reference .*--port {port}( |$)"])
    started = time.monotonic()
    new_proc, new_url = start_engine(model_dir, "1", 1, out / "engine0-replacement.log", *extra)
    procs.append(new_proc)
    again = [new_url, *urls[1:]]
    second = connected(again, "g2")
    loop.run_until_complete(second.send(bucketize(two, args.bucket_mb << 20)))
    q.put(("sender: replaced, a new group, the sync again: exact on every engine",
           "yes" if exact(two, again) else "NO",
           f"{time.monotonic() - started:.1f} s (engine start included)"))
    loop.run_until_complete(second.close())
    for proc in procs:
        proc.kill()


# ---- driver ----------------------------------------------------------------------------------

def run_check(name: str, fn: Any, args: argparse.Namespace, limit_s: float) -> None:
    """`fn(args, q)` in a process of its own: a hang or a crash is a result too."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=fn, args=(args, q))  # (not a daemon: it starts processes)
    print(f"\n{name}:", flush=True)
    proc.start()
    deadline = time.monotonic() + limit_s
    while proc.is_alive() and time.monotonic() < deadline:
        while not q.empty():
            row(*q.get())
        proc.join(0.5)
    while not q.empty():
        row(*q.get())
    if proc.is_alive():
        proc.kill()
        row(f"{name}: finished", "NO", f"still running after {limit_s:.0f} s (killed)")
    elif proc.exitcode:
        row(f"{name}: finished", "NO", f"exit code {proc.exitcode}"
            + (" (SIGABRT: torch's watchdog?)" if proc.exitcode == -6 else ""))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, default=None, help="default: every GPU seen")
    p.add_argument("--checks", default="one-gpu,raw,sender")
    p.add_argument("--release", choices=["abort", "shutdown", "none"], default="abort",
                   help="raw: what frees the trainer's stream after its peer died")
    p.add_argument("--timeout", type=float, default=60.0, help="the groups' timeout (s)")
    p.add_argument("--shape", default="qwen2.5-0.5b", help="sender: the model (gpu_common)")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--out", default="/tmp/kuberl-gpu-engine-death")
    args = p.parse_args()
    args.gpus = args.gpus or torch.cuda.device_count()
    if args.gpus < 1:
        p.error("no GPU: bench/engine_death.py is the CPU check")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    checks = args.checks.split(",")
    nccl = torch.cuda.nccl.version()
    print(f"{args.gpus} x {card()}, torch {torch.__version__}, NCCL "
          f"{nccl if isinstance(nccl, int) else '.'.join(map(str, nccl))}, "
          f"group timeout {args.timeout:.0f} s")
    if "one-gpu" in checks:
        run_check("one-gpu", one_gpu, args, 300)
    if args.gpus >= 2 and "raw" in checks:
        run_check(f"raw (--release {args.release})", raw, args, 3 * args.timeout + 300)
    if args.gpus >= 2 and "sender" in checks:
        run_check("sender", sender, args, 1200)
    if args.gpus < 2:
        print("\n(raw and sender need 2 GPUs: a dead peer mid-broadcast, and the reference "
              "engine's side with 3)")
    failed = [r for r in ROWS if r[1] == "NO"]
    print(f"\n{len(ROWS)} rows, {len(failed)} NO")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
