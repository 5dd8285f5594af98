"""Score an adapter (or a base alone) on lm-evaluation-harness tasks and record the scores in MLflow.

    python -m jobs.evaluate --adapter SOURCE --tasks TASK[,TASK...] [--include-path DIR] [--limit N]
    python -m jobs.evaluate --base PATH --tasks ...          # the base model alone

SOURCE is a run name under --output-dir, an adapter folder, models:/NAME/VERSION or models:/NAME@ALIAS. The
tasks are lm-eval's (hub tasks where their data can be read) and those in the folders given; this project's
`embedded_spelling` (generated, exact match) and `embedded_spelling_choice` (the right spelling against a near
miss, by likelihood) are always there. lm-eval's own Hugging Face backend scores the base with the PEFT adapter:
as a one-GPU Ray task on a cluster with GPUs, in this process otherwise. The scores go to the adapter's MLflow
run as `lm_eval/<task>/<metric>` with lm-eval's results JSON as `lm_eval/results.json` (a registered version
is tagged with them too); an adapter without a run gets a run in the `evaluations` experiment. Prints a line per
figure, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from app.config.loading import resolve_tracking_uri
from app.config.paths import export_credentials
from app.errors import CommandParser, UserInputError, exit_code
from app.eval_tasks.gym_lm_eval import with_gym_tasks
from app.eval_tasks.harness import Evaluation, check_tasks, task_metadata
from app.logs import quiet_import_noise
from app.model.gguf import dequantized_folder
from app.runs.layout import OutputDir


def add_evaluation_arguments(parser: argparse.ArgumentParser, tasks_required: bool = True) -> None:
    """The settings an evaluation is run with (shared with jobs.promote: both sides scored alike)."""
    parser.add_argument("--tasks", required=tasks_required, help="lm-eval tasks or groups, comma-separated")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a folder of lm-eval task YAMLs (repeatable)")
    parser.add_argument("--limit", type=float, help="documents per task (below 1: a fraction of them)")
    parser.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: each task's)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                        help="render prompts with the tokenizer's chat template (auto: when it has one)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--output-dir", default=os.environ.get("FINETUNE_STORAGE", "outputs"),
                        help="where run names and the local MLflow store are (train.output_dir)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.evaluate", description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", metavar="SOURCE", help="a run name, adapter folder or registered version")
    parser.add_argument("--base", help="the base model, a folder or a .gguf file (default: the one the adapter was "
                        "trained on)")
    add_evaluation_arguments(parser)
    args = parser.parse_args(argv)
    if args.adapter is None and args.base is None:
        parser.error("give --adapter SOURCE, or --base PATH to score a base model alone")
    return args


def evaluation_of(args: argparse.Namespace, base: str) -> Evaluation:
    """The settings, checked: every task known, every folder there, numbers in range."""
    for folder in args.include_path:
        if not Path(folder).is_dir():
            raise UserInputError(f"--include-path {folder}: not a folder")
    if args.limit is not None and not args.limit > 0:
        raise UserInputError(f"--limit {args.limit}: must be positive")
    if args.batch_size < 1 or (args.num_fewshot is not None and args.num_fewshot < 0):
        raise UserInputError("--batch-size must be positive and --num-fewshot 0 or more")
    evaluation = Evaluation(
        tasks=[task.strip() for task in args.tasks.split(",") if task.strip()], include_paths=args.include_path,
        limit=int(args.limit) if args.limit and args.limit >= 1 else args.limit, num_fewshot=args.num_fewshot,
        batch_size=args.batch_size, chat_template={"auto": None, "on": True, "off": False}[args.chat_template],
        seed=args.seed, metadata=task_metadata(base))
    evaluation = with_gym_tasks(evaluation)
    check_tasks(evaluation)
    return evaluation


def tracking_client(output_dir: str):
    """MLflow's client on $MLFLOW_TRACKING_URI, else the local store under the output directory (also set as
    MLflow's URI in this process: registered versions download through it)."""
    from mlflow.tracking import MlflowClient

    uri = resolve_tracking_uri(None, OutputDir(output_dir if "://" in output_dir else os.path.abspath(output_dir)))
    os.environ["MLFLOW_TRACKING_URI"] = export_credentials(os.environ.get("MLFLOW_TRACKING_URI", uri))
    return MlflowClient(uri)


def evaluate(client, source: str | None, base: str | None, args: argparse.Namespace) -> dict:
    """Score one adapter (None: `base` alone) and record it: {source, version, run_id, scores, where}."""
    from app.eval_tasks.harness import scores
    from app.launch.eval_tasks import evaluate_where_it_fits
    from app.tracking.task_scores import record_scores, resolve

    try:
        evaluated = resolve(client, source, args.output_dir, base)
    except ValueError as e:
        raise UserInputError(str(e)) from None
    evaluation = evaluation_of(args, evaluated.base)
    located = None if evaluated.folder is None else str(evaluated.folder.resolve())  # also where a GPU task runs
    if evaluated.version:
        located = "models:/{}/{}".format(*evaluated.version)  # downloaded where the task runs
    results, where = evaluate_where_it_fits(evaluated.base, located, args.output_dir, evaluation)
    figures = scores(results)
    run_id = record_scores(client, evaluated, figures, results)
    return {"source": source or evaluated.base, "version": evaluated.version and evaluated.version[1],
            "run_id": run_id, "scores": figures, "higher_is_better": results.get("higher_is_better", {}),
            "where": where}


def print_scores(done: dict) -> None:
    for key, value in done["scores"].items():
        if not key.endswith("_stderr"):
            error = done["scores"].get(f"{key}_stderr")
            print(f"{key} {value:.4f}" + (f" (± {error:.4f})" if error else ""))


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)

    def evaluate_and_print() -> int:
        client = tracking_client(args.output_dir)
        done = evaluate(client, args.adapter, args.base and dequantized_folder(args.base, key="--base"), args)
        print_scores(done)
        print(json.dumps({k: v for k, v in done.items() if k != "higher_is_better"}))
        return 0

    return exit_code(evaluate_and_print)


if __name__ == "__main__":
    sys.exit(main())
