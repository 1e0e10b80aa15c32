"""training.lora in a local run: what the engines generate from is the trained adapter.

LoRA's silent failure is an adapter that never reaches the engines: rollouts keep coming
from the base model while the run looks healthy (loss, grad norm and the adapter's norm all
move). The check here is on the engines themselves: after the run, every engine holds the
trainer's merged weights, and those differ from the base in every targeted weight (and only
there). `KUBERL_TEST_LORA_UNMERGED` (backends/lora.py) makes the backend send the base weights
instead; the same check must then fail, which the second test shows.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from safetensors.torch import load_file

from kuberl_wire.protocol import ENGINE_API_KEY_ENV
from tests.integration.local_run import manifest, metrics, session_options

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

STEPS = 2
T = TypeVar("T")


def engine_call(url: str, path: str, body: Any = None) -> Any:
    """One request to an engine with the run's API key (GET without a body)."""
    from kuberl_trainer.engines.client import engine_api_key

    ask = urllib.request.Request(
        f"{url}{path}", data=None if body is None else json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {engine_api_key()}",
                 "Content-Type": "application/json"})
    with urllib.request.urlopen(ask, timeout=60) as answer:
        return json.loads(answer.read())


def engine_checksums(urls: list[str]) -> list[dict[str, str]]:
    return [engine_call(url, "/get_weights_checksum") for url in urls]


def run_with(tiny: Path, tmp_path: Path, after_sync: Callable[[Any, int], T], *,
             steps: int = STEPS, own_ray: bool = False, **spec: Any) -> list[T]:
    """A tiny job with a rank-8 adapter (`spec` merged into the manifest), driven in this
    process; `after_sync(session, version)` after each step's sync, while the engines hold
    what it sent and can generate: what each call returned."""
    import dataclasses

    from kuberl_api import load
    from kuberl_trainer.preflight import check
    from kuberl_trainer.report.progress import Progress
    from kuberl_trainer.session import Session

    training = {"lora": {"rank": 8, **spec.pop("lora", {})}}
    job = load(manifest(tiny, tmp_path, "lora", training=training,
                        algorithm={"lr": 5e-3, "klCoef": 0.01, **spec.pop("algorithm", {})},
                        schedule={"numRollouts": steps}, **spec))
    opts = session_options(tmp_path)
    if own_ray:  # (a Ray started here: its actors inherit this process's environment)
        opts = dataclasses.replace(opts, address=None)
    session = Session(job, opts, check(job.spec))
    seen: list[T] = []
    try:
        session.start()
        assert session.trainers is not None
        push, to_engines = session.trainers.push_weights, session.memory.to_engines
        pushed: list[int] = []

        def push_and_note(engine_urls: list[str], version: int, bucket_bytes: int) -> float:
            seconds = push(engine_urls, version, bucket_bytes)
            pushed.append(version)
            return seconds

        def to_engines_and_look() -> None:
            # (after the sync and, colocated, once the engines have their cache back: they
            # can answer then, and have not yet released anything for the next step)
            to_engines()
            seen.append(after_sync(session, pushed[-1]))

        session.trainers.push_weights = push_and_note  # type: ignore[method-assign,assignment]
        session.memory.to_engines = to_engines_and_look  # type: ignore[method-assign]
        session.train(Progress(steps))
    finally:
        session.close()
    return seen


def lora_run(tiny: Path, tmp_path: Path, *, own_ray: bool = False,
             placement: dict[str, Any] | None = None
             ) -> tuple[dict[str, str], list[dict[str, str]]]:
    """A 2-step tiny job with a rank-8 adapter (sync: merged); the trainer's checksums of
    what it sends and each engine's checksums, after the last step's sync."""
    def read(session: Any, version: int) -> tuple[dict[str, str], list[dict[str, str]]]:
        # (read after each sync: colocated engines release their weights only later)
        return session.trainers.checksums(), engine_checksums(session.engines.urls)

    synced = run_with(tiny, tmp_path, read, own_ray=own_ray, **(placement or {}))
    assert len(synced) == STEPS
    return synced[-1]


def base_checksums(tiny: Path) -> dict[str, str]:
    """The base model's weights as the reference engine holds them (float32)."""
    from kuberl_wire.codec import tensor_sha256

    state = load_file(str(tiny / "model" / "model.safetensors"))
    return {name: tensor_sha256(t.to(torch.float32)) for name, t in state.items()}


def assert_adapter_reached_engines(want: dict[str, str], engines: list[dict[str, str]],
                                   base: dict[str, str]) -> None:
    """Every engine holds the trainer's weights, and they are the base moved by the adapter:
    every targeted weight (all linear layers of the decoder) differs from the base, every
    other one is the base's."""
    assert engines
    for sums in engines:
        assert {k: sums[k] for k in want} == want
    targeted = {name for name in base if name.endswith("_proj.weight")}
    assert targeted
    moved = {name for name in want if want[name] != base[name]}
    assert moved == targeted, sorted(targeted - moved)[:5]


# colocated (weights handed over in memory) and disaggregated (broadcast to the engines)
PLACEMENTS = {"colocate": {}, "disaggregated": {"placement": "disaggregated",
                                                "rollout": {"gpus": 0}}}


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_engines_generate_from_the_trained_adapter(tiny: Path, tmp_path: Path,
                                                       placement: str) -> None:
    want, engines = lora_run(tiny, tmp_path, placement=PLACEMENTS[placement])
    assert_adapter_reached_engines(want, engines, base_checksums(tiny))
    rows = metrics(tmp_path / "out")
    assert len(rows) == STEPS
    assert all(r["lora_trainable_params"] > 0 for r in rows)
    assert 0 < rows[0]["lora_adapter_norm"] < rows[-1]["lora_adapter_norm"]
    # the full merged weights still go out every step (sync: merged)
    assert all(r["weight_sync_bytes"] > 0 for r in rows)


def test_an_adapter_that_never_reaches_the_engines_fails_the_check(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: the backend sends the base weights (the adapter dropped from
    the export), training otherwise the same; the engines then serve the base, which the
    check above catches."""
    monkeypatch.setenv("KUBERL_TEST_LORA_UNMERGED", "1")
    # (the run's own Ray makes the engines' API key: set here, so that it goes with the test)
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "lora-negative-control")
    want, engines = lora_run(tiny, tmp_path, own_ray=True)
    with pytest.raises(AssertionError):
        assert_adapter_reached_engines(want, engines, base_checksums(tiny))
    assert all(sums == {**sums, **base_checksums(tiny)} for sums in engines)  # the base


# -- sync: adapter -----------------------------------------------------------------------------

PROBE = [5, 9, 13, 3, 7]  # a fixed prompt (token ids of the tiny vocabulary: 14 of them)


def peft_logprobs(tiny: Path, adapter: Path | None, ids: list[int], n: int) -> list[float]:
    """The log-probs of the last `n` of `ids` under the base model with `adapter` (None:
    the base alone), float32, as HF + PEFT compute them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return [float(logits[i - 1, ids[i]]) for i in range(len(ids) - n, len(ids))]


def engines_under(urls: list[str], name: str) -> list[tuple[list[int], list[float]]]:
    """Each engine's greedy answer to PROBE under the adapter `name`: (tokens, log-probs)."""
    answers = []
    for url in urls:
        out = engine_call(url, "/generate", {
            "input_ids": PROBE, "lora_path": name, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                "ignore_eos": True}})
        answers.append(([int(t) for t in out["output_ids"]],
                        [float(e[0]) for e in out["meta_info"]["output_token_logprobs"]]))
    return answers


SERVED_TOL = 2e-5  # float32 on both sides, one CPU


def adapter_served(tiny: Path, root: Path, version: int,
                   answers: list[tuple[list[int], list[float]]]) -> float:
    """Every engine answered as the trainer's version `version` (the base plus the adapter
    it wrote): its log-probs are HF + PEFT's for the same tokens. Returns how far the adapter
    moved them from the base's (a zero adapter would prove nothing: the caller checks it)."""
    assert answers
    moved = 0.0
    for tokens, logprobs in answers:
        ids = PROBE + tokens
        want = peft_logprobs(tiny, root / f"v{version}", ids, len(tokens))
        assert logprobs == pytest.approx(want, abs=SERVED_TOL)
        base = peft_logprobs(tiny, None, ids, len(tokens))
        moved = max(moved, *(abs(a - b) for a, b in zip(want, base, strict=True)))
    return moved


def look_at_adapters(tiny: Path) -> Callable[[Any, int], dict[str, Any]]:
    """What a test of sync: adapter reads after each sync: the engines' weights, their
    answers under the version just sent, and a request for the one before it."""
    def look(session: Any, version: int) -> dict[str, Any]:
        from kuberl_trainer.weight_sync.adapter import ADAPTERS_DIR

        urls = session.engines.urls
        root = session.ckpt.root / ADAPTERS_DIR
        seen: dict[str, Any] = {"weights": engine_checksums(urls), "version": version,
                                "dirs": sorted(p.name for p in root.iterdir())}
        try:
            answers = engines_under(urls, f"v{version}")
            seen["moved"] = adapter_served(tiny, root, version, answers)
            seen["served"] = None
        except AssertionError as exc:
            seen["served"] = repr(exc)
        except urllib.error.HTTPError as exc:
            seen["served"] = f"{exc}: {exc.read().decode()}"
        try:
            engines_under(urls[:1], f"v{version - 1}")
            seen["previous"] = "answered"
        except urllib.error.HTTPError as exc:
            seen["previous"] = (exc.code, exc.read().decode())
        return seen
    return look


def memory_moves(session: Any) -> list[list[str]]:
    """Each engine's memory requests so far, as (op:tags) (the reference engine's log)."""
    moves = []
    for url in session.engines.urls:
        events = engine_call(url, "/get_event_log")["events"]
        moves.append([f"{e['op']}:{','.join(e['tags'] or ['all'])}" for e in events
                      if e["op"].endswith("_memory")])
    return moves


# two engines of their own, or one sharing the trainer's (the memory handoff)
ADAPTER_PLACEMENTS: dict[str, dict[str, Any]] = {
    "disaggregated": {"placement": "disaggregated", "rollout": {"gpus": 0, "engines": 2}},
    "colocate": {}}


@pytest.mark.parametrize("placement", ADAPTER_PLACEMENTS)
def test_the_engines_serve_each_steps_adapter_and_hold_only_the_newest(
        tiny: Path, tmp_path: Path, placement: str) -> None:
    """sync: adapter, three steps: after every step each engine answers under the version
    just trained as HF + PEFT do with the adapter the trainer wrote, keeps its base weights
    (colocated, through the memory handoff: only its cache moves), and holds that version
    alone: a request for the one before is an error (its directory is gone), never an answer
    from stale weights or the base."""
    steps = 3
    look = look_at_adapters(tiny)

    def look_and_moves(session: Any, version: int) -> dict[str, Any]:
        return look(session, version) | {"moves": memory_moves(session)}

    # (a learning rate 4x the scenario's: the adapter moves the probe's log-probs further
    # from the base's in 3 steps than the tolerance they are compared at, on any machine)
    seen = run_with(tiny, tmp_path, look_and_moves, steps=steps, lora={"sync": "adapter"},
                    algorithm={"lr": 2e-2}, **ADAPTER_PLACEMENTS[placement])
    moves = {move for s in seen for engine in s["moves"] for move in engine}
    if placement == "colocate":  # released and taken back: the cache, never the weights
        assert moves == {"release_memory:kv_cache,cuda_graph",
                         "resume_memory:kv_cache,cuda_graph"}, moves
    else:
        assert moves == set()
    base = base_checksums(tiny)
    assert [s["version"] for s in seen] == list(range(1, steps + 1))
    for s in seen:
        assert s["served"] is None, s["served"]
        assert all(w == {**w, **base} for w in s["weights"])  # (the base, never moved)
        assert s["dirs"] == [f"v{s['version']}"]
        code, body = s["previous"]
        assert code == 400 and f"v{s['version'] - 1}" in body
    # the adapter moved the probe's log-probs well past the tolerance they were checked at
    assert seen[-1]["moved"] > 20 * SERVED_TOL, [s["moved"] for s in seen]
    rows = metrics(tmp_path / "out")
    assert [r["lora_adapters_loaded"] for r in rows] == [1] * steps
    adapter_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "adapters" / f"v{steps}"
                                                   ).iterdir())
    assert all(0 < r["weight_sync_bytes"] <= adapter_bytes for r in rows)
    # the rollouts came from the trained policy: the engines' log-probs of what they sampled
    # are the trainer's (float32 on both sides)
    assert all(r["rollout_logp_abs_diff_max"] < 1e-4 for r in rows)


def test_an_adapter_never_delivered_fails_the_check(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control of the test above: the adapter is written but never loaded,
    and requests name none (the engines serve the base)."""
    monkeypatch.setenv("KUBERL_TEST_LORA_UNMERGED", "1")
    monkeypatch.setenv(ENGINE_API_KEY_ENV, "lora-adapter-negative-control")
    seen = run_with(tiny, tmp_path, look_at_adapters(tiny), steps=1, own_ray=True,
                    placement="disaggregated", rollout={"gpus": 0},
                    lora={"sync": "adapter"})
    assert seen[0]["served"] is not None
