"""Checkpoint directories: atomic completion, discovery of the latest, pruning, and what a
save or a pruning killed at any moment leaves (never loaded; cleared unless still written)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kuberl_trainer import checkpoint as ckpt
from kuberl_trainer.checkpoint.writer import STALE_AFTER_S, WRITER, Lease, Writer


def write_weights(dir: str) -> None:
    (Path(dir) / "weights.bin").write_bytes(b"w" * 16)


def save(root: Path, step: int, keep: int = 10) -> Path:
    state = ckpt.TrainerState(step=step, data={"epoch": 0, "position": step * 4, "seed": 1},
                              weight_version=step, metrics={"reward_mean": 0.5})
    return ckpt.save(root, step, state, write_weights, keep=keep)


def test_save_writes_state_backend_files_and_marker(tmp_path: Path) -> None:
    path = save(tmp_path, 3)
    assert path == tmp_path / "step_3"
    assert (path / ckpt.COMPLETE).is_file() and (path / "weights.bin").is_file()
    state = ckpt.TrainerState.read(path)
    assert state == ckpt.TrainerState(step=3, data={"epoch": 0, "position": 12, "seed": 1},
                                      weight_version=3, metrics={"reward_mean": 0.5})
    assert ckpt.latest(tmp_path) == (3, path)
    assert [p.name for p in tmp_path.iterdir()] == ["step_3"]  # no staging left behind


def test_latest_ignores_incomplete_and_staging_dirs(tmp_path: Path) -> None:
    assert ckpt.latest(tmp_path / "missing") is None
    save(tmp_path, 2)
    (tmp_path / "step_9").mkdir()                 # no COMPLETE marker
    (tmp_path / ".step_7.abc").mkdir()            # a save that never finished
    (tmp_path / ".step_7.abc" / ckpt.COMPLETE).touch()
    (tmp_path / "step_x").mkdir()                 # not a step directory
    (tmp_path / "step_10").write_text("a file, not a directory")
    assert ckpt.latest(tmp_path) == (2, tmp_path / "step_2")


def test_latest_orders_steps_numerically(tmp_path: Path) -> None:
    for step in (9, 10, 2):
        save(tmp_path, step)
    assert ckpt.latest(tmp_path) == (10, tmp_path / "step_10")


def test_prune_keeps_the_newest_n(tmp_path: Path) -> None:
    for step in range(1, 6):
        save(tmp_path, step, keep=2)
    assert [s for s, _ in ckpt.complete(tmp_path)] == [4, 5]
    (tmp_path / "step_0").mkdir()  # incomplete: not this module's to delete
    assert ckpt.prune(tmp_path, 1) == [tmp_path / "step_4"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0", "step_5"]
    with pytest.raises(ValueError):
        ckpt.prune(tmp_path, 0)


def test_failed_save_leaves_no_trace_and_latest_unchanged(tmp_path: Path) -> None:
    save(tmp_path, 1)

    def crash(dir: str) -> None:
        write_weights(dir)
        # While the backend writes, the step is invisible: only the staging dir exists.
        assert not (tmp_path / "step_2").exists()
        assert ckpt.latest(tmp_path) == (1, tmp_path / "step_1")
        raise RuntimeError("rank 1 died")

    with pytest.raises(RuntimeError, match="rank 1 died"):
        ckpt.save(tmp_path, 2, ckpt.TrainerState(step=2), crash, keep=2)
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]


def test_leftover_staging_is_cleaned_and_a_step_can_be_saved_again(tmp_path: Path) -> None:
    leftover(tmp_path, ".step_4.dead", dead_writer())  # a crash mid-save, before a restart
    save(tmp_path, 4)
    (tmp_path / "step_4" / "stale").touch()
    again = ckpt.save(tmp_path, 4, ckpt.TrainerState(step=4, weight_version=7),
                      write_weights, keep=2)
    assert not (again / "stale").exists()
    assert ckpt.TrainerState.read(again).weight_version == 7
    assert [p.name for p in tmp_path.iterdir()] == ["step_4"]


def test_a_staged_checkpoint_is_invisible_until_committed(tmp_path: Path) -> None:
    """The loops stage a checkpoint after training and commit it once the step's row is
    written: a run killed in between resumes from the checkpoint before."""
    save(tmp_path, 2)
    staged = ckpt.stage(tmp_path, 4, ckpt.TrainerState(step=4), write_weights, keep=2)
    assert (staged.dir / ckpt.COMPLETE).is_file()  # whole, marker and all, but hidden
    assert ckpt.latest(tmp_path) == (2, tmp_path / "step_2")
    assert staged.commit() == tmp_path / "step_4"
    assert ckpt.latest(tmp_path) == (4, tmp_path / "step_4")
    staged = ckpt.stage(tmp_path, 6, ckpt.TrainerState(step=6), write_weights, keep=2)
    staged.discard()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4"]


def test_the_save_delay_switch_holds_a_save_open_before_its_marker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ckpt.SAVE_DELAY_ENV, "0.3")
    began = time.monotonic()
    save(tmp_path, 1)
    assert time.monotonic() - began >= 0.3


def dead_writer() -> Writer:
    """A process of this machine that has exited."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return replace(Writer.this_process(), pid=child.pid, started=None)


def leftover(root: Path, name: str, writer: Writer | None, age_s: float = 0.0,
             marked: bool = True) -> Path:
    """A staging directory as a save leaves it: the backend's files, the marker, and the
    WRITER file `age_s` seconds old (none for None)."""
    path = root / name
    (path / "model").mkdir(parents=True)
    (path / "model" / "weights.bin").write_bytes(b"w")
    if marked:
        (path / ckpt.COMPLETE).write_text("{}")
    if writer is not None:
        (path / WRITER).write_text(json.dumps(asdict(writer)))
    for entry in (path / WRITER, path):
        if entry.exists():
            then = time.time() - age_s
            os.utime(entry, (then, then))
    return path


def test_leftovers_of_killed_saves_go_and_live_saves_stay(tmp_path: Path) -> None:
    """What a resumed run (and every save) clears: a staging directory whose writer on this
    machine is gone, or whose writer elsewhere stopped renewing its lease; never the save in
    progress of another process on this machine or on another one (a stalled attempt's head
    saving in its grace period beside the next attempt's, on a shared volume)."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = Writer.this_process()
        live_here = replace(here, pid=sleeper.pid, started=None)
        elsewhere = replace(here, host="head-of-attempt-1", pid_ns="pid:[1]")
        save(tmp_path, 2)
        gone = [leftover(tmp_path, ".step_4.killed", dead_writer()),
                leftover(tmp_path, ".step_4.mine", here),  # this process gave it up
                leftover(tmp_path, ".step_4.lapsed", elsewhere, age_s=STALE_AFTER_S + 60),
                leftover(tmp_path, ".step_4.unnamed", None, age_s=STALE_AFTER_S + 60,
                         marked=False),
                leftover(tmp_path, ".deleting.abc", None)]
        (tmp_path / ".clock.abc").touch()  # (storage_now's, a kill before its unlink)
        kept = [leftover(tmp_path, ".step_4.running", live_here, age_s=STALE_AFTER_S + 60),
                leftover(tmp_path, ".step_4.remote", elsewhere, age_s=60),
                leftover(tmp_path, ".step_4.starting", None, age_s=60, marked=False)]
        ckpt.clear_leftovers(tmp_path)
        assert [p for p in gone if p.exists()] == []
        assert [p for p in kept if p.exists()] == kept
        assert ckpt.latest(tmp_path) == (2, tmp_path / "step_2")  # never a hidden one
        assert {p.name for p in tmp_path.iterdir()} == {"step_2", *(p.name for p in kept)}
    finally:
        sleeper.kill()
        sleeper.wait()
    ckpt.clear_leftovers(tmp_path)  # its writer gone now
    assert not (tmp_path / ".step_4.running").exists()


def test_resume_clears_leftovers_before_it_loads(tmp_path: Path) -> None:
    save(tmp_path, 2)
    leftover(tmp_path, ".step_4.killed", dead_writer())
    checkpointer = ckpt.Checkpointer(tmp_path, 2, 2, lambda step: pytest.fail("no save"))
    resumed = checkpointer.resume()
    assert resumed is not None and resumed[1] == tmp_path / "step_2"
    assert [p.name for p in tmp_path.iterdir()] == ["step_2"]


def test_a_replacement_cut_short_puts_the_old_checkpoint_back(tmp_path: Path) -> None:
    """A save of a step that exists moves the old one aside first; killed before its own
    rename, the old one comes back, never lost and never replaced by a half-written one."""
    save(tmp_path, 2)
    save(tmp_path, 4)
    os.rename(tmp_path / "step_4", tmp_path / ".step_4.replaced")
    leftover(tmp_path, ".step_4.killed", dead_writer())  # the replacement, not yet renamed
    ckpt.clear_leftovers(tmp_path)
    assert ckpt.latest(tmp_path) == (4, tmp_path / "step_4")
    assert (tmp_path / "step_4" / "weights.bin").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_4"]
    # Killed after its rename, before deleting the old one: the old one goes.
    os.rename(tmp_path / "step_2", tmp_path / ".step_4.replaced")
    ckpt.clear_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_4"]


def test_pruning_renames_a_checkpoint_away_before_deleting_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pruning killed mid-deletion leaves a hidden directory, never a half-deleted step_<N>
    (which nothing would ever delete: incomplete step directories are left alone)."""
    for step in (1, 2):
        save(tmp_path, step)

    def killed(path: Path, ignore_errors: bool = False) -> None:
        raise KeyboardInterrupt  # (as far as the directory's state goes: a kill)

    monkeypatch.setattr(shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt.prune(tmp_path, 1)
    monkeypatch.undo()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[1:] == ["step_2"] and names[0].startswith(ckpt.DELETING_PREFIX)
    ckpt.clear_leftovers(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["step_2"]


def test_an_open_save_renews_its_lease(tmp_path: Path) -> None:
    staging = tmp_path / ".step_1.x"
    staging.mkdir()
    lease = Lease(staging, renew_s=0.05)
    try:
        os.utime(staging / WRITER, (0, 0))
        deadline = time.monotonic() + 10
        while (staging / WRITER).stat().st_mtime == 0:
            assert time.monotonic() < deadline, "the lease was not renewed"
            time.sleep(0.01)
    finally:
        lease.release()
    written = json.loads((staging / WRITER).read_text())
    assert written["pid"] == os.getpid() and written["host"]
