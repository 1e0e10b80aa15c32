"""The reference engine's HTTP server with `--is-embedding`: SGLang 0.5.6's native API for a
reward (sequence classification) model, over classifier.py.

What SGLang 0.5.6 does, read in its source (sglang/srt/entrypoints/http_server.py,
managers/io_struct.py EmbeddingReqInput, managers/tokenizer_manager.py,
managers/scheduler_output_processor_mixin.py), and what this server does:

- POST|PUT /classify and /encode (one handler in SGLang, for any embedding model): a body of
  EmbeddingReqInput, `text` (a string or a list of them) or `input_ids` (a list of ints or a
  list of lists), not both, not neither, and an optional `rid` (a list for a list input).
  The answer is one object per input, `{"embedding": [num_labels floats], "meta_info": {"id",
  "finish_reason": {"type": "length", "length": 0}, "prompt_tokens", "weight_version",
  "total_retractions": 0, "e2e_latency"}}` (no completion_tokens or cached_tokens for an
  embedding), a list for a list input. A refused request is 400 {"error": {"message"}}.
- POST /generate: SGLang sends it to the scheduler as a generation request, which a
  classification model cannot serve (its decode step meets an embedding result). Refused
  here with 400, naming /classify.
- /health, /health_generate: SGLang's check for an embedding model is a one-token
  EmbeddingReqInput ([0]); here too: 200 once it is scored, 503 if the worker does not get to
  it within the health-check timeout.
- /get_model_info says is_generation false.
- The weight and memory endpoints answer 400 {"success": false, "message"}: a reward model
  kuberl serves never takes weights (SGLang would update an embedding model's weights).
- The API key: the same middleware as the generation server (server.py's api_key_check,
  SGLang's rule), so /classify and /encode need the key and /health* does not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from kuberl_rollout.reference.classifier import Classifier
from kuberl_rollout.reference.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, EngineMetrics
from kuberl_rollout.reference.server import (
    FLUSH_TEXT,
    HEALTH_CHECK_TIMEOUT_S,
    HttpError,
    _body,
    api_key_check,
    errors_as_json,
)

# EmbeddingReqInput fields the reference engine implements (SGLang's names and meanings).
_CLASSIFY_FIELDS = {"text", "input_ids", "rid"}
# EmbeddingReqInput fields SGLang has that the reference engine does not implement: accepted
# at SGLang's defaults, refused otherwise (the engine would answer differently). Fields that
# only label, log or route (sampling_params: "dummy ... for compatibility", log_metrics,
# priority, background, trace_context, validation_time) and keys SGLang does not know are
# ignored, as SGLang's HTTP layer does.
_DEFAULT_ONLY_FIELDS: dict[str, tuple[Any, ...]] = {
    "image_data": (None,), "video_data": (None,), "audio_data": (None,),
    "input_embeds": (None,), "modalities": (None,), "dimensions": (None,),
    "is_cross_encoder_request": (False,),
}
WEIGHT_ENDPOINTS = ("/init_weights_update_group", "/update_weights_from_distributed",
                    "/update_weights_from_tensor", "/destroy_weights_update_group",
                    "/abort_weights_update_group", "/release_memory_occupation",
                    "/resume_memory_occupation")
READ_ONLY = ("this reference engine serves a reward model (--is-embedding): its weights and "
             "memory stay as loaded")
NOT_GENERATIVE = ("this engine serves an embedding (reward) model (--is-embedding): it does not "
                  "generate; POST /classify (or /encode) scores inputs")


def parse_inputs(body: Mapping[str, Any], tokenize: Any) -> tuple[list[list[int]], list[str],
                                                                   bool]:
    """An EmbeddingReqInput body's inputs as token ids (text tokenized with `tokenize`), their
    rids and whether the input was single (HttpError 400 for a body SGLang refuses, or that
    the reference engine does not implement)."""
    changed = sorted(k for k, ok in _DEFAULT_ONLY_FIELDS.items()
                     if k in body and not any(body[k] == v and type(body[k]) is type(v)
                                              for v in ok))
    if changed:
        raise HttpError(400, f"/classify fields {changed} are not supported by the reference "
                             f"engine except at SGLang's defaults "
                             f"({ {k: _DEFAULT_ONLY_FIELDS[k][0] for k in changed} })")
    text, ids = body.get("text"), body.get("input_ids")
    # SGLang's messages (EmbeddingReqInput.normalize_batch_and_arguments)
    if text is None and ids is None:
        raise HttpError(400, "At least one of text, input_ids, or image should be provided")
    if text is not None and ids is not None:
        raise HttpError(400, "text and input_ids cannot be provided at the same time")
    if text is not None:
        single = isinstance(text, str)
        texts = [text] if single else text
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            raise HttpError(400, "text must be a string or a list of strings")
        rows = [tokenize(t) for t in texts]
    else:
        if not isinstance(ids, list) or not ids:
            raise HttpError(400, "input_ids must be a non-empty list of token ids, or of lists "
                                 "of them")
        single = not isinstance(ids[0], list)
        rows = [ids] if single else ids
        if not all(isinstance(r, list) for r in rows):
            raise HttpError(400, "input_ids must be a list of token ids, or a list of lists")
    if not rows:
        raise HttpError(400, "empty batch")
    rid = body.get("rid")
    if single:
        rids = [uuid.uuid4().hex if rid is None else str(rid)]
    elif rid is None:
        rids = [uuid.uuid4().hex for _ in rows]
    elif not isinstance(rid, list):
        raise HttpError(400, "The rid should be a list.")  # (SGLang's assertion)
    elif len(rid) != len(rows):
        raise HttpError(400, f"rid has {len(rid)} entries for {len(rows)} inputs")
    else:
        rids = [str(r) for r in rid]
    return rows, rids, single


class ClassifierServer:
    def __init__(self, classifier: Classifier, *, api_key: str = "",
                 server_args: Mapping[str, Any] | None = None,
                 enable_metrics: bool = False) -> None:
        self.classifier = classifier
        self.api_key = api_key  # "" (SGLang's None): every request is served
        self.server_args = dict(server_args or {})
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="classifier")
        self.in_flight = 0  # inputs of the /classify requests not yet answered
        self.metrics = EngineMetrics(classifier.model_path, running=lambda: self.in_flight,
                                     queued=lambda: 0) if enable_metrics else None

    def app(self) -> web.Application:
        checks = [api_key_check(self.api_key)] if self.api_key else []
        app = web.Application(middlewares=[*checks, errors_as_json], client_max_size=1 << 30)
        r = app.router
        for path in ("/classify", "/encode"):  # (one handler in SGLang 0.5.6)
            r.add_post(path, self.classify)
            r.add_put(path, self.classify)
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/server_info", self.server_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        r.add_route("*", "/flush_cache", self.flush_cache)
        for path in WEIGHT_ENDPOINTS:
            r.add_post(path, self.read_only)
        if self.metrics is not None:
            r.add_get("/metrics", self.prometheus)
        app.on_cleanup.append(self._stop)
        return app

    async def _stop(self, _: web.Application) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    async def _score(self, rows: list[list[int]]) -> list[list[float]]:
        return await asyncio.get_running_loop().run_in_executor(
            self.worker, self.classifier.score, rows)

    async def classify(self, request: web.Request) -> web.Response:
        start = time.time()
        body = await _body(request)
        c = self.classifier
        rows, rids, single = parse_inputs(body, c.tokenize)
        rows = [c.check(r) for r in rows]
        self.in_flight += len(rows)
        try:
            scores = await self._score(rows)
        finally:
            self.in_flight -= len(rows)
        latency = time.time() - start
        results = [{"embedding": values,
                    "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": 0},
                                  "prompt_tokens": len(row),
                                  "weight_version": c.weight_version,
                                  "total_retractions": 0, "e2e_latency": latency}}
                   for values, rid, row in zip(scores, rids, rows, strict=True)]
        if self.metrics is not None:
            self.metrics.finished(results)
        return web.json_response(results[0] if single else results)

    async def generate(self, _: web.Request) -> web.Response:
        raise HttpError(400, NOT_GENERATIVE)

    async def health(self, _: web.Request) -> web.Response:
        """SGLang's health check for an embedding model: a one-token input ([0]) scored."""
        try:
            await asyncio.wait_for(self._score([[0]]), HEALTH_CHECK_TIMEOUT_S)
        except TimeoutError:
            return web.Response(status=503, text="no output within the health-check timeout")
        return web.Response(status=200)

    async def model_info(self, _: web.Request) -> web.Response:
        c = self.classifier
        return web.json_response({"model_path": c.model_path, "tokenizer_path": c.tokenizer_path,
                                  "is_generation": False, "weight_version": c.weight_version})

    async def weight_version(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.classifier.weight_version})

    async def server_info(self, _: web.Request) -> web.Response:
        """SGLang's /get_server_info: the launch arguments, under ServerArgs' names."""
        c = self.classifier
        return web.json_response({
            "model_path": c.model_path, "tokenizer_path": c.tokenizer_path, "tp_size": 1,
            "is_embedding": True, "context_length": c.context_len, "device": c.device.type,
            "dtype": str(c.dtype).removeprefix("torch."),
            "max_running_requests": c.max_batch_size,
            "max_prefill_tokens": c.max_prefill_tokens, **self.server_args,
            "weight_version": c.weight_version,
            "max_total_num_tokens": c.max_batch_size * c.context_len,
            "internal_states": [{}], "version": "kuberl-reference",
        })

    async def loads(self, _: web.Request) -> web.Response:
        """SGLang's /v1/loads: one data-parallel rank, what is being scored now."""
        c, now = self.classifier, time.time()
        capacity = c.max_batch_size * c.context_len
        return web.json_response({"timestamp": now, "dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "timestamp": now, "num_running_reqs": self.in_flight,
            "num_waiting_reqs": 0, "max_total_num_tokens": capacity,
            "max_running_requests": c.max_batch_size}]})

    async def flush_cache(self, _: web.Request) -> web.Response:
        """SGLang flushes only with no batch running (400 otherwise); there is no cache here."""
        return web.Response(text=FLUSH_TEXT, status=400 if self.in_flight else 200)

    async def read_only(self, _: web.Request) -> web.Response:
        return web.json_response({"success": False, "message": READ_ONLY}, status=400)

    async def prometheus(self, _: web.Request) -> web.Response:
        assert self.metrics is not None
        return web.Response(body=self.metrics.exposition(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})
