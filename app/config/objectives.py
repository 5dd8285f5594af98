"""The table of training objectives: one row per `train.objective`, keyed by its name. A row says what the
objective is to the config and the driver: the section that holds its settings, the records it reads, what its
batch counts, the figures its evaluations report and the one it ranks by, whether it samples answers online (a
rollout group beside the workers, the rollout section), whether reward functions or a teacher score them, and the
name of its class on the workers (app/train/objectives.py: its loss and its evaluation). Everything that differs by
`train.objective` asks its row here; a name without a row is an error, never a fallback (docs/design.md, "Adding a
method": one module and one row)."""

from __future__ import annotations

from dataclasses import dataclass

from app.config.grpo import GrpoSection, reward_name
from app.config.rollout import RolloutSection
from app.config.sections import EvalSection, TrainSection, metric_name

LOWER_IS_BETTER = ("eval_loss", "eval_perplexity")  # every other figure ranks higher first


@dataclass(frozen=True)
class Objective:
    name: str  # train.objective
    section: str | None  # the config section of its own settings ("dpo"); None: none
    trainer: str  # its class on the workers, in app/train/objectives.py
    record_format: str | None  # the data.format its records must have ("preference", "prompt"); None: any text
    records: str  # what they are, in its errors: "preference pairs"
    fields: str  # what each holds: "records with prompt, chosen and rejected"
    use: str  # what the objective does with them: "pairs to prefer one answer of"
    truncation: str  # what data.max_seq_len cuts from one
    eval_figures: tuple[str, ...]  # what each evaluation reports before task metrics and reward means
    best_metric: str  # train.best_metric's default
    samples_online: bool = False  # a rollout group samples answers to its prompts every step (the rollout section)
    rewarded: bool = False  # reward functions (grpo.reward_funcs) score the sampled answers
    taught: bool = False  # a teacher (distill.teacher_adapter) scores every token of them
    side_by_side: bool = False  # several adapters (`adapters:`) may train in one job over one base

    def reported_figures(self, eval: EvalSection, grpo: GrpoSection) -> set[str]:
        """The evaluation figures a run reports, that train.best_metric and tune.metric may rank by."""
        rewards = {f"eval_rewards/{reward_name(spec)}/mean" for spec in grpo.reward_funcs if self.rewarded}
        tasks = {metric_name(spec) for spec in eval.metrics} if self.scores_answers(eval) else set()
        return set(self.eval_figures) | rewards | tasks

    def scores_answers(self, eval: EvalSection) -> bool:
        """Whether its evaluations decode answers that eval.metrics score: an online objective's always (greedy
        answers to every eval prompt), the others' with eval.generation_rows."""
        return self.samples_online or bool(eval.generation_rows)

    def rows_per_batch(self, train: TrainSection, rollout: RolloutSection, workers: int) -> int:
        """Rows of the training data a rank takes at a time: a micro-batch's, or when it samples online the
        prompts of one batch of rollouts (the rank's completions of a step / rollout.num_generations)."""
        if self.samples_online:
            return train.global_batch_size // (workers * rollout.num_generations)
        return train.micro_batch_size


PROMPT_TRUNCATION = "a prompt is truncated to data.max_seq_len (its end kept)"

OBJECTIVES = {objective.name: objective for objective in (
    Objective(name="sft", section=None, trainer="NextToken", record_format=None, records="texts",
              fields="chats, instructions or text", use="texts to learn", truncation="data.long_records says",
              eval_figures=("eval_loss", "eval_perplexity"), best_metric="eval_loss", side_by_side=True),
    Objective(name="dpo", section="dpo", trainer="Preference", record_format="preference", records="preference pairs",
              fields="records with prompt, chosen and rejected", use="pairs to prefer one answer of",
              truncation="a preference pair is truncated to data.max_seq_len (the prompt's end, the answers' starts)",
              eval_figures=("eval_loss", "eval_rewards/accuracies", "eval_rewards/margins"), best_metric="eval_loss"),
    Objective(name="grpo", section="grpo", trainer="GroupRelative", record_format="prompt", records="prompts",
              fields="records with a prompt and the fields the rewards read", use="prompts to sample answers to",
              truncation=PROMPT_TRUNCATION, eval_figures=("eval_reward",), best_metric="eval_reward",
              samples_online=True, rewarded=True),
    Objective(name="distill", section="distill", trainer="Distillation", record_format="prompt", records="prompts",
              fields="records with a prompt", use="prompts for the student to answer", truncation=PROMPT_TRUNCATION,
              eval_figures=("eval_loss",), best_metric="eval_loss", samples_online=True, taught=True),
)}


def objective_of(train: TrainSection) -> Objective:
    """train.objective's row (TrainSection admits no name without one: tests/unit/config/test_objectives.py)."""
    return OBJECTIVES[train.objective]


def reading(record_format: str) -> Objective | None:
    """The first objective whose records have `record_format`, if one does."""
    return next((o for o in OBJECTIVES.values() if o.record_format == record_format), None)
