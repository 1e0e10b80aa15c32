"""Engine command lines to check: one per shipped example, plus spec variants the examples do
not cover, each with the values SGLang (or the reference engine) must end up with.

Shared by tests/unit/test_engine_command.py (what kuberl builds) and the contract tier
(tests/sglang_contract/test_server_args.py: what the pinned SGLang's own parser makes of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kuberl_api import load, parse
from kuberl_api.spec import RLJobSpec
from kuberl_trainer.engines.command import engine_command, reward_engine_command

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
PORT, NCCL_PORT, SEED = 30011, 30012, 7
DIST_INIT_ADDR = "10.0.0.1:30013"  # node rank 0's, for an engine spanning nodes


@dataclass(frozen=True)
class Case:
    name: str
    spec: RLJobSpec
    # ServerArgs attribute -> value SGLang must parse (sglang engines only).
    expect: dict[str, Any] = field(default_factory=dict)
    node_rank: int = 0  # of an engine spanning nodes
    role: str = "rollout"  # or "reward": a replica of the served reward model (reward.model)

    def command(self, config_file: str = "") -> list[str]:
        """The engine's argv; `config_file`: SGLang's --config file with the API key."""
        if self.role == "reward":
            return reward_engine_command(self.spec, port=PORT, nccl_port=NCCL_PORT, seed=SEED,
                                         torch_threads=2, config_file=config_file)
        addr = DIST_INIT_ADDR if self.spec.engine_nodes > 1 else ""
        return engine_command(self.spec, model_path=self.spec.model.path, port=PORT,
                              nccl_port=NCCL_PORT, seed=SEED, torch_threads=2,
                              node_rank=self.node_rank, dist_init_addr=addr,
                              config_file=config_file)

    @property
    def engine(self) -> str:
        model = self.spec.reward.model
        return model.engine if self.role == "reward" and model else self.spec.rollout.engine

    @property
    def sglang(self) -> bool:
        return self.engine == "sglang"

    @property
    def tp_size(self) -> int:
        model = self.spec.reward.model
        if self.role == "reward" and model is not None:
            return max(1, model.gpus_per_replica)
        return self.spec.rollout.gpus_per_engine


def _spec(**spec: Any) -> RLJobSpec:
    body = {"model": {"path": "/models/qwen"}, "data": {"prompts": "/d.jsonl"}} | spec
    return parse({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLJob",
                  "metadata": {"name": "e"}, "spec": body}).spec


def _base_expect(spec: RLJobSpec, node_rank: int = 0) -> dict[str, Any]:
    colocated = spec.placement == "colocate" and bool(spec.rollout_gpus)
    nodes = spec.engine_nodes
    expect: dict[str, Any] = {
        "model_path": spec.model.path, "host": "0.0.0.0", "port": PORT, "nccl_port": NCCL_PORT,
        "tp_size": spec.rollout.gpus_per_engine, "random_seed": SEED,
        "tokenizer_path": spec.model.tokenizer,
        "enable_memory_saver": colocated,  # (SGLang's default False: refused colocated)
        "mem_fraction_static": spec.engine_memory_fraction,
        "nnodes": nodes, "node_rank": node_rank,
        "dist_init_addr": DIST_INIT_ADDR if nodes > 1 else None,
    }
    return expect


def _reward_expect(spec: RLJobSpec) -> dict[str, Any]:
    """What SGLang must parse of a served reward model's command line."""
    m = spec.reward.model
    assert m is not None
    return {"model_path": m.path, "tokenizer_path": m.tokenizer, "host": "0.0.0.0",
            "port": PORT, "nccl_port": NCCL_PORT, "tp_size": max(1, m.gpus_per_replica),
            "random_seed": SEED, "is_embedding": m.form == "scalar", "enable_metrics": True,
            "enable_memory_saver": False}


def example_cases() -> list[Case]:
    out = []
    for path in EXAMPLES:
        spec = load(path).spec
        out.append(Case(f"example:{path.stem}", spec,
                        _base_expect(spec) if spec.rollout.engine == "sglang" else {}))
        m = spec.reward.model
        if m is not None:
            out.append(Case(f"example:{path.stem}:reward-model", spec,
                            _reward_expect(spec) if m.engine == "sglang" else {},
                            role="reward"))
    return out


def variant_cases() -> list[Case]:
    colocated = {"training": {"backend": "megatron", "gpusPerNode": 8}, "placement": "colocate"}
    disagg = {"placement": "disaggregated"}
    variants: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("colocated-defaults", {**colocated, "rollout": {"gpusPerEngine": 1}}, {}),
        ("colocated-tp2-tokenizer", {**colocated, "model": {"path": "/models/qwen",
                                                            "tokenizer": "/models/tok"},
                                     "rollout": {"gpusPerEngine": 2}}, {}),
        ("colocated-tp4-fraction", {**colocated, "rollout": {"gpusPerEngine": 4,
                                                             "memoryFraction": 0.55}},
         {"mem_fraction_static": 0.55}),
        ("disaggregated-tp2", {**disagg, "rollout": {"gpus": 8, "gpusPerEngine": 2}}, {}),
        ("disaggregated-fraction", {**disagg, "rollout": {"gpus": 8, "memoryFraction": 0.85}},
         {"mem_fraction_static": 0.85}),
        ("disaggregated-tp4-switches", {**disagg, "rollout": {
            "gpus": 8, "gpusPerEngine": 4, "engineArgs": {
                "enable-memory-saver": "true", "skip-server-warmup": "",
                "disable-radix-cache": "false", "chunked-prefill-size": "4096",
                "context-length": "8192"}}},
         {"enable_memory_saver": True, "skip_server_warmup": True,
          "disable_radix_cache": False, "chunked_prefill_size": 4096,
          "context_length": 8192}),
        ("disaggregated-list-flags", {**disagg, "rollout": {
            "gpus": 8, "gpusPerEngine": 2, "engineArgs": {"cuda-graph-max-bs": "64"},
            "engineListArgs": {"cuda-graph-bs": ["1", "2", "4", "8"]}}},
         {"cuda_graph_bs": [1, 2, 4, 8], "cuda_graph_max_bs": 64}),
    ]
    out = []
    for name, body, extra in variants:
        spec = _spec(**body)
        out.append(Case(name, spec, _base_expect(spec) | extra))
    # An engine wider than a node (16 GPUs on 8-GPU nodes): both nodes' command lines.
    wide = _spec(**disagg, rollout={"gpus": 32, "gpusPerEngine": 16})
    out += [Case(f"disaggregated-tp16-node{rank}", wide, _base_expect(wide, rank), rank)
            for rank in range(wide.engine_nodes)]
    # The reference engine (no SGLang parser applies; its own flags are checked in
    # tests/unit/test_engine_command.py).
    out.append(Case("reference-cpu", _spec(training={"backend": "fsdp", "gpusPerNode": 0},
                                           rollout={"engine": "reference", "gpus": 0})))
    wide_cpu = _spec(placement="disaggregated", training={"backend": "fsdp", "gpusPerNode": 0},
                     rollout={"engine": "reference", "gpus": 0, "gpusPerEngine": 4,
                              "gpusPerNode": 2})
    out += [Case(f"reference-cpu-over-2-pods-node{rank}", wide_cpu, node_rank=rank)
            for rank in range(wide_cpu.engine_nodes)]
    # Served reward models (reward.model): a scalar head, a judge over 2 GPUs.
    scalar = _spec(reward={"type": "model", "model": {
        "path": "/models/rm", "tokenizer": "/models/rm-tok",
        "engineArgs": {"context-length": "4096"}}})
    judge = _spec(reward={"type": "model", "model": {
        "path": "/models/judge", "form": "judge", "gpusPerReplica": 2,
        "judge": {"prompt": "Grade {response}"}}})
    out += [Case("reward-model-scalar", scalar, _reward_expect(scalar) | {"context_length": 4096},
                 role="reward"),
            Case("reward-model-judge-tp2", judge, _reward_expect(judge), role="reward"),
            Case("reward-model-reference-cpu", _spec(reward={"type": "model", "model": {
                "path": "/models/rm", "engine": "reference", "gpusPerReplica": 0,
                "engineArgs": {"max-batch-size": "64"}}}), role="reward")]
    return out


def all_cases() -> list[Case]:
    return example_cases() + variant_cases()
