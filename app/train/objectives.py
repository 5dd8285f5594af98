"""What a training step minimises and an evaluation reports, by `train.objective`.

sft  next-token cross-entropy over the target tokens (app/train/loss.py), normalised by the global batch's
     target tokens; evaluation: eval loss and perplexity.
dpo  Direct Preference Optimization over (chosen, rejected) pairs (app/train/preference.py), normalised by
     the global batch's pairs; evaluation: the DPO loss and TRL's reward figures on held-out pairs.

Either way a micro-batch's loss is scaled so that its sum over micro-batches and ranks is the mean over the
whole global batch: 1 and N workers take the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from app.config.schema import FinetuneConfig
from app.train.dpo import METRICS, global_pair_count, metrics_from_sums, real_pairs, scaled_micro_batch_dpo_loss
from app.train.evaluation import dealt_eval_sums, eval_metrics, evaluate_loss
from app.train.loss import global_target_tokens, scaled_micro_batch_loss
from app.train.ranks import RankContext


class NextToken:
    """Supervised fine-tuning: the mean loss per target token."""

    metric_names: tuple[str, ...] = ()
    normaliser_name = "step_target_tokens"
    has_reference = False  # no reference model

    def __init__(self, cfg: FinetuneConfig):
        self.chunk_tokens = cfg.train.loss_chunk_tokens

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        return global_target_tokens(micro_batches)

    def micro_batch_loss(self, model, batch: dict, normaliser: torch.Tensor, world_size: int):
        """(the loss to backpropagate, its unscaled sum, sums of `metric_names`)."""
        loss, loss_sum = scaled_micro_batch_loss(model, batch, normaliser, world_size, self.chunk_tokens)
        return loss, loss_sum, torch.zeros(0, dtype=torch.float64, device=loss_sum.device)

    def step_figures(self, sums: list[float], normaliser: float) -> dict[str, float]:
        return {}

    def evaluate(self, model, eval_pass: Callable[[], Iterable], ctx: RankContext) -> dict[str, float]:
        return eval_metrics(evaluate_loss(model, eval_pass, ctx, self.chunk_tokens))

    def prompts(self, batches: Iterable[dict]) -> Iterable[dict]:
        """Eval rows to decode answers from (app/train/generation.py)."""
        return batches


class Preference:
    """DPO: the policy (the LoRA model) against the reference (the same model with its adapter disabled, or
    with the run's frozen starting adapter: model.init_adapter)."""

    metric_names = METRICS
    normaliser_name = "step_pairs"
    has_reference = True

    def __init__(self, cfg: FinetuneConfig):
        self.dpo, self.chunk_tokens = cfg.dpo, cfg.train.loss_chunk_tokens

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        return global_pair_count(micro_batches)

    def micro_batch_loss(self, model, batch: dict, normaliser: torch.Tensor, world_size: int):
        return scaled_micro_batch_dpo_loss(model, batch, normaliser, world_size, self.dpo.beta, self.dpo.loss_type,
                                           self.dpo.label_smoothing, self.chunk_tokens)

    def step_figures(self, sums: list[float], normaliser: float) -> dict[str, float]:
        return metrics_from_sums(torch.tensor(sums, dtype=torch.float64), normaliser)

    def evaluate(self, model, eval_pass: Callable[[], Iterable], ctx: RankContext) -> dict[str, float]:
        """The DPO loss (eval_loss) and reward figures (eval_rewards/accuracies, ...) over every held-out pair."""
        def score(batch: dict) -> torch.Tensor:
            _, loss_sum, sums = self.micro_batch_loss(model, batch, torch.ones((), dtype=torch.float64), 1)
            pairs = real_pairs(batch).sum().double().reshape(1).to(sums.device)
            return torch.cat([loss_sum.double().reshape(1), sums, pairs])

        *sums, pairs = dealt_eval_sums(model, eval_pass, ctx, score).tolist()
        return {"eval_loss": sums[0] / pairs} | {f"eval_{k}": v for k, v in self.step_figures(sums[1:], pairs).items()}

    def prompts(self, batches: Iterable[dict]) -> Iterable[dict]:
        """Each pair's prompt, with its chosen answer as the reference."""
        return ({"input_ids": b["chosen_input_ids"], "labels": b["chosen_labels"]} for b in batches)


def objective_for(cfg: FinetuneConfig) -> NextToken | Preference:
    return Preference(cfg) if cfg.train.objective == "dpo" else NextToken(cfg)
