"""The reference engine's HTTP server: SGLang's native API subset (docs/trainer-contracts.md).

Threads: aiohttp's event loop parses requests and answers /health at once; everything that
touches torch (generation batches, weight updates, checksums, memory moves) runs on one worker
thread, in submission order. A weight update therefore waits for the running batch and the
next batch waits for the update, as in SGLang, without locks.

Errors: /generate and friends answer {"error": {"message"}} (SGLang's shape) with 400 for a bad
request, 503 while memory is released, 500 for a bug; weight endpoints answer
{"success": false, "message"} with 400, as SGLang does.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from aiohttp import web

from kuberl_rollout.reference import weights
from kuberl_rollout.reference.batcher import Batcher
from kuberl_rollout.reference.engine import EngineBusy, GenRequest, ReferenceEngine
from kuberl_rollout.reference.sampling import parse_sampling
from kuberl_rollout.reference.tp import Peers

LOG = logging.getLogger("kuberl.reference")
T = TypeVar("T")

# GenerateReqInput fields this engine implements; other SGLang fields are refused with 400
# rather than silently ignored (the trainer would get different behaviour than from SGLang).
_GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "rid", "stream",
                    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"}


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
                 peers: Peers | None = None) -> None:
        self.engine = engine
        # Tensor parallel ranks 1..N-1 (tp.py): every weight and memory operation runs on
        # them too, in step with rank 0's.
        self.peers = peers
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.batcher = Batcher(engine.generate, self.worker, max_batch_size=max_batch_size,
                               max_wait_s=batch_wait_s)
        self.receiver = weights.Receiver(engine, timeout_s=weight_sync_timeout_s)
        self.seq = 0
        self.live: set[str] = set()

    async def on_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors_as_json], client_max_size=1 << 31)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/release_memory_occupation", self.release_memory)
        r.add_route("*", "/resume_memory_occupation", self.resume_memory)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_distributed)
        r.add_post("/update_weights_from_tensor", self.update_tensor)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_get("/get_weights_checksum", self.checksums)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self.batcher.start()

    async def _stop(self, _: web.Application) -> None:
        await self.batcher.stop()
        self.worker.shutdown(wait=False, cancel_futures=True)

    # ---- generation -------------------------------------------------------------------------

    def _requests(self, body: Mapping[str, Any]) -> tuple[list[GenRequest], bool]:
        unknown = sorted(set(body) - _GENERATE_FIELDS)
        if unknown:
            raise HttpError(400, f"unsupported /generate fields {unknown} (the reference "
                                 "engine implements the subset the trainer uses)")
        if body.get("stream"):
            raise HttpError(400, "stream is not supported by the reference engine")
        if body.get("logprob_start_len") not in (None, -1) or body.get("top_logprobs_num"):
            raise HttpError(400, "only output-token logprobs are supported "
                                 "(logprob_start_len -1, top_logprobs_num 0)")
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
        rid = body.get("rid")
        if isinstance(rid, list):
            rids = [str(r) for r in _per_item(rid, n, "rid")]
        elif rid is not None:
            rids = [str(rid)] if single else [f"{rid}_{i}" for i in range(n)]
        else:
            rids = [uuid.uuid4().hex for _ in range(n)]
        reqs = []
        for prompt, sp, lp, r in zip(prompts, params, logprob, rids, strict=True):
            self.seq += 1
            reqs.append(self.engine.make_request(prompt, parse_sampling(sp), rid=r,
                                                 seq=self.seq, return_logprob=bool(lp)))
        return reqs, single

    async def generate(self, request: web.Request) -> web.Response:
        if self.engine.released:
            raise EngineBusy(f"memory released ({sorted(self.engine.released)}); "
                             "call /resume_memory_occupation first")
        reqs, single = self._requests(await _body(request))
        rids = [r.rid for r in reqs]
        self.live.update(rids)
        try:
            results = await self.batcher.submit_many(reqs)
        finally:
            self.live.difference_update(rids)
            self.engine.aborted_rids.difference_update(rids)
        return web.json_response(results[0] if single else results)

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("abort_all"):
            self.engine.abort_all_upto = self.seq
        elif body.get("rid") and body["rid"] in self.live:
            self.engine.aborted_rids.add(str(body["rid"]))
        return web.json_response({})

    # ---- health and info --------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def health_generate(self, _: web.Request) -> web.Response:
        if self.engine.released:
            return web.Response(status=503, text="memory released")
        self.seq += 1
        req = self.engine.make_request([0], parse_sampling({"max_new_tokens": 1,
                                                            "temperature": 0.0}),
                                       rid=f"HEALTH_CHECK_{time.time()}", seq=self.seq,
                                       return_logprob=False)
        await self.batcher.submit(req)
        return web.Response(status=200)

    async def model_info(self, _: web.Request) -> web.Response:
        e = self.engine
        return web.json_response({"model_path": e.model_path, "tokenizer_path": e.tokenizer_path,
                                  "is_generation": True, "weight_version": e.weight_version})

    async def weight_version(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def flush_cache(self, _: web.Request) -> web.Response:
        # No prefix cache to flush: every batch builds its KV cache from scratch.
        return web.Response(text="Cache flushed.\n")

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

        def local(_: Any) -> dict[str, str]:
            return self.engine.checksums()

        def every_rank() -> list[Any]:
            return [local(None)] if self.peers is None else self.peers.run("checksums", None,
                                                                             local)
        return web.json_response({"tp_ranks": await self.on_worker(every_rank)})

    # ---- memory -----------------------------------------------------------------------------

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags")
        await self.on_worker(self._on_all_ranks, "release", self.engine.release, tags)
        return web.json_response({"success": True, "message": f"released {tags or 'all'}"})

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = (await _body(request)).get("tags")
        await self.on_worker(self._on_all_ranks, "resume", self.engine.resume, tags)
        return web.json_response({"success": True, "message": f"resumed {tags or 'all'}"})

    # ---- weight sync ------------------------------------------------------------------------

    async def _weight_op(self, op: str, fn: Callable[[Any], str], body: Any) -> web.Response:
        try:
            message = await self.on_worker(self._on_all_ranks, op, fn, body)
        except (ValueError, KeyError, EngineBusy, RuntimeError) as exc:
            LOG.warning("weight operation failed: %s", exc)
            return web.json_response({"success": False, "message": str(exc)}, status=400)
        return web.json_response({"success": True, "message": message})

    async def init_group(self, request: web.Request) -> web.Response:
        return await self._weight_op("init_group", self.receiver.init_group,
                                     await _body(request))

    async def update_distributed(self, request: web.Request) -> web.Response:
        return await self._weight_op("update_from_distributed",
                                     self.receiver.update_from_distributed,
                                     await _body(request))

    async def update_tensor(self, request: web.Request) -> web.Response:
        return await self._weight_op("update_from_tensor", self.receiver.update_from_tensor,
                                     await _body(request))

    async def destroy_group(self, request: web.Request) -> web.Response:
        return await self._weight_op("destroy_group", self.receiver.destroy_group,
                                     await _body(request))
