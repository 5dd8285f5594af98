"""What each training objective is to the config and the driver: the records it reads, what its batch counts,
the figures its evaluations report and the one it ranks by, and whether it samples answers online (a rollout
group beside the workers, reward functions to score them). The workers' side of each, its loss and its
evaluation, is app/train/objectives.py. Everything that differs by `train.objective` asks its Objective here."""

from __future__ import annotations

from dataclasses import dataclass

from app.config.grpo import GrpoSection, reward_name
from app.config.sections import EvalSection, TrainSection, metric_name

LOWER_IS_BETTER = ("eval_loss", "eval_perplexity")  # every other figure ranks higher first


@dataclass(frozen=True)
class Objective:
    name: str  # train.objective
    record_format: str | None  # the data.format its records must have ("preference", "prompt"); None: any text
    records: str  # what they are, in its errors: "preference pairs"
    fields: str  # what each holds: "records with prompt, chosen and rejected"
    use: str  # what the objective does with them: "pairs to prefer one answer of"
    truncation: str  # what data.max_seq_len cuts from one
    samples_online: bool  # a rollout group samples answers every step, reward functions score them
    eval_figures: tuple[str, ...]  # what each evaluation reports before task metrics and reward means
    best_metric: str  # train.best_metric's default
    side_by_side: bool = False  # several adapters (`adapters:`) may train in one job over one base

    def reported_figures(self, eval: EvalSection, grpo: GrpoSection) -> set[str]:
        """The evaluation figures a run reports, that train.best_metric and tune.metric may rank by."""
        rewards = {f"eval_rewards/{reward_name(spec)}/mean" for spec in grpo.reward_funcs if self.samples_online}
        tasks = {metric_name(spec) for spec in eval.metrics} if self.scores_answers(eval) else set()
        return set(self.eval_figures) | rewards | tasks

    def scores_answers(self, eval: EvalSection) -> bool:
        """Whether its evaluations decode answers that eval.metrics score: GRPO's always (greedy answers to every
        eval prompt), the others' with eval.generation_rows."""
        return self.samples_online or bool(eval.generation_rows)

    def rows_per_batch(self, train: TrainSection, grpo: GrpoSection, workers: int) -> int:
        """Rows of the training data a rank takes at a time: a micro-batch's, or when it samples online the
        prompts of one batch of rollouts (the rank's completions of a step / grpo.num_generations)."""
        if self.samples_online:
            return train.global_batch_size // (workers * grpo.num_generations)
        return train.micro_batch_size


OBJECTIVES = {objective.name: objective for objective in (
    Objective("sft", None, "texts", "chats, instructions or text", "texts to learn",
              "data.long_records says", False, ("eval_loss", "eval_perplexity"), "eval_loss", side_by_side=True),
    Objective("dpo", "preference", "preference pairs", "records with prompt, chosen and rejected",
              "pairs to prefer one answer of", "a preference pair is truncated to data.max_seq_len (the prompt's end, "
              "the answers' starts)", False, ("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"),
              "eval_loss"),
    Objective("grpo", "prompt", "prompts", "records with a prompt and the fields the rewards read",
              "prompts to sample answers to", "a prompt is truncated to data.max_seq_len (its end kept)", True,
              ("eval_reward",), "eval_reward"),
)}


def objective_of(train: TrainSection) -> Objective:
    return OBJECTIVES[train.objective]


def reading(record_format: str) -> Objective | None:
    """The objective whose records have `record_format`, if one does."""
    return next((o for o in OBJECTIVES.values() if o.record_format == record_format), None)
