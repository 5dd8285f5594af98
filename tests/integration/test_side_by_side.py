"""Several adapters over one base in one job (`adapters:`), end to end: Ray Train's worker group, Ray Data, gloo,
PEFT, an MLflow store. Nothing is mocked.

The job trains two adapters side by side, one on data of its own; each takes the steps the same adapter takes in
a job of its own, gets its own MLflow run nested under the job's (curves, params of its alone config, its data,
best evaluation, its folder as the artifact `adapter/`), and its folder reloads in plain PEFT in a fresh process to
its reported eval loss.
"""

import json
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from app.launch.driver import run_finetune
from tests.helpers import EMBEDDED_CONFIG, SHORT_RUN, make_config
from tests.integration.test_e2e import RELOAD_SCRIPT

# extended: adapters side by side train in CI with real gloo ranks (tests/unit/train/test_side_by_side.py)
pytestmark = [pytest.mark.e2e, pytest.mark.extended]

FAST, SMALL = "{name: fast, learning_rate: 5e-3, lr_schedule: constant}", "{name: small, r: 4, alpha: 8}"
RUN = [*SHORT_RUN, "train.max_steps=20", "train.eval_every=10", "train.checkpoint_every=10"]


def _losses(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_two_adapters_train_in_one_job_as_each_would_alone_each_a_run_of_its_own(ray_cluster, embedded, tmp_path):
    own = tmp_path / "fast.jsonl"  # fast's own data: other records (its eval rows held out of them)
    own.write_text("\n".join(embedded["train"].read_text().splitlines()[-400:]) + "\n")
    fast = FAST.replace("}", f", train_path: {own}}}")
    cfg = make_config(tmp_path / "both", embedded, *RUN, f"adapters=[{fast}, {SMALL}]", "mlflow.registered_model=sbs")
    both = run_finetune(cfg)
    alone = run_finetune(make_config(tmp_path / "alone", embedded, *RUN, f"adapters=[{SMALL}]"))
    client = MlflowClient(both["tracking_uri"])
    job = client.get_run(both["mlflow_run_id"])
    assert set(both["adapters"]) == {"fast", "small"}
    for name, entry in both["adapters"].items():
        initial = _losses(client, job.info.run_id, f"{name}/eval_loss")[0]  # on its own eval rows
        assert entry["final_eval_loss"] < 0.7 * initial, name  # each learned
        run = client.get_run(entry["mlflow_run_id"])
        assert run.data.tags["mlflow.parentRunId"] == job.info.run_id and run.info.status == "FINISHED"
        assert run.data.params["lora.r"] == {"fast": "16", "small": "4"}[name]  # the config it trained with alone
        assert run.data.params["data.train_path"] == {"fast": str(own), "small": str(embedded["train"])}[name]
        assert _losses(client, run.info.run_id, "train_loss") == _losses(client, job.info.run_id, f"{name}/train_loss")
        assert sorted(_losses(client, run.info.run_id, "train_loss")) == list(range(1, 21))
        assert {a.path for a in client.list_artifacts(run.info.run_id, "adapter")} >= {
            "adapter/adapter_config.json", "adapter/adapter_model.safetensors"}
        [version] = client.search_model_versions(f"name = 'sbs' and run_id = '{run.info.run_id}'")
        assert version.tags["adapter"] == name  # each adapter a registered version of mlflow.registered_model
    assert _losses(client, job.info.run_id, "fast/data_pass_rows/fast")[0] < 400  # built from its own records
    assert {(d.dataset.name, d.tags[0].value) for d in job.inputs.dataset_inputs} >= {("fast.jsonl", "train/fast")}
    # the same adapter in a job of its own takes the same steps (fp32; Ray Data deals the same rows)
    mine = _losses(client, both["adapters"]["small"]["mlflow_run_id"], "train_loss")
    theirs = _losses(MlflowClient(alone["tracking_uri"]), alone["adapters"]["small"]["mlflow_run_id"], "train_loss")
    assert mine == pytest.approx(theirs, rel=1e-5)

    folder = both["adapters"]["small"]["adapter_path"]
    out = subprocess.run([sys.executable, "-c", RELOAD_SCRIPT, str(embedded["model"]), folder, str(embedded["eval"]),
                          str(cfg.data.max_seq_len)], capture_output=True, text=True, check=True, cwd=str(tmp_path))
    reloaded = json.loads(out.stdout.strip().splitlines()[-1])["eval_loss"]
    assert reloaded == pytest.approx(both["adapters"]["small"]["final_eval_loss"], rel=1e-4)


def test_a_sweep_in_one_job_halves_its_adapters_at_the_asha_rungs(ray_cluster, embedded, tmp_path, capsys):
    """`jobs.tune --in-one-job`: four learning rates as four adapters of one job; ASHA's rungs (every 5 steps
    doubling, 1 in 2 going on) leave two after step 5 and one after step 10, which trains to the end and is the
    sweep's best."""
    from jobs.tune import one_job_sweep, parse_args, sweep_config, sweep_name

    paths = [f"model.path={embedded['model']}", f"data.train_path={embedded['train']}",
             f"data.eval_path={embedded['eval']}", f"train.output_dir={tmp_path / 'outputs'}"]
    settings = [*paths, *RUN, "train.eval_every=5", "train.checkpoint_every=20"]
    args = parse_args(["--config", str(EMBEDDED_CONFIG), *(a for s in settings for a in ("--set", s)), "--in-one-job",
                       "--space", "train.learning_rate=grid(1e-4,1e-3,3e-3,1e-2)", "--num-samples", "1",
                       "--scheduler", "asha", "--grace-period", "5", "--reduction-factor", "2", "--name", "halved"])
    assert one_job_sweep(args, sweep_config(args), sweep_name(args)) == 0  # jobs.tune's, without its signal handler
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    client = MlflowClient(summary["tracking_uri"])
    training = _losses(client, summary["mlflow_run_id"], "adapters_training")
    assert [training[s] for s in (1, 5, 6, 10, 11, 20)] == [4, 4, 2, 2, 1, 1]
    survivors = [name for name, entry in summary["adapters"].items() if not entry["stopped"]]
    assert survivors == [summary["best_adapter"]] and summary["adapters"][survivors[0]]["best_step"] >= 15
    assert summary["best_config"]["learning_rate"] in (1e-4, 1e-3, 3e-3, 1e-2)
