"""`kuberl run`: check inputs, start (or join) Ray, build the parts, resume, run the loop.

The same function is the RayJob entrypoint in a cluster (`--address auto --in-cluster`), where
it reports progress to the RLJob status and keeps checkpoints at spec.checkpoint.path; locally
checkpoints and metrics go under --output-dir.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuberl_api import RLJob
from kuberl_trainer import preflight
from kuberl_trainer.progress import Progress

LOG = logging.getLogger("kuberl.run")


@dataclass
class Options:
    address: str | None
    in_cluster: bool
    output_dir: Path
    checkpoint_dir: Path
    prometheus_port: int
    tensorboard: Path | None
    seed: int
    wandb_project: str | None = None

    @property
    def log_dir(self) -> Path | None:
        """Where the engines' and training workers' output goes on a local run (the terminal
        is for the step table); None in a cluster, where it stays in the pods' logs."""
        return None if self.address or self.in_cluster else self.output_dir / "logs"


def options(job: RLJob, args: argparse.Namespace) -> Options:
    out = Path(args.output_dir or Path("out") / job.name)
    ckpt = Path(job.spec.checkpoint.path) if args.in_cluster else out / "checkpoints"
    return Options(address=args.address, in_cluster=args.in_cluster, output_dir=out,
                   checkpoint_dir=ckpt, prometheus_port=getattr(args, "metrics_port", 0) or 0,
                   tensorboard=getattr(args, "tensorboard", None), seed=getattr(args, "seed", 0),
                   wandb_project=getattr(args, "wandb", None))


def run(job: RLJob, args: argparse.Namespace) -> int:
    opts = options(job, args)
    if job.spec.suspend:  # the operator holds such a job; run here, it must not start either
        print("error: spec.suspend is true: the job is held; set it to false to run it",
              file=sys.stderr)
        return 1
    try:
        checked = preflight.check(job.spec)        # before Ray starts: files, keys, rewards
    except preflight.PreflightError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from kuberl_trainer.session import Session  # ray/torch load only after the checks

    session = Session(job, opts, checked)
    if opts.log_dir is not None:
        print(f"logs: {opts.log_dir}/ (engines, training workers)", flush=True)
    stop = _install_sigterm()
    try:
        session.start()
        session.train(Progress(job.spec.schedule.num_rollouts))
    except KeyboardInterrupt:
        print("\ninterrupted: saving a checkpoint before exiting", file=sys.stderr)
        session.save_now()
        return 130
    except Exception as exc:  # an engine or worker died: fail with its error, never hang
        print(f"error: {session.explain(exc)}", file=sys.stderr)
        return 1
    finally:
        session.close()
        signal.signal(signal.SIGTERM, stop)
    return 0


def _install_sigterm() -> Any:
    """Kubernetes stops pods with SIGTERM: treat it like Ctrl-C (save, then exit)."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    return signal.signal(signal.SIGTERM, handler) if os.name == "posix" else None
