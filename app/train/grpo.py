"""Group Relative Policy Optimization (DeepSeekMath), with the Dr. GRPO and DAPO variants: the formulas.

Each prompt's answers form a group; an answer's advantage is its reward minus the group's mean reward, divided
by the group's standard deviation (grpo.scale_rewards: group), the whole batch's (batch) or nothing (none).
Each completion token t of an answer with advantage A contributes

    loss_t = -w_t min(r_t A, clip(r_t, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t
    r_t = exp(logp_t - old_logp_t),  kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
    w_t = min(exp(old_logp_t - sampler_logp_t), importance_cap)   (rollout.importance_correction: tis; else 1)

where logp is the policy's log-probability of the sampled token (logits divided by the sampling temperature),
old_logp the trainer's policy's before this batch's first update (at the first optimizer step on fresh answers:
logp itself, detached, so r = 1), sampler_logp the rollout side's as it sampled the token (an adapter up to
rollout.max_staleness steps older, or another numeric path), and ref the reference's. w is truncated importance
sampling (Yao et al., 2025: "Your efficient RL framework secretly brings you off-policy RL training"), detached:
a token the sampler found likelier than the trainer does counts less, one it found less likely counts more, up
to the cap. The loss of the global batch normalises the token losses by loss_type:

    grpo     mean over answers of (sum of an answer's token losses / its tokens)
    dr_grpo  sum of all token losses / (answers x max_completion_tokens)
    dapo     sum of all token losses / completion tokens

The normaliser (answers, or tokens) counts the whole global batch, so a rank backpropagates its micro-batch's
sum x world size / normaliser and 1 and N workers take the same step (app/train/loss.py's scheme).
"""

from __future__ import annotations

import math

import torch

STD_EPSILON = 1e-4  # added to the standard deviation before dividing (TRL's)
# sums a micro-batch reports, all-reduced with the loss (app/train/recipe.py), turned into figures by step_figures
METRIC_SUMS = ("kl", "entropy", "clip_low", "clip_high", "clip_region", "sampler_gap", "is_ratio", "is_truncated",
               "tokens")
METRIC_MAXIMA = ("sampler_gap_max",)  # after the sums, all-reduced by MAX
MAX_LOG_RATIO = 20.0  # an importance ratio's figure is kept finite past this (e^20)


def nan_std(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (Bessel-corrected) of the non-NaN values; NaN where fewer than two."""
    valid = ~torch.isnan(values)
    count = valid.sum() if dim is None else valid.sum(dim)
    mean = torch.nanmean(values) if dim is None else torch.nanmean(values, dim, keepdim=True)
    squares = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values))
    total = squares.sum() if dim is None else squares.sum(dim)
    return torch.where(count > 1, (total / (count - 1).clamp(min=1)).sqrt(), torch.full_like(total, float("nan")))


def group_advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None):
    """Each answer's advantage from its reward (answers of one prompt consecutive, `group` of them): minus the
    group's mean, divided (scale) by the group's std, by `batch_std` (the whole global batch's), or not. A NaN
    reward (no function applied) has advantage 0. Returns (advantages, whether each answer's group has zero std)."""
    grouped = rewards.view(-1, group)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(group)
    group_std = nan_std(grouped, dim=1).repeat_interleave(group)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (group_std + STD_EPSILON)
    elif scale == "batch":
        advantages = advantages / (batch_std + STD_EPSILON)
    zero_std = torch.isclose(torch.nan_to_num(group_std, nan=0.0), torch.zeros_like(group_std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def importance_weights(old_logps: torch.Tensor, sampler_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: each token's min(pi_trainer / pi_sampler, cap), detached."""
    return torch.exp((old_logps - sampler_logps).clamp(max=math.log(cap))).detach()


def token_terms(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, epsilon: float,
                 epsilon_high: float, beta: float = 0.0, ref_logps: torch.Tensor | None = None,
                 weights: torch.Tensor | None = None):
    """loss_t of every token ([answers, tokens]), its kl_t (zeros without beta), and where the ratio was clipped
    below (r < 1 - epsilon, A < 0) and above (r > 1 + epsilon_high, A > 0). `weights`: w_t (importance_weights)."""
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    advantage = advantages[:, None]
    loss = -torch.min(ratio * advantage, clipped * advantage)
    if weights is not None:
        loss = weights * loss
    kl = torch.zeros_like(loss)
    if beta:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        loss = loss + beta * kl
    low = (ratio < 1 - epsilon) & (advantage < 0)
    high = (ratio > 1 + epsilon_high) & (advantage > 0)
    return loss, kl, low, high


def summed_loss(loss: torch.Tensor, mask: torch.Tensor, loss_type: str, max_completion_tokens: int) -> torch.Tensor:
    """A micro-batch's part of the numerator of loss_type's normalisation (its answers' masked token losses)."""
    masked = loss * mask
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    if loss_type == "dr_grpo":
        return masked.sum() / max_completion_tokens
    if loss_type == "dapo":
        return masked.sum()
    raise ValueError(f"grpo.loss_type={loss_type}: use grpo, dr_grpo or dapo")


def normaliser_count(mask: torch.Tensor, real: torch.Tensor, loss_type: str) -> torch.Tensor:
    """What a micro-batch adds to the denominator: its completion tokens (dapo), or its answers."""
    return mask.sum() if loss_type == "dapo" else real.sum()


def metric_sums(loss_terms, mask: torch.Tensor, entropy: torch.Tensor, logps: torch.Tensor,
                sampler_logps: torch.Tensor, old_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """The METRIC_SUMS of a micro-batch over its completion tokens, then its METRIC_MAXIMA; `sampler_gap`: how far
    the trainer's log-probabilities of the sampled tokens are from the sampler's (a stale adapter on the rollout
    side, or another numeric path, shows here); `is_ratio` and `is_truncated`: the importance ratio old/sampler, and
    whether it exceeds importance_cap (whether or not the loss is weighted by it)."""
    _, kl, low, high = loss_terms
    m = mask.to(torch.float64)
    gap = (logps.detach().double() - sampler_logps.double()).abs()
    log_ratio = old_logps.detach().double() - sampler_logps.double()
    ratio = torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO))
    return torch.stack([(kl.double() * m).sum(), (entropy.double() * m).sum(), (low * m).sum(), (high * m).sum(),
                        ((low | high) * m).sum(), (gap * m).sum(), (ratio * m).sum(),
                        ((log_ratio > math.log(cap)) * m).sum(), m.sum(), (gap * m).max()])


def figures_from_sums(sums: list[float], beta: float) -> dict[str, float]:
    """TRL's names: kl (with beta), entropy and the clipped shares, each a mean over the global batch's completion
    tokens."""
    totals = dict(zip(METRIC_SUMS + METRIC_MAXIMA, sums))
    tokens = max(totals["tokens"], 1.0)
    return ({"kl": totals["kl"] / tokens} if beta else {}) | {"entropy": totals["entropy"] / tokens,
            "clip_ratio/low_mean": totals["clip_low"] / tokens, "clip_ratio/high_mean": totals["clip_high"] / tokens,
            "sampling/sampling_logp_difference/mean": totals["sampler_gap"] / tokens,
            "sampling/sampling_logp_difference/max": totals["sampler_gap_max"],
            "rollout/is_ratio_mean": totals["is_ratio"] / tokens,
            "rollout/is_truncated_share": totals["is_truncated"] / tokens,
            "clip_ratio/region_mean": totals["clip_region"] / tokens}
