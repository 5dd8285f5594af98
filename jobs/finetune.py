"""Fine-tune a causal LM with LoRA + FSDP2 on Ray Train.

    python -m jobs.finetune --config jobs/configs/embedded.yaml [--set key=value ...]

Locally this starts a Ray cluster of its own; under `ray job submit` (or with RAY_ADDRESS set) it
joins that cluster. The last line printed is a JSON summary of the run. Ray's own bookkeeping lines
are hidden unless --verbose.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

from app.config.loading import load_config
from app.config.paths import why_unwritable
from app.errors import CommandParser, UserInputError, exit_code
from app.launch.console import quiet_driver_logging
from app.logs import quiet_import_noise
from jobs.embedded import ensure_embedded


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.finetune", description=__doc__.split("\n")[1])
    parser.add_argument("--config", required=True, help="YAML config, e.g. jobs/configs/embedded.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override one config key, e.g. --set train.max_steps=50 (repeatable)")
    parser.add_argument("--resume", metavar="RUN_NAME",
                        help="continue this run (under train.output_dir) from its latest checkpoint")
    parser.add_argument("--verbose", action="store_true", help="show Ray's own start-up and bookkeeping lines")
    return parser.parse_args(argv)


def _stop_on_sigterm(signum, frame) -> None:
    """`ray job stop` sends SIGTERM: unwind like Ctrl-C, so the MLflow run is ended KILLED."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    return exit_code(lambda: finetune(args))


def finetune(args: argparse.Namespace) -> int:
    overrides = args.overrides + ([f"train.run_name={args.resume}"] if args.resume else [])
    cfg = load_config(args.config, overrides)
    problem = why_unwritable(Path(cfg.train.output_dir)) if cfg.output.is_local else None
    if problem:
        raise UserInputError(f"train.output_dir={cfg.train.output_dir}: {problem}; choose a directory this job "
                             "can write to")
    ensure_embedded(cfg)  # the demo's model and data, on first use
    if not args.verbose:
        quiet_driver_logging()
    from app.launch.driver import run_finetune  # imports Ray: only after the config is known good

    if os.environ.get("HF_TOKEN"):
        print("hub token: HF_TOKEN is set (its value is never logged)", file=sys.stderr, flush=True)

    import psutil

    summary = run_finetune(cfg, resume=bool(args.resume), verbose=args.verbose,
                           started_at=psutil.Process().create_time())  # the timeline from the command
    import ray

    ray.shutdown()  # Ray prints what workers wrote until it disconnects: the summary comes after all of it
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
