"""The reference engine's HTTP server: SGLang's native API subset (docs/engine-contract.md).

Threads: aiohttp's event loop parses requests and answers /health at once; everything that
touches torch (generation steps, weight updates, checksums, memory moves) runs on one worker
thread, in submission order, so the other work runs between two steps of the running batch
(batcher.py: continuous batching). A weight update or memory release while generation is not
paused first waits for the /generate requests in flight, new ones waiting behind it, as
SGLang's model_update_lock has it (update_gate.py).

Errors: /generate and friends answer {"error": {"message"}} (SGLang's shape) with 400 for a bad
request, 503 while memory is released, 500 for a bug; weight endpoints answer
{"success": false, "message"} with 400, as SGLang does.

Pausing (SGLang's /pause_generation, /continue_generation): while paused, new /generate
requests wait before they are validated or queued (SGLang's tokenizer manager waits on its
pause condition there). "abort" ends every request in flight (finish_reason abort) and answers
once none is left; "retract" and "in_place" stop the running batch after its current step and
hold its requests, with the tokens they have, until /continue_generation, when they resume by
recomputing prompt and tokens (SGLang's retract does the same; its in_place keeps the KV cache).

A test's fault switch (fault.py, never used by kuberl): armed, the engine dies as the next
weight-update bucket arrives, its peers in the group left to find out nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from aiohttp import web

from kuberl_rollout.reference import fault, weights
from kuberl_rollout.reference.batcher import Batcher
from kuberl_rollout.reference.engine import EngineBusy, GenRequest, ReferenceEngine
from kuberl_rollout.reference.lora_service import LoraService
from kuberl_rollout.reference.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, EngineMetrics
from kuberl_rollout.reference.sampling import parse_sampling
from kuberl_rollout.reference.tp import Peers
from kuberl_rollout.reference.update_gate import UpdateGate
from kuberl_wire.protocol import api_key_exempt

LOG = logging.getLogger("kuberl.reference")
T = TypeVar("T")

# GenerateReqInput fields the reference engine implements (SGLang's names and meanings).
_GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "rid",
                    "return_text_in_logprobs", "lora_path", "return_routed_experts"}
# GenerateReqInput fields SGLang has and the reference engine does not implement: accepted at
# the values that change nothing (SGLang's defaults), refused with 400 otherwise, since the
# engine would behave differently from SGLang. A field SGLang does not know is ignored, as
# SGLang's HTTP layer ignores extra JSON keys when it builds GenerateReqInput; fields that only
# label, log or route a request (priority, log_metrics, custom_labels, ...) fall under that.
_DEFAULT_ONLY_FIELDS: dict[str, tuple[Any, ...]] = {
    "stream": (None, False), "logprob_start_len": (None, -1), "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,), "input_embeds": (None,), "image_data": (None,),
    "video_data": (None,), "audio_data": (None,), "return_hidden_states": (None, False),
    "return_prompt_token_ids": (None, False),
    "session_params": (None,), "lora_id": (None,),
    "custom_logit_processor": (None,), "bootstrap_host": (None,), "bootstrap_port": (None,),
    "bootstrap_room": (None,), "bootstrap_pair_key": (None,),
    "data_parallel_rank": (None, 0), "routed_dp_rank": (None, 0),
}
PAUSE_MODES = ("abort", "retract", "in_place")
# SGLang's /flush_cache body, the same for success (200) and failure (400).
FLUSH_TEXT = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
              "running or waiting requests, the operation will not be performed.)\n")
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
EVENT_LOG_SIZE = 4096


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def errors_as_json(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except HttpError as exc:
        return _error(exc.status, exc.message)
    except EngineBusy as exc:
        return _error(503, str(exc))
    except ValueError as exc:
        return _error(400, str(exc))
    except web.HTTPException:
        raise
    except Exception as exc:
        LOG.exception("%s %s failed", request.method, request.path)
        return _error(500, f"{type(exc).__name__}: {exc}")


def api_key_check(api_key: str) -> Any:
    """SGLang 0.5.6's --api-key middleware (`add_api_key_middleware`), the same paths and
    answer: OPTIONS, /health* and /metrics* pass; any other request without exactly
    `Authorization: Bearer <api_key>` is answered 401 {"error": "Unauthorized"}."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if (not api_key_exempt(request.method, request.path)
                and request.headers.get("Authorization") != f"Bearer {api_key}"):
            return web.json_response({"error": "Unauthorized"}, status=401)
        response: web.StreamResponse = await handler(request)
        return response

    return check


async def _body(request: web.Request) -> dict[str, Any]:
    if not request.can_read_body:
        return {}
    try:
        data = await request.json()
    except ValueError as exc:
        raise HttpError(400, f"request body is not JSON: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HttpError(400, "request body must be a JSON object")
    return data


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """SGLang batch semantics: a list gives one value per prompt, a scalar/object applies to
    all."""
    if isinstance(value, list):
        if len(value) != n:
            raise HttpError(400, f"{name} has {len(value)} entries for {n} prompts")
        return value
    return [value] * n


class Server:
    def __init__(self, engine: ReferenceEngine, *, max_batch_size: int = 256,
                 batch_wait_s: float = 0.005, weight_sync_timeout_s: float = 300.0,
                 peers: Peers | None = None,
                 server_args: Mapping[str, Any] | None = None,
                 enable_metrics: bool = False, api_key: str = "",
                 max_prefill_tokens: int = 16384, continuous: bool = True,
                 max_loaded_loras: int | None = None) -> None:
        """LoRA is on when the engine holds adapters (engine.adapters: --enable-lora)."""
        self.engine = engine
        self.api_key = api_key  # "" (SGLang's None): every request is served
        self.max_batch_size = max_batch_size
        # What /server_info reports as the launch arguments (the CLI's, when given).
        self.server_args = dict(server_args or {})
        # Tensor parallel ranks 1..N-1 (tp.py): every weight and memory operation runs on
        # them too, in step with rank 0's.
        self.peers = peers
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.batcher = Batcher(engine.step, self.worker, max_batch_size=max_batch_size,
                               max_wait_s=batch_wait_s, max_prefill_tokens=max_prefill_tokens,
                               join_running=continuous and engine.joins_running_batch,
                               max_adapters=None if engine.adapters is None
                               else engine.adapters.max_loras_per_batch)
        self.lora = LoraService(enabled=engine.adapters is not None,
                                max_loaded_loras=max_loaded_loras,
                                load=engine.load_adapter, unload=engine.unload_adapter,
                                on_worker=self.on_worker)
        self.receiver = weights.Receiver(engine, timeout_s=weight_sync_timeout_s)
        self.seq = 0
        self.live: set[str] = set()
        self.pause_mode: str | None = None  # None: not paused
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.gate = UpdateGate(lambda: self.pause_mode is not None)
        self.die_at_next_bucket = False  # armed by fault.SIGNAL (__main__)
        self._warned_routes = False  # (routes asked of an engine without the flag: once)
        # What the engine was asked to do, in order (GET /get_event_log, a kuberl extension):
        # tests check a run's sequence of generation, memory and weight operations against it.
        self.events: deque[dict[str, Any]] = deque(maxlen=EVENT_LOG_SIZE)
        self.metrics = EngineMetrics(
            engine.model_path, running=lambda: len(self.batcher.running),
            queued=lambda: self.batcher.num_waiting() + self.batcher.num_held(),
        ) if enable_metrics else None

    def record(self, op: str, **detail: Any) -> None:
        self.events.append({"op": op, **detail})

    async def on_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def app(self) -> web.Application:
        checks = [api_key_check(self.api_key)] if self.api_key else []
        app = web.Application(middlewares=[*checks, errors_as_json], client_max_size=1 << 31)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health_generate)  # SGLang 0.5.6: the same handler
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_post("/update_weights_from_tensor", self.update_tensor)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_post("/abort_weights_update_group", self.abort_group)  # kuberl's own
        r.add_post("/load_lora_adapter", self.lora.load_route)
        r.add_post("/unload_lora_adapter", self.lora.unload_route)
        r.add_get("/get_weights_checksum", self.checksums)
        r.add_get("/get_event_log", self.event_log)
        if self.metrics is not None:  # (SGLang serves /metrics only with --enable-metrics)
            r.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.batcher.start()

    async def _stop(self, _: web.Application) -> None:
        await self.batcher.stop()
        self.worker.shutdown(wait=False, cancel_futures=True)

    # ---- generation -------------------------------------------------------------------------

    def _requests(self, body: Mapping[str, Any], lora_ids: list[str | None] | str | None = None
                  ) -> tuple[list[GenRequest], bool]:
        changed = sorted(k for k, ok in _DEFAULT_ONLY_FIELDS.items()
                         if k in body and not any(body[k] == v and type(body[k]) is type(v)
                                                  for v in ok))
        if changed:
            raise HttpError(400, f"/generate fields {changed} are not supported by the "
                                 "reference engine except at SGLang's defaults "
                                 f"({ {k: _DEFAULT_ONLY_FIELDS[k][-1] for k in changed} })")
        if (body.get("text") is None) == (body.get("input_ids") is None):
            raise HttpError(400, "give exactly one of text or input_ids")
        if body.get("text") is not None:
            text = body["text"]
            single = isinstance(text, str)
            texts = [text] if single else list(text)
            if not all(isinstance(t, str) for t in texts):
                raise HttpError(400, "text must be a string or a list of strings")
            prompts = [self.engine.tokenize(t) for t in texts]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise HttpError(400, "input_ids must be a non-empty list")
            single = not isinstance(ids[0], list)
            prompts = [ids] if single else ids
        n = len(prompts)
        if n == 0:
            raise HttpError(400, "empty batch")
        params = _per_item(body.get("sampling_params"), n, "sampling_params")
        logprob = _per_item(body.get("return_logprob"), n, "return_logprob")
        text_lp = _per_item(body.get("return_text_in_logprobs"), n, "return_text_in_logprobs")
        routes = _per_item(body.get("return_routed_experts"), n, "return_routed_experts")
        if any(routes) and not self.engine.return_routes and not self._warned_routes:
            # SGLang (>= 0.5.7) without --enable-return-routed-experts serves the request and
            # its answer has no routed_experts (its capturer is a no-op): so does this one.
            LOG.warning("return_routed_experts asked of an engine started without "
                        "--enable-return-routed-experts: answered without routed_experts")
            self._warned_routes = True
        rid = body.get("rid")
        if isinstance(rid, list):
            rids = [str(r) for r in _per_item(rid, n, "rid")]
        elif rid is not None:
            rids = [str(rid)] if single else [f"{rid}_{i}" for i in range(n)]
        else:
            rids = [uuid.uuid4().hex for _ in range(n)]
        adapters = _per_item(lora_ids, n, "lora_path")
        reqs = []
        for prompt, sp, lp, r, tl, lora, rt in zip(prompts, params, logprob, rids, text_lp,
                                                   adapters, routes, strict=True):
            self.seq += 1
            reqs.append(self.engine.make_request(prompt, parse_sampling(sp), rid=r,
                                                 seq=self.seq, return_logprob=bool(lp),
                                                 return_text_in_logprobs=bool(tl),
                                                 lora_id=lora, return_routes=bool(rt)))
        return reqs, single

    async def generate(self, request: web.Request) -> web.Response:
        body = await _body(request)
        await self.unpaused.wait()  # SGLang: requests wait out a pause before tokenizing
        async with self.gate.generating():  # (and behind a weight update that waits)
            if self.engine.released:
                self.record("generate_refused", released=sorted(self.engine.released))
                raise EngineBusy(f"memory released ({sorted(self.engine.released)}); "
                                 "call /resume_memory_occupation first")
            # SGLang resolves lora_path (re-loading an unloaded name) before tokenizing.
            lora_ids = await self.lora.acquire(body.get("lora_path"))
            try:
                reqs, single = self._requests(body, lora_ids)
                self.record("generate", requests=len(reqs))
                rids = [r.rid for r in reqs]
                self.live.update(rids)
                try:
                    results = await self.batcher.submit_many(reqs)
                finally:
                    self.live.difference_update(rids)
                    self.engine.aborted_rids.difference_update(rids)
            finally:
                await self.lora.release(lora_ids)
        if self.metrics is not None:
            self.metrics.finished(results)
        return web.json_response(results[0] if single else results)

    async def prometheus(self, _: web.Request) -> web.Response:
        assert self.metrics is not None
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("abort_all"):
            self.abort_all()
        elif body.get("rid") and body["rid"] in self.live:
            self.engine.aborted_rids.add(str(body["rid"]))
            self._answer_aborted()
        return web.json_response({})

    def abort_all(self) -> None:
        """Every request in flight finishes as aborted: running ones after their current step,
        waiting or held ones at once (requests still waiting out a pause are not in flight)."""
        self.engine.abort_all_upto = self.seq
        self._answer_aborted()

    def _answer_aborted(self) -> None:
        self.batcher.abort_waiting(self.engine.is_aborted, self.engine.abort_result)

    # ---- pause / continue -------------------------------------------------------------------

    async def pause_generation(self, request: web.Request) -> web.Response:
        """SGLang's PauseGenerationReqInput: {mode: "abort" (default) | "retract" | "in_place"}."""
        mode = (await _body(request)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise HttpError(400, f"Invalid mode: {mode!r}. Expected one of {list(PAUSE_MODES)}.")
        self.pause_mode = mode
        self.unpaused.clear()
        if mode == "abort":
            # SGLang aborts everything and answers once no request is left in flight.
            while self.live:
                self.abort_all()
                await asyncio.sleep(0.01)
        else:
            self.engine.suspend = True
            self.batcher.suspend()
        await self.gate.paused()
        self.record("pause_generation", mode=mode)
        return web.json_response({"message": "Generation paused successfully.",
                                  "status": "ok"})

    async def continue_generation(self, _: web.Request) -> web.Response:
        self.pause_mode = None
        self.engine.suspend = False
        self.batcher.resume()
        self.unpaused.set()
        self.record("continue_generation")
        return web.json_response({"message": "Generation continued successfully.",
                                  "status": "ok"})

    # ---- health and info --------------------------------------------------------------------

    async def health_generate(self, _: web.Request) -> web.Response:
        """SGLang's /health and /health_generate: healthy once the engine has produced any
        output since the check arrived (a running batch's next token, or the one token of a
        request the check sends), unhealthy (503) if nothing comes within its timeout: while
        paused, while released, or stuck (in a long weight update, say)."""
        if self.engine.released:
            return web.Response(status=503, text="memory released")
        arrived = time.monotonic()
        try:  # a paused SGLang engine gets no answer within its health-check timeout
            await asyncio.wait_for(self.unpaused.wait(), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503, text="generation paused")
        self.seq += 1
        req = self.engine.make_request([0], parse_sampling({"max_new_tokens": 1,
                                                            "temperature": 0.0}),
                                       rid=f"HEALTH_CHECK_{time.time()}", seq=self.seq,
                                       return_logprob=False)
        check = asyncio.ensure_future(self.batcher.submit(req))
        deadline = arrived + HEALTH_CHECK_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if check.done() or self.engine.last_output > arrived:
                    return web.Response(status=200)
                await asyncio.sleep(0.05)
        finally:
            if not check.done():  # (a running batch answered for it: dropped, as SGLang's)
                check.cancel()
        return web.Response(status=503, text="no output within the health-check timeout")

    async def model_info(self, _: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({"model_path": e.model_path, "tokenizer_path": e.tokenizer_path,
                                  "is_generation": True, "weight_version": e.weight_version})

    async def weight_version(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def flush_cache(self, _: web.Request) -> web.Response:
        """SGLang flushes only when no batch is running and answers 400 otherwise (0.5.6's
        Scheduler._is_no_request looks at the running, last and current batches, not the
        waiting queue: requests retracted by pause(retract) wait there and hold no KV cache,
        so kuberl's and slime's flush after pause(retract) succeeds; an in_place pause keeps
        them in the running batch, and the flush fails). There is no prefix cache
        to flush here (every request's KV cache is built when it joins); what a client observes is
        whether the flush would succeed."""
        waiting = self.batcher.num_waiting() + self.batcher.num_held()
        # An in_place pause leaves SGLang's requests in the running batch (here: held), with
        # their KV cache.
        in_place = self.pause_mode == "in_place" and self.batcher.num_held() > 0
        idle = not self.batcher.running and not in_place
        if not idle:
            LOG.info("cache not flushed: %d running, %d waiting", len(self.batcher.running),
                     waiting)
        self.record("flush_cache" if idle else "flush_cache_refused")
        return web.Response(text=FLUSH_TEXT, status=200 if idle else 400)

    async def server_info(self, _: web.Request) -> web.Response:
        """SGLang's /get_server_info (alias /server_info): the launch arguments, the scheduler's
        limits and per-rank internal state. Only what the reference engine can report truly."""
        e = self.engine
        args = {"model_path": e.model_path, "tokenizer_path": e.tokenizer_path,
                "tp_size": 1 if self.peers is None else self.peers.size,
                "context_length": e.context_len, "device": e.device.type,
                "dtype": str(e.model.dtype).removeprefix("torch."),
                "max_running_requests": self.max_batch_size, **self.server_args}
        return web.json_response({
            **args,
            "weight_version": e.weight_version,
            # No KV pool: a batch holds at most max_batch_size sequences of context_len tokens.
            "max_total_num_tokens": self.max_batch_size * e.context_len,
            "internal_states": [{"paused": self.pause_mode,
                                 "released_memory": sorted(e.released)}],
            "version": "kuberl-reference",
        })

    async def loads(self, _: web.Request) -> web.Response:
        """SGLang's /v1/loads: one entry per data-parallel rank (here one), core fields."""
        running = self.batcher.running
        waiting = ([r for r, f in self.batcher.waiting if not f.done()]
                   + [r for r, f in self.batcher.held if not f.done()])
        used = sum(len(r.input_ids) + len(r.output_ids) for r in running)
        pending = sum(len(r.input_ids) + len(r.output_ids) for r in waiting)
        capacity = self.max_batch_size * self.engine.context_len
        now = time.time()
        return web.json_response({"timestamp": now, "dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "timestamp": now,
            "num_running_reqs": len(running), "num_waiting_reqs": len(waiting),
            "num_used_tokens": used, "num_total_tokens": used + pending,
            "max_total_num_tokens": capacity, "token_usage": used / capacity,
            "max_running_requests": self.max_batch_size,
            "queues": {"waiting": self.batcher.num_waiting(), "grammar": 0,
                       "paused": self.batcher.num_held(), "retracted": 0},
        }]})

    def _on_all_ranks(self, op: str, local: Callable[[Any], T], body: Any) -> T:
        """`local(body)` here and `op` on the peer ranks (worker thread); rank 0's result."""
        if self.peers is None:
            return local(body)
        return cast(T, self.peers.run(op, body, local)[0])

    async def checksums(self, request: web.Request) -> web.Response:
        """Rank 0's {name: sha256}; with ?all_ranks=true, {"tp_ranks": [one per TP rank]}
        (a kuberl extension: weights must be exact on every TP process after a sync)."""
        if request.query.get("all_ranks", "").lower() not in ("1", "true"):
            return web.json_response(await self.on_worker(self.engine.checksums))

        return web.json_response({"tp_ranks": await self.on_worker(
            self._each_rank, "checksums", lambda _: self.engine.checksums())})

    def _each_rank(self, op: str, local: Callable[[Any], T]) -> list[T]:
        """Every TP rank's answer to `op` (worker thread), in rank order."""
        return [local(None)] if self.peers is None else self.peers.run(op, None, local)

    async def event_log(self, _: web.Request) -> web.Response:
        """The operations asked of this engine, oldest first (the last EVENT_LOG_SIZE): a
        kuberl extension, as /get_weights_checksum."""
        return web.json_response({"events": list(self.events)})

    # ---- memory -----------------------------------------------------------------------------

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags")
        async with self.gate.updating():  # (SGLang asserts that no request is in flight)
            await self.on_worker(self._on_all_ranks, "release", self.engine.release, tags)
        self.record("release_memory", tags=tags)
        return web.json_response({"success": True, "message": f"released {tags or 'all'}"})

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags")
        await self.on_worker(self._on_all_ranks, "resume", self.engine.resume, tags)
        self.record("resume_memory", tags=tags)
        return web.json_response({"success": True, "message": f"resumed {tags or 'all'}"})

    # ---- weight sync ------------------------------------------------------------------------

    async def _weight_op(self, op: str, fn: Callable[[Any], str], body: Any) -> web.Response:
        try:
            if op.startswith("update_"):  # not beside requests in flight (update_gate.py)
                async with self.gate.updating():
                    message = await self.on_worker(self._on_all_ranks, op, fn, body)
            else:
                message = await self.on_worker(self._on_all_ranks, op, fn, body)
        except (ValueError, KeyError, EngineBusy, RuntimeError) as exc:
            LOG.warning("weight operation failed: %s", exc)
            self.record(f"{op}_failed")
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        detail: dict[str, Any] = {}
        if op == "update_from_tensor":  # which GPU each rank's tensors came from
            detail["ranks"] = await self.on_worker(self._each_rank, "tensor_sources",
                                                   self.receiver.tensor_sources)
        self.record(op, weight_version=self.engine.weight_version, **detail)
        return web.json_response({"success": True, "message": message})

    async def init_group(self, request: web.Request) -> web.Response:
        return await self._weight_op("init_group", self.receiver.init_group,
                                     await _body(request))

    async def _update_body(self, request: web.Request) -> dict[str, Any]:
        """An update's body; its abort_all_requests (SGLang's field) aborts every request in
        flight before the update runs, which then waits for the running batch to stop."""
        body = await _body(request)
        if body.get("abort_all_requests"):
            self.abort_all()
        return body

    async def update_distributed(self, request: web.Request) -> web.Response:
        if self.die_at_next_bucket:  # the fault switch: no answer, no clean-up
            fault.vanish(int(self.server_args.get("port", 0)), self.receiver.timeout_s)
        return await self._weight_op("update_from_distributed",
                                     self.receiver.update_from_distributed,
                                     await self._update_body(request))

    async def update_tensor(self, request: web.Request) -> web.Response:
        return await self._weight_op("update_from_tensor", self.receiver.update_from_tensor,
                                     await self._update_body(request))

    async def destroy_group(self, request: web.Request) -> web.Response:
        return await self._weight_op("destroy_group", self.receiver.destroy_group,
                                     await _body(request))

    async def abort_group(self, request: web.Request) -> web.Response:
        """kuberl's own endpoint (SGLang 0.5.6 has none: docs/engine-contract.md): every rank
        leaves the group at once. Not on the worker thread, which may be the one blocked in
        the group's receive; the TP ranks are told over their connections, past the
        operation they may be in. Answers {success, message} as the weight endpoints do."""
        body = await _body(request)
        message = await asyncio.to_thread(self.receiver.abort_group, body)
        if self.peers is not None:
            await asyncio.to_thread(self.peers.abort, body)
        self.record("abort_group", group_name=body.get("group_name"))
        return web.json_response({"success": True, "message": message})
