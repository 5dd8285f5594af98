"""The embedded demo lives beside the commands (jobs/embedded.py), not in the product: a command whose config
reads it builds it on first use, before the driver starts; one that reads another model leaves it alone."""

import pytest

import jobs.embedded
from app.config.loading import load_config
from app.errors import UserInputError
from jobs.finetune import main
from tests.helpers import EMBEDDED_CONFIG


@pytest.fixture
def builds(monkeypatch) -> list:
    """The folders the command would build the demo in (the build itself stops the command: nothing starts)."""
    built = []

    def build_once(root):
        built.append(root)
        raise UserInputError("stopped before the driver")
    monkeypatch.setattr(jobs.embedded, "build_once", build_once)
    return built


def test_finetune_builds_the_embedded_demo_where_its_config_reads_it(builds, tmp_path, capsys):
    root = tmp_path / ".cache" / "embedded"
    paths = [f"model.path={root}/model", f"data.train_path={root}/data/train.jsonl",
             f"data.eval_path={root}/data/eval.jsonl", f"train.output_dir={tmp_path}/out"]
    assert main(["--config", str(EMBEDDED_CONFIG), *(arg for path in paths for arg in ("--set", path))]) == 2
    assert builds == [root]
    assert "stopped before the driver" in capsys.readouterr().err


def test_a_config_that_reads_no_embedded_path_builds_nothing(builds, tmp_path):
    cfg = load_config(str(EMBEDDED_CONFIG), [f"model.path={tmp_path}/model", f"data.train_path={tmp_path}/train.jsonl",
                                             f"data.eval_path={tmp_path}/eval.jsonl"])
    jobs.embedded.ensure_embedded(cfg)
    assert builds == []
