"""reasoning-gym tasks as lm-evaluation-harness tasks, so that a run's held-out figure, `jobs.evaluate` and
`jobs.promote` use one measure: the task's own `score_answer` of the answer a greedy generation gives (its
<answer> tag, else its last number for a numeric task: app.data.gym_tasks, as the GRPO reward reads it).

In `--tasks` and `train.eval_tasks` a task is named by its data source's own words,
`rg://TASK?size=N&seed=S&param=value...` (the same problems as a run's data.eval_path), or `rg_TASK`
(reasoning-gym's default parameters, 64 problems, seed 1000). Either is scored as the lm-eval task `rg_TASK`
(its figure: lm_eval/rg_TASK/score). Its problems are generated here (as a data source's are), and its YAML
written into a folder keyed by the specs, with a one-line module lm-eval's `!function` finds beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from app.config.paths import input_path
from app.data.gym_tasks import SCHEME, parse_spec, score_answer, write_task_source
from app.errors import UserInputError
from app.eval_tasks.harness import Evaluation

PREFIX = "rg_"
DEFAULT_PROBLEMS = "size=64&seed=1000"
FOLDER = ".cache/lm_eval_tasks"
MAX_ANSWER_TOKENS = 48
MODULE = "from app.eval_tasks.gym_lm_eval import problems, process_results  # noqa: F401\n"


def gym_spec(task: str) -> str | None:
    """The rg:// source a --tasks entry names (`rg_TASK`: reasoning-gym's defaults), or None for any other task."""
    if task.startswith(SCHEME):
        return task
    return f"{SCHEME}{task.removeprefix(PREFIX)}?{DEFAULT_PROBLEMS}" if task.startswith(PREFIX) else None


def task_yaml(name: str, problems_file: str) -> str:
    return "\n".join([
        f"task: {name}", "custom_dataset: !function gym_data.problems", "dataset_kwargs:",
        f"  file: {json.dumps(problems_file)}", "test_split: test", "output_type: generate_until",
        'doc_to_text: "{{question}}"', "doc_to_target: answer", "generation_kwargs:", "  until: []",
        f"  max_gen_toks: {MAX_ANSWER_TOKENS}", "  do_sample: false", "  temperature: 0.0",
        "process_results: !function gym_data.process_results", "metric_list:", "  - metric: score",
        "    aggregation: mean", "    higher_is_better: true", "metadata:", "  version: 1.0", ""])


def write_new(path: Path, text: str) -> None:
    """Write a file that readers may open at any time (sweep trials scoring at once): in full, by a rename."""
    if not path.is_file() or path.read_text() != text:
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        partial.write_text(text)
        os.rename(partial, path)


def with_gym_tasks(evaluation: Evaluation, key: str = "--tasks", folder: str | None = None) -> Evaluation:
    """The evaluation with its reasoning-gym tasks written as lm-eval tasks (named rg_TASK) in a folder it
    includes, their problems generated here (where the paths of a job resolve: an lm-eval task on a GPU node
    reads the file); unchanged where it names none. One line naming `key` where a spec is wrong."""
    specs = {task: gym_spec(task) for task in evaluation.tasks}
    if not any(specs.values()):
        return evaluation
    names = {task: f"{PREFIX}{parse_spec(spec, key).name}" for task, spec in specs.items() if spec}
    if len(set(names.values())) < len(names):
        raise UserInputError(f"{key}: {', '.join(names)} name one reasoning-gym task more than once (each is scored "
                             "as the lm-eval task rg_TASK); score them in separate evaluations")
    digest = hashlib.sha256(json.dumps(sorted(names.items())).encode()).hexdigest()[:12]
    where = Path(folder or input_path(FOLDER)) / digest
    where.mkdir(parents=True, exist_ok=True)
    write_new(where / "gym_data.py", MODULE)
    for task, name in names.items():
        write_new(where / f"{name}.yaml", task_yaml(name, str(write_task_source(specs[task], key).resolve())))
    return dataclasses.replace(evaluation, tasks=[names.get(task, task) for task in evaluation.tasks],
                               include_paths=[*evaluation.include_paths, str(where)])


def problems(file: str, **_):
    """lm-eval's custom_dataset: a task source's generated problems, as documents {question, answer, task,
    metadata}."""
    import datasets  # start-up: lm-eval has loaded it by the time it asks

    rows = [json.loads(line) for line in Path(file).read_text().splitlines() if line]
    docs = [{"question": r["prompt"][0]["content"], "answer": r["answer"], "task": r["task"],
             "metadata": r["metadata"]} for r in rows]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval's process_results: the task's own score of the answer the generation gives."""
    return {"score": score_answer(results, [doc["answer"]], [doc["task"]], [doc["metadata"]])[0]}
