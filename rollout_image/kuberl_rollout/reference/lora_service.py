"""The reference engine's LoRA API: /load_lora_adapter, /unload_lora_adapter and /generate's
lora_path, with SGLang 0.5.6's rules, answers and messages (its TokenizerManager,
tokenizer_communicator_mixin and lora/lora_registry.py: the tokenizer side of SGLang's LoRA).

- Names to adapters: a registry in least-recently-used order (a load, or a request naming it,
  makes it the most recent). Loading a name already loaded fails; so does unloading an
  unknown one. Loads and unloads run one at a time.
- --max-loaded-loras counts adapters only (not the base model): a load that goes past it
  unloads the least recently used unpinned adapter, and the answer's loaded_adapters leaves
  it out. A /generate naming more distinct adapters than that (a batch's None, the base,
  counts as one) is refused.
- Every name ever loaded is remembered with its path: a /generate naming one that was
  unloaded or evicted loads it again from that path first, silently (SGLang's "Reloading
  evicted adapter"); only a name never loaded is an error (400, in /generate's error shape).
- An unload first removes the name (requests naming it from then on re-load it, after the
  unload), then waits until no request in flight uses the adapter, then drops it.
- Without --enable-lora the endpoints answer "LoRA is not enabled" and /generate ignores
  lora_path (the base model serves it), as SGLang does.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from kuberl_rollout.reference.lora import LoraRef, update_output

NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
OnWorker = Callable[..., Awaitable[Any]]


def _failure(message: str) -> dict[str, Any]:
    """A failure SGLang's tokenizer side finds: no adapter list."""
    return update_output(False, message, None)


def _field_problem(body: dict[str, Any], name: str, kind: type, required: bool
                   ) -> dict[str, Any] | None:
    """FastAPI's 422 item for a missing or mistyped field of SGLang's request dataclass."""
    if name not in body:
        return ({"type": "missing", "loc": ["body", name], "msg": "Field required",
                 "input": body} if required else None)
    if type(body[name]) is not kind:
        return {"type": f"{kind.__name__}_type", "loc": ["body", name],
                "msg": f"Input should be a valid {'string' if kind is str else 'boolean'}",
                "input": body[name]}
    return None


class LoraService:
    def __init__(self, *, enabled: bool, max_loaded_loras: int | None,
                 load: Callable[[LoraRef], dict[str, Any]],
                 unload: Callable[[str], dict[str, Any]], on_worker: OnWorker) -> None:
        """`load` / `unload`: the engine's (lora.AdapterSet's), run via `on_worker`."""
        self.enabled = enabled
        self.max_loaded_loras = max_loaded_loras
        self._load, self._unload, self._on_worker = load, unload, on_worker
        self.registry: OrderedDict[str, LoraRef] = OrderedDict()  # LRU first
        self.in_use: dict[str, int] = {}  # lora_id -> requests in flight
        self._idle = asyncio.Condition()
        self.known: dict[str, LoraRef] = {}  # every name loaded, with its latest ref
        self._update_lock = asyncio.Lock()

    # ---- endpoints ------------------------------------------------------------------------

    async def load_route(self, request: web.Request) -> web.Response:
        body = await self._body(request, (("lora_name", str, True), ("lora_path", str, True),
                                          ("pinned", bool, False)))
        if isinstance(body, web.Response):
            return body
        result = await self.load(body["lora_name"], body["lora_path"],
                                 bool(body.get("pinned", False)))
        return web.json_response(result, status=200 if result["success"] else 400)

    async def unload_route(self, request: web.Request) -> web.Response:
        body = await self._body(request, (("lora_name", str, True),))
        if isinstance(body, web.Response):
            return body
        result = await self.unload(body["lora_name"])
        return web.json_response(result, status=200 if result["success"] else 400)

    @staticmethod
    async def _body(request: web.Request, fields: tuple[tuple[str, type, bool], ...]
                    ) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"detail": [{"type": "model_attributes_type",
                                                  "loc": ["body"], "msg": "Input should be a "
                                                  "valid dictionary", "input": body}]},
                                     status=422)
        problems = [p for name, kind, required in fields
                    if (p := _field_problem(body, name, kind, required)) is not None]
        if problems:
            return web.json_response({"detail": problems}, status=422)
        return body

    # ---- load / unload (SGLang's load_lora_adapter / unload_lora_adapter) ------------------

    async def load(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        if not self.enabled:
            return _failure(NOT_ENABLED)
        try:
            async with self._update_lock:
                ref = LoraRef(uuid.uuid4().hex, name, path, pinned)
                result: dict[str, Any] = await self._on_worker(self._load, ref)
                if result["success"]:
                    self._register(ref)
                    self.known[name] = ref
                await self._evict(result)
                return result
        except ValueError as exc:
            return _failure(str(exc))

    async def _evict(self, result: dict[str, Any]) -> None:
        """Past --max-loaded-loras: unload the least recently used unpinned adapters."""
        while self.max_loaded_loras is not None and len(self.registry) > self.max_loaded_loras:
            victim = next((n for n, r in self.registry.items() if not r.pinned), None)
            if victim is None:
                raise ValueError("Didn't find any LoRA adapters when trying to evict LRU LoRA "
                                 f"adapter. LoRA registry is: {self.registry}")
            gone = await self._unload_locked(victim)
            if not gone["success"]:
                raise ValueError(f"Error while unloading LRU LoRA adapter '{victim}': "
                                 f"{gone['error_message']}")
            result["loaded_adapters"].pop(victim, None)

    async def unload(self, name: str) -> dict[str, Any]:
        if not self.enabled:
            return _failure(NOT_ENABLED)
        try:
            async with self._update_lock:
                return await self._unload_locked(name)
        except ValueError as exc:
            return _failure(str(exc))

    async def _unload_locked(self, name: str) -> dict[str, Any]:
        ref = self.registry.get(name)
        if ref is None:
            raise ValueError(f"LoRA with name {name} does not exist. Loaded LoRAs: "
                             f"{self.registry.keys()}")
        del self.registry[name]  # new requests naming it now wait to re-load it
        async with self._idle:
            await self._idle.wait_for(lambda: self.in_use.get(ref.lora_id, 0) == 0)
        self.in_use.pop(ref.lora_id, None)
        result: dict[str, Any] = await self._on_worker(self._unload, ref.lora_id)
        return result

    def _register(self, ref: LoraRef) -> None:
        if ref.lora_name in self.registry:
            raise ValueError(f"LoRA with name {ref.lora_name} already exists. Loaded LoRAs: "
                             f"{self.registry.keys()}")
        self.registry[ref.lora_name] = ref
        self.in_use[ref.lora_id] = 0

    # ---- requests ---------------------------------------------------------------------------

    async def acquire(self, lora_path: Any) -> list[str | None] | str | None:
        """A /generate's lora_path (a name, or one entry per prompt, None for the base) as
        adapter ids, each counted in use until `release`; ValueError (HTTP 400) for a name
        never loaded or too many distinct ones. None when LoRA is off or no adapter named."""
        if not self.enabled or not lora_path:
            return None
        if not isinstance(lora_path, str | list):
            raise ValueError("lora_path should be a list or a string.")
        names = {lora_path} if isinstance(lora_path, str) else set(lora_path)
        if self.max_loaded_loras is not None and len(names) > self.max_loaded_loras:
            raise ValueError(f"Received request with {len(names)} unique loras requested but "
                             f"max loaded loras is {self.max_loaded_loras}")
        for name in [n for n in names if n is not None and self._touch(n) is None]:
            if name not in self.known:
                raise ValueError(f"Got LoRA adapter that has never been loaded: {name}\n"
                                 f"All loaded adapters: {self.known.keys()}.")
            ref = self.known[name]
            reloaded = await self.load(ref.lora_name, ref.lora_path, ref.pinned)
            if not reloaded["success"] and "already loaded" not in reloaded["error_message"]:
                raise ValueError(f"Failed to implicitly load LoRA adapter {name}: "
                                 f"{reloaded['error_message']}")
        ids = [self._lookup(n) for n in ([lora_path] if isinstance(lora_path, str)
                                         else lora_path)]
        for lora_id in ids:
            if lora_id is not None:
                self.in_use[lora_id] += 1
        return ids[0] if isinstance(lora_path, str) else ids

    def _touch(self, name: str) -> LoraRef | None:
        """The name's ref, now the most recently used; None when not loaded."""
        ref = self.registry.get(name)
        if ref is not None:
            self.registry.move_to_end(name)
        return ref

    def _lookup(self, name: str | None) -> str | None:
        if name is None:
            return None
        ref = self._touch(name)
        if ref is None:
            raise ValueError(f"The following requested LoRA adapters are not loaded: {name}\n"
                             f"Loaded adapters: {self.registry.keys()}.")
        return ref.lora_id

    async def release(self, ids: list[str | None] | str | None) -> None:
        if ids is None:
            return
        async with self._idle:
            for lora_id in [ids] if isinstance(ids, str) else ids:
                if lora_id is not None:
                    self.in_use[lora_id] -= 1
            self._idle.notify_all()
