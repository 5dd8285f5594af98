"""What a training step minimises and an evaluation reports, by `train.objective`.

sft  next-token cross-entropy over the target tokens (app/train/loss.py), normalised by the global batch's
     target tokens; evaluation: eval loss and perplexity.
dpo  Direct Preference Optimization over (chosen, rejected) pairs (app/train/dpo.py), normalised by
     the global batch's pairs; evaluation: the DPO loss and TRL's reward figures on held-out pairs.
grpo Group Relative Policy Optimization over sampled, scored answers (app/train/grpo.py, the batches from
     app/train/rollouts.py), normalised by grpo.loss_type's count; evaluation: the rewards of greedy answers to
     the eval prompts (app/train/reward_eval.py).
distill on-policy distillation: the divergence from a teacher at every token of sampled answers
     (app/train/distill.py), normalised by the global batch's answer tokens; evaluation: the task metrics of
     greedy answers and their divergence from the teacher.

Each is a class here (TRAINERS, by the name its row in app/config/objectives.py gives), with the same calls: its
normaliser, a micro-batch's loss and figures, its evaluation, and the frozen adapter that rides beside the trained
one (reference_adapter).

Either way a micro-batch's loss is scaled so that its sum over micro-batches and ranks is the mean over the
whole global batch: 1 and N workers take the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from app.config.objectives import objective_of
from app.config.schema import FinetuneConfig
from app.config.sections import EvalSection
from app.data.chat import IGNORE_INDEX
from app.model.adapter import FrozenAdapter
from app.train.distill import Distillation
from app.train.dpo import METRICS, global_pair_count, metrics_from_sums, real_pairs, scaled_micro_batch_dpo_loss
from app.train.evaluation import dealt_eval_sums, eval_metrics, evaluate_loss
from app.train.generation import generation_table
from app.train.group import RankContext
from app.train.grpo import (
    METRIC_MAXIMA,
    METRIC_SUMS,
    figures_from_sums,
    importance_weights,
    metric_sums,
    normaliser_count,
    summed_loss,
    token_terms,
)
from app.train.loss import global_target_tokens, sampled_token_logps, scaled_block_losses, scaled_micro_batch_loss
from app.train.reward_eval import evaluate_rewards
from app.train.rollouts import Scorer
from app.train.task_metrics import row_scores


class AnswersOnRequest:
    """The answers of an objective whose evaluation is a loss: with eval.generation_rows, each evaluation also
    answers that many eval rows greedily and scores them by eval.metrics (each row's scores kept beside it)."""

    answers: dict[str, list] | None = None  # the latest evaluation's answers table
    answers_artifact: str | None = None  # logged at every evaluation under this name (None: only the samples)
    answers_hold_every_eval_row = False  # they are the first eval.generation_rows rows
    metric_maxima: tuple[str, ...] = ()  # figures a micro-batch reports after its sums, kept at their largest
    eval_cfg: EvalSection

    def prompts(self, batches: Iterable[dict]) -> Iterable[dict]:
        """Eval rows to decode answers from (app/train/generation.py)."""
        return batches

    def answer_figures(self, model, eval_pass: Callable[[], Iterable], ctx: RankContext, tokenizer) -> dict:
        """The task metrics of greedy answers (their means); the answers kept, each row's scores with them."""
        rows, metrics = self.eval_cfg.generation_rows, self.eval_cfg.metrics
        if not rows:
            return {}
        table = generation_table(model, self.prompts(eval_pass()), tokenizer, rows, self.eval_cfg.max_new_tokens,
                                 ctx.device)
        scores = row_scores(table["generated"], table["reference"], metrics) if table["generated"] else {}
        self.answers = table | scores
        return {f"eval_{name}": sum(values) / len(values) for name, values in scores.items()}


class NextToken(AnswersOnRequest):
    """Supervised fine-tuning: the mean loss per target token."""

    metric_names: tuple[str, ...] = ()
    normaliser_name = "step_target_tokens"

    def __init__(self, cfg: FinetuneConfig):
        self.chunk_tokens, self.eval_cfg = cfg.train.loss_chunk_tokens, cfg.eval

    def reference_adapter(self, init_adapter: dict | None, teacher: FrozenAdapter | None) -> FrozenAdapter | None:
        return None

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        return global_target_tokens(micro_batches)

    def micro_batch_loss(self, model, batch: dict, normaliser: torch.Tensor, world_size: int):
        """(the loss to backpropagate, its unscaled sum, sums of `metric_names`)."""
        loss, loss_sum = scaled_micro_batch_loss(model, batch, normaliser, world_size, self.chunk_tokens)
        return loss, loss_sum, torch.zeros(0, dtype=torch.float64, device=loss_sum.device)

    def block_losses(self, model, batch: dict, normalisers: torch.Tensor, world_size: int, block_rows: list[int]):
        """(the loss to backpropagate, each block's unscaled sum): `batch` holds a block of rows per adapter, each
        normalised by its own adapter's global batch."""
        return scaled_block_losses(model, batch, normalisers, world_size, block_rows, self.chunk_tokens)

    def step_figures(self, sums: list[float], normaliser: float) -> dict[str, float]:
        return {}

    def evaluate(self, model, eval_pass: Callable[[], Iterable], ctx: RankContext, tokenizer) -> dict[str, float]:
        figures = eval_metrics(evaluate_loss(model, eval_pass, ctx, self.chunk_tokens))
        return figures | self.answer_figures(model, eval_pass, ctx, tokenizer)


class Preference(AnswersOnRequest):
    """DPO: the policy (the LoRA model) against the reference (the same model with its adapter disabled, or
    with the run's frozen starting adapter: model.init_adapter)."""

    metric_names = METRICS
    normaliser_name = "step_pairs"

    def __init__(self, cfg: FinetuneConfig):
        self.cfg, self.dpo, self.chunk_tokens, self.eval_cfg = cfg, cfg.dpo, cfg.train.loss_chunk_tokens, cfg.eval

    def reference_adapter(self, init_adapter: dict | None, teacher: FrozenAdapter | None) -> FrozenAdapter | None:
        return starting_adapter_as_reference(self.cfg, init_adapter)

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        return global_pair_count(micro_batches)

    def micro_batch_loss(self, model, batch: dict, normaliser: torch.Tensor, world_size: int):
        return scaled_micro_batch_dpo_loss(model, batch, normaliser, world_size, self.dpo.beta, self.dpo.loss_type,
                                           self.dpo.label_smoothing, self.chunk_tokens)

    def step_figures(self, sums: list[float], normaliser: float) -> dict[str, float]:
        return metrics_from_sums(torch.tensor(sums, dtype=torch.float64), normaliser)

    def evaluate(self, model, eval_pass: Callable[[], Iterable], ctx: RankContext, tokenizer) -> dict[str, float]:
        """The DPO loss (eval_loss) and reward figures (eval_rewards/accuracies, ...) over every held-out pair."""
        def score(batch: dict) -> torch.Tensor:
            _, loss_sum, sums = self.micro_batch_loss(model, batch, torch.ones((), dtype=torch.float64), 1)
            pairs = real_pairs(batch).sum().double().reshape(1).to(sums.device)
            return torch.cat([loss_sum.double().reshape(1), sums, pairs])

        *sums, pairs = dealt_eval_sums(model, eval_pass, ctx, score).tolist()
        rewards = {f"eval_{k}": v for k, v in self.step_figures(sums[1:], pairs).items()}
        return {"eval_loss": sums[0] / pairs} | rewards | self.answer_figures(model, eval_pass, ctx, tokenizer)

    def prompts(self, batches: Iterable[dict]) -> Iterable[dict]:
        """Each pair's prompt, with its chosen answer as the reference."""
        return ({"input_ids": b["chosen_input_ids"], "labels": b["chosen_labels"]} for b in batches)


class GroupRelative:
    """GRPO: the policy pushed toward its better answers of each prompt's group, against the policy that sampled
    them (and with grpo.beta, the reference: the base with LoRA off, or the frozen starting adapter)."""

    metric_names, metric_maxima = METRIC_SUMS, METRIC_MAXIMA
    answers_artifact = "eval/completions.json"  # its evaluation is greedy answers to every eval prompt, scored
    answers_hold_every_eval_row = True

    def __init__(self, cfg: FinetuneConfig, scorer: Scorer | None = None):
        self.cfg, self.grpo, self.rollout, self.eval_cfg, self.scorer = cfg, cfg.grpo, cfg.rollout, cfg.eval, scorer
        self.chunk_tokens = cfg.train.loss_chunk_tokens
        self.has_reference = cfg.grpo.beta > 0
        self.normaliser_name = "step_completion_tokens" if cfg.grpo.loss_type == "dapo" else "step_completions"
        self.answers: dict[str, list] | None = None

    def reference_adapter(self, init_adapter: dict | None, teacher: FrozenAdapter | None) -> FrozenAdapter | None:
        return starting_adapter_as_reference(self.cfg, init_adapter) if self.has_reference else None

    def normaliser(self, micro_batches: list[dict]) -> torch.Tensor:
        """The global batch's completion tokens (dapo) or answers (grpo, dr_grpo): one all-reduce. At least 1, as
        TRL's: a batch where no token trains (every answer cut off, with grpo.mask_truncated_completions) is a step
        of loss 0, not a division by zero."""
        count = sum(normaliser_count(b["labels"][:, 1:] != IGNORE_INDEX, b["real"], self.grpo.loss_type)
                    for b in micro_batches).to(torch.float64)
        if dist.is_initialized():
            dist.all_reduce(count)
        return count.clamp(min=1.0)

    def micro_batch_loss(self, model, batch: dict, normaliser: torch.Tensor, world_size: int):
        grpo, rollout = self.grpo, self.rollout
        logps, entropy = sampled_token_logps(model, batch, self.chunk_tokens, rollout.temperature)
        on = lambda key: batch[key].to(logps.device)
        old = on("old_logps") if "old_logps" in batch else logps.detach()  # first step on these answers: r = 1
        sampler = on("sampler_logps")
        tis = rollout.importance_correction == "tis"
        weights = importance_weights(old, sampler, rollout.importance_cap) if tis else None
        terms = token_terms(logps, old, on("advantages"), grpo.epsilon, grpo.clip_high, grpo.beta,
                            on("ref_logps") if grpo.beta else None, weights)
        mask = (batch["labels"][:, 1:] != IGNORE_INDEX).to(logps.device)
        loss_sum = summed_loss(terms[0], mask, grpo.loss_type, rollout.max_completion_tokens)
        return loss_sum * (world_size / normaliser), loss_sum.detach(), metric_sums(
            terms, mask, entropy, logps, sampler, old, rollout.importance_cap)

    def step_figures(self, sums: list[float], normaliser: float) -> dict[str, float]:
        return figures_from_sums(sums, self.grpo.beta)

    def evaluate(self, model, eval_pass: Callable[[], Iterable], ctx: RankContext, tokenizer) -> dict[str, float]:
        """The rewards (and task metrics) of greedy answers to every eval prompt; the answers' table is kept."""
        figures, self.answers = evaluate_rewards(model, eval_pass, tokenizer, ctx.device, self.scorer, self.grpo,
                                                 self.rollout, self.eval_cfg)
        return figures


TRAINERS = {trainer.__name__: trainer for trainer in (NextToken, Preference, GroupRelative, Distillation)}


def objective_for(cfg: FinetuneConfig, scorer: Scorer | None = None):
    """train.objective's class (its row's `trainer`, app/config/objectives.py), built for this run."""
    row = objective_of(cfg.train)
    if row.trainer not in TRAINERS:
        raise ValueError(f"train.objective={row.name}: its row names the class {row.trainer}, which "
                         "app/train/objectives.py's TRAINERS lacks")
    return TRAINERS[row.trainer](cfg, scorer) if row.rewarded else TRAINERS[row.trainer](cfg)


def starting_adapter_as_reference(cfg: FinetuneConfig, init_adapter: dict[str, torch.Tensor] | None):
    """A run that starts from model.init_adapter measures against it (DPO, GRPO's KL): a frozen copy beside the
    trained adapter. Without one, the reference is the base with the adapter off: no second adapter."""
    return FrozenAdapter(cfg.lora, init_adapter) if init_adapter is not None else None
