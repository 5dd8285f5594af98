import json

import pytest
import torch

from app.config.sections import ModelSection
from app.data.formatting import tokenize_rows
from app.model.base import load_base_model, load_tokenizer
from app.train.evaluation import BestEvaluation, cut_after_last_target
from app.train.loss import summed_token_loss


def test_eval_rows_cut_after_their_last_target_score_the_same_loss(embedded):
    """Rows padded to 128 whose records are ~20 tokens: the cut batch is a fraction as wide, same loss."""
    model_cfg = ModelSection(path=str(embedded["model"]), dtype="float32")
    model, tokenizer = load_base_model(model_cfg).eval(), load_tokenizer(model_cfg)
    records = [json.loads(line) for line in embedded["eval"].read_text().splitlines()[:8]]
    rows = tokenize_rows(records, tokenizer, "auto", 128)
    batch = {k: torch.as_tensor(rows[k]) for k in ("input_ids", "labels")}
    cut = cut_after_last_target(batch)
    assert cut["input_ids"].shape[1] <= int(rows["length"].max()) < 64
    with torch.no_grad():
        assert summed_token_loss(model, cut).item() == pytest.approx(summed_token_loss(model, batch).item(), rel=1e-5)


def test_the_best_evaluation_is_the_lowest_loss_or_the_highest_task_score():
    loss, score = BestEvaluation("eval_loss", patience=2), BestEvaluation("eval_exact_match", patience=2)
    for step, (eval_loss, s) in enumerate([(3.0, 0.1), (2.0, 0.4), (2.5, 0.3), (float("nan"), 0.2)]):
        loss.update(step, {"eval_loss": eval_loss})
        score.update(step, {"eval_exact_match": s})
    assert (loss.step, loss.value, loss.evals_since, loss.patience_spent) == (1, 2.0, 2, True)
    assert (score.step, score.value, score.evals_since) == (1, 0.4, 2)
    restored = BestEvaluation("eval_loss", 2, **loss.state())
    assert restored.state() == loss.state() and restored.patience_spent
