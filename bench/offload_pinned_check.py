"""The colocated offload's host memory: pinned at the data's size, not a power of two per storage.

backends/offload.py packs the kept storages into one host buffer of their summed sizes and pins
it with cudaHostRegister (backends/pinned_host.py). The old way, a `torch.empty(n,
pin_memory=True)` per storage, went through torch's pinned allocator, which rounds each request
up to a power of two: a 7B model's 272 MB MLP matrices took 512 MiB each.

This builds storages of awkward sizes on the device (by default 38 of the 7B MLP matrix's
271,581,184 bytes, just above 256 MiB, and a few odd ones: ~10 GiB), fills them with random
bytes, and runs two offload/onload cycles through `Offloads` (the values changed on the device
between them, so a stale host copy would show), then the same through the old per-storage
pinned buffers. Checks: every byte back, the storages freed while off, the second cycle reusing
the first's buffer, the buffer pinned (CUDA), host bytes held / data bytes <= 1.01. Prints a
table of both ways (host bytes pinned, seconds of each offload and onload) and exits 1 when a
check fails.

    python3 bench/offload_pinned_check.py                  # one GPU, ~10 GiB, ~1 min
    python3 bench/offload_pinned_check.py --device cpu     # no GPU: small sizes, no pinning

Never part of `make test`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "trainer_image") not in sys.path:
    sys.path.insert(0, str(ROOT / "trainer_image"))

from kuberl_trainer.backends.offload import Offloads, release_cached  # noqa: E402

GIB = float(1 << 30)
MLP_7B = 3584 * 18944  # elements of a Qwen2.5-7B MLP matrix: 271,581,184 bytes in float32
MAX_RATIO = 1.01


def build(device: torch.device, count: int) -> list[torch.Tensor]:
    """`count` float32 tensors of the 7B MLP matrix's size (1/1024 of it on CPU) and a few of
    odd byte counts, dtypes and sizes just above powers of two; random bytes."""
    big = MLP_7B if device.type == "cuda" else (1 << 16) + 1
    shapes = [(big, torch.float32)] * count + [
        ((1 << 20) + 1, torch.uint8), (4097, torch.uint8), (1, torch.uint8), (3, torch.uint8),
        ((1 << 21) + 3, torch.bfloat16), ((1 << 24) + 1, torch.float32)]
    out = []
    for numel, dtype in shapes:
        t = torch.empty(numel, dtype=dtype, device=device)
        raw = t.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=device))
        out.append(t)
    return out


def same_bits(tensors: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return all(torch.equal(t.view(torch.uint8), w)
               for t, w in zip(tensors, want, strict=True))


def change(tensors: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """New values on the device (every byte + 1), and in the expected copies."""
    for t, w in zip(tensors, want, strict=True):
        t.view(torch.uint8).add_(1)
        w.add_(1)


def allocator_pinned() -> int:
    """Bytes torch's pinned-memory allocator holds (rounded blocks, cached ones too)."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Any) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The bytes each way must bring back (taken anew per way: one way's loss is its own)."""
    return [t.view(torch.uint8).clone() for t in tensors]


def exact_way(tensors: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Two cycles through Offloads, as a backend's "weights" kind."""
    want = snapshot(tensors)
    parts = Offloads(device=None if device.type == "cuda" else device)
    out: dict[str, Any] = {"exact": True, "freed": True}
    before = allocator_pinned()
    buffer = None
    for cycle in (1, 2):
        if cycle == 2:
            change(tensors, want)
        out[f"offload_{cycle}_s"] = timed(device, lambda: parts.offload("weights", tensors))
        part = parts.active["weights"]
        out["freed"] &= all(t.untyped_storage().nbytes() == 0 for t in tensors)
        if cycle == 1:
            buffer = part.buffer
            out["host_bytes"] = 0 if buffer is None else buffer.nbytes
            out["pinned_bytes"] = parts.pinned_bytes
            out["buffer_pinned"] = buffer is not None and bool(buffer.tensor.is_pinned())
            out["allocator_added"] = allocator_pinned() - before
        else:
            out["reused"] = part.buffer is buffer
        out[f"onload_{cycle}_s"] = timed(device, parts.onload)
        out["exact"] &= same_bits(tensors, want)
    return out


def old_way(tensors: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """The same two cycles with a `torch.empty(n, pin_memory=True)` per storage, reused in the
    second cycle (what offload.py did before)."""
    want = snapshot(tensors)
    pin = device.type == "cuda"
    storages = [t.untyped_storage() for t in tensors]
    sizes = [s.nbytes() for s in storages]
    hosts: list[torch.Tensor] = []
    out: dict[str, Any] = {"exact": True}
    before = allocator_pinned()

    def view(s: torch.UntypedStorage) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8, device=device).set_(s)

    def offload() -> None:
        if not hosts:
            hosts.extend(torch.empty(n, dtype=torch.uint8, pin_memory=pin) for n in sizes)
        for s, h in zip(storages, hosts, strict=True):
            h.copy_(view(s), non_blocking=True)
        sync(device)
        for s in storages:
            s.resize_(0)
        release_cached()

    def onload() -> None:
        for s, h, n in zip(storages, hosts, sizes, strict=True):
            s.resize_(n)
            view(s).copy_(h, non_blocking=True)

    for cycle in (1, 2):
        if cycle == 2:
            change(tensors, want)
        out[f"offload_{cycle}_s"] = timed(device, offload)
        if cycle == 1:
            out["host_bytes"] = sum(h.numel() for h in hosts)
            rounded = sum(1 << (n - 1).bit_length() for n in sizes)  # PowerOf2Ceil
            out["pinned_bytes"] = allocator_pinned() - before if pin else 0
            out["pinned_computed"] = rounded if pin else 0
        out[f"onload_{cycle}_s"] = timed(device, onload)
        out["exact"] &= same_bits(tensors, want)
    hosts.clear()
    if pin:
        torch._C._host_emptyCache()  # its pinned blocks back to the host
    return out


ROWS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("host bytes held (GiB)", "host_bytes", lambda v: f"{v / GIB:.3f}"),
    ("host bytes pinned (GiB)", "pinned_bytes", lambda v: f"{v / GIB:.3f}"),
    ("held / data", "ratio", lambda v: f"{v:.4f}"),
    ("offload 1: pins, copies (s)", "offload_1_s", lambda v: f"{v:.2f}"),
    ("onload 1 (s)", "onload_1_s", lambda v: f"{v:.2f}"),
    ("offload 2: buffers reused (s)", "offload_2_s", lambda v: f"{v:.2f}"),
    ("onload 2 (s)", "onload_2_s", lambda v: f"{v:.2f}"),
    ("offload 2 (GB/s)", "offload_gbps", lambda v: f"{v:.1f}"),
    ("onload 2 (GB/s)", "onload_gbps", lambda v: f"{v:.1f}"),
    ("values bit-exact, both cycles", "exact", str),
]


def table(data: int, ways: dict[str, dict[str, Any]]) -> str:
    for out in ways.values():
        out["ratio"] = out["host_bytes"] / data
        out["offload_gbps"] = data / out["offload_2_s"] / 1e9
        out["onload_gbps"] = data / out["onload_2_s"] / 1e9
    lines = [f"{'':34}" + "".join(f"{name:>24}" for name in ways)]
    for label, key, fmt in ROWS:
        lines.append(f"{label:34}" + "".join(
            f"{fmt(out[key]) if key in out else '-':>24}" for out in ways.values()))
    return "\n".join(lines)


def failures(data: int, exact: dict[str, Any], old: dict[str, Any], pin: bool) -> list[str]:
    bad = []
    if not exact["exact"]:
        bad.append("the offload's round trips lost bytes")
    if not exact["freed"]:
        bad.append("storages not freed while offloaded")
    if not exact["reused"]:
        bad.append("the second offload pinned a new buffer")
    if exact["host_bytes"] > MAX_RATIO * data:
        bad.append(f"host bytes held {exact['host_bytes']} > {MAX_RATIO} x data {data}")
    if pin and not exact["buffer_pinned"]:
        bad.append("the host buffer is not pinned")
    if pin and exact["pinned_bytes"] > MAX_RATIO * data:
        bad.append(f"pinned {exact['pinned_bytes']} > {MAX_RATIO} x data {data}")
    if exact["allocator_added"]:
        bad.append(f"torch's pinned allocator grew by {exact['allocator_added']} B")
    if not old["exact"]:
        bad.append("the baseline's round trips lost bytes (the check itself is broken)")
    return bad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--count", type=int, default=38,
                        help="storages of the 7B MLP matrix's size (1/1024 of it on CPU)")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args()
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tensors = build(device, args.count)
    data = sum(t.untyped_storage().nbytes() for t in tensors)
    print(f"{len(tensors)} storages, {data / GIB:.3f} GiB of data on {device}", flush=True)
    exact = exact_way(tensors, device)
    gc.collect()  # (its buffer unpinned and freed before the baseline pins)
    old = old_way(tensors, device)
    ways = {"exact (Offload)": exact, "per-storage pow2 (old)": old}
    print(table(data, ways))
    if device.type == "cuda":
        print(f"old way's pinned bytes as PowerOf2Ceil predicts: "
              f"{old['pinned_computed'] / GIB:.3f} GiB")
    bad = failures(data, exact, old, device.type == "cuda")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": str(device), "data_bytes": data,
                                              **ways, "failures": bad}, indent=1))
    for line in bad:
        print(f"FAIL: {line}")
    print("FAIL" if bad else "OK")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
