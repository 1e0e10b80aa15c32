"""Which trainer rank feeds which engine TP rank in a colocated update (pure).

A colocated engine's TP rank r reads entry r of `serialized_named_tensors`: CUDA IPC handles it
can only open for tensors on its own GPU. Every trainer rank holds the full weights of a bucket
on its GPU while the bucket is exported, so the entry for (engine, r) comes from the trainer rank
on that engine's r-th GPU. GPUs are named by (node IP, node-local GPU index): what Ray reports
for a trainer actor (`ray.get_gpu_ids()`) and what the engine was given
(`placement.colocated_engine_devices`).
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

Gpu = tuple[str, int]  # (node IP, node-local GPU index)


def engine_gpus(urls: Sequence[str], devices: Sequence[Sequence[int]]) -> list[list[Gpu]]:
    """Each engine's GPUs in TP rank order: its URL's host (the node it serves on) and the
    node-local GPUs it was given."""
    return [[(str(urlsplit(url).hostname), d) for d in devs]
            for url, devs in zip(urls, devices, strict=True)]


def colocated_sources(trainer_gpus: Sequence[Gpu],
                      engines: Sequence[Sequence[Gpu]]) -> list[list[int]]:
    """For engine e's TP rank r, the trainer rank on the same GPU: ``sources[e][r]``.
    ValueError naming the engine and GPU when no trainer rank is there (the placement broke
    colocation: that engine would read handles it cannot open)."""
    by_gpu: dict[Gpu, int] = {}
    for rank, gpu in enumerate(trainer_gpus):
        by_gpu.setdefault(gpu, rank)
    sources = []
    for e, gpus in enumerate(engines):
        missing = [g for g in gpus if g not in by_gpu]
        if missing:
            raise ValueError(
                f"colocated engine {e} runs on {missing[0][0]} GPU {missing[0][1]}, where no "
                f"training rank runs (training ranks' GPUs: {sorted(by_gpu)}); a colocated "
                "engine must share its GPUs with training ranks")
        sources.append([by_gpu[g] for g in gpus])
    return sources
