"""`adapters:`: what each adapter may set, what stays the job's, and the one-line errors of what it may not."""

from pathlib import Path

import pytest

from app.config.adapters import data_streams
from app.config.loading import load_config
from app.errors import UserInputError
from tests.helpers import EMBEDDED_CONFIG

TWO = "adapters=[{name: fast, learning_rate: 5e-3, warmup_steps: 0}, {name: small, r: 4, target_modules: [q_proj]}]"


def test_each_adapter_is_the_job_config_with_its_own_keys():
    cfg = load_config(EMBEDDED_CONFIG, [TWO, "lora.alpha=64"])
    loras = cfg.trained_lora()
    assert (loras["fast"].r, loras["fast"].alpha, loras["small"].r, loras["small"].target_modules) == (
        16, 64.0, 4, ["q_proj"])
    fast = cfg.adapters[0].train_of(cfg.train)
    assert (fast.learning_rate, fast.warmup_steps, fast.max_steps) == (5e-3, 0, cfg.train.max_steps)
    alone = cfg.adapter_alone(cfg.adapters[1])  # the config it would train with alone
    assert (alone.adapters, alone.lora.r, alone.lora.alpha, alone.train.learning_rate) == ([], 4, 64.0, 2e-3)
    swept = load_config(EMBEDDED_CONFIG, [TWO, "tune.in_one_job=true"])  # a sweep's trial alone is no sweep
    assert not swept.adapter_alone(swept.adapters[0]).tune.in_one_job
    assert {k: v for k, v in cfg.flat().items() if k.startswith("adapters.")} == {
        "adapters.fast.learning_rate": 5e-3, "adapters.fast.warmup_steps": 0, "adapters.small.r": 4,
        "adapters.small.target_modules": ["q_proj"]}
    assert load_config(EMBEDDED_CONFIG).trained_lora() == load_config(EMBEDDED_CONFIG).lora  # no section: one


def test_an_adapter_with_its_own_data_trains_alone_on_it():
    cfg = load_config(EMBEDDED_CONFIG, ["adapters=[{name: tenant, train_path: [mine.jsonl, held.jsonl], "
                                        "mixture_weights: [3, 1]}, {name: job, eval_path: held.jsonl}, {name: same}, "
                                        "{name: tenant_lr, learning_rate: 1e-3, train_path: [mine.jsonl, held.jsonl], "
                                        "mixture_weights: [3.0, 1.0]}]"])
    tenant, job, same, _ = cfg.adapters
    assert tenant.train_path == [str(Path("mine.jsonl").resolve()), str(Path("held.jsonl").resolve())]  # absolute
    # a stream of rows per data: the job's (""), or the first adapter's with that data, shared by the others
    assert data_streams(cfg.adapters, cfg.data) == {"tenant": "tenant", "job": "job", "same": "", "tenant_lr": "tenant"}
    own = tenant.data_of(cfg.data)  # its own sources: its eval rows held out of them, not the job's eval set
    assert (own.mixture_weights, own.eval_path, own.max_seq_len) == ([3.0, 1.0], None, cfg.data.max_seq_len)
    assert job.data_of(cfg.data).train_path == cfg.data.train_path
    assert job.data_of(cfg.data).eval_path == str(Path("held.jsonl").resolve())
    alone = cfg.adapter_alone(tenant)
    assert (alone.data.train_path, alone.data.mixture_weights, alone.data.eval_path) == (
        tenant.train_path, [3.0, 1.0], None)
    assert cfg.adapter_alone(same).data == cfg.data


@pytest.mark.parametrize("overrides, message", [
    (["adapters=[{name: t1, train_path: [x.jsonl, y.jsonl], mixture_weights: [1]}]"],
     "adapters: t1's mixture_weights=[1.0] must give one positive weight for each of the 2 sources"),
    (["adapters=[{name: t1, split: test}]"], "'split' is the job's"),
    (["adapters=[{name: a1, max_seq_len: 64}]"], "'max_seq_len' is the job's, shared by every adapter"),
    (["adapters=[{name: a1, objective: dpo}]"], "'objective' is the job's"),
    (["adapters=[{name: x}, {name: x}]"], "x named more than once"),
    (["adapters=[{name: lr.1}]"], "name 'lr.1' must be"),
    (["adapters=[{name: default}]"], "not default or reference"),
    (["adapters=[{name: a}]"], "not part of 'lora_'"),
    (["adapters=[{name: b1, r: 0}]"], "adapters.0.r"),
    (["adapters.r=4"], "adapters is a list of entries, set whole"),
    ([TWO, "train.objective=dpo", "data.format=preference"], "adapters: train.objective=dpo is for a job of one"),
    ([TWO, "model.compile=true"], "adapters: model.compile=true is for a job of one"),
    ([TWO, "train.checkpoint_adapter=true"], "train.checkpoint_adapter=true is for a job of one"),
    (["train.adapters_per_micro_batch=2"], "train.adapters_per_micro_batch=2 is for a job of several adapters"),
    ([TWO, "train.adapters_per_micro_batch=3"], "more than the job's 2 adapters"),
    ([TWO, "train.adapters_per_micro_batch=2", "lora.use_dora=true"], "DoRA adapters take a pass each"),
])
def test_what_an_adapter_cannot_set_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(UserInputError) as error:
        load_config(EMBEDDED_CONFIG, overrides)
    assert message in str(error.value) and "\n" not in str(error.value)
