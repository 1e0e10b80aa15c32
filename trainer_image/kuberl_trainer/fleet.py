"""The engines as a fleet that outlives any one of them: dead engines are replaced.

An engine dies (its process exits: OOM, a crash; its actor goes with a lost pod) or stops
answering. While a rollout runs, the engine client sends the chunks a lost engine held to the
others (engine_client: every sample has its own seed, so none is lost or made twice). At the
next step boundary, before the weights go out, `heal` starts each lost engine again in its
place (its actors, or new ones in the same placement bundles) and waits until it answers;
the weight sync that follows builds its group again with the replacement and sends it the
current weights, as to every engine. `rollout.maxEngineRestarts` bounds the replacements in
a run: the next death fails the run with the engine's last log lines (Session.explain).

Colocated engines are not replaced (their budget is 0): they share the training GPUs, whose
memory handoff a fresh engine would have to join mid-step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kuberl_trainer.actors import EngineGroup
from kuberl_trainer.engine_client import EngineClient, EngineError

LOG = logging.getLogger("kuberl.run")


class Fleet:
    def __init__(self, engines: EngineGroup, client: EngineClient, *, budget: int,
                 start_timeout_s: float,
                 on_replaced: Callable[[str, str, str], None] | None = None) -> None:
        self.engines, self.client = engines, client
        self.budget, self.start_timeout_s = budget, start_timeout_s
        self.restarts = 0
        self.on_replaced = on_replaced  # (old URL, new URL, why): a log line, an Event

    async def heal(self) -> list[str]:
        """Replace every engine that died or was lost since the last call; their new URLs.
        Raises EngineError for the first engine past the restart budget."""
        loop = asyncio.get_running_loop()
        dead = await loop.run_in_executor(None, self.engines.dead)
        gone = sorted(set(dead) | self.client.lost, key=self.engines.urls.index)
        replaced = []
        for url in gone:
            why = (f"exited with code {dead[url]}" if url in dead
                   else "stopped answering")
            if self.restarts >= self.budget:
                raise EngineError(url, f"{why}; rollout.maxEngineRestarts is {self.budget}"
                                  f"{' and used up' if self.budget else ''}")
            new = await loop.run_in_executor(None, self.engines.restart, url)
            self.client.replace(url, new)
            self.restarts += 1
            await self.client.wait_healthy(timeout_s=self.start_timeout_s, urls=[new],
                                           exited=self.engines.dead)
            LOG.warning("engine at %s %s: replaced by %s (restart %d of %d)", url, why, new,
                        self.restarts, self.budget)
            if self.on_replaced is not None:
                self.on_replaced(url, new, why)
            replaced.append(new)
        return replaced
