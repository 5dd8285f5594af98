"""Promote a registered adapter version to the alias in service when it scores better than the one there.

    python -m jobs.promote NAME --candidate VERSION --metric TASK/METRIC [--min-gain X] [--alias champion]
                           [--tasks TASK,...] [--limit N] [--include-path DIR] ...

Both the candidate and the version behind `@ALIAS` (default `champion`) are scored by jobs.evaluate's harness
with the same settings (the metric's task unless --tasks names more); the alias moves to the candidate only
when it wins by at least --min-gain in the metric's better direction (lm-eval's `higher_is_better`). With no
champion yet, the candidate becomes it. Both scores and the decision are recorded on the versions (tags
`promotion.*`, `lm_eval/...`) and their runs. Exit code 0: promoted (or already the champion); 3: not
promoted, the reason in one line; 2: a mistake in the arguments. A server following the alias
(`jobs.serve --adapter NAME=models:/NAME@champion`) picks the new version up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from mlflow.exceptions import MlflowException

from app.errors import CommandParser, UserInputError, exit_code
from app.eval_tasks.promotion import NOT_PROMOTED, decide
from app.logs import quiet_import_noise
from jobs.evaluate import add_evaluation_arguments, evaluate, print_scores, tracking_client


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.promote", description=__doc__.split("\n")[0])
    parser.add_argument("name", help="the registered model (mlflow.registered_model of the runs)")
    parser.add_argument("--candidate", required=True, help="the version to promote")
    parser.add_argument("--metric", required=True, metavar="TASK/METRIC", help="e.g. embedded_spelling/exact_match")
    parser.add_argument("--min-gain", type=float, default=0.0, help="the least improvement that promotes")
    parser.add_argument("--alias", default="champion", help="the alias in service")
    add_evaluation_arguments(parser, tasks_required=False)
    args = parser.parse_args(argv)
    task, slash, metric = args.metric.partition("/")
    if not slash or not task or not metric:
        parser.error(f"--metric {args.metric}: expected TASK/METRIC, e.g. embedded_spelling/exact_match")
    if not args.candidate.isdigit():
        parser.error(f"--candidate {args.candidate}: a version number")
    args.tasks = args.tasks or task
    return args


def champion_version(client, name: str, alias: str) -> str | None:
    """The version behind the alias; None while the model has none there."""
    version = client.get_registered_model(name).aliases.get(alias)
    return None if version is None else str(version)


def promote(args: argparse.Namespace) -> int:
    client = tracking_client(args.output_dir)
    try:
        client.get_model_version(args.name, args.candidate)
        champion = champion_version(client, args.name, args.alias)
    except MlflowException as e:
        raise UserInputError(f"{args.name} version {args.candidate}: {str(e).splitlines()[0][:200]}") from None
    if champion == args.candidate:
        print(f"version {args.candidate} of {args.name} is @{args.alias} already")
        return 0
    key = f"lm_eval/{args.metric}"
    scored = {version: evaluate(client, f"models:/{args.name}/{version}", None, args)
              for version in (args.candidate, champion) if version is not None}
    for version, done in scored.items():
        if key not in done["scores"]:
            raise UserInputError(f"--metric {args.metric}: not among the scores of version {version} "
                                 f"({', '.join(k.removeprefix('lm_eval/') for k in done['scores'])})")
        print(f"version {version}:")
        print_scores(done)
    task, metric = args.metric.split("/", 1)
    higher = scored[args.candidate]["higher_is_better"].get(task, {}).get(metric.split(".")[0], True)
    decision = decide(key, scored[args.candidate]["scores"][key], champion and scored[champion]["scores"][key],
                      args.min_gain, higher, (f"version {args.candidate}", f"@{args.alias} (version {champion})"))
    record(client, args, champion, decision, scored, key)
    print(decision.reason)
    print(json.dumps({"promoted": decision.promote, "candidate": args.candidate, "champion_before": champion,
                      "metric": key, "scores": {v: done["scores"][key] for v, done in scored.items()}}))
    return 0 if decision.promote else NOT_PROMOTED


def record(client, args: argparse.Namespace, champion: str | None, decision, scored: dict, key: str) -> None:
    """The decision on the candidate's version (and the replaced champion's), then the alias move."""
    tags = {"promotion.decision": "promoted" if decision.promote else "not promoted",
            "promotion.reason": decision.reason[:5000], "promotion.metric": key,
            "promotion.alias": args.alias, "promotion.min_gain": str(args.min_gain),
            "promotion.champion_version": champion or "none",
            "promotion.time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    for name, value in tags.items():
        client.set_model_version_tag(args.name, args.candidate, name, value)
    if decision.promote:
        client.set_registered_model_alias(args.name, args.alias, args.candidate)
        if champion is not None:
            client.set_model_version_tag(args.name, champion, "promotion.replaced_by", args.candidate)


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    return exit_code(lambda: promote(args))


if __name__ == "__main__":
    sys.exit(main())
