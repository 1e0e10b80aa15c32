"""Bodies of SGLang's weight-management requests, with SGLang's field names (see
python/sglang/srt/managers/io_struct.py; tests/unit/test_engine_contract.py pins them).

Pure builders: the sender and the tests use them, and the contract test checks that every key
they emit is a field SGLang's request type accepts (SGLang rejects unknown fields).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kuberl_wire.plan import TensorMeta


def init_weights_update_group(*, master_address: str, master_port: int, rank_offset: int,
                              world_size: int, group_name: str, backend: str) -> dict[str, Any]:
    return {"master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size,
            "group_name": group_name, "backend": backend}


FLATTENED = "flattened_bucket"  # one broadcast of the bucket's tensors concatenated, flattened


def update_weights_from_distributed(metas: Sequence[TensorMeta], *, group_name: str,
                                    weight_version: str | None, flush_cache: bool = True,
                                    flattened: bool = False) -> dict[str, Any]:
    """``flattened``: the tensors (all of one dtype) arrive as one broadcast of their
    flattened concatenation, in ``names`` order (SGLang's ``load_format="flattened_bucket"``),
    instead of one broadcast each."""
    body: dict[str, Any] = {
        "names": [m.name for m in metas],
        "dtypes": [m.dtype for m in metas],
        "shapes": [list(m.shape) for m in metas],
        "group_name": group_name,
        "flush_cache": flush_cache,
    }
    if flattened:
        body["load_format"] = FLATTENED
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def update_weights_from_tensor(serialized_named_tensors: Sequence[str], *,
                               weight_version: str | None, flush_cache: bool = True,
                               load_format: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"serialized_named_tensors": list(serialized_named_tensors),
                            "load_format": load_format, "flush_cache": flush_cache}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def destroy_weights_update_group(group_name: str) -> dict[str, Any]:
    return {"group_name": group_name}


def abort_weights_update_group(group_name: str) -> dict[str, Any]:
    """kuberl's own request (the reference engine's; SGLang 0.5.6 has no such endpoint): leave
    the group at once, a receive of it in flight ended (docs/engine-contract.md)."""
    return {"group_name": group_name}


def load_lora_adapter(lora_name: str, lora_path: str, *, pinned: bool = False
                      ) -> dict[str, Any]:
    """SGLang's LoadLoRAAdapterReqInput (POST /load_lora_adapter): serve the PEFT adapter
    directory `lora_path` under `lora_name`, which /generate's lora_path then names. A name
    already loaded is refused: load a new adapter version under a new name, or unload first.
    `pinned` keeps it from the engine's eviction (--max-loaded-loras); sent only when set."""
    body: dict[str, Any] = {"lora_name": lora_name, "lora_path": lora_path}
    if pinned:
        body["pinned"] = True
    return body


def unload_lora_adapter(lora_name: str) -> dict[str, Any]:
    """SGLang's UnloadLoRAAdapterReqInput (POST /unload_lora_adapter). SGLang answers only
    once the requests in flight that use the adapter have finished. It remembers the name's
    path: a later /generate naming it loads it again from there (tokenizer_manager)."""
    return {"lora_name": lora_name}


def memory_occupation(tags: Sequence[str] | None = None) -> dict[str, Any]:
    """Body of both /release_memory_occupation and /resume_memory_occupation."""
    return {"tags": list(tags) if tags is not None else None}


def abort_request(rid: str | None = None, *, abort_all: bool = False) -> dict[str, Any]:
    return {"rid": rid or "", "abort_all": abort_all}


# How generation is paused around a weight update: "retract" sends running requests back to the
# waiting queue and frees their KV cache, so the flush that follows succeeds and they resume
# after /continue_generation, recomputed with the new weights ("in_place" keeps them running,
# and SGLang's flush then fails; "abort" ends them).
PAUSE_MODE = "retract"


def pause_generation(mode: str = PAUSE_MODE) -> dict[str, Any]:
    return {"mode": mode}


def continue_generation() -> dict[str, Any]:
    return {}


def rank_offsets(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """The weight-update group's size and each engine's `rank_offset`: the trainer is rank 0,
    then every TP process of every engine, in engine order (SGLang joins TP rank r of an
    engine as `rank_offset + r`)."""
    if any(tp < 1 for tp in tp_sizes):
        raise ValueError(f"tensor parallel sizes must be at least 1, got {list(tp_sizes)}")
    offsets, at = [], 1
    for tp in tp_sizes:
        offsets.append(at)
        at += tp
    return at, offsets


# Not SGLang's: the environment variable kuberl's launcher hands the nodes of one multi-node
# reference engine their shared key in (they authenticate each other's connections with it;
# see kuberl_rollout.reference.tp). An environment variable, so no command line shows it.
ENGINE_SECRET_ENV = "KUBERL_ENGINE_SECRET"

# Not SGLang's: the environment variable every process of a job reads the engines' API key
# from (the operator's per-job Secret in a cluster, through a secretKeyRef; a random key that
# `kuberl run` makes for a local Ray). The engines check it (SGLang's --api-key, given to
# SGLang in a --config file; the reference engine reads this variable) and the trainer sends
# it as `Authorization: Bearer <key>`. Empty or unset: the engines check nothing.
ENGINE_API_KEY_ENV = "KUBERL_ENGINE_API_KEY"


def api_key_exempt(method: str, path: str) -> bool:
    """Whether SGLang 0.5.6's --api-key check lets a request through without the key
    (`sglang.srt.utils.common.add_api_key_middleware`): CORS preflights (OPTIONS) and every
    path starting with /health or /metrics (so /health, /health_generate and /metrics, and
    any other path with those prefixes). Everything else needs `Authorization: Bearer <key>`
    exactly, or is answered 401 {"error": "Unauthorized"}."""
    return method == "OPTIONS" or path.startswith(("/health", "/metrics"))


def bearer(api_key: str) -> dict[str, str]:
    """The header that carries the engines' API key (none for an empty key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
