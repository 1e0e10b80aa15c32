"""Mixture-of-experts weights and flags against SGLang 0.5.6's own code, on CPU.

- The names kuberl sends a MoE model's weights under (the checkpoint's: kuberl_wire.expert_names
  on a transformers Qwen3-MoE, the reference engine's named_tensors) are each consumed by SGLang's
  `Qwen3MoeForCausalLM.load_weights`, run as shipped (compiled from the wheel's source: the
  module itself imports CUDA-only kernels) against the parameters SGLang's model has: an expert's
  matrix lands in its layer's fused `experts.w13_weight` / `w2_weight` with its expert id and
  shard (w1 gate, w3 up, w2 down), the router under `mlp.gate.weight`. SGLang skips a name it
  does not know without a word, so "consumed" is the property that matters.
- `--ep-size` (and its spellings) parses as SGLang's parser parses it; the experts the reference
  engine's ranks checksum are those SGLang's FusedMoE maps to that rank (its own
  `_map_global_expert_id_to_local_expert_id`, and its MoE-EP groups from
  `initialize_model_parallel`, both run from the wheel's source).
- `--enable-return-routed-experts` is not an SGLang 0.5.6 flag (it came in 0.5.7): kuberl's
  routingReplay: rollout cannot be served by the pinned SGLang (docs/engine-contract.md).
"""

from __future__ import annotations

import argparse
import ast
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kuberl_rollout.reference.__main__ import parse_args
from kuberl_rollout.reference.moe import owned_experts
from kuberl_wire import expert_names
from tests.integration.tiny_moe import DENSE_LAYERS, EXPERTS, LAYERS, tiny_moe_config

import sglang  # isort: skip  (the pinned wheel: conftest)
from sglang.srt.server_args import ServerArgs  # isort: skip

SRT = Path(sglang.__file__).parent / "srt"


def _function(path: Path, cls: str | None, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text(), str(path))
    body: list[ast.stmt] = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    return fn


def compiled(path: Path, cls: str | None, name: str, namespace: dict[str, Any]) -> Any:
    """Function `name` (of class `cls`) from SGLang's source, executed as shipped in
    `namespace` (what its module would have imported)."""
    fn = _function(path, cls, name)
    code = compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec")
    exec(code, namespace)
    return namespace[name]


class Param:
    """A parameter of SGLang's model that records what its weight loader is given."""

    def __init__(self, name: str, calls: list[tuple[Any, ...]]) -> None:
        self.name = name
        self.calls = calls

    def weight_loader(self, param: Param, weight: torch.Tensor, *args: Any,
                      **kwargs: Any) -> None:
        self.calls.append((self.name, tuple(weight.shape), args, kwargs))


def sglang_qwen3_moe_params(calls: list[tuple[Any, ...]]) -> dict[str, Param]:
    """The parameters SGLang 0.5.6's Qwen3MoeForCausalLM has for the tiny config: fused qkv
    (QKVParallelLinear "qkv_proj"), a dense layer's fused gate_up_proj (Qwen2MoeMLP), a MoE
    layer's router ReplicatedLinear "gate" and FusedMoE "experts" with w13_weight / w2_weight
    (asserted from the source in test_the_parameters_assumed_are_sglangs)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        names += [p + s for s in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                                  "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                  "input_layernorm.weight", "post_attention_layernorm.weight")]
        names += [p + s for s in (("mlp.gate_up_proj.weight", "mlp.down_proj.weight")
                                  if i in DENSE_LAYERS else
                                  ("mlp.gate.weight", "mlp.experts.w13_weight",
                                   "mlp.experts.w2_weight"))]
    return {n: Param(n, calls) for n in names}


def test_the_parameters_assumed_are_sglangs() -> None:
    source = (SRT / "models" / "qwen3_moe.py").read_text()
    block = source[source.index("class Qwen3MoeSparseMoeBlock"):]
    block = block[:block.index("\nclass ")]
    assert "self.experts = get_moe_impl_class(" in block
    assert 'prefix=add_prefix("experts", prefix)' in block
    assert "self.gate = ReplicatedLinear(" in block and 'add_prefix("gate", prefix)' in block
    unquant = (SRT / "layers" / "quantization" / "unquant.py").read_text()
    assert 'register_parameter("w13_weight"' in unquant
    assert 'register_parameter("w2_weight"' in unquant


def load_into_sglang(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[Any, ...]]:
    """Run SGLang's Qwen3MoeForCausalLM.load_weights over `named`; the loader calls made."""
    layer = SRT / "layers" / "moe" / "fused_moe_triton" / "layer.py"
    mapping = compiled(layer, "FusedMoE", "make_expert_params_mapping", {"List": list,
                                                                           "Tuple": tuple})
    calls: list[tuple[Any, ...]] = []
    params = sglang_qwen3_moe_params(calls)

    def default_loader(param: Param, weight: torch.Tensor) -> None:
        param.weight_loader(param, weight)

    from sglang.srt.layers.utils import get_layer_id  # (plain Python)

    namespace: dict[str, Any] = {
        "Iterable": Iterable, "Tuple": tuple, "torch": torch,
        "logger": logging.getLogger("sglang-contract"), "get_layer_id": get_layer_id,
        "default_weight_loader": default_loader,
        "FusedMoE": SimpleNamespace(make_expert_params_mapping=lambda **kw: mapping(None, **kw)),
        "Qwen3MoeSparseMoeBlock": type("Qwen3MoeSparseMoeBlock", (), {}),
    }
    load_weights: Callable[..., None] = compiled(SRT / "models" / "qwen3_moe.py",
                                                 "Qwen3MoeForCausalLM", "load_weights", namespace)
    model = SimpleNamespace(
        config=SimpleNamespace(num_experts=EXPERTS),
        model=SimpleNamespace(start_layer=0, end_layer=LAYERS),
        start_layer=0, end_layer=LAYERS, _cached_params_dict=params,
        routed_experts_weights_of_layer={})
    load_weights(model, named)
    return calls


def test_every_expert_name_kuberl_sends_is_consumed_by_sglangs_loader() -> None:
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(tiny_moe_config("qwen3"))  # type: ignore[arg-type]
    # What the reference engine names and what the fsdp backend sends: the same split.
    named = [part for name, t in model.state_dict().items()
             for part in expert_names.split(name, t)]
    calls = load_into_sglang((n, t) for n, t in named)
    assert len(calls) == len(named)  # one loader call per tensor: nothing skipped
    by_target: dict[str, list[tuple[Any, ...]]] = {}
    for target, shape, args, kwargs in calls:
        by_target.setdefault(target, []).append((shape, args, kwargs))
    shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    experts = [(n, t) for n, t in named if ".experts." in n]
    assert len(experts) == EXPERTS * 3 * (LAYERS - len(DENSE_LAYERS))
    for name, tensor in experts:
        slot = expert_names.slot(name)
        assert slot is not None
        layer = name.split(".mlp.")[0]
        target = f"{layer}.mlp.experts.{'w2' if slot.part == 'down_proj' else 'w13'}_weight"
        want = (tuple(tensor.shape), (target,),
                {"shard_id": shard[slot.part], "expert_id": slot.expert})
        assert want in by_target[target], name
    for i in set(range(LAYERS)) - set(DENSE_LAYERS):
        router = f"model.layers.{i}.mlp.gate.weight"
        assert router in dict(named) and len(by_target[router]) == 1
    assert set(by_target) == set(sglang_qwen3_moe_params([]))  # every parameter was loaded


def test_a_fused_expert_name_is_not_what_sglang_loads() -> None:
    """transformers' own fused names (mlp.experts.gate_up_proj) would be silently dropped by
    SGLang's loader: the reason kuberl sends per-expert names."""
    fused = [("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(EXPERTS, 32, 32)),
             ("model.layers.0.mlp.experts.down_proj", torch.zeros(EXPERTS, 32, 16))]
    assert load_into_sglang(fused) == []


def sglang_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("spelling", ["--ep-size", "--ep", "--expert-parallel-size"])
def test_ep_size_parses_as_sglangs(spelling: str) -> None:
    argv = ["--model-path", "/m", "--tp-size", "4", spelling, "2"]
    theirs = sglang_parser().parse_args(argv)
    ours = parse_args(argv)
    assert theirs.expert_parallel_size == ours.ep_size == 2
    default = ["--model-path", "/m"]
    assert sglang_parser().parse_args(default).expert_parallel_size == parse_args(
        default).ep_size == ServerArgs.ep_size == 1


def test_return_routed_experts_is_not_a_flag_of_the_pinned_sglang() -> None:
    flags = {opt for action in sglang_parser()._actions for opt in action.option_strings}
    assert "--enable-return-routed-experts" not in flags
    assert "--enable-return-routed-experts" in {
        opt for action in _reference_parser()._actions for opt in action.option_strings}


def _reference_parser() -> argparse.ArgumentParser:
    from kuberl_rollout.reference.__main__ import build_parser

    return build_parser()


def sglang_moe_ep_groups(tp: int, ep: int) -> list[list[int]]:
    """The MoE-EP groups SGLang's initialize_model_parallel builds for one TP group: the
    statement that builds them, run from the wheel's source."""
    path = SRT / "distributed" / "parallel_state.py"
    fn = _function(path, None, "initialize_model_parallel")
    node = next(n for n in ast.walk(fn) if isinstance(n, ast.If)
                and "moe_ep_size == tensor_model_parallel_size" in ast.unparse(n.test))
    built: list[list[int]] = []

    def init_group(group_ranks: list[list[int]], *_: Any, **__: Any) -> str:
        built.extend(group_ranks)
        return "group"

    namespace: dict[str, Any] = {
        "moe_ep_size": ep, "moe_tp_size": tp // ep, "tensor_model_parallel_size": tp,
        "num_tensor_model_parallel_groups": 1, "_TP": "tp", "backend": "gloo",
        "init_model_parallel_group": init_group,
        "get_world_group": lambda: SimpleNamespace(local_rank=0)}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
    return built if built else [list(range(tp))]  # (ep == tp: the TP group itself)


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (4, 2), (4, 4), (4, 1), (8, 2)])
def test_an_ep_rank_checksums_the_experts_sglang_gives_it(tp: int, ep: int) -> None:
    layer = SRT / "layers" / "moe" / "fused_moe_triton" / "layer.py"
    local = compiled(layer, "FusedMoE", "_map_global_expert_id_to_local_expert_id", {})
    groups = sglang_moe_ep_groups(tp, ep)
    for rank in range(tp):
        ep_rank = next(g.index(rank) for g in groups if rank in g)
        moe = SimpleNamespace(num_experts=EXPERTS, num_fused_shared_experts=0,
                              num_local_experts=EXPERTS // ep, moe_ep_rank=ep_rank)
        theirs = [e for e in range(EXPERTS) if local(moe, e) != -1]
        assert theirs == list(owned_experts(rank, tp, ep, EXPERTS)), (tp, ep, rank)
