"""The trainer's only way to reach engines: an async HTTP client over SGLang's native API.

The same client drives real SGLang servers and the reference engine (kuberl_rollout.reference);
request bodies use SGLang's field names (tests/unit/test_engine_contract.py checks them).

- Load balancing: a request goes to the engine with the fewest outstanding prompts (ties broken
  round-robin). The rollout sends a step's prompts with `generate_spread`: whole GRPO groups,
  one batched `/generate` per engine, so each engine sees its share at once and fills a batch
  without waiting for stragglers, and HTTP costs one round trip per engine, not per prompt.
  `generate` (one request per prompt) suits streams of independent prompts.
- Failure: every call has a total timeout; a refused connection, a dropped connection (engine
  died mid-request), a timeout or a 4xx/5xx answer raises `EngineError` carrying the engine URL
  and its error text. `generate` cancels its other requests on the first failure.
- Lost engines: `generate_spread` sends a chunk whose engine never answered (dead, or silent
  past the timeout) to another engine and takes the lost one out of rotation (`lost`) until
  `replace` puts its replacement in its place (`fleet.Fleet`). Every sample carries its own
  seed, so the retried chunk's samples are the ones the lost engine would have made: none is
  lost or made twice. With no engine left (a fleet of one), a chunk waits for `revive`
  (set by the fleet: the lost engines replaced and given the trainers' weights) and is sent
  to the replacement; without it, the rollout fails.
- Through SGLang's router (`router_url`, set by router.Router): `generate_spread` sends every
  sample as its own request to the router, with one routing key per group, and the router
  picks the engine (router.py says why). Which engine made a sample is then unknown.
- The engines' API key: every request carries `Authorization: Bearer <key>`, the key from
  $KUBERL_ENGINE_API_KEY (kuberl_wire.protocol.ENGINE_API_KEY_ENV) unless given; the engines
  answer 401 without it except on /health* and /metrics* (SGLang 0.5.6's rule).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp

from kuberl_wire.moe_routes import RETURN_ROUTES
from kuberl_wire.protocol import ENGINE_API_KEY_ENV, bearer

T = TypeVar("T")

# sglang-router's header for its `manual` policy: requests with one key go to one engine
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"
# What the router answers when no engine it tried could serve a request (every one gone)
ROUTER_UNSERVED = (500, 502, 503)
ROUTED_ATTEMPTS = 3  # a request the router could not place, sent again after a reroute


class EngineError(RuntimeError):
    """An engine failed: `url` is the engine, `status` the HTTP status if it answered."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        self.url = url
        self.message = message
        self.status = status
        where = f"engine {url}" + (f" (HTTP {status})" if status is not None else "")
        super().__init__(f"{where}: {message}")

    def __reduce__(self) -> tuple[type[EngineError], tuple[str, str, int | None]]:
        # Raised in a Ray actor (a trainer's weight push), it reaches the driver pickled: with
        # its own fields, so the driver can still name the engine.
        return (type(self), (self.url, self.message, self.status))

    @property
    def answered(self) -> bool:
        """The engine is alive and answered (with an error): unlike a dead connection or a
        timeout, it has finished handling the request."""
        return self.status is not None


class GroupBroken(EngineError):
    """A weight update's group broke in the middle of a broadcast (an engine died or stopped
    answering) and was aborted: `url` is the engine that failed, `stuck` the others left in
    the aborted update (or, over NCCL without an abort of their own, not known to be out of
    it), which must be replaced too (weight_sync.sender, engines.fleet)."""

    def __init__(self, url: str, message: str, stuck: Sequence[str] = ()) -> None:
        super().__init__(url, message)
        self.stuck = tuple(stuck)

    def __reduce__(self) -> tuple[Any, ...]:  # (see EngineError's)
        return (type(self), (self.url, self.message, self.stuck))


@dataclass(frozen=True)
class SamplingParams:
    """SGLang sampling params the trainer uses. temperature 0 means greedy. SGLang spells the
    per-request seed `sampling_seed`. `top_k=-1` means the whole vocabulary."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    sampling_seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens,
                               "temperature": self.temperature, "top_p": self.top_p,
                               "top_k": self.top_k}
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            out["ignore_eos"] = True
        if self.sampling_seed is not None:
            out["sampling_seed"] = self.sampling_seed
        return out


@dataclass
class GenerateResult:
    output_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[float] | None  # one per output token, when return_logprob
    weight_version: str | None
    engine_url: str
    meta_info: dict[str, Any] = field(repr=False, default_factory=dict)
    seconds: float = 0.0  # the /generate request it came in, from send to answer
    request: int = 0  # which request that was (this client's count)


def generate_request(input_ids: Sequence[int], sampling_params: Mapping[str, Any], *,
                     return_logprob: bool, lora_path: str | None = None,
                     return_routes: bool = False) -> dict[str, Any]:
    """The /generate body for one tokenized prompt (SGLang's GenerateReqInput fields);
    `lora_path`: the name of a loaded LoRA adapter to generate under (None: the base);
    `return_routes`: ask for the experts each token was routed to (a mixture-of-experts
    model's `meta_info["routed_experts"]`, kuberl_wire.moe_routes)."""
    body = {"input_ids": [int(t) for t in input_ids], "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob}
    if lora_path is not None:
        body["lora_path"] = lora_path
    if return_routes:
        body[RETURN_ROUTES] = True
    return body


# (a loaded LoRA adapter's name on the engines, the weight version it is)
Adapter = tuple[str, str]


def _under(adapter: Adapter | None, result: GenerateResult) -> GenerateResult:
    """`result` of a request that named `adapter`: its weight version is the adapter's (the
    engine reports its base weights', which an adapter does not change)."""
    if adapter is not None:
        result.weight_version = adapter[1]
    return result


def parse_generate_response(url: str, body: Any, *, return_logprob: bool) -> GenerateResult:
    """One /generate answer (SGLang's shape) -> GenerateResult; malformed -> EngineError."""
    try:
        meta = body["meta_info"]
        output_ids = [int(t) for t in body["output_ids"]]
        logprobs = None
        if return_logprob:
            logprobs = [float(entry[0]) for entry in meta["output_token_logprobs"]]
            if len(logprobs) != len(output_ids):
                raise ValueError(f"{len(logprobs)} logprobs for {len(output_ids)} tokens")
        finish = meta.get("finish_reason") or {}
        version = meta.get("weight_version")
        return GenerateResult(
            output_ids=output_ids, text=str(body.get("text", "")),
            finish_reason=str(finish.get("type", "")), prompt_tokens=int(meta["prompt_tokens"]),
            completion_tokens=int(meta["completion_tokens"]), logprobs=logprobs,
            weight_version=None if version is None else str(version), engine_url=url,
            meta_info=meta)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise EngineError(url, f"malformed /generate answer ({exc!r}): {body!r:.300}") from exc


def _error_text(body: str) -> str:
    """SGLang answers errors as {"error": {"message"}}, {"message"} or plain text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body.strip()[:2000] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in data:
            return str(data["message"])
    return body.strip()[:2000]


async def _await_all(aws: Iterable[Awaitable[T]],
                     keep_waiting: Callable[[BaseException], bool]) -> list[T]:
    """Await all; stop at the first exception for which keep_waiting is false, cancel what is
    still running, and raise the first exception in order (every one is retrieved, so none
    is reported as "never retrieved")."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        pending = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            if any((exc := task.exception()) is not None and not keep_waiting(exc)
                   for task in done):
                break
        errors = [exc for task in tasks if task.done() and (exc := task.exception())]
        if errors:
            raise errors[0]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()


async def first_error(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all; on the first exception cancel the rest and raise it (asyncio.gather would
    leave the others running and, with a dead engine, keep the caller waiting on them)."""
    return await _await_all(aws, keep_waiting=lambda exc: False)


def _answered(exc: BaseException) -> bool:
    return isinstance(exc, EngineError) and exc.answered


async def every_answer(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Await all, for requests that must reach every engine even when one of them fails, such
    as a weight-update bucket: every engine must take part in the same collectives, or the
    next bucket's broadcasts pair with the wrong receives (gloo then aborts the engine on a
    size mismatch). An engine's error answer therefore waits for the others to answer, and
    the first error in order is raised after. A failure that is not an answer (dead
    connection, timeout, a non-EngineError such as a failed collective) cancels the rest and
    raises at once, as first_error does: the group is broken anyway."""
    return await _await_all(aws, keep_waiting=_answered)


def engine_api_key() -> str:
    """The engines' API key as this process was given it ("" when none)."""
    return os.environ.get(ENGINE_API_KEY_ENV, "")


class EngineClient:
    """Async client for a fixed set of engine URLs (e.g. "http://10.0.0.5:30000")."""

    def __init__(self, urls: Sequence[str], *, request_timeout_s: float = 600.0,
                 connect_timeout_s: float = 10.0, max_connections: int = 1024,
                 api_key: str | None = None) -> None:
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.request_timeout_s = request_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._headers = bearer(engine_api_key() if api_key is None else api_key)
        self.outstanding = dict.fromkeys(self.urls, 0)
        self._rotation = itertools.cycle(range(len(self.urls)))
        self._session: aiohttp.ClientSession | None = None
        self.lost: set[str] = set()  # out of rotation until replaced (see lose)
        self._lost_events: dict[str, asyncio.Event] = {}
        self._requests = itertools.count(1)
        # Called once when no engine is left mid-rollout, awaited by every chunk (fleet.revive)
        self.revive: Callable[[], Awaitable[None]] | None = None
        self._reviving: asyncio.Future[None] | None = None
        self.router_url: str | None = None  # generation goes through it when set
        self._routed_calls = itertools.count()
        # Behind the router, awaited once by every request it could not place (fleet.reroute)
        self.reroute: Callable[[], Awaitable[None]] | None = None
        self._rerouting: asyncio.Future[None] | None = None
        # The LoRA adapter every /generate names (training.lora.sync: adapter; use_adapter)
        self.adapter: Adapter | None = None
        # Every /generate asks for the experts each token went to (routingReplay: rollout)
        self.return_routes = False

    def use_adapter(self, name: str, version: int) -> None:
        """From now on every /generate names the LoRA adapter `name` (loaded on every engine
        by the trainer: weight_sync/adapter.py), and its results carry `version` as their
        weight version. A request in flight keeps the adapter it named: an engine serves a
        request under one adapter from its first token to its last."""
        self.adapter = (name, str(version))

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _session_now(self) -> aiohttp.ClientSession:
        # Created lazily: a ClientSession belongs to the event loop it was created in.
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                headers=self._headers)
        return self._session

    def live(self) -> list[str]:
        return [u for u in self.urls if u not in self.lost]

    def pick(self) -> str:
        """Least outstanding requests among the engines in rotation; the rotating start spreads
        ties."""
        start = next(self._rotation)
        order = [u for u in self.urls[start:] + self.urls[:start] if u not in self.lost]
        if not order:
            raise EngineError(self.urls[0], "every engine is lost")
        return min(order, key=lambda u: self.outstanding[u])

    def lose(self, url: str) -> bool:
        """Take `url` out of rotation, giving up the requests it holds in generate_spread;
        whether another engine is left to take its work."""
        self.lost.add(url)
        self._lost_event(url).set()
        return bool(self.live())

    def replace(self, old: str, new: str) -> None:
        """The engine at `new` takes the place (and the index) of the one at `old`."""
        new = new.rstrip("/")
        self.urls[self.urls.index(old)] = new
        self.lost.discard(old)
        self.outstanding.pop(old, None)
        self.outstanding[new] = 0

    async def request(self, url: str, method: str, path: str, body: Any = None, *,
                      timeout_s: float | None = None,
                      headers: Mapping[str, str] | None = None) -> Any:
        """One HTTP call; returns the decoded JSON (or text, or None for an empty body)."""
        total = timeout_s if timeout_s is not None else self.request_timeout_s
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout_s)
        try:
            async with self._session_now().request(method, url + path, json=body,
                                                   timeout=timeout, headers=headers) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise EngineError(url, f"{path}: {_error_text(text)}", resp.status)
        except EngineError:
            raise
        except TimeoutError as exc:
            raise EngineError(url, f"{path}: no answer within {total:g}s") from exc
        except aiohttp.ClientConnectorError as exc:
            raise EngineError(url, f"{path}: cannot connect ({exc.os_error})") from exc
        except aiohttp.ClientError as exc:
            raise EngineError(url, f"{path}: {type(exc).__name__}: {exc}") from exc
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            return text

    async def generate_one(self, input_ids: Sequence[int], sampling_params: Mapping[str, Any],
                           *, return_logprob: bool = True, url: str | None = None,
                           ) -> GenerateResult:
        url = url or self.pick()
        adapter = self.adapter
        self.outstanding[url] += 1
        try:
            body = await self.request(url, "POST", "/generate", generate_request(
                input_ids, sampling_params, return_logprob=return_logprob,
                lora_path=adapter and adapter[0], return_routes=self.return_routes))
        finally:
            self.outstanding[url] -= 1
        return _under(adapter, parse_generate_response(url, body, return_logprob=return_logprob))

    async def generate(self, prompts: Sequence[Sequence[int]],
                       sampling_params: Mapping[str, Any] | Sequence[Mapping[str, Any]],
                       *, return_logprob: bool = True) -> list[GenerateResult]:
        """One result per prompt, in order. `sampling_params`: one mapping for all prompts or
        one per prompt (e.g. different `sampling_seed`s)."""
        if isinstance(sampling_params, Mapping):
            per_prompt: Sequence[Mapping[str, Any]] = [sampling_params] * len(prompts)
        else:
            per_prompt = sampling_params
            if len(per_prompt) != len(prompts):
                raise ValueError(f"{len(per_prompt)} sampling_params for {len(prompts)} prompts")
        return await first_error(
            self.generate_one(p, sp, return_logprob=return_logprob)
            for p, sp in zip(prompts, per_prompt, strict=True))

    async def _generate_on(self, url: str, prompts: Sequence[Sequence[int]],
                           sampling_params: Sequence[Mapping[str, Any]],
                           return_logprob: bool) -> list[GenerateResult]:
        adapter = self.adapter
        body = {"input_ids": [[int(t) for t in p] for p in prompts],
                "sampling_params": [dict(sp) for sp in sampling_params],
                "return_logprob": return_logprob}
        if adapter is not None:  # (SGLang's batched form: one per prompt)
            body["lora_path"] = [adapter[0]] * len(prompts)
        if self.return_routes:
            body[RETURN_ROUTES] = True
        sent = time.perf_counter()
        answer = await self.request(url, "POST", "/generate", body)
        seconds = time.perf_counter() - sent
        if not isinstance(answer, list) or len(answer) != len(prompts):
            raise EngineError(url, f"/generate: expected {len(prompts)} answers, got "
                              f"{answer!r:.200}")
        results = [_under(adapter, parse_generate_response(url, a,
                                                           return_logprob=return_logprob))
                   for a in answer]
        request = next(self._requests)
        for result in results:
            result.seconds, result.request = seconds, request
        return results

    async def generate_spread(self, prompts: Sequence[Sequence[int]],
                              sampling_params: Sequence[Mapping[str, Any]], *, group: int = 1,
                              return_logprob: bool = True) -> list[GenerateResult]:
        """All prompts in at most one batched request per engine, concurrently; results in
        order. Prompts come in consecutive groups of `group` (a GRPO group), and a group is
        never split: its samples are generated together, by one engine's weights."""
        if group < 1 or len(prompts) % group:
            raise ValueError(f"{len(prompts)} prompts are not whole groups of {group}")
        if self.router_url is not None:
            return await self._generate_routed(self.router_url, prompts, sampling_params,
                                               group, return_logprob)
        groups = len(prompts) // group
        chunks = max(1, min(len(self.live()), groups))
        bounds = [round(i * groups / chunks) * group for i in range(chunks + 1)]
        # Tasks start in order and each takes its engine (pick) before its first await, so
        # the chunks land on different engines.
        parts = await first_error(
            self.generate_batch(prompts[a:b], sampling_params[a:b],
                                return_logprob=return_logprob)
            for a, b in itertools.pairwise(bounds))
        return [result for part in parts for result in part]

    async def _generate_routed(self, router: str, prompts: Sequence[Sequence[int]],
                               sampling_params: Sequence[Mapping[str, Any]], group: int,
                               return_logprob: bool) -> list[GenerateResult]:
        """generate_spread through the router: a request per sample, a routing key per
        group. A request the router could not place (no engine it tried answered: its
        retries stay with the engine that holds the group's key) waits for `reroute` (the
        fleet takes the dead engines out) and is sent again; its seed makes the same
        sample."""
        call = next(self._routed_calls)

        async def one(i: int) -> GenerateResult:
            headers = {ROUTING_KEY_HEADER: f"{id(self):x}-{call}-{i // group}"}
            adapter = self.adapter
            body = generate_request(prompts[i], sampling_params[i],
                                    return_logprob=return_logprob,
                                    lora_path=adapter and adapter[0],
                                    return_routes=self.return_routes)
            attempt = 0
            while True:
                attempt += 1
                sent = time.perf_counter()
                try:
                    answer = await self.request(router, "POST", "/generate", body,
                                                headers=headers)
                except EngineError as exc:
                    if (exc.status not in ROUTER_UNSERVED or self.reroute is None
                            or attempt == ROUTED_ATTEMPTS):
                        raise
                    if self._rerouting is None or self._rerouting.done():
                        self._rerouting = asyncio.ensure_future(self.reroute())
                    await asyncio.shield(self._rerouting)
                    continue
                result = _under(adapter, parse_generate_response(
                    router, answer, return_logprob=return_logprob))
                # (the router does not say which engine answered)
                result.engine_url, result.seconds = "", time.perf_counter() - sent
                return result

        return await first_error(one(i) for i in range(len(prompts)))

    async def generate_batch(self, prompts: Sequence[Sequence[int]],
                             sampling_params: Sequence[Mapping[str, Any]], *,
                             return_logprob: bool = True) -> list[GenerateResult]:
        """Several prompts in ONE /generate request (SGLang's batched form: lists of
        input_ids and sampling_params) to one engine (the least loaded): one round trip, and
        the engine gets them all at once instead of gathering n requests again.
        `generate_spread` sends a step's prompts as one such request per engine. Sent again
        to another engine when its engine is lost: its connection failed, or `lose` was
        called on it meanwhile (a health probe found it silent: the request is given up at
        once). An engine's error answer is raised."""
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        while True:
            url = self.pick()
            # Counted before the first await: the next chunk's pick sees this one's load.
            self.outstanding[url] += len(prompts)
            request = asyncio.ensure_future(self._generate_on(url, prompts, sampling_params,
                                                              return_logprob))
            lost = asyncio.ensure_future(self._lost_event(url).wait())
            try:
                await asyncio.wait({request, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
                if not request.done():  # lost meanwhile, or this chunk was cancelled
                    request.cancel()
                    with contextlib.suppress(asyncio.CancelledError, EngineError):
                        await request
                if url in self.outstanding:  # (not if replaced meanwhile)
                    self.outstanding[url] -= len(prompts)
            if not request.cancelled():
                try:
                    return request.result()
                except EngineError as exc:
                    if exc.answered or (not self.lose(exc.url) and self.revive is None):
                        raise
            if not self.live():
                await self._revived(url)

    async def _revived(self, url: str) -> None:
        """Wait until the lost engines are replaced (one `revive` for every waiting chunk)."""
        if self.revive is None:
            raise EngineError(url, "stopped answering, and no other engine is left")
        if self._reviving is None or self._reviving.done():
            self._reviving = asyncio.ensure_future(self.revive())
        await asyncio.shield(self._reviving)  # (a cancelled chunk leaves it running)

    def _lost_event(self, url: str) -> asyncio.Event:
        return self._lost_events.setdefault(url, asyncio.Event())

    async def post_all(self, path: str, body: Any | Sequence[Any], *,
                       timeout_s: float | None = None, per_engine: bool = False,
                       in_step: bool = False) -> list[Any]:
        """POST to every engine concurrently (the same body, or with per_engine one body per
        engine); answers in engine order. SGLang's weight endpoints answer {success, message}
        with HTTP 200 or 400, so `success: false` is turned into EngineError here too.
        The first failure cancels the other requests, unless `in_step`: then an engine's error
        answer waits for the others' answers (see every_answer)."""
        bodies = list(body) if per_engine else [body] * len(self.urls)
        if len(bodies) != len(self.urls):
            raise ValueError(f"{len(bodies)} bodies for {len(self.urls)} engines")
        settle = every_answer if in_step else first_error
        return await settle(self.post(u, path, b, timeout_s=timeout_s)
                            for u, b in zip(self.urls, bodies, strict=True))

    async def post(self, url: str, path: str, body: Any, *,
                   timeout_s: float | None = None) -> Any:
        """POST to one engine; `success: false` (SGLang's weight endpoints) as EngineError."""
        answer = await self.request(url, "POST", path, body, timeout_s=timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(url, f"{path}: {answer.get('message', '')}", 200)
        return answer

    async def wait_healthy(self, timeout_s: float = 120.0, interval_s: float = 0.2,
                           exited: Callable[[], Mapping[str, int]] | None = None,
                           urls: Sequence[str] | None = None) -> None:
        """Until every engine (or those at `urls`) answers GET /health with 200; EngineError
        naming the engines still unhealthy (and why) after timeout_s. `exited` (engine URL ->
        exit code of its server process) ends the wait at once when a server dies while
        starting (a bad flag, a model it cannot load), instead of after the whole timeout."""
        deadline = time.monotonic() + timeout_s
        waiting = set(self.urls if urls is None else urls)
        last: dict[str, str] = {}
        while waiting:
            gone = exited() if exited is not None else {}
            if gone:
                url, code = sorted(gone.items())[0]
                raise EngineError(url, f"exited with code {code} while starting")
            for url in sorted(waiting):
                try:
                    await self.request(url, "GET", "/health",
                                       timeout_s=max(1.0, min(5.0, timeout_s)))
                    waiting.discard(url)
                except EngineError as exc:
                    last[url] = exc.message
            if not waiting:
                return
            if time.monotonic() > deadline:
                detail = "; ".join(f"{u}: {last.get(u, '?')}" for u in sorted(waiting))
                raise EngineError(sorted(waiting)[0],
                                  f"not healthy within {timeout_s:g}s ({detail})")
            await asyncio.sleep(interval_s)

    async def get_model_info(self, url: str) -> dict[str, Any]:
        info = await self.request(url, "GET", "/get_model_info")
        if not isinstance(info, dict):
            raise EngineError(url, f"/get_model_info: unexpected answer {info!r:.200}")
        return info
