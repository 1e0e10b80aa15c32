"""What slows the reference engine's generation while a trainer trains beside it on another GPU
of the same host (issue 37: 2.90 s alone, 3.33 s beside the fsdp trainer, 2x H200).

One reference engine (HF eager decoding, one forward per token, continuous batching) runs on
GPU 0 for the whole probe. A rollout is the trainer's: `--prompts` x `--samples` sequences in
ONE batched POST /generate (as the trainer's client sends a step's share to an engine), random
8-token prompts, `--response-len` new tokens each (ignore_eos, temperature 1, a seed per
sample: the same workload every time), timed from send to the answer. Each condition times
`--rounds` rollouts while a "load" process (bench/overlap_loads.py) runs beside the engine:

    idle           no load
    train          HF model from the model dir on GPU 1, float32 weights + bf16 autocast,
                   AdamW (fused): forward+backward over micro-batches of 8 sequences of
                   8 + response-len tokens, one optimizer step per rollout's worth; torch's
                   default threads (what a process not under Ray gets)
    train-1thread  the same, OMP_NUM_THREADS=1 and torch.set_num_threads(1) (what Ray gives an
                   actor of num_cpus=1, and a process started from one inherits)
    train-pinned   the same as train, the load pinned to the upper half of the host's physical
                   cores and the engine (every thread, at run time) to the lower half
    gpu-only       bf16 8192^2 matmuls on GPU 1, 20 per synchronize: GPU busy, host idle
    cpu-only       cores/2 processes spinning in pure Python: host busy, no GPU, no PCIe

How to read it: if `cpu-only` slows the engine as `train` does and `train-pinned` (or
`train-1thread`) does not, the cause is host CPU contention; if `gpu-only` slows it, the cause
is on the GPU side (power, clocks, the PCIe root). The engine's own counters say the same from
the inside, per rollout: CPU seconds (all its threads), the busiest thread's CPU seconds (close
to the rollout's seconds: a launch-bound loop on one core), and the seconds its threads spent
runnable but waiting for a core (`runq`, /proc/<pid>/task/*/schedstat), with its involuntary
context switches. The load's steps per second alone (before the rollouts) and during them show
how hard it ran and how much the engine slowed it; its CPU cores (CPU seconds per second of
rollout, over the load's whole process tree) how much host it took.

Schedule (why: a train load takes 10-20 s to load its model onto GPU 1, so it starts once per
condition, not once per rollout): a warm-up rollout, `--rounds` idle rollouts, then per load
condition: start the load, wait for its READY line (outside any timed window), measure its
rate alone for `--load-alone-s`, time `--rounds` rollouts, take one nvidia-smi snapshot (engine
idle, load running), stop the load, and time one idle rollout (drift control: the idle median
is over all idle rollouts; each idle one is in the JSON with its place in the sequence).

On 2 GPUs (the lead's machine; PYTHONPATH with the packages as for the other benches):

    python bench/overlap_probe.py --out /tmp/probe           # Qwen2.5-1.5B, ~4 min, 6 conditions

CPU dry run (every code path, tiny model, seconds):

    .venv/bin/python bench/overlap_probe.py --device cpu --shape tiny --prompts 4 --samples 2 \\
        --response-len 8 --rounds 1 --out /tmp/probe

Prints a markdown table and writes `--out/overlap_probe.json` (every rollout, every load
block). `--budget-s` caps the whole run: past it the probe stops, prints what it has and exits
0. Every child is in its own process group, killed on exit, and dies with the probe (prctl
PDEATHSIG) if the probe is killed. Never part of `make test`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from engine_batching import free_port, wait_ready  # bench/ is on sys.path
from overlap_loads import die_with_parent, parse_cpus

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
PACKAGES = [ROOT / d for d in ("operator", "trainer_image", "rollout_image", "wire")]
CONDITIONS = ["idle", "train", "train-1thread", "train-pinned", "gpu-only", "cpu-only"]
LOAD_UNITS = {"train": "micro-batches/s", "gpu-matmul": "20-matmul syncs/s",
              "cpu-spin": "spin steps/s (all procs)"}


class BudgetExhausted(Exception):
    pass


# ---------------------------------------------------------------- host: CPUs and /proc


def physical_cores(cpus: set[int]) -> list[list[int]]:
    """``cpus`` grouped by physical core (hyperthread siblings together), ordered by their
    lowest CPU number. Linux often numbers siblings N apart (0 and 16), so "the upper half of
    the CPU numbers" would share every core with the lower half."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for cpu in sorted(cpus):
        try:
            text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
            key = tuple(sorted(parse_cpus(text.read_text().strip()) & cpus))
        except OSError:
            key = (cpu,)
        groups.setdefault(key, []).append(cpu)
    return sorted(groups.values(), key=min)


def core_halves(cpus: set[int]) -> tuple[set[int], set[int]]:
    """(lower, upper): the host's physical cores split in two, whole cores to each side."""
    cores = physical_cores(cpus)
    if len(cores) < 2:  # one core: split its threads (or share the one CPU)
        ordered = sorted(cpus)
        k = max(1, len(ordered) // 2)
        return set(ordered[:k]), set(ordered[k:]) or set(ordered)
    k = len(cores) // 2
    return {c for g in cores[:k] for c in g}, {c for g in cores[k:] for c in g}


def cpu_list(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def tasks(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


@dataclass
class ThreadStat:
    cpu_s: float
    runq_s: float
    nvcsw: int


def thread_stats(pid: int) -> dict[int, ThreadStat]:
    """Per thread of ``pid``: CPU seconds, seconds runnable but waiting for a core, and
    involuntary context switches (schedstat: "exec_ns wait_ns slices")."""
    out = {}
    for tid in tasks(pid):
        base = f"/proc/{pid}/task/{tid}"
        try:
            exec_ns, wait_ns, _ = Path(f"{base}/schedstat").read_text().split()
            status = Path(f"{base}/status").read_text()
        except (OSError, ValueError):
            continue
        nv = next((int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("nonvoluntary_ctxt_switches")), 0)
        out[tid] = ThreadStat(int(exec_ns) / 1e9, int(wait_ns) / 1e9, nv)
    return out


@dataclass
class EngineDelta:
    cpu_s: float  # all threads
    busiest_cpu_s: float  # the thread that used the most CPU in the window
    runq_s: float  # all threads' time waiting for a core
    busiest_runq_s: float
    nvcsw: int


def engine_delta(before: dict[int, ThreadStat], after: dict[int, ThreadStat]) -> EngineDelta:
    zero = ThreadStat(0.0, 0.0, 0)
    deltas = {tid: ThreadStat(a.cpu_s - before.get(tid, zero).cpu_s,
                              a.runq_s - before.get(tid, zero).runq_s,
                              a.nvcsw - before.get(tid, zero).nvcsw)
              for tid, a in after.items()}
    busiest = max(deltas.values(), key=lambda d: d.cpu_s, default=zero)
    return EngineDelta(sum(d.cpu_s for d in deltas.values()), busiest.cpu_s,
                       sum(d.runq_s for d in deltas.values()), busiest.runq_s,
                       sum(d.nvcsw for d in deltas.values()))


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (from every process's parent in /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu_s(root: int) -> float:
    """CPU seconds of every thread of ``root``'s process tree (/proc/<pid>/schedstat counts
    only a process's main thread)."""
    return sum(t.cpu_s for pid in process_tree(root) for t in thread_stats(pid).values())


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (sched_setaffinity on a pid moves only the thread
    of that id; threads made later inherit their creator's set)."""
    for tid in tasks(pid):
        with contextlib.suppress(OSError):  # the thread ended meanwhile
            os.sched_setaffinity(tid, cpus)


def smi_snapshot() -> list[str]:
    """The fields asked, then one nvidia-smi line per GPU (clocks, power, temperature,
    throttle reasons); [] without nvidia-smi."""
    base = "index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu"
    # newer drivers name the throttle reasons "clocks_event_reasons"; older ones only the old
    for query in (f"{base},clocks_event_reasons.active", f"{base},clocks_throttle_reasons.active",
                  base):
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20, check=True).stdout
        except FileNotFoundError:
            return []
        except (OSError, subprocess.SubprocessError):
            continue
        return [query, *(line.strip() for line in out.splitlines() if line.strip())]
    return []


# ---------------------------------------------------------------- child processes


def child_env(gpu: str | None, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("KUBERL_ENGINE_API_KEY", None)  # the probe's requests carry no key
    env["PYTHONPATH"] = os.pathsep.join([*map(str, PACKAGES), str(BENCH),
                                         env.get("PYTHONPATH", "")])
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.update(extra)
    return env


def spawn(cmd: list[str], env: dict[str, str], stdout: IO[Any] | int,
          stderr: IO[Any] | int) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, text=True,
                            start_new_session=True, preexec_fn=die_with_parent)


def kill_group(proc: subprocess.Popen[str] | None) -> None:
    """SIGTERM the child's process group, SIGKILL what is left after 10 s."""
    if proc is None:
        return
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            if sig == signal.SIGTERM:  # the leader left: its group's stragglers get SIGKILL
                os.killpg(proc.pid, signal.SIGKILL)
            break
        except subprocess.TimeoutExpired:
            continue
        except ProcessLookupError:
            break


class Load:
    """A load process and the STEP times it reports (see overlap_loads.py)."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        self.steps: list[float] = []
        self.ready = threading.Event()
        self.proc = spawn(cmd, env, subprocess.PIPE, log.open("w"))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("STEP "):
                self.steps.append(float(line.split()[1]))
            elif line.startswith("READY"):
                self.ready.set()

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while not self.ready.wait(0.2):
            if self.proc.poll() is not None:
                raise RuntimeError(f"load {self.name} exited ({self.proc.returncode}):\n"
                                   f"{self.log.read_text()[-2000:]}")
            if time.monotonic() > end:
                raise RuntimeError(f"load {self.name} not ready after {timeout:.0f} s")

    def steps_between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t <= t1 for t in list(self.steps))


def load_command(cond: str, args: argparse.Namespace, model: Path,
                 halves: tuple[set[int], set[int]], cpus: set[int]
                 ) -> tuple[str, list[str], dict[str, str]]:
    """(load kind, command, environment) of a condition's load."""
    gpu = "1" if args.device == "cuda" else None
    script = [sys.executable, str(BENCH / "overlap_loads.py")]
    if cond.startswith("train"):
        cmd = [*script, "train", "--model-dir", str(model), "--device", args.device,
               "--micro-batch", "8", "--seq-len", str(8 + args.response_len),
               "--accum", str(max(1, args.prompts * args.samples // 8))]
        extra = {}
        if cond == "train-1thread":
            cmd += ["--threads", "1"]
            extra["OMP_NUM_THREADS"] = "1"
        if cond == "train-pinned":
            cmd += ["--cpus", cpu_list(halves[1])]
        return "train", cmd, child_env(gpu, **extra)
    if cond == "gpu-only":
        size = "8192" if args.device == "cuda" else "256"  # on CPU: a stand-in, one thread
        return "gpu-matmul", [*script, "gpu-matmul", "--device", args.device, "--size", size,
                              "--per-sync", "20"], child_env(gpu, OMP_NUM_THREADS="1")
    if cond == "cpu-only":
        procs = args.cpu_procs or max(1, len(cpus) // 2)
        return "cpu-spin", [*script, "cpu-spin", "--procs", str(procs)], child_env(None)
    raise ValueError(cond)


# ---------------------------------------------------------------- rollouts


def rollout_body(args: argparse.Namespace, vocab: int) -> bytes:
    rng = random.Random(0)
    n = args.prompts * args.samples
    prompts = [[rng.randrange(3, min(vocab, 1000)) for _ in range(8)] for _ in range(args.prompts)]
    return json.dumps({
        "input_ids": [prompts[i // args.samples] for i in range(n)],
        "sampling_params": [{"max_new_tokens": args.response_len, "ignore_eos": True,
                             "temperature": 1.0, "sampling_seed": i} for i in range(n)],
        "return_logprob": True}).encode()


def post_rollout(url: str, body: bytes, timeout: float, expect: int) -> tuple[float, int]:
    """(seconds from send to the whole answer, tokens generated)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    req = urllib.request.Request(f"{url}/generate", data=body,
                                 headers={"Content-Type": "application/json"})
    start = time.monotonic()
    with opener.open(req, timeout=timeout) as answer:
        raw = answer.read()
    seconds = time.monotonic() - start
    answers = json.loads(raw)
    if not isinstance(answers, list) or len(answers) != expect:
        raise RuntimeError(f"expected {expect} answers, got {str(answers)[:300]}")
    return seconds, sum(len(a["output_ids"]) for a in answers)


@dataclass
class Rollout:
    condition: str
    sequence: int  # place in the whole run
    at_s: float  # start, seconds since the probe began
    seconds: float
    tokens: int
    engine: EngineDelta
    load_steps: int | None
    load_cpu_s: float | None
    loadavg_1m: float


@dataclass
class Block:
    condition: str
    load_kind: str | None
    start_s: float = 0.0  # the load's start-up (spawn to READY)
    alone_rate: float | None = None
    alone_cpu_cores: float | None = None
    smi: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class Run:
    args: dict[str, Any]
    host: dict[str, Any]
    rollouts: list[Rollout] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Probe:
    def __init__(self, args: argparse.Namespace, run: Run, url: str,
                 engine: subprocess.Popen[str], body: bytes, t0: float) -> None:
        self.args, self.run, self.url, self.engine, self.body, self.t0 = (
            args, run, url, engine, body, t0)
        self.expect = args.prompts * args.samples
        self.last_s = 0.0

    def time_left(self) -> float:
        return float(self.args.budget_s) - (time.monotonic() - self.t0)

    def rollout(self, condition: str, load: Load | None) -> Rollout | None:
        if self.time_left() < 2 * self.last_s + 15:  # room for it and the clean-up
            raise BudgetExhausted(f"{self.time_left():.0f} s left before a {condition} rollout")
        before = thread_stats(self.engine.pid)
        load_before = tree_cpu_s(load.proc.pid) if load else None
        at = time.monotonic()
        seconds, tokens = post_rollout(self.url, self.body, self.args.timeout, self.expect)
        end = at + seconds
        delta = engine_delta(before, thread_stats(self.engine.pid))
        load_cpu = (tree_cpu_s(load.proc.pid) - load_before
                    if load and load_before is not None else None)
        self.last_s = seconds
        r = Rollout(condition, len(self.run.rollouts), at - self.t0, seconds, tokens, delta,
                    load.steps_between(at, end) if load else None, load_cpu,
                    os.getloadavg()[0])
        if condition != "warm-up":
            self.run.rollouts.append(r)
        print(f"  {condition:<14} {seconds:6.2f} s  engine CPU {delta.cpu_s:5.2f} s "
              f"(busiest thread {delta.busiest_cpu_s:5.2f}, runq {delta.runq_s:5.2f})"
              + (f"  load steps {r.load_steps}" if load else ""), flush=True)
        return r

    def block(self, cond: str, halves: tuple[set[int], set[int]], cpus: set[int],
              model: Path, out: Path) -> None:
        if cond == "idle":
            for _ in range(self.args.rounds):
                self.rollout("idle", None)
            return
        if self.args.device == "cpu" and cond == "gpu-only":
            self.run.notes.append("gpu-only on cpu: 256^2 float32 matmuls, one thread "
                                  "(a code-path check, not a GPU load)")
        if self.time_left() < self.args.load_alone_s + 4 * self.last_s + 45:
            raise BudgetExhausted(f"{self.time_left():.0f} s left before the {cond} load")
        kind, cmd, env = load_command(cond, self.args, model, halves, cpus)
        blk = Block(cond, kind)
        self.run.blocks.append(blk)
        spawned = time.monotonic()
        load = Load(cond, cmd, env, out / f"load-{cond}.log")
        try:
            if cond == "train-pinned":
                pin_threads(self.engine.pid, halves[0])
            load.wait_ready(max(10.0, min(180.0, self.time_left() - 30)))
            blk.start_s = time.monotonic() - spawned
            a0, c0 = time.monotonic(), tree_cpu_s(load.proc.pid)
            time.sleep(self.args.load_alone_s)
            a1, c1 = time.monotonic(), tree_cpu_s(load.proc.pid)
            blk.alone_rate = load.steps_between(a0, a1) / (a1 - a0)
            blk.alone_cpu_cores = (c1 - c0) / (a1 - a0)
            print(f"{cond}: load {kind} ready in {blk.start_s:.1f} s, alone "
                  f"{blk.alone_rate:.1f} {LOAD_UNITS[kind]}, {blk.alone_cpu_cores:.1f} cores",
                  flush=True)
            for _ in range(self.args.rounds):
                self.rollout(cond, load)
            if self.args.device == "cuda":
                blk.smi = smi_snapshot()
        except RuntimeError as exc:
            blk.error = str(exc)
            print(f"{cond}: {exc}", flush=True)
        finally:
            kill_group(load.proc)
            if cond == "train-pinned":
                pin_threads(self.engine.pid, cpus)
        if "idle" in self.args.conditions:
            self.rollout("idle", None)


# ---------------------------------------------------------------- report


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def table(run: Run) -> str:
    idle = median([r.seconds for r in run.rollouts if r.condition == "idle"])
    blocks = {b.condition: b for b in run.blocks}
    lines = ["| condition | rollouts | median s | min | max | x idle | engine CPU s | busiest "
             "thread CPU s | engine runq s | engine nvcsw | load rate alone | load rate "
             "during | load CPU cores during |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = list(dict.fromkeys(r.condition for r in run.rollouts))
    order += [b.condition for b in run.blocks if b.condition not in order]
    for cond in order:
        rs = [r for r in run.rollouts if r.condition == cond]
        secs = [r.seconds for r in rs]
        blk = blocks.get(cond)
        during = sum(r.load_steps or 0 for r in rs) / sum(secs) if secs and blk else None
        load_cpu = (sum(r.load_cpu_s or 0.0 for r in rs) / sum(secs)
                    if secs and blk else None)

        def f(x: float | None, fmt: str = ".2f") -> str:
            return "" if x is None or x != x else format(x, fmt)

        unit = f" ({LOAD_UNITS[blk.load_kind]})" if blk and blk.load_kind else ""
        lines.append(
            f"| {cond}{' (' + blk.error[:60] + ')' if blk and blk.error else ''} | {len(rs)} "
            f"| {f(median(secs))} | {f(min(secs, default=None))} | {f(max(secs, default=None))} "
            f"| {f(median(secs) / idle if secs else None)} "
            f"| {f(median([r.engine.cpu_s for r in rs]))} "
            f"| {f(median([r.engine.busiest_cpu_s for r in rs]))} "
            f"| {f(median([r.engine.runq_s for r in rs]), '.3f')} "
            f"| {f(median([float(r.engine.nvcsw) for r in rs]), '.0f')} "
            f"| {f(blk.alone_rate if blk else None, '.1f')}{unit} | {f(during, '.1f')} "
            f"| {f(load_cpu, '.1f')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="qwen2.5-1.5b", help="bench/gpu_common.SHAPES")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--response-len", type=int, default=64)
    p.add_argument("--engine-batch", type=int, default=512, help="engine --max-batch-size")
    p.add_argument("--max-prefill-tokens", type=int, default=16384)
    p.add_argument("--engine-threads", type=int, default=None,
                   help="engine --torch-threads and OMP_NUM_THREADS (default: torch's default "
                        "on cuda, 1 on cpu)")
    p.add_argument("--rounds", type=int, default=5, help="rollouts per condition")
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=CONDITIONS)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--cpu-procs", type=int, default=0,
                   help="cpu-only's busy processes (default: half the CPUs this process may "
                        "use)")
    p.add_argument("--load-alone-s", type=float, default=3.0,
                   help="seconds each load runs alone, before its rollouts (its rate alone)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per rollout")
    p.add_argument("--budget-s", type=float, default=500.0,
                   help="the whole run; past it: print what there is, exit 0")
    args = p.parse_args(argv)
    if args.engine_threads is None:
        args.engine_threads = 0 if args.device == "cuda" else 1
    return args


def build_model(out: Path, shape: str) -> Path:
    """gpu_common.build_model in a child process: this one stays free of torch and CUDA (no
    context on GPU 0, no thread pool), a plain HTTP client as the trainer's is."""
    code = ("import sys; from pathlib import Path; from gpu_common import build_model; "
            "print(build_model(Path(sys.argv[1]), sys.argv[2]))")
    proc = spawn([sys.executable, "-c", code, str(out), shape], child_env(None),
                 subprocess.PIPE, subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate()
    finally:
        kill_group(proc)
    if proc.returncode:
        raise RuntimeError(f"building the model failed:\n{stderr[-2000:]}")
    return Path(stdout.strip().splitlines()[-1])


def start_engine(model: Path, args: argparse.Namespace, out: Path
                 ) -> tuple[subprocess.Popen[str], str, Path]:
    port = free_port()
    extra = {"OMP_NUM_THREADS": str(args.engine_threads)} if args.engine_threads else {}
    log = out / "engine.log"
    cmd = [sys.executable, "-m", "kuberl_rollout.reference", "--model-path", str(model),
           "--port", str(port), "--device", args.device,
           "--dtype", "bfloat16" if args.device == "cuda" else "float32",
           "--max-batch-size", str(args.engine_batch), "--batching", "continuous",
           "--max-prefill-tokens", str(args.max_prefill_tokens),
           "--torch-threads", str(args.engine_threads)]
    proc = spawn(cmd, child_env("0" if args.device == "cuda" else None, **extra),
                 log.open("w"), subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    cpus = os.sched_getaffinity(0)
    halves = core_halves(cpus)
    run = Run({k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              {"cpus": len(cpus), "physical_cores": len(physical_cores(cpus)),
               "engine_half": cpu_list(halves[0]), "load_half": cpu_list(halves[1]),
               "loadavg_start": os.getloadavg(), "python": sys.version.split()[0]})

    def on_alarm(*_: Any) -> None:
        raise BudgetExhausted(f"--budget-s {args.budget_s:g} reached")

    def on_term(*_: Any) -> None:
        run.notes.append("stopped by SIGTERM")
        raise SystemExit(143)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.alarm(max(1, int(args.budget_s)))
    engine = None
    code = 0
    try:
        model = build_model(out, args.shape)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        run.host["model_built_s"] = round(time.monotonic() - t0, 1)
        print(f"model {args.shape} at {model} ({run.host['model_built_s']} s); "
              f"{len(cpus)} CPUs, {run.host['physical_cores']} cores; engine half "
              f"{run.host['engine_half']}, load half {run.host['load_half']}", flush=True)
        engine, url, log = start_engine(model, args, out)
        asyncio.run(wait_ready(url, engine, log))
        run.host["engine_ready_s"] = round(time.monotonic() - t0, 1)
        probe = Probe(args, run, url, engine, rollout_body(args, vocab), t0)
        probe.rollout("warm-up", None)
        if args.device == "cuda":
            run.host["smi_idle"] = smi_snapshot()
        for cond in args.conditions:
            probe.block(cond, halves, cpus, model, out)
    except BudgetExhausted as exc:
        run.notes.append(f"stopped early: {exc}")
    except Exception:  # print what there is, then fail
        run.notes.append(f"failed: {traceback.format_exc()}")
        code = 1
    finally:
        signal.alarm(0)
        kill_group(engine)
        run.host["total_s"] = round(time.monotonic() - t0, 1)
        (out / "overlap_probe.json").write_text(json.dumps(asdict(run), indent=1))
        report(run, args)
    return code


def report(run: Run, args: argparse.Namespace) -> None:
    print(f"\n{args.prompts} prompts x {args.samples} samples x {args.response_len} tokens, "
          f"{args.shape} on {args.device}, --max-batch-size {args.engine_batch}; "
          f"{run.host['cpus']} CPUs ({run.host['physical_cores']} cores); "
          f"{run.host['total_s']} s in all")
    print(table(run))
    for blk in run.blocks:
        if blk.smi:
            print(f"nvidia-smi, {blk.condition} load running, engine idle: "
                  + " | ".join(blk.smi))
    for note in run.notes:
        print(f"note: {note}")
    print(f"raw: {args.out / 'overlap_probe.json'}")


if __name__ == "__main__":
    sys.exit(main())
