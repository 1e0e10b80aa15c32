"""The trainer's engine requests use only field names SGLang's own request types accept.

SGLang's HTTP server parses bodies into the request types of
python/sglang/srt/managers/io_struct.py (and SamplingParams for `sampling_params`) and rejects
unknown fields, so a misspelt field works against the reference engine but fails in a cluster.

The field lists below are SGLang 0.5.6's (kuberl_trainer.engines.command.SGLANG_VERSION: the
rollout image's base, Dockerfile.rollout), the subset relevant to RL. They need no SGLang
install, so this file runs in `make unit`; the contract tier (`make contract`,
tests/sglang_contract/) checks them against the pinned wheel's own dataclasses and builds
SGLang's request types from the trainer's bodies. (Earlier lists, read from a 0.5.3rc2-era
main branch, held torch_empty_cache and disable_draft_model, which 0.5.6 does not have.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kuberl_rollout.reference import (
    classify_server as ref_classify,
    sampling as ref_sampling,
    server as ref_server,
)
from kuberl_trainer.engines.client import SamplingParams, generate_request
from kuberl_trainer.engines.command import SGLANG_VERSION
from kuberl_wire import protocol
from kuberl_wire.plan import TensorMeta

SGLANG_CHECKED = SGLANG_VERSION

# io_struct.py request types (the subset of fields relevant to RL; all exist there).
SGLANG_REQUEST_FIELDS: dict[str, set[str]] = {
    "GenerateReqInput": {
        "rid", "text", "input_ids", "input_embeds", "image_data", "sampling_params",
        "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
        "return_text_in_logprobs", "stream", "log_metrics", "return_hidden_states",
        "modalities", "session_params", "lora_path", "lora_id", "custom_logit_processor",
        "bootstrap_host", "bootstrap_port", "bootstrap_room", "data_parallel_rank",
        "priority", "no_logs", "custom_labels", "return_bytes", "return_entropy",
    },
    "InitWeightsUpdateGroupReqInput": {
        "rid", "master_address", "master_port", "rank_offset", "world_size", "group_name",
        "backend",
    },
    "UpdateWeightsFromDistributedReqInput": {
        "rid", "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests",
        "weight_version", "load_format",
    },
    "UpdateWeightsFromTensorReqInput": {
        "rid", "serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
        "weight_version",
    },
    "DestroyWeightsUpdateGroupReqInput": {"rid", "group_name"},
    "ReleaseMemoryOccupationReqInput": {"rid", "tags"},
    "ResumeMemoryOccupationReqInput": {"rid", "tags"},
    "AbortReq": {"rid", "abort_all", "finished_reason", "abort_message"},
    "PauseGenerationReqInput": {"rid", "mode"},
    "ContinueGenerationReqInput": {"rid"},
    # /classify and /encode (a reward model served with --is-embedding)
    "EmbeddingReqInput": {
        "rid", "text", "input_ids", "image_data", "video_data", "audio_data",
        "sampling_params", "input_embeds", "log_metrics", "modalities",
        "is_cross_encoder_request", "priority", "dimensions",
    },
}

# Fields of a later SGLang than the pin that the reference engine takes, and the release that
# has them: kuberl sends one only where it refuses SGLang engines (algorithm.routingReplay
# rollout: return_routed_experts, SGLang >= 0.5.7). When the pin reaches that release the
# field moves into SGLANG_REQUEST_FIELDS (test_later_fields_are_not_in_the_pin fails then).
LATER_SGLANG_FIELDS = {"GenerateReqInput": {"return_routed_experts": "0.5.7"}}

# sampling_params.py SamplingParams API parameters (internal fields such as stop_strs omitted).
SGLANG_SAMPLING_FIELDS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "n", "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}

# tokenizer_manager.py: keys of a /generate answer's meta_info the client reads; the answer
# itself carries "text" and "output_ids".
SGLANG_META_INFO_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                         "cached_tokens", "weight_version", "output_token_logprobs"}
SGLANG_FINISH_TYPES = {"stop", "length", "abort"}
# tokenizer_manager._handle_batch_output for an embedding (BatchEmbeddingOutput): no
# completion_tokens or cached_tokens; e2e_latency once finished.
SGLANG_EMBEDDING_META_INFO_KEYS = {"id", "finish_reason", "prompt_tokens", "weight_version",
                                   "total_retractions", "e2e_latency"}


def assert_fields(body: dict[str, Any], request_type: str) -> None:
    extra = set(body) - SGLANG_REQUEST_FIELDS[request_type]
    assert not extra, f"{request_type} has no fields {sorted(extra)} in SGLang {SGLANG_CHECKED}"


def test_generate_request_uses_sglang_fields() -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=5, stop=("x",),
                            stop_token_ids=(1,), ignore_eos=True, sampling_seed=3).to_dict()
    assert set(params) == {"max_new_tokens", "temperature", "top_p", "top_k", "stop",
                           "stop_token_ids", "ignore_eos", "sampling_seed"}
    assert set(params) <= SGLANG_SAMPLING_FIELDS
    assert_fields(generate_request([1, 2], params, return_logprob=True), "GenerateReqInput")


def test_weight_requests_use_sglang_fields() -> None:
    metas = [TensorMeta("w", "bfloat16", (2, 2), 8)]
    assert_fields(protocol.init_weights_update_group(
        master_address="10.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name="g",
        backend="nccl"), "InitWeightsUpdateGroupReqInput")
    assert_fields(protocol.update_weights_from_distributed(
        metas, group_name="g", weight_version="1"), "UpdateWeightsFromDistributedReqInput")
    flat = protocol.update_weights_from_distributed(metas, group_name="g", weight_version=None,
                                                    flattened=True)
    assert_fields(flat, "UpdateWeightsFromDistributedReqInput")
    assert flat["load_format"] == "flattened_bucket"  # the value SGLang's model runner takes
    assert_fields(protocol.update_weights_from_tensor(["x"], weight_version="1"),
                  "UpdateWeightsFromTensorReqInput")
    assert_fields(protocol.destroy_weights_update_group("g"), "DestroyWeightsUpdateGroupReqInput")
    assert_fields(protocol.memory_occupation(["weights"]), "ReleaseMemoryOccupationReqInput")
    assert_fields(protocol.memory_occupation(None), "ResumeMemoryOccupationReqInput")
    assert_fields(protocol.abort_request("r1"), "AbortReq")
    assert_fields(protocol.pause_generation(), "PauseGenerationReqInput")
    assert_fields(protocol.continue_generation(), "ContinueGenerationReqInput")


def test_init_group_carries_every_required_field() -> None:
    # SGLang's InitWeightsUpdateGroupReqInput has no defaults for these.
    body = protocol.init_weights_update_group(master_address="a", master_port=1, rank_offset=1,
                                              world_size=2, group_name="g", backend="gloo")
    assert {"master_address", "master_port", "rank_offset", "world_size"} <= set(body)


def test_reference_engine_accepts_only_sglang_names() -> None:
    """The reference engine must not accept a spelling SGLang would reject (the trainer would
    pass its tests and fail in the cluster)."""
    accepted_sampling = ref_sampling._SUPPORTED | set(ref_sampling._DEFAULT_ONLY)
    assert accepted_sampling <= SGLANG_SAMPLING_FIELDS, accepted_sampling - SGLANG_SAMPLING_FIELDS
    accepted_generate = ref_server._GENERATE_FIELDS - set(LATER_SGLANG_FIELDS["GenerateReqInput"])
    assert accepted_generate <= SGLANG_REQUEST_FIELDS["GenerateReqInput"]
    accepted_classify = ref_classify._CLASSIFY_FIELDS | set(ref_classify._DEFAULT_ONLY_FIELDS)
    assert accepted_classify <= SGLANG_REQUEST_FIELDS["EmbeddingReqInput"]


def test_later_fields_are_not_in_the_pin() -> None:
    """A later release's field the reference engine takes is not one of the pin's (else it
    belongs in SGLANG_REQUEST_FIELDS), and the pin is older than the release that has it."""
    def version(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split("."))

    for request, fields in LATER_SGLANG_FIELDS.items():
        for field, release in fields.items():
            assert field not in SGLANG_REQUEST_FIELDS[request]
            assert version(SGLANG_VERSION) < version(release), (field, release)


def test_reference_engine_answers_with_sglang_keys() -> None:
    """The keys the reference engine puts in meta_info are SGLang's (checked on a real answer
    in tests/integration/test_reference_engine.py; the set is the contract here)."""
    assert {"finish_reason", "prompt_tokens", "completion_tokens", "output_token_logprobs",
            "weight_version"} <= SGLANG_META_INFO_KEYS
    assert ref_sampling.Finish("stop", matched=1).to_json(4)["type"] in SGLANG_FINISH_TYPES
    assert ref_sampling.Finish("length").to_json(4) == {"type": "length", "length": 4}
    assert ref_sampling.Finish("abort").to_json(4)["type"] == "abort"


def test_one_sglang_version_everywhere() -> None:
    """The rollout image, the contract tier's install and the launcher name one release."""
    repo = Path(__file__).resolve().parents[2]
    base = re.search(r"^FROM lmsysorg/sglang:v(\S+?)-", (repo / "Dockerfile.rollout").read_text(),
                     re.M)
    assert base is not None and base.group(1) == SGLANG_VERSION
    make = re.search(r"^SGLANG_VERSION := (\S+)$", (repo / "Makefile").read_text(), re.M)
    assert make is not None and make.group(1) == SGLANG_VERSION
    reqs = (repo / "tests" / "sglang_contract" / "requirements.txt").read_text().splitlines()
    assert f"sglang=={SGLANG_VERSION}" in reqs


def test_reference_pool_is_sized_as_sglang_sizes_it() -> None:
    """SGLang 0.5.6: pool = mem_fraction_static x (free before the weights load) - weights.
    80 GB free, 0.7, 12 GB of weights -> 44 GB; a trainer already holding 24 GB leaves 56
    free -> 27.2 GB (a smaller pool, not an error); too little -> SGLang's own refusal."""
    from kuberl_rollout.reference.engine import static_pool_bytes

    gb = 10**9
    assert static_pool_bytes(0.7, 80 * gb, 12 * gb) == 44 * gb
    assert static_pool_bytes(0.7, 56 * gb, 12 * gb) == int(27.2 * gb)
    with pytest.raises(RuntimeError, match=r"Not enough memory\. Please try to increase "
                                           r"--mem-fraction-static"):
        static_pool_bytes(0.2, 56 * gb, 12 * gb)
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        static_pool_bytes(1.0, 80 * gb, 1)
