"""On-policy distillation (train.objective=distill):

- the per-token divergence is TRL's DistillationTrainer's (its own chunked function, run here on CPU): the same
  values and the same gradient for the student, for reverse KL, forward KL and the JSD, at a temperature;
- through the recipe on a real 2-process gloo group without Ray (the rollout side a Sampler in each rank's process),
  with the teacher a LoRA adapter on the same embedded base (frozen beside the student's), or a base of its own
  (every weight moved): the student's divergence from the teacher on its own greedy held-out answers falls, and its
  training loss with it.
"""

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

from app.config.loading import load_config
from app.errors import UserInputError
from app.model.adapter import FrozenAdapter, read_adapter_weights
from app.model.build import build_lora_model
from app.model.init_adapter import saved_lora_settings
from app.tracking.mlflow_run import check_same_teacher
from app.train.distill import generalized_jsd, over_shared_rows
from app.train.ports import RecipeParts
from app.train.recipe import FinetuneRecipe
from app.train.rollouts import LocalRollouts
from app.train.sampling import build_sampler
from tests.helpers import driver_plan, make_config, run_ranks
from tests.unit.train.test_grpo_recipe import GRPO, _grpo_rank
from tests.unit.train.test_recipe import RecordingTracker


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_the_divergence_and_its_gradient_are_trls(beta):
    torch.manual_seed(0)
    tokens, hidden, vocab, temperature = 6, 16, 50, 0.7
    student_hidden = torch.randn(tokens, hidden, requires_grad=True)
    teacher_hidden, student_head, teacher_head = torch.randn(tokens, hidden), torch.randn(vocab, hidden), \
        torch.randn(vocab, hidden)
    theirs, _ = ChunkedDivergenceFunction.apply(student_hidden, student_head, None, teacher_hidden, teacher_head, None,
                                                beta, temperature)
    (their_grad,) = torch.autograd.grad(theirs.sum(), student_hidden)
    student = torch.log_softmax(student_hidden @ student_head.T / temperature, -1)
    teacher = torch.log_softmax(teacher_hidden @ teacher_head.T / temperature, -1)
    ours = generalized_jsd(student, teacher, beta)
    (our_grad,) = torch.autograd.grad(ours.sum(), student_hidden)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-4, atol=1e-5)
    assert (ours > 0).all() and (generalized_jsd(student, student, beta).abs() < 1e-5).all()


def make_teacher(embedded: dict, folder: Path, tmp_path: Path) -> Path:
    """A teacher that answers otherwise than the base: a LoRA adapter of another rank, its weights drawn large."""
    cfg = load_config(None, [f"model.path={embedded['model']}", f"train.output_dir={tmp_path}", "lora.r=4",
                             "lora.alpha=8", "model.dtype=float32"])
    model = build_lora_model(cfg.model, cfg.lora, seed=3)
    torch.manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def make_teacher_base(embedded: dict, folder: Path) -> Path:
    """A teacher of its own base with the student's tokenizer: make_teacher's adapter merged into a copy of the
    embedded model, saved as a model (so the student's LoRA can learn it, as with the adapter beside it)."""
    base = AutoModelForCausalLM.from_pretrained(embedded["model"], dtype=torch.float32)
    adapter = make_teacher(embedded, folder.parent / f"{folder.name}-adapter", folder.parent)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(embedded["model"]).save_pretrained(folder)
    return folder


def _distill_rank(rank: int, world: int, embedded: dict, out: str, teacher: str, *extra: str) -> None:
    """`teacher`: distill.teacher_adapter=... (on the student's base) or distill.teacher=... (a base of its own)."""
    cfg, ctx, train_pass, eval_pass, _ = _grpo_rank(
        rank, world, embedded, out, "train.objective=distill", teacher, "grpo.reward_funcs=[]", "train.max_steps=8",
        "train.eval_every=8", "train.log_every=1", "train.eval_on_start=true", "rollout.temperature=1.0",
        "train.learning_rate=1e-2", *extra)
    folder = cfg.distill.teacher_adapter and Path(cfg.distill.teacher_adapter)
    teacher = folder and FrozenAdapter(saved_lora_settings(folder, "teacher"), read_adapter_weights(folder))
    tracker = RecordingTracker()
    parts = RecipeParts(tracker, teacher=teacher, rollouts=LocalRollouts(build_sampler(cfg), cfg.rollout))
    summary = FinetuneRecipe(driver_plan(cfg), ctx, train_pass, eval_pass, parts).train()
    if rank == 0:
        (Path(out) / "results.json").write_text(json.dumps({"summary": summary, "metrics": tracker.metrics},
                                                           default=float))


@pytest.mark.slow
def test_the_student_moves_toward_the_teacher_on_its_own_answers(embedded, tmp_path):
    """The same teacher three ways: an adapter beside the student's on its base; that adapter merged into a base of
    its own (distill.teacher), sharded over both ranks as the student is; a base of its own with the adapter beside
    it: the same first step, and each way the divergence falls."""
    adapter = make_teacher(embedded, tmp_path / "teacher", tmp_path)
    own_base = make_teacher_base(embedded, tmp_path / "teacher-base")
    first_losses = []
    for name, *teacher in (("beside", f"distill.teacher_adapter={adapter}"),
                           ("own", f"distill.teacher={own_base}", "scaling.mesh=null"),
                           ("own-with-adapter", f"distill.teacher={embedded['model']}",
                            f"distill.teacher_adapter={adapter}")):
        assert make_config(tmp_path, embedded, *[s for s in GRPO if "reward" not in s], "train.objective=distill",
                           *teacher).distill.beta == 1.0  # TRL's default: reverse KL
        (tmp_path / name).mkdir()
        run_ranks(_distill_rank, 2, embedded, str(tmp_path / name), *teacher)
        results = json.loads((tmp_path / name / "results.json").read_text())
        metrics = {int(step): figures for step, figures in results["metrics"].items()}
        first, last = metrics[0]["eval_loss"], metrics[8]["eval_loss"]
        assert last < 0.3 * first, (name, first, last)  # the student's own greedy answers, scored by the teacher
        losses = [metrics[step]["train_loss"] for step in range(1, 9)]
        assert sum(losses[-3:]) < 0.3 * sum(losses[:3]), (name, losses)
        assert {"entropy", "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
                "completions/mean_length"} <= metrics[1].keys()
        assert "reward" not in metrics[1]
        first_losses.append(losses[0])
    assert first_losses[1] == pytest.approx(first_losses[0], rel=1e-3)
    assert first_losses[2] == pytest.approx(first_losses[0], rel=1e-3)


def test_a_resumed_distillation_refuses_another_teacher():
    tags = {"teacher_adapter": "models:/t@champion", "teacher_adapter_sha256": "a" * 64}
    check_same_teacher(tags, "models:/t@champion", "a" * 64)  # the same bytes: it goes on
    check_same_teacher({}, "models:/t@champion", "b" * 64)  # a run recorded before teachers were: nothing to hold
    with pytest.raises(UserInputError, match=r"^--resume: the run learned from models:/t@champion \(sha256 aaaaaaaaa"
                                             r"aaa\), and distill.teacher_adapter=models:/t@champion gives bbbb"):
        check_same_teacher(tags, "models:/t@champion", "b" * 64)
    without = {"teacher_adapter": None, "teacher_adapter_sha256": "none"}  # a teacher base alone, no adapter
    check_same_teacher(without, None, None)
    with pytest.raises(UserInputError, match=r"^--resume: the run learned from no teacher adapter"):
        check_same_teacher(without, "models:/t@champion", "b" * 64)


def test_a_teacher_with_more_output_rows_is_compared_over_the_rows_both_have():
    """Models of one family pad their output layers to different sizes past the tokenizer's tokens: both
    distributions are renormalised over the shared rows (the same, where they agree in size)."""
    student, teacher = torch.randn(2, 3, 10).log_softmax(-1), torch.randn(2, 3, 12).log_softmax(-1)
    s, t = over_shared_rows(student, teacher)
    assert s.shape == t.shape == (2, 3, 10)
    torch.testing.assert_close(t, torch.log_softmax(teacher[..., :10], -1))  # as if the extra rows never were
    torch.testing.assert_close(s, student)
    same = torch.randn(2, 3, 10).log_softmax(-1)
    assert over_shared_rows(student, same)[1] is same
