"""Checkpoint directories: layout, atomic completion, discovery, pruning and leftovers.

Layout under the job's checkpoint path (``spec.checkpoint.path``, or ``--output-dir``)::

    <root>/step_<N>/            one complete checkpoint, N = finished training steps
        COMPLETE                marker, written last (JSON: step, time)
        trainer_state.json      TrainerState: step, data source position, weight version
        WRITER                  the process that wrote it (writer.py)
        ...                     the backend's files (model/, optimizer.pt, rng_rank<r>.pt)
    <root>/.step_<N>.<random>/  a save in progress (or one a crash interrupted)
    <root>/.step_<N>.replaced/  step_<N> as it was, while a save of step N replaces it
    <root>/.deleting.<random>/  a checkpoint being pruned

A save writes everything into a hidden staging directory (``stage``), marker last, then renames
it to ``step_<N>`` (``Staged.commit``). The rename is atomic on one filesystem, so
``step_<N>`` is either absent or whole; the marker guards the cases a rename cannot (a
directory copied by other means, a filesystem without atomic rename): ``latest`` trusts only
``step_<N>`` directories that hold it, and never a hidden one, marked or not. The loops stage
a checkpoint right after training (colocated, while the trainers hold their GPUs) and commit
it once the step's row is in metrics.jsonl: a checkpoint is never ahead of the metrics, so a
run killed at any moment resumes from a step whose rows are all written (and drops the rows
after it, which it trains again: report/metrics_log.py).

A save killed at any moment leaves at most a hidden directory, which the next save and a
resumed run (``clear_leftovers``) delete once no process will finish it (writer.py: its
writer gone, never a live save's of another process sharing the volume), or put back (a
``.replaced`` one whose replacement never landed). Pruning renames a checkpoint away before
deleting it, so a kill mid-deletion never leaves a half-deleted ``step_<N>``.

All training ranks write into the same staging directory, so it must be on storage they all
see (the checkpoint PVC in a cluster). This module never talks to other ranks: the caller's
``write`` function returns once every rank's files are written.

``KUBERL_TEST_SAVE_DELAY_S`` (tests only): seconds a save waits after the ranks' files are
written, before its state and marker, so that a test can kill a run inside a save.

``Checkpointer`` is a run's use of them: when one is due, what goes in it, what a resumed run
reads back.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kuberl_trainer.checkpoint.writer import CLOCK_PREFIX, Lease, Writer, abandoned, storage_now

STEP_PREFIX = "step_"
STAGING_PREFIX = ".step_"
REPLACED_SUFFIX = ".replaced"
DELETING_PREFIX = ".deleting."
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
SAVE_DELAY_ENV = "KUBERL_TEST_SAVE_DELAY_S"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_STAGING_DIR = re.compile(rf"^{re.escape(STAGING_PREFIX)}(\d+)\.(.+)$")


@dataclass
class TrainerState:
    """What the loop needs besides the backend's files to resume exactly where it stopped."""

    step: int                                              # training steps finished
    data: dict[str, Any] = field(default_factory=dict)     # PromptSource.state_dict()
    weight_version: int = 0                                # engines' weight version
    sft_data: dict[str, Any] = field(default_factory=dict)  # the demonstrations' position
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. the last reward_mean

    def write(self, dir: str | Path) -> None:
        _write_json(Path(dir) / STATE_FILE, asdict(self))

    @classmethod
    def read(cls, dir: str | Path) -> TrainerState:
        raw = json.loads((Path(dir) / STATE_FILE).read_text())
        return cls(step=int(raw["step"]), data=dict(raw.get("data", {})),
                   weight_version=int(raw.get("weight_version", 0)),
                   metrics=dict(raw.get("metrics", {})),
                   sft_data=dict(raw.get("sft_data", {})))


def model_step(model_dir: str | Path) -> int:
    """The training steps a model directory holds: N for a checkpoint's model/ (step_<N>/model,
    by its trainer_state.json), 0 for any other (a base model): the step mode eval reports."""
    parent = Path(model_dir).parent
    try:
        return TrainerState.read(parent).step if (parent / COMPLETE).exists() else 0
    except (OSError, ValueError, KeyError):
        return 0


class Position(Protocol):
    """Where the prompt sources stand (rollout.manager.DataPosition)."""

    @property
    def data(self) -> dict[str, Any]: ...
    @property
    def sft_data(self) -> dict[str, Any]: ...


class Models(Protocol):
    """Rank groups that write and read their own files in a checkpoint (the training ranks,
    a critic's)."""

    def save(self, path: str) -> None: ...
    def load(self, path: str) -> None: ...


class Checkpointer:
    """A run's checkpoints under `root`: one every `every` steps (None: only as the run ends),
    the newest `keep` kept. It holds the run's progress as last recorded (steps finished,
    the engines' weight version): what a save as the run stops writes. `position(step)`:
    where the prompt sources stood as step `step`'s rollout began drawing (mode async draws
    ahead; a checkpoint holds no rollout, so a resumed run draws those prompts again)."""

    def __init__(self, root: Path, every: int | None, keep: int,
                 position: Callable[[int], Position]) -> None:
        self.root, self.every, self.keep, self.position = root, every, keep, position
        self.models: Sequence[Models] = ()  # (set once the ranks exist)
        self.step = 0
        self.weight_version = 0

    def due(self, step: int) -> bool:
        """Whether a checkpoint is due after `step` finished steps (the loop asks once per
        step)."""
        self.step = step
        return self.every is not None and step % self.every == 0

    def stage(self, step: int, weight_version: int, position: Position | None = None
              ) -> Staged:
        """Write checkpoint `step` (the models' files and the state beside them), to be
        committed by the caller. `position`: the sources' position when the caller knows it
        better than `self.position`."""
        self.weight_version = weight_version
        drawn = position or self.position(step)
        state = TrainerState(step=step, weight_version=weight_version, data=drawn.data,
                             sft_data=drawn.sft_data)
        return stage(self.root, step, state, self._write_models, keep=self.keep)

    def save(self, step: int, weight_version: int, position: Position | None = None) -> str:
        """Checkpoint `step`, committed."""
        return str(self.stage(step, weight_version, position).commit())

    def _write_models(self, dir: str) -> None:
        for models in self.models:
            models.save(dir)

    def unsaved(self) -> bool:
        """Whether steps were trained since the newest checkpoint on disk."""
        newest = latest(self.root)
        return self.step > 0 and (newest is None or newest[0] < self.step)

    def resume(self) -> tuple[TrainerState, Path] | None:
        """Load the newest complete checkpoint into the models; its state and directory (None:
        there is none, a new run)."""
        clear_leftovers(self.root)  # (a killed run's save: never loaded, deleted here)
        found = latest(self.root)
        if found is None:
            return None
        path = found[1]
        for models in self.models:
            models.load(str(path))
        state = TrainerState.read(path)
        self.step, self.weight_version = state.step, state.weight_version
        return state, path


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{STEP_PREFIX}{step}"


def complete(root: str | Path) -> list[tuple[int, Path]]:
    """Every complete checkpoint under ``root``, oldest step first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = []
    for entry in base.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and (entry / COMPLETE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest(root: str | Path) -> tuple[int, Path] | None:
    """``(step, dir)`` of the newest complete checkpoint, or None; incomplete ones are
    ignored."""
    found = complete(root)
    return found[-1] if found else None


class Staged:
    """A checkpoint written but not yet the newest: ``commit`` makes it ``step_<N>`` (and
    prunes), ``discard`` deletes it. Its lease is renewed until then."""

    def __init__(self, root: Path, step: int, dir: Path, lease: Lease, keep: int) -> None:
        self.root, self.step, self.dir, self.keep = root, step, dir, keep
        self._lease: Lease | None = lease

    def commit(self) -> Path:
        """Rename it to ``step_<N>``, then prune to the newest ``keep``; the final directory."""
        self._release()
        final = _commit(self.dir, step_dir(self.root, self.step))
        prune(self.root, self.keep)
        return final

    def discard(self) -> None:
        self._release()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _release(self) -> None:
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def stage(root: str | Path, step: int, state: TrainerState, write: Callable[[str], None],
          *, keep: int) -> Staged:
    """Write checkpoint ``step`` into a staging directory, marker last (see the module's
    docstring); ``Staged.commit`` makes it the newest.

    ``write(dir)`` writes the backend's files into ``dir`` (all ranks, e.g.
    ``TrainGroup.save``) and returns when they are all on disk. Committing a step that
    already exists replaces it. ``keep``: how many checkpoints the commit leaves.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    clear_leftovers(base)  # saves a crash interrupted
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{step}.", dir=base))
    lease = None
    try:
        lease = Lease(staging)
        write(str(staging))
        delay = float(os.environ.get(SAVE_DELAY_ENV) or 0)
        if delay > 0:  # (tests: time to kill a run inside a save)
            time.sleep(delay)
        state.write(staging)
        _write_json(staging / COMPLETE, {"step": step, "time": time.time()})
    except BaseException:
        if lease is not None:
            lease.release()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Staged(base, step, staging, lease, keep)


def save(root: str | Path, step: int, state: TrainerState, write: Callable[[str], None],
         *, keep: int) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep`` (``stage``,
    then commit). Returns the final ``step_<N>`` directory."""
    return stage(root, step, state, write, keep=keep).commit()


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns what was deleted.

    Incomplete ``step_<N>`` directories are left alone: this module did not make them
    (its own saves appear only whole), so they may be someone's manual copy in progress.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    doomed = [path for _, path in complete(root)[:-keep]]
    for path in doomed:
        _delete(path)
    return doomed


def clear_leftovers(root: str | Path) -> None:
    """Tidy what saves and prunings cut short left under ``root`` (never a save another
    process still makes: writer.abandoned): a ``.replaced`` checkpoint whose replacement
    never landed goes back to ``step_<N>``; abandoned staging directories, other
    ``.replaced`` ones, half-pruned checkpoints and storage_now's files are deleted."""
    base = Path(root)
    if not base.is_dir():
        return
    me, now = Writer.this_process(), None
    entries = sorted(base.iterdir())
    for entry in entries:
        if entry.name.startswith(CLOCK_PREFIX) and entry.is_file():
            entry.unlink(missing_ok=True)
            continue
        if not entry.is_dir():
            continue
        if entry.name.startswith(DELETING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)
            continue
        match = _STAGING_DIR.match(entry.name)
        if match is None:
            continue
        if match.group(2) == REPLACED_SUFFIX[1:]:
            final = step_dir(base, int(match.group(1)))
            if not final.exists() and (entry / COMPLETE).is_file():
                _put_back(entry, final)
            elif final.exists():
                _delete(entry)
            continue
        now = storage_now(base) if now is None else now
        if abandoned(entry, me=me, now=now):
            _delete(entry)


def _put_back(replaced: Path, final: Path) -> None:
    """A commit cut short between its two renames: the old ``step_<N>`` back, unless a save
    of that step is still in progress (it will land)."""
    step = final.name.removeprefix(STEP_PREFIX)
    for entry in final.parent.iterdir():
        match = _STAGING_DIR.match(entry.name)
        if (match and match.group(1) == step and entry != replaced
                and not abandoned(entry)):
            return
    with contextlib.suppress(OSError):  # (another process put it back first)
        os.rename(replaced, final)


def _delete(path: Path) -> None:
    """Rename ``path`` out of the way first (atomic: a checkpoint is never half there), then
    delete it; a deletion cut short leaves a ``.deleting.`` directory, removed later."""
    try:
        doomed = Path(tempfile.mkdtemp(prefix=DELETING_PREFIX, dir=path.parent))
        os.rename(path, doomed / path.name)
    except OSError:  # (gone already: another process's clean-up)
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _commit(staging: Path, final: Path) -> Path:
    """Rename ``staging`` to ``final``; an existing ``final`` is moved aside first (a
    directory rename cannot replace a non-empty directory) and deleted after (put back by
    ``clear_leftovers`` if the process dies in between)."""
    _fsync_dir(staging)
    old = None
    if final.exists():
        old = final.with_name(f"{STAGING_PREFIX}{final.name.removeprefix(STEP_PREFIX)}"
                              f"{REPLACED_SUFFIX}")
        if old.exists():
            _delete(old)
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        _delete(old)
    return final


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    """Persist a directory's entries (the rename) where the OS allows it; best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
