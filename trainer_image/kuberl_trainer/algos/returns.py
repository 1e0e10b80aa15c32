"""Token-level rewards, returns and advantages: REINFORCE++, REINFORCE++-baseline and GAE.

Shapes: ``B`` sequences of ``T`` positions, indexed like ``input_ids`` (right-padded). A
``mask`` is ``[B, T]`` with 1 on response tokens and 0 on prompt and padding; a row's response
tokens are contiguous, so a row looks like ``prompt... response... padding...``. Every
function here returns ``[B, T]`` tensors that are exactly 0 off the mask, and reads nothing
from off-mask positions (padding may hold NaN or inf: it is replaced with ``torch.where``,
never multiplied by 0, because ``nan * 0`` is NaN).

Everything is computed in float32 (float64 inputs stay float64): integer scores from a
verifier would otherwise truncate, and bf16 would lose the small differences that whitening
divides by. Inputs are never modified.
"""

from __future__ import annotations

import torch
from torch import Tensor


def whiten(x: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise the masked-in entries of ``x[B, T]`` to unit variance over the whole batch.

    All masked-in entries of all rows are pooled: one mean and one variance for the batch
    (REINFORCE++'s "global" normalisation), not one per row.

    ``out = (x - mean) / sqrt(var + eps)`` on the mask, 0 elsewhere. ``var`` is the unbiased
    (Bessel-corrected, ``/ (n - 1)``) variance, as verl's ``masked_whiten`` uses; OpenRLHF's
    global advantage normalisation divides by ``n`` instead. The two differ by a factor
    ``sqrt(n / (n - 1))``, negligible over a batch of thousands of tokens; the unbiased one
    also matches ``torch.std`` and ``advantages.grpo``.

    Args:
        x: ``[B, T]`` values (returns, advantages or rewards).
        mask: ``[B, T]`` 1 on the entries to pool and normalise.
        shift_mean: ``True`` centres the entries to mean 0. ``False`` keeps their mean and
            only rescales their spread around it (``out = (x - mean) / std + mean``), the
            meaning of the same flag in verl/TRL's ``masked_whiten`` (used to whiten rewards
            without moving their mean).
        eps: ``>= 0``, added to the variance so a batch with almost no spread is not blown
            up to unit variance; a batch with none (all entries equal) gives exactly 0.

    Returns:
        ``[B, T]`` float. With fewer than two masked-in entries there is no spread to
        measure: the deviation from the mean is 0, so the output is 0 on the mask (or the
        entry itself with ``shift_mean=False``), never NaN. An empty mask gives all zeros.
    """
    check_token_shapes(mask, x=x)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    on = mask.bool()
    values = torch.where(on, _float(x), 0.0)
    count = on.sum()
    mean = values.sum() / count.clamp(min=1)
    centred = torch.where(on, values - mean, 0.0)
    # n = 1: the single deviation is 0, so any positive divisor gives var = 0.
    var = centred.square().sum() / (count - 1).clamp(min=1)
    # With eps = 0 and no spread, rsqrt(0) = inf and 0 * inf = NaN: every deviation is 0
    # then, so any finite scale gives the right answer, 0.
    scale = torch.where(var + eps > 0, torch.rsqrt(var + eps), 0.0)
    out = centred * scale
    if not shift_mean:
        out = out + mean
    return torch.where(on, out, 0.0)


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """Reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over each row's response tokens.

    The sum runs right to left over masked-in tokens only: the return of a row's last
    response token is its own reward (nothing after it counts, padding included), and
    prompt/padding positions contribute nothing and get 0.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (see ``kl_penalised_rewards``).
        mask: ``[B, T]`` 1 on response tokens.
        gamma: discount in ``[0, 1]``; LLM post-training uses 1 (the episode is one
            response, and a discount would favour short answers for reasons other than
            their reward).

    Returns:
        ``[B, T]`` float returns, 0 off the mask.
    """
    check_token_shapes(mask, token_rewards=token_rewards)
    _check_unit("gamma", gamma)
    on = mask.bool()
    rewards = torch.where(on, _float(token_rewards), 0.0)
    running = rewards.new_zeros(rewards.shape[0])
    columns: list[Tensor] = []
    for t in reversed(range(rewards.shape[1])):
        # Off the mask the running return resets to 0: after a row's last response token
        # (padding) nothing flows back, and the prompt before it receives nothing.
        running = torch.where(on[:, t], rewards[:, t] + gamma * running, 0.0)
        columns.append(running)
    return _stack_reversed(columns, rewards)


def kl_penalised_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards with the KL penalty folded in (REINFORCE++ / PPO-RLHF style).

    ``r[b, t] = -kl_coef * kl[b, t]`` on every response token, plus ``scores[b]`` on the
    row's last response token (the sequence is scored once, when it ends).

    Args:
        scores: ``[B]`` one scalar reward per sequence.
        kl: ``[B, T]`` per-token KL estimate to the reference, e.g. ``old_logp - ref_logp``
            (``kl.estimate``). Pass it detached: rewards are constants to the policy loss,
            and nothing here detaches them.
        mask: ``[B, T]`` 1 on response tokens.
        kl_coef: penalty weight, ``>= 0`` (0 turns the penalty off).

    Returns:
        ``[B, T]`` float rewards, 0 off the mask. A row with no response token (an empty
        generation whose mask is all 0) gets all zeros: its score has no token to sit on
        and is dropped, as it would contribute no gradient anyway.
    """
    _check_scores(scores, mask)
    check_token_shapes(mask, kl=kl)
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    on = mask.bool()
    rewards = torch.where(on, -kl_coef * _float(kl), 0.0)
    positions = torch.arange(mask.shape[1], device=mask.device)
    # Last masked-in position per row: the largest index where the mask is on (-1 if none,
    # which matches no position, so an empty row gets no score).
    last = torch.where(on, positions, -1).amax(dim=1, keepdim=True)
    at_end = positions == last
    return rewards + torch.where(at_end, _float(scores).unsqueeze(1), 0.0)


def reinforce_plus_plus(scores: Tensor, mask: Tensor, *, kl: Tensor | None = None,
                        kl_coef: float = 0.0, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv:2501.03262): no critic, no per-prompt group.

    Token rewards are ``kl_penalised_rewards``, the returns are their discounted
    reward-to-go (``discounted_returns``), and the advantages are those returns whitened
    over all response tokens of the batch (``whiten``): the batch mean is the baseline,
    the batch std the scale.

    Args:
        scores: ``[B]`` sequence rewards.
        mask: ``[B, T]`` 1 on response tokens.
        kl: ``[B, T]`` per-token KL estimate; ``None`` means no penalty.
        kl_coef: KL penalty weight (must be 0 when ``kl`` is ``None``).
        gamma: discount in ``[0, 1]``.

    Returns:
        ``[B, T]`` float advantages, 0 off the mask.
    """
    token_rewards = kl_penalised_rewards(scores, _kl_or_zeros(kl, kl_coef, mask), mask, kl_coef)
    return whiten(discounted_returns(token_rewards, mask, gamma), mask)


def reinforce_plus_plus_baseline(scores: Tensor, group_size: int, mask: Tensor, *,
                                 kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """REINFORCE++-baseline advantages: REINFORCE++ on group-centred scores.

    Each prompt's group mean is subtracted from its samples' scores (a baseline that removes
    the prompt's difficulty, without GRPO's division by the group std), then as
    ``reinforce_plus_plus`` with ``gamma = 1``: KL-penalised token rewards, reward-to-go,
    whitened over the whole batch.

    Note the batch whitening: a group whose scores are all equal has centred scores of 0,
    but its advantages are ``-mean / std`` of the batch's returns, which is 0 only when the
    batch mean is 0. Without KL it is the token-weighted mean of the centred scores, so it
    is non-zero when response lengths differ (a long, above-average response moves it up).

    Args:
        scores: ``[B]`` sequence rewards; groups are contiguous runs of ``group_size``
            samples (prompt 0's samples first), as in ``advantages.grpo``.
        group_size: samples per prompt; must be ``>= 1`` and divide ``B``.
        mask: ``[B, T]`` 1 on response tokens.
        kl: ``[B, T]`` per-token KL estimate; ``None`` means no penalty.
        kl_coef: KL penalty weight (must be 0 when ``kl`` is ``None``).

    Returns:
        ``[B, T]`` float advantages, 0 off the mask.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    if group_size < 1 or scores.shape[0] % group_size:
        raise ValueError(f"group_size {group_size} must be >= 1 and divide the batch "
                         f"({scores.shape[0]} scores)")
    groups = _float(scores).view(-1, group_size)
    centred = (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)
    token_rewards = kl_penalised_rewards(centred, _kl_or_zeros(kl, kl_coef, mask), mask, kl_coef)
    return whiten(discounted_returns(token_rewards, mask, 1.0), mask)


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Right to left over each row's response tokens::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}

    where the "next" token of ``t`` is ``t + 1`` if it is a response token; after a row's
    last response token the episode is over, so ``V_{t+1} = 0`` and ``A_{t+1} = 0`` there
    (padding values are never read). A response cut at the length limit is treated as
    terminal too. ``lam = 1`` gives the discounted return minus ``V_t``; ``lam = 0`` the
    one-step TD error.

    The advantages are not whitened here: PPO usually whitens them over the batch
    (``whiten(adv, mask)``) before the policy loss, but the returns (the critic's targets)
    must stay unwhitened, so the caller decides.

    Args:
        token_rewards: ``[B, T]`` per-token rewards (see ``kl_penalised_rewards``).
        values: ``[B, T]`` critic estimates ``V_t`` at each response token, detached (the
            critic is trained by ``value_loss`` on the returns, not through these).
        mask: ``[B, T]`` 1 on response tokens.
        gamma: discount in ``[0, 1]``.
        lam: GAE's bias/variance trade-off in ``[0, 1]``.

    Returns:
        ``(advantages, returns)``, both ``[B, T]`` float and 0 off the mask, with
        ``returns = advantages + values`` (the value-loss target).
    """
    check_token_shapes(mask, token_rewards=token_rewards, values=values)
    _check_unit("gamma", gamma)
    _check_unit("lam", lam)
    on = mask.bool()
    rewards = torch.where(on, _float(token_rewards), 0.0)
    vals = torch.where(on, _float(values), 0.0)
    # Both are 0 after the last response token: the terminal state has no value.
    next_value = vals.new_zeros(vals.shape[0])
    next_adv = torch.zeros_like(next_value)
    columns: list[Tensor] = []
    for t in reversed(range(vals.shape[1])):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        next_adv = torch.where(on[:, t], delta + gamma * lam * next_adv, 0.0)
        next_value = vals[:, t]  # already 0 off the mask
        columns.append(next_adv)
    advantages = _stack_reversed(columns, vals)
    return advantages, torch.where(on, advantages + vals, 0.0)


def _kl_or_zeros(kl: Tensor | None, kl_coef: float, mask: Tensor) -> Tensor:
    if kl is not None:
        return kl
    if kl_coef != 0:
        raise ValueError(f"kl_coef is {kl_coef} but no kl was given")
    return torch.zeros(mask.shape, device=mask.device)


def _stack_reversed(columns: list[Tensor], like: Tensor) -> Tensor:
    """Columns computed from ``t = T - 1`` down to 0 -> ``[B, T]`` in position order."""
    if not columns:  # T = 0
        return torch.zeros_like(like)
    return torch.stack(columns[::-1], dim=1)


def _float(x: Tensor) -> Tensor:
    """float32, or float64 if it already is (ints, bools, bf16 and fp16 are promoted)."""
    return x if x.dtype == torch.float64 else x.float()


def _check_unit(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value}")


def _check_scores(scores: Tensor, mask: Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [B] = [{mask.shape[0]}] (mask is "
                         f"{tuple(mask.shape)}), got shape {tuple(scores.shape)}")


def check_token_shapes(mask: Tensor, **tensors: Tensor) -> None:
    """``mask`` is ``[B, T]`` and every named tensor has its shape."""
    if mask.dim() != 2:
        raise ValueError(f"mask must be 2-D [B, T], got shape {tuple(mask.shape)}")
    for name, x in tensors.items():
        if x.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected mask's "
                             f"{tuple(mask.shape)}")
