"""Bucket planning for weight sync: pure, no torch.

A bucket is what one `/update_weights_from_distributed` call announces and the trainer then
broadcasts. Buckets bound the memory an engine allocates per call and the size of the HTTP
body; fewer, larger buckets mean fewer round trips. Order is preserved (the broadcast order must
equal the announced order), and a tensor larger than the limit gets a bucket of its own rather
than being split (engines receive whole named tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def iter_buckets(items: Iterable[T], nbytes: Callable[[T], int],
                 bucket_bytes: int) -> Iterator[list[T]]:
    """Greedy, order-preserving, streaming: yields a bucket as soon as the next item would
    overflow it, so a generator of tensors is never materialised whole."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[T] = []
    used = 0
    for item in items:
        size = nbytes(item)
        if size < 0:
            raise ValueError(f"negative size {size} for {item!r}")
        if bucket and used + size > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        bucket.append(item)
        used += size
    if bucket:
        yield bucket


def plan_buckets(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[TensorMeta]]:
    names = [m.name for m in metas]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate tensor names: {dupes}")
    return list(iter_buckets(metas, lambda m: m.nbytes, bucket_bytes))
