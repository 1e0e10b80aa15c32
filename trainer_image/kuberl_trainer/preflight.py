"""Checks that run before Ray starts, so bad input fails in a second with a message that says
what and where, instead of minutes later inside an actor."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kuberl_api.spec import RLJobSpec

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class PreflightError(ValueError):
    pass


@dataclass
class Checked:
    tokenizer_path: str
    reward_fn: Callable[..., Any] | None  # a built-in's or reward.function, imported
    rollout_function: Callable[..., Any] | None = None  # rollout.function, imported
    environment_class: Callable[[], Any] | None = None  # environment.class, imported


def check_model(path: str, field: str = "spec.model.path") -> None:
    p = Path(path)
    if not p.is_dir():
        raise PreflightError(f"{field}: {path} is not a directory (expected a Hugging Face "
                             "checkpoint with config.json and weights)")
    if not (p / "config.json").is_file():
        raise PreflightError(f"{field}: {path} has no config.json")
    if not any(any(p.glob(g)) for g in WEIGHT_GLOBS):
        raise PreflightError(f"{field}: {path} has no weights (*.safetensors or *.bin)")


def check_tokenizer(path: str, field: str) -> None:
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise PreflightError(f"{field}: {path} has no tokenizer files "
                             f"({', '.join(TOKENIZER_FILES)})")


def check_data(spec: RLJobSpec) -> None:
    from kuberl_trainer.rollout.prompts import DataError, PromptSource

    d = spec.data
    # (the prompts and eval sets go through the rollout function or environment: they carry
    # data.metadataKeys; the SFT demonstrations do not)
    paths = [("spec.data.prompts", d.prompts, d.metadata_keys)] if d.prompts else []
    paths += [
        (f"spec.data.evalSets[{i}].path", e.path, d.metadata_keys)
        for i, e in enumerate(d.eval_sets)]
    if d.sft is not None:
        paths.append(("spec.data.sft.path", d.sft.path, []))
    for field, path, metadata in paths:
        try:
            PromptSource(path, d.input_key, d.label_key, seed=0, metadata_keys=metadata).check()
        except DataError as exc:
            raise PreflightError(f"{field}: {exc}") from None


def check_backend(spec: RLJobSpec) -> None:
    """The megatron backend's needs: megatron-core installed, a model family it converts, and
    model (and expert) parallelism that divides the model."""
    if spec.training.backend != "megatron":
        return
    import importlib.util
    import json

    from kuberl_trainer.backends.megatron.hf_layout import DecoderShape
    from kuberl_trainer.backends.megatron.moe_layout import check_layout

    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec(
            "megatron.core") is None:
        raise PreflightError("spec.training.backend: megatron needs megatron-core, which is not "
                             "installed here (pip install 'kuberl[megatron]'; the trainer "
                             "image has it), or use backend fsdp")
    config = json.loads((Path(spec.model.path) / "config.json").read_text())
    p = spec.training.parallelism
    try:
        shape = DecoderShape.from_hf_config(config)
        shape.check_tp(p.tp)
    except ValueError as exc:
        raise PreflightError(f"spec.model.path: {exc}") from None
    try:
        check_layout(shape.experts, p.tp, p.ep, p.etp)
    except ValueError as exc:
        raise PreflightError(f"spec.training.parallelism: {exc}") from None
    if shape.num_layers % p.pp:
        raise PreflightError(f"spec.training.parallelism.pp: {p.pp} must divide the model's "
                             f"{shape.num_layers} layers")


# The mixture-of-experts families kuberl trains and syncs: transformers fuses their experts
# into 3-D parameters that kuberl_wire.expert_names names per expert, as their checkpoints
# and SGLang's loaders do, and routes them through routers kuberl_wire.hf_routers controls.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")


def check_moe(spec: RLJobSpec) -> None:
    """What only a mixture-of-experts policy has (routing replay, the router's aux loss,
    expert parallelism) is refused for a dense one, naming the field; an MoE policy must be
    of a family kuberl syncs, without LoRA, with ep dividing its experts."""
    from kuberl_wire.moe_routes import moe_shape

    config = _config(spec.model.path)
    shape = moe_shape(config)
    algo, p = spec.algorithm, spec.training.parallelism
    if shape is None:
        dense = f"{spec.model.path} is a dense model (its config.json names no experts)"
        if algo.routing_replay != "none":
            raise PreflightError(f"spec.algorithm.routingReplay: {algo.routing_replay} "
                                 f"replays a mixture-of-experts model's routes; {dense}")
        if algo.router_aux_loss_coef is not None:
            raise PreflightError("spec.algorithm.routerAuxLossCoef: weighs a mixture-of-experts "
                                 f"model's load-balancing loss; {dense}")
        if p.ep > 1 or p.etp is not None:
            raise PreflightError(f"spec.training.parallelism.{'ep' if p.ep > 1 else 'etp'}: "
                                 f"expert parallelism spreads experts; {dense}")
        return
    family = str(config.get("model_type", ""))
    if family not in MOE_FAMILIES:
        raise PreflightError(f"spec.model.path: a mixture-of-experts model of type {family!r}; "
                             f"kuberl trains {', '.join(MOE_FAMILIES)}")
    if spec.training.lora is not None:
        raise PreflightError("spec.training.lora: LoRA on a mixture-of-experts model is not "
                             "supported yet (its experts are 3-D parameters); train it in "
                             "full")
    if shape.experts % p.ep:
        raise PreflightError(f"spec.training.parallelism.ep: {p.ep} must divide the model's "
                             f"{shape.experts} experts")


def check_router(spec: RLJobSpec) -> None:
    """rollout.router sglang runs sglang-router where the loop runs: it must be installed."""
    import importlib.util

    if spec.rollout.router == "sglang" and importlib.util.find_spec("sglang_router") is None:
        raise PreflightError("spec.rollout.router: sglang needs sglang-router, which is not "
                             "installed here (pip install 'kuberl[trainer]'; the trainer image "
                             "has it), or use router none (the client's own balancer)")


def check_engine_tp(spec: RLJobSpec) -> None:
    """SGLang shards attention heads and the MLP across an engine's TP ranks and asserts at
    model load that they divide (sglang/srt/models/*.py, 0.5.6): attention heads by the TP
    size; KV heads by it, or it by them (then each is replicated); the MLP's intermediate size
    by it. Checked here for every engine, the reference engine included, so a CPU run refuses
    what the cluster's engines would crash on."""
    _check_tp(spec.model.path, spec.rollout.gpus_per_engine, "spec.rollout.gpusPerEngine")


def _check_tp(path: str, tp: int, field: str) -> None:
    """check_engine_tp's rule for the model at `path` served over `tp` GPUs (`field`)."""
    if tp <= 1:
        return
    config = _config(path)
    config = config.get("text_config", config)
    heads = int(config.get("num_attention_heads", 0) or 0)
    kv = int(config.get("num_key_value_heads", heads) or heads)
    inter = int(config.get("intermediate_size", 0) or 0)
    expert = int(config.get("moe_intermediate_size", 0) or 0)
    problems = []
    if heads and heads % tp:
        problems.append(f"the model's {heads} attention heads")
    if kv and (kv % tp if kv >= tp else tp % kv):
        problems.append(f"its {kv} key/value heads (or be a multiple of them)")
    if inter and inter % tp:
        problems.append(f"its MLP intermediate size {inter}")
    if expert and expert % tp:  # (each expert's MLP is split over the TP ranks)
        problems.append(f"its experts' intermediate size {expert}")
    if problems:
        raise PreflightError(f"{field}: tensor parallel size {tp} must "
                             f"divide {', '.join(problems)} ({path}/config.json)")


def _config(path: str) -> dict[str, Any]:
    import json

    config: dict[str, Any] = json.loads((Path(path) / "config.json").read_text())
    return config


# The heads SGLang serves with --is-embedding as a reward model's score (its model registry's
# *ForSequenceClassification and *ForRewardModel classes), and the generators a judge can be.
SCALAR_HEADS = ("ForSequenceClassification", "ForRewardModel")
GENERATORS = ("ForCausalLM", "ForConditionalGeneration")


def check_reward_model(spec: RLJobSpec) -> None:
    """reward.model: a checkpoint and a tokenizer (the head renders its chat template) of the
    form it is served in: a scalar head with one score for form scalar, a generator for a
    judge; its tensor parallel size dividing it as the rollout engines' must."""
    m = spec.reward.model
    if m is None:
        return
    check_model(m.path, "spec.reward.model.path")
    check_tokenizer(m.tokenizer_path, "spec.reward.model.tokenizer" if m.tokenizer
                    else "spec.reward.model.path")
    config = _config(m.path)
    kinds = [str(a) for a in config.get("architectures") or []]
    wanted = SCALAR_HEADS if m.form == "scalar" else GENERATORS
    if not any(k.endswith(wanted) for k in kinds):
        other = ("form judge serves a causal LM" if m.form == "scalar"
                 else "form scalar serves a scalar head")
        raise PreflightError(
            f"spec.reward.model.path: form {m.form} needs a model whose architectures end in "
            f"{' or '.join(wanted)}; {m.path}/config.json says {kinds or 'none'} ({other})")
    labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1) or 1)
    if m.form == "scalar" and labels != 1:
        raise PreflightError(f"spec.reward.model.path: a scalar reward model scores with one "
                             f"output; {m.path}/config.json has {labels} labels (num_labels)")
    _check_tp(m.path, m.gpus_per_replica, "spec.reward.model.gpusPerReplica")


def check_reward_auth(spec: RLJobSpec) -> None:
    """reward.auth: its credential reached this process (the operator gives the head the
    Secret's key; `kuberl run` takes it from the environment): without it every request
    would be refused, after the engines had started."""
    from kuberl_api.runtime import ENV_REWARD_AUTH

    auth = spec.reward.auth
    if auth is not None and not os.environ.get(ENV_REWARD_AUTH):
        raise PreflightError(f"spec.reward.auth: the credential is read from "
                             f"${ENV_REWARD_AUTH}, which is not set here (set it to the value "
                             f"of key {auth.key} of Secret {auth.secret}; in a cluster the "
                             "operator gives it to the head)")


def check(spec: RLJobSpec) -> Checked:
    from kuberl_trainer.rollout import rewards

    check_model(spec.model.path)
    if spec.algorithm.teacher_path:
        check_model(spec.algorithm.teacher_path, "spec.algorithm.teacherPath")
    if spec.has_critic and spec.critic.model_path:
        check_model(spec.critic.model_path, "spec.critic.modelPath")
    tokenizer = spec.model.tokenizer or spec.model.path
    check_tokenizer(tokenizer, "spec.model.tokenizer" if spec.model.tokenizer
                    else "spec.model.path")
    check_backend(spec)
    check_moe(spec)
    check_lora(spec)
    check_router(spec)
    check_engine_tp(spec)
    check_reward_model(spec)
    check_reward_auth(spec)
    check_data(spec)
    try:
        reward_fn = rewards.load(spec.reward)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:
        raise PreflightError(f"spec.reward: {exc}") from None
    function, environment = check_agent(spec)
    check_loss(spec)
    return Checked(tokenizer_path=tokenizer, reward_fn=reward_fn, rollout_function=function,
                   environment_class=environment)


def check_lora(spec: RLJobSpec) -> None:
    """training.lora against the model, built on the meta device (no weights read): every
    targetModules name matches a module, every match a linear layer (what a merged sync
    adds B A to), none the LM head of a model with tied embeddings (the engines tie it back
    to the embedding, dropping its update); lora.path an adapter of this rank and alpha."""
    lora = spec.training.lora
    if lora is None:
        return
    import json

    import torch
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(spec.model.path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    modules = dict(model.named_modules())
    linear = sorted({name.rpartition(".")[2] for name, m in modules.items()
                     if isinstance(m, torch.nn.Linear)})
    head = model.get_output_embeddings()
    field = "spec.training.lora.targetModules"
    for target in lora.target_modules or ():
        one = LoraConfig(target_modules=[target])
        matched = [m for name, m in modules.items() if check_target_module_exists(one, name)]
        if not matched:
            raise PreflightError(f"{field}: {target!r} names no module of {spec.model.path} "
                                 f"(its linear layers: {', '.join(linear)})")
        if any(not isinstance(m, torch.nn.Linear) for m in matched):
            raise PreflightError(f"{field}: {target!r} matches a module that is not a linear "
                                 f"layer; LoRA here adapts linear layers ({', '.join(linear)})")
        if getattr(config, "tie_word_embeddings", False) and any(m is head for m in matched):
            raise PreflightError(f"{field}: {target!r} matches the LM head, which this model "
                                 "ties to its embedding: the engines would tie it back and "
                                 "drop the adapter's update")
    if lora.path is not None:
        adapter = Path(lora.path)
        file = adapter / "adapter_config.json"
        if not file.is_file() or not (adapter / "adapter_model.safetensors").is_file():
            raise PreflightError(f"spec.training.lora.path: {lora.path} is not a PEFT adapter "
                                 "directory (adapter_config.json, adapter_model.safetensors)")
        saved = json.loads(file.read_text())
        if saved.get("r") != lora.rank or float(saved.get("lora_alpha", 0)) != lora.lora_alpha:
            raise PreflightError(f"spec.training.lora.path: the adapter has rank "
                                 f"{saved.get('r')} and alpha {saved.get('lora_alpha')}; "
                                 f"training.lora says rank {lora.rank}, alpha {lora.lora_alpha}")


def check_loss(spec: RLJobSpec) -> None:
    """algorithm.lossFunction imported and called once on a small synthetic batch
    (algos.custom_loss.check), so a function that does not import, raises, returns the wrong
    shape or non-finite values, or passes no gradient to the log-probs fails the job now,
    naming the field, rather than in the training ranks after the first rollout. (Only such a
    job imports torch here, before Ray: the check runs the function.)"""
    a = spec.algorithm
    if a.policy_loss != "custom" or a.loss_function is None:
        return
    from kuberl_trainer.algos.custom_loss import CustomLoss, LossFunctionError, check
    from kuberl_trainer.user_code import UserCodeError

    try:
        check(CustomLoss.load(a.loss_function, a.loss_args),
              with_ref=a.kl_coef > 0 or a.teacher_path is not None)
    except (UserCodeError, LossFunctionError) as exc:
        raise PreflightError(f"spec.algorithm.lossFunction: {exc}") from None


def check_agent(spec: RLJobSpec) -> tuple[Callable[..., Any] | None, Callable[[], Any] | None]:
    """rollout.function and environment.class, imported now (before Ray) so that a typo or
    a missing dependency fails the job at once, naming the field. With environment.image the
    class is the image's, served over HTTP (agents/service.py starts or reaches it), never
    imported here."""
    from kuberl_trainer.user_code import UserCodeError, import_object

    function = environment = None
    try:
        if spec.rollout.function:
            function = import_object(spec.rollout.function, "rollout function")
            if not inspect.iscoroutinefunction(function):
                raise UserCodeError(f"rollout function {spec.rollout.function!r} must be "
                                    "`async def`")
    except UserCodeError as exc:
        raise PreflightError(f"spec.rollout.function: {exc}") from None
    try:
        if spec.environment.class_ and spec.environment.image is None:
            environment = import_object(spec.environment.class_, "environment class")
            for method in ("reset", "step", "close"):
                if not inspect.iscoroutinefunction(getattr(environment, method, None)):
                    raise UserCodeError(f"environment class {spec.environment.class_!r} needs "
                                        f"`async def {method}`")
    except UserCodeError as exc:
        raise PreflightError(f"spec.environment.class: {exc}") from None
    return function, environment
