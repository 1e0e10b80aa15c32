"""`kuberl run`: check inputs, start (or join) Ray, build the parts, resume, run the loop.

The same function is the RayJob entrypoint in a cluster (`--address auto --in-cluster`), where
it reports progress to the RLJob status and keeps checkpoints at spec.checkpoint.path; locally
checkpoints and metrics go under --output-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kuberl_api import RLJob, runtime
from kuberl_trainer import preflight
from kuberl_trainer.progress import Progress
from kuberl_trainer.stopping import GracefulStop, PidFile, StopRequested

if TYPE_CHECKING:
    from kuberl_trainer.session import Session

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
    # Every actor shares this machine: a local Ray, or (once joined: startup.HeadStart) a Ray
    # at --address whose nodes are all this machine; never with --in-cluster. Then the actors'
    # output goes to log files, CPU actors split the cores, and the weight-sync rendezvous
    # takes a free port (runs side by side never collide).
    one_machine: bool = field(init=False)

    def __post_init__(self) -> None:
        self.one_machine = not self.address and not self.in_cluster

    @property
    def log_dir(self) -> Path | None:
        """Where the engines' and training workers' output goes on one machine (the terminal
        is for the step table); None in a cluster, where it stays in the pods' logs."""
        return self.output_dir / "logs" if self.one_machine else None


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
    from kuberl_trainer.startup import HeadStart  # (no torch: see there)

    # Kubernetes stops pods with SIGTERM (the head's preStop hook finds the driver by its pid
    # file): stop at a safe point, save, and exit with SIGTERM's status, never 0 (a stop that
    # read as success would end the RLJob). Installed once Ray has started: a local Ray head
    # sets its own handler (exit at once), and before the first step there is nothing to save.
    stop = GracefulStop()
    pid_file = PidFile(runtime.DRIVER_PID_FILE) if opts.in_cluster else contextlib.nullcontext()
    head: HeadStart | None = None
    session: Session | None = None
    try:
        with pid_file:
            # Ray and the engines start while a thread imports the loop (torch, transformers)
            head = HeadStart.begin(job.spec, opts, preload="kuberl_trainer.session")
            if opts.log_dir is not None:
                print(f"logs: {opts.log_dir}/ (engines, training workers)", flush=True)
            from kuberl_trainer.session import Session

            session = Session(job, opts, checked)
            session.start(head)
            stop.install()
            session.train(Progress(job.spec.schedule.num_rollouts), stop)
    except StopRequested:
        assert session is not None  # (requested only once training runs)
        print(f"stopping (SIGTERM): saving a checkpoint after step {session.step}",
              file=sys.stderr)
        session.save_and_report()
        return STOPPED
    except KeyboardInterrupt:
        print("\ninterrupted: saving a checkpoint before exiting", file=sys.stderr)
        if session is not None:
            session.save_now()
        return 130
    except Exception as exc:  # an engine or worker died: fail with its error, never hang
        print(f"error: {session.explain(exc) if session else f'{type(exc).__name__}: {exc}'}",
              file=sys.stderr)
        return 1
    finally:
        if session is not None:
            session.close()
        elif head is not None:
            head.close()
        stop.uninstall()
    return 0


STOPPED = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended
