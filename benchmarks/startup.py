"""Start-up and memory side by side: the job, launched as its users launch it, against TRL and the seed's loop.

    python -m benchmarks.startup [--repeats 2] [--steps 4] [--modes job submit floor submit-floor trl seed]

On the realistic shape (benchmarks/realistic.py's long-tailed chats and 134M-parameter Llama shape, seq 512,
2 workers, one packed row per worker per step, the job's `auto` compute dtype for every mode), each mode is
started the way a user starts it, and watched from outside:

- job: `python -m jobs.finetune` (a local Ray cluster of its own), the default `train.eval_on_start`
- submit: `ray job submit --working-dir . -- python -m jobs.finetune ...` to a running cluster (a
  cluster/local-up.sh stack, started once here and stopped at the end), timed from the `ray job submit`
- trl: `torchrun -m benchmarks.trl_sft` (TRL's SFTTrainer, its packing, PEFT LoRA, FSDP2)
- seed: `torchrun -m benchmarks.baseline` (the seed's plain loop, one record per row)
- floor: `python -m benchmarks.ray_floor`, Ray Train's own start: a local cluster and `TorchTrainer.fit()` of a
  function that does nothing; its "first step" is when that function starts, the earliest any Ray Train
  job's first step could begin on this machine
- submit-floor: the same function by `ray job submit` to the running cluster: the floor under the submit mode

For each run: seconds from the command to the end of the first optimizer step (the programs report its
wall-clock time); the CPU seconds every process on the machine spent until then (the sum over processes of
their user + system time, sampled every 0.1 s: on a machine with few cores this, not the overlap, sets the
start-up); and each worker's peak private memory (RssAnon: what it holds itself, not the shared library and
file pages that RSS also counts). The modes alternate, `--repeats` times; the table gives medians.
Writes <out>/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.common import TORCHRUN, write_and_log
from benchmarks.realistic import prepare

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKER_MARKS = {"job": "ray::RayTrainWorker", "submit": "ray::RayTrainWorker", "floor": "ray::RayTrainWorker",
                "submit-floor": "ray::RayTrainWorker",
                "trl": "benchmarks.trl_sft", "seed": "benchmarks.baseline"}


def rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:")), 0)
    except OSError:
        return 0


class Watch:
    """Every process on the machine, sampled every `interval` s: CPU time spent since the watch began (a
    running cluster's daemons count too) and peak private memory, per process."""

    def __init__(self, interval: float = 0.1):
        self.interval, self.began, self.procs, self.cpu_curve = interval, time.time(), {}, []
        self._stop = threading.Event()
        self._base = {p.pid: self._cpu(p) for p in psutil.process_iter()}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _cpu(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            for p in psutil.process_iter():
                if p.pid == me:
                    continue
                try:
                    key = (p.pid, p.create_time())
                    entry = self.procs.setdefault(key, {"name": " ".join(p.cmdline())[:160], "cpu": 0.0, "anon": 0,
                                                        "created": p.create_time(),
                                                        "base": self._base.get(p.pid, 0.0) if p.create_time()
                                                        < self.began else 0.0})
                    entry["cpu"] = self._cpu(p) - entry["base"]
                    entry.setdefault("curve", []).append((time.time(), entry["cpu"]))
                    entry["anon"] = max(entry["anon"], rss_anon(p.pid))
                    entry["name"] = " ".join(p.cmdline())[:160] or entry["name"]  # Ray renames its workers
                except psutil.Error:
                    continue
            self.cpu_curve.append((time.time(), sum(e["cpu"] for e in self.procs.values())))
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_until(self, when: float) -> float:
        """CPU seconds all processes had spent when the wall clock read `when` (the last sample before it)."""
        return max((cpu for t, cpu in self.cpu_curve if t <= when), default=0.0)

    def workers(self, mark: str) -> list[dict]:
        return [e for e in self.procs.values() if mark in e["name"] and "torch.distributed.run" not in e["name"]]

    def drivers(self) -> list[dict]:
        return [e for e in self.procs.values() if "-m jobs.finetune" in e["name"] and "ray job submit" not in
                e["name"] and "--working-dir" not in e["name"]]


def job_overrides(model: Path, train: Path, evals: Path, steps: int, run_name: str) -> list[str]:
    """benchmarks/realistic.py's mode (a) (packed), for `steps` steps, evaluated at the end only."""
    return [f"model.path={model.resolve()}", f"data.train_path={train.resolve()}", f"data.eval_path={evals.resolve()}",
            "data.max_seq_len=512", "data.max_eval_rows=16", "data.packing=true", "train.learning_rate=2e-4",
            "train.lr_schedule=constant", "train.warmup_steps=0", "train.log_every=1", "train.sample_prompts=0",
            "fsdp.reshard_after_forward=true", "eval.generation_rows=0", "train.best_metric=eval_loss",
            "train.global_batch_size=2", "train.micro_batch_size=1", f"train.max_steps={steps}",
            f"train.eval_every={steps}", f"train.checkpoint_every={steps}", "train.eval_on_start=false",
            f"train.run_name={run_name}"]


def last_json(text: str, prefix: str = "{") -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith(prefix)][-1])


def run_mode(mode: str, args, model: Path, train: Path, evals: Path, stack: dict | None, index: int) -> dict:
    """One run of `mode`, watched; its figures."""
    name = f"startup-{mode}-{time.strftime('%H%M%S')}-{index}"
    sets = [a for o in job_overrides(model, train, evals, args.steps, name) for a in ("--set", o)]
    config = ["--config", "jobs/configs/embedded.yaml"]
    submit = [str(BIN / "ray"), "job", "submit", "--working-dir", ".", "--", "python"]
    floor = ["-m", "benchmarks.ray_floor", "--storage", str(Path(args.out).resolve())]
    if mode == "job":
        command, env = [sys.executable, "-m", "jobs.finetune", *config, *sets], dict(os.environ)
    elif mode == "submit":
        command, env = [*submit, "-m", "jobs.finetune", *config, *sets], stack["env"]
    elif mode == "floor":
        command, env = [sys.executable, *floor], dict(os.environ)
    elif mode == "submit-floor":
        command, env = [*submit, *floor], stack["env"]
    else:
        script = "benchmarks.trl_sft" if mode == "trl" else "benchmarks.baseline"
        common = ["--model-path", str(model), "--seq-len", "512", "--micro-batch", "1", "--steps", str(args.steps),
                  "--warmup", "1"]
        extra = (["--train", str(train), "--eval", str(evals), "--out", str(Path(args.out) / "trl")] if mode == "trl"
                 else ["--data", str(train), "--global-batch", "2", "--dtype", args.dtype])
        command, env = [*TORCHRUN, "--nproc-per-node=2", "-m", script, *common, *extra], dict(os.environ)
    watch = Watch()
    started = time.time()
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    watch.stop()
    if out.returncode != 0:
        raise SystemExit(f"{mode}: {' '.join(command[:8])} ... failed:\n{out.stderr[-3000:]}{out.stdout[-2000:]}")
    if mode in ("job", "submit"):
        summary = last_json(out.stdout, '{"mlflow_run_id"')
        [driver] = sorted(watch.drivers(), key=lambda e: e["created"])[-1:]
        first_step_at = driver["created"] + summary["time_to_first_step_seconds"]
        timeline = {k: round(v + driver["created"] - started, 1) for k, v in summary["startup_seconds"].items()}
    else:
        summary = last_json(out.stdout, '{"first_step_at"' if "floor" in mode else "{")
        first_step_at = summary["first_step_at"]
        timeline = {k.removesuffix("_at"): round(v - started, 1) for k, v in summary.items()
                    if k.endswith("_at") and k != "first_step_at"}
    workers = watch.workers(WORKER_MARKS[mode])
    return {"first_step_from_command_s": round(first_step_at - started, 1),
            "cpu_seconds_before_first_step": round(watch.cpu_until(first_step_at), 1),
            "worker_peak_private_gib": sorted(round(w["anon"] / 2**30, 3) for w in workers),
            "timeline_from_command_s": timeline,
            "first_step_own_s": summary.get("first_step_seconds"),  # the step itself (the floor has none)
            "cpu_seconds_by_process": cpu_by_process(watch, first_step_at)}


def cpu_by_process(watch: Watch, until: float) -> dict[str, float]:
    """CPU seconds spent until `until` (the first step) by the processes that spent over half a second, by
    what they are: Ray names its actors' processes ray::<class>; others by their command."""
    groups: dict[str, float] = {}
    for e in watch.procs.values():
        name = e["name"].split(" ")[0] if e["name"].startswith("ray::") else " ".join(e["name"].split(" ")[:3])
        spent = max((cpu for t, cpu in e.get("curve", []) if t <= until), default=0.0)
        groups[name] = groups.get(name, 0.0) + spent
    return {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1]) if v > 0.5}


def start_stack(out: Path) -> dict:
    """cluster/local-up.sh on free ports in its own directories: the running cluster `ray job submit` joins."""
    def free_port() -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    stack_dir = Path(tempfile.mkdtemp(prefix="stack-", dir=out))
    ports = {name: str(free_port()) for name in ("RAY_PORT", "DASHBOARD_PORT", "MLFLOW_PORT", "AGENT_PORT",
                                                  "CLIENT_PORT")}
    env = {k: v for k, v in os.environ.items() if k not in ("FINETUNE_STORAGE", "MLFLOW_TRACKING_URI")}
    env |= ports | {"STACK_DIR": str(stack_dir), "BIN": str(BIN), "RAY_TMP": f"/tmp/ray-bench-{ports['RAY_PORT']}"}
    subprocess.run(["bash", "cluster/local-up.sh"], cwd=REPO, env=env, check=True, capture_output=True)
    client = dict(os.environ) | {"RAY_AUTH_MODE": "token", "RAY_ADDRESS": f"http://127.0.0.1:{ports['DASHBOARD_PORT']}",
                                 "PATH": f"{BIN}:{os.environ['PATH']}"}
    return {"env": client, "up_env": env}


def median_figures(runs: list[dict]) -> dict:
    keys = ("first_step_from_command_s", "cpu_seconds_before_first_step")
    figures = {k: statistics.median(r[k] for r in runs) for k in keys}
    figures["worker_peak_private_gib"] = statistics.median(max(r["worker_peak_private_gib"], default=0.0)
                                                           for r in runs)  # a floor run can end before it is seen
    return figures


def run(args) -> dict:
    out = Path(args.out)
    model, train, evals = prepare(out, 4000)
    stack = start_stack(out) if {"submit", "submit-floor"} & set(args.modes) else None
    try:
        runs = {mode: [] for mode in args.modes}
        for i in range(args.repeats):
            for mode in args.modes:
                runs[mode].append(run_mode(mode, args, model, train, evals, stack, i))
                print(mode, json.dumps({k: v for k, v in runs[mode][-1].items() if k != "cpu_seconds_by_process"}),
                      file=sys.stderr, flush=True)
    finally:
        if stack:
            subprocess.run(["bash", "cluster/local-down.sh"], cwd=REPO, env=stack["up_env"], capture_output=True)
    result = {"steps": args.steps, "repeats": args.repeats, "cpus": os.cpu_count(), "runs": runs,
              "median": {mode: median_figures(r) for mode, r in runs.items()}}
    med = result["median"]
    ratio = lambda key, to: {m: round(f[key] / med[to][key], 3) for m, f in med.items()}
    if "seed" in med:
        result["peak_private_over_seed"] = ratio("worker_peak_private_gib", "seed")
    if "trl" in med:
        result["first_step_over_trl"] = ratio("first_step_from_command_s", "trl")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", nargs="+", default=["job", "submit", "floor", "submit-floor", "trl", "seed"],
                        choices=list(WORKER_MARKS))
    parser.add_argument("--dtype", default=None, help="the seed loop's dtype; default: the job's auto")
    parser.add_argument("--out", default="outputs/benchmark")
    args = parser.parse_args(argv)
    if args.dtype is None:
        import torch

        from app.model.hardware import has_fast_bf16

        args.dtype = "bfloat16" if has_fast_bf16(torch.device("cpu")) else "float32"
    write_and_log(run(args), Path(args.out), "startup")
    return 0


if __name__ == "__main__":
    sys.exit(main())
