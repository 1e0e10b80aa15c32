"""How the integration tests judge "it learns": exactly, on fixed prompts, before and after.

The learning tests used to compare the sampled reward of a run's last steps with that of its
first ones. Each step's reward is a mean over 16 prompts x 8 samples and wanders by ~0.05 from
step to step, and on another machine the run takes other steps altogether, so an 8-step curve
judged against a fixed line passed on one machine and failed on another.

Here every measure is exact. The toy reward (`toy_rewards.leading_one`: the response starts
with "1") has an expectation under a policy that one forward pass gives: the probability that
the first response token is "1", averaged over the tiny build's 500 held-out prompts. A test
compares that number for the model the run started from and for the checkpoint it saved: a
paired comparison on the same prompts, with no sampling noise. The same goes for the
distillation test (the teacher-student KL at the first response token) and the mixed SFT test
(the log-likelihood of the demonstrated answer). What is left is the spread of the training run
itself: `bench/learning_margins.py` runs each scenario under several seeds and CPU numerics
configurations, and each threshold below states the mean, the spread and the margin it leaves.

`KUBERL_TEST_SEED` (default 0) goes to every learning run as `kuberl run --seed`: another seed
draws other prompts and samples, as another machine does, so `KUBERL_TEST_SEED=3 make
integration` re-checks the margins on a new trajectory.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch
import yaml

from tests.integration.local_run import (
    LEARNABLE,
    ROOT,
    failed,
    kuberl_run,
    manifest,
    metrics,
    tiny_job,
    tiny_moe_job,
    tiny_tool_job,
)

LEADING = "1"  # what toy_rewards.leading_one rewards
MAX_PROMPT_LEN = 8  # local_run.manifest's data.maxPromptLen


def run_seed() -> int:
    return int(os.environ.get("KUBERL_TEST_SEED", "0") or 0)


# ------------------------------------------------------------------------- exact measures

def eval_prompts(tiny: Path) -> list[str]:
    """The tiny build's held-out prompts: never trained on, by SFT or by RL."""
    lines = (tiny / "data" / "eval.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def final_model(out: Path) -> Path:
    """The model directory of the newest checkpoint a run wrote under `out`."""
    steps = sorted((int(p.name.removeprefix("step_")), p)
                   for p in (out / "checkpoints").glob("step_*"))
    assert steps, f"no checkpoint under {out}"
    return steps[-1][1] / "model"


@cache
def _load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


@torch.no_grad()
def response_logprobs(model_dir: Path, prompts: list[str], response: list[int] | None = None
                      ) -> torch.Tensor:
    """Log-probabilities at temperature 1, as the engines sample: [N, V] over the first
    response token when `response` is None, else [N] of the whole `response` (token ids)
    after each prompt (prompt tokens cut to the last MAX_PROMPT_LEN, as the rollout does)."""
    model, tokenizer = _load(model_dir)
    rows = [ids[-MAX_PROMPT_LEN:] for ids in
            tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("the tiny build's prompts share one length; these do not")
    width = len(rows[0])
    ids = torch.tensor([r + (response or []) for r in rows])
    logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    if response is None:
        return logp[:, width - 1]
    targets = torch.tensor(response)
    # position t predicts token t + 1: the response's tokens are scored at width-1 onwards
    scored = logp[:, width - 1:width - 1 + len(response)]
    return scored.gather(-1, targets.expand(len(rows), -1)[..., None]).squeeze(-1).sum(-1)


def expected_leading_one(model_dir: Path, prompts: list[str]) -> float:
    """E[leading_one reward] of the policy: the mean over prompts of P(first response token
    starts with "1")."""
    _, tokenizer = _load(model_dir)
    leading = [i for t, i in tokenizer.get_vocab().items() if t.startswith(LEADING)]
    probs = response_logprobs(model_dir, prompts).exp()
    return float(probs[:, leading].sum(-1).mean())


def first_token_kl(student: Path, teacher: Path, prompts: list[str]) -> float:
    """Mean over prompts of KL(student || teacher) at the first response token: the reverse
    KL on-policy distillation lowers, exactly, where the two models differ most (the teacher
    is the student after RL on leading_one, which moved mostly that token)."""
    p, q = response_logprobs(student, prompts), response_logprobs(teacher, prompts)
    return float((p.exp() * (p - q)).sum(-1).mean())


def answer_nll(model_dir: Path, prompts: list[str], answer: str) -> float:
    """Mean negative log-likelihood of `answer` then EOS after each prompt."""
    _, tokenizer = _load(model_dir)
    ids = [*tokenizer(answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return float(-response_logprobs(model_dir, prompts, ids).mean())


def expected_exact_reward(model_dir: Path, tiny: Path) -> float:
    """E[exact reward] of the policy on the held-out addition problems: the mean over them of
    the probability of writing the label's digits and then EOS at temperature 1 (each digit
    is one token of the tiny tokenizer, so this is the exact reward's expectation, with no
    sampling)."""
    from kuberl_trainer.tiny.evaluate import sequence_logprob

    model, tokenizer = _load(model_dir)
    lines = (tiny / "data" / "eval.jsonl").read_text().splitlines()
    problems = [json.loads(line) for line in lines if line.strip()]
    logp = sequence_logprob(model, tokenizer, [p["prompt"] for p in problems],
                            [p["label"] + tokenizer.eos_token for p in problems])
    return float(logp.exp().mean())


# ----------------------------------------------------------------------------- scenarios

@dataclass(frozen=True)
class Measure:
    name: str
    before: float
    after: float
    value: float  # what the threshold judges


@dataclass
class Outcome:
    out: Path  # the run's --output-dir
    stdout: str  # what `kuberl run` printed
    rows: list[dict[str, Any]]  # its metrics.jsonl
    measures: dict[str, Measure]


def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Manifest sections `a` with `b`'s keys on top, one level deep (as manifest() does)."""
    return {**a, **{k: {**a.get(k, {}), **v} if isinstance(v, dict) else v
                    for k, v in b.items()}}


def _run(tiny: Path, tmp: Path, name: str, steps: int, spec: dict[str, Any],
         env: dict[str, str] | None = None) -> tuple[Path, str]:
    """`kuberl run` of the tiny job for `steps` steps with the test seed: (output dir,
    stdout)."""
    spec = merge({"schedule": {"numRollouts": steps}}, spec)
    out = tmp / name
    res = kuberl_run(manifest(tiny, tmp, name, **spec), out, "--seed", str(run_seed()),
                     env=env)
    assert res.returncode == 0, failed(res)
    return out, res.stdout


@dataclass(frozen=True)
class Scenario:
    """One learning run and the measures that judge it. `thresholds` maps each measure to
    the line it must beat: a gain or share must exceed it, a ratio (a name ending in _ratio)
    must stay below it, as must every measure in `ceilings`. `prepare` (tiny, tmp) makes
    what the run needs first and returns the manifest sections that point at it. `task`:
    the tiny build it runs on ("add"; "tool": the tiny agent's; "moe": the add task on a
    mixture-of-experts policy); `env`: variables for the run."""

    measure: Callable[[Path, Path, Path], dict[str, Measure]]  # (tiny, tmp, out)
    spec: dict[str, Any] = field(default_factory=dict)
    steps: int = 8
    thresholds: dict[str, float] = field(default_factory=dict)
    prepare: Callable[[Path, Path], dict[str, Any]] | None = None
    task: str = "add"
    env: dict[str, str] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)

    def below(self, name: str) -> bool:
        """Whether `name` must stay below its line (else it must exceed it)."""
        return name.endswith("_ratio") or name in self.ceilings

    def line(self, name: str) -> float:
        return self.ceilings[name] if name in self.ceilings else self.thresholds[name]

    def run(self, tiny: Path, tmp: Path) -> Outcome:
        spec = merge(self.spec, self.prepare(tiny, tmp)) if self.prepare else self.spec
        out, stdout = _run(tiny, tmp, "run", self.steps, spec, self.env)
        outcome = Outcome(out=out, stdout=stdout, rows=metrics(out),
                          measures=self.measure(tiny, tmp, out))
        # what `pytest -rP` shows of a passing test: the margins on this machine
        print(f"learning (seed {run_seed()}): " + ", ".join(
            f"{m.name} {m.value:.4f} ({m.before:.4f} -> {m.after:.4f})"
            for m in outcome.measures.values()))
        return outcome

    def failures(self, outcome: Outcome) -> list[str]:
        bad = []
        for name in [*self.thresholds, *self.ceilings]:
            m, line = outcome.measures[name], self.line(name)
            ok = m.value < line if self.below(name) else m.value > line
            if not ok:
                bad.append(f"{name} {m.value:.4f} (before {m.before:.4f}, after {m.after:.4f})"
                           f" does not pass {line}")
        return bad


def tiny_for(task: str) -> Path:
    """The tiny build a scenario's task runs on."""
    return {"tool": tiny_tool_job, "moe": tiny_moe_job}.get(task, tiny_job)()


def reward_gain(tiny: Path, tmp: Path, out: Path) -> dict[str, Measure]:
    prompts = eval_prompts(tiny)
    before = expected_leading_one(tiny / "model", prompts)
    after = expected_leading_one(final_model(out), prompts)
    return {"reward_gain": Measure("reward_gain", before, after, after - before)}


def grpo_teacher(tiny: Path, tmp: Path) -> dict[str, Any]:
    """A teacher that starts its answers with "1" far more often than the student: the
    student after GRPO on leading_one."""
    teacher, _ = _run(tiny, tmp, "teacher", 12, {"reward": LEARNABLE})
    return {"algorithm": {"teacherPath": str(final_model(teacher))}}


def distillation(tiny: Path, tmp: Path, out: Path) -> dict[str, Measure]:
    """The student (the tiny model) is distilled from grpo_teacher's model:
    the KL to the teacher falls, and the student's expected leading_one reward - which the
    distillation loss never sees - closes on the teacher's."""
    prompts, teacher = eval_prompts(tiny), final_model(tmp / "teacher")
    student, distilled = tiny / "model", final_model(out)
    kl0, kl1 = first_token_kl(student, teacher, prompts), first_token_kl(distilled, teacher,
                                                                          prompts)
    r0, r1, rt = (expected_leading_one(m, prompts) for m in (student, distilled, teacher))
    return {"teacher_kl_ratio": Measure("teacher_kl_ratio", kl0, kl1, kl1 / kl0),
            "reward_share": Measure("reward_share", r0, r1, (r1 - r0) / (rt - r0))}


SEVEN = "7"  # MIXED_SFT's demonstrations answer every problem with it


def sevens(tiny: Path, tmp: Path) -> dict[str, Any]:
    """Demonstrations of something the reward never asks for: every one of 256 training
    problems answered SEVEN."""
    lines = (tiny / "data" / "train.jsonl").read_text().splitlines()[:256]
    demos = tmp / "sevens.jsonl"
    demos.write_text("".join(json.dumps({"prompt": json.loads(line)["prompt"],
                                         "label": SEVEN}) + "\n" for line in lines))
    return {"data": {"sft": {"path": str(demos), "batchSize": 32}}}


def demonstrations_nll(tiny: Path, tmp: Path, out: Path) -> dict[str, Measure]:
    prompts = eval_prompts(tiny)
    before = answer_nll(tiny / "model", prompts, SEVEN)
    after = answer_nll(final_model(out), prompts, SEVEN)
    return {"demo_nll_ratio": Measure("demo_nll_ratio", before, after, after / before)}


def exact_reward_gain(tiny: Path, tmp: Path, out: Path) -> dict[str, Measure]:
    before = expected_exact_reward(tiny / "model", tiny)
    after = expected_exact_reward(final_model(out), tiny)
    return {"exact_reward_gain": Measure("exact_reward_gain", before, after, after - before)}


def _example_job(example: str) -> dict[str, Any]:
    """An example manifest's spec as the tests' manifest() takes it: every section as written
    but the model, the prompts' path, the schedule and the checkpoint (the test's)."""
    spec = yaml.safe_load((ROOT / "examples" / example).read_text())["spec"]
    for local in ("model", "schedule", "checkpoint"):
        del spec[local]
    del spec["data"]["prompts"]
    return dict(spec)


def demo_job() -> dict[str, Any]:
    """examples/tiny-grpo.yaml's spec (addition, exact reward, lr 2e-4, 32 prompts x 8 samples)
    disaggregated on one CPU engine, async's placement, with no eval sets."""
    spec = _example_job("tiny-grpo.yaml")
    spec["data"] = {k: v for k, v in spec["data"].items() if k != "evalSets"}
    spec["placement"] = "disaggregated"
    spec["rollout"] = {**spec["rollout"], "gpus": 0, "engines": 1}
    spec.pop("mode", None)
    return spec


# The demo's task after ADDITION_STEPS steps, from an expected exact reward of 0.288
# (bench/async_correction.py, seeds 0-7; bench/RESULTS.md "Async off-policy correction"):
# sync gained 0.117 on average (sd 0.017, 0.092-0.140). Async at maxStaleness 4 with the
# defaults (TIS at 2; runAhead adaptive, which on CPU keeps the engines about one rollout
# ahead: staleness 1.1-1.9 on average) gained 0.109 with whole rollouts (sd 0.009) and 0.110
# with partial ones (sd 0.016): 93% of sync, the issue's 60% far inside (pooled sd 0.013).
# Run by run the spread is wider than one seed's: the tests' seed 0 is the weakest seed for
# sync (0.092) and for partial rollouts (0.053-0.092 in six runs, mean 0.076, sd 0.014:
# timing decides which responses span an update), so the line a test can hold is half of 60%:
# 0.035, 2.8 sd below seed 0's partial runs and 5.7 below the pooled mean. What it tells
# apart: with the engines always 4 ahead and no correction, async lost reward at every seed
# measured (-0.02 to -0.13).
ASYNC_MIN_EXACT_GAIN = 0.035


# The tiny model starts at an expected reward of 0.595, so the largest possible gain is 0.405.
# A test asks for half of it: 0.2. Over 8 seeds (bench/learning_margins.py, RESULTS.md
# "Learning-test margins") every scenario below closed almost all of it: means 0.394-0.403,
# standard deviations 0.0005-0.0125, worst run 0.374 (ppo-dedicated-critic); the nearest mean
# lies 15.5 standard deviations above 0.2. A run that does not learn gains ~0 (lr 1e-9:
# 0.0000), so the line sits between the two with room on both sides.
MIN_REWARD_GAIN = 0.2


def _algorithm(algorithm: dict[str, Any], steps: int = 8, **extra: Any) -> Scenario:
    return Scenario(reward_gain, {"reward": LEARNABLE, "algorithm": algorithm, **extra},
                    steps=steps, thresholds={"reward_gain": MIN_REWARD_GAIN})


TWO_STEPS_PER_ROLLOUT = {"globalBatchSize": 64}

# Every advantage estimator and policy-loss option (test_algorithms.py), and the default job
# (GRPO, PPO clip, token-mean) colocated (test_local_run.py).
ALGORITHMS: dict[str, Scenario] = {
    "grpo-colocated": _algorithm({}, schedule={"saveInterval": 3}),
    "dr_grpo": _algorithm({"advantageEstimator": "dr_grpo",
                           "lossAggregation": "seq-mean-token-sum-norm"}),
    "rloo": _algorithm({"advantageEstimator": "rloo"}),
    # REINFORCE++'s baseline is the batch mean, not the prompt's group mean: an addition
    # whose answer is >= 100 starts with "1" anyway, and all its samples are pushed up or
    # down together. The noisier steps need 12 steps to climb as reliably as GRPO does in 8.
    "reinforce_plus_plus": _algorithm({"advantageEstimator": "reinforce_plus_plus",
                                       "gamma": 0.99}, steps=12),
    "reinforce_plus_plus-kl_in_reward": _algorithm(
        {"advantageEstimator": "reinforce_plus_plus", "klPenalty": "reward", "klCoef": 0.01},
        steps=12),
    "reinforce_plus_plus_baseline": _algorithm(
        {"advantageEstimator": "reinforce_plus_plus_baseline"}),
    "gspo": _algorithm({"policyLoss": "gspo", "lossAggregation": "seq-mean-token-mean",
                        "epsClip": 3e-4, "epsClipHigh": 4e-4}),
    # The losses of issue 37 differ from each other (and from PPO) only off-policy: with one
    # optimizer step per rollout every ratio is 1 and each is the plain policy gradient. So
    # they take two steps per rollout (globalBatchSize half of the 16 x 8 samples): the second
    # trains on ratios of 0.01-8, where CISPO clips some weights and SAPO's gate fades.
    # Over 6 seeds each gained 0.4024-0.4041 (bench/RESULTS.md).
    # CISPO with its defaults: the weight at most 1.28, no lower bound (MiniMax-M1's practice).
    "cispo": _algorithm({"policyLoss": "cispo"}, training=TWO_STEPS_PER_ROLLOUT),
    # SAPO as the paper trains it: the soft gate, each response's tokens averaged first.
    "sapo": _algorithm({"policyLoss": "sapo", "lossAggregation": "seq-mean-token-mean"},
                       training=TWO_STEPS_PER_ROLLOUT),
    # GPG as its paper defines it (docs/algorithms.md): r - mean(group) without the std, and
    # groups without spread out of the token mean (the paper's alpha = B / (B - M)).
    "gpg": _algorithm({"policyLoss": "gpg", "advantageEstimator": "dr_grpo",
                       "dropConstantGroups": True}, training=TWO_STEPS_PER_ROLLOUT),
    "ppo-shared-critic": _algorithm({"advantageEstimator": "ppo", "gamma": 1.0,
                                     "gaeLambda": 0.95}, critic={"lr": 1e-3}),
    # its own CPU "node", started from the policy's weights
    "ppo-dedicated-critic": _algorithm(
        {"advantageEstimator": "ppo", "klPenalty": "reward", "klCoef": 0.01},
        critic={"placement": "dedicated", "gpusPerNode": 0, "lr": 1e-3}),
    "dapo": _algorithm({"epsClipHigh": 0.28, "dynamicSamplingRounds": 3, "overlongBuffer": 2,
                        "overlongPenalty": 0.5, "tisCap": 2.0, "klCoef": 0.01,
                        "klLossType": "k3"}),
    # training.lora (docs/lora.md): a rank-8 adapter on every linear layer, the KL to the
    # base (the adapter off). lr 5e-3 from the sweep in bench/RESULTS.md ("LoRA learning-rate
    # sweep", bench/lora_lr_sweep.py): over seeds 0-4 it had the best worst run of the rates
    # tried, gaining 0.4020-0.4038 on the checkpoint's model/ (the merged weights; sd 0.0007),
    # as the full-weight job does at 5e-4 (0.4009-0.4036). 1e-2 did as well on average; at 2e-2
    # one seed in 5 fell to 0.37; below, the adapter has not finished in 8 steps (2e-3:
    # 0.30-0.39) or fails the line (1e-3: 0.11-0.15). The line is MIN_REWARD_GAIN's
    "lora": _algorithm({"lr": 5e-3, "klCoef": 0.01}, training={"lora": {"rank": 8}}),
}

# policyLoss: custom (test_algorithms.py): a user's copy of PPO clip (tests/user_losses.py,
# written from the formula), two optimizer steps per rollout like the losses above, so that
# its second step trains off-policy and clips; it must learn like the built-ins, to the same
# line: over seeds 0-3 it gained 0.4026-0.4040 (sd 0.0006), where cispo, sapo and gpg gained
# 0.4024-0.4041. The same copy with its sign flipped pushes down what earns reward: the
# reward must FALL, which only a loss that is really called can make it do. In 4 steps it
# fell from 0.595 to 0.0005-0.0014 (gain -0.5939 to -0.5947 over seeds 1-3, sd 0.0004; 8
# steps at seed 0: -0.5951); the line, -0.2, mirrors MIN_REWARD_GAIN, ~1000 sd away, and a
# loss that is not called would gain about +0.4 instead (the built-in's).
CUSTOM_PPO = {"policyLoss": "custom", "lossFunction": "tests.user_losses:ppo_clip"}
CUSTOM_PPO_FLIPPED = {**CUSTOM_PPO, "lossFunction": "tests.user_losses:ppo_clip_flipped"}
MAX_FLIPPED_GAIN = -0.2
CUSTOM_LOSSES: dict[str, Scenario] = {
    "custom-ppo": _algorithm(CUSTOM_PPO, training=TWO_STEPS_PER_ROLLOUT),
    "custom-ppo-sign-flipped": Scenario(
        reward_gain, {"reward": LEARNABLE, "algorithm": CUSTOM_PPO_FLIPPED,
                      "training": TWO_STEPS_PER_ROLLOUT},
        steps=4, ceilings={"reward_gain": MAX_FLIPPED_GAIN}),
}

# The same job in sync mode and the async scenarios' placement: the baseline
# bench/learning_margins.py compares them with (the sync path itself is covered above).
SYNC_DISAGGREGATED = _algorithm({}, placement="disaggregated", rollout={"gpus": 0})

# mode async, one-step-off (test_local_run.py): the default job's GRPO, disaggregated (the
# only placement async runs in), each step trained on samples one version old.
ASYNC_ONE_STEP_OFF = _algorithm({}, placement="disaggregated", rollout={"gpus": 0},
                                mode="async", schedule={"saveInterval": 3})
# Fully asynchronous, judged on the demo's task (examples/tiny-grpo.yaml: addition, exact
# reward, lr 2e-4) as a new user meets it: the engines may run up to 4 versions ahead (as far as
# keeps the trainers fed: async.runAhead adaptive), the updates
# waiting for the rollout in flight or (partialRollout) pausing it, with the release's default
# off-policy correction (async.offPolicyCorrection: truncated, TIS at 2). The leading_one
# reward learns in 8 steps under almost anything, so it would not tell a correction from none.
ADDITION_STEPS = 100
ASYNC_STALENESS_4 = {
    partial: Scenario(exact_reward_gain, merge(demo_job(), {
        "mode": "async", "async": {"maxStaleness": 4, "partialRollout": partial}}),
        steps=ADDITION_STEPS, thresholds={"exact_reward_gain": ASYNC_MIN_EXACT_GAIN})
    for partial in (False, True)}

# On-policy distillation from a GRPO teacher (test_algorithms.py). Over 8 seeds the student's
# first-token KL to the teacher fell to 0.0022 of its start on average (sd 0.0026, worst
# 0.007; the line, 0.1, is 37 sd away), and it closed 0.992 of the reward gap to the teacher
# (sd 0.008, worst 0.975; the line, 0.8, is 23 sd away).
DISTILLATION = Scenario(
    distillation, {"reward": LEARNABLE,
                   "algorithm": {"advantageEstimator": "on_policy_distillation", "lr": 2e-4}},
    steps=16, thresholds={"teacher_kl_ratio": 0.1, "reward_share": 0.8}, prepare=grpo_teacher)

# GRPO on the exact reward plus an SFT term on SEVEN demonstrations (test_algorithms.py).
# The demonstrated answer's NLL on held-out prompts fell from 15.5 to 0.0008 of it on average
# over 8 seeds (sd 0.0002, worst 0.0011); the line, 0.05 (P("7", EOS) above 0.46), is far off.
MIXED_SFT = Scenario(demonstrations_nll, {"algorithm": {"sftCoef": 1.0}},
                     thresholds={"demo_nll_ratio": 0.05}, prepare=sevens)

# ------------------------------------------------------------------ the tiny agent's arms

@cache
def _tool_measures(model_dir: Path, eval_file: Path) -> dict[str, float]:
    from kuberl_trainer.tiny.evaluate import sequence_logprob, tool_measures
    from kuberl_trainer.tiny.tool import ToolProblem

    model, tokenizer = _load(model_dir)
    problems = [ToolProblem(*map(int, json.loads(line)["prompt"][:-1].split("+")))
                for line in eval_file.read_text().splitlines() if line.strip()]
    measures = tool_measures(model, tokenizer, problems)
    # the calculator's answer to a call ("92="), as if the model wrote it: its log-probability
    # rises far more if the environment's tokens are trained
    measures["result_logprob"] = float(sequence_logprob(
        model, tokenizer, [p.prompt + "=" for p in problems],
        [p.label + "=" for p in problems]).mean())
    return measures


def tool_gains(tiny: Path, tmp: Path, out: Path) -> dict[str, Measure]:
    """The tiny agent's exact measures (kuberl_trainer.tiny.evaluate.tool_measures) on the
    held-out problems, before and after: the expected reward with the truthful calculator,
    the probability of calling, and the log-probability of the calculator's result written
    by the model itself."""
    eval_file = tiny / "data" / "eval.jsonl"
    before = _tool_measures(tiny / "model", eval_file)
    after = _tool_measures(final_model(out), eval_file)
    names = {"tool_reward_gain": "expected_reward_truthful", "call_prob_gain": "call_prob",
             "lying_reward_gain": "expected_reward_lying",
             "result_logprob_gain": "result_logprob"}
    return {name: Measure(name, before[key], after[key], after[key] - before[key])
            for name, key in names.items()}


# the tiny agent's example as written (the test's steps and seed)
TOOL_JOB = _example_job("tiny-agent.yaml")
LYING = {"environment": {"args": {"lie": "1"}}}
TOOL_STEPS = 16


def _tool(thresholds: dict[str, float], ceilings: dict[str, float], *,
          spec: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Scenario:
    return Scenario(tool_gains, merge(TOOL_JOB, spec or {}), steps=TOOL_STEPS,
                    thresholds=thresholds, ceilings=ceilings, task="tool", env=env or {})


# The three arms of test_agents.py's tool test, same seeds (bench/RESULTS.md, "The tiny
# agent": 6 seeds of 16 steps). A truthful calculator is learnt to be called: the expected
# reward rose by 0.86 on average (sd 0.09, worst 0.69; the line, 0.4, is 5 sd below). A lying
# one is not: the call probability moved by 0.002 (sd 0.009, worst +0.018; line 0.1, 10 sd
# off) and the reward by under 0.004 (line 0.05). With the environment's tokens in the loss (a
# test-only switch) the model learns to write the calculator's "92=" itself: its
# log-probability rose by 16.6 nats (sd 0.5, worst 15.7), against 2.9 (sd 1.5, worst 5.1) in
# the truthful arm, whose trajectories are the same but masked; the line between, 12, is 9 sd
# from the first and 6 from the second.
RESULT_LINE = 12.0
TOOL_ARMS: dict[str, Scenario] = {
    "tool-truthful": _tool({"tool_reward_gain": 0.4}, {"result_logprob_gain": RESULT_LINE}),
    "tool-lying": _tool({}, {"call_prob_gain": 0.1, "lying_reward_gain": 0.05}, spec=LYING),
    "tool-env-tokens-trained": _tool(
        {"result_logprob_gain": RESULT_LINE}, {},
        env={"KUBERL_TEST_TRAIN_ENV_TOKENS": "1"}),
}

# ------------------------------------------------------- the mixture-of-experts policy

# grpo-colocated's job on the tiny build's Qwen3-MoE variant (tiny build --variant moe: 4
# experts, top-2; test_moe_learning.py), judged by the same measure and line, at twice its lr.
# The moe build starts at 0.612 (largest gain 0.388). At grpo-colocated's lr, 5e-4, 8 steps
# closed the gap less reliably than for the dense model: seeds 0-5 gained 0.286, 0.387, 0.387,
# 0.385, 0.388, 0.357 (mean 0.365, sd 0.041: 4 sd above 0.2, the test's seed the worst); its
# first step raised the expected reward by 0.020 where the dense model's rose by 0.075 (seed
# 0). At 1e-3 seeds 0-5 gained 0.3863-0.3876 (sd 0.0005; bench/RESULTS.md). routingReplay
# unset (the router's own choice in the trainer; the engine's agrees, same float32 weights).
MOE = replace(ALGORITHMS["grpo-colocated"], task="moe",
              spec=merge(ALGORITHMS["grpo-colocated"].spec, {"algorithm": {"lr": 1e-3}}))
# The same in each routing replay mode (docs/moe.md). training: the rollout's 128 samples feed
# two optimizer steps of 64 (with one there would be nothing to replay), the second replaying
# the experts the old-log-prob pass chose; rollout: the engine returns each token's experts
# and every trainer pass replays them. Margins: bench/RESULTS.md.
MOE_REPLAY = {
    "moe-replay-training": replace(MOE, spec=merge(MOE.spec, {
        "algorithm": {"routingReplay": "training"}, "training": TWO_STEPS_PER_ROLLOUT})),
    "moe-replay-rollout": replace(MOE, spec=merge(MOE.spec, {
        "algorithm": {"routingReplay": "rollout"}})),
}

SCENARIOS: dict[str, Scenario] = {**TOOL_ARMS, "moe": MOE, **MOE_REPLAY, **ALGORITHMS,
                                  **CUSTOM_LOSSES,
                                  "on_policy_distillation": DISTILLATION,
                                  "mixed-sft": MIXED_SFT,
                                  "sync-disaggregated": SYNC_DISAGGREGATED,
                                  "async-one-step-off": ASYNC_ONE_STEP_OFF,
                                  "async-staleness-4": ASYNC_STALENESS_4[False],
                                  "async-staleness-4-partial": ASYNC_STALENESS_4[True]}
