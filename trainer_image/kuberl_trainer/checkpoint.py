"""Checkpoint directories: layout, atomic completion, discovery and pruning.

Layout under the job's checkpoint path (``spec.checkpoint.path``, or ``--output-dir``)::

    <root>/step_<N>/            one complete checkpoint, N = finished training steps
        COMPLETE                marker, written last (JSON: step, time)
        trainer_state.json      TrainerState: step, data source position, weight version
        ...                     the backend's files (model/, optimizer.pt, rng_rank<r>.pt)
    <root>/.step_<N>.<random>/  a save in progress (or one a crash interrupted)

A save writes everything into a hidden staging directory, then renames it to ``step_<N>``.
The rename is atomic on one filesystem, so ``step_<N>`` is either absent or whole; the marker
guards the cases a rename cannot (a directory copied by other means, a filesystem without
atomic rename): ``latest`` trusts only ``step_<N>`` directories that hold it.

All training ranks write into the same staging directory, so it must be on storage they all
see (the checkpoint PVC in a cluster). This module never talks to other ranks: the caller's
``write`` function returns once every rank's files are written.

``Checkpointer`` is a run's use of them: when one is due, what goes in it, what a resumed run
reads back.
"""

from __future__ import annotations

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

STEP_PREFIX = "step_"
STAGING_PREFIX = ".step_"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")


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

    def save(self, step: int, weight_version: int, position: Position | None = None) -> str:
        """Checkpoint `step`: the models' files and the state beside them. `position`: the
        sources' position when the caller knows it better than `self.position`."""
        self.weight_version = weight_version
        drawn = position or self.position(step)
        state = TrainerState(step=step, weight_version=weight_version, data=drawn.data,
                             sft_data=drawn.sft_data)
        return str(save(self.root, step, state, self._write_models, keep=self.keep))

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


def save(root: str | Path, step: int, state: TrainerState, write: Callable[[str], None],
         *, keep: int) -> Path:
    """Write checkpoint ``step`` atomically, then prune to the newest ``keep``.

    ``write(dir)`` writes the backend's files into ``dir`` (all ranks, e.g.
    ``TrainGroup.save``) and returns when they are all on disk. Saving a step that already
    exists replaces it. Returns the final ``step_<N>`` directory.
    """
    base = Path(root)
    base.mkdir(parents=True, exist_ok=True)
    _remove_staging(base)  # leftovers of saves a crash interrupted
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{step}.", dir=base))
    try:
        write(str(staging))
        state.write(staging)
        _write_json(staging / COMPLETE, {"step": step, "time": time.time()})
        final = _commit(staging, step_dir(base, step))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    prune(base, keep)
    return final


def prune(root: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints; returns what was deleted.

    Incomplete ``step_<N>`` directories are left alone: this module did not make them
    (its own saves appear only whole), so they may be someone's manual copy in progress.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    doomed = [path for _, path in complete(root)[:-keep]]
    for path in doomed:
        # Un-mark first: a deletion cut short must not leave a half-deleted "complete" dir.
        (path / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(path)
    return doomed


def _commit(staging: Path, final: Path) -> Path:
    """Rename ``staging`` to ``final``; an existing ``final`` is moved aside first (a
    directory rename cannot replace a non-empty directory) and deleted after."""
    _fsync_dir(staging)
    old = None
    if final.exists():
        old = final.with_name(f"{STAGING_PREFIX}{final.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _remove_staging(base: Path) -> None:
    for entry in base.iterdir():
        if entry.name.startswith(STAGING_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)


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
