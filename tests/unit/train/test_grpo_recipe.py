"""GRPO through the recipe on a real 2-process gloo group, without Ray: the rollout side is a Sampler in each rank's
process, the scorer the demo's reward file, checkpoints a directory.

- The sampler's log-probabilities of the tokens it sampled are the trainer's (FSDP2-sharded) log-probabilities of
  them, and the first optimizer step on fresh answers takes the ratio at 1.
- 1 and 2 workers take the same step on the same rollouts, for each loss variant.
- A run restored from a checkpoint taken between two optimizer steps on one batch of rollouts (num_iterations=2),
  or with a batch sampled ahead (max_staleness=1), samples and takes the very steps the uninterrupted run took.
"""

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from app.data.chat import IGNORE_INDEX
from app.data.formatting import tokenize_rows
from app.data.stream import RankStream
from app.model.base import load_tokenizer
from app.model.build import build_training_model
from app.model.sharding import build_device_mesh, trainable_parameters
from app.plan.plan import Plan
from app.runs.layout import RunDir
from app.train import rewards
from app.train.group import RankContext
from app.train.loss import sampled_token_logps
from app.train.objectives import GroupRelative
from app.train.ports import RecipeParts
from app.train.recipe import FinetuneRecipe
from app.train.rollouts import LocalRollouts, RolloutStream
from app.train.sampling import build_sampler
from tests.helpers import REPO, driver_plan, make_config, run_ranks
from tests.unit.train.test_recipe import DirectoryCheckpoints, RecordingTracker

pytestmark = pytest.mark.slow

REWARD_FILE = REPO / "jobs" / "rewards.py"
REWARDS = f"grpo.reward_funcs=[{REWARD_FILE}:exact_words, {REWARD_FILE}:words_in_place]"
GRPO = ["train.objective=grpo", REWARDS, "rollout.num_generations=4", "rollout.max_completion_tokens=8",
        "train.global_batch_size=16", "train.micro_batch_size=4", "model.dtype=float32", "fsdp.param_dtype=float32",
        "train.learning_rate=5e-3", "train.warmup_steps=0", "train.lr_schedule=constant", "data.max_seq_len=24"]


def _prompt_rows(cfg, tokenizer, path: str, count: int) -> dict:
    records = [json.loads(line) for line in Path(path).read_text().splitlines()[:count]]
    rows = tokenize_rows(records, tokenizer, "prompt", cfg.data.max_seq_len)
    return {k: v for k, v in rows.items() if k not in ("targets", "truncated")}


def _dealt(rows: dict, rank: int, world: int, size: int) -> list[dict]:
    """A rank's prompt rows (rank r: rows r, r + W, ...) in batches of `size`, as the pass coordinator deals them."""
    mine = {k: v[rank::world] if v.dtype == object else torch.as_tensor(v[rank::world]) for k, v in rows.items()}
    count = len(mine["prompt_length"])
    return [{k: v[i:i + size] for k, v in mine.items()} for i in range(0, count, size)]


def _grpo_rank(rank: int, world: int, embedded: dict, out: str, *overrides: str):
    data = [f"data.train_path={embedded['model'].parent / 'data' / 'grpo_train.jsonl'}",
            f"data.eval_path={embedded['model'].parent / 'data' / 'grpo_eval.jsonl'}"]
    cfg = make_config(Path(out), embedded, *GRPO, *data, *overrides)
    tokenizer = load_tokenizer(cfg.model)
    train_rows = _prompt_rows(cfg, tokenizer, cfg.data.train_path, 64)
    eval_rows = _prompt_rows(cfg, tokenizer, cfg.data.eval_path, 8)
    train_pass = lambda _: _dealt(train_rows, rank, world, Plan(cfg).rows_per_batch(world))  # noqa: E731
    eval_pass = lambda: _dealt(eval_rows, 0, 1, 4)  # noqa: E731
    scorer = functools.partial(rewards.score, cfg.grpo.reward_funcs)
    return cfg, RankContext(rank, world, torch.device("cpu")), train_pass, eval_pass, scorer


def _logps_agree(rank: int, world: int, embedded: dict, out: str) -> None:
    cfg, ctx, train_pass, _, scorer = _grpo_rank(rank, world, embedded, out, "grpo.num_iterations=2",
                                                 "rollout.temperature=0.7", "rollout.top_k=5")  # logps: before top_k
    model = build_training_model(cfg.model, cfg.lora, cfg.fsdp, build_device_mesh("cpu"), 0, ctx.device)
    with torch.no_grad():  # a trained adapter, not the no-op a fresh lora_B = 0 gives
        for p in trainable_parameters(model):
            p.to_local().add_(torch.randn_like(p.to_local()) * 0.05)
    sampler = build_sampler(cfg)
    stream = RolloutStream(RankStream(train_pass, ctx.device, rank=rank, world_size=world),
                           LocalRollouts(sampler, cfg.rollout), scorer, cfg, rank, load_tokenizer(cfg.model), model,
                           lambda: 0)
    batch = next(stream)
    logps, _ = sampled_token_logps(model, batch, 0, cfg.rollout.temperature)
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    result = {"sampler": (batch["sampler_logps"] - batch["old_logps"])[mask].abs().max().item(),
              "ratio": (logps - batch["old_logps"])[mask].abs().max().item(), "tokens": int(mask.sum()),
              "figures": stream.take_figures(1.0), "synced": sampler.version}
    torch.save(result, f"{out}/agree-{rank}.pt")


def test_the_samplers_log_probs_are_the_trainers_and_the_first_step_takes_the_ratio_at_one(embedded, tmp_path):
    run_ranks(_logps_agree, 2, embedded, str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"agree-{rank}.pt", weights_only=False)
        assert result["tokens"] > 0 and result["synced"] == 0  # the trained adapter reached the sampler first
        assert result["sampler"] < 1e-4, result  # the same tokens under the same policy (fp32)
        assert result["ratio"] < 1e-5, result  # old log-probs: the policy before any update
        figures = result["figures"]
        assert figures["rollout/sync_bytes"] > 0 and 0 <= figures["frac_reward_zero_std"] <= 1
        assert {"reward", "reward_std", "rewards/exact_words/mean", "rewards/words_in_place/std",
                "completions/mean_length", "completions/clipped_ratio"} <= figures.keys()


def _one_step(rank: int, world: int, embedded: dict, out: str, rollouts_file: str) -> None:
    """The gradient of one step of each loss variant on the same global batch of rollouts, this rank's share of it."""
    cfg, ctx, *_ = _grpo_rank(rank, world, embedded, out)
    everything = torch.load(rollouts_file, weights_only=False)
    results = {}
    for loss_type in ("grpo", "dr_grpo", "dapo"):
        step_cfg = cfg.with_set({"grpo.loss_type": loss_type})
        model = build_training_model(cfg.model, cfg.lora, cfg.fsdp, build_device_mesh("cpu"), 0, ctx.device)
        with torch.no_grad():
            for p in trainable_parameters(model):
                p.to_local().add_(0.01)
        objective = GroupRelative(step_cfg, None)
        mine = [{k: v[rank::world] for k, v in mb.items()} for mb in everything]
        normaliser = objective.normaliser(mine)
        for i, batch in enumerate(mine):
            model.set_requires_gradient_sync(i == len(mine) - 1)
            loss, _, _ = objective.micro_batch_loss(model, batch, normaliser, world)
            loss.backward()
        results[loss_type] = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save(results, f"{out}/step-{world}.pt")


def test_one_and_two_workers_take_the_same_step_on_the_same_rollouts(embedded, tmp_path):
    cfg, ctx, train_pass, _, scorer = _grpo_rank(0, 1, embedded, str(tmp_path))
    g = torch.Generator().manual_seed(0)
    batches = []
    for lengths in ((3, 6, 2, 8), (5, 1, 7, 4)):  # answers of several lengths, and advantages of both signs
        ids = torch.randint(4, 300, (4, 16), generator=g)
        labels = torch.full_like(ids, IGNORE_INDEX)
        for row, n in enumerate(lengths):
            labels[row, 6:6 + n] = ids[row, 6:6 + n]
        batches.append({"input_ids": ids, "labels": labels, "advantages": torch.randn(4, generator=g),
                        "real": torch.ones(4), "length": torch.full((4,), 16), "sampler_logps": torch.zeros(4, 15)})
    torch.save(batches, tmp_path / "rollouts.pt")
    for world in (1, 2):
        run_ranks(_one_step, world, embedded, str(tmp_path), str(tmp_path / "rollouts.pt"))
    one, two = (torch.load(tmp_path / f"step-{w}.pt", weights_only=False) for w in (1, 2))
    for loss_type in one:
        largest = max(g.abs().max().item() for g in one[loss_type].values())
        assert largest > 1e-3, loss_type  # a real gradient
        for name, gradient in one[loss_type].items():  # the same gradient: the same step, whatever the optimizer
            torch.testing.assert_close(two[loss_type][name], gradient, rtol=1e-4, atol=1e-6 * largest,
                                       msg=f"{loss_type} {name}")


def _train_twice(rank: int, world: int, embedded: dict, out: str, *overrides: str) -> None:
    cfg, ctx, train_pass, eval_pass, scorer = _grpo_rank(
        rank, world, embedded, out, "train.max_steps=6", "train.checkpoint_every=3", "train.eval_every=3",
        "train.log_every=1", "train.sample_prompts=2", *overrides)
    results = {}
    for name, restore_from in (("whole", None), ("restored", Path(out) / "whole" / "step3")):
        tracker = RecordingTracker()
        recipe = FinetuneRecipe(driver_plan(cfg), ctx, train_pass, eval_pass, RecipeParts(
            tracker, DirectoryCheckpoints(Path(out) / name, restore_from), RunDir(str(Path(out) / name)),
            rollouts=LocalRollouts(build_sampler(cfg), cfg.rollout), scorer=scorer))
        results[name] = {"summary": recipe.train(), "metrics": tracker.metrics}
    if rank == 0:
        (Path(out) / "results.json").write_text(json.dumps(results, default=float))


@pytest.mark.parametrize("overrides", [("grpo.num_iterations=2",),
                                       ("rollout.max_staleness=1", "rollout.importance_correction=tis")])
def test_a_restored_run_samples_and_takes_the_steps_the_uninterrupted_run_took(overrides, embedded, tmp_path):
    run_ranks(_train_twice, 2, embedded, str(tmp_path), *overrides)
    results = json.loads((tmp_path / "results.json").read_text())
    whole = {int(s): m for s, m in results["whole"]["metrics"].items()}
    restored = {int(s): m for s, m in results["restored"]["metrics"].items()}
    assert sorted(s for s in whole if "train_loss" in whole[s]) == list(range(1, 7))
    ahead = "rollout.max_staleness=1" in overrides  # a batch every step, sampled a step ahead; else every 2 steps
    assert [s for s in whole if "reward" in whole[s]] == ([1, 2, 3, 4, 5, 6] if ahead else [1, 3, 5])
    if ahead:
        assert [whole[s]["rollout/staleness_max"] for s in range(1, 7)] == [0, 1, 1, 1, 1, 1]
        assert whole[4]["rollout/staleness_max"] == restored[4]["rollout/staleness_max"] == 1  # kept in the checkpoint
        for step in range(2, 7):  # sampled by the adapter a step behind: the trainer's log-probs differ from it
            gap = whole[step]["sampling/sampling_logp_difference/mean"]
            assert 0 < gap < whole[step]["sampling/sampling_logp_difference/max"] < 50, (step, whole[step])
    assert {"eval_reward", "eval_rewards/exact_words/mean", "eval_exact_match"} <= whole[3].keys()
    assert np.isfinite([whole[s]["entropy"] for s in range(1, 7)]).all()
    for step in (4, 5, 6):  # step 4 trains the rollouts the checkpoint kept; 5 samples afresh, seeded alike
        for key in ("train_loss", "grad_norm", "reward", "entropy", "rollout/is_ratio_mean",
                    "sampling/sampling_logp_difference/max"):
            if key in whole[step]:
                assert restored[step][key] == pytest.approx(whole[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert results["restored"]["summary"]["final_eval_reward"] == pytest.approx(
        results["whole"]["summary"]["final_eval_reward"])
    assert (tmp_path / "whole" / "step3" / "stream-rank0.pt").exists()
    assert RunDir(str(tmp_path / "whole")).adapter_complete()
