"""The DPO loss: the formulas by hand, the reference is the base model, gradients reach LoRA only, and the
per-pair normalisation gives 1 and 2 workers (FSDP2, gloo) the same step."""

import copy
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from app.config.sections import FsdpSection
from app.data.chat import IGNORE_INDEX
from app.model.sharding import build_device_mesh, shard_model
from app.train.dpo import (
    METRICS,
    concatenated,
    dpo_losses,
    global_pair_count,
    metric_sums,
    metrics_from_sums,
    reference_logps,
    scaled_micro_batch_dpo_loss,
    sequence_logps,
)
from tests.helpers import TINY, run_ranks

# (policy chosen, policy rejected, reference chosen, reference rejected) log-probs of three pairs
TOY = [(-3.0, -5.0, -4.0, -4.5), (-2.0, -1.0, -2.5, -1.2), (-7.0, -9.0, -7.0, -9.0)]
BETA = 0.5


def _log_sigmoid(x: float) -> float:
    return -math.log(1 + math.exp(-x))


HAND = {  # each pair's loss from h = (pc - rc) - (pr - rr), written out independently of the module
    ("sigmoid", 0.0): lambda h: -_log_sigmoid(BETA * h),
    ("sigmoid", 0.2): lambda h: -0.8 * _log_sigmoid(BETA * h) - 0.2 * _log_sigmoid(-BETA * h),
    ("ipo", 0.0): lambda h: (h - 1 / (2 * BETA)) ** 2,
    ("hinge", 0.0): lambda h: max(0.0, 1 - BETA * h),
}


@pytest.mark.parametrize("loss_type, smoothing", list(HAND))
def test_the_loss_is_the_dpo_formula_computed_by_hand(loss_type, smoothing):
    pc, pr, rc, rr = (torch.tensor(column, dtype=torch.float64) for column in zip(*TOY))
    losses = dpo_losses(pc, pr, rc, rr, BETA, loss_type, smoothing)
    expected = [HAND[loss_type, smoothing]((a - c) - (b - d)) for a, b, c, d in TOY]
    assert losses.tolist() == pytest.approx(expected, rel=1e-12)


def test_the_metrics_are_the_implicit_rewards_by_hand():
    pc, pr, rc, rr = (torch.tensor(column, dtype=torch.float64) for column in zip(*TOY))
    figures = metrics_from_sums(metric_sums(pc, pr, rc, rr, BETA), len(TOY))
    chosen = [BETA * (a - c) for a, _, c, _ in TOY]  # 0.5, 0.25, 0
    rejected = [BETA * (b - d) for _, b, _, d in TOY]  # -0.25, 0.1, 0
    assert list(figures) == list(METRICS)
    assert figures == pytest.approx({
        "rewards/chosen": sum(chosen) / 3, "rewards/rejected": sum(rejected) / 3,
        "rewards/accuracies": 2 / 3,  # the third pair's rewards tie: not counted as right
        "rewards/margins": (sum(chosen) - sum(rejected)) / 3,
        "logps/chosen": (-3 - 2 - 7) / 3, "logps/rejected": (-5 - 1 - 9) / 3})


def _tiny_lora(seed: int = 0):
    """A tiny Llama and its LoRA model (every LoRA weight random, so the adapter changes the logits)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY), dtype=torch.float32)
    untouched = copy.deepcopy(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False,
                                            lora_dropout=0.0))
    return model, untouched


def _pairs(count: int, seed: int = 0) -> dict:
    """`count` pairs: a shared prompt of 5 tokens; answers of different lengths, right-padded."""
    g = torch.Generator().manual_seed(seed)
    batch = {}
    for side, width, answer in (("chosen", 12, 6), ("rejected", 10, 4)):
        ids = torch.randint(4, TINY["vocab_size"], (count, width), generator=g)
        labels = torch.full_like(ids, IGNORE_INDEX)
        labels[:, 5:5 + answer] = ids[:, 5:5 + answer]
        ids[:, 5 + answer:] = 0
        batch |= {f"{side}_input_ids": ids, f"{side}_labels": labels}
    batch["rejected_input_ids"][:, :5] = batch["chosen_input_ids"][:, :5]
    return batch


def test_sequence_logps_sum_the_log_probs_of_the_answer_tokens_only():
    model, _ = _tiny_lora()
    ids, labels = concatenated(_pairs(2))
    assert ids.shape == (4, 11) and (labels[2:, 9:] == IGNORE_INDEX).all()  # cut after the last target (col 10)
    with torch.no_grad():
        logps = sequence_logps(model, ids, labels)
        log_probs = model(input_ids=ids).logits.log_softmax(-1)
    for row in range(4):
        expected = sum(log_probs[row, t - 1, labels[row, t]].item() for t in range(1, ids.shape[1])
                       if labels[row, t] != IGNORE_INDEX)
        assert logps[row].item() == pytest.approx(expected, rel=1e-5)


def test_the_reference_is_the_base_model_without_lora_and_the_adapter_is_back_after_it():
    model, base = _tiny_lora()
    ids, labels = concatenated(_pairs(2))
    policy = sequence_logps(model, ids, labels)
    reference = reference_logps(model, ids, labels)
    with torch.no_grad():
        torch.testing.assert_close(reference, sequence_logps(base, ids, labels), rtol=0, atol=1e-6)
    assert not reference.requires_grad and (policy - reference).abs().min() > 1e-3
    torch.testing.assert_close(sequence_logps(model, ids, labels), policy)  # LoRA is on again


def test_one_forward_per_model_and_gradients_reach_only_the_lora_weights():
    model, _ = _tiny_lora()
    rows_per_forward = []
    model.get_base_model().register_forward_hook(lambda _m, args, kw, _out: rows_per_forward.append(
        len(kw["input_ids"])), with_kwargs=True)
    loss, _, _ = scaled_micro_batch_dpo_loss(model, _pairs(3), torch.tensor(3.0), 1, BETA)
    loss.backward()
    assert rows_per_forward == [6, 6]  # the reference's forward, then the policy's: chosen and rejected in each
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    lora = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert with_grad == lora and all(model.get_parameter(n).grad.abs().sum() > 0 for n in lora)


def _step(model, batch: dict, global_pairs: float, world_size: int, chunk_tokens: int = 0) -> tuple[float, dict]:
    model.zero_grad(set_to_none=True)
    loss, loss_sum, _ = scaled_micro_batch_dpo_loss(model, batch, torch.tensor(global_pairs, dtype=torch.float64),
                                                    world_size, BETA, chunk_tokens=chunk_tokens)
    loss.backward()
    return loss_sum.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rows(batch: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in batch.items()}


def test_micro_batches_of_a_step_add_up_to_the_mean_over_its_pairs():
    model, _ = _tiny_lora()
    batch = _pairs(4)
    whole_sum, whole = _step(model, batch, 4, 1)
    halves = [_step(model, _rows(batch, slice(i, i + 2)), 4, 1) for i in (0, 2)]
    assert whole_sum == pytest.approx(halves[0][0] + halves[1][0], rel=1e-6)
    for name, grad in whole.items():
        torch.testing.assert_close(halves[0][1][name] + halves[1][1][name], grad, rtol=1e-5, atol=1e-7)
    # the mean over pairs: the gradient of the plain mean of the pairs' losses
    mean = dpo_losses(*sequence_logps(model, *concatenated(batch)).split(4),
                      *reference_logps(model, *concatenated(batch)).split(4), BETA).mean()
    model.zero_grad(set_to_none=True)
    mean.backward()
    for name, grad in whole.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-5, atol=1e-7)


def test_chunked_logits_give_the_plain_log_probs_loss_and_gradients():
    """train.loss_chunk_tokens under DPO: the log-probs from 5 positions' logits at a time (never the whole
    micro-batch's), each sequence's gradient weighted by its own DPO weight in backward."""
    from app.train.loss import chunkable_head

    model, _ = _tiny_lora()
    assert chunkable_head(model) is not None  # the chunked path is the one taken
    batch = _pairs(3)
    ids, labels = concatenated(batch)
    torch.testing.assert_close(sequence_logps(model, ids, labels, 5), sequence_logps(model, ids, labels))
    plain_sum, plain = _step(model, batch, 3, 1)
    chunked_sum, chunked = _step(model, batch, 3, 1, chunk_tokens=5)
    assert chunked_sum == pytest.approx(plain_sum, rel=1e-5)
    for name, grad in plain.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-4, atol=1e-6, msg=name)  # fp32 rounding


def _sharded_step(rank: int, world: int, out: str, reshard: bool) -> None:
    model, _ = _tiny_lora()
    shard_model(model, build_device_mesh("cpu"), FsdpSection(param_dtype="float32", reshard_after_forward=reshard))
    mine = _rows(_pairs(4), slice(2 * rank, 2 * rank + 2))  # two pairs on each rank
    pairs = global_pair_count([mine])
    assert pairs.item() == 4
    _, grads = _step(model, mine, pairs.item(), world)
    full = {n: g.full_tensor() for n, g in grads.items()}  # a collective: every rank gathers
    if rank == 0:
        torch.save(full, Path(out) / "grads.pt")


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep-gathered"])
def test_one_and_two_fsdp_workers_take_the_same_step(tmp_path, reshard):
    """Two gloo ranks, two pairs each, under FSDP2 (which averages gradients over ranks) give the one-worker
    gradient of all four pairs (without the world-size scale they were half of it), also when the layers'
    weights stay gathered after the reference's no-grad forward (the embedded config's setting)."""
    run_ranks(_sharded_step, 2, str(tmp_path), reshard)
    sharded = torch.load(tmp_path / "grads.pt")
    model, _ = _tiny_lora()
    _, whole = _step(model, _pairs(4), 4, 1)
    assert sharded.keys() == whole.keys()
    for name, grad in whole.items():
        torch.testing.assert_close(sharded[name], grad, rtol=1e-4, atol=1e-6, msg=name)
