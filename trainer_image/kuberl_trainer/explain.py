"""The one line a failed run ends with: which engine died, with the end of its log, or the
error itself; on a local run, where the actors' logs are; and a replica of the served reward
model (reward.model) that died, with the end of its log. Explaining an error never raises
another (a dead actor, a log file gone)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import ray

from kuberl_trainer.engines.actors import EngineGroup
from kuberl_trainer.engines.client import EngineError
from kuberl_trainer.engines.fleet import dead_after
from kuberl_trainer.engines.reward_engines import RewardEngines

LOG_TAIL_LINES = 20  # of a dead engine's log, with the error that names it
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours its exceptions' headers


def explain(exc: BaseException, engines: EngineGroup | None, log_dir: Path | None,
            rewards: RewardEngines | None = None) -> str:
    """The error line for `exc`. `log_dir`: where a local run's actors write (None in a
    cluster, where each engine's output is in its pod's log and its actor kept the end)."""
    return _explained(exc, engines, log_dir) + _reward_model_deaths(rewards)


def _explained(exc: BaseException, engines: EngineGroup | None, log_dir: Path | None) -> str:
    dead = _dead_engines(exc, engines)
    if dead:
        codes = ", ".join(f"{url} exited with code {c}" for url, c in dead.items())
        return ANSI.sub("", f"engine died: {codes} ({exc})") + "".join(
            _engine_log(engines, url) for url in dead)
    if isinstance(exc, EngineError):  # alive but failing: its log says why
        return ANSI.sub("", str(exc)) + _engine_log(engines, exc.url)
    return ANSI.sub("", f"{type(exc).__name__}: {exc}") + (
        f"\n(the engines' and training workers' logs: {log_dir}/)" if log_dir is not None
        else "")


def _dead_engines(exc: BaseException, engines: EngineGroup | None) -> dict[str, int]:
    """Engines whose server exited, with the code (fleet.dead_after)."""
    if engines is None:
        return {}
    try:
        return dead_after(engines, exc)
    except Exception:  # explaining an error must not raise another (a dead actor)
        return {}


def _engine_log(engines: EngineGroup | None, url: str) -> str:
    """The last lines of the log of the engine at `url`, naming the file (on a local run;
    in a cluster, the lines its actor kept: EngineServer.log_tail)."""
    path = engines.log_of(url) if engines is not None else None
    if path is None:
        lines = _actor_log_tail(engines, url)
        return "".join([f"\nlast lines of the engine at {url}:\n",
                        *(f"  {line}\n" for line in lines)]).rstrip("\n") if lines else ""
    if not path.exists():
        return ""
    return f"\nlast lines of {path} ({url}):\n" + "\n".join(
        f"  {line}" for line in tail(path, LOG_TAIL_LINES))


def _reward_model_deaths(rewards: RewardEngines | None) -> str:
    """Each replica of the reward model whose server exited, with the end of its log (the
    reward's error itself only says its requests failed)."""
    if rewards is None:
        return ""
    try:  # explaining an error must not raise another (a dead actor)
        dead = rewards.dead()
        out = ""
        for url, code in dead.items():
            path = rewards.logs[rewards.urls.index(url)]
            lines = (tail(path, LOG_TAIL_LINES) if path is not None and path.exists()
                     else rewards.log_tail(url, LOG_TAIL_LINES))
            where = f" ({path})" if path is not None else ""
            out += f"\nthe reward model at {url} exited with code {code}; its last lines{where}:"
            out += "".join(f"\n  {line}" for line in lines)
        return out
    except Exception:
        return ""


def _actor_log_tail(engines: EngineGroup | None, url: str) -> list[str]:
    if engines is None or url not in engines.urls:
        return []
    try:  # explaining an error must not raise another (a dead actor)
        return [str(line) for line in ray.get(
            engines.actor_of(url).log_tail.remote(LOG_TAIL_LINES), timeout=10)]
    except Exception:
        return []


def tail(path: Path, lines: int, max_bytes: int = 64 << 10) -> list[str]:
    """The last `lines` lines of a text file that may be long (read from its end)."""
    with path.open("rb") as f:
        f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
        return f.read().decode(errors="replace").splitlines()[-lines:]
