"""Where a train step makes the host wait for the GPU: the call site of every sync, by count.

``torch.cuda.set_sync_debug_mode("warn")`` makes torch warn at each synchronizing CUDA call it
knows of (``.item()``, ``.cpu()`` / ``.tolist()`` of a CUDA tensor, ``nonzero``, a blocking copy
to the host, ``torch.cuda.synchronize``...). torch raises each warning into Python at the
Python call that ran the op, so a ``warnings.showwarning`` hook that reads the Python stack
there names the line; syncs inside ``backward()`` surface at that call (autograd replays its
threads' warnings there). This replaces the profiler's stack grouping, whose frames came back
empty on torch 2.11 (``megatron_throughput.py --profile``).

Each sync is counted at its innermost frame in this repository (trainer_image/, bench/...),
with the innermost frame outside it (torch, megatron, transformers: where the sync actually
happened) as ``via``; a stack with no repository frame is counted at its innermost frame, with
its caller as ``via``.

Only syncs torch performs on CUDA tensors are reported (``torch.distributed`` ones are not
covered, torch's docs say): on CPU there are none. ``python bench/sync_sites.py`` checks the
capture and the aggregation on CPU with synthetic warnings (and a real ``.item()`` on a GPU).
"""

from __future__ import annotations

import linecache
import sys
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
SYNC_MESSAGE = "called a synchronizing CUDA operation"  # torch's c10/cuda warning text


@dataclass(frozen=True)
class Site:
    where: str  # "path:line function", the path relative to the repository when in it
    code: str  # that line's source
    via: str  # the library frame the sync happened in (or the caller), "" when none


def _skipped(filename: str) -> bool:
    """The warnings machinery between the op and the hook."""
    return filename.endswith(("/warnings.py", "<frozen warnings>"))


def _in_repo(filename: str, root: Path) -> bool:
    # Installed packages are not the repository's code, even in a venv inside it.
    if "site-packages" in filename or "dist-packages" in filename:
        return False
    try:
        Path(filename).resolve().relative_to(root)
    except ValueError:
        return False
    return True


def _short(frame: traceback.FrameSummary, root: Path) -> str:
    path = frame.filename
    try:
        path = str(Path(path).resolve().relative_to(root))
    except ValueError:
        for marker in ("site-packages/", "dist-packages/"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
    return f"{path}:{frame.lineno} {frame.name}"


def site_of(stack: list[traceback.FrameSummary], root: Path = ROOT) -> Site:
    """The call site a sync is counted at, from the stack at its warning (outermost first)."""
    frames = [f for f in stack if not _skipped(f.filename)]
    if not frames:
        return Site("(no Python frame)", "", "")
    ours = [i for i, f in enumerate(frames) if _in_repo(f.filename, root)]
    if ours:
        i = ours[-1]
        via = _short(frames[-1], root) if i < len(frames) - 1 else ""
    else:
        i = len(frames) - 1
        via = _short(frames[i - 1], root) if i > 0 else ""
    return Site(_short(frames[i], root), (frames[i].line or "").strip(), via)


class SyncSites:
    """Within ``with SyncSites() as sites:``, every sync torch warns of is counted by call
    site (``sites.counts``); other warnings go where they went before. The previous sync
    debug mode and warning state come back on exit."""

    def __init__(self, root: Path = ROOT) -> None:
        self.root = root
        self.counts: Counter[Site] = Counter()
        self._catch: Any = None
        self._mode: int | None = None

    def __enter__(self) -> SyncSites:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        # "always": the default filter shows a warning once per code location, and every
        # sync at one location must count.
        warnings.filterwarnings("always", message=f".*{SYNC_MESSAGE}")
        self._previous = warnings.showwarning
        warnings.showwarning = self._show
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
            self._mode = None
        self._catch.__exit__(kind, exc, tb)

    def _show(self, message: Warning | str, category: type[Warning], filename: str,
              lineno: int, file: Any = None, line: str | None = None) -> None:
        if SYNC_MESSAGE not in str(message):
            self._previous(message, category, filename, lineno, file, line)
            return
        self.record(traceback.extract_stack()[:-1])  # (without this hook's own frame)

    def record(self, stack: list[traceback.FrameSummary]) -> None:
        self.counts[site_of(stack, self.root)] += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def table(self, limit: int = 40) -> str:
        """count | call site | code, most first; the library frame below as "via"."""
        lines = [f"{'count':>6}  call site  |  code"]
        for site, n in self.counts.most_common(limit):
            lines.append(f"{n:>6}  {site.where}  |  {site.code}")
            if site.via:
                lines.append(f"{'':>6}    via {site.via}")
        if len(self.counts) > limit:
            rest = sum(n for _, n in self.counts.most_common()[limit:])
            lines.append(f"{rest:>6}  ({len(self.counts) - limit} more sites)")
        return "\n".join(lines)


# -- self-check (CPU) ----------------------------------------------------------------------


def _fake_repo_function(root: Path) -> Any:
    """A function whose code claims to live at root/trainer_image/fake_sync.py (its source in
    linecache, so tracebacks show its lines), warning as torch does at a sync."""
    path = str(root / "trainer_image" / "fake_sync.py")
    source = ("import warnings\n"
              "def step():\n"
              f"    warnings.warn({SYNC_MESSAGE!r}, UserWarning)\n"
              f"    warnings.warn({SYNC_MESSAGE!r}, UserWarning)\n"
              "    warnings.warn('something else', UserWarning)\n")
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    namespace: dict[str, Any] = {}
    exec(compile(source, path, "exec"), namespace)
    return namespace["step"]


def self_check() -> None:
    step = _fake_repo_function(ROOT)
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with SyncSites() as sites:
            for _ in range(3):  # one location, warned 6 times: all must count
                step()
            if torch.cuda.is_available():  # a real sync: .item() of a CUDA tensor
                torch.ones(1, device="cuda").sum().item()
            else:  # on CPU torch warns of nothing
                torch.ones(1).sum().item()
    fake = [(s, n) for s, n in sites.counts.items() if s.where.startswith("trainer_image/")]
    assert len(fake) == 2 and all(n == 3 for _, n in fake), sites.counts
    assert {s.where for s, _ in fake} == {"trainer_image/fake_sync.py:3 step",
                                          "trainer_image/fake_sync.py:4 step"}, fake
    assert all(s.code.startswith("warnings.warn(") and s.via == "" for s, _ in fake), fake
    # the unrelated warning went to the previous handler, once per call
    # (torch may add warnings of its own on a GPU: only ours are counted here)
    mine = [str(w.message) for w in others if str(w.message) == "something else"]
    assert mine == ["something else"] * 3, [str(w.message) for w in others]
    real = sites.total - 6  # (.item() may count more than once on some torch: at least 1)
    assert real >= 1 if torch.cuda.is_available() else real == 0, sites.counts
    # A stack through a library: counted at the repo frame, the library's innermost as via.
    lib = "/x/site-packages/megatron/core/schedules.py"
    stack = [traceback.FrameSummary(str(ROOT / "bench" / "b.py"), 1, "main", line="go()"),
             traceback.FrameSummary(str(ROOT / "trainer_image" / "t.py"), 7, "train",
                                    line="run()"),
             traceback.FrameSummary(lib, 10, "forward_backward", line="x"),
             traceback.FrameSummary(lib, 20, "sync", line="y.item()")]
    assert site_of(stack) == Site("trainer_image/t.py:7 train", "run()",
                                  "megatron/core/schedules.py:20 sync"), site_of(stack)
    assert site_of(stack[2:]) == Site("megatron/core/schedules.py:20 sync", "y.item()",
                                      "megatron/core/schedules.py:10 forward_backward")
    print(sites.table())
    print(f"sync_sites self-check passed ({'CUDA' if torch.cuda.is_available() else 'CPU'})")


if __name__ == "__main__":
    self_check()
    sys.exit(0)
