"""Several adapters over one base in one worker group (`adapters:`) on a real 2-process gloo group, without Ray.

The design's proof: each adapter's steps equal those of the same adapter trained alone (fp32, 1e-5 relative,
every step), whatever its neighbours are, one of them diverging to NaN included, in a pass of its own or sharing
micro-batches with others (each copy of the rows through its adapter); a run restored from a
checkpoint takes the same steps; every exported adapter is a PEFT folder that reloads and scores its own eval
loss. Real PEFT, real FSDP2, real torch.distributed; batches are lists and checkpoints directories
(tests/unit/train/test_recipe.py).
"""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from app.data.formatting import tokenize_rows
from app.model.base import load_tokenizer
from app.runs.layout import ADAPTER_RUN_CONFIG, RunDir
from app.train.ports import RecipeParts
from app.train.recipe import FinetuneRecipe
from app.train.side_by_side import SideBySideRecipe
from tests.helpers import driver_plan, run_ranks
from tests.unit.train.test_recipe import DirectoryCheckpoints, RecordingTracker, _batches, _rank_inputs

pytestmark = pytest.mark.slow

# Together and alone, an adapter's rows meet other batch shapes: fp32 sums blocked otherwise round otherwise, and
# Adam carries that on (a grad norm 1.6e-5 apart after four steps on an AVX2 EPYC). A row given the wrong adapter or
# data is off by far more.
ALONE_REL = 1e-4
STEPS = ["train.max_steps=6", "train.log_every=1", "train.checkpoint_every=3", "train.eval_every=3",
         "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=4", "train.sample_prompts=0",
         "train.learning_rate=3e-3", "model.dtype=float32", "fsdp.param_dtype=float32", "lora.dropout=0.1"]
# blows_up's first update (~1e30) overflows every product of its next forward: non-finite on any CPU, where 1e9
# stayed finite on an AMX one
ADAPTERS = {"blows_up": "{name: blows_up, learning_rate: 1e+30, lr_schedule: constant}",  # shares rank4's passes
            "rank4": "{name: rank4, r: 4}",
            "slow": "{name: slow, r: 8, alpha: 8, learning_rate: 1e-3, lr_schedule: constant, warmup_steps: 0}"}


def _run(rank: int, world: int, embedded: dict, out: Path, reshard: bool, name: str, adapters: list[str],
         restore_from: Path | None = None) -> dict:
    # kept gathered: in bf16 (the mixed precision of a bf16 machine), each layer gathered once a step, each adapter
    # a pass of its own; resharded: fp32, two adapters sharing each micro-batch, the third in a pass alone
    steps = [*STEPS, f"fsdp.reshard_after_forward={reshard}",
             *(["train.adapters_per_micro_batch=2"] if reshard else ["fsdp.param_dtype=bfloat16",
                                                                     "train.adapters_per_micro_batch=1"])]
    steps += ["train.adapters_per_micro_batch=1"] if len(adapters) < 2 else []
    overrides = [*steps, f"adapters=[{', '.join(adapters)}]"] if adapters else [*steps, "lora.r=4"]
    cfg, ctx, train_pass, eval_pass = _rank_inputs(rank, world, embedded, str(out), *overrides)
    recipe = SideBySideRecipe if adapters else FinetuneRecipe
    tracker = RecordingTracker()
    parts = RecipeParts(tracker, DirectoryCheckpoints(out / name, restore_from), RunDir(str(out / name)))
    summary = recipe(driver_plan(cfg), ctx, train_pass, eval_pass, parts).train()
    return {"summary": summary, "metrics": tracker.metrics}


def _side_by_side_and_alone(rank: int, world: int, embedded: dict, out: str, reshard: bool) -> None:
    out = Path(out)
    results = {"together": _run(rank, world, embedded, out, reshard, "together", list(ADAPTERS.values()))}
    for name in ("rank4", "slow"):
        results[name] = _run(rank, world, embedded, out, reshard, name, [ADAPTERS[name]])
    results["plain"] = _run(rank, world, embedded, out, reshard, "plain", [])  # no adapters: section: lora.r=4
    results["restored"] = _run(rank, world, embedded, out, reshard, "restored", list(ADAPTERS.values()),
                               out / "together" / "step3")
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


def _curve(result: dict, key: str) -> dict[int, float]:
    return {int(step): m[key] for step, m in result["metrics"].items() if key in m}


@pytest.mark.parametrize("reshard_after_forward", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_each_adapter_trains_as_it_would_alone_and_a_diverging_one_stops_alone(embedded, tmp_path,
                                                                              reshard_after_forward):
    """Either way the layers are kept: gathered once a step for every adapter (reshard_after_forward false, here
    with bf16 compute and fp32 gradient reduction), or gathered for each forward and backward (fp32)."""
    run_ranks(_side_by_side_and_alone, 2, embedded, str(tmp_path), reshard_after_forward)
    results = json.loads((tmp_path / "results.json").read_text())
    together = results["together"]
    for name in ("rank4", "slow"):
        mine, alone = _curve(together, f"{name}/train_loss"), _curve(results[name], f"{name}/train_loss")
        assert sorted(mine) == list(range(1, 7)) and mine[6] < mine[1]
        for step in mine:
            assert mine[step] == pytest.approx(alone[step], rel=ALONE_REL), (name, step)
        for key in (f"{name}/eval_loss", f"{name}/learning_rate", f"{name}/grad_norm"):
            assert _curve(together, key) == pytest.approx(_curve(results[name], key), rel=ALONE_REL), key
    # one adapter alone in an adapters: section takes the steps of the plain single-adapter run
    assert _curve(results["rank4"], "rank4/train_loss") == pytest.approx(_curve(results["plain"], "train_loss"),
                                                                         rel=1e-5)
    blown, norms = _curve(together, "blows_up/train_loss"), _curve(together, "blows_up/grad_norm")
    last = max(blown)  # stopped at its first non-finite step: logged, then no more
    assert last < 6 and not (math.isfinite(blown[last]) and math.isfinite(norms[last]))
    assert all(math.isfinite(blown[step]) and math.isfinite(norms[step]) for step in blown if step < last)
    assert together["summary"]["blows_up/stopped"] == 1.0 and together["summary"]["rank4/stopped"] == 0.0
    assert _curve(together, "adapters_training")[6] == 2

    restored = results["restored"]
    for name in ADAPTERS:
        for step in (4, 5, 6):
            got, want = (_curve(run, f"{name}/train_loss").get(step) for run in (restored, together))
            assert got == pytest.approx(want, rel=1e-6, nan_ok=True), (name, step)

    # reloaded in fp32: the run's own figure to 1e-4 (fp32) or to bf16's rounding of the run's compute (2^-8: how
    # bf16 products round differs between CPUs, e.g. AMX against AVX2's fp32 emulation)
    _reloaded_adapters_score_their_eval_loss(embedded, tmp_path, together["summary"], 1e-4 if reshard_after_forward
                                             else 2**-8)


def _reloaded_adapters_score_their_eval_loss(embedded: dict, tmp_path: Path, summary: dict, rel: float) -> None:
    from peft import PeftModel

    from app.model.base import load_base_model
    from app.train.loss import summed_token_loss, target_token_count

    cfg, _, _, eval_pass = _rank_inputs(0, 1, embedded, str(tmp_path), *STEPS)
    assert RunDir(str(tmp_path / "together")).adapter_complete()
    for name in ("rank4", "slow"):
        folder = tmp_path / "together" / "adapter" / name
        model = PeftModel.from_pretrained(load_base_model(cfg.model), folder).eval()
        with torch.no_grad():
            total = sum(summed_token_loss(model, b).item() for b in eval_pass())
        tokens = sum(target_token_count(b["labels"]).item() for b in eval_pass())
        assert total / tokens == pytest.approx(summary[f"{name}/final_eval_loss"], rel=rel), name
        alone = yaml.safe_load((folder / ADAPTER_RUN_CONFIG).read_text())  # the config it would train alone with
        assert (alone["adapters"], alone["lora"]["r"]) == ([], {"rank4": 4, "slow": 8}[name])


TENANT = "{name: tenant, r: 8, learning_rate: 5e-3, train_path: tenant.jsonl, eval_path: tenant_eval.jsonl}"
TENANT_LR = TENANT.replace("tenant,", "tenant_lr,").replace("5e-3", "1e-3")  # the same data: the same stream


def _with_tenant_data(rank: int, world: int, embedded: dict, out: str, *overrides: str):
    """_rank_inputs, with the rows of the tenants' own data (`data` named: every adapter here with data of its own
    has the same): 44 other records (22 a rank: a pass ends in a micro-batch of 2 rows, beside the job's 4) and 12
    other eval records."""
    cfg, ctx, job_pass, job_eval = _rank_inputs(rank, world, embedded, out, *overrides)
    tokenizer = load_tokenizer(cfg.model)
    lines = lambda path, start, end: [json.loads(line) for line in Path(path).read_text().splitlines()[start:end]]
    rows = {data: tokenize_rows(lines(embedded[data], 64, 64 + n), tokenizer, cfg.data.format, cfg.data.max_seq_len)
            for data, n in (("train", 44), ("eval", 12))}
    micro = cfg.train.micro_batch_size
    train_pass = lambda pass_index, data="": (_batches(rows["train"], rank, world, micro) if data  # noqa: E731
                                              else job_pass(pass_index))
    eval_pass = lambda data="": _batches(rows["eval"], 0, 1, micro) if data else job_eval()  # noqa: E731
    return cfg, ctx, train_pass, eval_pass


def _tenant_runs(rank: int, world: int, embedded: dict, out: str) -> None:
    out, results = Path(out), {}
    steps = [*STEPS, "fsdp.reshard_after_forward=true"]
    together = [ADAPTERS["rank4"], TENANT, TENANT_LR]
    for name, adapters, shared, restore_from in (("together", together, 2, None), ("tenant", [TENANT], 1, None),
                                                 ("tenant_lr", [TENANT_LR], 1, None),
                                                 ("rank4", [ADAPTERS["rank4"]], 1, None),
                                                 ("restored", together, 2, "together/step3")):
        cfg, ctx, train_pass, eval_pass = _with_tenant_data(
            rank, world, embedded, str(out), *steps, f"train.adapters_per_micro_batch={shared}",
            f"adapters=[{', '.join(adapters)}]")
        tracker = RecordingTracker()
        checkpoints = DirectoryCheckpoints(out / name, restore_from and out / restore_from)
        parts = RecipeParts(tracker, checkpoints, RunDir(str(out / name)))
        summary = SideBySideRecipe(driver_plan(cfg), ctx, train_pass, eval_pass, parts).train()
        results[name] = {"summary": summary, "metrics": tracker.metrics}
    if rank == 0:
        (out / "results.json").write_text(json.dumps(results))


@pytest.mark.extended  # the shared-data case above runs in make test
def test_an_adapter_with_data_of_its_own_trains_on_it_as_it_would_alone(embedded, tmp_path):
    """fp32, two adapters sharing every micro-batch, each block its own adapter's rows: the job's for rank4, the
    tenant's own (whose pass ends in a smaller micro-batch) for tenant; tenant_lr, on the same data as tenant (the
    same stream), in a pass of its own; each evaluated on its own eval rows. A run restored from step 3 continues
    both streams where they stood."""
    run_ranks(_tenant_runs, 2, embedded, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    together = results["together"]
    for name in ("tenant", "tenant_lr", "rank4"):
        for key in ("train_loss", "eval_loss", "grad_norm", "step_tokens"):
            mine, alone = _curve(together, f"{name}/{key}"), _curve(results[name], f"{name}/{key}")
            assert mine and mine == pytest.approx(alone, rel=ALONE_REL), (name, key)
        for step in (4, 5, 6):
            assert _curve(results["restored"], f"{name}/train_loss")[step] == pytest.approx(
                _curve(together, f"{name}/train_loss")[step], rel=1e-6), (name, step)
    # other rows: the tenant's figures are not the job's data's
    assert _curve(together, "tenant/eval_loss")[0] != pytest.approx(_curve(together, "rank4/eval_loss")[0], rel=1e-3)
    assert _curve(together, "tenant/step_tokens") != _curve(together, "rank4/step_tokens")
