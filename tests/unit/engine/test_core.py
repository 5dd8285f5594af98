"""The engine's core (app/engine/core.py) on tiny random models and the embedded one, fp32, no threads: what it
decodes is what transformers' own decoding gives, whatever shares a step, however prompts are chunked, whichever
architecture; a seeded answer is the same however it is batched; the log-probabilities are the model's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from app.engine.core import EngineCore
from app.engine.sampling import SamplingParams, draw, filtered_logits
from app.engine.sequence import Sequence
from tests.helpers import ARCHITECTURES, TINY

WINDOWED = {"mistral": {"sliding_window": 6}, "gemma2": ARCHITECTURES["gemma2"] | {"sliding_window": 6}}


def tiny_model(architecture: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(architecture, **(TINY | ARCHITECTURES[architecture] | extra))
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompts(*lengths: int, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 500, (n,), generator=generator).tolist() for n in lengths]


def run(core: EngineCore, sequences: list[Sequence], joining_after: int | None = None) -> list[Sequence]:
    """Every sequence to its end; with `joining_after`, the second half added once that many steps ran."""
    first = sequences if joining_after is None else sequences[:len(sequences) // 2]
    for seq in first:
        core.add(seq)
    steps = 0
    while core.busy or steps < (joining_after or 0):
        core.step()
        steps += 1
        if steps == joining_after:
            for seq in sequences[len(first):]:
                core.add(seq)
    return sequences


def generated(model, prompt: list[int], tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("architecture, extra", [(name, {}) for name in ARCHITECTURES] + list(WINDOWED.items()))
def test_greedy_answers_are_transformers_own_for_every_architecture(architecture, extra):
    """Prompts chunked over several steps (8 tokens a step), rows joining mid-decode; sliding windows shorter than
    the answers (mistral, gemma2: soft-capped logits too)."""
    model = tiny_model(architecture, **extra)
    asked = prompts(5, 11, 17, 3)
    expected = [generated(model, prompt, 12) for prompt in asked]
    answers = run(EngineCore(model, [], max_step_tokens=8), [Sequence(p, SamplingParams(max_tokens=12))
                                                             for p in asked], joining_after=3)
    assert [a.ids for a in answers] == expected
    assert all(a.finish == "length" and a.error is None for a in answers)


def seeded(asked: list[list[int]], seed: int = 7, **params) -> list[Sequence]:
    drawing = SamplingParams(**({"max_tokens": 10, "temperature": 0.9, "top_k": 8, "top_p": 0.95, "logprobs": 0,
                                 "logprobs_of": "sampled"} | params))
    return [Sequence(p, drawing, seed=seed * 1000 + i) for i, p in enumerate(asked)]


def test_a_seeded_answer_is_the_same_whichever_answers_share_its_steps_and_however_many_rows_run():
    model = tiny_model("llama")
    asked = [p for p in prompts(4, 9, 13) for _ in range(4)]  # groups of 4 answers sharing a prompt
    alone = [run(EngineCore(model, []), [seq])[0] for seq in seeded(asked)]
    for rows, joining in ((3, None), (64, 2), (2, 5)):
        together = run(EngineCore(model, [], max_rows=rows), seeded(asked), joining)
        assert [a.ids for a in together] == [a.ids for a in alone], (rows, joining)
        assert [e.logprob for a in together for e in a.logprobs] == pytest.approx(
            [e.logprob for a in alone for e in a.logprobs], abs=1e-5)


def test_a_prompt_that_answers_share_goes_through_the_model_once():
    model = tiny_model("llama")
    asked = prompts(9, 13)
    fed = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].shape[1]))
    try:
        run(EngineCore(model, []), seeded([p for p in asked for _ in range(4)]))
    finally:
        hook.remove()
    assert fed[0] == 9 + 13  # eight answers' first step: each prompt once


def test_an_answer_ends_at_its_end_token_and_its_row_leaves_without_disturbing_the_others():
    model = tiny_model("llama")
    asked = [p for p in prompts(4, 9, 13) for _ in range(4)]
    unending = run(EngineCore(model, []), seeded(asked))
    end = Counter(t for a in unending for t in a.ids[1:-1]).most_common(1)[0][0]
    ended = run(EngineCore(model, [end], max_rows=5), seeded(asked))
    assert len({len(a.ids) for a in ended}) > 1
    for answer, long in zip(ended, unending):  # the same draws up to and with the first end token
        cut = long.ids.index(end) + 1 if end in long.ids else len(long.ids)
        assert answer.ids == long.ids[:cut]
        assert answer.finish == ("stop" if end in long.ids else "length") and answer.ended_by_token == (end in long.ids)


@pytest.mark.parametrize("rows", [64, 3])
def test_the_recorded_log_probs_are_the_models_over_the_whole_sequence(rows):
    model = tiny_model("qwen2")
    for answer in run(EngineCore(model, [], max_rows=rows), seeded(prompts(4, 9, 13, 6))):
        ids = torch.tensor([answer.prompt + answer.ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(answer.prompt) - 1:-1].float()
        expected = torch.log_softmax(logits / 0.9, -1).gather(-1, torch.tensor(answer.ids)[:, None])[:, 0]
        assert [e.logprob for e in answer.logprobs] == pytest.approx(expected.tolist(), abs=1e-5)


def test_model_log_probs_and_alternatives_are_the_logits_own_and_a_prompt_is_scored_whole():
    model = tiny_model("llama")
    asked = prompts(12, seed=3)[0]
    seq = Sequence(asked, SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=2))
    run(EngineCore(model, [], max_step_tokens=4), [seq])  # the scored prompt is computed whole all the same
    with torch.no_grad():
        logps = torch.log_softmax(model(input_ids=torch.tensor([asked + seq.ids])).logits[0].float(), -1)
    tokens = asked + seq.ids
    assert seq.prompt_logprobs[0].logprob is None and len(seq.prompt_logprobs) == len(asked)
    assert [e.logprob for e in seq.prompt_logprobs[1:]] == pytest.approx(
        [logps[i - 1, t].item() for i, t in enumerate(tokens[1:len(asked)], 1)], abs=1e-5)
    for i, entry in enumerate(seq.logprobs):
        position = len(asked) - 1 + i
        assert entry.logprob == pytest.approx(logps[position, entry.token].item(), abs=1e-5)
        assert [t for t, _ in entry.top] == logps[position].topk(3).indices.tolist()
        assert entry.top[0][0] == entry.token  # greedy: the most likely


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (20, 0.5), (3, 0.999)])
def test_the_filters_are_transformers_top_k_and_top_p(top_k, top_p):
    logits = torch.randn(6, 50) * 3
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(None, expected)
    assert torch.equal(filtered_logits(logits, top_k, top_p).isinf(), expected.isinf())


def test_draws_follow_each_rows_filtered_distribution_and_never_pick_a_filtered_token():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).expand(20_000, -1)
    filtered = SamplingParams(max_tokens=1, temperature=0.5, top_k=4, logprobs=0, logprobs_of="sampled")
    plain = SamplingParams(max_tokens=1, temperature=2.0)
    params = [filtered if i % 2 else plain for i in range(len(logits))]
    drawn = draw(logits, params, [torch.Generator().manual_seed(i) for i in range(len(logits))])
    for p, scaled in ((filtered, filtered_logits(logits[:1] / 0.5, 4, 1.0)), (plain, logits[:1] / 2.0)):
        tokens = [t for t, q in zip(drawn.tokens, params) if q is p]
        counts = Counter(tokens)
        expected = torch.softmax(scaled, -1)[0]
        assert set(counts) <= {i for i, v in enumerate(expected.tolist()) if v > 0}
        for token, probability in enumerate(expected.tolist()):
            assert counts[token] / len(tokens) == pytest.approx(probability, abs=0.015)
    assert drawn.logprobs[1] == pytest.approx(torch.log_softmax(logits[0] / 0.5, -1)[drawn.tokens[1]].item())


def test_greedy_and_sampled_rows_with_their_own_settings_share_a_step_and_each_answers_as_alone():
    model = tiny_model("llama")
    asked = prompts(5, 8, 11, 6)
    kinds = [dict(temperature=0.0), dict(temperature=1.3, top_p=0.9), dict(temperature=0.7, top_k=5), {}]
    alone = [run(EngineCore(model, []), seeded([p], seed=i, **kind))[0] for i, (p, kind) in enumerate(zip(asked,
                                                                                                           kinds))]
    core = EngineCore(model, [])
    together = [seeded([p], seed=i, **kind)[0] for i, (p, kind) in enumerate(zip(asked, kinds))]
    run(core, together)
    assert [a.ids for a in together] == [a.ids for a in alone]
    assert core.steps == max(len(a.ids) for a in alone)  # one forward a token for all four
