"""The engines' routes on their way to the trainer (algorithm.routingReplay rollout): asked
for in every /generate, kept with each row, aligned to its tokens in the TrainBatch."""

from __future__ import annotations

import pytest
import torch

from kuberl_trainer.engines.client import GenerateResult, generate_request
from kuberl_trainer.rollout.batch import pack
from kuberl_trainer.rollout.generate import Response
from kuberl_trainer.rollout.prompts import Sample
from kuberl_wire.moe_routes import NO_ROUTE, MoeShape, encode

SAMPLE = Sample(prompt="1+2=", label="3", index=0, epoch=0)
SHAPE = MoeShape(layers=2, experts=4, top_k=2, moe_layers=(0, 1))


def row(prompt: list[int], output: list[int], routes: torch.Tensor | None) -> Response:
    return Response(sample=SAMPLE, prompt_ids=prompt, output_ids=output,
                    logprobs=[-0.5] * len(output), text="", truncated=False,
                    routes=None if routes is None else encode(routes))


def table(tokens: int, base: int) -> torch.Tensor:
    return (torch.arange(tokens * 4).view(tokens, 2, 2) + base) % 4


def test_each_rows_routes_sit_at_its_tokens_positions() -> None:
    a, b = table(4, 0), table(2, 1)   # every token but the last of 5 and of 3 tokens
    rows = [row([1, 2, 3], [4, 5], a), row([1, 2], [6], b),
            Response.filler_row(SAMPLE, pad_id=0)]
    batch = pack(rows, torch.zeros(3), pad_id=0, routes=SHAPE)
    assert batch.routes is not None and batch.routes.shape == (3, 5, 2, 2)
    assert torch.equal(batch.routes[0, :4], a) and (batch.routes[0, 4] == NO_ROUTE).all()
    assert torch.equal(batch.routes[1, :2], b) and (batch.routes[1, 2:] == NO_ROUTE).all()
    assert (batch.routes[2] == NO_ROUTE).all()
    assert pack(rows, torch.zeros(3), pad_id=0).routes is None


def test_a_row_without_routes_or_with_too_many_is_refused() -> None:
    with pytest.raises(ValueError, match="row 0: the engine returned no routed_experts"):
        pack([row([1], [2], None)], torch.zeros(1), pad_id=0, routes=SHAPE)
    with pytest.raises(ValueError, match="routes for 5 tokens, the row has 3"):
        pack([row([1, 2], [3], table(5, 0))], torch.zeros(1), pad_id=0, routes=SHAPE)


def test_generate_asks_for_routes_only_when_told() -> None:
    body = generate_request([1, 2], {"max_new_tokens": 2}, return_logprob=True,
                            return_routes=True)
    assert body["return_routed_experts"] is True
    assert "return_routed_experts" not in generate_request([1], {}, return_logprob=True)


class RoutingEngine:
    """Answers each turn "7" then EOS, with routes for every token of the call's sequence but
    the last: expert (position + call) % 4 and its neighbour, in both layers."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate_one(self, input_ids: list[int], params: dict[str, object], *,
                           url: str | None = None) -> GenerateResult:
        from tests.integration.tiny_model import build_tokenizer

        tok = build_tokenizer()
        self.calls += 1
        ids = [*tok("7", add_special_tokens=False)["input_ids"], tok.eos_token_id]
        n = len(input_ids) + len(ids) - 1
        first = (torch.arange(n) + self.calls) % 4
        table = torch.stack([first, (first + 1) % 4], dim=-1)[:, None].expand(n, 2, 2)
        return GenerateResult(output_ids=ids, text="7", finish_reason="stop",
                              prompt_tokens=len(input_ids), completion_tokens=len(ids),
                              logprobs=[-0.25] * len(ids), weight_version="1",
                              engine_url=url or "http://e", meta_info={
                                  "routed_experts": encode(table)})


async def test_a_trajectorys_routes_are_its_last_turns_over_every_token_before_it() -> None:
    from kuberl_trainer.agents import RolloutContext

    engine = RoutingEngine()
    ctx = RolloutContext(engine, {"max_new_tokens": 4}, prompt_ids=[5, 6, 7],  # type: ignore[arg-type]
                         budget=12)
    traj = ctx.trajectory()
    await ctx.generate(traj)
    traj.append_env([8, 9])  # the environment's tokens, routed in the next turn's prefill
    await ctx.generate(traj)
    response = Response.from_trajectory(SAMPLE, traj, text="7")
    batch = pack([response], torch.zeros(1), pad_id=0, routes=SHAPE)
    assert batch.routes is not None
    length = len(traj.prompt_ids) + len(traj.ids)
    # the second call's table covers every token but the last: prompt, first turn, the
    # environment's tokens and the second turn but its last token
    covered = batch.routes[0, :length - 1]
    assert (covered[:, 0, 0] == (torch.arange(length - 1) + 2) % 4).all()
    assert (batch.routes[0, length - 1:] == NO_ROUTE).all()
