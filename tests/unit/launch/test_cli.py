"""Bad input through the real command line: one line naming the key/file/line, exit code 2, nothing started."""

import importlib
import subprocess
import sys

import pytest

from app.runs.layout import RunDir
from jobs.finetune import main
from tests.helpers import EMBEDDED_CONFIG, REPO, chat, write_jsonl


@pytest.fixture
def run_cli(tmp_path, embedded, capsys):
    def run(*overrides: str) -> str:
        args = ["--config", str(EMBEDDED_CONFIG), "--set", f"train.output_dir={tmp_path / 'out'}",
                "--set", f"model.path={embedded['model']}", "--set", f"data.eval_path={embedded['eval']}"]
        for item in overrides:
            args += ["--set", item]
        connected_before = "ray" in sys.modules and sys.modules["ray"].is_initialized()  # a shared test cluster
        assert main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err
        assert not (tmp_path / "out").exists()  # no MLflow store, no run directory: nothing started
        if not connected_before:  # the model checks run while a local Ray starts: it is stopped again
            assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
        return err
    return run


def test_unknown_key_and_wrong_type(run_cli):
    assert "lora.rank: unknown key (did you mean lora.r?)" in run_cli("lora.rank=8")
    assert "train.max_steps: Input should be a valid integer" in run_cli("train.max_steps=ten")


def test_missing_model_directory(run_cli, tmp_path):
    err = run_cli(f"model.path={tmp_path / 'no-model'}")
    assert f"model.path={tmp_path / 'no-model'}: no such directory" in err and "make embedded" in err


def test_missing_empty_and_malformed_data(run_cli, tmp_path):
    assert "no such file or directory" in run_cli(f"data.train_path={tmp_path / 'none.jsonl'}")
    empty = write_jsonl(tmp_path / "empty.jsonl", [])
    assert "no records; the data is empty" in run_cli(f"data.train_path={empty}")
    broken = write_jsonl(tmp_path / "broken.jsonl", [chat("q", "a"), "{not json"])
    assert f"{broken}:2: not valid JSON" in run_cli(f"data.train_path={broken}")
    fieldless = write_jsonl(tmp_path / "fields.jsonl", [chat("q", "a"), {"question": "q", "answer": "a"}])
    assert f"{fieldless}:2: record needs fields" in run_cli(f"data.train_path={fieldless}")
    # an adapter's own data is checked as the job's, naming the adapter's key
    err = run_cli(f"adapters=[{{name: fine}}, {{name: tenant, train_path: {broken}}}]")
    assert f"{broken}:2: not valid JSON" in err
    err = run_cli(f"adapters=[{{name: tenant, eval_path: {tmp_path / 'none.jsonl'}}}]")
    assert f"adapters.tenant.eval_path={tmp_path / 'none.jsonl'}" in err and "no such file or directory" in err


@pytest.mark.slow  # the checks that load the model run while Ray starts: a local cluster starts and stops again
def test_lora_target_modules_are_checked_against_the_model(run_cli):
    err = run_cli("lora.target_modules=[q_proj, qkv_proj]")
    assert "lora.target_modules: ['qkv_proj'] match no module of" in err and "'q_proj'" in err


def test_an_earlier_run_is_never_overwritten_and_resume_needs_one(embedded, tmp_path, capsys):
    base = ["--config", str(EMBEDDED_CONFIG), "--set", f"train.output_dir={tmp_path}",
            "--set", f"model.path={embedded['model']}", "--set", f"data.eval_path={embedded['eval']}"]
    RunDir(str(tmp_path / "mine")).write_record("an-earlier-mlflow-run")
    assert main(base + ["--set", "train.run_name=mine"]) == 2
    assert "holds an earlier run; pass --resume to continue it" in capsys.readouterr().err
    assert main(base + ["--resume", "other"]) == 2
    assert "--resume: no run to resume at" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == [tmp_path / "mine"]
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["run.json"]  # the claim is released


def test_the_process_exits_nonzero_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jobs.finetune", "--config", str(EMBEDDED_CONFIG),
                           "--set", "scaling.num_workers=3"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert "must be a multiple of train.micro_batch_size x scaling.num_workers = 48" in proc.stderr


def test_the_inputs_users_get_wrong_on_a_cluster_are_one_line_each(run_cli, tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "caf\xe9"}\n')
    assert f"{latin1}:1: not UTF-8 text" in run_cli(f"data.train_path={latin1}")
    assert "train.run_name=../escape: use letters, digits" in run_cli("train.run_name=../escape")
    assert "--set train.max_steps=[1: the value is not valid YAML" in run_cli("train.max_steps=[1")
    remote = write_jsonl(tmp_path / "remote.jsonl", [chat("q", "a"), {"question": "q"}])
    assert f"{remote.as_uri()}:2: record needs fields" in run_cli(f"data.train_path={remote.as_uri()}")
    assert "data.mixture_weights=[1.0] must give one positive weight" in run_cli(
        f"data.train_path=[{remote}, {remote}]", "data.mixture_weights=[1.0]")


def test_a_local_looking_model_path_that_does_not_exist_is_never_looked_up_on_the_hub(run_cli):
    for path in ("./models/mine", "models/org/name", "~/models/mine"):
        assert "no such directory" in run_cli(f"model.path={path}")


@pytest.mark.parametrize("command", ["finetune", "plan", "submit"])
def test_a_config_file_that_is_not_utf8_is_one_line_naming_it(command, tmp_path, one_line_error, closed_address):
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"train:\n  max_steps: 5  # caf\xe9\n")
    argv = {"finetune": ["--config", latin1], "plan": ["--config", latin1],
            "submit": ["--address", closed_address, "submit", "--config", latin1]}[command]
    err = one_line_error(importlib.import_module(f"jobs.{command}").main, argv)
    assert f"--config {latin1}: not UTF-8 text" in err


def test_an_output_dir_under_a_file_is_one_line(run_cli, tmp_path):
    (tmp_path / "file.txt").write_text("not a directory")
    err = run_cli(f"train.output_dir={tmp_path / 'file.txt' / 'out'}")
    assert f"train.output_dir={tmp_path / 'file.txt' / 'out'}: {tmp_path / 'file.txt'} is a file" in err
