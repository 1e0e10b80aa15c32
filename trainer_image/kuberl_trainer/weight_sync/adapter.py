"""Weight sync of a LoRA adapter itself (training.lora.sync: adapter), rank 0's side.

Each step's adapter is a PEFT directory `<root>/v<version>` (root: `adapters/` under the
checkpoint path, which in a cluster is a PVC the engine pods mount read-only), loaded by every
engine through SGLang's `/load_lora_adapter` under the name `v<version>`. The head's engine
client then names that version in every `/generate` (EngineClient.use_adapter), so a request
runs under one adapter from its first token to its last, and its sample's weight version is
the adapter's. The base weights never move: nothing is paused, no weight-update group exists.

What stays loaded is bounded: the newest `slots` versions (spec.adapter_slots: in mode async
the maxStaleness versions before the newest, which requests still in flight may name).
Older ones are unloaded from every engine and their directories deleted: SGLang re-loads a
name it once knew from its path when a request names it again, so only a missing directory
makes a request for a version past the bound an error rather than an answer from stale
weights. An engine the fleet replaced (a URL not seen before) gets every retained version.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from kuberl_trainer.engines.client import EngineClient, first_error
from kuberl_wire import protocol

ADAPTERS_DIR = "adapters"  # under the checkpoint path: each version's PEFT directory
LOAD_TIMEOUT_S = 120.0  # reading a small adapter from shared storage into host memory
# Tests only: the adapter is never delivered (no load, and the client names none), the
# silent failure (rollouts from the base) the integration test must be able to catch
UNDELIVERED_ENV = "KUBERL_TEST_LORA_UNMERGED"


def adapter_name(version: int) -> str:
    """The name the engines know version `version` of the adapter by."""
    return f"v{version}"


def delivered() -> bool:
    return not os.environ.get(UNDELIVERED_ENV)


def write_atomically(root: Path, version: int, write: Callable[[Path], object]) -> Path:
    """`write(dir)` into a temporary directory under `root`, renamed to `v<version>` once
    complete: an engine never reads half an adapter (a directory of that version left by an
    earlier attempt of the job is replaced)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / adapter_name(version)
    tmp = root / f".{adapter_name(version)}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


class AdapterPublisher:
    """Keeps every engine loaded with the newest `slots` adapter versions (rank 0 of the
    trainers; one per run)."""

    def __init__(self, client: EngineClient, root: Path, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"adapter slots must be at least 1, got {slots}")
        self.client, self.root, self.slots = client, root, slots
        self.retained: list[int] = []           # versions loaded everywhere, oldest first
        self.loaded: dict[str, set[int]] = {}   # engine URL -> versions it holds
        self.reported = 0  # the most adapters an engine said it held after the last publish

    async def publish(self, urls: Sequence[str], version: int) -> None:
        """Version `version` (written under root already) loaded on every engine of `urls`,
        the versions past the bound unloaded first (their directories deleted once no
        engine holds them)."""
        keep = ([v for v in self.retained if v != version] + [version])[-self.slots:]
        urls = [u.rstrip("/") for u in urls]
        self.loaded = {u: self.loaded.get(u, set()) for u in urls}  # (replaced ones: gone)
        counts = await first_error(self._bring(url, keep) for url in urls)
        self.reported = max(counts, default=0)
        self.retained = keep
        self._prune(set(keep))

    async def _bring(self, url: str, keep: list[int]) -> int:
        """One engine: unload what it holds past `keep`, then load what it lacks (a sync
        made again after an engine died finds the others holding the newest already); the
        number of adapters it reports holding."""
        held = self.loaded[url]
        for version in sorted(held - set(keep)):
            await self.client.request(url, "POST", "/unload_lora_adapter",
                                      protocol.unload_lora_adapter(adapter_name(version)),
                                      timeout_s=LOAD_TIMEOUT_S)
            held.discard(version)
        answer = None
        for version in keep:
            if version not in held:
                answer = await self.client.request(
                    url, "POST", "/load_lora_adapter",
                    protocol.load_lora_adapter(adapter_name(version),
                                               str(self.root / adapter_name(version))),
                    timeout_s=LOAD_TIMEOUT_S)
                held.add(version)
        loaded = answer.get("loaded_adapters") if isinstance(answer, dict) else None
        return len(loaded) if isinstance(loaded, dict) else len(held)

    def _prune(self, keep: set[int]) -> None:
        """Delete every version directory under root but `keep` (an earlier attempt's too)."""
        for entry in self.root.iterdir():
            name = entry.name.lstrip(".").removesuffix(".partial")
            if name.startswith("v") and name[1:].isdigit() and int(name[1:]) not in keep:
                shutil.rmtree(entry, ignore_errors=True)
