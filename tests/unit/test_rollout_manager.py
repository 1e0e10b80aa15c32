"""The rollout manager's bookkeeping: groups, seeds, packing, the constant-group filter, eval.

The engine here is a stand-in that answers from a table (the real reference engine is
exercised in tests/integration); what is under test is how responses become a TrainBatch."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from kuberl_api import parse
from kuberl_trainer.engines.client import EngineClient, GenerateResult
from kuberl_trainer.rollout.batch import pack
from kuberl_trainer.rollout.generate import Response, sample_seed
from kuberl_trainer.rollout.manager import RolloutManager
from kuberl_trainer.rollout.prompts import PromptSource, Sample
from tests.integration.tiny_model import build_tokenizer


class TableEngine(EngineClient):
    """Two engines answering from a table: "right" (the label) for even seeds, "wrong"
    otherwise. Only the HTTP round trip is replaced; load balancing is the real client's."""

    def __init__(self, labels: dict[str, str], tokenizer: Any) -> None:
        super().__init__(["http://engine-a", "http://engine-b"])
        self.labels, self.tok = labels, tokenizer
        self.always_right: set[str] = set()  # prompts answered right whatever the seed
        self.calls: list[list[Mapping[str, Any]]] = []
        self.prompts_sent: list[list[int]] = []
        self.urls_used: list[str] = []

    async def _generate_on(self, url: str, prompts: Sequence[Sequence[int]],
                           params: Sequence[Mapping[str, Any]],
                           return_logprob: bool) -> list[GenerateResult]:
        await asyncio.sleep(0)  # the next chunk is dispatched while this one is in flight
        self.calls.append(list(params))
        self.prompts_sent += [list(ids) for ids in prompts]
        self.urls_used.append(url)
        out = []
        for ids, p in zip(prompts, params, strict=True):
            prompt = self.tok.decode(list(ids))
            right = (p["sampling_seed"] % 2 == 0 or p["temperature"] == 0
                     or prompt in self.always_right)
            text = self.labels.get(prompt, "0") if right else "0"  # cut prompts: unknown
            toks = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(GenerateResult(output_ids=toks, text=text, finish_reason="stop",
                                      prompt_tokens=len(ids), completion_tokens=len(toks),
                                      logprobs=[-0.5] * len(toks), weight_version="1",
                                      engine_url="table"))
        return out


def setup(tmp_path: Path, ref_logprobs: Any = None, values: Any = None, sft: bool = False,
          eval_samples: int = 1, max_prompt_len: int = 1024, pass_k: list[int] | None = None,
          **algorithm: Any) -> tuple[RolloutManager, TableEngine]:
    rows = [{"prompt": f"{a}+{a}=", "label": str(2 * a)} for a in range(10, 20)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    spec = parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "x"},
                  "spec": {"model": {"path": "/m"},
                           "data": {"prompts": str(data), "rolloutBatchSize": 2,
                                    "nSamplesPerPrompt": 4, "maxResponseLen": 4,
                                    "maxPromptLen": max_prompt_len,
                                    "evalSets": [{"name": "add", "path": str(data),
                                                  "nSamplesPerPrompt": eval_samples,
                                                  "passK": pass_k or []}],
                                    **({"sft": {"path": str(data), "batchSize": 4}} if sft
                                       else {})},
                           "reward": {"type": "exact"}, "algorithm": algorithm,
                           "schedule": {"evalInterval": 1},
                           "training": {"backend": "fsdp", "gpusPerNode": 0},
                           "rollout": {"engine": "reference"}}}).spec
    tok = build_tokenizer()
    engine = TableEngine({r["prompt"]: r["label"] for r in rows}, tok)
    from kuberl_trainer.rollout.grading import load_grader

    mgr = RolloutManager(spec, PromptSource(data, "prompt", "label", seed=0), engine,  # type: ignore[arg-type]
                         tok, load_grader(spec.reward), seed=7, ref_logprobs=ref_logprobs,
                         values=values,
                         sft_source=PromptSource(data, "prompt", "label", seed=1) if sft else None)
    return mgr, engine


def test_groups_seeds_and_batch(tmp_path: Path) -> None:
    mgr, engine = setup(tmp_path)
    rollout = asyncio.run(mgr.generate(step=3))
    batch = rollout.batch
    assert batch.input_ids.shape[0] == 8  # 2 prompts x 4 samples
    seeds = [p["sampling_seed"] for call in engine.calls for p in call]
    assert len(set(seeds)) == 8  # every response has its own seed...
    again, engine2 = setup(tmp_path)
    asyncio.run(again.generate(step=3))
    assert seeds == [p["sampling_seed"] for c in engine2.calls for p in c]  # ...reproducibly
    rewards = torch.tensor([1.0 if s % 2 == 0 else 0.0 for s in seeds])
    assert rollout.metrics["reward_mean"] == float(rewards.mean())
    # advantages: GRPO per group, only on response tokens
    assert torch.all(batch.advantages[batch.loss_mask == 0] == 0)
    # one request per engine, each a whole group: 2 groups of 4 over the 2 engines
    assert [len(call) for call in engine.calls] == [4, 4]
    assert sorted(engine.urls_used) == ["http://engine-a", "http://engine-b"]


def test_groups_never_split_across_engines(tmp_path: Path) -> None:
    _, engine = setup(tmp_path)
    prompts = [engine.tok("10+10=", add_special_tokens=False)["input_ids"]] * 12
    params = [{"sampling_seed": 0, "temperature": 1.0}] * 12
    with pytest.raises(ValueError, match="whole groups of 5"):
        asyncio.run(engine.generate_spread(prompts, params, group=5))
    # 3 groups of 4 over 2 engines: one engine takes 2 groups, the other 1; never 6/6
    results = asyncio.run(engine.generate_spread(prompts, params, group=4))
    assert len(results) == 12 and all(r.text == "20" for r in results)
    assert sorted(len(call) for call in engine.calls) == [4, 8]
    assert sorted(engine.urls_used) == ["http://engine-a", "http://engine-b"]  # one each


def test_drop_constant_groups_masks_them_out(tmp_path: Path) -> None:
    mgr, _ = setup(tmp_path, dropConstantGroups=True)
    rollout = asyncio.run(mgr.generate(step=0))
    b = rollout.batch
    rewards = b.advantages.sum(1)  # 0 for a dropped group
    per_group = b.loss_mask.sum(1).view(2, 4)
    for g in range(2):
        kept = bool(per_group[g].sum() > 0)
        assert kept == bool(rewards.view(2, 4)[g].abs().sum() > 0)
    assert b.input_ids.shape[0] == 8 and "kept_group_fraction" in rollout.metrics


def test_evaluate_is_greedy(tmp_path: Path) -> None:
    mgr, engine = setup(tmp_path)
    out = asyncio.run(mgr.evaluate(step=0))
    assert out == {"eval_add_reward": 1.0}
    assert all(p["temperature"] == 0.0 for call in engine.calls for p in call)


def test_evaluate_samples_n_per_prompt_at_the_jobs_temperature(tmp_path: Path) -> None:
    """evalSets[].nSamplesPerPrompt > 1: that many samples of each problem at
    algorithm.temperature (each with its own seed), and the reward is their mean."""
    mgr, engine = setup(tmp_path, eval_samples=3, temperature=0.7)
    out = asyncio.run(mgr.evaluate(step=0))
    params = [p for call in engine.calls for p in call]
    assert len(params) == 10 * 3  # every problem of the set, 3 times
    assert {p["temperature"] for p in params} == {0.7}
    assert len({p["sampling_seed"] for p in params}) == len(params)
    # the table engine answers right exactly on even seeds
    expected = sum(p["sampling_seed"] % 2 == 0 for p in params) / len(params)
    assert out == {"eval_add_reward": pytest.approx(expected)}
    assert 0.0 < expected < 1.0  # sampled, not greedy (greedy answers are all right)


def test_evaluate_reports_pass_at_k_and_maj_at_k_from_each_problems_samples(
        tmp_path: Path) -> None:
    """passK [1, 4]: avg@k, pass@k (Chen et al.'s estimator over the 4 samples) and maj@k (the
    exact reward's answer: the text) per problem, from the very samples the engine made."""
    mgr, engine = setup(tmp_path, eval_samples=4, temperature=0.7, pass_k=[1, 4])
    out = asyncio.run(mgr.evaluate(step=0))
    seeds = [p["sampling_seed"] for call in engine.calls for p in call]
    right = [[s % 2 == 0 for s in seeds[i:i + 4]] for i in range(0, 40, 4)]  # per problem
    assert out["eval_add_pass@1"] == pytest.approx(sum(map(sum, right)) / 40)
    assert out["eval_add_avg@1"] == pytest.approx(sum(r[0] for r in right) / 10)
    assert out["eval_add_pass@4"] == pytest.approx(sum(any(r) for r in right) / 10)
    # wrong answers are all "0": the majority is right only with 3 or 4 right, or 2 that came
    # first (a tie goes to the answer that came first)
    majority = [sum(r) > 2 or (sum(r) == 2 and r[0]) for r in right]
    assert out["eval_add_maj@4"] == pytest.approx(sum(majority) / 10)
    assert out["eval_add_reward"] == out["eval_add_avg@4"]


def test_eval_seeds_do_not_depend_on_the_step(tmp_path: Path) -> None:
    """The same weights score the same after any step: what lets mode eval reproduce a
    training run's evaluation of a checkpoint."""
    mgr, engine = setup(tmp_path, eval_samples=3, temperature=0.7, pass_k=[3])
    first = asyncio.run(mgr.evaluate(step=0))
    seeds = [p["sampling_seed"] for call in engine.calls for p in call]
    engine.calls.clear()
    assert asyncio.run(mgr.evaluate(step=41)) == first
    assert [p["sampling_seed"] for call in engine.calls for p in call] == seeds
    asyncio.run(mgr.generate(step=0))  # (a training rollout's seeds are the step's own)
    assert not set(seeds) & {p["sampling_seed"] for p in engine.calls[-1]}


def test_prompts_keep_their_last_max_prompt_len_tokens(tmp_path: Path) -> None:
    mgr, engine = setup(tmp_path, max_prompt_len=2)
    rollout = asyncio.run(mgr.generate(step=0))
    tok = engine.tok
    full = {tuple(tok(f"{a}+{a}=", add_special_tokens=False)["input_ids"])
            for a in range(10, 20)}
    assert all(len(ids) == 6 for ids in full)
    assert len(engine.prompts_sent) == 8
    for sent in engine.prompts_sent:
        assert any(list(ids[-2:]) == sent for ids in full), sent  # the last 2 tokens
    # the trained rows start with the same cut prompt
    assert sorted(rollout.batch.input_ids[:, :2].tolist()) == sorted(engine.prompts_sent)


def test_pack_aligns_tokens_with_positions() -> None:
    s = Sample("p", "l", 0, 0)
    rs = [Response(s, [5, 6, 7], [8, 1], [-0.1, -0.2], "x", False),
          Response(s, [5, 6], [9, 9, 1], [-0.3, -0.4, -0.5], "y", True)]
    b = pack(rs, torch.tensor([1.0, -1.0]), pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 1], [5, 6, 9, 9, 1]]
    assert b.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert torch.allclose(b.rollout_logprobs[0], torch.tensor([0, 0, 0, -0.1, -0.2]))
    assert torch.allclose(b.rollout_logprobs[1], torch.tensor([0, 0, -0.3, -0.4, -0.5]))
    assert b.advantages.tolist() == [[0, 0, 0, 1, 1], [0, 0, -1, -1, -1]]
    assert sample_seed(0, 1, s, 0) != sample_seed(0, 1, s, 1) != sample_seed(0, 2, s, 1)


def test_dynamic_sampling_replaces_groups_without_spread(tmp_path: Path) -> None:
    """Most prompts are answered right whatever the seed (no spread, no signal); dynamic
    sampling draws fresh prompts until the batch holds groups with spread, for at most
    dynamicSamplingRounds rounds; what it could not replace leaves the loss."""
    mgr, engine = setup(tmp_path, dynamicSamplingRounds=6)
    mixed = {"13+13=", "17+17="}
    engine.always_right = {f"{a}+{a}=" for a in range(10, 20)} - mixed
    rollout = asyncio.run(mgr.generate(step=0))
    b, m = rollout.batch, rollout.metrics
    assert b.input_ids.shape[0] == 8  # still rolloutBatchSize groups
    prompts = [engine.tok.decode(b.input_ids[i, :6].tolist()) for i in range(0, 8, 4)]
    assert set(prompts) == mixed, prompts  # both groups with spread found (10 prompts, 6 rounds)
    assert m["kept_group_fraction"] == 1.0 and 1 <= m["dynamic_sampling_rounds"] <= 6
    assert b.loss_mask.sum() > 0 and m["prompts_sha"]
    # The same draws again from scratch: a resumed run replays them.
    mgr2, engine2 = setup(tmp_path, dynamicSamplingRounds=6)
    engine2.always_right = engine.always_right
    again = asyncio.run(mgr2.generate(step=0))
    assert again.metrics["prompts_sha"] == m["prompts_sha"]
    assert torch.equal(again.batch.input_ids, b.input_ids)


def test_dynamic_sampling_gives_up_after_its_rounds(tmp_path: Path) -> None:
    mgr, engine = setup(tmp_path, dynamicSamplingRounds=2)
    engine.always_right = {f"{a}+{a}=" for a in range(10, 20)}  # no prompt has spread
    rollout = asyncio.run(mgr.generate(step=0))
    assert rollout.metrics["dynamic_sampling_rounds"] == 2
    assert rollout.metrics["kept_group_fraction"] == 0.0
    assert rollout.batch.loss_mask.sum() == 0  # nothing left to train on, nothing made up
    # 2 prompts, then 2 rounds of 2 fresh prompts: one engine request per round
    assert len(engine.calls) == 2 + 2 * 2


def test_overlong_shaping_lowers_scores_not_rewards(tmp_path: Path) -> None:
    # maxResponseLen 4, buffer 2: the ramp starts after 2 tokens; a right answer ("2x" + eos)
    # is 3 tokens -> -(3 - 2) / 2 * 0.5 = -0.25; a wrong one ("0" + eos) is 2 tokens -> 0.
    mgr, _ = setup(tmp_path, overlongBuffer=2, overlongPenalty=0.5)
    rollout = asyncio.run(mgr.generate(step=3))
    m = rollout.metrics
    lengths = rollout.batch.loss_mask.sum(1)
    rights = float((lengths == 3).float().mean())
    assert m["reward_mean"] == pytest.approx(rights)
    assert m["score_mean"] == pytest.approx(rights * (1 - 0.25))


def test_kl_in_the_reward_uses_the_trainers_reference(tmp_path: Path) -> None:
    asked: list[int] = []

    def ref(batch: Any) -> torch.Tensor:
        asked.append(len(batch))
        return batch.rollout_logprobs - 1.0 * batch.loss_mask  # KL of 1 per response token

    algo = {"advantageEstimator": "reinforce_plus_plus", "klPenalty": "reward", "klCoef": 0.5}
    mgr, _ = setup(tmp_path, ref_logprobs=ref, **algo)
    with_kl = asyncio.run(mgr.generate(step=3)).batch
    assert asked == [8] and with_kl.ref_logprobs is not None
    plain, _ = setup(tmp_path, advantageEstimator="reinforce_plus_plus")
    without = asyncio.run(plain.generate(step=3)).batch
    assert torch.equal(with_kl.input_ids, without.input_ids)
    assert not torch.allclose(with_kl.advantages, without.advantages)
    with pytest.raises(ValueError, match="reference \\(teacher\\) log-probs"):
        setup(tmp_path, **algo)


def test_ppo_asks_the_critic_and_sets_targets(tmp_path: Path) -> None:
    def values(batch: Any) -> torch.Tensor:
        return 0.25 * batch.loss_mask  # a critic that predicts 0.25 everywhere

    mgr, _ = setup(tmp_path, values=values, advantageEstimator="ppo", gaeLambda=1.0)
    rollout = asyncio.run(mgr.generate(step=3))
    b = rollout.batch
    assert b.values is not None and b.returns is not None
    on = b.loss_mask.bool()
    # gamma = lambda = 1: every token's return is its response's score, here the exact reward
    # (the engine answers right for even seeds): one value per response, and their mean is the
    # step's reward_mean.
    per_response = [b.returns[i][on[i]] for i in range(len(b))]
    assert all(torch.all(r == r[0]) and float(r[0]) in (0.0, 1.0) for r in per_response)
    assert sum(float(r[0]) for r in per_response) / len(b) == rollout.metrics["reward_mean"]
    assert 0.0 < rollout.metrics["reward_mean"] < 1.0  # both kinds present: the check bites
    assert abs(float(b.advantages[on].mean())) < 1e-5  # whitened
    assert "explained_variance" in rollout.metrics
    with pytest.raises(ValueError, match="critic"):
        setup(tmp_path, advantageEstimator="ppo")


def test_demonstrations_come_with_each_rollout(tmp_path: Path) -> None:
    mgr, engine = setup(tmp_path, sft=True, sftCoef=0.5)
    rollout = asyncio.run(mgr.generate(step=0))
    sft = rollout.sft
    assert sft is not None and len(sft) == 4
    for i in range(4):
        ids = sft.input_ids[i][sft.attention_mask[i].bool()].tolist()
        target = sft.input_ids[i][sft.loss_mask[i].bool()].tolist()
        prompt = engine.tok.decode(ids[:len(ids) - len(target)])
        # the target is the label then EOS, cut to maxResponseLen (4); nothing else trains
        want = engine.tok(engine.labels[prompt], add_special_tokens=False)["input_ids"]
        assert target == [*want, engine.tok.eos_token_id][:4]
    again = asyncio.run(mgr.generate(step=1)).sft
    assert again is not None and not torch.equal(again.input_ids, sft.input_ids)  # moves on
    plain, _ = setup(tmp_path)
    assert asyncio.run(plain.generate(step=0)).sft is None


def test_a_checkpoint_records_where_the_untrained_rollouts_began_drawing(tmp_path: Path
                                                                         ) -> None:
    """Mode async draws the prompts of later steps before the current one trains. The position
    a checkpoint after step k records is where step k+1's rollout began drawing (prompts and
    demonstrations), so a run resumed from it draws the same prompts for step k+1 on."""
    mgr, engine = setup(tmp_path, sft=True, sftCoef=0.5)
    for step in range(3):  # steps 1 and 2 generated ahead of training
        asyncio.run(mgr.generate(step))
    drawn = engine.prompts_sent[8:]  # steps 1 and 2 (8 requests a step)
    position = mgr.position_at(1)
    assert position != mgr.position_at(3)  # (3: not begun, so where the sources are now)
    resumed, engine2 = setup(tmp_path, sft=True, sftCoef=0.5)
    resumed.source.load_state_dict(position.data)
    assert resumed.sft_source is not None
    resumed.sft_source.load_state_dict(position.sft_data)
    for step in (1, 2):
        asyncio.run(resumed.generate(step))
    assert engine2.prompts_sent == drawn
    assert mgr.position_at(2) != position  # positions of trained steps are forgotten...
    assert mgr.position_at(1) == mgr.position_at(3)  # ...and read as the current one


def test_engine_throughput_per_engine_and_spread() -> None:
    """Tokens per second of each engine over its own requests (hand-computed)."""
    from kuberl_trainer.rollout.batch import engine_throughput

    sample = Sample(prompt="p", label="l", index=0, epoch=0)

    def resp(engine: str, tokens: int, seconds: float, request: int) -> Response:
        return Response(sample=sample, prompt_ids=[1], output_ids=[5] * tokens, logprobs=[],
                        text="", truncated=False, engine=engine, seconds=seconds,
                        request=request)
    # A: one request of 2 s for 3 + 3 tokens: 3 tok/s. B: a request of 1 s (4 tokens) and
    # one of 3 s (8 + 4 tokens): 16 tokens in 4 s, 4 tok/s.
    out = engine_throughput([resp("A", 3, 2.0, 1), resp("A", 3, 2.0, 1),
                             resp("B", 4, 1.0, 2), resp("B", 8, 3.0, 3),
                             resp("B", 4, 3.0, 3)])
    assert out == {"engine_tokens_per_s_min": 3.0, "engine_tokens_per_s_max": 4.0,
                   "engine_tokens_per_s_mean": 3.5, "engine_throughput_spread": 4.0 / 3.0}
    assert engine_throughput([resp("", 3, 0.0, 0)]) == {}  # (untimed: none reported)


def test_a_rows_versions_are_its_oldest_possible_and_its_newest(tmp_path: Path) -> None:
    """Mode async tells the rollout the version the engines hold as it goes (`held`): a
    response reported under a newer one (an update came while it was generated) counts as of
    the held one, the oldest weights that can have sampled its first tokens."""
    mgr, _ = setup(tmp_path)  # the table's engines report version 1
    assert set(asyncio.run(mgr.generate(step=0, held=lambda: 0)).versions) == {("0", "1")}
    assert set(asyncio.run(mgr.generate(step=1, held=lambda: 1)).versions) == {("1", "1")}
    assert set(asyncio.run(mgr.generate(step=2)).versions) == {("1", "1")}  # (sync mode)
