"""The engines' routes on their way to the trainer (algorithm.routingReplay rollout): asked
for in every /generate, kept with each row, aligned to its tokens in the TrainBatch."""

from __future__ import annotations

import pytest
import torch

from kuberl_trainer.engines.client import generate_request
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
