"""The reference engine's model: batched generation with a KV cache, and weight management.

Not thread-safe by design: every method that touches torch runs on the server's single worker
thread (see server.py), which serialises generation steps and weight updates the way SGLang's
scheduler does, with no locks here.

Generation is continuous (token-level) batching, stepped by the batcher: each `step` gives
every running request its next token (one decode forward over the batch's KV cache) and
prefills the requests joining it (one forward of their own, merged into the batch's cache:
kv_batch.py), and finished requests leave. Rows of different lengths are left-padded, with
attention masks and per-row position ids, so a request's tokens and logprobs are what it gets
alone, up to float rounding; its sampling draws come from its own seeded stream (sampling.py),
never from the batch. Between steps the worker thread runs whatever else was queued on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from kuberl_rollout.reference import kv_batch, moe
from kuberl_rollout.reference.lora import AdapterSet, LoraRef
from kuberl_rollout.reference.sampling import (
    Finish,
    Sampling,
    UniformDraws,
    check_finish,
    choose_tokens,
)
from kuberl_wire import expert_names
from kuberl_wire.codec import tensor_sha256
from kuberl_wire.moe_routes import ROUTES_FIELD, encode

GB = 1e9

LOG = logging.getLogger("kuberl.reference")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# SGLang's GPU_MEMORY_TYPE_* (constants.py); a release with no tags releases all of them.
# The reference engine has no CUDA graphs, but tracks the tag so that an engine released
# without tags stays released until cuda_graph is resumed too, as SGLang's does.
MEMORY_TAGS = frozenset({"weights", "kv_cache", "cuda_graph"})
# SGLang's scheduler caps a request's max_new_tokens at max_req_len - input_len - 1, where
# max_req_len = context_len - 1 (smaller only when the KV pool is; the reference engine has no
# pool limit); a null max_new_tokens asks for that cap.
UNLIMITED_NEW_TOKENS = 1 << 30


class EngineBusy(RuntimeError):
    """The engine can't serve this now (memory released): HTTP 503."""


@dataclass
class GenRequest:
    rid: str
    seq: int  # arrival order; abort_all aborts every request up to a sequence number
    input_ids: list[int]
    sampling: Sampling
    return_logprob: bool
    draws: UniformDraws = field(repr=False)
    return_text_in_logprobs: bool = False
    lora_id: str | None = None  # the adapter it runs under (lora.py); None: the base model
    # Progress, kept across a retraction (/pause_generation): generation resumes from here,
    # recomputing the prompt and these tokens (SGLang's retract frees the KV cache too).
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: Finish | None = None
    # MoE routes (moe.py), kept across a retraction as the progress is: the rows
    # [num_tokens, layers, top_k] of its positions 0.. as they were computed. None: not asked.
    routes: list[torch.Tensor] | None = None

    @property
    def routed(self) -> int:
        """The positions whose routes the request holds."""
        return sum(int(t.shape[0]) for t in self.routes or ())

    @property
    def max_new_tokens(self) -> int:
        return self.sampling.max_new_tokens or 0  # resolved by make_request


@dataclass
class Step:
    """What one step of the running batch gave back (ReferenceEngine.step)."""

    finished: list[tuple[GenRequest, dict[str, Any]]] = field(default_factory=list)
    suspended: list[GenRequest] = field(default_factory=list)


@dataclass
class _Batch:
    """The running requests, in the order of their rows in `cache`."""

    reqs: list[GenRequest]
    cache: kv_batch.PaddedCache

    def keep(self, rows: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in rows]
        self.cache.select(rows)

    def merge(self, other: _Batch) -> None:
        self.reqs += other.reqs
        self.cache.merge(other.cache)


def static_pool_bytes(fraction: float, free_at_start: int, weights: int) -> int:
    """The KV-cache pool SGLang 0.5.6 reserves (ModelRunner.profile_max_num_token): the memory
    free before loading x mem_fraction_static, less what the weights took. So an engine that
    starts beside another process's allocations gets a smaller pool, not an error, and only
    a pool of nothing is refused, in SGLang's words."""
    if not 0 < fraction < 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {fraction}")
    pool = int(free_at_start * fraction) - weights
    if pool <= 0:
        raise RuntimeError(
            "Not enough memory. Please try to increase --mem-fraction-static. Current value: "
            f"{fraction} (of {free_at_start / GB:.1f} GB free at start; the weights took "
            f"{weights / GB:.1f} GB)")
    return pool


class ReferenceEngine:
    def __init__(self, model_path: str, *, tokenizer_path: str | None = None,
                 device: str = "cpu", dtype: str = "float32", seed: int = 0,
                 weight_version: str = "default",
                 mem_fraction_static: float | None = None,
                 weights_cpu_backup: bool = False,
                 lora: dict[str, Any] | None = None, return_routes: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, ep_size: int = 1) -> None:
        """`lora`: AdapterSet's keyword arguments (--enable-lora); None: no LoRA.
        `return_routes`: --enable-return-routed-experts (a MoE model's only). `tp_rank`,
        `tp_size`, `ep_size`: which experts this rank's checksums cover (moe.py)."""
        self.model_path = model_path
        self.weights_cpu_backup = weights_cpu_backup
        self._released_shapes: list[tuple[torch.nn.Parameter, torch.Size]] = []
        self.tokenizer_path = tokenizer_path or model_path
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path,
                                                       local_files_only=True)
        model: Any = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True,
                                                          dtype=DTYPES[dtype])
        # What the GPU has free before the weights land (SGLang measures it after creating
        # its CUDA context and process groups, before loading): the static pool's base.
        free_at_start = (torch.cuda.mem_get_info(self.device)[0]
                         if self.device.type == "cuda" else 0)
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.vocab_size = int(self.model.config.vocab_size)
        self.context_len = int(getattr(self.model.config, "max_position_embeddings", 1 << 20))
        self.eos_ids = self._eos_ids()
        self.pad_id = self.tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids) if self.eos_ids else 0
        self.weight_version = weight_version
        self.released: set[str] = set()
        self.last_output = 0.0  # time.monotonic() of the last token generated (/health)
        self._target_cache: dict[str, torch.Tensor] | None = None
        # SGLang's static memory on a GPU (see static_pool_bytes). A stand-in pool of the
        # same size makes the same demands of a colocated trainer (release kv_cache before
        # training, or run out of memory); None: no pool.
        self.kv_pool_bytes = 0
        self._kv_pool: torch.Tensor | None = None
        if mem_fraction_static is not None and self.device.type == "cuda":
            self.kv_pool_bytes = static_pool_bytes(
                mem_fraction_static, free_at_start, torch.cuda.memory_allocated(self.device))
            self._kv_pool = self._allocate_pool()
        self.original_logprob = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in {
            "1", "true", "yes"}
        # Seeds for requests without sampling_seed: reproducible given --seed and arrival order.
        self._seeds = random.Random(seed)
        torch.manual_seed(seed)
        self.aborted_rids: set[str] = set()
        self.abort_all_upto = -1
        # Set by /pause_generation (retract, in_place): the running batch stops after its
        # current step and hands its unfinished requests back (step's `suspended`).
        self.suspend = False
        self._batch: _Batch | None = None  # the running batch between steps
        self.adapters = AdapterSet(self.model, **lora) if lora is not None else None
        self._init_moe(return_routes, tp_rank, tp_size, ep_size)

    def _init_moe(self, return_routes: bool, tp_rank: int, tp_size: int, ep_size: int) -> None:
        shape = moe.model_shape(self.model)
        moe.check_expert_parallel(tp_size, ep_size, shape.experts if shape else None)
        if return_routes and shape is None:
            # (SGLang's capturer reads num_experts_per_tok from the config: it fails to start)
            raise ValueError(f"--enable-return-routed-experts: {self.model_path} is not a "
                             "mixture-of-experts model (its config names no routed experts)")
        self.return_routes = return_routes
        self.routing = (moe.EngineRouting(self.model, shape, perturb=moe.perturb_requested())
                        if shape is not None else None)
        self.own_experts = (moe.owned_experts(tp_rank, tp_size, ep_size, shape.experts)
                            if shape is not None else None)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config.eos_token_id,
                       self.model.config.eos_token_id, self.tokenizer.eos_token_id):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list | tuple):
                ids.update(int(i) for i in source)
        return frozenset(ids)

    # ---- requests ---------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text)["input_ids"])

    def make_request(self, input_ids: Sequence[int], sampling: Sampling, *, rid: str, seq: int,
                     return_logprob: bool, return_text_in_logprobs: bool = False,
                     lora_id: str | None = None, return_routes: bool = False) -> GenRequest:
        """Validate one prompt (ValueError -> HTTP 400) with SGLang's checks and messages
        (tokenizer_manager: the input must be shorter than the context, and input plus
        max_new_tokens too), then cap max_new_tokens as SGLang's scheduler does."""
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        bad = [t for t in input_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        n = len(input_ids)
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context "
                             f"length ({self.context_len} tokens).")
        asked = sampling.max_new_tokens
        if asked is not None and asked + n >= self.context_len:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {asked + n} tokens: {n} "
                f"tokens from the input messages and {asked} tokens for the completion. Please "
                f"reduce the number of tokens in the input messages or the completion to fit "
                f"within the limit.")
        max_new = max(0, min(UNLIMITED_NEW_TOKENS if asked is None else asked,
                             (self.context_len - 1) - n - 1))
        sampling = replace(sampling, max_new_tokens=max_new)
        seed = sampling.seed if sampling.seed is not None else self._seeds.getrandbits(63)
        return GenRequest(rid=rid, seq=seq, input_ids=list(input_ids), sampling=sampling,
                          return_logprob=return_logprob,
                          return_text_in_logprobs=return_text_in_logprobs,
                          draws=UniformDraws(seed, max_new), lora_id=lora_id,
                          routes=[] if return_routes and self.return_routes else None)

    def is_aborted(self, req: GenRequest) -> bool:
        return req.seq <= self.abort_all_upto or req.rid in self.aborted_rids

    # ---- generation (worker thread) ---------------------------------------------------------

    def step(self, join: Sequence[GenRequest] = (), drop: Sequence[GenRequest] = ()) -> Step:
        """One step of the running batch: every running request gets its next token and the
        requests in `join` are prefilled and get their first, so each gains one token per
        step whenever it joined; `drop` leave unanswered (their callers went away). Finished
        requests leave with their results. While `suspend` is set nothing is computed: every
        request running or joining is handed back, its progress in req.output_ids and
        req.logprobs, to resume by recomputing prompt and tokens in a later step.
        An exception ends the running batch (the caller fails its requests)."""
        try:
            with torch.inference_mode():
                return self._step(join, drop)
        except BaseException:
            self._batch = None
            raise

    def _step(self, join: Sequence[GenRequest], drop: Sequence[GenRequest]) -> Step:
        out = Step()
        batch = self._batch
        if batch is not None and drop:
            gone = {id(r) for r in drop}
            batch.keep([i for i, r in enumerate(batch.reqs) if id(r) not in gone])
        running = batch.reqs if batch is not None else []
        if self.suspend:  # (before the released check: a retract needs no weights)
            out.suspended = [*running, *join]
            self._batch = None
            return out
        if self.released and (running or join):
            raise EngineBusy(f"memory released ({sorted(self.released)}); "
                             "call /resume_memory_occupation first")
        # Finished before any model work: aborted while running or waiting, nothing to make.
        for req in [*running, *join]:
            if self.is_aborted(req):
                req.finish = Finish("abort")
            elif len(req.output_ids) >= req.max_new_tokens:
                req.finish = Finish("length")
        if batch is not None:
            self._leave(batch, out)
            if batch.reqs:
                self._decode_step(batch)
                self._leave(batch, out)
        newcomers = [r for r in join if r.finish is None]
        out.finished += [(r, self._result(r)) for r in join if r.finish is not None]
        if newcomers:
            joined = self._prefill(newcomers)
            self._leave(joined, out)
            if joined.reqs:
                if batch is None or not batch.reqs:
                    batch = joined
                else:
                    batch.merge(joined)
        self._batch = batch if batch is not None and batch.reqs else None
        return out

    @property
    def joins_running_batch(self) -> bool:
        """Whether requests can join a running batch (kv_batch.joinable for this model)."""
        return kv_batch.joinable(DynamicCache(config=self.model.config))

    def run_alone(self, reqs: Sequence[GenRequest]) -> list[dict[str, Any] | None]:
        """`reqs` as one batch of their own, stepped to completion (tests and scripts; the
        server steps through the batcher). None for a request suspended by a pause."""
        if self._batch is not None:
            raise RuntimeError("a batch is running")
        results: dict[int, dict[str, Any] | None] = {}
        out = self.step(join=reqs)
        while True:
            results.update({id(r): res for r, res in out.finished})
            results.update({id(r): None for r in out.suspended})
            if self._batch is None:
                return [results[id(r)] for r in reqs]
            out = self.step()

    def abort_result(self, req: GenRequest) -> dict[str, Any]:
        """The answer for a request aborted while it waited (no model work)."""
        req.finish = Finish("abort")
        return self._result(req)

    def _leave(self, batch: _Batch, out: Step) -> None:
        """Finished rows leave the batch with their results."""
        done = [r for r in batch.reqs if r.finish is not None]
        if done:
            out.finished += [(r, self._result(r)) for r in done]
            batch.keep([i for i, r in enumerate(batch.reqs) if r.finish is None])

    def _prefill(self, reqs: list[GenRequest]) -> _Batch:
        """A batch of `reqs` with their first token (or their next: a retracted request
        resumes by recomputing its prompt and the tokens it already has)."""
        prefixes = [r.input_ids + r.output_ids for r in reqs]
        ids, mask = kv_batch.prefill_inputs(prefixes, self.pad_id, self.device)
        lengths = [len(p) for p in prefixes]
        attention, positions = kv_batch.model_mask(mask, min(lengths) != max(lengths))
        self._select_adapters(reqs)
        with self._routing(reqs) as control:
            out = self.model(input_ids=ids, attention_mask=attention, position_ids=positions,
                             past_key_values=DynamicCache(config=self.model.config),
                             use_cache=True, logits_to_keep=1)
        rows = moe.recorded_rows(control, len(reqs))
        if rows is not None:  # row i's prefix is the last lengths[i] columns (left padding)
            width = rows.shape[1]
            for i, req in enumerate(reqs):
                if req.routes is not None:  # (a resumed request keeps the rows it had)
                    req.routes.append(rows[i, width - lengths[i] + req.routed:].clone())
        batch = _Batch(list(reqs), kv_batch.PaddedCache(out.past_key_values, mask, lengths))
        self._sample(batch.reqs, out.logits[:, -1, :])
        return batch

    def _decode_step(self, batch: _Batch) -> None:
        """Feed every row its last token (not yet in the cache) and sample the next."""
        feed = torch.tensor([[r.output_ids[-1]] for r in batch.reqs], dtype=torch.long,
                            device=self.device)
        attention, positions = batch.cache.decode_inputs()
        self._select_adapters(batch.reqs)
        with self._routing(batch.reqs) as control:
            out = self.model(input_ids=feed, attention_mask=attention, position_ids=positions,
                             past_key_values=batch.cache.cache, use_cache=True)
        rows = moe.recorded_rows(control, len(batch.reqs))
        if rows is not None:
            for i, req in enumerate(batch.reqs):
                if req.routes is not None:
                    req.routes.append(rows[i].clone())
        self._sample(batch.reqs, out.logits[:, -1, :])

    def _routing(self, reqs: Sequence[GenRequest]) -> Any:
        """The context one forward of `reqs` runs in: a MoE model's routers recorded when a
        request wants its routes, perturbed under the test switch (moe.py)."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.forward(any(r.routes is not None for r in reqs))

    def _select_adapters(self, reqs: Sequence[GenRequest]) -> None:
        """Each row of the next forward under its request's adapter (rows in `reqs` order:
        the cache's, which kv_batch keeps through merges and selections)."""
        if self.adapters is not None:
            self.adapters.select([r.lora_id for r in reqs])

    def load_adapter(self, ref: LoraRef) -> dict[str, Any]:
        """SGLang's LoRAUpdateOutput as a dict (lora.AdapterSet.answer)."""
        assert self.adapters is not None
        return self.adapters.load(ref)

    def unload_adapter(self, lora_id: str) -> dict[str, Any]:
        assert self.adapters is not None
        return self.adapters.unload(lora_id)

    def _sample(self, reqs: list[GenRequest], logits: torch.Tensor) -> None:
        tokens, logprobs = choose_tokens(logits.float(), [r.sampling for r in reqs],
                                         [r.draws for r in reqs],
                                         original_logprob=self.original_logprob)
        self.last_output = time.monotonic()
        for req, token, logprob in zip(reqs, tokens.tolist(), logprobs.tolist(), strict=True):
            self._append(req, token, logprob)

    def _append(self, req: GenRequest, token: int, logprob: float) -> None:
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        p = req.sampling
        tail = ""
        if p.stop:
            window = max(len(s) for s in p.stop) + 2
            tail = self._text(req.output_ids[-window:], p)
        req.finish = check_finish(req.output_ids, p, self.eos_ids, tail)
        if req.finish is None and self.is_aborted(req):
            req.finish = Finish("abort")

    def _result(self, req: GenRequest) -> dict[str, Any]:
        finish = req.finish or Finish("abort")
        p = req.sampling
        text_ids = req.output_ids
        # SGLang's detokenizer drops a matched stop token and cuts at a matched stop string;
        # output_ids and logprobs keep every generated token (what the trainer trains on).
        if isinstance(finish.matched, int) and not p.no_stop_trim:
            text_ids = text_ids[:-1]
        text = self._text(text_ids, p)
        if isinstance(finish.matched, str) and not p.no_stop_trim:
            cut = text.find(finish.matched)
            text = text if cut < 0 else text[:cut]
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish.to_json(req.max_new_tokens),
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
        }
        if req.routes:  # (a request that never ran has none: SGLang answers it without)
            # positions [0, prompt + output - 1): the last token was never fed back
            table = torch.cat(req.routes)[:len(req.input_ids) + len(req.output_ids) - 1]
            meta[ROUTES_FIELD] = encode(table)
        if req.return_logprob:
            # SGLang's third entry: the token's text with return_text_in_logprobs, else null.
            meta["output_token_logprobs"] = [
                [lp, tok, self._text([tok], p) if req.return_text_in_logprobs else None]
                for lp, tok in zip(req.logprobs, req.output_ids, strict=True)]
        self.aborted_rids.discard(req.rid)
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    def _text(self, ids: Sequence[int], p: Sampling) -> str:
        """Decode as SGLang's detokenizer does: both flags go to the tokenizer's decode."""
        return str(self.tokenizer.decode(
            list(ids), skip_special_tokens=p.skip_special_tokens,
            spaces_between_special_tokens=p.spaces_between_special_tokens))

    # ---- weights (worker thread) ------------------------------------------------------------

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """HF name -> tensor, tied aliases included (both `lm_head.weight` and
        `model.embed_tokens.weight` when tied; writing either updates both). A
        mixture-of-experts model's experts are named one matrix per expert, as checkpoints
        and SGLang's loaders name them (`kuberl_wire.expert_names`): views into
        transformers' fused parameters, so writing one updates the model."""
        return dict(part for name, tensor in self.model.state_dict().items()
                    for part in expert_names.split(name, tensor))

    def _targets(self) -> dict[str, torch.Tensor]:
        """named_tensors(), kept between weight updates: building it walks every module
        (about a millisecond per update for a 24-layer model). Dropped whenever the parameters
        may be new tensors (release/resume move the model)."""
        if self._target_cache is None:
            self._target_cache = self.named_tensors()
        return self._target_cache

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model by HF name (cast to the model's dtype). All names and
        shapes are checked before anything is written, so a bad update changes nothing.
        Asynchronous on a GPU: the copies are queued on the stream generation runs on, so
        later requests see the new weights without this call waiting for them."""
        if "weights" in self.released:
            raise EngineBusy("weights released; call /resume_memory_occupation first")
        targets = self._targets()
        items = list(named)
        problems = [f"unknown tensor {n!r}" for n, _ in items if n not in targets]
        problems += [f"{n}: shape {tuple(t.shape)} != {tuple(targets[n].shape)}"
                     for n, t in items if n in targets and t.shape != targets[n].shape]
        if problems:
            raise ValueError("; ".join(problems[:10]))
        with torch.no_grad():
            # One multi-tensor copy instead of a kernel launch per tensor (hundreds a bucket).
            torch._foreach_copy_([targets[name] for name, _ in items],
                                 [tensor for _, tensor in items])
        return len(items)

    def synchronize(self) -> None:
        """Wait for queued GPU work (weight copies) to finish."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def checksums(self) -> dict[str, str]:
        """{name: sha256} of the weights this rank would hold in SGLang: with expert
        parallelism, only its own experts' (moe.py)."""
        own = self.own_experts
        return {name: tensor_sha256(t) for name, t in self.named_tensors().items()
                if own is None or (e := moe.expert_of(name)) is None or e in own}

    def _allocate_pool(self) -> torch.Tensor:
        """torch.cuda.OutOfMemoryError when the card has no room (another process holds it),
        as SGLang fails to start or resume then."""
        return torch.empty(self.kv_pool_bytes, dtype=torch.uint8, device=self.device)

    def release(self, tags: Sequence[str] | None) -> None:
        chosen = self._tags(tags)
        if "kv_cache" in chosen and self._kv_pool is not None:
            self._kv_pool = None
            torch.cuda.empty_cache()
        if "weights" in chosen and "weights" not in self.released:
            self._release_weights()
        self.released |= chosen

    def resume(self, tags: Sequence[str] | None) -> None:
        chosen = self._tags(tags)
        if "kv_cache" in chosen and self.kv_pool_bytes and self._kv_pool is None:
            self._kv_pool = self._allocate_pool()
        if "weights" in chosen and "weights" in self.released:
            self._resume_weights()
        self.released -= chosen

    def _release_weights(self) -> None:
        """SGLang (torch_memory_saver) frees the weights' memory and, without
        --enable-weights-cpu-backup, their values: a resume maps fresh memory that only a weight
        update makes the model again. Here the parameters' storage goes the same way (on CPU
        too, so a CPU run shows what a GPU run would) and comes back zeroed; with the backup
        the values wait in host memory."""
        if self.weights_cpu_backup:
            self.model.to("cpu")
        else:
            self._released_shapes = [(p, p.shape) for p in self.model.parameters()]
            for param, _ in self._released_shapes:
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._target_cache = None  # the parameters now hold other tensors
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _resume_weights(self) -> None:
        if self.weights_cpu_backup:
            self.model.to(self.device)
        else:
            for param, shape in self._released_shapes:
                param.data = torch.zeros(shape, dtype=param.dtype, device=self.device)
            self._released_shapes = []
        self._target_cache = None

    @staticmethod
    def _tags(tags: Sequence[str] | None) -> set[str]:
        chosen = set(tags) if tags else set(MEMORY_TAGS)
        unknown = chosen - MEMORY_TAGS
        if unknown:
            raise ValueError(f"unknown memory tags {sorted(unknown)} (known: "
                             f"{sorted(MEMORY_TAGS)})")
        return chosen
