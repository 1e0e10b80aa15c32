"""PromptSource: reading, validation messages, seeded per-epoch order, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kuberl_trainer.rollout.prompts import DataError, PromptSource, Sample

ROWS = [{"prompt": f"q{i}", "label": str(i)} for i in range(8)]


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    return _jsonl(tmp_path / "prompts.jsonl", ROWS)


def _source(path: Path, seed: int = 0, **keys: str) -> PromptSource:
    return PromptSource(path, keys.get("input_key", "prompt"), keys.get("label_key", "label"),
                        seed=seed)


def test_order_is_pinned_for_seed_0(prompts: Path) -> None:
    # A golden: resumed runs depend on the order being a stable function of (seed, epoch);
    # a change to the shuffle must show up here, not as silently different data after resume.
    source = _source(prompts)
    first = source.next_batch(8)
    assert [s.index for s in first] == [6, 0, 2, 5, 4, 7, 1, 3]
    assert [s.index for s in source.next_batch(8)] == [6, 0, 2, 7, 5, 1, 4, 3]
    assert first[0] == Sample(prompt="q6", label="6", index=6, epoch=0)


def test_each_epoch_is_a_permutation_and_batches_wrap(prompts: Path) -> None:
    # 8 rows in batches of 3: 3 + 3 + (2 of epoch 0, 1 of epoch 1).
    source = _source(prompts, seed=7)
    batches = [source.next_batch(3) for _ in range(3)]
    assert [s.epoch for s in batches[2]] == [0, 0, 1]
    epoch0 = [s.index for b in batches for s in b if s.epoch == 0]
    assert sorted(epoch0) == list(range(8))
    assert source.state_dict() == {"epoch": 1, "position": 1, "seed": 7}
    assert all(s.prompt == f"q{s.index}" and s.label == str(s.index) for b in batches for s in b)


def test_batch_larger_than_the_file_spans_epochs(prompts: Path) -> None:
    batch = _source(prompts).next_batch(20)  # 8 + 8 + 4
    assert [s.epoch for s in batch] == [0] * 8 + [1] * 8 + [2] * 4


def test_same_seed_same_order_other_seed_other_order(prompts: Path) -> None:
    def order(seed: int) -> list[int]:
        return [s.index for s in _source(prompts, seed=seed).next_batch(16)]

    assert order(3) == order(3)
    assert order(3) != order(4)
    # (seed, epoch) is hashed as a pair: seed 1's epoch 0 is not seed 0's epoch 1.
    assert order(1)[:8] != order(0)[8:]


def test_state_round_trip_replays_the_same_batches(prompts: Path) -> None:
    source = _source(prompts, seed=11)
    source.next_batch(5)
    state = json.loads(json.dumps(source.state_dict()))  # survives a checkpoint file
    assert set(state) == {"epoch", "position", "seed"}
    expected = [source.next_batch(3) for _ in range(6)]
    resumed = _source(prompts, seed=999)  # the saved seed wins
    resumed.load_state_dict(state)
    assert [resumed.next_batch(3) for _ in range(6)] == expected


def test_load_state_dict_rejects_bad_state(prompts: Path) -> None:
    source = _source(prompts)
    with pytest.raises(ValueError, match="need integer epoch, position and seed"):
        source.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match=r"position must be within 0\.\.8"):
        source.load_state_dict({"epoch": 0, "position": 9, "seed": 0})


def test_next_batch_rejects_nonpositive(prompts: Path) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        _source(prompts).next_batch(0)


def test_custom_keys_numeric_labels_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "1+1?", "answer": 2, "extra": true}\n\n'
                    '{"question": "2+2?", "answer": "4"}\n')
    source = _source(path, input_key="question", label_key="answer")
    source.check()
    assert len(source) == 2
    by_index = {s.index: s for s in source.next_batch(2)}
    assert by_index[0].label == "2" and by_index[1].label == "4"  # JSON number -> text


def test_parquet_matches_jsonl(tmp_path: Path, prompts: Path) -> None:
    path = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{**row, "extra": 1} for row in ROWS]), path)
    parquet, jsonl = _source(path, seed=5), _source(prompts, seed=5)
    parquet.check()
    assert parquet.next_batch(12) == jsonl.next_batch(12)


# --- check(): every message names the file and what is wrong -----------------------------


def _error(path: Path, **keys: str) -> str:
    with pytest.raises(DataError) as info:
        _source(path, **keys).check()
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)
    return str(info.value)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    assert "does not exist" in _error(tmp_path / "nope.jsonl")
    assert "is a directory" in _error(tmp_path)


@pytest.mark.parametrize("text", ["", "\n  \n"])
def test_empty_file(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(text)
    assert "is empty (no rows)" in _error(path)


def test_unreadable_files(tmp_path: Path) -> None:
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert "is unreadable" in _error(binary)
    fake = tmp_path / "fake.parquet"
    fake.write_text('{"prompt": "not parquet"}\n')
    assert "is unreadable as Parquet" in _error(fake)


def test_unsupported_extension(tmp_path: Path) -> None:
    path = tmp_path / "prompts.csv"
    path.write_text("prompt,label\nq,1\n")
    assert "unsupported extension '.csv'" in _error(path)


@pytest.mark.parametrize(("line", "message"), [
    ('{"prompt": "q"', "line 2: invalid JSON"),
    ('["q", "1"]', "line 2: expected a JSON object, got list"),
    ('{"prompt": "q"}', "line 2: missing key 'label' (keys present: 'prompt')"),
    ('{"label": "1"}', "line 2: missing key 'prompt' (keys present: 'label')"),
    ('{"prompt": "q", "label": null}', "line 2: key 'label' is null"),
    ('{"prompt": ["chat"], "label": "1"}', "line 2: 'prompt' must be a string, got list"),
])
def test_bad_jsonl_row(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "label": "1"}\n' + line + "\n")
    assert message in _error(path)


def test_bad_row_with_custom_keys(prompts: Path) -> None:
    # The configured key is named, not the default.
    assert "line 1: missing key 'question'" in _error(prompts, input_key="question")


def test_bad_parquet(tmp_path: Path) -> None:
    no_label = tmp_path / "no_label.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "q"}]), no_label)
    assert "missing key 'label' (no such column; columns present: 'prompt')" in _error(no_label)
    null_label = tmp_path / "null_label.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "label": "1"},
                                         {"prompt": "r", "label": None}]), null_label)
    assert "row 1: key 'label' is null" in _error(null_label)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()),
                             "label": pa.array([], pa.string())}), empty)
    assert "is empty (no rows)" in _error(empty)


def test_metadata_keys_are_copied_into_each_sample(tmp_path: Path) -> None:
    rows = [{"prompt": f"q{i}", "label": str(i), "level": i % 3, "tools": ["calc"] if i else [],
             "unused": "x"} for i in range(4)]
    source = PromptSource(_jsonl(tmp_path / "p.jsonl", rows), "prompt", "label", seed=0,
                          metadata_keys=["level", "tools"])
    drawn = source.next_batch(4) + source.samples()
    assert all(s.metadata == {"level": s.index % 3, "tools": ["calc"] if s.index else []}
               for s in drawn)  # as the file has them (a number stays a number), nothing else
    assert drawn[0] == Sample(drawn[0].prompt, drawn[0].label, drawn[0].index, 0)  # (not keyed)
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, tmp_path / "p.parquet")
    parquet = PromptSource(tmp_path / "p.parquet", "prompt", "label", seed=0,
                           metadata_keys=["level"]).samples()
    assert [s.metadata for s in parquet] == [{"level": i % 3} for i in range(4)]
    assert _source(tmp_path / "p.parquet").samples()[1].metadata == {}  # none asked for


def test_a_missing_metadata_key_names_the_file_the_row_and_the_key(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "label": "1", "level": 1},
                                         {"prompt": "b", "label": "2"}])
    source = PromptSource(path, "prompt", "label", seed=0, metadata_keys=["level"])
    with pytest.raises(DataError, match=rf"^prompt file {path}, line 2: missing key 'level' "
                                        r"of data.metadataKeys \(keys present: 'prompt', "):
        source.check()
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "label": "1"}]), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"p.parquet: missing key 'level' \(no such column"):
        PromptSource(tmp_path / "p.parquet", "prompt", "label", seed=0,
                     metadata_keys=["level"]).check()
