"""Every request body the trainer sends constructs the pinned SGLang's own request types
(sglang.srt.managers.io_struct, SamplingParams), as its HTTP server does with each body."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kuberl_trainer.engines.client import SamplingParams as KuberlSampling, generate_request
from kuberl_wire import protocol
from kuberl_wire.plan import TensorMeta
from tests.sglang_contract.conftest import load_io_struct

io_struct = load_io_struct()
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402  isort: skip


def build(type_name: str, body: dict[str, Any]) -> Any:
    cls = getattr(io_struct, type_name)
    fields = {f.name for f in dataclasses.fields(cls)}
    assert set(body) <= fields, f"{type_name} has no fields {sorted(set(body) - fields)}"
    return cls(**body)


def sampling() -> dict[str, Any]:
    return KuberlSampling(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=5, stop=("x",),
                          stop_token_ids=(1,), ignore_eos=True, sampling_seed=3).to_dict()


def test_generate_request_builds_generate_req_input() -> None:
    body = generate_request([1, 2, 3], sampling(), return_logprob=True)
    req = build("GenerateReqInput", body)
    req.normalize_batch_and_arguments()  # what SGLang's tokenizer manager does first
    assert req.input_ids == [1, 2, 3] and req.return_logprob is True and req.is_single


def test_sampling_params_build_sglang_sampling_params() -> None:
    params = SamplingParams(**sampling())
    params.normalize(None)
    params.verify(vocab_size=1000)
    assert (params.max_new_tokens, params.top_k, params.sampling_seed) == (8, 5, 3)


@pytest.mark.parametrize("type_name, body", [
    ("InitWeightsUpdateGroupReqInput", protocol.init_weights_update_group(
        master_address="10.0.0.1", master_port=1, rank_offset=1, world_size=2,
        group_name="g", backend="nccl")),
    ("UpdateWeightsFromDistributedReqInput", protocol.update_weights_from_distributed(
        [TensorMeta("w", "bfloat16", (2, 2), 8)], group_name="g", weight_version="1")),
    ("UpdateWeightsFromDistributedReqInput", protocol.update_weights_from_distributed(
        [TensorMeta("w", "bfloat16", (2, 2), 8)], group_name="g", weight_version=None,
        flattened=True)),
    ("UpdateWeightsFromTensorReqInput", protocol.update_weights_from_tensor(
        ["x"], weight_version="1")),
    ("DestroyWeightsUpdateGroupReqInput", protocol.destroy_weights_update_group("g")),
    ("ReleaseMemoryOccupationReqInput", protocol.memory_occupation(["weights"])),
    ("ReleaseMemoryOccupationReqInput", protocol.memory_occupation(None)),
    ("ResumeMemoryOccupationReqInput", protocol.memory_occupation(None)),
    ("AbortReq", protocol.abort_request("r1")),
    ("AbortReq", protocol.abort_request(abort_all=True)),
    ("PauseGenerationReqInput", protocol.pause_generation()),
    ("ContinueGenerationReqInput", protocol.continue_generation()),
])
def test_weight_and_control_bodies_build_sglang_types(type_name: str,
                                                      body: dict[str, Any]) -> None:
    build(type_name, body)


def test_pause_mode_is_one_sglang_accepts() -> None:
    req = build("PauseGenerationReqInput", protocol.pause_generation())
    assert req.mode in ("abort", "in_place", "retract")


def test_the_unit_tiers_field_lists_are_the_pinned_releases() -> None:
    """tests/unit/test_engine_contract.py checks the reference engine and the trainer against
    field lists that need no SGLang install; they must be the pinned release's."""
    import inspect

    from tests.unit import test_engine_contract as unit

    for type_name, listed in unit.SGLANG_REQUEST_FIELDS.items():
        fields = {f.name for f in dataclasses.fields(getattr(io_struct, type_name))}
        assert listed <= fields, (type_name, sorted(listed - fields))
    params = set(inspect.signature(SamplingParams.__init__).parameters) - {"self"}
    assert params >= unit.SGLANG_SAMPLING_FIELDS, sorted(unit.SGLANG_SAMPLING_FIELDS - params)
