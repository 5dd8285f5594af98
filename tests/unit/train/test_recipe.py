"""The recipe on a real 2-process gloo group, without Ray: batches are lists, checkpoints a directory.

It learns, and a run restored from its step-4 checkpoint takes the same steps 5-8 as the
uninterrupted run: the checkpoint holds everything a step depends on (LoRA weights, AdamW state, LR
schedule, data position). Early stopping ends a run whose eval gets worse, restored or not, and the
exported adapter is the best evaluation's.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from app.data.formatting import tokenize_rows
from app.model.base import load_tokenizer
from app.model.hardware import has_fast_bf16, resolve_dtype
from app.runs.layout import RunDir
from app.train.group import RankContext
from app.train.ports import RecipeParts
from app.train.recipe import FinetuneRecipe
from tests.helpers import driver_plan, make_config, run_ranks

pytestmark = pytest.mark.slow  # make test runs it, make test-fast does not

STEPS = ["train.max_steps=8", "train.log_every=1", "train.checkpoint_every=4", "train.eval_every=4",
         "train.warmup_steps=1", "train.global_batch_size=16", "train.micro_batch_size=4", "train.sample_prompts=1",
         "train.sample_max_new_tokens=4", "train.learning_rate=3e-3"]


class DirectoryCheckpoints:
    """Checkpoints as plain directories (what Ray Train does across nodes, here on one disk)."""

    def __init__(self, root: Path, restore_from: Path | None = None, notice_at_step: int | None = None):
        self.root, self.restore_from = root, restore_from
        self.notice_at_step, self.steps = notice_at_step, 0  # a drain notice from that step on (a fresh run)

    def restore(self, load):
        return load(self.restore_from) if self.restore_from else None

    def save(self, write, metrics):
        directory = self.root / f"step{metrics['step']}"
        directory.mkdir(parents=True, exist_ok=True)
        write(directory)

    def registration_seconds(self):
        return 0.0

    def preemption_deadline(self):
        self.steps += 1
        return 4102444800.0 if self.notice_at_step and self.steps >= self.notice_at_step else None


class RecordingTracker:
    logged_through = -1

    def __init__(self):
        self.metrics: dict[int, dict[str, float]] = {}
        self.params: dict[str, str] = {}

    def log_metrics(self, metrics, step, once_per_step=True):
        self.metrics.setdefault(step, {}).update(metrics)

    def log_params(self, params):
        self.params.update(params)

    def log_artifacts(self, local_dir, artifact_path): ...
    def log_table(self, data, artifact_file): ...


def _batches(rows: dict, rank: int, world: int, micro: int) -> list[dict]:
    """Unpacked rows dealt to the ranks, as the pass coordinator hands them out (one data source)."""
    columns = [k for k in rows if k.endswith(("input_ids", "labels", "length"))]  # pairs: both sides' columns
    mine = {k: torch.as_tensor(rows[k][rank::world]) for k in columns}
    mine["records"] = torch.ones(len(mine["length"]), 1, dtype=torch.int64)
    return [{k: v[i:i + micro] for k, v in mine.items()} for i in range(0, len(mine["length"]), micro)]


def _rank_inputs(rank: int, world: int, embedded: dict, out: str, *overrides: str):
    cfg = make_config(Path(out), embedded, *overrides)
    tokenizer = load_tokenizer(cfg.model)
    read = lambda path, n: [json.loads(line) for line in Path(path).read_text().splitlines()[:n]]  # noqa: E731
    train_rows = tokenize_rows(read(cfg.data.train_path, 64), tokenizer, cfg.data.format, cfg.data.max_seq_len)
    eval_rows = tokenize_rows(read(cfg.data.eval_path, 16), tokenizer, cfg.data.format, cfg.data.max_seq_len)
    ctx = RankContext(rank, world, torch.device("cpu"))
    train_pass = lambda pass_index: _batches(train_rows, rank, world, cfg.train.micro_batch_size)  # noqa: E731
    eval_pass = lambda: _batches(eval_rows, 0, 1, cfg.train.micro_batch_size)  # noqa: E731
    return cfg, ctx, train_pass, eval_pass


def _train_twice(rank: int, world: int, embedded: dict, out: str, *overrides: str) -> None:
    """The whole run (told at step 6 that a node will be reclaimed), then the same run restored from its first
    checkpoint (train.checkpoint_every)."""
    cfg, ctx, train_pass, eval_pass = _rank_inputs(rank, world, embedded, out, *overrides)
    results = {}
    first_checkpoint = Path(out) / "whole" / f"step{cfg.train.checkpoint_every}"
    for name, restore_from in (("whole", None), ("restored", first_checkpoint)):
        tracker = RecordingTracker()
        checkpoints = DirectoryCheckpoints(Path(out) / name, restore_from, 6 if name == "whole" else None)
        parts = RecipeParts(tracker, checkpoints, RunDir(str(Path(out) / name)))
        summary = FinetuneRecipe(driver_plan(cfg), ctx, train_pass, eval_pass, parts).train()
        results[name] = {"summary": summary, "metrics": tracker.metrics, "params": tracker.params}
    if rank == 0:
        (Path(out) / "results.json").write_text(json.dumps(results))


def test_the_recipe_learns_and_a_restored_run_takes_the_same_steps(embedded, tmp_path):
    run_ranks(_train_twice, 2, embedded, str(tmp_path), *STEPS)
    results = json.loads((tmp_path / "results.json").read_text())
    whole, restored = results["whole"], results["restored"]
    loss = {int(step): m["train_loss"] for step, m in whole["metrics"].items() if "train_loss" in m}
    assert sorted(loss) == list(range(1, 9))
    assert {int(s) for s, m in whole["metrics"].items() if "preemption_notice_seconds_left" in m} == {6}
    # the notice's out-of-schedule checkpoint, once, beside the scheduled and the final ones
    assert sorted(p.name for p in (tmp_path / "whole").glob("step*")) == ["step4", "step6", "step8"]
    assert whole["summary"]["final_eval_loss"] < 0.8 * whole["summary"]["initial_eval_loss"]
    assert loss[8] < loss[1]

    resumed = {int(step): m for step, m in restored["metrics"].items()}
    assert resumed[4]["resumed_from_step"] == 4 and min(s for s in resumed if "train_loss" in resumed[s]) == 5
    for step in range(5, 9):
        assert resumed[step]["train_loss"] == pytest.approx(loss[step], rel=1e-6), step
        assert resumed[step]["learning_rate"] == pytest.approx(whole["metrics"][str(step)]["learning_rate"])
    assert restored["summary"]["final_eval_loss"] == pytest.approx(whole["summary"]["final_eval_loss"], rel=1e-6)
    assert restored["summary"]["initial_eval_loss"] == whole["summary"]["initial_eval_loss"]
    for name in ("whole", "restored"):
        assert (tmp_path / name / "adapter" / "adapter_model.safetensors").exists()
        assert RunDir(str(tmp_path / name)).adapter_complete()
    # the embedded config's `auto` dtypes resolve by this machine's hardware, and the choice is logged
    expected = resolve_dtype("auto", has_fast_bf16(torch.device("cpu")))
    assert {k: v for k, v in whole["params"].items() if k.startswith("resolved.")} == {
        "resolved.model.dtype": expected, "resolved.fsdp.param_dtype": expected, "resolved.model.compile": False}
    assert whole["params"]["plan.fsdp.param_dtype"].startswith(expected)  # and why


EARLY_STOP = ["train.max_steps=16", "train.log_every=1", "train.checkpoint_every=4", "train.eval_every=2",
              "train.warmup_steps=0", "train.global_batch_size=16", "train.micro_batch_size=4",
              "train.learning_rate=0.3", "train.lr_schedule=constant", "train.early_stopping_patience=2",
              "train.export=best", "train.best_metric=eval_exact_match", "eval.generation_rows=6",
              "eval.max_new_tokens=4", "eval.metrics=[exact_match, contains]",
              "model.dtype=float32", "fsdp.param_dtype=float32"]  # the reload below computes in fp32 too


def test_early_stopping_ends_a_run_whose_task_metric_stalls_and_exports_the_best_evaluation(embedded, tmp_path):
    """The eval loss falls fast, but four steps cannot teach a random model to spell a number: exact
    match stays 0, no evaluation beats step 0's, and two evaluations later (step 4) the run stops, restored
    from its step-4 checkpoint or not. The exported adapter is step 0's: reloaded in plain PEFT it scores
    the untrained eval loss, not the last step's."""
    from peft import PeftModel

    from app.model.base import load_base_model
    from app.train.loss import summed_token_loss, target_token_count

    run_ranks(_train_twice, 2, embedded, str(tmp_path), *EARLY_STOP)
    results = json.loads((tmp_path / "results.json").read_text())
    whole, restored = results["whole"], results["restored"]
    summary = whole["summary"]
    assert (summary["stopped_early"], summary["steps"], summary["best_step"], summary["best_value"]) == (1.0, 4, 0, 0.0)
    for key in ("steps", "best_step", "best_value", "stopped_early"):
        assert restored["summary"][key] == summary[key], key
    evaluated = {int(step): m for step, m in whole["metrics"].items() if "eval_loss" in m}
    assert sorted(evaluated) == [0, 2, 4]
    assert all(0.0 <= m["eval_exact_match"] <= m["eval_contains"] <= 1.0 for m in evaluated.values())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.5  # the last weights differ

    cfg, ctx, _, eval_pass = _rank_inputs(0, 1, embedded, str(tmp_path), *EARLY_STOP)
    for name in ("whole", "restored"):
        model = PeftModel.from_pretrained(load_base_model(cfg.model), tmp_path / name / "adapter").eval()
        with torch.no_grad():
            total = sum(summed_token_loss(model, b).item() for b in eval_pass())
        tokens = sum(target_token_count(b["labels"]).item() for b in eval_pass())
        assert total / tokens == pytest.approx(summary["initial_eval_loss"], rel=1e-4), name


def _dpo(embedded: dict, *overrides: str) -> list[str]:
    data = Path(embedded["train"]).parent
    return ["train.objective=dpo", f"data.train_path={data / 'preference_train.jsonl'}",
            f"data.eval_path={data / 'preference_eval.jsonl'}", "train.best_metric=eval_rewards/accuracies",
            "train.max_steps=6", "train.eval_every=3", "train.log_every=1", "train.checkpoint_every=3",
            "train.warmup_steps=0", "train.global_batch_size=16",
            "train.micro_batch_size=4", "train.learning_rate=1e-3", "train.sample_prompts=2",
            "train.sample_max_new_tokens=4", "eval.generation_rows=0", "dpo.beta=0.1",
            "model.dtype=float32", "fsdp.param_dtype=float32", *overrides]  # fp32: 1 and 2 workers agree closely


def test_dpo_takes_the_same_steps_on_one_and_two_workers_resumes_exactly_and_prefers_the_chosen_answers(
        embedded, tmp_path):
    """The same 16 pairs per step, as 4 micro-batches on one worker or 2 x 2 on two: the same DPO loss and
    rewards at every step (evaluating before the first step or not); restored from its step-3 checkpoint, the
    2-worker run takes the same steps 4-6.
    Training raises the chosen answers' reward above the rejected ones'."""
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"world{world}"
        run_ranks(_train_twice, world, embedded, str(out), *_dpo(embedded, f"scaling.num_workers={world}",
                                                                 f"train.eval_on_start={world == 2}"))
        runs[world] = json.loads((out / "results.json").read_text())["whole"]
        if world == 2:
            restored = json.loads((out / "results.json").read_text())["restored"]
    one, two = ({int(step): m for step, m in runs[w]["metrics"].items()} for w in (1, 2))
    for step in range(4, 7):
        assert restored["metrics"][str(step)]["train_loss"] == pytest.approx(two[step]["train_loss"], rel=1e-6)
    for step in range(1, 7):
        for key in ("train_loss", "logps/chosen", "logps/rejected", "step_pairs"):
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4), (step, key)
        # differences of summed fp32 log-probs: rounding in another reduction order, and at most one tied pair
        assert two[step]["rewards/margins"] == pytest.approx(one[step]["rewards/margins"], abs=1e-3), step
        assert two[step]["rewards/accuracies"] == pytest.approx(one[step]["rewards/accuracies"], abs=1 / 16), step
    assert one[1]["train_loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy = reference at the start
    assert two[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-4) and two[0]["eval_rewards/margins"] == 0
    # without train.eval_on_start (the default) step 0 logs the start-up clock only, and the summary no initial loss
    assert not any(k.startswith("eval_") for k in one[0]) and math.isnan(runs[1]["summary"]["initial_eval_loss"])
    summary = runs[2]["summary"]
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["final_eval_rewards/margins"] > 0 and summary["final_eval_rewards/accuracies"] > 0.5
    # every LoRA weight is saved, trained (the reference's adapter switch leaves the sharded weights trainable)
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "world2" / "whole" / "adapter" / "adapter_model.safetensors")
    assert len(saved) == 4 * 7 * 2 and all(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)


def _sft_then_dpo(rank: int, world: int, embedded: dict, out: str) -> None:
    """An SFT run; a second SFT run and a DPO run that both start from its adapter (model.init_adapter), read
    slice by slice (model.load=sharded)."""
    from app.model.adapter import read_adapter_weights

    fp32 = ["model.dtype=float32", "fsdp.param_dtype=float32", "train.eval_on_start=true"]
    results = {}
    for name, overrides, start in (
            ("sft", [*STEPS, "train.max_steps=4", *fp32], None),
            ("sft_again", [*STEPS, "train.max_steps=1", "model.load=sharded", *fp32], "sft"),
            ("dpo", _dpo(embedded, "train.max_steps=3", "train.checkpoint_every=3", "model.load=sharded", *fp32),
             "sft")):
        cfg, ctx, train_pass, eval_pass = _rank_inputs(rank, world, embedded, out, *overrides)
        tracker = RecordingTracker()
        weights = read_adapter_weights(Path(out) / start / "adapter") if start else None
        parts = RecipeParts(tracker, run_dir=RunDir(str(Path(out) / name)), init_adapter=weights)
        summary = FinetuneRecipe(driver_plan(cfg), ctx, train_pass, eval_pass, parts).train()
        results[name] = {"summary": summary, "metrics": tracker.metrics}
        torch.distributed.barrier()  # rank 0 writes the adapter after the run's last collective
    if rank == 0:
        (Path(out) / "results.json").write_text(json.dumps(results))


def test_a_run_starts_from_a_trained_adapter_and_dpo_measures_against_it(embedded, tmp_path):
    """SFT, then DPO from its adapter: the DPO run's policy and its reference both start as the SFT adapter (step 0:
    zero margins, a loss of log 2, chosen answers likelier than under a fresh adapter), the reference stays
    frozen while the policy moves, and the saved adapter is the trained one alone. An SFT run that starts from
    the adapter evaluates, before its first step, to exactly the eval loss the first run reported at its end."""
    from safetensors.torch import load_file

    run_ranks(_sft_then_dpo, 2, embedded, str(tmp_path))
    results = json.loads((tmp_path / "results.json").read_text())
    sft, again, dpo = (results[name]["summary"] for name in ("sft", "sft_again", "dpo"))
    assert again["initial_eval_loss"] == pytest.approx(sft["final_eval_loss"], rel=1e-5)
    assert sft["final_eval_loss"] < sft["initial_eval_loss"] - 0.5

    start = results["dpo"]["metrics"]["0"]
    assert start["eval_loss"] == pytest.approx(math.log(2), abs=1e-6) and start["eval_rewards/margins"] == 0
    steps = {int(s): m for s, m in results["dpo"]["metrics"].items() if "train_loss" in m}
    assert steps[1]["train_loss"] == pytest.approx(math.log(2), abs=1e-6)  # the reference is the policy's start
    # the reference stays where the policy started: the policy's margins over it grow on the pairs it trains on
    # (held-out pairs after 3 steps from a 4-step SFT go either way; the DPO test above trains longer for those)
    assert steps[3]["rewards/margins"] > 0 and steps[3]["train_loss"] < math.log(2)

    fresh = _figures_of_a_fresh_dpo_start(embedded, tmp_path / "fresh")
    assert start["eval_logps/chosen"] > fresh["eval_logps/chosen"] + 1  # SFT made the right spellings likelier
    saved, sft_saved = (load_file(tmp_path / name / "adapter" / "adapter_model.safetensors") for name in ("dpo", "sft"))
    assert saved.keys() == sft_saved.keys() and len(saved) == 4 * 7 * 2  # no reference weights exported
    assert any(not torch.equal(saved[k], sft_saved[k]) for k in saved)  # the policy moved from its start


def _fresh_dpo_start(rank: int, world: int, embedded: dict, out: str) -> None:
    cfg, ctx, train_pass, eval_pass = _rank_inputs(rank, world, embedded, out, *_dpo(
        embedded, "model.dtype=float32", "fsdp.param_dtype=float32"))
    recipe = FinetuneRecipe(driver_plan(cfg), ctx, train_pass, eval_pass)
    recipe.setup()
    (Path(out) / "fresh.json").write_text(json.dumps(recipe.evaluate()))


def _figures_of_a_fresh_dpo_start(embedded: dict, out: Path) -> dict:
    """The step-0 evaluation of a DPO run with a fresh adapter (the base, as policy and reference)."""
    out.mkdir()
    run_ranks(_fresh_dpo_start, 1, embedded, str(out))
    return json.loads((out / "fresh.json").read_text())
