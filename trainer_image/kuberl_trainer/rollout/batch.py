"""A step's responses as the trainers take them (a TrainBatch), what the step reports about
them (rewards, lengths, advantages, each engine's throughput), and its rows as trajectories.

Each trajectory (a sample and seed: one member of its prompt's GRPO group) takes `rows`
consecutive rows (rollout.maxRowsPerSample; 1 unless a rollout function returns several): its
trajectories, then fillers out of the loss. Every row of a trajectory carries its one reward
and score; a trajectory whose episode failed (environment.onError drop) is only fillers, the
first with the error; one whose reward could not be had (reward.onError drop) keeps its rows,
each with the reason (`reward_error`). Either leaves the loss with its group."""

from __future__ import annotations

import statistics

import torch

from kuberl_trainer.backends.base import TrainBatch
from kuberl_trainer.rollout.generate import Response
from kuberl_wire import moe_routes
from kuberl_wire.moe_routes import ROUTES_FLAG, MoeShape


def pack(responses: list[Response], advantages: torch.Tensor, pad_id: int,
         routes: MoeShape | None = None) -> TrainBatch:
    """Right-padded [B, T] tensors of prompt+response; loss on response tokens only (the ones
    a response's `loss_mask` keeps: a trajectory's environment tokens are out).

    Token-level tensors (advantages, rollout logprobs) sit at the response tokens' positions in
    input_ids, the convention the backend's log-probs use (position t scores token t).
    `routes` (a mixture-of-experts model's shape; routingReplay: rollout): the engines'
    routes of every row's tokens as `TrainBatch.routes`.
    """
    width = max((len(r.prompt_ids) + len(r.output_ids) for r in responses), default=1)
    # Rows built as Python lists, then one tensor each: per-row tensor writes cost more than
    # the rest of a tiny step's packing.
    ids, attention, loss, logprobs = [], [], [], []
    for r in responses:
        p, o = len(r.prompt_ids), len(r.output_ids)
        pad = width - p - o
        ids.append(r.prompt_ids + r.output_ids + [pad_id] * pad)
        attention.append([1] * (p + o) + [0] * pad)
        mask = r.loss_mask if r.loss_mask is not None else [1.0] * o
        loss.append([0.0] * p + list(mask) + [0.0] * pad)
        lp = list(r.logprobs[:o]) if r.logprobs else []
        logprobs.append([0.0] * p + lp + [0.0] * (o - len(lp) + pad))
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention_mask = torch.tensor(attention, dtype=torch.long)
    loss_mask = torch.tensor(loss, dtype=torch.float32)
    rollout_lp = torch.tensor(logprobs, dtype=torch.float32)
    token_adv = advantages[:, None] * loss_mask
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask,
                      advantages=token_adv, rollout_logprobs=rollout_lp,
                      routes=None if routes is None else route_table(responses, width, routes))


def route_table(responses: list[Response], width: int, shape: MoeShape) -> torch.Tensor:
    """``[B, width, layers, top_k]``: each row's routes as its engine answered them (every
    token but the last, which no forward pass took as input), NO_ROUTE elsewhere. A real row
    without them, or with routes for more tokens than it has, is an error: replaying
    misaligned experts would train on a forward pass no engine ran."""
    rows = []
    for i, r in enumerate(responses):
        length = len(r.prompt_ids) + len(r.output_ids)
        table = None
        if not r.filler:
            if r.routes is None:
                raise ValueError(f"row {i}: the engine returned no routed_experts "
                                 "(algorithm.routingReplay rollout needs an engine started "
                                 f"with --{ROUTES_FLAG})")
            table = moe_routes.decode(r.routes, shape.layers, shape.top_k)
            if table.shape[0] > length:
                raise ValueError(f"row {i}: the engine returned routes for "
                                 f"{table.shape[0]} tokens, the row has {length}")
        rows.append(moe_routes.pad_to(table, width, shape.layers, shape.top_k))
    return torch.stack(rows)


def trajectories(responses: list[Response], rows: int) -> list[list[Response]]:
    """The step's rows by trajectory: consecutive runs of `rows`."""
    if rows < 1 or len(responses) % rows:
        raise ValueError(f"{len(responses)} rows are not whole trajectories of {rows}")
    return [responses[i:i + rows] for i in range(0, len(responses), rows)]


def failed(trajectory: list[Response]) -> bool:
    """Whether it is dropped with its group: its episode failed (environment.onError drop)
    or its reward could not be had (reward.onError drop)."""
    return any(r.error is not None or r.reward_error is not None for r in trajectory)


def failure(responses: list[Response]) -> str | None:
    """The first reason a trajectory among `responses` was dropped, if one was."""
    return next((r.error or r.reward_error for r in responses
                 if r.error is not None or r.reward_error is not None), None)


def graded_row(trajectory: list[Response]) -> Response | None:
    """The row its answer is read from: its last real row (None when its episode failed)."""
    real = [r for r in trajectory if not r.filler]
    return real[-1] if real else None


def failed_groups(responses: list[Response], n: int, rows: int) -> torch.Tensor:
    """``BoolTensor[groups]``: the groups of ``n`` trajectories with a failed episode."""
    return torch.tensor([failed(t) for t in trajectories(responses, rows)],
                        dtype=torch.bool).view(-1, n).any(dim=1)


def step_metrics(responses: list[Response], batch: TrainBatch, rows: int = 1, *,
                 agentic: bool = False) -> dict[str, float]:
    """Rewards and scores per trajectory, failed ones left out (never counted as 0); lengths
    and truncation per row, fillers left out; `agentic`: the job has a rollout function or an
    environment (its turn and token metrics every step, even one of single turns)."""
    done = [t[0] for t in trajectories(responses, rows) if not failed(t)]
    rewards = torch.tensor([r.reward for r in done], dtype=torch.float32)
    scores = torch.tensor([r.score for r in done], dtype=torch.float32)
    real = [r for r in responses if not r.filler]
    lengths = [len(r.output_ids) for r in real]
    on = batch.loss_mask.bool()
    adv = batch.advantages[on]
    return {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "score_mean": float(scores.mean()),  # after shaping (= reward_mean without it)
        "advantage_mean": float(adv.mean()) if adv.numel() else 0.0,
        "advantage_std": float(adv.std(unbiased=False)) if adv.numel() else 0.0,
        "response_length_mean": statistics.fmean(lengths),
        "response_length_min": float(min(lengths)),
        "response_length_max": float(max(lengths)),
        "truncated_fraction": sum(r.truncated for r in real) / len(real),
        **({"rows_mean": len(real) / len(done)} if rows > 1 and done else {}),
        **(agent_metrics(real) if agentic or _multi_turn(real) else {}),
        **reward_metrics(done),
    }


def reward_metrics(graded: list[Response]) -> dict[str, float]:
    """The reward service's own metrics of each trajectory (its `results[].metrics`), as
    means over the trajectories that have each, prefixed reward/."""
    out = {}
    for key in sorted({k for r in graded for k in r.reward_metrics}):
        out[f"reward/{key}"] = statistics.fmean(r.reward_metrics[key] for r in graded
                                                if key in r.reward_metrics)
    return out


def agent_metrics(responses: list[Response]) -> dict[str, float]:
    """Multi-turn trajectories: the model's turns, each trajectory's length split into the
    model's tokens and the environment's, the seconds of its environment's steps, and the
    environment's own metrics (mean over steps, then trajectories; prefixed env_)."""
    env = [float(r.env_tokens) for r in responses]
    out = {"turns_mean": statistics.fmean(r.turns for r in responses),
           "response_env_tokens_mean": statistics.fmean(env),
           "response_model_tokens_mean": statistics.fmean(
               len(r.output_ids) - e for r, e in zip(responses, env, strict=True)),
           "env_step_s": statistics.fmean(r.env_step_s for r in responses)}
    for key in sorted({k for r in responses for k in r.env_metrics}):  # the environment's own
        values = [r.env_metrics[key] for r in responses if key in r.env_metrics]
        out[f"env_{key}"] = statistics.fmean(values)
    return out


def _multi_turn(responses: list[Response]) -> bool:
    return any(r.turns != 1 or r.env_tokens for r in responses)


def engine_throughput(responses: list[Response]) -> dict[str, float]:
    """Generated tokens per second of each engine over its requests in this rollout: the
    slowest, the mean and the fastest engine, and the spread (fastest / slowest; 1 when they
    keep pace; a lagging engine holds every synchronous step back)."""
    tokens: dict[str, int] = {}
    seconds: dict[str, dict[int, float]] = {}  # engine -> request -> its time
    for r in responses:
        if r.engine and r.seconds > 0:
            tokens[r.engine] = tokens.get(r.engine, 0) + len(r.output_ids)
            seconds.setdefault(r.engine, {})[r.request] = r.seconds
    rates = [tokens[e] / sum(seconds[e].values()) for e in tokens]
    if not rates:
        return {}
    return {"engine_tokens_per_s_min": min(rates), "engine_tokens_per_s_max": max(rates),
            "engine_tokens_per_s_mean": statistics.fmean(rates),
            "engine_throughput_spread": max(rates) / min(rates) if min(rates) > 0 else 0.0}
