"""Continuous batching (app/train/decoding.py) on the embedded model in fp32, without Ray: an answer is the same
whichever answers share its batch, a finished answer's row leaves without disturbing the others, the recorded
log-probabilities are the model's own over the whole sequence, and the draws follow the filtered distribution."""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, MistralConfig
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from app.model.base import load_tokenizer
from app.train.decoding import (
    Answer,
    DecodingBatch,
    Drawing,
    answer_seed,
    decode,
    draw,
    filtered_logits,
    supports_continuous_batching,
)
from app.train.sampling import build_sampler
from tests.helpers import TINY, make_config

PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to three, then stop counting at once."]
DRAWING = Drawing(temperature=0.9, top_k=8, top_p=0.95, max_tokens=10)


@pytest.fixture(scope="module")
def sampler(embedded, tmp_path_factory):
    cfg = make_config(tmp_path_factory.mktemp("decoding"), embedded, "model.dtype=float32")
    sampler = build_sampler(cfg)
    with torch.no_grad():  # a trained adapter's effect, not the no-op of a fresh lora_B = 0
        for name, p in sampler.model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.05)
    tokenizer = load_tokenizer(cfg.model)
    sampler.prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]  # of unequal lengths
    return sampler


def _answers(sampler, end_ids, slots=None, parts=((0, 12),)):
    """Four answers to each prompt, decoded in `parts` (each its own call: [first, end) of the answers)."""
    rows = [p for p in sampler.prompts for _ in range(4)]
    answers = []
    for first, end in parts:
        batch = DecodingBatch(sampler.model, end_ids, sampler.pad_id, sampler.device, DRAWING)
        answers += decode(batch, [Answer.seeded(rows[i], answer_seed(7, i)) for i in range(first, end)], slots)
    return answers


@pytest.fixture(scope="module")
def end(sampler) -> int:
    """An end token the answers draw at different places: rows leave the batch at different steps."""
    unending = _answers(sampler, end_ids=[])
    assert all(len(a.ids) == DRAWING.max_tokens for a in unending)
    return Counter(t for a in unending for t in a.ids[1:-1]).most_common(1)[0][0]


def test_an_answer_is_the_same_whichever_answers_share_its_batch_and_ends_at_its_end_token(sampler, end):
    unending, alone = _answers(sampler, end_ids=[]), _answers(sampler, [end])
    lengths = [len(a.ids) for a in alone]
    assert min(lengths) < max(lengths)
    for answer, long in zip(alone, unending):  # the same draws up to and with the first end token
        cut = long.ids.index(end) + 1 if end in long.ids else DRAWING.max_tokens
        assert answer.ids == long.ids[:cut]
        assert answer.logps == pytest.approx(long.logps[:cut], abs=1e-5)
    for slots, parts in ((3, ((0, 12),)), (None, ((0, 5), (5, 12))), (2, ((0, 7), (7, 12)))):
        other = _answers(sampler, [end], slots, parts)
        assert [a.ids for a in other] == [a.ids for a in alone], (slots, parts)
        assert [x for a in other for x in a.logps] == pytest.approx([x for a in alone for x in a.logps], abs=1e-5)


def test_a_prompt_that_answers_share_goes_through_the_model_once_and_answers_as_if_alone(sampler, end):
    shapes = []
    hook = sampler.model.get_input_embeddings().register_forward_hook(lambda m, args, out: shapes.append(args[0].shape))
    try:
        shared = _answers(sampler, [end])
    finally:
        hook.remove()
    assert tuple(shapes[0]) == (3, max(len(p) for p in sampler.prompts))  # 12 answers' first forward: 3 prompts
    alone = _answers(sampler, [end], parts=tuple((i, i + 1) for i in range(12)))
    assert [a.ids for a in shared] == [a.ids for a in alone]
    assert [x for a in shared for x in a.logps] == pytest.approx([x for a in alone for x in a.logps], abs=1e-5)


@pytest.mark.parametrize("slots", [None, 3])
def test_the_recorded_log_probs_are_the_models_over_the_whole_sequence(sampler, end, slots):
    """With rows leaving and (3 slots) joining a batch already decoding: the cache merged and trimmed."""
    for answer in _answers(sampler, [end], slots):
        ids = torch.tensor([answer.prompt + answer.ids])
        with torch.no_grad():
            logits = sampler.model(input_ids=ids).logits[0, len(answer.prompt) - 1:-1].float()
        expected = torch.log_softmax(logits / DRAWING.temperature, -1).gather(-1, torch.tensor(answer.ids)[:, None])
        assert answer.logps == pytest.approx(expected[:, 0].tolist(), abs=1e-5)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (20, 0.5), (3, 0.999)])
def test_the_filters_are_transformers_top_k_and_top_p(top_k, top_p):
    logits = torch.randn(6, 50) * 3
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(filtered_logits(logits, top_k, top_p).isinf(), expected.isinf())


def test_draws_follow_the_filtered_distribution_and_never_pick_a_filtered_token():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    drawing = Drawing(temperature=0.5, top_k=4, top_p=1.0, max_tokens=1)
    answers = [Answer.seeded([0], answer_seed(3, i)) for i in range(20_000)]
    draw(answers, logits.expand(len(answers), -1), drawing)
    counts = Counter(a.ids[0] for a in answers)
    expected = torch.softmax(filtered_logits(logits / 0.5, 4, 1.0), -1)[0]
    assert set(counts) == {0, 1, 2, 3}
    for token, p in enumerate(expected.tolist()[:4]):
        assert counts[token] / len(answers) == pytest.approx(p, abs=0.015)
    assert answers[0].logps[0] == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, answers[0].ids[0]].item())


@pytest.mark.parametrize("config, continuous", [
    (LlamaConfig(**TINY), True), (MistralConfig(**TINY, sliding_window=None), True),
    (MistralConfig(**TINY, sliding_window=16), False)])
def test_a_model_whose_cache_has_sliding_windows_is_left_to_transformers_generate(config, continuous):
    assert supports_continuous_batching(SimpleNamespace(config=config)) is continuous
