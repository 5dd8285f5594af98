"""Scores on lm-evaluation-harness tasks, by lm-eval's own Hugging Face backend on a base model and, if
given, a PEFT adapter on it: the field's standard metrics, not a copy of them.

Tasks are lm-eval's (hub tasks by name, where their data can be read) and those of the task folders given,
always including this project's own (`app/eval_tasks/tasks`: the embedded demo's spelling, generated and by
likelihood). Plain functions, no Ray: jobs/evaluate.py places them.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from app.config.paths import embedded_root
from app.errors import UserInputError, first_line
from app.model.adapter import peft_on_transformers_5

SHIPPED_TASKS = Path(__file__).parent / "tasks"


@dataclass(frozen=True)
class Evaluation:
    """What to score and how: the same settings give the same scores for any adapter on the same base."""

    tasks: list[str]
    include_paths: list[str] = field(default_factory=list)
    limit: float | None = None  # documents per task (a fraction below 1)
    num_fewshot: int | None = None
    batch_size: int = 8
    chat_template: bool | None = None  # None: when the tokenizer has one
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 1234
    metadata: dict = field(default_factory=dict)  # every task's metadata: e.g. embedded_data
    log_samples: bool = False  # keep each document's answers in the results (`samples`)


def task_metadata(base: str) -> dict:
    """What every task is told: where the embedded demo's data is, when the base is the embedded model."""
    root = embedded_root(base)
    return {"embedded_data": str(Path(root, "data").resolve())} if root else {}


def task_manager(evaluation: Evaluation):
    """lm-eval's TaskManager over the task folders, and over lm-eval's own tasks only when a task is not in
    them (indexing its thousands of YAMLs takes ~10 s); one per process for each set of folders."""
    folders, metadata = (str(SHIPPED_TASKS), *evaluation.include_paths), json.dumps(evaluation.metadata, sort_keys=True)
    local = _task_manager(folders, metadata, False)
    if all(task in local.all_tasks for task in evaluation.tasks):
        return local
    return _task_manager(folders, metadata, True)


@functools.lru_cache(maxsize=4)
def _task_manager(folders: tuple[str, ...], metadata: str, with_lm_evals_own: bool):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(folders), include_defaults=with_lm_evals_own, metadata=json.loads(metadata))


def check_tasks(evaluation: Evaluation, manager=None) -> None:
    """Every task (or group) is known, before any model loads."""
    manager = manager or task_manager(evaluation)
    unknown = [task for task in evaluation.tasks if task not in manager.all_tasks]
    if unknown:
        raise UserInputError(f"--tasks: {', '.join(unknown)} is not an lm-eval task here (known: lm-eval's own, "
                             f"those under {', '.join(map(str, [SHIPPED_TASKS, *evaluation.include_paths]))}); "
                             "check the name or give its folder with --include-path")


def uses_chat_template(evaluation: Evaluation, tokenizer_path: str) -> bool:
    if evaluation.chat_template is not None:
        return evaluation.chat_template
    from transformers import AutoTokenizer

    return bool(AutoTokenizer.from_pretrained(tokenizer_path).chat_template)


def run_harness(base: str, adapter: str | None, evaluation: Evaluation) -> dict:
    """lm-eval's results (its JSON: `results`, `configs`, `versions`, `n-samples`...) for `base` with `adapter`.
    The tokenizer is the adapter's where it carries one (a run saves its own), else the base's."""
    from lm_eval import simple_evaluate

    tokenizer = adapter if adapter and (Path(adapter) / "tokenizer_config.json").exists() else base
    model_args = {"pretrained": base, "tokenizer": tokenizer, "dtype": evaluation.dtype, "device": evaluation.device,
                  "trust_remote_code": False, **({"peft": adapter} if adapter else {})}
    manager = task_manager(evaluation)
    check_tasks(evaluation, manager)
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on every custom task
    try:
        with peft_on_transformers_5():
            results = simple_evaluate(
                model="hf", model_args=model_args, tasks=list(evaluation.tasks), task_manager=manager,
                apply_chat_template=uses_chat_template(evaluation, tokenizer), limit=evaluation.limit,
                num_fewshot=evaluation.num_fewshot, batch_size=evaluation.batch_size,
                log_samples=evaluation.log_samples, random_seed=evaluation.seed, numpy_random_seed=evaluation.seed,
                torch_random_seed=evaluation.seed, fewshot_random_seed=evaluation.seed)
    except (OSError, ValueError, ConnectionError) as e:  # a hub task's data that cannot be read here, mostly
        raise UserInputError(f"lm-eval on {', '.join(evaluation.tasks)}: {first_line(e, 300)}") from None
    return results


def scores(results: dict) -> dict[str, float]:
    """The results as `lm_eval/<task>/<metric>` figures (a filter other than lm-eval's `none` appended to the
    metric with a dot), their standard errors included: MLflow metric names, and what jobs.promote compares."""
    figures = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, kept = key.partition(",")
            if isinstance(value, bool) or not isinstance(value, int | float) or metric == "sample_len":
                continue  # the alias, "N/A" where lm-eval has no standard error, the documents' count
            figures[f"lm_eval/{task}/{metric if kept in ('', 'none') else f'{metric}.{kept}'}"] = float(value)
    return figures
