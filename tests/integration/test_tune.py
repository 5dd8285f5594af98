"""Extended (make test-all): each sweep starts a Ray cluster of its own and a Ray Train run per trial.

`python -m jobs.tune` as a user runs it (its own local Ray cluster, the real Ray Tune schedulers, Ray Train
worker groups, MLflow store): ASHA stops the trials behind and keeps what they made, PBT copies a better trial's
checkpoint into a worse one with a perturbed learning rate."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from tests.helpers import EMBEDDED_CONFIG, REPO

pytestmark = pytest.mark.extended

# short trials: an evaluation (and a report to the scheduler) every 2 steps, one worker each
TRIAL = ["train.max_steps=8", "train.eval_every=2", "train.log_every=1", "train.warmup_steps=0",
         "scaling.num_workers=1", "eval.generation_rows=0", "train.best_metric=eval_loss", "train.sample_prompts=0",
         "model.dtype=float32", "fsdp.param_dtype=float32"]


def tune_command(embedded, out: Path, *args: str) -> subprocess.CompletedProcess:
    paths = [f"model.path={embedded['model']}", f"data.train_path={embedded['train']}",
             f"data.eval_path={embedded['eval']}", f"train.output_dir={out}"]
    sets = [arg for item in [*paths, *TRIAL] for arg in ("--set", item)]
    return subprocess.run([sys.executable, "-m", "jobs.tune", "--config", str(EMBEDDED_CONFIG), *sets, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=780)


def summary_of(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def runs_of(out: Path) -> tuple[MlflowClient, dict]:
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    experiment = client.get_experiment_by_name("embedded-demo").experiment_id
    return client, {r.info.run_name: r for r in client.search_runs([experiment])}


@pytest.mark.timeout(900)
def test_asha_stops_the_trials_behind_and_keeps_their_runs_figures_and_adapters(embedded, tmp_path):
    """Four learning rates, two far too small: ASHA stops those at its first rung; the best trains to the end.
    A stopped trial's run is KILLED (not FAILED) and says by whom and where, every figure it reported is in MLflow,
    its adapter of that step is in its run directory and on the run; the sweep spent fewer steps than a grid."""
    out = tmp_path / "out"
    # seed 0 orders the grid 2e-3, 1e-6, 3e-3, 2e-6, one trial at a time: each small one reaches the first rung
    # after a good one (two at once, which of the first two gets there first is up to the machine's load)
    summary = summary_of(tune_command(embedded, out, "--space", "train.learning_rate=grid(3e-3,1e-6,2e-6,2e-3)",
                                      "--seed", "0", "--num-samples", "1", "--max-concurrent", "1",
                                      "--grace-period", "2", "--reduction-factor", "2", "--name", "lr-asha"))
    assert summary["best"]["config"] == {"train.learning_rate": 0.003} and summary["trials"] == 4
    assert summary["steps_spent"] == 8 + 2 + 8 + 2 and summary["steps_to_the_end"] == 32

    client, runs = runs_of(out)
    parent = runs.pop("lr-asha")
    assert parent.info.status == "FINISHED" and parent.data.tags["best_trial_run"] == summary["best"]["run"]
    logged = {a.path for a in client.list_artifacts(parent.info.run_id, "tune")}
    assert logged == {"tune/trials.json", "tune/curves.png"}
    assert len(runs) == 4 and {r.data.tags["mlflow.parentRunId"] for r in runs.values()} == {parent.info.run_id}
    stopped = [r for r in runs.values() if r.data.params["train.learning_rate"] in ("1e-06", "2e-06")]
    for run in stopped:
        assert run.info.status == "KILLED" and run.data.tags["tune.stopped_by"] == "asha"
        step = int(run.data.tags["tune.stopped_at_step"])
        evaluated = [m.step for m in client.get_metric_history(run.info.run_id, "eval_loss")]
        assert step in evaluated and step < 8
        adapter = out / run.info.run_name / "adapter"
        weights = load_file(adapter / "adapter_model.safetensors")
        assert weights and {"adapter/adapter_model.safetensors"} <= {
            a.path for a in client.list_artifacts(run.info.run_id, "adapter")}
        assert list((out / run.info.run_name).glob("checkpoint_*"))  # its checkpoints are kept
    best = runs[summary["best"]["run"]]
    assert best.info.status == "FINISHED" and best.data.metrics["steps"] == 8


@pytest.mark.timeout(900)
def test_pbt_restarts_the_worse_trial_from_the_better_ones_checkpoint_with_its_new_learning_rate(embedded, tmp_path):
    """Two trials, one with a learning rate far too small: PBT copies the other's checkpoint into it. The copy
    continues its own MLflow run from the step of that checkpoint, with the lineage in its tags, and trains its
    next step at its (perturbed) learning rate on the same schedule as the trial it copied."""
    out = tmp_path / "out"
    # seed 1 samples 6.0e-5 and 2.0e-3; one decision, at step 4, for both trials at once (synchronous: the first
    # there waits for the other, however the machine's load staggers them): the worse copies the better
    summary_of(tune_command(embedded, out, "--space", "train.learning_rate=loguniform(1e-6,3e-3)", "--seed", "1",
                            "--num-samples", "2", "--max-concurrent", "2", "--scheduler", "pbt", "--synchronous",
                            "--perturb", "train.learning_rate", "--quantile-fraction", "0.5",
                            "--perturbation-interval", "4", "--set", "train.max_steps=6", "--name", "lr-pbt"))
    client, runs = runs_of(out)
    runs.pop("lr-pbt")
    exploited = [r for r in runs.values() if "pbt.exploited_from" in r.data.tags]
    assert exploited, {name: r.data.tags for name, r in runs.items()}
    run = exploited[0]
    first_copy = run.data.tags["pbt.lineage"].splitlines()[0]  # "step 4: from RUN (train.learning_rate A -> B)"
    step, origin_name = int(first_copy.split(":")[0].removeprefix("step ")), first_copy.split(" ")[3]
    origin = runs[origin_name]
    assert origin.info.run_id != run.info.run_id and step == 4 and len(exploited) == 1
    before, perturbed = (float(v) for v in first_copy.rstrip(")").split(" ")[-3::2])
    assert before == pytest.approx(float(origin.data.params["train.learning_rate"])) and perturbed != before

    def lr_at(r, at: int) -> float:  # the last logged at that step: the copy logs the steps after `step` anew
        history = sorted(client.get_metric_history(r.info.run_id, "learning_rate"), key=lambda m: m.timestamp)
        return {m.step: m.value for m in history}[at]

    resumed = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "resumed_from_step")}
    assert step in resumed.values()
    # the copy's next step: its perturbed rate on the schedule of the trial it copied
    assert lr_at(run, step + 1) / lr_at(origin, step + 1) == pytest.approx(perturbed / before, rel=1e-5)


def yaml_value(config: Path) -> float:
    import yaml

    return yaml.safe_load(config.read_text())["train"]["learning_rate"]


def _second_trial_checkpointed(out: Path) -> bool:
    """The second trial (one runs at a time: the first has ended) has made its first checkpoint. Read from the
    files, not the MLflow store: a client opening the store while the sweep creates it would race its setup."""
    return any(out.glob("lr-resume-*_00001/checkpoint_*"))


@pytest.mark.timeout(900)
def test_a_sweep_stopped_midway_resumes_without_rerunning_its_finished_trials(embedded, tmp_path):
    """Ctrl-C after the first of two trials (one at a time) has finished: the running trial's run and the sweep's
    end KILLED and the command says how to continue; --resume finishes the second trial from its checkpoint,
    in the same run, and the first is not run again."""
    out = tmp_path / "out"
    paths = [f"model.path={embedded['model']}", f"data.train_path={embedded['train']}",
             f"data.eval_path={embedded['eval']}", f"train.output_dir={out}", *TRIAL, "train.max_steps=6"]
    command = [sys.executable, "-m", "jobs.tune", "--config", str(EMBEDDED_CONFIG),
               *(arg for item in paths for arg in ("--set", item)), "--space", "train.learning_rate=grid(3e-3,2e-3)",
               "--num-samples", "1", "--max-concurrent", "1", "--scheduler", "fifo", "--name", "lr-resume"]
    sweep = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not _second_trial_checkpointed(out) and sweep.poll() is None and time.monotonic() < deadline:
        time.sleep(1)
    sweep.send_signal(signal.SIGINT)
    stdout, stderr = sweep.communicate(timeout=180)
    assert sweep.returncode == 1 and "--resume lr-resume" in stderr, stdout[-2000:] + stderr[-3000:]
    client, runs = runs_of(out)
    assert runs["lr-resume"].info.status == "KILLED"
    [first] = [r for name, r in runs.items() if r.info.status == "FINISHED"]
    [second] = [r for name, r in runs.items() if name != "lr-resume" and r is not first]
    assert second.info.status == "KILLED" and second.data.tags["tune.interrupted"] == "true"
    first_losses = client.get_metric_history(first.info.run_id, "train_loss")

    summary = summary_of(subprocess.run([*command[:command.index("--space")], "--resume", "lr-resume"], cwd=REPO,
                                        capture_output=True, text=True, timeout=600))
    assert summary["status"] == "FINISHED" and summary["trials"] == 2
    client, runs = runs_of(out)
    assert runs["lr-resume"].info.status == "FINISHED"
    again = runs[first.info.run_name]
    assert "resumes" not in again.data.tags
    assert client.get_metric_history(first.info.run_id, "train_loss") == first_losses
    resumed = runs[second.info.run_name]
    assert resumed.info.status == "FINISHED" and resumed.data.tags["resumes"] == "1"
    assert [m.step for m in client.get_metric_history(resumed.info.run_id, "train_loss")] == list(range(1, 7))
