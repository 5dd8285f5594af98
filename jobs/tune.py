"""Sweep a fine-tuning config with Ray Tune: trials sampled from a search space, the ones behind stopped early.

    python -m jobs.tune --config jobs/configs/embedded.yaml \\
        --space 'train.learning_rate=loguniform(1e-4,3e-3)' --space 'lora.r=choice(8,16,32)' \\
        --num-samples 8 --scheduler asha [--metric eval_loss --mode min] [--set key=value ...]
    python -m jobs.tune --config C --resume SWEEP_NAME      (after Ctrl-C or `ray job stop`)

Each trial is a whole fine-tuning job (its own worker group, checkpoints and MLflow run, nested under the
sweep's run). The flags set the config's `tune:` section (docs/config.md), which a YAML file may hold too;
every value a trial may take is checked before the first trial starts. Locally this starts a Ray cluster of
its own; under `ray job submit` it joins that cluster. The last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import yaml

from app.config.loading import load_config
from app.config.schema import FinetuneConfig
from app.config.sections import RUN_NAME
from app.config.sweep_space import check_space
from app.errors import CommandParser, UserInputError, exit_code
from app.launch.console import quiet_driver_logging
from app.launch.grid_sweep import format_table
from app.logs import quiet_import_noise
from jobs.embedded import ensure_embedded

FLAGS = {"num_samples": int, "max_concurrent": int, "metric": str, "mode": str, "scheduler": str,
         "grace_period": int, "reduction_factor": float, "perturbation_interval": int, "quantile_fraction": float,
         "seed": int}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.tune", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="YAML config, e.g. jobs/configs/embedded.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set train.max_steps=50 (repeatable)")
    parser.add_argument("--space", action="append", default=[], metavar="KEY=DISTRIBUTION",
                        help="one key of the search space, e.g. 'lora.r=choice(8,16)' (repeatable; adds to tune.space)")
    for flag, kind in FLAGS.items():
        parser.add_argument(f"--{flag.replace('_', '-')}", type=kind, help=f"tune.{flag}")
    parser.add_argument("--perturb", action="append", metavar="KEY", help="tune.perturb: a key PBT may change")
    parser.add_argument("--synchronous", action="store_true", help="tune.synchronous: PBT's trials wait for each other")
    parser.add_argument("--name", help="the sweep's name (its folder, MLflow parent run); default tune-CONFIG-TIME")
    parser.add_argument("--resume", metavar="NAME", help="continue this stopped sweep (its recorded config)")
    parser.add_argument("--verbose", action="store_true", help="show Ray's own lines and Tune's progress table")
    parser.add_argument("--in-one-job", action="store_true", help="train the trials as adapters of one job over one "
                        "base (a space of keys an adapter sets: lora.r, lora.alpha, train.learning_rate, ...)")
    return parser.parse_args(argv)


def sweep_config(args: argparse.Namespace) -> FinetuneConfig:
    """The config with the flags as tune.* keys, --space added to the file's tune.space, checked whole."""
    overrides = list(args.overrides)
    overrides += [f"tune.{flag}={getattr(args, flag)}" for flag in FLAGS if getattr(args, flag) is not None]
    if args.perturb:
        overrides.append(f"tune.perturb={json.dumps(args.perturb)}")
    if args.synchronous:
        overrides.append("tune.synchronous=true")
    if args.space:
        space = file_space(args.config)
        for item in args.space:
            key, sep, distribution = item.partition("=")
            if not sep or not key.strip():
                raise UserInputError(f"--space {item}: expected KEY=DISTRIBUTION, e.g. --space 'lora.r=choice(8,16)'")
            space[key.strip()] = distribution.strip()
        overrides.append(f"tune.space={json.dumps(space)}")
    cfg = load_config(args.config, overrides)
    if not args.resume:
        check_space(cfg)
    return cfg


def file_space(config: str) -> dict:
    """The config file's tune.space, which --space adds to (a file that does not load fails in load_config)."""
    try:
        tune = (yaml.safe_load(Path(config).read_text(encoding="utf-8")) or {}).get("tune") or {}
        return dict(tune.get("space") or {})
    except (OSError, ValueError, AttributeError, yaml.YAMLError):
        return {}


def sweep_name(args: argparse.Namespace) -> str:
    name = args.resume or args.name or f"tune-{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    if not RUN_NAME.fullmatch(name) or ".." in name:
        raise UserInputError(f"--name {name}: use letters, digits and . _ - = , + only (it names a folder and a run)")
    return name


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    # `ray job stop` sends SIGTERM: stop as on Ctrl-C, where Ray Tune saves the sweep for --resume
    signal.signal(signal.SIGTERM, lambda signum, frame: signal.raise_signal(signal.SIGINT))
    return exit_code(lambda: tune_sweep(args))


def tune_sweep(args: argparse.Namespace) -> int:
    cfg, name = sweep_config(args), sweep_name(args)
    if args.in_one_job:
        return one_job_sweep(args, cfg, name)
    from app.launch.inputs import check_tracking_server, plan_files  # after the config is known good

    if args.resume and not cfg.output.run(name).exists("sweep.json"):
        raise UserInputError(f"--resume {name}: no sweep of that name under {cfg.train.output_dir}")
    if args.resume and not cfg.output.run(name).exists("tuner.pkl"):
        raise UserInputError(f"--resume {name}: it was stopped before Ray Tune saved its state; start it again "
                             "under another --name")
    if not args.resume:
        if cfg.output.run(name).exists():
            raise UserInputError(f"--name {name}: {cfg.output.run(name).root} exists; choose another name, or "
                                 f"--resume {name}")
        ensure_embedded(cfg)
        cfg = plan_files(cfg)[0].cfg  # a GGUF model's folder, a hub model's commit: what every trial reads
    check_tracking_server(cfg.mlflow.tracking_uri)
    if not args.verbose:
        quiet_driver_logging()
    from app.launch.tune_sweep import run_sweep  # imports Ray and Tune: only after the checks

    summary = run_sweep(cfg, name, resume=bool(args.resume), verbose=args.verbose)
    table = summary["trials_table"]
    print(format_table({column: [row[column] for row in table] for column in table[0]}) if table else "no trial "
          "reported", flush=True)
    print(json.dumps(summary), flush=True)
    if summary["status"] == "KILLED":
        print(f"sweep {name} was stopped; continue it with: python -m jobs.tune --config {args.config} "
              f"--resume {name}", file=sys.stderr, flush=True)
    return 1 if summary["status"] == "KILLED" or summary["trials_failed"] else 0


def one_job_sweep(args: argparse.Namespace, cfg: FinetuneConfig, name: str) -> int:
    """The trials as adapters of one finetune job named after the sweep; its JSON summary, the best adapter in it."""
    if args.resume:
        raise UserInputError(f"--resume {args.resume} --in-one-job: the sweep is one job; continue it with "
                             f"python -m jobs.finetune --config {args.config} --resume {args.resume} and the "
                             "adapters its run recorded (config/resolved.yaml in its MLflow run)")
    ensure_embedded(cfg)
    from app.launch.adapter_sweep import sweep_in_one_job  # imports Ray and Tune: only after the checks

    summary = sweep_in_one_job(cfg, name)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
