"""`kuberl run` SIGKILLed at any moment (start-up, mid-step, inside a save, right after one)
and run again into the same output folder: each kill loses at most the steps since the last
checkpoint, leaves no process behind and no checkpoint that resumes wrongly, and the run
that finishes holds what an uninterrupted run holds: one metrics row per step, the same
numbers, the same final checkpoint."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.integration.local_run import ENV, KUBERL, manifest, metrics
from tests.integration.test_local_run import whole_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS, EVERY = 6, 2
SAVE_DELAY_S = 2.0  # a save held open this long (KUBERL_TEST_SAVE_DELAY_S), to kill inside it
# The variable that marks every process of a run (inherited by all it starts, Ray's too).
MARK = "KUBERL_TEST_KILLED_RUN"
HIDDEN = re.compile(r"^\.(step_|deleting\.)")  # a save's or a pruning's leftovers


class Run:
    """One `kuberl run` of `job` into `out`, its output in files, its processes marked."""

    def __init__(self, job: Path, out: Path, n: int, env: dict[str, str] | None = None
                 ) -> None:
        self.out, self.mark = out, uuid.uuid4().hex
        self.stdout, self.stderr = out.parent / f"run-{n}.out", out.parent / f"run-{n}.err"
        with self.stdout.open("w") as so, self.stderr.open("w") as se:
            self.proc = subprocess.Popen(
                [*KUBERL, "run", str(job), "--output-dir", str(out)], stdout=so, stderr=se,
                cwd=job.parent, env={**ENV, MARK: self.mark, **(env or {})})

    def wait_for(self, what: str, ready: Callable[[], Any], timeout: float = 300) -> Any:
        deadline = time.monotonic() + timeout
        while not (found := ready()):
            assert self.proc.poll() is None, f"the run ended before {what}: {self.tail()}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s: {self.tail()}"
            time.sleep(0.01)
        return found

    def kill(self) -> None:
        self.proc.kill()
        assert self.proc.wait(timeout=60) == -9, self.tail()

    def survivors(self) -> list[str]:
        """The processes of this run still alive: what it started, however far from it."""
        needle = f"{MARK}={self.mark}".encode()
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}")
            except OSError:  # gone, or a zombie's
                continue
        return found

    def tail(self) -> str:
        return (f"--- stderr ---\n{self.stderr.read_text()[-3000:]}\n"
                f"--- stdout ---\n{self.stdout.read_text()[-1500:]}")


def lines(out: Path) -> int:
    """metrics.jsonl's lines, one a kill cut short included."""
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def last_step_s(out: Path) -> float:
    """The last step's seconds (of the rows whole so far: the run is writing the file)."""
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return float(rows[-1]["time_step_s"])


def test_kill_9_at_any_moment_loses_at_most_the_steps_since_the_last_checkpoint(
        tiny: Path, tmp_path: Path, shared_run: Callable[[str, Path], Path]) -> None:
    from kuberl_trainer.checkpoint import latest

    seed = int(os.environ.get("KUBERL_TEST_KILL_SEED") or random.randrange(1 << 20))
    print(f"kill points drawn with seed {seed} (KUBERL_TEST_KILL_SEED={seed} repeats them)")
    rng = random.Random(seed)
    whole = whole_run(tiny, tmp_path, shared_run, "grpo")
    # Each run starts its own Ray (no --address): the processes a kill could orphan are its.
    job = manifest(tiny, tmp_path, "killed", schedule={"numRollouts": STEPS,
                                                       "saveInterval": EVERY})
    out, ckpts = tmp_path / "out", tmp_path / "out" / "checkpoints"

    def newest() -> int:
        found = latest(ckpts)
        return 0 if found is None else found[0]

    def hidden() -> list[str]:
        return [p.name for p in ckpts.iterdir() if HIDDEN.match(p.name)] if ckpts.exists() else []

    def start_up(run: Run) -> str:
        # Ray up, the engines and the training workers starting (the log folder's line comes
        # once Ray has started), then a moment more
        run.wait_for("Ray", lambda: run.stdout.read_text().startswith("logs:"))
        time.sleep(rng.uniform(0, 1.5))
        return "start-up"

    def mid_step(run: Run) -> str:
        want = lines(out) + rng.choice([1, 2])
        run.wait_for(f"row {want}", lambda: lines(out) >= want)
        time.sleep(rng.uniform(0.1, 0.9) * last_step_s(out))
        return f"mid-step after {want} rows"

    def in_save(run: Run) -> str:
        earlier = set(hidden())  # (a save the last kill cut short: this run deletes it)
        found = run.wait_for("a save", lambda: set(hidden()) - earlier)
        # from the staging folder's first file to past the ranks' files, before the marker
        time.sleep(rng.uniform(0, SAVE_DELAY_S))
        return f"inside the save into {min(found)}"

    def after_save(run: Run) -> str:
        before = newest()
        run.wait_for("a new checkpoint", lambda: newest() > before)
        return f"right after step_{newest()} landed"

    kills: list[tuple[Callable[[Run], str], dict[str, str]]] = [
        (start_up, {}), (mid_step, {}),
        (in_save, {"KUBERL_TEST_SAVE_DELAY_S": str(SAVE_DELAY_S)}), (after_save, {})]
    # Rows the runs after the kills train again (metrics.dropped.jsonl). (Counted at each kill:
    # the start-up kill comes first, before any row, so no run is killed holding rows that
    # an earlier kill left for it to drop.)
    dropped = 0
    started = time.monotonic()
    for n, (kill_at, env) in enumerate(kills):
        resumed_from = newest()
        run = Run(job, out, n, env)
        where = kill_at(run)
        run.kill()
        print(f"run {n}: killed {where}, {lines(out)} rows, newest checkpoint "
              f"step_{newest()}, left behind: {hidden()}")
        # No process of the killed run outlives it (its Ray, engines, training workers).
        deadline = time.monotonic() + 20
        while (alive := run.survivors()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive, (seed, where, alive)
        # The kill lost the steps since the newest checkpoint, no more: every row before it is
        # written, and the checkpoint the run resumed from (or a newer one) is still there.
        assert resumed_from <= newest() <= lines(out), (seed, where)
        assert lines(out) - newest() <= EVERY, (seed, where)
        if kill_at is after_save:
            assert lines(out) == newest(), (seed, where)
        if kill_at is in_save:  # a staging folder, never a checkpoint
            assert hidden() and newest() == resumed_from, (seed, where, hidden())
        dropped += lines(out) - newest()
    final = Run(job, out, len(kills))
    assert final.proc.wait(timeout=600) == 0, final.tail()
    print(f"kills and resumes: {time.monotonic() - started:.1f} s")
    deadline = time.monotonic() + 20
    while (alive := final.survivors()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive, alive
    assert hidden() == [], hidden()  # the killed saves' leftovers are gone

    # One row per step, equal to the uninterrupted run's; the rows trained again set aside.
    a, b = metrics(whole), metrics(out)
    assert [r["step"] for r in b] == list(range(STEPS)), (seed, [r["step"] for r in b])
    for ra, rb in zip(a, b, strict=True):
        assert ra["prompts_sha"] == rb["prompts_sha"], (seed, rb["step"])
        for key in ("reward_mean", "pg_loss", "entropy"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-4, abs=1e-5), (seed, rb["step"], key)
    assert lines_of(out / "metrics.dropped.jsonl") == dropped, seed
    # The final checkpoint is the uninterrupted run's.
    assert newest() == STEPS
    same_checkpoint(whole / "checkpoints" / f"step_{STEPS}", ckpts / f"step_{STEPS}")


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def same_checkpoint(a: Path, b: Path) -> None:
    """The same files with the same contents: tensors equal within the metrics' tolerance,
    the trainer's state and the model's configuration exactly (the marker's time, the
    writer's name and the RNG states aside)."""
    import torch
    from safetensors.torch import load_file

    names = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    assert names == {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    # (Each rank's RNG states: the fsdp backend seeds none, and training draws from none, so
    # they are what each process started with, Python's and NumPy's from the OS's entropy.)
    for name in sorted(n for n in names - {Path("COMPLETE"), Path("WRITER")}
                       if not n.name.startswith("rng_rank")):
        x, y = a / name, b / name
        if name.suffix == ".safetensors":
            torch.testing.assert_close(load_file(x), load_file(y), rtol=1e-4, atol=1e-5)
        elif name.suffix == ".pt":  # the optimizer's and scheduler's state
            same_values(torch.load(x, weights_only=False), torch.load(y, weights_only=False),
                        str(name))
        elif name.suffix == ".json":
            assert json.loads(x.read_text()) == json.loads(y.read_text()), name
        else:
            assert x.read_bytes() == y.read_bytes(), name


def same_values(x: Any, y: Any, where: str) -> None:
    """Nested dicts and lists of tensors, numbers and strings, equal (floats within the
    metrics' tolerance)."""
    import torch

    if isinstance(x, dict):
        assert isinstance(y, dict) and x.keys() == y.keys(), where
        for key in x:
            same_values(x[key], y[key], f"{where}[{key!r}]")
    elif isinstance(x, list | tuple):
        assert isinstance(y, list | tuple) and len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y, strict=True)):
            same_values(u, v, f"{where}[{i}]")
    elif isinstance(x, torch.Tensor | float):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5, msg=where)
    else:
        assert x == y, where
