"""Weight sync's sending side of the megatron backend: every HF tensor, gathered from the
ranks' TP shards (and, for an MoE model's experts, from the etp x ep ranks that hold them),
bucket by bucket in ``export.plan``'s order. A mixin of ``MegatronBackend``: it reads the
backend's ``model``, ``par``, ``shape``, ``ps`` (megatron's parallel_state), ``rank`` and
``dp_rank``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kuberl_trainer.backends.megatron import export, hf_layout as L, model as M


class BucketExport:
    model: Any
    par: M.Parallel
    shape: L.DecoderShape
    ps: Any
    rank: int
    dp_rank: int

    def named_tensor_buckets(self, bucket_bytes: int, dtype: torch.dtype | None = None,
                             ) -> Iterator[list[tuple[str, Tensor]]]:
        """Collective over every rank (each must iterate it to the end). Global rank 0 gets
        the full HF-named buckets, in ``dtype`` (None: the parameters' bf16); the others
        yield what they gathered (possibly nothing). A tied model's output layer is the
        embedding: the plan exports it once, as ``model.embed_tokens.weight``."""
        # Data-parallel replicas hold the same weights, except the experts: the other ep ranks
        # of rank 0's expert group hold theirs (expert-data-parallel rank 0).
        experts_only = self.dp_rank != 0
        if experts_only and (self.shape.experts is None
                             or self.ps.get_expert_data_parallel_rank() != 0):
            return
        local = M.named_local_tensors(self.model, self.par, self.shape.num_layers,
                                      self.shape.experts)
        size = 2 if dtype is None else dtype.itemsize
        plan = export.plan(self.shape, self.par.pp, bucket_bytes, bytes_per_element=size,
                           ep=self.par.ep)
        pending: tuple[list[export.Export], list[Any]] | None = None
        for bucket in plan:
            # Issue this bucket's all-gathers before finishing the previous one: they run on
            # NCCL's stream while the caller sends what we yield.
            issued = (bucket, self._gather(bucket, local))
            if pending is not None:
                yield self._finish(*pending, dtype)
            pending = issued
        if pending is not None:
            yield self._finish(*pending, dtype)

    def _gather(self, bucket: list[export.Export], local: dict[str, Tensor]) -> list[Any]:
        if bucket[0].stage != self.par.pp_rank:
            return []
        out: list[tuple[list[Tensor], Any] | None] = []
        for e in bucket:
            if e.experts:
                out.append(self._gather_expert(e, local))
                continue
            if self.dp_rank != 0:
                out.append(None)
                continue
            shard = local[e.megatron]
            if self.par.tp == 1:
                out.append(([shard], None))
                continue
            parts = [torch.empty_like(shard) for _ in range(self.par.tp)]
            work = dist.all_gather(parts, shard.contiguous(), async_op=True,
                                   group=self.ps.get_tensor_model_parallel_group())
            out.append((parts, work))
        return out

    def _finish(self, bucket: list[export.Export], gathered: list[Any],
                dtype: torch.dtype | None) -> list[tuple[str, Tensor]]:
        named: list[tuple[str, Tensor]] = []
        for e, item in zip(bucket, gathered, strict=False):
            if item is None:
                continue
            parts, work = item
            if work is not None:
                work.wait()
            if e.experts:
                fulls = export.gather_experts(e, parts, self.shape, self.par.etp, self.par.ep)
                named += export.experts_to_hf(
                    e, fulls if dtype is None else [t.to(dtype) for t in fulls])
                continue
            full = L.tp_gather(e.megatron, parts, self.shape)
            named += export.to_hf(e, full if dtype is None else full.to(dtype), self.shape)
        if self.dp_rank != 0:
            return []  # an expert-parallel peer of rank 0's: it only contributed its experts
        stage = bucket[0].stage
        if stage == 0 or self.par.tp_rank != 0:
            return named
        return self._to_rank0(named, stage)

    def _gather_expert(self, e: export.Export, local: dict[str, Tensor]) -> tuple[Any, Any]:
        """An expert export's shards from every rank of the expert tensor-and-expert-parallel
        group (etp x ep), issued asynchronously."""
        shard = local[e.local_source(self.par.ep_rank)]
        if self.par.ep * self.par.etp == 1:
            return [shard], None
        parts = [torch.empty_like(shard) for _ in range(self.par.ep * self.par.etp)]
        work = dist.all_gather(parts, shard.contiguous(), async_op=True,
                               group=self.ps.get_expert_tensor_and_model_parallel_group())
        return parts, work

    def _to_rank0(self, named: list[tuple[str, Tensor]], stage: int) -> list[tuple[str, Tensor]]:
        """Pipeline stage ``stage``'s (TP rank 0, DP rank 0) sends its bucket to global rank 0,
        which holds stage 0: the engines are fed by one rank."""
        source = self.ps.get_pipeline_model_parallel_group()
        src = dist.get_global_rank(source, stage)
        if self.rank == src:
            dist.send_object_list([[(n, t.shape, t.dtype) for n, t in named]], dst=0)
            for _, t in named:
                dist.send(t.contiguous(), dst=0)
            return named
        if self.rank != 0:
            return []
        meta: list[Any] = [None]
        dist.recv_object_list(meta, src=src)
        out = []
        for name, shape, dtype in meta[0]:
            t = torch.empty(shape, dtype=dtype, device="cuda")
            dist.recv(t, src=src)
            out.append((name, t))
        return out
