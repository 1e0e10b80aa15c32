"""The engines as a fleet that outlives any one of them: dead engines are replaced.

An engine dies (its process exits: OOM, a crash; its actor goes with a lost pod) or stops
answering. While a rollout runs, the engine client sends the chunks a lost engine held to the
others (engine_client: every sample has its own seed, so none is lost or made twice). At the
next step boundary, before the weights go out, `heal` starts each lost engine again in its
place (its actors, or new ones in the same placement bundles) and waits until it answers;
the weight sync that follows builds its group again with the replacement and sends it the
current weights, as to every engine. An engine that dies during the weight sync itself is
replaced the same way and the sync made again, to every engine (`sync`): the others may hold
half an update, and stay paused until a whole one has arrived. One that dies in the middle of
a broadcast leaves the others in it until the group's timeout: the trainer aborts the group
(weight_sync/sender.py), and the engines it names as still stuck in the aborted update
(GroupBroken.stuck: SGLang's, which cannot be told to abort) are replaced with it at once.
`rollout.maxEngineRestarts`
bounds the replacements in a run: the next death fails the run with the engine's last log
lines (Session.explain).

An engine that stops answering without dying (hung, or its node gone silent) is found by the
health probe (`rollout.healthProbe`): a thread that asks every engine in rotation for GET
/health, on its own clock, so that a loop busy training (sync mode) neither delays a probe nor
mistakes its own pause for the engine's. After failureThreshold silent probes in a row the
engine is lost: its requests in flight are given up and sent to the others, and heal replaces
it (stopping it first).

Behind SGLang's router (router.py) the fleet also keeps the router's engines current: a
replaced engine is removed from it before it is stopped and its replacement added once it
answers. An engine the probe finds silent is removed and its server killed at once, not at
the step boundary: the router holds the requests it sent there until their connection drops,
then sends them to another engine.

Colocated engines are not replaced (their budget is 0): they share the training GPUs, whose
memory handoff a fresh engine would have to join mid-step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Executor

from kuberl_api.spec import HealthProbe
from kuberl_trainer.engines.actors import EngineGroup
from kuberl_trainer.engines.client import EngineClient, EngineError, GroupBroken
from kuberl_trainer.engines.router import Router

LOG = logging.getLogger("kuberl.run")
# A dying engine drops its connections a moment before its process is seen to exit: after an
# error without an answer, look a few times before concluding that no engine died.
DEATH_LOOKS, DEATH_LOOK_INTERVAL_S = 6, 0.5


class Fleet:
    def __init__(self, engines: EngineGroup, client: EngineClient, *, budget: int,
                 start_timeout_s: float) -> None:
        self.engines, self.client = engines, client
        self.budget, self.start_timeout_s = budget, start_timeout_s
        self.restarts = 0
        self._quiet = threading.Event()  # see quiet
        self._syncing: asyncio.Lock | None = None  # one sync at a time (see revive)
        # What revive sends: armed by the training loop (see arm)
        self._push: Callable[..., object] | None = None
        self._push_args: tuple[object, ...] = ()
        self._executor: Executor | None = None
        self.held = 0  # the weight version the trainers hold
        # Told of each replacement, in words (in a cluster: an Event on the RLJob)
        self.announce: Callable[[str], None] = lambda message: None
        self.router: Router | None = None  # kept to the engines in rotation when set
        self._silenced: set[str] = set()  # killed for their silence (see _evict)
        self._why: dict[str, str] = {}  # why an engine lost in a sync is replaced (heal's log)
        self._evictions: set[asyncio.Future[None]] = set()

    def arm(self, push: Callable[..., object], bucket_bytes: int, held: int,
            executor: Executor | None = None) -> None:
        """Let the engine client wait for `revive` when every engine is lost mid-rollout
        (within a restart budget): `push(urls, version, bucket_bytes)` on `executor` (where
        the trainers' calls queue, so it follows a training step in progress)."""
        self._push, self._push_args, self._executor = push, (bucket_bytes,), executor
        self.held = held
        if self.budget > 0:
            self.client.revive = self.revive
            if self.router is not None:
                self.client.reroute = self.reroute

    def trained(self) -> None:
        """The trainers took a step: they hold the next weight version (called where their
        calls queue, before any push that follows it)."""
        self.held += 1

    async def revive(self) -> None:
        """Every engine is lost in the middle of a rollout (one engine, say): replace them
        now and send them the weights the trainers hold, for the rollout to go on (the
        engine client waits for this). The version they report is the trainers' own."""
        push = self._push
        assert push is not None
        LOG.warning("no engine is left to generate: replacing the lost ones mid-rollout")
        # (self.held read when the push runs: after the trainers' step in progress)
        await self.sync(lambda urls: push(urls, self.held, *self._push_args),
                        executor=self._executor)

    async def reroute(self) -> None:
        """Behind the router, a request that no engine it tried could serve: its retries
        stay with the engine that holds the group's routing key, dead or not. The engines
        that died are taken out of the router and out of rotation (heal replaces them at the
        step boundary); with none left, they are replaced now (revive)."""
        assert self.router is not None
        loop = asyncio.get_running_loop()
        unserved = EngineError(self.router.url, "no engine could serve a request")
        dead = await loop.run_in_executor(None, dead_after, self.engines, unserved)
        for url in dead:
            if url in self.client.live():
                LOG.warning("engine at %s exited with code %d: taken out of the router, to be "
                            "replaced", url, dead[url])
                self.client.lose(url)
                await self.router.remove(url)
        if not self.client.live():
            await self.revive()

    async def heal(self) -> None:
        """Replace every engine that died or was lost since the last call. Raises EngineError
        for the first engine past the restart budget."""
        loop = asyncio.get_running_loop()
        if self._evictions:  # (a kill landing after the restart would kill the replacement)
            await asyncio.gather(*self._evictions, return_exceptions=True)
        dead = await loop.run_in_executor(None, self.engines.dead)
        gone = sorted(set(dead) | self.client.lost, key=self.engines.urls.index)
        for url in gone:
            why = self._why.pop(url, None) or (
                f"exited with code {dead[url]}"
                if url in dead and url not in self._silenced else "stopped answering")
            if self.restarts >= self.budget:
                raise EngineError(url, f"{why}; rollout.maxEngineRestarts is {self.budget}"
                                  f"{' and used up' if self.budget else ''}")
            if self.router is not None:
                await self.router.remove(url)
            new = await loop.run_in_executor(None, self.engines.restart, url)
            self._silenced.discard(url)
            self.restarts += 1
            await self.client.wait_healthy(timeout_s=self.start_timeout_s, urls=[new],
                                           exited=self.engines.dead)
            self.client.replace(url, new)  # (into rotation, and probed, once it answers)
            if self.router is not None:
                await self.router.add(new)
            message = (f"engine at {url} {why}: replaced by {new} (restart {self.restarts} "
                       f"of {self.budget})")
            LOG.warning("%s", message)
            await loop.run_in_executor(None, self.announce, message)

    async def sync(self, push: Callable[..., object], *args: object,
                   executor: Executor | None = None) -> None:
        """Replace the engines lost so far, then `push(urls, *args)` the weights to every
        engine (a blocking call, run on `executor`). A push that fails because an engine died
        or was lost meanwhile is made again once that engine is replaced, within the restart
        budget; any other failure is raised."""
        loop = asyncio.get_running_loop()
        if self._syncing is None:
            self._syncing = asyncio.Lock()
        # Quiet throughout: after a failed push the engines left stay paused (answering 503 to
        # a probe) until the push made again has given them whole weights.
        async with self._syncing:
            await self._sync(loop, push, args, executor)

    async def _sync(self, loop: asyncio.AbstractEventLoop, push: Callable[..., object],
                    args: tuple[object, ...], executor: Executor | None) -> None:
        with self.quiet():
            while True:
                await self.heal()
                try:
                    await loop.run_in_executor(executor, push, list(self.engines.urls), *args)
                    return
                except Exception as exc:
                    gone = await loop.run_in_executor(None, dead_after, self.engines, exc)
                    # A broken update (GroupBroken): the engine that failed, if it did not
                    # die (hung), and those left in the update the trainer aborted, replaced
                    # now rather than at the group's timeout
                    for url, why in _broken_update(exc, self.client.urls):
                        if url not in gone:
                            self.client.lose(url)
                            self._why[url] = why
                            gone[url] = 0
                    if not gone and not self.client.lost:
                        hung = _silent_engine(exc, self.client.urls)
                        if hung is None:
                            raise
                        # (past the sync's deadline: hung, not left to NCCL's timeout)
                        self.client.lose(hung)
                        gone = {hung: 0}
                    if self.restarts < self.budget:  # (else heal raises, naming the budget)
                        LOG.warning("the weight sync failed on %s (%s): sent again once "
                                    "replaced", ", ".join(sorted(gone)), _reason(exc))

    # ---- the health probe ------------------------------------------------------------------
    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """While weights go to the engines: SGLang's /health generates a token, which waits
        for the update (a large one takes longer than a probe's timeout); silence then says
        nothing about an engine's health."""
        self._quiet.set()
        try:
            yield
        finally:
            self._quiet.clear()

    def watch(self, probe: HealthProbe, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
        """Start probing every engine in rotation; returns what stops it. An engine found
        silent is lost on `loop` (the client's: where its requests wait). Nothing is probed
        without a restart budget (colocated engines: SGLang's /health fails while they have
        released their memory, and there is nothing to replace them with)."""
        if self.budget == 0:
            return lambda: None
        stop = threading.Event()
        thread = threading.Thread(target=self._probe_until, args=(probe, loop, stop),
                                  daemon=True, name="engine-health-probe")
        thread.start()

        def stop_watching() -> None:
            stop.set()
            thread.join(timeout=probe.timeout_seconds + 5)
        return stop_watching

    def _probe_until(self, probe: HealthProbe, loop: asyncio.AbstractEventLoop,
                     stop: threading.Event) -> None:
        silent: dict[str, int] = {}
        while not stop.wait(probe.period_seconds):
            urls = self.client.live()
            answered = _probe_all(urls, probe.timeout_seconds)
            if self._quiet.is_set():  # (probed during a weight update: no verdict)
                silent.clear()
                continue
            for url in urls:
                silent[url] = 0 if answered[url] else silent.get(url, 0) + 1
                if silent[url] == probe.failure_threshold and not stop.is_set():
                    LOG.warning("engine at %s did not answer %d health probes in a row "
                                "(%d s each): taken out of rotation, to be replaced", url,
                                probe.failure_threshold, probe.timeout_seconds)
                    loop.call_soon_threadsafe(self._lose, url)

    def _lose(self, url: str) -> None:
        if url in self.client.urls:  # (not if replaced meanwhile)
            self.client.lose(url)
            if self.router is not None:
                eviction = asyncio.ensure_future(self._evict(url))
                self._evictions.add(eviction)
                eviction.add_done_callback(self._evictions.discard)

    async def _evict(self, url: str) -> None:
        """Behind the router: no new request for the silent engine at `url`, and its server
        killed, so that the router sends the requests it holds there to another engine (it
        would wait for them until its request timeout). heal replaces it as a lost one."""
        assert self.router is not None
        loop = asyncio.get_running_loop()
        try:
            await self.router.remove(url)
            self._silenced.add(url)
            await loop.run_in_executor(None, self.engines.kill, url)
        except Exception as exc:  # (heal stops and replaces it regardless)
            LOG.warning("could not take the silent engine at %s out of the router: %s", url,
                        _reason(exc))


def _reason(exc: BaseException) -> str:
    """One line: an engine's own message (a Ray task error's str() is its whole traceback)."""
    message = getattr(exc, "message", None)
    return str(message) if isinstance(message, str) else type(exc).__name__


def _silent_engine(exc: BaseException, urls: list[str]) -> str | None:
    """The engine that `exc` says did not answer (a timeout, a dropped connection) if it is
    one of `urls`; None for an engine's answer or any other error."""
    if isinstance(exc, EngineError) and not exc.answered and exc.url in urls:
        return exc.url
    return None


def _broken_update(exc: BaseException, urls: list[str]) -> list[tuple[str, str]]:
    """(engine, why it is replaced) for the engines a broken weight update names (GroupBroken:
    the one that failed, then those still in the update the trainer aborted); [] for any
    other error."""
    if not isinstance(exc, GroupBroken):
        return []
    named = [(exc.url, "stopped answering in a weight update")]
    named += [(url, "was left in an aborted weight update") for url in exc.stuck]
    return [(url, why) for url, why in named if url in urls]


def dead_after(engines: EngineGroup, exc: BaseException) -> dict[str, int]:
    """The engines whose server exited (url: exit code), as seen after `exc`: looked at a few
    times when `exc` is an engine's error without an answer (see DEATH_LOOKS)."""
    looks = DEATH_LOOKS if isinstance(exc, EngineError) and not exc.answered else 1
    for look in range(looks):
        dead = engines.dead()
        if dead or look == looks - 1:
            return dead
        time.sleep(DEATH_LOOK_INTERVAL_S)
    return {}


def _probe_all(urls: list[str], timeout_s: float) -> dict[str, bool]:
    """Whether each engine answered GET /health with 200 within timeout_s (concurrently)."""
    answered = dict.fromkeys(urls, False)

    def probe(url: str) -> None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as answer:
                answered[url] = answer.status == 200
        except OSError:  # refused, reset, timed out, HTTP error
            pass
    threads = [threading.Thread(target=probe, args=(u,), daemon=True) for u in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 1)
    return answered
