"""Prompts for rollouts: a JSONL or Parquet file, shuffled per epoch, resumable.

The whole file is read into memory once (prompt sets are thousands to millions of short rows,
well within the head pod's memory); that keeps the order a pure function of (seed, epoch) and
lets `check()` report a bad row before any GPU is allocated.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
_Row = tuple[str, str, dict[str, Any]]  # a row's prompt, label and metadata


class DataError(ValueError):
    """The prompt file cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Sample:
    """One prompt as handed to rollout: ``index`` is its row in the file (0-based, blank
    JSONL lines not counted) and ``epoch`` the pass over the file it was drawn in;
    ``metadata``: the row's data.metadataKeys columns, as the file has them (for a rollout
    function and an environment)."""

    prompt: str
    label: str
    index: int
    epoch: int
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)


class PromptSource:
    """Endless stream of prompts: each epoch is a seeded permutation of the file's rows.

    The order of epoch ``e`` depends only on ``(seed, e)``, so ``state_dict()`` needs only
    the epoch and the position within it for a resumed run to draw exactly the same prompts.
    """

    def __init__(self, path: str | Path, input_key: str, label_key: str, *, seed: int,
                 metadata_keys: Sequence[str] = ()) -> None:
        self.path = Path(path)
        self.input_key = input_key
        self.label_key = label_key
        self.metadata_keys = tuple(metadata_keys)
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._rows: list[_Row] | None = None
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) cache

    def check(self) -> None:
        """Read and validate the whole file; raises `DataError` on the first problem."""
        self._load()

    def __len__(self) -> int:
        return len(self._load())

    def next_batch(self, n: int) -> list[Sample]:
        """The next ``n`` prompts; crossing the end of an epoch continues into the next one
        (a fresh permutation), so a batch may hold samples of two (or more) epochs."""
        if n < 1:
            raise ValueError(f"batch size must be >= 1, got {n}")
        rows = self._load()
        batch: list[Sample] = []
        while len(batch) < n:
            if self.position == len(rows):
                self.epoch, self.position = self.epoch + 1, 0
            order = self._permutation(self.epoch)
            index = order[self.position]
            prompt, label, metadata = rows[index]
            batch.append(Sample(prompt, label, index, self.epoch, dict(metadata)))
            self.position += 1
        return batch

    def samples(self) -> list[Sample]:
        """Every row once, in file order (for evaluation sets)."""
        return [Sample(prompt, label, i, 0, dict(metadata))
                for i, (prompt, label, metadata) in enumerate(self._load())]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume where `state_dict()` left off. The saved seed wins over the constructor's:
        the point is to replay the original run's order."""
        try:
            epoch, position, seed = int(state["epoch"]), int(state["position"]), int(state["seed"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"bad PromptSource state {state!r}: need integer epoch, "
                             "position and seed") from exc
        size = len(self._load())
        if epoch < 0 or not 0 <= position <= size:
            raise ValueError(f"bad PromptSource state {state!r}: position must be within "
                             f"0..{size} (rows in {self.path}) and epoch >= 0")
        self.epoch, self.position, self.seed = epoch, position, seed
        self._order = None

    def _permutation(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self._load())))
            # A string seed is hashed with SHA-512 by random.seed (not Python's randomised
            # hash), so it is stable across processes; (seed, epoch) pairs never collide the
            # way seed + epoch would (seed 1 epoch 0 == seed 0 epoch 1).
            random.Random(f"kuberl:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def _load(self) -> list[_Row]:
        if self._rows is None:
            self._rows = self._validated(self._read_records())
        return self._rows

    def _read_records(self) -> list[tuple[str, dict[str, Any]]]:
        """``(where, record)`` pairs; ``where`` says "line N" or "row N" for messages."""
        if not self.path.is_file():
            what = "is a directory" if self.path.is_dir() else "does not exist"
            raise DataError(f"prompt file {self.path} {what}")
        suffix = self.path.suffix.lower()
        if suffix in JSONL_SUFFIXES:
            return _read_jsonl(self.path)
        if suffix in PARQUET_SUFFIXES:
            return _read_parquet(self.path, (self.input_key, self.label_key,
                                             *self.metadata_keys))
        raise DataError(f"prompt file {self.path}: unsupported extension {suffix!r}; expected "
                        f"one of {', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")

    def _validated(self, records: list[tuple[str, dict[str, Any]]]) -> list[_Row]:
        if not records:
            raise DataError(f"prompt file {self.path} is empty (no rows)")
        return [self._row(where, record) for where, record in records]

    def _row(self, where: str, record: dict[str, Any]) -> _Row:
        present = ', '.join(map(repr, record)) or 'none'
        for key in (self.input_key, self.label_key):
            if key not in record:
                raise DataError(f"prompt file {self.path}, {where}: missing key {key!r} "
                                f"(keys present: {present})")
            if record[key] is None:
                raise DataError(f"prompt file {self.path}, {where}: key {key!r} is null")
        prompt = record[self.input_key]
        if not isinstance(prompt, str):
            raise DataError(f"prompt file {self.path}, {where}: {self.input_key!r} must be a "
                            f"string, got {type(prompt).__name__}")
        missing = [key for key in self.metadata_keys if key not in record]
        if missing:
            raise DataError(f"prompt file {self.path}, {where}: missing key {missing[0]!r} "
                            f"of data.metadataKeys (keys present: {present})")
        # Labels are often numbers in the file ({"label": 42}); rewards compare text.
        return (prompt, _label_text(record[self.label_key]),
                {key: record[key] for key in self.metadata_keys})


def _label_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _read_jsonl(path: Path) -> list[tuple[str, dict[str, Any]]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"prompt file {path} is unreadable: {exc}") from exc
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"prompt file {path}, line {number}: invalid JSON ({exc})") from exc
        if not isinstance(record, dict):
            raise DataError(f"prompt file {path}, line {number}: expected a JSON object, got "
                            f"{type(record).__name__}")
        records.append((f"line {number}", record))
    return records


def _read_parquet(path: Path, keys: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    # Imported here: pyarrow is a trainer extra, and JSONL-only users (tests, the CLI's
    # config check) should not pay for it.
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        missing = [key for key in keys if key not in names]
        if missing:
            # A missing column is missing from every row; naming the column says more.
            raise DataError(f"prompt file {path}: missing key {missing[0]!r} (no such column; "
                            f"columns present: {', '.join(map(repr, names)) or 'none'})")
        table = pq.read_table(path, columns=list(dict.fromkeys(keys)))
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"prompt file {path} is unreadable as Parquet: {exc}") from exc
    return [(f"row {i}", record) for i, record in enumerate(table.to_pylist())]
