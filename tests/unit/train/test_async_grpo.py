"""GRPO's rollouts sampled ahead (rollout.max_staleness) and its verified adapter sync, on a real gloo group without
Ray: the rollout side is a Sampler in the rank's process, the model the FSDP2-sharded embedded one, each optimizer step
stood in for by a change of its LoRA weights.

- A batch trains at most max_staleness steps after the adapter that sampled it, and exactly that many once the
  pipeline is full; one sampled longer ago (a resumed run that now allows less) is sampled again, never trained.
- A sync the rollout side never received, or received changed, stops the run in one line.
"""

import re

import pytest
import torch

from app.data.stream import RankStream
from app.model.base import load_tokenizer
from app.model.build import build_training_model
from app.model.sharding import build_device_mesh, trainable_parameters
from app.train.rollouts import LocalRollouts, RolloutStream
from app.train.sampling import build_sampler
from tests.helpers import run_ranks
from tests.unit.train.test_grpo_recipe import _grpo_rank

pytestmark = pytest.mark.slow
STEPS = 5


class RecordingRollouts(LocalRollouts):
    """The adapter step each request asked for, in order."""

    def __init__(self, sampler, grpo):
        super().__init__(sampler, grpo)
        self.asked: list[int] = []

    def submit(self, prompts, seed, version):
        self.asked.append(version)
        return super().submit(prompts, seed, version)


class DroppingRollouts(LocalRollouts):
    """Receives the first sync only: every later one is lost on the way."""

    def sync(self, weights, version, checksum):
        if self.sampler.version < 0:
            super().sync(weights, version, checksum)


class CorruptingRollouts(LocalRollouts):
    """Every sync arrives with one weight changed."""

    def sync(self, weights, version, checksum):
        name = sorted(weights)[0]
        super().sync(weights | {name: weights[name] + 1e-3}, version, checksum)


def _stream(rank, world, embedded, out, rollouts_type, *overrides):
    cfg, ctx, train_pass, _, scorer = _grpo_rank(rank, world, embedded, out, *overrides)
    model = build_training_model(cfg.model, cfg.lora, cfg.fsdp, build_device_mesh("cpu"), 0, ctx.device)
    steps = [0]
    rollouts = rollouts_type(build_sampler(cfg), cfg.rollout)
    stream = RolloutStream(RankStream(train_pass, ctx.device, rank=rank, world_size=world), rollouts, scorer, cfg,
                           rank, load_tokenizer(cfg.model), model, lambda: steps[0])
    return model, stream, rollouts, steps


def _take_step(model, stream, steps) -> dict:
    """The step's micro-batches taken, as the recipe takes them; then the adapter changes, as an update would."""
    next(stream)
    while stream.buffer:
        next(stream)
    with torch.no_grad():
        for p in trainable_parameters(model):
            p.to_local().add_(0.01)
    steps[0] += 1
    return stream.take_figures(1.0)


def _sample_ahead(rank: int, world: int, embedded: dict, out: str, staleness: int) -> None:
    model, stream, rollouts, steps = _stream(rank, world, embedded, out, RecordingRollouts,
                                             f"rollout.max_staleness={staleness}", "rollout.importance_correction=tis")
    figures = [_take_step(model, stream, steps) for _ in range(STEPS)]
    batch, version, handle = stream.ahead[0] if stream.ahead else (None, None, None)
    if batch is not None:  # a batch sampled long ago (as a resume that now allows less would find it)
        stream.ahead[0] = (batch, version - staleness - 1, handle)
        rollouts.asked.clear()
        figures.append(_take_step(model, stream, steps))
    torch.save({"figures": figures, "asked": rollouts.asked, "run": stream.run_figures()}, f"{out}/ahead-{rank}.pt")


@pytest.mark.parametrize("staleness", [0, 1, 2])
def test_a_batch_trains_at_most_max_staleness_steps_after_the_adapter_that_sampled_it(staleness, embedded, tmp_path):
    run_ranks(_sample_ahead, 1, embedded, str(tmp_path), staleness)
    result = torch.load(tmp_path / "ahead-0.pt", weights_only=False)
    figures = result["figures"]
    assert [f["rollout/staleness_max"] for f in figures[:STEPS]] == [min(step, staleness) for step in range(STEPS)]
    assert all(f["rollout/completions"] == 16 and f["rollout/actor_restarts"] == 0 for f in figures)
    assert 0 <= figures[1]["rollout/trainer_idle_share"] and figures[1]["rollout/generated_tokens"] > 0
    assert result["run"]["completions_per_second"] > 0 and 0 <= result["run"]["trainer_idle_share"]
    if staleness:  # the stale batch was sampled again with the current adapter, then the pipeline refilled
        assert figures[-1]["rollout/staleness_max"] == 0 and result["asked"] == [STEPS] * 2


def _lose_a_sync(rank: int, world: int, embedded: dict, out: str, kind: str) -> None:
    rollouts_type = {"lost": DroppingRollouts, "changed": CorruptingRollouts}[kind]
    model, stream, _, steps = _stream(rank, world, embedded, out, rollouts_type)
    try:
        for _ in range(2):
            _take_step(model, stream, steps)
        message = "no error"
    except (RuntimeError, ValueError) as e:
        message = str(e)
    torch.save(message, f"{out}/sync-{rank}.pt")


@pytest.mark.parametrize("kind, says", [
    ("lost", r"^rank 0: the rollout side answered with the adapter of step 0 \(checksum \w+\) where step 1 "
             r"\(checksum \w+\) was asked for, at step 1: a sync was lost or changed; the run stops"),
    ("changed", r"^the adapter of step 0 arrived changed \(checksum \w+, sent \w+\): the sync is refused$")])
def test_a_lost_or_changed_sync_stops_the_run_in_one_line(kind, says, embedded, tmp_path):
    run_ranks(_lose_a_sync, 1, embedded, str(tmp_path), kind)
    message = torch.load(tmp_path / "sync-0.pt", weights_only=False)
    assert "\n" not in message
    assert re.search(says, message), message
