"""Checkpoint directories: atomic completion, discovery of the latest, pruning."""

from __future__ import annotations

from pathlib import Path

import pytest

from kuberl_trainer import checkpoint as ckpt


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
    (tmp_path / ".step_4.dead").mkdir(parents=True)   # a crash mid-save, before a restart
    save(tmp_path, 4)
    (tmp_path / "step_4" / "stale").touch()
    again = ckpt.save(tmp_path, 4, ckpt.TrainerState(step=4, weight_version=7),
                      write_weights, keep=2)
    assert not (again / "stale").exists()
    assert ckpt.TrainerState.read(again).weight_version == 7
    assert [p.name for p in tmp_path.iterdir()] == ["step_4"]
