"""Send a run's kept records to MLflow once the tracking server is back.

    python -m jobs.sync RUN_NAME [--config jobs/configs/embedded.yaml] [--set train.output_dir=...]

The run directory is found the way the job found it (train.output_dir of the config, `$FINETUNE_STORAGE`
in a job). On a cluster, run it where that storage is: `python -m jobs.submit sync RUN_NAME` submits
this command as a job. Prints what was sent as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys

from app.config.loading import load_config
from app.config.paths import export_tracking_credentials
from app.errors import CommandParser, exit_code
from app.logs import quiet_import_noise
from app.tracking.journal import Journal
from app.tracking.logger import bound_http_calls


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.sync", description=__doc__.split("\n")[0])
    parser.add_argument("run_name")
    parser.add_argument("--config", default="jobs/configs/embedded.yaml", help="the config the run was started with")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    return exit_code(lambda: sync(args.run_name, args.config, args.overrides))


def sync(run_name: str, config: str, overrides: list[str]) -> int:
    cfg = load_config(config, [*overrides, f"train.run_name={run_name}"])
    export_tracking_credentials()
    bound_http_calls()
    sent = Journal(cfg.run_dir).sync(cfg.mlflow.tracking_uri)
    print(json.dumps({"run_dir": cfg.run_dir.root, "tracking_uri": cfg.mlflow.tracking_uri, "sent": sent}))
    return 0

if __name__ == "__main__":
    sys.exit(main())
