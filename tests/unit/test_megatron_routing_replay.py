"""Routing replay's hook on megatron's routers, without megatron-core
(megatron/routing_replay.py): which experts a token goes to, how the router's probabilities of
the replayed experts are formed and differentiated, the mismatch count, and the token order of
a packed micro-batch's routes."""

from __future__ import annotations

import torch

from kuberl_trainer.backends.megatron.routing_replay import (
    LayerReplay,
    layer_table,
    packed_routes,
    unpack_routes,
)
from kuberl_trainer.backends.packing import pack_rows
from kuberl_wire.moe_routes import NO_ROUTE, mismatch


def topk(scores: torch.Tensor, k: int, num_groups: int | None = None,
         group_topk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.topk(scores, k=k, dim=1)  # megatron's _compute_topk without groups


def route(hook: LayerReplay, logits: torch.Tensor, k: int = 2
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's softmax routing with ``moe_router_pre_softmax=False`` (Qwen3-MoE's
    norm_topk_prob): top-k of the logits, softmax over the k chosen."""
    chosen, idx = hook.get_replay_topk(logits, k, None, None, topk)
    return torch.softmax(chosen, dim=-1), idx


def test_no_target_is_the_routers_own_choice_and_can_be_recorded() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, 0.0]])
    hook = LayerReplay(layer=0)
    hook.record = True
    _, idx = route(hook, logits)
    assert idx.tolist() == [[1, 3], [0, 2]]
    assert torch.equal(hook.recorded[0], idx)
    assert hook.covered is None


def test_replayed_experts_get_the_routers_renormalised_probabilities_and_gradient() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, 0.0, 4.0, 0.0]], requires_grad=True)
    hook = LayerReplay(layer=0)
    hook.target = torch.tensor([[0, 2], [NO_ROUTE, NO_ROUTE]])
    probs, idx = route(hook, logits)
    assert idx.tolist() == [[0, 2], [0, 2]]  # row 1: NO_ROUTE keeps the router's own
    full = torch.softmax(logits.detach(), dim=-1)
    want = full[0, [0, 2]] / full[0, [0, 2]].sum()  # HF: softmax, pick, renormalise
    assert torch.allclose(probs[0], want)
    probs[0, 0].backward()
    assert logits.grad is not None
    assert logits.grad[0, [0, 2]].abs().sum() > 0 and logits.grad[0, [1, 3]].abs().sum() == 0
    # Row 0's own top-2 {1, 3} differs from the replayed {0, 2}; row 1 was not replayed.
    assert (int(hook.mismatched), int(hook.covered)) == (1, 1)  # type: ignore[arg-type]


def test_mismatch_ignores_order_within_the_top_k_as_the_wire_does() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]] * 3)
    hook = LayerReplay(layer=0)
    target = torch.tensor([[3, 1], [1, 2], [NO_ROUTE, 0]])
    hook.target = target
    _, own = torch.topk(logits, 2, dim=1)
    route(hook, logits)
    # Row 2's target is partly NO_ROUTE: the whole row keeps the router's choice.
    assert (int(hook.mismatched), int(hook.covered)) == (1, 2)  # type: ignore[arg-type]
    assert mismatch(own, target) == (1, 2)


def test_routes_follow_the_packed_token_order() -> None:
    """A micro-batch's routes go to the router in the packed row's order (sequences one after
    another, padding dropped), and what the router records comes back to the same slots."""
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0]])
    mask = (ids != 0).long()
    packed = pack_rows(ids, mask)
    # routes[b, t] = the token id in both layers and both slots, so the order is visible.
    routes = ids[:, :, None, None].expand(2, 4, 2, 2).clone()
    flat = packed_routes(routes, mask)
    assert flat[:, 0, 0].tolist() == packed.input_ids[0].tolist()
    back = unpack_routes(flat, mask)
    assert torch.equal(back[mask.bool()], routes[mask.bool()])
    assert (back[~mask.bool()] == NO_ROUTE).all()


def test_layer_table_leaves_other_stages_layers_unrouted() -> None:
    a, b = torch.tensor([[1, 2]]), torch.tensor([[3, 0]])
    table = layer_table([a, None, b], layers=4, moe_layers=[0, 1, 3])
    assert table[0].tolist() == [[1, 2], [NO_ROUTE, NO_ROUTE], [NO_ROUTE, NO_ROUTE], [3, 0]]


def test_grouped_experts_compute_each_experts_swiglu_on_its_rows() -> None:
    """The grouped experts' function (its loop path here; the grouped-GEMM path on GPUs is
    checked against HF by bench/megatron_moe_check.py): expert e's rows go through
    fc2 @ (silu(gate) * up * p), an expert with no rows included."""
    from kuberl_trainer.backends.megatron.grouped_experts import grouped_swiglu

    torch.manual_seed(0)
    counts = torch.tensor([3, 0, 2])
    x, probs = torch.randn(5, 4), torch.rand(5)
    fc1 = [torch.randn(6, 4) for _ in range(3)]
    fc2 = [torch.randn(4, 3) for _ in range(3)]
    out = grouped_swiglu(x, fc1, fc2, counts, probs)
    owner = [0, 0, 0, 2, 2]
    for t, e in enumerate(owner):
        gate, up = fc1[e][:3] @ x[t], fc1[e][3:] @ x[t]
        want = fc2[e] @ (torch.nn.functional.silu(gate) * up * probs[t])
        assert torch.allclose(out[t], want, atol=1e-5)
