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
from typing import TYPE_CHECKING

from kuberl_api import RLJob, runtime
from kuberl_trainer import preflight
from kuberl_trainer.options import options
from kuberl_trainer.report.progress import Progress
from kuberl_trainer.stopping import GracefulStop, PidFile, StopRequested

if TYPE_CHECKING:
    from kuberl_trainer.report.heartbeat import StartupHeartbeat
    from kuberl_trainer.session import Session

LOG = logging.getLogger("kuberl.run")


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
        if opts.in_cluster:  # the RLJob fails now, rather than after backoffLimit restarts
            _report_refusal(str(exc))
        return 1
    from kuberl_trainer.agents.remote import EnvironmentUnavailable
    from kuberl_trainer.agents.service import environment_service

    # A local run's processes (its Ray's, the engines', an environment server) end with it,
    # however it ends (SIGKILL too): started before any of them (see watchdog.py)
    services = contextlib.ExitStack()
    if not opts.address and not opts.in_cluster:
        from kuberl_trainer import watchdog

        guard = watchdog.start()
        if guard is not None and guard.stdin is not None:
            services.callback(guard.stdin.close)  # (closed last: what is left then, ends)
    # environment.image: its service reached (or served here) before Ray starts, stopped last
    try:
        service = services.enter_context(environment_service(job.spec, opts))
    except EnvironmentUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if service is not None:
        checked.environment_class = service
    from kuberl_trainer.startup import HeadStart  # (no torch: see there)

    # Kubernetes stops pods with SIGTERM (the head's preStop hook finds the driver by its pid
    # file): stop at a safe point, save, and exit with SIGTERM's status, never 0 (a stop that
    # read as success would end the RLJob). Installed once Ray has started: a local Ray head
    # sets its own handler (exit at once), and before the first step there is nothing to save.
    stop = GracefulStop()
    pid_file = PidFile(runtime.DRIVER_PID_FILE) if opts.in_cluster else contextlib.nullcontext()
    head: HeadStart | None = None
    session: Session | None = None
    beat: StartupHeartbeat | None = None
    try:
        with pid_file:
            if opts.in_cluster:  # the RLJob status heartbeat, from now to the first step
                beat = _startup_heartbeat(job)
            # Ray and the engines start while a thread imports the loop (torch, transformers)
            head = HeadStart.begin(job.spec, opts, preload="kuberl_trainer.session")
            if opts.log_dir is not None:
                print(f"logs: {opts.log_dir}/ (engines, training workers)", flush=True)
            from kuberl_trainer.session import Session

            session = Session(job, opts, checked, beat=beat)
            if job.spec.mode == "eval":  # the eval sets scored once; nothing trains
                session.evaluate_only(head)
                return 0
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
        from kuberl_trainer.explain import explain  # (Ray's up by now: no start-up cost)

        why = (explain(exc, session.engines, opts.log_dir, session.reward_engines)
               if session is not None
               else f"{type(exc).__name__}: {exc}")
        print(f"error: {why}", file=sys.stderr)
        return 1
    finally:
        if beat is not None:
            beat.stop()
        if session is not None:
            session.close()
        elif head is not None:
            head.close()
        stop.uninstall()
        services.close()
    return 0


def _report_refusal(message: str) -> None:
    """In a cluster, the refusal on the RLJob's status (report/status.py `refuse`), naming this
    attempt, so the operator fails the job at once: a restart would refuse the same way. Best
    effort, as the heartbeat: a refusal not reported leaves a failed Ray job, which the operator
    restarts as after a crash, and the next attempt refuses and reports again."""
    import os

    from kuberl_trainer.report.status import StatusReporter

    attempt = os.environ.get(runtime.ENV_ATTEMPT, "")
    try:
        if not attempt.isdigit():
            raise ValueError(f"{runtime.ENV_ATTEMPT} is {attempt!r}, not an attempt number")
        StatusReporter.in_cluster().refuse(int(attempt), message)
    except Exception as exc:
        print(f"warning: could not report the refusal to the RLJob's status ({exc}); the "
              "operator will restart the job as after a crash", file=sys.stderr)


def _startup_heartbeat(job: RLJob) -> StartupHeartbeat:
    """In a cluster, the RLJob status heartbeat from now until the first step reports (see
    report/heartbeat.py): phase Starting while Ray and the engines' actors start."""
    from kuberl_trainer.report.heartbeat import StartupHeartbeat
    from kuberl_trainer.report.status import StatusReporter

    reporter = StatusReporter.in_cluster()
    total = job.spec.schedule.num_rollouts
    beat = StartupHeartbeat(lambda phase: reporter.beat(phase, total))
    beat.reporter = reporter
    beat.enter("Starting")
    return beat


STOPPED = 143  # 128 + SIGTERM, as a shell reports a process that SIGTERM ended
