"""Group named tensors into size-bounded buckets for weight sync."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from torch import Tensor


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def bucketize(named: Iterable[tuple[str, Tensor]],
              bucket_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Consecutive runs of ``named`` whose sizes sum to at most ``bucket_bytes``.

    Greedy in input order (the receiver loads in the same order). A tensor larger than the
    limit on its own goes out alone: splitting one tensor across buckets would need a
    reassembly protocol on the engine side for no gain in peak memory.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, tensor in named:
        n = nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket
