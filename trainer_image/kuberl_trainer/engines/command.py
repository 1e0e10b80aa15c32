"""The engine server's command line (engine_actors.EngineServer runs it), from the spec alone.

Pure (no Ray, no CUDA): the contract tier (tests/sglang_contract/) parses every command built
here with the pinned SGLang's own server-argument parser.

What kuberl passes to SGLang (`python -m sglang.launch_server`) and why:
  --model-path, --tokenizer-path   the spec's model (the engines detokenize what rewards read)
  --host 0.0.0.0 --port P          a free port on the actor's node (the trainer calls it there)
  --nccl-port Q                    a second free port on that node, for the engine's own TP
                                   process group; SGLang's default is a random port that can
                                   collide when several engines share a node
  --tp-size N                      rollout.gpusPerEngine
  --nnodes K --node-rank R         an engine wider than a rollout node (spec.engine_nodes K > 1):
  --dist-init-addr H:P             one process per node, node rank 0 serving HTTP, the others
                                   only joining its TP group, whose rendezvous is H:P (a free
                                   port on node rank 0's node); SGLang's ranks >= 1 answer only
                                   /health on their own port
  --random-seed S                  the run's seed + the engine's index
  --mem-fraction-static F          spec.engine_memory_fraction: rollout.memoryFraction, by
                                   default 0.7 for colocated engines on GPUs (the reference
                                   engine reserves its pool the same way); unset otherwise
  --enable-metrics                 GET /metrics (Prometheus), for dashboards and the chart's
                                   PodMonitor; engineArgs {enable-metrics: "false"} turns it off
  colocate with rollout GPUs:      --enable-memory-saver (what SGLang needs to release and
                                   resume its memory, handing it to training between phases)
  training.lora sync: adapter:     --enable-lora --max-lora-rank R --lora-target-modules M..
                                   --max-loaded-loras N --max-loras-per-batch N (lora_flags:
                                   the engines serve the base with the trainer's adapters)
  algorithm.routingReplay rollout: --enable-return-routed-experts (the engine answers each
                                   /generate's return_routed_experts; SGLang >= 0.5.7's flag,
                                   so kuberl refuses rollout replay on SGLang 0.5.6 engines
                                   and only the reference engine gets it)
  then rollout.engineArgs and      see engine_arg_flags
  engineListArgs
  --config F                       with an API key (the job's $KUBERL_ENGINE_API_KEY): a YAML
                                   file {api-key: KEY} (api_key_config) that SGLang 0.5.6's
                                   prepare_server_args merges under the command line's flags;
                                   SGLang reads the key from no environment variable, and a
                                   --api-key flag would show it in `ps` and /proc/PID/cmdline.
                                   The file is the engine actor's (EngineServer), mode 0600 in
                                   a private directory on /dev/shm (memory, not disk), removed
                                   with the server
The reference engine (`python -m kuberl_rollout.reference`) gets the same model, host, port,
--tp-size, multi-node and metrics flags, plus --seed, --device and (on CPU) --torch-threads;
it reads the API key from $KUBERL_ENGINE_API_KEY itself (its environment, inherited).

A served reward model (reward.model, `reward_engine_command`) gets the same host, port, seed
(the run's seed + its replica's index), API key and metrics flags, its own model and
tokenizer, --tp-size gpusPerReplica, its engineArgs, and --is-embedding for form scalar (SGLang
serves a sequence-classification head as an embedding model, scored on /classify).

`engine_dtype`: the dtype an engine so launched serves in (weight sync sends in it); it also
reads the model's config.json, as SGLang's "auto" does.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from kuberl_api.spec import RLJobSpec
from kuberl_wire.moe_routes import ROUTES_FLAG

# The SGLang release the rollout image is built on (Dockerfile.rollout's base image tag) and
# the contract tier checks against (Makefile's SGLANG_VERSION): keep the three equal.
SGLANG_VERSION = "0.5.6"

# engineArgs values that turn a switch (SGLang's store_true flags) on or leave it off.
TRUE_VALUES, FALSE_VALUES = ("", "true"), ("false",)

EngineArgValue = str | Sequence[str]


def engine_arg_flags(args: Mapping[str, EngineArgValue]) -> list[str]:
    """rollout.engineArgs as flags, in name order: "" or "true" -> the switch alone,
    "false" -> nothing, another string -> `--key value`, a list -> `--key v1 v2 ...` (one
    flag, its values after it: SGLang's list flags are nargs='+'/'*' with argparse's default
    store action, where a repeated flag would keep only its last values)."""
    cmd: list[str] = []
    for key, value in sorted(args.items()):
        if isinstance(value, str):
            if value in FALSE_VALUES:
                continue
            cmd += [f"--{key}"] if value in TRUE_VALUES else [f"--{key}", value]
        else:
            cmd += [f"--{key}", *value]
    return cmd


def colocated_sglang(spec: RLJobSpec) -> bool:
    return (spec.rollout.engine == "sglang" and spec.placement == "colocate"
            and bool(spec.rollout_gpus))


# SGLang's --lora-target-modules value for every linear layer (PEFT's "all-linear")
ALL_LORA_MODULES = "all"


def lora_flags(spec: RLJobSpec) -> list[str]:
    """The LoRA flags of engines that load the trainer's adapter (training.lora.sync:
    adapter); none otherwise. Both pools hold the adapter versions the trainer keeps loaded
    (spec.adapter_slots): every request names one of them (none asks for the base, which
    SGLang would count in a batch's), and the trainer unloads the oldest before it loads the
    next, so SGLang's own LRU eviction past --max-loaded-loras never acts."""
    lora = spec.training.lora
    if lora is None or not spec.adapter_sync:
        return []
    slots = str(spec.adapter_slots)
    return ["--enable-lora", "--max-lora-rank", str(lora.rank),
            "--lora-target-modules", *(lora.target_modules or [ALL_LORA_MODULES]),
            "--max-loaded-loras", slots, "--max-loras-per-batch", slots]


def default_engine_args(spec: RLJobSpec) -> dict[str, EngineArgValue]:
    """The engineArgs kuberl adds itself unless the spec's engineArgs set them."""
    defaults: dict[str, EngineArgValue] = {"enable-metrics": "true"}
    if colocated_sglang(spec):
        defaults["enable-memory-saver"] = "true"
    return defaults


# --dtype spellings (SGLang's choices; the reference engine takes the torch names) -> torch names
DTYPE_NAMES = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16",
               "float": "float32", "float32": "float32"}
REFERENCE_DEFAULT_DTYPE = "float32"  # kuberl_rollout.reference's --dtype default


def engine_dtype(spec: RLJobSpec) -> str:
    """The dtype the engines hold the policy's weights in (a torch name, "bfloat16"), which
    weight sync sends them in: fewer bytes than the trainer's fp32 master weights, and the
    bytes the engine's checksums are of. From rollout.engineArgs' dtype; else the engine's
    default: the reference engine's float32, SGLang's "auto" (`ModelConfig`'s
    `_get_and_verify_dtype` in 0.5.6): the model's config.json dtype (`dtype`, or the older
    `torch_dtype`), where a float32 or unstated one serves as float16 (bfloat16 for Gemma)."""
    asked = spec.rollout.engine_args.get("dtype")
    if asked is None:
        asked = "auto" if spec.rollout.engine == "sglang" else REFERENCE_DEFAULT_DTYPE
    if asked != "auto":
        if asked not in DTYPE_NAMES:
            raise ValueError(f"rollout.engineArgs dtype {asked!r}: expected auto or one of "
                             f"{sorted(DTYPE_NAMES)}")
        return DTYPE_NAMES[asked]
    config = json.loads((Path(spec.model.path) / "config.json").read_text())
    stated = DTYPE_NAMES.get(str(config.get("dtype") or config.get("torch_dtype")), "float32")
    if stated != "float32":
        return stated
    return "bfloat16" if str(config.get("model_type", "")).startswith("gemma") else "float16"


def api_key_config(api_key: str) -> str:
    """The YAML of SGLang's --config file that holds the engines' API key (JSON is YAML; a
    JSON string quotes any character the key may hold)."""
    return json.dumps({"api-key": api_key}) + "\n"


def engine_command(spec: RLJobSpec, *, model_path: str, port: int, nccl_port: int, seed: int,
                   torch_threads: int = 0, node_rank: int = 0, dist_init_addr: str = "",
                   python: str = sys.executable, config_file: str = "") -> list[str]:
    """The argv of one engine server process: the whole engine, or node `node_rank` of one
    spanning `spec.engine_nodes` nodes (`dist_init_addr`: node rank 0's "host:port" for the
    TP group's rendezvous). `port`, `nccl_port`: free ports on this node (the reference
    engine has no NCCL port of its own: its TP processes take their work from rank 0 over
    pipes and sockets); `torch_threads`: its CPU threads when it runs on CPU; `config_file`:
    SGLang's --config file with the API key (api_key_config; SGLang only)."""
    r = spec.rollout
    nodes = spec.engine_nodes
    if nodes > 1 and not dist_init_addr:
        raise ValueError(f"an engine over {nodes} nodes needs node rank 0's dist-init address")
    if not 0 <= node_rank < nodes:
        raise ValueError(f"node rank {node_rank} outside the engine's {nodes} node(s)")
    multi_node = ["--nnodes", str(nodes), "--node-rank", str(node_rank),
                  "--dist-init-addr", dist_init_addr] if nodes > 1 else []
    if r.engine == "reference":
        # From the spec, not torch.cuda here: a colocated engine's actor sees no GPU (see
        # placement.colocated_engine_devices); its process is given its own.
        device = "cuda" if spec.rollout_gpus else "cpu"
        cmd = [python, "-m", "kuberl_rollout.reference", "--model-path", model_path,
               "--host", "0.0.0.0", "--port", str(port), "--tp-size", str(r.gpus_per_engine),
               "--seed", str(seed), "--device", device]
        if device == "cpu":
            cmd += ["--torch-threads", str(torch_threads)]
        cmd += multi_node
    else:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", model_path,
               "--host", "0.0.0.0", "--port", str(port), "--nccl-port", str(nccl_port),
               "--tp-size", str(r.gpus_per_engine), "--random-seed", str(seed), *multi_node]
    if spec.model.tokenizer:  # the engines detokenize the text rewards are read from
        cmd += ["--tokenizer-path", spec.model.tokenizer]
    if spec.engine_memory_fraction is not None:
        cmd += ["--mem-fraction-static", str(spec.engine_memory_fraction)]
    cmd += lora_flags(spec)
    if spec.algorithm.routing_replay == "rollout":
        cmd += [f"--{ROUTES_FLAG}"]
    cmd += engine_arg_flags(
        default_engine_args(spec) | dict(r.engine_args) | dict(r.engine_list_args))
    if config_file and r.engine == "sglang":
        cmd += ["--config", config_file]
    return cmd


def reward_engine_command(spec: RLJobSpec, *, port: int, nccl_port: int, seed: int,
                          torch_threads: int = 0, python: str = sys.executable,
                          config_file: str = "") -> list[str]:
    """The argv of one engine serving the job's reward model (reward.model): SGLang, or the
    reference engine (on CPU when gpusPerReplica is 0)."""
    m = spec.reward.model
    if m is None:
        raise ValueError("reward.type is not model: the job serves no reward model")
    tp = str(max(1, m.gpus_per_replica))
    if m.engine == "reference":
        device = "cuda" if m.gpus_per_replica else "cpu"
        cmd = [python, "-m", "kuberl_rollout.reference", "--model-path", m.path,
               "--host", "0.0.0.0", "--port", str(port), "--tp-size", tp,
               "--seed", str(seed), "--device", device]
        if device == "cpu":
            cmd += ["--torch-threads", str(torch_threads)]
    else:
        cmd = [python, "-m", "sglang.launch_server", "--model-path", m.path,
               "--host", "0.0.0.0", "--port", str(port), "--nccl-port", str(nccl_port),
               "--tp-size", tp, "--random-seed", str(seed)]
    if m.tokenizer:
        cmd += ["--tokenizer-path", m.tokenizer]
    if m.form == "scalar":
        cmd += ["--is-embedding"]
    cmd += engine_arg_flags({"enable-metrics": "true"} | dict(m.engine_args))
    if config_file and m.engine == "sglang":
        cmd += ["--config", config_file]
    return cmd
