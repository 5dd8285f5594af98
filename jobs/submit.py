"""Drive fine-tuning jobs on a Ray cluster through the Ray Jobs API.

    python -m jobs.submit submit --config jobs/configs/embedded.yaml [--set k=v ...] [--follow]
    python -m jobs.submit list | status JOB | logs JOB [--follow] | stop JOB
    python -m jobs.submit sweep --config C --grid train.learning_rate=1e-3,3e-3 [--grid lora.r=4,8]
    python -m jobs.submit tune [--follow] -- --config C --space 'lora.r=choice(8,16)' [jobs.tune's flags]
    python -m jobs.submit sync RUN_NAME --config C    (after an MLflow outage: send what the run kept)

The cluster is --address (default $RAY_API_SERVER_ADDRESS, $RAY_ADDRESS, or http://127.0.0.1:8265);
with Ray's token authentication on, export RAY_AUTH_MODE=token (the token comes from
$RAY_AUTH_TOKEN or ~/.ray/auth_token, as for the `ray` CLI). Every job's runtime environment is
--runtime-env (default jobs/runtime_env.yaml) with this directory as its working directory. Configs
are validated here, before anything is submitted. A job's submission id is its run name, which is
also its MLflow run name and its directory under train.output_dir.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from app.config.loading import load_config
from app.config.paths import export_credentials
from app.errors import CommandParser, UserInputError, exit_code, first_line
from app.launch.grid_sweep import format_table, grid_points, parse_grid, point_name, point_overrides, results_table
from app.logs import quiet_import_noise
from jobs.tune import parse_args as parse_tune_args
from jobs.tune import sweep_config, sweep_name

TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
SECRET_KEY = re.compile(r"(^|[._-])(password|passwd|secret|token|api_?key|access_key|credentials?)$", re.I)
SECRET_VALUE = re.compile(
    r"[a-z][a-z0-9+.-]*://[^/\s@]+@"  # user[:password]@ in a URI
    r"|\b(hf_[a-z0-9]{30,}|gh[pousr]_[a-z0-9]{30,}|github_pat_\w{30,}|sk-[\w-]{20,}|akia[0-9a-z]{16})\b"  # tokens
    r"|\b(password|passwd|secret|token|api_?key)=",  # a secret in a query string
    re.I)


def job_client(address: str | None):
    from ray.job_submission import JobSubmissionClient

    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") \
        or "http://127.0.0.1:8265"
    try:
        return JobSubmissionClient(address)
    except Exception as e:  # connection refused, 401/403 without a token, ...
        raise UserInputError(f"--address {address}: cannot reach the Ray Jobs API ({first_line(e)}); "
                             "is the cluster up, and RAY_AUTH_MODE=token exported?") from None


def runtime_env(path: str) -> dict:
    if not Path(path).is_file():
        raise UserInputError(f"--runtime-env {path}: no such file; the shipped one is jobs/runtime_env.yaml")
    try:
        env = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise UserInputError(f"--runtime-env {path}: not valid YAML or JSON ({first_line(e)})") from None
    if not isinstance(env, dict) or not isinstance(env.get("env_vars") or {}, dict):
        raise UserInputError(f"--runtime-env {path}: must be a mapping of Ray runtime_env fields (env_vars: a "
                             "mapping NAME: value, excludes:, ...), as jobs/runtime_env.yaml is")
    return {"working_dir": ".", **env}


def refuse_secrets(items: list[str], flag: str = "--set") -> None:
    """A job's entrypoint is shown to anyone who can list jobs: no credentials may travel in it (nor be
    printed here: the message names the key, never the value)."""
    for number, item in enumerate(items, 1):
        key = item.partition("=")[0].strip()
        if SECRET_KEY.search(key) or SECRET_VALUE.search(item):
            name = key if re.fullmatch(r"[\w.]+", key) else f"#{number}"
            raise UserInputError(f"{flag} {name}: it holds credentials, which would be visible in the job's "
                                 "entrypoint; keep secrets in the cluster's environment instead (MLFLOW_TRACKING_URI, "
                                 "HF_TOKEN, ...: cluster/local-up.sh, the k8s Secret)")


def run_job(config: str, overrides: list[str], env: dict, resume: str | None = None, run_name: str | None = None,
            metadata: dict[str, str] | None = None) -> dict:
    """One fine-tuning job, its config validated here: the keyword arguments of `submit_job`."""
    refuse_secrets(overrides)
    if resume:
        overrides = [*overrides, f"train.run_name={resume}"]
    elif run_name:
        overrides = [*overrides, f"train.run_name={run_name}"]
    cfg = load_config(config, overrides)  # a typo fails here, not on the cluster
    if not resume and not run_name:  # pin the generated name: the job must use the same one
        overrides = [*overrides, f"train.run_name={cfg.train.run_name}"]
    command = ["python", "-m", "jobs.finetune", "--config", config]
    for item in overrides:
        command += ["--set", item]
    if resume:
        command += ["--resume", resume]
    submission_id = cfg.train.run_name if not resume else f"{resume}-resume-{time.strftime('%Y%m%d-%H%M%S')}"
    from app.tracking.mlflow_run import git_commit  # MLflow (seconds) only for the commands that talk to it

    commit = git_commit()  # the uploaded working dir has no .git: the run's commit tag comes from here
    env = env | {"env_vars": (env.get("env_vars") or {}) | ({"GIT_COMMIT": commit} if commit else {})}
    return {"entrypoint": shlex.join(command), "submission_id": submission_id, "runtime_env": env,
            "metadata": {"run_name": cfg.train.run_name, "config": config, **(metadata or {})}}


def sync_job(run_name: str, config: str, overrides: list[str], env: dict) -> dict:
    """`python -m jobs.sync` as a job, its config validated here: it runs where the run directory is (the
    cluster's storage). The keyword arguments of `submit_job`."""
    refuse_secrets(overrides)
    load_config(config, [*overrides, f"train.run_name={run_name}"])
    command = ["python", "-m", "jobs.sync", run_name, "--config", config]
    for item in overrides:
        command += ["--set", item]
    return {"entrypoint": shlex.join(command), "runtime_env": env,
            "submission_id": f"sync-{run_name}-{time.strftime('%Y%m%d-%H%M%S')}",
            "metadata": {"run_name": run_name, "config": config}}


def tune_job(tune_args: list[str], env: dict) -> dict:
    """`python -m jobs.tune` as one job (its trials run on the cluster it joins), its flags, config and space checked
    here first, its sweep name pinned: the keyword arguments of `submit_job`."""
    tune_args = tune_args[1:] if tune_args[:1] == ["--"] else tune_args
    args = parse_tune_args(tune_args)
    refuse_secrets(args.overrides)
    sweep_config(args)
    name = sweep_name(args)
    command = ["python", "-m", "jobs.tune", *tune_args]
    if not args.name and not args.resume:
        command += ["--name", name]
    submission_id = name if not args.resume else f"{name}-resume-{time.strftime('%Y%m%d-%H%M%S')}"
    return {"entrypoint": shlex.join(command), "submission_id": submission_id, "runtime_env": env,
            "metadata": {"sweep": name, "config": args.config}}


def reconcile(client) -> None:
    """MLflow runs left RUNNING by jobs that have ended (a driver killed with SIGKILL, a lost head) are
    ended with their job's outcome. Needs $MLFLOW_TRACKING_URI here; skipped without it."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return
    from app.tracking.mlflow_run import reconcile_runs

    ended = {job.submission_id: str(job.status.value) for job in client.list_jobs()
             if job.submission_id and str(job.status.value) in TERMINAL}
    for line in reconcile_runs(export_credentials(uri), ended):
        print(line, file=sys.stderr)


def wait_for(client, job_ids: list[str], poll_seconds: float = 2.0, quiet: bool = False) -> dict[str, str]:
    """Poll until every job has ended; prints each status change. Returns id -> final status."""
    seen: dict[str, str] = {}
    while True:
        for job_id in job_ids:
            status = str(client.get_job_status(job_id).value)
            if seen.get(job_id) != status and not quiet:
                print(f"{time.strftime('%H:%M:%S')}  {job_id}: {status}", flush=True)
            seen[job_id] = status
        if all(s in TERMINAL for s in seen.values()):
            return seen
        time.sleep(poll_seconds)


def follow_logs(client, job_id: str) -> str:
    async def tail():
        async for chunk in client.tail_job_logs(job_id):
            print(chunk, end="", flush=True)
    asyncio.run(tail())
    return str(client.get_job_status(job_id).value)


def stop(client, job_id: str, wait: bool) -> str:
    if not client.stop_job(job_id):
        return str(client.get_job_status(job_id).value)  # had already ended
    return wait_for(client, [job_id], quiet=True)[job_id] if wait else "STOPPING"


def list_jobs(client) -> str:
    jobs = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
    columns = {"job": [], "status": [], "started": [], "config": []}
    for job in jobs:
        columns["job"].append(job.submission_id or job.job_id)
        columns["status"].append(str(job.status.value))
        columns["started"].append(time.strftime("%Y-%m-%d %H:%M", time.localtime((job.start_time or 0) / 1000)))
        columns["config"].append((job.metadata or {}).get("config", "-"))
    return format_table(columns)


@dataclass(frozen=True)
class Sweep:
    """A sweep checked whole before the cluster or MLflow is contacted."""

    name: str
    grid: dict[str, list]
    points: list[tuple[str, list[str]]]  # each point's run name and overrides
    tracking_uri: str  # without credentials
    experiment: str
    best_metric: str  # train.best_metric of its runs: what the table ranks them by


def plan_sweep(config: str, overrides: list[str], axes: list[str], name: str | None, env: dict) -> Sweep:
    refuse_secrets(axes, flag="--grid")  # first: a malformed axis is echoed in parse_grid's error
    grid = parse_grid(axes)
    name = name or f"sweep-{Path(config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    points = [(point_name(name, i, point), [*overrides, *point_overrides(point), f"mlflow.sweep={name}"])
              for i, point in enumerate(grid_points(grid))]
    for run_name, point in points:
        run_job(config, point, env, run_name=run_name)
    cfg = load_config(config, overrides)
    return Sweep(name, grid, points, _sweep_tracking_uri(overrides, env), cfg.mlflow.experiment, cfg.train.best_metric)


def run_sweep(client, sweep: Sweep, config: str, env: dict) -> int:
    """One job per grid point, grouped in MLflow under a parent run; waits, then prints the table."""
    from mlflow.tracking import MlflowClient

    from app.tracking.mlflow_run import get_or_create_experiment

    mlflow = MlflowClient(sweep.tracking_uri)
    experiment_id = get_or_create_experiment(mlflow, sweep.experiment)
    parent = mlflow.create_run(experiment_id, run_name=sweep.name, tags={"sweep": sweep.name, "sweep.role": "parent"})
    parent_id = parent.info.run_id
    mlflow.log_param(parent_id, "sweep.grid", yaml.safe_dump(sweep.grid, default_flow_style=True).strip())
    job_ids = [client.submit_job(**run_job(config, [*overrides, f"mlflow.parent_run_id={parent_id}"], env,
                                           run_name=run_name, metadata={"sweep": sweep.name}))
               for run_name, overrides in sweep.points]
    print(f"sweep {sweep.name}: {len(job_ids)} jobs submitted; they queue on the cluster's resources", flush=True)
    statuses = wait_for(client, job_ids)
    runs = [{"run_name": r.info.run_name, "status": r.info.status, "params": r.data.params, "metrics": r.data.metrics}
            for r in mlflow.search_runs([experiment_id], f"tags.sweep = '{sweep.name}'")
            if r.info.run_id != parent_id]
    table = results_table(runs, list(sweep.grid), sweep.best_metric)
    mlflow.log_table(parent_id, data=table, artifact_file="sweep/results.json")
    failed = [j for j, s in statuses.items() if s != "SUCCEEDED"]
    mlflow.set_terminated(parent_id, status="FAILED" if failed else "FINISHED")
    print(format_table(table))
    print(f"MLflow: {sweep.tracking_uri}  experiment {sweep.experiment}, parent run {sweep.name} ({parent_id})")
    if failed:
        print(f"failed: {', '.join(failed)}; see `python -m jobs.submit logs JOB`", file=sys.stderr)
    return 1 if failed else 0


def _sweep_tracking_uri(overrides: list[str], env: dict) -> str:
    """Where the sweep's jobs record their runs (a server this client reaches too), its credentials moved
    to MLflow's variables before the URI is recorded or printed."""
    configured = [item.partition("=")[2] for item in overrides if item.startswith("mlflow.tracking_uri=")]
    uri = (configured[-1] if configured else (env.get("env_vars") or {}).get("MLFLOW_TRACKING_URI")
           or os.environ.get("MLFLOW_TRACKING_URI", ""))
    if not uri or "${" in uri:
        raise UserInputError("sweep: needs the tracking server its jobs log to; export MLFLOW_TRACKING_URI here "
                             "(the cluster's server), or --set mlflow.tracking_uri=URL")
    return export_credentials(uri)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = CommandParser(prog="python -m jobs.submit", description=__doc__.split("\n")[1])
    parser.add_argument("--address", help="Ray dashboard / Jobs API URL, e.g. http://127.0.0.1:8265")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_config(p):
        p.add_argument("--config", required=True, help="YAML config, e.g. jobs/configs/embedded.yaml")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("--runtime-env", default="jobs/runtime_env.yaml")
        return p

    submit = with_config(commands.add_parser("submit", help="submit one fine-tuning job"))
    submit.add_argument("--resume", metavar="RUN_NAME", help="continue this run from its latest checkpoint")
    submit.add_argument("--follow", action="store_true", help="stream its logs; exit 0 only if it succeeds")
    commands.add_parser("list", help="every job of the cluster")
    for name, text in (("status", "a job's status"), ("logs", "a job's logs"), ("stop", "stop a job")):
        p = commands.add_parser(name, help=text)
        p.add_argument("job_id")
    commands.choices["logs"].add_argument("--follow", action="store_true")
    commands.choices["stop"].add_argument("--wait", action="store_true", help="until it has stopped")
    sw = with_config(commands.add_parser("sweep", help="a grid of configs as separate jobs, compared in MLflow"))
    sw.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="one axis (repeatable)")
    sw.add_argument("--name", help="the sweep's name (MLflow parent run and tag); default sweep-CONFIG-TIME")
    tune = commands.add_parser("tune", help="a Ray Tune sweep (python -m jobs.tune) as one job")
    tune.add_argument("--runtime-env", default="jobs/runtime_env.yaml")
    tune.add_argument("--follow", action="store_true", help="stream its logs; exit 0 only if it succeeds")
    tune.add_argument("tune_args", nargs=argparse.REMAINDER, metavar="-- JOBS.TUNE FLAGS",
                      help="after --: python -m jobs.tune's flags, e.g. -- --config C --space 'lora.r=choice(8,16)'")
    sync = with_config(commands.add_parser("sync", help="send what a run kept while MLflow was unreachable"))
    sync.add_argument("run_name")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    quiet_import_noise()
    args = parse_args(argv)
    return exit_code(lambda: run_command(args))


def run_command(args: argparse.Namespace) -> int:
    """What the command line gives is checked first; the cluster is contacted only then."""
    env = runtime_env(args.runtime_env) if hasattr(args, "runtime_env") else {}
    if args.command == "sweep":
        sweep = plan_sweep(args.config, args.overrides, args.grid, args.name, env)
        return run_sweep(job_client(args.address), sweep, args.config, env)
    if args.command in ("submit", "sync", "tune"):
        job = (run_job(args.config, args.overrides, env, resume=args.resume) if args.command == "submit"
               else tune_job(args.tune_args, env) if args.command == "tune"
               else sync_job(args.run_name, args.config, args.overrides, env))
        client = job_client(args.address)
        job_id = client.submit_job(**job)
        print(job_id, flush=True)
        if args.command in ("submit", "tune") and not args.follow:
            return 0
        return 0 if follow_logs(client, job_id) == "SUCCEEDED" else 1
    client = job_client(args.address)
    if args.command in ("list", "status"):
        reconcile(client)
    if args.command == "list":
        print(list_jobs(client))
    elif args.command == "status":
        info = client.get_job_info(args.job_id)
        print(f"{args.job_id}: {info.status.value}" + (f" ({info.message})" if info.message else ""))
    elif args.command == "logs" and args.follow:
        follow_logs(client, args.job_id)
    elif args.command == "logs":
        print(client.get_job_logs(args.job_id), end="")
    elif args.command == "stop":
        print(f"{args.job_id}: {stop(client, args.job_id, args.wait)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
