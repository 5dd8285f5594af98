import pickle
from pathlib import Path

import pytest

from app.config.loading import load_config
from app.errors import UserInputError
from app.plan.dtypes import dtype_decisions
from app.plan.plan import Plan
from tests.helpers import EMBEDDED_CONFIG


def test_yaml_and_dotted_overrides_are_typed_and_validated():
    cfg = load_config(EMBEDDED_CONFIG, ["lora.r=4", "train.max_steps=7", "lora.target_modules=[q_proj, v_proj]",
                                        "scaling.use_gpu=false", "mlflow.experiment=x"])
    assert (cfg.lora.r, cfg.train.max_steps, cfg.lora.target_modules) == (4, 7, ["q_proj", "v_proj"])
    assert cfg.lora.alpha == 32  # untouched keys keep the file's values
    assert Plan(cfg).grad_accum_steps == 1


def test_relative_paths_become_absolute_and_tracking_defaults_to_a_local_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(EMBEDDED_CONFIG, [f"train.output_dir={tmp_path}"])
    assert Path(cfg.model.path).is_absolute() and Path(cfg.data.train_path).is_absolute()
    assert cfg.mlflow.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert cfg.train.run_name.startswith("embedded-")
    assert load_config(None, ["model.path=meta-llama/Llama-3.1-8B"]).model.path == "meta-llama/Llama-3.1-8B"


def test_workers_receive_the_same_config():
    cfg = load_config(EMBEDDED_CONFIG, ["train.run_name=r1"])
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # what Ray ships to each worker


def test_gradient_accumulation_keeps_the_global_batch():
    one = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=4", "scaling.num_workers=1"])
    two = load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=4", "scaling.num_workers=2"])
    assert (Plan(one).grad_accum_steps, Plan(two).grad_accum_steps) == (4, 2)


def test_an_elastic_run_keeps_its_global_batch_on_every_worker_count_it_may_shrink_to():
    cfg = load_config(None, ["train.global_batch_size=24", "train.micro_batch_size=2", "scaling.num_workers=4",
                             "scaling.min_workers=2"])
    assert cfg.scaling.elastic and list(cfg.scaling.worker_counts) == [2, 3, 4]
    assert [Plan(cfg).grad_accum_steps_on(workers) for workers in cfg.scaling.worker_counts] == [6, 4, 3]
    with pytest.raises(UserInputError, match=r"multiple of train.micro_batch_size x 3 workers = 6 \(an elastic "
                                             r"group may shrink to scaling.min_workers=3\); change one of them$"):
        load_config(None, ["train.global_batch_size=16", "train.micro_batch_size=2", "scaling.num_workers=4",
                           "scaling.min_workers=3"])
    with pytest.raises(UserInputError, match="scaling.min_workers=3 is more than scaling.num_workers=2"):
        load_config(None, ["scaling.min_workers=3"])
    with pytest.raises(UserInputError, match="an HSDP mesh is for a fixed worker count"):
        load_config(None, ["scaling.num_workers=4", "scaling.mesh=[2,2]", "scaling.min_workers=2",
                           "train.global_batch_size=48"])
    fixed = load_config(None, ["scaling.min_workers=2"])  # min = num: a fixed group
    assert not fixed.scaling.elastic and list(fixed.scaling.worker_counts) == [2]


@pytest.mark.parametrize("override, message", [
    ("lora.rank=8", "unknown key (did you mean lora.r?)"),
    ("training.max_steps=8", "unknown key"),
    ("train.max_steps=many", "train.max_steps: Input should be a valid integer"),
    ("lora.dropout=1.5", "lora.dropout"),
    ("scaling.num_workers=0", "scaling.num_workers"),
    ("train.global_batch_size=30", "must be a multiple of train.micro_batch_size x scaling.num_workers"),
    ("train.max_steps", "expected key=value"),
    ("fsdp.cpu_offload=true", "fsdp.cpu_offload=true moves GPU state to host memory"),
    ("scaling.mesh=[2,2]", "scaling.mesh=[2, 2] must be [replicas, shard size]"),
])
def test_bad_values_get_one_line_naming_the_key(override, message):
    with pytest.raises(UserInputError) as e:
        load_config(EMBEDDED_CONFIG, [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_unknown_key_in_the_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("lora:\n  r: 8\n  alpah: 16\n")
    with pytest.raises(UserInputError, match=r"bad.yaml: unknown key 'lora.alpah' \(did you mean lora.alpha\?\)"):
        load_config(bad)


def test_missing_config_file():
    with pytest.raises(UserInputError, match="no such file"):
        load_config("jobs/configs/nope.yaml")


@pytest.mark.parametrize("path", sorted((EMBEDDED_CONFIG.parent).glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    micro = 1 if cfg.train.micro_batch_size == "auto" else cfg.train.micro_batch_size  # auto: resolved at launch
    assert cfg.train.global_batch_size % (micro * cfg.scaling.num_workers) == 0


def test_the_tracking_server_comes_from_the_environment_unless_the_config_names_one(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")  # what jobs/runtime_env.yaml sets
    assert load_config(EMBEDDED_CONFIG).mlflow.tracking_uri == "http://mlflow:5000"
    assert load_config(EMBEDDED_CONFIG, ["mlflow.tracking_uri=http://other:5000"]).mlflow.tracking_uri == "http://other:5000"


def test_the_config_reference_in_docs_matches_the_code():
    from app.config.reference import main

    assert main(["--check"]) == 0, "run `make docs` and commit docs/config.md"


def test_a_mixture_needs_one_positive_weight_per_source(tmp_path):
    two = ["data.train_path=[a.jsonl, b.jsonl]"]
    cfg = load_config(EMBEDDED_CONFIG, [*two, "data.mixture_weights=[0.7, 0.3]"])
    assert cfg.data.train_paths[1].endswith("b.jsonl") and cfg.data.mixture_weights == [0.7, 0.3]
    for weights in ("[1.0]", "[1.0, 0]"):
        with pytest.raises(UserInputError, match=r"data.mixture_weights=.* must give one positive weight for each of "
                                                 r"the 2 sources"):
            load_config(EMBEDDED_CONFIG, [*two, f"data.mixture_weights={weights}"])


def test_fp16_compute_without_loss_scaling_is_refused_and_auto_resolves_by_hardware():
    with pytest.raises(UserInputError, match="fsdp.param_dtype=float16 needs loss scaling"):
        load_config(EMBEDDED_CONFIG, ["fsdp.param_dtype=float16"])
    cfg = load_config(EMBEDDED_CONFIG)
    assert (cfg.model.dtype, cfg.fsdp.param_dtype) == ("auto", "auto")
    assert Plan(cfg).decided(*dtype_decisions(cfg, fast_bf16=True)).cfg.fsdp.param_dtype == "bfloat16"
    assert Plan(cfg).decided(*dtype_decisions(cfg, fast_bf16=False)).cfg.model.dtype == "float32"


def test_a_chat_template_file_travels_as_its_text(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_config(EMBEDDED_CONFIG, [f"data.chat_template={template}"]).data.chat_template == template.read_text()
    with pytest.raises(UserInputError, match="data.chat_template=nope.jinja: neither a Jinja template"):
        load_config(EMBEDDED_CONFIG, ["data.chat_template=nope.jinja"])
