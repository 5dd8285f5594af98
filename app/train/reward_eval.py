"""A policy evaluated by its answers (online objectives): greedy answers to the eval prompts, decoded by every
rank in lockstep (app/train/generation.py), each rank scoring its share with the reward functions (GRPO) and the task
metrics (against the record's eval.reference_column), gathered on every rank: eval_reward,
eval_rewards/<function>/mean, eval_<task metric>, and the table of prompts, answers and their rewards."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from app.config.grpo import reward_name
from app.config.sections import metric_name
from app.data.chat import pad_id
from app.engine.sequence import end_token_ids
from app.train.generation import all_ranks_done, greedy_batch
from app.train.host_memory import release_free_host_memory
from app.train.rewards import combined
from app.train.rollouts import Scorer, as_answers, reward_columns
from app.train.task_metrics import row_scores


def eval_prompts(batches: Iterable[dict]) -> tuple[list[torch.Tensor], list[dict]]:
    """The eval rows' prompt ids and records."""
    prompts, records = [], []
    for batch in batches:
        for ids, length, record in zip(batch["prompt_input_ids"], batch["prompt_length"].tolist(), batch["record"]):
            prompts.append(torch.as_tensor(ids)[:length].cpu())
            records.append(json.loads(record))
    return prompts, records


def evaluate_rewards(model, eval_pass: Callable[[], Iterable], tokenizer, device: torch.device, scorer: Scorer | None,
                     grpo, rollout, eval_cfg) -> tuple[dict[str, float], dict[str, list]]:
    """(the figures, the table of every eval prompt's greedy answer and its scores), the same on every rank."""
    mine, records, _, answers = greedy_eval_answers(model, eval_pass, tokenizer, device, rollout.max_completion_tokens)
    return scored_table(mine, records, answers, tokenizer, scorer, grpo, eval_cfg)


def greedy_eval_answers(model, eval_pass: Callable[[], Iterable], tokenizer, device: torch.device,
                        max_tokens: int) -> tuple[list[int], list[dict], list[torch.Tensor], list[torch.Tensor]]:
    """This rank's share of the eval prompts (their indices, records and ids) and their greedy answers (each with
    its end token), decoded by every rank in lockstep; a rank with no prompt decodes a stand-in (the first)."""
    prompts, records = eval_prompts(eval_pass())
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(range(rank, len(prompts), world))
    batch = [prompts[i] for i in mine] or [prompts[0]]
    was_training = model.training
    model.eval()
    ends = end_token_ids(getattr(model, "generation_config", None), tokenizer)
    answers = greedy_batch(model, batch, max_tokens, ends, pad_id(tokenizer), device,
                           lambda done: all_ranks_done(done, device))
    model.train(was_training)
    release_free_host_memory()
    return mine, [records[i] for i in mine], batch, answers


def scored_table(mine: list[int], records: list[dict], answers: list[torch.Tensor], tokenizer, scorer: Scorer | None,
                 grpo, eval_cfg) -> tuple[dict[str, float], dict[str, list]]:
    """Every rank's answers scored (rewards with a scorer, task metrics) and gathered: (the figures, the table)."""
    rows = score_rows(records, answers[:len(mine)], tokenizer, scorer, grpo, eval_cfg, mine)
    gathered: list[list | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    table_rows = sorted((row for part in gathered for row in part), key=lambda row: row["index"])
    return eval_figures(table_rows, grpo if scorer else None, eval_cfg), {
        column: [row[column] for row in table_rows] for column in table_rows[0] if column != "index"}


def score_rows(records: list[dict], answers: list[torch.Tensor], tokenizer, scorer: Scorer | None, grpo, eval_cfg,
               indices: list[int]) -> list[dict]:
    """One table row per answer: the prompt, the answer, its reward and each function's (with a scorer), each task
    metric's."""
    if not records:
        return []
    texts = tokenizer.batch_decode([a.tolist() for a in answers], skip_special_tokens=True)
    rewards = reward_rows(records, answers, texts, scorer, grpo, indices[0]) if scorer else [{} for _ in records]
    references = [r.get(eval_cfg.reference_column) for r in records]
    tasks = row_scores(texts, [str(ref) for ref in references], eval_cfg.metrics) if None not in references else {}
    rows = []
    for i, (index, record, text) in enumerate(zip(indices, records, texts)):
        prompt = record["prompt"] if isinstance(record["prompt"], str) else json.dumps(record["prompt"])
        rows.append({"index": index, "prompt": prompt, "completion": text} | rewards[i]
                    | {name: scores[i] for name, scores in tasks.items()})
    return rows


def reward_rows(records: list[dict], answers: list[torch.Tensor], texts: list[str], scorer: Scorer, grpo,
                first: int) -> list[dict]:
    """Each answer's reward and each function's."""
    per_function = scorer([r["prompt"] for r in records], as_answers(texts, records), [a.tolist() for a in answers],
                          reward_columns(records), first)
    reward = combined(per_function, grpo.weights)
    return [{"reward": _float(reward[i])} | {reward_name(s): _float(per_function[i, k])
                                             for k, s in enumerate(grpo.reward_funcs)} for i in range(len(records))]


def eval_figures(rows: list[dict], grpo, eval_cfg) -> dict[str, float]:
    """The means over the table's answers (each function's over the answers it applied to; rewards where `grpo`
    scored them)."""
    figures = {"eval_reward": _mean([row["reward"] for row in rows])} if grpo else {}
    for spec in grpo.reward_funcs if grpo else ():
        figures[f"eval_rewards/{reward_name(spec)}/mean"] = _mean([row[reward_name(spec)] for row in rows])
    for spec in eval_cfg.metrics:
        name = metric_name(spec).removeprefix("eval_")
        if rows and name in rows[0]:
            figures[f"eval_{name}"] = _mean([row[name] for row in rows])
    return figures


def _float(value) -> float | None:
    return None if np.isnan(value) else float(value)


def _mean(values: list) -> float:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else float("nan")
