"""Per-step metrics: one JSON object per line in metrics.jsonl (stable key names), the same
numbers as Prometheus gauges, and TensorBoard when it is installed and asked for.

metrics.jsonl holds one row per step of the training its output directory's checkpoints
continue: a run that starts at step K (resumed from the checkpoint of step K, or K = 0 with
none) first moves the rows of steps >= K, which it trains again, to metrics.dropped.jsonl
(those of a run killed after its last checkpoint, and a row the kill cut short), then appends.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

# Keys every step line carries, in this order (others follow, sorted).
STEP_KEYS = ("step", "reward_mean", "reward_std", "response_length_mean", "time_generate_s",
             "time_train_s", "time_sync_s", "time_step_s", "weight_version")
METRICS = "metrics.jsonl"
DROPPED = "metrics.dropped.jsonl"


class MetricsLog:
    """`first_step`: the step this run starts at; the rows of that step and later already in
    metrics.jsonl are moved to metrics.dropped.jsonl first (`dropped`: how many). None (mode
    eval, which trains nothing): every row stays, the new ones are appended."""

    def __init__(self, out_dir: Path, *, first_step: int | None = 0, prometheus_port: int = 0,
                 tensorboard_dir: Path | None = None, wandb_project: str | None = None,
                 run_name: str = "kuberl") -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / METRICS
        self.dropped = 0 if first_step is None else drop_rows_from(self.path, first_step)
        self._file = self.path.open("a")
        self._gauges: dict[str, Any] = {}
        self._counters: dict[str, tuple[Any, float]] = {}
        self._registry = None
        if prometheus_port:
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry()
            serve_text_format(prometheus_port, self._registry)
        self._tb = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                print("warning: tensorboard is not installed; skipping --tensorboard",
                      file=sys.stderr)
            else:
                self._tb = SummaryWriter(str(tensorboard_dir))

        self._wandb: Any = None
        if wandb_project:
            try:
                import wandb
            except ImportError:  # wandb is optional
                print("warning: wandb is not installed; skipping --wandb", file=sys.stderr)
            else:
                self._wandb = wandb.init(project=wandb_project, name=run_name,
                                         dir=str(out_dir))

    def serve_also(self, collector: Any) -> None:
        """Serve `collector`'s metrics on the Prometheus endpoint too (if there is one)."""
        if self._registry is not None:
            self._registry.register(collector)

    def write(self, record: dict[str, Any]) -> None:
        ordered = {k: record[k] for k in STEP_KEYS if k in record}
        ordered.update({k: record[k] for k in sorted(record) if k not in ordered})
        ordered["time"] = time.time()
        self._file.write(json.dumps(ordered) + "\n")
        self._file.flush()
        step = int(record["step"])
        for key, value in record.items():
            if isinstance(value, int | float) and key.endswith("_total"):
                self._count(key, value)
            elif isinstance(value, int | float) and key != "step":
                self._gauge(key).set(value)
                if self._tb is not None:
                    self._tb.add_scalar(key, value, step)
        if "step" in record:
            self._gauge("step").set(step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items()
                             if isinstance(v, int | float)}, step=step)

    def _gauge(self, key: str) -> Any:
        if self._registry is None:
            return _Null()
        if key not in self._gauges:
            from prometheus_client import Gauge

            self._gauges[key] = Gauge(prometheus_name(key), key.replace("_", " "),
                                      registry=self._registry)
        return self._gauges[key]

    def _count(self, key: str, total: float) -> None:
        """A running total (`<name>_total` in the record) as the Prometheus counter
        kuberl_<name>_total: raised by what it grew since the last record (a resumed run's
        count starts again at 0, as a restarted process's counters do)."""
        if self._registry is None:
            return
        if key not in self._counters:
            from prometheus_client import Counter

            name = key.removesuffix("_total")
            self._counters[key] = (Counter(f"kuberl_{name}", name.replace("_", " "),
                                           registry=self._registry), 0.0)
        counter, seen = self._counters[key]
        if total > seen:
            counter.inc(total - seen)
        self._counters[key] = (counter, max(seen, total))

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def prometheus_name(key: str) -> str:
    """A metric's gauge, kuberl_train_<key>, in the characters Prometheus allows: pass@8 is
    pass_at_8, an eval set's name's "-" is "_"."""
    return "kuberl_train_" + re.sub(r"[^a-zA-Z0-9_:]", "_", key.replace("@", "_at_"))


def drop_rows_from(path: Path, first_step: int) -> int:
    """Move the rows of steps >= `first_step` from `path` to metrics.dropped.jsonl beside it,
    with any line that is not a row (one a kill cut short); how many lines moved. `path` is
    replaced atomically: a kill meanwhile leaves it as it was (and the next run moves those
    rows again: metrics.dropped.jsonl may then hold one twice)."""
    try:
        lines = [line.rstrip("\n") + "\n" for line in path.read_text().splitlines()]
    except FileNotFoundError:
        return 0
    kept: list[str] = []
    moved: list[str] = []
    for line in lines:
        (kept if _step_of(line) < first_step else moved).append(line)
    if not moved:
        return 0
    with (path.parent / DROPPED).open("a") as out:
        out.writelines(moved)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return len(moved)


def _step_of(line: str) -> float:
    """A row's step; infinity for a line that is not a row (dropped whatever its step)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return float("inf")


def serve_text_format(port: int, registry: Any, addr: str = "0.0.0.0") -> Any:
    """/metrics in Prometheus' text format whatever the scraper asks for. Prometheus 2.x asks
    for OpenMetrics, in which prometheus_client writes SGLang's `sglang:` names (the engines'
    metrics served again here) as `sglang_`: the same series would then have two names."""
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    app = make_wsgi_app(registry)

    def text_only(environ: dict[str, Any], start_response: Any) -> Any:
        return app({k: v for k, v in environ.items() if k != "HTTP_ACCEPT"}, start_response)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # one line per scrape
            pass

    server = make_server(addr, port, text_only, ThreadingWSGIServer, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics").start()
    return server


class _Null:
    def set(self, value: float) -> None:
        pass
