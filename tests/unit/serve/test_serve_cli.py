"""jobs.serve checks its arguments before Ray starts: one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from app.errors import UserInputError
from app.model.vllm_support import vllm_installed
from app.serve.engines import MERGED_AT_MOST
from tests.helpers import REPO


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    environment = {k: v for k, v in os.environ.items()  # nothing another test left in this process's environment
                   if k != "SERVE_API_KEY" and not k.startswith("MLFLOW_")} | (env or {})
    return subprocess.run([sys.executable, "-m", "jobs.serve", "--adapter", "demo=models:/demo/1", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=environment)


@pytest.mark.parametrize(("args", "says"), [
    (["--host", "0.0.0.0"], "--host 0.0.0.0: serving beyond loopback needs an API key"),
    (["--host", "10.1.2.3"], "--host 10.1.2.3: serving beyond loopback needs an API key"),
    (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key: No such file"),
    (["--max-batch-size", "0"], "--max-batch-size 0: must be positive"),
    (["--max-ongoing-requests", "4"], "--max-ongoing-requests 4: fewer than --max-batch-size 64"),
    (["--engine", "tgi"], "python -m jobs.serve: argument --engine: invalid choice: 'tgi'"),
    (["--request-timeout-s", "-1"], "--request-timeout-s -1.0: must be positive"),
    (["--metrics-port", "70000"], "--metrics-port 70000: a port number (0: a free one)"),
])
def test_a_bad_argument_is_refused_in_one_line_before_ray_starts(args, says):
    result = _serve(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().startswith(f"error: {says}") and len(result.stderr.strip().splitlines()) == 1


def test_the_key_comes_from_the_environment_or_a_file(tmp_path, monkeypatch):
    from jobs.serve import api_key, parse_args

    outside = ["--adapter", "a=b", "--host", "0.0.0.0"]
    monkeypatch.setenv("SERVE_API_KEY", "from-env")
    assert api_key(parse_args(outside)) == "from-env"
    (tmp_path / "key").write_text("from-file\n")
    assert api_key(parse_args([*outside, "--api-key-file", str(tmp_path / "key")])) == "from-file"
    monkeypatch.delenv("SERVE_API_KEY")
    assert api_key(parse_args(["--adapter", "a=b"])) is None  # loopback: a key is optional


def test_an_adapter_that_is_not_there_is_refused_before_ray_starts_without_the_trackers_password(tmp_path):
    """A folder or run that does not exist, and a registered version on a tracking server that does not answer:
    one line naming the --adapter, at once (no minutes of MLflow retries), and the URI's password nowhere."""
    from tests.helpers import free_port

    unregistered = _serve("--output-dir", str(tmp_path))  # no tracking URI and no local store there
    assert unregistered.returncode == 2 and len(unregistered.stderr.strip().splitlines()) == 1
    assert unregistered.stderr.startswith("error: --adapter demo=models:/demo/1: no registry to ask: set "
                                          "MLFLOW_TRACKING_URI")
    assert not (tmp_path / "mlflow.db").exists()  # a check creates no store
    from app.errors import UserInputError
    from jobs.serve import check_sources

    with pytest.raises(UserInputError, match=f"^--adapter local={tmp_path / 'nothing'}: neither an adapter folder"):
        check_sources({"local": str(tmp_path / "nothing")}, str(tmp_path))
    password = "serve_password_do_not_print_5e1c"
    down = _serve(env={"MLFLOW_TRACKING_URI": f"http://user:{password}@127.0.0.1:{free_port()}"})
    assert down.returncode == 2 and down.stderr.startswith("error: --adapter demo=models:/demo/1: ")
    assert len(down.stderr.strip().splitlines()) == 1
    assert password not in down.stdout + down.stderr


@pytest.mark.parametrize(("running", "argv", "says"), [
    # a first deploy bound every interface with a key; a keyless redeploy would have been served there to anyone
    (("0.0.0.0", 8000), [], "Serve already runs on this cluster at 0.0.0.0:8000, beyond loopback: a deploy "
                            "without an API key would answer anyone there"),
    # another address asked of a running proxy, which keeps its own
    (("127.0.0.2", 8000), [], "--host 127.0.0.1 --port 8000: Serve already runs on this cluster at 127.0.0.2:8000"),
    (("127.0.0.1", 8001), [], "deploy with --host 127.0.0.1 --port 8001"),
])
def test_a_deploy_the_running_proxy_would_not_honour_is_refused(running, argv, says):
    from jobs.serve import check_running_proxy, parse_args

    with pytest.raises(UserInputError) as error:
        check_running_proxy(running, parse_args(["--adapter", "a=x", *argv]), key=None)
    assert says in str(error.value) and "\n" not in str(error.value)
    check_running_proxy(("0.0.0.0", 8000), parse_args(["--adapter", "a=x", "--host", "0.0.0.0"]), key="k")  # the same
    check_running_proxy(None, parse_args(["--adapter", "a=x"]), key=None)  # none runs: serve.start binds ours


def test_vllm_asked_for_where_it_is_missing_or_cannot_run_the_model_is_one_line(embedded, tmp_path, monkeypatch):
    """Before Ray starts: the flag named and what to do; auto picks this project's engine instead."""
    import shutil

    import jobs.serve as serve_cli

    args = serve_cli.parse_args(["--adapter", f"a={embedded['model']}", "--engine", "vllm"])
    monkeypatch.setattr("app.model.vllm_support.vllm_installed", lambda: False)
    with pytest.raises(UserInputError, match=r"^--engine vllm: vLLM is not installed \(pip install '\.\[vllm\]'.*; or "
                                             r"serve with --engine transformers$"):
        serve_cli.engine_choice(args, {})
    auto = serve_cli.engine_choice(serve_cli.parse_args(["--adapter", "a=b"]), {})
    assert (auto.base, auto.adapters) == ("transformers", "transformers") and "not installed" in auto.reason
    monkeypatch.undo()
    if not vllm_installed():
        return
    odd = shutil.copytree(embedded["model"], tmp_path / "odd")
    (odd / "config.json").write_text((odd / "config.json").read_text().replace("LlamaForCausalLM", "NoSuchForCausalLM"))
    args = serve_cli.parse_args(["--adapter", "a=b", "--engine", "vllm", "--base", str(odd)])
    with pytest.raises(UserInputError, match="^--engine vllm: vLLM does not run NoSuchForCausalLM; or serve with"):
        serve_cli.engine_choice(args, {})
    auto = serve_cli.engine_choice(serve_cli.parse_args(["--adapter", "a=b", "--base", str(odd)]), {})
    assert (auto.base, auto.adapters) == ("transformers", "transformers") and "NoSuchForCausalLM" in auto.reason


@pytest.mark.skipif(not vllm_installed(), reason="vLLM is not installed")
def test_auto_on_a_cpu_serves_the_base_on_vllm_and_a_few_mergeable_adapters_merged(adapters, tmp_path):
    """vLLM with LoRA off for the base; each adapter merged into an engine of its own while they are few and
    mergeable; otherwise this project's engine for the adapters, saying why."""
    import shutil

    import jobs.serve as serve_cli

    def choice(served: dict[str, str]):
        specs = [arg for name, source in served.items() for arg in ("--adapter", f"{name}={source}")]
        made = serve_cli.engine_choice(serve_cli.parse_args(specs), served)
        return made.base, made.adapters, made.reason

    assert choice(adapters)[:2] == ("vllm", "vllm-merged")
    many = {f"a{i}": adapters["noisy"] for i in range(MERGED_AT_MOST + 1)}
    assert choice(many)[:2] == ("vllm", "transformers")
    patterned = shutil.copytree(adapters["noisy"], tmp_path / "patterned")
    config = json.loads((patterned / "adapter_config.json").read_text())
    (patterned / "adapter_config.json").write_text(json.dumps(config | {"rank_pattern": {"q_proj": 4}}))
    base, served_by, reason = choice({"plain": adapters["noisy"], "patterned": str(patterned)})
    assert (base, served_by) == ("vllm", "transformers") and "rank_pattern is set" in reason


def test_a_replica_serves_the_adapters_on_its_own_engine_where_one_does_not_merge(adapters, tmp_path):
    """A registered version is first seen by the replica: one the merge cannot take turns auto's merged engines
    into this project's engine for the adapters, saying why, rather than failing the replica."""
    import shutil

    from app.serve.engines import Choice
    from app.serve.models import served_files
    from app.serve.server import mergeable

    patterned = shutil.copytree(adapters["noisy"], tmp_path / "patterned")
    config = json.loads((patterned / "adapter_config.json").read_text())
    (patterned / "adapter_config.json").write_text(json.dumps(config | {"rank_pattern": {"q_proj": 4}}))
    merged = Choice("vllm", "vllm-merged", "auto")
    assert mergeable(merged, served_files({"plain": adapters["noisy"]})) == merged
    fallen = mergeable(merged, served_files({"plain": adapters["noisy"], "patterned": str(patterned)}))
    assert (fallen.base, fallen.adapters) == ("vllm", "transformers") and "rank_pattern is set" in fallen.reason
